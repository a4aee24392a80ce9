"""Tests of build.sh: the patch series against clean vLLM 0.30.0, failure reporting, and
idempotent builds into a vllm package directory (``--target-vllm``)."""

from __future__ import annotations

import difflib
import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build.sh"
VLLM_VERSION = "0.30.0"
REGISTRY = "vllm/v1/attention/backends/registry.py"


def run_build(*args: str, env: dict | None = None, check: bool = False):
    full_env = dict(os.environ)
    full_env.pop("MOIRA_PATCH_TOOL", None)
    full_env.update(env or {})
    proc = subprocess.run(
        ["bash", str(BUILD), *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"build.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="session")
def sdist() -> Path:
    """The vLLM 0.30.0 sdist, downloaded once into .cache/ (a failure to fetch fails)."""
    proc = run_build("--fetch-sdist", check=True)
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.is_file(), proc.stdout + proc.stderr
    return path


@pytest.fixture(scope="session")
def clean_src(sdist: Path, tmp_path_factory) -> Path:
    """Extracted clean vLLM 0.30.0 source tree (read-only use)."""
    dest = tmp_path_factory.mktemp("vllm-src")
    with tarfile.open(sdist) as tf:
        members = [
            m
            for m in tf.getmembers()
            if m.name.startswith(f"vllm-{VLLM_VERSION}/vllm/") or m.name.endswith("PKG-INFO")
        ]
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members=members, filter="data")
        else:  # Python < 3.11.4
            tf.extractall(dest, members=members)
    tree = dest / f"vllm-{VLLM_VERSION}"
    assert (tree / "vllm" / "_version.py").is_file()
    return tree


@pytest.fixture()
def fake_site(clean_src: Path, tmp_path: Path) -> Path:
    """A writable copy of a stock vllm package dir, like <site-packages>/vllm."""
    site = tmp_path / "site"
    shutil.copytree(clean_src / "vllm", site / "vllm")
    return site / "vllm"


def tree_digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def make_patch(rel: str, old: str | None, new: str) -> str:
    old_lines = [] if old is None else old.splitlines(keepends=True)
    fromfile = "/dev/null" if old is None else f"a/{rel}"
    diff = difflib.unified_diff(old_lines, new.splitlines(keepends=True), fromfile, f"b/{rel}")
    return "".join(diff)


def synthetic_series(src: Path, dest: Path) -> list[str]:
    """Two patches like the real ones: edit registry.py, add a new module."""
    dest.mkdir(parents=True, exist_ok=True)
    reg = (src / REGISTRY).read_text()
    anchor = "    CUSTOM = None\n"
    assert anchor in reg
    new_reg = reg.replace(anchor, '    MOIRA_TEST = "vllm.v1.attention.backends.x.Y"\n' + anchor, 1)
    (dest / "0001-registry.patch").write_text(make_patch(REGISTRY, reg, new_reg))
    (dest / "0002-new-module.patch").write_text(
        make_patch("vllm/moira_test_new.py", None, "X = 1\n")
    )
    (dest / "series").write_text(
        "# synthetic series\n\n0001-registry.patch\n  0002-new-module.patch   # new file\n"
    )
    return ["0001-registry.patch", "0002-new-module.patch"]


# ----------------------------------------------------------------------------- --check


def test_check_current_series_applies_to_clean_vllm(sdist: Path):
    proc = run_build("--check", env={"MOIRA_VLLM_SDIST": str(sdist)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: OK" in proc.stdout
    series = ROOT / "patches" / "series"
    if series.is_file():
        for line in series.read_text().splitlines():
            name = line.split("#", 1)[0].strip()
            if name:
                assert f"check: {name}: applies" in proc.stdout


def test_check_synthetic_series(clean_src: Path, tmp_path: Path):
    names = synthetic_series(clean_src, tmp_path / "p")
    proc = run_build("--check", "--vllm-src", str(clean_src), "--patches", str(tmp_path / "p"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in names:
        assert f"check: {name}: applies" in proc.stdout
    # --vllm-src is copied, never modified
    assert "MOIRA_TEST" not in (clean_src / REGISTRY).read_text()
    assert not (clean_src / "vllm" / "moira_test_new.py").exists()


TOOLS = pytest.mark.parametrize("tool", ["patch", "git"])


def _tool_env(tool: str) -> dict:
    if shutil.which(tool) is None:
        pytest.fail(f"'{tool}' not on PATH: build.sh needs GNU patch or git")
    return {"MOIRA_PATCH_TOOL": tool}


@TOOLS
def test_check_broken_patch_fails_naming_it(clean_src: Path, tmp_path: Path, tool: str):
    pdir = tmp_path / "p"
    synthetic_series(clean_src, pdir)
    good = (pdir / "0001-registry.patch").read_text()
    broken = good.replace(" CUSTOM = None", " CUSTOM = NotTheContext")
    assert broken != good
    (pdir / "0003-broken.patch").write_text(broken.replace("MOIRA_TEST", "MOIRA_TEST2"))
    (pdir / "series").write_text("0001-registry.patch\n0003-broken.patch\n")
    proc = run_build(
        "--check",
        "--vllm-src",
        str(clean_src),
        "--patches",
        str(pdir),
        env=_tool_env(tool),
    )
    assert proc.returncode != 0
    assert "0003-broken.patch" in proc.stderr
    assert "does not apply" in proc.stderr
    assert "rejected hunks of 0003-broken.patch" in proc.stderr  # the .rej is shown
    assert "check: 0001-registry.patch: applies" in proc.stdout


def test_check_sequential_dependency(clean_src: Path, tmp_path: Path):
    """A patch on top of an earlier one applies only if applied in order."""
    pdir = tmp_path / "p"
    synthetic_series(clean_src, pdir)
    (pdir / "0003-on-top.patch").write_text(
        make_patch("vllm/moira_test_new.py", "X = 1\n", "X = 2\n")
    )
    (pdir / "series").write_text("0002-new-module.patch\n0003-on-top.patch\n")
    proc = run_build("--check", "--vllm-src", str(clean_src), "--patches", str(pdir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (pdir / "series").write_text("0003-on-top.patch\n0002-new-module.patch\n")
    proc = run_build("--check", "--vllm-src", str(clean_src), "--patches", str(pdir))
    assert proc.returncode != 0
    assert "0003-on-top.patch" in proc.stderr


def test_check_empty_series_applies_nothing(clean_src: Path, tmp_path: Path):
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "series").write_text("# nothing yet\n\n")
    proc = run_build("--check", "--vllm-src", str(clean_src), "--patches", str(empty))
    assert proc.returncode == 0, proc.stderr
    assert "nothing to apply" in proc.stdout


@pytest.mark.parametrize("mode", [[], ["--check"]], ids=["build", "check"])
def test_mistyped_patch_directory_fails_naming_the_option(tmp_path: Path, mode: list[str]):
    """A patch directory that does not exist, or has no series, is an error (it once built
    nothing and reported "already the Moira build"); nothing is touched before the check."""
    missing = tmp_path / "nonexistent"
    proc = run_build(*mode, "--patches", str(missing))
    assert proc.returncode != 0
    assert f"--patches {missing}: no such directory" in proc.stderr
    assert "already the Moira build" not in proc.stdout

    no_series = tmp_path / "no-series"
    no_series.mkdir()
    proc = run_build(*mode, "--patches", str(no_series))
    assert proc.returncode != 0
    assert "no 'series' file" in proc.stderr

    proc = run_build(*mode, env={"MOIRA_PATCHES_DIR": str(missing)})
    assert proc.returncode != 0
    assert f"MOIRA_PATCHES_DIR {missing}: no such directory" in proc.stderr


# ----------------------------------------------------------------------------- build


def overlay_files() -> list[str]:
    base = ROOT / "vllm_moira"
    out = []
    for p in sorted(base.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            rel = str(p.relative_to(base))
            if rel.startswith("v1/"):
                out.append(rel)
    return out


def top_level_modules() -> list[str]:
    """The package's own modules (plugin entry point...), never copied into vLLM."""
    return sorted(p.name for p in (ROOT / "vllm_moira").glob("*.py"))


def _assert_overlay_installed(target: Path):
    for rel in overlay_files():
        dest = target / rel
        assert dest.is_file(), f"overlay file {rel} not installed"
        if Path(rel).name != "__init__.py":
            assert dest.read_bytes() == (ROOT / "vllm_moira" / rel).read_bytes(), rel
    assert not (target / "vllm_moira").exists()
    for name in top_level_modules():
        if name != "__init__.py":
            assert not (target / name).exists(), f"top-level module {name} copied into vllm/"


def test_build_current_series_twice_is_idempotent(fake_site: Path):
    stock_init = (fake_site / "v1" / "__init__.py").read_bytes()
    first = run_build("--target-vllm", str(fake_site), check=True)
    digest1 = tree_digest(fake_site)
    second = run_build("--target-vllm", str(fake_site), check=True)
    digest2 = tree_digest(fake_site)
    assert digest1 == digest2
    assert "patches applied 0" in second.stdout
    assert "overlay files installed 0" in second.stdout
    assert "no changes" in second.stdout
    assert ": applied" not in second.stdout
    _assert_overlay_installed(fake_site)
    # vllm's own __init__.py files are never overwritten
    assert (fake_site / "v1" / "__init__.py").read_bytes() == stock_init
    assert "summary:" in first.stdout


@TOOLS
def test_build_synthetic_series_twice_is_idempotent(fake_site: Path, tmp_path: Path, tool: str):
    names = synthetic_series(fake_site.parent, tmp_path / "p")
    before = tree_digest(fake_site)
    env = _tool_env(tool)
    first = run_build("--target-vllm", str(fake_site), "--patches", str(tmp_path / "p"), env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    for name in names:
        assert f"patch {name}: applied" in first.stdout
    digest1 = tree_digest(fake_site)
    assert digest1 != before
    assert 'MOIRA_TEST = "' in (fake_site / "v1/attention/backends/registry.py").read_text()
    assert (fake_site / "moira_test_new.py").read_text() == "X = 1\n"
    second = run_build("--target-vllm", str(fake_site), "--patches", str(tmp_path / "p"), env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    for name in names:
        assert f"patch {name}: already applied, skipped" in second.stdout
    assert "no changes" in second.stdout
    assert tree_digest(fake_site) == digest1
    assert not list(fake_site.rglob("*.orig")) and not list(fake_site.rglob("*.rej"))
    _assert_overlay_installed(fake_site)


@TOOLS
def test_build_broken_patch_fails_with_rejects(fake_site: Path, tmp_path: Path, tool: str):
    pdir = tmp_path / "p"
    pdir.mkdir()
    reg = (fake_site / "v1/attention/backends/registry.py").read_text()
    wrong = reg.replace("    CUSTOM = None\n", "    CUSTOM = Missing\n", 1)
    (pdir / "0001-bad.patch").write_text(
        make_patch(REGISTRY, wrong, wrong.replace("Missing", "Other"))
    )
    (pdir / "series").write_text("0001-bad.patch\n")
    proc = run_build("--target-vllm", str(fake_site), "--patches", str(pdir), env=_tool_env(tool))
    assert proc.returncode != 0
    assert "0001-bad.patch does not apply" in proc.stderr
    assert "CUSTOM = Missing" in proc.stderr  # rejected hunk shown


def test_build_refuses_wrong_vllm_version(fake_site: Path):
    vf = fake_site / "_version.py"
    vf.write_text(vf.read_text().replace("'0.30.0'", "'0.29.9'"))
    proc = run_build("--target-vllm", str(fake_site))
    assert proc.returncode != 0
    assert "need 0.30.0" in proc.stderr


def test_help():
    proc = run_build("--help", check=True)
    for opt in (
        "--use-active-env",
        "--check",
        "--vllm-src",
        "--target-vllm",
        "--patches",
    ):
        assert opt in proc.stdout


def test_build_follows_edited_series(fake_site: Path, tmp_path: Path):
    """An edited/dropped patch is reverted via the recorded series, then the new one applied."""
    pdir = tmp_path / "p"
    synthetic_series(fake_site.parent, pdir)
    stock_registry = (fake_site / "v1/attention/backends/registry.py").read_bytes()
    run_build("--target-vllm", str(fake_site), "--patches", str(pdir), check=True)
    (pdir / "0002-new-module.patch").write_text(
        make_patch("vllm/moira_test_new.py", None, "X = 2\n")
    )
    proc = run_build("--target-vllm", str(fake_site), "--patches", str(pdir), check=True)
    assert "reverted" in proc.stdout
    assert (fake_site / "moira_test_new.py").read_text() == "X = 2\n"
    # drop the registry patch: the file goes back to stock
    (pdir / "series").write_text("0002-new-module.patch\n")
    run_build("--target-vllm", str(fake_site), "--patches", str(pdir), check=True)
    assert (fake_site / "v1/attention/backends/registry.py").read_bytes() == stock_registry
    assert (fake_site / "moira_test_new.py").read_text() == "X = 2\n"


def test_build_over_reinstalled_vllm_with_leftover_files(fake_site: Path, clean_src: Path):
    """A stock vLLM re-installed over a Moira build (pip --force-reinstall, a re-extracted
    bundle) restores vLLM's files but leaves the files that patches created: the build must
    still apply the series and end with the same tree."""
    created = [
        line.split()[1][2:]
        for p in (ROOT / "patches").glob("*.patch")
        for prev, line in zip(p.read_text().splitlines(), p.read_text().splitlines()[1:])
        if prev.startswith("--- /dev/null") and line.startswith("+++ b/")
    ]
    assert created, "the series creates no file: this test would not test anything"
    run_build("--target-vllm", str(fake_site), check=True)
    built = tree_digest(fake_site)
    shutil.copytree(clean_src / "vllm", fake_site, dirs_exist_ok=True)
    assert all((fake_site.parent / rel).exists() for rel in created)
    again = run_build("--target-vllm", str(fake_site))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "over files left by an earlier build" in again.stdout
    assert tree_digest(fake_site) == built
