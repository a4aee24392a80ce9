# SPDX-License-Identifier: Apache-2.0
"""Greedy tokens of one engine on real text, for the plugin-mode check on stock vLLM.

Run once with ``--backend CUSTOM`` (stock vLLM 0.30.0 with this package pip-installed:
the plugin registers Moira as CUSTOM; its request guard is passed as vLLM requires in plugin
mode), once with ``--backend FLASH_ATTN`` and, on the patched build, ``--backend MOIRA``;
then ``--compare`` each Moira output with the dense one (``run_gpu.sh plugin-check``)::

    MOIRA_GAMMA=1 MOIRA_DENSE_BATCH_TOKENS=0 python benchmarks/plugin_greedy_check.py \\
        --backend CUSTOM --model MODEL_DIR --prompts prompts.json.gz --out custom.json
    python benchmarks/plugin_greedy_check.py --backend FLASH_ATTN ... --out dense.json
    python benchmarks/plugin_greedy_check.py --compare custom.json dense.json --out RECORD.json

The prompts are the first ``--num-prompts`` documents of a run_accuracy_vllm export whose
length lies in [--min-tokens, --max-tokens].
"""

from __future__ import annotations

import argparse
import gzip
import json

REQUEST_GUARD = "vllm_moira.request_guard:MoiraRequestGuard"


def generate(a: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    opener = gzip.open if a.prompts.endswith(".gz") else open
    with opener(a.prompts, "rt") as f:
        docs = json.load(f)["docs"]
    docs = [d for d in docs if a.min_tokens < len(d["prompt_token_ids"]) < a.max_tokens]
    docs = docs[: a.num_prompts]
    kw = dict(model=a.model, skip_tokenizer_init=True, block_size=64,
              max_model_len=a.max_tokens + 256, gpu_memory_utilization=0.5,
              enable_prefix_caching=False, seed=0, attention_backend=a.backend)  # fmt: skip
    if a.backend == "CUSTOM":
        kw["logits_processors"] = [REQUEST_GUARD]
    llm = LLM(**kw)
    # The two most likely tokens of every step: where two engines part, the margin
    # between them tells a near tie (bf16 rounding decides it) from a real difference.
    sp = SamplingParams(max_tokens=a.gen, temperature=0, ignore_eos=True, detokenize=False,
                        logprobs=2)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": d["prompt_token_ids"]} for d in docs], sp)
    result = []
    for o in outs:
        steps = o.outputs[0].logprobs or []
        top2 = [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]
                for step in steps]  # fmt: skip
        result.append({"tokens": list(o.outputs[0].token_ids), "top2": top2})
    with open(a.out, "w") as f:
        json.dump(result, f)


def load_outputs(path: str) -> list[dict]:
    """One engine's outputs: [{"tokens", "top2"}], or bare token lists."""
    with open(path) as f:
        data = json.load(f)
    return [x if isinstance(x, dict) else {"tokens": x, "top2": []} for x in data]


def margin_at(output: dict, step: int | None) -> float | None:
    """Log-probability gap between the two most likely tokens at ``step``."""
    if step is None or step >= len(output["top2"]) or len(output["top2"][step]) < 2:
        return None
    (_, first), (_, second) = output["top2"][step][:2]
    return first - second


def compare(moira: list[dict], dense: list[dict]) -> list[dict]:
    rows = []
    for i, (x, y) in enumerate(zip(moira, dense, strict=True)):
        a, b = x["tokens"], y["tokens"]
        diverged = next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), None)
        rows.append({"prompt": i, "tokens": len(a), "identical": a == b,
                     "first_divergence": diverged,
                     "dense_margin_at_divergence": margin_at(y, diverged),
                     "moira_margin_at_divergence": margin_at(x, diverged)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["CUSTOM", "MOIRA", "FLASH_ATTN"])
    ap.add_argument("--model")
    ap.add_argument("--prompts")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--compare", nargs=2, metavar=("MOIRA_JSON", "DENSE_JSON"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.compare:
        moira, dense = (load_outputs(p) for p in a.compare)
        record = {"check": "gamma1_vs_fa3_greedy", "rows": compare(moira, dense),
                  "moira_tokens": [x["tokens"] for x in moira],
                  "dense_tokens": [x["tokens"] for x in dense]}  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
        return
    if not (a.backend and a.model and a.prompts):
        ap.error("--backend, --model and --prompts are needed (or --compare)")
    generate(a)


if __name__ == "__main__":
    main()
