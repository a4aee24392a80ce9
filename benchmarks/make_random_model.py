# SPDX-License-Identifier: Apache-2.0
"""Write a randomly initialized Llama-architecture checkpoint (GPU host, offline).

vLLM's ``--load-format dummy`` fills weights with uniform(-1e-3, 1e-3): logits are
~1e-8, attention is flat, every page's mass ties, and the coverage rule keeps every
page at any gamma. A checkpoint with transformers' own random init (normal, std
``initializer_range`` = 0.02) has the shapes of a real model and attention that is
*not* flat, so gamma < 1 reads fewer pages. It says nothing about accuracy: the
model is untrained. Used to show per-request gamma on a live server
(``serve_smoke.py --gamma-check --load-format auto``).

    python benchmarks/make_random_model.py \\
        --config shared/gpu/models/tokenizer-smollm2/config.json \\
        --out /tmp/random-smollm2 --max-position 32768
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a Llama-architecture config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-position", type=int, default=None,
                    help="override max_position_embeddings (longer prompts)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = json.loads(Path(args.config).read_text())
    if args.max_position:
        raw["max_position_embeddings"] = args.max_position
    config = LlamaConfig(**{k: v for k, v in raw.items() if not k.startswith("_")})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "params": params, "layers": config.num_hidden_layers,
                      "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
