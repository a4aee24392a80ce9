# SPDX-License-Identifier: Apache-2.0
"""Moira's captured-mass audit: how much attention mass the kept pages hold.

Select keeps the pages whose *estimated* share reaches gamma. The audit
measures the *exact* share on a sample: for a (row, layer, KV head) list it
computes the softmax of the G query heads over every key of the row, sums it
over the kept pages and averages over the group (the quantity gamma bounds).

It runs inside the decode step's CUDA graph, one launch per layer after Merge
(``MoiraAudit.launch``), with everything decided on the device:

- ``state[0]`` counts the audit launches of the workspace (L per step, L =
  the layers sharing it), so launch c is layer c % L of step c // L; steps
  with step % every == 0 are audited. The last program of a launch to finish
  (a ticket in ``state[1]``) advances the count, after every program read it.
- An audited launch takes ``samples`` lists, each chosen by a hash of (step,
  layer, sample) among the step's live rows (seq_len > 0) and the KV heads;
  rows read whole (dense rows) are skipped: their mass is 1 by construction.
- ``list_programs`` programs share a list's pages and store per-head partial
  softmax sums (max, all keys, kept keys); the last program combines them and
  adds the list to the workspace's int64 counters: a histogram bucket of the
  mass and, under the coverage rule, the below-gamma count (mass < its row's
  gamma - 0.01). ReadStatsPoller copies these counters with the read counts.

A launch whose step is not audited reads one counter and bumps the ticket.
Bytes: an audited list costs one read of that row's keys for one KV head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.triton_utils import tl, triton

from .moira_config import audit_launch

try:  # Hopper grid dependency control (Triton >= 3.4)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - no Triton, or one without it: plain launches
    gdc_wait = None

#: A list counts as below its gamma when its captured mass is under gamma - this
#: (the bisection's grid and the estimate's rounding are far finer; a list this far
#: under its target lost mass that the estimate did not see).
AUDIT_BELOW_MARGIN = 0.01
#: Layout of the audit's part of the workspace's int64 counters (after the two
#: read counts): the below-gamma count, then one count per histogram bucket.
AUDIT_BELOW_INDEX = 0
AUDIT_BUCKETS_INDEX = 1
# Offsets (from gamma) of the fine buckets' upper bounds; coarse ones below them.
_FINE_OFFSETS = (-0.10, -0.05, -0.03, -0.02, -0.01, -0.005, 0.0)
_COARSE_BOUNDS = (0.5, 0.8)


def captured_mass_buckets(gamma: float) -> tuple[float, ...]:
    """Upper bounds of the captured-mass histogram, fine around ``gamma`` (the
    server's): coarse 0.5 and 0.8, gamma - 0.10 ... gamma, halfway to 1, and 1.0
    (masses are clamped to 1, so the last bucket holds every list at or above
    it). Rounded to 4 digits so that the device and /metrics agree on them."""
    bounds = {round(b, 4) for b in _COARSE_BOUNDS if b < gamma - 0.10}
    bounds |= {round(gamma + o, 4) for o in _FINE_OFFSETS if 0.0 < gamma + o < 1.0}
    if gamma < 1.0:
        bounds.add(round(gamma + (1.0 - gamma) / 2, 4))
    bounds.add(1.0)
    return tuple(sorted(b for b in bounds if 0.0 < b <= 1.0))


def audit_counter_count(num_buckets: int) -> int:
    """int64 counters the audit adds to the workspace's: below-gamma + buckets."""
    return AUDIT_BUCKETS_INDEX + num_buckets


@triton.jit
def _mix32(x):
    # A 32-bit integer hash (the "lowbias32" finalizer): consecutive steps and
    # layers land on unrelated rows and heads. uint32 arithmetic wraps.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def mix32(x: int) -> int:
    """``_mix32`` on the host (tests pick the audited lists with it)."""
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


@triton.jit
def _audit_list(step, layer, sample, num_rows, num_kv_heads, seq_lens_ptr, ROWS_TILE: tl.constexpr):
    # The (row, KV head) of an audited launch's sample: a hash of (step, layer,
    # sample) over the live rows (padding rows, seq_len 0, come last) and heads.
    # Returns row -1 when the step has no live row.
    offs = tl.arange(0, ROWS_TILE)
    live = 0
    for first in range(0, num_rows, ROWS_TILE):
        lens = tl.load(seq_lens_ptr + first + offs, mask=first + offs < num_rows, other=0)
        live += tl.sum((lens > 0).to(tl.int32), axis=0)
    # tl.cast: the sample index is a plain int in the combine's loop.
    key = (tl.cast(step, tl.uint32) * 0x9E3779B1) ^ (tl.cast(layer, tl.uint32) * 0x85EBCA77)
    h = _mix32(key ^ (tl.cast(sample, tl.uint32) * 0xC2B2AE3D))
    row = tl.cast(h % tl.cast(tl.maximum(live, 1), tl.uint32), tl.int32)
    head = tl.cast(_mix32(h) % tl.cast(num_kv_heads, tl.uint32), tl.int32)
    return tl.where(live > 0, row, -1), head


def audit_list(step: int, layer: int, sample: int, live_rows: int, num_kv_heads: int):
    """``_audit_list`` on the host, for ``live_rows`` rows: (row, KV head)."""
    m = 0xFFFFFFFF
    key = ((step * 0x9E3779B1) & m) ^ ((layer * 0x85EBCA77) & m)
    h = mix32(key ^ ((sample * 0xC2B2AE3D) & m))
    return h % max(live_rows, 1), mix32(h) % num_kv_heads


@triton.jit
def _skipped(row, seq_lens_ptr, selector_ptr, num_rows, PAGE_SIZE: tl.constexpr):
    # No live row, or a row read whole (dense_batch_tokens, Select's
    # _is_dense_row test on the step's rows): nothing to audit.
    seq_len = tl.load(seq_lens_ptr + tl.maximum(row, 0))
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    dense = (num_pages * num_rows).to(tl.float32) <= tl.load(selector_ptr + 3)
    return ((row < 0) | (seq_len <= 0) | dense).to(tl.int32), seq_len


@triton.jit(do_not_specialize=["num_rows", "num_layers", "num_kv_heads"])
def kernel_moira_audit(
    query_ptr,  # [num_rows, num_q_heads, HEAD_SIZE] bf16
    kv_cache_ptr,  # [num_blocks, num_kv_heads, PAGE_SIZE, 2 * HEAD_SIZE] bf16 (fp8 if KV_FP8)
    block_table_ptr,  # [num_rows, max_blocks] int32
    seq_lens_ptr,  # [num_rows] int32
    page_list_ptr,  # [max_rows, num_kv_heads, max_pages] int32 (Select's lists)
    list_lengths_ptr,  # [max_rows, num_kv_heads] int32
    selector_ptr,  # [4] fp32: gamma, fixed K, fixed fraction, dense batch pages
    row_gamma_ptr,  # [max_rows] fp32: per-row gamma, <= 0: selector's
    k_scale_ptr,  # [1] fp32: the layer's K dequantization scale (if KV_FP8)
    state_ptr,  # [3] int64: audit launches so far, finished programs of this launch, period
    partial_ptr,  # [SAMPLES * LIST_PROGRAMS, GROUP_ROWS, 3] fp32 (scratch)
    edges_ptr,  # [NUM_EDGES] fp32: the histogram's upper bounds, increasing, last 1.0
    counters_ptr,  # [1 + NUM_EDGES] int64 (accumulated): below gamma, bucket counts
    recent_ptr,  # [SAMPLES, 4] fp32 (out): row, KV head, mass, gamma of the last audit
    scale, num_rows, num_layers, num_kv_heads,
    stride_q_row: tl.int64, stride_q_head: tl.int64,  # query
    stride_kv_block: tl.int64, stride_kv_head: tl.int64, stride_kv_token: tl.int64,  # cache
    stride_bt_row: tl.int64,  # block table
    stride_pl_row: tl.int64, stride_pl_head: tl.int64, stride_ll_row: tl.int64,  # lists
    GROUP_SIZE: tl.constexpr, GROUP_ROWS: tl.constexpr,  # query heads per KV head, padded
    HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SAMPLES: tl.constexpr, LIST_PROGRAMS: tl.constexpr, PROGRAMS_TILE: tl.constexpr,
    NUM_EDGES: tl.constexpr, EDGES_TILE: tl.constexpr, ROWS_TILE: tl.constexpr,
    LIST_TILE: tl.constexpr, KV_FP8: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    # One program per (sample, part of the list's pages). Everything it reads
    # (the lists, the cache, the counters) is complete once the previous kernel
    # is: wait first.
    if USE_GDC:
        gdc_wait()
    pid = tl.program_id(0)
    sample = pid // LIST_PROGRAMS
    part = pid % LIST_PROGRAMS
    launch_no = tl.load(state_ptr, volatile=True)
    # The period on the device: set_selector can pause the audit (0) in
    # captured graphs.
    every = tl.load(state_ptr + 2)
    step = launch_no // num_layers
    layer = launch_no % num_layers
    active = (every > 0) & (step % tl.maximum(every, 1) == 0)
    offs_g = tl.arange(0, GROUP_ROWS)
    mask_g = offs_g < GROUP_SIZE
    if active:
        row, head = _audit_list(step, layer, sample, num_rows, num_kv_heads, seq_lens_ptr,
                                ROWS_TILE)  # fmt: skip
        skipped, seq_len = _skipped(row, seq_lens_ptr, selector_ptr, num_rows, PAGE_SIZE)
        if skipped == 0:
            num_pages = tl.cdiv(seq_len, PAGE_SIZE)
            per_part = tl.cdiv(num_pages, LIST_PROGRAMS)
            first = part * per_part
            last = tl.minimum(first + per_part, num_pages)
            offs_t = tl.arange(0, PAGE_SIZE)
            offs_d = tl.arange(0, HEAD_SIZE)
            q = tl.load(
                query_ptr + row * stride_q_row
                + (head * GROUP_SIZE + offs_g)[:, None] * stride_q_head + offs_d[None, :],
                mask=mask_g[:, None], other=0.0,
            )  # fmt: skip
            logit_scale = scale
            if KV_FP8:
                # As Attend: e4m3 keys meet the query in fp16, where both are exact.
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
                logit_scale = scale * tl.load(k_scale_ptr)
            pages = page_list_ptr + row * stride_pl_row + head * stride_pl_head
            n_kept = tl.load(list_lengths_ptr + row * stride_ll_row + head)
            # The list is in page order: entries before this part's first page
            # are skipped once, then the list advances as its pages come up.
            offs_l = tl.arange(0, LIST_TILE)
            idx = 0
            for start in range(0, n_kept, LIST_TILE):
                entry = tl.load(pages + start + offs_l, mask=start + offs_l < n_kept,
                                other=num_pages)  # fmt: skip
                idx += tl.sum((entry < first).to(tl.int32), axis=0)
            peak = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_ROWS], tl.float32)
            kept = tl.zeros([GROUP_ROWS], tl.float32)
            cache = kv_cache_ptr + head * stride_kv_head
            for page in range(first, last):
                block = tl.load(block_table_ptr + row * stride_bt_row + page).to(tl.int64)
                mask_t = offs_t < seq_len - page * PAGE_SIZE
                k = tl.load(
                    cache + block * stride_kv_block + offs_t[:, None] * stride_kv_token
                    + offs_d[None, :], mask=mask_t[:, None], other=0.0,
                )  # fmt: skip
                if KV_FP8:
                    k = k.to(tl.float16)
                s = tl.dot(q, tl.trans(k)) * logit_scale  # [GROUP_ROWS, PAGE_SIZE]
                s = tl.where(mask_t[None, :], s, float("-inf"))
                new_peak = tl.maximum(peak, tl.max(s, axis=1))
                alpha = tl.exp(peak - new_peak)
                page_sum = tl.sum(tl.exp(s - new_peak[:, None]), axis=1)
                entry = tl.load(pages + idx, mask=idx < n_kept, other=-1)
                is_kept = entry == page
                total = total * alpha + page_sum
                kept = kept * alpha + tl.where(is_kept, page_sum, 0.0)
                idx += is_kept.to(tl.int32)
                peak = new_peak
            out = partial_ptr + (pid * GROUP_ROWS + offs_g) * 3
            tl.store(out, peak)
            tl.store(out + 1, total)
            tl.store(out + 2, kept)
    # The last program of the launch (its stores are ordered before the
    # ticket's release; the acquire sees every other program's) combines the
    # samples and advances the launch count, which every program has read.
    ticket = tl.atomic_add(state_ptr + 1, 1)
    if ticket == SAMPLES * LIST_PROGRAMS - 1:
        if active:
            offs_p = tl.arange(0, PROGRAMS_TILE)
            offs_e = tl.arange(0, EDGES_TILE)
            edges = tl.load(edges_ptr + offs_e, mask=offs_e < NUM_EDGES, other=float("inf"))
            server_gamma = tl.load(selector_ptr)
            by_count = (tl.load(selector_ptr + 1) > 0.0) | (tl.load(selector_ptr + 2) > 0.0)
            for smp in range(SAMPLES):
                row, head = _audit_list(step, layer, smp, num_rows, num_kv_heads, seq_lens_ptr,
                                        ROWS_TILE)  # fmt: skip
                skipped, seq_len = _skipped(row, seq_lens_ptr, selector_ptr, num_rows, PAGE_SIZE)
                rec = recent_ptr + smp * 4
                if skipped != 0:
                    tl.store(rec, -1.0)
                else:
                    src = partial_ptr + (
                        (smp * LIST_PROGRAMS + offs_p)[:, None] * GROUP_ROWS + offs_g[None, :]
                    ) * 3  # fmt: skip
                    mask_p = (offs_p < LIST_PROGRAMS)[:, None]
                    # Parts with no pages stored (-inf, 0, 0) and add nothing.
                    # Volatile: the other programs' partials, past this SM's L1.
                    peaks = tl.load(src, mask=mask_p, other=float("-inf"), volatile=True)
                    top = tl.max(peaks, axis=0)
                    weight = tl.where(peaks == float("-inf"), 0.0, tl.exp(peaks - top[None, :]))
                    totals = tl.load(src + 1, mask=mask_p, other=0.0, volatile=True)
                    kepts = tl.load(src + 2, mask=mask_p, other=0.0, volatile=True)
                    totals = tl.sum(totals * weight, axis=0)
                    kepts = tl.sum(kepts * weight, axis=0)
                    share = tl.where(mask_g, kepts / tl.where(mask_g, totals, 1.0), 0.0)
                    mass = tl.minimum(tl.sum(share, axis=0) / GROUP_SIZE, 1.0)
                    row_gamma = tl.load(row_gamma_ptr + row)
                    gamma = tl.where(row_gamma > 0.0, row_gamma, server_gamma)
                    bucket = tl.sum((edges < mass).to(tl.int32), axis=0)
                    tl.atomic_add(counters_ptr + 1 + bucket, 1, sem="relaxed")
                    if (by_count == 0) & (mass < gamma - 0.01):  # AUDIT_BELOW_MARGIN
                        tl.atomic_add(counters_ptr, 1, sem="relaxed")
                    tl.store(rec, row.to(tl.float32))
                    tl.store(rec + 1, head.to(tl.float32))
                    tl.store(rec + 2, mass)
                    tl.store(rec + 3, gamma)
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, launch_no + 1)


def make_stats_counters(
    config: Any, max_pages: int, group_size: int, device: torch.device | str,
    launch: Mapping[str, Mapping[str, Any]] | None,
) -> tuple[torch.Tensor, MoiraAudit | None]:  # fmt: skip
    """The workspace's int64 counters (two read counts, then the audit's) and its
    audit: None when ``config.audit_every`` is 0 (no audit launches at all)."""
    if config.audit_every <= 0:
        return torch.zeros(2, dtype=torch.int64, device=device), None
    edges = captured_mass_buckets(config.gamma)
    counters = torch.zeros(2 + audit_counter_count(len(edges)), dtype=torch.int64, device=device)
    audit = MoiraAudit(config.audit_every, config.gamma, max_pages, group_size, counters[2:],
                       device, launch)  # fmt: skip
    return counters, audit


def switch_audit(audit: MoiraAudit | None, config: Any) -> None:
    """set_selector's part: a new period (0 pauses the captured launches); turning
    the audit on where no launches were captured is refused."""
    if audit is None:
        if config.audit_every > 0:
            raise ValueError(
                "Moira: set_selector cannot turn the captured-mass audit on (audit_every="
                f"{config.audit_every}) on a workspace built with it off (no audit launches "
                "were captured); build it with audit_every > 0"
            )
        return
    audit.set_every(config.audit_every)


class MoiraAudit:
    """The audit's buffers and launch for one workspace, allocated once, before
    CUDA-graph capture. ``counters`` is a view of the workspace's int64 counters
    (after the two read counts), so one device-to-host copy reads both."""

    def __init__(
        self,
        every: int,
        gamma: float,
        max_pages: int,
        group_size: int,
        counters: torch.Tensor,
        device: torch.device | str,
        launch: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.every = every
        self.launch = audit_launch(max_pages, (launch or {}).get("audit"))
        #: Audit launches per decode step: the layers sharing the workspace
        #: (the metadata builder sets it before capture; 1 for direct callers).
        self.num_layers = 1
        self.edges: tuple[float, ...] = captured_mass_buckets(gamma)
        if counters.numel() != audit_counter_count(len(self.edges)):
            raise ValueError(
                f"Moira: the audit needs {audit_counter_count(len(self.edges))} counters, "
                f"got {counters.numel()}"
            )
        self.counters = counters
        group_rows = max(16, triton.next_power_of_2(group_size))
        programs = self.launch.samples * self.launch.list_programs
        f32 = torch.float32
        #: launches so far, this launch's finished programs, the period (every).
        self.state = torch.tensor([0, 0, every], dtype=torch.int64, device=device)
        self.partial = torch.empty(programs, group_rows, 3, dtype=f32, device=device)
        self.edges_tensor = torch.tensor(self.edges, dtype=f32, device=device)
        self.recent = torch.full((self.launch.samples, 4), -1.0, dtype=f32, device=device)

    def set_every(self, every: int) -> None:
        """Change the period in place (0 pauses; between steps, like set_selector)."""
        self.every = every
        self.state[2].fill_(every)

    def nbytes(self) -> int:
        tensors = (self.state, self.partial, self.edges_tensor, self.recent)
        return sum(t.numel() * t.element_size() for t in tensors)

    def below_and_buckets(self, values: Sequence[int]) -> tuple[int, list[int]]:
        """Split the audit's counters (as read back) into (below gamma, buckets)."""
        return int(values[AUDIT_BELOW_INDEX]), [int(v) for v in values[AUDIT_BUCKETS_INDEX:]]

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
        seq_lens: torch.Tensor, workspace: Any, scale: float, kv_fp8: bool,
        k_scale_arg: torch.Tensor, dependent_launch: Mapping[str, Any],
    ) -> None:  # fmt: skip
        """One layer's audit launch (after Merge) over ``workspace``'s lists,
        selector parameters and per-row gamma. Grid and arguments depend only
        on the step's rows and static shapes: it replays in the step's graph."""
        page_list, list_lengths = workspace.page_list, workspace.list_lengths
        selector_params, row_gamma = workspace.selector_params, workspace.row_gamma
        num_rows, num_q_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[1]
        group_size = num_q_heads // num_kv_heads
        samples, list_programs = self.launch
        kernel_moira_audit[(samples * list_programs,)](
            query, kv_cache, block_table, seq_lens, page_list, list_lengths, selector_params,
            row_gamma, k_scale_arg, self.state, self.partial, self.edges_tensor, self.counters,
            self.recent, scale, num_rows, self.num_layers, num_kv_heads,
            query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), block_table.stride(0), page_list.stride(0), page_list.stride(1),
            list_lengths.stride(0),
            GROUP_SIZE=group_size, GROUP_ROWS=self.partial.shape[1], HEAD_SIZE=head_size,
            PAGE_SIZE=64, SAMPLES=samples, LIST_PROGRAMS=list_programs,
            PROGRAMS_TILE=triton.next_power_of_2(list_programs), NUM_EDGES=len(self.edges),
            EDGES_TILE=triton.next_power_of_2(len(self.edges)),
            ROWS_TILE=min(1024, triton.next_power_of_2(max(num_rows, 16))), LIST_TILE=256,
            KV_FP8=kv_fp8, num_warps=4, **dependent_launch,
        )  # fmt: skip
