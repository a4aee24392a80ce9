"""The patch series is PR-ready: order, headers, paths, and applies to v0.30.0 sources.

Applying to a clean tree is also covered by build.sh --check (tests/test_build.py);
here each patch's shape is checked, and the series is applied to the pristine vllm/
files it touches, taken from the installed wheel's RECORD-free copy when the
installed vllm is unpatched, else reverse-applied.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = Path(__file__).resolve().parents[2] / "patches"


def _series() -> list[str]:
    lines = (PATCHES / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_series_lists_every_patch_in_order():
    series = _series()
    assert series == sorted(p.name for p in PATCHES.glob("*.patch"))
    assert [int(name[:4]) for name in series] == list(range(1, len(series) + 1))


@pytest.mark.parametrize("name", _series())
def test_patch_header_is_pr_ready(name):
    text = (PATCHES / name).read_text()
    head, _, diff = text.partition("\n---\n")
    assert re.search(r"^Subject: \[PATCH[^\]]*\] \[\w+\] .{10,}", head, re.M), "Subject"
    body = head.split("Subject:", 1)[1]
    assert len(body.split("\n\n", 1)[1].strip()) > 200, "body must explain why"
    assert re.search(r"^Signed-off-by: .+ <.+@.+>$", head, re.M), "DCO sign-off"
    paths = re.findall(r"^diff --git a/(\S+) b/(\S+)$", diff, re.M)
    assert paths, "no diff"
    for a, b in paths:
        # vllm/ (the package) or tests/ (vLLM's own tests, e.g. MOIRA in their backend list)
        assert a == b and a.startswith(("vllm/", "tests/")), (a, b)


def _installed_series() -> list[str]:
    """The patches build.sh installs: those that change the vllm/ package (a patch of
    vLLM's tests/ alone applies to the source tree: build.sh --check, tests/upstream)."""
    return [n for n in _series() if re.search(r"^\+\+\+ b/vllm/", (PATCHES / n).read_text(), re.M)]


def test_series_applies_in_order_to_installed_sources(tmp_path):
    """Reverse-apply the installed series (newest first) on a copy of the installed,
    patched vllm files, then apply it forward in order: both must succeed cleanly."""
    import vllm

    if shutil.which("patch") is None:
        pytest.fail("GNU patch is required")
    site = Path(vllm.__file__).resolve().parent.parent
    touched = set()
    for name in _installed_series():
        touched |= set(re.findall(r"^diff --git a/(\S+) ", (PATCHES / name).read_text(), re.M))
    for rel in touched:
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if (site / rel).exists():
            shutil.copy2(site / rel, dst)

    def run(name, *extra):
        return subprocess.run(
            [
                "patch",
                "-p1",
                "-s",
                "-f",
                "--no-backup-if-mismatch",
                *extra,
                "-d",
                str(tmp_path),
                "-i",
                str(PATCHES / name),
            ],
            capture_output=True,
            text=True,
        )

    for name in reversed(_installed_series()):
        res = run(name, "-R")
        assert res.returncode == 0, f"reverse {name}: {res.stdout}{res.stderr}"
    for name in _installed_series():
        res = run(name, "--dry-run")
        assert res.returncode == 0, f"{name} does not apply: {res.stdout}{res.stderr}"
        assert run(name).returncode == 0
