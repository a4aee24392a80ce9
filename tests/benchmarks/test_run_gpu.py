# SPDX-License-Identifier: Apache-2.0
"""benchmarks/run_gpu.sh: argument checks that fail before anything is installed (CPU)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "--out", str(tmp_path / "out"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--kv-cache-dtype", "fp16", "tpot"), "--kv-cache-dtype must be auto or fp8, not 'fp16'"),
        (("no-such-step",), "unknown step 'no-such-step'"),
        (("--kv-cache-dtype",), "--kv-cache-dtype needs a value"),
    ],
)
def test_bad_arguments_are_refused_before_installing(tmp_path, args, message):
    result = _run(*args, tmp_path=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


def test_help_names_the_kv_cache_option():
    result = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--kv-cache-dtype D" in result.stdout and "_fp8" in result.stdout
