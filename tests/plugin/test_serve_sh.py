"""scripts/serve.sh picks plugin mode for a stock vLLM 0.30.0 in python3 and the
patched build otherwise. python3 is a stand-in on PATH: the venv's interpreter
(with the stock package first on its path, or not), except that it prints the
pip and vllm commands instead of running them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve(tmp_path: Path, pythonpath: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "python3"
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -m && ( "$2" == pip || "$2" == vllm.entrypoints.cli.main ) ]]; then\n'
        '    echo "RAN $*"; exit 0\n'
        "fi\n"
        f'PYTHONPATH="{pythonpath}" exec "{sys.executable}" "$@"\n'
    )
    stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOIRA_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", MOIRA_SKIP_GPU_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serve.sh"), "/models/m", "--max-model-len", "4096"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_stock_vllm_is_served_as_a_plugin(tmp_path, stock_vllm):
    out = _serve(tmp_path, str(stock_vllm)).stdout
    assert f"RAN -m pip install -q --no-deps --force-reinstall --no-build-isolation {ROOT}" in out
    assert (
        "RAN -m vllm.entrypoints.cli.main serve /models/m --attention-backend=CUSTOM "
        "--logits-processors=vllm_moira.request_guard:MoiraRequestGuard --max-model-len 4096"
    ) in out
    assert "build.sh" not in out


def test_patched_vllm_is_served_as_moira(tmp_path):
    out = _serve(tmp_path, "").stdout
    assert "RAN -m pip" not in out
    assert "[build.sh]" in out  # refreshed in place (--use-active-env), idempotent
    assert "RAN -m vllm.entrypoints.cli.main serve /models/m --max-model-len 4096" in out
    assert "VLLM_ATTENTION_BACKEND=MOIRA" in out
