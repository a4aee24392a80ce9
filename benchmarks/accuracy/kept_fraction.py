# SPDX-License-Identifier: Apache-2.0
"""Kept fraction per (layer, KV head) of Moira's coverage rule on a real model, float32.

    python -m benchmarks.accuracy.kept_fraction --model qwen2.5-coder-1.5b --context 16384 \\
        [--gamma 0.98] [--estimators int8:mvar_top8 mvar] [--last-k 4] [--device cpu|cuda] \\
        --out kept.json
    # on the GPU host, a document of the exported suite:
    python -m benchmarks.accuracy.kept_fraction --model-dir MODEL_DIR --device cuda \\
        --prompts prompts.json.gz --doc-id 'niah_single|16384|0' --out kept.json

One document (niah_single, the given haystack) is prefilled densely through transformers in
float32 (in ``--chunk`` token pieces, so no full ``T x T`` score matrix is ever held), the
last chunk with the harness in capture mode: the post-RoPE queries of the last ``--last-k``
rows and every key of every layer. For each of those rows, layer and KV head, each estimator's
page log-masses go through Select at ``--gamma`` (sink and current page always kept), and
the exact page masses (the oracle) likewise: the JSON has the kept fraction per (layer, KV
head) per estimator, averaged over the rows, and the row-level values.

Cost: one dense float32 prefill of ``--context`` tokens. On 2 CPU cores a 1.5B model takes
minutes per few thousand tokens (``--context 1024`` first to time it); ``--device cuda``
does 16k in seconds on a GPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import data as D  # noqa: E402
from benchmarks.accuracy import harness as H  # noqa: E402
from vllm_moira.v1.attention.ops import moira_reference as ref  # noqa: E402


def kept_by_head(query, keys, gamma: float, estimator: str, scale: float) -> list[float]:
    """Kept fraction of each KV head for one row (``query [H_q, D]`` at the last position of
    ``keys [H_kv, T, D]``, fp32)."""
    seq_len = keys.shape[1]
    n = ref.num_pages(seq_len)
    est, _ = H.estimate_logmass(query, keys, seq_len, scale, estimator)
    pibar = ref.group_mean_shares(est)
    return [ref.select_pages(pibar[h], gamma=gamma).numel() / n for h in range(keys.shape[0])]


@torch.no_grad()
def capture(model, ids: torch.Tensor, last_k: int, chunk: int) -> dict:
    """Dense chunked prefill; the last chunk captured (queries of its last ``last_k`` rows,
    all keys). Returns the harness's captured dict: layer -> {q, k, v}."""
    from transformers import DynamicCache

    # transformers renamed past_key_values to cache (the older name still works, deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {name: DynamicCache(), "use_cache": True, "logits_to_keep": 1}
    total = ids.shape[1]
    start = 0
    H.STATE.mode = "off"
    while total - start > chunk:
        model(input_ids=ids[:, start : start + chunk], **kv)
        start += chunk
    H.STATE.mode, H.STATE.last_k, H.STATE.captured = "capture", last_k, {}
    try:
        model(input_ids=ids[:, start:], **kv)
    finally:
        H.STATE.mode = "off"
    return H.STATE.captured


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="prepare_model.py's key")
    ap.add_argument("--model-dir", help="the HF directory (default: prepare_model.py's)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--haystack", default="essays", choices=sorted(D.HAYSTACKS))
    ap.add_argument("--doc", type=int, default=0, help="which niah_single document")
    ap.add_argument(
        "--prompts",
        help="take the document from a run_accuracy_vllm export instead (its token ids; no "
        "haystack needed, e.g. on the GPU host)",
    )
    ap.add_argument("--doc-id", help="with --prompts: the document's id, e.g. niah_single|16384|0")
    ap.add_argument("--gamma", type=float, default=0.98)
    ap.add_argument("--estimators", nargs="+", default=["int8:mvar_top8", "mvar"])
    ap.add_argument("--last-k", type=int, default=4, help="decode rows measured")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not 0.0 < args.gamma < 1.0:
        ap.error(f"--gamma must be in (0, 1), got {args.gamma}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.accuracy.run_accuracy_vllm import _prepare_module, load_json

    exported = None
    if args.prompts:  # checked before the (slow) model load
        docs = {d["id"]: d for d in load_json(args.prompts)["docs"]}
        if args.doc_id not in docs:
            ap.error(f"--doc-id {args.doc_id!r} is not in {args.prompts}")
        exported = docs[args.doc_id]
    prepare = _prepare_module()
    model_dir = Path(args.model_dir) if args.model_dir else prepare.prepare(model=args.model)
    t0 = time.time()
    tok, model = H.load_model(model_dir)
    model.to(args.device)
    t_load = time.time() - t0
    if exported is not None:
        document = exported["id"]
        haystack = exported["sample"].get("haystack", "essays")
        ids = torch.tensor([exported["prompt_token_ids"]], device=args.device)
    else:
        sample = D.ruler_samples(
            tok, "niah_single", args.context, args.doc + 1, haystacks=[args.haystack]
        )[args.doc]
        document, haystack = f"niah_single|{args.context}|{args.doc}", args.haystack
        ids = H.chat_ids(tok, sample.prompt, sample.answer_prefix).to(args.device)
    t1 = time.time()
    captured = capture(model, ids, args.last_k, args.chunk)
    t_prefill = time.time() - t1
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scale = head_dim**-0.5
    seq = ids.shape[1]
    arms = [*args.estimators, "oracle"]
    rows: dict[str, list] = {a: [] for a in arms}  # [layer][row][kv head]
    for layer in sorted(captured):
        q_rows = captured[layer]["q"].float().cpu()  # [H_q, K, D]
        keys = captured[layer]["k"].float().cpu()  # [H_kv, T, D]
        k_rows = q_rows.shape[1]
        for arm in arms:
            per_row = []
            for i in range(k_rows):
                pos = seq - k_rows + i
                per_row.append(
                    kept_by_head(q_rows[:, i], keys[:, : pos + 1], args.gamma, arm, scale)
                )
            rows[arm].append(per_row)
    mean = {
        a: [
            [sum(r[h] for r in layer) / len(layer) for h in range(len(layer[0]))]
            for layer in rows[a]
        ]
        for a in arms
    }
    overall = {a: sum(sum(x) for x in m) / sum(len(x) for x in m) for a, m in mean.items()}
    record = {
        "command": "python -m benchmarks.accuracy.kept_fraction " + " ".join(sys.argv[1:]),
        "where": f"{args.device}, float32 reference via transformers, "
        f"{torch.get_num_threads()} threads",
        "model": model_dir.name,
        "document": document,
        "haystack": haystack,
        "prompt_tokens": seq,
        "gamma": args.gamma,
        "last_k": args.last_k,
        "seconds": {
            "load": round(t_load, 1),
            "prefill": round(t_prefill, 1),
            "total": round(time.time() - t0, 1),
        },
        "kept_fraction_mean": overall,
        "kept_fraction_by_layer_head": mean,
        "kept_fraction_rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"{seq} tokens: prefill {t_prefill:.0f}s; kept at gamma {args.gamma}: "
        + ", ".join(f"{a} {v:.3f}" for a, v in overall.items())
    )


if __name__ == "__main__":
    main()
