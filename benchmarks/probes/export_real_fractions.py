# SPDX-License-Identifier: Apache-2.0
"""Kept fractions of a real model, for the kernel-spread benchmark's CV "real" rows.

Reads the estimator study (``benchmarks/probes/estimator_study.py`` output, real SmolLM2-135M
weights, needle prompts at 4k and 8k) and writes the mean kept fraction of every
(layer, KV head) for one estimator at gamma=0.98 as ``{"fractions": [...]}``, the
format ``bench_kernel_spread.py --real-fractions`` reads. These are means over the
study's decode steps and both contexts: they carry the spread across layers and KV
heads (paper Fig. 1a), not the extra spread across steps (recorded next to them as
``cv_across_steps_mean``).

    python benchmarks/probes/export_real_fractions.py --estimator mvar_top4 \\
        --out benchmarks/results/real_fractions_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEY = "kept_fraction_variation_gamma_0.98"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default="benchmarks/results/estimator_smollm2.json")
    ap.add_argument("--estimator", default="mvar_top4")
    ap.add_argument("--out", default="benchmarks/results/real_fractions_smollm2.json")
    args = ap.parse_args()
    study = json.loads(Path(args.study).read_text())
    variation = study[KEY]
    if args.estimator not in variation:
        raise SystemExit(f"--estimator must be one of {sorted(variation)}, got {args.estimator!r}")
    entry = variation[args.estimator]
    fractions = [float(x) for layer in entry["kept_per_layer_head"] for x in layer]
    fractions = [min(1.0, max(x, 1e-4)) for x in fractions]  # (0, 1] for the benchmark
    mean = statistics.fmean(fractions)
    out = {
        "command": "python benchmarks/probes/export_real_fractions.py "
        f"--study {args.study} --estimator {args.estimator} --out {args.out}",
        "source": f"{args.study} ({study.get('model', 'SmolLM2-135M-Instruct')}), {KEY}",
        "estimator": args.estimator,
        "gamma": 0.98,
        "layers": len(entry["kept_per_layer_head"]),
        "kv_heads": len(entry["kept_per_layer_head"][0]),
        "mean": mean,
        "cv": statistics.pstdev(fractions) / mean,
        "cv_across_steps_mean": entry.get("cv_across_steps_mean"),
        "fractions": fractions,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: {len(fractions)} fractions, mean {mean:.3f}, cv {out['cv']:.3f}")


if __name__ == "__main__":
    main()
