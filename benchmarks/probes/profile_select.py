# SPDX-License-Identifier: Apache-2.0
"""Where Estimate + Select spend their time at one shape (H200; not a test).

Without hardware counters, time variants that leave a stage out and take
differences (device/H200.md): the launch floor (an empty kernel on Select's
grid), Select with 0 / half / all bisection passes, a kernel that only does
Select's two loads + softmax (pass 1 + 2), and one that only does its
compaction (cumsum + scattered store). Every time is the median per launch of
20 back-to-back launches replayed in one CUDA graph, as moira_correctness.py
times them.

    python benchmarks/probes/profile_select.py --shape 4x131072 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm.v1.attention.backends import moira  # noqa: E402

from benchmarks.moira_correctness import (  # noqa: E402
    SCALE,
    build_case,
    graph_time_us,
    workspace,
)


@triton.jit
def kernel_empty(x_ptr):
    # The launch floor: nothing but a program id.
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0.0)


@triton.jit
def kernel_softmax_only(
    logmass_ptr,  # [rows, H_kv, G, max_pages] fp32
    pibar_ptr,  # [rows, H_kv, pages] fp32 (out)
    seq_lens_ptr,  # [rows] int32
    stride_lm_row,
    stride_lm_head,
    stride_lm_group,
    stride_pib_row,
    stride_pib_head,
    GROUP_SIZE: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    TILE_PAGES: tl.constexpr,
):
    # Select's pass 1 + 2 on one tile: two loads, softmax per head, group mean.
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + row), 64)
    offs_g = tl.arange(0, GROUP_ROWS)
    pages = tl.arange(0, TILE_PAGES)
    mask = (offs_g < GROUP_SIZE)[:, None] & (pages < num_pages)[None, :]
    lm = logmass_ptr + row * stride_lm_row + head * stride_lm_head
    x = tl.load(lm + offs_g[:, None] * stride_lm_group + pages[None, :], mask=mask, other=-1e30)
    peak = tl.max(x, axis=1)
    denom = tl.sum(tl.exp(x - peak[:, None]), axis=1)
    x = tl.load(lm + offs_g[:, None] * stride_lm_group + pages[None, :], mask=mask, other=-1e30)
    pib = tl.sum(tl.exp(x - peak[:, None]) / denom[:, None], axis=0) / GROUP_SIZE
    tl.store(pibar_ptr + row * stride_pib_row + head * stride_pib_head + pages, pib)


@triton.jit
def kernel_compaction_only(
    pibar_ptr,  # [rows, H_kv, pages] fp32
    page_list_ptr,  # [rows, H_kv, max_pages] int32 (out)
    seq_lens_ptr,  # [rows] int32
    tau,
    stride_pib_row,
    stride_pib_head,
    stride_pl_row,
    stride_pl_head,
    TILE_PAGES: tl.constexpr,
):
    # Select's pass 4: keep pages >= tau, cumsum for slots, scattered store.
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + row), 64)
    pages = tl.arange(0, TILE_PAGES)
    pib = tl.load(pibar_ptr + row * stride_pib_row + head * stride_pib_head + pages)
    keep = (pages < num_pages) & (pib >= tau)
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(page_list_ptr + row * stride_pl_row + head * stride_pl_head + slot, pages, mask=keep)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4x131072")
    parser.add_argument("--estimator", default=moira.MOIRA_DEFAULT_ESTIMATOR)
    parser.add_argument("--json")
    parser.add_argument("--once", action="store_true",
                        help="one Estimate + one default Select, then exit (for ncu)")  # fmt: skip
    args = parser.parse_args()
    batch, context = map(int, args.shape.split("x"))
    case = build_case(batch, context)
    if args.estimator != moira.MoiraConfig().estimator:
        from benchmarks.moira_correctness import estimator_case

        case = estimator_case(case, args.estimator)
    ws = workspace(case, moira.MoiraConfig.paper(gamma=0.98, estimator=args.estimator))
    hkv, group = ws.logmass.shape[1], ws.logmass.shape[2]
    max_pages = case["max_pages"]
    moira.estimate_page_logmass(case["query"], case["kv"], case["summaries"], case["table"],
                                case["seq"], ws.logmass, SCALE, args.estimator)  # fmt: skip
    torch.cuda.synchronize()
    if args.once:
        moira.select_pages(ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths,
                           ws.selector_params, batch, max_pages, ws.read_stats)  # fmt: skip
        torch.cuda.synchronize()
        return
    rows = {"shape": args.shape, "estimator": args.estimator, "gpu": torch.cuda.get_device_name()}
    rows["estimate_us"] = graph_time_us(
        lambda: moira.estimate_page_logmass(
            case["query"], case["kv"], case["summaries"], case["table"], case["seq"],
            ws.logmass, SCALE, args.estimator)
    )  # fmt: skip
    dummy = torch.zeros(1, device="cuda")
    rows["empty_kernel_us"] = graph_time_us(lambda: kernel_empty[(batch, hkv)](dummy))
    tile = min(triton.next_power_of_2(max(max_pages, 16)), 4096)

    def select(lanes, passes, warps):
        moira.kernel_moira_select[(batch, hkv)](
            ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths, ws.read_stats,
            ws.list_lengths,  # kept_total: unwritten (HAS_KEPT_TOTAL is False)
            ws.selector_params, ws.row_gamma,
            ws.logmass.stride(0), ws.logmass.stride(1), ws.logmass.stride(2),
            ws.pibar.stride(0), ws.pibar.stride(1), ws.page_list.stride(0),
            ws.page_list.stride(1), ws.list_lengths.stride(0),
            GROUP_SIZE=group, GROUP_ROWS=triton.next_power_of_2(group), TILE_PAGES=tile,
            NUM_TILES=1, SHORT_TILE_PAGES=256, LONG_LANES=lanes, LONG_LANE_PASSES=passes,
            PAGE_SIZE=64, HAS_ROW_GAMMA=True, num_warps=warps,
        )  # fmt: skip

    rows["select"] = []
    for lanes, passes in ((8, 8), (8, 4), (8, 1), (8, 0), (4, 12), (1, 24), (1, 0)):
        for warps in (4, 8, 16):
            us = graph_time_us(lambda: select(lanes, passes, warps))  # noqa: B023
            rows["select"].append({"lanes": lanes, "passes": passes, "warps": warps, "us": us})
            print("select", lanes, passes, warps, f"{us:.2f}", flush=True)
    for warps in (4, 8, 16):
        rows[f"softmax_only_w{warps}_us"] = graph_time_us(
            lambda: kernel_softmax_only[(batch, hkv)](
                ws.logmass, ws.pibar, case["seq"], ws.logmass.stride(0), ws.logmass.stride(1),
                ws.logmass.stride(2), ws.pibar.stride(0), ws.pibar.stride(1),
                GROUP_SIZE=group, GROUP_ROWS=triton.next_power_of_2(group), TILE_PAGES=tile,
                num_warps=warps)  # noqa: B023
        )  # fmt: skip
        rows[f"compaction_only_w{warps}_us"] = graph_time_us(
            lambda: kernel_compaction_only[(batch, hkv)](
                ws.pibar, ws.page_list, case["seq"], 1.0 / max_pages, ws.pibar.stride(0),
                ws.pibar.stride(1), ws.page_list.stride(0), ws.page_list.stride(1),
                TILE_PAGES=tile, num_warps=warps)  # noqa: B023
        )  # fmt: skip
    print(json.dumps({k: v for k, v in rows.items() if k != "select"}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
