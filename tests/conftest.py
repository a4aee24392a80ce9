"""Test configuration shared by every Moira test.

CPU mode (default): the environment is forced to run Triton kernels in the interpreter on
CPU, before anything imports triton, torch or vllm:

    TRITON_INTERPRET=1  CUDA_VISIBLE_DEVICES=""  VLLM_TARGET_DEVICE=cpu

and a test-only fix for the Triton interpreter's bf16 ``tl.dot`` bug (triton issue #11584:
the interpreter multiplies the raw uint16 bit patterns of bf16 operands) is installed.

GPU mode: ``MOIRA_TEST_GPU=1`` leaves CUDA visible and compiles kernels for real. Tests
marked ``@pytest.mark.gpu`` run only in GPU mode with CUDA available; otherwise they are
skipped with a reason (shown by ``-ra``).
"""

from __future__ import annotations

import functools
import os

import pytest

GPU_RUN = os.environ.get("MOIRA_TEST_GPU", "0") == "1"

if not GPU_RUN:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"


def _install_interpreter_bf16_dot_fix() -> bool:
    """Wrap the Triton interpreter's ``create_dot`` so bf16 operands become fp32 first.

    bf16 -> fp32 is exact (bf16 is the top half of an fp32), so the product matches what
    the GPU computes with fp32 accumulation. Returns True when the fix is active.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except Exception:  # triton missing or not importable: nothing to fix
        return False

    builder_cls = getattr(interp, "InterpreterBuilder", None)
    orig = getattr(builder_cls, "create_dot", None)
    handle_cls = getattr(interp, "TensorHandle", None)
    if orig is None or handle_cls is None:
        return False
    if getattr(orig, "_moira_bf16_fix", False):
        return True

    def to_fp32(h):
        dtype = getattr(h, "dtype", None)
        scalar = getattr(dtype, "scalar", dtype)
        if scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).astype(np.uint32) << np.uint32(16)
        return handle_cls(bits.view(np.float32), tl.float32)

    @functools.wraps(orig)
    def create_dot(self, *args, **kwargs):
        args = list(args)
        for i in range(min(2, len(args))):  # (a, b, d, ...) in every known signature
            args[i] = to_fp32(args[i])
        for key in ("a", "b", "lhs", "rhs"):
            if key in kwargs:
                kwargs[key] = to_fp32(kwargs[key])
        return orig(self, *args, **kwargs)

    create_dot._moira_bf16_fix = True  # type: ignore[attr-defined]
    create_dot._moira_orig = orig  # type: ignore[attr-defined]
    builder_cls.create_dot = create_dot
    return True


INTERPRETER_BF16_DOT_FIX = (
    _install_interpreter_bf16_dot_fix() if os.environ.get("TRITON_INTERPRET") == "1" else False
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper GPU (run on the H200)")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    if not GPU_RUN:
        reason = "gpu test: set MOIRA_TEST_GPU=1 on a CUDA (Hopper) machine to run it"
    elif not _cuda_available():
        reason = "gpu test: MOIRA_TEST_GPU=1 but torch.cuda.is_available() is False"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    mode = "GPU (MOIRA_TEST_GPU=1)" if GPU_RUN else "CPU (TRITON_INTERPRET=1)"
    return f"moira: {mode}; interpreter bf16 dot fix: {INTERPRETER_BF16_DOT_FIX}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Llama config directory for vLLM configs built on the CPU (no weights)."""
    from tests.v1.attention.moira_backend_utils import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture()
def clean_moira_env(monkeypatch):
    """No MOIRA_* option or VLLM_ATTENTION_BACKEND from the caller's environment."""
    for name in list(os.environ):
        if name.startswith("MOIRA_") or name == "VLLM_ATTENTION_BACKEND":
            monkeypatch.delenv(name)
