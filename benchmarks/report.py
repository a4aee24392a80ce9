# SPDX-License-Identifier: Apache-2.0
"""Write docs/results.md from the committed records under benchmarks/results/.

    python benchmarks/report.py            # (re)write docs/results.md
    python benchmarks/report.py --check    # exit 1 with a diff summary if the page is stale

CPU only, standard library only, deterministic: the page is a function of MANIFEST and the
record files it names. MANIFEST lists the current record of every benchmark, one section each;
a record that is not in it is not on the page and should not be in the tree.

Each record entry: ``path`` (relative to benchmarks/results/), and where the record itself does
not say them: ``commit`` (the tree it ran on), ``device``, ``command``; ``config`` (the Moira
configuration of the rows that do not name it: estimator, summary dtype, ...);
``model`` (a display name where the record has a folder name); ``filter`` (row field -> the
values to keep); ``note`` (how the run differs from the section's method); ``optional`` (a
record still to be added: a warning, not an error, while it is missing). The commit is taken
from the record, else from ``<record stem>.run.json`` or ``run.json`` beside it
(benchmarks/run_gpu.sh writes one), else from the manifest, else "not recorded"; the same for
the command (record, manifest) and the device (record's ``gpu``, manifest).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
NOT_RECORDED = "not recorded"

#: The Moira configuration of the rows whose record does not name it.
DEFAULT_OFF = {"estimator": "mvar_top8", "summary_dtype": "int8"}
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
QWEN = "Qwen2.5-Coder-1.5B-Instruct"
#: The quantized key copy's rows on the results page: alone, and as the refinement's stage 2.
KEY_COPY_ARMS = ["keyq4c", "2v/int8:mvar_top8/keyq4c/3/0.75"]
#: Estimator-study arms shown: the paper's, the default and the removed refinement.
STUDY_ARMS = {
    "gamma": [0.98],
    "estimator": ["mvar", "int8:mvar_top8", "2v/int8:mvar_top8/oracle/3/0.75"],
}
#: Accuracy arms shown: dense, γ 0.99 and 0.98, and the fixed count at γ 0.98's reads.
ACC_GAMMAS = {"gamma": [None, 0.98, 0.99]}

MANIFEST: list[dict] = [
    {
        "title": "TPOT",
        "kind": "tpot",
        "intro": (
            f"Time per output token of a whole decode step in vLLM (full CUDA graphs, median "
            f"of the timed steps), {QWEN} with its real weights on the accuracy suite's "
            "haystack text, the coverage rule at the named γ; dense FA3 (`FLASH_ATTN`) in the "
            "same run; the engine core in its own process, as `vllm serve` runs it, unless a "
            "record's note says otherwise. Rows marked **default** are the shipped "
            "configuration."
        ),
        "records": [
            {
                "path": "tpot/tpot_real_h100.json",
                "commit": "095a818",
                "model": QWEN,
                "note": "At batch 1 (0.86×) every step of both engines runs FA3's decode graph "
                "(kernels busy 2.41 and 2.43 ms a step) and waits on the host; see the repeat "
                "below",
            },
            {
                "path": "tpot/tpot_real_b1_repeat_h100.json",
                "commit": "095a818",
                "model": QWEN,
                "note": "Batch 1 again, right after the run above on the same machine: both "
                "engines read every page in FA3's graph (the same kernels, busy 2.42 ms a "
                "step), and the step waits on the host (graph launch and the runner's Python), "
                "whose speed moved by 15% between the two runs: dense took 3.05 ms there, "
                "2.66 ms here",
            },
            {
                "path": "tpot/tpot_real_arms_h100.json",
                "commit": "a5c363e",
                "model": QWEN,
                "filter": {"audit_every": [64]},
                "note": "The engine ran in the benchmark's own process then (host-bound at "
                "batch 1 and 8k×64); ratios against dense in that run",
            },
            {
                "path": "tpot/tpot_real_arms_h100.json",
                "commit": "a5c363e",
                "model": QWEN,
                "filter": {"summary_dtype": ["int4"]},
                "note": "As the row above: the engine in the benchmark's process",
            },
            {
                "path": "plugin/tpot_plugin_h100.json",
                "commit": "a5c363e",
                "model": QWEN,
                "filter": {"mode": ["plugin"]},
                "note": "Plugin mode (`CUSTOM` on the stock vLLM 0.30.0 bundle, summaries in "
                "the padded KV pages) in the same lease as `tpot/tpot_real_arms_h100.json`, "
                "whose dense and patched-build engines are its baseline; the engine in the "
                "benchmark's process",
            },
        ],
    },  # fmt: skip
    {
        "title": "TPOT, dummy weights at fixed page counts (kernel evidence)",
        "kind": "tpot",
        "intro": (
            "Dummy weights make every page tie, so the coverage rule reads every page there; "
            "these rows set the page budget with the fixed-count selector at the fraction the "
            "coverage rule reads on real data (the paper's Table 3, or the real-weights rows "
            "above). They measure the kernels at a given read fraction, not the default's "
            "speed; the coverage rows show Estimate + Select at full reads."
        ),
        "records": [
            {
                "path": "tpot/tpot_kv_dtypes_h200.json",
                "commit": "0c09116",
                "config": DEFAULT_OFF,
                "filter": {"kv_cache_dtype": ["auto"]},
            },
            {"path": "tpot/tpot_mid_final_h200.json", "commit": "3d23509", "config": DEFAULT_OFF},
            {
                "path": "tpot/tpot_mvar_b1_h200.json",
                "commit": "6869ee6",
                "config": {"estimator": "mvar", "summary_dtype": "int8"},
                "filter": {"batch": [4, 32], "selector": ["fixed"]},
            },
            {"path": "tpot/tpot_qwen_now_h200.json", "commit": "bb43c43", "config": DEFAULT_OFF},
            {
                "path": "tpot/tpot_llama_at_qwen_coder_reads_h200.json",
                "commit": "336d422",
                "config": DEFAULT_OFF,
            },
        ],
        "figures": ["img/tpot_speedup.png"],
    },  # fmt: skip
    {
        "title": "Batch 1",
        "kind": "tpot",
        "intro": (
            "One request (Llama-3.1-8B, dummy weights, the coverage rule). A step whose batch "
            "holds at most `dense_batch_tokens` tokens runs FA3's own decode graph; longer "
            "contexts run Moira's step, which reads every page on dummy weights, so those rows "
            "are its cost at full reads."
        ),
        "records": [
            {
                "path": "batch1/tpot_b1_fa3steps_h200.json",
                "commit": "b9f8d11",
                "config": {**DEFAULT_OFF, "dense_batch_tokens": 32768},
                "filter": {"selector": ["coverage"], "context": [16384, 65536]},
            },
            {
                "path": "batch1/tpot_b1_32k_final_h200.json",
                "commit": "af2182b",
                "config": {**DEFAULT_OFF, "dense_batch_tokens": 36864},
                "filter": {"selector": ["coverage"]},
            },
        ],
    },  # fmt: skip
    {
        "title": "Serving",
        "kind": "serving",
        "intro": (
            "`vllm serve` with `vllm bench serve` (closed loop, prefix caching off), dense "
            "and Moira servers one after the other on one GPU. Output tokens/s over the "
            "whole run, prefill included."
        ),
        "records": [
            {
                "path": "serving/serving_real_h100.json",
                "commit": "4125617",
                "model": f"{QWEN} (real weights, text of 4k–30k tokens)",
                "config": DEFAULT_OFF,
            },
            {
                "path": "serving/serving_qwen_real_h200.json",
                "commit": "4c2bea9",
                "model": f"{QWEN} (real weights, text of 4k–30k tokens)",
                "config": DEFAULT_OFF,
            },
            {
                "path": "serving/serving_setA_phases_h200.json",
                "commit": "6869ee6",
                "model": "Llama-3.1-8B (dummy weights, set A: 4k–64k prompts)",
                "config": DEFAULT_OFF,
            },
            {
                "path": "serving/serving_setB_h200.json",
                "commit": "f0e0aa7",
                "model": "Llama-3.1-8B (dummy weights, set B: 64k–126k prompts)",
                "config": {**DEFAULT_OFF, "attend": "lists (Alg. 2)"},
            },
            {
                "path": "serving/serving_setB_c1_h200.json",
                "commit": "f0e0aa7",
                "model": "Llama-3.1-8B (dummy weights, set B: 64k–126k prompts)",
                "config": {**DEFAULT_OFF, "attend": "lists (Alg. 2)"},
            },
        ],
    },  # fmt: skip
    {
        "title": "Accuracy",
        "kind": "accuracy",
        "intro": (
            "RULER-style tasks (needle variants, variable tracking, common words), 20 "
            "documents per task and context, greedy, scored against the reference answers "
            "(0–100). Cells: dense's score; for Moira, Δ points against the dense row of its "
            "own record @ the fraction of pages Select kept. The fixed-count rows read what "
            "γ 0.98 read on the same documents. Method: [accuracy.md](accuracy.md)."
        ),
        "records": [
            {
                "path": "accuracy/accuracy_qwen_vllm_h200.json",
                "commit": "8c19d2b",
                "device": H200,
                "config": DEFAULT_OFF,
                "filter": ACC_GAMMAS,
            },
            {
                "path": "accuracy/accuracy_smollm2_vllm_final_h200.json",
                "commit": "e23043e",
                "device": H200,
                "model": "SmolLM2-135M-Instruct",
                "config": DEFAULT_OFF,
                "filter": ACC_GAMMAS,
            },
            {
                "path": "accuracy/accuracy_smollm2_vllm_mvar_h200.json",
                "commit": "e23043e",
                "device": H200,
                "model": "SmolLM2-135M-Instruct",
                "config": {"estimator": "mvar", "summary_dtype": "int8"},
                "filter": ACC_GAMMAS,
            },
        ],
    },  # fmt: skip
    {
        "title": "Estimator study",
        "kind": "estimator",
        "intro": (
            "Select's lists from each estimator against the oracle (exact page masses) on "
            "needle prompts, in the float32 reference. kept: mean fraction of pages kept; "
            "p10 mass: 10th percentile of the attention mass captured; needle drops: lists "
            "attending a needle (share ≥ 5%) that lost a needle page; error: output error "
            "relative to the oracle's. `int8:mvar_top8` is the default; `2v/…/3/0.75` is the "
            "spread-gated refinement (studied; removed from the backend). Method: "
            "[estimator.md](estimator.md)."
        ),
        "records": [
            {
                "path": "estimator/estimator_widened_smollm2.json",
                "commit": "6906d9f",
                "device": "CPU",
                "filter": {"gamma": [0.98], "estimator": ["int8:mvar_top8"]},
            },
            {
                "path": "estimator/estimator_refine_smollm2.json",
                "commit": "8cabe43",
                "device": "CPU",
                "filter": {"gamma": [0.98], "estimator": ["2v/int8:mvar_top8/oracle/3/0.75"]},
            },
            {
                "path": "estimator/estimator_int4_smollm2.json",
                "commit": "bc0b3c2",
                "device": "CPU",
                "filter": {"gamma": [0.98], "estimator": ["int4:mvar_top8"]},
            },
            {
                "path": "estimator/estimator_qwen_8k.json",
                "commit": "887a617",
                "device": "CPU",
                "filter": STUDY_ARMS,
            },
            {
                "path": "estimator/estimator_qwen_16k.json",
                "commit": "fc14aed",
                "device": "CPU",
                "filter": STUDY_ARMS,
            },
            {
                "path": "estimator/estimator_heldout_smollm2.json",
                "commit": "d1a4e30",
                "device": "CPU",
                "filter": {
                    "gamma": [0.98],
                    "seeds": ["1"],
                    "counted_rows_per_prompt": [16],
                    "estimator": ["int8:mvar_top8"],
                },  # fmt: skip
                "note": "held-out prompts (seed 1); the query-chosen ceiling `qtop8`, the other "
                "candidate first stages, bytes and the seed-2 validation in the record",
            },
            {
                "path": "estimator/estimator_heldout_qwen_8k.json",
                "commit": "ff5cdb7",
                "device": "CPU",
                "filter": {
                    "gamma": [0.98],
                    "estimator": ["int8:mvar_top8", "2v/int8:mvar_top8/oracle/3/0.75"],
                },  # fmt: skip
                "note": "held-out prompts (seed 1); int4 keys and gamma 0.99 in the record",
            },
            {
                "path": "estimator/estimator_keyq_smollm2.json",
                "commit": "7fbddc5",
                "device": "CPU",
                "filter": {"gamma": [0.98], "seeds": ["1"], "estimator": KEY_COPY_ARMS},
                "note": "held-out prompts (seed 1); uncentered, 2- and 3-bit, channel-subset and "
                "principal-axes copies and gamma 0.99 in the record",
            },
            {
                "path": "estimator/estimator_keyq_smollm2.json",
                "commit": "7fbddc5",
                "device": "CPU",
                "filter": {
                    "gamma": [0.98],
                    "seeds": ["2"],
                    "context": [4096],
                    "estimator": ["int8:mvar_top8", *KEY_COPY_ARMS],
                },  # fmt: skip
                "note": "the same at seed 2 (4k): a second held-out set; seed 2 at 8k in the "
                "record",
            },
            {
                "path": "estimator/estimator_keyq_qwen_8k.json",
                "commit": "7fbddc5",
                "device": "CPU",
                "filter": {"gamma": [0.98], "seeds": ["1"], "estimator": KEY_COPY_ARMS},
                "note": "held-out prompts (seed 1); 4k (seed 0), principal-axes copies and gamma "
                "0.99 in the record",
            },
        ],
    },  # fmt: skip
    {
        "title": "fp8 KV cache",
        "kind": "tpot",
        "intro": (
            "`--kv-cache-dtype fp8` (e4m3): Moira against dense FA3 on the same fp8 cache and, "
            "in brackets, against dense on a bf16 cache. Llama-3.1-8B, dummy weights, fixed "
            "page counts. Accuracy on fp8 caches: "
            "[below](#accuracy-fp8-kv-cache)."
        ),
        "records": [
            {
                "path": "tpot/tpot_fp8_stages_h200.json",
                "commit": "f773cc7",
                "config": DEFAULT_OFF,
                "filter": {"kv_cache_dtype": ["fp8"]},
            },
            {
                "path": "tpot/tpot_kv_dtypes_h200.json",
                "commit": "0c09116",
                "config": DEFAULT_OFF,
                "filter": {"kv_cache_dtype": ["fp8"]},
            },
        ],
    },  # fmt: skip
    {
        "title": "Accuracy, fp8 KV cache",
        "kind": "accuracy",
        "intro": "As in [Accuracy](#accuracy), all arms on an fp8 (e4m3) cache.",
        "records": [
            {
                "path": "accuracy/accuracy_qwen_vllm_fp8_h200.json",
                "commit": "a5a88f5",
                "device": H200,
                "config": DEFAULT_OFF,
                "filter": ACC_GAMMAS,
            },
        ],
    },  # fmt: skip
    {
        "title": "Tensor parallelism",
        "kind": "tpot",
        "intro": (
            "Llama-3.1-8B, dummy weights, TP = 2 on two GPUs of one host; greedy outputs at "
            "γ 1 checked against dense."
        ),
        "records": [
            {
                "path": "tensor_parallel/tp2_h200.json",
                "commit": "aac2044",
                "config": {
                    "estimator": "mvar",
                    "summary_dtype": "bf16",
                    "attend": "lists (Alg. 2)",
                },
            },
        ],
    },  # fmt: skip
    {
        "title": "Kernel correctness",
        "kind": "correctness",
        "intro": (
            "`benchmarks/moira_correctness.py` on one layer of Llama-3.1-8B's geometry "
            "(32 query heads, 8 KV heads, head size 128): γ = 1 against FA3, CUDA-graph "
            "replay against eager, Select's lists against the float32 reference at γ 0.98."
        ),
        "records": [
            {"path": "correctness/correctness_h100.json", "commit": "dce8757"},
            {
                "path": "fp8/correctness_fp8_h100.json",
                "commit": "543d956",
                "note": "On an fp8 cache the bf16-ulp bound does not apply; the reference is "
                "FA3's own error against float32 (the next column)",
            },
        ],
    },  # fmt: skip
    {
        "title": "GPU test suites and checks in vLLM",
        "kind": "checks",
        "intro": (
            "The `-m gpu` pytest suite, end-to-end greedy checks in vLLM, the page summaries "
            "recomputed from a live KV cache, vLLM's own attention-backend tests with MOIRA "
            "added, and a serving soak under preemption and prefix caching."
        ),
        "records": [
            {
                "path": "correctness/pytest_gpu_h200.log",
                "commit": "0dffbd6",
                "device": H200,
                "command": "bash benchmarks/run_gpu.sh --out DIR gpu-tests",
            },
            {"path": "plugin/plugin_gamma1_h100.json"},
            {
                "path": "fp8/gpu_tests_fp8_h200.log",
                "commit": "4906468",
                "device": H200,
                "command": "bash benchmarks/run_gpu.sh --kv-cache-dtype fp8 --out DIR "
                "gpu-tests:fp8",
            },
            {
                "path": "correctness/e2e_dense_steps_h200.json",
                "commit": "4794177",
                "device": H200,
                "command": "python benchmarks/e2e_moira_vllm.py --timeout 185 --out ...",
            },
            {"path": "correctness/summaries_in_vllm_dense_steps_h200.json", "commit": "4794177"},
            {
                "path": "upstream/vllm_tests_gamma1_h200.jsonl",
                "commit": "8c19d2b",
                "device": H200,
                "command": "python tests/upstream/run_vllm_tests.py run --gamma 1 --out DIR",
            },
            {
                "path": "upstream/vllm_tests_gamma0.98_h200.jsonl",
                "commit": "0c09116",
                "device": H200,
                "command": "python tests/upstream/run_vllm_tests.py run --gamma 0.98 --out DIR",
            },
            {
                "path": "soak/soak_h200.json",
                "commit": "e23043e",
                "device": H200,
                "command": "python benchmarks/soak_serve.py --phases moira1,dense,moira098 "
                "--gamma-check --requests 100 --max-len 32768 --max-tokens 128 "
                "--num-gpu-blocks 1100 --out ...",
            },
        ],
    },  # fmt: skip
    {
        "title": "Stage timing",
        "kind": "timing",
        "intro": (
            "µs per layer of each decode stage, CUDA-graph replay median, one layer of "
            "Llama-3.1-8B's geometry; Select at γ 0.98; Attend + Merge on a fixed 22% of the "
            "pages; copy rate: the device-to-device copy rate measured in the same run."
        ),
        "records": [
            {"path": "kernel_timing/kernel_timing_pages_h200.json", "commit": "0f7987a"},
            {
                "path": "kernel_timing/estimate_sweep_real_h200.json",
                "commit": "0dffbd6",
                "sweep_rows": {
                    "previous launch, 32 pages × 2 warps": {
                        "tile_pages": 32,
                        "num_warps": 2,
                        "key_stages": 3,
                        "maxnreg": 128,
                    }
                },
                "note": "At Qwen2.5-Coder-1.5B's heads (12 query, 2 KV) and the real-text "
                "rows' shapes; the summaries stay in L2 across replays here, unlike in a "
                "decode step (the TPOT breakdown has the in-step times)",
            },
            {
                "path": "kernel_timing/keyq_estimate_h100.json",
                "commit": "a5c363e",
                "note": "The quantized key copy's Estimate (`benchmarks/probes/keyq_estimate.py`, "
                "a study kernel, not in the backend) beside the default's Estimate on the same "
                "pages",
            },
        ],
    },  # fmt: skip
    {
        "title": "Kernel spread",
        "kind": "spread",
        "intro": (
            "Attention µs per layer against the spread (CV) of per-head list lengths, 22% of "
            "the pages kept (the paper's Table 6). CV \"real\": lengths drawn from SmolLM2's "
            "per-(layer, KV head) kept fractions (`real_fractions_smollm2.json`). `moira_pages` "
            "is the backend's Attend; `moira` is the paper's Alg. 2."
        ),
        "records": [
            {
                "path": "kernel_spread/kernels_h200.json",
                "commit": "3a87d01",
                "filter": {"context": [8192, 131072]},
            },
            {
                "path": "kernel_spread/real_fractions_smollm2.json",
                "commit": "9b7e23a",
                "device": "CPU",
                "input_only": True,
            },
        ],
        "figures": ["img/kernel_spread.png"],
    },  # fmt: skip
]

#: Row fields that name a Moira engine's configuration, in display order.
CONFIG_KEYS = ("estimator", "summary_dtype", "attend", "dense_batch_tokens", "mode")


# ---------------------------------------------------------------- formatting helpers


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def sci(x) -> str:
    return "–" if x is None else f"{x:.1e}"


def shape(context, batch) -> str:
    """Context tokens × batch, as run: 8192×32."""
    return f"{context}×{batch}"


_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|tmp|home|mnt|work|data)/\S*?([^/\s]+)(?=\s|$)")


def clean_command(cmd: str | None) -> str:
    """A command as recorded, with the host's absolute paths cut to their last part."""
    if not cmd:
        return NOT_RECORDED
    cmd = _MACHINE_PATH.sub(r"…/\1", cmd.strip())
    return cmd.replace(".shared/gpu/", "shared/gpu/")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(c.replace("|", "\\|") for c in header) + " |",
           "|" + " --- |" * len(header)]  # fmt: skip
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def config_text(row: dict, defaults: dict | None) -> str:
    """The configuration of one Moira row: engine fields (the row's, else the manifest's),
    then the selector and its parameter; "**default**" where the row says so."""
    merged = {**(defaults or {}), **{k: row[k] for k in CONFIG_KEYS if row.get(k)}}
    parts = []
    for k in CONFIG_KEYS:
        if merged.get(k) is not None:
            v = merged[k]
            if k in ("attend", "dense_batch_tokens"):
                parts.append(f"{k} {v}")
            else:
                parts.append(f"{v} mode" if k == "mode" else str(v))
    if row.get("audit_every"):
        parts.append(f"audit every {row['audit_every']} steps")
    if row.get("attend_launch"):
        parts.append(f"Attend launch `{json.dumps(row['attend_launch'], sort_keys=True)}`")
    sel = row.get("selector")
    if sel == "coverage":
        parts.append(f"coverage γ {fmt(row.get('gamma'), 2)}")
    elif sel == "fixed":
        parts.append(f"fixed {fmt(row.get('fixed_fraction'), 2)}")
    elif sel:
        parts.append(str(sel))
    text = ", ".join(parts) if parts else NOT_RECORDED
    return f"**default**: {text}" if row.get("config") == "default" else text


def keep(row: dict, filt: dict | None) -> bool:
    return all(row.get(k, "auto" if k == "kv_cache_dtype" else None) in v
               for k, v in (filt or {}).items())  # fmt: skip


# ---------------------------------------------------------------- record metadata


def load(path: Path):
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return path.read_text(errors="replace")


def run_json(path: Path) -> dict:
    for cand in (path.with_name(path.stem + ".run.json"), path.with_name("run.json")):
        if cand.is_file():
            try:
                return json.loads(cand.read_text())
            except ValueError:
                return {}
    return {}


def meta(entry: dict, data, results: Path = RESULTS) -> dict:
    """commit, device, command and source commands of one record (see the module doc)."""
    rec = data if isinstance(data, dict) else {}
    side = run_json(results / entry["path"])
    commit = rec.get("commit") or side.get("commit") or entry.get("commit") or NOT_RECORDED
    device = rec.get("gpu") or entry.get("device") or NOT_RECORDED
    command = rec.get("command") or entry.get("command")
    sources, merged = [], True
    if not command and rec.get("commands"):  # one record of several runs
        command, *rest = rec["commands"]
        sources = [clean_command(c) for c in rest]
        merged = False
    for s in rec.get("sources") or []:
        c = s.get("command") if isinstance(s, dict) else s
        if c and c != command:
            sources.append(clean_command(c))
    return {"commit": str(commit)[:9] if commit != NOT_RECORDED else commit,
            "device": device, "command": clean_command(command), "sources": sources,
            "copy_tbps": rec.get("d2d_copy_tbps"), "merged": merged}  # fmt: skip


def provenance(entry: dict, m: dict) -> list[str]:
    lines = [f"- `{entry['path']}`: commit {m['commit']}, {m['device']}; `{m['command']}`"]
    if m["sources"]:
        lead = "; its inputs: " if m.get("merged", True) else "; then: "
        lines[-1] += lead + "; ".join(f"`{c}`" for c in m["sources"])
    if entry.get("note"):
        lines[-1] += f". {entry['note']}"
    if m.get("copy_tbps"):
        lines[-1] += f"; device copy rate in the same run {m['copy_tbps']:.2f} TB/s"
    return lines


# ---------------------------------------------------------------- tables per kind


def tpot_rows(entry: dict, data: dict) -> list[list[str]]:
    out = []
    for r in sorted(data.get("speedups", []), key=lambda r: (r["batch"] == 1, r["context"])):
        if not keep(r, entry.get("filter")):
            continue
        kv = r.get("kv_cache_dtype", "auto")
        ratio = f"**{r['speedup']:.2f}×**"
        if r.get("speedup_vs_dense_bf16"):
            ratio += f" ({r['speedup_vs_dense_bf16']:.2f}×)"
        out.append([
            entry.get("model") or r["model"], shape(r["context"], r["batch"]),
            "bf16" if kv == "auto" else kv, config_text(r, entry.get("config")),
            fmt(r.get("reads"), 3), fmt(r["dense_ms"], 3), fmt(r["moira_ms"], 3), ratio,
            f"`{entry['path']}`",
        ])  # fmt: skip
    return out


TPOT_HEADER = ["model", "shape (context×batch)", "KV cache", "Moira configuration", "reads",
               "dense ms", "Moira ms", "dense / Moira", "record"]  # fmt: skip


def render_tpot(section: dict, loaded: list) -> list[str]:
    rows = []
    for entry, data, _ in loaded:
        rows += tpot_rows(entry, data)
    lines = table(TPOT_HEADER, rows) if rows else ["No rows in the current records."]
    for entry, data, _ in loaded:
        g = data.get("greedy_moira_gamma1_vs_dense")
        if g:
            n = len(g.get("prompts", []))
            lines += ["", f"Greedy outputs at γ 1 equal to dense (`{entry['path']}`): "
                      f"{fmt(g.get('all_equal'))}, {n} prompts."]  # fmt: skip
    return lines


def serving_rows(entry: dict, data: dict) -> list[list[str]]:
    """One row per (concurrency, non-dense arm), against the dense arm at that concurrency."""
    by: dict = {}
    for r in data.get("rows", []):
        by.setdefault(r["concurrency"], {}).setdefault(r["arm"], r)
    out = []
    for c in sorted(by):
        d = by[c].get("dense")
        for arm, m in by[c].items():
            if arm == "dense" or not d:
                continue
            env = " ".join(re.findall(r"MOIRA_\w+=\S+", m.get("server_command") or ""))
            cfg = config_text(m, entry.get("config"))
            cfg = f"{cfg}; `{env}`" if env else cfg
            if arm != "moira":
                cfg = f"`{arm}`: {cfg}"
            gain = (data.get("gains") or {}).get(f"c{c}") if arm == "moira" else None
            if gain is None and d.get("output_tok_s") and m.get("output_tok_s"):
                gain = m["output_tok_s"] / d["output_tok_s"] - 1
            out.append([
                entry.get("model") or str(m.get("model")), str(c), cfg,
                fmt(d.get("output_tok_s"), 0), fmt(m.get("output_tok_s"), 0),
                "–" if gain is None else f"**{gain * 100:+.1f}%**",
                fmt(d.get("median_tpot_ms")), fmt(m.get("median_tpot_ms")),
                f"`{entry['path']}`",
            ])  # fmt: skip
    return out


def render_serving(section: dict, loaded: list) -> list[str]:
    header = ["model and prompts", "concurrency", "Moira configuration", "dense tok/s",
              "Moira tok/s", "output tok/s", "dense median TPOT ms", "Moira median TPOT ms",
              "record"]  # fmt: skip
    rows = []
    for entry, data, _ in loaded:
        rows += serving_rows(entry, data)
    return table(header, rows)


def accuracy_config(r: dict, defaults: dict | None) -> str:
    """One accuracy arm's configuration: its estimator field (``[int4:]name``) where the
    record has one, else the manifest's; then its selector."""
    if r["arm"] == "dense":
        return "dense (`FLASH_ATTN`)"
    cfg = dict(defaults or {})
    est = r.get("estimator")
    if est:
        dtype, _, name = est.rpartition(":")
        cfg.update(estimator=name)
        if dtype:
            cfg["summary_dtype"] = dtype
    if r["arm"] == "moira":
        sel = {"selector": "coverage", "gamma": r.get("gamma")}
    else:  # fixed_k: the fixed-count selector at the reads of γ 0.98 on the same documents
        sel = {"selector": "fixed at γ 0.98's reads"}
    return config_text(sel, cfg)


def render_accuracy(section: dict, loaded: list) -> list[str]:
    """One table per (model, KV cache dtype): a row per arm and record, a column per context."""
    groups: dict = {}
    for entry, data, _ in loaded:
        model = entry.get("model") or data.get("model") or NOT_RECORDED
        groups.setdefault((model, data.get("kv_cache_dtype", "auto")), []).append((entry, data))
    lines: list[str] = []
    for (model, kv), members in groups.items():
        rows = [(e, r) for e, d in members for r in d.get("rows", [])
                if r.get("task") == "all" and r.get("haystack") is None
                and keep(r, e.get("filter"))]  # fmt: skip
        contexts = sorted({r["context"] for _, r in rows})
        keys: list = []
        cell: dict = {}
        for e, r in rows:
            key = (e["path"], accuracy_config(r, e.get("config")))
            if key not in keys:
                keys.append(key)
            text = f"{r['score']:.1f}" if r["arm"] == "dense" else f"{r['diff_vs_dense']:+.1f}"
            if r["arm"] != "dense" and r.get("reads") is not None:
                text += f" @ {r['reads']:.2f}"
            cell[(key, r["context"])] = text
        lines += [""] if lines else []
        lines += [f"**{model}**, KV cache {'bf16' if kv == 'auto' else kv}:", ""]
        header = ["configuration", *(f"{c // 1024}k" for c in contexts), "record"]
        body = [[cfg, *(cell.get(((p, cfg), c), "–") for c in contexts), f"`{p}`"]
                for p, cfg in keys]  # fmt: skip
        lines += table(header, body)
    return lines


def render_estimator(section: dict, loaded: list) -> list[str]:
    header = ["model", "context", "γ", "estimator", "kept", "kept / oracle", "p10 mass",
              "needle drops", "error / oracle", "drops by (layer, KV head)", "record"]  # fmt: skip
    rows = []
    for entry, data, _ in loaded:
        model = str(data.get("model", NOT_RECORDED)).split(" (")[0]
        order = (entry.get("filter") or {}).get("estimator") or []
        seen = set()
        for r in sorted(data.get("rows", []), key=lambda r: (
                r["context"], r["gamma"], order.index(r["estimator"])
                if r["estimator"] in order else len(order))):  # fmt: skip
            key = (r["context"], r["gamma"], r["estimator"])
            if not keep(r, entry.get("filter")) or key in seen:
                continue
            seen.add(key)
            drops = r.get("drops_by_layer_head") or {}
            rows.append([
                model, shape(r["context"], 1).split("×")[0], fmt(r["gamma"]),
                f"`{r['estimator']}`", fmt(r.get("kept_mean"), 3),
                fmt(r.get("kept_x_oracle"), 3), fmt(r.get("captured_p10"), 3),
                f"{r.get('needle_dropped', 0)} / {r.get('needle_lists', 0)} "
                f"({fmt(r.get('needle_dropped_pct'), 2)}%)",
                fmt(r.get("err_x_oracle"), 3),
                ", ".join(f"{k}: {v}" for k, v in drops.items()) or "–",
                f"`{entry['path']}`",
            ])  # fmt: skip
    return table(header, rows)


def render_correctness(section: dict, loaded: list) -> list[str]:
    header = ["record", "KV cache", "shape", "γ = 1: max |Δ| vs FA3 (one bf16 ulp)",
              "γ = 1: max |Δ| vs float32, Moira / FA3",
              "graph replay bitwise", "Select lists = reference (γ, estimator: equal/rows)",
              "int8 summaries: max step diff"]  # fmt: skip
    rows = []
    for entry, data, _ in loaded:
        kv = data.get("kv_cache_dtype") or ("fp8" if "fp8" in entry["path"] else "bf16")
        for case in data.get("cases", []):
            g1 = case.get("gamma_one", {})
            replay = case.get("graph_replay", {})
            bitwise = all(v.get("bitwise_equal") for v in replay.values()) if replay else None
            sel = [case["select"], *case.get("estimators", [])] if case.get("select") else []
            sel_txt = "; ".join(
                f"{s.get('gamma')}, {s.get('summary_dtype')}:{s.get('estimator')}: "
                f"{s.get('rows_equal')}/{s.get('rows_checked')}" for s in sel)  # fmt: skip
            steps = [e["summaries"].get("int8_max_step_diff")
                     for e in case.get("estimators", []) if e.get("summaries")]  # fmt: skip
            bound = g1.get("bound_one_bf16_ulp") or g1.get("bound")
            rows.append([
                f"`{entry['path']}`", "bf16" if kv == "auto" else kv, case.get("shape", "–"),
                f"{sci(g1.get('max_abs_diff_vs_fa3'))} ({sci(bound)})",
                f"{sci(g1.get('max_abs_diff_moira_vs_fp32'))} / "
                f"{sci(g1.get('max_abs_diff_fa3_vs_fp32'))}", fmt(bitwise),
                sel_txt or "–", fmt(max(steps)) if steps else "–",
            ])  # fmt: skip
    return table(header, rows)


_PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?)(?: in [\d.]+s.*)?\s*=*$")


def check_row(entry: dict, data) -> list[str]:
    p = entry["path"]
    if isinstance(data, str):  # a pytest log: its summary line
        hits = [m.group(1) for line in data.splitlines() if (m := _PYTEST_SUMMARY.match(line))]
        summary = hits[-1] if hits else NOT_RECORDED
        summary = re.sub(r",? \d+ deselected|,? \d+ warnings?", "", summary)
        return ["GPU tests (`-m gpu`)", summary]
    if isinstance(data, list):  # vLLM's own tests, one comparison per line
        moira = [r for r in data if r.get("backend") == "MOIRA"]
        ok = sum(1 for r in moira if r.get("within_tolerance"))
        gamma = moira[0].get("gamma") if moira else NOT_RECORDED
        return [
            f"vLLM's attention-backend tests, MOIRA at γ {gamma}",
            f"{ok} / {len(moira)} comparisons within tolerance",
        ]
    if "compare_gamma1_vs_dense" in data or "phases" in data:
        phases = data.get("summary") or {}
        done = ", ".join(f"{k}: {v.get('completed')}/{v.get('requests')} completed, "
                         f"{v.get('errored')} errors, {fmt(v.get('num_preemptions_delta'), 0)} "
                         "preemptions" for k, v in phases.items())  # fmt: skip
        cmp = "; ".join(f"{k.removeprefix('compare_')}: {v.get('mismatches')} of "
                        f"{v.get('compared')} outputs differ" for k, v in data.items()
                        if k.startswith("compare_"))  # fmt: skip
        return ["soak: `vllm serve` under preemption and prefix caching", f"{done}; {cmp}"]
    if "summary" in data and "runs" in data:  # e2e_moira_vllm.py
        summ = data["summary"]
        greedy = summ.get("moira_gamma1_vs_fa3_greedy") or {}
        g_same = sum(1 for v in greedy.values() if isinstance(v, dict) and v.get("identical"))
        checks = {k: v for k, v in summ.items() if k.startswith("MOIRA_") and "identical" in v}
        same = sum(1 for v in checks.values() if v["identical"])
        return ["greedy in vLLM: MOIRA at γ 1 vs FLASH_ATTN; mixed batches and prefix hits",
                f"γ 1 vs dense: {g_same} / {len(greedy)} prompts identical; MOIRA mixed "
                f"batch and prefix-cache checks: {same} / {len(checks)} identical"]  # fmt: skip
    if data.get("check") == "plugin_gamma1_vs_fa3_greedy":  # plugin mode on stock vLLM
        rows = data.get("rows", [])
        same = sum(1 for r in rows if r.get("identical"))
        diverged = ", ".join(str(r["first_divergence"]) for r in rows if not r.get("identical"))
        tokens = rows[0]["tokens"] if rows else 0
        result = (f"{same} / {len(rows)} prompts identical over {tokens} tokens; the others "
                  f"diverge at token {diverged or '–'}")  # fmt: skip
        margins = [max(r.get("dense_margin_at_divergence") or 0,
                       r.get("moira_margin_at_divergence") or 0)
                   for r in rows if not r.get("identical")]  # fmt: skip
        if margins:
            result += f", where the top two logits are within {fmt(max(margins), 4)}"
        if "plugin_tokens_equal_patched" in data:
            result += (
                "; tokens equal to the patched build's (`MOIRA`, same lease): "
                f"{fmt(data['plugin_tokens_equal_patched'])}"
            )
        return ["plugin mode on stock vLLM 0.30.0 (`CUSTOM`, V1 runner): greedy at γ 1 vs "
                "FLASH_ATTN, real weights", result]  # fmt: skip
    if "per_rank" in data:  # summaries_in_vllm.py
        pages = sum(r.get("pages", 0) for r in data["per_rank"])
        bad = sum(r.get("mismatched", 0) for r in data["per_rank"])
        return [f"page summaries recomputed from vLLM's KV cache ({data.get('estimator')}, "
                f"{data.get('summary_dtype')})",
                f"{pages} pages, {bad} differ; passed: {fmt(data.get('passed'))}"]  # fmt: skip
    return [f"`{p}`", NOT_RECORDED]


def render_checks(section: dict, loaded: list) -> list[str]:
    rows = []
    for entry, data, m in loaded:
        what, result = check_row(entry, data)
        rows.append([what, result, m["device"], m["commit"], f"`{entry['path']}`",
                     f"`{m['command']}`"])  # fmt: skip
    return table(["check", "result", "device", "commit", "record", "command"], rows)


def render_timing(section: dict, loaded: list) -> list[str]:
    header = ["shape", "estimator", "Estimate µs", "Select µs",
              "Estimate + Select µs", "Attend + Merge µs (reads)",
              "Attend % of copy rate", "dense FA3 µs", "device", "record"]  # fmt: skip
    rows = []
    for entry, data, m in loaded:
        for r in data.get("rows", []):
            if "keyq_estimate_us" in r:  # benchmarks/probes/keyq_estimate.py
                e = r["default_estimate"]
                rows.append([
                    r["shape"], f"`{e['summary_dtype']}:{e['estimator']}` (same pages)",
                    fmt(e["estimate_us"]), "–", "–", "–", "–", "–",
                    m["device"], f"`{entry['path']}`",
                ])  # fmt: skip
                rows.append([
                    r["shape"], f"key copy `keyq4c`, {r['bytes_per_page_head']:,} B per page "
                    f"and KV head at {fmt(100 * r['keyq_fraction_of_copy_bw'], 1)}% of the "
                    "copy rate", fmt(r["keyq_estimate_us"]), "–", "–", "–", "–", "–",
                    m["device"], f"`{entry['path']}`",
                ])  # fmt: skip
                continue
            for e in r.get("estimators", []):
                if not keep(e, entry.get("filter")):
                    continue
                rows.append([
                    r["shape"], f"`{e.get('summary_dtype')}:{e['estimator']}`",
                    fmt(e.get("estimate_us")),
                    fmt(e.get("select_us")), fmt(e.get("estimate_select_us")),
                    "–", "–", "–", m["device"], f"`{entry['path']}`",
                ])  # fmt: skip
                # Other launches of the same Estimate in the same run (its launch sweep).
                for label, launch in entry.get("sweep_rows", {}).items():
                    for swept in e.get("estimate_sweep", []):
                        if all(swept.get(k) == v for k, v in launch.items()):
                            rows.append([
                                r["shape"], f"`{e.get('summary_dtype')}:{e['estimator']}`, "
                                f"{label}", fmt(swept["us"]), "–", "–", "–", "–", "–",
                                m["device"], f"`{entry['path']}`",
                            ])  # fmt: skip
                            break
            if "attend_pages_merge_us" in r:
                rows.append([
                    r["shape"], "Attend `pages` + Merge", "–", "–", "–",
                    f"{fmt(r['attend_pages_merge_us'])} ({fmt(r.get('attend_kept_fraction'))})",
                    f"{fmt(100 * r.get('attend_pages_fraction_of_copy_bw', 0), 1)}%",
                    fmt(r.get("dense_fa3_us")), m["device"], f"`{entry['path']}`",
                ])  # fmt: skip
    return table(header, rows)


def render_spread(section: dict, loaded: list) -> list[str]:
    lines: list[str] = []
    for entry, data, _ in loaded:
        if entry.get("input_only"):
            continue
        methods: list[str] = []
        cells: dict = {}
        keys: list = []
        for r in data.get("rows", []):
            if not keep(r, entry.get("filter")):
                continue
            cv = "–" if r.get("cv") is None else "real" if r["cv"] == "real" else fmt(r["cv"], 1)
            k = (r["context"], r["batch"])
            if k not in keys:
                keys.append(k)
            if r["method"] not in methods:
                methods.append(r["method"])
            cells[(k, cv, r["method"])] = fmt(r.get("us_per_layer"), 1)
        cvs = sorted({cv for (_, cv, _) in cells if cv != "–"}, key=lambda c: (c == "real", c))
        body = []
        for k in keys:
            for cv in cvs:
                body.append([shape(*k), cv, *(cells.get((k, cv, mth)) or cells.get(
                    (k, "–", mth), "–") for mth in methods)])  # fmt: skip
        lines += table(["shape", "CV", *(f"`{mth}`" for mth in methods)], body)
    return lines


RENDER = {"tpot": render_tpot, "serving": render_serving, "accuracy": render_accuracy,
          "estimator": render_estimator, "correctness": render_correctness,
          "checks": render_checks, "timing": render_timing, "spread": render_spread}  # fmt: skip


# ---------------------------------------------------------------- the page


HEAD = """# Results

<!-- Generated by `python benchmarks/report.py` from the records under benchmarks/results/;
edit the manifest in benchmarks/report.py, not this page. -->

Current measurements, one table per benchmark. Speed is a ratio against dense FA3 (vLLM's
`FLASH_ATTN`) in the same run; `reads` is the fraction of KV pages Moira read. Each record's
commit, device and command come from the record, a run.json beside it or the manifest ("not
recorded" where none holds it); configuration names are [usage.md](usage.md)'s.
"""


def collect(manifest: list[dict], warn, results: Path) -> tuple[list[tuple], list[str]]:
    """(section, [(entry, data, meta)]) per section; missing non-optional records -> errors."""
    out, errors = [], []
    for section in manifest:
        loaded = []
        for entry in section["records"]:
            path = results / entry["path"]
            if not path.is_file():
                msg = f"{entry['path']}: not in benchmarks/results/"
                (warn if entry.get("optional") else errors.append)(msg)
                continue
            data = load(path)
            loaded.append((entry, data, meta(entry, data, results)))
        out.append((section, loaded))
    return out, errors


def render(manifest: list[dict] | None = None, warn=None, results: Path = RESULTS) -> str:
    """The page for ``manifest`` (default MANIFEST) from the records under ``results``."""
    manifest = MANIFEST if manifest is None else manifest
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    sections, errors = collect(manifest, warn, Path(results))
    if errors:
        raise FileNotFoundError("; ".join(errors))
    lines = [HEAD.rstrip("\n"), "", "Sections: " + ", ".join(
        f"[{s['title']}](#{slug(s['title'])})" for s, _ in sections) + ".", ""]  # fmt: skip
    for section, loaded in sections:
        lines += [f"## {section['title']}", ""]
        lines += [section["intro"], ""]
        if not loaded:
            lines += ["No current record.", ""]
            continue
        lines += RENDER[section["kind"]](section, loaded) + [""]
        for fig in section.get("figures", []):
            lines += [f"![{section['title']}]({fig})", ""]
        if section["kind"] != "checks":  # the checks table names them in its rows
            lines += ["Records:"]
            for entry, _, m in loaded:
                lines += provenance(entry, m)
            lines += [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def cited(manifest: list[dict] | None = None) -> list[str]:
    """The record paths the page cites (relative to benchmarks/results/)."""
    return [e["path"] for s in (MANIFEST if manifest is None else manifest) for e in s["records"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the page differs from what the records give")  # fmt: skip
    ap.add_argument("--out", default=str(PAGE), help="the page (default docs/results.md)")
    ap.add_argument("--results", default=str(RESULTS), help="the records' folder")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        text = render(results=Path(a.results))
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not a.check:
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    old = out.read_text() if out.is_file() else ""
    if old == text:
        print(f"{out}: up to date")
        return 0
    diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), "committed",
                                     "from records", lineterm="", n=0))  # fmt: skip
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    print(f"{out} differs from the records ({changed} lines); "
          "run `python benchmarks/report.py`:", file=sys.stderr)  # fmt: skip
    print("\n".join(diff[:40]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
