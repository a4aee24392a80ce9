# SPDX-License-Identifier: Apache-2.0
"""benchmarks/plot_results.py on small fake results (CPU, matplotlib Agg)."""

from __future__ import annotations

import json

import pytest
from _load import load

pytest.importorskip("matplotlib", reason="matplotlib not installed (plots are optional)")
pr = load("plot_results")


def _fake_results(d):
    rows = []
    for model in ("Llama-3.1-8B", "Qwen3-4B"):
        for (c, b, dense, moira, reads) in ((8192, 32, 12.7, 9.2, 0.42),
                                            (130048, 4, 19.3, 7.3, 0.15),
                                            (2048, 1, 5.0, 5.1, 0.6)):  # fmt: skip
            base = {"model": model, "batch": b, "context": c, "steps": 60, "p10_ms": None,
                    "p90_ms": None}  # fmt: skip
            rows.append(dict(base, arm="dense", selector=None, gamma=None, reads=None,
                             tpot_ms=dense))  # fmt: skip
            rows.append(dict(base, arm="moira", selector="coverage", gamma=0.98, reads=reads,
                             tpot_ms=moira))  # fmt: skip
    breakdown = [{"model": "Llama-3.1-8B", "backend": "MOIRA", "batch": 4, "context": 130048,
                  "estimate_ms": 0.4, "select_ms": 0.4, "attend_ms": 2.8, "merge_ms": 0.1,
                  "gemm_ms": 3.8, "rest_ms": 0.5, "kernels_total_ms": 8.0}]  # fmt: skip
    (d / "tpot_h200.json").write_text(json.dumps({"rows": rows, "breakdown": breakdown}))
    krows = []
    for c, b in ((8192, 32), (131072, 4)):
        shape = f"{c // 1024}k x{b}"
        krows.append({"shape": shape, "context": c, "batch": b, "cv": None,
                      "method": "dense_fa3", "us_per_layer": 490.0})  # fmt: skip
        for cv in (0, 1, "real"):
            for m, us in (("moira", 120), ("fa3_varlen", 140), ("pad", 330), ("pow2", 200)):
                krows.append({"shape": shape, "context": c, "batch": b, "cv": cv, "method": m,
                              "us_per_layer": float(us)})  # fmt: skip
    (d / "kernels_h200.json").write_text(json.dumps({"notes": [], "rows": krows}))


def test_plots_from_fake_json(tmp_path, capsys):
    res, img = tmp_path / "results", tmp_path / "img"
    res.mkdir()
    _fake_results(res)
    assert pr.main(["--results", str(res), "--img", str(img)]) == 0
    names = sorted(p.name for p in img.iterdir())
    assert names == ["kernel_spread.png", "step_breakdown.png", "tpot_batch1.png",
                     "tpot_speedup.png"]  # fmt: skip
    for p in img.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    assert "serving_h200.json not found" in capsys.readouterr().out


def test_serving_plot_and_missing_inputs(tmp_path, capsys):
    res, img = tmp_path / "results", tmp_path / "img"
    res.mkdir()
    rows = [{"model": "Llama-3.1-8B", "set": "A", "arm": arm, "concurrency": c,
             "output_tok_s": tps} for arm, c, tps in
            (("FA3", 1, 152), ("FA3", 16, 511), ("Moira", 1, 137), ("Moira", 16, 743))]  # fmt: skip
    (res / "serving_h200.json").write_text(json.dumps({"rows": rows}))
    assert pr.main(["--results", str(res), "--img", str(img)]) == 0
    assert [p.name for p in img.iterdir()] == ["serving_throughput.png"]
    out = capsys.readouterr().out
    assert "tpot_h200.json not found" in out and "kernels_h200.json not found" in out


def test_serving_plot_joins_set_b_runs(tmp_path, monkeypatch):
    res, img = tmp_path / "results", tmp_path / "img"
    res.mkdir()

    def rows(set_, c):
        return [{"model": "Llama-3.1-8B", "set": set_, "arm": arm, "concurrency": c,
                 "output_tok_s": tps}
                for arm, tps in (("dense", 100.0), ("moira", 137.0))]  # fmt: skip

    (res / "serving_h200.json").write_text(json.dumps({"rows": rows("A", 16)}))
    (res / "serving_setB_h200.json").write_text(json.dumps({"rows": rows("B", 8)}))
    (res / "serving_setB_c1_h200.json").write_text(json.dumps({"rows": rows("B", 1)}))
    seen = {}
    real = pr.plot_serving
    monkeypatch.setattr(pr, "plot_serving", lambda data, out: seen.update(data) or real(data, out))
    assert pr.main(["--results", str(res), "--img", str(img)]) == 0
    assert sorted((r["set"], r["concurrency"]) for r in seen["rows"])[::2] == [
        ("A", 16), ("B", 1), ("B", 8)]  # fmt: skip
    assert (img / "serving_throughput.png").stat().st_size > 1000


def test_join_tpot_pairs_arms_within_each_record_only():
    def row(model, arm, tpot):
        return {"model": model, "batch": 4, "context": 130048, "arm": arm, "tpot_ms": tpot,
                "selector": None if arm == "dense" else "fixed", "gamma": None,
                "fixed_fraction": None if arm == "dense" else 0.15,
                "reads": None if arm == "dense" else 0.15}  # fmt: skip

    llama = {"rows": [row("Llama-3.1-8B", "dense", 20.0), row("Llama-3.1-8B", "moira", 10.0)]}
    qwen = {"rows": [row("Qwen3-4B", "dense", 21.0), row("Qwen3-4B", "moira", 7.0)]}
    moira_only = {"rows": [row("Llama-3.1-8B", "moira", 5.0)]}  # no dense arm of its own
    joined = pr.join_tpot(llama, None, qwen, moira_only)
    assert len(joined["rows"]) == 5
    assert sorted((s["model"], round(s["speedup"], 3)) for s in joined["speedups"]) == [
        ("Llama-3.1-8B", 2.0), ("Qwen3-4B", 3.0)]  # fmt: skip
