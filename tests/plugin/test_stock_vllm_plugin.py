"""Plugin mode on the STOCK vLLM 0.30.0: the project's wheel, installed next to an
unpatched vLLM, registers Moira through its entry point, and vLLM's own registry,
config parser and CUDA selector resolve CUSTOM to it.

The stock package comes from conftest.py (``stock_vllm``); the wheel goes into a
separate ``--target`` directory; a subprocess sees both first on its path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("stock_vllm_probe.py")
BACKEND_CLASS = "vllm_moira.v1.attention.backends.moira.MoiraBackend"


@pytest.fixture(scope="module")
def moira_wheel_site(tmp_path_factory) -> Path:
    """This project installed with pip (a wheel build) into a throwaway target."""
    work = tmp_path_factory.mktemp("moira-wheel")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "vllm_moira", src / "vllm_moira", ignore=shutil.ignore_patterns("__pycache__")
    )
    site = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(site.glob("vllm_moira-*.dist-info/entry_points.txt"))
    return site


def _probe(stock_vllm: Path, site: Path, **env_extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VLLM_ATTENTION_BACKEND", "VLLM_PLUGINS")
        and not k.startswith("MOIRA_")
    }
    env.update(
        PYTHONPATH=f"{stock_vllm}{os.pathsep}{site}",
        VLLM_TARGET_DEVICE="cpu",
        CUDA_VISIBLE_DEVICES="",
        TRITON_INTERPRET="1",
        **env_extra,
    )
    proc = subprocess.run(
        [sys.executable, str(PROBE)],
        cwd=site.parent,  # not the checkout: vllm_moira must come from the wheel
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["log"] = proc.stdout + proc.stderr  # vLLM logs to stdout by default
    assert out["vllm_file"].startswith(str(stock_vllm)), out["vllm_file"]
    assert out["vllm_moira_file"].startswith(str(site)), out["vllm_moira_file"]
    assert out["enum_has_moira"] is False
    return out


@pytest.fixture(scope="module")
def probe(stock_vllm, moira_wheel_site, tmp_path_factory) -> dict:
    from tests.v1.attention.moira_backend_utils import write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return _probe(stock_vllm, moira_wheel_site, PROBE_TINY_MODEL=model)


def test_stock_vllm_resolves_custom_to_moira(probe, moira_wheel_site):
    out = probe
    assert out["custom_registered_before"] is False
    # The entry point registered the installed package's class ...
    assert out["custom_path"] == BACKEND_CLASS
    assert "Moira registered as attention backend CUSTOM" in out["log"]
    # ... which --attention-backend custom and the CUDA selector resolve to.
    assert out["config_backend"] == "CUSTOM"
    assert out["selected_path"] == BACKEND_CLASS
    assert out["selected_module_file"].startswith(str(moira_wheel_site))
    assert out["get_name"] == "CUSTOM"
    assert out["name_round_trip"] is True
    # Moira's own checks still run inside the selector.
    assert "head_size=96 is not supported by MOIRA" in out["selector_refusal"]


def test_stock_vllm_metadata_without_request_extras(probe):
    # Stock metadata has no per-request extras; a mixed step's prefill rows
    # are sliced from it all the same.
    assert probe["stock_metadata_has_extras"] is False
    assert probe["sliced_prefill"] == [1, 5, [5]]


def test_stock_vllm_pads_pages_for_the_summaries(probe):
    out = probe
    plain, padded = out["page_bytes"]
    # 2 KV heads x 64 tokens x (K + V) x 64 x bf16; default summaries: int8,
    # mvar_top8 (10 slots + 1 row of scales) x 64 bytes per KV head.
    assert plain == 2 * 64 * 128 * 2
    assert padded == plain + 2 * 11 * 64
    assert "needs --block-size 64" in out["block_size_refusal"]


def test_stock_vllm_refuses_what_needs_the_patches(probe):
    out = probe
    (no_guard,) = out["reasons_without_guard"]
    assert "--logits-processors vllm_moira.request_guard:MoiraRequestGuard" in no_guard
    assert "patched build" in no_guard
    assert out["reasons_with_guard"] == []
    refusal = out["gamma_refusal"]
    assert refusal["parameter"] == "moira_gamma"
    assert "patched build" in refusal["message"]
    # An engine configured as documented passes Moira's checks; without the
    # guard it is refused, naming the flag.
    assert out["engine_backend"] == "CUSTOM"
    assert out["guarded_v2_runner"] is False  # custom logits processors: V1 runner
    assert "--logits-processors vllm_moira.request_guard" in out["unguarded_engine_refusal"]


@pytest.mark.parametrize("value", ["MOIRA", "custom"])
def test_stock_vllm_refuses_the_env_var(stock_vllm, moira_wheel_site, value):
    out = _probe(stock_vllm, moira_wheel_site, VLLM_ATTENTION_BACKEND=value)
    assert out["plugin_error"].startswith("ValueError: VLLM_ATTENTION_BACKEND=")
    assert "--attention-backend CUSTOM" in out["plugin_error"]
