#!/usr/bin/env python3
"""End-to-end MOIRA vs FLASH_ATTN check in vLLM 0.30 (H200, dummy weights).

Runs two engines, each in its own subprocess (engine starts cost 85-175 s, so
every scenario runs in the same engine): MOIRA at gamma=1 (MOIRA_GAMMA=1) and
FLASH_ATTN (FA3). Both use Llama-3.1-8B dummy weights (deterministic dummy
init, so both engines see the same weights), block_size=64, token-id prompts,
skip_tokenizer_init, FULL_AND_PIECEWISE CUDA graphs, prefix caching enabled.

Scenarios (per engine):
  greedy  N prompts of >= 8k random tokens x 64 greedy tokens, batched,
          with top-2 logprobs per step.
  mixed   prompt 0 decodes while long prompts are added and prefilled in
          chunks (steps with decode rows and prefill rows), vs prompt 0 alone
          (from `greedy`).
  prefix  reset the prefix cache; prompt P (miss), P again (full hit),
          P' = P[:8192] + new tail (partial hit); each vs a cold run.

The parent compares MOIRA with FLASH_ATTN per prompt: first divergent token,
and the FLASH_ATTN top-1/top-2 logprob margin at that step (dummy weights give
near-uniform distributions, so a divergence at a tiny margin is a tie, not an
error), plus the smallest margin over the compared prefix. JSON -> --out.

Usage (on the GPU host, from the checkout root, after build.sh patched vLLM):
    python benchmarks/e2e_moira_vllm.py --out /tmp/e2e.json
    python benchmarks/e2e_moira_vllm.py --out o.json --backends MOIRA   # one engine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

MODEL_DEFAULT = "shared/gpu/models/Llama-3.1-8B"


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--model", default=MODEL_DEFAULT)
    ap.add_argument("--backends", default="MOIRA,FLASH_ATTN")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=8192, help="shortest prompt (>= 8192)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--timeout", type=int, default=1500, help="per engine subprocess, s")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one backend
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap.parse_args()


# ------------------------------------------------------------------ worker side
def _prompts(a: argparse.Namespace) -> dict[str, list[int]]:
    import numpy as np

    rng = np.random.default_rng(a.seed)
    vocab = 128256
    lens = [a.prompt_len + 600 * i + 37 * i for i in range(a.num_prompts)]
    out = {f"p{i}": rng.integers(100, vocab - 100, size=n).tolist() for i, n in enumerate(lens)}
    out["long0"] = rng.integers(100, vocab - 100, size=12288).tolist()
    out["long1"] = rng.integers(100, vocab - 100, size=12800).tolist()
    base = out["p0"]
    out["prefix_tail"] = base[:8192] + rng.integers(100, vocab - 100, size=700).tolist()
    return out


def _record(o) -> dict:
    c = o.outputs[0]
    margins, top2 = [], []
    for step in c.logprobs or []:
        vals = sorted((lp.logprob for lp in step.values()), reverse=True)
        top2.append(vals[:2])
        margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
    return {"tokens": list(c.token_ids), "top2_logprobs": top2, "margins": margins}


def _run_worker(a: argparse.Namespace) -> None:
    backend = a.worker
    res: dict = {"backend": backend, "errors": {}}
    t0 = time.time()
    from vllm import LLM, SamplingParams

    attn = {"backend": backend}
    if backend == "FLASH_ATTN":
        attn["flash_attn_version"] = 3
    kw = dict(
        model=a.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=64,
        max_model_len=a.max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=True,
        gpu_memory_utilization=a.gpu_memory_utilization,
        seed=a.seed,
        attention_config=attn,
    )
    if a.enforce_eager:
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    llm = LLM(**kw)
    eng = llm.llm_engine
    vc = eng.vllm_config
    res["engine"] = {
        "init_s": time.time() - t0,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "attention_backend": str(vc.attention_config.backend),
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "moira_env": {k: v for k, v in os.environ.items() if k.startswith("MOIRA_")},
    }
    print(f"[{backend}] engine ready: {res['engine']}", flush=True)
    prompts = _prompts(a)
    sp = SamplingParams(
        max_tokens=a.gen,
        min_tokens=a.gen,
        ignore_eos=True,
        temperature=0.0,
        logprobs=2,
        detokenize=False,
    )

    def gen(names: list[str]) -> dict:
        outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], sp, use_tqdm=False)
        return {n: _record(o) for n, o in zip(names, outs)}

    # greedy: batched, >= 8k-token prompts, cold cache.
    try:
        llm.reset_prefix_cache()
        t = time.time()
        res["greedy"] = gen([f"p{i}" for i in range(a.num_prompts)])
        res["greedy_s"] = time.time() - t
    except Exception:
        res["errors"]["greedy"] = traceback.format_exc()

    # mixed: p0 decodes while long prompts prefill in chunks (mixed steps).
    try:
        llm.reset_prefix_cache()
        preprocess = getattr(llm, "_preprocess_cmpl_one", None)

        def add(rid: str, name: str) -> None:
            prompt = {"prompt_token_ids": prompts[name]}
            inp = preprocess(prompt, None, mm_processor_kwargs=None) if preprocess else prompt
            eng.add_request(rid, inp, sp.clone() if hasattr(sp, "clone") else sp)

        add("mixed-p0", "p0")
        finished, started_long, mixed_steps = {}, False, 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            for o in outs:
                if o.finished:
                    finished[o.request_id] = _record(o)
                elif (
                    o.request_id == "mixed-p0"
                    and not started_long
                    and o.outputs
                    and len(o.outputs[0].token_ids) >= 1
                ):
                    add("mixed-long0", "long0")
                    add("mixed-long1", "long1")
                    started_long = True
            if (
                started_long
                and "mixed-p0" not in finished
                and len(finished) < 3
                and eng.has_unfinished_requests()
            ):
                mixed_steps += 1
        res["mixed"] = {"p0_in_mixed": finished.get("mixed-p0"), "steps_while_mixed": mixed_steps}
    except Exception:
        res["errors"]["mixed"] = traceback.format_exc()

    # prefix: miss vs full hit vs partial hit (block-aligned 8192-token prefix).
    try:
        llm.reset_prefix_cache()
        cold_tail = gen(["prefix_tail"])["prefix_tail"]
        llm.reset_prefix_cache()
        miss = gen(["p0"])["p0"]
        hit = gen(["p0"])["p0"]
        partial = gen(["prefix_tail"])["prefix_tail"]
        res["prefix"] = {"miss": miss, "hit": hit, "cold_tail": cold_tail, "partial_hit": partial}
    except Exception:
        res["errors"]["prefix"] = traceback.format_exc()

    with open(a.worker_out, "w") as f:
        json.dump(res, f)


# ------------------------------------------------------------------ parent side
def _compare(x: dict | None, y: dict | None) -> dict:
    """First divergence of x vs y (y = reference), with y's margins."""
    if not x or not y:
        return {"error": "missing output"}
    tx, ty = x["tokens"], y["tokens"]
    n = min(len(tx), len(ty))
    first = next((i for i in range(n) if tx[i] != ty[i]), None)
    upto = n if first is None else first + 1
    margins = [m for m in y.get("margins", [])[:upto] if m is not None]
    return {
        "identical": first is None and len(tx) == len(ty),
        "first_divergence": first,
        "ref_margin_at_divergence": (
            y["margins"][first] if first is not None and first < len(y.get("margins", [])) else None
        ),
        "top2_at_divergence": {
            "test": x["top2_logprobs"][first] if first is not None and x["top2_logprobs"] else None,
            "ref": y["top2_logprobs"][first] if first is not None and y["top2_logprobs"] else None,
        },
        "min_ref_margin_until_divergence": min(margins) if margins else None,
        "matching_prefix_tokens": first if first is not None else n,
    }


def _summarize(runs: dict) -> dict:
    s: dict = {}
    m, f = runs.get("MOIRA"), runs.get("FLASH_ATTN")
    for name, r in runs.items():
        g = r.get("greedy") or {}
        mix = (r.get("mixed") or {}).get("p0_in_mixed")
        pre = r.get("prefix") or {}
        s[f"{name}_mixed_vs_alone_p0"] = _compare(mix, g.get("p0"))
        s[f"{name}_prefix_hit_vs_miss"] = _compare(pre.get("hit"), pre.get("miss"))
        s[f"{name}_prefix_partial_vs_cold"] = _compare(pre.get("partial_hit"), pre.get("cold_tail"))
        s[f"{name}_errors"] = sorted(r.get("errors", {}))
    if m and f:
        gm, gf = m.get("greedy") or {}, f.get("greedy") or {}
        s["moira_gamma1_vs_fa3_greedy"] = {k: _compare(gm.get(k), gf.get(k)) for k in sorted(gf)}
        s["moira_vs_fa3_mixed_p0"] = _compare(
            (m.get("mixed") or {}).get("p0_in_mixed"), (f.get("mixed") or {}).get("p0_in_mixed")
        )
        s["kv_blocks"] = {
            "MOIRA": m["engine"]["num_gpu_blocks"],
            "FLASH_ATTN": f["engine"]["num_gpu_blocks"],
        }
    return s


def main() -> int:
    a = _parse()
    if a.worker:
        _run_worker(a)
        return 0
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    runs, meta = {}, {"args": vars(a), "engines": {}}
    for backend in [b.strip().upper() for b in a.backends.split(",") if b.strip()]:
        wout = os.path.join(out_dir, f".e2e_{backend}.json")
        env = dict(os.environ)
        env.pop("VLLM_ATTENTION_BACKEND", None)  # attention_config selects it
        if backend == "MOIRA":
            env["MOIRA_GAMMA"] = "1"  # dense-equivalent page set: must match FA3
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            backend,
            "--worker-out",
            wout,
        ] + [
            x
            for k, v in vars(a).items()
            if k not in ("worker", "worker_out", "out") and v not in (None, False)
            for x in (
                (f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v))
            )
        ]
        cmd += ["--out", a.out]
        t = time.time()
        print(f"== {backend}: {' '.join(cmd)}", flush=True)
        try:
            rc = subprocess.run(cmd, env=env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        meta["engines"][backend] = {"rc": rc, "wall_s": time.time() - t}
        if os.path.exists(wout):
            with open(wout) as fh:
                runs[backend] = json.load(fh)
    result = {"meta": meta, "summary": _summarize(runs), "runs": runs}
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(e["rc"] == 0 for e in meta["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
