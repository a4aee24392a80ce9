# SPDX-License-Identifier: Apache-2.0
"""Regenerate the benchmark figures (PNG) from the JSONs in benchmarks/results.

CPU only (matplotlib, Agg backend). Inputs that are missing are skipped with a
message; every figure that can be drawn is written:

  tpot_prmt_h200.json + tpot_qwen_h200.json -> docs/img/tpot_speedup.png
                     (dense / Moira TPOT by shape, Llama-3.1-8B and Qwen3-4B)
  tpot_b1_fa3steps_h200.json -> docs/img/tpot_batch1.png (batch 1 TPOT vs context)
  tpot_h200.json     -> docs/img/step_breakdown.png (ms per step by kernel)
  kernels_h200.json  -> docs/img/kernel_spread.png  (attention us/layer vs CV, per arm)
  serving_h200.json (set A) + serving_setB*_h200.json (set B)
                     -> docs/img/serving_throughput.png (output tok/s vs concurrency,
                        one panel per prompt set)

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

#: The latest TPOT run at the five shapes (docs/benchmarks.md, "TPOT").
TPOT_LATEST = "tpot_prmt_h200.json"
#: Qwen3-4B at the five shapes (each shape's pair from one call; tpot_qwen_now + tpot_qwen_mid).
TPOT_QWEN_LATEST = "tpot_qwen_h200.json"
#: The latest TPOT run with batch 1 (docs/benchmarks.md, "Batch 1 TPOT").
TPOT_BATCH1_LATEST = "tpot_b1_fa3steps_h200.json"
#: Legend of the kernel-spread arms (bench_kernel_spread.py methods).
KERNEL_METHOD_LABELS = {"moira_pages": "moira (pages, backend default)",
                        "moira": "moira (lists, Alg. 2)"}  # fmt: skip
#: Serving runs joined into one figure: set A (two waves, concurrency 1 and 16)
#: and set B (one wave each, concurrency 8, then 1).
SERVING_INPUTS = ("serving_h200.json", "serving_setB_h200.json", "serving_setB_c1_h200.json")
BREAKDOWN_PARTS = ("estimate", "select", "attend", "merge", "summaries", "fa3", "gemm", "rest")
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
    # fraction, written on the bar), one per coverage gamma.
    return "fixed count" if r.get("selector") == "fixed" else _arm_label(r)


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


def plot_tpot_batch1(data: dict, out: Path) -> Path | None:
    rows = [r for r in data.get("rows", []) if r.get("batch") == 1 and r.get("tpot_ms")]
    if not rows:
        print("skip: no batch-1 TPOT rows", flush=True)
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["model"], _arm_label(r)) for r in rows}):
        pts = sorted((r["context"], r["tpot_ms"]) for r in rows
                     if (r["model"], _arm_label(r)) == key)  # fmt: skip
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens), batch 1")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("Batch 1: Moira vs dense")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_breakdown(data: dict, out: Path) -> Path | None:
    entries = [b for b in data.get("breakdown") or [] if "kernels_total_ms" in b]
    if not entries:
        print("skip: no per-kernel breakdown", flush=True)
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(entries) + 2), 4))
    labels = [f"{b.get('model', '?')}\n{b.get('backend', '')} {_shape(b)}" for b in entries]
    bottom = [0.0] * len(entries)
    for part in BREAKDOWN_PARTS:
        vals = [float(b.get(f"{part}_ms", 0.0)) for b in entries]
        if any(vals):
            ax.bar(range(len(entries)), vals, 0.6, bottom=bottom, label=part)
            bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GPU kernel time per decode step (ms)")
    ax.set_title("One decode step by kernel (torch.profiler)")
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


def _first(r: dict, *keys):
    for k in keys:
        if r.get(k) is not None:
            return r[k]
    return None


def plot_serving(data: dict, out: Path) -> Path | None:
    rows = []
    for r in data.get("rows", []):
        c = _first(r, "concurrency", "max_concurrency", "c")
        tps = _first(r, "output_tok_s", "output_throughput", "output_tokens_per_s")
        arm = _first(r, "arm", "backend", "method")
        if c is not None and tps is not None and arm is not None:
            rows.append((str(r.get("model", "")), str(r.get("set", "")), str(arm), c, tps))
    if not rows:
        print("skip: serving JSON has no (concurrency, output tok/s, arm) rows", flush=True)
        return None
    plt = _plt()
    panels = sorted({(m, s) for m, s, *_ in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (model, set_) in zip(axes[0], panels):
        for arm in sorted({r[2] for r in rows if r[:2] == (model, set_)}):
            pts = sorted((r[3], r[4]) for r in rows if r[:3] == (model, set_, arm))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
        ax.set_xlabel("concurrency")
        ax.set_title(f"{model} {('set ' + set_) if set_ else ''}".strip())
    axes[0][0].set_ylabel("output tok/s")
    axes[0][-1].legend(fontsize=7)
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
    # The speedup figure from the latest five-shape run (the default estimator
    # of its day), batch 1 from the latest run with it; the per-kernel windows
    # from tpot_h200.json.
    latest = _load(results / TPOT_LATEST) or _load(results / "tpot_h200.json")
    qwen = _load(results / TPOT_QWEN_LATEST)
    if latest or qwen:
        written.append(plot_tpot_speedup(join_tpot(latest, qwen), img / "tpot_speedup.png"))
    batch1 = (_load(results / TPOT_BATCH1_LATEST) or _load(results / "tpot_pdl_h200.json")
              or _load(results / "tpot_h200.json"))  # fmt: skip
    if batch1:
        written.append(plot_tpot_batch1(batch1, img / "tpot_batch1.png"))
    tpot = _load(results / "tpot_h200.json")
    if tpot:
        written.append(plot_breakdown(tpot, img / "step_breakdown.png"))
    kernels = _load(results / "kernels_h200.json")
    if kernels:
        written.append(plot_kernel_spread(kernels, img / "kernel_spread.png"))
    serving = [data for data in map(_load, (results / n for n in SERVING_INPUTS)) if data]
    if serving:
        joined = {"rows": [row for data in serving for row in data.get("rows", [])]}
        written.append(plot_serving(joined, img / "serving_throughput.png"))
    for path in written:
        if path:
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
