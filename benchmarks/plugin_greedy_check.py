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
    sp = SamplingParams(max_tokens=a.gen, temperature=0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": d["prompt_token_ids"]} for d in docs], sp)
    with open(a.out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


def load_tokens(path: str) -> list[list[int]]:
    with open(path) as f:
        return json.load(f)


def compare(moira: list[list[int]], dense: list[list[int]]) -> list[dict]:
    rows = []
    for i, (x, y) in enumerate(zip(moira, dense, strict=True)):
        diverged = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        rows.append({"prompt": i, "tokens": len(x), "identical": x == y,
                     "first_divergence": diverged})  # fmt: skip
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
        moira, dense = (load_tokens(p) for p in a.compare)
        record = {"check": "plugin_gamma1_vs_fa3_greedy", "rows": compare(moira, dense),
                  "moira_tokens": moira, "dense_tokens": dense}  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
        return
    if not (a.backend and a.model and a.prompts):
        ap.error("--backend, --model and --prompts are needed (or --compare)")
    generate(a)


if __name__ == "__main__":
    main()
