# SPDX-License-Identifier: Apache-2.0
"""benchmarks/run_gpu.sh: argument checks that fail before anything is installed, and the
TPOT steps' engine wiring with a stand-in ``python`` (CPU)."""

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


def _stand_in_python(tmp_path: Path, log: str = 'echo "$*"') -> tuple[Path, Path]:
    """A stand-in ``python`` on the PATH (through the prefix's env.sh) that appends what
    the bash command ``log`` prints to calls.log and writes its --out record, plus the model
    and prompts the real-model steps check for. Returns (prefix, calls.log)."""
    bin_dir, prefix = tmp_path / "bin", tmp_path / "prefix"
    bin_dir.mkdir()
    prefix.mkdir()
    calls = tmp_path / "calls.log"
    fake = bin_dir / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f"{log} >> {calls}\n"
        'out=""; prev=""\n'
        'for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done\n'
        '[[ -n $out ]] && echo "{}" > "$out"\n'
    )
    fake.chmod(0o755)
    (prefix / "env.sh").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (tmp_path / "p.json.gz").write_bytes(b"")
    (tmp_path / "model").mkdir()
    return prefix, calls


@pytest.mark.parametrize(
    "args, message",
    [
        (("--kv-cache-dtype", "fp16", "tpot"), "--kv-cache-dtype must be auto or fp8, not 'fp16'"),
        (("no-such-step",), "unknown step 'no-such-step'"),
        (("--tpot-arms", "moira wide", "tpot"), "--tpot-arms takes moira, mvar, int4, int8"),
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
    assert "attend-sweep[:SHAPES]" in result.stdout


@pytest.mark.parametrize(
    "step", ["accuracy-suite", "tpot-real:8192x4", "tpot-b1:2", "serving-real:1", "plugin-check"]
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
        "attend-sweep:4x131072",
    ],
)
def test_estimate_sweep_is_a_known_step(tmp_path, step):
    result = _run("--no-install", "--prefix", str(tmp_path / "no-prefix"), step, tmp_path=tmp_path)
    # A known step gets past the step check and stops at the missing install instead.
    assert result.returncode == 1
    assert "unknown step" not in result.stderr and "env.sh not found" in result.stderr


def test_tpot_steps_run_dense_then_each_moira_mode_then_merge(tmp_path):
    # The stand-in logs each command with its MOIRA_* mode and writes the --out record,
    # so every merge finds its parts.
    prefix, calls = _stand_in_python(
        tmp_path, 'echo "${MOIRA_SUMMARY_DTYPE:-${MOIRA_ESTIMATOR:-env}} $*"'
    )
    result = _run(
        "--no-install", "--prefix", str(prefix),
        "--acc-model", str(tmp_path / "model"), "--acc-prompts", str(tmp_path / "p.json.gz"),
        "--tpot-arms", "moira mvar int4", "tpot:8192x4", "tpot-real:8192x4",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = calls.read_text().splitlines()
    out = tmp_path / "out"

    def engine(line: str) -> tuple[str, str, str]:
        words = line.split()
        backend = words[words.index("--backend") + 1] if "--backend" in words else "merge"
        return words[0], backend, Path(words[words.index("--out") + 1]).name

    assert [engine(line) for line in lines] == [
        ("env", "FLASH_ATTN", "tpot_dense.json"),
        ("env", "MOIRA", "tpot_moira.json"),
        ("env", "merge", "tpot.json"),
        ("env", "FLASH_ATTN", "tpot_real_dense.json"),
        ("env", "MOIRA", "tpot_real_moira.json"),
        ("mvar", "MOIRA", "tpot_real_mvar.json"),
        ("int4", "MOIRA", "tpot_real_int4.json"),
        ("env", "merge", "tpot_real.json"),
    ]
    # The real-text MOIRA engines run the coverage rule at the default γ only, on the
    # given shapes and text; the dense engine runs neither MOIRA-only argument.
    for line in lines[4:7]:
        assert "--gammas 0.98 --no-fixed" in line and "--shapes 8192x4" in line
        assert f"--prompts {tmp_path / 'p.json.gz'}" in line
    assert "--gammas" not in lines[3]
    assert f"--merge {out}/tpot_real_dense.json {out}/tpot_real_moira.json" in lines[7]


def test_tpot_b1_alternates_dense_and_the_default_per_round(tmp_path):
    prefix, calls = _stand_in_python(tmp_path)
    result = _run(
        "--no-install", "--prefix", str(prefix),
        "--acc-model", str(tmp_path / "model"), "--acc-prompts", str(tmp_path / "p.json.gz"),
        "tpot-b1:2",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = calls.read_text().splitlines()
    outs = [Path(line.split()[line.split().index("--out") + 1]).name for line in lines]
    expected = [f"tpot_b1_r{r}{part}.json" for r in (1, 2) for part in ("_dense", "_moira", "")]
    assert outs == expected
    assert all("--shapes 31744x1" in line for line in lines if "--merge" not in line)
