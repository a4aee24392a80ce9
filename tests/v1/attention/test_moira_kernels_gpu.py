# SPDX-License-Identifier: Apache-2.0
"""Moira's kernels at real shapes on a Hopper GPU (Llama-3.1-8B geometry).

Run with ``MOIRA_TEST_GPU=1 python -m pytest -m gpu tests/v1/attention`` after
``build.sh``; the checks are the ones ``benchmarks/moira_correctness.py``
records in ``benchmarks/results/correctness/``.
``MOIRA_TEST_ESTIMATE_LAUNCH='{"maxnreg": 128}'`` runs them under a candidate
Estimate launch (a JSON dict of Estimate launch overrides) before it becomes the
default; ``MOIRA_TEST_ATTEND_LAUNCH`` does the same for Attend's.
"""

from __future__ import annotations

import itertools

import pytest
import triton
import triton.language as tl

from tests.v1.attention.moira_test_utils import apply_launch_candidates

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _launch_candidates(monkeypatch):
    apply_launch_candidates(monkeypatch)


SHAPES = [(4, 131072), (32, 8192)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def case(request):
    from benchmarks import moira_correctness as mc

    batch, context = request.param
    return mc.build_case(batch, context)


def test_gamma_one_matches_fa3_within_one_ulp(case):
    from benchmarks import moira_correctness as mc

    result = mc.check_gamma_one(case)
    assert result["keeps_every_page"]
    assert result["all_finite"]
    # Within one bf16 ulp at unit scale (paper App. B: <= 3.9e-3), and no
    # further from the float32 result than FA3 itself is (same rounding class).
    assert result["max_abs_diff_vs_fa3"] <= result["bound_one_bf16_ulp"], result
    assert result["max_abs_diff_moira_vs_fp32"] <= (
        1.25 * result["max_abs_diff_fa3_vs_fp32"] + 1e-4
    ), result


def test_graph_replay_equals_eager_bitwise(case):
    from benchmarks import moira_correctness as mc

    for name, result in mc.check_graph_replay(case).items():
        assert result["bitwise_equal"] and result["lists_equal"], name


def test_dependent_launches_equal_plain_launches_bitwise(case):
    from benchmarks import moira_correctness as mc

    result = mc.check_dependent_launches(case)
    assert result["dependent_launch_on"], result  # Hopper: the launches are dependent
    assert result["eager_equal_bits"] and result["graph_equal_bits"], result


def test_select_lists_equal_reference(case):
    from benchmarks import moira_correctness as mc

    result = mc.check_select_and_estimate(case)
    assert result["rows_checked"] >= 32
    assert result["rows_equal"] == result["rows_checked"], result
    assert result["estimate_max_abs_err"] < 1e-3, result
    assert result["sparse_vs_fp32_max_abs_diff"] < 1.6e-2, result


@pytest.mark.parametrize("name", ["int8:mvar", "int8:mvar_top8", "int4:mvar_top8"])
def test_int8_summaries_match_reference(case, name):
    # MOIRA_SUMMARY_DTYPE=int8: the writer's values within one int8 step of the
    # reference's quantization (fp32 summation order), Estimate on the stored values
    # vs the reference on the same values, lists equal.
    from benchmarks import moira_correctness as mc

    case8 = mc.estimator_case(case, name)
    summaries = mc.check_estimator_summaries(case8, name)
    assert summaries["int8_max_step_diff"] <= 1, summaries
    assert summaries["int8_equal_fraction"] > 0.99, summaries
    assert summaries["scale_max_rel_err"] < 1e-5, summaries
    result = mc.check_select_and_estimate(case8, estimator=name)
    assert result["rows_checked"] >= 32
    assert result["rows_equal"] == result["rows_checked"], result
    assert result["estimate_max_abs_err"] < 1e-3, result


def test_int4_pair_products_equal_unpacked_keys_bitwise():
    # The int4 Estimate's products from the nibbles in place (int8 tensor cores)
    # equal the unpacked keys' products, bit for bit, compiled for the GPU.
    from tests.v1.attention.test_moira_summary_int4 import check_int4_pair_products

    check_int4_pair_products("cuda")


def test_layouts_bitwise_equal(case):
    from benchmarks import moira_correctness as mc

    assert mc.check_layouts(case)["bitwise_equal"]


# Small batches with the serving backend's settings: rows of context x batch <= 36864
# tokens take the dense-row path (identity lists, no Estimate work).
SMALL_BATCH_SHAPES = [(1, 2048), (1, 65536), (2, 12288)]


@pytest.fixture(scope="module", params=SMALL_BATCH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def small_case(request):
    from benchmarks import moira_correctness as mc

    batch, context = request.param
    return mc.build_case(batch, context)


def _backend_config(**changes):
    import dataclasses

    from vllm.v1.attention.backends import moira

    return dataclasses.replace(moira.moira_config_from_env({}), **changes)


def test_small_batch_gamma_one_matches_fa3(small_case):
    from benchmarks import moira_correctness as mc

    result = mc.check_gamma_one(small_case, _backend_config(gamma=1.0))
    assert result["keeps_every_page"] and result["all_finite"], result
    assert result["max_abs_diff_vs_fa3"] <= result["bound_one_bf16_ulp"], result


def test_small_batch_graph_replay_equals_eager_bitwise(small_case):
    # Shorter and mixed lengths under the captured graph move rows across the
    # dense-row threshold (1 x 65536 -> 21845 tokens: dense), both ways.
    from benchmarks import moira_correctness as mc

    for name, result in mc.check_graph_replay(small_case, config=_backend_config()).items():
        assert result["bitwise_equal"] and result["lists_equal"], name


def test_small_batch_dependent_launches_equal_plain_launches_bitwise(small_case):
    from benchmarks import moira_correctness as mc

    result = mc.check_dependent_launches(small_case, config=_backend_config())
    assert result["eager_equal_bits"] and result["graph_equal_bits"], result


@pytest.mark.parametrize("name", ["int8:mvar_top8", "int8:mvar", "mvar_top8", "int4:mvar_top8"])
def test_estimate_writes_filled_pages_like_the_writer(name):
    # The decode step's summary write (Estimate, write_filled_pages) stores the
    # bits that write_page_summaries stores for the same page: on the GPU the
    # per-channel sums are reduced in the order of the warps' layout, so both
    # run on Estimate's warps (CPU tests cannot see this).
    import torch
    from vllm.v1.attention.backends import moira

    from benchmarks.moira_correctness import split_summary_dtype
    from tests.v1.attention.moira_test_utils import (
        full_page_slots,
        make_block_table,
        make_kv_cache,
    )

    estimator, summary_dtype = split_summary_dtype(name)
    gen = torch.Generator().manual_seed(3)
    seq_lens = [64 * 40, 64 * 3, 64, 64 * 7 + 9]  # rows 0-2: the new token fills a page
    num_blocks = sum(-(-n // 64) for n in seq_lens) + 2
    kv = make_kv_cache(num_blocks, 8, 128, "token_major", generator=gen).cuda()
    table = make_block_table(seq_lens, num_blocks, 40, generator=gen).cuda()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(seq_lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    expected = torch.zeros(num_blocks, 8, rows, 128, dtype=dtype, device="cuda")
    moira.write_page_summaries(kv, expected, full_page_slots(table.cpu(), seq_lens).cuda())
    summaries = expected.clone()
    filled = [int(table[r, (seq_lens[r] - 1) // 64]) for r in range(3)]
    summaries[filled] = 0
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    ws = moira.MoiraWorkspace(4, 32, 8, 128, 40, config, "cuda")
    moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 128**-0.5,
                                estimator, ws.selector_params, write_filled_pages=True)  # fmt: skip
    torch.cuda.synchronize()
    assert summaries[filled].ne(0).any()
    assert torch.equal(summaries, expected)


@triton.jit
def _kernel_fresh_for_the_hook(out_ptr, VALUE: tl.constexpr):
    # A new VALUE is a new specialization: it compiles, so the hook must see it.
    tl.store(out_ptr, VALUE)


_hook_check_values = itertools.count(1)


@pytest.mark.parametrize("name", ["int8:mvar_top8", "int8:mvar", "mvar_top8"])
def test_summary_writer_warm_up_covers_every_prefill_slice(name):
    # After warm_up_summary_writer (run at KV bind time), prefill slices that
    # start after an odd number of decode tokens (slot mapping not 16-byte
    # aligned) compile nothing: no writer compilation inside a serving step.
    import torch
    import triton
    from vllm.v1.attention.backends import moira

    from benchmarks.moira_correctness import split_summary_dtype
    from tests.v1.attention.moira_test_utils import make_kv_cache

    estimator, summary_dtype = split_summary_dtype(name)
    gen = torch.Generator().manual_seed(5)
    kv = make_kv_cache(12, 8, 128, "token_major", generator=gen).cuda()
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    summaries = torch.zeros(12, 8, rows, 128, dtype=dtype, device="cuda")
    moira.warm_up_summary_writer(kv, summaries)
    torch.cuda.synchronize()
    assert summaries.eq(0).all()  # the warm-up writes nothing
    compiled = []
    hook = triton.knobs.runtime.jit_cache_hook

    def record(*, fn, **_):
        compiled.append(fn.name)
        return hook(fn=fn, **_) if hook else None

    triton.knobs.runtime.jit_cache_hook = record
    try:
        slots = torch.arange(64, 64 * 12, dtype=torch.int64, device="cuda")
        for decode_tokens in (0, 1, 3, 5):  # the slice's offset in the step's slots
            pad = torch.full((decode_tokens,), -1, dtype=torch.int64, device="cuda")
            step = torch.cat([pad, slots])
            moira.write_page_summaries(kv, summaries, step[decode_tokens:])
        torch.cuda.synchronize()
        # The hook sees compilations: a kernel new to this process compiles.
        value = next(_hook_check_values)
        scratch = torch.zeros(1, dtype=torch.int32, device="cuda")
        _kernel_fresh_for_the_hook[(1,)](scratch, value)
        torch.cuda.synchronize()
        assert int(scratch) == value
    finally:
        triton.knobs.runtime.jit_cache_hook = hook
    assert summaries[1:].ne(0).any()
    assert compiled == ["_kernel_fresh_for_the_hook"], compiled
