# SPDX-License-Identifier: Apache-2.0
"""benchmarks/report.py: docs/results.md agrees with the committed records, and the tables
built from small synthetic records (CPU, standard library only)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _load import ROOT, load

report = load("report")


def test_results_page_matches_records():
    """The committed page is what the records give: run `python benchmarks/report.py`."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_results_tree_holds_only_cited_records():
    results = ROOT / "benchmarks" / "results"
    files = {str(p.relative_to(results)) for p in results.rglob("*") if p.is_file()}
    cited = set(report.cited())
    extra = sorted(f for f in files - cited if f != "README.md" and not f.endswith(".run.json"))
    assert not extra, f"records no section cites (git rm them or add them): {extra}"
    assert len(files) <= 100


def test_readme_cites_current_records():
    """Every record the README's results table names is one the results page cites."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Results") : readme.index("## Two commands")]
    named = set(re.findall(r"`([\w./-]+\.jsonl?)`", table))
    assert named, "no record named in the README's results table"
    assert not named - set(report.cited()), sorted(named - set(report.cited()))


def _tpot_record(gpu="NVIDIA H100 80GB HBM3", **moira):
    dense = {
        "model": "M",
        "batch": 16,
        "context": 32768,
        "kv_cache_dtype": "auto",
        "arm": "dense",
        "selector": None,
        "gamma": None,
        "reads": None,
        "tpot_ms": 7.0,
    }
    sp = {"model": "M", "batch": 16, "context": 32768, "kv_cache_dtype": "auto",
          "selector": "coverage", "gamma": 0.98, "fixed_fraction": None, "reads": 0.476,
          "dense_ms": 7.0, "moira_ms": 5.5, "speedup": 7.0 / 5.5, **moira}  # fmt: skip
    return {"command": "python benchmarks/bench_tpot.py --merge /root/x/d.json /root/x/m.json "
                       "--out tpot_real.json",
            "gpu": gpu,
            "sources": [{"file": "d.json", "command": "python b.py --out /root/a/d.json"}],
            "rows": [dense], "speedups": [sp], "breakdown": []}  # fmt: skip


def _section(kind, records, title="T"):
    return {"title": title, "kind": kind, "intro": "intro.", "records": records}


def test_tpot_table_names_configuration_device_and_commit(tmp_path):
    rec = _tpot_record(estimator="mvar_top8", summary_dtype="int8", audit_every=64,
                       config="default")  # fmt: skip
    (tmp_path / "tpot").mkdir()
    (tmp_path / "tpot" / "r.json").write_text(json.dumps(rec))
    (tmp_path / "tpot" / "r.run.json").write_text(json.dumps({"commit": "abcdef0123456789"}))
    page = report.render([_section("tpot", [{"path": "tpot/r.json", "commit": "zzz"}])],
                         results=tmp_path)  # fmt: skip
    row = next(line for line in page.splitlines() if line.startswith("| M |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "32768×16"
    assert cells[3] == "**default**: mvar_top8, int8, audit every 64 steps, coverage γ 0.98"
    assert cells[4:8] == ["0.476", "7.000", "5.500", "**1.27×**"]
    # the sidecar's commit wins over the manifest's; the device comes from the record;
    # the host's absolute paths are cut to their last part
    prov = next(line for line in page.splitlines() if line.startswith("- `tpot/r.json`"))
    assert "commit abcdef012, NVIDIA H100 80GB HBM3" in prov
    assert "/root/" not in page
    assert "; its inputs: `python b.py --out …/d.json`" in prov


def test_manifest_config_fills_rows_without_engine_fields(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(_tpot_record(gpu="")))
    entry = {"path": "r.json", "config": {"estimator": "mvar", "summary_dtype": "bf16"}}
    page = report.render([_section("tpot", [entry])], results=tmp_path)
    assert "| mvar, bf16, coverage γ 0.98 |" in page
    assert "commit not recorded, not recorded;" in page  # neither commit nor device invented


def test_optional_record_warns_and_required_record_fails(tmp_path):
    warned = []
    page = report.render([_section("tpot", [{"path": "new.json", "optional": True}])],
                         warn=warned.append, results=tmp_path)  # fmt: skip
    assert warned == ["new.json: not in benchmarks/results/"]
    assert "No current record." in page
    with pytest.raises(FileNotFoundError):
        report.render([_section("tpot", [{"path": "new.json"}])], results=tmp_path)


def test_accuracy_table(tmp_path):
    def row(label, arm, ctx, score, diff, reads):
        return {"task": "all", "context": ctx, "haystack": None, "label": label, "arm": arm,
                "gamma": 0.99, "score": score, "diff_vs_dense": diff, "reads": reads}  # fmt: skip

    rows = [row("dense", "dense", 4096, 70.0, 0.0, None),
            row("moira[mvar_top8]@0.99", "moira", 4096, 70.5, 0.5, 0.68),
            {**row("dense", "dense", 4096, 1.0, 0.0, None), "haystack": "essays"},
            {**row("dense", "dense", 4096, 1.0, 0.0, None), "task": "niah_single"}]  # fmt: skip
    rows[1]["estimator"] = "int4:mvar_top8"
    (tmp_path / "a.json").write_text(json.dumps({"model": "Q", "rows": rows}))
    entry = {"path": "a.json", "config": {"estimator": "mvar", "summary_dtype": "int8"}}
    page = report.render([_section("accuracy", [entry])], results=tmp_path)
    assert "| dense (`FLASH_ATTN`) | 70.0 | `a.json` |" in page
    # the row's estimator field wins over the record's configuration
    assert "| mvar_top8, int4, coverage γ 0.99 | +0.5 @ 0.68 | `a.json` |" in page
    assert page.count("| dense (`FLASH_ATTN`) |") == 1  # per-task and per-haystack rows hidden


def test_serving_table(tmp_path):
    def row(arm, c, tok, env=""):
        return {"arm": arm, "concurrency": c, "output_tok_s": tok, "median_tpot_ms": 5.0,
                "server_command": f"{env} vllm serve m", "model": "m"}  # fmt: skip

    rec = {"command": "x", "gpu": "G", "rows": [row("dense", 32, 100.0),
           row("moira", 32, 125.0, "VLLM_ATTENTION_BACKEND=MOIRA MOIRA_GAMMA=0.98")]}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(rec))
    page = report.render([_section("serving", [{"path": "s.json"}])], results=tmp_path)
    assert "**+25.0%**" in page and "`MOIRA_GAMMA=0.98`" in page


def test_checks_rows(tmp_path):
    (tmp_path / "gpu.log").write_text("...\n70 passed, 1 skipped, 808 deselected in 1.5s\n")
    lines = [{"backend": "MOIRA", "gamma": "1", "within_tolerance": ok} for ok in (1, 1, 0)]
    (tmp_path / "u.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    page = report.render([_section("checks", [{"path": "gpu.log"}, {"path": "u.jsonl"}])],
                         results=tmp_path)  # fmt: skip
    assert "| 70 passed, 1 skipped |" in page
    assert "2 / 3 comparisons within tolerance" in page


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    (tmp_path / "r.json").write_text(json.dumps(_tpot_record()))
    monkeypatch.setattr(report, "MANIFEST", [_section("tpot", [{"path": "r.json"}])])
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    page = tmp_path / "results.md"
    assert report.main(["--out", str(page), "--results", str(tmp_path)]) == 0
    assert report.main(["--check", "--out", str(page), "--results", str(tmp_path)]) == 0
    page.write_text(page.read_text().replace("**1.27×**", "**1.30×**"))
    assert report.main(["--check", "--out", str(page), "--results", str(tmp_path)]) == 1
    assert "differs from the records" in capsys.readouterr().err
