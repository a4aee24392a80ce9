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

Real text (``--dataset``): a JSONL of chat-formatted prompts that ``--make-dataset``
cuts from a ``run_accuracy_vllm`` export (haystack documents, lengths uniform in
``--min-tokens``..``--max-tokens``, each ending in its document's question), served with the
model's own weights and tokenizer through ``vllm bench serve --dataset-name custom``. For
a ``moira`` arm the read fraction comes from the server's ``/metrics`` gauge
(``vllm:moira_page_read_fraction``), sampled every 2 s while the run lasts; the dense
server's ``/metrics`` is scraped alike, so both arms serve the same client.

    python benchmarks/bench_serving.py --make-dataset serve_text.jsonl \
        --from-prompts prompts.json.gz --tokenizer MODEL_DIR
    python benchmarks/bench_serving.py --model MODEL_DIR --dataset serve_text.jsonl \
        --concurrency 1,16,32 --moira-env MOIRA_GAMMA=0.98 --out serving_text.json

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
TOKENIZER_DEFAULT = "shared/gpu/models/tokenizer-smollm2"
READ_GAUGE = "vllm:moira_page_read_fraction"
QUESTION_TOKENS = 256  # a cut document keeps its last tokens: the question and the answer cue


def make_dataset(prompts_path: str, tokenizer_dir: str, count: int, min_tokens: int,
                 max_tokens: int, seed: int) -> list[dict]:  # fmt: skip
    """Real-text serving prompts from a ``run_accuracy_vllm`` export: ``count`` prompts of
    lengths uniform in [min_tokens, max_tokens], each cut from a document at least that long
    (its chat header and haystack up to the length, then its last ``QUESTION_TOKENS`` tokens:
    the question and the assistant cue), decoded to text. ``prompt_tokens`` is the length
    re-tokenized as the server will see it."""
    import random

    from transformers import AutoTokenizer

    from benchmarks.accuracy.run_accuracy_vllm import load_json

    docs = [d["prompt_token_ids"] for d in load_json(prompts_path)["docs"]]
    if min_tokens <= QUESTION_TOKENS or max_tokens < min_tokens:
        raise SystemExit(f"--min-tokens must exceed {QUESTION_TOKENS} and --max-tokens "
                         f"must be at least --min-tokens")  # fmt: skip
    long_enough = max(len(d) for d in docs)
    if long_enough < max_tokens:
        raise SystemExit(f"--from-prompts: the longest document has {long_enough} tokens, "
                         f"fewer than --max-tokens {max_tokens}")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        n = rng.randint(min_tokens, max_tokens)
        ids = rng.choice([d for d in docs if len(d) >= n])
        cut = ids[: n - QUESTION_TOKENS] + ids[-QUESTION_TOKENS:]
        text = tok.decode(cut)
        rows.append({"prompt": text, "prompt_tokens": len(tok(text).input_ids)})
    return rows


def dataset_lengths(path: str) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["prompt_tokens"] for line in f if line.strip()]


def longest_prompt(args) -> int:
    if args.dataset:
        return max(dataset_lengths(args.dataset))
    mean_len, ratio = SETS[args.set]
    return int(mean_len * (1 + ratio))


def parse_read_gauge(text: str) -> float | None:
    """The Moira read-fraction gauge's value in a Prometheus text page (None if absent)."""
    for line in text.splitlines():
        if line.startswith(READ_GAUGE):
            return float(line.rsplit(" ", 1)[1])
    return None


class ReadFractionSampler:
    """Samples the server's read-fraction gauge every ``period`` s while a run lasts (a
    thread). The gauge covers the last few decode steps and keeps its value while idle, so
    the mean of the samples is the run's read fraction. Every arm is scraped alike, so that
    the API server's work for ``/metrics`` is the same in both; a dense server has no gauge
    and gives no samples."""

    def __init__(self, base: str, period: float = 2.0) -> None:
        import threading

        self.url, self.period = base + "/metrics", period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as page:
                    value = parse_read_gauge(page.read().decode())
            except OSError:
                continue
            if value is not None:
                self.samples.append(value)

    def __enter__(self) -> ReadFractionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        samples = self.samples
        return {"mean": statistics.fmean(samples), "median": statistics.median(samples),
                "samples": len(samples)}  # fmt: skip


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def parse_env(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--moira-env must be NAME=VALUE,... got {text!r}")
    return dict(pairs)  # type: ignore[arg-type]


def dataset_args(args) -> list[str]:
    """``vllm bench serve``'s prompt source: random ids of the set's lengths, or the
    ``--dataset`` texts (already chat-formatted, so no template is applied again)."""
    if getattr(args, "dataset", None):
        return ["--dataset-name", "custom", "--dataset-path", args.dataset,
                "--custom-output-len", str(args.output_len), "--skip-chat-template"]  # fmt: skip
    mean_len, ratio = SETS[args.set]
    return ["--dataset-name", "random",
            "--random-input-len", str(mean_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", json.dumps({"input": ratio, "output": 0.0})]  # fmt: skip


def bench_command(args, base: str, concurrency: int, result_dir: str, name: str) -> list[str]:
    return vllm_exe() + [
        "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", args.model,
        "--tokenizer", args.tokenizer, *dataset_args(args),
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
    max_len = longest_prompt(args) + args.output_len + 64
    weights = [] if args.dataset else ["--load-format", "dummy"]  # real text: real weights
    serve = vllm_exe() + [
        "serve", args.model, *weights, "--tokenizer", args.tokenizer,
        "--block-size", "64", "--max-model-len", str(max_len), "--no-enable-prefix-caching",
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-num-seqs", str(max(int(c) for c in args.concurrency.split(","))),
        "--seed", "0", "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip
    if arm == "dense":
        serve += ["--attention-backend", "FLASH_ATTN"]
    command = " ".join(f"{k}={v}" for k, v in extra_env.items()) + " " + " ".join(serve)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
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
                    with open(bench_log, "w") as out, ReadFractionSampler(base) as reads:
                        run = subprocess.run(bench, env=env, stdout=out,
                                             stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
                    rc = run.returncode
                    result_path = Path(result_dir) / name
                    if rc != 0 or not result_path.exists():
                        raise RuntimeError(f"bench serve rc={rc} (see {bench_log})")
                    result = json.loads(result_path.read_text())
                row = {
                    "model": Path(args.model).name,
                    "set": None if args.dataset else args.set,
                    "arm": arm,
                    "concurrency": concurrency,
                    "num_prompts": result.get("num_prompts", result.get("completed")),
                    "completed": result.get("completed"),
                    "output_tok_s": result.get("output_throughput"),
                    "median_tpot_ms": result.get("median_tpot_ms"),
                    "p90_tpot_ms": result.get("p90_tpot_ms"),
                    "median_ttft_ms": result.get("median_ttft_ms"),
                    "duration_s": result.get("duration"),
                    "moira_read_fraction": reads.summary(),
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
    p.add_argument("--tokenizer", default=TOKENIZER_DEFAULT)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--port", type=int, default=8041)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detailed", action="store_true",
                   help="also record each request's input length and TTFT")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=570.0,
                   help="whole invocation, every arm's server start included (with real "
                   "weights about 150 s each on one H200); an arm whose server is not up "
                   "before the budget ends is reported as failed")  # fmt: skip
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--out", default="benchmarks/results/serving_h200.json")
    p.add_argument("--merge", nargs="+", help="join result JSONs into --out (no GPU)")
    p.add_argument("--dataset", help="real text: a JSONL from --make-dataset (the model's own "
                   "weights and tokenizer; --set is then unused)")  # fmt: skip
    p.add_argument("--make-dataset", metavar="OUT", help="write a --dataset JSONL and exit (CPU)")
    p.add_argument("--from-prompts", help="--make-dataset: a run_accuracy_vllm export")
    p.add_argument("--count", type=int, default=256, help="--make-dataset: prompts")
    p.add_argument("--min-tokens", type=int, default=4096, help="--make-dataset: shortest")
    p.add_argument("--max-tokens", type=int, default=30720, help="--make-dataset: longest")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.make_dataset:
        if not args.from_prompts:
            raise SystemExit("--make-dataset needs --from-prompts (a run_accuracy_vllm export)")
        rows = make_dataset(args.from_prompts, args.tokenizer, args.count, args.min_tokens,
                            args.max_tokens, args.seed)  # fmt: skip
        Path(args.make_dataset).parent.mkdir(parents=True, exist_ok=True)
        with open(args.make_dataset, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        lens = [r["prompt_tokens"] for r in rows]
        log(f"wrote {args.make_dataset}: {len(rows)} prompts, {min(lens)}-{max(lens)} tokens")
        return
    if args.dataset and args.tokenizer == TOKENIZER_DEFAULT:
        args.tokenizer = args.model  # the served model's own tokenizer
    parse_env(args.moira_env)
    deadline = time.time() + args.budget_s
    record = {"command": "python " + " ".join(sys.argv),
              "set": None if args.dataset else args.set, "rows": []}  # fmt: skip
    if args.dataset:
        lens = dataset_lengths(args.dataset)
        record["dataset"] = {"file": Path(args.dataset).name, "prompts": len(lens),
                             "tokens_min_max": [min(lens), max(lens)]}  # fmt: skip
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
