# SPDX-License-Identifier: Apache-2.0
"""Run Estimate and Select once each inside a CUDA profiler range, for Nsight
Compute (hardware counters: where the kernels stall). Not a benchmark: the
times come from moira_correctness.py; this only gives ncu one launch of each
kernel per estimator, after a warm-up outside the range. ``--attend F`` also
runs Attend + Merge once on fixed-count lists of F of the pages (as
moira_correctness.py times them).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section MemoryWorkloadAnalysis --section SchedulerStats \\
        python benchmarks/probes/ncu_estimate_select.py --shape 4x131072 \\
        --estimators int8:mvar_top8,int8:mvar
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.moira_correctness import (
    SCALE,
    build_case,
    estimator_case,
    moira,
    split_summary_dtype,
    workspace,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4x131072", help="BATCHxCONTEXT")
    parser.add_argument("--estimators", default="int8:mvar_top8,int8:mvar")
    parser.add_argument(
        "--attend", type=float, default=0.0, metavar="F",
        help="also profile Attend + Merge on fixed-count lists of this fraction of the pages",
    )  # fmt: skip
    args = parser.parse_args()
    if not 0.0 <= args.attend <= 1.0:
        parser.error(f"--attend must be a fraction in [0, 1], got {args.attend}")
    batch, context = map(int, args.shape.split("x"))
    case = build_case(batch, context)
    runs = []
    for name in args.estimators.split(","):
        case_e = estimator_case(case, name)
        estimator, summary_dtype = split_summary_dtype(name)
        ws = workspace(
            case_e, moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
        )
        inputs = (
            case_e["query"],
            case_e["kv"],
            case_e["summaries"],
            case_e["table"],
            case_e["seq"],
        )

        def estimate(inputs=inputs, ws=ws, estimator=estimator):
            moira.estimate_page_logmass(*inputs, ws.logmass, SCALE, estimator)

        def select(ws=ws):
            moira.select_pages(
                ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths,
                ws.selector_params, batch, case["max_pages"], ws.read_stats,
            )  # fmt: skip

        for _ in range(3):  # compile and warm up outside the profiled range
            estimate()
            select()
        runs.append((name, estimate, select))
    attend = None
    if args.attend > 0.0:
        fixed = moira.MoiraConfig.paper(
            selector="fixed", fixed_pages=max(2, round(args.attend * case["max_pages"]))
        )
        ws_fixed = workspace(case, fixed)
        inputs = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])
        moira.estimate_and_select(*inputs, ws_fixed, SCALE)
        out = torch.empty_like(case["query"])

        def attend(ws=ws_fixed, out=out):
            moira.attend(
                case["query"], case["kv"], case["table"], case["seq"], ws.page_list,
                ws.list_lengths, out, ws, SCALE,
            )  # fmt: skip

        for _ in range(3):
            attend()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, estimate, select in runs:
        print("profiling", name, flush=True)
        estimate()
        select()
    if attend is not None:
        print("profiling attend", args.attend, flush=True)
        attend()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
