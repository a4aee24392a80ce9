#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Run vLLM 0.30.0's own attention-backend tests against the installed Moira build.

An upstream PR that adds a backend is reviewed against vLLM's tests: the reviewer adds it to
``BACKENDS_TO_TEST`` in ``tests/v1/attention/test_attention_backends.py`` and runs them. This
script does exactly that, offline, with the test files of the vLLM sdist left as vLLM ships
them except for the series' test patch (``patches/`` entries that change ``tests/`` only):

    # where the sdist is (CPU machine; build.sh --fetch-sdist caches it):
    python tests/upstream/run_vllm_tests.py stage            # -> .stage/vllm-tests/
    # on the GPU host, after `bash build.sh --use-active-env`:
    python tests/upstream/run_vllm_tests.py run --out DIR [--gamma 1] [-- PYTEST_ARGS...]

``run`` copies the staged files into a scratch tree, applies the series' test patches, and
runs pytest there with:

- a Hugging Face cache holding only ``config.json`` of ``meta-llama/Meta-Llama-3-8B`` (the
  model the tests name; they read its geometry, never its weights), ``HF_HUB_OFFLINE=1``;
- ``--noconftest`` plus ``tests/upstream/vllm_fixtures.py``: vLLM's top-level ``conftest.py``
  imports packages and fetches assets an offline host does not have; the test files use one
  of its fixtures (``default_vllm_config``), which the plugin provides with the same body;
- ``MOIRA_GAMMA`` (default 1: every page read, so MOIRA must match the SDPA reference within
  the tests' own tolerances; below 1 the result is a measurement, not a pass criterion).

The selection (``--tests``) defaults to the backend-generic files that apply to a decode
backend; ``docs/upstream.md`` lists which apply and why the others do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.30.0"
STAGE_DIR = ROOT / ".stage" / "vllm-tests"
SDIST_CACHE = ROOT / ".cache" / "sdist" / f"vllm-{VLLM_VERSION}.tar.gz"
PATCH_DIR = ROOT / "patches"

# Files of the sdist's tests/ tree the selected tests import (paths relative to tests/).
STAGED_FILES = (
    "__init__.py",
    "v1/__init__.py",
    "v1/attention/__init__.py",
    "v1/attention/utils.py",
    "v1/attention/test_attention_backends.py",
    "v1/attention/test_attention_splitting.py",
    "v1/attention/test_batch_reordering.py",
)

# The backend-generic tests that apply to a decode backend (MOIRA in BACKENDS_TO_TEST), and
# vLLM's own split/reorder logic that MOIRA's builder relies on. tests/v1/cudagraph/ is not
# run: its dispatch tests import vLLM's tests/utils.py (server and client helpers that need
# packages an offline host lacks) and check vLLM's dispatcher on mock configs, whatever the
# backend; its mode test loads Qwen/Qwen2-1.5B-Instruct from the hub.
DEFAULT_TESTS = (
    "tests/v1/attention/test_attention_backends.py::test_causal_backend_correctness",
    "tests/v1/attention/test_attention_splitting.py",
    "tests/v1/attention/test_batch_reordering.py",
)

TEST_MODEL = "meta-llama/Meta-Llama-3-8B"
# Meta-Llama-3-8B's published config.json (geometry only; no weights are read).
TEST_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "initializer_range": 0.02,
}


def series_test_patches(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """The series' patches that change vLLM's tests/ only, in series order."""
    names = []
    for line in (patch_dir / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    out = []
    for name in names:
        text = (patch_dir / name).read_text()
        targets = [ln[6:].split()[0] for ln in text.splitlines() if ln.startswith("+++ b/")]
        if targets and all(t.startswith("tests/") for t in targets):
            out.append(patch_dir / name)
    return out


def stage(sdist: Path, dest: Path) -> None:
    """Copy the selected test files, as vLLM ships them, out of the sdist into ``dest``."""
    if not sdist.is_file():
        raise SystemExit(
            f"no vLLM sdist at {sdist}: run `bash build.sh --fetch-sdist` or pass --sdist FILE"
        )
    prefix = f"vllm-{VLLM_VERSION}/tests/"
    wanted = {prefix + f: f for f in STAGED_FILES}
    if dest.exists():
        shutil.rmtree(dest)
    found = set()
    with tarfile.open(sdist) as tar:
        for member in tar:
            rel = wanted.get(member.name)
            if rel is None or not member.isfile():
                continue
            target = dest / "tests" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            target.write_bytes(src.read())
            found.add(rel)
    for rel in STAGED_FILES:  # package markers the sdist may lack
        if rel not in found and rel.endswith("__init__.py"):
            (dest / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / "tests" / rel).write_text("")
            found.add(rel)
    missing = sorted(set(STAGED_FILES) - found)
    if missing:
        raise SystemExit(f"the sdist lacks {missing}")
    print(f"[run_vllm_tests] staged {len(found)} files of vLLM {VLLM_VERSION}'s tests in {dest}")


def apply_test_patches(tree: Path, patches: list[Path]) -> None:
    for patch in patches:
        subprocess.run(
            [
                "patch",
                "-p1",
                "--fuzz=0",
                "-N",
                "--no-backup-if-mismatch",
                "-s",
                "-d",
                str(tree),
                "-i",
                str(patch),
            ],
            check=True,
        )
        print(f"[run_vllm_tests] applied {patch.name}")


def write_hf_cache(hf_home: Path) -> None:
    snapshot = "0" * 40
    repo = hf_home / "hub" / ("models--" + TEST_MODEL.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot)
    (repo / "snapshots" / snapshot).mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / snapshot / "config.json").write_text(json.dumps(TEST_MODEL_CONFIG))


def run(args: argparse.Namespace) -> int:
    staged = Path(args.staged)
    if not (staged / "tests" / "v1" / "attention" / "test_attention_backends.py").is_file():
        raise SystemExit(f"no staged vLLM tests in {staged}: run `{Path(__file__).name} stage`")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moira-vllm-tests."))
    shutil.copytree(staged / "tests", work / "tests")
    apply_test_patches(work, series_test_patches())
    write_hf_cache(work / "hf")
    report = out / f"vllm_tests_gamma{args.gamma}.jsonl"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        HF_HOME=str(work / "hf"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MOIRA_GAMMA=str(args.gamma),
        MOIRA_VLLM_TESTS_REPORT=str(report),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(work), str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p
        ),
    )
    cmd = [
        sys.executable, "-m", "pytest", "--noconftest", "-p", "vllm_fixtures",
        "-o", "addopts=", "-rA", "-q", "--rootdir", str(work),
        "--junitxml", str(out / f"vllm_tests_gamma{args.gamma}.xml"),
        *(args.tests or DEFAULT_TESTS), *args.pytest_args,
    ]  # fmt: skip
    print("[run_vllm_tests] " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=work, env=env).returncode
    summarize(report)
    return rc


def summarize(report: Path) -> dict[str, dict[str, float]]:
    """Per backend: comparisons made, how many were within the test's tolerance, and the
    largest absolute difference from the reference (printed; the JSON lines keep each case)."""
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = table.setdefault(row["backend"], {"cases": 0, "within_tol": 0, "max_abs": 0.0})
        entry["cases"] += 1
        entry["within_tol"] += int(bool(row.get("within_tolerance")))
        entry["max_abs"] = max(entry["max_abs"], row["max_abs"])
    for backend, entry in sorted(table.items()):
        print(f"[run_vllm_tests] {backend or '?'}: {entry['within_tol']} of {entry['cases']} "
              f"within the test's tolerance, max |diff| {entry['max_abs']:.3g}")  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_stage = sub.add_parser("stage", help="copy vLLM's test files out of the sdist")
    p_stage.add_argument("--sdist", default=str(SDIST_CACHE), help="vllm-0.30.0.tar.gz")
    p_stage.add_argument("--dest", default=str(STAGE_DIR))
    p_run = sub.add_parser("run", help="run the staged tests against the installed vLLM")
    p_run.add_argument("--staged", default=str(STAGE_DIR))
    p_run.add_argument("--out", required=True, help="folder for the junit XML")
    p_run.add_argument("--gamma", default="1", help="MOIRA_GAMMA for the run (default 1)")
    p_run.add_argument("--tests", nargs="*", help=f"pytest node ids (default: {DEFAULT_TESTS})")
    p_run.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    if args.cmd == "stage":
        stage(Path(args.sdist), Path(args.dest))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
