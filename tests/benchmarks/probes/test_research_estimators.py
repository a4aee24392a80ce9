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


def _pages_and_exact(seed: int):
    kv, query = _paged_case(seed)
    pages = kv[:, :, :, :D]  # [n, H, 64, D]
    logits = torch.einsum("hgd,nhtd->hgnt", query.view(2, 3, D) * SCALE, pages)
    return pages, query, torch.logsumexp(logits, dim=-1)


def test_page_spread_bounds_are_the_largest_deviations_from_the_mean():
    pages, _, _ = _pages_and_exact(6)
    radius, chan = research.page_spread_bounds(pages)
    dev = pages - pages.mean(dim=2, keepdim=True)
    assert radius.shape == pages.shape[:2] and chan.shape == (*pages.shape[:2], D)
    torch.testing.assert_close(radius, dev.norm(dim=-1).amax(dim=-1))
    torch.testing.assert_close(chan, dev.abs().amax(dim=2))
    assert float(radius[3, 0]) > float(radius[2, 0]) + 3.0  # the outlier key of page 3


def test_radius_bound_is_an_upper_bound_and_caps_the_gaussian_spread():
    pages, query, exact = _pages_and_exact(7)
    mean, var = pages.mean(dim=2), pages.var(dim=2, unbiased=False)
    radius, chan = research.page_spread_bounds(pages)
    sharp = query * 40.0  # Eq. 2's x^2 var / 2 grows past the radius bound
    upper = research.radius_upper_logmass(sharp, mean, radius, SCALE)
    logits = torch.einsum("hgd,nhtd->hgnt", sharp.view(2, 3, D) * SCALE, pages)
    assert bool((upper >= torch.logsumexp(logits, -1) - 1e-4).all())
    gauss = research.capped_spread_logmass(sharp, mean, var, SCALE, rem=False)
    torch.testing.assert_close(
        gauss, ref.mvar_page_logmass(sharp, torch.stack([mean, var], 2), SCALE)
    )
    capped = research.capped_spread_logmass(sharp, mean, var, SCALE, radius=radius, rem=False)
    torch.testing.assert_close(capped, torch.minimum(gauss, upper))
    assert bool((capped < gauss - 1.0).any())
    both = research.capped_spread_logmass(sharp, mean, var, SCALE, radius, chan, rem=True)
    assert bool((both <= capped + 1e-4).all())
    rem = ref.rem_page_logmass(sharp, torch.stack([mean, var], 2), SCALE)
    assert bool((both <= rem + 1e-4).all())


def test_refine_band_brackets_the_stage1_threshold():
    pibar = torch.tensor([0.05, 0.40, 0.20, 0.10, 0.05, 0.02, 0.005, 0.1])
    # gamma 0.88: target 0.88 - 0.05 - 0.1 = 0.73 -> middle pages 0.40, 0.20, 0.10, 0.05: tau 0.05
    assert ref.select_pages(pibar, gamma=0.88).tolist() == [0, 1, 2, 3, 4, 7]
    band = research.refine_band(pibar, 0.88, below=math.log(3.0), above=math.log(2.5))
    assert band.tolist() == [False, False, False, True, True, True, False, False]
    above_all = research.refine_band(pibar, 0.88, below=0.0, above=math.inf)
    assert above_all.tolist() == [False, True, True, True, True, False, False, False]
    assert not research.refine_band(pibar[:2], 0.9, 1.0, 1.0).any()


def test_wide_threshold_is_relative_to_rem_critical_variance():
    summ = torch.zeros(3, 1, 10, 4)
    summ[:, 0, 1] = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0], [3.0, 0, 0, 0]])
    query = torch.tensor([[2.0, 0, 0, 0]])  # x^2 = 4: v = 4, 8, 12
    wide = research.wide_pages(query, summ, 1.0, num_top=8, factor=0.75)
    critical = 0.75 * 2 * math.log(56)  # 6.04
    assert wide.tolist() == [[v >= critical for v in (4.0, 8.0, 12.0)]]
    # A smaller factor lowers the bar: every page is wide at 0.25 (critical 2.01).
    assert research.wide_pages(query, summ, 1.0, num_top=8, factor=0.25).tolist() == [[True] * 3]


def test_two_stage_replaces_only_the_refined_pages():
    gen = torch.Generator().manual_seed(8)
    stage1 = torch.randn(2, 3, 10, generator=gen) * 2
    stage2 = stage1 + 5.0
    est, mask = research.two_stage_logmass(stage1, stage2, 0.9, 1.0, 1.0)
    assert mask.shape == (2, 10) and bool(mask.any()) and not bool(mask.all())
    assert not bool(mask[:, [0, 9]].any())
    pibar = ref.group_mean_shares(stage1)
    for h in range(2):
        torch.testing.assert_close(mask[h], research.refine_band(pibar[h], 0.9, 1.0, 1.0))
    torch.testing.assert_close(est, torch.where(mask.unsqueeze(1), stage2, stage1))


def test_bound_gated_refines_dropped_pages_the_bound_cannot_rule_out():
    stage1 = torch.log(torch.tensor([[[0.1, 0.5, 0.3, 0.02, 0.01, 0.07]]]))  # one KV head, G=1
    upper = stage1.clone()
    upper[..., 3] = math.log(0.4)  # might be a big page
    upper[..., 4] = math.log(0.011)  # bounded: cannot matter
    stage2 = stage1 + 1.0
    # gamma 0.9: target 0.9 - 0.1 - 0.07 = 0.73 -> keeps 0.5, 0.3; tau 0.3
    est, mask = research.bound_gated_logmass(stage1, upper, stage2, 0.9, slack=0.0)
    assert mask.tolist() == [[False, False, False, True, False, False]]
    torch.testing.assert_close(est[..., 3], stage2[..., 3])
    torch.testing.assert_close(est[..., [0, 1, 2, 4, 5]], stage1[..., [0, 1, 2, 4, 5]])
    _, wide = research.bound_gated_logmass(stage1, upper, stage2, 0.9, slack=math.log(100.0))
    assert wide.tolist() == [[False, False, False, True, True, False]]


def test_anchored_estimate_adds_the_last_exact_error_of_kept_middle_pages():
    gen = torch.Generator().manual_seed(3)
    h_kv, g, n = 2, 3, 6
    base_0 = torch.randn(h_kv, g, n, generator=gen)
    exact_0 = torch.randn(h_kv, g, n, generator=gen)
    anchor = research.AnchoredEstimate(h_kv, n + 1)
    assert torch.equal(anchor.correct(base_0), base_0)  # nothing anchored yet
    lists = [torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 1, 3, 5])]
    anchor.update(lists, exact_0, base_0)
    base_1 = torch.randn(h_kv, g, n, generator=gen)
    got = anchor.correct(base_1)
    want = base_1.clone()
    for h, pages in ((0, [2]), (1, [1, 3])):  # middle pages only: not the sink, not page 5
        want[h][:, pages] += exact_0[h][:, pages] - base_0[h][:, pages]
    assert torch.allclose(got, want)
    # a base equal to the anchored step's gives back that step's exact masses
    assert torch.allclose(anchor.correct(base_0)[0, :, 2], exact_0[0, :, 2])


def test_anchored_estimate_horizon_and_down_only():
    h_kv, g, n = 1, 1, 5
    base = torch.zeros(h_kv, g, n)
    exact = torch.tensor([[[0.0, 2.0, -3.0, 0.0, 0.0]]])
    down = research.AnchoredEstimate(h_kv, n, down_only=True)
    down.update([torch.tensor([0, 1, 2, 4])], exact, base)
    assert down.correct(base)[0, 0].tolist() == [0.0, 0.0, -3.0, 0.0, 0.0]
    h1 = research.AnchoredEstimate(h_kv, n, horizon=1)
    h1.update([torch.tensor([0, 1, 4])], exact, base)
    assert h1.correct(base)[0, 0, 1] == 2.0
    h1.update([torch.tensor([0, 2, 4])], exact, base)  # page 1 not kept: its anchor expires
    assert h1.correct(base)[0, 0].tolist() == [0.0, 0.0, -3.0, 0.0, 0.0]


def test_uniform_spread_is_the_log_mean_exp_of_uniform_logits():
    v = torch.tensor([0.0, 1e-8, 0.3, 3.0, 40.0])
    got = research.uniform_spread(v)
    a = (3 * v).sqrt()
    grid = torch.linspace(-1, 1, 200001, dtype=torch.float64)
    for i in range(len(v)):  # log E exp(X), X uniform on [-a, a], by quadrature
        want = torch.logsumexp(grid * float(a[i]), 0) - math.log(len(grid))
        assert float(got[i]) == pytest.approx(float(want), abs=1e-4)
    # never above the Gaussian's v / 2; for a wide page (v = 40) 6 nats under REM's term
    assert (got <= 0.5 * v + 1e-6).all()
    assert float(got[-1]) < float(ref.rem_spread(v, 56)[-1]) - 6.0


def test_top_spread_with_rem_would_be_the_shipped_top_estimator():
    kv, query = _paged_case()
    pages = kv[..., :D]  # [n, H, 64, D]
    summ = ref.summarize_key_pages_top(pages, 4)
    research.SPREADS["rem_test"] = lambda v: ref.rem_spread(v, PAGE - 4)
    try:
        got = research.top_spread_logmass(query, summ, SCALE, "rem_test")
    finally:
        del research.SPREADS["rem_test"]
    assert torch.allclose(got, ref.top_page_logmass(query, summ, SCALE), atol=1e-5)


def test_two_stage_only_narrows_the_refined_pages():
    gen = torch.Generator().manual_seed(8)
    stage1 = torch.randn(2, 3, 10, generator=gen) * 2
    stage2 = stage1 - 4.0
    _, band = research.two_stage_logmass(stage1, stage2, 0.9, 1.0, math.inf)
    only = torch.zeros(2, 10, dtype=torch.bool)
    only[:, ::2] = True
    est, mask = research.two_stage_logmass(stage1, stage2, 0.9, 1.0, math.inf, only)
    torch.testing.assert_close(mask, band & only)
    torch.testing.assert_close(est, torch.where(mask.unsqueeze(1), stage2, stage1))


def test_principal_axes_give_the_variance_along_the_query():
    pages, query, _ = _pages_and_exact(5)  # [n, H, 64, D]
    r = 4
    summ = research.summarize_top_pc(pages, r, k=D)  # every axis: the full covariance
    assert summ.shape == (*pages.shape[:2], 2 + D + r, D)
    top = ref.summarize_key_pages_top(pages, r)
    torch.testing.assert_close(summ[:, :, :2], top[:, :, :2])
    torch.testing.assert_close(summ[:, :, 2 + D :], top[:, :, 2:])
    # with all D axes the bulk term uses x^T Cov x: the Gaussian variance of the bulk logits
    got = research.top_pc_logmass(query, summ, SCALE, k=D)
    x = query.view(2, 3, D) * SCALE
    mean = pages.mean(dim=-2, keepdim=True)
    order = ((pages - mean) ** 2).sum(-1).sort(dim=-1, descending=True, stable=True).indices
    bulk_idx = order[..., r:]  # [n, H, 60]
    bulk = torch.gather(pages, 2, bulk_idx.unsqueeze(-1).expand(-1, -1, -1, D))
    logits = torch.einsum("hgd,nhtd->hgnt", x, bulk)
    v = logits.var(dim=-1, unbiased=False)
    mu = torch.einsum("hgd,nhd->hgn", x, top[:, :, 0])
    stored = torch.einsum("hgd,nhrd->hgnr", x, top[:, :, 2:])
    want = torch.logaddexp(
        mu + ref.rem_spread(v, PAGE - r) + math.log(PAGE - r), torch.logsumexp(stored, -1)
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bennett_spread_bounds_and_the_max_cap():
    v = torch.tensor([0.5, 4.0, 30.0])
    b = torch.tensor([3.0, 3.0, 8.0])
    ben = research.bennett_spread(v, b)
    assert bool((ben <= b + 1e-6).all())
    # two-point variable (b with probability p, -v/b otherwise) attains it
    p = v / (v + b * b)
    two_point = torch.log(p * torch.exp(b) + (1 - p) * torch.exp(-v / b))
    torch.testing.assert_close(ben, two_point)
    pages, query, exact = _pages_and_exact(6)
    summ = research.summarize_top_pc_bound(pages, 4, k=2)
    for rule in ("max", "bennett"):
        capped = research.top_pc_bound_logmass(query, summ, SCALE, 2, rule)
        assert capped.shape == exact.shape
        # the cap only ever lowers the bulk term; the bound itself is above the true bulk max
        without_bound = torch.cat([summ[:, :, :4], summ[:, :, 5:]], 2)
        plain = research.top_pc_logmass(query, without_bound, SCALE, 2)
        assert bool((capped <= plain + 1e-5).all())


def test_sampled_stage_two_with_every_key_is_the_exact_mass():
    pages, query, exact = _pages_and_exact(9)
    torch.testing.assert_close(research.sampled_logmass(query, pages, SCALE, 4, 1), exact)
    # every other bulk key, scaled: an estimate, not the mass
    half = research.sampled_logmass(query, pages, SCALE, 4, 2)
    assert half.shape == exact.shape and not torch.allclose(half, exact)


def test_quantized_keys_approach_the_exact_mass_as_bits_grow():
    pages, query, exact = _pages_and_exact(9)
    errors = [
        float((research.quantized_key_logmass(query, pages, SCALE, bits) - exact).abs().max())
        for bits in (2, 4, 8, 16)
    ]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-3 < errors[0]
    # keys already on the grid (one scale per channel) come back exactly
    levels = 7
    grid = torch.randint(-levels, levels + 1, pages.shape).float()
    grid[:, :, 0] = levels  # every channel's absmax on the grid
    on_grid = grid * torch.rand(1, pages.shape[1], 1, pages.shape[3])
    exact_on_grid = torch.logsumexp(
        torch.einsum("hgd,nhtd->hgnt", query.float().view(pages.shape[1], -1, pages.shape[3])
                     * SCALE, on_grid), dim=-1)  # fmt: skip
    torch.testing.assert_close(
        research.quantized_key_logmass(query, on_grid, SCALE, 4), exact_on_grid
    )


def test_centered_quantization_spends_no_levels_on_a_channel_offset():
    pages, query, exact = _pages_and_exact(9)
    offset = torch.zeros(pages.shape[-1])
    offset[:3] = 40.0  # outlier channels: a large constant part in every key of the head
    shifted = pages + offset
    exact_shifted = research.quantized_key_logmass(query, shifted, SCALE, 16)
    plain = research.quantized_key_logmass(query, shifted, SCALE, 4)
    centered = research.quantized_key_logmass(query, shifted, SCALE, 4, centered=True)
    assert float((centered - exact_shifted).abs().max()) < float(
        (plain - exact_shifted).abs().max()
    )


def test_channel_subset_keeps_the_channels_that_vary():
    pages, query, _ = _pages_and_exact(9)
    flat = pages.clone()
    flat[..., 2:] = flat[..., 2:].mean(dim=2, keepdim=True)  # only channels 0 and 1 vary
    full = research.quantized_key_logmass(query, flat, SCALE, 16, centered=True)
    two = research.quantized_key_logmass(query, flat, SCALE, 16, centered=True, channels=2)
    torch.testing.assert_close(two, full)
    one = research.quantized_key_logmass(query, flat, SCALE, 16, centered=True, channels=1)
    assert not torch.allclose(one, full)
    with pytest.raises(ValueError, match="centered"):
        research.quantized_key_logmass(query, flat, SCALE, 4, channels=2)


def test_principal_axes_hold_keys_that_live_in_a_subspace():
    pages, query, _ = _pages_and_exact(9)
    n, h_kv, page, d = pages.shape
    basis = torch.linalg.qr(torch.randn(d, 2))[0]  # two directions
    low_rank = (pages[..., :2] @ basis.T) + torch.randn(n, h_kv, 1, d)  # page means + plane
    exact = research.quantized_key_logmass(query, low_rank, SCALE, 16, centered=True)
    axes = research.principal_key_axes(low_rank, 2)
    assert axes.shape == (h_kv, d, 2)
    two = research.quantized_key_logmass(query, low_rank, SCALE, 16, centered=True, axes=axes)
    torch.testing.assert_close(two, exact, atol=1e-3, rtol=1e-4)
    one = research.quantized_key_logmass(query, low_rank, SCALE, 16, centered=True,
                                         axes=research.principal_key_axes(low_rank, 1))  # fmt: skip
    assert not torch.allclose(one, exact, atol=1e-2)
    # the residual's spread term: nothing to add where the axes hold the keys, a raise where not
    spread = research.quantized_key_logmass(query, low_rank, SCALE, 16, centered=True, axes=axes,
                                            residual_spread=True)  # fmt: skip
    torch.testing.assert_close(spread, two, atol=1e-4, rtol=1e-5)
    one_spread = research.quantized_key_logmass(
        query, low_rank, SCALE, 16, centered=True,
        axes=research.principal_key_axes(low_rank, 1), residual_spread=True,
    )  # fmt: skip
    assert bool((one_spread > one).all())


def test_cap_refined_keeps_the_largest_shares():
    mask = torch.tensor([[False, True, True, True, True, True, False, False, True, False, True,
                          False]])  # fmt: skip
    pibar = torch.arange(12, dtype=torch.float32).unsqueeze(0) / 100.0
    # 10 middle pages, cap 0.2: the 2 refined pages of largest share (10 and 8)
    capped = research.cap_refined(mask, pibar, 0.2)
    assert capped.nonzero()[:, 1].tolist() == [8, 10]
    assert torch.equal(research.cap_refined(mask, pibar, float("inf")), mask)
    assert not research.cap_refined(mask, pibar, 0.0).any()
    assert torch.equal(research.cap_refined(mask, pibar, 1.0), mask)  # more room than pages


def test_sub_page_estimate_spans_mvar_to_the_exact_mass():
    # One run of 64 keys is the paper's mvar; 64 runs of one key (variance 0) are the
    # exact log-mass; runs in between add their Gaussian terms.
    torch.manual_seed(0)
    n, h_kv, g, d = 5, 2, 3, 16
    pages = torch.randn(n, h_kv, ref.PAGE_SIZE, d)
    query = torch.randn(h_kv * g, d)
    scale = d**-0.5
    one = research.summarize_sub_pages(pages, 1)
    mvar = ref.mvar_page_logmass(query, one, scale)
    assert torch.allclose(research.sub_page_logmass(query, one, scale, rem=False), mvar)
    every = research.summarize_sub_pages(pages, ref.PAGE_SIZE)
    logits = torch.einsum("hgd,nhtd->hgnt", query.view(h_kv, g, d) * scale, pages)
    exact = torch.logsumexp(logits, dim=-1)
    for rem in (False, True):
        got = research.sub_page_logmass(query, every, scale, rem=rem)
        assert torch.allclose(got, exact, atol=1e-5)
    four = research.summarize_sub_pages(pages, 4)
    assert four.shape == (n, h_kv, 8, d)
    assert torch.allclose(four[:, :, 2], pages[:, :, 16:32].mean(dim=-2))
    with pytest.raises(ValueError, match="must divide"):
        research.summarize_sub_pages(pages, 3)


def test_box_floor_sees_a_key_the_top_estimate_misses():
    pages, query, exact = _pages_and_exact(11)
    # every bulk key's logit is under the bulk box's bound, stored int8 (rounded outward)
    box = research.store_box_int8(research.summarize_key_box(pages, 8))
    bound = research.box_max_logit(query, box, SCALE)  # [H, G, n]
    bulk = research.bulk_mask(pages, 8)  # [n, H, 64]
    h_kv = pages.shape[1]
    logits = torch.einsum("hgd,nhtd->hgnt", query.view(h_kv, -1, D) * SCALE, pages)
    bulk_logits = torch.where(bulk.permute(1, 0, 2).unsqueeze(1), logits, -math.inf)
    assert bool((bound >= bulk_logits.amax(-1) - 1e-5).all())
    # the full box holds every key, so its bound is at least the bulk's
    full = research.store_box_int8(research.summarize_key_box(pages))
    assert bool((research.box_max_logit(query, full, SCALE) >= bound - 1e-5).all())
    base = ref.top_page_logmass(query, ref.summarize_key_pages_top(pages, 8), SCALE)
    floored = research.box_floor_logmass(base, bound, 4.0)
    assert bool((floored >= base).all()) and bool((floored >= bound - 4.0).all())
    # a huge slack leaves the base as it was
    torch.testing.assert_close(research.box_floor_logmass(base, bound, 1e4), base)


def test_standardized_order_prefers_a_key_far_out_in_a_quiet_channel():
    gen = torch.Generator().manual_seed(3)
    page = torch.randn(ref.PAGE_SIZE, D, generator=gen) * 0.1
    page[:, 0] *= 100.0  # a loud channel: every key is far out in it
    page[7, 5] += 2.0  # key 7: far out (20 sigma) in a quiet channel
    assert 7 not in ref.stored_key_order(page, 4).tolist()
    assert research.standardized_key_order(page, 4)[0] == 7
    summ = research.summarize_top_standardized(page.unsqueeze(0), 4)[0]
    assert summ.shape == (2 + 4, D)
    torch.testing.assert_close(summ[2], page[7])
    rest = torch.ones(ref.PAGE_SIZE, dtype=torch.bool)
    rest[research.standardized_key_order(page, 4)] = False
    torch.testing.assert_close(summ[0], page[rest].mean(0))
    torch.testing.assert_close(summ[1], page[rest].var(0, unbiased=False))


def test_query_chosen_keys_store_the_largest_logits():
    pages, query, exact = _pages_and_exact(12)
    # all but one key stored: the bulk is one key, its variance 0, so the mass is exact
    got = research.query_chosen_logmass(query, pages, SCALE, ref.PAGE_SIZE - 1, None)
    torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-5)
    # the planted outlier (page 3, head 0, token 5) is stored when it tops the logits
    x = query.view(2, 3, D) * SCALE
    logits = torch.einsum("gd,td->gt", x[0], pages[3, 0]).amax(0)
    chosen = research.query_chosen_logmass(query, pages, SCALE, 1, None)
    order = torch.tensor([[int(logits.argmax())]])
    summ = ref.summarize_key_pages_by_order(pages[3:4, :1], order.view(1, 1, 1))
    torch.testing.assert_close(
        chosen[0, :, 3], ref.top_page_logmass(query[:3], summ, SCALE)[0, :, 0]
    )


def test_window_chosen_keys_are_the_window_queries_largest_logits_and_causal():
    pages, query, _ = _pages_and_exact(12)  # [n, 2, 64, D], 6 query heads
    n = pages.shape[0]
    window = torch.stack([query, -query], dim=1)  # [6, 2, D]: two window rows
    last = n * ref.PAGE_SIZE - 1
    pos = torch.tensor([last, last])  # both see every key
    order = research.window_key_order(pages, window, pos, SCALE, 1)
    x = window.view(2, 3, 2, D) * SCALE
    logits = torch.einsum("hgwd,nhtd->nhgwt", x, pages).amax(dim=(2, 3))
    assert torch.equal(order[..., 0], logits.argmax(-1))
    # l2_keys first: mvar_top's farthest keys, then the window's
    mixed = research.window_key_order(pages, window, pos, SCALE, 4, l2_keys=2)
    l2_first = ref.stored_key_order(pages, 2).sort(-1).values
    assert torch.equal(mixed[..., :2].sort(-1).values, l2_first)
    # a window row at position p sees no key after p: the last page is unseen, its order
    # falls back to the first tokens (all scores -inf, topk's ties)
    early = research.window_key_order(pages, window, torch.tensor([last - 64, last - 64]), SCALE, 1)
    assert torch.equal(early[:-1], order[:-1])
    summ = research.summarize_top_window(pages, window, pos, SCALE, 8, 4)
    assert summ.shape == (n, 2, 2 + 8, D)


def test_projected_order_ignores_the_heads_loud_shared_axis():
    gen = torch.Generator().manual_seed(5)
    pages = torch.randn(4, 1, ref.PAGE_SIZE, D, generator=gen) * 0.1
    pages[..., 0] += torch.randn(4, 1, ref.PAGE_SIZE, generator=gen) * 50.0  # loud axis 0
    pages[2, 0, 9, 3] += 3.0  # key 9 of page 2: far out off the loud axis
    assert 9 not in ref.stored_key_order(pages[2, 0], 4).tolist()
    assert int(research.projected_key_order(pages, 4, 1)[2, 0, 0]) == 9
    assert research.summarize_top_projected(pages, 8, 1).shape == (4, 1, 2 + 8, D)
