# SPDX-License-Identifier: Apache-2.0
"""Moira: sparse decode attention with an adaptive page budget.

Each decode step reads only the 64-token KV pages that carry the attention
mass. Four Triton kernels run per layer, on grids fixed by the batch size, so
the step replays in vLLM's full CUDA graph with no host planning:

1. Estimate: log-mass of every page from its summary (``MoiraConfig.estimator``);
   the sink and current pages exactly from their keys.
2. Select: the fewest pages whose share reaches gamma (coverage rule), by
   bisection; or a fixed count.
3. Attend: N_F blocks share the step's selected pages evenly, the lists laid
   end to end; blocks plan their own work from the list lengths in device memory.
4. Merge: log-sum-exp combine of lists split over several blocks.

Summaries are written when a page fills: by ``write_page_summaries`` for
prefill tokens, by Estimate for decode rows. Prefill runs on FA3.

Layout: the kernels' constants; the kernels stage by stage, each launcher
after its kernel; the decode step and its workspace; the vLLM backend
(metadata, builder, backend, impl). The options, the launch parameters and
the refused configurations are in moira_config.py; the prefill rows'
metadata slice in moira_utils.py.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

# MOIRA_SUMMARY_DTYPES (an option's values) and summary_storage (the kernel API's) re-exported.
from ...worker.moira_summaries import (  # noqa: F401
    MOIRA_PAGE_SIZE,
    MOIRA_SUMMARY_DTYPES,
    acquire_summaries,
    release_summaries,
    summaries_in_kv_pages,
    summary_bytes_for_kv_bytes,
    summary_key,
    summary_padded_spec,
    summary_storage,
)
from .moira_audit import MoiraAudit, make_stats_counters, switch_audit  # noqa: F401

# moira_config's public names are re-exported: callers use moira.MoiraConfig etc.
from .moira_config import (  # noqa: F401
    _REFUSED_FEATURES,
    _SELECT_MAX_TILE_PAGES,
    ATTEND_BLOCKS_PER_SM,
    LAUNCH_KERNELS,
    MOIRA_DEFAULT_AUDIT_EVERY,
    MOIRA_DEFAULT_ESTIMATOR,
    MOIRA_DEFAULT_SUMMARY_DTYPE,
    MOIRA_DENSE_STEPS,
    MOIRA_ESTIMATOR_NUM_TOP,
    MOIRA_ESTIMATORS,
    MOIRA_FP8_KV_CACHE_DTYPES,
    MOIRA_KV_CACHE_DTYPES,
    MOIRA_MAX_GROUP_SIZE,
    MOIRA_PAPER_SETTINGS,
    MOIRA_SELECTORS,
    MOIRA_SUPPORTED_HEAD_SIZES,
    AttendLaunch,
    AuditLaunch,
    EstimateLaunch,
    MoiraConfig,
    SelectLaunch,
    WriterLaunch,
    _overridden,
    _unsupported_vllm_config_reasons,
    attend_launch,
    audit_launch,
    check_launch_overrides,
    check_vllm_config_for_moira,
    estimate_launch,
    estimator_num_top,
    moira_config_from_env,
    resolve_attend_fill_blocks,
    select_launch,
    summary_slots,
    unsupported_kv_cache_dtype_message,
    writer_launch,
)
from .moira_mode import (
    MOIRA_GAMMA_EXTRA_ARG,
    backend_enum_name,
    has_kv_cache_extras_hook,
)
from .moira_utils import slice_prefill_common_metadata

try:  # Hopper grid dependency control (Triton >= 3.4)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - no Triton, or one without it: plain launches
    gdc_wait = None

logger = init_logger(__name__)

# ==========================================================================
# Constants
# ==========================================================================

# Select's tile for rows of fewer pages (K_B = 8 in Alg. 1); the largest is
# _SELECT_MAX_TILE_PAGES (moira_config).
_SELECT_SHORT_TILE_PAGES = 256
# Largest tile of list lengths that Attend scans at once.
_ATTEND_MAX_LISTS_TILE = 1024
# Chunks of one row that Merge combines per loop iteration.
_MERGE_TILE_CHUNKS = 32
# tl.dot needs at least 16 rows: the G query heads are padded to this.
_MIN_DOT_ROWS = 16


def _summary_layout(summaries: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(slots, fp32 scale view ``[num_blocks, H_kv, slots]``) of a summary
    tensor; bf16 summaries have no scales (the tensor itself is returned, as
    an unread kernel argument)."""
    if summaries.dtype == torch.bfloat16:
        return summaries.shape[2], summaries
    if summaries.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"Moira: summaries must be bfloat16, int8 or uint8 (int4 keys), got {summaries.dtype}"
        )
    rows = summaries.shape[2]
    # int8: the slots, then the scales; int4 (uint8): mean, variance, the
    # stored keys two per row, then the scales.
    num_slots = rows - 1 if summaries.dtype == torch.int8 else 2 * (rows - 2)
    min_slots = 2 if summaries.dtype == torch.int8 else 4  # int4: at least two keys
    if 4 * num_slots > summaries.shape[3] or num_slots < min_slots:
        raise ValueError(
            f"Moira: {summaries.dtype} summaries of {num_slots} slots need D >= "
            f"{4 * num_slots}, got shape {tuple(summaries.shape)}"
        )
    scales = summaries.view(torch.int8)[:, :, rows - 1, : 4 * num_slots].view(torch.float32)
    return num_slots, scales


def _summary_kernel_args(summaries: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """(the summaries as the kernels read them, INT8, INT4): int8 and int4 slots
    are integers with fp32 scales (INT8); int4 summaries (uint8, the stored keys
    two per byte, INT4) are read through an int8 view."""
    int4 = summaries.dtype == torch.uint8
    kernel_summaries = summaries.view(torch.int8) if int4 else summaries
    return kernel_summaries, kernel_summaries.dtype == torch.int8, int4


def _triton_interpreting() -> bool:
    """TRITON_INTERPRET=1 (the CPU tests): no inline PTX there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _estimate_rows(group_size: int, int8: bool) -> int:
    """Query-head columns of Estimate's [pages, heads] tiles: GROUP_ROWS for
    bf16 products (tl.dot's 16-row minimum), G padded to a power of two and to
    4 for int8 summaries' digit products, whose 4 digits per head fill the 16
    columns."""
    if int8:
        return max(4, triton.next_power_of_2(group_size))
    return _group_rows(group_size)


def _register_cap(maxnreg: int | None) -> dict[str, int]:
    """Launch option capping registers per thread (not under the interpreter)."""
    if maxnreg is None or _triton_interpreting():
        return {}
    return {"maxnreg": int(maxnreg)}


def _dependent_launch(launch: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """USE_GDC flag and the launch option of a decode-step kernel: Hopper's
    programmatic dependent launch, so each kernel may be scheduled while the
    previous one finishes and waits (gdc_wait) for its memory first, with the
    same outputs, bit for bit, as plain launches. Empty (plain launches, where
    stream order starts each kernel after the previous one) when ``launch``'s
    "step" overrides set pdl False, under the interpreter, without Triton's
    grid dependency control, and off a Hopper GPU."""
    step = _overridden("step", {"pdl": True}, (launch or {}).get("step"))
    on = (
        bool(step["pdl"])
        and gdc_wait is not None
        and not _triton_interpreting()
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9
    )
    if not on:
        return {}
    return {"USE_GDC": True, "launch_pdl": True}


@triton.jit
def _wait_for_previous_kernel(USE_GDC: tl.constexpr):
    # Under a dependent launch this kernel's blocks may start before the
    # previous kernel has finished: wait until its memory is visible before
    # any load or store. The next kernel's blocks are scheduled as this
    # kernel's blocks exit, and wait in turn, so every kernel sees all earlier
    # ones complete.
    if USE_GDC:
        gdc_wait()


def _group_rows(group_size: int) -> int:
    """Rows of the query tile: G padded to a power of two and to tl.dot's minimum."""
    return max(_MIN_DOT_ROWS, triton.next_power_of_2(group_size))


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != MOIRA_PAGE_SIZE:
        raise ValueError(
            "Moira: kv_cache must be [num_blocks, num_kv_heads, 64, 2 * head_size], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(
            "Moira: kv_cache must be bfloat16 or float8_e4m3fn (an fp8 cache viewed "
            f"as e4m3, with its k_scale and v_scale), got {kv_cache.dtype}"
        )


def _kv_scale_args(kv_cache: torch.Tensor, **scales: torch.Tensor | None) -> tuple[Any, ...]:
    """(KV_FP8, then each of ``scales`` as a kernel argument) for ``kv_cache``.

    An fp8 (e4m3) cache needs the layer's scales that the kernel reads
    (``k_scale``, ``v_scale``): fp32 tensors of one value each (vLLM's
    ``layer._k_scale`` / ``_v_scale``), read on the device. A bf16 cache
    takes none; the cache itself is passed as the unread pointers.
    """
    _check_kv_cache(kv_cache)  # vLLM's fp8 storage is uint8: it must come as an e4m3 view
    if kv_cache.dtype != torch.float8_e4m3fn:
        given = sorted(name for name, scale in scales.items() if scale is not None)
        if given:
            raise ValueError(
                f"Moira: {' / '.join(given)} apply to an fp8 KV cache only, got a "
                f"{kv_cache.dtype} cache with scales"
            )
        return (False, *(kv_cache for _ in scales))
    for name, scale in scales.items():
        if scale is None:
            raise ValueError(
                f"Moira: an fp8 KV cache needs its {name} (the layer's float32 "
                "dequantization scale, one value), got None"
            )
        if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != kv_cache.device:
            raise ValueError(
                f"Moira: {name} must be one float32 value on the cache's device "
                f"({kv_cache.device}), got {scale.dtype} shape {tuple(scale.shape)} "
                f"on {scale.device}"
            )
    return (True, *scales.values())


# ==========================================================================
# Page summaries
# ==========================================================================
@triton.jit
def _quantize_slot(vec, LEVELS: tl.constexpr):
    # Symmetric per slot vector: scale = absmax / LEVELS, q = floor(x / scale
    # + 0.5) clamped to +-LEVELS; an all-zero vector gets scale 0
    # (ref.quantize_summaries_int8 / _int4). Returns (q as fp32, scale).
    scale = tl.max(tl.abs(vec), axis=0) / LEVELS
    safe = tl.where(scale > 0.0, scale, 1.0)
    q = tl.minimum(tl.maximum(tl.floor(vec / safe + 0.5), -LEVELS), LEVELS)
    return q, scale


@triton.jit
def _store_summary_slot(
    out,  # this (page, KV head)'s summary row 0: [rows, HEAD_SIZE] bf16 or int8
    scales,  # its slot scales: [2 + NUM_TOP] fp32 (if INT8)
    slot,
    vec,  # [HEAD_SIZE] fp32
    HEAD_SIZE: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, HEAD_SIZE)
    if INT8:
        q, scale = _quantize_slot(vec, 127.0)
        tl.store(out + slot * HEAD_SIZE + offs_d, q.to(tl.int8))
        tl.store(scales + slot, scale)
    else:
        tl.store(out + slot * HEAD_SIZE + offs_d, vec.to(tl.bfloat16))


@triton.jit
def _store_int4_key_pair(
    out,  # this (page, KV head)'s summary row 0: [rows, HEAD_SIZE] int8
    scales,  # its slot scales: [2 + NUM_TOP] fp32
    pair,  # stored keys 2 pair and 2 pair + 1 -> row 2 + pair
    even_key,  # [HEAD_SIZE] fp32: stored key 2 pair
    odd_key,  # [HEAD_SIZE] fp32: stored key 2 pair + 1
    HEAD_SIZE: tl.constexpr,
):  # fmt: skip
    # Each key symmetric in 4 bits with its own scale (absmax / 7, as
    # ref.quantize_summaries_int4), the pair in one byte per channel: the odd
    # key in the high nibble (two's complement), the even key plus 8 in the
    # low one (offset binary, 1..15), i.e. the byte 16 * odd + even + 8, in
    # [-111, 127]. Offset binary lets Estimate take both nibbles to the
    # tensor cores as they are (_int4_pair_digit_dots).
    offs_d = tl.arange(0, HEAD_SIZE)
    even_q, even_scale = _quantize_slot(even_key, 7.0)
    odd_q, odd_scale = _quantize_slot(odd_key, 7.0)
    byte = odd_q.to(tl.int32) * 16 + even_q.to(tl.int32) + 8
    tl.store(out + (2 + pair) * HEAD_SIZE + offs_d, byte.to(tl.int8))
    tl.store(scales + 2 + 2 * pair, even_scale)
    tl.store(scales + 3 + 2 * pair, odd_scale)


@triton.jit
def _summarize_page(
    block,  # the page's block id
    head,  # its KV head
    kv_cache_ptr, summaries_ptr, scales_ptr,  # as kernel_moira_write_summaries'
    stride_kv_block, stride_kv_head, stride_kv_token, stride_sum_block, stride_sum_head,
    stride_scale_block, stride_scale_head,
    k_scale,  # fp32 scalar: the layer's K dequantization scale (if KV_FP8)
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_TOP: tl.constexpr,
    INT8: tl.constexpr, KV_FP8: tl.constexpr, INT4: tl.constexpr,
):  # fmt: skip
    # The summary of one full page, from its 64 keys in the cache. Shared by
    # the summary writer (prefill) and Estimate (a decode row's page that its
    # new token filled), so both store the same bits.
    # NUM_TOP = 0 (mvar): slot 0 = mean, slot 1 = variance of the 64 keys.
    # NUM_TOP = r > 0 (mvar_top8): slots 2 .. 1 + r = the r keys
    # farthest (L2) from the mean of the 64 keys, farthest first (ties: lower
    # token index), copied bit for bit; slots 0 / 1 = mean / variance of the
    # other 64 - r keys (the bulk). INT8: every slot vector stored as int8
    # with its fp32 scale (stored keys then are quantized, not bit copies).
    # INT4 (with INT8): the stored keys in 4 bits instead, two per row.
    # KV_FP8: the summary of the dequantized keys (e4m3 value x k_scale, in
    # fp32), so that Estimate meets them as it meets bf16 keys.
    page_keys = kv_cache_ptr + block * stride_kv_block + head * stride_kv_head
    out = summaries_ptr + block * stride_sum_block + head * stride_sum_head
    scales = scales_ptr + block * stride_scale_block + head * stride_scale_head
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    # One flat load of the page's keys, reshaped, so the register layout (and
    # with it the order of the per-channel sums) is the same in the writer and
    # in Estimate: a [PAGE_SIZE, HEAD_SIZE] load took the layout of the
    # kernel's other accesses of that shape, and the two stored different bits.
    flat = tl.arange(0, PAGE_SIZE * HEAD_SIZE)
    keys = tl.load(page_keys + (flat // HEAD_SIZE) * stride_kv_token + flat % HEAD_SIZE)
    keys = tl.reshape(keys, (PAGE_SIZE, HEAD_SIZE)).to(tl.float32)
    if KV_FP8:
        keys = keys * k_scale
    mean = tl.sum(keys, axis=0) / PAGE_SIZE
    centered = keys - mean[None, :]
    if NUM_TOP == 0:
        var = tl.sum(centered * centered, axis=0) / PAGE_SIZE
        _store_summary_slot(out, scales, 0, mean, HEAD_SIZE, INT8)
        _store_summary_slot(out, scales, 1, var, HEAD_SIZE, INT8)
    else:
        dist = tl.sum(centered * centered, axis=1)  # [PAGE_SIZE]
        in_bulk = offs_t >= 0  # all True
        even_key = tl.zeros([HEAD_SIZE], tl.float32)  # INT4: the pair's first key
        for j in tl.static_range(NUM_TOP):
            # argmax with the lowest index among the maxima, written out so
            # that the tie rule does not depend on tl.argmax's lowering.
            peak = tl.max(dist, axis=0)
            top = tl.min(tl.where(dist == peak, offs_t, PAGE_SIZE), axis=0)
            top = tl.minimum(top, PAGE_SIZE - 1)  # NaN keys: stay in the page
            key = tl.load(page_keys + top * stride_kv_token + offs_d).to(tl.float32)
            if KV_FP8:
                key = key * k_scale
            if not INT4:
                _store_summary_slot(out, scales, 2 + j, key, HEAD_SIZE, INT8)
            elif j % 2 == 0:
                even_key = key
            else:
                _store_int4_key_pair(out, scales, j // 2, even_key, key, HEAD_SIZE)
            chosen = offs_t == top
            dist = tl.where(chosen, float("-inf"), dist)
            in_bulk = in_bulk & (offs_t != top)
        bulk_keys = tl.where(in_bulk[:, None], keys, 0.0)
        bulk_mean = tl.sum(bulk_keys, axis=0) / (PAGE_SIZE - NUM_TOP)
        bulk_centered = tl.where(in_bulk[:, None], keys - bulk_mean[None, :], 0.0)
        bulk_var = tl.sum(bulk_centered * bulk_centered, axis=0) / (PAGE_SIZE - NUM_TOP)
        _store_summary_slot(out, scales, 0, bulk_mean, HEAD_SIZE, INT8)
        _store_summary_slot(out, scales, 1, bulk_var, HEAD_SIZE, INT8)


# A mixed step's prefill slot mapping starts after the decode tokens (8 bytes
# each): 16-byte aligned only for an even count, and Triton would compile a second
# variant at the first odd step of a serving run (one load per program: alignment
# buys nothing). num_tokens changes every step: not specialized either.
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_mapping_ptr"])
def kernel_moira_write_summaries(
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16 (fp8 if KV_FP8)
    summaries_ptr,  # [num_blocks, num_kv_heads, 2 + NUM_TOP (+1 if INT8), HEAD_SIZE] bf16/int8
    scales_ptr,  # [num_blocks, num_kv_heads, 2 + NUM_TOP] fp32 view (if INT8)
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    k_scale_ptr,  # [1] fp32: the layer's K dequantization scale (if KV_FP8)
    num_tokens,
    stride_kv_block: tl.int64, stride_kv_head: tl.int64, stride_kv_token: tl.int64,
    stride_sum_block: tl.int64, stride_sum_head: tl.int64,
    stride_scale_block: tl.int64, stride_scale_head: tl.int64,
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, WINDOW_TOKENS: tl.constexpr,
    NUM_TOP: tl.constexpr = 0, INT8: tl.constexpr = False, KV_FP8: tl.constexpr = False,
    INT4: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # One program per (window of WINDOW_TOKENS tokens, KV head). It summarizes
    # the pages that its tokens fill (a token at page offset PAGE_SIZE - 1),
    # one after another in token order: one page per window of 64 tokens of
    # one request, more where requests' segments meet. The keys are read back
    # from the cache, so a page filled across two prefill chunks is summarized
    # over all of its tokens (_summarize_page: the slots). The decode step
    # does not launch it: Estimate summarizes the pages that the decode rows'
    # new tokens fill (WRITE_FILLED_PAGE).
    _wait_for_previous_kernel(USE_GDC)
    window = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, WINDOW_TOKENS)
    tokens = window * WINDOW_TOKENS + offs
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    fills = (slots >= 0) & (slots % PAGE_SIZE == PAGE_SIZE - 1)
    k_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
    for _ in range(tl.sum(fills.to(tl.int32), axis=0)):
        first = tl.min(tl.where(fills, offs, WINDOW_TOKENS), axis=0)
        slot = tl.sum(tl.where(offs == first, slots, 0), axis=0)
        fills = fills & (offs != first)
        _summarize_page(
            slot // PAGE_SIZE, head, kv_cache_ptr, summaries_ptr, scales_ptr, stride_kv_block,
            stride_kv_head, stride_kv_token, stride_sum_block, stride_sum_head,
            stride_scale_block, stride_scale_head, k_scale, HEAD_SIZE, PAGE_SIZE, NUM_TOP, INT8,
            KV_FP8, INT4,
        )  # fmt: skip


def write_page_summaries(
    kv_cache: torch.Tensor, summaries: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, launch: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:  # fmt: skip
    """Summarize every page whose last slot (offset 63) is in ``slot_mapping``.

    Call after the KV scatter of the same tokens. ``summaries`` is
    ``[num_blocks, H_kv, 2 + r, D]`` bf16, ``[num_blocks, H_kv, 2 + r + 1, D]``
    int8 (the last row holds the slots' fp32 scales), or ``[num_blocks, H_kv, 2 +
    r / 2 + 1, D]`` uint8 (int4 stored keys, two per row): its slot count selects
    the summary (2: mean and variance of the 64 keys, for mvar; 2 + r: bulk mean
    and variance and the r farthest keys, for mvar_top8).
    It runs on Estimate's warps (writer_launch), which summarizes the pages
    that decode rows fill (``write_filled_pages``), so that both store the
    same bits (the per-channel sums are reduced in the order of the warps'
    layout, and int8 scales keep every fp32 bit of it). Graph-safe: the grid
    is the number of tokens over the launch's window; no host sync.
    ``launch``: launch overrides by kernel (``check_launch_overrides``).
    An fp8 (e4m3) ``kv_cache`` needs ``k_scale`` (the layer's fp32 scale, one
    value): the summaries are those of the dequantized keys.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    kv_fp8, k_scale_arg = _kv_scale_args(kv_cache, k_scale=k_scale)
    head_size = kv_cache.shape[-1] // 2
    num_slots, scales = _summary_layout(summaries)
    num_top = num_slots - 2
    if num_top not in MOIRA_ESTIMATOR_NUM_TOP.values():
        raise ValueError(
            f"Moira: summaries must have {sorted(set(map(summary_slots, MOIRA_ESTIMATORS)))} "
            f"slots (int8: plus one row of scales), got shape {tuple(summaries.shape)}"
        )
    # Rows of D contiguous elements; blocks and heads at any stride (the
    # kernel takes them), e.g. summaries stored in the KV pages' padding.
    assert kv_cache.stride(-1) == 1 and summaries.stride(3) == 1
    assert summaries.stride(2) == summaries.shape[3]
    kernel_summaries, int8, int4 = _summary_kernel_args(summaries)
    writer = writer_launch((launch or {}).get("writer"))
    grid = (triton.cdiv(num_tokens, writer.window_tokens), kv_cache.shape[1])
    kernel_moira_write_summaries[grid](
        kv_cache, kernel_summaries, scales, slot_mapping, k_scale_arg, num_tokens,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), summaries.stride(0),
        summaries.stride(1), scales.stride(0), scales.stride(1),
        HEAD_SIZE=head_size, PAGE_SIZE=MOIRA_PAGE_SIZE, WINDOW_TOKENS=writer.window_tokens,
        NUM_TOP=num_top, INT8=int8, INT4=int4, KV_FP8=kv_fp8, num_warps=writer.num_warps,
        **_dependent_launch(launch),
    )  # fmt: skip


def rebuild_page_summaries(
    kv_cache: torch.Tensor, summaries: torch.Tensor, k_scale: torch.Tensor | None = None
) -> None:
    """Summarize every page of the cache from the keys it holds now.

    For a cache filled without the backend (a KV connector or offload loading
    pages, a test harness writing them directly): the summaries then describe
    those keys, as if the pages had been filled through the backend. Pages
    never filled get summaries of whatever they hold, which no list reads
    (block tables point at filled pages; the current page is exact). One pass
    over the cache; not for the decode step.
    """
    last_slots = torch.arange(kv_cache.shape[0], dtype=torch.int64, device=kv_cache.device)
    last_slots = last_slots * MOIRA_PAGE_SIZE + (MOIRA_PAGE_SIZE - 1)
    write_page_summaries(kv_cache, summaries, last_slots, k_scale)


def warm_up_summary_writer(
    kv_cache: torch.Tensor, summaries: torch.Tensor, k_scale: torch.Tensor | None = None
) -> None:
    """Compile the summary writer for this cache and summary layout now.

    The writer first runs on the first request's prefill (vLLM's profiling run
    has no attention metadata, and graph capture runs decode steps only), so
    without this its compilation (seconds on a cold Triton cache) lands in that
    request's first step. One launch over a padding slot (-1): it writes
    nothing. Call outside CUDA-graph capture; a no-op off the GPU.
    """
    if not kv_cache.is_cuda or kv_cache.numel() == 0:
        return
    padding = torch.full((1,), -1, dtype=torch.int64, device=kv_cache.device)
    write_page_summaries(kv_cache, summaries, padding, k_scale)


def verify_page_summaries(
    kv_cache: torch.Tensor, summaries: torch.Tensor, k_scale: torch.Tensor | None = None
) -> dict[str, int]:
    """Every page whose summary was written (any nonzero byte, over all KV
    heads) summarized again from the keys now in the cache, into a fresh
    buffer (``write_page_summaries``), and compared:
    {"pages" checked, "mismatched" (any bit differs), "beyond_rounding" (a
    value off by more than one bf16 step, or one int8 step / a scale off by
    more than 1e-5 relative)}. A debugging and validation helper (host sync;
    not for the decode step): a page that filled and was not summarized is
    missing from "pages"; one summarized from other keys differs beyond
    rounding. Pages freed and refilled only in part keep their old summary
    and differ too: check before blocks are reused."""
    written = summaries.flatten(1).ne(0).any(dim=1)
    blocks = written.nonzero().flatten()
    if blocks.numel() == 0:
        return {"pages": 0, "mismatched": 0, "beyond_rounding": 0}
    fresh = torch.zeros_like(summaries)
    last_slots = blocks.to(torch.int64) * MOIRA_PAGE_SIZE + MOIRA_PAGE_SIZE - 1
    write_page_summaries(kv_cache, fresh, last_slots, k_scale)
    got, want = summaries[blocks], fresh[blocks]
    mismatched = (got != want).flatten(1).any(dim=1)
    num_slots, _ = _summary_layout(summaries)
    if summaries.dtype != torch.bfloat16:  # int8 or int4: one step of the slot's integers
        got_values, got_scales = _integer_slots(got, num_slots)
        want_values, want_scales = _integer_slots(want, num_slots)
        off = (got_values - want_values).abs().flatten(1).gt(1).any(dim=1)
        scale_off = (got_scales - want_scales).abs() > 1e-5 * want_scales.abs() + 1e-30
        off |= scale_off.flatten(1).any(dim=1)
    else:
        a, b = got.float(), want.float()
        size = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-126)
        bf16_step = torch.pow(2.0, torch.floor(torch.log2(size)) - 7)
        off = ((a - b).abs() > bf16_step).flatten(1).any(dim=1)
    return {"pages": int(blocks.numel()), "mismatched": int(mismatched.sum()),
            "beyond_rounding": int(off.sum())}  # fmt: skip


def _integer_slots(summaries: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 or int4 (uint8) summaries ``[..., rows, D]`` as (the slots' integer values,
    int32 ``[..., num_slots, D]``, the int4 keys unpacked as _store_int4_key_pair
    packs them; their fp32 scales ``[..., num_slots]``)."""
    x = summaries.view(torch.int8)
    scales = x[..., -1, : 4 * num_slots].clone().view(torch.float32)
    if summaries.dtype == torch.int8:
        return x[..., :num_slots, :].int(), scales
    packed = x[..., 2:-1, :].int()
    odd = packed >> 4
    even = (packed & 15) - 8
    keys = torch.stack([even, odd], dim=-2).flatten(-3, -2)
    return torch.cat([x[..., :2, :].int(), keys], dim=-2), scales


# ==========================================================================
# Estimate (Eq. 2)
# ==========================================================================
@triton.jit
def _fp16_query(q):
    # The bf16 query for products with fp8 K/V pages, which are converted to
    # fp16 (e4m3 -> fp16 is one exact conversion per two values; to bf16 it
    # takes three). bf16 values are exact in fp16 over its normal range; the
    # clamp only keeps an absurd query finite.
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _exact_page_logmass(
    q,  # [GROUP_ROWS, HEAD_SIZE] bf16 query heads of the KV head (padded rows 0)
    scale, kv_cache_ptr, block, head, num_valid, stride_kv_block, stride_kv_head,
    stride_kv_token,
    k_scale,  # fp32 scalar: the layer's K dequantization scale (if KV_FP8)
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    # log sum_k exp(s q.k) over the page's valid tokens, for every query head.
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask_t = offs_t < num_valid
    page_keys = kv_cache_ptr + block * stride_kv_block + head * stride_kv_head
    keys = tl.load(page_keys + offs_t[:, None] * stride_kv_token + offs_d[None, :],
                   mask=mask_t[:, None], other=0.0)  # fmt: skip
    if KV_FP8:
        # Dequantized keys: the e4m3 values meet q in fp16 (_fp16_query), in
        # which both are exact, and k_scale joins the softmax scale.
        logits = tl.dot(keys.to(tl.float16), tl.trans(_fp16_query(q))) * (scale * k_scale)
    else:
        logits = tl.dot(keys, tl.trans(q)) * scale  # [PAGE_SIZE, GROUP_ROWS]
    logits = tl.where(mask_t[:, None], logits, float("-inf"))
    peak = tl.max(logits, axis=0)
    return peak + tl.log(tl.sum(tl.exp(logits - peak[None, :]), axis=0))


@triton.jit
def _is_dense_row(num_pages, selector_ptr):
    # dense_batch_tokens: a row whose pages x decode rows (the grid's rows)
    # are at most selector_params[3] keeps every page. Estimate skips it and
    # Select writes its whole list; both decide with this one test.
    dense_pages = tl.load(selector_ptr + 3)
    return (num_pages * tl.num_programs(0)).to(tl.float32) <= dense_pages


@triton.jit
def _int8_digits(x, ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr):
    # x [ROWS, HEAD_SIZE] fp32 as four int8 digits per value on a per-row
    # power-of-two grid: x = sum_p d_p * step_p + r, step_p = s * 128^-p,
    # d_0 in [-128, 127], d_1..3 in [0, 127], 0 <= r < s * 2^-21, with s =
    # 2^(E - 6) for the row's largest |x| in [2^E, 2^(E+1)). Every step is an
    # exact power of two built from exponent bits (no division, no exp2), so
    # x / step_p and its floor are exact and so is each digit: a bf16 query
    # is represented exactly down to 2^-27 of its largest value. Returns the
    # digits [ROWS * 4, HEAD_SIZE] int8 (row r's digit p at row 4 r + p) and
    # step [ROWS, 4] fp32. All-zero rows get s = 1 (digits 0).
    absmax = tl.max(tl.abs(x), axis=1)
    exponent = (absmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # Rows whose largest |x| is below 2^-96 (0 included) take s = 1: their
    # values are then represented within 2^-21 (no 2^127 overflow below).
    exponent = tl.where(exponent > 30, exponent, 133)
    s = ((exponent - 6) << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - (exponent - 6)) << 23).to(tl.float32, bitcast=True)
    p = tl.arange(0, 4)
    shift = tl.where(p == 0, 1.0, tl.where(p == 1, 128.0, tl.where(p == 2, 16384.0, 2097152.0)))
    inv_shift = tl.where(
        p == 0, 1.0, tl.where(p == 1, 2.0**-7, tl.where(p == 2, 2.0**-14, 2.0**-21))
    )
    step = s[:, None] * inv_shift[None, :]  # products of powers of two: exact
    inv_step = inv_s[:, None] * shift[None, :]
    # d_p = floor(x / step_p) - 128 floor(x / step_{p-1}) (d_0: the first term).
    x3 = x[:, None, :]
    whole = tl.floor(x3 * inv_step[:, :, None])
    above = tl.where(
        p[None, :, None] > 0, 128.0 * tl.floor(x3 * (inv_step[:, :, None] * 0.0078125)), 0.0
    )
    digits = (whole - above).to(tl.int8)
    return tl.reshape(digits, [ROWS * 4, HEAD_SIZE]), step


@triton.jit
def _int8_digit_dot(slot, digits, step, TILE_PAGES: tl.constexpr, ROWS: tl.constexpr):
    # [TILE_PAGES, HEAD_SIZE] int8 slot values times the int8 digits of q (or
    # (s q)^2) on the int8 tensor cores: one int32 product of 4 x ROWS columns,
    # exact (|sum| < 128 * 127 * 128 < 2^24, so also in fp32), then each head's
    # four digit products scaled by their steps and summed: [TILE_PAGES, ROWS]
    # fp32, before the slot's scale.
    acc = tl.dot(slot, tl.trans(digits), out_dtype=tl.int32)
    return _scale_digit_products(acc, step, TILE_PAGES, ROWS)


@triton.jit
def _scale_digit_products(acc, step, TILE_PAGES: tl.constexpr, ROWS: tl.constexpr):
    # [TILE_PAGES, 4 x ROWS] int32 products with q's digits -> [TILE_PAGES,
    # ROWS] fp32: each head's four digit products times their steps, summed.
    acc = tl.reshape(acc.to(tl.float32), [TILE_PAGES, ROWS, 4])
    return tl.sum(acc * step[None, :, :], axis=2)


@triton.jit
def _int4_pair_digit_dots(
    packed, digits, digit_sums, step, TILE_PAGES: tl.constexpr, ROWS: tl.constexpr
):
    # Stored keys 2 i and 2 i + 1 of row 2 + i times q's int8 digits, with no
    # per-key unpacking: the byte is 16 odd + (even + 8) (_store_int4_key_pair),
    # so its high nibble in place (byte & 0xF0 = 16 odd) and its low nibble
    # (even + 8) are valid int8 operands as they are, one bitwise AND per byte
    # each, where unpacking both keys costs several instructions per key on
    # an issue-bound loop. Then q.odd = q.(16 odd) / 16
    # and q.even = q.(even + 8) - 8 sum(digits), exact in int32 (|products| <
    # 2^21): the same integers as the unpacked keys' products, so the same
    # bits. Returns (even, odd) logits [TILE_PAGES, ROWS] fp32, before the
    # slots' scales.
    high = (packed & -16).to(tl.int8)
    low = (packed & 15).to(tl.int8)
    odd = tl.dot(high, tl.trans(digits), out_dtype=tl.int32) >> 4
    even = tl.dot(low, tl.trans(digits), out_dtype=tl.int32) - 8 * digit_sums[None, :]
    return (
        _scale_digit_products(even, step, TILE_PAGES, ROWS),
        _scale_digit_products(odd, step, TILE_PAGES, ROWS),
    )


@triton.jit
def _add_stored_key(
    peak,  # [TILE_PAGES, EST_ROWS] fp32 running max of the page's log-terms
    total,  # [TILE_PAGES, EST_ROWS] fp32 running sum of exp(term - peak)
    key,  # [TILE_PAGES, HEAD_SIZE] stored key j of each page, as stored (bf16 or int8)
    page_scales,  # [TILE_PAGES] pointers to the pages' slot scales (if INT8)
    j,  # stored key index (slot 2 + j)
    q, q_digits, q_step, scale, mask_p, TILE_PAGES: tl.constexpr, EST_ROWS: tl.constexpr,
    INT8: tl.constexpr,
):  # fmt: skip
    # One stored key's exact logits, folded into the online logaddexp.
    if INT8:
        logit = _int8_digit_dot(key, q_digits, q_step, TILE_PAGES, EST_ROWS)
    else:
        logit = tl.dot(key, tl.trans(q))
    return _fold_key_logit(peak, total, logit, page_scales, j, scale, mask_p, INT8)


@triton.jit
def _fold_key_logit(peak, total, logit, page_scales, j, scale, mask_p, INT8: tl.constexpr):
    # Stored key j's products with q ([TILE_PAGES, EST_ROWS] fp32, before the
    # softmax scale and, if INT8, the slot's scale) into the online logaddexp.
    logit = logit * scale
    if INT8:
        logit = logit * tl.load(page_scales + 2 + j, mask=mask_p, other=0.0)[:, None]
    new_peak = tl.maximum(peak, logit)
    total = total * tl.exp(peak - new_peak) + tl.exp(logit - new_peak)
    return new_peak, total


@triton.jit
def _summary_tile_logmass(
    q,  # [EST_ROWS, HEAD_SIZE] bf16 query heads of the KV head (padded rows 0)
    q_sq_hi,  # [EST_ROWS, HEAD_SIZE] bf16: (s q)^2, high part (if not INT8)
    q_sq_lo,  # [EST_ROWS, HEAD_SIZE] bf16: (s q)^2 - high part (if not INT8)
    q_digits,  # [4 * EST_ROWS, HEAD_SIZE] int8: q's digits (if INT8)
    q_step,  # [EST_ROWS, 4] fp32: their steps
    sq_digits,  # [4 * EST_ROWS, HEAD_SIZE] int8: (s q)^2's digits (if INT8)
    sq_step,  # [EST_ROWS, 4] fp32: their steps
    scale, summaries_ptr, scales_ptr,
    bt_row,  # this row's block table
    pages,  # [TILE_PAGES] logical pages of the tile
    mask_p,  # [TILE_PAGES] pages the tile estimates
    head, stride_sum_block, stride_sum_head, stride_scale_block, stride_scale_head,
    EST_ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE_PAGES: tl.constexpr, NUM_TOP: tl.constexpr, INT8: tl.constexpr, KEY_STAGES: tl.constexpr,
    INT4: tl.constexpr = False,
):  # fmt: skip
    # The summary estimate of one tile of pages, all G query heads at once on
    # the tensor cores: [TILE_PAGES, EST_ROWS] fp32. Products of bf16 values
    # are exact in the fp32 accumulator, so the mean term is fp32-exact up to
    # summation order; (s q)^2 is split into two bf16 parts (hi + lo) so the
    # spread term keeps ~16 significant bits. INT8 summaries: every slot, the
    # variance too, meets the int8 digits of q or (s q)^2 as stored
    # (_int8_digits: exact to 2^-27 of the row's largest value), one int32
    # product per slot with all heads' digits in its 16+ columns, scaled by
    # the slot's fp32 scale afterwards (one multiply per page).
    offs_d = tl.arange(0, HEAD_SIZE)
    blocks = tl.load(bt_row + pages, mask=mask_p, other=0)
    summary = (
        summaries_ptr + blocks.to(tl.int64)[:, None] * stride_sum_block + head * stride_sum_head
    )
    mean = tl.load(summary + offs_d[None, :], mask=mask_p[:, None], other=0.0)
    var = tl.load(summary + HEAD_SIZE + offs_d[None, :], mask=mask_p[:, None], other=0.0)
    page_scales = scales_ptr  # unread unless INT8
    if INT8:
        page_scales = (
            scales_ptr + blocks.to(tl.int64) * stride_scale_block + head * stride_scale_head
        )
        mean_scale = tl.load(page_scales, mask=mask_p, other=0.0)[:, None]
        var_scale = tl.load(page_scales + 1, mask=mask_p, other=0.0)[:, None]

    # Eq. 2: s q.mu + 1/2 (s q)^2 . sigma^2 + log S, as [TILE_PAGES, EST_ROWS]
    if INT8:
        est = _int8_digit_dot(mean, q_digits, q_step, TILE_PAGES, EST_ROWS)
        est = est * scale * mean_scale
        v = _int8_digit_dot(var, sq_digits, sq_step, TILE_PAGES, EST_ROWS) * var_scale
    else:
        est = tl.dot(mean, tl.trans(q)) * scale
        v = tl.dot(var, tl.trans(q_sq_hi)) + tl.dot(var, tl.trans(q_sq_lo))
    if NUM_TOP > 0:
        # mvar_top8: the spread term of the random energy model over the
        # m = 64 - r summarized keys, v / 2 up to v = 2 ln m, then linear in
        # sqrt(v).
        log_m = tl.log((PAGE_SIZE - NUM_TOP) * 1.0)
        v = tl.maximum(v, 0.0)
        spread = tl.where(v <= 2.0 * log_m, 0.5 * v, tl.sqrt(2.0 * log_m) * tl.sqrt(v) - log_m)
        est += spread + log_m
    else:
        est += 0.5 * v
        est += tl.log(PAGE_SIZE * 1.0)
    if NUM_TOP > 0:
        # logaddexp of the bulk and the stored keys' exact logits (online:
        # running max and sum of exp relative to it).
        peak = est
        total = tl.full([TILE_PAGES, EST_ROWS], 1.0, tl.float32)
        # A loop that Triton software-pipelines (KEY_STAGES > 1: the next
        # keys' tiles are copied into shared memory while this key's product
        # runs), faster than the unrolled keys. INT4: one load per pair of
        # keys (row 2 + i holds keys 2 i and 2 i + 1), whose products with q
        # are those of int8 keys, in the same order.
        if INT4:
            # Each head digit's sum over the channels: [4 * EST_ROWS] int32.
            digit_sums = tl.sum(q_digits.to(tl.int32), axis=1)
            for i in tl.range(0, NUM_TOP // 2, num_stages=KEY_STAGES):
                packed = tl.load(summary + (2 + i) * HEAD_SIZE + offs_d[None, :],
                                 mask=mask_p[:, None], other=0)  # fmt: skip
                even, odd = _int4_pair_digit_dots(
                    packed, q_digits, digit_sums, q_step, TILE_PAGES, EST_ROWS
                )
                peak, total = _fold_key_logit(
                    peak, total, even, page_scales, 2 * i, scale, mask_p, INT8
                )
                peak, total = _fold_key_logit(
                    peak, total, odd, page_scales, 2 * i + 1, scale, mask_p, INT8
                )
        else:
            for j in tl.range(0, NUM_TOP, num_stages=KEY_STAGES):
                key = tl.load(summary + (2 + j) * HEAD_SIZE + offs_d[None, :],
                              mask=mask_p[:, None], other=0.0)  # fmt: skip
                peak, total = _add_stored_key(
                    peak, total, key, page_scales, j, q, q_digits, q_step, scale, mask_p,
                    TILE_PAGES, EST_ROWS, INT8,
                )  # fmt: skip
        est = peak + tl.log(total)
    return est


@triton.jit
def _query_heads(q_heads, stride_q_head, GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr,
                 HEAD_SIZE: tl.constexpr):  # fmt: skip
    # The G query heads of a KV head as a [ROWS, HEAD_SIZE] tile (padded rows
    # 0), with the rows' offsets and mask.
    offs = tl.arange(0, ROWS)
    mask = offs < GROUP_SIZE
    q = tl.load(q_heads + offs[:, None] * stride_q_head + tl.arange(0, HEAD_SIZE)[None, :],
                mask=mask[:, None], other=0.0)  # fmt: skip
    return q, offs, mask


@triton.jit
def kernel_moira_estimate(
    query_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16 (fp8 if KV_FP8)
    summaries_ptr,  # [num_blocks, num_kv_heads, 2 + NUM_TOP (+1 if INT8), HEAD_SIZE] bf16/int8
    scales_ptr,  # [num_blocks, num_kv_heads, 2 + NUM_TOP] fp32 view (if INT8)
    block_table_ptr,  # [num_rows, max_blocks] int32
    seq_lens_ptr,  # [num_rows] int32
    logmass_ptr,  # [max_rows, num_kv_heads, GROUP_SIZE, max_pages] fp32 (out)
    selector_ptr,  # [4] fp32: gamma, K, fraction, dense batch pages (if SKIP_DENSE_ROWS)
    kept_total_ptr,  # [1] int32: the step's pages in all lists (zeroed, if RESET_KEPT_TOTAL)
    k_scale_ptr,  # [1] fp32: the layer's K dequantization scale (if KV_FP8)
    scale,
    stride_q_row: tl.int64, stride_q_head: tl.int64,
    stride_kv_block: tl.int64, stride_kv_head: tl.int64, stride_kv_token: tl.int64,
    stride_sum_block: tl.int64, stride_sum_head: tl.int64,
    stride_scale_block: tl.int64, stride_scale_head: tl.int64,
    stride_bt_row: tl.int64,
    stride_lm_row: tl.int64, stride_lm_head: tl.int64, stride_lm_group: tl.int64,
    GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr, EST_ROWS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr,
    NUM_TOP: tl.constexpr = 0, SKIP_DENSE_ROWS: tl.constexpr = False,
    INT8: tl.constexpr = False, KEY_STAGES: tl.constexpr = 1,
    RESET_KEPT_TOTAL: tl.constexpr = False, WRITE_FILLED_PAGE: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, INT4: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # Programs (row, KV head, z). z = 0 and 1 compute the sink page and the
    # current page exactly from the keys: programs of their own, so that the
    # exact pages (a 64-key read and a softmax) do not lengthen the critical
    # path of the summary tiles, and first in launch order (z varies slowest),
    # so that they do not run as a tail after the tiles. z >= 2: the summary
    # estimate of TILE_PAGES pages (_summary_tile_logmass).
    row = tl.program_id(0)
    head = tl.program_id(1)
    z = tl.program_id(2)
    # The row's length is host-written before the step: read before the wait,
    # so that under a dependent launch its round trip overlaps the previous
    # kernel's end. Nothing that kernel writes is read, and nothing is
    # stored, before the wait.
    seq_len = tl.load(seq_lens_ptr + row)
    _wait_for_previous_kernel(USE_GDC)
    # Select (the next kernel) adds every list's length to this total, which
    # sizes Attend's chunks; one program zeroes it for the step. (The outer
    # test is a constexpr: without it the store is not compiled at all.)
    if RESET_KEPT_TOTAL:  # noqa: SIM102
        if (row == 0) & (head == 0) & (z == 0):
            tl.store(kept_total_ptr, 0)
    tile = z - 2
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    last = num_pages - 1
    k_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
    if WRITE_FILLED_PAGE:
        # The decode step's summary writer, folded in (one launch fewer per
        # layer): when the row's new token is its page's 64th, the program of
        # that page (the current page: z = 1, or z = 0 on a one-page row)
        # summarizes it, also on a dense row. No program of this launch reads
        # that summary (the current page is exact here); the next step does.
        of_current_page = (z == 1) | ((z == 0) & (last == 0))
        if of_current_page & (seq_len > 0) & (seq_len % PAGE_SIZE == 0):
            block = tl.load(block_table_ptr + row * stride_bt_row + last).to(tl.int64)
            _summarize_page(block, head, kv_cache_ptr, summaries_ptr, scales_ptr,
                            stride_kv_block, stride_kv_head, stride_kv_token, stride_sum_block,
                            stride_sum_head, stride_scale_block, stride_scale_head, k_scale,
                            HEAD_SIZE, PAGE_SIZE, NUM_TOP, INT8, KV_FP8, INT4)  # fmt: skip
    # Idle programs: tiles past the row's end, and the current-page program of
    # a one-page row (its current page is the sink page, z = 0 has it).
    idle = (num_pages == 0) | ((z >= 2) & (tile * TILE_PAGES >= num_pages))
    idle = idle | ((z == 1) & (last == 0))
    if SKIP_DENSE_ROWS:
        # Rows that Select keeps whole (dense_batch_tokens) need no estimate.
        idle = idle | _is_dense_row(num_pages, selector_ptr)
    if idle:
        return
    q_heads = query_ptr + row * stride_q_row + head * GROUP_SIZE * stride_q_head
    lm_row = logmass_ptr + row * stride_lm_row + head * stride_lm_head
    if z >= 2:
        # The tile's query rows: EST_ROWS (= GROUP_ROWS unless the int8
        # digit products pack the heads, _estimate_rows).
        q_rows, offs_e, mask_e = _query_heads(q_heads, stride_q_head, GROUP_SIZE, EST_ROWS,
                                              HEAD_SIZE)  # fmt: skip
        q_scaled = q_rows.to(tl.float32) * scale
        q_sq = q_scaled * q_scaled
        if INT8:
            q_digits, q_step = _int8_digits(q_rows.to(tl.float32), EST_ROWS, HEAD_SIZE)
            sq_digits, sq_step = _int8_digits(q_sq, EST_ROWS, HEAD_SIZE)
            # Unused on this path.
            q_sq_hi = q_rows
            q_sq_lo = q_rows
        else:
            q_sq_hi = q_sq.to(tl.bfloat16)
            q_sq_lo = (q_sq - q_sq_hi.to(tl.float32)).to(tl.bfloat16)
            # Unused on this path.
            q_digits = q_rows
            q_step = q_sq
            sq_digits = q_rows
            sq_step = q_sq
        pages = tile * TILE_PAGES + tl.arange(0, TILE_PAGES)
        # Page 0 and the current page belong to the exact programs.
        mask_p = (pages > 0) & (pages < last)
        est = _summary_tile_logmass(
            q_rows, q_sq_hi, q_sq_lo, q_digits, q_step, sq_digits, sq_step, scale,
            summaries_ptr, scales_ptr, block_table_ptr + row * stride_bt_row, pages, mask_p,
            head, stride_sum_block, stride_sum_head, stride_scale_block, stride_scale_head,
            EST_ROWS, HEAD_SIZE, PAGE_SIZE, TILE_PAGES, NUM_TOP, INT8, KEY_STAGES, INT4,
        )  # fmt: skip
        tl.store(
            lm_row + offs_e[None, :] * stride_lm_group + pages[:, None],
            est,
            mask=mask_p[:, None] & mask_e[None, :],
        )
    else:
        q, offs_g, mask_g = _query_heads(q_heads, stride_q_head, GROUP_SIZE, GROUP_ROWS, HEAD_SIZE)
        # The sink page (z = 0) or the current page (z = 1), from the keys.
        page = tl.where(z == 0, 0, last)
        block = tl.load(block_table_ptr + row * stride_bt_row + page).to(tl.int64)
        num_valid = tl.minimum(seq_len - page * PAGE_SIZE, PAGE_SIZE)
        exact = _exact_page_logmass(
            q, scale, kv_cache_ptr, block, head, num_valid,
            stride_kv_block, stride_kv_head, stride_kv_token, k_scale, HEAD_SIZE, PAGE_SIZE,
            KV_FP8,
        )  # fmt: skip
        tl.store(lm_row + offs_g * stride_lm_group + page, exact, mask=mask_g)


def _estimate_strides(query, kv_cache, summaries, scales, block_table, logmass) -> tuple:
    """kernel_moira_estimate's stride arguments, in its order (query, KV cache,
    summaries, scales, block table, log-masses)."""
    return (
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        summaries.stride(0), summaries.stride(1),
        scales.stride(0), scales.stride(1),
        block_table.stride(0),
        logmass.stride(0), logmass.stride(1), logmass.stride(2),
    )  # fmt: skip


def estimate_page_logmass(
    query: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, logmass: torch.Tensor, scale: float,
    estimator: str, selector_params: torch.Tensor | None = None,
    kept_total: torch.Tensor | None = None, write_filled_pages: bool = False,
    k_scale: torch.Tensor | None = None, launch: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:  # fmt: skip
    """Fill ``logmass[:B, h, g, :n_pages]`` for every row (Eq. 2, or the
    ``estimator``'s formula; sink and current page exact). ``summaries`` must
    have ``summary_slots(estimator)`` slots (no default: the summaries decide,
    and the config's default is not the paper's mvar). Grid covers
    ``block_table.shape[1]`` pages per row. ``selector_params``
    (``MoiraWorkspace.selector_params``): rows that Select will keep whole
    (``dense_batch_tokens``) are skipped; None estimates every row.
    ``kept_total`` (int32 ``[1]``, ``MoiraWorkspace.kept_total``) is zeroed
    for Select to sum the step's list lengths into. ``write_filled_pages``:
    also write the summary of each row's current page whose 64 tokens are
    all in (``seq_len % 64 == 0``), as ``write_page_summaries`` does for its
    last slot: the decode step's summary write, without a launch of its own.
    An fp8 (e4m3) ``kv_cache`` needs ``k_scale`` (the layer's fp32 scale, one
    value): the exact pages read the dequantized keys. ``launch``: launch
    overrides by kernel (``check_launch_overrides``)."""
    kv_fp8, k_scale_arg = _kv_scale_args(kv_cache, k_scale=k_scale)
    num_top = estimator_num_top(estimator)
    num_rows, num_q_heads, head_size = query.shape
    num_slots, scales = _summary_layout(summaries)
    if num_slots != 2 + num_top:
        raise ValueError(
            f"Moira: estimator {estimator!r} needs a summary of {2 + num_top} slots "
            f"[num_blocks, H_kv, {2 + num_top}, D] (int8: {3 + num_top} rows, the last "
            f"the scales; int4 keys: {3 + num_top // 2} uint8 rows), got {summaries.dtype} "
            f"shape {tuple(summaries.shape)}"
        )
    assert summaries.stride(3) == 1 and summaries.stride(2) == head_size
    num_kv_heads = kv_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    max_pages = min(block_table.shape[1], logmass.shape[-1])
    assert logmass.shape[2] == group_size
    kernel_summaries, int8, int4 = _summary_kernel_args(summaries)
    est = estimate_launch(num_top, int8, (launch or {}).get("estimate"))
    # The two exact-page programs (sink, current page), then the summary tiles.
    grid = (num_rows, num_kv_heads, 2 + triton.cdiv(max_pages, est.tile_pages))
    kernel_moira_estimate[grid](
        query, kv_cache, kernel_summaries, scales, block_table, seq_lens, logmass,
        # Unread when SKIP_DENSE_ROWS is False; any fp32 pointer will do.
        logmass if selector_params is None else selector_params,
        # Unwritten when RESET_KEPT_TOTAL is False.
        seq_lens if kept_total is None else kept_total, k_scale_arg, scale,
        *_estimate_strides(query, kv_cache, summaries, scales, block_table, logmass),
        GROUP_SIZE=group_size, GROUP_ROWS=_group_rows(group_size),
        EST_ROWS=_estimate_rows(group_size, int8), HEAD_SIZE=head_size, PAGE_SIZE=MOIRA_PAGE_SIZE,
        TILE_PAGES=est.tile_pages, NUM_TOP=num_top, SKIP_DENSE_ROWS=selector_params is not None,
        INT8=int8, KEY_STAGES=est.key_stages, RESET_KEPT_TOTAL=kept_total is not None,
        WRITE_FILLED_PAGE=write_filled_pages, KV_FP8=kv_fp8, INT4=int4, num_warps=est.num_warps,
        **_register_cap(est.maxnreg), **_dependent_launch(launch),
    )  # fmt: skip


# ==========================================================================
# Select (Eq. 3, Alg. 1)
# ==========================================================================
@triton.jit
def _pibar_tile(pibar_ptr, tile_pibar, t, num_pages, TILE_PAGES: tl.constexpr,
                NUM_TILES: tl.constexpr):  # fmt: skip
    # Tile t of a row's pibar: (its pages, which of them are middle pages (not
    # the sink, not the current page), their pibar). One tile stays in
    # registers; longer rows re-read their pibar from the scratch buffer
    # (L1/L2-resident).
    pages = t * TILE_PAGES + tl.arange(0, TILE_PAGES)
    middle = (pages > 0) & (pages < num_pages - 1)
    if NUM_TILES == 1:
        pib = tile_pibar
    else:
        pib = tl.load(pibar_ptr + pages, mask=middle, other=0.0)
    return pages, middle, pib


@triton.jit
def _kept_share(pibar_ptr, tile_pibar, num_pages, tau, by_count, TILE_PAGES: tl.constexpr,
                NUM_TILES: tl.constexpr):  # fmt: skip
    # Share (or count) of the middle pages whose pibar is >= tau.
    total = 0.0
    for t in tl.static_range(NUM_TILES):
        pages, middle, pib = _pibar_tile(pibar_ptr, tile_pibar, t, num_pages, TILE_PAGES, NUM_TILES)
        above = middle & (pib >= tau)
        total += tl.sum(tl.where(above, tl.where(by_count, 1.0, pib), 0.0), axis=0)
    return total


@triton.jit
def _count_list(read_stats_ptr, kept_total_ptr, n_kept, num_pages, HAS_KEPT_TOTAL: tl.constexpr):
    # Adds one (row, KV head)'s list to the running totals: pages kept and
    # pages in the rows (the read fraction, read by the host only outside the
    # decode step), and the step's list pages (Attend's chunk size). Plain
    # integer counters: nothing in this kernel reads them, and the kernels
    # that do run after it has completed (or, dependent, after gdc_wait), so
    # relaxed atomics suffice. Triton's default (acq_rel) put a GPU-wide fence
    # (MEMBAR.ALL.GPU) before each of the three, at the end of Select's
    # critical path, waiting for the list's stores.
    tl.atomic_add(read_stats_ptr, n_kept.to(tl.int64), sem="relaxed")  # type: ignore[attr-defined]
    tl.atomic_add(read_stats_ptr + 1, num_pages.to(tl.int64), sem="relaxed")
    if HAS_KEPT_TOTAL:
        # Integer sum: the same in any order.
        tl.atomic_add(kept_total_ptr, n_kept, sem="relaxed")


@triton.jit
def _select_row(
    lm,  # this row's log-masses: [GROUP_SIZE, pages] at stride stride_lm_group
    pib_ptr,  # this row's pibar scratch (used when NUM_TILES > 1)
    out,  # this row's page list
    count_ptr, read_stats_ptr, kept_total_ptr, selector_ptr,
    gamma,  # this row's coverage target (its request's, else the server's)
    num_pages, stride_lm_group, GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr,
    TILE_PAGES: tl.constexpr, NUM_TILES: tl.constexpr, LANES: tl.constexpr,
    LANE_PASSES: tl.constexpr, HAS_KEPT_TOTAL: tl.constexpr,
):  # fmt: skip
    # Alg. 1 for one (row, KV head) whose pages fit NUM_TILES * TILE_PAGES.
    # LANES > 1 (one tile, K_B = LANES, LANE_PASSES = 24 / log2 K_B): the
    # K_B - 1 thresholds of a pass are summed in one 2D reduction; LANES == 1:
    # one reduction per threshold, K_B = 8 / 4 / 2 by the row's length.
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
        denom = denom * tl.exp(peak - safe_peak) + tl.sum(tl.exp(x - safe_peak[:, None]), axis=1)
        peak = new_peak
    safe_peak = tl.where(peak == float("-inf"), 0.0, peak)
    # Padded query rows have denom 0: divide by 1 there (no inf to discard).
    inv_denom = tl.where(mask_g, 1.0 / tl.where(mask_g, denom, 1.0), 0.0) / GROUP_SIZE

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
        tile_pibar = tl.sum(tl.exp(x - safe_peak[:, None]) * inv_denom[:, None], axis=0)
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
    fixed_pages = tl.load(selector_ptr + 1)
    fixed_fraction = tl.load(selector_ptr + 2)
    # Fixed-count mode: K pages per row in total, sink and current included;
    # K = ceil(fraction * pages) when a fraction is given.
    fixed_pages = tl.where(fixed_fraction > 0.0, tl.ceil(fixed_fraction * num_pages), fixed_pages)
    by_count = fixed_pages > 0.0
    target = tl.where(by_count, fixed_pages - 2.0, gamma - forced)
    if LANES > 1:
        kb = LANES
        passes = LANE_PASSES
    else:
        kb = tl.where(num_pages < 256, 8, tl.where(num_pages < 1024, 4, 2))
        passes = tl.where(num_pages < 256, 8, tl.where(num_pages < 1024, 12, 24))
    if LANES > 1:
        # Loop-invariant parts of the pass, once: pages that are not middle
        # pages get pibar -1, below every threshold (tau >= 0), so a pass tests
        # one compare per (page, threshold) instead of a compare and a mask.
        tile = tl.arange(0, TILE_PAGES)
        middle_pibar = tl.where((tile > 0) & (tile < last), tile_pibar, -1.0)[:, None]
        weight = tl.where(by_count, 1.0, tile_pibar)[:, None]
    lo = 0.0
    for _ in range(passes):
        # Thresholds k = 1 .. K_B - 1 (k = 0 is lo itself, which holds).
        width = hi - lo
        new_lo = lo
        new_hi = hi
        if LANES > 1:
            # Everything of the pass stays in the layout of the [pages, lanes]
            # tile (2D, keep_dims): the only exchange between warps is the
            # reduction over the pages. The kept share falls as tau rises, so
            # the thresholds that reach the target are k = 1 .. r and the new
            # bounds are thresholds r and r + 1 (hi if r + 1 = K_B): one
            # in-warp count instead of a max and a min over the lanes.
            lanes = tl.arange(0, LANES)[None, :]
            above = middle_pibar >= lo + width * lanes / kb
            kept = tl.sum(tl.where(above, weight, 0.0), axis=0, keep_dims=True)
            reached = (lanes >= 1) & (lanes < kb) & (kept >= target)
            r = tl.sum(reached.to(tl.int32))
            new_lo = tl.where(r > 0, lo + width * r / kb, lo)
            new_hi = tl.where(r + 1 < kb, lo + width * (r + 1) / kb, hi)
        else:
            # One reduction over the row per threshold: that is why long rows
            # use fewer thresholds (K_B) and more passes.
            for k in range(1, kb):
                tau = lo + width * k / kb
                kept = _kept_share(
                    pib_ptr, tile_pibar, num_pages, tau, by_count, TILE_PAGES, NUM_TILES
                )
                reached = kept >= target
                new_lo = tl.where(reached, tl.maximum(new_lo, tau), new_lo)
                new_hi = tl.where(reached, new_hi, tl.minimum(new_hi, tau))
        lo = new_lo
        hi = new_hi
    # Special cases of Eq. 3: nothing more is needed (target <= 0), or every
    # page is (gamma >= 1, or a fixed budget that covers the row).
    keep_all = tl.where(by_count, num_middle <= fixed_pages - 2.0, gamma >= 1.0)
    lo = tl.where(target <= 0.0, float("inf"), lo)
    lo = tl.where(keep_all, float("-inf"), lo)
    # Fixed count keeps exactly K pages: the pages above the final interval
    # [lo, hi], then, from the pages inside it (ties, e.g. the flat attention
    # of dummy weights), the most recent ones. The coverage rule keeps every
    # page >= lo (Eq. 3's threshold form keeps ties).
    exact_count = tl.where(by_count, tl.abs(lo) < float("inf"), False)
    n_skip = 0
    if exact_count:
        n_above = 0.0
        n_band = 0.0
        for t in tl.static_range(NUM_TILES):
            pages, middle, pib = _pibar_tile(
                pib_ptr, tile_pibar, t, num_pages, TILE_PAGES, NUM_TILES
            )
            n_above += tl.sum((middle & (pib > hi)).to(tl.float32), axis=0)
            n_band += tl.sum((middle & (pib >= lo) & (pib <= hi)).to(tl.float32), axis=0)
        # Band pages to skip (the oldest ones) so that exactly K - 2 are kept.
        n_skip = (n_band - (target - n_above)).to(tl.int32)

    _compact_list(
        pib_ptr, tile_pibar, out, count_ptr, read_stats_ptr, kept_total_ptr, lo, hi,
        exact_count, n_skip, num_pages, TILE_PAGES, NUM_TILES, HAS_KEPT_TOTAL,
    )  # fmt: skip


@triton.jit
def _compact_list(
    pib_ptr, tile_pibar, out, count_ptr, read_stats_ptr, kept_total_ptr, lo, hi, exact_count,
    n_skip, num_pages, TILE_PAGES: tl.constexpr, NUM_TILES: tl.constexpr,
    HAS_KEPT_TOTAL: tl.constexpr,
):  # fmt: skip
    # Pass 4 of _select_row: compaction into the row's list, in page order.
    last = num_pages - 1
    tl.store(out, 0)
    n_kept = 1
    band_seen = tl.full([], 0, tl.int32)
    for t in tl.static_range(NUM_TILES):
        pages, middle, pib = _pibar_tile(pib_ptr, tile_pibar, t, num_pages, TILE_PAGES, NUM_TILES)
        keep = middle & (pib >= lo)
        if exact_count:
            # Only the fixed count ranks its band pages: the coverage rule
            # skips this scan (one of the two over the tile).
            band = keep & (pib <= hi)
            band_rank = band_seen + tl.cumsum(band.to(tl.int32), axis=0)  # 1-based
            keep = keep & ~(band & (band_rank <= n_skip))
            band_seen += tl.sum(band.to(tl.int32), axis=0)
        slot = n_kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out + slot, pages, mask=keep)
        n_kept += tl.sum(keep.to(tl.int32), axis=0)
    if num_pages > 1:
        tl.store(out + n_kept, last)
        n_kept += 1
    tl.store(count_ptr, n_kept)
    _count_list(read_stats_ptr, kept_total_ptr, n_kept, num_pages, HAS_KEPT_TOTAL)


@triton.jit
def kernel_moira_select(
    logmass_ptr,  # [max_rows, num_kv_heads, GROUP_SIZE, max_pages] fp32
    seq_lens_ptr,  # [num_rows] int32
    pibar_ptr,  # [max_rows, num_kv_heads, max_pages] fp32 (scratch)
    page_list_ptr,  # [max_rows, num_kv_heads, max_pages] int32 (out)
    list_lengths_ptr,  # [max_rows, num_kv_heads] int32 (out)
    read_stats_ptr,  # [2] int64 (accumulated: pages kept, pages in the rows)
    kept_total_ptr,  # [1] int32: the step's pages in all lists (added to, if HAS_KEPT_TOTAL)
    selector_ptr,  # [4] fp32: gamma, fixed K (0 = off), fixed fraction (0 = off),
    # dense batch pages (0 = off)
    row_gamma_ptr,  # [num_rows] fp32 per-request gamma, <= 0: selector's (if HAS_ROW_GAMMA)
    stride_lm_row: tl.int64, stride_lm_head: tl.int64, stride_lm_group: tl.int64,  # logmass
    stride_pib_row: tl.int64, stride_pib_head: tl.int64,  # pibar
    stride_pl_row: tl.int64, stride_pl_head: tl.int64, stride_ll_row: tl.int64,  # the lists
    GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr,
    TILE_PAGES: tl.constexpr, NUM_TILES: tl.constexpr, SHORT_TILE_PAGES: tl.constexpr,
    LONG_LANES: tl.constexpr, LONG_LANE_PASSES: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_ROW_GAMMA: tl.constexpr, HAS_KEPT_TOTAL: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # One program per (row, KV head). Writes the row's page list (logical
    # page indices in page order, sink first, current page last) and its
    # length, the only things Attend reads. The selector's parameters are
    # read from device memory, so a captured graph follows set_selector().
    # Rows of < 256 pages (K_B = 8) take a small register tile, so their cost
    # does not grow with max_model_len; longer rows take the full tile
    # (LONG_LANES thresholds per pass; 1 when the row needs several tiles).
    row = tl.program_id(0)
    head = tl.program_id(1)
    # Host-written inputs (the row's length, the selector's parameters, the
    # request's gamma) are read before waiting for Estimate: under a
    # dependent launch their round trip overlaps Estimate's last blocks
    # instead of following them. Nothing Estimate writes is read, and
    # nothing is stored, before the wait.
    seq_len = tl.load(seq_lens_ptr + row)
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    # A request's own gamma (moira_gamma) wins over the server's; 0 means
    # the request did not set one. Fixed-count mode never reads gamma.
    gamma = tl.load(selector_ptr)
    if HAS_ROW_GAMMA:
        row_gamma = tl.load(row_gamma_ptr + row)
        gamma = tl.where(row_gamma > 0.0, row_gamma, gamma)
    dense_row = _is_dense_row(num_pages, selector_ptr)
    _wait_for_previous_kernel(USE_GDC)
    count_ptr = list_lengths_ptr + row * stride_ll_row + head
    if num_pages == 0:
        tl.store(count_ptr, 0)
        return
    lm = logmass_ptr + row * stride_lm_row + head * stride_lm_head
    pib_ptr = pibar_ptr + row * stride_pib_row + head * stride_pib_head
    out = page_list_ptr + row * stride_pl_row + head * stride_pl_head
    if dense_row:
        # dense_batch_tokens: the whole row, in page order (Estimate skipped it).
        for start in range(0, num_pages, SHORT_TILE_PAGES):
            pages = start + tl.arange(0, SHORT_TILE_PAGES)
            tl.store(out + pages, pages, mask=pages < num_pages)
        tl.store(count_ptr, num_pages)
        _count_list(read_stats_ptr, kept_total_ptr, num_pages, num_pages, HAS_KEPT_TOTAL)
        return
    if SHORT_TILE_PAGES < TILE_PAGES:
        if num_pages < SHORT_TILE_PAGES:
            _select_row(
                lm, pib_ptr, out, count_ptr, read_stats_ptr, kept_total_ptr, selector_ptr, gamma,
                num_pages, stride_lm_group, GROUP_SIZE, GROUP_ROWS, SHORT_TILE_PAGES, 1, 8, 8,
                HAS_KEPT_TOTAL,
            )  # fmt: skip
        else:
            _select_row(
                lm, pib_ptr, out, count_ptr, read_stats_ptr, kept_total_ptr, selector_ptr, gamma,
                num_pages, stride_lm_group, GROUP_SIZE, GROUP_ROWS, TILE_PAGES, NUM_TILES,
                LONG_LANES, LONG_LANE_PASSES, HAS_KEPT_TOTAL,
            )  # fmt: skip
    else:  # every row fits the short tile
        _select_row(
            lm, pib_ptr, out, count_ptr, read_stats_ptr, kept_total_ptr, selector_ptr, gamma,
            num_pages, stride_lm_group, GROUP_SIZE, GROUP_ROWS, TILE_PAGES, 1, 8, 8,
            HAS_KEPT_TOTAL,
        )  # fmt: skip


def select_pages(
    logmass: torch.Tensor, seq_lens: torch.Tensor, pibar: torch.Tensor, page_list: torch.Tensor,
    list_lengths: torch.Tensor, selector_params: torch.Tensor, num_rows: int, max_pages: int,
    read_stats: torch.Tensor, row_gamma: torch.Tensor | None = None,
    kept_total: torch.Tensor | None = None,
    launch: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:  # fmt: skip
    """Coverage (or fixed-count) selection for rows ``[:num_rows]``.

    ``selector_params`` is the fp32 ``[4]`` device tensor of
    ``MoiraWorkspace`` (gamma, K, fraction, dense batch pages). ``row_gamma`` (fp32, at least
    ``num_rows``; ``MoiraWorkspace.row_gamma``) overrides gamma per row where
    it is > 0 (coverage only: fixed-count rows keep their K). Adds the kept
    and total page counts of the rows to ``read_stats`` (int64 ``[2]``), so
    ``read_stats[0] / read_stats[1]`` is the fraction of pages read since it
    was last zeroed. ``kept_total`` (int32 ``[1]``, zeroed by Estimate) gets
    the lengths of all the lists added, for Attend's chunk size. ``launch``:
    launch overrides by kernel (``check_launch_overrides``).
    """
    num_kv_heads, group_size = logmass.shape[1], logmass.shape[2]
    tile_pages = min(triton.next_power_of_2(max(max_pages, 16)), _SELECT_MAX_TILE_PAGES)
    num_tiles = triton.cdiv(max_pages, tile_pages)
    assert pibar.shape[-1] >= num_tiles * tile_pages
    select = select_launch(tile_pages, num_tiles, (launch or {}).get("select"))
    kernel_moira_select[(num_rows, num_kv_heads)](
        logmass, seq_lens, pibar, page_list, list_lengths, read_stats,
        # Unwritten when HAS_KEPT_TOTAL is False.
        list_lengths if kept_total is None else kept_total, selector_params,
        # Unread when HAS_ROW_GAMMA is False; any fp32 pointer will do.
        selector_params if row_gamma is None else row_gamma,
        logmass.stride(0), logmass.stride(1), logmass.stride(2), pibar.stride(0), pibar.stride(1),
        page_list.stride(0), page_list.stride(1), list_lengths.stride(0),
        GROUP_SIZE=group_size, GROUP_ROWS=triton.next_power_of_2(group_size),
        TILE_PAGES=tile_pages, NUM_TILES=num_tiles, SHORT_TILE_PAGES=_SELECT_SHORT_TILE_PAGES,
        LONG_LANES=select.lanes,
        # 24 / log2(K_B) passes shrink the search interval 2^24-fold.
        LONG_LANE_PASSES=24 // max(select.lanes.bit_length() - 1, 1), PAGE_SIZE=MOIRA_PAGE_SIZE,
        HAS_ROW_GAMMA=row_gamma is not None,
        HAS_KEPT_TOTAL=kept_total is not None, num_warps=select.num_warps,
        **_dependent_launch(launch),
    )  # fmt: skip


# ==========================================================================
# Attend (Eq. 4): N_F blocks share the step's pages evenly
# ==========================================================================
@triton.jit
def _attend_list_pages(
    q_row_ptr,  # [num_q_heads, HEAD_SIZE] bf16: the row's query
    kv_head_ptr,  # [num_blocks, ., PAGE_SIZE, 2 * HEAD_SIZE] bf16 (fp8 if KV_FP8): its pages
    block_table_row_ptr,  # [max_blocks] int32: the row's block table
    pages_ptr,  # [max_pages] int32: the (row, KV head)'s page list
    seq_len, start, end, scale,
    k_scale,  # fp32 scalar: the layer's K dequantization scale (if KV_FP8)
    v_scale,  # fp32 scalar: the layer's V dequantization scale (if KV_FP8)
    q_heads, mask_g, stride_q_head, stride_kv_block, stride_kv_token, GROUP_ROWS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    # Online softmax of the G query heads over list entries [start, end), one
    # page per iteration: returns the unnormalized output, the running max
    # (base 2) and sum. KV_FP8: the pages' e4m3 K and V are converted to fp16
    # (exact) and meet q and p in fp16; the layer's scales are per tensor, so
    # k_scale joins the softmax scale and v_scale multiplies the chunk's output
    # once, which is attention over the dequantized K and V. A plain cast,
    # which Triton moves to the dot operands' layout: converting in the loaded
    # tile's layout instead (so V reaches ldmatrix as fp16) is slower.
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_SIZE)
    q = tl.load(
        q_row_ptr + q_heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None],
        other=0.0,
    )
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    if KV_FP8:
        q = _fp16_query(q)
        qk_scale = qk_scale * k_scale

    running_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_SIZE], tl.float32)
    for i in range(start, end):
        page = tl.load(pages_ptr + i)
        block = tl.load(block_table_row_ptr + page).to(tl.int64)
        mask_t = offs_t < seq_len - page * PAGE_SIZE
        tile = kv_head_ptr + block * stride_kv_block + offs_t[:, None] * stride_kv_token
        k = tl.load(tile + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        v = tl.load(tile + HEAD_SIZE + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        if KV_FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(mask_t[None, :], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        p = tl.exp2(s - new_max[:, None])
        alpha = tl.exp2(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    if KV_FP8:
        acc = acc * v_scale
    return acc, running_max, running_sum


@triton.jit
def _step_pages_per_block(kept_total_ptr, num_blocks):
    # Pages per Attend block: the step's kept pages P over its N_F blocks, so
    # that ceil(P / chunk) <= N_F blocks cover them.
    return tl.maximum(tl.cdiv(tl.load(kept_total_ptr), num_blocks), 1)


@triton.jit
def _list_of_step_page(list_lengths_ptr, stride_ll_row, num_kv_heads, num_lists, position,
                       LISTS_TILE: tl.constexpr):  # fmt: skip
    # The list (row * num_kv_heads + head) that holds entry `position` of
    # the step's lists laid end to end, and the position of its first entry:
    # the lists before it are those whose running total ends at or before
    # `position` (lengths are >= 0, so they are a prefix).
    offs = tl.arange(0, LISTS_TILE)
    lists_before = 0
    pages_before = 0
    total = 0
    for first in range(0, num_lists, LISTS_TILE):
        index = first + offs
        mask = index < num_lists
        count = tl.load(
            list_lengths_ptr + (index // num_kv_heads) * stride_ll_row + index % num_kv_heads,
            mask=mask,
            other=0,
        )
        ends = total + tl.cumsum(count, axis=0)
        before = mask & (ends <= position)
        lists_before += tl.sum(before.to(tl.int32), axis=0)
        pages_before += tl.sum(tl.where(before, count, 0), axis=0)
        total += tl.sum(count, axis=0)
    return lists_before, pages_before


@triton.jit(do_not_specialize=["num_lists", "num_blocks"])
def kernel_moira_attend(
    query_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16 (fp8 if KV_FP8)
    block_table_ptr,  # [num_rows, max_blocks] int32
    seq_lens_ptr,  # [num_rows] int32
    page_list_ptr,  # [max_rows, num_kv_heads, max_pages] int32 (logical pages)
    list_lengths_ptr,  # [max_rows, num_kv_heads] int32
    kept_total_ptr,  # [1] int32: pages in all the lists of the step
    output_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16 (out, lists of one part)
    partial_out_ptr,  # [(num_blocks + num_lists) * GROUP_SIZE, HEAD_SIZE] fp32 (out)
    partial_lse_ptr,  # [(num_blocks + num_lists) * GROUP_SIZE] fp32 (out)
    k_scale_ptr,  # [1] fp32: the layer's K dequantization scale (if KV_FP8)
    v_scale_ptr,  # [1] fp32: the layer's V dequantization scale (if KV_FP8)
    scale,
    list_start_ptr,  # [max_rows * num_kv_heads] int32 (out): each list's first step position
    num_kv_heads, num_lists, num_blocks, stride_q_row: tl.int64, stride_q_head: tl.int64,
    stride_kv_block: tl.int64, stride_kv_head: tl.int64, stride_kv_token: tl.int64,
    stride_bt_row: tl.int64, stride_pl_row: tl.int64, stride_pl_head: tl.int64,
    stride_ll_row: tl.int64, stride_o_row: tl.int64, stride_o_head: tl.int64,
    GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, LISTS_TILE: tl.constexpr, KV_FP8: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # Block b plans its own work from device memory (paper Alg. 2 plans per
    # list; this plans over the whole step, so uneven lists leave no block
    # with more work than another): the step's lists laid end to end (list index = row *
    # num_kv_heads + head) are cut into num_blocks runs of the same number
    # of pages, and block b takes run b. A run that crosses list boundaries
    # is attended one list part at a time. A list that lies inside one run is
    # written to the output directly; the parts of any other list go to
    # partial slot (b + list), which is unique because from one part to the
    # next along the step either b or the list (or both) grows. Merge finds a
    # list's parts from its first position (list_start).
    _wait_for_previous_kernel(USE_GDC)
    block_id = tl.program_id(0)
    kept_total = tl.load(kept_total_ptr)
    chunk = _step_pages_per_block(kept_total_ptr, num_blocks)
    position = block_id * chunk
    if position >= kept_total:
        return
    end = tl.minimum(position + chunk, kept_total)
    lst, lst_first = _list_of_step_page(list_lengths_ptr, stride_ll_row, num_kv_heads,
                                        num_lists, position, LISTS_TILE)  # fmt: skip
    offs_g = tl.arange(0, GROUP_ROWS)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask_g = offs_g < GROUP_SIZE
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    while (position < end) & (lst < num_lists):
        row = lst // num_kv_heads
        head = lst % num_kv_heads
        n = tl.load(list_lengths_ptr + row * stride_ll_row + head)
        lo = position - lst_first
        hi = tl.minimum(end - lst_first, n)
        if hi > lo:
            if lo == 0:
                tl.store(list_start_ptr + lst, lst_first)
            q_heads = head * GROUP_SIZE + offs_g
            acc, running_max, running_sum = _attend_list_pages(
                query_ptr + row * stride_q_row,
                kv_cache_ptr + head * stride_kv_head,
                block_table_ptr + row * stride_bt_row,
                page_list_ptr + row * stride_pl_row + head * stride_pl_head,
                tl.load(seq_lens_ptr + row), lo, hi, scale, k_scale, v_scale, q_heads, mask_g,
                stride_q_head, stride_kv_block, stride_kv_token, GROUP_ROWS, HEAD_SIZE,
                PAGE_SIZE, KV_FP8,
            )  # fmt: skip
            acc = acc / running_sum[:, None]
            if (lo == 0) & (hi == n):
                tl.store(
                    output_ptr + row * stride_o_row + q_heads[:, None] * stride_o_head
                    + offs_d[None, :],
                    acc.to(output_ptr.dtype.element_ty),
                    mask=mask_g[:, None],
                )  # fmt: skip
            else:
                part = (block_id + lst).to(tl.int64) * GROUP_SIZE + offs_g
                tl.store(
                    partial_out_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
                    acc,
                    mask=mask_g[:, None],
                )
                lse = (running_max + tl.log2(running_sum)) * 0.6931471805599453
                tl.store(partial_lse_ptr + part, lse, mask=mask_g)
            position = lst_first + hi
        lst_first += n
        lst += 1


# ==========================================================================
# Merge, and the Attend + Merge launcher
# ==========================================================================
@triton.jit
def _merge_chunks(
    partial_out_ptr,  # [num_parts, HEAD_SIZE] fp32
    partial_lse_ptr,  # [num_parts] fp32
    out_ptr,  # [HEAD_SIZE] bf16 (out): one query head of one row
    first_part, part_step, num_chunks, HEAD_SIZE: tl.constexpr, TILE_CHUNKS: tl.constexpr,
):  # fmt: skip
    # Log-sum-exp combine of the partials first_part + j * part_step,
    # j < num_chunks, in chunk order.
    offs_j = tl.arange(0, TILE_CHUNKS)
    offs_d = tl.arange(0, HEAD_SIZE)
    running_max = float("-inf")
    running_sum = 0.0
    acc = tl.zeros([HEAD_SIZE], tl.float32)
    for j0 in range(0, num_chunks, TILE_CHUNKS):
        mask_j = j0 + offs_j < num_chunks
        part = first_part + (j0 + offs_j) * part_step
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
    tl.store(out_ptr + offs_d, (acc / running_sum).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_blocks"])
def kernel_moira_merge(
    list_lengths_ptr,  # [max_rows, num_kv_heads] int32
    kept_total_ptr,  # [1] int32: pages in all the lists of the step
    partial_out_ptr,  # [(num_blocks + num_lists) * GROUP_SIZE, HEAD_SIZE] fp32
    partial_lse_ptr,  # [(num_blocks + num_lists) * GROUP_SIZE] fp32
    output_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16 (out)
    list_start_ptr,  # [max_rows * num_kv_heads] int32: each list's first step position
    num_blocks, stride_ll_row: tl.int64, stride_o_row: tl.int64, stride_o_head: tl.int64,
    GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, TILE_CHUNKS: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # One program per (row, query head) after kernel_moira_attend: the
    # list's parts are blocks first .. last of its run, in slots b + list.
    # Lists inside one run were written by Attend and exit here.
    _wait_for_previous_kernel(USE_GDC)
    row = tl.program_id(0)
    q_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1) // GROUP_SIZE
    head = q_head // GROUP_SIZE
    n = tl.load(list_lengths_ptr + row * stride_ll_row + head)
    if n == 0:
        return
    lst = row * num_kv_heads + head
    first = tl.load(list_start_ptr + lst)
    chunk = _step_pages_per_block(kept_total_ptr, num_blocks)
    first_block = first // chunk
    num_parts = (first + n - 1) // chunk - first_block + 1
    if num_parts <= 1:
        return
    first_part = (first_block + lst).to(tl.int64) * GROUP_SIZE + q_head % GROUP_SIZE
    _merge_chunks(partial_out_ptr, partial_lse_ptr,
                  output_ptr + row * stride_o_row + q_head * stride_o_head,
                  first_part, GROUP_SIZE, num_parts, HEAD_SIZE, TILE_CHUNKS)  # fmt: skip


def attend(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    page_list: torch.Tensor, list_lengths: torch.Tensor, output: torch.Tensor,
    workspace: MoiraWorkspace, scale: float, kept_total: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Attend + Merge over any selector's page lists.

    ``page_list`` ``[>= B, H_kv, >= max list length]`` int32 holds logical
    page indices of each (row, KV head), ``list_lengths`` ``[>= B, H_kv]`` their
    lengths; both are read on the device only. ``output`` ``[B, H_q, D]``.
    N_F blocks (``workspace.attend_fill_blocks``) share the step's pages
    evenly; Merge combines the lists that span several blocks. The launch is
    ``attend_launch`` with the workspace's overrides.
    ``kept_total`` (int32 ``[1]``): the sum of ``list_lengths[:B]``, as Select
    leaves it in ``workspace.kept_total``; None sums the counts here (one
    reduction on the device, into ``workspace.kept_total``).
    An fp8 (e4m3) ``kv_cache`` needs ``k_scale`` and ``v_scale`` (the layer's
    fp32 scales, one value each): attention over the dequantized K and V.
    """
    num_rows, num_q_heads, head_size = query.shape
    if num_rows == 0:
        return
    kv_fp8, k_scale_arg, v_scale_arg = _kv_scale_args(kv_cache, k_scale=k_scale, v_scale=v_scale)
    if num_rows > workspace.max_num_seqs:
        raise ValueError(
            f"Moira: {num_rows} decode rows exceed the workspace's "
            f"max_num_seqs={workspace.max_num_seqs}"
        )
    num_kv_heads = kv_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    if kept_total is None:
        kept_total = workspace.kept_total
        torch.sum(list_lengths[:num_rows, :num_kv_heads], dim=(0, 1), dtype=torch.int32,
                  out=kept_total[0])  # fmt: skip
    num_lists = num_rows * num_kv_heads
    num_blocks = workspace.attend_fill_blocks
    # A few tile sizes (so a few compiled variants) cover every batch; the
    # scan over the step's list lengths loops over tiles beyond 1024 lists.
    lists_tile = min(_ATTEND_MAX_LISTS_TILE, max(128, triton.next_power_of_2(num_lists)))
    launch = attend_launch(kv_fp8, workspace.launch.get("attend"))
    kernel_moira_attend[(num_blocks,)](
        query, kv_cache, block_table, seq_lens, page_list, list_lengths, kept_total, output,
        workspace.partial_out, workspace.partial_lse, k_scale_arg, v_scale_arg, scale,
        workspace.list_start, num_kv_heads, num_lists, num_blocks,
        query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), block_table.stride(0), page_list.stride(0), page_list.stride(1),
        list_lengths.stride(0), output.stride(0), output.stride(1),
        GROUP_SIZE=group_size, GROUP_ROWS=_group_rows(group_size), HEAD_SIZE=head_size,
        PAGE_SIZE=MOIRA_PAGE_SIZE, LISTS_TILE=lists_tile, KV_FP8=kv_fp8,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **_register_cap(launch.maxnreg),
        **_dependent_launch(workspace.launch),
    )  # fmt: skip
    kernel_moira_merge[(num_rows, num_q_heads)](
        list_lengths, kept_total, workspace.partial_out, workspace.partial_lse, output,
        workspace.list_start, num_blocks, list_lengths.stride(0), output.stride(0),
        output.stride(1),
        GROUP_SIZE=group_size, HEAD_SIZE=head_size, TILE_CHUNKS=_MERGE_TILE_CHUNKS, num_warps=4,
        **_dependent_launch(workspace.launch),
    )  # fmt: skip


# ==========================================================================
# The decode step: workspace, Estimate + Select, moira_decode
# ==========================================================================
#: Every live MoiraWorkspace of this process (benchmarks switch selectors and
#: read counters through it; weak, so it never keeps a workspace alive).
_LIVE_WORKSPACES: weakref.WeakSet[MoiraWorkspace] = weakref.WeakSet()


def live_workspaces() -> list[MoiraWorkspace]:
    """The MoiraWorkspaces allocated in this process (one per metadata builder)."""
    return list(_LIVE_WORKSPACES)


class MoiraWorkspace:
    """Persistent buffers of the decode step, sized for the worst case.

    Allocated once (before CUDA-graph capture) and shared by all layers of a
    model (layers run one after another). Every launch reads and writes views
    of these tensors, so a captured graph replays against the same addresses.
    ``launch``: launch overrides by kernel for this workspace's decode steps
    (benchmarks and probes; ``check_launch_overrides``), fixed like the grids.
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
        launch: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        config.validate()
        self.launch = check_launch_overrides(launch)
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
                f"Moira: head_size must be one of {MOIRA_SUPPORTED_HEAD_SIZES}, got {head_size}"
            )
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_pages = max_pages
        #: N_F as Attend uses it: config.attend_fill_blocks, or for 0 the
        #: blocks this device holds at once.
        self.attend_fill_blocks = resolve_attend_fill_blocks(config, device)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        tile = min(triton.next_power_of_2(max(max_pages, 16)), _SELECT_MAX_TILE_PAGES)
        pibar_pages = triton.cdiv(max_pages, tile) * tile
        # Attend's partial slots (block + list) of G query heads each: fewer
        # than N_F + lists of them (kernel_moira_attend).
        max_lists = max_num_seqs * num_kv_heads
        num_parts = triton.cdiv(self.attend_fill_blocks + max_lists, num_kv_heads)
        f32, i32 = torch.float32, torch.int32
        self.logmass = torch.empty(
            max_num_seqs, num_kv_heads, group_size, max_pages, dtype=f32, device=device
        )
        self.pibar = torch.empty(max_num_seqs, num_kv_heads, pibar_pages, dtype=f32, device=device)
        self.page_list = torch.empty(
            max_num_seqs, num_kv_heads, max_pages, dtype=i32, device=device
        )
        self.list_lengths = torch.zeros(max_num_seqs, num_kv_heads, dtype=i32, device=device)
        self.partial_out = torch.empty(num_parts, num_q_heads, head_size, dtype=f32, device=device)
        self.partial_lse = torch.empty(num_parts, num_q_heads, dtype=f32, device=device)
        #: Where each list of the step starts
        #: when the lists are laid end to end (Attend writes, Merge reads).
        self.list_start = torch.zeros(max_num_seqs * num_kv_heads, dtype=i32, device=device)
        #: int64 counters read back in one copy: [0:2] read_stats, then the
        #: audit's; the audit (None when audit_every is 0: no launches at all).
        self.stats_counters, self.audit = make_stats_counters(config, max_pages, group_size,
                                                              device, self.launch)  # fmt: skip
        #: Pages kept and pages in the rows, summed over layers and steps
        #: (Select adds to it on the device; zero it to start a window).
        self.read_stats = self.stats_counters[:2]
        #: Pages of the steps that ran FA3 (dense_steps="fa3"), every one
        #: read; counted on the host. read_counts() adds them to read_stats.
        self.dense_read_pages = 0
        #: Pages in all the lists of the current step (Estimate zeroes it,
        #: Select adds each list, Attend and Merge size their chunks by it).
        self.kept_total = torch.zeros(1, dtype=i32, device=device)
        #: Select's parameters (gamma, K, fraction), read on the device so that
        #: set_selector() changes what captured graphs do.
        self.selector_params = torch.tensor(config.selector_values(), dtype=f32, device=device)
        #: Per-row gamma of the decode rows (a request's moira_gamma); 0 means
        #: the server's gamma (selector_params[0]). The builder rewrites it
        #: every step (set_row_gamma), outside the captured graph, and Select
        #: reads it on the device, so FULL graphs replay with each step's values.
        self.row_gamma = torch.zeros(max_num_seqs, dtype=f32, device=device)
        _LIVE_WORKSPACES.add(self)

    def set_selector(self, config: MoiraConfig) -> None:
        """Switch gamma / the selector in place (host -> device copy; call it
        between steps, never inside one). Attend's constants and the estimator
        (and the summary dtype) must not change: graphs were captured with
        their grid and kernel variant, and the summaries were written for them."""
        config.validate()
        # Attend's split constants are baked into captured grids; the
        # estimator into the captured Estimate variant and the summary layout.
        fixed_fields = (
            "attend_fill_blocks",
            "estimator",
            "summary_dtype",
        )
        if any(getattr(config, f) != getattr(self.config, f) for f in fixed_fields):
            raise ValueError(f"Moira: set_selector cannot change {fixed_fields}")
        switch_audit(self.audit, config)  # refuses before anything changes
        self.selector_params.copy_(torch.tensor(config.selector_values(), dtype=torch.float32))
        self.config = config

    def read_counts(self) -> tuple[int, int]:
        """(pages kept, pages in the rows) since the last reset: Select's
        device counters plus the dense steps' pages. A host sync; call it
        between steps."""
        kept, total = (int(v) for v in self.read_stats.tolist())
        return kept + self.dense_read_pages, total + self.dense_read_pages

    def reset_read_counts(self) -> None:
        """Zero both counts (a device fill and a host reset)."""
        self.read_stats.zero_()
        self.dense_read_pages = 0

    def set_row_gamma(self, values: torch.Tensor | None, num_rows: int) -> None:
        """Load rows ``[:num_rows]`` of ``row_gamma`` from ``values`` (fp32 on
        the workspace's device; rows past ``values`` get 0) and reset every
        later row to 0, the server's gamma. Device-side copy and fill only: no
        host sync, no allocation, fixed addresses."""
        num_given = 0 if values is None else min(num_rows, values.shape[0], self.max_num_seqs)
        if num_given > 0:
            assert values is not None
            self.row_gamma[:num_given].copy_(values[:num_given], non_blocking=True)
        self.row_gamma[num_given:].zero_()

    def nbytes(self) -> int:
        tensors = (
            self.logmass,
            self.pibar,
            self.page_list,
            self.list_lengths,
            self.partial_out,
            self.partial_lse,
            self.list_start,
            self.stats_counters,
            self.kept_total,
            self.selector_params,
            self.row_gamma,
        )
        audit = 0 if self.audit is None else self.audit.nbytes()
        return audit + sum(t.numel() * t.element_size() for t in tensors)


def moira_workspace_bytes(
    vllm_config: VllmConfig, num_q_heads: int, num_kv_heads: int, head_size: int
) -> int:
    """Bytes of the builder's persistent MoiraWorkspace for this engine, built
    on the ``meta`` device (shapes only), so it matches what
    MoiraMetadataBuilder allocates."""
    max_pages = cdiv(vllm_config.model_config.max_model_len, MOIRA_PAGE_SIZE)
    config = moira_config_from_env()
    # The partials follow N_F, which for 0 is
    # this process's GPU's: resolve it here, not on the meta device.
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    config = dataclasses.replace(
        config, attend_fill_blocks=resolve_attend_fill_blocks(config, device)
    )
    ws = MoiraWorkspace(
        vllm_config.scheduler_config.max_num_seqs,
        num_q_heads,
        num_kv_heads,
        head_size,
        max_pages,
        config,
        torch.device("meta"),
    )
    return int(ws.nbytes())


def estimate_and_select(
    query: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, workspace: MoiraWorkspace, scale: float,
    write_filled_pages: bool = False, k_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Estimate + Select: fills ``workspace.page_list`` / ``list_lengths``
    (``write_filled_pages``, ``k_scale``: see ``estimate_page_logmass``)."""
    num_rows = query.shape[0]
    if num_rows == 0:
        return
    if num_rows > workspace.max_num_seqs:
        raise ValueError(
            f"Moira: {num_rows} rows exceed the workspace "
            f"({workspace.max_num_seqs} rows of {workspace.max_pages} pages)"
        )
    # vLLM's block tables may carry spare columns past max_model_len; rows
    # never reach them (seq_len <= max_model_len <= 64 * workspace.max_pages),
    # so the grids cover only the pages the workspace was sized for.
    max_pages = min(block_table.shape[1], workspace.max_pages)
    ws = workspace
    estimate_page_logmass(
        query, kv_cache, summaries, block_table, seq_lens, ws.logmass, scale, ws.config.estimator,
        ws.selector_params, kept_total=ws.kept_total, write_filled_pages=write_filled_pages,
        k_scale=k_scale, launch=ws.launch,
    )  # fmt: skip
    select_pages(ws.logmass, seq_lens, ws.pibar, ws.page_list, ws.list_lengths,
                 ws.selector_params, num_rows, max_pages, ws.read_stats, row_gamma=ws.row_gamma,
                 kept_total=ws.kept_total, launch=ws.launch)  # fmt: skip


def moira_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, output: torch.Tensor,
    workspace: MoiraWorkspace, scale: float, write_filled_pages: bool = False,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One layer's sparse decode: Estimate -> Select -> Attend -> Merge.

    ``query``/``output`` ``[B, H_q, D]`` bf16 (one token per row),
    ``block_table`` ``[B, max_blocks]`` int32, ``seq_lens`` ``[B]`` int32
    (0 = padded row: its output is left untouched). The selector is the
    workspace's (``MoiraWorkspace.set_selector``). Launch grids depend only on
    B and the static shapes, so the call replays in a CUDA graph.
    ``write_filled_pages``: also summarize each row's page that its new token
    filled (the backend's decode step; off for callers whose summaries are
    already written, e.g. benchmarks replaying one step).
    ``kv_cache`` is bf16, or fp8 e4m3 (vLLM's fp8 cache viewed as
    ``torch.float8_e4m3fn``) with the layer's ``k_scale`` and ``v_scale``
    (fp32, one value each, read on the device): every kernel then reads the
    dequantized K and V (stored value x scale). The query stays bf16.
    """
    _check_kv_cache(kv_cache)
    kv_fp8, k_scale_arg, _ = _kv_scale_args(kv_cache, k_scale=k_scale, v_scale=v_scale)
    estimate_and_select(query, kv_cache, summaries, block_table, seq_lens, workspace, scale,
                        write_filled_pages, k_scale)  # fmt: skip
    attend(
        query,
        kv_cache,
        block_table,
        seq_lens,
        workspace.page_list,
        workspace.list_lengths,
        output,
        workspace,
        scale,
        kept_total=workspace.kept_total,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if workspace.audit is not None and query.shape[0] > 0:  # the captured-mass audit
        workspace.audit.run(query, kv_cache, block_table, seq_lens, workspace, scale, kv_fp8,
                            k_scale_arg, _dependent_launch(workspace.launch))  # fmt: skip


# ==========================================================================
# vLLM backend: MoiraMetadata -> MoiraMetadataBuilder -> MoiraBackend -> MoiraImpl.
#
# Moira reuses FlashAttention for everything it does not replace: the KV cache
# layout and scatter (do_kv_cache_update), and FA3 for prefill rows. Decode rows
# (one query token each) go to moira_decode. They come first in the batch (reorder
# threshold 1), so the split is two contiguous slices and FA3 never sees them (FA3
# writes zeros for rows with nothing to attend to: no zero-length decode rows).
# ==========================================================================

#: The builder reads read_stats back for logs and /metrics every this many
#: steps (an event query and a D2H copy; the counters are cumulative, so
#: nothing is lost between readings).
_READ_STATS_POLL_STEPS = 16


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------
@dataclass
class MoiraMetadata:
    """Per-step metadata: decode rows for Moira, prefill rows for FA3.

    Rows are ordered decode-first; rows [0, num_decodes) hold one query token
    each (tokens [0, num_decode_tokens)). The tensors below are views of
    runner-persistent buffers (CUDA-graph safe): FULL decode graphs replay
    with the same addresses and read the lengths the runner wrote on device.
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    # [num_decodes] int32 context lengths incl. the new token (0 = padding).
    decode_seq_lens: torch.Tensor
    # [num_decodes, max_blocks] int32 kernel block ids.
    decode_block_table: torch.Tensor
    # [num_actual_tokens] int64 cache slot of every token of the step, as in
    # FlashAttentionMetadata: callers of do_kv_cache_update read it here.
    slot_mapping: torch.Tensor
    # FA metadata for the prefill rows only (sliced batch), None if none.
    prefill: FlashAttentionMetadata | None
    # Persistent buffers and the selector (workspace.config, set_selector).
    workspace: MoiraWorkspace
    # Dense step (dense_steps="fa3", CUDA-graph step class 1 or 2): FA metadata
    # for the whole batch, every row a decode row read whole by FA3. None in
    # every other step.
    dense_step: FlashAttentionMetadata | None = None
    # Dense step in which a row's new token fills a page (class 2): the
    # summary writer runs on the step's slots before FA3.
    dense_step_fills_pages: bool = False


class MoiraMetadataBuilder(FlashAttentionMetadataBuilder):
    """Splits each batch into Moira decode rows and FA3 prefill rows.

    UNIFORM_SINGLE_TOKEN_DECODE: pure one-token decode batches are captured
    in FULL CUDA graphs (the whole Moira step), mixed batches run eagerly
    (FULL_AND_PIECEWISE keeps attention outside the piecewise graphs).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    # build() returns a new metadata object; the in-place block-table update
    # path of FA (spec-decode drafting) does not apply.
    supports_update_block_table: bool = False
    # Set by vLLM's V2 runner before each build (patch 0006); 0 without it.
    cudagraph_step_class: int = 0

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: Any
    ) -> AttentionCGSupport:
        return cls._cudagraph_support

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        # Refuse before allocating anything (spec decode is only visible in
        # the full config, not in the per-layer selector flags).
        check_vllm_config_for_moira(vllm_config)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decode rows first (V1 reorders only if a builder asks; V2 always
        # does). Short extends (query_len 1 while prefilling) count as
        # decodes: a one-token query over a cached context is a decode step.
        self._init_reorder_batch_threshold(1)
        self.supports_draft_decode_metadata_update = False
        self.moira_config = moira_config_from_env()
        logger.info_once(
            "MOIRA decode: %s (rows with context x decode rows <= %d tokens read every "
            "page; Attend runs %d blocks, the blocks this GPU holds at once)",
            self.moira_config,
            self.moira_config.dense_batch_tokens,
            resolve_attend_fill_blocks(self.moira_config, device),
        )
        if kv_cache_spec.block_size % MOIRA_PAGE_SIZE != 0:
            raise ValueError(
                f"MOIRA needs a KV cache block size that is a multiple of "
                f"{MOIRA_PAGE_SIZE}, got {kv_cache_spec.block_size}"
            )
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_pages = cdiv(vllm_config.model_config.max_model_len, MOIRA_PAGE_SIZE)
        # Persistent buffers, allocated once here: builders are created in
        # initialize_kv_cache, before warmup and CUDA-graph capture, so
        # captured graphs see these addresses for the life of the engine.
        self.workspace = MoiraWorkspace(
            self.max_num_seqs,
            self.num_heads_q,
            self.num_heads_kv,
            self.headdim,
            self.max_pages,
            self.moira_config,
            device,
        )
        from ...worker.moira_metrics import ReadStatsPoller

        audit = self.workspace.audit
        if audit is not None:
            audit.num_layers = max(len(layer_names), 1)  # its launches per step
        # Read fraction and audit counts for logs and /metrics: one copy, no host sync.
        audit_edges = audit.edges if audit is not None else None
        self.read_stats_poller = ReadStatsPoller(self.workspace.stats_counters,
                                                 audit_edges=audit_edges)  # fmt: skip
        self._capturing = False
        self._builds = 0

    def use_cascade_attention(self, *args: Any, **kwargs: Any) -> bool:
        # FA's cascade path would process every row, decode rows included.
        return False

    # ---- CUDA-graph step classes (vLLM patch 0006, V2 runner) ---------------
    # Class 0: Moira's decode step. With dense_steps="fa3", a step whose rows
    # are all dense runs FA3 instead, in FULL graphs of its own: class 1 when
    # no row's new token fills a page, class 2 (FA3 and the summary writer)
    # when one does (a row of length L has just filled a page when L % 64 ==
    # 0; at batch 1 that is one step in 64, so most dense steps are FA3's
    # launches alone). A graph holds one kernel sequence, so this is decided
    # where vLLM picks the graph, by the rule that Estimate and Select apply
    # per row on the GPU (_is_dense_row: pages x rows in the graph <= dense
    # pages). Steps the runner does not classify (V1, eager, mixed) stay in
    # class 0, where those rows are still read whole.
    def get_cudagraph_step_classes(self) -> int:
        return 3 if self.moira_config.dense_steps == "fa3" else 1

    def classify_cudagraph_step(self, num_reqs_padded: int, seq_lens_upper_bound: Any) -> int:
        config = self.workspace.config  # set_selector may change the threshold
        # The dense pages that Estimate and Select read from selector_params.
        dense_pages = config.selector_values()[3]
        if config.dense_steps != "fa3" or dense_pages == 0 or len(seq_lens_upper_bound) == 0:
            return 0
        max_pages = cdiv(int(seq_lens_upper_bound.max()), MOIRA_PAGE_SIZE)
        if max_pages * max(num_reqs_padded, 1) > dense_pages:
            return 0
        return 2 if bool((seq_lens_upper_bound % MOIRA_PAGE_SIZE == 0).any()) else 1

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MoiraMetadata:
        cam = common_attn_metadata
        nd, npf, ndt, npt = split_decodes_and_prefills(cam, decode_threshold=1)
        self._builds += 1
        if self._builds % _READ_STATS_POLL_STEPS == 0:
            self.read_stats_poller.poll()  # async D2H of read_stats; never waits for the GPU
        if nd > self.max_num_seqs:
            raise ValueError(f"MOIRA: {nd} decode rows exceed max_num_seqs={self.max_num_seqs}")
        prefill = dense_step = None
        step_class = self.cudagraph_step_class
        if step_class in (1, 2):
            if npf > 0:
                raise RuntimeError(
                    f"MOIRA: a dense-step graph (CUDA-graph step class {step_class}) was "
                    f"chosen for a batch with {npf} prefill rows; the runner classifies "
                    "decode steps only"
                )
            # Every row dense: FA3 on the whole batch, in this class's graph
            # (no Select, so no per-row gamma to load).
            dense_step = super().build(common_prefix_len, cam, fast_build)
            self._count_dense_step_reads(cam)
        else:
            # Each decode row's own gamma (its request's moira_gamma; 0 = the
            # server's): a device-to-device copy into the workspace's
            # persistent buffer, which also resets the rows past the decode
            # rows. build() runs eagerly every step, before a FULL graph
            # replays, so the copy is never captured; Select reads the buffer
            # inside the graph.
            extras = getattr(cam, "attn_request_extras", None)  # patch 0005; absent on stock vLLM
            self.workspace.set_row_gamma(
                None if extras is None else extras.get(MOIRA_GAMMA_EXTRA_ARG), nd
            )
            if npf > 0:
                prefill = super().build(0, slice_prefill_common_metadata(cam, nd, ndt), fast_build)
        return MoiraMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=npf,
            num_prefill_tokens=npt,
            decode_seq_lens=cam.seq_lens[:nd],
            decode_block_table=cam.block_table_tensor[:nd],
            slot_mapping=cam.slot_mapping,
            prefill=prefill,
            workspace=self.workspace,
            dense_step=dense_step,
            dense_step_fills_pages=step_class == 2,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> MoiraMetadata:
        self._capturing = True  # capture metadata is not a step: no read counts
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False

    def _count_dense_step_reads(self, cam: CommonAttentionMetadata) -> None:
        # A dense step reads every page of its rows (per layer and KV head, as
        # Select would have counted them). Counted on the host, from the
        # rows' lengths: no launch and no copy in the step.
        if self._capturing or cam.seq_lens_cpu_upper_bound is None:
            return
        logger.info_once(
            "MOIRA: decode steps whose rows are all dense run FA3 in their own CUDA graphs"
        )
        seq = cam.seq_lens_cpu_upper_bound[: cam.num_reqs].numpy()
        pages = int(((seq + (MOIRA_PAGE_SIZE - 1)) // MOIRA_PAGE_SIZE).sum())
        pages *= self.num_heads_kv * len(self.layer_names)
        self.workspace.dense_read_pages += pages
        self.read_stats_poller.observe_host(pages)


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------
def _unsupported(cls: type[MoiraBackend]) -> bool:
    """A capability MoiraBackend does not have (see its class body)."""
    return False


class MoiraBackend(FlashAttentionBackend):
    """Sparse decode (Moira kernels) + FA3 prefill, for SM90, bf16 or fp8 KV.

    Subclasses FlashAttentionBackend to inherit the KV cache spec/layout and
    the FA3 prefill path; every capability FA advertises beyond Moira's is
    switched off here so the selector refuses it instead of falling back.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(MOIRA_KV_CACHE_DTYPES)
    # The layer scatters K/V through do_kv_cache_update before forward();
    # forward() then writes the page summaries (prefill: the writer kernel;
    # decode rows: Estimate).
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        # The enum member the class is selected through: MOIRA on the patched
        # build, vLLM's plugin slot CUSTOM on the stock wheel.
        return backend_enum_name()

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        # Without the extras hook (stock vLLM), each KV page carries its
        # summaries in padding that vLLM's planner budgets with the cache.
        if has_kv_cache_extras_hook():
            return spec
        config = moira_config_from_env()
        return summary_padded_spec(spec, config.summary_slots, config.summary_dtype)

    @staticmethod
    def get_impl_cls() -> type[MoiraImpl]:
        return MoiraImpl

    @staticmethod
    def get_builder_cls() -> type[MoiraMetadataBuilder]:
        return MoiraMetadataBuilder

    # A request's own coverage gamma (patch 0005): SamplingParams(extra_args=
    # {"moira_gamma": 0.9}), or vllm_xargs over the OpenAI API. The runner
    # hands each row's value to the builder; 0 (not set) means MOIRA_GAMMA.
    @classmethod
    def get_request_extras(cls) -> dict[str, float]:
        return {MOIRA_GAMMA_EXTRA_ARG: 0.0}

    @classmethod
    def validate_request_extras(cls, extra_args: Mapping[str, Any]) -> None:
        super().validate_request_extras(extra_args)  # a finite number
        gamma = extra_args.get(MOIRA_GAMMA_EXTRA_ARG)
        if gamma is not None and not 0.0 < gamma <= 1.0:
            raise VLLMValidationError(
                f"{MOIRA_GAMMA_EXTRA_ARG} must be in (0, 1] (1 keeps every page; "
                f"omit it to use the server's MOIRA_GAMMA), got {gamma!r}",
                parameter=MOIRA_GAMMA_EXTRA_ARG,
                value=gamma,
            )
        # A fixed page count has no gamma: the request's would be ignored, so
        # say so instead (the frontend shares the server's MOIRA_* environment).
        if gamma is not None and moira_config_from_env().selector != "coverage":
            raise VLLMValidationError(
                f"{MOIRA_GAMMA_EXTRA_ARG} applies to the coverage selector only; this "
                "server runs MOIRA_SELECTOR='fixed' (a fixed page count per row and KV "
                f"head): omit {MOIRA_GAMMA_EXTRA_ARG}",
                parameter=MOIRA_GAMMA_EXTRA_ARG,
                value=gamma,
            )

    # Kernel pages are exactly 64 tokens (one summary per page). A manager
    # block that is a multiple of 64 is split into 64-token kernel blocks.
    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [MOIRA_PAGE_SIZE]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # Used when the user did not pass --block-size (default 16).
        return MOIRA_PAGE_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(MOIRA_SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in MOIRA_SUPPORTED_HEAD_SIZES

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # Prefill rows run on FA3, which vLLM only picks on SM90.
        return capability.major == 9

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    # Capabilities FA advertises that Moira's kernels do not have: the selector
    # refuses them instead of falling back.
    supports_sliding_window = classmethod(_unsupported)
    supports_rswa = classmethod(_unsupported)
    supports_non_causal = classmethod(_unsupported)
    supports_sink = classmethod(_unsupported)
    supports_mm_prefix = classmethod(_unsupported)
    supports_batch_invariance = classmethod(_unsupported)
    supports_per_head_quant_scales = classmethod(_unsupported)
    supports_kv_connector = classmethod(_unsupported)

    @classmethod
    def supports_combination(cls, *args: Any, **kwargs: Any) -> str | None:
        return None

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: DeviceCapability,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
        **unknown_flags: Any,
    ) -> list[str]:
        """Same contract as AttentionBackend.validate_configuration, but every
        reason names the offending option and what MOIRA supports (the base
        class only says e.g. "head_size not supported")."""
        r: list[str] = []
        if not cls.supports_head_size(head_size):
            r.append(
                f"head_size={head_size} is not supported by MOIRA; supported "
                f"head sizes: {list(MOIRA_SUPPORTED_HEAD_SIZES)}"
            )
        if not cls.supports_dtype(dtype):
            r.append(
                f"dtype={dtype} is not supported by MOIRA; only torch.bfloat16 "
                "is supported (--dtype bfloat16)"
            )
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            r.append(unsupported_kv_cache_dtype_message(kv_cache_dtype))
        if block_size is not None and block_size % MOIRA_PAGE_SIZE != 0:
            r.append(
                f"block_size={block_size} is not supported by MOIRA; the kernel "
                f"block size is exactly {MOIRA_PAGE_SIZE} (use --block-size "
                f"{MOIRA_PAGE_SIZE}, or a multiple of it, or leave it unset)"
            )
        if not cls.supports_compute_capability(device_capability):
            r.append(
                f"compute capability {device_capability.major}."
                f"{device_capability.minor} is not supported by MOIRA; only "
                "SM90 (9.x, Hopper) is supported (FA3 prefill)"
            )
        if not cls.supports_attn_type(attn_type):
            r.append(
                f"attention type {attn_type!r} is not supported by MOIRA; only "
                f"{AttentionType.DECODER.value!r} is supported"
            )
        features = dict(
            use_mla=use_mla, use_sparse=use_sparse, has_sink=has_sink,
            use_mm_prefix=use_mm_prefix, use_per_head_quant_scales=use_per_head_quant_scales,
            has_sliding_window=has_sliding_window, use_rswa=use_rswa,
            use_non_causal=use_non_causal, use_batch_invariant=use_batch_invariant,
            use_kv_connector=use_kv_connector, use_dcp=use_dcp, use_pcp=use_pcp,
            use_adaptive_verification=use_adaptive_verification,
            # A newer vLLM's feature flags that this backend does not know:
            # refused if set rather than ignored.
            **unknown_flags,
        )  # fmt: skip
        r.extend(_REFUSED_FEATURES.get(flag, f"{flag}={value!r} is not supported by MOIRA")
                 for flag, value in features.items() if value)  # fmt: skip
        try:
            moira_config_from_env()
        except ValueError as e:
            r.append(str(e))
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            # The engine-wide reasons, less those the flags above gave already
            # (the cache dtype is both a selector flag and a config field).
            r.extend(x for x in _unsupported_vllm_config_reasons(vllm_config) if x not in r)
        return r


# --------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------
class MoiraImpl(FlashAttentionImpl):
    """FA impl whose decode rows go to moira_decode and whose cache update
    also writes page summaries."""

    # Moira produces no LSE for DCP and has no context-parallel path; these
    # class flags feed the selector's supports_dcp()/supports_pcp().
    supports_dcp: bool = False
    supports_pcp: bool = False
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        # Refuse what the kernels do not implement before FA sets anything up.
        if alibi_slopes is not None:
            raise ValueError("MOIRA does not support ALiBi; use FLASH_ATTN")
        if logits_soft_cap:
            raise ValueError(
                f"MOIRA does not support logits soft-capping "
                f"(logits_soft_cap={logits_soft_cap}); use FLASH_ATTN"
            )
        if sinks is not None:
            raise ValueError("MOIRA does not support attention sinks; use FLASH_ATTN")
        if sliding_window is not None:
            raise ValueError(
                f"MOIRA does not support sliding-window attention "
                f"(sliding_window={sliding_window}); only full attention"
            )
        if attn_type != AttentionType.DECODER:
            raise ValueError(
                f"MOIRA supports decoder self-attention only, got attn_type={attn_type!r}"
            )
        if kv_cache_dtype not in MOIRA_KV_CACHE_DTYPES:
            raise ValueError(unsupported_kv_cache_dtype_message(kv_cache_dtype))
        if head_size not in MOIRA_SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"MOIRA supports head sizes {list(MOIRA_SUPPORTED_HEAD_SIZES)}, got {head_size}"
            )
        check_vllm_config_for_moira(get_current_vllm_config_or_none())
        self.moira_config = moira_config_from_env()
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        #: vLLM's fp8 cache (uint8 storage of e4m3 values): the kernels read it
        #: through an e4m3 view, with the layer's K and V scales.
        self.kv_cache_fp8 = kv_cache_dtype in MOIRA_FP8_KV_CACHE_DTYPES
        # On an fp8 cache vLLM's attention layer would quantize the query to
        # e4m3 before forward() for FA3 (which takes q, K and V in one element
        # type). Moira's decode reads the bf16 query instead, a product of bf16
        # q with the dequantized keys; the rows FA3 serves get their query
        # quantized here (_flash_attention), as the layer would have.
        self.supports_quant_query_input = False
        self._fa3_query_quant: Any = None
        if self.kv_cache_fp8:
            from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
            from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

            # The layer's own quantizer for FA (static, per tensor, q_scale).
            self._fa3_query_quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
        self._summaries: torch.Tensor | None = None
        self._summaries_key: tuple | None = None
        # (weak reference to the KV view, its in-page summaries): stock vLLM.
        self._page_summaries: tuple[weakref.ref, torch.Tensor] | None = None

    def _moira_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> tuple[Any, ...]:
        """(cache view, K scale, V scale) as the Moira kernels read them: the
        bf16 cache and no scales, or the fp8 cache viewed as e4m3 and the
        layer's scales (fp32 device tensors, so graphs replay with their
        current values)."""
        if not self.kv_cache_fp8:
            return kv_cache, None, None
        return kv_cache.view(torch.float8_e4m3fn), layer._k_scale, layer._v_scale

    def _flash_attention(
        self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """FlashAttentionImpl.forward on the rows that FA3 serves (prefill
        rows, dense steps). On an fp8 cache the bf16 query is quantized to
        e4m3 with the layer's q_scale first, and FA3 gets q_scale as its
        q_descale: FA3's fp8 path exactly as with FLASH_ATTN."""
        if not self.kv_cache_fp8:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        num_tokens = query.shape[0]
        query_fp8, _ = self._fa3_query_quant(query.reshape(num_tokens, -1), layer._q_scale)
        query_fp8 = query_fp8.view(query.shape)
        # FlashAttentionImpl.forward passes layer._q_scale as q_descale only
        # when its query arrives quantized; this one does.
        self.supports_quant_query_input = True
        try:
            return super().forward(layer, query_fp8, key, value, kv_cache, attn_metadata, output)
        finally:
            self.supports_quant_query_input = False

    # ---- KV-cache extras hook (patch 0003) --------------------------------
    def bind_kv_cache_extras(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> None:
        if self._summaries_key is not None:
            release_summaries(self._summaries_key)
        self._summaries = acquire_summaries(
            kv_cache, self.moira_config.summary_slots, self.moira_config.summary_dtype
        )
        self._summaries_key = summary_key(kv_cache)
        if self.kv_sharing_target_layer_name is None:
            # Before capture and before the first request (Triton caches the
            # compiled kernel: the other layers' calls are plain launches).
            moira_kv, k_scale, _ = self._moira_kv(layer, kv_cache)
            warm_up_summary_writer(moira_kv, self._summaries, k_scale)

    def release_kv_cache_extras(self, layer: torch.nn.Module) -> None:
        if self._summaries_key is not None:
            release_summaries(self._summaries_key)
        self._summaries = None
        self._summaries_key = None

    def get_kv_cache_extras_bytes(self, kv_cache_bytes: int) -> int:
        if self.kv_sharing_target_layer_name is not None:
            return 0  # shares the target layer's KV view and summaries
        return summary_bytes_for_kv_bytes(
            kv_cache_bytes,
            self.moira_config.summary_slots,
            self.moira_config.summary_dtype,
            kv_element_bytes=1 if self.kv_cache_fp8 else 2,
        )

    def get_shared_kv_cache_extras_bytes(self) -> dict[str, int]:
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return {}
        return {
            "moira_workspace": moira_workspace_bytes(
                vllm_config, self.num_heads, self.num_kv_heads, self.head_size
            )
        }

    def _get_summaries(
        self, kv_cache: torch.Tensor, k_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Summaries for this KV view. On the patched build, bound by the worker
        hook before anything is written to the cache. On stock vLLM, stored in
        the padding of the KV pages (``customize_spec``). Acquired here instead
        (a caller that drives the impl directly, as vLLM's backend tests do), the
        cache may already hold pages written behind the backend's back: their
        summaries are rebuilt from the keys (an fp8 cache: with the layer's
        ``k_scale``)."""
        if self._page_summaries is not None and self._page_summaries[0]() is kv_cache:
            return self._page_summaries[1]
        key = summary_key(kv_cache)
        if self._summaries is not None and self._summaries_key == key:
            return self._summaries
        if not has_kv_cache_extras_hook():
            in_pages = self._bind_page_summaries(kv_cache, k_scale)
            if in_pages is not None:
                return in_pages
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "MOIRA: page summaries were not allocated before CUDA-graph "
                "capture (the KV-cache extras hook did not run for this layer); "
                "apply the Moira patch series or run with enforce_eager=True"
            )
        if self._summaries_key is not None:
            release_summaries(self._summaries_key)  # KV view was replaced
        self._summaries = acquire_summaries(
            kv_cache, self.moira_config.summary_slots, self.moira_config.summary_dtype
        )
        self._summaries_key = key
        if kv_cache.numel() > 0:
            moira_kv = kv_cache.view(torch.float8_e4m3fn) if self.kv_cache_fp8 else kv_cache
            rebuild_page_summaries(moira_kv, self._summaries, k_scale)
        return self._summaries

    def _bind_page_summaries(
        self, kv_cache: torch.Tensor, k_scale: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The summaries in this padded KV view's pages (None: no room there).

        Cached per view object; a weak reference drops the cached view when
        vLLM drops the cache (profiling teardown), so the view never keeps a
        freed cache's memory alive."""
        summaries = summaries_in_kv_pages(
            kv_cache, self.moira_config.summary_slots, self.moira_config.summary_dtype
        )
        if summaries is None:
            return None
        impl_ref = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            impl = impl_ref()
            cached = None if impl is None else impl._page_summaries
            if impl is not None and cached is not None and cached[0] is ref:
                impl._page_summaries = None

        self._page_summaries = (weakref.ref(kv_cache, forget), summaries)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.kv_sharing_target_layer_name is None and not capturing:
            # Compile the writer before the first request's prefill (no hook
            # runs at bind time here; warm-up steps come before capture).
            moira_kv = kv_cache.view(torch.float8_e4m3fn) if self.kv_cache_fp8 else kv_cache
            warm_up_summary_writer(moira_kv, summaries, k_scale)
        return summaries

    # ---- forward -------------------------------------------------------------
    # The KV scatter is FlashAttentionImpl.do_kv_cache_update, unchanged: the
    # page summaries are written in forward(), which runs after it and knows
    # the decode / prefill split.
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MoiraMetadata,  # type: ignore[override]
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by MOIRA")
        if attn_metadata is None:
            # Profiling run.
            return output.fill_(0)

        # Layers that share another layer's KV cache neither scatter keys nor
        # write its summaries (the target layer does both).
        writes_summaries = self.kv_sharing_target_layer_name is None
        moira_kv, k_scale, v_scale = self._moira_kv(layer, kv_cache)
        dense_step = attn_metadata.dense_step
        if dense_step is not None:
            # Every row is read whole: FA3 decodes the batch. The pages that
            # this step's tokens filled still get their summaries, for the
            # steps in which these rows are no longer dense.
            if attn_metadata.dense_step_fills_pages and writes_summaries and kv_cache.numel() > 0:
                write_page_summaries(
                    moira_kv,
                    self._get_summaries(kv_cache, k_scale),
                    dense_step.slot_mapping,
                    k_scale,
                )
            return self._flash_attention(layer, query, key, value, kv_cache, dense_step, output)

        # Padded FULL-graph batches may have more (padded) rows than real
        # tokens; the runner's buffers are padded to the graph size.
        nd = min(attn_metadata.num_decodes, query.shape[0])
        if nd > 0:
            # One token per decode row: rows [0, nd) are tokens [0, nd).
            # No host sync: lengths and tables are read on device.
            moira_decode(
                query[:nd].view(nd, self.num_heads, self.head_size),
                moira_kv,
                self._get_summaries(kv_cache, k_scale),
                attn_metadata.decode_block_table,
                attn_metadata.decode_seq_lens,
                output[:nd].view(nd, self.num_heads, self.head_size),
                attn_metadata.workspace,
                self.scale,
                # The pages that the decode rows' new tokens filled are
                # summarized by Estimate (no writer launch in the decode step).
                write_filled_pages=writes_summaries,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        prefill = attn_metadata.prefill
        if prefill is not None:
            if writes_summaries and kv_cache.numel() > 0:
                # The prefill tokens' full pages, after the scatter
                # (do_kv_cache_update ran before forward).
                write_page_summaries(
                    moira_kv, self._get_summaries(kv_cache, k_scale), prefill.slot_mapping, k_scale
                )
            ndt = attn_metadata.num_decode_tokens
            # FA3 on the prefill slice only (its metadata was built for the
            # sliced batch); the decode rows' output is left as Moira wrote it.
            self._flash_attention(
                layer,
                query[ndt:],
                key[ndt:],
                value[ndt:],
                kv_cache,
                prefill,
                output[ndt:],
            )
        return output
