# SPDX-License-Identifier: Apache-2.0
"""Serving throughput, dense FA3 vs Moira (paper Table 5 protocol; H200).

Per arm, one ``vllm serve`` (Llama-3.1-8B config, dummy weights, SmolLM2
tokenizer, block size 64, prefix caching off) and, per concurrency, one
closed-loop ``vllm bench serve`` run: random prompts, ``--random-output-len``
tokens with ``--ignore-eos``. Set A: prompts of 4k-64k tokens (uniform),
set B: 64k-126k (126 x 1024 tokens). Rows: output tokens/s, median and p90 TPOT, median TTFT;
with ``--detailed`` also each request's TTFT and the run split at the last first token
(``serving_phases``): the prefill phase, which both arms spend mostly in prefill, and
the decode tail with its median inter-token latency (the served decode step).

Arms:
- ``dense``: ``--attention-backend FLASH_ATTN``.
- ``moira``: ``VLLM_ATTENTION_BACKEND=MOIRA`` with the environment given by
  ``--moira-env`` (default: the fixed-count selector at 30% of the pages, the
  paper's gamma=0.98 read fraction near set A's mean context; dummy weights
  have flat attention, where the coverage rule keeps every page).

Bounded: ``--budget-s`` covers the whole invocation; a server is always
killed; the JSON is rewritten after every run.

    python benchmarks/bench_serving.py --set A --concurrency 1,16 \\
        --out benchmarks/results/serving_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_common import stop_server, vllm_exe, wait_for_health  # noqa: E402

# (mean input length, input range ratio): uniform in mean * (1 -+ ratio).
SETS = {"A": (34816, 0.8823), "B": (97280, 0.3263)}
DEFAULT_MOIRA_ENV = "MOIRA_SELECTOR=fixed,MOIRA_FIXED_FRACTION=0.3"


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def parse_env(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--moira-env must be NAME=VALUE,... got {text!r}")
    return dict(pairs)  # type: ignore[arg-type]


def bench_command(args, base: str, concurrency: int, result_dir: str, name: str) -> list[str]:
    mean_len, ratio = SETS[args.set]
    return vllm_exe() + [
        "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", args.model,
        "--tokenizer", args.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(mean_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", json.dumps({"input": ratio, "output": 0.0}),
        "--num-prompts", str(max(args.min_prompts, args.waves * concurrency)),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(args.seed),
        "--save-result", "--result-dir", result_dir, "--result-filename", name,
        "--disable-tqdm",
    ] + (["--save-detailed"] if args.detailed else [])  # fmt: skip


def run_arm(arm: str, args, record: dict, save, deadline: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOIRA_")}
    env.pop("VLLM_ATTENTION_BACKEND", None)
    extra_env = {"VLLM_ATTENTION_BACKEND": "MOIRA", **parse_env(args.moira_env)}
    if arm == "dense":
        extra_env = {}
    env.update(extra_env)
    mean_len, ratio = SETS[args.set]
    max_len = int(mean_len * (1 + ratio)) + args.output_len + 64
    serve = vllm_exe() + [
        "serve", args.model, "--load-format", "dummy", "--tokenizer", args.tokenizer,
        "--block-size", "64", "--max-model-len", str(max_len), "--no-enable-prefix-caching",
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-num-seqs", str(max(int(c) for c in args.concurrency.split(","))),
        "--seed", "0", "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip
    if arm == "dense":
        serve += ["--attention-backend", "FLASH_ATTN"]
    command = " ".join(f"{k}={v}" for k, v in extra_env.items()) + " " + " ".join(serve)
    log_path = Path(args.log_dir) / f"serving_{arm}_server.log"
    base = f"http://127.0.0.1:{args.port}"
    start = time.time()
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(serve, env=env, stdout=server_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            wait_for_health(server, base, deadline - 60, log_path)
            log(f"[{arm}] server up after {time.time() - start:.0f} s")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                if time.time() > deadline - 30:
                    log(f"[{arm}] concurrency {concurrency}: skipped (budget)")
                    continue
                with tempfile.TemporaryDirectory() as result_dir:
                    name = f"{arm}_c{concurrency}.json"
                    bench = bench_command(args, base, concurrency, result_dir, name)
                    bench_log = Path(args.log_dir) / f"serving_{arm}_c{concurrency}.log"
                    timeout = max(10.0, deadline - time.time())
                    with open(bench_log, "w") as out:
                        run = subprocess.run(bench, env=env, stdout=out,
                                             stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
                    rc = run.returncode
                    result_path = Path(result_dir) / name
                    if rc != 0 or not result_path.exists():
                        raise RuntimeError(f"bench serve rc={rc} (see {bench_log})")
                    result = json.loads(result_path.read_text())
                row = {
                    "model": Path(args.model).name,
                    "set": args.set,
                    "arm": arm,
                    "concurrency": concurrency,
                    "num_prompts": result.get("num_prompts", result.get("completed")),
                    "completed": result.get("completed"),
                    "output_tok_s": result.get("output_throughput"),
                    "median_tpot_ms": result.get("median_tpot_ms"),
                    "p90_tpot_ms": result.get("p90_tpot_ms"),
                    "median_ttft_ms": result.get("median_ttft_ms"),
                    "duration_s": result.get("duration"),
                    "server_command": command,
                    "bench_command": " ".join(bench),
                }
                if args.detailed:
                    # Per request, in the order sent: where a TTFT difference
                    # between arms comes from (a shift of every request, or of
                    # the later ones only).
                    row["input_lens"] = result.get("input_lens")
                    row["ttfts_s"] = result.get("ttfts")
                    row.update(serving_phases(result))
                record["rows"].append(row)
                save()
                log(f"[{arm}] c={concurrency}: {row['output_tok_s']:.1f} tok/s, "
                    f"median TPOT {row['median_tpot_ms']:.2f} ms")  # fmt: skip
        except Exception as error:
            record.setdefault("errors", []).append(f"{arm}: {error!r}")
            save()
            log(f"[{arm}] FAILED: {error!r}")
        finally:
            stop_server(server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", choices=sorted(SETS), default="A")
    p.add_argument("--arms", default="dense,moira")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--waves", type=int, default=2, help="prompts = waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--moira-env", default=DEFAULT_MOIRA_ENV)
    p.add_argument("--model", default="shared/gpu/models/Llama-3.1-8B")
    p.add_argument("--tokenizer", default="shared/gpu/models/tokenizer-smollm2")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--port", type=int, default=8041)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detailed", action="store_true",
                   help="also record each request's input length and TTFT")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=570.0, help="whole invocation")
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--out", default="benchmarks/results/serving_h200.json")
    p.add_argument("--merge", nargs="+", help="join result JSONs into --out (no GPU)")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    parse_env(args.moira_env)
    deadline = time.time() + args.budget_s
    record = {"command": "python " + " ".join(sys.argv), "set": args.set, "rows": []}
    try:
        import torch

        record["gpu"] = torch.cuda.get_device_name()
    except Exception:
        record["gpu"] = None

    def save() -> None:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

    for arm in args.arms.split(","):
        if arm not in ("dense", "moira"):
            raise SystemExit(f"--arms: unknown arm {arm!r} (dense, moira)")
        run_arm(arm, args, record, save, deadline)
    record["gains"] = serving_gains(record["rows"])
    record["decode_tail_speedups"] = decode_tail_speedups(record["rows"])
    save()
    log("gains (output tok/s, moira/dense - 1):", record["gains"])
    log("decode tail (median ITL, dense/moira):", record["decode_tail_speedups"])


def serving_phases(result: dict) -> dict[str, float | int | None]:
    """Split a run at the moment the last request got its first token.

    Before it, steps mix prefill chunks with the decode rows of the requests
    already answered: their cost is mostly prefill, the same for both arms.
    After it (the decode tail), no prefill is left in a run of one wave, so
    the tail's inter-token latencies are the served decode step itself.
    Needs ``--save-detailed``'s per-request ``start_times``, ``ttfts`` and
    ``itls`` (seconds, one clock); missing ones give None values.
    """
    starts = result.get("start_times") or []
    ttfts = result.get("ttfts") or []
    itls = result.get("itls") or []
    empty = {"prefill_phase_s": None, "decode_tail_s": None,
             "decode_tail_median_itl_ms": None, "decode_tail_tokens": 0}  # fmt: skip
    if not starts or len(starts) != len(ttfts) or len(itls) != len(ttfts):
        return empty
    first_tokens = [s + t for s, t in zip(starts, ttfts)]
    prefill_end = max(first_tokens)
    tail_itls, ends = [], []
    for first, gaps in zip(first_tokens, itls):
        arrival = first
        for gap in gaps:
            arrival += gap
            if arrival > prefill_end:
                tail_itls.append(gap)
        ends.append(arrival)
    median = statistics.median(tail_itls) if tail_itls else None
    return {
        "prefill_phase_s": prefill_end - min(starts),
        "decode_tail_s": max(ends) - prefill_end,
        "decode_tail_median_itl_ms": None if median is None else 1000.0 * median,
        "decode_tail_tokens": len(tail_itls),
    }


def decode_tail_speedups(rows: list[dict]) -> dict[str, float]:
    """Dense over Moira median inter-token latency in the decode tail, per
    concurrency both arms ran with ``--detailed``."""
    itl = {(r["arm"], r["concurrency"]): r.get("decode_tail_median_itl_ms") for r in rows}
    return {
        f"c{c}": itl[("dense", c)] / itl[("moira", c)]
        for (arm, c) in itl
        if arm == "dense" and itl[("dense", c)] and itl.get(("moira", c))
    }


def serving_gains(rows: list[dict]) -> dict[str, float]:
    """Output tok/s of moira over dense, minus 1, per concurrency both arms ran."""
    by_key = {(r["arm"], r["concurrency"]): r for r in rows}
    return {
        f"c{c}": by_key[("moira", c)]["output_tok_s"] / by_key[("dense", c)]["output_tok_s"] - 1
        for (arm, c) in by_key
        if arm == "dense" and ("moira", c) in by_key
    }


def merge(paths: list[str], out: str) -> None:
    """Join the rows of runs made one after another (e.g. one arm per GPU call, when
    two server starts and both arms do not fit one call's budget). A run's errors
    are kept only for arms that no other run completed."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = [row for run in runs for row in run["rows"]]
    done = {row["arm"] for row in rows}
    errors = [e for run in runs for e in run.get("errors", []) if e.split(":")[0] not in done]
    record = {
        "command": "python benchmarks/bench_serving.py --merge " + " ".join(paths),
        "sources": [run["command"] for run in runs],
        "set": runs[0]["set"],
        "gpu": runs[0].get("gpu"),
        "rows": rows,
        "gains": serving_gains(rows),
        "decode_tail_speedups": decode_tail_speedups(rows),
    }
    if errors:
        record["errors"] = errors
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print("gains (output tok/s, moira/dense - 1):", record["gains"])


if __name__ == "__main__":
    main()
