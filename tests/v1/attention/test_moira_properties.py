# SPDX-License-Identifier: Apache-2.0
"""Property-based tests of every Moira kernel against the float32 reference (CPU).

Hypothesis draws the batch: number of rows, ragged lengths from one token to a few pages
(padded rows with ``seq_len == 0`` included), GQA group G in {1, 2, 3, 4, 8}, head size
64/128, 1-2 KV heads, both KV layouts, three cache memory layouts (contiguous, a view
sliced out of a bigger buffer, a per-block padding stride), attention patterns, gamma in
(0, 1] and the fixed-count selector. Properties:

- Summaries are within one bf16 step of the fp32 mean/variance of the page's keys.
- Estimate equals the reference log-masses (fp32, summation order only).
- Select's page lists equal the reference's exactly, computed from the same log-masses.
- Attend + Merge equal reference attention over the kernel's own lists (bf16 tolerance);
  at gamma = 1 they also equal dense attention; padded rows and empty lists are untouched.

Plus one deterministic test that block ids whose element offsets exceed 2**31 address
correctly (int64 index math), on a lazily committed virtual-memory cache.

Runs are derandomized (same examples every run, CI-stable). ``HYPOTHESIS_EXPLORE=1``
draws fresh random examples, 5x as many (slower, for local bug hunting).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.v1.attention.moira_test_utils import (
    PAGE,
    make_block_table,
    make_kv_cache,
    shape_attention,
)
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2
# Estimate is fp32 on both sides; only the summation order differs.
LOGMASS_ATOL, LOGMASS_RTOL = 1e-4, 1e-4

_EXPLORE = os.environ.get("HYPOTHESIS_EXPLORE", "0") == "1"


def _settings(max_examples: int):
    return settings(
        max_examples=max_examples * (5 if _EXPLORE else 1),
        deadline=None,
        derandomize=not _EXPLORE,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------
def make_cache(num_blocks, num_kv_heads, head_size, layout, variant, gen):
    """bf16 logical view ``[blocks, H_kv, 64, 2D]`` in one of three memory layouts.

    ``contiguous``: the usual cache. ``sliced``: a view cut out of a bigger buffer
    (storage offset, extra blocks, heads, tokens and channels around it). ``padded``:
    a flat buffer viewed with a block stride that is the page size plus an odd pad.
    """
    two_d = 2 * head_size
    if variant == "contiguous":
        return make_kv_cache(num_blocks, num_kv_heads, head_size, layout, generator=gen)
    if variant == "sliced":
        bf16 = torch.bfloat16
        if layout == "token_major":
            big = torch.zeros(num_blocks + 2, PAGE + 3, num_kv_heads + 1, two_d + 16, dtype=bf16)
            view = big[1 : num_blocks + 1, 2 : PAGE + 2, 1:, 16 : 16 + two_d].permute(0, 2, 1, 3)
        else:
            big = torch.zeros(num_blocks + 2, num_kv_heads + 1, PAGE + 3, two_d + 16, dtype=bf16)
            view = big[1 : num_blocks + 1, 1:, 2 : PAGE + 2, 16 : 16 + two_d]
    elif variant == "padded":
        page_elems = PAGE * num_kv_heads * two_d
        block_stride = page_elems + 40
        offset = 24
        flat = torch.zeros(offset + num_blocks * block_stride, dtype=torch.bfloat16)
        if layout == "token_major":
            strides = (block_stride, two_d, num_kv_heads * two_d, 1)
        else:
            strides = (block_stride, PAGE * two_d, two_d, 1)
        view = torch.as_strided(flat, (num_blocks, num_kv_heads, PAGE, two_d), strides, offset)
    else:
        raise ValueError(variant)
    view.copy_(torch.randn(view.shape, generator=gen).to(torch.bfloat16))
    assert not view.is_contiguous()
    return view


def summarize_full_pages(kv, summaries, table, seq_lens):
    full = [
        int(table[r, p]) * PAGE + PAGE - 1 for r, s in enumerate(seq_lens) for p in range(s // PAGE)
    ]
    moira.write_page_summaries(kv, summaries, torch.tensor(full, dtype=torch.int64))


@st.composite
def batches(draw, max_rows=4, max_pages=6):
    num_rows = draw(st.integers(1, max_rows))
    pages = st.integers(1, max_pages)
    seq_lens = []
    for _ in range(num_rows):
        n = draw(pages)
        tail = draw(st.sampled_from(["full", "one", "any"]))
        if tail == "full":
            seq_lens.append(n * PAGE)
        elif tail == "one":
            seq_lens.append((n - 1) * PAGE + 1)
        else:
            seq_lens.append(draw(st.integers((n - 1) * PAGE + 1, n * PAGE)))
    if draw(st.booleans()):  # a padded row (seq_len 0), anywhere in the batch
        seq_lens.insert(draw(st.integers(0, num_rows)), 0)
    return dict(
        seq_lens=seq_lens,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 3, 4, 8])),
        head_size=draw(st.sampled_from([64, 128])),
        layout=draw(st.sampled_from(["token_major", "head_major"])),
        variant=draw(st.sampled_from(["contiguous", "sliced", "padded"])),
        pattern=draw(st.sampled_from(["random", "concentrated", "outlier", "diffuse"])),
        slack_pages=draw(st.integers(0, 2)),  # block table wider than the longest row
        seed=draw(st.integers(0, 2**20)),
    )


def build(case):
    gen = torch.Generator().manual_seed(case["seed"])
    seq_lens = case["seq_lens"]
    hkv, group, d = case["num_kv_heads"], case["group"], case["head_size"]
    num_blocks = sum(math.ceil(s / PAGE) for s in seq_lens) + 3
    width = max(math.ceil(s / PAGE) for s in seq_lens) + case["slack_pages"]
    kv = make_cache(num_blocks, hkv, d, case["layout"], case["variant"], gen)
    table = make_block_table(seq_lens, num_blocks, width, generator=gen)
    query = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(torch.bfloat16)
    shape_attention(kv, query, table, seq_lens, case["pattern"], generator=gen)
    slots = moira.summary_slots(case.get("estimator", "mvar"))
    summaries = torch.zeros(num_blocks, hkv, slots, d, dtype=torch.bfloat16)
    summarize_full_pages(kv, summaries, table, seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return kv, summaries, table, seq, query


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def _lists(ws, row, num_kv_heads):
    return [
        ws.page_list[row, h, : int(ws.list_lengths[row, h])].tolist() for h in range(num_kv_heads)
    ]


# --------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------
@_settings(10)
@given(case=batches(max_rows=3, max_pages=4))
def test_summaries_property(case):
    kv, summaries, table, seq, _ = build(case)
    blocks = [int(table[r, p]) for r, s in enumerate(case["seq_lens"]) for p in range(s // PAGE)]
    if not blocks:
        return
    expected = ref.summarize_pages(kv, torch.tensor(blocks))
    got = summaries[blocks].float()
    assert torch.all((got - expected).abs() <= _bf16_ulp(expected) + 1e-6)
    # Partial pages and unused blocks are never summarized.
    untouched = sorted(set(range(kv.shape[0])) - set(blocks))
    assert summaries[untouched].eq(0).all()


# --------------------------------------------------------------------------
# Select alone, on random log-masses (many pages, cheap: Select has no cache)
# --------------------------------------------------------------------------
@st.composite
def logmass_cases(draw):
    num_rows = draw(st.integers(1, 4))
    max_pages = draw(st.integers(1, 300))
    seq_lens = [draw(st.integers(0, max_pages * PAGE)) for _ in range(num_rows)]
    selector = draw(st.sampled_from(["coverage", "coverage", "fixed", "fraction"]))
    gamma = draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0)))
    fixed = draw(st.integers(1, max_pages + 2)) if selector == "fixed" else None
    fraction = draw(st.floats(0.01, 1.0)) if selector == "fraction" else None
    return dict(
        seq_lens=seq_lens,
        max_pages=max_pages,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 3, 4, 8])),
        spread=draw(st.sampled_from([0.1, 1.0, 3.0, 30.0])),
        gamma=gamma,
        fixed_pages=fixed,
        fixed_fraction=fraction,
        seed=draw(st.integers(0, 2**20)),
    )


def _config(case, **splits):
    splits = {"estimator": case.get("estimator", "mvar"), **splits}
    if case["fixed_pages"] is not None:
        return moira.MoiraConfig.paper(selector="fixed", fixed_pages=case["fixed_pages"], **splits)
    if case["fixed_fraction"] is not None:
        return moira.MoiraConfig.paper(
            selector="fixed", fixed_fraction=case["fixed_fraction"], **splits
        )
    return moira.MoiraConfig.paper(gamma=case["gamma"], **splits)


def _ref_select(pibar, case):
    if case["fixed_pages"] is not None or case["fixed_fraction"] is not None:
        return ref.select_pages(
            pibar, fixed_pages=case["fixed_pages"], fixed_fraction=case["fixed_fraction"]
        )
    return ref.select_pages(pibar, gamma=case["gamma"])


@_settings(30)
@given(case=logmass_cases())
def test_select_property(case):
    gen = torch.Generator().manual_seed(case["seed"])
    rows, hkv, g, mp = len(case["seq_lens"]), case["num_kv_heads"], case["group"], case["max_pages"]
    logmass = torch.randn(rows, hkv, g, mp, generator=gen) * case["spread"]
    logmass += (torch.rand(rows, hkv, 1, mp, generator=gen) < 0.1) * 4.0
    config = _config(case)
    ws = moira.MoiraWorkspace(rows, hkv * g, hkv, 64, mp, config, "cpu")
    ws.logmass.copy_(logmass)
    ws.page_list.fill_(-7)
    seq = torch.tensor(case["seq_lens"], dtype=torch.int32)
    moira.select_pages(ws.logmass, seq, ws.pibar, ws.page_list, ws.list_lengths,
                       ws.selector_params, rows, mp, ws.read_stats)  # fmt: skip
    total_pages = 0
    for row, seq_len in enumerate(case["seq_lens"]):
        n = math.ceil(seq_len / PAGE)
        total_pages += n * hkv
        if n == 0:
            assert ws.list_lengths[row].tolist() == [0] * hkv
            continue
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(hkv):
            expected = _ref_select(pibar[h], case)
            got = _lists(ws, row, hkv)[h]
            if case["fixed_pages"] is None and case["fixed_fraction"] is None:
                assert got == expected.tolist(), (row, h)
            else:
                _assert_same_top_k(got, expected.tolist(), pibar[h])
    assert ws.read_stats.tolist() == [int(ws.list_lengths[:rows].sum()), total_pages]


def _assert_same_top_k(got, expected, pibar):
    """Fixed count: exactly K pages, sink first and current last, and the kept
    shares equal the reference's up to the bisection's resolution (2^-24 of the
    largest share); within it, ties go to recent pages in both."""
    assert len(got) == len(expected)
    assert got[:1] == expected[:1] and got[-1:] == expected[-1:]
    assert got == sorted(got)
    kept = sorted(float(pibar[p]) for p in got[1:-1])
    want = sorted(float(pibar[p]) for p in expected[1:-1])
    resolution = float(pibar[1:-1].max()) * 2.0**-22 if len(pibar) > 2 else 0.0
    assert all(abs(a - b) <= resolution for a, b in zip(kept, want)), (got, expected)


# --------------------------------------------------------------------------
# The whole step: Estimate -> Select -> Attend -> Merge
# --------------------------------------------------------------------------
@st.composite
def decode_cases(draw):
    case = draw(batches(max_rows=3, max_pages=5))
    selector = draw(st.sampled_from(["coverage", "coverage", "coverage", "fixed", "fraction"]))
    case["gamma"] = draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
    case["fixed_pages"] = draw(st.integers(1, 7)) if selector == "fixed" else None
    case["fixed_fraction"] = draw(st.floats(0.05, 1.0)) if selector == "fraction" else None
    # The paper's estimator and the default (stored keys + REM spread term).
    case["estimator"] = draw(st.sampled_from(sorted({"mvar", moira.MOIRA_DEFAULT_ESTIMATOR})))
    return case


@_settings(20)
@given(case=decode_cases())
def test_decode_step_property(case):
    kv, summaries, table, seq, query = build(case)
    seq_lens, hkv, d = case["seq_lens"], case["num_kv_heads"], case["head_size"]
    config = _config(case, **SMALL_FILL)
    rows = len(seq_lens)
    ws = moira.MoiraWorkspace(rows + 1, query.shape[1], hkv, d, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    scale = d**-0.5
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, scale)

    fixed = case["fixed_pages"] is not None or case["fixed_fraction"] is not None
    gamma_one = not fixed and case["gamma"] >= 1.0
    dense = ref.dense_decode(query, kv, table, seq, scale) if gamma_one else None
    for row, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.isnan(out[row].float()).all(), "padded row was written"
            continue
        n = math.ceil(seq_len / PAGE)
        # Estimate: the reference math on the same summaries.
        expected_lm = ref.estimate_row_logmass(
            query[row], kv, summaries, table[row], seq_len, scale, case["estimator"]
        )
        lm = ws.logmass[row, :, :, :n]
        torch.testing.assert_close(lm, expected_lm, atol=LOGMASS_ATOL, rtol=LOGMASS_RTOL)
        # Select: exactly the reference's lists from the same log-masses.
        pibar = ref.group_mean_shares(lm)
        expected_lists = [_ref_select(pibar[h], case) for h in range(hkv)]
        got_lists = _lists(ws, row, hkv)
        assert got_lists == [e.tolist() for e in expected_lists], row
        for lst in got_lists:
            assert lst[0] == 0 and lst[-1] == n - 1
        # Attend + Merge: reference attention over those lists.
        keys, values = ref.row_keys_values(kv, table[row], seq_len)
        expected, _ = ref.attend_pages(query[row], keys, values, expected_lists, seq_len, scale)
        got = out[row].float()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=BF16_ATOL, rtol=BF16_RTOL)
        if dense is not None:
            assert got_lists == [list(range(n))] * hkv
            torch.testing.assert_close(got, dense[row], atol=BF16_ATOL, rtol=BF16_RTOL)


# --------------------------------------------------------------------------
# Attend + Merge over arbitrary lists (other selectors), empty lists included
# --------------------------------------------------------------------------
@_settings(10)
@given(case=batches(max_rows=3, max_pages=6), data=st.data())
def test_attend_any_lists_property(case, data):
    kv, _, table, seq, query = build(case)
    seq_lens, hkv, d = case["seq_lens"], case["num_kv_heads"], case["head_size"]
    rows = len(seq_lens)
    page_list = torch.full((rows, hkv, table.shape[1]), -1, dtype=torch.int32)
    list_lengths = torch.zeros(rows, hkv, dtype=torch.int32)
    lists = []
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        row_lists = []
        for h in range(hkv):
            pages = data.draw(st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n))
            pages = sorted(pages) if data.draw(st.booleans()) else pages  # any order
            page_list[row, h, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            list_lengths[row, h] = len(pages)
            row_lists.append(pages)
        lists.append(row_lists)
    config = moira.MoiraConfig.paper(**SMALL_FILL)
    ws = moira.MoiraWorkspace(rows, query.shape[1], hkv, d, table.shape[1], config, "cpu")
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    scale = d**-0.5
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, scale)
    group = case["group"]
    for row, seq_len in enumerate(seq_lens):
        keys, values = (None, None)
        if seq_len:
            keys, values = ref.row_keys_values(kv, table[row], seq_len)
        for h in range(hkv):
            got = out[row, h * group : (h + 1) * group].float()
            if not lists[row][h]:
                assert torch.isnan(got).all(), "an empty list wrote output"
                continue
            expected, _ = ref.attend_pages(
                query[row, h * group : (h + 1) * group], keys[h : h + 1], values[h : h + 1],
                [torch.tensor(lists[row][h])], seq_len, scale,
            )  # fmt: skip
            torch.testing.assert_close(got, expected, atol=BF16_ATOL, rtol=BF16_RTOL)


# --------------------------------------------------------------------------
# Index overflow: element offsets past 2**31 (block id * block stride)
# --------------------------------------------------------------------------
def _virtual_empty(numel: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A large CPU tensor whose pages are committed only when touched (Linux mmap)."""
    try:
        return torch.empty(numel, dtype=dtype)
    except RuntimeError as e:  # no overcommit on this machine
        pytest.skip(f"cannot reserve {numel * 2 / 2**30:.1f} GiB of virtual memory: {e}")


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_block_offsets_beyond_int32(layout):
    """Block ids > 2**24 with a small block stride put K/V element offsets past 2**31
    and summary offsets past 2**31: every kernel must index in int64. The cache is a
    real (virtual) 4 GiB buffer; only the pages used are touched."""
    hkv, group, d = 1, 4, 64
    two_d = 2 * d
    block_stride = 128  # elements; pages of blocks >= 64 apart do not overlap
    num_blocks = 2**24 + 64 * 8
    span = (PAGE - 1) * (hkv * two_d if layout == "token_major" else two_d) + two_d
    storage = _virtual_empty(num_blocks * block_stride + span)
    if layout == "token_major":
        strides = (block_stride, two_d, hkv * two_d, 1)
    else:
        strides = (block_stride, PAGE * two_d, two_d, 1)
    kv = torch.as_strided(storage, (num_blocks, hkv, PAGE, two_d), strides)
    summaries = _virtual_empty(num_blocks * hkv * 2 * d).view(num_blocks, hkv, 2, d)
    gen = torch.Generator().manual_seed(3)
    # Row 0: 5 pages (the last partial), row 1: 2 pages; all ids >= 2**24, 64 apart.
    seq_lens = [4 * PAGE + 9, 2 * PAGE]
    ids = [2**24 + 64 * i for i in range(1, 8)]
    assert max(ids) * block_stride > 2**31 and max(ids) * hkv * 2 * d > 2**31
    table = torch.zeros(2, 5, dtype=torch.int32)
    table[0, :5] = torch.tensor(ids[:5], dtype=torch.int32)
    table[1, :2] = torch.tensor(ids[5:7], dtype=torch.int32)
    for b in ids:
        kv[b] = torch.randn(hkv, PAGE, two_d, generator=gen).to(torch.bfloat16)
        summaries[b] = 0
    summarize_full_pages(kv, summaries, table, seq_lens)
    full = [b for b in ids if b != ids[4]]
    expected_sum = ref.summarize_pages(kv, torch.tensor(full))
    got_sum = summaries[full].float()
    assert torch.all((got_sum - expected_sum).abs() <= _bf16_ulp(expected_sum) + 1e-6)

    query = torch.randn(2, hkv * group, d, generator=gen).to(torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    for gamma in (1.0, 0.6):
        config = moira.MoiraConfig.paper(gamma=gamma, estimator="mvar", **SMALL_FILL)
        ws = moira.MoiraWorkspace(2, hkv * group, hkv, d, 5, config, "cpu")
        out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, d**-0.5)
        expected, lists = ref.sparse_decode(query, kv, summaries, table, seq, d**-0.5, gamma)
        for row in range(2):
            assert _lists(ws, row, hkv) == [x.tolist() for x in lists[row]]
        torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_coverage_threshold_is_the_smallest_kept_middle_share():
    pibar = torch.tensor([0.2, 0.05, 0.4, 0.1, 0.15, 0.1], dtype=torch.float32)
    # Target 0.9 - 0.2 - 0.1 = 0.6 of the middle: pages 2 (0.4) and 4 (0.15) reach 0.55,
    # page 3 (0.1) reaches 0.65: tau = 0.1.
    assert ref.select_pages(pibar, gamma=0.9).tolist() == [0, 2, 3, 4, 5]
    assert ref.coverage_threshold(pibar, gamma=0.9) == pytest.approx(0.1)
    # Sink and current page alone reach gamma: no middle page, no threshold.
    assert ref.coverage_threshold(pibar, gamma=0.25) is None
    assert ref.coverage_threshold(pibar[:2], gamma=0.9) is None
