# SPDX-License-Identifier: Apache-2.0
"""The paper's Attend schedule (Alg. 2, Eq. 4) for benchmarks/bench_kernel_spread.py.

The backend's Attend lets N_F blocks share the step's pages evenly
(``moira.attend``). Alg. 2 instead gives each (row, KV head) list J blocks of
its own, each taking one chunk of the list; this module keeps it as the spread
benchmark's comparison arm. It shares the backend's page loop
(``_attend_list_pages``) and log-sum-exp combine (``_merge_chunks``), so only
the chunking differs.

Chunks: a list of n pages is cut into chunks of
max(ceil(n / J), min(C, ceil(P / N_F))) pages, P the pages in all lists of the
step and J = max(N_J, ceil(N_T / (B H_kv))); ``fill_blocks=1`` is Eq. 4 exactly.
"""

from __future__ import annotations

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.attention.backends.moira import (
    MOIRA_PAGE_SIZE,
    _attend_list_pages,
    _dependent_launch,
    _group_rows,
    _kv_scale_args,
    _merge_chunks,
    _wait_for_previous_kernel,
    attend_launch,
)

#: C, N_J, N_T of the paper (§3.3).
PAPER_MIN_CHUNK_PAGES = 24
PAPER_MIN_SPLITS_PER_ROW = 32
PAPER_MIN_SPLITS_TOTAL = 4096
_MERGE_TILE_CHUNKS = 32


@triton.jit
def _chunk_pages(n, num_splits, min_chunk_pages, fill_blocks, kept_total):
    # Pages per chunk of a list of n pages: at least ceil(n / J) so that J
    # blocks cover the list; otherwise C, or less when the step's lists could
    # not give fill_blocks blocks C pages each. The fill term is the same for
    # every list, so a long list gets more chunks, not longer ones.
    fill = tl.cdiv(kept_total, fill_blocks)
    chunk = tl.maximum(tl.cdiv(n, num_splits), tl.minimum(min_chunk_pages, fill))
    return tl.maximum(chunk, 1)


@triton.jit(do_not_specialize=["num_splits", "min_chunk_pages", "fill_blocks"])
def kernel_paper_attend(
    query_ptr, kv_cache_ptr, block_table_ptr, seq_lens_ptr, page_list_ptr, list_lengths_ptr,
    kept_total_ptr, output_ptr, partial_out_ptr, partial_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale, num_splits, min_chunk_pages, fill_blocks,
    stride_q_row: tl.int64, stride_q_head: tl.int64, stride_kv_block: tl.int64,
    stride_kv_head: tl.int64, stride_kv_token: tl.int64, stride_bt_row: tl.int64,
    stride_pl_row: tl.int64, stride_pl_head: tl.int64, stride_ll_row: tl.int64,
    stride_o_row: tl.int64, stride_o_head: tl.int64,
    GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # Block (row, KV head, j) reads the list length n, cuts the list into
    # chunks and takes chunk j, or exits. A one-chunk list is written to the
    # output; the others go to partial slot row * J + j.
    _wait_for_previous_kernel(USE_GDC)
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(list_lengths_ptr + row * stride_ll_row + head)
    chunk = _chunk_pages(n, num_splits, min_chunk_pages, fill_blocks, tl.load(kept_total_ptr))
    num_chunks = tl.cdiv(n, chunk)
    if split >= num_chunks:
        return
    offs_g = tl.arange(0, GROUP_ROWS)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask_g = offs_g < GROUP_SIZE
    q_heads = head * GROUP_SIZE + offs_g
    start = split * chunk
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    acc, running_max, running_sum = _attend_list_pages(
        query_ptr + row * stride_q_row,
        kv_cache_ptr + head * stride_kv_head,
        block_table_ptr + row * stride_bt_row,
        page_list_ptr + row * stride_pl_row + head * stride_pl_head,
        tl.load(seq_lens_ptr + row), start, tl.minimum(start + chunk, n), scale, k_scale,
        v_scale, q_heads, mask_g, stride_q_head, stride_kv_block, stride_kv_token, GROUP_ROWS,
        HEAD_SIZE, PAGE_SIZE, KV_FP8,
    )  # fmt: skip
    acc = acc / running_sum[:, None]
    if num_chunks == 1:
        tl.store(
            output_ptr + row * stride_o_row + q_heads[:, None] * stride_o_head + offs_d[None, :],
            acc.to(output_ptr.dtype.element_ty),
            mask=mask_g[:, None],
        )
    else:
        part = (row * num_splits + split).to(tl.int64) * tl.num_programs(1) * GROUP_SIZE
        tl.store(
            partial_out_ptr + (part + q_heads[:, None]) * HEAD_SIZE + offs_d[None, :],
            acc,
            mask=mask_g[:, None],
        )
        lse = (running_max + tl.log2(running_sum)) * 0.6931471805599453
        tl.store(partial_lse_ptr + part + q_heads, lse, mask=mask_g)


@triton.jit(do_not_specialize=["num_splits", "min_chunk_pages", "fill_blocks"])
def kernel_paper_merge(
    list_lengths_ptr, kept_total_ptr, partial_out_ptr, partial_lse_ptr, output_ptr, num_splits,
    min_chunk_pages, fill_blocks, stride_ll_row: tl.int64, stride_o_row: tl.int64,
    stride_o_head: tl.int64, GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    TILE_CHUNKS: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # One program per (row, query head): the combine of the list's chunks, by
    # the same chunking as kernel_paper_attend. One-chunk lists exit here.
    _wait_for_previous_kernel(USE_GDC)
    row = tl.program_id(0)
    q_head = tl.program_id(1)
    n = tl.load(list_lengths_ptr + row * stride_ll_row + q_head // GROUP_SIZE)
    chunk = _chunk_pages(n, num_splits, min_chunk_pages, fill_blocks, tl.load(kept_total_ptr))
    num_chunks = tl.cdiv(n, chunk)
    if num_chunks <= 1:
        return
    num_q_heads = tl.num_programs(1)
    first_part = (row * num_splits).to(tl.int64) * num_q_heads + q_head
    _merge_chunks(partial_out_ptr, partial_lse_ptr,
                  output_ptr + row * stride_o_row + q_head * stride_o_head,
                  first_part, num_q_heads, num_chunks, HEAD_SIZE, TILE_CHUNKS)  # fmt: skip


class PaperAttend:
    """Alg. 2's Attend + Merge with buffers for up to ``max_rows`` rows (allocated
    here, so the call replays in a CUDA graph)."""

    def __init__(
        self,
        max_rows: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_size: int,
        fill_blocks: int,
        device: torch.device | str,
        min_chunk_pages: int = PAPER_MIN_CHUNK_PAGES,
        min_splits_per_row: int = PAPER_MIN_SPLITS_PER_ROW,
        min_splits_total: int = PAPER_MIN_SPLITS_TOTAL,
    ) -> None:
        for name, value in (("fill_blocks", fill_blocks), ("min_chunk_pages", min_chunk_pages),
                            ("min_splits_per_row", min_splits_per_row),
                            ("min_splits_total", min_splits_total)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PaperAttend: {name} must be an integer >= 1, got {value!r}")
        self.num_kv_heads = num_kv_heads
        self.fill_blocks = fill_blocks
        self.min_chunk_pages = min_chunk_pages
        self.min_splits_per_row = min_splits_per_row
        self.min_splits_total = min_splits_total
        # Partials are indexed by row * J + j; J shrinks as the batch grows.
        max_parts = max(b * self.num_splits(b) for b in range(1, max_rows + 1))
        f32 = torch.float32
        self.partial_out = torch.empty(max_parts, num_q_heads, head_size, dtype=f32, device=device)
        self.partial_lse = torch.empty(max_parts, num_q_heads, dtype=f32, device=device)
        self.kept_total = torch.zeros(1, dtype=torch.int32, device=device)

    def num_splits(self, num_rows: int) -> int:
        """J of Eq. 4: blocks per (row, KV head) for a batch of ``num_rows`` rows."""
        per_grid = triton.cdiv(self.min_splits_total, max(num_rows, 1) * self.num_kv_heads)
        return max(self.min_splits_per_row, per_grid)

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_list: torch.Tensor,
        list_lengths: torch.Tensor,
        output: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        num_rows, num_q_heads, head_size = query.shape
        kv_fp8, k_scale, v_scale = _kv_scale_args(kv_cache, k_scale=k_scale, v_scale=v_scale)
        group_size = num_q_heads // self.num_kv_heads
        torch.sum(list_lengths[:num_rows], dim=(0, 1), dtype=torch.int32, out=self.kept_total[0])
        num_splits = self.num_splits(num_rows)
        splits = (num_splits, self.min_chunk_pages, self.fill_blocks)
        launch = attend_launch(kv_fp8)
        kernel_paper_attend[(num_rows, self.num_kv_heads, num_splits)](
            query, kv_cache, block_table, seq_lens, page_list, list_lengths, self.kept_total,
            output, self.partial_out, self.partial_lse, k_scale, v_scale, scale, *splits,
            query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), block_table.stride(0), page_list.stride(0), page_list.stride(1),
            list_lengths.stride(0), output.stride(0), output.stride(1),
            GROUP_SIZE=group_size, GROUP_ROWS=_group_rows(group_size), HEAD_SIZE=head_size,
            PAGE_SIZE=MOIRA_PAGE_SIZE, KV_FP8=kv_fp8, num_warps=launch.num_warps,
            num_stages=launch.num_stages, **_dependent_launch(None),
        )  # fmt: skip
        kernel_paper_merge[(num_rows, num_q_heads)](
            list_lengths, self.kept_total, self.partial_out, self.partial_lse, output, *splits,
            list_lengths.stride(0), output.stride(0), output.stride(1), GROUP_SIZE=group_size,
            HEAD_SIZE=head_size, TILE_CHUNKS=_MERGE_TILE_CHUNKS, num_warps=4,
            **_dependent_launch(None),
        )  # fmt: skip
