# SPDX-License-Identifier: Apache-2.0
"""benchmarks/plot_results.py on small fake records in the topic folders (CPU, matplotlib Agg)."""

from __future__ import annotations

import json

import pytest
from _load import load

pytest.importorskip("matplotlib", reason="matplotlib not installed (plots are optional)")
pr = load("plot_results")


def _tpot_row(model, context, batch, arm, tpot, kv="auto", fraction=0.15):
    moira = arm != "dense"
    return {"model": model, "batch": batch, "context": context, "arm": arm, "tpot_ms": tpot,
            "kv_cache_dtype": kv, "selector": "fixed" if moira else None, "gamma": None,
            "fixed_fraction": fraction if moira else None,
            "reads": fraction if moira else None}  # fmt: skip


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _fake_results(d):
    rows = []
    for kv, dense, moira in (("auto", 20.0, 8.0), ("fp8", 15.0, 7.5)):
        rows += [_tpot_row("Llama-3.1-8B", 130048, 4, "dense", dense, kv),
                 _tpot_row("Llama-3.1-8B", 130048, 4, "moira", moira, kv)]  # fmt: skip
    _write(d / "tpot" / "tpot_kv_dtypes_h200.json", {"rows": rows})
    qwen = [_tpot_row("Qwen3-4B", 8192, 32, "dense", 12.0, fraction=0.49),
            _tpot_row("Qwen3-4B", 8192, 32, "moira", 9.6, fraction=0.49)]  # fmt: skip
    _write(d / "tpot" / "tpot_qwen_now_h200.json", {"rows": qwen})
    krows = []
    for c, b in ((8192, 32), (131072, 4)):
        shape = f"{c // 1024}k x{b}"
        krows.append({"shape": shape, "context": c, "batch": b, "cv": None,
                      "method": "dense_fa3", "us_per_layer": 490.0})  # fmt: skip
        for cv in (0, 1, "real"):
            for m, us in (("moira", 120), ("fa3_varlen", 140), ("pad", 330), ("pow2", 200)):
                krows.append({"shape": shape, "context": c, "batch": b, "cv": cv, "method": m,
                              "us_per_layer": float(us)})  # fmt: skip
    _write(d / "kernel_spread" / "kernels_h200.json", {"notes": [], "rows": krows})


def test_plots_from_fake_records(tmp_path, capsys):
    res, img = tmp_path / "results", tmp_path / "img"
    _fake_results(res)
    assert pr.main(["--results", str(res), "--img", str(img)]) == 0
    assert sorted(p.name for p in img.iterdir()) == ["kernel_spread.png", "tpot_speedup.png"]
    for p in img.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    assert "tpot_mid_final_h200.json not found" in capsys.readouterr().out


def test_missing_records_draw_nothing(tmp_path, capsys):
    img = tmp_path / "img"
    assert pr.main(["--results", str(tmp_path / "none"), "--img", str(img)]) == 0
    assert list(img.iterdir()) == []
    out = capsys.readouterr().out
    assert "tpot_kv_dtypes_h200.json not found" in out and "kernels_h200.json not found" in out


def test_fp8_pairs_are_their_own_series():
    joined = pr.join_tpot(
        {"speedups": None,
         "rows": [_tpot_row("Llama-3.1-8B", 130048, 4, arm, t, kv)
                  for kv, pairs in (("auto", (("dense", 20.0), ("moira", 8.0))),
                                    ("fp8", (("dense", 15.0), ("moira", 7.5))))
                  for arm, t in pairs]})  # fmt: skip
    series = sorted((pr._speedup_series(s), round(s["speedup"], 2)) for s in joined["speedups"])
    assert series == [("fixed count", 2.5), ("fixed count, fp8 KV", 2.0)]


def test_join_tpot_pairs_arms_within_each_record_only():
    def row(model, arm, tpot):
        return _tpot_row(model, 130048, 4, arm, tpot)

    llama = {"rows": [row("Llama-3.1-8B", "dense", 20.0), row("Llama-3.1-8B", "moira", 10.0)]}
    qwen = {"rows": [row("Qwen3-4B", "dense", 21.0), row("Qwen3-4B", "moira", 7.0)]}
    moira_only = {"rows": [row("Llama-3.1-8B", "moira", 5.0)]}  # no dense arm of its own
    joined = pr.join_tpot(llama, None, qwen, moira_only)
    assert len(joined["rows"]) == 5
    assert sorted((s["model"], round(s["speedup"], 3)) for s in joined["speedups"]) == [
        ("Llama-3.1-8B", 2.0), ("Qwen3-4B", 3.0)]  # fmt: skip
