# SPDX-License-Identifier: Apache-2.0
"""Scratch lab: fast evaluation of candidate page-mass estimators on the
cached SmolLM2 captures of ``benchmarks.probes.estimator_study`` (no model load).

    python -m benchmarks.probes.estimator_lab --context 4096 --est mvar top:2:dev ...

Per-page exact log-masses and per-page partial outputs are computed once per row, so
any page list's output is a masked LSE merge (same numbers as ``ref.attend_pages``).
Estimators take ``x = s q`` ``[H, G, D]`` and the page keys ``[H, N, 64, D]`` of the
full pages and return ``[H, G, N]``; the summary each one needs is computed inside.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from vllm_moira.v1.attention.ops import moira_reference as ref

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "benchmarks" / "scratch" / "estimator_cache"
P = 64
LOG_P = math.log(P)


# ---------------------------------------------------------------- estimators
REM = {"on": False, "c": 1.0}


def spread_term(v, count=P):
    """0.5 v (Gaussian) or, with REM on, the random-energy-model form: 0.5 v below
    sigma_c^2 = 2 ln(count) (times c^2), sigma_c sqrt(v) - 0.5 sigma_c^2 above."""
    if not REM["on"]:
        return 0.5 * v
    sc = REM["c"] * math.sqrt(2 * math.log(count))
    return torch.where(v <= sc * sc, 0.5 * v, sc * v.clamp_min(0).sqrt() - 0.5 * sc * sc)


def _mvar(x, mu, var, count=P):
    return (
        torch.einsum("hgd,hnd->hgn", x, mu)
        + spread_term(torch.einsum("hgd,hnd->hgn", x * x, var), count)
        + math.log(count)
    )


def est_mvar(x, pages, alpha=1.0):
    mu = pages.mean(2)
    var = pages.var(2, unbiased=False)
    return _mvar(x, mu, alpha * var)


def est_fullcov(x, pages):
    mu = pages.mean(2)
    c = pages - mu.unsqueeze(2)
    proj = torch.einsum("hgd,hnkd->hgnk", x, c)
    return torch.einsum("hgd,hnd->hgn", x, mu) + spread_term((proj**2).mean(-1)) + LOG_P


def pick_keys(pages, r, crit):
    """Indices [H, N, r] of the r stored keys of each page."""
    mu = pages.mean(2, keepdim=True)
    if crit == "norm":
        score = pages.norm(dim=-1)
    elif crit == "dev":
        score = (pages - mu).norm(dim=-1)
    elif crit == "zdev":  # deviation in per-channel standard units
        sd = pages.std(2, unbiased=False, keepdim=True).clamp_min(1e-6)
        score = ((pages - mu) / sd).norm(dim=-1)
    else:
        raise ValueError(crit)
    return score.topk(r, dim=-1).indices


def est_top(x, pages, r, crit, rest="rest", alpha=1.0, cap=False):
    """Store r keys exactly + mean/var of the other 64 - r; logaddexp of the two parts."""
    h, n, _, d = pages.shape
    idx = pick_keys(pages, r, crit)
    top = torch.gather(pages, 2, idx.unsqueeze(-1).expand(h, n, r, d))  # [H,N,r,D]
    mask = torch.ones(h, n, P, dtype=torch.bool)
    mask.scatter_(2, idx, False)
    m = mask.unsqueeze(-1).float()
    if rest == "rest":
        mu = (pages * m).sum(2) / (P - r)
        var = (((pages - mu.unsqueeze(2)) * m) ** 2).sum(2) / (P - r)
        bulk = _mvar(x, mu, alpha * var, P - r)
        if cap:  # spread term <= sum_d |x_d| max|k_d - mu_d| over the bulk keys
            a = ((pages - mu.unsqueeze(2)).abs() * m).amax(2)
            b = torch.einsum("hgd,hnd->hgn", x.abs(), a)
            mean_t = torch.einsum("hgd,hnd->hgn", x, mu) + math.log(P - r)
            bulk = torch.minimum(bulk, mean_t + b)
    else:  # "all": mvar over all 64 keys counted for the 64-r bulk
        mu, var = pages.mean(2), pages.var(2, unbiased=False)
        bulk = _mvar(x, mu, alpha * var, P - r)
    exact = torch.einsum("hgd,hnrd->hgnr", x, top)
    return torch.logaddexp(bulk, torch.logsumexp(exact, -1))


def est_top_oracle(x, pages, r):
    """Diagnostic upper limit: the r largest logits *for this query* exact + mvar of the rest."""
    logits = torch.einsum("hgd,hnkd->hgnk", x, pages)
    srt, idx = logits.sort(-1, descending=True)
    top = torch.logsumexp(srt[..., :r], -1)
    # mvar of the rest per query head (diag stats of the keys not among that head's top r)
    out = torch.empty_like(top)
    for g in range(x.shape[1]):
        mask = torch.ones(pages.shape[:3], dtype=torch.bool)
        mask.scatter_(2, idx[:, g, :, :r], False)
        m = mask.unsqueeze(-1).float()
        mu = (pages * m).sum(2) / (P - r)
        var = (((pages - mu.unsqueeze(2)) * m) ** 2).sum(2) / (P - r)
        out[:, g] = _mvar(x[:, g : g + 1], mu, var, P - r)[:, 0]
    return torch.logaddexp(out, top)


def kmeans(pages, r, iters=6):
    """Fixed-iteration Lloyd on each page; init = farthest-point from the mean (k-center)."""
    h, n, _, d = pages.shape
    mu = pages.mean(2, keepdim=True)
    cents = [mu.squeeze(2)]
    dist = ((pages - mu) ** 2).sum(-1)
    for _ in range(r - 1):
        j = dist.argmax(-1)
        c = torch.gather(pages, 2, j.view(h, n, 1, 1).expand(h, n, 1, d)).squeeze(2)
        cents.append(c)
        dist = torch.minimum(dist, ((pages - c.unsqueeze(2)) ** 2).sum(-1))
    cents = torch.stack(cents, 2)  # [H,N,r,D]
    for _ in range(iters):
        dd = ((pages.unsqueeze(3) - cents.unsqueeze(2)) ** 2).sum(-1)  # [H,N,64,r]
        a = dd.argmin(-1)
        oh = torch.nn.functional.one_hot(a, r).float()  # [H,N,64,r]
        cnt = oh.sum(2)  # [H,N,r]
        s = torch.einsum("hnkr,hnkd->hnrd", oh, pages)
        newc = s / cnt.clamp_min(1).unsqueeze(-1)
        cents = torch.where(cnt.unsqueeze(-1) > 0, newc, cents)
    dd = ((pages.unsqueeze(3) - cents.unsqueeze(2)) ** 2).sum(-1)
    oh = torch.nn.functional.one_hot(dd.argmin(-1), r).float()
    cnt = oh.sum(2)
    mean = torch.einsum("hnkr,hnkd->hnrd", oh, pages) / cnt.clamp_min(1).unsqueeze(-1)
    sq = torch.einsum("hnkr,hnkd->hnrd", oh, pages * pages) / cnt.clamp_min(1).unsqueeze(-1)
    var = (sq - mean * mean).clamp_min(0)
    return mean, var, cnt


def est_kmeans(x, pages, r, shared_var=False):
    mean, var, cnt = kmeans(pages, r)
    if shared_var:  # one within-cluster var per page (pooled)
        var = ((var * cnt.unsqueeze(-1)).sum(2, keepdim=True) / P).expand_as(var)
    t = torch.einsum("hgd,hnrd->hgnr", x, mean) + 0.5 * torch.einsum("hgd,hnrd->hgnr", x * x, var)
    t = t + torch.log(cnt.clamp_min(1e-30)).unsqueeze(1)
    return torch.logsumexp(t, -1)


def est_lowrank(x, pages, r):
    """Gaussian with covariance diag(resid) + top-r principal components."""
    mu = pages.mean(2)
    c = pages - mu.unsqueeze(2)
    cov = torch.einsum("hnkd,hnke->hnde", c, c) / P
    evals, evecs = torch.linalg.eigh(cov)
    u = evecs[..., -r:] * evals[..., -r:].clamp_min(0).sqrt().unsqueeze(-2)  # [H,N,D,r]
    resid = (torch.diagonal(cov, dim1=-2, dim2=-1) - (u * u).sum(-1)).clamp_min(0)
    proj = torch.einsum("hgd,hndr->hgnr", x, u)
    return (
        torch.einsum("hgd,hnd->hgn", x, mu)
        + 0.5 * torch.einsum("hgd,hnd->hgn", x * x, resid)
        + 0.5 * (proj**2).sum(-1)
        + LOG_P
    )


def make_estimator(name):
    inner = make_estimator_inner(name.split("@")[0])
    if "@" not in name:
        return inner
    c = float(name.split("@")[1])

    def fn(x, p):
        REM["on"], REM["c"] = True, c
        try:
            return inner(x, p)
        finally:
            REM["on"] = False

    return fn


def make_estimator_inner(name):
    parts = name.split(":")
    kind = parts[0]
    if kind == "mvar":
        a = float(parts[1]) if len(parts) > 1 else 1.0
        return lambda x, p: est_mvar(x, p, a)
    if kind == "fullcov":
        return est_fullcov
    if kind == "top":  # top:r:crit[:rest[:alpha]]
        r, crit = int(parts[1]), parts[2]
        rest = parts[3] if len(parts) > 3 else "rest"
        a = float(parts[4]) if len(parts) > 4 else 1.0
        cap = crit.endswith("+b")
        crit = crit.removesuffix("+b")
        return lambda x, p: est_top(x, p, r, crit, rest, a, cap)
    if kind == "topor":
        return lambda x, p: est_top_oracle(x, p, int(parts[1]))
    if kind == "km":
        return lambda x, p: est_kmeans(x, p, int(parts[1]), len(parts) > 2)
    if kind == "lr":
        return lambda x, p: est_lowrank(x, p, int(parts[1]))
    raise ValueError(name)


# ---------------------------------------------------------------- evaluation
def evaluate(blob, names, gammas, scale, stats, layers=None):
    seq_total = blob["seq_len"]
    n0, n1 = (t // P for t in blob["needle_tokens"])
    fns = {nm: make_estimator(nm) for nm in names if nm != "oracle"}
    for layer, cap in blob["layers"].items():
        if layers is not None and layer not in layers:
            continue
        keys_all = cap["k"].float()
        vals_all = cap["v"].float()
        q_rows = cap["q"].float()
        h_kv, _, d = keys_all.shape
        g = q_rows.shape[0] // h_kv
        n_full = seq_total // P
        pages = keys_all[:, : n_full * P].reshape(h_kv, n_full, P, d)
        k_rows = q_rows.shape[1]
        for i in range(k_rows):
            seq_len = seq_total - k_rows + i + 1
            n = ref.num_pages(seq_len)
            x = q_rows[:, i].view(h_kv, g, d) * scale
            logits = torch.full((h_kv, g, n * P), -math.inf)
            logits[..., :seq_len] = torch.einsum("hgd,htd->hgt", x, keys_all[:, :seq_len])
            logits = logits.view(h_kv, g, n, P)
            lse_p = torch.logsumexp(logits, -1)  # [H,G,n]
            w = torch.softmax(logits, -1).nan_to_num(0.0)
            vpad = torch.zeros(h_kv, n * P, d)
            vpad[:, :seq_len] = vals_all[:, :seq_len]
            o_p = torch.einsum("hgnk,hnkd->hgnd", w, vpad.view(h_kv, n, P, d))
            o_dense = (torch.softmax(lse_p, -1).unsqueeze(-1) * o_p).sum(2)
            true_pibar = ref.group_mean_shares(lse_p)  # [H, n]
            for nm in names:
                if nm == "oracle":
                    est = lse_p
                else:
                    est = lse_p.clone()
                    e = fns[nm](x, pages[:, : n - 1])
                    est[..., 1 : n - 1] = e[..., 1 : n - 1]
                pibar = ref.group_mean_shares(est)
                for gamma in gammas:
                    s = stats.setdefault(
                        (nm, gamma),
                        {"kept": [], "cap": [], "err": [], "needle_rows": 0, "needle_drop": 0},
                    )
                    mask = torch.zeros(h_kv, n, dtype=torch.bool)
                    for h in range(h_kv):
                        lst = ref.select_pages(pibar[h], gamma=gamma).long()
                        mask[h, lst] = True
                        s["kept"].append(len(lst) / n)
                        s["cap"].append(float(true_pibar[h, lst].sum()))
                        for p in range(n0, n1 + 1):
                            if p < n and float(true_pibar[h, p]) >= 0.05:
                                s["needle_rows"] += 1
                                s["needle_drop"] += int(not mask[h, p])
                    lm = lse_p.masked_fill(~mask.unsqueeze(1), -math.inf)
                    o = (torch.softmax(lm, -1).unsqueeze(-1) * o_p).sum(2)
                    err = (o - o_dense).norm(dim=-1) / o_dense.norm(dim=-1).clamp_min(1e-12)
                    s["err"].append(float(err.mean()))


def summarize(stats):
    rows = []
    for (nm, gamma), s in stats.items():
        cap = torch.tensor(s["cap"])
        rows.append(
            {
                "estimator": nm,
                "gamma": gamma,
                "kept_mean": sum(s["kept"]) / len(s["kept"]),
                "captured_mean": float(cap.mean()),
                "captured_p10": float(torch.quantile(cap, 0.1)),
                "captured_min": float(cap.min()),
                "needle_rows": s["needle_rows"],
                "needle_dropped": s["needle_drop"],
                "out_err_mean": sum(s["err"]) / len(s["err"]),
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--last-k", type=int, default=8)
    ap.add_argument("--est", nargs="+", default=["oracle", "mvar"])
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.95, 0.98, 0.99])
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    blob = torch.load(CACHE / f"needle_{args.context}_s0_k{args.last_k}.pt")
    scale = blob["layers"][0]["k"].shape[-1] ** -0.5
    stats: dict = {}
    evaluate(blob, args.est, args.gammas, scale, stats, args.layers)
    rows = summarize(stats)
    orc = {r["gamma"]: r for r in rows if r["estimator"] == "oracle"}
    print(f"ctx={args.context} ({time.time() - t0:.0f}s)")
    print(f"{'estimator':22s} gam   kept  (xor)  capm   p10    min   needle   err   (xor)")
    for r in rows:
        o = orc.get(r["gamma"])
        kx = r["kept_mean"] / o["kept_mean"] if o else math.nan
        ex = r["out_err_mean"] / o["out_err_mean"] if o else math.nan
        print(
            f"{r['estimator']:22s} {r['gamma']:.2f} {r['kept_mean']:.3f} ({kx:.2f}) "
            f"{r['captured_mean']:.3f} {r['captured_p10']:.3f} {r['captured_min']:.3f} "
            f"{r['needle_dropped']:2d}/{r['needle_rows']:2d} {r['out_err_mean']:.4f} ({ex:.2f})"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
