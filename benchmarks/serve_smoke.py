# SPDX-License-Identifier: Apache-2.0
"""`VLLM_ATTENTION_BACKEND=MOIRA vllm serve` answers OpenAI completions (H200).

Starts the server exactly as a user would (the environment variable, no
--attention-backend and no --block-size: Moira picks 64 itself), waits for
/health, sends completion requests on loopback, checks the answers, reads the
backend and block size from the log, and stops the server. Writes a JSON record.

    python benchmarks/serve_smoke.py --out benchmarks/results/serve_smoke_h200.json

Per-request gamma (``--gamma-check``, patch 0005): one long prompt (>= 8k tokens),
greedy, 64 tokens, sent concurrently with ``vllm_xargs={"moira_gamma": 1.0}`` and
``{"moira_gamma": 0.9}``; then each gamma alone, reading the gauge
``vllm:moira_page_read_fraction`` after each phase (the server reports no per-request
fraction; the gauge covers the last decode steps, i.e. only that request); and a
``moira_gamma=1.5`` request, which must be refused with HTTP 400. With
``--dense-output`` (this script's JSON from a ``--backend FLASH_ATTN --gamma-check``
run, or a text file) it records whether the gamma=1 output equals the dense one:

    python benchmarks/serve_smoke.py --backend FLASH_ATTN --gamma-check --out dense.json
    python benchmarks/serve_smoke.py --gamma-check --dense-output dense.json --out moira.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_common import stop_server, wait_for_health

#: Gauge exported by patch 0004 for Moira's page-read fraction.
READ_FRACTION_GAUGE = "vllm:moira_page_read_fraction"
#: Tokens generated per request in the gamma check.
GAMMA_CHECK_TOKENS = 64
#: The long prompt must exceed this many tokens (prompt_tokens from the server).
GAMMA_CHECK_MIN_PROMPT_TOKENS = 8192


def http_json(url: str, payload: dict | None = None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip().startswith(("{", "[")) else body


def http_status(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, str]:
    """POST ``payload``; (HTTP status, body) also for error statuses."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def long_prompt(num_facts: int) -> str:
    """A deterministic prompt of numbered, distinct sentences (about 14 tokens
    each with Llama-style tokenizers), so attention is not trivially uniform."""
    facts = (f"Fact {i}: the code of item {i} is {(i * 7919) % 10007}." for i in range(num_facts))
    return " ".join(facts) + " Question: what is the code of item 17? Answer:"


def read_gauge(metrics_text: str, name: str = READ_FRACTION_GAUGE) -> float | None:
    """The value of a Prometheus gauge (first sample), or None if absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", re.M)
    match = pattern.search(metrics_text)
    return float(match.group(1)) if match else None


def load_dense_text(path: str) -> str:
    """The dense (FLASH_ATTN) output: this script's JSON record of a
    ``--backend FLASH_ATTN --gamma-check`` run, or a plain text file."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        return json.loads(text)["gamma_check"]["dense_text"]
    return text


def complete(base: str, model: str, prompt: str, gamma: float | None) -> dict:
    payload: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": GAMMA_CHECK_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    if gamma is not None:
        payload["vllm_xargs"] = {"moira_gamma": gamma}
    reply = http_json(base + "/v1/completions", payload, timeout=600.0)
    return {
        "gamma": gamma,
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "completion_tokens": reply["usage"]["completion_tokens"],
        "text": reply["choices"][0]["text"],
    }


def gamma_check(base: str, args: argparse.Namespace) -> dict:
    """Per-request gamma on a running server (see the module docstring)."""
    prompt = long_prompt(args.gamma_prompt_facts)
    if args.backend != "MOIRA":
        # Dense reference: the same prompt and sampling, no moira_gamma.
        dense = complete(base, args.model, prompt, None)
        ok = dense["completion_tokens"] == GAMMA_CHECK_TOKENS
        return {"dense_text": dense["text"], "dense": dense, "ok": ok}

    gammas = args.gamma_values
    result: dict = {"gammas": gammas}
    # Phase 1: the gammas in one batch (concurrent requests).
    with ThreadPoolExecutor(len(gammas)) as pool:
        together = list(pool.map(lambda g: complete(base, args.model, prompt, g), gammas))
    result["concurrent"] = together
    # Phase 2: each gamma alone; the gauge then covers only that request's steps.
    alone = []
    for gamma in gammas:
        reply = complete(base, args.model, prompt, gamma)
        time.sleep(args.gauge_settle_s)
        reply["read_fraction_after"] = read_gauge(str(http_json(base + "/metrics")))
        alone.append(reply)
    result["sequential"] = alone
    # An out-of-range gamma is a client error, refused before scheduling.
    status, body = http_status(
        base + "/v1/completions",
        {"model": args.model, "prompt": "hi", "max_tokens": 4, "vllm_xargs": {"moira_gamma": 1.5}},
    )
    result["invalid_gamma"] = {"status": status, "body": body[:500]}

    fractions = {r["gamma"]: r["read_fraction_after"] for r in alone}
    checks = {
        "prompt_long_enough": all(
            r["prompt_tokens"] >= GAMMA_CHECK_MIN_PROMPT_TOKENS for r in together
        ),
        "all_tokens_generated": all(
            r["completion_tokens"] == GAMMA_CHECK_TOKENS for r in together + alone
        ),
        "invalid_gamma_is_400": status == 400 and "moira_gamma" in body,
        # Same request alone or batched with another gamma: same greedy text.
        "batch_independent": [r["text"] for r in together] == [r["text"] for r in alone],
    }
    if 1.0 in fractions and fractions[1.0] is not None:
        checks["gamma_1_reads_every_page"] = fractions[1.0] >= 0.999
        sparse = [f for g, f in fractions.items() if g < 1.0 and f is not None]
        checks["smaller_gamma_reads_less"] = bool(sparse) and max(sparse) < fractions[1.0]
    if args.dense_output:
        dense_text = load_dense_text(args.dense_output)
        gamma_1 = [r["text"] for r in together if r["gamma"] == 1.0]
        result["dense_text"] = dense_text
        checks["gamma_1_equals_dense"] = bool(gamma_1) and all(t == dense_text for t in gamma_1)
    result["checks"] = checks
    # The requests alone are batch-1 rows: at or under the dense-row threshold
    # every page is read whatever gamma is, so gamma cannot change the reads.
    threshold = dense_batch_tokens()
    longest = max(r["prompt_tokens"] for r in together) + GAMMA_CHECK_TOKENS
    rows_read_whole = threshold is not None and longest <= threshold
    result["rows_read_whole"] = rows_read_whole
    informative = informative_checks(args.load_format, rows_read_whole)
    result["informative_checks"] = sorted(informative)
    result["ok"] = all(v for k, v in checks.items() if k not in informative)
    return result


def informative_checks(load_format: str, rows_read_whole: bool = False) -> set[str]:
    """Checks of gamma_check that are recorded but need not hold: bf16
    split-KV results may legitimately differ between batch shapes
    (batch_independent); and a smaller gamma still keeps every page
    (smaller_gamma_reads_less) on dummy weights, where every page has the same
    mass, and when the prompt is short enough that the backend reads a batch-1
    row whole (rows_read_whole: MOIRA_DENSE_BATCH_TOKENS). Every other check
    must hold for ``ok``."""
    informative = {"batch_independent"}
    if load_format == "dummy" or rows_read_whole:
        informative.add("smaller_gamma_reads_less")
    return informative


def dense_batch_tokens() -> int | None:
    """The server's dense-row threshold (MOIRA_DENSE_BATCH_TOKENS, else the
    backend's default), read as the server reads it; None where the backend
    cannot be imported."""
    try:
        from vllm.v1.attention.backends.moira import moira_config_from_env
    except ImportError:
        return None
    return moira_config_from_env().dense_batch_tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shared/gpu/models/Llama-3.1-8B")
    parser.add_argument("--tokenizer", default="shared/gpu/models/tokenizer-smollm2")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument(
        "--load-format",
        default="dummy",
        help="vLLM --load-format: dummy (default; flat attention, every page ties) or auto for a "
        "checkpoint such as benchmarks/make_random_model.py's",
    )
    parser.add_argument("--startup-timeout", type=float, default=400.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", default=None, help="server log path (default: next to --out)")
    parser.add_argument(
        "--backend",
        default="MOIRA",
        type=str.upper,
        help="VLLM_ATTENTION_BACKEND of the server (FLASH_ATTN for the dense reference)",
    )
    parser.add_argument(
        "--gamma-check", action="store_true", help="also run the per-request gamma check"
    )
    parser.add_argument(
        "--gamma-values",
        default=[1.0, 0.9],
        type=lambda text: [float(v) for v in text.split(",")],
        help="comma-separated moira_gamma values sent together (default: 1.0,0.9)",
    )
    parser.add_argument(
        "--gamma-prompt-facts",
        type=int,
        default=600,
        help="sentences in the long prompt (600: about 12k SmolLM2 or 8.4k Llama-3 tokens; "
        "the check requires >= 8192 prompt tokens)",
    )
    parser.add_argument(
        "--gauge-settle-s",
        type=float,
        default=2.0,
        help="wait after a request before reading the read-fraction gauge",
    )
    parser.add_argument(
        "--dense-output",
        default=None,
        help="dense output to compare the gamma=1 text with (JSON of a FLASH_ATTN run, or text)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    log_path = Path(args.log or Path(args.out).with_suffix(".log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ATTENTION_BACKEND=args.backend)
    command = [
        "vllm", "serve", args.model, "--load-format", args.load_format,
        "--tokenizer", args.tokenizer,
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", "32",
        "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip
    record: dict = {"command": f"VLLM_ATTENTION_BACKEND={args.backend} " + " ".join(command)}
    base = f"http://127.0.0.1:{args.port}"
    start = time.time()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_for_health(server, base, start + args.startup_timeout, log_path)
            record["startup_s"] = time.time() - start
            print(f"server up after {record['startup_s']:.0f}s", flush=True)
            answers = []
            prompts = [
                "The capital of France is",
                " ".join(["Long context keeps going."] * 900) + " Summary:",
            ]
            for prompt in prompts:
                reply = http_json(
                    base + "/v1/completions",
                    {"model": args.model, "prompt": prompt, "max_tokens": 32, "temperature": 0},
                )
                choice = reply["choices"][0]
                answers.append(
                    {
                        "prompt_chars": len(prompt),
                        "prompt_tokens": reply["usage"]["prompt_tokens"],
                        "completion_tokens": reply["usage"]["completion_tokens"],
                        "text": choice["text"],
                        "finish_reason": choice["finish_reason"],
                    }
                )
                print("completion:", answers[-1], flush=True)
            record["completions"] = answers
            time.sleep(12)  # one stats interval, so the frontend has exported the gauge
            metrics = http_json(base + "/metrics")
            record["moira_metrics"] = [
                line for line in str(metrics).splitlines() if "moira" in line.lower()
            ][:10]
            print("moira metrics:", record["moira_metrics"], flush=True)
            record["ok"] = all(a["completion_tokens"] == 32 for a in answers)
            if args.gamma_check:
                record["gamma_check"] = gamma_check(base, args)
                print("gamma check:", record["gamma_check"].get("checks"), flush=True)
                record["ok"] = record["ok"] and record["gamma_check"]["ok"]
        except Exception as error:  # recorded, and the exit code says it failed
            record["ok"] = False
            record["error"] = repr(error)
        finally:
            stop_server(server)
    text = log_path.read_text(errors="replace")
    backend = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text)
    record["backend_log_lines"] = sorted(set(backend))[:5]
    record["block_size_log"] = re.findall(r"block_size[=: ]+(\d+)", text)[:3]
    record["moira_in_log"] = "MOIRA" in text
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("ok", "backend_log_lines", "moira_in_log")}))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
