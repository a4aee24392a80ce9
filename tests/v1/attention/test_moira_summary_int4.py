# SPDX-License-Identifier: Apache-2.0
"""int4 stored keys (``MOIRA_SUMMARY_DTYPE=int4``, the ``mvar_top8`` estimator) against
the float32 reference (CPU interpreter): the packed layout, the writer, Estimate on the
stored values, storage and configuration (the whole sparse step and γ = 1:
test_moira_summary_int8.py). docs/estimator.md "Summary layout"."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.v1.attention.moira_test_utils import PAGE, make_decode_batch, make_kv_cache
from tests.v1.attention.test_moira_summary_int8 import check_estimate_int8
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.backends.moira import (
    _int4_pair_digit_dots,
    _int8_digit_dot,
    _int8_digits,
)
from vllm_moira.v1.attention.ops import moira_reference as ref
from vllm_moira.v1.worker import moira_summaries as ms


# --------------------------------------------------------------------------
# The packed layout (reference)
# --------------------------------------------------------------------------
def test_reference_packing_round_trips_every_int4_pair():
    """Row 2 + i holds key 2i + 1 in the high nibble and key 2i + 8 in the low one (the
    byte 16 key[2i+1] + key[2i] + 8), for every pair of values in [-7, 7]; mean and
    variance stay int8; the scales row last."""
    values = torch.arange(-7, 8, dtype=torch.float32)
    even, odd = torch.meshgrid(values, values, indexing="ij")  # 225 channel pairs
    keys = torch.stack([even.flatten(), odd.flatten()])  # [2, 225], absmax 7: scale 1
    summaries = torch.cat([torch.randn(2, 225) * 3, keys]).unsqueeze(0)  # [1, 4, 225]
    packed = ref.pack_int4_summaries(summaries)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 2 + 1 + 1, 225)
    byte = packed[0, 2].view(torch.int8).int()
    assert torch.equal(byte, (odd.flatten() * 16 + even.flatten() + 8).int())
    assert torch.equal(byte & -16, (odd.flatten() * 16).int())  # byte & 0xF0: 16 key[2i+1]
    q, scales = ref.split_int4_summaries(packed)
    assert torch.equal(q[0, 2:].float(), keys)
    assert torch.equal(q[0, :2], ref.quantize_summaries_int8(summaries[0, :2])[0])
    assert torch.equal(scales[0, 2:], torch.ones(2))
    # stored_summaries (the study's values) = the packed layout read back
    x = torch.randn(3, 2, 10, 64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(ref.stored_summaries(x, "int4"),
                       ref.read_summaries(ref.pack_int4_summaries(x)))  # fmt: skip
    with pytest.raises(ValueError, match="even number of stored keys"):
        ref.pack_int4_summaries(torch.zeros(1, 5, 64))


# --------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_write_int4_summaries_matches_reference(layout, head_size, estimator="mvar_top8"):
    gen = torch.Generator().manual_seed(head_size + len(estimator))
    slots = moira.summary_slots(estimator)
    kv = make_kv_cache(6, 2, head_size, layout, generator=gen)
    kv[3] *= 20.0  # a page of large keys: its own scales, not its neighbours'
    dtype, rows = moira.summary_storage(slots, "int4")
    summaries = torch.full((6, 2, rows, head_size), 99, dtype=dtype)
    written = [2, 3, 5]
    slot_mapping = torch.tensor([-1] + [b * PAGE + 63 for b in written] + [4 * PAGE + 10])
    moira.write_page_summaries(kv, summaries, slot_mapping)
    fp32 = ref.summarize_pages_top(kv, torch.tensor(written), slots - 2)
    got, scales = ref.split_int4_summaries(summaries[written])
    want, want_scales = ref.split_int4_summaries(ref.pack_int4_summaries(fp32))
    # Mean / variance may differ from torch's by fp32 summation order (one int8 step at
    # most); the stored keys are bf16 values, so exactly the reference's.
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0)
    assert (got.int() - want.int()).abs().max() <= 1
    assert torch.equal(got[:, :, 2:], want[:, :, 2:])
    assert torch.equal(scales[:, :, 2:], want_scales[:, :, 2:])
    assert int(got[:, :, 2:].abs().max()) == 7
    assert (summaries[[0, 1, 4]] == 99).all(), "pages that did not fill are untouched"


def test_write_int4_summaries_of_an_all_zero_page():
    kv = make_kv_cache(2, 1, 64, "head_major")
    kv[1, :, :, :64] = 0.0
    summaries = torch.full((2, 1, 7, 64), 5, dtype=torch.uint8)  # mvar_top8: 2 + 4 + 1 rows
    moira.write_page_summaries(kv, summaries, torch.tensor([PAGE + 63]))
    q, scales = ref.split_int4_summaries(summaries[1, 0])
    assert (q == 0).all() and scales.tolist() == [0.0] * 10
    assert torch.equal(ref.read_summaries(summaries)[1], torch.zeros(1, 10, 64))


def test_verify_page_summaries_sees_a_changed_int4_key():
    kv, summaries, *_ = make_decode_batch([64 * 5], 1, 2, 64, "head_major", "mvar_top8",
                                          summary_dtype="int4")  # fmt: skip
    assert moira.verify_page_summaries(kv, summaries) == {
        "pages": 5, "mismatched": 0, "beyond_rounding": 0
    }  # fmt: skip
    block = int(summaries.flatten(1).ne(0).any(dim=1).nonzero()[0])
    summaries.view(torch.int8)[block, 0, 3, 7] += 32  # key 3, channel 7: two int4 steps
    assert moira.verify_page_summaries(kv, summaries)["beyond_rounding"] == 1


# --------------------------------------------------------------------------
# Estimate and the whole step
# --------------------------------------------------------------------------
@triton.jit
def _unpack_int4_pair(packed):
    # The test's oracle: stored keys 2 i and 2 i + 1 of a byte as int8 values in [-7, 7]
    # (the odd key is floor(byte / 16), the even key the low nibble minus 8).
    x = packed.to(tl.int32)
    return ((x & 15) - 8).to(tl.int8), (x >> 4).to(tl.int8)


@triton.jit
def _pair_products_kernel(
    packed_ptr,  # [TILE, D] int8: row 2 + i of TILE pages (two keys a byte)
    query_ptr,  # [ROWS, D] fp32
    out_ptr,  # [4, TILE, ROWS] fp32: even, odd (pair products), even, odd (unpacked keys)
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
):
    offs_t = tl.arange(0, TILE)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    packed = tl.load(packed_ptr + offs_t[:, None] * D + offs_d[None, :])
    q = tl.load(query_ptr + offs_r[:, None] * D + offs_d[None, :])
    digits, step = _int8_digits(q, ROWS, D)
    digit_sums = tl.sum(digits.to(tl.int32), axis=1)
    even, odd = _int4_pair_digit_dots(packed, digits, digit_sums, step, TILE, ROWS)
    even_key, odd_key = _unpack_int4_pair(packed)
    out = out_ptr + offs_t[:, None] * ROWS + offs_r[None, :]
    tl.store(out, even)
    tl.store(out + TILE * ROWS, odd)
    tl.store(out + 2 * TILE * ROWS, _int8_digit_dot(even_key, digits, step, TILE, ROWS))
    tl.store(out + 3 * TILE * ROWS, _int8_digit_dot(odd_key, digits, step, TILE, ROWS))


def check_int4_pair_products(device: str) -> None:
    """Estimate's int4 products without unpacking (_int4_pair_digit_dots: each nibble in
    place on the int8 tensor cores, then q.odd = q.(16 odd) / 16 and q.even = q.(even + 8)
    - 8 sum(digits)) equal, bit for bit, the unpacked keys' products (_unpack_int4_pair,
    then _int8_digit_dot), for every int4 value and queries with negative, large and tiny
    entries; and both are q . key within the digits' resolution."""
    tile, rows, d = 16, 8, 128
    gen = torch.Generator().manual_seed(11)
    keys = torch.randint(-7, 8, (2, tile, d), generator=gen).float()  # [even, odd]
    keys[:, 0, :15] = torch.arange(-7, 8, dtype=torch.float32)  # every value, both nibbles
    keys[:, 0, 15] = 7.0  # absmax 7 in every page: scale 1, the keys stored as they are
    keys[:, 1:, 15] = 7.0
    summaries = torch.cat([torch.randn(tile, 2, d, generator=gen), keys.permute(1, 0, 2)], dim=1)
    packed = ref.pack_int4_summaries(summaries)[:, 2].view(torch.int8).contiguous()
    query = torch.randn(rows, d, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    query[0, :5] = torch.tensor([-1e4, 3e-7, 0.0, -2.5e-3, 7.0])
    out = torch.empty(4, tile, rows, dtype=torch.float32, device=device)
    _pair_products_kernel[(1,)](packed.to(device), query.to(device), out, tile, rows, d)
    out = out.cpu()
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])
    exact = torch.einsum("ktd,rd->ktr", keys.double(), query.double())
    # Digits represent each q within 2^-27 of its row's largest |q| (x 4: slack).
    bound = 7 * d * query.abs().amax(dim=1).double() * 2.0**-25
    assert ((out[:2].double() - exact).abs() <= bound).all()


def test_int4_pair_products_equal_unpacked_keys_bitwise():
    check_int4_pair_products("cpu")


@pytest.mark.parametrize(
    ("layout", "group", "head_size", "pattern"),
    [
        ("token_major", 3, 64, "outlier"),
        ("head_major", 4, 128, "concentrated"),
        ("head_major", 8, 64, "diffuse"),
    ],
)
def test_estimate_int4_matches_reference(layout, group, head_size, pattern,
                                         estimator="mvar_top8"):  # fmt: skip
    check_estimate_int8([1, 65, 300, 64 * 20 + 7], estimator, layout, group, head_size, pattern,
                        summary_dtype="int4", tile_pages=16)  # fmt: skip


# --------------------------------------------------------------------------
# Storage and configuration
# --------------------------------------------------------------------------
@pytest.mark.parametrize("head_size", [64, 128])
def test_int4_summary_storage_and_accounting(head_size, estimator="mvar_top8", rows=7):
    slots = moira.summary_slots(estimator)
    assert moira.summary_storage(slots, "int4") == (torch.uint8, rows)
    kv = torch.zeros(10, 2, PAGE, 2 * head_size, dtype=torch.bfloat16)
    summaries = ms.acquire_summaries(kv, slots, "int4")
    try:
        assert summaries.dtype == torch.uint8
        assert tuple(summaries.shape) == (10, 2, rows, head_size)
        kv_bytes = kv.numel() * kv.element_size()
        assert summaries.numel() == ms.summary_bytes_for_kv_bytes(kv_bytes, slots, "int4")
        assert summaries.numel() * 256 == kv_bytes * 7  # 7/256 of the KV cache (int8: 11/256)
    finally:
        ms.release_summaries(ms.summary_key(kv))


def test_int4_needs_stored_keys():
    with pytest.raises(ValueError, match=r"'int4' stores the keys of mvar_top\{r\}"):
        ms.summary_storage(2, "int4")
    with pytest.raises(
        ValueError,
        match=r"MOIRA_SUMMARY_DTYPE 'int4' stores the keys of "
        r"\('mvar_top8',\) in 4 bits; "
        r"MOIRA_ESTIMATOR 'mvar' stores none \(use 'int8'\)",
    ):
        moira.moira_config_from_env({"MOIRA_SUMMARY_DTYPE": "int4", "MOIRA_ESTIMATOR": "mvar"})
    config = moira.moira_config_from_env({"MOIRA_SUMMARY_DTYPE": "int4"})
    assert (config.summary_dtype, config.estimator) == ("int4", "mvar_top8")
    assert ref.parse_stored_estimator("int4:mvar_top8") == ("mvar_top8", "int4")


def test_estimate_rejects_int4_summaries_of_another_estimator():
    kv, summaries, table, seq, query = make_decode_batch(
        [300], 1, 2, 64, "head_major", "mvar_top8", summary_dtype="int4"
    )
    ws = moira.MoiraWorkspace(1, 2, 1, 64, table.shape[1], moira.MoiraConfig.paper(), "cpu")
    with pytest.raises(ValueError, match=r"needs a summary of 2 slots .*int4 keys: 3 uint8 rows"):
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    "mvar")  # fmt: skip
