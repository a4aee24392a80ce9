# SPDX-License-Identifier: Apache-2.0
"""Moira's Triton kernels against the float32 reference (CPU interpreter).

Small shapes: the Triton interpreter runs a program per grid point in Python
(conftest installs the bf16 ``tl.dot`` fix). The same properties at real
shapes run on the H200 in ``test_moira_kernels_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import (
    PAGE,
    full_page_slots,
    make_decode_batch,
    make_kv_cache,
    pack_page_lists,
)
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Few Attend blocks (N_F), so that CPU-sized lists are cut over several blocks and
# Merge combines their parts (the default N_F is exercised separately).
SMALL_FILL = dict(attend_fill_blocks=5)
# Decode-step tests run the default estimator (its summaries and Estimate);
# estimator-specific kernels are tested in test_moira_estimator_kernels.py.
DEFAULT_ESTIMATOR = moira.MOIRA_DEFAULT_ESTIMATOR
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2  # one bf16 ulp at |x| <= 1, plus fp32 noise


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significand bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def _batch(seq_lens, num_kv_heads, group, head_size, layout, pattern="random",
           seed=0, extra_blocks=3, estimator=DEFAULT_ESTIMATOR):  # fmt: skip
    return make_decode_batch(seq_lens, num_kv_heads, group, head_size, layout, estimator,
                             pattern, seed, extra_blocks)  # fmt: skip


# --------------------------------------------------------------------------
# Page summaries
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_write_summaries_matches_reference(layout, head_size):
    gen = torch.Generator().manual_seed(1)
    kv = make_kv_cache(6, 2, head_size, layout, generator=gen)
    summaries = torch.full((6, 2, 2, head_size), float("nan"), dtype=torch.bfloat16)
    # Slots of a decode step: padding (-1), a page's 64th token for blocks 2
    # and 5, and tokens that do not fill a page (no summary).
    slots = torch.tensor([-1, 2 * PAGE + 63, 3 * PAGE + 10, 5 * PAGE + 63, 4 * PAGE])
    moira.write_page_summaries(kv, summaries, slots)
    expected = ref.summarize_pages(kv, torch.tensor([2, 5]))
    got = summaries[[2, 5]].float()
    # The kernel stores bf16: at most one bf16 step away from the fp32 value.
    assert torch.all((got - expected).abs() <= _bf16_ulp(expected) + 1e-6)
    untouched = summaries[[0, 1, 3, 4]]
    assert torch.isnan(untouched.float()).all(), "pages that did not fill were written"


@pytest.mark.parametrize("estimator", ["mvar", DEFAULT_ESTIMATOR])
def test_write_summaries_same_bits_for_every_window(estimator):
    # A prefill slice where requests' segments meet: three page ends within
    # 8 tokens (blocks 6, 1, 4), a chunk that starts mid-page and fills
    # block 3 at its 22nd token, padding, and a token count that no window
    # size divides. Every window size summarizes exactly the pages that
    # filled, with the same bits (one page after another where a window
    # holds several ends, as when it is one token per program).
    gen = torch.Generator().manual_seed(4)
    kv = make_kv_cache(8, 2, 64, "token_major", generator=gen)
    summary_dtype = "int8" if estimator == DEFAULT_ESTIMATOR else "bfloat16"
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    slots = torch.cat([
        torch.arange(6 * PAGE + 60, 6 * PAGE + 64),  # ends block 6
        torch.tensor([1 * PAGE + 63, -1, 4 * PAGE + 63]),  # 1-token segments: blocks 1, 4
        torch.arange(3 * PAGE + 42, 3 * PAGE + 64),  # block 3, from the middle
        torch.arange(5 * PAGE, 5 * PAGE + 30),  # block 5, not filled
        torch.tensor([-1, -1]),
    ])  # fmt: skip
    results = {}
    for window in (1, 4, 16, 64):
        summaries = torch.zeros(8, 2, rows, 64, dtype=dtype)
        moira.write_page_summaries(kv, summaries, slots,
                                   launch={"writer": {"window_tokens": window}})  # fmt: skip
        results[window] = summaries
    filled = [1, 3, 4, 6]
    for window, summaries in results.items():
        assert torch.equal(summaries, results[1]), f"window_tokens={window}"
        written = summaries.flatten(1).ne(0).any(dim=1).nonzero().flatten().tolist()
        assert written == filled, f"window_tokens={window}"
    if estimator == "mvar":
        expected = ref.summarize_pages(kv, torch.tensor(filled))
        got = results[64][filled].float()
        assert torch.all((got - expected).abs() <= _bf16_ulp(expected) + 1e-6)


def test_writer_window_must_be_a_power_of_two():
    kv = make_kv_cache(2, 1, 64, "token_major", generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"writer launch window_tokens must be a power of two "
                       r"in \[1, 1024\], got 48"):  # fmt: skip
        moira.write_page_summaries(
            kv,
            torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16),
            torch.tensor([PAGE + 63]),
            launch={"writer": {"window_tokens": 48}},
        )


@pytest.mark.parametrize(
    ("estimator", "summary_dtype"),
    [("mvar", "bfloat16"), (DEFAULT_ESTIMATOR, "bfloat16"), (DEFAULT_ESTIMATOR, "int8"),
     (DEFAULT_ESTIMATOR, "int4")],
)  # fmt: skip
@pytest.mark.parametrize("dense", [False, True])
def test_estimate_writes_the_pages_that_filled(estimator, summary_dtype, dense):
    # The decode step's summary write, inside Estimate: rows whose new token
    # is their page's 64th (a one-page row, whose page z = 0 handles, and a
    # 4-page row) get that page summarized exactly as write_page_summaries
    # does (same bits); every other page and row is left alone. Dense rows
    # (no estimate) still get it.
    seq_lens = [64, 4 * PAGE, 3 * PAGE + 5, 130]
    kv, summaries, table, seq, query = make_decode_batch(
        seq_lens, 2, 2, 64, "token_major", estimator, summary_dtype=summary_dtype
    )
    expected = summaries.clone()  # every full page summarized by the writer
    filled = [int(table[0, 0]), int(table[1, 3])]
    integer = summaries.dtype != torch.bfloat16  # int8, or int4 keys (uint8)
    sentinel = 99 if integer else float("nan")
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype,
                               dense_batch_tokens=4096 if dense else 0)  # fmt: skip
    ws = moira.MoiraWorkspace(4, 4, 2, 64, table.shape[1], config, "cpu")
    _, scales = moira._summary_layout(summaries)  # int8 / int4: the scales row's fp32 view
    value_rows = summaries.shape[2] - 1 if integer else summaries.shape[2]
    logmass = {}
    for write in (False, True):
        # What the writer stores: the slot rows, and for int8 / int4 their scales.
        summaries[filled, :, :value_rows] = sentinel
        if integer:
            scales[filled] = float("nan")
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    estimator, ws.selector_params,
                                    write_filled_pages=write)  # fmt: skip
        logmass[write] = ws.logmass.clone()
        others = [b for b in range(summaries.shape[0]) if b not in filled]
        assert torch.equal(summaries[others], expected[others])
        if not write:
            written = summaries[filled, :, :value_rows]
            assert (
                torch.equal(written, torch.full_like(written, sentinel))
                or torch.isnan(written.float()).all()
            )
    assert torch.equal(summaries, expected)  # bit for bit, the filled pages included
    torch.testing.assert_close(logmass[True], logmass[False], rtol=0, atol=0, equal_nan=True)


def test_verify_page_summaries_finds_wrong_and_missing_pages():
    seq_lens = [3 * PAGE, 2 * PAGE + 9]
    kv, summaries, table, _, _ = make_decode_batch(seq_lens, 2, 2, 64, "token_major",
                                                   "mvar")  # fmt: skip

    def found(pages, mismatched, beyond_rounding):
        return {"pages": pages, "mismatched": mismatched, "beyond_rounding": beyond_rounding}

    assert moira.verify_page_summaries(kv, summaries) == found(5, 0, 0)  # 3 + 2 full pages
    wrong = summaries.clone()
    wrong[int(table[0, 1]), 1, 0, 5] += 1.0  # one channel of one KV head's mean
    assert moira.verify_page_summaries(kv, wrong) == found(5, 1, 1)
    rounded = summaries.clone()  # one value one bf16 step off: rounding, not a wrong key
    value = rounded[int(table[0, 2]), 0, 1, 7].float()
    rounded[int(table[0, 2]), 0, 1, 7] = (value * (1 + 2.0**-8)).to(torch.bfloat16)
    assert moira.verify_page_summaries(kv, rounded) == found(5, 1, 0)
    missing = summaries.clone()
    missing[int(table[1, 0])] = 0  # a full page that was never summarized
    assert moira.verify_page_summaries(kv, missing) == found(4, 0, 0)


# --------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "group", "head_size", "pattern"),
    [
        ("token_major", 1, 64, "random"),
        ("head_major", 3, 64, "concentrated"),
        ("token_major", 4, 128, "outlier"),
        ("head_major", 8, 128, "diffuse"),
    ],
)
@pytest.mark.parametrize("tile_pages", [16, 64])
def test_estimate_matches_reference(layout, group, head_size, pattern, tile_pages):
    # 16-page tiles: the sink, a middle tile and the current page fall in
    # different programs; 64: one tile holds the whole row.
    seq_lens = [1, 64, 65, 300, 64 * 5, 64 * 40 + 7]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, head_size, layout, pattern,
                                              estimator="mvar")  # fmt: skip
    scale = head_size**-0.5
    ws = moira.MoiraWorkspace(8, 2 * group, 2, head_size, table.shape[1],
                              moira.MoiraConfig.paper(), "cpu")  # fmt: skip
    ws.logmass.fill_(float("nan"))
    moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, scale, "mvar",
                                launch={"estimate": {"tile_pages": tile_pages}})  # fmt: skip
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        expected = ref.estimate_row_logmass(query[row], kv, summaries, table[row], seq_len, scale)
        torch.testing.assert_close(ws.logmass[row, :, :, :n], expected, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------
# Select
# --------------------------------------------------------------------------
def _random_logmass(num_rows, num_kv_heads, group, max_pages, seed, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    logmass = torch.randn(num_rows, num_kv_heads, group, max_pages, generator=gen)
    # Heavy-tailed pages (a few carry most of the mass), different per head.
    heavy = torch.rand(num_rows, num_kv_heads, 1, max_pages, generator=gen) < 0.1
    return logmass * spread + heavy * 4.0


def _run_select(logmass, seq_lens, config, launch=None):
    num_rows, num_kv_heads, group, max_pages = logmass.shape
    ws = moira.MoiraWorkspace(num_rows, num_kv_heads * group, num_kv_heads, 64,
                              max_pages, config, "cpu", launch=launch)  # fmt: skip
    ws.logmass.copy_(logmass)
    ws.page_list.fill_(-7)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    moira.select_pages(ws.logmass, seq, ws.pibar, ws.page_list, ws.list_lengths,
                       ws.selector_params, num_rows, max_pages, ws.read_stats,
                       launch=ws.launch)  # fmt: skip
    return ws


@pytest.fixture(params=[1, 4, 8], ids=lambda lanes: f"long_lanes{lanes}")
def long_lanes(request):
    """Both bisection forms for rows of >= 256 pages (one reduction per
    threshold, and K_B thresholds per 2D reduction) must give the same lists:
    Select's launch overrides."""
    return {"select": {"long_lanes": request.param}}


# Groups 1 (no GQA) and 4 (Llama-3.1-8B) run by default; 3 and 8 are slow in the interpreter.
@pytest.mark.parametrize("group", [1, pytest.param(3, marks=pytest.mark.slow), 4,
                                   pytest.param(8, marks=pytest.mark.slow)])  # fmt: skip
def test_select_lists_equal_reference_at_098(group, long_lanes):
    """Select's lists equal the float32 reference exactly, on 64 rows."""
    num_rows, num_kv_heads, max_pages = 16, 4, 300
    gen = torch.Generator().manual_seed(group)
    seq_lens = torch.randint(1, max_pages * PAGE + 1, (num_rows,), generator=gen)
    seq_lens[:4] = torch.tensor([1, 64, 129, max_pages * PAGE])  # edge lengths
    logmass = _random_logmass(num_rows, num_kv_heads, group, max_pages, seed=group)
    config = moira.MoiraConfig.paper(gamma=0.98)
    ws = _run_select(logmass, seq_lens.tolist(), config, launch=long_lanes)
    checked = 0
    for row, seq_len in enumerate(seq_lens.tolist()):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(num_kv_heads):
            expected = ref.select_pages(pibar[h], gamma=0.98)
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == expected.tolist(), (row, h)
            checked += 1
    assert checked >= 64


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.95, 0.99])
def test_select_coverage_reaches_gamma_with_fewest_pages(gamma, long_lanes):
    num_rows, max_pages = 6, 200
    seq_lens = [max_pages * PAGE, 5000, 3 * PAGE, 64 * 77 + 5, 999, 64 * 150]
    logmass = _random_logmass(num_rows, 2, 3, max_pages, seed=7)
    ws = _run_select(logmass, seq_lens, moira.MoiraConfig.paper(gamma=gamma), launch=long_lanes)
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            pages = ws.page_list[row, h, :count]
            assert pages[0] == 0 and pages[-1] == n - 1
            assert torch.all(pages[1:] > pages[:-1]), "list not in page order"
            kept = pibar[h, pages.long()].sum()
            assert kept >= gamma - 1e-5
            # Fewest: dropping the smallest kept middle page falls below gamma.
            middle = pibar[h, pages[1:-1].long()]
            if middle.numel():
                assert kept - middle.min() < gamma + 1e-5
    # Select accumulates the read fraction's numerator and denominator.
    total_pages = sum(math.ceil(s / PAGE) for s in seq_lens) * 2
    assert ws.read_stats.tolist() == [int(ws.list_lengths.sum()), total_pages]


def test_select_gamma_one_keeps_every_page():
    max_pages = 90
    seq_lens = [1, 64, 65, 64 * 90, 64 * 37 + 1]
    logmass = _random_logmass(len(seq_lens), 2, 4, max_pages, seed=3, spread=30.0)
    ws = _run_select(logmass, seq_lens, moira.MoiraConfig.paper(gamma=1.0))
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        for h in range(2):
            assert int(ws.list_lengths[row, h]) == n
            assert ws.page_list[row, h, :n].tolist() == list(range(n))


@pytest.mark.parametrize("fixed_pages", [1, 2, 5, 40])
def test_select_fixed_count(fixed_pages):
    max_pages = 64
    seq_lens = [1, 64 * 3, 64 * 64, 64 * 20 + 3]
    logmass = _random_logmass(len(seq_lens), 2, 3, max_pages, seed=fixed_pages)
    config = moira.MoiraConfig.paper(selector="fixed", fixed_pages=fixed_pages)
    ws = _run_select(logmass, seq_lens, config)
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            expected = ref.select_pages(pibar[h], fixed_pages=fixed_pages)
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == expected.tolist()
            assert count == min(n, max(fixed_pages, min(n, 2)))


@pytest.mark.parametrize("fraction", [0.05, 0.3, 1.0])
def test_select_fixed_fraction(fraction):
    max_pages = 70
    seq_lens = [1, 64 * 3, 64 * 70, 64 * 33 + 9]
    logmass = _random_logmass(len(seq_lens), 2, 4, max_pages, seed=21)
    ws = _run_select(
        logmass, seq_lens, moira.MoiraConfig.paper(selector="fixed", fixed_fraction=fraction)
    )
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            expected = ref.select_pages(pibar[h], fixed_fraction=fraction)
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == expected.tolist()
            assert count == max(min(n, 2), math.ceil(fraction * n))


@pytest.mark.parametrize("max_pages", [40, 300])
def test_select_fixed_count_with_ties_keeps_exactly_k(max_pages, long_lanes):
    """Flat attention (e.g. vLLM's dummy weights) gives every page the same
    share. Fixed count must still keep exactly K pages: the most recent ones."""
    seq_lens = [max_pages * PAGE, 20 * PAGE + 3]
    logmass = torch.full((len(seq_lens), 2, 3, max_pages), 4.1588831)
    logmass[1, 1, :, 5] += 2.0  # one page above the ties
    config = moira.MoiraConfig.paper(selector="fixed", fixed_pages=6)
    ws = _run_select(logmass, seq_lens, config, launch=long_lanes)
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            expected = ref.select_pages(pibar[h], fixed_pages=6)
            count = int(ws.list_lengths[row, h])
            assert count == 6
            assert ws.page_list[row, h, :count].tolist() == expected.tolist()
    assert ws.page_list[0, 0, :6].tolist() == [0] + list(range(max_pages - 5, max_pages))
    assert ws.page_list[1, 1, :6].tolist() == [0, 5, 17, 18, 19, 20]


def test_set_selector_switches_in_place():
    """The selector lives in device memory: set_selector changes what the
    same launches (and so a captured graph) select, without reallocating."""
    max_pages = 40
    seq_lens = [64 * 40, 64 * 17 + 3]
    logmass = _random_logmass(len(seq_lens), 2, 3, max_pages, seed=4)
    ws = _run_select(logmass, seq_lens, moira.MoiraConfig.paper(gamma=0.9))
    params = ws.selector_params.data_ptr()
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    for config in (
        moira.MoiraConfig.paper(gamma=1.0),
        moira.MoiraConfig.paper(selector="fixed", fixed_pages=3),
    ):
        ws.set_selector(config)
        moira.select_pages(ws.logmass, seq, ws.pibar, ws.page_list, ws.list_lengths,
                           ws.selector_params, len(seq_lens), max_pages, ws.read_stats)  # fmt: skip
        for row, seq_len in enumerate(seq_lens):
            n = math.ceil(seq_len / PAGE)
            expected = n if config.selector == "coverage" else 3
            assert ws.list_lengths[row].tolist() == [expected, expected]
    assert ws.selector_params.data_ptr() == params
    with pytest.raises(ValueError, match="cannot change"):
        ws.set_selector(moira.MoiraConfig.paper(attend_fill_blocks=5))


def test_select_rows_longer_than_4096_pages():
    """Rows past one register tile (e.g. 256k contexts) loop over tiles."""
    max_pages = 4096 + 300
    seq_lens = [max_pages * PAGE, 4097 * PAGE + 1, 200 * PAGE]
    logmass = _random_logmass(len(seq_lens), 1, 2, max_pages, seed=11)
    ws = _run_select(logmass, seq_lens, moira.MoiraConfig.paper(gamma=0.98))
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        expected = ref.select_pages(pibar[0], gamma=0.98)
        count = int(ws.list_lengths[row, 0])
        assert ws.page_list[row, 0, :count].tolist() == expected.tolist()


# --------------------------------------------------------------------------
# Attend + Merge, and the whole step
# --------------------------------------------------------------------------
def _gamma_one_step(config, seq_lens, group, head_size, layout):
    """Moira's step (output prefilled with 7) and dense attention on one batch."""
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, head_size, layout)
    ws = moira.MoiraWorkspace(8, 2 * group, 2, head_size, table.shape[1], config, "cpu")
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    scale = head_size**-0.5
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, scale)
    return out, ref.dense_decode(query, kv, table, seq, scale), ws


@pytest.mark.parametrize(
    ("layout", "group", "head_size"),
    [("token_major", 1, 64), ("head_major", 3, 64), ("token_major", 4, 128),
     ("head_major", 8, 128)],
)  # fmt: skip
def test_gamma_one_equals_dense(layout, group, head_size):
    # Rows: 1 token, one page, 2 and 7 pages, a ragged row, and a padded row
    # (seq_len 0, must stay untouched).
    config = moira.MoiraConfig.paper(gamma=1.0, **SMALL_FILL)
    seq_lens = [1, 64, 2 * PAGE, (3 * 2 + 1) * PAGE, 64 * 4 + 17, 0]
    out, dense, ws = _gamma_one_step(config, seq_lens, group, head_size, layout)
    for row, seq_len in enumerate(seq_lens[:-1]):
        n = math.ceil(seq_len / PAGE)
        assert ws.list_lengths[row].tolist() == [n, n]
    torch.testing.assert_close(out[:-1].float(), dense[:-1], atol=BF16_ATOL,
                               rtol=BF16_RTOL)  # fmt: skip
    assert torch.all(out[-1] == 7.0), "padded row was written"


def _assert_attend_equals_reference(out, query, kv, table, lists, seq_lens):
    """Attend's output of every row against the float32 reference over the same lists."""
    for row, seq_len in enumerate(seq_lens):
        keys, values = ref.row_keys_values(kv, table[row], seq_len)
        expected, _ = ref.attend_pages(query[row], keys, values, lists[row], seq_len, 0.125)
        torch.testing.assert_close(out[row].float(), expected, atol=BF16_ATOL,
                                   rtol=BF16_RTOL)  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "group", "pattern", "gamma", "estimator"),
    [
        ("token_major", 3, "concentrated", 0.98, DEFAULT_ESTIMATOR),
        ("head_major", 3, "outlier", 0.95, DEFAULT_ESTIMATOR),
        ("token_major", 1, "diffuse", 0.9, DEFAULT_ESTIMATOR),
        ("head_major", 4, "random", 0.98, DEFAULT_ESTIMATOR),
        ("token_major", 3, "outlier", 0.98, "mvar"),
        ("head_major", 4, "concentrated", 0.95, "mvar"),
    ],
)
def test_sparse_decode_matches_reference(layout, group, pattern, gamma, estimator):
    config = moira.MoiraConfig.paper(gamma=gamma, estimator=estimator, **SMALL_FILL)
    seq_lens = [64 * 12, 64 * 7 + 3, 100, 1]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, 64, layout, pattern,
                                              estimator=estimator)  # fmt: skip
    ws = moira.MoiraWorkspace(4, 2 * group, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    expected, lists = ref.sparse_decode(query, kv, summaries, table, seq, 0.125, gamma,
                                        estimator=estimator)  # fmt: skip
    for row in range(len(seq_lens)):
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist()
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_attend_accepts_any_page_list():
    """attend() runs other selectors' lists (here: every other page)."""
    config = moira.MoiraConfig.paper(**SMALL_FILL)
    seq_lens = [64 * 9 + 5, 64 * 3]
    kv, _, table, seq, query = _batch(seq_lens, 2, 2, 64, "token_major")
    ws = moira.MoiraWorkspace(2, 4, 2, 64, table.shape[1], config, "cpu")
    lists = [[torch.tensor([0, 2, 4, 6, 8, 9])] * 2, [torch.tensor([1])] * 2]
    page_list, list_lengths = pack_page_lists(lists, table.shape[1])
    out = torch.empty_like(query)
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, 0.125)
    _assert_attend_equals_reference(out, query, kv, table, lists, seq_lens)


def test_launches_are_functions_of_the_shapes_with_overrides():
    # Attend: 3 stages on bf16 pages, 5 on fp8 ones (half the bytes per stage); an
    # override (a sweep's candidate) applies to both. Estimate: 64-page programs for
    # mvar on int8 summaries, 32 otherwise. Nothing is module state: a call with
    # overrides leaves the next call's defaults as they were.
    assert moira.attend_launch(kv_fp8=False) == moira.AttendLaunch(4, 3, 168)
    assert moira.attend_launch(kv_fp8=True).num_stages == 5
    assert moira.attend_launch(True, {"num_stages": 2}).num_stages == 2
    assert moira.attend_launch(kv_fp8=True).num_stages == 5
    assert moira.estimate_launch(0, True).tile_pages == 64
    assert moira.estimate_launch(0, False).tile_pages == 32
    assert moira.estimate_launch(8, True) == moira.EstimateLaunch(64, 4, 3, 128)
    assert moira.estimate_launch(0, True, {"tile_pages": 16}).tile_pages == 16
    assert moira.writer_launch().num_warps == moira.estimate_launch(8, True).num_warps
    assert moira.select_launch(4096, 1) == moira.SelectLaunch(lanes=8, num_warps=16)
    assert moira.select_launch(4096, 2) == moira.SelectLaunch(lanes=1, num_warps=16)
    assert moira.select_launch(256, 1) == moira.SelectLaunch(lanes=8, num_warps=4)


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ({"attend": {"tile_pages": 2}}, r"attend launch overrides \['tile_pages'\] are not among "
                                        r"\['maxnreg', 'num_stages', 'num_warps'\]"),
        ({"estimate": {"tile_pages": 48}}, r"estimate launch tile_pages must be a power of two"),
        ({"select": {"long_lanes": 3}}, r"select launch long_lanes must be a power of two"),
        ({"refine": {"pipeline_stages": 3}}, r"launch overrides for \['refine'\]; kernels: "
                                             r"\('writer', 'estimate', 'select', 'attend'"),
        ({"merge": {}}, r"launch overrides for \['merge'\]; kernels: \('writer', 'estimate'"),
        ({"step": {"early_trigger": True}}, r"step launch overrides \['early_trigger'\]"),
    ],
)  # fmt: skip
def test_workspace_refuses_unknown_launch_overrides(launch, message):
    with pytest.raises(ValueError, match=message):
        moira.MoiraWorkspace(1, 2, 1, 64, 4, moira.MoiraConfig.paper(), "cpu", launch=launch)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8"])
def test_attend_uneven_lists_match_reference(kv_dtype):
    """Lists of 1, 3, 5 and 6 pages, entries out of order, a partial last page,
    and 4 blocks whose runs cut lists at odd positions all equal the reference."""
    config = moira.MoiraConfig.paper(attend_fill_blocks=4)
    seq_lens = [64 * 9 + 5, 64 * 3, 64 * 6]
    kv, _, table, seq, query = _batch(seq_lens, 2, 3, 64, "head_major", seed=5)
    scales = {}
    if kv_dtype == "fp8":
        k_scale, v_scale = 0.0431, 0.0173
        kv = ref.quantize_kv_cache_fp8(kv, k_scale, v_scale)
        scales = {"k_scale": torch.tensor([k_scale]), "v_scale": torch.tensor([v_scale])}
    lists = [
        [torch.tensor([9, 0, 2, 4, 6]), torch.tensor([0, 1, 2, 3, 8, 9])],
        [torch.tensor([1]), torch.tensor([2, 0, 1])],
        [torch.tensor([5, 0, 3]), torch.tensor([0, 1, 2, 3, 4, 5])],
    ]
    page_list, list_lengths = pack_page_lists(lists, table.shape[1])
    ws = moira.MoiraWorkspace(3, 6, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, 0.125, **scales)
    kv_values = ref.dequantize_kv_cache(kv, **scales) if scales else kv
    _assert_attend_equals_reference(out, query, kv_values, table, lists, seq_lens)


def test_fill_blocks_default_is_the_blocks_the_device_holds():
    """attend_fill_blocks = 0 (default) resolves to ATTEND_BLOCKS_PER_SM per SM
    (off the GPU: 132 SMs, an H200); a set value is used as given."""
    ws = moira.MoiraWorkspace(2, 2, 1, 64, 8, moira.MoiraConfig.paper(), "cpu")
    assert ws.attend_fill_blocks == moira.ATTEND_BLOCKS_PER_SM * 132 == 396
    ws = moira.MoiraWorkspace(2, 2, 1, 64, 8, moira.MoiraConfig.paper(attend_fill_blocks=7), "cpu")
    assert ws.attend_fill_blocks == 7


def test_step_list_pages_sum_the_lists_and_attend_agrees_without_them():
    """Select leaves the sum of the step's list lengths in
    workspace.kept_total (Estimate zeroes it first, so a second step does not
    accumulate); attend() without it sums the counts itself and gives the
    same output bit for bit."""
    config = moira.MoiraConfig.paper(gamma=0.9, **SMALL_FILL)
    seq_lens = [64 * 12, 64 * 7 + 3, 100, 1]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, 3, 64, "head_major", "concentrated")
    ws = moira.MoiraWorkspace(4, 6, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    for _ in range(2):
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
        assert int(ws.kept_total[0]) == int(ws.list_lengths[:4].sum())
    ws.kept_total.fill_(-5)
    again = torch.full_like(out, float("nan"))
    moira.attend(query, kv, table, seq, ws.page_list, ws.list_lengths, again, ws, 0.125)
    assert int(ws.kept_total[0]) == int(ws.list_lengths[:4].sum())
    assert torch.equal(again, out)


def test_dense_batch_tokens_reads_short_rows_whole():
    """Rows whose pages x decode rows <= dense_batch_tokens / 64 skip Estimate
    (their log-masses stay unwritten) and keep every page; longer rows in
    the same batch go through the coverage rule as usual."""
    seq_lens = [64 * 3 + 5, 64 * 12, 64 * 20]  # 4, 12, 20 pages; x 3 rows: 12, 36, 60
    config = moira.MoiraConfig.paper(gamma=0.5, dense_batch_tokens=40 * PAGE, **SMALL_FILL)
    kv, summaries, table, seq, query = _batch(seq_lens, 2, 3, 64, "head_major", "concentrated")
    ws = moira.MoiraWorkspace(3, 6, 2, 64, table.shape[1], config, "cpu")
    ws.logmass.fill_(float("nan"))
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    dense = ref.dense_decode(query, kv, table, seq, 0.125)
    expected, lists = ref.sparse_decode(query, kv, summaries, table, seq, 0.125, 0.5,
                                        estimator=config.estimator)  # fmt: skip
    for row in (0, 1):
        n = math.ceil(seq_lens[row] / PAGE)
        assert ws.list_lengths[row].tolist() == [n, n]
        assert ws.page_list[row, :, :n].tolist() == [list(range(n))] * 2
        assert ws.logmass[row].isnan().all(), "Estimate ran on a dense row"
        torch.testing.assert_close(out[row].float(), dense[row], atol=BF16_ATOL,
                                   rtol=BF16_RTOL)  # fmt: skip
    for h in range(2):
        count = int(ws.list_lengths[2, h])
        assert ws.page_list[2, h, :count].tolist() == lists[2][h].tolist()
        assert count < 20, "the long row should be sparse at gamma=0.5"
    torch.testing.assert_close(out[2].float(), expected[2], atol=BF16_ATOL, rtol=BF16_RTOL)
    # Switched off in place (graphs read it from selector_params): all sparse.
    ws.set_selector(dataclasses.replace(config, dense_batch_tokens=0))
    ws.logmass.fill_(float("nan"))
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    for row in range(3):
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist()


# --------------------------------------------------------------------------
# Attend's schedule: N_F blocks share the step's pages evenly
# --------------------------------------------------------------------------
def _page_schedule_parts(list_lengths, num_blocks):
    """Parts (one per block and list it touches) of every list, computed on the
    host from the lengths."""
    counts = [int(c) for c in list_lengths.flatten()]
    total = sum(counts)
    chunk = max(-(-total // num_blocks), 1)
    parts, first = [], 0
    for n in counts:
        parts.append(0 if n == 0 else (first + n - 1) // chunk - first // chunk + 1)
        first += n
    return parts


@pytest.mark.parametrize(
    ("layout", "group", "head_size", "fill_blocks"),
    [("token_major", 1, 64, 1), ("head_major", 3, 64, 3), ("token_major", 4, 128, 7),
     ("head_major", 8, 128, 396), ("head_major", 3, 64, 10)],
)  # fmt: skip
def test_page_schedule_gamma_one_equals_dense(layout, group, head_size, fill_blocks):
    """Every page kept: Attend equals dense attention for 1, a few and more
    blocks than pages (1-token, 1-page, ragged and padded rows),
    and leaves the padded row untouched."""
    config = moira.MoiraConfig.paper(gamma=1.0, attend_fill_blocks=fill_blocks)
    seq_lens = [1, 64, 2 * PAGE, 7 * PAGE, 64 * 4 + 17, 0]
    out, dense, _ = _gamma_one_step(config, seq_lens, group, head_size, layout)
    torch.testing.assert_close(out[:-1].float(), dense[:-1], atol=BF16_ATOL,
                               rtol=BF16_RTOL)  # fmt: skip
    assert torch.all(out[-1] == 7.0), "padded row was written"


@pytest.mark.parametrize(
    ("layout", "group", "pattern", "gamma", "fill_blocks"),
    [("token_major", 3, "concentrated", 0.98, 5), ("head_major", 4, "outlier", 0.95, 2),
     ("head_major", 1, "diffuse", 0.9, 16)],
)  # fmt: skip
def test_page_schedule_sparse_decode_matches_reference(layout, group, pattern, gamma,
                                                       fill_blocks):  # fmt: skip
    """The coverage rule's lists attended over N_F blocks equal the reference
    step (its lists are Select's, so only Attend and Merge differ)."""
    config = moira.MoiraConfig.paper(gamma=gamma, attend_fill_blocks=fill_blocks)
    seq_lens = [64 * 12, 64 * 7 + 3, 100, 1]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, 64, layout, pattern)
    ws = moira.MoiraWorkspace(4, 2 * group, 2, 64, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    expected, _ = ref.sparse_decode(query, kv, summaries, table, seq, 0.125, gamma,
                                    estimator=config.estimator)  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=BF16_RTOL)


@pytest.mark.parametrize("fill_blocks", [1, 4, 6, 40])
def test_page_schedule_runs_cross_lists_and_skip_empty_ones(fill_blocks):
    """attend() with uneven lists, empty ones among them (first, middle and
    last list): each list's output equals the
    reference over its pages, lists of no pages leave their output as it
    was, and Attend wrote a partial slot exactly for each part of a list
    that spans several blocks (slots start NaN)."""
    config = moira.MoiraConfig.paper(attend_fill_blocks=fill_blocks)
    seq_lens = [64 * 9 + 5, 64 * 3, 64 * 14]
    kv, _, table, seq, query = _batch(seq_lens, 2, 2, 64, "head_major", seed=4)
    ws = moira.MoiraWorkspace(3, 4, 2, 64, table.shape[1], config, "cpu")
    ws.partial_lse.fill_(float("nan"))
    lists = [
        [torch.tensor([], dtype=torch.long), torch.tensor([0, 2, 4, 6, 8, 9])],
        [torch.tensor([0, 1, 2]), torch.tensor([], dtype=torch.long)],
        [torch.arange(14), torch.tensor([0, 5, 13])],
    ]
    page_list, list_lengths = pack_page_lists(lists, table.shape[1])
    out = torch.full(query.shape, 5.0, dtype=torch.bfloat16)
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, 0.125)
    for row, seq_len in enumerate(seq_lens):
        keys, values = ref.row_keys_values(kv, table[row], seq_len)
        for h in range(2):
            heads = slice(2 * h, 2 * h + 2)
            if len(lists[row][h]) == 0:
                assert torch.all(out[row, heads] == 5.0), "an empty list was written"
                continue
            same_list = [lists[row][h]] * 2  # the reference wants a page per head
            expected, _ = ref.attend_pages(query[row], keys, values, same_list, seq_len, 0.125)
            torch.testing.assert_close(out[row, heads].float(), expected[heads],
                                       atol=BF16_ATOL, rtol=BF16_RTOL)  # fmt: skip
    parts = _page_schedule_parts(list_lengths, fill_blocks)
    written = ws.partial_lse.view(-1, 2)[:, 0].isfinite()  # slot (block + list) x G heads
    assert int(written.sum()) == sum(p for p in parts if p > 1)


def test_merge_matches_reference_lse_combine():
    gen = torch.Generator().manual_seed(5)
    chunks = torch.randn(4, 3, 8, generator=gen)
    lses = torch.randn(4, 3, generator=gen) * 3
    merged, lse = ref.merge_partials(chunks, lses)
    # Same combine as softmax over the concatenation of the chunks' logits.
    weights = torch.softmax(lses, dim=0).unsqueeze(-1)
    torch.testing.assert_close(merged, (weights * chunks).sum(0))
    torch.testing.assert_close(lse, torch.logsumexp(lses, 0))


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gamma=0.0), "gamma must be in \\(0, 1\\]"),
        (dict(gamma=1.5), "gamma must be in \\(0, 1\\]"),
        (dict(selector="topk"), "selector must be one of"),
        (dict(selector="fixed"), "needs exactly one of fixed_pages"),
        (dict(selector="fixed", fixed_pages=0), "needs fixed_pages"),
        (dict(selector="fixed", fixed_fraction=1.5), "fixed_fraction must be in"),
        (dict(selector="fixed", fixed_pages=3, fixed_fraction=0.5), "exactly one of"),
        (dict(fixed_pages=4), "only used with selector='fixed'"),
        (dict(attend_fill_blocks=-1), "attend_fill_blocks must be an integer >= 0"),
        (dict(dense_batch_tokens=-64), "dense_batch_tokens must be an integer >= 0"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moira.MoiraConfig.paper(**kwargs).validate()


def test_selector_values_carry_the_dense_row_threshold_in_pages():
    # Estimate and Select compare pages x rows with selector_params[3].
    assert moira.MoiraConfig.paper().selector_values()[3] == 0.0
    assert moira.MoiraConfig.paper(dense_batch_tokens=32768).selector_values()[3] == 512.0
    fixed = moira.MoiraConfig.paper(selector="fixed", fixed_pages=5, dense_batch_tokens=100)
    assert fixed.selector_values() == (0.98, 5.0, 0.0, 1.0)  # whole pages: 100 // 64


def test_workspace_rejects_unsupported_geometry():
    with pytest.raises(ValueError, match="head_size must be one of"):
        moira.MoiraWorkspace(2, 8, 2, 96, 4, moira.MoiraConfig.paper(), "cpu")
    with pytest.raises(ValueError, match="multiple of"):
        moira.MoiraWorkspace(2, 6, 4, 64, 4, moira.MoiraConfig.paper(), "cpu")


# --------------------------------------------------------------------------
# Tensor parallelism: per-rank KV-head shards
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.slow
def test_tensor_parallel_shards_equal_the_unsharded_step(layout):
    """vLLM's tensor parallelism gives each rank a contiguous block of KV heads
    with their G query heads, its own KV cache, summaries and workspace. Every
    Moira step is per (row, KV head), so each rank's step on its shard must
    give bitwise the page lists and read counts of the unsharded step. A
    rank's Attend runs follow its own total pages, so a list may be cut
    elsewhere than in the unsharded step: outputs agree to rounding."""
    tp, num_kv_heads, group, head_size = 2, 4, 3, 64
    seq_lens = [1, 64, 64 * 9 + 5, 64 * 30, 64 * 17 + 63]
    kv, summaries, table, seq, query = _batch(seq_lens, num_kv_heads, group, head_size, layout,
                                              pattern="concentrated")  # fmt: skip
    config = moira.MoiraConfig.paper(gamma=0.95, **SMALL_FILL)
    scale = head_size**-0.5
    whole = moira.MoiraWorkspace(8, num_kv_heads * group, num_kv_heads, head_size,
                                 table.shape[1], config, "cpu")  # fmt: skip
    out_whole = torch.zeros_like(query)
    moira.moira_decode(query, kv, summaries, table, seq, out_whole, whole, scale)
    heads_per_rank = num_kv_heads // tp
    kept = total = 0
    for rank in range(tp):
        kv_heads = slice(rank * heads_per_rank, (rank + 1) * heads_per_rank)
        q_heads = slice(kv_heads.start * group, kv_heads.stop * group)
        kv_rank = kv[:, kv_heads].clone()  # the rank's own cache, same layout
        summaries_rank = torch.zeros_like(summaries[:, kv_heads])
        moira.write_page_summaries(kv_rank, summaries_rank, full_page_slots(table, seq_lens))
        assert torch.equal(summaries_rank, summaries[:, kv_heads])
        ws = moira.MoiraWorkspace(8, heads_per_rank * group, heads_per_rank, head_size,
                                  table.shape[1], config, "cpu")  # fmt: skip
        query_rank = query[:, q_heads].contiguous()
        out = torch.zeros_like(query_rank)
        moira.moira_decode(query_rank, kv_rank, summaries_rank, table, seq, out, ws, scale)
        rows = len(seq_lens)
        torch.testing.assert_close(out.float(), out_whole[:, q_heads].float(),
                                   atol=BF16_ATOL, rtol=BF16_RTOL)  # fmt: skip
        assert torch.equal(ws.list_lengths[:rows], whole.list_lengths[:rows, kv_heads])
        for row in range(rows):
            for h in range(heads_per_rank):
                n = int(ws.list_lengths[row, h])
                assert torch.equal(ws.page_list[row, h, :n],
                                   whole.page_list[row, kv_heads.start + h, :n])  # fmt: skip
        kept += int(ws.read_stats[0])
        total += int(ws.read_stats[1])
    assert [kept, total] == whole.read_stats.tolist()
    assert kept < total, "the case must be sparse to test anything"


def test_decode_step_padded_query_rows_raise_no_numpy_warnings():
    """A GQA group of 3 heads is padded to 4 rows in Select's tile: the padded
    rows' softmax denominators are 0 and must not be divided by (the
    interpreter computes every lane in numpy, so x / 0 would warn)."""
    import warnings

    kv, summaries, table, seq, query = _batch([64 * 9 + 5, 64 * 3, 1], 2, 3, 64, "token_major")
    config = moira.MoiraConfig.paper(gamma=0.9, **SMALL_FILL)
    ws = moira.MoiraWorkspace(4, 6, 2, 64, table.shape[1], config, "cpu")
    out = torch.zeros_like(query)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert torch.isfinite(out.float()).all()
