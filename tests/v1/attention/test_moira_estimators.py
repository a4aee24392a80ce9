# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the issue-10 page-mass estimators of the float32 reference
(``mvar_rem`` and ``mvar_top{r}``, docs/estimator.md) on constructed pages."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moira.v1.attention.ops import moira_reference as ref

PAGE = ref.PAGE_SIZE
D = 64
SCALE = D**-0.5
TOPS = sorted(ref.TOP_ESTIMATORS.items())


def _exact(query: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """Exact log-mass of one page ``[64, D]`` for queries ``[G, D]``: ``[G]``."""
    return torch.logsumexp(SCALE * query.float() @ page.float().T, dim=-1)


def _estimate(name: str, query: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """Estimate of one page (one KV head, G query heads): ``[G]``."""
    if name == "mvar":
        summ = torch.stack([page.mean(0), page.var(0, unbiased=False)])
        return ref.mvar_page_logmass(query, summ.view(1, 1, 2, D), SCALE)[0, :, 0]
    if name == "mvar_rem":
        summ = torch.stack([page.mean(0), page.var(0, unbiased=False)])
    else:
        summ = ref.summarize_key_pages_top(page, ref.TOP_ESTIMATORS[name])
    out = ref.outlier_page_logmass(query, summ.view(1, 1, *summ.shape), SCALE, name)
    return out[0, :, 0]


@pytest.mark.parametrize("name", ["mvar_rem"] + [n for n, _ in TOPS])
def test_equal_keys_give_exact_mass(name):
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(D, generator=gen) * 3
    page = key.expand(PAGE, D).clone()
    query = torch.randn(4, D, generator=gen) * 3
    torch.testing.assert_close(_estimate(name, query, page), _exact(query, page))


@pytest.mark.parametrize("name,r", TOPS)
def test_outlier_key_page_is_exact_and_mvar_is_not(name, r):
    """63 equal keys plus one far key aligned with the query: the stored key carries the
    mass, the bulk has zero variance, so the estimate is exact; mvar misses it by nats."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(D, generator=gen)
    query = torch.randn(1, D, generator=gen)
    page = base.expand(PAGE, D).clone()
    page[17] = base + 12.0 * query[0] / query[0].norm()  # logit +12 * s * |q| above the rest
    exact = _exact(query, page)
    got = _estimate(name, query, page)
    torch.testing.assert_close(got, exact)
    assert float(exact - _estimate("mvar", query, page)) > 3.0


@pytest.mark.parametrize("r", [1, 2, 4])
def test_top_summary_layout(r):
    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(3, 2, PAGE, D, generator=gen)
    pages[1, 0, 5] += 20.0  # a clear outlier
    summ = ref.summarize_key_pages_top(pages, r)
    assert summ.shape == (3, 2, 2 + r, D)
    for i in range(3):
        for h in range(2):
            page = pages[i, h]
            dist = ((page - page.mean(0)) ** 2).sum(-1)
            idx = torch.argsort(dist, descending=True)[:r]
            torch.testing.assert_close(summ[i, h, 2:], page[idx])
            rest = torch.ones(PAGE, dtype=torch.bool)
            rest[idx] = False
            torch.testing.assert_close(summ[i, h, 0], page[rest].mean(0))
            torch.testing.assert_close(summ[i, h, 1], page[rest].var(0, unbiased=False))
            # the paper's all-key mean is recoverable from the top-r summary
            mean_all = ((PAGE - r) * summ[i, h, 0] + summ[i, h, 2:].sum(0)) / PAGE
            torch.testing.assert_close(mean_all, page.mean(0), atol=1e-5, rtol=1e-5)
    assert bool((summ[1, 0, 2] == pages[1, 0, 5]).all())  # the outlier is stored first


def test_rem_spread_is_gaussian_then_linear():
    m = 60
    sc2 = 2 * math.log(m)
    v = torch.tensor([0.0, 1.0, sc2, sc2 * 4, 400.0])
    got = ref.rem_spread(v, m)
    sc = math.sqrt(sc2)
    want = torch.tensor([0.0, 0.5, 0.5 * sc2, sc * 2 * sc - 0.5 * sc2, sc * 20.0 - 0.5 * sc2])
    torch.testing.assert_close(got, want)
    # continuous with a continuous slope at sigma_c^2
    eps = 1e-3
    lo, mid, hi = ref.rem_spread(torch.tensor([sc2 - eps, sc2, sc2 + eps]), m).tolist()
    assert abs((mid - lo) - (hi - mid)) < 1e-5


def test_rem_is_closer_on_a_bounded_page():
    """Keys at mean +-10 on channel 0 (half each), query 8 there: the logits are the mean
    +-10 (s = 1/8), exact log-mean-exp log cosh(10) = 9.3; the Gaussian term 50 overshoots
    by far more than the REM term (2.88 * 10 - 4.16 = 24.7)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, D, generator=gen) * 0.1
    query[0, 0] = 8.0
    u = torch.zeros(D)
    u[0] = 1.0
    base = torch.randn(D, generator=gen)
    page = torch.stack([base + (10.0 if i % 2 else -10.0) * u for i in range(PAGE)])
    exact = _exact(query, page)
    err_mvar = float(_estimate("mvar", query, page) - exact)
    err_rem = float(_estimate("mvar_rem", query, page) - exact)
    assert err_mvar > 10.0
    assert 0.0 <= err_rem < 0.5 * err_mvar


def test_gaussian_page_top_close_to_mvar():
    """Low-spread Gaussian keys (no outliers): mvar_top stays close to mvar and to exact."""
    gen = torch.Generator().manual_seed(4)
    page = torch.randn(PAGE, D, generator=gen) * 0.2 + torch.randn(D, generator=gen)
    query = torch.randn(8, D, generator=gen)
    exact = _exact(query, page)
    for name, _ in TOPS:
        got = _estimate(name, query, page)
        assert float((got - exact).abs().max()) < 0.1, name
        assert float((got - _estimate("mvar", query, page)).abs().max()) < 0.1, name


@pytest.mark.parametrize("name", ["mvar_rem", "mvar_top2", "mvar_top4"])
def test_estimate_row_logmass_paged(name):
    """Through the paged cache: sink/current exact, middle pages from the summary,
    and a summary of the wrong slot count is refused."""
    gen = torch.Generator().manual_seed(5)
    h_kv, g, n_blocks, seq_len = 2, 3, 8, 5 * PAGE + 7
    kv = torch.randn(n_blocks, h_kv, PAGE, 2 * D, generator=gen)
    kv[2, 1, 9, :D] += 15.0  # an outlier key in block 2
    table = torch.tensor([3, 0, 2, 7, 5, 1], dtype=torch.int32)
    query = torch.randn(h_kv * g, D, generator=gen)
    blocks = torch.arange(n_blocks)
    if name == "mvar_rem":
        summ = ref.summarize_pages(kv, blocks)
    else:
        summ = ref.summarize_pages_top(kv, blocks, ref.TOP_ESTIMATORS[name])
    est = ref.estimate_row_logmass(query, kv, summ, table, seq_len, SCALE, name)
    exact = ref.estimate_row_logmass(query, kv, summ, table, seq_len, SCALE, "oracle")
    n = ref.num_pages(seq_len)
    assert est.shape == (h_kv, g, n)
    torch.testing.assert_close(est[..., [0, n - 1]], exact[..., [0, n - 1]])
    middle = ref.outlier_page_logmass(query, summ[table[1 : n - 1].long()], SCALE, name)
    torch.testing.assert_close(est[..., 1 : n - 1], middle)
    wrong = ref.summarize_pages_top(kv, blocks, 1)  # 3 slots: no estimator here reads it
    with pytest.raises(ValueError):
        ref.estimate_row_logmass(query, kv, wrong, table, seq_len, SCALE, name)


def test_reference_summaries_stay_on_the_pages_device():
    """The H200 checks run the reference on CUDA tensors: a tensor made without the pages'
    device (CPU by default) breaks them there. On the meta device any such tensor raises,
    so the CPU suite catches it."""
    pages = torch.empty(3, 2, ref.PAGE_SIZE, D, device="meta")
    top = ref.summarize_key_pages_top(pages, 8)
    assert top.device.type == "meta" and tuple(top.shape) == (3, 2, 10, D)
    packed = ref.pack_int4_summaries(top)
    assert packed.device.type == "meta" and tuple(packed.shape) == (3, 2, 7, D)
    for summary_dtype in ("int8", "int4"):
        assert ref.stored_summaries(top, summary_dtype).device.type == "meta"
