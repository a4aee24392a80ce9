# SPDX-License-Identifier: Apache-2.0
"""Soak test of `vllm serve` with MOIRA under preemption and prefix caching (H200).

One phase = one server start (about 175 s) + a bounded closed-loop workload:

- ``moira1``: ``VLLM_ATTENTION_BACKEND=MOIRA``, ``MOIRA_GAMMA=1`` (dense-equivalent).
- ``dense``: ``VLLM_ATTENTION_BACKEND=FLASH_ATTN``, same flags, same workload.
- ``moira098``: MOIRA at ``MOIRA_GAMMA=0.98`` (outputs and read fraction recorded).

Server: Llama-3.1-8B with dummy weights (deterministic), SmolLM2 tokenizer,
``--block-size 64 --enable-prefix-caching`` and ``--num-gpu-blocks-override`` small
enough that the KV cache cannot hold the concurrent contexts (forces preemption).
Client: loopback only, stdlib (urllib in threads), closed loop with ``--concurrency``
workers; prompts are token-id lists of 1k-64k tokens, most sharing one of a few long
prefixes; greedy (temperature 0, ignore_eos), ``--max-tokens`` new tokens. The workload
is a pure function of ``--seed``, so phases run in separate invocations compare too.

Records per phase: requests sent / completed / errored / not run (budget), output token
ids, /metrics counters (preemptions, prefix-cache queries and hits, any ``moira`` metric
such as the page read fraction) before and after, and wall times. ``compare`` (written
whenever a ``moira1`` and a ``dense`` phase are both in the JSON): requests whose greedy
token ids differ, and the first differing position.

Bounded: ``--budget-s`` covers the whole invocation; each phase gets a deadline, stops
sending at it, and its server is always killed. The JSON is rewritten after every
phase and every 20 completions. Phases already in ``--out`` are kept (and skipped
unless ``--rerun``), so two commands of < 10 min each can build the full record:

    python benchmarks/soak_serve.py --phases moira1 --budget-s 570
    python benchmarks/soak_serve.py --phases dense --budget-s 570
    python benchmarks/soak_serve.py --quick --phases moira1,dense --budget-s 580
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_common import stop_server, vllm_exe, wait_for_health

PHASES = {
    "moira1": {"VLLM_ATTENTION_BACKEND": "MOIRA", "MOIRA_GAMMA": "1"},
    "dense": {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"},
    "moira098": {"VLLM_ATTENTION_BACKEND": "MOIRA", "MOIRA_GAMMA": "0.98"},
    # Plugin mode (stock vLLM 0.30.0 with this package installed): selected by flags, not
    # by VLLM_ATTENTION_BACKEND, which the plugin refuses.
    "plugin1": {"MOIRA_GAMMA": "1"},
}
#: The phases' own `vllm serve` flags.
PHASE_SERVE_ARGS = {
    "plugin1": ["--attention-backend", "CUSTOM",
                "--logits-processors", "vllm_moira.request_guard:MoiraRequestGuard"],
}  # fmt: skip
METRICS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# --------------------------------------------------------------------------
# Workload (deterministic in the seed)
# --------------------------------------------------------------------------
def make_workload(args) -> list[dict]:
    rng = random.Random(args.seed)
    lo, hi = args.min_len, args.max_len
    prefix_lens = [2048, 8192, 16384, 32768][: max(1, args.num_prefixes)]
    while len(prefix_lens) < args.num_prefixes:
        prefix_lens.append(rng.choice([4096, 12288, 24576]))
    prefixes = [[rng.randrange(1000, args.max_token_id) for _ in range(n)] for n in prefix_lens]
    requests = []
    for i in range(args.requests):
        # Log-uniform total length in [lo, hi]: many short, some very long.
        total = int(round(lo * (hi / lo) ** rng.random()))
        group = -1
        if rng.random() < args.shared_fraction:
            fits = [g for g, p in enumerate(prefixes) if len(p) + 64 <= total]
            if fits:
                group = rng.choice(fits)
        prefix = prefixes[group] if group >= 0 else []
        suffix = [rng.randrange(1000, args.max_token_id) for _ in range(total - len(prefix))]
        requests.append({"index": i, "prefix_group": group, "prompt": prefix + suffix})
    return requests


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------
def http(url: str, payload: dict | None = None, timeout: float = 60.0):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip().startswith(("{", "[")) else body


def scrape_metrics(base: str) -> dict:
    """Sums of the counters in METRICS (all label sets) and every line naming moira."""
    try:
        text = http(base + "/metrics", timeout=20)
    except Exception as error:
        return {"error": repr(error)}
    out: dict = {name: 0.0 for name in METRICS}
    moira_lines = []
    for line in str(text).splitlines():
        if line.startswith("#"):
            continue
        if "moira" in line.lower():
            moira_lines.append(line)
        match = re.match(r"^([\w:]+?)(_total)?(\{.*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if match and match.group(1) in out:
            out[match.group(1)] += float(match.group(4))
    out["moira_lines"] = moira_lines[:20]
    return out


# --------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------
def server_command(args, phase: str) -> list[str]:
    return vllm_exe() + [
        "serve", args.model, "--load-format", "dummy", "--tokenizer", args.tokenizer,
        "--block-size", "64", "--max-model-len", str(args.max_model_len),
        "--enable-prefix-caching", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-num-seqs",
        str(args.max_num_seqs), "--seed", "0", "--host", "127.0.0.1", "--port", str(args.port),
        *PHASE_SERVE_ARGS.get(phase, []),
    ]  # fmt: skip


# --------------------------------------------------------------------------
# One phase
# --------------------------------------------------------------------------
def run_phase(name, args, workload, deadline, record, save) -> dict:
    phase: dict = {"env": PHASES[name], "status": "starting", "requests": len(workload)}
    record["phases"][name] = phase
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOIRA_")}
    env.pop("VLLM_ATTENTION_BACKEND", None)
    env.update(PHASES[name])
    command = server_command(args, name)
    phase["command"] = (
        " ".join(f"{k}={v}" for k, v in PHASES[name].items()) + " " + " ".join(command)
    )
    log_path = Path(args.out).with_name(f"soak_{name}.log")
    base = f"http://127.0.0.1:{args.port}"
    start = time.time()
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(
            command, env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            startup_deadline = min(deadline - 30, start + args.startup_timeout)
            wait_for_health(server, base, startup_deadline, log_path)
            phase["startup_s"] = round(time.time() - start, 1)
            log(f"[{name}] server up after {phase['startup_s']}s")
            phase["metrics_before"] = scrape_metrics(base)
            phase["status"] = "running"
            save()
            run_workload(name, args, workload, base, deadline - 20, phase, save)
            phase["metrics_after"] = scrape_metrics(base)
            if args.gamma_check:
                left = deadline - time.time()
                if left > 60:
                    phase["gamma_check"] = run_gamma_check(name, base, args)
                    save()
                else:
                    # Said, not silent: the record shows the check was asked for.
                    phase["gamma_check_skipped"] = f"{left:.0f} s left in the phase (needs 60 s)"
                    log(f"[{name}] gamma check skipped: {phase['gamma_check_skipped']}")
            for key in METRICS:
                before = phase["metrics_before"].get(key, 0.0)
                after = phase["metrics_after"].get(key)
                if isinstance(after, float):
                    phase[key.split(":")[1] + "_delta"] = after - before
            phase["status"] = "done"
        except Exception as error:
            phase["status"] = "failed"
            phase["error"] = repr(error)
            log(f"[{name}] FAILED: {error!r}")
        finally:
            stop_server(server)
    phase["phase_wall_s"] = round(time.time() - start, 1)
    tail = log_path.read_text(errors="replace").splitlines()
    phase["server_log"] = str(log_path)
    backend_re = re.compile(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend")
    phase["backend_log_lines"] = sorted({m for line in tail for m in backend_re.findall(line)})[:5]
    phase["server_log_errors"] = [line for line in tail if "Error" in line or "Traceback" in line][
        :20
    ]
    save()
    return phase


def run_workload(name, args, workload, base, deadline, phase, save) -> None:
    results: dict[int, dict] = {}
    lock = threading.Lock()
    next_index = [0]
    counts = {"completed": 0, "errored": 0}
    phase["outputs"] = results
    start = time.time()

    def worker() -> None:
        while True:
            with lock:
                if next_index[0] >= len(workload) or time.time() > deadline:
                    return
                item = workload[next_index[0]]
                next_index[0] += 1
            payload = {
                "model": args.model,
                "prompt": item["prompt"],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            t0 = time.time()
            entry = {"prompt_len": len(item["prompt"]), "prefix_group": item["prefix_group"]}
            try:
                timeout = max(5.0, min(args.request_timeout, deadline - t0))
                reply = http(base + "/v1/completions", payload, timeout=timeout)
                choice = reply["choices"][0]
                entry["token_ids"] = choice.get("token_ids")
                entry["text"] = choice.get("text")
                entry["finish_reason"] = choice.get("finish_reason")
                entry["completion_tokens"] = reply.get("usage", {}).get("completion_tokens")
                ok = entry["completion_tokens"] == args.max_tokens
                entry["ok"] = ok
            except urllib.error.HTTPError as error:
                entry["ok"] = False
                entry["error"] = f"HTTP {error.code}: {error.read()[:300]!r}"
            except Exception as error:
                entry["ok"] = False
                entry["error"] = repr(error)[:300]
            entry["latency_s"] = round(time.time() - t0, 2)
            with lock:
                results[item["index"]] = entry
                counts["completed" if entry["ok"] else "errored"] += 1
                done = counts["completed"] + counts["errored"]
                phase.update(counts)
                if done % 20 == 0 or done == len(workload):
                    log(f"[{name}] {done}/{len(workload)} done ({counts['errored']} errors), "
                        f"{time.time() - start:.0f}s")  # fmt: skip
                    save()

    with ThreadPoolExecutor(args.concurrency) as pool:
        for _ in range(args.concurrency):
            pool.submit(worker)
    phase.update(counts)
    phase["not_run"] = len(workload) - len(results)
    phase["workload_wall_s"] = round(time.time() - start, 1)
    lat = sorted(e["latency_s"] for e in results.values())
    if lat:
        phase["latency_p50_s"] = lat[len(lat) // 2]
        phase["latency_max_s"] = lat[-1]


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------
def run_gamma_check(name: str, base: str, args) -> dict:
    """serve_smoke's per-request gamma check on this phase's server (after the
    workload): MOIRA phases send moira_gamma 1.0 and 0.9 together and alone and
    an invalid 1.5; the dense phase gives the reference text."""
    from benchmarks import serve_smoke

    backend = PHASES[name].get("VLLM_ATTENTION_BACKEND", "CUSTOM")
    smoke_args = serve_smoke.build_parser().parse_args(
        ["--out", "unused", "--backend", backend, "--model", args.model]
    )
    try:
        if backend == "CUSTOM":
            return plugin_gamma_check(base, smoke_args)
        return serve_smoke.gamma_check(base, smoke_args)
    except Exception as error:  # recorded, never fatal to the soak record
        log(f"[{name}] gamma check failed: {error!r}")
        return {"ok": False, "error": repr(error)}


#: Least time a phase is started with: a server start (75-200 s on the H200, the
#: first start of a machine being the slowest), the load and the gamma check.
PHASE_MIN_S = 240.0


def budget_problem(budget_s: float, todo: list[str]) -> str | None:
    """Why ``--budget-s`` cannot run the phases still to do, or None. The
    budget is split evenly over them, so each needs PHASE_MIN_S of it."""
    if not todo:
        return None
    share = budget_s / len(todo)
    if share >= PHASE_MIN_S:
        return None
    return (
        f"--budget-s {budget_s:g} leaves {share:.0f} s to each of the {len(todo)} phase(s) "
        f"still to run ({', '.join(todo)}); a phase needs at least {PHASE_MIN_S:.0f} s "
        f"(server start, load, gamma check): use --budget-s >= "
        f"{PHASE_MIN_S * len(todo):.0f} or fewer --phases (phases already done in --out "
        "are kept, so separate invocations can build one record)"
    )


def plugin_gamma_check(base: str, smoke_args) -> dict:
    """Plugin mode: the dense check's request (its text, compared with the dense phase's),
    and a request with ``moira_gamma``, which the request guard must refuse with HTTP 400
    naming the parameter (plugin mode cannot apply a request's own gamma)."""
    from benchmarks import serve_smoke

    result = serve_smoke.gamma_check(base, smoke_args)  # a backend other than MOIRA: dense's
    status, body = serve_smoke.http_status(
        base + "/v1/completions",
        {"model": smoke_args.model, "prompt": "hi", "max_tokens": 4,
         "vllm_xargs": {"moira_gamma": 0.9}},
    )  # fmt: skip
    result["moira_gamma_request"] = {"status": status, "body": body[:500]}
    result["ok"] = result["ok"] and status == 400 and "moira_gamma" in body
    return result


def compare_gamma_checks(record: dict) -> dict | None:
    """The gamma=1 request of the MOIRA gamma check, and plugin mode's request, vs the dense
    reference text; plugin mode's refusal of moira_gamma."""
    dense = record["phases"].get("dense", {}).get("gamma_check", {})
    moira = record["phases"].get("moira1", {}).get("gamma_check", {})
    plugin = record["phases"].get("plugin1", {}).get("gamma_check", {})
    if "dense_text" not in dense:
        return None
    out: dict = {}
    if "concurrent" in moira:
        gamma_1 = [r["text"] for r in moira["concurrent"] if r["gamma"] == 1.0]
        out["gamma_1_equals_dense"] = bool(gamma_1) and all(
            t == dense["dense_text"] for t in gamma_1)  # fmt: skip
        out["moira_checks"] = moira.get("checks")
    if "dense_text" in plugin:
        out["plugin_equals_dense"] = plugin["dense_text"] == dense["dense_text"]
        out["plugin_refuses_moira_gamma"] = plugin.get("ok", False)
    return out or None


def compare(record: dict, a: str, b: str) -> dict | None:
    pa, pb = record["phases"].get(a), record["phases"].get(b)
    if not pa or not pb or "outputs" not in pa or "outputs" not in pb:
        return None
    oa = {int(k): v for k, v in pa["outputs"].items()}
    ob = {int(k): v for k, v in pb["outputs"].items()}
    both = sorted(i for i in oa if i in ob and oa[i].get("token_ids") and ob[i].get("token_ids"))
    mismatches = []
    for i in both:
        ta, tb = oa[i]["token_ids"], ob[i]["token_ids"]
        if ta != tb:
            first = next(
                (k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))
            )
            mismatches.append({"index": i, "prompt_len": oa[i]["prompt_len"], "first_diff": first})
    return {
        "compared": len(both),
        "mismatches": len(mismatches),
        "mismatch_fraction": len(mismatches) / len(both) if both else None,
        "mismatch_examples": mismatches[:20],
    }


def summarize(record: dict) -> dict:
    summary = {}
    for name, phase in record["phases"].items():
        summary[name] = {
            k: phase.get(k)
            for k in ("status", "requests", "completed", "errored", "not_run",
                      "num_preemptions_delta", "prefix_cache_hits_delta",
                      "prefix_cache_queries_delta", "startup_s", "workload_wall_s")
        }  # fmt: skip
        moira = (phase.get("metrics_after") or {}).get("moira_lines")
        if moira:
            summary[name]["moira_metrics"] = moira[:5]
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phases", default="moira1,dense", help=f"comma list of {list(PHASES)}")
    p.add_argument("--quick", action="store_true", help="60 requests (default 500)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=570.0, help="whole invocation")
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=65536 - 64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--shared-fraction", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-token-id", type=int, default=40000, help="< tokenizer vocab (49152)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="shared/gpu/models/Llama-3.1-8B")
    p.add_argument("--tokenizer", default="shared/gpu/models/tokenizer-smollm2")
    p.add_argument("--max-model-len", type=int, default=66560)
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="64-token blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--request-timeout", type=float, default=400.0)
    p.add_argument("--out", default="benchmarks/results/soak_h200.json")
    p.add_argument("--rerun", action="store_true", help="rerun phases already in --out")
    p.add_argument("--gamma-check", action="store_true",
                   help="after each phase's workload: the per-request gamma check")  # fmt: skip
    args = p.parse_args()
    if args.requests is None:
        args.requests = 60 if args.quick else 500
    t_start = time.time()
    deadline_all = t_start + args.budget_s
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {unknown}; choose from {list(PHASES)}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict = {}
    if out.exists():
        try:
            record = json.loads(out.read_text())
        except ValueError:
            record = {}
    # What makes phases comparable (the workload and the server flags); budgets,
    # ports and timeouts may differ between the invocations that build one record.
    not_workload = ("rerun", "phases", "out", "gamma_check", "budget_s", "port",
                    "startup_timeout", "request_timeout")  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in not_workload}
    if record.get("workload_config") not in (None, config):
        log("workload config differs from the one in --out: starting a fresh record")
        record = {}
    record["workload_config"] = config
    record.setdefault("phases", {})

    def save() -> None:
        record["summary"] = summarize(record)
        cmp_ = compare(record, "moira1", "dense")
        if cmp_ is not None:
            record["compare_gamma1_vs_dense"] = cmp_
        gamma_cmp = compare_gamma_checks(record)
        if gamma_cmp is not None:
            record["compare_gamma_check"] = gamma_cmp
        cmp_plugin = compare(record, "plugin1", "dense")
        if cmp_plugin is not None:
            record["compare_plugin_gamma1_vs_dense"] = cmp_plugin
        cmp98 = compare(record, "moira098", "dense")
        if cmp98 is not None:
            record["compare_gamma098_vs_dense"] = cmp98
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        tmp.replace(out)

    workload = make_workload(args)
    lens = sorted(len(r["prompt"]) for r in workload)
    record["workload"] = {
        "requests": len(workload),
        "prompt_len_min": lens[0],
        "prompt_len_p50": lens[len(lens) // 2],
        "prompt_len_max": lens[-1],
        "prompt_tokens_total": sum(lens),
        "shared_prefix_requests": sum(r["prefix_group"] >= 0 for r in workload),
    }
    log("workload:", record["workload"])
    todo = [x for x in phases if args.rerun or record["phases"].get(x, {}).get("status") != "done"]
    problem = budget_problem(args.budget_s, todo)
    if problem:
        p.error(problem)
    for i, name in enumerate(todo):
        remaining = deadline_all - time.time()
        # Split what is left evenly over the phases still to run.
        share = remaining / (len(todo) - i)
        if share < PHASE_MIN_S:
            log(f"[{name}] skipped: {share:.0f}s left for it (needs >= {PHASE_MIN_S:.0f}s)")
            record["phases"].setdefault(name, {})["status"] = "skipped (budget)"
            save()
            continue
        log(f"[{name}] starting, {share:.0f}s for this phase")
        run_phase(name, args, workload, time.time() + share, record, save)
    save()
    log("summary:", json.dumps(record["summary"]))
    for key in ("compare_gamma1_vs_dense", "compare_gamma098_vs_dense"):
        if key in record:
            log(key, json.dumps({k: v for k, v in record[key].items() if k != "mismatch_examples"}))
    ok = all(record["phases"].get(x, {}).get("status") == "done" for x in phases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
