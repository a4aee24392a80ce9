# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/research_estimators.py: the estimators studied and not kept,
against exact page masses and the shipped reference (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from _load import load

from vllm_moira.v1.attention.ops import moira_reference as ref

research = load("probes.research_estimators")

PAGE, D, SCALE = 64, 16, 0.25


def _paged_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(6, 2, PAGE, 2 * D, generator=gen)
    kv[3, 0, 5, :D] += 6.0  # an outlier key
    query = torch.randn(2 * 3, D, generator=gen)
    return kv, query


def test_ext_summary_is_the_paper_summary_plus_min_and_max():
    kv, _ = _paged_case()
    blocks = torch.arange(kv.shape[0])
    ext = research.summarize_pages_ext(kv, blocks)
    assert ext.shape == (6, 2, research.SUMMARY_SLOTS_EXT, D)
    torch.testing.assert_close(ext[:, :, :2], ref.summarize_pages(kv, blocks).float())
    keys = kv[:, :, :, :D]
    torch.testing.assert_close(ext[:, :, 2], keys.amin(dim=2))
    torch.testing.assert_close(ext[:, :, 3], keys.amax(dim=2))


def test_box_bounds_every_page_from_above():
    kv, query = _paged_case(1)
    ext = research.summarize_pages_ext(kv, torch.arange(kv.shape[0]))
    box = research.box_page_logmass(query, ext, SCALE)  # [H, G, n]
    keys = kv[:, :, :, :D].permute(1, 0, 2, 3)  # [H, n, 64, D]
    logits = torch.einsum("hgd,hntd->hgnt", query.view(2, 3, D), keys) * SCALE
    exact = torch.logsumexp(logits, dim=-1)
    assert bool((box >= exact - 1e-4).all())
    assert float((box - exact).max()) > 0.1  # a bound, not the mass


def test_mvar_variants_combine_mvar_and_box():
    kv, query = _paged_case(2)
    ext = research.summarize_pages_ext(kv, torch.arange(kv.shape[0]))
    mvar = ref.mvar_page_logmass(query, ext[:, :, :2], SCALE)
    box = research.box_page_logmass(query, ext, SCALE)
    got = {
        e: research.robust_page_logmass(query, ext, SCALE, e) for e in research.ROBUST_ESTIMATORS
    }
    torch.testing.assert_close(got["box"], box)
    torch.testing.assert_close(got["mvar_box"], torch.minimum(mvar, box))
    mean_term = ref.mvar_page_logmass(
        query, torch.stack([ext[:, :, 0], torch.zeros_like(ext[:, :, 1])], 2), SCALE
    )
    torch.testing.assert_close(got["mvar_max"], torch.logaddexp(mean_term, box))
    spread = mvar - mean_term
    want_cap = mean_term + spread.clamp_max(research.DEFAULT_VAR_CAP)
    torch.testing.assert_close(got["mvar_cap"], want_cap)
    # Bennett's term is the smaller of the Gaussian one and its own, channel by
    # channel; for a sharp query (large spread) its own is the smaller.
    sharp = query * 4.0
    bennett = research.robust_page_logmass(sharp, ext, SCALE, "mvar_bennett")
    sharp_mvar = ref.mvar_page_logmass(sharp, ext[:, :, :2], SCALE)
    assert bool((bennett <= sharp_mvar + 1e-4).all())
    assert bool((bennett < sharp_mvar - 1e-2).any())


def test_robust_estimators_need_the_four_slot_summary():
    kv, query = _paged_case(3)
    two_slots = ref.summarize_pages(kv, torch.arange(kv.shape[0]))
    with pytest.raises(ValueError, match="4-slot summary"):
        research.robust_page_logmass(query, two_slots, SCALE, "box")
    with pytest.raises(ValueError, match="unknown estimator"):
        research.robust_page_logmass(
            query, research.summarize_pages_ext(kv, torch.arange(6)), SCALE, "mvar_bad"
        )


@pytest.mark.parametrize("estimator", ["box", "mvar_bennett"])
def test_paged_row_keeps_sink_and_current_page_exact(estimator):
    kv, query = _paged_case(4)
    table = torch.tensor([2, 0, 3, 5, 1], dtype=torch.int32)
    seq_len = 4 * PAGE + 9
    ext = research.summarize_pages_ext(kv, torch.arange(kv.shape[0]))
    est = research.estimate_row_logmass_robust(query, kv, ext, table, seq_len, SCALE, estimator)
    exact = ref.estimate_row_logmass(query, kv, ext[:, :, :2], table, seq_len, SCALE, "oracle")
    n = ref.num_pages(seq_len)
    assert est.shape == (2, 3, n)
    torch.testing.assert_close(est[..., [0, n - 1]], exact[..., [0, n - 1]])
    middle = research.robust_page_logmass(query, ext[table[1 : n - 1].long()], SCALE, estimator)
    torch.testing.assert_close(est[..., 1 : n - 1], middle)
    assert math.isfinite(float(est.sum()))


def test_reference_keeps_only_the_shipped_estimators():
    kv, query = _paged_case(5)
    ext = research.summarize_pages_ext(kv, torch.arange(kv.shape[0]))
    table = torch.tensor([2, 0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown estimator 'box'"):
        ref.estimate_row_logmass(query, kv, ext, table, 2 * PAGE + 1, SCALE, "box")
