# SPDX-License-Identifier: Apache-2.0
"""Issue 6 in vLLM: the RULER-style suite on real SmolLM2-135M weights, MOIRA vs FLASH_ATTN.

The CPU harness (``run_accuracy.py``) decodes through the float32 reference and also
measures token KL; here the same documents run through vLLM on the GPU, so the suite can
cover 2k, 4k and 8k tokens with 20 documents per task. vLLM prefills with FA3 (dense), so a
teacher-forced KL is not available here: rows carry scores and reads, ``kl`` is null.

Three steps:

1. ``export`` (CPU, where the tokenizer and the essays are): every document as chat-template
   token ids plus its expected answers, to one JSON file::

       python -m benchmarks.accuracy.run_accuracy_vllm export --contexts 2048 4096 8192 \\
           --docs 20 --out .stage/accuracy/prompts.json

2. ``run`` (GPU host, vLLM 0.30 with Moira built in, the model as a local HF directory),
   once per backend; greedy, ``--max-new`` tokens::

       python -m benchmarks.accuracy.run_accuracy_vllm run --backend FLASH_ATTN \\
           --prompts prompts.json --model MODEL_DIR --out dense.json
       python -m benchmarks.accuracy.run_accuracy_vllm run --backend MOIRA \\
           --prompts prompts.json --model MODEL_DIR --out moira.json

   MOIRA arms, one ``generate`` per arm and context, switched in place with
   ``rpc_set_selector``: the coverage rule at gamma 0.95, 0.98, 0.99 (the default
   estimator), gamma 1 (every page: the bf16 noise floor against FLASH_ATTN), then the
   fixed-count selector at the read fraction that gamma 0.98 measured at the same context
   (equal reads). Reads come from Select's counters (``rpc_read_stats``), reset before
   every arm. The dense-row path
   is switched off (``MOIRA_DENSE_BATCH_TOKENS=0``) so that every row is decided by the
   arm's rule, as on the CPU.

3. ``merge`` (anywhere): scores, paired bootstrap (95%, by document) against dense, and the
   rows of ``accuracy_smollm2.json``'s schema::

       python -m benchmarks.accuracy.run_accuracy_vllm merge dense.json moira.json \\
           --out benchmarks/results/accuracy_smollm2_vllm_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import data as D  # noqa: E402
from benchmarks.accuracy.run_accuracy import bootstrap  # noqa: E402

GAMMAS = (0.95, 0.98, 0.99)
#: gamma = 1 keeps every page: dense attention through Moira's kernels. Its
#: score difference to FLASH_ATTN is the run-to-run noise of bf16 rounding
#: alone (different kernels, same math), the floor for the sparse arms' gaps.
CONTROL_GAMMA = 1.0
#: Engine knobs of the run step (SmolLM2-135M: 8,192 positions).
ENGINE_KWARGS = dict(dtype="bfloat16", block_size=64, max_model_len=8192, seed=0,
                     enable_prefix_caching=False, gpu_memory_utilization=0.8)  # fmt: skip


# --------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------
def export(args) -> None:
    from benchmarks.accuracy import harness as H

    tok, _ = H.load_model(threads=1)
    docs = []
    for ctx in args.contexts:
        for task in args.tasks:
            for doc, sample in enumerate(D.ruler_samples(tok, task, ctx, args.docs)):
                ids = H.chat_ids(tok, sample.prompt, sample.answer_prefix)[0].tolist()
                docs.append({"id": f"{task}|{ctx}|{doc}", "doc": doc, "sample": asdict(sample),
                             "prompt_token_ids": ids})  # fmt: skip
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    out = {"command": "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:]),
           "tokenizer": "SmolLM2-135M-Instruct", "stop_token_ids": stop, "docs": docs}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out) + "\n")
    longest = max(len(d["prompt_token_ids"]) for d in docs)
    print(f"wrote {args.out}: {len(docs)} documents, longest prompt {longest} tokens")


# --------------------------------------------------------------------------
# run (GPU)
# --------------------------------------------------------------------------
def _generate(llm, prompts: dict, max_new: int) -> dict[str, dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new,
                            stop_token_ids=prompts["stop_token_ids"])  # fmt: skip
    inputs = [TokensPrompt(prompt_token_ids=d["prompt_token_ids"]) for d in prompts["docs"]]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return {
        d["id"]: {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
        for d, o in zip(prompts["docs"], outputs)
    }


def run(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: collective_rpc
    if args.backend == "MOIRA":
        os.environ["MOIRA_DENSE_BATCH_TOKENS"] = "0"
    from vllm import LLM

    prompts = json.loads(Path(args.prompts).read_text())
    t0 = time.time()
    llm = LLM(model=args.model, attention_backend=args.backend, **ENGINE_KWARGS)
    command = "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:])
    record = {"command": command, "backend": args.backend, "model": args.model,
              "engine_start_s": time.time() - t0, "arms": []}  # fmt: skip

    def save() -> None:
        Path(args.out).write_text(json.dumps(record) + "\n")

    if args.backend == "FLASH_ATTN":
        arms = [{"arm": "dense", "gamma": None, "selector": None}]
    else:
        arms = [{"arm": "moira", "gamma": g, "selector": "coverage"} for g in GAMMAS]
        arms.append({"arm": "moira", "gamma": CONTROL_GAMMA, "selector": "coverage"})
        arms.append({"arm": "fixed_k", "gamma": None, "selector": "fixed"})
    moira = None
    if args.backend == "MOIRA":
        from vllm.v1.attention.backends import moira

        # The engine's settings (MOIRA_ESTIMATOR, MOIRA_SUMMARY_DTYPE, ...), so the record
        # says which estimator and summary storage made it.
        record["moira_config"] = asdict(moira.moira_config_from_env())
    for arm in arms:
        arm.update(outputs={}, pages_by_context={}, seconds=0.0)
        record["arms"].append(arm)
    # Context by context, every arm in turn: reads (Select's counters) are per
    # context, and the fixed-count arm matches the gamma 0.98 arm's reads of
    # the same context (reads fall with context, so a pooled fraction would
    # give short prompts too few pages and long ones too many).
    contexts = sorted({d["sample"]["context"] for d in prompts["docs"]})
    for ctx in contexts:
        docs = [d for d in prompts["docs"] if d["sample"]["context"] == ctx]
        subset = {"stop_token_ids": prompts["stop_token_ids"], "docs": docs}
        reads_at_098 = None
        for arm in arms:
            t_arm = time.time()
            if moira is not None:
                if arm["selector"] == "coverage":
                    changes = dict(selector="coverage", gamma=arm["gamma"], fixed_pages=None,
                                   fixed_fraction=None)  # fmt: skip
                else:  # equal reads to the coverage rule at gamma 0.98
                    arm.setdefault("fixed_fraction_by_context", {})[str(ctx)] = reads_at_098
                    changes = dict(selector="fixed", fixed_fraction=reads_at_098, fixed_pages=None)
                llm.collective_rpc(moira.rpc_set_selector, kwargs=changes)
                llm.collective_rpc(moira.rpc_read_stats, kwargs={"reset": True})
            arm["outputs"].update(_generate(llm, subset, args.max_new))
            reads = None
            if moira is not None:
                kept, total = llm.collective_rpc(moira.rpc_read_stats)[0]
                arm["pages_by_context"][str(ctx)] = [kept, total]
                reads = kept / total if total else None
                if arm["gamma"] == 0.98:
                    reads_at_098 = reads
            seconds = time.time() - t_arm
            arm["seconds"] += seconds
            print(f"[{args.backend}] {ctx:>5} {arm['arm']} gamma={arm['gamma']} reads={reads} "
                  f"{len(subset['docs'])} docs {seconds:.1f}s", flush=True)  # fmt: skip
        for arm in arms:
            pages = arm["pages_by_context"].values()
            kept, total = sum(p[0] for p in pages), sum(p[1] for p in pages)
            arm["reads"] = kept / total if total else None
        save()
    print(f"wrote {args.out}")


# --------------------------------------------------------------------------
# merge
# --------------------------------------------------------------------------
def _summary(label_arm: dict, scores: list[float], dense: list[float], reads) -> dict:
    diffs = [100 * (a - b) for a, b in zip(scores, dense)]
    lo, hi = bootstrap(diffs)
    return {
        "arm": label_arm["arm"],
        "gamma": label_arm["gamma"],
        "docs": len(scores),
        "score": 100 * sum(scores) / len(scores),
        "kl": None,
        "reads": reads,
        "diff_vs_dense": sum(diffs) / len(diffs),
        "diff_vs_dense_ci95": [lo, hi],
    }


def _reads(arm: dict, ctx: int) -> float | None:
    """The arm's read fraction at this context (Select's counters), else its pooled one."""
    pages = arm.get("pages_by_context", {}).get(str(ctx))
    if pages is not None:
        kept, total = pages
        return kept / total if total else None
    return arm.get("reads")


def merge_records(prompts: dict, runs: list[dict]) -> list[dict]:
    """Rows per (task, context, arm) and pooled per (context, arm) ("task": "all")."""
    samples = {d["id"]: D.Sample(**d["sample"]) for d in prompts["docs"]}
    arms = [a for r in runs for a in r["arms"]]
    dense = next((a for a in arms if a["arm"] == "dense"), None)
    if dense is None:
        raise SystemExit("merge: no dense arm (run --backend FLASH_ATTN first)")
    keys = sorted({(d["sample"]["task"], d["sample"]["context"]) for d in prompts["docs"]})
    rows = []
    for arm in arms:
        pooled: dict[int, tuple[list, list]] = {}
        for task, ctx in keys:
            ids = [d["id"] for d in prompts["docs"]
                   if (d["sample"]["task"], d["sample"]["context"]) == (task, ctx)]  # fmt: skip
            scores = [D.score(samples[i], arm["outputs"][i]["text"]) for i in ids]
            base = [D.score(samples[i], dense["outputs"][i]["text"]) for i in ids]
            rows.append({"task": task, "context": ctx,
                         **_summary(arm, scores, base, _reads(arm, ctx))})  # fmt: skip
            pooled.setdefault(ctx, ([], []))
            pooled[ctx][0].extend(scores)
            pooled[ctx][1].extend(base)
        for ctx, (scores, base) in sorted(pooled.items()):
            rows.append({"task": "all", "context": ctx,
                         **_summary(arm, scores, base, _reads(arm, ctx))})  # fmt: skip
    return rows


def merge(args) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    prompts = json.loads(Path(args.prompts).read_text())
    out = {
        "command": "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:]),
        "where": "vLLM 0.30 on the GPU (bf16, FA3 prefill); reads: Select's counters per arm, "
        "pooled over the documents of all contexts",
        "model": "SmolLM2-135M-Instruct",
        "sources": [r["command"] for r in runs],
        "rows": merge_records(prompts, runs),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for row in out["rows"]:
        if row["task"] == "all":
            print(f"{row['context']:>5} {row['arm']:>8} gamma={row['gamma']} "
                  f"score={row['score']:.1f} diff={row['diff_vs_dense']:+.1f} "
                  f"ci={row['diff_vs_dense_ci95']} reads={row['reads']}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    ex = sub.add_parser("export", help="documents as token ids (CPU)")
    ex.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ex.add_argument("--tasks", nargs="+", default=D.TASKS)
    ex.add_argument("--docs", type=int, default=20)
    ex.add_argument("--out", required=True)
    rn = sub.add_parser("run", help="greedy answers through vLLM (GPU)")
    rn.add_argument("--backend", choices=["FLASH_ATTN", "MOIRA"], required=True)
    rn.add_argument("--prompts", required=True)
    rn.add_argument("--model", required=True, help="local HF directory of SmolLM2-135M-Instruct")
    rn.add_argument("--max-new", type=int, default=12)
    rn.add_argument("--out", required=True)
    mg = sub.add_parser("merge", help="scores and bootstrap against dense")
    mg.add_argument("runs", nargs="+")
    mg.add_argument("--prompts", required=True)
    mg.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    {"export": export, "run": run, "merge": merge}[args.step](args)


if __name__ == "__main__":
    main()
