"""Fixtures of the plugin-mode tests: the stock vLLM 0.30.0 package.

The test venv holds the patched build, so the stock package is rebuilt from it:
a hard-linked copy of the installed ``vllm`` in which every file the patch series
touches is replaced by the sdist's original (the sdist's Python files are the
wheel's), the files the series adds are removed, and the overlay files that
build.sh copied in are removed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.30.0"


def _series_files() -> tuple[set[str], set[str]]:
    """(files under vllm/ the series modifies, files it creates), package-relative."""
    modified, created = set(), set()
    for name in (ROOT / "patches" / "series").read_text().split():
        text = (ROOT / "patches" / name).read_text()
        for old, new in re.findall(r"^--- (\S+).*\n\+\+\+ (\S+)", text, flags=re.M):
            if not new.startswith("b/vllm/"):
                continue
            rel = new[len("b/vllm/") :]
            (created if old == "/dev/null" else modified).add(rel)
    return modified, created


def _sdist() -> Path:
    proc = subprocess.run(
        ["bash", str(ROOT / "build.sh"), "--fetch-sdist"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.is_file(), proc.stdout
    return path


@pytest.fixture(scope="session")
def stock_vllm(tmp_path_factory) -> Path:
    """A directory holding the stock ``vllm`` package (no patch, no overlay)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin
    installed = Path(spec.origin).parent
    root = tmp_path_factory.mktemp("stock")
    stock = root / "vllm"
    try:
        shutil.copytree(
            installed, stock, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__")
        )
    except OSError:  # another filesystem: plain copies
        shutil.rmtree(stock, ignore_errors=True)
        shutil.copytree(installed, stock, ignore=shutil.ignore_patterns("__pycache__"))
    modified, created = _series_files()
    assert "v1/attention/backends/registry.py" in modified
    prefix = f"vllm-{VLLM_VERSION}/vllm/"
    with tarfile.open(_sdist()) as tf:
        for rel in sorted(modified):
            member = tf.extractfile(prefix + rel)
            assert member is not None, rel
            target = stock / rel
            target.unlink()  # a new file: the hard-linked original stays as it is
            target.write_bytes(member.read())
    for rel in created:
        (stock / rel).unlink(missing_ok=True)
    overlay = ROOT / "vllm_moira" / "v1"
    for path in overlay.rglob("*.py"):
        if path.name != "__init__.py":
            (stock / "v1" / path.relative_to(overlay)).unlink(missing_ok=True)
    shutil.rmtree(stock / ".moira-build", ignore_errors=True)  # build.sh's record
    registry = (stock / "v1" / "attention" / "backends" / "registry.py").read_text()
    assert "MOIRA" not in registry
    assert not (stock / "v1" / "attention" / "backends" / "moira.py").exists()
    return root
