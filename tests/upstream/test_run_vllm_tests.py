# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the runner for vLLM's own backend tests (the GPU run is on the H200)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import run_vllm_tests as runner


def test_the_series_test_patch_is_the_only_tests_only_patch():
    patches = runner.series_test_patches()
    assert [p.name for p in patches] == [
        "0007-Tests-Run-MOIRA-in-the-attention-backend-correctness.patch"
    ]
    # and build.sh installs every other patch of the series (they change vllm/)
    series = [
        line.strip()
        for line in (runner.PATCH_DIR / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(series) == 7 and series[-1] == patches[0].name


def _backend_lists(tree: Path) -> dict[str, list[str]]:
    source = (tree / "tests/v1/attention/test_attention_backends.py").read_text()
    lists = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            name = getattr(node.targets[0], "id", None)
            if name in ("BACKENDS_TO_TEST", "BLOCK_64_BACKENDS"):
                lists[name] = [ast.unparse(elt) for elt in node.value.elts]
    return lists


@pytest.mark.skipif(not runner.SDIST_CACHE.is_file(), reason="no cached vLLM sdist")
def test_stage_and_patch_put_moira_in_vllms_backend_list(tmp_path):
    runner.stage(runner.SDIST_CACHE, tmp_path / "staged")
    pristine = _backend_lists(tmp_path / "staged")
    assert "AttentionBackendEnum.MOIRA" not in pristine["BACKENDS_TO_TEST"]
    assert "BLOCK_64_BACKENDS" not in pristine

    runner.apply_test_patches(tmp_path / "staged", runner.series_test_patches())
    patched = _backend_lists(tmp_path / "staged")
    assert "AttentionBackendEnum.MOIRA" in patched["BACKENDS_TO_TEST"]
    assert patched["BLOCK_64_BACKENDS"] == ["AttentionBackendEnum.MOIRA"]
    # the rest of the list is vLLM's, in vLLM's order
    assert [b for b in patched["BACKENDS_TO_TEST"] if "MOIRA" not in b] == pristine[
        "BACKENDS_TO_TEST"
    ]


def test_stage_refuses_a_missing_sdist(tmp_path):
    with pytest.raises(SystemExit, match="no vLLM sdist"):
        runner.stage(tmp_path / "missing.tar.gz", tmp_path / "staged")


def test_run_refuses_an_unstaged_tree(tmp_path):
    with pytest.raises(SystemExit, match="no staged vLLM tests"):
        runner.main(["run", "--staged", str(tmp_path), "--out", str(tmp_path / "out")])


def test_summarize_counts_per_backend(tmp_path, capsys):
    report = tmp_path / "r.jsonl"
    rows = [
        {"test": "a", "backend": "MOIRA", "max_abs": 0.01, "within_tolerance": True},
        {"test": "b", "backend": "MOIRA", "max_abs": 0.2, "within_tolerance": False},
        {"test": "a", "backend": "FLASH_ATTN", "max_abs": 0.015, "within_tolerance": True},
    ]
    report.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = runner.summarize(report)
    assert table["MOIRA"] == {"cases": 2, "within_tol": 1, "max_abs": 0.2}
    assert table["FLASH_ATTN"] == {"cases": 1, "within_tol": 1, "max_abs": 0.015}
    assert "MOIRA: 1 of 2 within" in capsys.readouterr().out


def test_fixture_plugin_records_and_still_asserts(tmp_path):
    # A tiny test file using the plugin's recording: one case within tolerance, one not.
    (tmp_path / "test_probe.py").write_text(
        "import functools, torch, pytest\n"
        "def msg(m, backend_name): return m\n"
        "def test_close():\n"
        "    torch.testing.assert_close(torch.ones(3), torch.ones(3) + 1e-3, atol=1e-2, rtol=0,\n"
        "                               msg=functools.partial(msg, backend_name='MOIRA'))\n"
        "def test_far():\n"
        "    torch.testing.assert_close(torch.ones(3), torch.zeros(3), atol=1e-2, rtol=0,\n"
        "                               msg=functools.partial(msg, backend_name='MOIRA'))\n"
    )
    report = tmp_path / "r.jsonl"
    env = {
        **__import__("os").environ,
        "MOIRA_VLLM_TESTS_REPORT": str(report),
        "PYTHONPATH": str(Path(__file__).parent),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--noconftest", "-p", "vllm_fixtures", "-q",
         "-o", "addopts=", str(tmp_path / "test_probe.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_far fails, as before
    rows = {
        r["test"].split("::")[-1]: r for r in map(json.loads, report.read_text().split("\n")[:-1])
    }
    assert rows["test_close"]["within_tolerance"] is True
    assert rows["test_far"]["within_tolerance"] is False
    assert rows["test_far"]["max_abs"] == pytest.approx(1.0)
    assert rows["test_far"]["backend"] == "MOIRA"
