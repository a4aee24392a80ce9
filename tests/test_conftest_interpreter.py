"""The conftest's Triton-interpreter bf16 ``tl.dot`` fix (triton issue #11584)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter-only test (TRITON_INTERPRET=1, CPU mode)",
)

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

N = 16


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + rows * N + cols)
    b = tl.load(b_ptr + rows * N + cols)
    c = tl.dot(a, b)  # fp32 accumulation
    tl.store(c_ptr + rows * N + cols, c)


def _run(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, N, generator=g).to(dtype)
    b = torch.randn(N, N, generator=g).to(dtype)
    c = torch.empty(N, N, dtype=torch.float32)
    _dot_kernel[(1,)](a, b, c, N=N)
    ref = a.float() @ b.float()
    return c, ref


def test_fix_is_installed():
    from triton.runtime.interpreter import InterpreterBuilder

    assert getattr(InterpreterBuilder.create_dot, "_moira_bf16_fix", False)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_dot_matches_fp32_matmul(seed):
    c, ref = _run(torch.bfloat16, seed)
    torch.testing.assert_close(c, ref, rtol=1e-5, atol=1e-5)


def test_fp16_and_fp32_dot_unaffected():
    for dtype in (torch.float16, torch.float32):
        c, ref = _run(dtype)
        # fp32 operands may go through tf32 on the GPU; the interpreter computes exactly
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-4)


def test_bug_present_without_fix():
    """Documents the upstream bug: the unpatched interpreter gets bf16 dot wrong."""
    from triton.runtime.interpreter import InterpreterBuilder

    fixed = InterpreterBuilder.create_dot
    InterpreterBuilder.create_dot = fixed._moira_orig
    try:
        c, ref = _run(torch.bfloat16)
    finally:
        InterpreterBuilder.create_dot = fixed
    if torch.allclose(c, ref, rtol=1e-3, atol=1e-3):
        pytest.skip(
            "triton's interpreter now handles bf16 dot (issue #11584 fixed upstream): "
            "the conftest fix can be dropped"
        )
    assert not torch.allclose(c, ref, rtol=1e-3, atol=1e-3)
