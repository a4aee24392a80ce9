# SPDX-License-Identifier: Apache-2.0
"""CPU-sized: RULER-style accuracy of SmolLM2-135M under Moira vs dense.

    python -m benchmarks.accuracy.run_accuracy [--contexts 2048] [--docs 2] [--max-new 12]

Every arm decodes greedily with every layer sparse at every decode step (dense prefill,
computed once per document and copied into every arm), through the float32 reference
(benchmarks/accuracy/harness.py). Token KL: the dense answer is teacher-forced on the
prefilled cache and every answer row is recomputed with every layer sparse. Documents run
in document-major order and the JSON is rewritten after each one (``"complete": false``
until the end), with pooled ``task: "all"`` rows per context.
Fixed K and Quest use the mean page count of Moira mvar gamma=0.98 on the same document,
proportional top-k its mean kept fraction (equal reads). Paired bootstrap (95%, by
document) of each arm's score minus dense. The full suite (>= 20 documents per task and
length) is meant for the H200 through vLLM; this CPU run uses ``--docs`` documents.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.accuracy import data as D
from benchmarks.accuracy import harness as H

REPO = Path(__file__).resolve().parents[2]


GAMMAS = (0.95, 0.98, 0.99)


def arms(estimators: list[str], gammas=GAMMAS) -> list[tuple[str, H.Selector]]:
    out = [("dense", H.Selector("dense", None))]
    for est in estimators:
        for g in gammas:
            out.append(("moira", H.Selector("moira", g, est)))
    out.append(("oracle", H.Selector("oracle", 0.98)))
    return out


def bootstrap(diffs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    if not diffs:
        return (float("nan"), float("nan"))
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048])
    ap.add_argument("--tasks", nargs="+", default=D.TASKS)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument(
        "--estimators",
        default="mvar",
        help="comma list of Moira estimators (gamma 0.95/0.98/0.99 each); the first one at "
        "gamma=0.98 sets the reads of the equal-read arms (fixed_k, proportional: same "
        "estimator; quest: box bound)",
    )
    ap.add_argument("--gammas", type=float, nargs="+", default=list(GAMMAS),
                    help="coverage targets of the Moira arms; 0.98 must be among them unless "
                    "--no-equal-reads")  # fmt: skip
    ap.add_argument("--no-equal-reads", action="store_true",
                    help="skip the fixed K / proportional / Quest arms (a faster run)")  # fmt: skip
    ap.add_argument("--robust", default="none", help="deprecated: adds one estimator after mvar")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/accuracy_smollm2.json"))
    args = ap.parse_args()
    estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    if args.robust not in ("", "none"):
        estimators.append(args.robust)
    ref_estimator = estimators[0]
    if not args.no_equal_reads and 0.98 not in args.gammas:
        ap.error("--gammas must include 0.98 (the equal-read arms match it), or --no-equal-reads")
    t_start = time.time()
    tok, model = H.load_model(threads=args.threads or None)
    stop = (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
    per: dict = {}  # (task, ctx, label) -> dict(scores, kls, reads, arm, gamma)
    # document-major order: a partial (killed) run still covers every task evenly
    jobs = []
    for ctx in args.contexts:
        samples = {task: D.ruler_samples(tok, task, ctx, args.docs) for task in args.tasks}
        for doc in range(args.docs):
            for task in args.tasks:
                jobs.append((ctx, task, doc, samples[task][doc]))
    for ctx, task, doc, sample in jobs:
        ids = H.chat_ids(tok, sample.prompt, sample.answer_prefix)
        # one dense prefill per document, shared (copied) by every arm
        cache, first = H.prefill(model, ids)
        dense_sel = H.Selector("dense", None)
        dense_toks = H.generate_from(model, cache, first, args.max_new, dense_sel, stop)
        ans = [t for t in dense_toks if t not in stop] or dense_toks[:1]
        dense_logits = H.forced_logits(model, cache, ans, "off")
        ref_reads = None
        run_arms = arms(estimators, args.gammas)
        equal_reads = [] if args.no_equal_reads else [
            ("fixed_k", None),
            ("proportional", None),
            ("quest", None),
        ]  # fmt: skip
        for arm, sel in run_arms + equal_reads:
            if sel is None:  # equal reads to moira <ref_estimator> 0.98 on this document
                pages, frac = ref_reads
                sel = {
                    "fixed_k": H.Selector("fixed_k", None, ref_estimator, fixed_pages=pages),
                    "proportional": H.Selector("proportional", None, ref_estimator, fraction=frac),
                    "quest": H.Selector("quest", None, "box", fixed_pages=pages),
                }[arm]
            toks = (
                dense_toks
                if arm == "dense"
                else H.generate_from(model, cache, first, args.max_new, sel, stop)
            )
            text = tok.decode([t for t in toks if t not in stop])
            sc = D.score(sample, text)
            kl, reads = None, None
            if arm != "dense":
                sparse_logits = H.forced_logits(model, cache, ans, "sparse", sel)
                kl = float(H.token_kl(dense_logits, sparse_logits).mean())
                r = torch.tensor([x[3] / x[4] for x in H.STATE.reads])
                pg = torch.tensor([float(x[3]) for x in H.STATE.reads])
                reads = float(r.mean())
                if arm == "moira" and sel.estimator == ref_estimator and sel.gamma == 0.98:
                    ref_reads = (max(2, round(float(pg.mean()))), reads)
            # equal-read arms pool under one label per arm (their K varies by document)
            label = arm if arm in ("fixed_k", "proportional", "quest") else sel.label()
            key = (task, ctx, label)
            d = per.setdefault(
                key,
                {
                    "arm": arm,
                    "gamma": sel.gamma,
                    "scores": [],
                    "kls": [],
                    "reads": [],
                    "estimator": sel.estimator,
                },
            )
            d["scores"].append(sc)
            if kl is not None:
                d["kls"].append(kl)
                d["reads"].append(reads)
        print(
            f"[{time.time() - t_start:.0f}s] {task} ctx={ctx} doc={doc} "
            f"answer={sample.answers} dense={tok.decode(ans)!r} "
            f"ref_pages={ref_reads[0] if ref_reads else None} of {-(-ids.shape[1] // H.PAGE)}",
            flush=True,
        )
        write(args, per, t_start, done=False)
    write(args, per, t_start, done=True)
    print(f"wrote {args.out}")


def summarise(d: dict, dense_scores: list[float]) -> dict:
    diffs = [100 * (a - b) for a, b in zip(d["scores"], dense_scores)]
    lo, hi = bootstrap(diffs)
    return {
        "arm": d["arm"],
        "estimator": d["estimator"] if d["arm"] == "moira" else None,
        "gamma": d["gamma"],
        "docs": len(d["scores"]),
        "score": 100 * sum(d["scores"]) / len(d["scores"]),
        "kl": sum(d["kls"]) / len(d["kls"]) if d["kls"] else None,
        "reads": sum(d["reads"]) / len(d["reads"]) if d["reads"] else None,
        "diff_vs_dense": sum(diffs) / len(diffs),
        "diff_vs_dense_ci95": [lo, hi],
    }


def write(args, per: dict, t_start: float, done: bool) -> None:
    """Per-(task, context, arm) rows plus pooled rows (task "all": every document of every
    task at that context, paired bootstrap by document). Rewritten after every document."""
    rows = []
    pooled: dict = {}
    for (task, ctx, label), d in per.items():
        dense_scores = per[(task, ctx, "dense")]["scores"][: len(d["scores"])]
        rows.append({"task": task, "context": ctx, "label": label, **summarise(d, dense_scores)})
        p = pooled.setdefault(
            (ctx, label), {**d, "scores": [], "kls": [], "reads": [], "dense": []}
        )
        p["scores"] += d["scores"]
        p["kls"] += d["kls"]
        p["reads"] += d["reads"]
        p["dense"] += dense_scores
    for (ctx, label), p in pooled.items():
        rows.append({"task": "all", "context": ctx, "label": label, **summarise(p, p["dense"])})
    out = {
        "command": "python -m benchmarks.accuracy.run_accuracy " + " ".join(sys.argv[1:]),
        "where": f"CPU ({torch.get_num_threads()} threads), float32 reference via transformers; "
        "not vLLM",
        "model": "SmolLM2-135M-Instruct",
        "complete": done,
        "seconds": round(time.time() - t_start, 1),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
