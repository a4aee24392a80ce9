# SPDX-License-Identifier: Apache-2.0
"""Which key of a dropped needle page carries its mass, and could a writer have stored it?

    python -m benchmarks.probes.drop_key_ranks CAPTURE.pt ... [--gamma 0.98] --out ranks.json

On ``estimator_study`` captures (``benchmarks/scratch/estimator_cache/*.pt``), for every list
``int8:mvar_top8`` builds that drops a needle page (the study's definition), in the query
head of the group with the largest true share of that page:

- ``page_err_nats``: estimated - exact log-mass of the page; ``norm_err_nats``: the same for
  the row's total (over-estimated other pages dilute the needle's share);
- ``keys_within_2nats``: the page's keys within 2 nats of its largest logit;
- the rank (0 = first stored) of the largest-logit key under query-blind writer orders:
  ``l2`` (mvar_top's distance from the page mean), ``z`` (per-channel standardized,
  ``ztop``), ``maha`` (Mahalanobis under the head's key covariance over the prompt), ``pc4``
  / ``pc16`` (L2 after the covariance's top 4 / 16 axes are projected out).

A rule that stores ``r`` keys catches the page only where its rank is below ``r``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.accuracy import harness as H
from benchmarks.probes import estimator_study as S
from vllm_moira.v1.attention.ops import moira_reference as ref


def descending(score: torch.Tensor) -> torch.Tensor:
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def key_orders(keys_all: torch.Tensor, pages: torch.Tensor) -> dict:
    """Query-blind orders ``[n, H, 64]`` of each page's keys (see the module docstring)."""
    allk = keys_all[:, : pages.shape[0] * H.PAGE]  # [H, T, D]
    c = allk - allk.mean(1, keepdim=True)
    ev, u = torch.linalg.eigh(c.transpose(1, 2) @ c / c.shape[1])  # ascending
    inv = u @ torch.diag_embed(1.0 / (ev + 1e-3 * ev.mean(-1, keepdim=True))) @ u.transpose(1, 2)
    dev = pages - pages.mean(-2, keepdim=True)  # [n, H, 64, D]
    z = dev / dev.pow(2).mean(-2, keepdim=True).sqrt().clamp_min(1e-6)
    orders = {
        "l2": descending(dev.pow(2).sum(-1)),
        "z": descending(z.pow(2).sum(-1)),
        "maha": descending(torch.einsum("nhtd,hde,nhte->nht", dev, inv, dev)),
    }
    for k in (4, 16):
        rest = torch.einsum("nhtd,hdk->nhtk", dev, u[:, :, :-k])
        orders[f"pc{k}"] = descending(rest.pow(2).sum(-1))
    return orders


def drops(blob: dict, gamma: float, label: str) -> list[dict]:
    seq_total = blob["seq_len"]
    needles = S.needle_pages(blob["needle_spans"], H.PAGE)
    out = []
    for layer, cap in blob["layers"].items():
        keys_all, q_rows = cap["k"].float(), cap["q"].float()
        h_kv, _, d = keys_all.shape
        k_rows, scale = q_rows.shape[1], d**-0.5
        n_full = seq_total // H.PAGE
        pages = keys_all[:, : n_full * H.PAGE].reshape(h_kv, n_full, H.PAGE, d).transpose(0, 1)
        summ = H.page_summaries_for(keys_all, n_full, "int8:mvar_top8")
        orders = key_orders(keys_all, pages)
        for i in range(k_rows):
            seq_len = seq_total - k_rows + i + 1
            q = q_rows[:, i]
            n = ref.num_pages(seq_len)
            exact = ref.exact_page_logmass(q, keys_all[:, :seq_len], seq_len, scale)
            true = ref.group_mean_shares(exact)
            est = ref.top_page_logmass(q, summ[torch.arange(n).clamp_max(n_full - 1)], scale)
            est[..., 0], est[..., n - 1] = exact[..., 0], exact[..., n - 1]
            pib = ref.group_mean_shares(est)
            x = q.view(h_kv, -1, d) * scale
            for h in range(h_kv):
                kept = set(ref.select_pages(pib[h], gamma=gamma).tolist())
                for p in needles:
                    if p >= n - 1 or float(true[h, p]) < S.NEEDLE_SHARE or p in kept:
                        continue
                    head_share = torch.softmax(exact[h], -1)[:, p]
                    g = int(head_share.argmax())
                    lg = x[h, g] @ pages[p, h].T  # [64]
                    t = int(lg.argmax())
                    out.append({
                        "prompt": label, "layer": layer, "kv_head": h, "row": i, "page": p,
                        "true_share": round(float(true[h, p]), 4),
                        "est_share": round(float(pib[h, p]), 5),
                        "page_err_nats": round(float(est[h, g, p] - exact[h, g, p]), 2),
                        "norm_err_nats": round(float(torch.logsumexp(est[h, g], -1)
                                                     - torch.logsumexp(exact[h, g], -1)), 2),
                        "keys_within_2nats": int((lg > lg[t] - 2).sum()),
                        "top_logit_above_page_mean": round(float(lg[t] - lg.mean()), 2),
                        "rank": {k: int((o[p, h] == t).nonzero()[0, 0]) for k, o in orders.items()},
                    })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--gamma", type=float, default=0.98)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for path in args.captures:
        rows += drops(torch.load(path), args.gamma, path.rsplit("/", 1)[-1].removesuffix(".pt"))
    record = {"command": "python -m benchmarks.probes.drop_key_ranks " + " ".join(sys.argv[1:]),
              "gamma": args.gamma, "drops": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{len(rows)} dropped needle lists -> {args.out}")


if __name__ == "__main__":
    main()
