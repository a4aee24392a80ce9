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
    return box_max_logit(query, page_summaries[:, :, 2:4], scale) + math.log(ref.PAGE_SIZE)


def box_max_logit(query: torch.Tensor, box: torch.Tensor, scale: float) -> torch.Tensor:
    """``sum_d max(x_d lo_d, x_d hi_d)`` with ``x = s q``: at least every logit of the keys
    the box ``[n, H_kv, 2, D]`` (per-channel min, max) holds. Returns ``[H_kv, G, n]``."""
    h_kv = box.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale  # [H, G, D]
    qe = q.unsqueeze(2)  # [H, G, 1, D]
    lo_t = box[:, :, 0].float().permute(1, 0, 2).unsqueeze(1)  # [H, 1, n, D]
    hi_t = box[:, :, 1].float().permute(1, 0, 2).unsqueeze(1)
    return torch.maximum(qe * lo_t, qe * hi_t).sum(-1)


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


# --------------------------------------------------------------------------
# Cheaper candidates: a spread term capped by a page bound, and two-stage Estimate
# --------------------------------------------------------------------------
def page_spread_bounds(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page of keys ``[..., 64, D]``: the L2 radius ``max_t ||k_t - mu||`` (``[...]``)
    and the per-channel deviation ``max_t |k_td - mu_d|`` (``[..., D]``), mu the page mean."""
    dev = pages.float() - pages.float().mean(dim=-2, keepdim=True)
    return dev.norm(dim=-1).amax(dim=-1), dev.abs().amax(dim=-2)


def capped_spread_logmass(
    query: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    scale: float,
    radius: torch.Tensor | None = None,
    chan_dev: torch.Tensor | None = None,
    rem: bool = True,
) -> torch.Tensor:
    """``x.mu + min(spread, bound) + log 64`` with ``x = s q``: ``[H_kv, G, n]``.

    ``spread`` is the REM term of ``x^2.var`` (``rem=True``) or Eq. 2's ``x^2.var / 2``.
    The bound caps the log-mean-exp above the mean logit by the page's largest
    deviation along x: ``|x| * radius`` (Cauchy-Schwarz; ``radius`` ``[n, H_kv]``) and/or
    ``sum_d |x_d| chan_dev_d`` (``chan_dev`` ``[n, H_kv, D]``). ``mean``/``var``: ``[n, H_kv, D]``.
    """
    h_kv = mean.shape[1]
    x = query.float().view(h_kv, -1, query.shape[-1]) * scale  # [H, G, D]
    mean_term = torch.einsum("hgd,nhd->hgn", x, mean.float())
    v = torch.einsum("hgd,nhd->hgn", x * x, var.float())
    spread = ref.rem_spread(v, ref.PAGE_SIZE) if rem else 0.5 * v
    if radius is not None:
        bound = x.norm(dim=-1, keepdim=True) * radius.float().t().unsqueeze(1)  # [H, G, n]
        spread = torch.minimum(spread, bound)
    if chan_dev is not None:
        spread = torch.minimum(spread, torch.einsum("hgd,nhd->hgn", x.abs(), chan_dev.float()))
    return mean_term + spread + math.log(ref.PAGE_SIZE)


def refine_band(pibar: torch.Tensor, gamma: float, below: float, above: float) -> torch.Tensor:
    """Pages a two-stage Estimate refines, from stage 1's group-mean shares ``[n]``.

    ``tau`` is the smallest share Select keeps at ``gamma`` from stage 1 alone; the
    middle pages (not the sink, not the current page: exact anyway) whose share
    lies in ``[tau e^-below, tau e^above]`` are refined. ``above=inf``: every
    page stage 1 keeps, and the band below it. Returns a bool mask ``[n]``.
    """
    n = pibar.numel()
    mask = torch.zeros(n, dtype=torch.bool)
    if n <= 2:
        return mask
    tau = ref.coverage_threshold(pibar, gamma)
    if tau is None:
        return mask
    share = pibar[1 : n - 1].float()
    lo = tau * math.exp(-below)
    hi = math.inf if math.isinf(above) else tau * math.exp(above)
    mask[1 : n - 1] = (share >= lo) & (share <= hi)
    return mask


def two_stage_logmass(
    stage1: torch.Tensor,
    stage2: torch.Tensor,
    gamma: float,
    below: float,
    above: float,
    only: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's log-masses ``[H_kv, G, n]`` with the pages of :func:`refine_band`
    (per KV head, from stage 1's group-mean shares; ``only`` ``[H_kv, n]``: of those, these)
    replaced by stage 2's. Returns ``(log-masses, refined mask [H_kv, n])``."""
    pibar = ref.group_mean_shares(stage1)
    mask = torch.stack([refine_band(pibar[h], gamma, below, above) for h in range(len(pibar))])
    if only is not None:
        mask = mask & only
    return torch.where(mask.unsqueeze(1), stage2, stage1), mask


def cap_refined(mask: torch.Tensor, pibar: torch.Tensor, fraction: float) -> torch.Tensor:
    """At most ``ceil(fraction (n - 2))`` refined pages per KV head: of ``mask [H_kv, n]``,
    those with the largest stage-1 group-mean share ``pibar [H_kv, n]`` (the ones whose
    over-estimate pushes the most mass past a needle page). ``fraction`` inf: ``mask``."""
    n = mask.shape[1]
    if math.isinf(fraction) or n == 0:
        return mask
    limit = min(math.ceil(fraction * max(n - 2, 0)), n)
    if limit == 0:
        return torch.zeros_like(mask)
    score = torch.where(mask, pibar.float(), torch.tensor(float("-inf")))
    top = score.topk(limit, dim=1).indices
    capped = torch.zeros_like(mask).scatter_(1, top, True)
    return capped & mask


def wide_pages(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, num_top: int, factor: float
) -> torch.Tensor:
    """The spread gate of the ``2v`` family: ``[H_kv, n]`` mask of the pages whose group-mean
    variance along ``x = s q``, ``x^2 . sigma^2`` (slot 1 of the ``[n, H_kv, S, D]``
    summaries as Estimate reads them), is at least ``factor`` times REM's critical variance
    ``2 ln m`` (m = 64 - ``num_top`` summarized keys): the pages whose spread term is large
    enough to over-estimate them."""
    h_kv = page_summaries.shape[1]
    x = query.float().view(h_kv, -1, query.shape[-1]) * scale
    v = torch.einsum("hgd,nhd->hgn", x * x, page_summaries[:, :, 1].float()).mean(dim=1)
    return v >= factor * 2.0 * math.log(ref.PAGE_SIZE - num_top)


def radius_upper_logmass(
    query: torch.Tensor, mean: torch.Tensor, radius: torch.Tensor, scale: float
) -> torch.Tensor:
    """Upper bound of every page's log-mass from its mean and L2 radius (one scalar per
    page): ``x.mu + |x| radius + log 64`` (each key's logit is at most ``x.mu + |x| radius``).
    ``mean`` ``[n, H_kv, D]``, ``radius`` ``[n, H_kv]``; returns ``[H_kv, G, n]``."""
    h_kv = mean.shape[1]
    x = query.float().view(h_kv, -1, query.shape[-1]) * scale
    mean_term = torch.einsum("hgd,nhd->hgn", x, mean.float())
    bound = x.norm(dim=-1, keepdim=True) * radius.float().t().unsqueeze(1)
    return mean_term + bound + math.log(ref.PAGE_SIZE)


def bound_gated_logmass(
    stage1: torch.Tensor, upper: torch.Tensor, stage2: torch.Tensor, gamma: float, slack: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-stage Estimate gated by an upper bound: the middle pages that stage 1 alone
    would drop at ``gamma`` but whose upper bound's share (normalized by stage 1's total
    mass, group mean) reaches ``tau e^-slack`` get stage 2's log-mass; the pages stage 1
    keeps and those the bound rules out keep stage 1's. ``[H_kv, G, n]`` inputs; returns
    ``(log-masses, refined mask [H_kv, n])``."""
    h_kv, _, n = stage1.shape
    mask = torch.zeros(h_kv, n, dtype=torch.bool)
    if n <= 2:
        return stage1.clone(), mask
    pibar = ref.group_mean_shares(stage1)
    total = torch.logsumexp(stage1, dim=-1, keepdim=True)
    upper_share = torch.exp(upper - total).mean(dim=1)  # [H, n]
    for h in range(h_kv):
        tau = ref.coverage_threshold(pibar[h], gamma)
        if tau is None:
            continue
        kept = ref.select_pages(pibar[h], gamma=gamma).long()
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[kept] = False
        dropped[0] = dropped[n - 1] = False
        mask[h] = dropped & (upper_share[h] >= tau * math.exp(-slack))
    return torch.where(mask.unsqueeze(1), stage2, stage1), mask


class AnchoredEstimate:
    """Estimates anchored to the exact log-masses of earlier steps, per KV head.

    Attend computes every kept page's exact log-mass ``e_s(p)`` at step ``s``; the page's
    base estimate ``b_s(p)`` at that step is known too. At a later step ``t`` the page gets
    ``b_t(p) + (e_s(p) - b_s(p))``: the last exact value plus the change the base estimator
    predicts since then, so its error is the error of a difference, not of a level. Pages
    never kept (and never seeded) keep ``b_t(p)``. The sink and the current page are exact
    in every base estimate; the current page gets no anchor (it is partial).
    """

    def __init__(self, h_kv: int, max_pages: int, horizon: int = 0, down_only: bool = False):
        self.delta: torch.Tensor | None = None  # [H_kv, G, max_pages]
        self.known = torch.zeros(h_kv, max_pages, dtype=torch.bool)
        self.stamp = torch.zeros(h_kv, max_pages, dtype=torch.long)
        self.step = 0
        self.horizon = horizon  # steps an anchor is used for (0: no end)
        self.down_only = down_only  # only lower over-estimated pages

    def correct(self, base: torch.Tensor) -> torch.Tensor:
        """``base`` ``[H_kv, G, n]`` with the anchored pages' corrections added."""
        if self.delta is None:
            return base
        n = base.shape[-1]
        known = self.known[:, :n]
        if self.horizon:
            known = known & (self.step - self.stamp[:, :n] < self.horizon)
        delta = self.delta[..., :n]
        if self.down_only:
            delta = delta.clamp_max(0.0)
        return base + torch.where(known.unsqueeze(1), delta, torch.zeros_like(base))

    def update(self, lists: list[torch.Tensor], exact: torch.Tensor, base: torch.Tensor) -> None:
        """Anchor the middle pages of this step's ``lists`` (what Attend reads)."""
        h_kv, g, n = exact.shape
        self.step += 1
        if self.delta is None:
            self.delta = torch.zeros(h_kv, g, self.known.shape[1])
        for h, lst in enumerate(lists):
            pages = lst.long()
            pages = pages[(pages > 0) & (pages < n - 1)]
            self.delta[h][:, pages] = exact[h][:, pages] - base[h][:, pages]
            self.known[h, pages] = True
            self.stamp[h, pages] = self.step


def uniform_spread(v: torch.Tensor) -> torch.Tensor:
    """Spread term of logits spread uniformly with variance ``v``: ``log(sinh(a) / a)``,
    ``a = sqrt(3 v)`` (the half-width). ``v / 2`` to first order, like the Gaussian's, but
    ``a - log(2 a)`` for wide pages, where the Gaussian grows as ``v / 2`` and REM as
    ``sqrt(2 ln m v)``: a light-tailed model of the bulk's logits."""
    a = (3.0 * v.clamp_min(0.0)).sqrt()
    small = a < 1e-3
    a_safe = torch.where(small, torch.ones_like(a), a)
    big = a_safe + torch.log1p(-torch.exp(-2.0 * a_safe)) - torch.log(2.0 * a_safe)
    return torch.where(small, 0.5 * v, big)


SPREADS = {"uniform": uniform_spread}


def top_spread_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, spread: str
) -> torch.Tensor:
    """``mvar_top{r}`` (``[n, H_kv, 2 + r, D]`` summary) with the bulk's REM term replaced by
    ``SPREADS[spread]``; ``[H_kv, G, n]``."""
    return ref.top_page_logmass(query, page_summaries, scale, lambda v, _: SPREADS[spread](v))


def bulk_mask(pages: torch.Tensor, r: int) -> torch.Tensor:
    """``[..., 64]``: True for the keys of each page ``[..., 64, D]`` that ``mvar_top{r}``
    summarizes (not among its ``r`` stored keys, ``ref.stored_key_order``)."""
    order = ref.stored_key_order(pages, r)
    return torch.ones(pages.shape[:-1], dtype=torch.bool).scatter(-1, order, False)


def summarize_top_pc(pages: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """``mvar_top{r}``'s summary plus the bulk's ``k`` leading principal axes:
    ``[..., 2 + k + r, D]``: bulk mean, bulk per-channel variance, ``w_i = sqrt(l_i) u_i``
    (eigenpairs of the bulk's covariance, largest first), then the ``r`` stored keys."""
    top = ref.summarize_key_pages_top(pages, r)
    pages = pages.float()
    centred = (pages - top[..., :1, :]) * bulk_mask(pages, r).unsqueeze(-1).float()
    cov = centred.transpose(-1, -2) @ centred / (ref.PAGE_SIZE - r)  # [..., D, D]
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    lead = evals[..., -k:].flip(-1).clamp_min(0.0).sqrt()  # [..., k]
    axes = evecs[..., -k:].flip(-1).transpose(-1, -2) * lead.unsqueeze(-1)  # [..., k, D]
    return torch.cat([top[..., :2, :], axes, top[..., 2:, :]], dim=-2)


def _pc_mean_and_variance(x: torch.Tensor, summ: torch.Tensor, k: int):
    """``x . mu_b`` and the bulk's variance along ``x`` from ``summarize_top_pc``'s slots 0,
    1 and the ``k`` axes: ``sum_i (x.w_i)^2 + x^2 . (sigma^2 - sum_i w_i^2)``, ``[H, G, n]``
    each (``x`` ``[H, G, D]``, ``summ`` fp32)."""
    axes = summ[:, :, 2 : 2 + k]  # [n, H, k, D]
    mean_term = torch.einsum("hgd,nhd->hgn", x, summ[:, :, 0])
    residual = (summ[:, :, 1] - (axes**2).sum(dim=2)).clamp_min(0.0)
    v = torch.einsum("hgd,nhd->hgn", x * x, residual)
    return mean_term, v + (torch.einsum("hgd,nhkd->hgnk", x, axes) ** 2).sum(-1)


def top_pc_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, k: int
) -> torch.Tensor:
    """``mvar_top{r}`` whose bulk variance along ``x`` is taken from the ``k`` principal axes
    exactly and the rest per channel: ``sum_i (x.w_i)^2 + x^2 . (sigma^2 - sum_i w_i^2)``
    (``summarize_top_pc``'s layout); ``[H_kv, G, n]``."""
    h_kv = page_summaries.shape[1]
    r = page_summaries.shape[2] - 2 - k
    count = ref.PAGE_SIZE - r
    x = query.float().view(h_kv, -1, query.shape[-1]) * scale
    summ = page_summaries.float()
    mean_term, v = _pc_mean_and_variance(x, summ, k)
    bulk = mean_term + ref.rem_spread(v, count) + math.log(count)
    stored = torch.einsum("hgd,nhrd->hgnr", x, summ[:, :, 2 + k :])
    if stored.shape[-1] == 0:
        return bulk
    return torch.logaddexp(bulk, torch.logsumexp(stored, dim=-1))


def summarize_top_pc_bound(pages: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """``summarize_top_pc``'s layout plus, before the stored keys, one slot of the bulk's
    largest deviations: ``[max_t |c_ti|]_{i<k}`` along each axis ``u_i`` and ``max_t |e_t|``
    of the remainder ``e_t`` (``k_t - mu = sum_i c_ti u_i + e_t``): ``[..., 3 + k + r, D]``."""
    summ = summarize_top_pc(pages, r, k)
    pages = pages.float()
    bulk = bulk_mask(pages, r)
    axes = summ[..., 2 : 2 + k, :]
    units = axes / axes.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # [..., k, D]
    dev = pages - summ[..., :1, :]  # [..., 64, D]
    coef = dev @ units.transpose(-1, -2)  # [..., 64, k]
    rest = (dev - coef @ units).norm(dim=-1)  # [..., 64]
    neg = torch.tensor(0.0)
    cmax = torch.where(bulk.unsqueeze(-1), coef.abs(), neg).amax(dim=-2)  # [..., k]
    rmax = torch.where(bulk, rest, neg).amax(dim=-1, keepdim=True)  # [..., 1]
    slot = torch.zeros_like(summ[..., :1, :])
    slot[..., 0, :k] = cmax
    slot[..., 0, k] = rmax[..., 0]
    return torch.cat([summ[..., : 2 + k, :], slot, summ[..., 2 + k :, :]], dim=-2)


def bennett_spread(v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest ``log E exp(X - EX)`` of a variable of variance ``v`` with ``X - EX <= b``
    (Bennett): ``log((v e^b + b^2 e^(-v/b)) / (v + b^2))``."""
    b = b.clamp_min(1e-6)
    v = v.clamp_min(1e-12)
    num = torch.logaddexp(torch.log(v) + b, 2 * torch.log(b) - v / b)
    return num - torch.log(v + b * b)


def top_pc_bound_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, k: int, rule: str
) -> torch.Tensor:
    """``top_pc_logmass``'s variance with the bulk's spread term capped by the bound ``b`` of
    its largest logit above the mean (``summarize_top_pc_bound``'s layout):
    ``rule`` ``"max"``: ``min(rem, b)``; ``"bennett"``: ``min(rem, bennett(v, b))``."""
    h_kv = page_summaries.shape[1]
    r = page_summaries.shape[2] - 3 - k
    count = ref.PAGE_SIZE - r
    x = query.float().view(h_kv, -1, query.shape[-1]) * scale
    summ = page_summaries.float()
    axes = summ[:, :, 2 : 2 + k]  # [n, H, k, D]
    bnd = summ[:, :, 2 + k]  # [n, H, D]
    mean_term, v = _pc_mean_and_variance(x, summ, k)
    units = axes / axes.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    xu = torch.einsum("hgd,nhkd->hgnk", x, units)  # x . u_i
    x_rest = (x.norm(dim=-1, keepdim=True) ** 2 - (xu**2).sum(-1)).clamp_min(0.0).sqrt()
    b = (xu.abs() * bnd[:, :, :k].permute(1, 0, 2).unsqueeze(1)).sum(-1)
    b = b + x_rest * bnd[:, :, k].t().unsqueeze(1)
    spread = ref.rem_spread(v, count)
    cap = b if rule == "max" else bennett_spread(v, b)
    bulk = mean_term + torch.minimum(spread, cap) + math.log(count)
    stored = torch.einsum("hgd,nhrd->hgnr", x, summ[:, :, 3 + k :])
    return torch.logaddexp(bulk, torch.logsumexp(stored, dim=-1))


def sampled_logmass(
    query: torch.Tensor, pages: torch.Tensor, scale: float, r: int, stride: int
) -> torch.Tensor:
    """A cheaper stage 2 than the exact mass: the ``r`` keys farthest from the page mean
    exactly (``mvar_top{r}``'s stored keys), plus every ``stride``-th of the other keys in
    token order, their mass scaled by (bulk keys / sampled keys). Reads ``r + (64 - r) /
    stride`` keys of the page instead of 64. ``pages`` ``[n, H_kv, 64, D]``; returns
    ``[H_kv, G, n]``."""
    n, h_kv, page, d = pages.shape
    x = query.float().view(h_kv, -1, d) * scale
    pages = pages.float()
    stored = ~bulk_mask(pages, r)  # [n, H, 64]
    bulk_rank = torch.cumsum((~stored).int(), dim=-1) - 1  # rank among the bulk keys
    sampled = ~stored & (bulk_rank % stride == 0)
    logits = torch.einsum("hgd,nhtd->hgnt", x, pages)  # [H, G, n, 64]
    neg = torch.tensor(float("-inf"))
    top = torch.where(stored.permute(1, 0, 2).unsqueeze(1), logits, neg)
    samp = torch.where(sampled.permute(1, 0, 2).unsqueeze(1), logits, neg)
    count = sampled.sum(dim=-1).clamp_min(1).float()  # [n, H]
    weight = torch.log((page - r) / count).t().unsqueeze(1)  # [H, 1, n]
    return torch.logaddexp(torch.logsumexp(top, -1), torch.logsumexp(samp, -1) + weight)


def round_over_tokens(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` ``[n, H_kv, 64, C]`` as ``bits``-bit integer codes in ``[-L, L]``
    (``L = 2**(bits-1) - 1``) with one absmax scale per (page, KV head, C): ``(codes, scale)``,
    ``codes * scale`` the rounded values; ``scale`` ``[n, H_kv, 1, C]``."""
    levels = 2 ** (bits - 1) - 1
    scale = values.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / levels
    return torch.round(values / scale).clamp(-levels, levels), scale


def quantized_key_logmass(
    query: torch.Tensor,
    pages: torch.Tensor,
    scale: float,
    bits: int,
    centered: bool = False,
    channels: int | None = None,
    axes: torch.Tensor | None = None,
    residual_spread: bool = False,
) -> torch.Tensor:
    """Each page's log-mass over all of its keys, the keys rounded to ``bits``-bit integers
    with one absmax scale per (page, KV head, channel): a stage 2 (or a whole estimator)
    that reads a quantized copy of the keys, ``bits / 16`` of a bf16 page's key bytes plus
    the scales, instead of the keys. Channel scales because a head's outlier channels
    carry most of a key's magnitude. ``centered``: the keys minus their page mean (a row
    the summaries already store) are rounded, so a channel's constant offset costs no
    levels. ``channels``: only that many channels per (page, KV head), those of the largest
    variance over the page, are stored; the others are taken at the page mean (``centered``
    only). ``axes`` ``[H_kv, D, k]`` (``principal_key_axes``): the centered keys are stored as
    their coordinates along these k orthonormal axes, each rounded with its own scale
    (``centered`` only); ``residual_spread``: plus half the variance of ``x`` along what the
    axes leave out (per channel over the page: the mvar term of the residual), so the dropped
    part adds its Gaussian share instead of nothing. ``pages`` ``[n, H_kv, 64, D]``; returns
    ``[H_kv, G, n]``."""
    n, h_kv, page, d = pages.shape
    x = query.float().view(h_kv, -1, d) * scale
    pages = pages.float()
    mean = pages.mean(dim=2, keepdim=True) if centered else torch.zeros_like(pages[:, :, :1])
    if axes is not None:
        if not centered:
            raise ValueError("quantized_key_logmass: axes needs centered=True")
        coords = torch.einsum("nhtd,hdk->nhtk", pages - mean, axes)
        codes, coord_scale = round_over_tokens(coords, bits)
        keys = torch.einsum("nhtk,hdk->nhtd", codes * coord_scale, axes) + mean
        logmass = torch.logsumexp(torch.einsum("hgd,nhtd->hgnt", x, keys), dim=-1)
        if residual_spread:
            kept = torch.einsum("nhtk,hdk->nhtd", coords, axes)
            variance = (pages - mean - kept).var(dim=2, unbiased=False)  # [n, H, D]
            logmass = logmass + 0.5 * torch.einsum("hgd,nhd->hgn", x * x, variance)
        return logmass
    codes, channel_scale = round_over_tokens(pages - mean, bits)
    keys = codes * channel_scale + mean
    if channels is not None:
        if not centered:
            raise ValueError("quantized_key_logmass: channels needs centered=True")
        top = pages.var(dim=2).topk(channels, dim=-1).indices  # [n, H, channels]
        stored = torch.zeros(n, h_kv, d, dtype=torch.bool).scatter_(-1, top, True)
        keys = torch.where(stored.unsqueeze(2), keys, mean)
    return torch.logsumexp(torch.einsum("hgd,nhtd->hgnt", x, keys), dim=-1)


def principal_key_axes(pages: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` leading principal axes of each KV head's keys after each page's mean is taken
    out (what a prefill-time calibration of the head would find): ``[H_kv, D, k]``."""
    n, h_kv, page, d = pages.shape
    residual = (pages.float() - pages.float().mean(dim=2, keepdim=True)).permute(1, 0, 2, 3)
    residual = residual.reshape(h_kv, n * page, d)
    covariance = residual.transpose(1, 2) @ residual  # [H, D, D]
    _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
    return vectors[..., -k:].flip(-1)


def summarize_sub_pages(pages: torch.Tensor, parts: int) -> torch.Tensor:
    """Mean and population variance of each of a page's ``parts`` runs of ``64 / parts``
    consecutive keys: ``pages`` ``[n, H_kv, 64, D]`` -> ``[n, H_kv, 2 * parts, D]`` fp32
    (slots ``2j`` and ``2j + 1``: run ``j``'s mean and variance)."""
    n, h_kv, page, d = pages.shape
    if parts < 1 or page % parts:
        raise ValueError(f"parts must divide {page}, got {parts}")
    runs = pages.float().view(n, h_kv, parts, page // parts, d)
    mean = runs.mean(dim=-2)
    var = runs.var(dim=-2, unbiased=False)
    return torch.stack([mean, var], dim=-2).reshape(n, h_kv, 2 * parts, d)


def sub_page_logmass(
    query: torch.Tensor, summ: torch.Tensor, scale: float, rem: bool
) -> torch.Tensor:
    """Eq. 2 on each run of a ``summarize_sub_pages`` summary ``[n, H_kv, 2 * parts, D]``,
    the runs' masses added: ``logsumexp_j (x.mu_j + spread(x^2.var_j) + log(64 / parts))``
    with ``x = s q`` and spread ``v / 2`` (mvar's) or REM's (``rem``). ``[H_kv, G, n]``."""
    n, h_kv, slots, d = summ.shape
    parts = slots // 2
    count = ref.PAGE_SIZE // parts
    x = query.float().view(h_kv, -1, d) * scale
    runs = summ.float().view(n, h_kv, parts, 2, d)
    mean_term = torch.einsum("hgd,nhjd->hgnj", x, runs[:, :, :, 0])
    v = torch.einsum("hgd,nhjd->hgnj", x * x, runs[:, :, :, 1])
    spread = ref.rem_spread(v, count) if rem else 0.5 * v
    return torch.logsumexp(mean_term + spread + math.log(count), dim=-1)


# --------------------------------------------------------------------------
# A floor under the first stage from a per-channel box: every key is seen
# --------------------------------------------------------------------------
def summarize_key_box(pages: torch.Tensor, r: int = 0) -> torch.Tensor:
    """Per-channel min and max of each page's keys ``[..., 64, D]``: ``[..., 2, D]`` fp32.

    ``r > 0``: of the bulk only (``mvar_top{r}``'s stored keys left out): the estimate reads
    those exactly, and the few keys farthest from the mean are what widens the box most.
    """
    pages = pages.float()
    if r == 0:
        return torch.stack([pages.amin(dim=-2), pages.amax(dim=-2)], dim=-2)
    bulk = bulk_mask(pages, r).unsqueeze(-1)
    inf = torch.tensor(math.inf)
    lo = torch.where(bulk, pages, inf).amin(dim=-2)
    hi = torch.where(bulk, pages, -inf).amax(dim=-2)
    return torch.stack([lo, hi], dim=-2)


def store_box_int8(box: torch.Tensor) -> torch.Tensor:
    """A ``summarize_key_box`` box as int8 gives it back, rounded outward (min down, max up)
    so that it still holds every key: one scale per row, ``absmax / 127``, like the other
    int8 summary rows; ``[..., 2, D]`` fp32."""
    scale = box.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127.0
    lo = torch.floor(box[..., :1, :] / scale[..., :1, :]).clamp(-127, 127)
    hi = torch.ceil(box[..., 1:, :] / scale[..., 1:, :]).clamp(-127, 127)
    return torch.cat([lo, hi], dim=-2) * scale


def box_floor_logmass(base: torch.Tensor, bound: torch.Tensor, slack: float) -> torch.Tensor:
    """``logaddexp(base, bound - slack)``: the first stage's log-masses ``[H_kv, G, n]``
    floored by the box's largest possible logit ``bound`` (:func:`box_max_logit`) less
    ``slack`` nats. A page whose one large key the base misses (not stored, drowned in the
    bulk's mean and variance) still scores near that key's logit when the box is tight in
    the query's direction; ``slack`` trades those pages against the pages the loose bound
    over-states (reads)."""
    return torch.logaddexp(base, bound - slack)


def standardized_key_order(pages: torch.Tensor, r: int) -> torch.Tensor:
    """Token indices ``[..., r]`` of the ``r`` keys of each page ``[..., 64, D]`` farthest from
    the page mean with each channel divided by its spread over the page (``sum_d z_d^2``,
    largest first): unlike ``ref.stored_key_order`` (plain L2), a key far out in a quiet
    channel, where a query weighting that channel finds a large logit, outranks keys that
    are merely far in the loud channels every key varies in."""
    pages = pages.float()
    dev = pages - pages.mean(dim=-2, keepdim=True)
    spread = dev.pow(2).mean(dim=-2, keepdim=True).sqrt().clamp_min(1e-6)
    dist = (dev / spread).pow(2).sum(dim=-1)  # [..., 64]
    return torch.sort(dist, dim=-1, descending=True, stable=True).indices[..., :r]


def summarize_top_standardized(pages: torch.Tensor, r: int) -> torch.Tensor:
    """``mvar_top{r}``'s layout ``[..., 2 + r, D]`` (bulk mean, bulk variance, stored keys)
    with the stored keys chosen by :func:`standardized_key_order`."""
    return ref.summarize_key_pages_by_order(pages, standardized_key_order(pages, r))


def query_chosen_logmass(
    query: torch.Tensor, pages: torch.Tensor, scale: float, r: int, storage: str | None
) -> torch.Tensor:
    """A ceiling for any rule that picks which keys ``mvar_top{r}`` stores: the ``r`` keys of
    each page ``[n, H_kv, 64, D]`` with the largest logit for this row's query (the largest
    over the group's query heads) stored, the rest the bulk, the summary as ``storage``
    (``ref.SUMMARY_DTYPES`` or None) gives it back; ``[H_kv, G, n]``. Not a writer's rule:
    the writer summarizes a page long before the queries that read it."""
    h_kv, d = pages.shape[1], pages.shape[-1]
    x = query.float().view(h_kv, -1, d) * scale
    logits = torch.einsum("hgd,nhtd->nhgt", x, pages.float()).amax(dim=2)  # [n, H, 64]
    order = logits.topk(r, dim=-1).indices
    summ = ref.summarize_key_pages_by_order(pages, order)
    if storage is not None:
        summ = ref.stored_summaries(summ, storage)
    return ref.top_page_logmass(query, summ, scale)


# --------------------------------------------------------------------------
# Stored keys chosen by an observation window of prompt queries (a prefill writer)
# --------------------------------------------------------------------------
def window_key_order(
    pages: torch.Tensor, window_q: torch.Tensor, window_pos: torch.Tensor, scale: float,
    r: int, l2_keys: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Token indices ``[n, H_kv, r]`` of the keys ``mvar_top{r}`` stores when the writer
    summarizes the prompt's pages ``[n, H_kv, 64, D]`` at the end of prefill with the
    prompt's last queries at hand (SnapKV's observation window): the first ``l2_keys`` by
    L2 distance from the page mean (``ref.stored_key_order``), the other ``r - l2_keys``
    the keys with the largest logit for some window query ``window_q`` ``[H_q, W, D]`` at
    absolute positions ``window_pos`` ``[W]`` (causal: a key after a query's position is
    not seen by it) over the group's query heads. No decode query is used."""
    n, h_kv, page, d = pages.shape
    x = window_q.float().view(h_kv, -1, window_q.shape[1], d) * scale  # [H, G, W, D]
    logits = torch.einsum("hgwd,nhtd->nhgwt", x, pages.float())  # [n, H, G, W, 64]
    key_pos = torch.arange(n * page).view(n, 1, 1, 1, page)
    seen = key_pos <= window_pos.view(1, 1, 1, -1, 1)
    score = torch.where(seen, logits, -math.inf).amax(dim=(2, 3))  # [n, H, 64]
    if l2_keys:
        first = ref.stored_key_order(pages, l2_keys)
        score = score.scatter(-1, first, math.inf)  # taken first, the rest by the window
    return score.topk(r, dim=-1).indices


def summarize_top_window(
    pages: torch.Tensor, window_q: torch.Tensor, window_pos: torch.Tensor, scale: float,
    r: int, l2_keys: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``mvar_top{r}``'s layout ``[..., 2 + r, D]`` with the stored keys chosen by
    :func:`window_key_order`."""
    order = window_key_order(pages, window_q, window_pos, scale, r, l2_keys)
    return ref.summarize_key_pages_by_order(pages, order)


def projected_key_order(pages: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """Token indices ``[n, H_kv, r]``: each page's ``r`` keys farthest (L2) from the page mean
    once the ``k`` leading axes of the head's key covariance over all ``pages``
    ``[n, H_kv, 64, D]`` are projected out (a per-head ``D x D`` projection a writer could
    take from a calibration run): the loud shared axes (positional, massive channels) no
    longer decide which keys count as far."""
    pages = pages.float()
    n, h_kv, page, d = pages.shape
    allk = pages.transpose(0, 1).reshape(h_kv, n * page, d)
    c = allk - allk.mean(1, keepdim=True)
    _, u = torch.linalg.eigh(c.transpose(1, 2) @ c / c.shape[1])  # ascending
    dev = pages - pages.mean(-2, keepdim=True)
    rest = torch.einsum("nhtd,hdk->nhtk", dev, u[:, :, : d - k])
    return torch.sort(rest.pow(2).sum(-1), dim=-1, descending=True, stable=True).indices[..., :r]


def summarize_top_projected(pages: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """``mvar_top{r}``'s layout with the stored keys chosen by :func:`projected_key_order`."""
    return ref.summarize_key_pages_by_order(pages, projected_key_order(pages, r, k))
