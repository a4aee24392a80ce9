# SPDX-License-Identifier: Apache-2.0
"""Moira page summaries: allocation, sharing and memory accounting.

Installed as ``vllm.v1.worker.moira_summaries``. The Moira impl calls these
helpers from the KV-cache extras hook (``AttentionImplBase.
bind_kv_cache_extras`` / ``release_kv_cache_extras``, patch 0003), which both
model runners reach right after the KV cache is bound and before warmup and
CUDA-graph capture.

One summary buffer per KV-cache *view*: ``[num_kernel_blocks, H_kv, S, D]``
bf16, S = ``summary_slots(estimator)`` of the backend (2 for mvar / mvar_rem:
per-channel mean and variance of the 64 keys of each page; 2 + r for
mvar_top{r}: mean and variance of the other 64 - r keys, then the r keys
farthest from the page mean), or, with ``MOIRA_SUMMARY_DTYPE=int8``,
``[num_kernel_blocks, H_kv, S + 1, D]`` int8: the S slot vectors quantized and
one more row of D bytes holding their S fp32 scales, or, with
``MOIRA_SUMMARY_DTYPE=int4`` (mvar_top{r}), ``[num_kernel_blocks, H_kv, 2 + r / 2
+ 1, D]`` uint8: the stored keys in 4 bits, two per row; indexed by
the same kernel block id as the view's dim 0, i.e. the values stored in the
block table. It is sized from the view itself, not from
``kv_cache_config.num_blocks``: when the manager block is a multiple of 64,
each manager block is split into several 64-token kernel blocks and the view
has that many more rows. Layers that share a KV view (cross-layer KV sharing)
get the same summary buffer: the registry is keyed on the view's device,
``data_ptr()`` and geometry.

On stock vLLM (Moira as a plugin, no extras hook) the summaries are stored in
the KV pages instead: ``summary_padded_spec`` pads each page and
``summaries_in_kv_pages`` views the padding (below).

The storage of a summary (page size, dtypes) is defined here; the backend
imports it, and this module imports nothing of the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: Tokens per page: one summary per page, and the kernels' block size.
MOIRA_PAGE_SIZE = 64
#: Summary storage -> torch dtype. "bfloat16": each slot vector as D bf16 values
#: (the paper's summary). "int8": D int8 values per slot and one fp32 scale per
#: slot (absmax / 127), the scales in one extra row of D bytes after the slots.
#: "int4" (estimators with stored keys): mean and variance as int8, the r
#: stored keys in 4 bits (absmax / 7), two keys per row of D bytes (key 2i in
#: the low nibble of row 2 + i, key 2i + 1 in the high one), then the row of
#: scales; uint8 marks the layout (the kernels read it as int8).
_SUMMARY_STORAGE = {"bfloat16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
MOIRA_SUMMARY_DTYPES = tuple(_SUMMARY_STORAGE)

# (device, data_ptr, shape) of a KV view -> [summaries, number of holders].
_REGISTRY: dict[tuple, list] = {}


def summary_key(kv_cache: torch.Tensor) -> tuple:
    """Identity of a KV view: same storage offset and geometry."""
    return (str(kv_cache.device), kv_cache.data_ptr(), tuple(kv_cache.shape))


def summary_storage(num_slots: int, summary_dtype: str) -> tuple[torch.dtype, int]:
    """(torch dtype, rows of D elements per (page, KV head)) of a summary tensor of
    ``num_slots`` slots stored as ``summary_dtype``: the slots, plus, for int8, the
    row that holds their fp32 scales; for int4, the two int8 rows, the stored keys
    two per row and the row of scales."""
    if summary_dtype not in _SUMMARY_STORAGE:
        raise ValueError(
            f"Moira: summary_dtype must be one of {MOIRA_SUMMARY_DTYPES}, got {summary_dtype!r}"
        )
    dtype = _SUMMARY_STORAGE[summary_dtype]
    if summary_dtype == "bfloat16":
        return dtype, num_slots
    if summary_dtype == "int8":
        return dtype, num_slots + 1
    num_keys = num_slots - 2
    if num_keys <= 0 or num_keys % 2:
        raise ValueError(
            "Moira: summary_dtype 'int4' stores the keys of mvar_top{r} in 4 bits, two per "
            f"byte; {num_slots} slots have {num_keys} stored keys (use 'int8' for mvar and "
            "mvar_rem)"
        )
    return dtype, 2 + num_keys // 2 + 1


def summary_shape(
    kv_cache: torch.Tensor, num_slots: int = 2, summary_dtype: str = "bfloat16"
) -> tuple[int, int, int, int]:
    """``[num_blocks, H_kv, rows, D]`` for a ``[num_blocks, H_kv, 64, 2*D]`` view:
    rows = ``num_slots`` (bf16), ``num_slots + 1`` (int8: values, then the scales),
    ``2 + r / 2 + 1`` (int4, r = num_slots - 2 stored keys)."""
    if kv_cache.dim() != 4 or kv_cache.shape[2] != MOIRA_PAGE_SIZE:
        raise ValueError(
            "Moira: expected a KV cache view [num_blocks, num_kv_heads, 64, "
            f"2 * head_size], got shape {tuple(kv_cache.shape)}; the kernel "
            "block size must be 64"
        )
    num_blocks, num_kv_heads, _, width = kv_cache.shape
    _, rows = summary_storage(num_slots, summary_dtype)
    if summary_dtype != "bfloat16" and 4 * num_slots > width // 2:
        raise ValueError(
            f"Moira: {summary_dtype} summaries of {num_slots} slots need head_size >= "
            f"{4 * num_slots} "
            f"(one row of D bytes holds the fp32 scales), got {width // 2}"
        )
    return (num_blocks, num_kv_heads, rows, width // 2)


def acquire_summaries(
    kv_cache: torch.Tensor, num_slots: int = 2, summary_dtype: str = "bfloat16"
) -> torch.Tensor:
    """Return the summary buffer of this KV view, allocating it on first use.

    ``num_slots`` is ``summary_slots(estimator)`` (2 + r), ``summary_dtype`` the
    config's storage. Zero-filled: a page that has never been filled (e.g. the
    null block 0) has a zero summary (int8: scale 0) and is never selected on
    its own merit.
    """
    key = summary_key(kv_cache)
    shape = summary_shape(kv_cache, num_slots, summary_dtype)
    dtype, _ = summary_storage(num_slots, summary_dtype)
    entry = _REGISTRY.get(key)
    if entry is not None and (tuple(entry[0].shape) != shape or entry[0].dtype != dtype):
        raise ValueError(
            f"Moira: the summaries of this KV view are {entry[0].dtype} "
            f"{tuple(entry[0].shape)}, a layer asked for {num_slots} slots of "
            f"{summary_dtype}; every layer must use the same estimator and summary dtype"
        )
    if entry is None:
        summaries = torch.zeros(shape, dtype=dtype, device=kv_cache.device)
        entry = _REGISTRY[key] = [summaries, 0]
    entry[1] += 1
    return entry[0]


def release_summaries(key: tuple) -> None:
    """Drop one holder; the buffer is freed with its last holder."""
    entry = _REGISTRY.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _REGISTRY[key]


def live_summary_bytes() -> int:
    """Device bytes held by summary buffers right now (for tests/logging)."""
    return sum(t.numel() * t.element_size() for t, _ in _REGISTRY.values())


def summary_bytes_for_kv_bytes(
    kv_cache_bytes: int,
    num_slots: int = 2,
    summary_dtype: str = "bfloat16",
    kv_element_bytes: int = 2,
) -> int:
    """Summary bytes for a KV view of ``kv_cache_bytes`` (bf16: ``kv_element_bytes``
    2; an fp8 cache, 1, holds twice the pages in the same bytes).

    A page holds 64 tokens x 2D bf16 values (K and V) per KV head; its bf16
    summary ``num_slots`` x D bf16 values. So bf16 summaries are exactly
    ``num_slots / 128`` of the KV bytes (rounded up): 1/64 for mvar / mvar_rem
    (2 slots), 1/32 for mvar_top2 (4), 3/64 for mvar_top4 (6). int8 summaries
    hold ``num_slots + 1`` rows of D bytes: ``(num_slots + 1) / 256`` of the KV
    bytes (7/256 for mvar_top4); int4 summaries ``2 + r / 2 + 1`` rows (7/256 for
    mvar_top8).
    """
    if kv_element_bytes not in (1, 2):
        raise ValueError(
            f"Moira: kv_element_bytes must be 2 (bf16 KV) or 1 (fp8 KV), got {kv_element_bytes!r}"
        )
    dtype, rows = summary_storage(num_slots, summary_dtype)
    page_bytes = 2 * MOIRA_PAGE_SIZE * kv_element_bytes  # per element of D: 64 keys, 64 values
    return -(-kv_cache_bytes * rows * dtype.itemsize // page_bytes)


# --------------------------------------------------------------------------
# Summaries inside the KV pages (stock vLLM: no extras hook)
# --------------------------------------------------------------------------
# Without the extras hook, the summaries live in the KV cache itself: the
# backend's customize_spec() pads every page (one layer's 64 tokens of every
# KV head) by the bytes of its summaries, and the summary of kernel block b is
# read from the padding that follows block b's K/V. vLLM then budgets them
# with the KV cache, allocates and frees them with it (profiling teardown,
# sleep mode), and a block reused through prefix caching keeps its summary.
# vLLM cannot split a padded page into kernel blocks, so the block size is
# exactly the page size there.


def summary_page_bytes(
    num_kv_heads: int, head_size: int, num_slots: int = 2, summary_dtype: str = "bfloat16"
) -> int:
    """Bytes of one page's summaries, all KV heads: ``H_kv * rows * D`` elements."""
    dtype, rows = summary_storage(num_slots, summary_dtype)
    return num_kv_heads * rows * head_size * dtype.itemsize


def summary_padded_spec(spec: Any, num_slots: int = 2, summary_dtype: str = "bfloat16") -> Any:
    """``spec`` (vLLM's ``AttentionSpec``) with each page padded by its summaries."""
    if spec.block_size != MOIRA_PAGE_SIZE:
        raise ValueError(
            f"MOIRA on stock vLLM (plugin mode) needs --block-size {MOIRA_PAGE_SIZE}, got "
            f"block_size={spec.block_size}: the page summaries are stored in each KV page's "
            "padding, and vLLM does not split padded pages into kernel blocks (the patched "
            f"build accepts multiples of {MOIRA_PAGE_SIZE})"
        )
    if spec.page_size_padded is not None or spec.state_content_bytes is not None:
        raise ValueError(
            "MOIRA on stock vLLM (plugin mode) stores the page summaries in the KV page "
            "padding, but this layer's KV spec is already packed or padded "
            f"(page_size_padded={spec.page_size_padded}, "
            f"state_content_bytes={spec.state_content_bytes})"
        )
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"MOIRA needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v}"
        )
    extra = summary_page_bytes(spec.num_kv_heads, spec.head_size, num_slots, summary_dtype)
    return dataclasses.replace(spec, page_size_padded=spec.unpadded_page_size_bytes + extra)


def summaries_in_kv_pages(
    kv_cache: torch.Tensor, num_slots: int = 2, summary_dtype: str = "bfloat16"
) -> torch.Tensor | None:
    """The summaries stored after each page of a padded KV view, as a
    ``[num_blocks, H_kv, rows, D]`` view of the cache's memory (strided: one
    page apart), or None when the view's pages have no room for them (a cache
    that ``summary_padded_spec`` did not lay out, e.g. a contiguous one).

    The kernels take the block and head strides of the summaries, so they read
    and write this view as they do a separate buffer. The view owns no memory.
    """
    shape = summary_shape(kv_cache, num_slots, summary_dtype)
    dtype, _ = summary_storage(num_slots, summary_dtype)
    element = kv_cache.element_size()
    page_bytes = kv_cache[0].numel() * element if kv_cache.shape[0] else 0
    # One page is one dense run of bytes (heads, tokens and K/V inside the block
    # dimension); its padding follows it.
    inner = sum((kv_cache.shape[d] - 1) * kv_cache.stride(d) for d in (1, 2, 3))
    inner_bytes = element * (1 + inner)
    block_stride = kv_cache.stride(0) * element
    extra = summary_page_bytes(shape[1], shape[3], num_slots, summary_dtype)
    if kv_cache.shape[0] == 0 or inner_bytes != page_bytes or block_stride < page_bytes + extra:
        return None
    kv_bytes = kv_cache.view(torch.uint8)
    start = kv_bytes.storage_offset() + page_bytes
    end = start + (shape[0] - 1) * block_stride + extra
    if end > kv_bytes.untyped_storage().nbytes() or start % dtype.itemsize:
        return None
    flat = torch.as_strided(kv_bytes, (shape[0], extra), (block_stride, 1), start)
    return flat.view(dtype).unflatten(1, shape[1:])
