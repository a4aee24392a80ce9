# SPDX-License-Identifier: Apache-2.0
"""Moira: sparse decode attention with an adaptive page budget.

Every decode step reads only the KV pages that carry the attention mass, with
a budget that adapts per (request, layer, KV head, step). Four Triton kernels
run per layer, all with grids fixed by the batch size so the step replays in
vLLM's full CUDA graph without any host planning:

1. Estimate: log-mass of every 64-token page from its summary (per-channel
   mean and variance of its keys, Eq. 2 "mvar"); sink and current page exact.
2. Select: group-mean softmax over the G query heads of a KV head; keep the
   fewest pages whose share reaches gamma (coverage rule, Eq. 3), found by
   bisection rather than a sort (Alg. 1). Also a fixed-count mode.
3. Attend: self-planning split-KV (Alg. 2). Each of the J blocks of a row
   reads the row's list length from device memory, takes its chunk or exits.
4. Merge: log-sum-exp combine of the chunks of multi-chunk rows.

Page summaries are written when a page fills (prefill and decode alike) by
``write_page_summaries``, called right after the KV-cache scatter.

Layout of this module: constants and configuration; the kernels, each next to
its launcher; the decode-step entry points; the vLLM backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton

# ==========================================================================
# Constants and configuration
# ==========================================================================

#: Tokens per page. Summaries and kernels are built for exactly this size.
MOIRA_PAGE_SIZE = 64
#: Head sizes the kernels are built and tested for.
MOIRA_SUPPORTED_HEAD_SIZES = (64, 128)
#: Largest GQA group (query heads per KV head) the kernels support.
MOIRA_MAX_GROUP_SIZE = 16
MOIRA_SELECTORS = ("coverage", "fixed")

# Pages per Estimate program ("each covering 64 pages", paper App. A).
_ESTIMATE_TILE_PAGES = 64
# Largest page tile Select keeps in registers; longer rows loop over tiles.
_SELECT_MAX_TILE_PAGES = 4096
# Chunks of one row that Merge combines per loop iteration.
_MERGE_TILE_CHUNKS = 32
# tl.dot needs at least 16 rows: the G query heads are padded to this.
_MIN_DOT_ROWS = 16


@dataclass(frozen=True)
class MoiraConfig:
    """Knobs of the Moira decode step (paper §3; defaults from §3.3)."""

    #: Coverage: keep the fewest pages whose estimated share reaches gamma.
    gamma: float = 0.98
    #: "coverage" (Eq. 3) or "fixed" (the ``fixed_pages`` largest pages).
    selector: str = "coverage"
    #: K for ``selector="fixed"``: pages per (row, KV head), sink and current
    #: page included.
    fixed_pages: int | None = None
    #: C: fewest pages per Attend chunk (a short row needs one block).
    min_chunk_pages: int = 24
    #: N_J: fewest Attend blocks per row.
    min_splits_per_row: int = 32
    #: N_T: fewest Attend blocks per grid (so a few long rows fill the GPU).
    min_splits_total: int = 4096

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option and its allowed values."""
        if not isinstance(self.gamma, (int, float)) or not 0.0 < self.gamma <= 1.0:
            raise ValueError(
                f"Moira: gamma must be in (0, 1] (default 0.98), got {self.gamma!r}"
            )
        if self.selector not in MOIRA_SELECTORS:
            raise ValueError(
                f"Moira: selector must be one of {MOIRA_SELECTORS}, "
                f"got {self.selector!r}"
            )
        if self.selector == "fixed":
            if not isinstance(self.fixed_pages, int) or self.fixed_pages < 1:
                raise ValueError(
                    "Moira: selector='fixed' needs fixed_pages, an integer >= 1 "
                    f"(pages kept per row and KV head), got {self.fixed_pages!r}"
                )
        elif self.fixed_pages is not None:
            raise ValueError(
                "Moira: fixed_pages is only used with selector='fixed', "
                f"got fixed_pages={self.fixed_pages!r} with selector={self.selector!r}"
            )
        for name in ("min_chunk_pages", "min_splits_per_row", "min_splits_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Moira: {name} must be an integer >= 1, got {value!r}")

    def num_splits(self, num_rows: int, num_kv_heads: int) -> int:
        """J of Eq. 4: Attend blocks per (row, KV head) for a batch of rows."""
        per_grid = triton.cdiv(self.min_splits_total, max(num_rows, 1) * num_kv_heads)
        return max(self.min_splits_per_row, per_grid)


def _group_rows(group_size: int) -> int:
    """Rows of the query tile: G padded to a power of two and to tl.dot's minimum."""
    return max(_MIN_DOT_ROWS, triton.next_power_of_2(group_size))


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != MOIRA_PAGE_SIZE:
        raise ValueError(
            "Moira: kv_cache must be [num_blocks, num_kv_heads, 64, 2 * head_size], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"Moira: kv_cache must be bfloat16, got {kv_cache.dtype}")


# ==========================================================================
# Page summaries
# ==========================================================================
@triton.jit
def kernel_moira_write_summaries(
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16
    summaries_ptr,  # [num_blocks, num_kv_heads, 2, HEAD_SIZE] bf16
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_kv_block: tl.int64,
    stride_kv_head: tl.int64,
    stride_kv_token: tl.int64,
    stride_sum_block: tl.int64,
    stride_sum_head: tl.int64,
    HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    # One program per (token, KV head). Only the token that fills its page
    # (offset PAGE_SIZE - 1) summarizes; the others exit at once. The keys are
    # read back from the cache, so a page filled across two prefill chunks is
    # summarized over all of its tokens.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if (slot < 0) | (slot % PAGE_SIZE != PAGE_SIZE - 1):
        return
    block = slot // PAGE_SIZE
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    keys = tl.load(
        kv_cache_ptr
        + block * stride_kv_block
        + head * stride_kv_head
        + offs_t[:, None] * stride_kv_token
        + offs_d[None, :]
    ).to(tl.float32)
    mean = tl.sum(keys, axis=0) / PAGE_SIZE
    centered = keys - mean[None, :]
    var = tl.sum(centered * centered, axis=0) / PAGE_SIZE
    out = summaries_ptr + block * stride_sum_block + head * stride_sum_head + offs_d
    tl.store(out, mean.to(tl.bfloat16))
    tl.store(out + HEAD_SIZE, var.to(tl.bfloat16))


def write_page_summaries(
    kv_cache: torch.Tensor, summaries: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Summarize every page whose last slot (offset 63) is in ``slot_mapping``.

    Call after the KV scatter of the same tokens. Graph-safe: the grid is the
    number of tokens; no host sync.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    head_size = kv_cache.shape[-1] // 2
    assert kv_cache.stride(-1) == 1 and summaries.is_contiguous()
    kernel_moira_write_summaries[(num_tokens, kv_cache.shape[1])](
        kv_cache,
        summaries,
        slot_mapping,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        summaries.stride(0),
        summaries.stride(1),
        HEAD_SIZE=head_size,
        PAGE_SIZE=MOIRA_PAGE_SIZE,
    )


# ==========================================================================
# Estimate (Eq. 2)
# ==========================================================================
@triton.jit
def _exact_page_logmass(
    q_scaled,  # [HEAD_SIZE] fp32, query head already multiplied by the scale
    kv_cache_ptr,
    block,
    head,
    num_valid,
    stride_kv_block,
    stride_kv_head,
    stride_kv_token,
    HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask_t = offs_t < num_valid
    keys = tl.load(
        kv_cache_ptr
        + block * stride_kv_block
        + head * stride_kv_head
        + offs_t[:, None] * stride_kv_token
        + offs_d[None, :],
        mask=mask_t[:, None],
        other=0.0,
    ).to(tl.float32)
    logits = tl.sum(keys * q_scaled[None, :], axis=1)
    logits = tl.where(mask_t, logits, float("-inf"))
    peak = tl.max(logits, axis=0)
    return peak + tl.log(tl.sum(tl.exp(logits - peak), axis=0))


@triton.jit
def kernel_moira_estimate(
    query_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16
    summaries_ptr,  # [num_blocks, num_kv_heads, 2, HEAD_SIZE] bf16
    block_table_ptr,  # [num_rows, max_blocks] int32
    seq_lens_ptr,  # [num_rows] int32
    logmass_ptr,  # [max_rows, num_kv_heads, GROUP_SIZE, max_pages] fp32 (out)
    scale,
    stride_q_row: tl.int64,
    stride_q_head: tl.int64,
    stride_kv_block: tl.int64,
    stride_kv_head: tl.int64,
    stride_kv_token: tl.int64,
    stride_sum_block: tl.int64,
    stride_sum_head: tl.int64,
    stride_bt_row: tl.int64,
    stride_lm_row: tl.int64,
    stride_lm_head: tl.int64,
    stride_lm_group: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_PAGES: tl.constexpr,
):
    # One program per (row, KV head, tile of TILE_PAGES pages). The estimate
    # is computed in fp32 by broadcast-and-reduce rather than tl.dot: it reads
    # only 1/64 of the KV bytes, and exact fp32 keeps Select's input equal to
    # the float32 reference up to summation order.
    row = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    if tile * TILE_PAGES >= num_pages:
        return
    pages = tile * TILE_PAGES + tl.arange(0, TILE_PAGES)
    mask_p = pages < num_pages
    offs_d = tl.arange(0, HEAD_SIZE)
    blocks = tl.load(
        block_table_ptr + row * stride_bt_row + pages, mask=mask_p, other=0
    ).to(tl.int64)
    summary = (
        summaries_ptr
        + blocks[:, None] * stride_sum_block
        + head * stride_sum_head
        + offs_d[None, :]
    )
    mean = tl.load(summary, mask=mask_p[:, None], other=0.0).to(tl.float32)
    var = tl.load(summary + HEAD_SIZE, mask=mask_p[:, None], other=0.0).to(tl.float32)

    last = num_pages - 1
    has_sink = tile == 0
    has_last = last // TILE_PAGES == tile
    sink_block = tl.load(block_table_ptr + row * stride_bt_row).to(tl.int64)
    last_block = tl.load(block_table_ptr + row * stride_bt_row + last).to(tl.int64)
    sink_valid = tl.minimum(seq_len, PAGE_SIZE)
    last_valid = seq_len - last * PAGE_SIZE
    log_page = tl.log(PAGE_SIZE * 1.0)

    for g in tl.static_range(GROUP_SIZE):
        q = tl.load(
            query_ptr + row * stride_q_row + (head * GROUP_SIZE + g) * stride_q_head + offs_d
        ).to(tl.float32)
        q = q * scale
        # Eq. 2: s q.mu + 1/2 (s q)^2 . sigma^2 + log S
        est = tl.sum(mean * q[None, :], axis=1)
        est += 0.5 * tl.sum(var * (q * q)[None, :], axis=1)
        est += log_page
        if has_sink:
            exact = _exact_page_logmass(
                q, kv_cache_ptr, sink_block, head, sink_valid,
                stride_kv_block, stride_kv_head, stride_kv_token,
                HEAD_SIZE, PAGE_SIZE,
            )  # fmt: skip
            est = tl.where(pages == 0, exact, est)
        if has_last:
            exact = _exact_page_logmass(
                q, kv_cache_ptr, last_block, head, last_valid,
                stride_kv_block, stride_kv_head, stride_kv_token,
                HEAD_SIZE, PAGE_SIZE,
            )  # fmt: skip
            est = tl.where(pages == last, exact, est)
        tl.store(
            logmass_ptr
            + row * stride_lm_row
            + head * stride_lm_head
            + g * stride_lm_group
            + pages,
            est,
            mask=mask_p,
        )


def estimate_page_logmass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    logmass: torch.Tensor,
    scale: float,
) -> None:
    """Fill ``logmass[:B, h, g, :n_pages]`` for every row (Eq. 2; sink and
    current page exact). Grid covers ``block_table.shape[1]`` pages per row."""
    num_rows, num_q_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    max_pages = block_table.shape[1]
    assert logmass.shape[-1] >= max_pages and logmass.shape[2] == group_size
    grid = (num_rows, num_kv_heads, triton.cdiv(max_pages, _ESTIMATE_TILE_PAGES))
    kernel_moira_estimate[grid](
        query,
        kv_cache,
        summaries,
        block_table,
        seq_lens,
        logmass,
        scale,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        summaries.stride(0),
        summaries.stride(1),
        block_table.stride(0),
        logmass.stride(0),
        logmass.stride(1),
        logmass.stride(2),
        GROUP_SIZE=group_size,
        HEAD_SIZE=head_size,
        PAGE_SIZE=MOIRA_PAGE_SIZE,
        TILE_PAGES=_ESTIMATE_TILE_PAGES,
        num_warps=4,
    )


# ==========================================================================
# Select (Eq. 3, Alg. 1)
# ==========================================================================
@triton.jit
def _kept_share(
    pibar_ptr,
    tile_pibar,
    num_pages,
    tau,
    BY_COUNT: tl.constexpr,
    TILE_PAGES: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    # Share (or count) of the middle pages (not the sink, not the current
    # page) whose pibar is >= tau. One tile stays in registers; longer rows
    # re-read their pibar from the scratch buffer (L1/L2-resident).
    total = 0.0
    for t in tl.static_range(NUM_TILES):
        pages = t * TILE_PAGES + tl.arange(0, TILE_PAGES)
        middle = (pages > 0) & (pages < num_pages - 1)
        if NUM_TILES == 1:
            pib = tile_pibar
        else:
            pib = tl.load(pibar_ptr + pages, mask=middle, other=0.0)
        above = middle & (pib >= tau)
        if BY_COUNT:
            total += tl.sum(above.to(tl.float32), axis=0)
        else:
            total += tl.sum(tl.where(above, pib, 0.0), axis=0)
    return total


@triton.jit(do_not_specialize=["fixed_pages"])
def kernel_moira_select(
    logmass_ptr,  # [max_rows, num_kv_heads, GROUP_SIZE, max_pages] fp32
    seq_lens_ptr,  # [num_rows] int32
    pibar_ptr,  # [max_rows, num_kv_heads, max_pages] fp32 (scratch)
    page_list_ptr,  # [max_rows, num_kv_heads, max_pages] int32 (out)
    page_count_ptr,  # [max_rows, num_kv_heads] int32 (out)
    gamma,
    fixed_pages,
    stride_lm_row: tl.int64,
    stride_lm_head: tl.int64,
    stride_lm_group: tl.int64,
    stride_pib_row: tl.int64,
    stride_pib_head: tl.int64,
    stride_pl_row: tl.int64,
    stride_pl_head: tl.int64,
    stride_pc_row: tl.int64,
    GROUP_SIZE: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    TILE_PAGES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    FIXED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    # One program per (row, KV head). Writes the row's page list (logical
    # page indices in page order, sink first, current page last) and its
    # length, the only things Attend reads.
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    count_ptr = page_count_ptr + row * stride_pc_row + head
    if num_pages == 0:
        tl.store(count_ptr, 0)
        return
    lm = logmass_ptr + row * stride_lm_row + head * stride_lm_head
    pib_ptr = pibar_ptr + row * stride_pib_row + head * stride_pib_head
    offs_g = tl.arange(0, GROUP_ROWS)
    mask_g = offs_g < GROUP_SIZE

    # Pass 1: per query head, max and sum of exp over the pages (softmax).
    peak = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_ROWS], tl.float32)
    for t in tl.static_range(NUM_TILES):
        pages = t * TILE_PAGES + tl.arange(0, TILE_PAGES)
        mask = mask_g[:, None] & (pages < num_pages)[None, :]
        x = tl.load(
            lm + offs_g[:, None] * stride_lm_group + pages[None, :],
            mask=mask,
            other=float("-inf"),
        )
        new_peak = tl.maximum(peak, tl.max(x, axis=1))
        safe_peak = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        denom = denom * tl.exp(peak - safe_peak) + tl.sum(
            tl.exp(x - safe_peak[:, None]), axis=1
        )
        peak = new_peak
    safe_peak = tl.where(peak == float("-inf"), 0.0, peak)
    inv_denom = tl.where(mask_g, 1.0 / denom, 0.0) / GROUP_SIZE

    # Pass 2: pibar = group mean of the softmax; the forced pages' shares and
    # the largest middle share bound the threshold search.
    last = num_pages - 1
    hi = 0.0
    forced = 0.0
    tile_pibar = tl.zeros([TILE_PAGES], tl.float32)
    for t in tl.static_range(NUM_TILES):
        pages = t * TILE_PAGES + tl.arange(0, TILE_PAGES)
        mask_p = pages < num_pages
        x = tl.load(
            lm + offs_g[:, None] * stride_lm_group + pages[None, :],
            mask=mask_g[:, None] & mask_p[None, :],
            other=float("-inf"),
        )
        tile_pibar = tl.sum(
            tl.exp(x - safe_peak[:, None]) * inv_denom[:, None], axis=0
        )
        if NUM_TILES > 1:
            tl.store(pib_ptr + pages, tile_pibar, mask=mask_p)
        middle = (pages > 0) & (pages < last)
        hi = tl.maximum(hi, tl.max(tl.where(middle, tile_pibar, 0.0), axis=0))
        is_forced = mask_p & ((pages == 0) | (pages == last))
        forced += tl.sum(tl.where(is_forced, tile_pibar, 0.0), axis=0)
    if NUM_TILES > 1:
        # Later passes re-read pibar written by other threads of this block.
        tl.debug_barrier()

    # Pass 3: bisection for tau (Alg. 1). K_B thresholds per pass: 8/4/2 for
    # rows of < 256 / 1024 / more pages; 24 / log2(K_B) passes shrink the
    # interval 2^24-fold. lo always satisfies the target (or is the start, 0).
    num_middle = tl.maximum(num_pages - 2, 0)
    if FIXED:
        target = (fixed_pages - 2) * 1.0
    else:
        target = gamma - forced
    kb = tl.where(num_pages < 256, 8, tl.where(num_pages < 1024, 4, 2))
    passes = tl.where(num_pages < 256, 8, tl.where(num_pages < 1024, 12, 24))
    lo = 0.0
    for _ in range(passes):
        width = hi - lo
        new_lo = lo
        new_hi = hi
        for k in tl.static_range(1, 8):
            tau = lo + width * k / kb
            kept = _kept_share(
                pib_ptr, tile_pibar, num_pages, tau, FIXED, TILE_PAGES, NUM_TILES
            )
            active = k < kb
            reached = active & (kept >= target)
            new_lo = tl.where(reached, tl.maximum(new_lo, tau), new_lo)
            new_hi = tl.where(active & (kept < target), tl.minimum(new_hi, tau), new_hi)
        lo = new_lo
        hi = new_hi
    # Special cases of Eq. 3: nothing more is needed (target <= 0), or every
    # page is (gamma >= 1, or a fixed budget that covers the row).
    if FIXED:
        keep_all = num_middle <= fixed_pages - 2
    else:
        keep_all = gamma >= 1.0
    lo = tl.where(target <= 0.0, float("inf"), lo)
    lo = tl.where(keep_all, float("-inf"), lo)

    # Pass 4: compaction into the row's list, in page order.
    out = page_list_ptr + row * stride_pl_row + head * stride_pl_head
    tl.store(out, 0)
    n_kept = 1
    for t in tl.static_range(NUM_TILES):
        pages = t * TILE_PAGES + tl.arange(0, TILE_PAGES)
        middle = (pages > 0) & (pages < last)
        if NUM_TILES == 1:
            pib = tile_pibar
        else:
            pib = tl.load(pib_ptr + pages, mask=middle, other=0.0)
        keep = middle & (pib >= lo)
        slot = n_kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out + slot, pages, mask=keep)
        n_kept += tl.sum(keep.to(tl.int32), axis=0)
    if num_pages > 1:
        tl.store(out + n_kept, last)
        n_kept += 1
    tl.store(count_ptr, n_kept)


def select_pages(
    logmass: torch.Tensor,
    seq_lens: torch.Tensor,
    pibar: torch.Tensor,
    page_list: torch.Tensor,
    page_count: torch.Tensor,
    config: MoiraConfig,
    num_rows: int,
    max_pages: int,
) -> None:
    """Coverage (or fixed-count) selection for rows ``[:num_rows]``."""
    num_kv_heads, group_size = logmass.shape[1], logmass.shape[2]
    tile_pages = min(triton.next_power_of_2(max(max_pages, 16)), _SELECT_MAX_TILE_PAGES)
    num_tiles = triton.cdiv(max_pages, tile_pages)
    assert pibar.shape[-1] >= num_tiles * tile_pages
    fixed = config.selector == "fixed"
    kernel_moira_select[(num_rows, num_kv_heads)](
        logmass,
        seq_lens,
        pibar,
        page_list,
        page_count,
        float(config.gamma),
        int(config.fixed_pages or 0),
        logmass.stride(0),
        logmass.stride(1),
        logmass.stride(2),
        pibar.stride(0),
        pibar.stride(1),
        page_list.stride(0),
        page_list.stride(1),
        page_count.stride(0),
        GROUP_SIZE=group_size,
        GROUP_ROWS=triton.next_power_of_2(group_size),
        TILE_PAGES=tile_pages,
        NUM_TILES=num_tiles,
        FIXED=fixed,
        PAGE_SIZE=MOIRA_PAGE_SIZE,
        num_warps=8 if tile_pages >= 1024 else 4,
    )


# ==========================================================================
# Attend (Eq. 4, Alg. 2) and Merge
# ==========================================================================
@triton.jit(do_not_specialize=["num_splits", "min_chunk_pages"])
def kernel_moira_attend(
    query_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16
    block_table_ptr,  # [num_rows, max_blocks] int32
    seq_lens_ptr,  # [num_rows] int32
    page_list_ptr,  # [max_rows, num_kv_heads, max_pages] int32 (logical pages)
    page_count_ptr,  # [max_rows, num_kv_heads] int32
    output_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16 (out, 1-chunk rows)
    partial_out_ptr,  # [num_rows * num_splits, num_q_heads, HEAD_SIZE] fp32 (out)
    partial_lse_ptr,  # [num_rows * num_splits, num_q_heads] fp32 (out)
    scale,
    num_splits,
    min_chunk_pages,
    stride_q_row: tl.int64,
    stride_q_head: tl.int64,
    stride_kv_block: tl.int64,
    stride_kv_head: tl.int64,
    stride_kv_token: tl.int64,
    stride_bt_row: tl.int64,
    stride_pl_row: tl.int64,
    stride_pl_head: tl.int64,
    stride_pc_row: tl.int64,
    stride_o_row: tl.int64,
    stride_o_head: tl.int64,
    GROUP_SIZE: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    # Block (row, KV head, j) plans its own work (Alg. 2): it reads the
    # list length n from device memory, cuts the row into chunks of
    # c = max(C, ceil(n / J)) pages and takes chunk j, or exits. All G query
    # heads of the KV head share each K/V tile, so every byte is read once.
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(page_count_ptr + row * stride_pc_row + head)
    chunk = tl.maximum(min_chunk_pages, tl.cdiv(n, num_splits))
    num_chunks = tl.cdiv(n, chunk)
    if split >= num_chunks:
        return
    seq_len = tl.load(seq_lens_ptr + row)

    offs_g = tl.arange(0, GROUP_ROWS)
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask_g = offs_g < GROUP_SIZE
    q_heads = head * GROUP_SIZE + offs_g
    q = tl.load(
        query_ptr + row * stride_q_row + q_heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None],
        other=0.0,
    )
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    running_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_SIZE], tl.float32)
    pages_ptr = page_list_ptr + row * stride_pl_row + head * stride_pl_head
    kv_head_ptr = kv_cache_ptr + head * stride_kv_head
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    for i in range(start, end):
        page = tl.load(pages_ptr + i)
        block = tl.load(block_table_ptr + row * stride_bt_row + page).to(tl.int64)
        mask_t = offs_t < seq_len - page * PAGE_SIZE
        tile = kv_head_ptr + block * stride_kv_block + offs_t[:, None] * stride_kv_token
        k = tl.load(tile + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        v = tl.load(tile + HEAD_SIZE + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(mask_t[None, :], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        p = tl.exp2(s - new_max[:, None])
        alpha = tl.exp2(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max

    acc = acc / running_sum[:, None]
    if num_chunks == 1:
        tl.store(
            output_ptr
            + row * stride_o_row
            + q_heads[:, None] * stride_o_head
            + offs_d[None, :],
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


@triton.jit(do_not_specialize=["num_splits", "min_chunk_pages"])
def kernel_moira_merge(
    page_count_ptr,  # [max_rows, num_kv_heads] int32
    partial_out_ptr,  # [num_rows * num_splits, num_q_heads, HEAD_SIZE] fp32
    partial_lse_ptr,  # [num_rows * num_splits, num_q_heads] fp32
    output_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16 (out)
    num_splits,
    min_chunk_pages,
    stride_pc_row: tl.int64,
    stride_o_row: tl.int64,
    stride_o_head: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    TILE_CHUNKS: tl.constexpr,
):
    # One program per (row, query head): log-sum-exp combine of the row's
    # chunks. Single-chunk rows were written by Attend and exit here.
    row = tl.program_id(0)
    q_head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    n = tl.load(page_count_ptr + row * stride_pc_row + q_head // GROUP_SIZE)
    chunk = tl.maximum(min_chunk_pages, tl.cdiv(n, num_splits))
    num_chunks = tl.cdiv(n, chunk)
    if num_chunks <= 1:
        return
    offs_j = tl.arange(0, TILE_CHUNKS)
    offs_d = tl.arange(0, HEAD_SIZE)
    base = (row * num_splits).to(tl.int64)
    running_max = float("-inf")
    running_sum = 0.0
    acc = tl.zeros([HEAD_SIZE], tl.float32)
    for j0 in range(0, num_chunks, TILE_CHUNKS):
        mask_j = j0 + offs_j < num_chunks
        part = (base + j0 + offs_j) * num_q_heads + q_head
        lse = tl.load(partial_lse_ptr + part, mask=mask_j, other=float("-inf"))
        out = tl.load(
            partial_out_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
            mask=mask_j[:, None],
            other=0.0,
        )
        new_max = tl.maximum(running_max, tl.max(lse, axis=0))
        weight = tl.exp(lse - new_max)
        alpha = tl.exp(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(weight, axis=0)
        acc = acc * alpha + tl.sum(out * weight[:, None], axis=0)
        running_max = new_max
    tl.store(
        output_ptr + row * stride_o_row + q_head * stride_o_head + offs_d,
        (acc / running_sum).to(output_ptr.dtype.element_ty),
    )


# ==========================================================================
# Decode-step entry points
# ==========================================================================
class MoiraWorkspace:
    """Persistent buffers of the decode step, sized for the worst case.

    Allocated once (before CUDA-graph capture) and shared by all layers of a
    model (layers run one after another). Every launch reads and writes views
    of these tensors, so a captured graph replays against the same addresses.
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_size: int,
        max_pages: int,
        config: MoiraConfig,
        device: torch.device | str,
    ) -> None:
        config.validate()
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(
                f"Moira: num_q_heads ({num_q_heads}) must be a multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        group_size = num_q_heads // num_kv_heads
        if group_size > MOIRA_MAX_GROUP_SIZE:
            raise ValueError(
                f"Moira: at most {MOIRA_MAX_GROUP_SIZE} query heads per KV head are "
                f"supported, got {group_size}"
            )
        if head_size not in MOIRA_SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"Moira: head_size must be one of {MOIRA_SUPPORTED_HEAD_SIZES}, "
                f"got {head_size}"
            )
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_pages = max_pages
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        tile = min(triton.next_power_of_2(max(max_pages, 16)), _SELECT_MAX_TILE_PAGES)
        pibar_pages = triton.cdiv(max_pages, tile) * tile
        # Attend's partials are indexed by (row * J + j); J shrinks as the
        # batch grows (Eq. 4), so size for the largest rows * J over batches.
        max_chunks = max(
            b * config.num_splits(b, num_kv_heads) for b in range(1, max_num_seqs + 1)
        )
        f32, i32 = torch.float32, torch.int32
        self.logmass = torch.empty(
            max_num_seqs, num_kv_heads, group_size, max_pages, dtype=f32, device=device
        )
        self.pibar = torch.empty(
            max_num_seqs, num_kv_heads, pibar_pages, dtype=f32, device=device
        )
        self.page_list = torch.empty(
            max_num_seqs, num_kv_heads, max_pages, dtype=i32, device=device
        )
        self.page_count = torch.zeros(max_num_seqs, num_kv_heads, dtype=i32, device=device)
        self.partial_out = torch.empty(
            max_chunks, num_q_heads, head_size, dtype=f32, device=device
        )
        self.partial_lse = torch.empty(max_chunks, num_q_heads, dtype=f32, device=device)

    def nbytes(self) -> int:
        tensors = (
            self.logmass,
            self.pibar,
            self.page_list,
            self.page_count,
            self.partial_out,
            self.partial_lse,
        )
        return sum(t.numel() * t.element_size() for t in tensors)


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_list: torch.Tensor,
    page_count: torch.Tensor,
    output: torch.Tensor,
    workspace: MoiraWorkspace,
    scale: float,
    config: MoiraConfig | None = None,
) -> None:
    """Attend + Merge over any selector's page lists.

    ``page_list`` ``[>= B, H_kv, >= max list length]`` int32 holds logical
    page indices of each (row, KV head), ``page_count`` ``[>= B, H_kv]`` their
    lengths; both are read on the device only. ``output`` ``[B, H_q, D]``.
    """
    config = config or workspace.config
    num_rows, num_q_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    num_splits = config.num_splits(num_rows, num_kv_heads)
    assert num_rows * num_splits <= workspace.partial_out.shape[0]
    group_rows = _group_rows(group_size)
    kernel_moira_attend[(num_rows, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_table,
        seq_lens,
        page_list,
        page_count,
        output,
        workspace.partial_out,
        workspace.partial_lse,
        scale,
        num_splits,
        config.min_chunk_pages,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        page_list.stride(0),
        page_list.stride(1),
        page_count.stride(0),
        output.stride(0),
        output.stride(1),
        GROUP_SIZE=group_size,
        GROUP_ROWS=group_rows,
        HEAD_SIZE=head_size,
        PAGE_SIZE=MOIRA_PAGE_SIZE,
        num_warps=4,
        num_stages=3,
    )
    kernel_moira_merge[(num_rows, num_q_heads)](
        page_count,
        workspace.partial_out,
        workspace.partial_lse,
        output,
        num_splits,
        config.min_chunk_pages,
        page_count.stride(0),
        output.stride(0),
        output.stride(1),
        GROUP_SIZE=group_size,
        HEAD_SIZE=head_size,
        TILE_CHUNKS=_MERGE_TILE_CHUNKS,
        num_warps=4,
    )


def estimate_and_select(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace: MoiraWorkspace,
    scale: float,
    config: MoiraConfig | None = None,
) -> None:
    """Estimate + Select: fills ``workspace.page_list`` / ``page_count``."""
    config = config or workspace.config
    num_rows = query.shape[0]
    max_pages = block_table.shape[1]
    if max_pages > workspace.max_pages:
        raise ValueError(
            f"Moira: block table has {max_pages} pages per row, the workspace "
            f"was sized for {workspace.max_pages}"
        )
    estimate_page_logmass(
        query, kv_cache, summaries, block_table, seq_lens, workspace.logmass, scale
    )
    select_pages(
        workspace.logmass,
        seq_lens,
        workspace.pibar,
        workspace.page_list,
        workspace.page_count,
        config,
        num_rows,
        max_pages,
    )


def moira_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    output: torch.Tensor,
    workspace: MoiraWorkspace,
    scale: float,
    config: MoiraConfig | None = None,
) -> None:
    """One layer's sparse decode: Estimate -> Select -> Attend -> Merge.

    ``query``/``output`` ``[B, H_q, D]`` bf16 (one token per row),
    ``block_table`` ``[B, max_blocks]`` int32, ``seq_lens`` ``[B]`` int32
    (0 = padded row: its output is left untouched). Launch grids depend only
    on B and the static shapes, so the call replays in a CUDA graph.
    """
    _check_kv_cache(kv_cache)
    estimate_and_select(
        query, kv_cache, summaries, block_table, seq_lens, workspace, scale, config
    )
    attend(
        query,
        kv_cache,
        block_table,
        seq_lens,
        workspace.page_list,
        workspace.page_count,
        output,
        workspace,
        scale,
        config,
    )
