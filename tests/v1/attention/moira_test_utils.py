# SPDX-License-Identifier: Apache-2.0
"""Builders of paged KV caches and decode batches for Moira's kernel tests.

Shared by the CPU (Triton interpreter) tests, the GPU tests and the H200
correctness script, so every check runs on the same kinds of data.
"""

from __future__ import annotations

import math

import torch

PAGE = 64


def make_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    layout: str,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random bf16 cache as vLLM's logical view ``[blocks, H_kv, 64, 2D]``.

    ``layout="token_major"`` (vLLM's default LBNHC/"NHD") stores a page as
    ``[64, H_kv, 2D]``; ``"head_major"`` (LBHNC/"HND") as ``[H_kv, 64, 2D]``.
    """
    if layout == "token_major":
        shape, order = (num_blocks, PAGE, num_kv_heads, 2 * head_size), (0, 2, 1, 3)
    elif layout == "head_major":
        shape, order = (num_blocks, num_kv_heads, PAGE, 2 * head_size), (0, 1, 2, 3)
    else:
        raise ValueError(f"layout must be 'token_major' or 'head_major', got {layout!r}")
    if torch.device(device).type == "cpu":
        raw = torch.randn(shape, generator=generator).to(torch.bfloat16)
    else:  # GPU-sized caches: draw on the device (seeded by torch.manual_seed)
        raw = torch.randn(shape, device=device, dtype=torch.bfloat16)
    return raw.permute(order)


def make_block_table(
    seq_lens: list[int],
    num_blocks: int,
    max_pages: int,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Shuffled distinct blocks per row; block 0 is vLLM's null block and only
    pads the table (it is never a real page)."""
    needed = sum(math.ceil(s / PAGE) for s in seq_lens)
    assert needed <= num_blocks - 1, "cache too small for the rows"
    perm = torch.randperm(num_blocks - 1, generator=generator) + 1
    table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    start = 0
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        table[row, :n] = perm[start : start + n].to(torch.int32)
        start += n
    return table.to(device)


def shape_attention(
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    pattern: str,
    generator: torch.Generator | None = None,
) -> None:
    """Give the random data a structure, in place.

    - ``concentrated``: a few pages per row hold keys aligned with the query,
      so most of the mass sits there.
    - ``diffuse``: small keys everywhere, near-uniform attention.
    - ``outlier``: one page per row has a few keys strongly aligned with the
      query among ordinary ones (the case mvar's variance term is for).
    - ``random``: unchanged.
    """
    if pattern == "random":
        return
    head_size = kv_cache.shape[-1] // 2
    num_kv_heads = kv_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        if n == 0:
            continue
        blocks = block_table[row, :n].long()
        if pattern == "diffuse":
            kv_cache[blocks, :, :, :head_size] *= 0.1
            continue
        for h in range(num_kv_heads):
            direction = query[row, h * group : (h + 1) * group].float().mean(0)
            direction = direction / direction.norm().clamp_min(1e-6)
            chosen = torch.randint(0, n, (3 if pattern == "concentrated" else 1,),
                                   generator=generator)  # fmt: skip
            for page in chosen.tolist():
                valid = min(PAGE, seq_len - page * PAGE)
                if pattern == "concentrated":
                    tokens = torch.arange(valid)
                    strength = 6.0
                else:
                    tokens = torch.randint(0, valid, (3,), generator=generator)
                    strength = 14.0
                key = kv_cache[blocks[page], h, tokens, :head_size].float()
                key += strength * direction
                kv_cache[blocks[page], h, tokens, :head_size] = key.to(kv_cache.dtype)


def full_page_slots(block_table: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Slot of the 64th token of every full page of the rows: where vLLM's
    cache write completes a page, and so where Moira writes its summary."""
    slots = [
        int(block_table[r, p]) * PAGE + PAGE - 1
        for r, s in enumerate(seq_lens)
        for p in range(s // PAGE)
    ]
    return torch.tensor(slots, dtype=torch.int64)


def make_decode_batch(seq_lens, num_kv_heads, group, head_size, layout, estimator,
                      pattern="random", seed=0, extra_blocks=3, query_scale=1.0,
                      summary_dtype="bfloat16"):  # fmt: skip
    """A decode batch on a shuffled paged cache with ``estimator``'s summaries
    of every full page written by the kernel, stored as ``summary_dtype``: (kv,
    summaries, block table, seq_lens tensor, bf16 query)."""
    from vllm_moira.v1.attention.backends import moira

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / PAGE) for s in seq_lens) + extra_blocks
    max_pages = max(1, max(math.ceil(s / PAGE) for s in seq_lens))
    kv = make_kv_cache(num_blocks, num_kv_heads, head_size, layout, generator=gen)
    table = make_block_table(seq_lens, num_blocks, max_pages, generator=gen)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_size, generator=gen)
    query = (query * query_scale).to(torch.bfloat16)
    shape_attention(kv, query, table, seq_lens, pattern, generator=gen)
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    summaries = torch.zeros(num_blocks, num_kv_heads, rows, head_size, dtype=dtype)
    moira.write_page_summaries(kv, summaries, full_page_slots(table, seq_lens))
    return kv, summaries, table, torch.tensor(seq_lens, dtype=torch.int32), query


def pack_page_lists(lists, max_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attend()'s (page_list [B, H_kv, max_pages], list_lengths [B, H_kv]) int32
    from lists[row][head] of logical page indices (empty lists allowed)."""
    rows, heads = len(lists), len(lists[0])
    page_list = torch.zeros(rows, heads, max_pages, dtype=torch.int32)
    list_lengths = torch.zeros(rows, heads, dtype=torch.int32)
    for row in range(rows):
        for head in range(heads):
            pages = lists[row][head]
            page_list[row, head, : len(pages)] = pages
            list_lengths[row, head] = len(pages)
    return page_list, list_lengths


def apply_launch_candidates(monkeypatch) -> None:
    """Run a GPU test under candidate launch settings before they become the
    default: ``MOIRA_TEST_ESTIMATE_LAUNCH`` and ``MOIRA_TEST_ATTEND_LAUNCH``
    hold JSON dicts of Estimate and Attend launch overrides (e.g.
    ``'{"num_stages": 4}'``), which benchmarks/moira_correctness.py's workspaces
    and launches then use; an unknown key fails."""
    import json
    import os

    from vllm.v1.attention.backends import moira

    from benchmarks import moira_correctness as mc

    launch = {kernel: json.loads(os.environ[variable]) for kernel, variable in (
        ("estimate", "MOIRA_TEST_ESTIMATE_LAUNCH"), ("attend", "MOIRA_TEST_ATTEND_LAUNCH"),
    ) if os.environ.get(variable)}  # fmt: skip
    monkeypatch.setattr(mc, "LAUNCH", moira.check_launch_overrides(launch))
