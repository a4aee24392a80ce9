# SPDX-License-Identifier: Apache-2.0
"""Moira's kernels on an fp8 KV cache at real shapes on the H200.

The cache is quantized to e4m3 with per-layer K and V scales (vLLM's
``--kv-cache-dtype fp8``; benchmarks/moira_correctness.py ``build_case(...,
kv_cache_dtype="fp8")``). FA3 runs on the same fp8 cache as vLLM runs it (the
query in e4m3, the scales as descales); the float32 reference reads the
dequantized cache with the bf16 query, which is what Moira computes with.

    MOIRA_TEST_GPU=1 python -m pytest -m gpu tests/v1/attention/test_moira_fp8_kv_gpu.py

``MOIRA_TEST_ATTEND_LAUNCH='{"num_stages": 4}'`` runs them under a candidate
Attend launch (as in ``test_moira_kernels_gpu.py``).
"""

from __future__ import annotations

import pytest

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
    return mc.build_case(batch, context, kv_cache_dtype="fp8")


def _config(**changes):
    from vllm.v1.attention.backends import moira

    return moira.MoiraConfig.paper(**changes)


def test_fp8_gamma_one_matches_fa3_within_vllm_fp8_tolerance(case):
    # vLLM's own bar for attention on an fp8 cache (atol 6e-2, rtol 1e-1),
    # and no further from the float32 result than FA3 (which also rounds the
    # query and the probabilities to e4m3) is.
    from benchmarks import moira_correctness as mc

    result = mc.check_gamma_one(case, _config(gamma=1.0))
    assert result["keeps_every_page"] and result["all_finite"], result
    assert result["fa3_close_at_fp8_tolerance"], result
    assert result["max_abs_diff_moira_vs_fp32"] <= result["max_abs_diff_fa3_vs_fp32"], result


def test_fp8_graph_replay_equals_eager_bitwise(case):
    from benchmarks import moira_correctness as mc

    config = _config(gamma=0.98)
    for name, result in mc.check_graph_replay(case, config=config).items():
        assert result["bitwise_equal"] and result["lists_equal"], name


def test_fp8_dependent_launches_equal_plain_launches_bitwise(case):
    from benchmarks import moira_correctness as mc

    result = mc.check_dependent_launches(case, config=_config(gamma=0.98))
    assert result["eager_equal_bits"] and result["graph_equal_bits"], result


def test_fp8_select_lists_and_estimate_match_reference(case):
    # Default estimator (int8 mvar_top8): Estimate's exact pages read the
    # e4m3 keys with k_scale, the summaries are those of the dequantized keys.
    from benchmarks import moira_correctness as mc

    case8 = mc.estimator_case(case, "int8:mvar_top8")
    summaries = mc.check_estimator_summaries(case8, "int8:mvar_top8")
    assert summaries["int8_max_step_diff"] <= 1, summaries
    assert summaries["scale_max_rel_err"] < 1e-5, summaries
    result = mc.check_select_and_estimate(case8, estimator="int8:mvar_top8")
    # An e4m3 cache makes many pages' int8 summaries, hence log-masses, equal, so a kept
    # share can meet the coverage target within float32 summation order: such a list is
    # counted apart (rows_near_tie) and must stay rare; any other difference fails.
    assert result["rows_checked"] >= 32
    assert result["rows_equal"] + result["rows_near_tie"] == result["rows_checked"], result
    assert result["rows_near_tie"] <= result["rows_checked"] // 64, result
    assert result["estimate_max_abs_err"] < 1e-3, result
    assert result["sparse_vs_fp32_max_abs_diff"] < 1.6e-2, result


def test_fp8_bf16_summaries_store_the_dequantized_keys(case):
    # bf16 mvar_top8: the stored keys are the dequantized keys rounded to
    # bf16, bit for bit; the bulk within bf16 rounding.
    from benchmarks import moira_correctness as mc

    case8 = mc.estimator_case(case, "mvar_top8")
    result = mc.check_estimator_summaries(case8, "mvar_top8")
    assert result["stored_keys_equal"] >= result["pages_checked"] - 2, result
    assert result["bulk_max_err_in_bf16_ulps"] <= 1.0, result


def test_fp8_layouts_bitwise_equal(case):
    from benchmarks import moira_correctness as mc

    assert mc.check_layouts(case)["bitwise_equal"]


def test_e4m3_to_fp16_conversion_is_exact():
    # The kernels' fp8 pages meet q in fp16 through Triton's e4m3 -> fp16
    # conversion: every finite e4m3 byte, at every position of a page tile.
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel_convert(src_ptr, dst_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs).to(tl.float16))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7f / 0xff are e4m3fn's NaNs
    gen = torch.Generator().manual_seed(0)
    picks = finite[torch.randint(0, finite.numel(), (64 * 128,), generator=gen)]
    src = picks.view(64, 128).view(torch.float8_e4m3fn).cuda()
    for warps in (2, 4):
        dst = torch.full((64, 128), 99.0, dtype=torch.float16, device="cuda")
        kernel_convert[(1,)](src, dst, ROWS=64, COLS=128, num_warps=warps)
        assert torch.equal(dst, src.float().to(torch.float16)), warps


@pytest.mark.parametrize("name", ["int8:mvar_top8", "mvar_top8"])
def test_fp8_estimate_writes_filled_pages_like_the_writer(name):
    # On an fp8 cache too, the decode step's summary write (Estimate,
    # write_filled_pages) stores the bits that write_page_summaries stores.
    import torch
    from vllm.v1.attention.backends import moira

    from benchmarks.moira_correctness import split_summary_dtype
    from tests.v1.attention.moira_test_utils import (
        full_page_slots,
        make_block_table,
        make_kv_cache,
    )
    from vllm_moira.v1.attention.ops import moira_reference as ref

    estimator, summary_dtype = split_summary_dtype(name)
    gen = torch.Generator().manual_seed(3)
    seq_lens = [64 * 40, 64 * 3, 64, 64 * 7 + 9]  # rows 0-2: the new token fills a page
    num_blocks = sum(-(-n // 64) for n in seq_lens) + 2
    kv = make_kv_cache(num_blocks, 8, 128, "token_major", generator=gen).cuda()
    kv8 = ref.quantize_kv_cache_fp8(kv, 0.011, 0.007)
    k_scale = torch.tensor([0.011], device="cuda")
    table = make_block_table(seq_lens, num_blocks, 40, generator=gen).cuda()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(seq_lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    expected = torch.zeros(num_blocks, 8, rows, 128, dtype=dtype, device="cuda")
    moira.write_page_summaries(kv8, expected, full_page_slots(table.cpu(), seq_lens).cuda(),
                               k_scale)  # fmt: skip
    summaries = expected.clone()
    filled = [int(table[r, (seq_lens[r] - 1) // 64]) for r in range(3)]
    summaries[filled] = 0
    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    ws = moira.MoiraWorkspace(4, 32, 8, 128, 40, config, "cuda")
    moira.estimate_page_logmass(query, kv8, summaries, table, seq, ws.logmass, 128**-0.5,
                                estimator, ws.selector_params, write_filled_pages=True,
                                k_scale=k_scale)  # fmt: skip
    torch.cuda.synchronize()
    assert summaries[filled].ne(0).any()
    assert torch.equal(summaries, expected)
