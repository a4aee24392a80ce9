# SPDX-License-Identifier: Apache-2.0
"""Where a ``mvar_top{r}`` estimate goes wrong, per (layer, KV head) (CPU, float32).

    python -m benchmarks.probes.estimator_errors [--model smollm2-135m]
        [--contexts 4096] [--haystacks essays austen mobydick]
        [--tasks niah_single niah_multikey niah_multiquery] [--last-k 16]
        [--estimator int8:mvar_top8] [--gamma 0.98] --out errors.json

On the captures of ``benchmarks.probes.estimator_study`` (made there if missing), for every
row, query head and middle page (not the sink, not the current page) it splits the error of
the page's estimated log-mass into the parts of the bulk (the keys the summary does not
store) that Eq. 2's spread term stands for:

- ``error``: estimate - exact log-mass of the page;
- ``var_ratio``: the bulk's variance summed per channel (``x^2 . sigma_b^2``, what the
  summary gives) over the variance of its logits along ``x`` (what a full covariance would
  give): above 1 where channels that vary together cancel along ``x``;
- ``variance_excess``: the REM spread term at the per-channel variance minus the term at the
  logits' own variance: what the missing covariance adds, in nats;
- ``tail_excess``: the REM spread term at the logits' own variance minus the bulk's exact
  log-mean-exp above its mean logit: what the Gaussian tail adds on top of the variance;
- per needle-attending list that drops a needle page (``estimator_study``'s definition),
  the needle page's error and the median error of the other middle pages.

Per (layer, KV head) it reports medians over rows, query heads and pages, and the drops;
the (layer, KV head) pairs with the most drops first.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.accuracy import harness as H
from benchmarks.accuracy.run_accuracy_vllm import _prepare_module
from benchmarks.probes import estimator_study as study
from benchmarks.probes import research_estimators as research
from vllm_moira.v1.attention.ops import moira_reference as ref

PARTS = ("var_ratio", "variance_excess", "tail_excess")


def bulk_decomposition(
    query: torch.Tensor, pages: torch.Tensor, r: int, scale: float
) -> dict[str, torch.Tensor]:
    """``var_ratio``, ``variance_excess`` and ``tail_excess`` of every page's bulk,
    ``[H_kv, G, n]`` each.

    ``pages`` are the full pages' keys ``[n, H_kv, 64, D]`` (float32); the bulk is what
    ``ref.summarize_key_pages_top`` leaves after the ``r`` stored keys.
    """
    n, h_kv, page, d = pages.shape
    x = query.float().view(h_kv, -1, d) * scale  # [H, G, D]
    bulk = research.bulk_mask(pages, r)  # [n, H, 64]
    count = page - r
    logits = torch.einsum("hgd,nhtd->hgnt", x, pages)  # [H, G, n, 64]
    in_bulk = bulk.permute(1, 0, 2).unsqueeze(1)  # [H, 1, n, 64]
    masked = logits.masked_fill(~in_bulk, -math.inf)
    mu = torch.where(in_bulk, logits, 0.0).sum(-1) / count
    var_along = (torch.where(in_bulk, logits - mu.unsqueeze(-1), 0.0) ** 2).sum(-1) / count
    var_b = ref.summarize_key_pages_top(pages, r)[:, :, 1]  # [n, H, D]: the bulk's variance
    var_diag = torch.einsum("hgd,nhd->hgn", x * x, var_b)
    lme = torch.logsumexp(masked, dim=-1) - math.log(count) - mu
    return {
        "var_ratio": var_diag / var_along.clamp_min(1e-12),
        "variance_excess": ref.rem_spread(var_diag, count) - ref.rem_spread(var_along, count),
        "tail_excess": ref.rem_spread(var_along, count) - lme,
    }


def _median(xs: list[float]) -> float:
    return float(torch.tensor(xs).median()) if xs else math.nan


def analyse(blob: dict, scale: float, estimator: str, gamma: float, acc: dict, label: str):
    """Add one captured prompt's rows to ``acc[(layer, KV head)]``."""
    base, _ = ref.parse_stored_estimator(estimator)
    r = ref.TOP_ESTIMATORS[base]
    seq_total = blob["seq_len"]
    needle = study.needle_pages(blob["needle_spans"], H.PAGE)
    for layer, cap in blob["layers"].items():
        keys_all = cap["k"].float()
        q_rows = cap["q"].float()
        h_kv, _, d = keys_all.shape
        n_full = seq_total // H.PAGE
        summ = H.page_summaries_for(keys_all, n_full, estimator)
        pages = keys_all[:, : n_full * H.PAGE].reshape(h_kv, n_full, H.PAGE, d).transpose(0, 1)
        k_rows = q_rows.shape[1]
        for i in range(k_rows):
            seq_len = seq_total - k_rows + i + 1
            q = q_rows[:, i]
            n = ref.num_pages(seq_len)
            est, exact = H.estimate_logmass(q, keys_all, seq_len, scale, estimator, summ)
            parts = bulk_decomposition(q, pages[: n - 1], r, scale)  # the full middle pages
            true_share = ref.group_mean_shares(exact)
            est_share = ref.group_mean_shares(est)
            err = est - exact  # [H, G, n]
            for h in range(h_kv):
                a = acc.setdefault(
                    (layer, h),
                    {k: [] for k in ("error", *PARTS, "drops")},
                )
                a["error"] += err[h, :, 1 : n - 1].flatten().tolist()
                for k in PARTS:
                    a[k] += parts[k][h, :, 1 : n - 1].flatten().tolist()
                kept = set(ref.select_pages(est_share[h], gamma=gamma).tolist())
                share = true_share[h]
                hot = [p for p in needle if 0 < p < n - 1 and share[p] >= study.NEEDLE_SHARE]
                missed = [p for p in hot if p not in kept]
                if not missed:
                    continue
                page_err = err[h].mean(dim=0)  # mean over the G query heads
                others = [float(page_err[p]) for p in range(1, n - 1) if p not in needle]
                for p in missed:
                    a["drops"].append(
                        {
                            "prompt": label,
                            "row": i,
                            "page": p,
                            "true_share": round(float(true_share[h, p]), 4),
                            "needle_error": round(float(page_err[p]), 2),
                            "others_error_median": round(_median(others), 2),
                        }
                    )


def summarize(acc: dict) -> list[dict]:
    rows = []
    for (layer, h), a in acc.items():
        rows.append(
            {
                "layer": layer,
                "kv_head": h,
                "error_median": round(_median(a["error"]), 2),
                "error_p90": round(float(torch.tensor(a["error"]).quantile(0.9)), 2),
                "var_ratio_median": round(_median(a["var_ratio"]), 3),
                "variance_excess_median": round(_median(a["variance_excess"]), 2),
                "tail_excess_median": round(_median(a["tail_excess"]), 2),
                "needle_pages_dropped": len(a["drops"]),
                "drops": a["drops"],
            }
        )
    rows.sort(key=lambda x: (-x["needle_pages_dropped"], -x["error_median"]))
    return rows


def main() -> None:
    prepare = _prepare_module()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study.add_prompt_arguments(ap, prepare, "niah_single")
    ap.add_argument("--last-k", type=int, default=16, help="teacher-forced rows per prompt")
    ap.add_argument("--estimator", default="int8:mvar_top8", help="a mvar_top{r} estimator")
    ap.add_argument("--gamma", type=float, default=0.98)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if ref.parse_stored_estimator(args.estimator)[0] not in ref.TOP_ESTIMATORS:
        ap.error(f"--estimator must be a mvar_top{{r}} estimator, got {args.estimator!r}")
    t_start = time.time()
    tok, model = H.load_model(prepare.prepare(model=args.model), threads=args.threads or None)
    cfg = model.config
    scale = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    acc: dict = {}
    runs = [(c, hay, task) for c in args.contexts for hay in args.haystacks for task in args.tasks]
    for j, (ctx, hay, task) in enumerate(runs):
        label = f"{task}/{hay}/{ctx}/s0"
        blob = study.capture(tok, model, args.model, ctx, 0, args.last_k, task, hay)
        analyse(blob, scale, args.estimator, args.gamma, acc, label)
        print(f"[{j + 1}/{len(runs)}] {label} (total {time.time() - t_start:.0f}s)", flush=True)
    rows = summarize(acc)
    every = {k: [x for a in acc.values() for x in a[k]] for k in ("error", *PARTS)}
    out = {
        "command": "python -m benchmarks.probes.estimator_errors "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k != "out"
        ),
        "model": study.model_label(prepare.MODELS[args.model]),
        "all_pairs": {f"{k}_median": round(_median(v), 3) for k, v in every.items()},
        "layer_heads": rows,
        "seconds": round(time.time() - t_start, 1),
    }
    print("layer/head  drops  error med (p90)  var ratio  variance excess  tail excess")
    for r in rows[:8]:
        print(f"L{r['layer']}/H{r['kv_head']}  {r['needle_pages_dropped']}  {r['error_median']} "
              f"({r['error_p90']})  {r['var_ratio_median']}  {r['variance_excess_median']}  "
              f"{r['tail_excess_median']}")  # fmt: skip
    print("all pairs:", out["all_pairs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({time.time() - t_start:.0f}s)")


if __name__ == "__main__":
    main()
