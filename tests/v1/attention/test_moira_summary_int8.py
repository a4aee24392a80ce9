# SPDX-License-Identifier: Apache-2.0
"""int8 page summaries (``MOIRA_SUMMARY_DTYPE=int8``) against the float32 reference (CPU
interpreter): the writer's quantization, Estimate on the stored values, the whole sparse
step (for int4 keys too), storage shape and accounting, configuration. docs/estimator.md
"Summary layout"."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from tests.v1.attention.moira_test_utils import PAGE, make_decode_batch, make_kv_cache
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref
from vllm_moira.v1.worker import moira_summaries as ms

# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)


def _ref_fp32_summaries(kv: torch.Tensor, blocks: torch.Tensor, estimator: str) -> torch.Tensor:
    r = moira.estimator_num_top(estimator)
    if r == 0:
        return ref.summarize_pages(kv, blocks)
    return ref.summarize_pages_top(kv, blocks, r)


# --------------------------------------------------------------------------
# Reference quantizer
# --------------------------------------------------------------------------
def test_reference_quantizer_rule():
    x = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 127.0], [-3.0, 1.4, 0.0, 0.25]]])
    q, scale = ref.quantize_summaries_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(scale, torch.tensor([[0.0, 127.0, 3.0]]) / 127.0)  # absmax / 127, fp32
    assert q[0, 0].tolist() == [0, 0, 0, 0]  # all-zero vector: scale 0, values 0
    assert q[0, 1].tolist() == [1, -2, 1, 127]  # floor(x / scale + 0.5): 0.5 -> 1
    assert q[0, 2].tolist() == [-127, 59, 0, 11]
    back = ref.dequantize_summaries_int8(q, scale)
    # |error| <= scale / 2 per element
    assert torch.all((back - x).abs() <= scale.unsqueeze(-1) / 2 + 1e-7)


# --------------------------------------------------------------------------
# Estimate's int8 digits of q and (s q)^2
# --------------------------------------------------------------------------
@triton.jit
def _kernel_int8_digits(x_ptr, digits_ptr, step_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + offs_r[:, None] * D + offs_d[None, :])
    digits, step = moira._int8_digits(x, ROWS, D)
    offs_rd = tl.arange(0, 4 * ROWS)
    tl.store(digits_ptr + offs_rd[:, None] * D + offs_d[None, :], digits)
    tl.store(step_ptr + offs_r[:, None] * 4 + tl.arange(0, 4)[None, :], step)


def test_int8_digits_represent_the_rows():
    """Each row is sum_p d_p * step_p to 2^-27 of its largest |x| (a bf16 row exactly), with
    d_0 in [-128, 127], d_1..3 in [0, 127] and power-of-two steps 128 apart; an all-zero row
    and one of values below 2^-96 get zero (or near-zero) digits."""
    gen = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(64, generator=gen) * 3.0,  # a query row
        (torch.randn(64, generator=gen) * 3.0) ** 2,  # (s q)^2: non-negative
        torch.randn(64, generator=gen) * 1e4 * (torch.rand(64, generator=gen) < 0.1),  # spikes
        torch.zeros(64),
        torch.full((64,), -1e-30),  # below 2^-96: taken as s = 1
        -torch.logspace(-20, 3, 64),  # wide range, all negative
        torch.tensor([-(2.0**k) for k in range(64)]) * 2.0**-40,  # exact powers, at the edges
        torch.randn(64, generator=gen).to(torch.bfloat16).float(),  # bf16 values
    ]
    x = torch.stack(rows).float()
    digits = torch.empty(4 * x.shape[0], 64, dtype=torch.int8)
    step = torch.empty(x.shape[0], 4)
    _kernel_int8_digits[(1,)](x, digits, step, ROWS=x.shape[0], D=64)
    d = digits.view(x.shape[0], 4, 64).double()
    assert d[:, 0].min() >= -128 and d[:, 1:].min() >= 0 and d.max() <= 127
    # Steps: powers of two, each 128 times the next.
    assert torch.equal(torch.frexp(step)[0], torch.full_like(step, 0.5))
    assert torch.equal(step[:, :3], step[:, 1:] * 128)
    value = (d * step.double()[:, :, None]).sum(1)
    err = (value - x.double()).abs().max(dim=1).values
    absmax = x.double().abs().max(dim=1).values
    big = absmax >= 2.0**-96
    assert (err[big] <= absmax[big] * 2.0**-27).all()
    assert (err[~big] <= 2.0**-21).all()
    assert torch.equal(value[-1], x.double()[-1])  # a bf16 row exactly
    assert torch.equal(value[3], torch.zeros(64, dtype=torch.float64))


# --------------------------------------------------------------------------
# Summary writer
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("estimator", ["mvar", "mvar_top8"])
def test_write_int8_summaries_matches_reference(layout, head_size, estimator):
    gen = torch.Generator().manual_seed(head_size + len(estimator))
    slots = moira.summary_slots(estimator)
    kv = make_kv_cache(6, 2, head_size, layout, generator=gen)
    kv[3] *= 20.0  # a page of large keys: its own scales, not its neighbours'
    summaries = torch.full((6, 2, slots + 1, head_size), -99, dtype=torch.int8)
    written = [2, 3, 5]
    slot_mapping = torch.tensor([-1] + [b * PAGE + 63 for b in written] + [4 * PAGE + 10])
    moira.write_page_summaries(kv, summaries, slot_mapping)
    q_ref, scale_ref = ref.quantize_summaries_int8(
        _ref_fp32_summaries(kv, torch.tensor(written), estimator)
    )
    got, scales = ref.split_int8_summaries(summaries[written])
    # The kernel's mean / variance may differ from torch's by fp32 summation order:
    # a value on a rounding boundary can land one step off, never more.
    torch.testing.assert_close(scales, scale_ref, rtol=1e-5, atol=0)
    assert (got.int() - q_ref.int()).abs().max() <= 1
    assert (got == q_ref).float().mean() > 0.99
    if estimator != "mvar":
        # Stored keys are bf16 values: the same fp32 input, so exactly the reference's.
        assert torch.equal(got[:, :, 2:], q_ref[:, :, 2:])
    assert (summaries[[0, 1, 4]] == -99).all(), "pages that did not fill are untouched"
    # The stored summary reads back within half a step of the fp32 values.
    back = ref.read_summaries(summaries)[written]
    exact = _ref_fp32_summaries(kv, torch.tensor(written), estimator)
    assert torch.all((back - exact).abs() <= 1.5 * scale_ref.unsqueeze(-1) + 1e-6)


def test_write_int8_summaries_of_an_all_zero_page():
    kv = make_kv_cache(2, 1, 64, "head_major")
    kv[1, :, :, :64] = 0.0
    summaries = torch.full((2, 1, 11, 64), 5, dtype=torch.int8)  # mvar_top8: 10 slots + scales
    moira.write_page_summaries(kv, summaries, torch.tensor([PAGE + 63]))
    q, scales = ref.split_int8_summaries(summaries[1, 0])
    assert (q == 0).all() and scales.tolist() == [0.0] * 10
    assert torch.equal(ref.read_summaries(summaries)[1], torch.zeros(1, 10, 64))


# --------------------------------------------------------------------------
# Estimate and the whole step
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("estimator", "layout", "group", "head_size", "pattern"),
    [
        ("mvar", "token_major", 1, 64, "random"),
        ("mvar", "head_major", 8, 128, "diffuse"),
        ("mvar_top8", "token_major", 3, 64, "outlier"),
        ("mvar_top8", "token_major", 4, 128, "concentrated"),
        ("mvar_top8", "head_major", 16, 64, "outlier"),  # G = 16: 64 digit columns
    ],
)
# The int8 slots as stored against q's int8 digits on the int8 tensor cores, on 16-page
# tiles (the sink, middle tiles and the current page in different programs).
@pytest.mark.slow
def test_estimate_int8_matches_reference(estimator, layout, group, head_size, pattern):
    check_estimate_int8([1, 64, 65, 300, 64 * 40 + 7], estimator, layout, group, head_size,
                        pattern, tile_pages=16)  # fmt: skip


def check_estimate_int8(seq_lens, estimator, layout, group, head_size, pattern,
                        summary_dtype="int8", tile_pages=None):  # fmt: skip
    """Estimate on int8 summaries (or int4 keys) (2 KV heads x G) vs the float32
    reference, row by row, on ``tile_pages``-page programs (None: the default launch's)."""
    kv, summaries, table, seq, query = make_decode_batch(
        seq_lens, 2, group, head_size, layout, estimator, pattern, query_scale=3.0,
        summary_dtype=summary_dtype,
    )  # fmt: skip
    assert summaries.dtype == moira.summary_storage(moira.summary_slots(estimator),
                                                    summary_dtype)[0]  # fmt: skip
    scale = head_size**-0.5
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    ws = moira.MoiraWorkspace(len(seq_lens), 2 * group, 2, head_size, table.shape[1], config,
                              "cpu")  # fmt: skip
    ws.logmass.fill_(float("nan"))
    launch = {"estimate": {"tile_pages": tile_pages}} if tile_pages else None
    moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, scale, estimator,
                                launch=launch)  # fmt: skip
    stored = ref.read_summaries(summaries)
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        expected = ref.estimate_row_logmass(query[row], kv, stored, table[row], seq_len, scale,
                                            estimator)  # fmt: skip
        torch.testing.assert_close(ws.logmass[row, :, :, :n], expected, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize(
    ("estimator", "summary_dtype", "query_scale"),
    [
        ("mvar", "int8", 1.0),
        ("mvar_top8", "int8", 1.0),
        # int4 stored keys (test_moira_summary_int4.py); queries x3: wider logit spreads
        ("mvar_top8", "int4", 3.0),
    ],
)
def test_sparse_decode_int8_matches_reference(estimator, summary_dtype, query_scale):
    """Lists equal the reference's on the stored (dequantized) summaries; the output
    matches the reference's attention over those lists."""
    config = moira.MoiraConfig.paper(gamma=0.9, estimator=estimator, summary_dtype=summary_dtype,
                                     **SMALL_FILL)  # fmt: skip
    seq_lens = [1, 64, 7 * PAGE, 64 * 12 + 5, 64 * 30 + 33]
    kv, summaries, table, seq, query = make_decode_batch(
        seq_lens, 2, 4, 128, "head_major", estimator, "concentrated", seed=2,
        query_scale=query_scale, summary_dtype=summary_dtype,
    )  # fmt: skip
    ws = moira.MoiraWorkspace(8, 8, 2, 128, table.shape[1], config, "cpu")
    out = torch.empty_like(query)
    scale = 128**-0.5
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, scale)
    stored = ref.read_summaries(summaries)
    expected, lists = ref.sparse_decode(query, kv, stored, table, seq_lens, scale, gamma=0.9,
                                        estimator=estimator)  # fmt: skip
    for row in range(len(seq_lens)):
        for h in range(2):
            n = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :n].tolist() == lists[row][h].tolist(), (row, h)
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=1.6e-2)


@pytest.mark.parametrize("summary_dtype", ["int8", "int4"])
def test_gamma_one_int8_equals_dense(summary_dtype):
    config = moira.MoiraConfig.paper(gamma=1.0, summary_dtype=summary_dtype, **SMALL_FILL)
    seq_lens = [1, 64, 7 * PAGE, 64 * 4 + 17]
    kv, summaries, table, seq, query = make_decode_batch(seq_lens, 2, 4, 128, "head_major",
                                                         config.estimator,
                                                         summary_dtype=summary_dtype)  # fmt: skip
    ws = moira.MoiraWorkspace(8, 8, 2, 128, table.shape[1], config, "cpu")
    out = torch.empty_like(query)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 128**-0.5)
    dense = ref.dense_decode(query, kv, table, seq, 128**-0.5)
    torch.testing.assert_close(out.float(), dense, atol=8e-3, rtol=1.6e-2)


def test_estimate_rejects_int8_summaries_of_another_estimator():
    kv, summaries, table, seq, query = make_decode_batch([300], 1, 2, 64, "head_major", "mvar",
                                                         summary_dtype="int8")  # fmt: skip
    ws = moira.MoiraWorkspace(1, 2, 1, 64, table.shape[1], moira.MoiraConfig.paper(), "cpu")
    with pytest.raises(ValueError, match=r"needs a summary of 10 slots .*int8: 11 rows"):
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    "mvar_top8")  # fmt: skip


# --------------------------------------------------------------------------
# Storage and configuration
# --------------------------------------------------------------------------
@pytest.mark.parametrize(("estimator", "head_size"), [("mvar", 64), ("mvar_top8", 128)])
def test_int8_summary_storage_and_accounting(estimator, head_size):
    slots = moira.summary_slots(estimator)
    kv = torch.zeros(10, 2, PAGE, 2 * head_size, dtype=torch.bfloat16)
    summaries = ms.acquire_summaries(kv, slots, "int8")
    try:
        assert summaries.dtype == torch.int8
        assert tuple(summaries.shape) == (10, 2, slots + 1, head_size)
        kv_bytes = kv.numel() * kv.element_size()
        assert summaries.numel() == ms.summary_bytes_for_kv_bytes(kv_bytes, slots, "int8")
        # (S + 1) rows of D bytes per page and KV head, vs S rows of 2 D bytes in bf16.
        bf16 = ms.summary_bytes_for_kv_bytes(kv_bytes, slots)
        assert bf16 * (slots + 1) == summaries.numel() * 2 * slots
        with pytest.raises(ValueError, match="same estimator and summary dtype"):
            ms.acquire_summaries(kv, slots, "bfloat16")
    finally:
        ms.release_summaries(ms.summary_key(kv))


def test_int8_summaries_need_room_for_their_scales():
    kv = torch.zeros(2, 1, PAGE, 2 * 16, dtype=torch.bfloat16)  # D = 16 < 4 * 6
    with pytest.raises(ValueError, match="head_size >= 24"):
        ms.summary_shape(kv, 6, "int8")


def test_config_summary_dtype():
    assert moira.MoiraConfig().summary_dtype == "int8"  # the default (docs/estimator.md)
    assert moira.MOIRA_SUMMARY_DTYPES == ref.SUMMARY_DTYPES
    assert moira.moira_config_from_env({"MOIRA_SUMMARY_DTYPE": "INT8"}).summary_dtype == "int8"
    with pytest.raises(
        ValueError, match=r"MOIRA_SUMMARY_DTYPE must be one of \('bfloat16', 'int8', 'int4'\)"
    ):
        moira.moira_config_from_env({"MOIRA_SUMMARY_DTYPE": "fp8"})
    ws = moira.MoiraWorkspace(1, 2, 1, 64, 4, moira.MoiraConfig.paper(summary_dtype="int8"), "cpu")
    with pytest.raises(ValueError, match="cannot change.*summary_dtype"):
        ws.set_selector(moira.MoiraConfig.paper(gamma=0.9, summary_dtype="bfloat16"))


def test_summary_storage_table_and_benchmark_names():
    assert moira.summary_storage(6, "bfloat16") == (torch.bfloat16, 6)
    assert moira.summary_storage(6, "int8") == (torch.int8, 7)
    with pytest.raises(
        ValueError, match=r"summary_dtype must be one of \('bfloat16', 'int8', 'int4'\)"
    ):
        ms.summary_bytes_for_kv_bytes(1 << 20, 6, "fp8")
    assert ref.parse_stored_estimator("int8:mvar_top8") == ("mvar_top8", "int8")
    assert ref.parse_stored_estimator("bf16:mvar") == ("mvar", "bfloat16")
    assert ref.parse_stored_estimator("mvar_top4") == ("mvar_top4", None)


@pytest.mark.parametrize(
    ("estimator", "layout", "group", "head_size"),
    [("mvar", "token_major", 4, 128), ("mvar", "head_major", 3, 64)],
)
def test_estimate_int8_two_slots_default_launch_matches_reference(estimator, layout, group,
                                                                  head_size):  # fmt: skip
    # The default launch of mvar on int8 summaries: 64-page tiles, q's int8 digits. Rows of
    # one page, one tile exactly (65 pages: the sink and current page exact), and three tiles.
    check_estimate_int8([1, 64 * 64 + 64, 64 * 64 + 65, 64 * 150 + 3], estimator, layout, group,
                        head_size, "outlier")  # fmt: skip
