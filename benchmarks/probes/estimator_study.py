# SPDX-License-Identifier: Apache-2.0
"""Issue 10: page-mass estimators on real SmolLM2-135M queries/keys (CPU).

    python -m benchmarks.probes.estimator_study [--contexts 4096 8192] [--prompts 2] [--last-k 16]

For needle prompts (Paul Graham essays, one needle at 50% depth + question), the
post-RoPE q/k/v of every layer at the last ``K`` prompt positions (teacher-forced
decode steps) are captured once (cached under ``benchmarks/scratch/``, git-ignored)
and every estimator x gamma is evaluated on the same rows:

- kept: mean kept fraction of pages (sink and current page included);
- captured mass: true group-mean share (oracle pi-bar) of the kept pages, mean/p10/min;
- needle drops: rows whose true share on a needle page is >= 0.05 and whose list
  drops that page (``needle_rows`` = such rows in total);
- out_err: mean relative L2 error of the attention output vs dense, per query head.

Writes ``benchmarks/results/estimator_smollm2.json`` and a heat map of the mean kept
fraction per (layer, KV head) to ``docs/img/``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.accuracy import data as D
from benchmarks.accuracy import harness as H
from vllm_moira.v1.attention.ops import moira_reference as ref

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "benchmarks" / "scratch" / "estimator_cache"
ESTIMATORS = ["oracle", "mvar", "mvar_rem", "mvar_top2", "mvar_top4", "mvar_bennett", "box"]
# earlier candidates, still selectable with --estimators: mvar_box mvar_cap vscale:2 ext:8 mvar_top1
GAMMAS = [0.95, 0.98, 0.99]
NEEDLE_SHARE = 0.05


def capture(tok, model, context: int, seed: int, last_k: int) -> dict:
    path = CACHE / f"needle_{context}_s{seed}_k{last_k}.pt"
    if path.is_file():
        return torch.load(path)
    sample, needle = D.needle_prompt(tok, context, depth=0.5, seed=seed)
    msgs = [{"role": "user", "content": sample.prompt}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    text += sample.answer_prefix
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([enc["input_ids"]])
    c0 = text.index(needle)
    c1 = c0 + len(needle)
    span = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > c0 and a < c1]
    t0 = time.time()
    H.forward_logits(model, ids, "capture", last_k)
    secs = time.time() - t0
    blob = {
        "layers": H.STATE.captured,
        "needle_tokens": (min(span), max(span)),
        "seq_len": ids.shape[1],
        "forward_s": secs,
        "answer": sample.answers[0],
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(blob, path)
    print(f"[capture] ctx={context} seed={seed}: {ids.shape[1]} tokens, {secs:.1f}s", flush=True)
    return blob


def analyse(blob: dict, scale: float, estimators, gammas, stats: dict, heat: dict) -> None:
    seq_total = blob["seq_len"]
    n0, n1 = (t // H.PAGE for t in blob["needle_tokens"])
    needle_pages = list(range(n0, n1 + 1))
    for layer, cap in blob["layers"].items():
        keys_all = cap["k"].float()
        vals_all = cap["v"].float()
        q_rows = cap["q"].float()  # [Hq, K, D]
        k_rows = q_rows.shape[1]
        n_full = seq_total // H.PAGE
        summaries = {
            e: H.page_summaries_for(keys_all, n_full, e)
            for e in estimators
            if e in ref.TOP_ESTIMATORS
        }
        for e in estimators:  # "int8:mvar_top4": the summary as stored, then read back
            base, storage = ref.parse_stored_estimator(e)
            if storage is not None:
                summaries[e] = ref.stored_summaries(
                    H.page_summaries_for(keys_all, n_full, base), storage
                )
        summaries[None] = H.page_summaries_ext(keys_all, n_full)
        for i in range(k_rows):
            seq_len = seq_total - k_rows + i + 1
            q = q_rows[:, i]
            keys = keys_all[:, :seq_len]
            vals = vals_all[:, :seq_len]
            n = ref.num_pages(seq_len)
            exact = ref.exact_page_logmass(q, keys, seq_len, scale)
            true_pibar = ref.group_mean_shares(exact)  # [H, n]
            dense = [torch.arange(n, dtype=torch.int32)] * keys.shape[0]
            o_dense, _ = ref.attend_pages(q, keys, vals, dense, seq_len, scale)
            for est_name in estimators:
                summ = summaries.get(est_name, summaries[None])
                base = ref.parse_stored_estimator(est_name)[0]
                est, _ = H.estimate_logmass(q, keys, seq_len, scale, base, summ, exact)
                pibar = ref.group_mean_shares(est)
                for gamma in gammas:
                    lists = [ref.select_pages(pibar[h], gamma=gamma) for h in range(len(pibar))]
                    o, _ = ref.attend_pages(q, keys, vals, lists, seq_len, scale)
                    err = (
                        (o - o_dense).norm(dim=-1) / o_dense.norm(dim=-1).clamp_min(1e-12)
                    ).mean()
                    s = stats.setdefault(
                        (est_name, gamma),
                        {"kept": [], "cap": [], "err": [], "needle_rows": 0, "needle_drop": 0},
                    )
                    s["err"].append(float(err))
                    for h, lst in enumerate(lists):
                        kept = set(lst.tolist())
                        s["kept"].append(len(kept) / n)
                        s["cap"].append(float(true_pibar[h, lst.long()].sum()))
                        key = (est_name, gamma, layer, h)
                        heat.setdefault(key, []).append(len(kept) / n)
                        for p in needle_pages:
                            if p < n and float(true_pibar[h, p]) >= NEEDLE_SHARE:
                                s["needle_rows"] += 1
                                s["needle_drop"] += int(p not in kept)


def quantile(xs, q):
    t = torch.tensor(xs)
    return float(torch.quantile(t, q)) if len(xs) else math.nan


def summarize(stats) -> list[dict]:
    rows = []
    for (est, gamma), s in sorted(stats.items(), key=lambda x: (x[0][0], x[0][1])):
        rows.append(
            {
                "estimator": est,
                "gamma": gamma,
                "rows": len(s["kept"]),
                "kept_mean": sum(s["kept"]) / len(s["kept"]),
                "captured_mean": sum(s["cap"]) / len(s["cap"]),
                "captured_p10": quantile(s["cap"], 0.10),
                "captured_min": min(s["cap"]),
                "needle_rows": s["needle_rows"],
                "needle_dropped": s["needle_drop"],
                "out_err_mean": sum(s["err"]) / len(s["err"]),
            }
        )
    return rows


def write_png(path: Path, grid: torch.Tensor, cell: int = 12) -> None:
    """Tiny dependency-free PNG heat map (rows = layers, cols = KV heads), viridis-like."""
    import struct
    import zlib

    stops = torch.tensor(
        [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
        dtype=torch.float32,
    )
    rows_px = []
    for r in range(grid.shape[0]):
        line = bytearray()
        for c in range(grid.shape[1]):
            v = float(grid[r, c]) * (len(stops) - 1)
            i = min(int(v), len(stops) - 2)
            f = v - i
            rgb = (stops[i] * (1 - f) + stops[i + 1] * f).round().to(torch.uint8).tolist()
            line += bytes(rgb) * cell
        rows_px += [bytes(line)] * cell
    w, h = grid.shape[1] * cell, grid.shape[0] * cell
    raw = b"".join(b"\x00" + row for row in rows_px)

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


def cv(xs: torch.Tensor) -> float:
    return float(xs.std() / xs.mean()) if xs.numel() > 1 and xs.mean() > 0 else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--prompts", type=int, default=1, help="needle prompts per context")
    ap.add_argument("--last-k", type=int, default=16)
    ap.add_argument("--estimators", nargs="+", default=ESTIMATORS)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/estimator_smollm2.json"))
    args = ap.parse_args()
    t_start = time.time()
    tok, model = H.load_model(threads=args.threads or None)
    scale = model.config.head_dim**-0.5
    results, captures = [], []
    heat_all: dict = {}
    for ctx in args.contexts:
        stats: dict = {}
        for seed in range(args.prompts):
            blob = capture(tok, model, ctx, seed, args.last_k)
            captures.append(
                {
                    "context": ctx,
                    "seed": seed,
                    "tokens": blob["seq_len"],
                    "needle_tokens": list(blob["needle_tokens"]),
                    "forward_s": round(blob["forward_s"], 1),
                }
            )
            t0 = time.time()
            analyse(blob, scale, args.estimators, GAMMAS, stats, heat_all)
            print(f"[analyse] ctx={ctx} seed={seed}: {time.time() - t0:.1f}s", flush=True)
        for row in summarize(stats):
            row["context"] = ctx
            results.append(row)
            print(json.dumps(row), flush=True)
    # heat maps + CV of kept fraction per (layer, KV head)
    n_layers = model.config.num_hidden_layers
    h_kv = model.config.num_key_value_heads
    variation = {}
    for est in ("oracle", "mvar", "mvar_top4", "mvar_top2"):
        if est not in args.estimators:
            continue
        grid = torch.zeros(n_layers, h_kv)
        per_step = []
        for layer in range(n_layers):
            for h in range(h_kv):
                vals = torch.tensor(heat_all.get((est, 0.98, layer, h), [math.nan]))
                grid[layer, h] = vals.mean()
                per_step.append(cv(vals))
        write_png(REPO / f"docs/img/kept_fraction_{est}_g098.png", grid)
        variation[est] = {
            "kept_per_layer_head": [[round(float(x), 4) for x in r] for r in grid],
            "cv_across_layers": cv(grid.mean(1)),
            "cv_across_heads_within_layer_mean": float(
                torch.tensor([cv(r) for r in grid]).nanmean()
            ),
            "cv_across_steps_mean": float(torch.tensor(per_step).nanmean()),
        }
    out = {
        "command": "python -m benchmarks.probes.estimator_study "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k != "out"
        ),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16 -> fp32, CPU)",
        "needle_share_threshold": NEEDLE_SHARE,
        "captures": captures,
        "rows": results,
        "kept_fraction_variation_gamma_0.98": variation,
        "seconds": round(time.time() - t_start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({time.time() - t_start:.0f}s)")


if __name__ == "__main__":
    main()
