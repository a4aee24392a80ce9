# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/estimator_errors.py: the bulk's error split on synthetic pages."""

from __future__ import annotations

import math

import torch
from _load import load

from vllm_moira.v1.attention.ops import moira_reference as ref

errors = load("probes.estimator_errors")


def test_independent_channels_have_no_covariance_excess():
    gen = torch.Generator().manual_seed(0)
    # keys vary along one channel only: the per-channel variance is the variance along x
    pages = torch.zeros(3, 1, 64, 8)
    pages[..., 2] = torch.randn(3, 1, 64, generator=gen)
    query = torch.randn(2, 8, generator=gen)
    parts = errors.bulk_decomposition(query, pages, r=4, scale=1.0)
    torch.testing.assert_close(parts["var_ratio"], torch.ones(1, 2, 3))
    torch.testing.assert_close(parts["variance_excess"], torch.zeros(1, 2, 3))


def test_channels_that_cancel_along_the_query_show_as_covariance_excess():
    gen = torch.Generator().manual_seed(1)
    pages = torch.zeros(2, 1, 64, 4)
    z = 3.0 * torch.randn(2, 1, 64, generator=gen)
    pages[..., 0], pages[..., 1] = z, z  # perfectly correlated channels
    query = torch.tensor([[1.0, -1.0, 0.0, 0.0]])  # along which they cancel
    parts = errors.bulk_decomposition(query, pages, r=0 + 1, scale=1.0)
    assert bool((parts["var_ratio"] > 1e6).all())  # no variance along x at all
    assert bool((parts["variance_excess"] > 5.0).all())
    # a logit variance of zero: the bulk's log-mean-exp is its mean, no tail excess
    torch.testing.assert_close(parts["tail_excess"], torch.zeros(1, 1, 2), atol=1e-5, rtol=0)


def test_tail_excess_is_rem_minus_the_exact_log_mean_exp():
    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(2, 1, 64, 4, generator=gen)
    query = torch.randn(1, 4, generator=gen)
    parts = errors.bulk_decomposition(query, pages, r=8, scale=0.5)
    x = query[0] * 0.5
    mean = pages.mean(dim=-2, keepdim=True)
    order = ((pages - mean) ** 2).sum(-1).sort(dim=-1, descending=True, stable=True).indices
    for p in range(2):
        bulk = pages[p, 0, order[p, 0, 8:]]
        logits = bulk @ x
        lme = torch.logsumexp(logits, 0) - math.log(56) - logits.mean()
        want = ref.rem_spread(logits.var(unbiased=False), 56) - lme
        torch.testing.assert_close(parts["tail_excess"][0, 0, p], want, atol=1e-4, rtol=1e-4)
