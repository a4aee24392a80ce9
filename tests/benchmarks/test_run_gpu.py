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


def test_help_names_the_kv_cache_option_and_the_steps():
    result = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--kv-cache-dtype D" in result.stdout and "_fp8" in result.stdout
    assert "estimate-sweep[:ESTIMATORS]" in result.stdout
    assert "refine-sweep[:SHAPES]" in result.stdout


@pytest.mark.parametrize(
    "step", ["accuracy-suite", "tpot-real:8192x4", "tpot-real-refine:8192x4", "serving-real:1"]
)
def test_real_model_steps_need_the_model_and_text_before_installing(tmp_path, step):
    result = _run(
        "--acc-prompts", str(tmp_path / "missing.json.gz"),
        "--acc-model", str(tmp_path / "missing-model"),
        step,
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "need --acc-prompts FILE" in result.stderr and "missing-model" in result.stderr
    assert not (tmp_path / "out").exists()


def test_real_model_steps_pass_the_check_when_the_files_exist(tmp_path):
    prompts = tmp_path / "prompts.json.gz"
    prompts.write_bytes(b"")
    (tmp_path / "model").mkdir()
    result = _run(
        "--acc-prompts", str(prompts), "--acc-model", str(tmp_path / "model"),
        "--no-install", "--prefix", str(tmp_path / "no-prefix"), "tpot-real",
        tmp_path=tmp_path,
    )  # fmt: skip
    # Past the model check, it stops at the missing install instead.
    assert result.returncode == 1
    assert "env.sh not found" in result.stderr


@pytest.mark.parametrize(
    "step",
    [
        "estimate-sweep",
        "estimate-sweep:int8:mvar,int4:mvar_top8",
        "refine-sweep:4x131072",
        "tpot-refine:130048x4,8192x32",
    ],
)
def test_estimate_sweep_is_a_known_step(tmp_path, step):
    result = _run("--no-install", "--prefix", str(tmp_path / "no-prefix"), step, tmp_path=tmp_path)
    # A known step gets past the step check and stops at the missing install instead.
    assert result.returncode == 1
    assert "unknown step" not in result.stderr and "env.sh not found" in result.stderr
