# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/estimator_study.py: needle spans, two-stage names, the summary rows."""

from __future__ import annotations

import math

import pytest
from _load import load

study = load("probes.estimator_study")


def test_needle_spans_find_every_needle_and_not_the_question():
    text = (
        "Call me Ishmael. The special magic number for Oslo is 1234567. Some years ago. "
        "One of the special magic numbers for Rome is 7654321. What is the special magic "
        "number for Oslo mentioned in the text above?"
    )
    # one token per word, offsets from the text itself
    offsets, pos = [], 0
    for word in text.split(" "):
        offsets.append((pos, pos + len(word)))
        pos += len(word) + 1
    spans = study.needle_spans(text, offsets)
    assert len(spans) == 2
    words = text.split(" ")
    assert " ".join(words[spans[0][0] : spans[0][1] + 1]) == (
        "The special magic number for Oslo is 1234567."
    )
    assert words[spans[1][0]] == "One" and words[spans[1][1]] == "7654321."
    assert study.needle_pages([(60, 70), (200, 205), (130, 130)], 64) == [0, 1, 2, 3]


def test_parse_two_stage_names():
    assert study.parse_two_stage("int8:mvar_top8") is None
    assert study.parse_two_stage("2s/int8:mvar_rem/oracle/2/inf") == (
        "int8:mvar_rem",
        "oracle",
        2.0,
        math.inf,
    )
    s1, s2, slack, nan = study.parse_two_stage("2u/mvar_rem/oracle/1.5")
    assert (s1, s2, slack) == ("mvar_rem", "oracle", 1.5) and math.isnan(nan)
    with pytest.raises(ValueError, match="2s/"):
        study.parse_two_stage("2s/mvar_rem/oracle/2")
    assert study.base_estimators(["oracle", "2s/int8:mvar_rem/oracle/1/1", "mvar"]) == [
        "oracle",
        "int8:mvar_rem",
        "mvar",
    ]


def test_parse_anchored_names():
    assert study.parse_anchored("int8:mvar_top8") is None
    assert study.parse_anchored("fb/int8:mvar_top8/seed") == ("int8:mvar_top8", (True, 0, False))
    assert study.parse_anchored("fb/mvar/h1down") == ("mvar", (False, 1, True))
    with pytest.raises(ValueError, match="fb/<base>/"):
        study.parse_anchored("fb/mvar/h2")
    assert study.base_estimators(["oracle", "fb/int8:mvar_top8/h1"]) == ["oracle", "int8:mvar_top8"]


def test_parse_spread_names():
    assert study.parse_spread("int8:top8_uniform") == ("int8:mvar_top8", "uniform")
    assert study.parse_spread("top4_uniform") == ("mvar_top4", "uniform")
    assert study.parse_spread("int8:mvar_top8") is None
    with pytest.raises(ValueError, match="unknown spread"):
        study.parse_spread("top8_cauchy")


def test_int4_quantizer_rule_round_trip_clamp_and_zero_vector():
    torch = pytest.importorskip("torch")
    from vllm_moira.v1.attention.ops import moira_reference as ref

    x = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 7.0], [-3.0, 1.4, 0.0, 0.25]]])
    q, scale = ref.quantize_summaries_int4(x)
    assert scale.dtype == torch.float32
    assert torch.equal(scale, torch.tensor([[0.0, 7.0, 3.0]]) / 7.0)  # absmax / 7, fp32
    assert q[0, 0].tolist() == [0, 0, 0, 0]  # all-zero vector: scale 0, values 0
    assert q[0, 1].tolist() == [1, -2, 1, 7]  # floor(x / scale + 0.5): 0.5 -> 1
    assert q[0, 2].tolist() == [-7, 3, 0, 1]
    assert torch.equal(ref.dequantize_summaries_int8(q, scale)[0, 0], torch.zeros(4))
    # random slot vectors with outliers: every value in [-7, 7], each absmax on +-7, and
    # |error| <= scale / 2 per element
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 10, 128, generator=gen) * torch.rand(5, 3, 10, 1, generator=gen)
    x[..., 7] *= 40.0
    q, scale = ref.quantize_summaries_int4(x)
    assert int(q.min()) >= -7 and int(q.max()) <= 7
    assert torch.equal(q.abs().amax(dim=-1), torch.full(scale.shape, 7, dtype=q.dtype))
    back = ref.dequantize_summaries_int8(q, scale)
    assert torch.all((back - x).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-7)
    assert ref.quantize_summaries_int8(x)[0].abs().amax() == 127  # int8 unchanged


def test_int4_storage_quantizes_only_the_stored_keys():
    torch = pytest.importorskip("torch")
    from benchmarks.accuracy import harness as H
    from vllm_moira.v1.attention.ops import moira_reference as ref

    assert ref.parse_stored_estimator("int4:mvar_top8") == ("mvar_top8", "int4")
    assert study.parse_spread("int4:top8_uniform") == ("int4:mvar_top8", "uniform")
    assert study.base_estimators(["2v/int4:mvar_top8/oracle/3/0.75"]) == [
        "int4:mvar_top8", "oracle"
    ]  # fmt: skip
    keys = torch.randn(2, 64 * 5 + 9, 64, generator=torch.Generator().manual_seed(1))
    fp32 = H.page_summaries_for(keys, 5, "mvar_top8")
    int8 = H.page_summaries_for(keys, 5, "int8:mvar_top8")
    int4 = H.page_summaries_for(keys, 5, "int4:mvar_top8")
    assert int4.shape == int8.shape == fp32.shape == (5, 2, 10, 64)
    assert torch.equal(int4[:, :, :2], int8[:, :, :2])  # mean and variance: int8 as shipped
    # the keys: the int4 rule's values, through the packed layout and back
    quantized = ref.dequantize_summaries_int8(*ref.quantize_summaries_int4(fp32[:, :, 2:]))
    assert torch.equal(int4[:, :, 2:], quantized)
    step = fp32[:, :, 2:].abs().amax(dim=-1, keepdim=True) / ref.INT4_LEVELS
    err = (int4[:, :, 2:] - fp32[:, :, 2:]).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5)) and bool((err > step / 4).any())
    with pytest.raises(ValueError, match="int4"):
        H.page_summaries_for(keys, 5, "int4:mvar")


def test_summarize_reports_ratios_to_the_oracle_and_needle_drops():
    stats = {}
    for name, kept, err, drops in (("oracle", 0.4, 0.02, {}), ("mvar", 0.5, 0.03, {"L18/H2": 2})):
        s = study._new_stats()
        s["kept"] = [kept] * 10
        s["cap"] = [0.98] * 10
        s["err"] = [err] * 5
        s["needle_lists"] = 8
        s["needle_drop"] = sum(drops.values())
        s["drops"] = drops
        stats[(name, 0.98)] = s
    rows = {r["estimator"]: r for r in study.summarize(stats)}
    assert rows["mvar"]["kept_x_oracle"] == pytest.approx(1.25)
    assert rows["mvar"]["err_x_oracle"] == pytest.approx(1.5)
    assert rows["mvar"]["needle_dropped_pct"] == pytest.approx(25.0)
    assert rows["mvar"]["drops_by_layer_head"] == {"L18/H2": 2}
    assert rows["oracle"]["needle_dropped"] == 0
    assert "stage2_fraction_mean" not in rows["mvar"]
    assert "| mvar | 0.98 | 0.500 (1.25) |" in study.table(list(rows.values()))


def test_captures_are_cached_per_model_and_the_record_names_the_model():
    prepare = study._prepare_module()
    args = ("niah_single", "essays", 4096, 0, 16)
    smol, qwen = (study.cache_path(m, *args) for m in ("smollm2-135m", "qwen2.5-coder-1.5b"))
    assert smol != qwen and smol.parent == qwen.parent == study.CACHE
    assert qwen.name == "qwen2.5-coder-1.5b_niah_single_essays_4096_s0_k16.pt"
    labels = {key: study.model_label(spec) for key, spec in prepare.MODELS.items()}
    # SmolLM2's is the string its earlier records carry
    assert labels["smollm2-135m"] == "SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16 -> fp32, CPU)"
    assert labels["qwen2.5-coder-1.5b"] == (
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M -> bf16 -> fp32, CPU)"
    )
    assert labels["qwen2.5-coder-0.5b"] == "Qwen2.5-Coder-0.5B-Instruct (GGUF -> bf16 -> fp32, CPU)"


def _synthetic_blob(torch, seq=300, k_rows=2, h_kv=2, group=3, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h_kv, seq, d, generator=gen)
    q = torch.randn(h_kv, 1, k_rows, d, generator=gen) + 0.3 * torch.randn(
        h_kv, group, k_rows, d, generator=gen
    )
    keys[:, 140:150] = 3.0 * q.mean(dim=(1, 2)).unsqueeze(1)  # the needle, on page 2
    return {
        "layers": {
            0: {
                "q": q.reshape(h_kv * group, k_rows, d).half(),
                "k": keys.half(),
                "v": torch.randn(h_kv, seq, d, generator=gen).half(),
            }
        },
        "needle_spans": [(140, 149)],
        "seq_len": seq,
    }


def test_analyse_takes_qwen_shapes_one_list_per_kv_head():
    """G = 6 query heads per KV head, head dim 128 (Qwen2.5-Coder-1.5B), on random rows
    whose queries all point at a needle page."""
    torch = pytest.importorskip("torch")
    h_kv, group, d, k_rows = 2, 6, 128, 2
    blob = _synthetic_blob(torch, seq=300, k_rows=k_rows, h_kv=h_kv, group=group, d=d)
    stats = {}
    estimators = ["oracle", "int8:mvar_top8", "mvar", "rem_capr", "2u/int8:mvar_top4/oracle/0"]
    study.analyse(blob, d**-0.5, estimators, [0.98], stats, "synthetic")
    rows = {r["estimator"]: r for r in study.summarize(stats)}
    assert set(rows) == set(estimators)
    for r in rows.values():
        assert r["lists"] == k_rows * h_kv
        assert r["needle_lists"] == k_rows * h_kv and r["needle_dropped"] == 0
    assert rows["oracle"]["captured_min"] >= 0.98


def test_parse_spread_gated_and_pc_names():
    assert study.parse_spread_gated("2v/int8:mvar_top8/oracle/2/0.75") == (
        "int8:mvar_top8", "oracle", 2.0, 0.75, math.inf
    )  # fmt: skip
    assert study.parse_spread_gated("2v/int8:mvar_top8/oracle/3/0.75/0.1")[4] == 0.1
    assert study.parse_spread_gated("2s/int8:mvar_rem/oracle/2/inf") is None
    with pytest.raises(ValueError, match="2v/"):
        study.parse_spread_gated("2v/int8:mvar_top8/oracle/2")
    assert study.parse_pc("top8_pc2") == (8, 2, None)
    assert study.parse_pc("top8_pc2_bennett") == (8, 2, "bennett")
    assert study.parse_pc("top8_uniform") is None
    assert study.base_estimators(["2v/int8:mvar_top8/oracle/2/1"]) == ["int8:mvar_top8", "oracle"]


def test_parse_box_floor_names_and_their_bases_come_first():
    assert study.parse_box_floor("ub4/int8:mvar_top8") == ("int8:mvar_top8", 4.0, False)
    assert study.parse_box_floor("ubb2.5/int4:mvar_top8") == ("int4:mvar_top8", 2.5, True)
    assert study.parse_box_floor("int8:mvar_top8") is None
    with pytest.raises(ValueError, match="ubb"):
        study.parse_box_floor("ubb2/mvar_rem")
    assert study.base_estimators(["ub4/int8:mvar_top8", "int8:mvar_top8"]) == [
        "int8:mvar_top8", "ub4/int8:mvar_top8"
    ]  # fmt: skip


def test_new_families_run_on_a_synthetic_prompt_and_gated_refines_fewer_pages():
    torch = pytest.importorskip("torch")
    blob = _synthetic_blob(torch, seq=600, k_rows=3)
    estimators = [
        "oracle",
        "int8:mvar_top8",
        "2s/int8:mvar_top8/oracle/2/inf",
        "2v/int8:mvar_top8/oracle/2/1",
        "2v/int4:mvar_top8/oracle/3/0.75",
        "int8:top8_uniform",
        "top8_pc2",
        "top8_pc2_max",
        "fb/int8:mvar_top8/h1",
        "ub4/int8:mvar_top8",
        "ubb2/int4:mvar_top8",
        "int8:ztop8",
        "int4:qtop16",
        "int8:wtop8_4",
        "int4:ptop16_4",
    ]
    stats = {}
    study.analyse(blob, 64**-0.5, estimators, [0.98], stats, "synthetic", warmup_rows=1)
    rows = {r["estimator"]: r for r in study.summarize(stats)}
    assert set(rows) == set(estimators)
    assert all(r["lists"] == 2 * 2 for r in rows.values())  # the warm-up row not counted
    gated, banded = rows["2v/int8:mvar_top8/oracle/2/1"], rows["2s/int8:mvar_top8/oracle/2/inf"]
    assert gated["stage2_fraction_mean"] <= banded["stage2_fraction_mean"]
    assert 0 <= gated["stage2_outside_list_mean"] <= gated["stage2_fraction_mean"]


def test_heat_maps_of_another_model_do_not_overwrite_smollm2s(tmp_path, monkeypatch):
    import types

    (tmp_path / "docs/img").mkdir(parents=True)
    monkeypatch.setattr(study, "REPO", tmp_path)
    config = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2)
    heat = {("oracle", 0.98, layer, h): [0.5, 0.25] for layer in range(2) for h in range(2)}
    for model in ("smollm2-135m", "qwen2.5-coder-1.5b"):
        args = types.SimpleNamespace(estimators=["oracle"], model=model)
        variation = study.heat_maps(config, heat, args)
        assert variation["oracle"]["kept_per_layer_head"] == [[0.375, 0.375], [0.375, 0.375]]
    names = sorted(p.name for p in (tmp_path / "docs/img").iterdir())
    assert names == [
        "kept_fraction_oracle_g098.png",
        "kept_fraction_qwen2.5-coder-1.5b_oracle_g098.png",
    ]


def test_gated_family_refines_the_band_pages_whose_spread_is_wide():
    """``2v/<s1>/oracle/3/0.75``: stage 2 for the pages of ``research.refine_band`` (3 nats
    under the threshold, and above it) whose group-mean ``x^2 . sigma^2`` is at least
    0.75 * 2 ln 56 (``research.wide_pages``), and for no other page."""
    torch = pytest.importorskip("torch")
    from vllm_moira.v1.attention.ops import moira_reference as ref

    research = load("probes.research_estimators")
    gen = torch.Generator().manual_seed(5)
    h_kv, group, d, seq = 2, 3, 64, 64 * 20 + 7
    n = ref.num_pages(seq)
    keys = torch.randn(h_kv, seq, d, generator=gen)
    query = 3.0 * torch.randn(h_kv * group, d, generator=gen)
    pages = keys[:, : (seq // 64) * 64].reshape(h_kv, seq // 64, 64, d).transpose(0, 1)
    summ = ref.summarize_key_pages_top(pages, 8)
    idx = torch.arange(n).clamp_max(summ.shape[0] - 1)
    exact = ref.exact_page_logmass(query, keys, seq, d**-0.5)
    est = ref.top_page_logmass(query, summ[idx], d**-0.5)
    est[..., 0], est[..., n - 1] = exact[..., 0], exact[..., n - 1]
    x = query.view(h_kv, group, d) * d**-0.5
    v = torch.einsum("hgd,nhd->hgn", x * x, summ[idx, :, 1]).mean(dim=1)
    wide = research.wide_pages(query, summ[idx], d**-0.5, 8, 0.75)
    assert torch.equal(wide, v >= 0.75 * 2.0 * math.log(56))
    study_est, study_mask = research.two_stage_logmass(est, exact, 0.98, 3.0, math.inf, wide)
    pibar = ref.group_mean_shares(est)
    band = torch.stack([research.refine_band(pibar[h], 0.98, 3.0, math.inf) for h in range(h_kv)])
    assert bool(study_mask.any()) and not bool(study_mask.all())
    assert torch.equal(study_mask, band & wide) and not torch.equal(study_mask, wide)
    torch.testing.assert_close(study_est, torch.where(study_mask.unsqueeze(1), exact, est))
