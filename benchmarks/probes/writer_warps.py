# SPDX-License-Identifier: Apache-2.0
"""The summary writer's prefill cost on Estimate's warps (H200; not a test).

Since decode rows' filled pages are summarized by Estimate, the prefill writer
(``write_page_summaries``) runs on Estimate's warps (``moira.writer_launch``) so
that both store the same bits. This times the writer on a prefill chunk's
slot mapping (every token of ``--tokens`` tokens, so ``tokens / 64`` pages
per KV head are summarized and the other programs exit) at Llama-3.1-8B's
8 KV heads x D = 128, on 2 and 4 warps and with ``--windows`` tokens per
program (the "writer" launch override window_tokens; 1 is one program per token), in
one run, next to dense FA3's prefill attention over the same chunk (causal,
``flash_attn_varlen_func``), for scale. Per layer; median of CUDA-graph
replays as moira_correctness.py. Every launch's summaries are compared with
the tree launch's, bit for bit (``same_bits_as_tree``).

    python benchmarks/probes/writer_warps.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm.v1.attention.backends import moira  # noqa: E402

from benchmarks.moira_correctness import graph_time_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, moira.MOIRA_PAGE_SIZE
SUMMARIES = ("int8:mvar", "int8:mvar_top8", "bfloat16:mvar_top8")


def fa3_prefill_us(tokens: int) -> float | None:
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)

    def run():
        flash_attn_varlen_func(q, k, v, max_seqlen_q=tokens, cu_seqlens_q=cu,
                               max_seqlen_k=tokens, cu_seqlens_k=cu, causal=True,
                               fa_version=3)  # fmt: skip

    return graph_time_us(run, reps=5, iters=9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="prefill chunk (tokens)")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--windows", default="1,16,64,256", help="tokens per writer program")
    args = ap.parse_args()
    pages = args.tokens // PAGE
    num_blocks = pages + 1  # block 0 is vLLM's null block
    kv = torch.randn(num_blocks, HKV, PAGE, 2 * D, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(PAGE, PAGE + args.tokens, device="cuda", dtype=torch.int64)
    default_warps = moira.writer_launch().num_warps
    default_window = moira.writer_launch().window_tokens
    rows = []
    for name in SUMMARIES:
        dtype_name, estimator = name.split(":")
        dtype, slot_rows = moira.summary_storage(moira.summary_slots(estimator), dtype_name)
        tree = torch.zeros(num_blocks, HKV, slot_rows, D, device="cuda", dtype=dtype)
        moira.write_page_summaries(kv, tree, slots)
        for warps in (int(w) for w in args.warps.split(",")):
            for window in (int(w) for w in args.windows.split(",")):
                summaries = torch.zeros_like(tree)
                launch = {"writer": {"num_warps": warps, "window_tokens": window}}
                moira.write_page_summaries(kv, summaries, slots, launch=launch)
                same = bool(torch.equal(summaries, tree))
                us = graph_time_us(lambda s=summaries, launch=launch: moira.write_page_summaries(
                    kv, s, slots, launch=launch))  # fmt: skip
                rows.append({"summaries": name, "num_warps": warps, "window_tokens": window,
                             "tokens": args.tokens, "pages_per_kv_head": pages,
                             "writer_us_per_layer": us, "same_bits_as_tree": same})  # fmt: skip
                print(f"{name:22s} {warps} warps, {window:4d}-token windows: {us:7.2f} us "
                      f"per layer ({pages} pages x {HKV} heads), same bits as the tree's: "
                      f"{same}")  # fmt: skip
    fa3 = fa3_prefill_us(args.tokens)
    if fa3 is not None:
        print(f"dense FA3 causal prefill attention, same chunk: {fa3:.1f} us per layer")
    record = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "tree_num_warps": default_warps,
        "tree_window_tokens": default_window,
        "geometry": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_size": D},
        "fa3_prefill_attention_us_per_layer": fa3,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
