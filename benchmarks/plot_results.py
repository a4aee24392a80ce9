# SPDX-License-Identifier: Apache-2.0
"""Regenerate the figures of docs/results.md (PNG) from the records in benchmarks/results.

CPU only (matplotlib, Agg backend). Records that are missing are skipped with a message;
every figure that can be drawn is written:

  tpot/tpot_kv_dtypes_h200.json, tpot/tpot_mid_final_h200.json, tpot/tpot_qwen_now_h200.json
      -> docs/img/tpot_speedup.png (dense / Moira TPOT by shape, model and KV cache dtype)
  kernel_spread/kernels_h200.json
      -> docs/img/kernel_spread.png (attention µs per layer vs CV, per method)

    python benchmarks/plot_results.py [--results benchmarks/results] [--img docs/img]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_tpot import speedup_rows  # noqa: E402  (pure helpers, no GPU)

#: The records each figure reads, relative to --results (benchmarks/results/README.md).
TPOT_RECORDS = (
    "tpot/tpot_kv_dtypes_h200.json",
    "tpot/tpot_mid_final_h200.json",
    "tpot/tpot_qwen_now_h200.json",
)
KERNELS_RECORD = "kernel_spread/kernels_h200.json"
#: Legend of the kernel-spread arms (bench_kernel_spread.py methods).
KERNEL_METHOD_LABELS = {"moira_pages": "moira (pages, backend default)",
                        "moira": "moira (lists, Alg. 2)"}  # fmt: skip
CV_ORDER = {"0": 0, "0.0": 0, "0.5": 1, "1": 2, "1.0": 2, "1.2": 3, "real": 4}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(path: Path) -> dict | None:
    if not path.exists():
        print(f"skip: {path} not found", flush=True)
        return None
    return json.loads(path.read_text())


def _shape(r: dict) -> str:
    context = r["context"]
    k = context // 1024 if context < 100_000 else context // 1000
    return f"{k}k×{r['batch']}"


def _arm_label(r: dict) -> str:
    if r.get("selector") == "fixed":
        return f"fixed {r.get('fixed_fraction')}"
    if r.get("selector") == "coverage":
        return f"γ={r.get('gamma')}"
    return "dense"


def _speedup_series(r: dict) -> str:
    # One bar series for the fixed-count arms (each shape at its own read
    # fraction, written on the bar), one per coverage gamma; fp8 KV cache pairs
    # (MOIRA fp8 over dense fp8) are their own series.
    series = "fixed count" if r.get("selector") == "fixed" else _arm_label(r)
    return f"{series}, fp8 KV" if r.get("kv_cache_dtype") == "fp8" else series


def join_tpot(*records: dict | None) -> dict:
    """Rows and speedups of several TPOT records (each speedup computed within
    its own record, i.e. from arms measured in the same run)."""
    rows: list[dict] = []
    speedups: list[dict] = []
    for record in records:
        if not record:
            continue
        own = record.get("rows", [])
        rows += own
        speedups += record.get("speedups") or speedup_rows(own)
    return {"rows": rows, "speedups": speedups}


def plot_tpot_speedup(data: dict, out: Path) -> Path | None:
    rows = [r for r in data.get("rows", []) if r.get("batch", 0) > 1]
    speedups = [s for s in (data.get("speedups") or speedup_rows(rows)) if s["batch"] > 1]
    if not speedups:
        print("skip: no dense/Moira TPOT pairs at batch > 1", flush=True)
        return None
    plt = _plt()
    shapes = sorted({(s["context"], s["batch"]) for s in speedups})
    series = sorted({(s["model"], _speedup_series(s)) for s in speedups})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes) + 2), 4))
    width = 0.8 / max(len(series), 1)
    for i, (model, arm) in enumerate(series):
        xs, ys, reads = [], [], []
        for j, (c, b) in enumerate(shapes):
            hit = [s for s in speedups if (s["context"], s["batch"], s["model"]) == (c, b, model)
                   and _speedup_series(s) == arm]  # fmt: skip
            if hit:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(hit[0]["speedup"])
                reads.append(hit[0].get("reads"))
        bars = ax.bar(xs, ys, width, label=f"{model} {arm}")
        for bar, rd in zip(bars, reads):
            if rd is not None:
                ax.annotate(f"{rd:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([_shape({"context": c, "batch": b}) for c, b in shapes])
    ax.set_ylabel("TPOT dense / Moira (×)")
    ax.set_title("Decode TPOT speedup over dense FA3 (labels: page reads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_kernel_spread(data: dict, out: Path) -> Path | None:
    rows = [r for r in data.get("rows", []) if r.get("us_per_layer")]
    if not rows:
        print("skip: no kernel rows with us_per_layer", flush=True)
        return None
    plt = _plt()
    shapes = sorted({(r["context"], r["batch"]) for r in rows if "context" in r})
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.4 * len(shapes), 3.4), squeeze=False)
    for ax, (c, b) in zip(axes[0], shapes):
        here = [r for r in rows if (r.get("context"), r.get("batch")) == (c, b)]
        cvs = sorted({str(r["cv"]) for r in here if r["cv"] is not None},
                     key=lambda v: CV_ORDER.get(v, 9))  # fmt: skip
        for method in ("moira_pages", "moira", "fa3_varlen", "pad", "pow2"):
            pts = {str(r["cv"]): r["us_per_layer"] for r in here if r["method"] == method}
            xs = [i for i, cv in enumerate(cvs) if cv in pts]
            if xs:
                ax.plot(xs, [pts[cvs[i]] for i in xs], marker="o",
                        label=KERNEL_METHOD_LABELS.get(method, method))  # fmt: skip
        dense = [r["us_per_layer"] for r in here if r["method"] == "dense_fa3"]
        if dense:
            ax.axhline(dense[0], color="gray", ls="--", lw=1, label="dense FA3")
        ax.set_xticks(range(len(cvs)))
        ax.set_xticklabels(cvs)
        ax.set_xlabel("CV of list lengths")
        ax.set_title(_shape({"context": c, "batch": b}))
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("µs per layer")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Attention time vs spread of per-head list lengths (22% kept)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--img", default=str(ROOT / "docs" / "img"))
    a = ap.parse_args(argv)
    try:
        _plt()
    except ImportError:
        print("matplotlib is not installed: nothing plotted (pip install matplotlib)")
        return 1
    results, img = Path(a.results), Path(a.img)
    img.mkdir(parents=True, exist_ok=True)
    written = []
    tpot = [_load(results / name) for name in TPOT_RECORDS]
    if any(tpot):
        written.append(plot_tpot_speedup(join_tpot(*tpot), img / "tpot_speedup.png"))
    kernels = _load(results / KERNELS_RECORD)
    if kernels:
        written.append(plot_kernel_spread(kernels, img / "kernel_spread.png"))
    for path in written:
        if path:
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
