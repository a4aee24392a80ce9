# SPDX-License-Identifier: Apache-2.0
"""Pure helpers of benchmarks/bench_kernel_spread.py (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _load import ROOT, load

ks = load("bench_kernel_spread")


def test_imports_are_gpu_free():
    # the scripts import torch / vLLM only inside their GPU functions
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "import benchmarks.bench_kernel_spread, benchmarks.bench_tpot, benchmarks.plot_results; "
        "bad = [m for m in ('torch', 'vllm', 'triton', 'matplotlib') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert ks.parse_shapes("8192x32, 131072x4") == [(8192, 32), (131072, 4)]


@pytest.mark.parametrize(
    "context,batch,label",
    [(8192, 32, "8k x32"), (32768, 16, "32k x16"), (65536, 8, "64k x8"), (131072, 4, "131k x4")],
)
def test_shape_label(context, batch, label):
    assert ks.shape_label(context, batch) == label


@pytest.mark.parametrize("context,batch", ks.parse_shapes(ks.DEFAULT_SHAPES))
@pytest.mark.parametrize("cv", [0.0, 0.5, 1.0])
def test_list_lengths_hit_mean_and_cv(context, batch, cv):
    n_pages = -(-context // ks.PAGE)
    count = batch * ks.HKV
    lengths = ks.list_lengths(count, n_pages, 0.22, cv, seed=3)
    assert lengths.shape == (count,)
    assert lengths.min() >= 2 and lengths.max() <= n_pages
    # mean within one page (rounding) of 22%
    assert abs(lengths.mean() - 0.22 * n_pages) <= max(1.0, 0.005 * n_pages)
    if cv == 0:
        assert ks.cv_of(lengths) == 0
    else:  # quantile draw: close to nominal even for 32 lengths (clipping lowers it)
        assert cv * 0.88 <= ks.cv_of(lengths) <= cv * 1.02


def test_list_lengths_deterministic():
    a = ks.list_lengths(256, 128, 0.22, 1.0, seed=1)
    b = ks.list_lengths(256, 128, 0.22, 1.0, seed=1)
    assert np.array_equal(a, b)


def test_gamma_quantiles_exponential():
    q = np.array([0.1, 0.5, 0.9])
    got = ks._gamma_quantiles(q, 1.0)  # Gamma(1) = Exp(1)
    assert np.allclose(got, -np.log(1 - q), atol=1e-6)


def test_page_lists_sink_current_and_nested_padding():
    orders = ks.page_orders(6, 40, seed=0)
    lengths = [2, 3, 10, 40, 7, 20]
    lists = ks.padded_lists(orders, lengths)
    padded = ks.padded_lists(orders, [40] * 6)
    for pages, n, full in zip(lists, lengths, padded):
        assert len(pages) == n == len(set(pages.tolist()))
        assert pages[0] == 0 and pages[-1] == 39  # sink first, current page last
        assert np.all(np.diff(pages) > 0)
        assert set(pages.tolist()) <= set(full.tolist())  # padding adds real pages only
        assert sorted(full.tolist()) == list(range(40))


def test_pow2_buckets():
    b = ks.pow2_buckets([2, 3, 4, 5, 100, 2048, 1500], 2048)
    assert b == {2: [0], 4: [1, 2], 8: [3], 128: [4], 2048: [5, 6]}
    assert ks.pow2_buckets([3, 5], 6) == {4: [0], 6: [1]}  # capped at the row's pages
    assert [ks.next_pow2(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]


def test_real_fractions(tmp_path):
    path = tmp_path / "fr.json"
    path.write_text(json.dumps({"fractions": [0.3, 0.4, 0.35]}))
    fr = ks.load_fractions(str(path))
    lengths = ks.lengths_from_fractions(64, 2048, fr, seed=0)
    assert set(np.unique(lengths)) <= {round(f * 2048) for f in fr}
    # Scaled to a mean of 0.22 (from 0.35): the same three lengths, times 0.22 / 0.35.
    scaled = ks.lengths_from_fractions(64, 2048, fr, seed=0, mean_fraction=0.22)
    assert set(np.unique(scaled)) <= {round(f * 0.22 / 0.35 * 2048) for f in fr}
    assert abs(scaled.mean() / 2048 - 0.22) < 0.02
    path.write_text(json.dumps([0.5, 1.5]))
    with pytest.raises(ValueError):
        ks.load_fractions(str(path))


def test_validate_row():
    ok = {"shape": "131k x4", "cv": 1, "method": "moira", "us_per_layer": 120.4}
    ks.validate_row(ok)
    ks.validate_row(dict(ok, cv="real"))
    ks.validate_row(dict(ok, cv=None, method="dense_fa3"))
    ks.validate_row({"shape": "8k x32", "cv": 0, "method": "pad", "error": "boom"})
    for bad in (dict(ok, method="flashinfer"), dict(ok, cv="x"), dict(ok, us_per_layer=0),
                {k: v for k, v in ok.items() if k != "shape"}):  # fmt: skip
        with pytest.raises(ValueError):
            ks.validate_row(bad)
