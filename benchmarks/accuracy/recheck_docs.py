# SPDX-License-Identifier: Apache-2.0
"""Re-run chosen documents of an exported suite on the CPU float32 reference.

For documents that an arm of the vLLM run lost (``run_accuracy_vllm.py``), this decodes the
same token ids greedily with every decode step sparse, as ``run_accuracy.py`` does, for
dense, Moira (each of ``--estimators`` at each of ``--gammas``) and the oracle coverage set
at each gamma, so a loss can be told apart: the same wrong answer in fp32 (the selection),
or only on the GPU (bf16 rounding), or dense itself wrong in fp32 (a marginal document)::

    python -m benchmarks.accuracy.recheck_docs --prompts .stage/accuracy/prompts.json \\
        --out recheck.json 'niah_multikey|4096|5' 'niah_single|2048|12'
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import data as D  # noqa: E402


def recheck(prompts: dict, ids: list[str], gammas: list[float], estimators: list[str],
            max_new: int) -> dict:  # fmt: skip
    from benchmarks.accuracy import harness as H

    docs = {d["id"]: d for d in prompts["docs"]}
    missing = [i for i in ids if i not in docs]
    if missing:
        raise SystemExit(f"recheck: not in the prompts file: {missing}")
    tok, model = H.load_model(threads=1)
    stop = tuple(prompts["stop_token_ids"])
    arms = [("dense", H.Selector("dense", None))]
    for gamma in gammas:
        arms += [(f"moira[{e}]@{gamma}", H.Selector("moira", gamma, e)) for e in estimators]
        arms.append((f"oracle@{gamma}", H.Selector("oracle", gamma)))
    out = {}
    for doc_id in ids:
        doc = docs[doc_id]
        sample = D.Sample(**doc["sample"])
        t0 = time.time()
        ids_t = H.chat_ids(tok, sample.prompt, sample.answer_prefix)
        if ids_t[0].tolist() != doc["prompt_token_ids"]:
            raise SystemExit(f"recheck: {doc_id}: the tokenizer gives other ids than the export")
        cache, first = H.prefill(model, ids_t)
        row = {"answers": sample.answers}
        for label, selector in arms:
            toks = H.generate_from(model, cache, first, max_new, selector, stop)
            text = tok.decode([t for t in toks if t not in stop])
            row[label] = {"text": text, "score": D.score(sample, text)}
        out[doc_id] = row
        print(doc_id, json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ids", nargs="+", help="document ids, e.g. 'niah_single|2048|12'")
    ap.add_argument("--prompts", required=True, help="run_accuracy_vllm export file")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.99])
    ap.add_argument("--estimators", nargs="+", default=["mvar_top4"])
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    rows = recheck(prompts, args.ids, args.gammas, args.estimators, args.max_new)
    command = "python -m benchmarks.accuracy.recheck_docs " + shlex.join(sys.argv[1:])
    record = {"command": command, "where": "CPU, float32 reference", "docs": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
