# SPDX-License-Identifier: Apache-2.0
"""refine="wide" (Estimate's second stage): kernels against the float32 reference
(CPU interpreter), and the config that turns it on."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import full_page_slots, make_decode_batch
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)
SCALE = 0.125  # head size 64
SEQ_LENS = [64 * 12, 64 * 9 + 5, 100, 1]
# A row over three 16-page refine tiles (the refine launch's tile_pages).
TILED_SEQ_LENS = [64 * 40 + 7, 64 * 9 + 5, 100, 1]


def _refined_mask(query, kv, summaries, table, seq, gamma, estimator):
    """The reference's refined pages of every row: [B] of [H_kv, n] bool."""
    fp32_summaries = ref.read_summaries(summaries)
    masks = []
    for b, seq_len in enumerate(seq.tolist()):
        if seq_len == 0:
            masks.append(None)
            continue
        est = ref.estimate_row_logmass(query[b], kv, fp32_summaries, table[b], seq_len, SCALE,
                                       estimator)  # fmt: skip
        _, mask = ref.refine_row_logmass(query[b], kv, fp32_summaries, table[b], seq_len, SCALE,
                                         est, gamma, estimator)  # fmt: skip
        masks.append(mask)
    return masks


def _assert_lists(ws, lists):
    for row in range(len(SEQ_LENS)):
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist()


def _run(config, batch, built_with=None):
    """Decode ``batch`` under ``config`` on a workspace built with ``built_with``
    (default ``config``), switched to ``config`` by set_selector as a server's
    captured graphs would be."""
    kv, summaries, table, seq, query = batch
    group = query.shape[1] // kv.shape[1]
    ws = moira.MoiraWorkspace(len(SEQ_LENS), kv.shape[1] * group, kv.shape[1], 64,
                              table.shape[1], built_with or config, "cpu")  # fmt: skip
    if built_with is not None:
        ws.set_selector(config)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    return ws, out


@pytest.mark.parametrize(
    ("estimator", "summary_dtype", "group", "pattern", "gamma"),
    [
        (moira.MOIRA_DEFAULT_ESTIMATOR, "int8", 3, "concentrated", 0.98),
        (moira.MOIRA_DEFAULT_ESTIMATOR, "bfloat16", 4, "outlier", 0.95),
        ("mvar", "bfloat16", 3, "concentrated", 0.95),
        # The refinement applies whatever the estimator: one without stored keys on
        # int8 summaries too.
        ("mvar", "int8", 4, "outlier", 0.98),
    ],
)
def test_refine_lists_and_output_equal_reference(estimator, summary_dtype, group, pattern, gamma):
    # query_scale 3: x^2 . sigma^2 of random pages is about 9, so some pages are wide.
    batch = make_decode_batch(SEQ_LENS, 2, group, 64, "token_major", estimator, pattern, seed=1,
                              query_scale=3.0, summary_dtype=summary_dtype)  # fmt: skip
    kv, summaries, table, seq, query = batch
    masks = _refined_mask(query, kv, summaries, table, seq, gamma, estimator)
    refined = sum(int(m.sum()) for m in masks if m is not None)
    candidates = sum(m[:, 1:-1].numel() for m in masks if m is not None)
    assert 0 < refined < candidates  # the case refines some pages, not all
    config = moira.MoiraConfig.paper(gamma=gamma, estimator=estimator, summary_dtype=summary_dtype,
                                     refine="wide", **SMALL_FILL)  # fmt: skip
    ws, out = _run(config, batch)
    fp32_summaries = ref.read_summaries(summaries)
    expected, lists = ref.sparse_decode(query, kv, fp32_summaries, table, seq, SCALE, gamma,
                                        estimator=estimator, refine="wide")  # fmt: skip
    _assert_lists(ws, lists)
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=1.6e-2)


def test_refined_pages_carry_their_exact_log_mass_and_the_others_stage_1s():
    estimator = moira.MOIRA_DEFAULT_ESTIMATOR
    batch = make_decode_batch(SEQ_LENS, 2, 3, 64, "head_major", estimator, "concentrated",
                              seed=2, query_scale=3.0, summary_dtype="int8")  # fmt: skip
    kv, summaries, table, seq, query = batch
    config = moira.MoiraConfig.paper(gamma=0.98, refine="wide", **SMALL_FILL)
    ws = moira.MoiraWorkspace(len(SEQ_LENS), 6, 2, 64, table.shape[1], config, "cpu")
    moira.estimate_and_select(query, kv, summaries, table, seq, ws, SCALE)
    fp32_summaries = ref.read_summaries(summaries)
    masks = _refined_mask(query, kv, summaries, table, seq, 0.98, estimator)
    seen = 0
    for b, seq_len in enumerate(seq.tolist()):
        n = ref.num_pages(seq_len)
        est = ref.estimate_row_logmass(query[b], kv, fp32_summaries, table[b], seq_len, SCALE,
                                       estimator)  # fmt: skip
        keys, _ = ref.row_keys_values(kv, table[b], seq_len)
        exact = ref.exact_page_logmass(query[b], keys, seq_len, SCALE)
        want = torch.where(masks[b].unsqueeze(1), exact, est)
        torch.testing.assert_close(ws.logmass[b, :, :, :n], want, atol=2e-3, rtol=1e-4)
        seen += int(masks[b].sum())
    assert seen > 0


@pytest.mark.parametrize(
    "launch",
    [
        {"pipeline_stages": 3},
        {"pipeline_stages": 2, "num_warps": 8},
        {"pipeline_stages": 3, "tile_pages": 16},
        {"pipeline_stages": 1, "tile_pages": 32},
        # One program per list takes all three 16-page tiles of the long row.
        {"pipeline_stages": 3, "tile_pages": 16, "step_programs": 1},
        # Two per list (9 programs over 8 lists): tiles 0 and 2, and tile 1.
        {"pipeline_stages": 1, "tile_pages": 16, "step_programs": 9},
    ],
)
def test_refine_launches_give_the_same_log_masses(launch):
    """The refine launch's pipeline depths (the loop over a tile's compacted refined pages;
    3 is the default), smaller tiles (``tile_pages``: a list's pages over more programs),
    and programs that take several tiles each (``step_programs``) write the log-masses
    and lists of the unpipelined loop over 64-page tiles, bit for bit; values outside
    the allowed ones are refused."""
    batch = make_decode_batch(TILED_SEQ_LENS, 2, 3, 64, "token_major",
                              moira.MOIRA_DEFAULT_ESTIMATOR, "concentrated", seed=3,
                              query_scale=3.0, summary_dtype="int8")  # fmt: skip
    kv, summaries, table, seq, query = batch
    config = moira.MoiraConfig.paper(gamma=0.98, refine="wide", **SMALL_FILL)
    results = []
    for changes in ({"pipeline_stages": 1, "tile_pages": 64}, launch):
        ws = moira.MoiraWorkspace(len(TILED_SEQ_LENS), 6, 2, 64, table.shape[1], config, "cpu",
                                  launch={"refine": changes})  # fmt: skip
        moira.estimate_and_select(query, kv, summaries, table, seq, ws, SCALE)
        results.append((ws.logmass.clone(), ws.page_list.clone(), ws.list_lengths.clone()))
    masks = _refined_mask(query, kv, summaries, table, seq, 0.98, moira.MOIRA_DEFAULT_ESTIMATOR)
    assert sum(int(m.sum()) for m in masks if m is not None) > 1  # several pages refined
    assert bool(masks[0][..., 16:].any())  # and some beyond the first 16-page tile
    (lm0, list0, count0), (lm1, list1, count1) = results
    assert torch.equal(count0, count1)
    for row, n in enumerate(seq.tolist()):
        pages = ref.num_pages(n)
        assert torch.equal(lm0[row, ..., :pages], lm1[row, ..., :pages])
        for h in range(2):
            assert torch.equal(list0[row, h, : count0[row, h]], list1[row, h, : count1[row, h]])
    for refine, message in (
        ({"pipeline_stages": 0}, r"refine launch pipeline_stages must be an integer in 1\.\.6"),
        ({"pipeline_stages": 9}, r"refine launch pipeline_stages must be an integer in 1\.\.6"),
        ({"tile_pages": 8}, r"refine launch tile_pages must be one of \(16, 32, 64, 128\)"),
        ({"step_programs": 0}, r"refine launch step_programs must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            moira.MoiraWorkspace(1, 6, 2, 64, table.shape[1], config, "cpu",
                                 launch={"refine": refine})  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "kv_heads", "max_pages", "expected"),
    [
        (4, 8, 2035, 128),  # 4x131072: one program per 16-page tile
        (32, 8, 2035, 16),  # 32 rows under a 130k max_model_len: 4096 programs, not 32768
        (64, 2, 512, 32),  # every tile of a 32k row
        (256, 8, 2035, 2),
        (1024, 8, 2035, 1),  # at least one per list
        (1, 1, 10, 1),  # one tile
    ],
)
def test_refine_programs_per_list_caps_the_steps_programs(rows, kv_heads, max_pages, expected):
    """The refine grid's third extent: about the launch's step_programs (4096)
    programs a step, at most one per tile of max_pages, at least one per list."""
    launch = moira.refine_launch()
    assert moira.refine_programs_per_list(rows, kv_heads, max_pages, launch) == expected


@pytest.mark.parametrize("change", [dict(gamma=1.0), dict(selector="fixed", fixed_pages=3)])
def test_refine_leaves_gamma_one_and_fixed_count_lists_alone(change, monkeypatch):
    batch = make_decode_batch(SEQ_LENS, 2, 3, 64, "token_major", moira.MOIRA_DEFAULT_ESTIMATOR,
                              "concentrated", seed=3, query_scale=3.0)  # fmt: skip
    base = moira.MoiraConfig.paper(**change, **SMALL_FILL)
    ws_off, out_off = _run(base, batch)
    # Built for the coverage rule, then switched: the launches stay (a server's graphs)
    # and must refine nothing. A workspace built for a fixed count launches none.
    wide = moira.MoiraConfig.paper(refine="wide", **SMALL_FILL)
    ws_on, out_on = _run(dataclasses.replace(wide, **change), batch, built_with=wide)
    assert torch.equal(ws_on.list_lengths, ws_off.list_lengths)
    for row in range(len(SEQ_LENS)):
        for h in range(2):
            count = int(ws_on.list_lengths[row, h])
            assert torch.equal(ws_on.page_list[row, h, :count], ws_off.page_list[row, h, :count])
    assert torch.equal(out_on, out_off)
    # The first Select marks every list as having nothing to refine.
    assert bool((ws_on.select_stats[: len(SEQ_LENS), :, 0] == float("inf")).all())
    if change.get("selector") == "fixed":
        # Built for the fixed count, the default runs refine="off"'s kernels exactly:
        # one Select, no refine launch.
        calls = []
        for name in ("select_pages", "refine_page_logmass"):
            original = getattr(moira, name)
            monkeypatch.setattr(
                moira, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)
            )
        ws_fixed, out_fixed = _run(dataclasses.replace(wide, **change), batch)
        assert calls == ["select_pages"]
        assert ws_fixed.select_stats is None and torch.equal(out_fixed, out_off)
        assert torch.equal(ws_fixed.list_lengths, ws_off.list_lengths)


def test_refine_counts_each_list_once():
    batch = make_decode_batch(SEQ_LENS, 2, 3, 64, "token_major", moira.MOIRA_DEFAULT_ESTIMATOR,
                              "concentrated", seed=4, query_scale=3.0)  # fmt: skip
    ws, _ = _run(moira.MoiraConfig.paper(gamma=0.98, refine="wide", **SMALL_FILL), batch)
    kept, total = ws.read_counts()
    assert total == 2 * sum(ref.num_pages(s) for s in SEQ_LENS)
    assert kept == int(ws.list_lengths[: len(SEQ_LENS)].sum())
    assert int(ws.kept_total) == kept


def test_refine_config_and_constants():
    assert moira.REFINE_BELOW_NATS == ref.REFINE_BELOW_NATS
    assert moira.REFINE_WIDE_FACTOR == ref.REFINE_WIDE_FACTOR
    assert moira.MOIRA_REFINE_MODES == ref.REFINE_MODES
    # The refinement is the opt-in accuracy mode: off by default (its reads cost more
    # decode time on real text than they save) and in the paper's algorithm.
    assert moira.MoiraConfig().refine == moira.MOIRA_DEFAULT_REFINE == "off"
    assert not moira.MoiraConfig().refines
    assert moira.MoiraConfig.paper().refine == "off"
    assert moira.moira_config_from_env({}).refine == "off"
    assert moira.moira_config_from_env({"MOIRA_REFINE": "wide"}).refine == "wide"
    with pytest.raises(ValueError, match=r"MOIRA_REFINE must be one of \('off', 'wide'\)"):
        moira.moira_config_from_env({"MOIRA_REFINE": "exact"})
    ws = moira.MoiraWorkspace(2, 6, 2, 64, 8, moira.MoiraConfig(refine="wide"), "meta")
    assert ws.select_stats is not None and ws.select_stats.shape == (2, 2, 1 + 2 * 4)
    off = moira.MoiraWorkspace(2, 6, 2, 64, 8, moira.MoiraConfig(refine="off"), "meta")
    assert off.select_stats is None and ws.nbytes() == off.nbytes() + 2 * 2 * 9 * 4
    with pytest.raises(ValueError, match="set_selector cannot change"):
        off.set_selector(moira.MoiraConfig(refine="wide"))
    # A fixed count refines nothing: a workspace built for one allocates and launches
    # no refinement, and cannot be switched to the coverage rule that would need it.
    fixed = moira.MoiraConfig(selector="fixed", fixed_pages=4, refine="wide")
    assert not fixed.refines and moira.MoiraConfig(refine="wide").refines
    fixed_ws = moira.MoiraWorkspace(2, 6, 2, 64, 8, fixed, "meta")
    assert fixed_ws.select_stats is None and fixed_ws.nbytes() == off.nbytes()
    with pytest.raises(ValueError, match="cannot switch to selector='coverage'"):
        fixed_ws.set_selector(moira.MoiraConfig(refine="wide"))
    fixed_ws.set_selector(dataclasses.replace(fixed, fixed_pages=6))
    ws.set_selector(fixed)  # coverage -> fixed: the captured launches refine nothing


def test_wide_threshold_is_relative_to_rem_critical_variance():
    summ = torch.zeros(3, 1, 10, 4)
    summ[:, 0, 1] = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0], [3.0, 0, 0, 0]])
    query = torch.tensor([[2.0, 0, 0, 0]])  # x^2 = 4: v = 4, 8, 12
    wide = ref.wide_pages(query, summ, 1.0, num_top=8)
    critical = 0.75 * 2 * math.log(56)  # 6.04
    assert wide.tolist() == [[v >= critical for v in (4.0, 8.0, 12.0)]]


def test_refine_leaves_dense_rows_whole():
    # The backend's defaults: rows of context x 4 rows <= 36864 tokens read every page;
    # the first Select marks them done, so refine reads nothing for them.
    batch = make_decode_batch(SEQ_LENS, 2, 3, 64, "token_major", moira.MOIRA_DEFAULT_ESTIMATOR,
                              "concentrated", seed=6, query_scale=3.0)  # fmt: skip
    ws, out = _run(moira.MoiraConfig(refine="wide"), batch)
    for row, seq_len in enumerate(SEQ_LENS):
        n = ref.num_pages(seq_len)
        for h in range(2):
            assert ws.page_list[row, h, : int(ws.list_lengths[row, h])].tolist() == list(range(n))
    assert bool((ws.select_stats[: len(SEQ_LENS), :, 0] == float("inf")).all())
    _, out_off = _run(moira.MoiraConfig(refine="off"), batch)
    assert torch.equal(out, out_off)


def test_refine_on_an_fp8_cache_equals_the_reference_on_the_dequantized_cache():
    k_scale, v_scale = 0.0431, 0.0173  # not powers of two, as calibrated scales are
    estimator = moira.MOIRA_DEFAULT_ESTIMATOR
    kv, _, table, seq, query = make_decode_batch(
        SEQ_LENS, 2, 3, 64, "token_major", estimator, "concentrated", seed=7, query_scale=3.0
    )
    kv8 = ref.quantize_kv_cache_fp8(kv, k_scale, v_scale)
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), "int8")
    summaries = torch.zeros(kv.shape[0], 2, rows, 64, dtype=dtype)
    scales = {"k_scale": torch.tensor([k_scale]), "v_scale": torch.tensor([v_scale])}
    moira.write_page_summaries(kv8, summaries, full_page_slots(table, SEQ_LENS), scales["k_scale"])
    deq = ref.dequantize_kv_cache(kv8, k_scale, v_scale)
    fp32_summaries = ref.read_summaries(summaries)
    masks = _refined_mask(query, deq, summaries, table, seq, 0.98, estimator)
    assert sum(int(m.sum()) for m in masks if m is not None) > 0
    config = moira.MoiraConfig.paper(gamma=0.98, refine="wide", **SMALL_FILL)
    ws = moira.MoiraWorkspace(len(SEQ_LENS), 6, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, SCALE, **scales)
    expected, lists = ref.sparse_decode(query, deq, fp32_summaries, table, seq, SCALE, 0.98,
                                        estimator=estimator, refine="wide")  # fmt: skip
    _assert_lists(ws, lists)
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=1.6e-2)


@pytest.mark.parametrize("summary_dtype", ["int8", "int4"])
def test_reference_refinement_stays_on_the_inputs_device(summary_dtype):
    # The H200 checks run the reference on CUDA tensors. A tensor that the reference
    # makes without the inputs' device lands on the default device: under a meta
    # default it meets the CPU inputs and raises, so the CPU suite sees what the GPU
    # checks would.
    estimator = moira.MOIRA_DEFAULT_ESTIMATOR
    kv, summaries, table, seq, query = make_decode_batch(
        SEQ_LENS, 2, 3, 64, "head_major", estimator, "concentrated", seed=2, query_scale=3.0,
        summary_dtype=summary_dtype)  # fmt: skip
    with torch.device("meta"):
        masks = _refined_mask(query, kv, summaries, table, seq, 0.98, estimator)
        top = ref.summarize_pages_top(kv, table[0, :2], ref.TOP_ESTIMATORS[estimator])
    assert all(m.device.type == "cpu" for m in masks if m is not None)
    assert sum(int(m.sum()) for m in masks if m is not None) > 0
    assert top.device.type == "cpu"
