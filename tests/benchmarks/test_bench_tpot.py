# SPDX-License-Identifier: Apache-2.0
"""Pure helpers of benchmarks/bench_tpot.py (CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _load import load

bt = load("bench_tpot")


def test_parse_and_family():
    assert bt.parse_shapes(bt.DEFAULT_SHAPES)[-1] == (130048, 4)
    assert bt.model_family("shared/gpu/models/Llama-3.1-8B/") == "llama"
    assert bt.model_family("shared/gpu/models/Qwen3-4B") == "qwen"
    assert bt.model_family("x/SmolLM2") is None
    assert bt.parse_fraction_overrides("8192x32=0.4, 130048x4=0.15") == {
        (8192, 32): 0.4,
        (130048, 4): 0.15,
    }


def test_plan_arms():
    assert bt.plan_arms("FLASH_ATTN", "llama", 130048, 4, [0.98]) == [
        {"arm": "dense", "selector": None, "gamma": None, "fixed_fraction": None}
    ]
    arms = bt.plan_arms("MOIRA", "llama", 130048, 4, [0.98, 0.99])
    assert [(a["selector"], a["gamma"], a["fixed_fraction"]) for a in arms] == [
        ("coverage", 0.98, None),
        ("coverage", 0.99, None),
        ("fixed", None, 0.15),
    ]
    assert bt.plan_arms("MOIRA", "qwen", 8192, 32, [0.98])[-1]["fixed_fraction"] == 0.49
    assert bt.plan_arms("MOIRA", None, 4096, 1, [0.98])[-1]["fixed_fraction"] == 0.3
    assert len(bt.plan_arms("MOIRA", None, 1000, 3, [0.98])) == 1  # no fraction known
    over = bt.plan_arms("MOIRA", "llama", 8192, 32, [0.98], {(8192, 32): 0.5})
    assert over[-1]["fixed_fraction"] == 0.5


def test_interval_stats_only_consecutive_steps():
    stamps = [(10, 0.0), (11, 0.010), (12, 0.021), (14, 0.050), (15, 0.060)]
    s = bt.interval_stats(stamps)
    assert s["steps"] == 3  # 12 -> 14 skipped a step
    assert s["tpot_ms"] == pytest.approx(10.0)
    assert s["p10_ms"] <= s["tpot_ms"] <= s["p90_ms"]
    assert bt.interval_stats([(1, 0.0)])["tpot_ms"] is None


def test_max_tokens_covers_windows():
    windows = [{"settle": 3, "measure": 64}] * 2
    n = bt.max_tokens_for(130048, 4, windows, 16384)
    assert n >= 2 * 67 + 130048 * 4 // 16384
    assert 130048 + n <= 131072  # fits Llama-3.1-8B's 131072 positions


def test_classify_and_summarize_kernels():
    assert bt.classify_kernel("kernel_moira_select_0d1d2d") == "select"
    assert bt.classify_kernel("void flash::FlashAttnFwdSm90<...>") == "fa3"
    assert bt.classify_kernel("nvjet_tst_128x64") == "gemm"
    assert bt.classify_kernel("triton_red_fused_rms_norm") == "rest"
    one_step = [("kernel_moira_estimate", 20.0), ("kernel_moira_select", 10.0),
                ("kernel_moira_attend", 100.0), ("sm90_xmma_gemm", 300.0), ("x", 70.0)]  # fmt: skip
    events = one_step * 64
    s = bt.summarize_kernels(events, steps=2)
    assert s["estimate_ms"] == pytest.approx(0.64)
    assert s["estimate_select_ms"] == pytest.approx(0.96)
    assert s["kernels_total_ms"] == pytest.approx(500 * 64 / 1e3 / 2)
    assert s["rest_ms"] == pytest.approx(70 * 64 / 1e3 / 2)


def test_stage_rates_per_layer_bytes_and_share_of_copy_rate():
    # 28 layers, 2 KV heads, D 128, bf16 KV; 16 rows of 8,192 tokens = 2,048 pages.
    geometry = {"num_layers": 28, "num_kv_heads": 2, "head_size": 128, "kv_element_bytes": 2,
                "summary_page_bytes": 2 * 11 * 128}  # fmt: skip
    breakdown = {"estimate_ms": 0.56, "attend_ms": 2.8, "select_ms": 0.28, "gemm_ms": 3.0,
                 "kernels_total_ms": 6.64, "estimate_select_ms": 0.7}  # fmt: skip
    r = bt.stage_rates(breakdown, geometry, context=8192, batch=16, reads=0.5, copy_gbps=3000.0)
    assert r["us_per_layer"] == pytest.approx({"estimate": 20.0, "attend": 100.0, "select": 10.0})
    assert "gemm" not in r["us_per_layer"]
    pages = 16 * 128
    assert r["bytes_per_layer"]["estimate"] == pages * 2 * 11 * 128
    kv = 0.5 * pages * 64 * 2 * 128 * 2 * 2
    assert r["bytes_per_layer"]["attend"] == kv
    assert r["gbps"]["attend"] == pytest.approx(kv / 100.0 / 1e3)
    assert r["of_copy_rate"]["attend"] == pytest.approx(kv / 100.0 / 1e3 / 3000.0)
    assert "select" not in r["gbps"]  # its bytes are not known from the shape
    dense = bt.stage_rates({"fa3_ms": 2.8}, geometry, 8192, 16, None, None)
    assert dense["bytes_per_layer"]["fa3"] == 2 * kv and dense["of_copy_rate"] == {}


def test_model_geometry_of_a_dense_engine():
    cfg = {"num_attention_heads": 12, "hidden_size": 1536, "num_key_value_heads": 2,
           "num_hidden_layers": 28}  # fmt: skip
    assert bt.model_geometry(cfg, "fp8", "FLASH_ATTN") == {
        "num_layers": 28, "num_kv_heads": 2, "head_size": 128, "kv_element_bytes": 1,
        "summary_page_bytes": 0,
    }  # fmt: skip


def test_busy_time_counts_overlapping_kernels_once():
    assert bt.busy_us([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (21.0, 22.0)]) == 17.0
    assert bt.busy_us([]) == 0.0
    # Two kernels of 10 us, the second starting 4 us before the first ends
    # (a dependent launch): 20 us of durations, 16 us busy.
    s = bt.summarize_kernels([("kernel_moira_select", 10.0, 0.0),
                              ("kernel_moira_attend", 10.0, 6.0)], steps=1)  # fmt: skip
    assert s["kernels_total_ms"] == pytest.approx(0.020)
    assert s["kernels_busy_ms"] == pytest.approx(0.016)
    assert "kernels_busy_ms" not in bt.summarize_kernels([("x", 1.0)], steps=1)


def test_attention_wall_time_counts_the_gaps_around_attention_kernels():
    # gemm [0, 10), attention kernels [12, 15) and [16, 20), gemm [23, 30),
    # reshape_and_cache [31, 32), FA3 [32, 35), nothing after.
    events = [
        ("nvjet_gemm", 10.0, 0.0),
        ("kernel_moira_estimate", 3.0, 12.0),
        ("kernel_moira_attend", 4.0, 16.0),
        ("nvjet_gemm", 7.0, 23.0),
        ("reshape_and_cache_flash_kernel", 1.0, 31.0),
        ("FlashAttnFwdSm90", 3.0, 32.0),
    ]
    # First run: from the gemm's end (10) to the next gemm's start (23) = 13;
    # second: from 30 to its own end (35) = 5.
    assert bt.attention_wall_us(events) == pytest.approx(18.0)
    s = bt.summarize_kernels(events, steps=1)
    assert s["attention_busy_ms"] == pytest.approx(0.011)
    assert s["attention_wall_ms"] == pytest.approx(0.018)
    assert bt.attention_wall_us([("nvjet_gemm", 1.0, 0.0)]) == 0.0


def test_profiled_steps_count_select_launches_per_layer():
    # Events as kernel_events() returns them: (name, duration us, start us).
    events = [("kernel_moira_select", 3.0, float(t)) for t in range(64)] + [("gemm", 9.0, 0.0)]
    assert bt.profiled_steps(events, num_layers=32, step_calls=5) == 2.0
    assert bt.profiled_steps([("gemm", 9.0, 0.0)], num_layers=32, step_calls=5) == 5.0
    # Dense: one FULL-graph launch per decode step, counted in the engine process.
    assert bt.profiled_steps([("gemm", 9.0, 0.0)], 32, step_calls=5, graph_launches=4) == 4.0


def _row(**kw):
    row = {"model": "Llama-3.1-8B", "batch": 4, "context": 130048, "arm": "moira",
           "selector": "coverage", "gamma": 0.98, "reads": 0.15, "tpot_ms": 7.3, "steps": 63,
           "p10_ms": 7.2, "p90_ms": 7.4}  # fmt: skip
    row.update(kw)
    return row


def test_host_calls_count_launches_graphs_copies_and_syncs_per_step():
    # (name, duration us) as cpu_events() returns them: runtime and driver API names.
    events = [("cudaGraphLaunch", 20.0), ("cudaGraphLaunch", 22.0),
              ("cudaLaunchKernel", 5.0), ("cuLaunchKernelEx", 7.0), ("cudaLaunchKernelExC", 4.0),
              ("cudaMemcpyAsync", 3.0), ("cudaStreamSynchronize", 400.0),
              ("aten::copy_", 9.0)]  # fmt: skip
    calls = bt.host_calls(events, steps=2)
    assert calls["graph_launch"] == {"per_step": 1.0, "us_per_step": 21.0}
    assert calls["kernel_launch"] == {"per_step": 1.5, "us_per_step": 8.0}
    assert calls["memcpy"] == {"per_step": 0.5, "us_per_step": 1.5}
    assert calls["synchronize"] == {"per_step": 0.5, "us_per_step": 200.0}
    assert bt.host_calls([], steps=1)["synchronize"] == {"per_step": 0.0, "us_per_step": 0.0}
    # The names taking the most host time, whatever they are.
    assert list(calls["top"])[:2] == ["cudaStreamSynchronize", "cudaGraphLaunch"]
    assert calls["top"]["aten::copy_"] == {"per_step": 0.5, "us_per_step": 4.5}


def test_validate_tpot_row():
    bt.validate_tpot_row(_row())
    bt.validate_tpot_row(_row(arm="dense", selector=None, gamma=None, reads=None, tpot_ms=19.3))
    bt.validate_tpot_row(_row(tpot_ms=None, steps=0))  # skipped shape
    for bad in (_row(arm="x"), _row(selector=None), _row(reads=1.5), _row(tpot_ms=0),
                _row(arm="dense", selector=None, reads=0.2), _row(batch="4")):  # fmt: skip
        with pytest.raises(ValueError):
            bt.validate_tpot_row(bad)
    with pytest.raises(ValueError):
        bt.validate_tpot_row({k: v for k, v in _row().items() if k != "reads"})


def test_merge_with_dense_baseline_format(tmp_path):
    moira = {"command": "c1", "gpu": "NVIDIA H200",
             "rows": [_row(), _row(selector="fixed", gamma=None, fixed_fraction=0.15, tpot_ms=7.0)],
             "breakdown": [{"model": "Llama-3.1-8B", "estimate_ms": 0.4}]}  # fmt: skip
    dense = {"info": {"model": "Llama-3.1-8B", "gpu": "NVIDIA H200", "args": {"gen": 128}},
             "results": [{"batch": 4, "ctx": 130048, "gen": 128, "tpot_ms_median": 19.32,
                          "tpot_ms_p10": 19.2, "tpot_ms_p90": 19.4, "full_decode_steps": 103},
                         {"batch": 8, "ctx": 65536, "skipped": "deadline"}]}  # fmt: skip
    a, b = tmp_path / "m.json", tmp_path / "d.json"
    a.write_text(json.dumps(moira))
    b.write_text(json.dumps(dense))
    out = tmp_path / "tpot.json"
    rec = bt.merge([str(a), str(b)], str(out))
    assert json.loads(out.read_text()) == rec
    assert len(rec["rows"]) == 3 and rec["gpu"] == "NVIDIA H200"
    for row in rec["rows"]:
        bt.validate_tpot_row(row)
    sp = {s["selector"]: s["speedup"] for s in rec["speedups"]}
    assert sp["coverage"] == pytest.approx(19.32 / 7.3)
    assert sp["fixed"] == pytest.approx(19.32 / 7.0)
    assert rec["breakdown"] == moira["breakdown"]


def test_merge_pairs_fp8_rows_with_both_dense_rows(tmp_path):
    """Four files (dense / Moira x bf16 / fp8 KV): each Moira row against the
    dense row of its KV dtype, and an fp8 Moira row also against dense bf16."""
    files = []
    for name, kv, rows in (
        ("dense_auto", "auto", [_row(arm="dense", selector=None, gamma=None, reads=None,
                                     tpot_ms=20.0)]),
        ("dense_fp8", "fp8", [_row(arm="dense", selector=None, gamma=None, reads=None,
                                   tpot_ms=12.0, kv_cache_dtype="fp8")]),
        ("moira_auto", "auto", [_row(tpot_ms=7.0)]),
        ("moira_fp8", "fp8", [_row(tpot_ms=5.0, kv_cache_dtype="fp8")]),
    ):  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"command": name, "kv_cache_dtype": kv, "rows": rows}))
        files.append(str(path))
    rec = bt.merge(files, str(tmp_path / "tpot.json"))
    by_kv = {s["kv_cache_dtype"]: s for s in rec["speedups"]}
    assert set(by_kv) == {"auto", "fp8"}
    assert by_kv["auto"]["speedup"] == pytest.approx(20.0 / 7.0)
    assert "speedup_vs_dense_bf16" not in by_kv["auto"]
    assert by_kv["fp8"]["speedup"] == pytest.approx(12.0 / 5.0)
    assert by_kv["fp8"]["speedup_vs_dense_bf16"] == pytest.approx(20.0 / 5.0)


def test_merge_keeps_each_attend_launch_apart(tmp_path):
    """Two fp8 Moira engines, the default launch and an Attend launch candidate (records
    such as tpot_fp8_stages carry ``attend_launch``): both rows pair with the one dense
    row, and the candidate's speedup names it."""
    rows = [_row(arm="dense", selector=None, gamma=None, reads=None, tpot_ms=12.0,
                 kv_cache_dtype="fp8"),
            _row(tpot_ms=6.0, kv_cache_dtype="fp8"),
            _row(tpot_ms=5.0, kv_cache_dtype="fp8", attend_launch={"num_stages": 4})]  # fmt: skip
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"command": "c", "kv_cache_dtype": "fp8", "rows": rows}))
    rec = bt.merge([str(path)], str(tmp_path / "tpot.json"))
    by_launch = {json.dumps(s.get("attend_launch")): s["speedup"] for s in rec["speedups"]}
    assert by_launch == {"null": pytest.approx(2.0), '{"num_stages": 4}': pytest.approx(2.4)}


def test_merge_keeps_each_estimator_apart(tmp_path):
    """Two MOIRA engines that differ only in MOIRA_ESTIMATOR (run_gpu.sh tpot-real's moira
    and mvar arms): both pair with the one dense row, and each speedup names its estimator."""
    rows = [_row(arm="dense", selector=None, gamma=None, reads=None, tpot_ms=12.0),
            _row(tpot_ms=6.0, estimator="mvar"),
            _row(tpot_ms=5.0, estimator="mvar_top8")]  # fmt: skip
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"command": "c", "rows": rows}))
    rec = bt.merge([str(path)], str(tmp_path / "tpot.json"))
    assert {s["estimator"]: s["speedup"] for s in rec["speedups"]} == {
        "mvar": pytest.approx(2.0),
        "mvar_top8": pytest.approx(2.4),
    }


def test_rows_name_the_engines_estimator_on_moira_arms_only():
    ctx = {"model": "m", "estimator": "mvar"}
    moira_arm = {"arm": "moira", "selector": "fixed", "gamma": None, "fixed_fraction": 0.15}
    dense_arm = {"arm": "dense", "selector": None, "gamma": None, "fixed_fraction": None}
    assert bt.base_row(ctx, 8192, 32, moira_arm)["estimator"] == "mvar"
    assert "estimator" not in bt.base_row(ctx, 8192, 32, dense_arm)
    assert "estimator" not in bt.base_row({"model": "m"}, 8192, 32, moira_arm)


def test_merge_compares_greedy_outputs(tmp_path):
    """--greedy-check files of both backends: equal lists pass, a divergence
    is located with the dense margin at that step."""

    def greedy(tokens_per_prompt):
        return {"gamma": 1.0, "prompts": [
            {"prompt_len": 8192 + i, "tokens": t, "margins": [0.5, 0.01, 0.3][: len(t)]}
            for i, t in enumerate(tokens_per_prompt)]}  # fmt: skip

    files = []
    for backend, toks in (
        ("FLASH_ATTN", [[1, 2, 3], [4, 5, 6]]),
        ("MOIRA", [[1, 2, 3], [4, 9, 6]]),
    ):
        path = tmp_path / f"{backend}.json"
        path.write_text(json.dumps({"backend": backend, "rows": [], "greedy": greedy(toks)}))
        files.append(str(path))
    rec = bt.merge(files, str(tmp_path / "out.json"))
    cmp = rec["greedy_moira_gamma1_vs_dense"]
    assert not cmp["all_equal"]
    assert [p["equal"] for p in cmp["prompts"]] == [True, False]
    assert cmp["prompts"][1]["first_divergence"] == 1
    assert cmp["prompts"][1]["dense_margin_there"] == 0.01
    assert bt.compare_greedy(greedy([[7]]), greedy([[7]]))["all_equal"]


def test_text_prompts_are_real_windows_from_distinct_documents(tmp_path):
    import gzip

    docs = [
        {"sample": {"context": 4096}, "prompt_token_ids": list(range(100, 130))},
        {"sample": {"context": 8192}, "prompt_token_ids": list(range(1000, 1050))},
        {"sample": {"context": 4096}, "prompt_token_ids": list(range(200, 220))},
    ]
    path = tmp_path / "prompts.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"docs": docs}, f)
    stream, starts = bt.load_text_stream(str(path))
    # longest context first, documents back to back
    assert stream[:50] == list(range(1000, 1050)) and starts == [0, 50, 80]
    assert len(stream) == 100
    w0, w1 = bt.text_window(stream, starts, 0, 40), bt.text_window(stream, starts, 1, 40)
    assert w0 == list(range(1000, 1040))
    # a short document runs on into the next one
    assert w1 == list(range(100, 130)) + list(range(200, 210))
    # near the end the window slides back so it stays whole; requests cycle over documents
    assert bt.text_window(stream, starts, 2, 40) == stream[60:100]
    assert bt.text_window(stream, starts, 3, 40) == w0
    with pytest.raises(ValueError, match="fewer than one 101-token prompt"):
        bt.text_window(stream, starts, 0, 101)


def test_rows_of_the_default_engine_at_the_default_gamma_say_default():
    moira = pytest.importorskip("vllm.v1.attention.backends.moira")
    default = dataclasses.asdict(moira.MoiraConfig())
    ctx = {"model": "m", **bt.engine_fields(default)}
    arm = {"arm": "moira", "selector": "coverage", "gamma": default["gamma"],
           "fixed_fraction": None}  # fmt: skip
    row = bt.base_row(ctx, 8192, 32, arm)
    assert row["config"] == "default"
    assert (row["estimator"], row["summary_dtype"]) == ("mvar_top8", "int8")
    # Another γ, or an engine with any other field changed, is not the default.
    assert "config" not in bt.base_row(ctx, 8192, 32, dict(arm, gamma=0.99))
    mvar = {"model": "m", **bt.engine_fields(dict(default, estimator="mvar"))}
    assert "config" not in bt.base_row(mvar, 8192, 32, arm)
    assert bt.base_row(mvar, 8192, 32, arm)["estimator"] == "mvar"


def test_plugin_mode_rows_say_so_and_run_moira_arms():
    pytest.importorskip("vllm.v1.attention.backends.moira")
    default = dataclasses.asdict(bt.moira_module("CUSTOM").MoiraConfig())
    ctx = {"model": "m", **bt.engine_fields(default, "CUSTOM")}
    arm = {"arm": "moira", "selector": "coverage", "gamma": default["gamma"],
           "fixed_fraction": None}  # fmt: skip
    row = bt.base_row(ctx, 8192, 32, arm)
    assert row["mode"] == "plugin" and row["config"] == "default"
    assert "mode" not in bt.base_row({"model": "m", **bt.engine_fields(default)}, 8192, 32, arm)
    arms = bt.plan_arms("CUSTOM", None, 8192, 32, [0.98], {})
    assert [a["arm"] for a in arms] == ["moira"] * len(arms) and arms[0]["gamma"] == 0.98
