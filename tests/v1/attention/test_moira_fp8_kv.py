# SPDX-License-Identifier: Apache-2.0
"""Moira's kernels on an fp8 KV cache (CPU interpreter) against the float32
reference on the dequantized cache.

vLLM's ``--kv-cache-dtype fp8`` stores K / k_scale and V / v_scale as e4m3
with one scale per layer for K and one for V. The kernels read the e4m3
values and the scales; the reference reads the dequantized cache
(``ref.dequantize_kv_cache``), so both compute with the same K and V. The
Triton interpreter loads and converts ``float8e4nv`` itself (Triton 3.6 and
3.9), so these run the kernels' fp8 paths as compiled for the GPU, less the
hardware conversion instruction. The same checks at real shapes, against FA3
on the same fp8 cache, are in ``test_moira_fp8_kv_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import (
    PAGE,
    full_page_slots,
    make_decode_batch,
    make_kv_cache,
)
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Scales as a checkpoint's calibration gives them (amax / 448 of the data):
# not powers of two, so dequantization rounds like it does in serving.
K_SCALE, V_SCALE = 0.0431, 0.0173
# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2  # one bf16 ulp at |x| <= 1, plus fp32 noise


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def _scales() -> dict[str, torch.Tensor]:
    return {"k_scale": torch.tensor([K_SCALE]), "v_scale": torch.tensor([V_SCALE])}


def _fp8_batch(seq_lens, num_kv_heads, group, head_size, layout, estimator,
               summary_dtype="bfloat16", pattern="random", seed=0):  # fmt: skip
    """A decode batch on an fp8 cache, its summaries written by the kernel
    writer from the fp8 cache: (kv8, dequantized fp32 kv, summaries, table,
    seq, query)."""
    kv, _, table, seq, query = make_decode_batch(seq_lens, num_kv_heads, group, head_size,
                                                 layout, estimator, pattern, seed)  # fmt: skip
    kv8 = ref.quantize_kv_cache_fp8(kv, K_SCALE, V_SCALE)
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    summaries = torch.zeros(kv.shape[0], num_kv_heads, rows, head_size, dtype=dtype)
    moira.write_page_summaries(kv8, summaries, full_page_slots(table, seq_lens),
                               _scales()["k_scale"])  # fmt: skip
    return kv8, ref.dequantize_kv_cache(kv8, K_SCALE, V_SCALE), summaries, table, seq, query


def test_quantized_cache_keeps_its_layout_and_dequantizes_exactly():
    # The reference's fp8 write: e4m3 of K / k_scale, V / v_scale (saturated),
    # in the strides of the bf16 view; dequantized back, every value is the
    # e4m3 value times its scale.
    kv = make_kv_cache(3, 2, 64, "token_major", generator=torch.Generator().manual_seed(0))
    kv[0, 0, 0, 0] = 1000.0  # beyond 448 * k_scale: saturates
    kv8 = ref.quantize_kv_cache_fp8(kv, K_SCALE, V_SCALE)
    assert kv8.dtype == torch.float8_e4m3fn and kv8.stride() == kv.stride()
    deq = ref.dequantize_kv_cache(kv8, K_SCALE, V_SCALE)
    assert float(deq[0, 0, 0, 0]) == pytest.approx(448.0 * K_SCALE)
    assert torch.equal(deq[..., :64], kv8[..., :64].float() * K_SCALE)
    assert torch.equal(deq[..., 64:], kv8[..., 64:].float() * V_SCALE)
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of the input.
    rel = (deq[..., 64:] - kv[..., 64:].float()).abs() / kv[..., 64:].float().abs()
    assert float(rel[kv[..., 64:].float().abs() > 0.1].max()) <= 2.0**-4


# --------------------------------------------------------------------------
# Page summaries
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_fp8_writer_summarizes_the_dequantized_keys(layout, head_size):
    seq_lens = [64 * 4 + 9, 64 * 2]
    kv8, deq, summaries, table, _, _ = _fp8_batch(seq_lens, 2, 2, head_size, layout, "mvar")
    blocks = full_page_slots(table, seq_lens) // PAGE
    expected = ref.summarize_pages(deq, blocks)
    got = summaries[blocks].float()
    assert torch.all((got - expected).abs() <= _bf16_ulp(expected) + 1e-6)
    # Pages that did not fill (the partial last page, spare blocks) are untouched.
    others = torch.ones(summaries.shape[0], dtype=torch.bool)
    others[blocks] = False
    assert summaries[others].eq(0).all()


@pytest.mark.parametrize(("estimator", "summary_dtype"),
                         [("mvar_top8", "bfloat16"), ("mvar_top8", "int8")])  # fmt: skip
def test_fp8_writer_stored_keys_are_dequantized_keys(estimator, summary_dtype):
    # mvar_top8: the r keys farthest from the page mean, each the e4m3 key
    # times k_scale (in bf16: its rounding; in int8: the reference's
    # quantization of it within one step), and the bulk's mean and variance.
    seq_lens = [64 * 3, 64 * 2 + 1]
    kv8, deq, summaries, table, _, _ = _fp8_batch(seq_lens, 2, 1, 64, "token_major", estimator,
                                                  summary_dtype)  # fmt: skip
    blocks = full_page_slots(table, seq_lens) // PAGE
    r = moira.estimator_num_top(estimator)
    expected = ref.summarize_pages_top(deq, blocks, r)
    if summary_dtype == "int8":
        q_ref, scale_ref = ref.quantize_summaries_int8(expected)
        q, scales = ref.split_int8_summaries(summaries[blocks])
        assert int((q.int() - q_ref.int()).abs().max()) <= 1
        torch.testing.assert_close(scales, scale_ref, rtol=1e-5, atol=0.0)
        return
    # Every slot within one bf16 step of the fp32 value (the interpreter's
    # fp32 -> bf16 conversion does not round to nearest; the GPU's does, and
    # test_moira_fp8_kv_gpu.py holds the stored keys to the bit there).
    got = summaries[blocks].float()
    assert torch.all((got - expected).abs() <= _bf16_ulp(expected) + 1e-6)


@pytest.mark.parametrize(("estimator", "summary_dtype"),
                         [("mvar", "bfloat16"), ("mvar_top8", "int8")])  # fmt: skip
def test_fp8_estimate_writes_the_pages_that_filled_like_the_writer(estimator, summary_dtype):
    # The decode step's summary write inside Estimate stores the writer's bits
    # on an fp8 cache too (both read the dequantized keys the same way).
    seq_lens = [64, 4 * PAGE, 3 * PAGE + 5]
    kv8, _, expected, table, seq, query = _fp8_batch(seq_lens, 2, 2, 64, "token_major",
                                                     estimator, summary_dtype)  # fmt: skip
    filled = [int(table[0, 0]), int(table[1, 3])]
    summaries = expected.clone()
    summaries[filled] = 0
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    ws = moira.MoiraWorkspace(3, 4, 2, 64, table.shape[1], config, "cpu")
    moira.estimate_page_logmass(query, kv8, summaries, table, seq, ws.logmass, 0.125, estimator,
                                ws.selector_params, write_filled_pages=True,
                                k_scale=_scales()["k_scale"])  # fmt: skip
    assert summaries[filled].ne(0).any()
    assert torch.equal(summaries, expected)


# --------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "group", "head_size", "estimator", "summary_dtype", "pattern"),
    [
        ("token_major", 1, 64, "mvar", "bfloat16", "random"),
        ("head_major", 3, 64, "mvar_top8", "int8", "concentrated"),
        ("token_major", 4, 128, "mvar_top8", "bfloat16", "outlier"),
    ],
)
def test_fp8_estimate_matches_reference(layout, group, head_size, estimator, summary_dtype,
                                        pattern):  # fmt: skip
    # Exact sink and current pages from the e4m3 keys and k_scale; summary
    # pages from the summaries of the dequantized keys.
    seq_lens = [1, 64, 65, 300, 64 * 9 + 7]
    kv8, deq, summaries, table, seq, query = _fp8_batch(seq_lens, 2, group, head_size, layout,
                                                        estimator, summary_dtype,
                                                        pattern)  # fmt: skip
    scale = head_size**-0.5
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    ws = moira.MoiraWorkspace(8, 2 * group, 2, head_size, table.shape[1], config, "cpu")
    ws.logmass.fill_(float("nan"))
    moira.estimate_page_logmass(query, kv8, summaries, table, seq, ws.logmass, scale, estimator,
                                k_scale=_scales()["k_scale"])  # fmt: skip
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        expected = ref.estimate_row_logmass(query[row], deq, ref.read_summaries(summaries),
                                            table[row], seq_len, scale, estimator)  # fmt: skip
        torch.testing.assert_close(ws.logmass[row, :, :, :n], expected, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------
# The decode step: Estimate, Select, Attend, Merge
# --------------------------------------------------------------------------
@pytest.mark.parametrize("fill_blocks", [1, 5])
@pytest.mark.parametrize(
    ("layout", "group", "head_size"),
    [("token_major", 1, 64), ("head_major", 3, 64), ("token_major", 4, 128)],
)
def test_fp8_gamma_one_equals_dense_on_the_dequantized_cache(fill_blocks, layout, group,
                                                             head_size):  # fmt: skip
    # Rows: 1 token, one page, 2 and 7 pages, ragged, and a padded row
    # (seq_len 0, left untouched); one Attend block, or lists cut over five.
    seq_lens = [1, 64, 2 * PAGE, 7 * PAGE, 64 * 4 + 17, 0]
    kv8, deq, summaries, table, seq, query = _fp8_batch(
        seq_lens, 2, group, head_size, layout, moira.MOIRA_DEFAULT_ESTIMATOR,
        moira.MOIRA_DEFAULT_SUMMARY_DTYPE,
    )  # fmt: skip
    config = moira.MoiraConfig.paper(gamma=1.0, attend_fill_blocks=fill_blocks)
    ws = moira.MoiraWorkspace(6, 2 * group, 2, head_size, table.shape[1], config, "cpu")
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    scale = head_size**-0.5
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, scale, **_scales())
    dense = ref.dense_decode(query, deq, table, seq, scale)
    for row, seq_len in enumerate(seq_lens[:-1]):
        n = math.ceil(seq_len / PAGE)
        assert ws.list_lengths[row].tolist() == [n, n]
    torch.testing.assert_close(out[:-1].float(), dense[:-1], atol=BF16_ATOL, rtol=BF16_RTOL)
    assert torch.all(out[-1] == 7.0), "padded row was written"


@pytest.mark.parametrize(
    ("fill_blocks", "layout", "group", "pattern", "gamma", "estimator", "summary_dtype"),
    [
        (5, "token_major", 3, "concentrated", 0.98, "mvar_top8", "int8"),
        (4, "head_major", 4, "outlier", 0.95, "mvar_top8", "int8"),
        (1, "head_major", 1, "diffuse", 0.9, "mvar", "bfloat16"),
    ],
)
def test_fp8_sparse_decode_matches_reference(fill_blocks, layout, group, pattern, gamma,
                                             estimator, summary_dtype):  # fmt: skip
    seq_lens = [64 * 12, 64 * 7 + 3, 100, 1]
    kv8, deq, summaries, table, seq, query = _fp8_batch(seq_lens, 2, group, 64, layout,
                                                        estimator, summary_dtype,
                                                        pattern)  # fmt: skip
    config = moira.MoiraConfig.paper(gamma=gamma, estimator=estimator, summary_dtype=summary_dtype,
                                     attend_fill_blocks=fill_blocks)  # fmt: skip
    ws = moira.MoiraWorkspace(4, 2 * group, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125, **_scales())
    expected, lists = ref.sparse_decode(query, deq, ref.read_summaries(summaries), table, seq,
                                        0.125, gamma, estimator=estimator)  # fmt: skip
    dropped = 0
    for row in range(len(seq_lens)):
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist()
            dropped += math.ceil(seq_lens[row] / PAGE) - count
    assert dropped > 0, "gamma < 1 kept every page: the case tests nothing sparse"
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_fp8_scales_are_read_on_the_device():
    # The scales are device tensors read at every launch (a captured graph
    # sees their current values): twice v_scale is twice the output, bit for
    # bit (a power of two); k_scale = 0 makes every logit 0, so the output is
    # the mean of the values.
    seq_lens = [64 * 3 + 5, 64 * 2]
    kv8, deq, summaries, table, seq, query = _fp8_batch(seq_lens, 2, 2, 64, "token_major",
                                                        "mvar")  # fmt: skip
    config = moira.MoiraConfig.paper(gamma=1.0, estimator="mvar", summary_dtype="bfloat16",
                               **SMALL_FILL)  # fmt: skip
    ws = moira.MoiraWorkspace(2, 4, 2, 64, table.shape[1], config, "cpu")
    scales = _scales()
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125, **scales)
    first = out.clone()
    scales["v_scale"].mul_(2.0)
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125, **scales)
    assert torch.equal(out, first * 2)
    scales["k_scale"].zero_()
    moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125, **scales)
    for row, seq_len in enumerate(seq_lens):
        _, values = ref.row_keys_values(deq, table[row], seq_len)
        mean = (values * 2).mean(dim=1).repeat_interleave(2, dim=0)  # [H_q, D]
        torch.testing.assert_close(out[row].float(), mean, atol=BF16_ATOL, rtol=BF16_RTOL)


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------
def test_fp8_cache_needs_its_scales_and_a_bf16_cache_takes_none():
    seq_lens = [64 * 2]
    kv8, deq, summaries, table, seq, query = _fp8_batch(seq_lens, 2, 1, 64, "token_major",
                                                        "mvar")  # fmt: skip
    ws = moira.MoiraWorkspace(1, 2, 2, 64, table.shape[1],
                              moira.MoiraConfig.paper(estimator="mvar", summary_dtype="bfloat16"),
                              "cpu")  # fmt: skip
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    slots = full_page_slots(table, seq_lens)
    scales = _scales()
    with pytest.raises(ValueError, match=r"an fp8 KV cache needs its v_scale"):
        moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125,
                           k_scale=scales["k_scale"])  # fmt: skip
    with pytest.raises(ValueError, match=r"an fp8 KV cache needs its k_scale"):
        moira.write_page_summaries(kv8, summaries, slots)
    bf16_scale = scales["k_scale"].bfloat16()
    with pytest.raises(ValueError, match=r"k_scale must be one float32 value .*bfloat16"):
        moira.moira_decode(query, kv8, summaries, table, seq, out, ws, 0.125,
                           k_scale=bf16_scale, v_scale=scales["v_scale"])  # fmt: skip
    with pytest.raises(ValueError, match=r"k_scale / v_scale apply to an fp8 KV cache only"):
        moira.moira_decode(query, deq.bfloat16(), summaries, table, seq, out, ws, 0.125,
                           **scales)  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_cache must be bfloat16 or float8_e4m3fn"):
        moira.moira_decode(query, kv8.view(torch.uint8), summaries, table, seq, out, ws, 0.125,
                           **scales)  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_cache must be bfloat16 or float8_e4m3fn"):
        moira.write_page_summaries(kv8.view(torch.uint8), summaries, slots, scales["k_scale"])
