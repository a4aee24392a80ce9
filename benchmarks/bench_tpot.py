# SPDX-License-Identifier: Apache-2.0
"""Decode TPOT in vLLM 0.30: dense FA3 vs Moira (paper Tables 3, 4 and 7 protocol).

One engine per invocation (one model, one backend; the engine core in its own
process, as vLLM runs it by default), dummy weights,
token-id prompts, block_size 64, prefix caching off, torch.compile mode 3 with
FULL_AND_PIECEWISE CUDA graphs, chunked prefill (16384 tokens per step). For
each shape (context x batch) one batch of random prompts is submitted and the
engine is stepped by hand. A "full decode step" is one in which every request
got one token and none got its first (no prefill rows). TPOT = median interval
between consecutive full decode steps.

Arms. FLASH_ATTN: one arm, "dense". MOIRA: per shape, the coverage rule at each
--gammas value, then the fixed-count selector at the paper's gamma=0.98 read
fraction for the shape (--fixed-fractions; batch 1: 0.3). All arms of a shape
run on the same batch, one after another, in windows of full decode steps:
the selector is switched in place on the live workspaces
(MoiraWorkspace.set_selector, picked up by the captured graphs), --settle
steps are dropped, then --gen steps are timed. reads = pages kept / pages in
the rows, from MoiraWorkspace.read_stats zeroed at the start of the timed
window and read at its end (so prefill and mixed steps never count). The
context grows by the tokens of earlier windows (<= 2% at 8k).

--breakdown CONTEXTxBATCH adds a window at that shape (first arm's setting)
profiled with torch.profiler in the engine process (benchmarks/engine_profile.py;
CUDA activity, kernels inside the graphs): time
per step by kernel (Moira estimate/select/attend/merge/summaries, GEMM, FA3,
rest; kernels_busy_ms: the union of the kernels' intervals, in case dependent
launches overlap them; attention_busy_ms / attention_wall_ms: the attention
layers' kernels alone, and their runs with the idle gaps around them), written
under "breakdown". --batch1 adds contexts 2k..64k at batch 1.

    source /opt/vllm030/env.sh
    python benchmarks/bench_tpot.py --model shared/gpu/models/Llama-3.1-8B --backend MOIRA \\
        --batch1 --breakdown 130048x4 --out benchmarks/results/tpot_llama_moira.json
    python benchmarks/bench_tpot.py --model shared/gpu/models/Llama-3.1-8B --backend FLASH_ATTN \\
        --batch1 --breakdown 130048x4 --out benchmarks/results/tpot_llama_dense.json
    python benchmarks/bench_tpot.py --merge benchmarks/results/tpot_llama_*.json \\
        --out benchmarks/results/tpot_h200.json

--kv-cache-dtype fp8 runs the engine on vLLM's fp8 KV cache (e4m3, per-layer
K/V scales; FA3's fp8 path for FLASH_ATTN, and for MOIRA's prefill rows). Its
rows carry kv_cache_dtype; --merge pairs each Moira row with the dense row of
its shape and KV dtype ("speedup") and, for fp8, also with the dense bf16 row
("speedup_vs_dense_bf16"). Dense and Moira, bf16 and fp8, side by side:

    for kv in auto fp8; do for backend in FLASH_ATTN MOIRA; do
        python benchmarks/bench_tpot.py --model shared/gpu/models/Llama-3.1-8B \
            --backend $backend --kv-cache-dtype $kv --quick \
            --out benchmarks/results/tpot_kv_${kv}_${backend}.json
    done; done
    python benchmarks/bench_tpot.py --merge benchmarks/results/tpot_kv_*.json \
        --out benchmarks/results/tpot_fp8_kv_h200.json

--merge also accepts shared/gpu/bench_dense_tpot.py JSON files (dense rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import engine_profile
from benchmarks.bench_kernel_spread import parse_shapes

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SHAPES = "8192x32,16384x32,32768x16,65536x8,130048x4"
QUICK_SHAPES = "130048x4,8192x32"
BATCH1_SHAPES = "2048x1,4096x1,8192x1,16384x1,32768x1,65536x1"
BATCH1_FIXED_FRACTION = 0.3
#: Paper Table 3 page reads of gamma=0.98, used as the fixed-count fraction.
PAPER_FIXED_FRACTIONS = {
    "llama": {(8192, 32): 0.42, (16384, 32): 0.37, (32768, 16): 0.31, (65536, 8): 0.16,
              (130048, 4): 0.15},
    "qwen": {(8192, 32): 0.49, (16384, 32): 0.43, (32768, 16): 0.39, (65536, 8): 0.25,
             (130048, 4): 0.21},
}  # fmt: skip
MOIRA_KERNELS = {
    "kernel_moira_estimate": "estimate",
    "kernel_moira_select": "select",
    "kernel_moira_attend": "attend",
    "kernel_moira_merge": "merge",
    "kernel_moira_write_summaries": "summaries",
}
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")
FA3_MARKERS = ("flash", "fmha", "flashattn")


# --------------------------------------------------------------------------
# Pure helpers (CPU; unit-tested in tests/benchmarks/)
# --------------------------------------------------------------------------
def model_family(model: str) -> str | None:
    name = os.path.basename(os.path.normpath(model)).lower()
    for family in PAPER_FIXED_FRACTIONS:
        if family in name:
            return family
    return None


def parse_fraction_overrides(text: str | None) -> dict[tuple[int, int], float]:
    """'8192x32=0.4,130048x4=0.15' -> {(8192, 32): 0.4, (130048, 4): 0.15}."""
    out = {}
    for item in (text or "").split(","):
        if item.strip():
            shape, value = item.split("=")
            ((context, batch),) = parse_shapes(shape)
            out[(context, batch)] = float(value)
    return out


def fixed_fraction_for(family, context, batch, overrides=None) -> float | None:
    if overrides and (context, batch) in overrides:
        return overrides[(context, batch)]
    if batch == 1:
        return BATCH1_FIXED_FRACTION
    return PAPER_FIXED_FRACTIONS.get(family or "", {}).get((context, batch))


def plan_arms(backend, family, context, batch, gammas, overrides=None) -> list[dict]:
    """The arms of one shape: dense, or Moira coverage per gamma + fixed."""
    if backend not in MOIRA_BACKENDS:
        return [{"arm": "dense", "selector": None, "gamma": None, "fixed_fraction": None}]
    arms = [{"arm": "moira", "selector": "coverage", "gamma": g, "fixed_fraction": None}
            for g in gammas]  # fmt: skip
    fraction = fixed_fraction_for(family, context, batch, overrides)
    if fraction is not None:
        arms.append(
            {"arm": "moira", "selector": "fixed", "gamma": None, "fixed_fraction": fraction}
        )
    return arms


def interval_stats(full_steps: list[tuple[int, float]]) -> dict:
    """TPOT statistics from (global step number, end time) of full decode
    steps; only intervals between consecutive step numbers count."""
    iv = sorted(b[1] - a[1] for a, b in zip(full_steps, full_steps[1:]) if b[0] == a[0] + 1)
    if not iv:
        return {"tpot_ms": None, "steps": 0, "p10_ms": None, "p90_ms": None, "mean_ms": None}
    return {
        "tpot_ms": 1e3 * statistics.median(iv),
        "steps": len(iv),
        "p10_ms": 1e3 * iv[len(iv) // 10],
        "p90_ms": 1e3 * iv[(9 * len(iv)) // 10],
        "mean_ms": 1e3 * statistics.fmean(iv),
    }


def max_tokens_for(context, batch, windows, max_num_batched_tokens) -> int:
    """Tokens per request: steps until the last prefill (upper bound) + the
    full decode steps of every window + slack."""
    prefill_steps = math.ceil(context * batch / max_num_batched_tokens) + batch + 4
    return prefill_steps + sum(w["settle"] + w["measure"] for w in windows) + 8


def classify_kernel(name: str) -> str:
    for key, cat in MOIRA_KERNELS.items():
        if key in name:
            return cat
    low = name.lower()
    if any(m in low for m in FA3_MARKERS):
        return "fa3"
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    return "rest"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us): GPU time with at
    least one kernel running, overlapping kernels counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


#: Kernel categories of the attention layers (with vLLM's KV scatter): the
#: part of a step where the two backends differ.
ATTENTION_CATEGORIES = frozenset(MOIRA_KERNELS.values()) | {"fa3"}


def is_attention_kernel(name: str) -> bool:
    return classify_kernel(name) in ATTENTION_CATEGORIES or "reshape_and_cache" in name


def attention_wall_us(events: list[tuple]) -> float:
    """Wall time of the attention layers (us): for every run of consecutive
    attention kernels (by start time), from the end of the kernel before it
    to the start of the kernel after it, so the idle gaps around and inside
    the run (launches waiting on the previous kernel) count with it. Events
    are (name, duration us, start us)."""
    order = sorted(events, key=lambda e: e[2])
    total, i = 0.0, 0
    reach = None  # latest end among the kernels before order[i]
    while i < len(order):
        name, us, start = order[i][:3]
        if not is_attention_kernel(name):
            reach = start + us if reach is None else max(reach, start + us)
            i += 1
            continue
        run_end, j = start, i
        while j < len(order) and is_attention_kernel(order[j][0]):
            run_end = max(run_end, order[j][2] + order[j][1])
            j += 1
        before = start if reach is None else reach
        total += (order[j][2] if j < len(order) else run_end) - before
        reach = run_end if reach is None else max(reach, run_end)
        i = j
    return total


def summarize_kernels(events: list[tuple], steps: float) -> dict:
    """[(kernel name, us[, start us])] -> ms per step by category (+ total, top
    kernels). With start times also kernels_busy_ms, the union of the kernels'
    intervals: under dependent launches (Moira's decode kernels) a kernel's
    blocks start while the previous kernel finishes, so durations overlap and
    their sum overstates the GPU time."""
    cats: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for name, us, *_ in events:
        cat = classify_kernel(name)
        cats[cat] = cats.get(cat, 0.0) + us
        by_name[name] = by_name.get(name, 0.0) + us
    steps = max(steps, 1e-9)
    out = {f"{c}_ms": v / 1e3 / steps for c, v in sorted(cats.items())}
    out["kernels_total_ms"] = sum(cats.values()) / 1e3 / steps
    if events and all(len(e) >= 3 for e in events):
        out["kernels_busy_ms"] = busy_us([(e[2], e[2] + e[1]) for e in events]) / 1e3 / steps
        attention = [(e[2], e[2] + e[1]) for e in events if is_attention_kernel(e[0])]
        out["attention_busy_ms"] = busy_us(attention) / 1e3 / steps
        out["attention_wall_ms"] = attention_wall_us(events) / 1e3 / steps
    if "estimate" in cats or "select" in cats:
        out["estimate_select_ms"] = (cats.get("estimate", 0) + cats.get("select", 0)) / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    out["top_kernels_ms"] = {n[:120]: v / 1e3 / steps for n, v in top}
    return out


#: Stages whose bytes per layer follow from the shape: Estimate reads every page's
#: summary, Attend the kept pages' keys and values, FA3 every page's.
BYTE_STAGES = ("estimate", "attend", "fa3")


def stage_rates(
    breakdown: dict,
    geometry: dict,
    context: int,
    batch: int,
    reads: float | None,
    copy_gbps: float | None,
) -> dict:
    """Per-layer time of each stage of one profiled window (µs), and for the stages
    whose bytes follow from the shape, their bytes per layer, GB/s and that rate as a
    share of the device copy rate measured in the same run. ``geometry``: num_layers,
    num_kv_heads, head_size, kv_element_bytes, summary_page_bytes (one page, all KV
    heads). The other stages get their time only."""  # fmt: skip
    layers = geometry["num_layers"]
    pages = batch * math.ceil(context / 64)
    page_kv_bytes = 64 * geometry["num_kv_heads"] * geometry["head_size"] * 2 * \
        geometry["kv_element_bytes"]  # fmt: skip
    stage_bytes = {
        "estimate": pages * geometry["summary_page_bytes"],
        "attend": (reads or 0.0) * pages * page_kv_bytes,
        "fa3": pages * page_kv_bytes,
    }
    out: dict = {"us_per_layer": {}, "bytes_per_layer": {}, "gbps": {}, "of_copy_rate": {}}
    for key, ms in breakdown.items():
        if not key.endswith("_ms") or not isinstance(ms, (int, float)):
            continue
        stage = key[: -len("_ms")]
        if stage not in set(MOIRA_KERNELS.values()) | {"fa3"}:
            continue
        us = 1e3 * ms / layers
        out["us_per_layer"][stage] = us
        if stage in BYTE_STAGES and us > 0 and stage_bytes[stage] > 0:
            out["bytes_per_layer"][stage] = stage_bytes[stage]
            out["gbps"][stage] = stage_bytes[stage] / us / 1e3
            if copy_gbps:
                out["of_copy_rate"][stage] = out["gbps"][stage] / copy_gbps
    out["copy_gbps"] = copy_gbps
    return out


def model_geometry(cfg: dict, kv_cache_dtype: str, backend: str) -> dict:
    """What stage_rates needs from the model's config.json and the engine's options."""
    heads = int(cfg["num_attention_heads"])
    head_size = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    summary_page_bytes = 0
    if backend in MOIRA_BACKENDS:
        moira = moira_module(backend)
        config = moira.moira_config_from_env()
        dtype, rows = moira.summary_storage(config.summary_slots, config.summary_dtype)
        summary_page_bytes = kv_heads * rows * head_size * dtype.itemsize
    return {"num_layers": int(cfg["num_hidden_layers"]), "num_kv_heads": kv_heads,
            "head_size": head_size, "kv_element_bytes": 1 if kv_cache_dtype == "fp8" else 2,
            "summary_page_bytes": summary_page_bytes}  # fmt: skip


def device_copy_gbps(torch, nbytes: int = 1 << 28, repeats: int = 20) -> float:
    """Device-to-device copy rate in GB/s, bytes read plus bytes written: the
    bandwidth a memory-bound stage can reach on this GPU, measured in this run."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds / 1e9


TPOT_ROW_KEYS = ("model", "batch", "context", "arm", "selector", "gamma", "reads", "tpot_ms",
                 "steps", "p10_ms", "p90_ms")  # fmt: skip


def validate_tpot_row(row: dict) -> None:
    missing = [k for k in TPOT_ROW_KEYS if k not in row]
    if missing:
        raise ValueError(f"row {row!r}: missing {missing}")
    if row["arm"] not in ("dense", "moira"):
        raise ValueError(f"row {row!r}: arm must be 'dense' or 'moira'")
    if row["arm"] == "moira" and row["selector"] not in ("coverage", "fixed"):
        raise ValueError(f"row {row!r}: moira rows need selector 'coverage' or 'fixed'")
    if row["arm"] == "dense" and (row["selector"] is not None or row["reads"] is not None):
        raise ValueError(f"row {row!r}: dense rows have selector and reads null")
    if not isinstance(row["batch"], int) or not isinstance(row["context"], int):
        raise ValueError(f"row {row!r}: batch and context must be int")
    if row["tpot_ms"] is not None and not row["tpot_ms"] > 0:
        raise ValueError(f"row {row!r}: tpot_ms must be > 0 or null")
    if row["reads"] is not None and not 0 < row["reads"] <= 1:
        raise ValueError(f"row {row!r}: reads must be in (0, 1] or null")


#: Moira's backend names: MOIRA on the patched build, CUSTOM in plugin mode on stock vLLM.
MOIRA_BACKENDS = ("MOIRA", "CUSTOM")
#: The logits processor that plugin mode requires (it refuses per-request moira_gamma).
REQUEST_GUARD = "vllm_moira.request_guard:MoiraRequestGuard"


def moira_module(backend: str):
    """The backend module the engine runs: the copy inside vLLM on the patched build, the
    installed package in plugin mode (the class the plugin registers)."""
    if backend == "CUSTOM":
        from vllm_moira.v1.attention.backends import moira
    else:
        from vllm.v1.attention.backends import moira
    return moira


#: MoiraConfig fields fixed per engine that every MOIRA row names.
ENGINE_FIELDS = ("estimator", "summary_dtype", "audit_every", "mode")


def engine_fields(moira_config: dict | None, backend: str = "MOIRA") -> dict:
    """The row fields of one MOIRA engine's configuration: ENGINE_FIELDS (``mode``:
    "plugin" for CUSTOM), whether every field but γ is the backend's default
    (``is_default``), and that default γ."""
    if not moira_config:
        return {}
    default = dataclasses.asdict(moira_module(backend).MoiraConfig())
    same = all(moira_config.get(k) == v for k, v in default.items() if k != "gamma")
    return {**{k: moira_config.get(k) for k in ENGINE_FIELDS if k != "mode"},
            **({"mode": "plugin"} if backend == "CUSTOM" else {}),
            "is_default": same, "default_gamma": default["gamma"]}  # fmt: skip


def _moira_config_record(backend: str) -> dict | None:
    """The backend's MoiraConfig as the engine will build it from MOIRA_*
    (defaults included, e.g. the Attend schedule), for the record."""
    try:
        moira = moira_module(backend)
    except ImportError:  # neither built into this vLLM nor installed
        return None
    return dataclasses.asdict(moira.moira_config_from_env())


def rows_from_file(data: dict) -> tuple[list[dict], dict]:
    """Rows of one input of --merge: this script's JSON, or a dense JSON of
    shared/gpu/bench_dense_tpot.py ({"info", "results"})."""
    if "rows" in data:
        return list(data["rows"]), data
    info = data.get("info", {})
    rows = []
    for r in data.get("results", []):
        if "tpot_ms_median" not in r:
            continue
        rows.append({
            "model": info.get("model"), "batch": int(r["batch"]), "context": int(r["ctx"]),
            "kv_cache_dtype": "auto",
            "arm": "dense", "selector": None, "gamma": None, "reads": None,
            "tpot_ms": r["tpot_ms_median"], "steps": r.get("full_decode_steps"),
            "p10_ms": r.get("tpot_ms_p10"), "p90_ms": r.get("tpot_ms_p90"),
            "mean_ms": r.get("tpot_ms_mean"), "gen": r.get("gen"),
            "source": "shared/gpu/bench_dense_tpot.py",
        })  # fmt: skip
    return rows, {"command": "shared/gpu/bench_dense_tpot.py " + json.dumps(info.get("args", {})),
                  "gpu": info.get("gpu")}  # fmt: skip


def speedup_rows(rows: list[dict]) -> list[dict]:
    """dense / moira TPOT for every Moira row with a dense row of its shape and
    KV cache dtype (the first dense row found for a (model, batch, context,
    kv_cache_dtype); rows without the field are bf16, "auto"). An fp8 Moira
    row also gets ``speedup_vs_dense_bf16``, against the dense bf16 row."""

    def key(r, kv_cache_dtype=None):
        return (r["model"], r["batch"], r["context"],
                kv_cache_dtype or r.get("kv_cache_dtype", "auto"))  # fmt: skip

    dense = {}
    for r in rows:
        if r["arm"] == "dense" and r.get("tpot_ms"):
            dense.setdefault(key(r), r)
    out = []
    for r in rows:
        d = dense.get(key(r))
        if r["arm"] == "moira" and d and r.get("tpot_ms"):
            row = {
                "model": r["model"], "batch": r["batch"], "context": r["context"],
                "kv_cache_dtype": r.get("kv_cache_dtype", "auto"),
                "selector": r["selector"], "gamma": r["gamma"],
                "fixed_fraction": r.get("fixed_fraction"), "reads": r["reads"],
                "dense_ms": d["tpot_ms"], "moira_ms": r["tpot_ms"],
                "speedup": d["tpot_ms"] / r["tpot_ms"],
                **({"attend_launch": r["attend_launch"]} if r.get("attend_launch") else {}),
                **{k: r[k] for k in (*ENGINE_FIELDS, "config") if r.get(k)},
                # 0 (the audit off) is a setting too.
                **({"audit_every": r["audit_every"]} if "audit_every" in r else {}),
            }  # fmt: skip
            d_bf16 = dense.get(key(r, "auto"))
            if row["kv_cache_dtype"] != "auto" and d_bf16:
                row["dense_bf16_ms"] = d_bf16["tpot_ms"]
                row["speedup_vs_dense_bf16"] = d_bf16["tpot_ms"] / r["tpot_ms"]
            out.append(row)
    return out


def merge(paths: list[str], out: str) -> dict:
    rows, sources, breakdown, gpus = [], [], [], set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        got, meta = rows_from_file(data)
        rows += got
        sources.append({"file": path, "command": meta.get("command"), "rows": len(got)})
        if meta.get("gpu"):
            gpus.add(meta["gpu"])
        if data.get("breakdown"):
            for b in (
                data["breakdown"] if isinstance(data["breakdown"], list) else [data["breakdown"]]
            ):
                breakdown.append(b)
    greedy = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("greedy"):
            greedy[(data.get("backend"), data.get("kv_cache_dtype", "auto"))] = data["greedy"]
    record = {
        "command": "python benchmarks/bench_tpot.py --merge " + " ".join(paths) + f" --out {out}",
        "gpu": ", ".join(sorted(gpus)),
        "sources": sources,
        "rows": rows,
        "speedups": speedup_rows(rows),
        "breakdown": breakdown,
    }
    for kv_cache_dtype in sorted({kv for _, kv in greedy}):
        pair = greedy.get(("FLASH_ATTN", kv_cache_dtype)), greedy.get(("MOIRA", kv_cache_dtype))
        if pair[0] and pair[1]:
            suffix = "" if kv_cache_dtype == "auto" else f"_{kv_cache_dtype}"
            record[f"greedy_moira_gamma1_vs_dense{suffix}"] = compare_greedy(*pair)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    return record


# --------------------------------------------------------------------------
# Engine part (GPU)
# --------------------------------------------------------------------------
class Selector:
    """Switches Moira's selector on every rank's workspaces (in the engine process,
    through LLM.collective_rpc) and sums their read counts."""

    def __init__(self, backend: str, llm):
        self.note = None
        self.llm = llm
        self.ranks = self.workspaces = 0
        if backend not in MOIRA_BACKENDS:
            return
        if backend == "CUSTOM":
            from vllm_moira.v1.worker import moira_rpc
        else:
            from vllm.v1.worker import moira_rpc
        self.moira_rpc = moira_rpc
        changed = llm.collective_rpc(moira_rpc.set_selector)  # no change: counts workspaces
        self.ranks = len(changed)
        self.workspaces = sum(changed)
        if not all(changed):
            self.note = (
                f"a rank has no Moira workspace ({changed}): only the MOIRA_* env setting runs"
            )

    @property
    def can_switch(self) -> bool:
        return self.ranks > 0 and self.note is None

    def apply(self, arm: dict) -> None:
        if arm["arm"] != "moira" or not self.can_switch:
            return
        if arm["selector"] == "fixed":
            changes = dict(selector="fixed", fixed_pages=None, fixed_fraction=arm["fixed_fraction"])
        else:
            changes = dict(selector="coverage", gamma=arm["gamma"], fixed_pages=None,
                           fixed_fraction=None)  # fmt: skip
        self.llm.collective_rpc(self.moira_rpc.set_selector, kwargs=changes)

    def zero(self) -> None:
        if self.can_switch:
            self.llm.collective_rpc(self.moira_rpc.read_stats, kwargs={"reset": True})

    def reads(self) -> float | None:
        if not self.can_switch:
            return None
        counts = self.llm.collective_rpc(self.moira_rpc.read_stats)
        kept, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        return kept / total if total else None


def greedy_check(llm, selector: Selector, a, vocab: int) -> dict:
    """Greedy continuations of --greedy-check prompts (>= 8k random tokens
    each), with top-2 logprobs per step; MOIRA runs at gamma=1 (every page),
    so --merge can compare its tokens with FLASH_ATTN's."""
    import numpy as np
    from vllm import SamplingParams

    selector.apply({"arm": "moira", "selector": "coverage", "gamma": 1.0})
    rng = np.random.default_rng(a.seed + 1)
    lens = [8192 + 637 * i for i in range(a.greedy_check)]
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, size=n).tolist()}
               for n in lens]  # fmt: skip
    sp = SamplingParams(max_tokens=a.greedy_tokens, min_tokens=a.greedy_tokens, ignore_eos=True,
                        temperature=0.0, logprobs=2, detokenize=False)  # fmt: skip
    outs = llm.generate(prompts, sp, use_tqdm=False)
    rows = []
    for n, o in zip(lens, outs):
        c = o.outputs[0]
        margins = []
        for step in c.logprobs or []:
            vals = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
        rows.append({"prompt_len": n, "tokens": list(c.token_ids), "margins": margins})
    return {"gamma": 1.0 if selector.can_switch else None, "prompts": rows}


def compare_greedy(dense: dict, moira: dict) -> dict:
    """Per prompt: equal token lists, else the first divergent step and the
    dense top-1/top-2 margin there (a tiny margin is a tie under bf16)."""
    out = []
    for d, m in zip(dense["prompts"], moira["prompts"]):
        first = next((i for i, (x, y) in enumerate(zip(d["tokens"], m["tokens"])) if x != y), None)
        margin = None if first is None else d["margins"][first]
        out.append({"prompt_len": d["prompt_len"], "tokens": len(d["tokens"]),
                    "equal": d["tokens"] == m["tokens"], "first_divergence": first,
                    "dense_margin_there": margin})  # fmt: skip
    return {"prompts": out, "all_equal": all(p["equal"] for p in out) and bool(out)}


def profiled_steps(
    events: list[tuple], num_layers: int, step_calls: int, graph_launches: int = 0
) -> float:
    """Decode steps in a profiled window: Moira's Select runs once per layer
    and step; without it (dense), one FULL-graph launch per decode step, else
    the engine steps that the frontend saw (the profiler starts and stops
    between steps of the engine, not exactly at the frontend's)."""
    n_select = sum(1 for name, *_ in events if "kernel_moira_select" in name)
    if n_select:
        return n_select / num_layers
    return float(graph_launches or step_calls)


def engine_rpc(llm, fn, **kwargs):
    """``fn(worker, **kwargs)`` in the engine process (rank 0's result)."""
    return llm.collective_rpc(fn, kwargs=kwargs)[0]


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, duration us, start us) of every CUDA kernel the profiler saw."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) == DeviceType.CUDA:
            span = evt.time_range
            out.append((evt.name, float(span.elapsed_us()), float(span.start)))
    return out


#: Host-side CUDA runtime and driver calls counted per step in a profiled window, by
#: what their names contain: a step replayed as one FULL graph makes one graph launch
#: and few kernel launches; attention run eagerly makes launches per layer, and a
#: synchronize makes the host wait for the GPU (no overlap with the next step's work).
HOST_CALLS = {
    "kernel_launch": ("LaunchKernel",),
    "graph_launch": ("GraphLaunch",),
    "memcpy": ("Memcpy",),
    "synchronize": ("Synchronize",),
}


#: Host ops and calls listed per step by their total time.
HOST_TOP = 12


def host_calls(events: list[tuple[str, float]], steps: float) -> dict:
    """Per step, the count and host µs of each HOST_CALLS kind among ``events``
    ((name, duration us) of the profiler's CPU-side events), and of the HOST_TOP
    names that take the most time (``top``)."""
    steps = max(steps, 1e-9)
    out: dict = {}
    for kind, parts in HOST_CALLS.items():
        hits = [us for name, us in events if any(p in name for p in parts)]
        out[kind] = {"per_step": len(hits) / steps, "us_per_step": sum(hits) / steps}
    # Where else the host's time goes: the ops and calls that take most of it (nested
    # events each count their whole span, so these do not add up to the step).
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        by_name.setdefault(name[:80], []).append(us)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:HOST_TOP]
    out["top"] = {n: {"per_step": len(v) / steps, "us_per_step": sum(v) / steps} for n, v in top}
    return out


#: The function called once per engine step that python_hotspots counts steps by:
#: the profiler starts and stops between the engine's steps, not the frontend's.
ENGINE_STEP_FUNCTION = ("gpu_worker.py", "execute_model")


def python_hotspots(py_prof, steps: int, top: int = 30) -> dict:
    """The Python functions taking the most host time per step under cProfile:
    by own time (``self``) and by time including callees (``total``), each as
    calls and µs per step, and the function calls per step (``calls_per_step``,
    the same on a fast or a slow host). Steps are the engine's (calls of
    ENGINE_STEP_FUNCTION) where it ran, else ``steps``. cProfile slows Python
    code, so these rank the host's work and compare backends; the step time
    beside them is inflated."""
    import pstats

    stats = pstats.Stats(py_prof).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
    engine_steps = sum(
        calls
        for (path, _line, func), (_cc, calls, *_rest) in stats.items()
        if path.endswith(ENGINE_STEP_FUNCTION[0]) and func == ENGINE_STEP_FUNCTION[1]
    )
    steps = engine_steps or steps
    rows = []
    for (path, line, func), (_cc, calls, own, total, _callers) in stats.items():
        where = f"{'/'.join(path.split('/')[-3:])}:{line}({func})"
        rows.append((where, calls / steps, 1e6 * own / steps, 1e6 * total / steps))

    def ranked(col: int) -> dict:
        best = sorted(rows, key=lambda r: -r[col])[:top]
        return {r[0]: {"calls_per_step": round(r[1], 2), "self_us": round(r[2], 1),
                       "total_us": round(r[3], 1)} for r in best}  # fmt: skip

    return {
        "steps": steps,
        "steps_counted_by": "engine" if engine_steps else "frontend",
        "calls_per_step": round(sum(r[1] for r in rows), 1),
        "self": ranked(2),
        "total": ranked(3),
    }


def cpu_events(prof) -> list[tuple[str, float]]:
    """(name, duration us) of every CPU-side event the profiler saw (runtime API
    calls included)."""
    from torch.autograd import DeviceType

    return [
        (evt.name, float(evt.time_range.elapsed_us()))
        for evt in prof.events()
        if getattr(evt, "device_type", None) == DeviceType.CPU
    ]


def load_text_stream(path: str) -> tuple[list[int], list[int]]:
    """All documents of a run_accuracy_vllm export, longest context first, as one token
    stream, and where each document starts in it."""
    from benchmarks.accuracy.run_accuracy_vllm import load_json

    docs = sorted(load_json(path)["docs"], key=lambda d: -d["sample"]["context"])
    stream: list[int] = []
    starts = []
    for d in docs:
        starts.append(len(stream))
        stream.extend(d["prompt_token_ids"])
    return stream, starts


def text_window(stream: list[int], starts: list[int], i: int, context: int) -> list[int]:
    """Request ``i``'s prompt: ``context`` tokens of real text from the start of document
    ``i`` (cycling), running on into the next documents where one is shorter; near the end
    of the stream the window slides back so that it stays whole. Requests of one batch
    start at distinct documents (no shared prefix) while the batch is smaller than the
    number of documents whose start leaves ``context`` tokens of stream."""
    if context > len(stream):
        raise ValueError(
            f"--prompts holds {len(stream)} tokens, fewer than one {context}-token prompt"
        )
    start = min(starts[i % len(starts)], len(stream) - context)
    return stream[start : start + context]


def run_shape(eng, llm, a, ctx, selector: Selector, context, batch, arms, emit, rng) -> None:
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    windows = [dict(arm, kind="arm", settle=a.settle, measure=a.gen) for arm in arms]
    if a.breakdown and (context, batch) in a.breakdown:
        windows.append(dict(arms[0], kind="profile", settle=a.settle, measure=a.profile_steps))
        # The host's Python time per step, apart from the CUDA profiler (whose CPU
        # events see torch ops and runtime calls, not the runner's own code).
        windows.append(dict(arms[0], kind="host", settle=a.settle, measure=a.profile_steps))
    max_tokens = max_tokens_for(context, batch, windows, a.max_num_batched_tokens)
    if batch * (context + max_tokens) > ctx["kv_capacity_tokens"]:
        print(f"SKIP {context}x{batch}: KV capacity", flush=True)
        for arm in arms:
            emit(dict(base_row(ctx, context, batch, arm), skipped="kv capacity"))
        return
    if context + max_tokens > ctx["max_model_len"]:
        print(f"SKIP {context}x{batch}: max_model_len", flush=True)
        for arm in arms:
            emit(dict(base_row(ctx, context, batch, arm), skipped="max_model_len"))
        return
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                        temperature=0.0, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)  # fmt: skip
    selector.apply(windows[0])
    preprocess = getattr(llm, "_preprocess_cmpl_one", None)
    ids = []
    t_submit = time.perf_counter()
    for i in range(batch):
        if "text_stream" in ctx:
            ids_i = text_window(ctx["text_stream"], ctx["text_starts"], i, context)
        else:
            ids_i = rng.integers(100, ctx["vocab"] - 100, size=context).tolist()
        prompt = {"prompt_token_ids": ids_i}
        inp = preprocess(prompt, None, mm_processor_kwargs=None) if preprocess else prompt
        rid = f"{context}x{batch}-{i}-{time.time_ns()}"
        eng.add_request(rid, inp, sp.clone() if hasattr(sp, "clone") else sp)
        ids.append(rid)
    got = dict.fromkeys(ids, 0)
    starts, acc = [], 0
    for w in windows:
        starts.append(acc)
        acc += w["settle"] + w["measure"]
    w_idx, full_idx, step_no = 0, 0, 0
    stamps: list[list[tuple[int, float]]] = [[] for _ in windows]
    done = [False] * len(windows)
    t_first_full = None
    profiling: str | None = None  # the profiler running in the engine: "cuda" or "python"
    prof_calls = 0

    def finish(i: int) -> None:
        nonlocal profiling
        w = windows[i]
        done[i] = True
        if w["kind"] in ("profile", "host"):
            if profiling is None:
                return
            kind, profiling = profiling, None
            head = {"model": ctx["model"], "backend": a.backend, "batch": batch,
                    "context": context, "selector": w["selector"], "gamma": w["gamma"]}  # fmt: skip
            try:
                if kind == "python":
                    b = dict(head, kind="host_python", **interval_stats(stamps[i]))
                    b["functions"] = engine_rpc(llm, engine_profile.stop_python,
                                                steps=max(len(stamps[i]) - 1, 1))  # fmt: skip
                else:
                    b = dict(head, **engine_rpc(llm, engine_profile.stop_cuda,
                                                num_layers=ctx["num_layers"],
                                                step_calls=prof_calls))  # fmt: skip
                    b.update(interval_stats(stamps[i]))
                    b["reads"] = selector.reads() if w["arm"] == "moira" else None
                    b["stages"] = stage_rates(b, ctx["geometry"], context, batch, b["reads"],
                                              ctx.get("copy_gbps"))  # fmt: skip
                    if not b["kernel_events"]:
                        b["error"] = "profiler recorded no CUDA kernels"
            except Exception as exc:
                b = dict(head, error=f"{type(exc).__name__}: {exc}"[:500])
            ctx["breakdown"].append(b)
            print("BREAKDOWN", json.dumps(b)[:4000], flush=True)
            emit(None)
            return
        row = base_row(ctx, context, batch, w)
        row.update(interval_stats(stamps[i]))
        row["reads"] = selector.reads() if w["arm"] == "moira" else None
        if w["arm"] == "moira" and not selector.can_switch:
            row["note"] = selector.note
        row["prefill_s"] = (t_first_full - t_submit) if t_first_full else None
        row["gen_window"] = w["measure"]
        if row["steps"] < w["measure"] - 1:
            row["incomplete"] = True
        emit(row)

    while eng.has_unfinished_requests():
        outs = eng.step()
        t = time.perf_counter()
        if not outs:  # nothing returned (e.g. async scheduling filling its queue)
            continue
        step_no += 1
        if profiling is not None:
            prof_calls += 1
        n_new, first = 0, False
        for o in outs:
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k:
                n_new += 1
                first = first or got.get(o.request_id, 1) == 0
                got[o.request_id] = got.get(o.request_id, 0) + k
        if n_new != batch or first or w_idx >= len(windows):
            continue
        if t_first_full is None:
            t_first_full = t
        w = windows[w_idx]
        rel = full_idx - starts[w_idx]
        full_idx += 1
        if rel >= w["settle"] - 1:
            stamps[w_idx].append((step_no, t))
        if rel == w["settle"] - 1:  # timed window starts after this step
            selector.zero()
            if w["kind"] in ("profile", "host"):
                kind = "cuda" if w["kind"] == "profile" else "python"
                try:
                    engine_rpc(llm, engine_profile.start, kind=kind)
                    profiling, prof_calls = kind, 0
                except Exception as exc:
                    ctx["breakdown"].append({"error": f"profiler start: {exc}"[:300]})
        if rel == w["settle"] + w["measure"] - 1:
            finish(w_idx)
            w_idx += 1
            if w_idx < len(windows):
                selector.apply(windows[w_idx])
            else:
                try:  # all windows done: drop the remaining tokens
                    eng.abort_request(ids)
                except Exception as exc:
                    print(f"abort_request failed ({exc}); stepping to the end", flush=True)
    for i in range(len(windows)):  # requests ended early: keep what was measured
        if not done[i]:
            finish(i)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"shape {context}x{batch} done in {time.perf_counter() - t_submit:.1f}s", flush=True)


def base_row(ctx, context, batch, arm) -> dict:
    return {
        "model": ctx["model"], "batch": batch, "context": context,
        "kv_cache_dtype": ctx.get("kv_cache_dtype", "auto"), "arm": arm["arm"],
        "selector": arm["selector"], "gamma": arm["gamma"],
        "fixed_fraction": arm["fixed_fraction"], "reads": None, "tpot_ms": None, "steps": 0,
        "p10_ms": None, "p90_ms": None,
        # The engine's estimator, summary dtype and audit period (0 = off):
        # MOIRA engines that differ only in them merge apart, and the rows of the
        # shipped defaults say "default".
        **({k: ctx[k] for k in ENGINE_FIELDS if ctx.get(k) is not None}
           if arm["arm"] == "moira" else {}),
        **({"config": "default"} if arm["arm"] == "moira" and ctx.get("is_default")
           and arm["selector"] == "coverage" and arm["gamma"] == ctx.get("default_gamma")
           else {}),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="shared/gpu/models/Llama-3.1-8B")
    ap.add_argument(
        "--backend",
        default="MOIRA",
        choices=["FLASH_ATTN", *MOIRA_BACKENDS],
        help="CUSTOM: Moira in plugin mode on stock vLLM (with its request guard)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="vLLM's --kv-cache-dtype: auto (bf16) or fp8 (e4m3, per-layer "
                    "K/V scales)")  # fmt: skip
    ap.add_argument("--shapes", default=None, help=f"CONTEXTxBATCH,... (default {DEFAULT_SHAPES})")
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, --gen 32")
    ap.add_argument("--batch1", action="store_true", help=f"add {BATCH1_SHAPES}")
    ap.add_argument("--gen", type=int, default=64, help="timed full decode steps per arm")
    ap.add_argument("--settle", type=int, default=3, help="untimed steps after a switch (>= 1)")
    ap.add_argument("--gammas", default="0.98", help="coverage arms (MOIRA), e.g. 0.98,0.99")
    ap.add_argument("--fixed-fractions", default=None,
                    help="CONTEXTxBATCH=F,... overrides of the fixed arm's fraction")  # fmt: skip
    ap.add_argument("--no-fixed", action="store_true", help="MOIRA: coverage arms only")
    ap.add_argument("--breakdown", default=None, help="CONTEXTxBATCH[,...]: profile one window")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mem-util", type=float, default=0.92)
    ap.add_argument(
        "--prompts",
        default=None,
        help="real text instead of random ids: a run_accuracy_vllm export (.json[.gz]); "
        "each request is a window of its documents' token ids, and the model's own weights "
        "are loaded (no dummy weights)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="skip shapes that would start after this many s from the script's "
                    "start (engine start included)")  # fmt: skip
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="TP ranks (> 1: selector switches and reads through collective_rpc)",
    )
    ap.add_argument(
        "--greedy-check",
        type=int,
        default=0,
        metavar="N",
        help="first: N prompts (>= 8k tokens) x --greedy-tokens greedy tokens "
        "(MOIRA at gamma=1), compared with FLASH_ATTN by --merge",
    )
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", help="join result JSONs into --out (no GPU)")
    a = ap.parse_args()
    if a.merge:
        if not a.out:
            ap.error("--merge needs --out")
        record = merge(a.merge, a.out)
        print(f"wrote {a.out}: {len(record['rows'])} rows, {len(record['speedups'])} speedups")
        for s in record["speedups"]:
            print(f"  {s['model']} {s['context']}x{s['batch']} {s['selector']} "
                  f"reads={s['reads']} speedup={s['speedup']:.2f}")  # fmt: skip
        return 0
    if a.backend == "CUSTOM" and a.tensor_parallel_size > 1:
        ap.error("--backend CUSTOM switches the selector in this process: --tensor-parallel-size 1")
    a.settle = max(1, a.settle)
    if a.quick:
        a.shapes = a.shapes or QUICK_SHAPES
        a.gen = min(a.gen, 32)
    shapes = parse_shapes(a.shapes or DEFAULT_SHAPES)
    if a.batch1:
        shapes += [s for s in parse_shapes(BATCH1_SHAPES) if s not in shapes]
    a.breakdown = parse_shapes(a.breakdown) if a.breakdown else []
    if a.breakdown and a.tensor_parallel_size > 1:
        ap.error(
            "--breakdown profiles this process's CUDA kernels: not with --tensor-parallel-size > 1"
        )
    # profiled shapes last: a profiler failure cannot cost the other shapes
    shapes = [s for s in shapes if s not in a.breakdown] + [s for s in shapes if s in a.breakdown]
    gammas = [float(g) for g in a.gammas.split(",") if g.strip()]
    overrides = parse_fraction_overrides(a.fixed_fractions)
    family = model_family(a.model)
    model_name = os.path.basename(os.path.normpath(a.model))
    kv_suffix = "" if a.kv_cache_dtype == "auto" else f"_{a.kv_cache_dtype}"
    out = Path(a.out or f"benchmarks/results/tpot_{model_name}_{a.backend.lower()}{kv_suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    # The engine core runs in its own process (vLLM's default, as `vllm serve` runs it):
    # in the benchmark's process its scheduling and output handling would share one
    # thread with the timing loop, and steps short on the GPU would measure the host.
    # collective_rpc sends moira_rpc's and engine_profile's functions (pickled by
    # reference) to it.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if a.tensor_parallel_size > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on this host
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.pop("VLLM_ATTENTION_BACKEND", None)
    import numpy as np
    import torch
    from vllm import LLM

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    plans = {s: plan_arms(a.backend, family, s[0], s[1], gammas, overrides) for s in shapes}
    if a.no_fixed:
        plans = {s: [x for x in p if x["selector"] != "fixed"] for s, p in plans.items()}
    window = {"settle": a.settle, "measure": max(a.gen, a.profile_steps)}
    budget = {
        s: max_tokens_for(s[0], s[1], [window] * (len(p) + 2), a.max_num_batched_tokens)
        for s, p in plans.items()
    }
    max_len = max(c + budget[(c, b)] for c, b in shapes)
    max_pos = int(cfg.get("max_position_embeddings", max_len))
    if max_len > max_pos:
        print(f"max_model_len {max_len} > {max_pos}: capped (longest shape may be skipped)")
        max_len = max_pos
    attn = {"backend": a.backend}
    if a.backend == "FLASH_ATTN":
        attn["flash_attn_version"] = 3
    sizes = sorted({1, 2} | {b for _, b in shapes})
    kw = dict(
        model=a.model, load_format="auto" if a.prompts else "dummy", skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=64, max_model_len=max_len, max_num_seqs=max(b for _, b in shapes),
        max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False,
        tensor_parallel_size=a.tensor_parallel_size, kv_cache_dtype=a.kv_cache_dtype,
        gpu_memory_utilization=a.gpu_mem_util, seed=a.seed, attention_config=attn,
        compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                            "cudagraph_capture_sizes": sizes},
    )  # fmt: skip
    if a.backend == "CUSTOM":
        kw["logits_processors"] = [REQUEST_GUARD]
    print("LLM kwargs:", kw, flush=True)
    record: dict = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "model": model_name,
        "backend": a.backend,
        "kv_cache_dtype": a.kv_cache_dtype,
        "moira_env": {k: v for k, v in os.environ.items() if k.startswith("MOIRA_")},
        "moira_config": _moira_config_record(a.backend) if a.backend in MOIRA_BACKENDS else None,
        "notes": [],
        "rows": [],
        "breakdown": [],
    }

    def write():
        record["wall_s"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(record, indent=1) + "\n")

    if a.breakdown:
        # Before the engine takes the GPU's memory; the stage rates are read against it.
        record["copy_gbps"] = device_copy_gbps(torch)
        print(f"device copy rate: {record['copy_gbps']:.0f} GB/s", flush=True)
    write()
    t0 = time.time()
    llm = LLM(**kw)
    eng = llm.llm_engine
    nblocks = eng.vllm_config.cache_config.num_gpu_blocks or 0
    record["engine"] = {"init_s": round(time.time() - t0, 1), "num_gpu_blocks": nblocks,
                        "vllm": __import__("vllm").__version__, "torch": torch.__version__,
                        "cudagraph_mode": str(eng.vllm_config.compilation_config.cudagraph_mode),
                        "max_model_len": max_len}  # fmt: skip
    print(f"engine ready: {record['engine']}", flush=True)
    record["engine"]["tensor_parallel_size"] = a.tensor_parallel_size
    selector = Selector(a.backend, llm)
    if a.backend in MOIRA_BACKENDS:
        record["engine"]["moira_workspaces"] = selector.workspaces
        record["engine"]["moira_ranks"] = selector.ranks
        if selector.note:
            record["notes"].append(selector.note)
            print("WARNING:", selector.note, flush=True)
    ctx = {"model": model_name, "kv_cache_dtype": a.kv_cache_dtype,
           **engine_fields(record["moira_config"], a.backend),
           "vocab": int(cfg["vocab_size"]), "num_layers":
           int(cfg["num_hidden_layers"]), "kv_capacity_tokens": nblocks * 64,
           "max_model_len": max_len, "breakdown": record["breakdown"],
           "copy_gbps": record.get("copy_gbps"),
           "geometry": model_geometry(cfg, a.kv_cache_dtype, a.backend)}  # fmt: skip
    write()

    def emit(row):
        if row is not None:
            try:
                validate_tpot_row(row)
            except ValueError as exc:
                row["schema_error"] = str(exc)[:300]
            record["rows"].append(row)
            print("ROW", json.dumps(row), flush=True)
        write()

    if a.greedy_check:
        t_greedy = time.time()
        record["greedy"] = greedy_check(llm, selector, a, ctx["vocab"])
        record["greedy"]["wall_s"] = round(time.time() - t_greedy, 1)
        heads = [p["tokens"][:8] for p in record["greedy"]["prompts"]]
        print("GREEDY", json.dumps({"wall_s": record["greedy"]["wall_s"], "tokens": heads}),
              flush=True)  # fmt: skip
        write()
    rng = np.random.default_rng(a.seed)
    if a.prompts:
        ctx["text_stream"], ctx["text_starts"] = load_text_stream(a.prompts)
        record["prompts"] = {"file": os.path.basename(a.prompts),
                             "tokens": len(ctx["text_stream"]),
                             "documents": len(ctx["text_starts"])}  # fmt: skip
    for context, batch in shapes:
        arms = plans[(context, batch)]
        if a.backend in MOIRA_BACKENDS and not selector.can_switch:
            arms = arms[:1]  # cannot switch: the env setting only (see notes)
        if a.deadline_s and time.time() - t_start > a.deadline_s:
            print(f"SKIP {context}x{batch}: --deadline-s {a.deadline_s:g} passed "
                  f"({time.time() - t_start:.0f} s since start, engine start "
                  f"{record['engine']['init_s']} s of it)", flush=True)  # fmt: skip
            for arm in arms:
                emit(dict(base_row(ctx, context, batch, arm), skipped="deadline"))
            continue
        print(f"== {context}x{batch}: arms {arms}", flush=True)
        try:
            run_shape(eng, llm, a, ctx, selector, context, batch, arms, emit, rng)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            record["notes"].append(f"{context}x{batch}: {type(exc).__name__}: {exc}"[:500])
            write()
    write()
    print(f"wrote {out} ({len(record['rows'])} rows) in {time.time() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
