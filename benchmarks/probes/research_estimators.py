# SPDX-License-Identifier: Apache-2.0
"""Page-mass estimators that were studied and not kept (docs/estimator.md).

No kernel implements them; benchmarks/probes/estimator_study.py,
estimator_lab.py and the accuracy harness's Quest-style baseline use them.
The shipped estimators are in vllm_moira/v1/attention/ops/moira_reference.py.
"""

from __future__ import annotations

import math

import torch

from vllm_moira.v1.attention.ops import moira_reference as ref

# Extended summary layout ``[num_blocks, H_kv, 4, D]``: per-channel mean,
# population variance, min and max of the 64 keys of a page (slots 0 and 1 are
# exactly the paper's summary, so every mvar consumer can read a 4-slot
# summary unchanged).
SUMMARY_SLOTS_EXT = 4
ROBUST_ESTIMATORS = ("box", "mvar_box", "mvar_cap", "mvar_max", "mvar_bennett")
DEFAULT_VAR_CAP = 4.0


def summarize_pages_ext(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Mean, variance, min and max of the keys of full pages: ``[n, H_kv, 4, D]`` fp32."""
    head_size = kv_cache.shape[-1] // 2
    keys = kv_cache[block_ids.long(), :, :, :head_size].float()  # [n, H, 64, D]
    mean = keys.mean(dim=2)
    var = ((keys - mean.unsqueeze(2)) ** 2).mean(dim=2)
    return torch.stack([mean, var, keys.amin(dim=2), keys.amax(dim=2)], dim=2)


def box_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float
) -> torch.Tensor:
    """Quest-style bound ``sum_d max(x_d min_d, x_d max_d) + log 64`` with ``x = s q``.

    An upper bound of the exact log-mass (64 keys, each at most the box's
    largest logit). ``page_summaries`` is ``[n, H_kv, 4, D]``; returns ``[H_kv, G, n]``.
    """
    h_kv = page_summaries.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale  # [H, G, D]
    lo = page_summaries[:, :, 2].float()  # [n, H, D]
    hi = page_summaries[:, :, 3].float()
    qe = q.unsqueeze(2)  # [H, G, 1, D]
    lo_t = lo.permute(1, 0, 2).unsqueeze(1)  # [H, 1, n, D]
    hi_t = hi.permute(1, 0, 2).unsqueeze(1)
    bound = torch.maximum(qe * lo_t, qe * hi_t).sum(-1)
    return bound + math.log(ref.PAGE_SIZE)


def bennett_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float
) -> torch.Tensor:
    """Eq. 2 with each channel's Gaussian term capped by Bennett's bound.

    Per channel ``d`` with ``x = s q``: ``m = x_d mu_d``, ``v = x_d^2 var_d`` and
    ``b = max(x_d min_d, x_d max_d) - m >= 0`` (largest deviation the page allows
    in the query's direction). The sharpest bound of ``log E exp(X - m)`` given
    variance ``v`` and ``X - m <= b`` is
    ``c = log((v e^b + b^2 e^{-v/b}) / (v + b^2))``; the term used is
    ``min(v / 2, c)``. Returns ``[H_kv, G, n]``.
    """
    h_kv = page_summaries.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale
    qe = q.unsqueeze(2)  # [H, G, 1, D]
    mean, var, lo, hi = (
        page_summaries[:, :, i].float().permute(1, 0, 2).unsqueeze(1) for i in range(4)
    )
    m = qe * mean
    v = qe * qe * var
    b = (torch.maximum(qe * lo, qe * hi) - m).clamp_min(0.0)
    gauss = 0.5 * v
    safe_b = b.clamp_min(1e-12)
    # log((v e^b + b^2 e^{-v/b}) / (v + b^2)), computed in log space
    num = torch.logaddexp(torch.log(v.clamp_min(1e-30)) + b, 2 * torch.log(safe_b) - v / safe_b)
    c = num - torch.log(v + b * b).clamp_min(-1e30)
    c = torch.where((v <= 1e-30) | (b <= 1e-12), torch.zeros_like(c), c)
    term = torch.minimum(gauss, c)
    return (m + term).sum(-1) + math.log(ref.PAGE_SIZE)


def robust_page_logmass(
    query: torch.Tensor,
    page_summaries: torch.Tensor,
    scale: float,
    estimator: str,
    var_cap: float = DEFAULT_VAR_CAP,
) -> torch.Tensor:
    """Candidate estimators from a 4-slot summary: ``[H_kv, G, n]``.

    - ``box``: Quest-style upper bound (above).
    - ``mvar_box``: ``min(mvar, box)``.
    - ``mvar_cap``: ``s q.mu + min(0.5 (s q)^2.sigma^2, var_cap) + log 64``.
    - ``mvar_max``: ``logaddexp(s q.mu + log 64, box)`` (mean term plus an extreme-key term).
    - ``mvar_bennett``: :func:`bennett_page_logmass` (per-channel min of Gaussian and Bennett).
    """
    if page_summaries.shape[2] < SUMMARY_SLOTS_EXT and estimator != "mvar_cap":
        raise ValueError(f"estimator {estimator!r} needs the 4-slot summary (mean, var, min, max)")
    if estimator == "box":
        return box_page_logmass(query, page_summaries, scale)
    if estimator == "mvar_bennett":
        return bennett_page_logmass(query, page_summaries, scale)
    h_kv = page_summaries.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale
    mean_term = torch.einsum("hgd,nhd->hgn", q, page_summaries[:, :, 0].float())
    spread = 0.5 * torch.einsum("hgd,nhd->hgn", q * q, page_summaries[:, :, 1].float())
    log_s = math.log(ref.PAGE_SIZE)
    if estimator == "mvar_cap":
        return mean_term + spread.clamp_max(var_cap) + log_s
    box = box_page_logmass(query, page_summaries, scale)
    if estimator == "mvar_box":
        return torch.minimum(mean_term + spread + log_s, box)
    if estimator == "mvar_max":
        return torch.logaddexp(mean_term + log_s, box)
    raise ValueError(f"unknown estimator {estimator!r}")


def estimate_row_logmass_robust(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    estimator: str,
) -> torch.Tensor:
    """``ref.estimate_row_logmass`` for the estimators above (4-slot
    ``summaries``): ``[H_kv, G, n]``, the sink and current page exact."""
    keys, _ = ref.row_keys_values(kv_cache, block_table_row, seq_len)
    exact = ref.exact_page_logmass(query, keys, seq_len, scale)
    n = ref.num_pages(seq_len)
    est = robust_page_logmass(query, summaries[block_table_row[:n].long()], scale, estimator)
    est[..., 0] = exact[..., 0]
    est[..., n - 1] = exact[..., n - 1]
    return est
