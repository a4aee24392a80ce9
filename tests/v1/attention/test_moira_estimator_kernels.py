# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the estimators with stored keys (``mvar_top8``) and the paper's
``mvar`` against the float32 reference (CPU interpreter): summary writer, Estimate, the
whole sparse step, configuration."""

from __future__ import annotations

import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import (
    PAGE,
    make_decode_batch,
    make_kv_cache,
)
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def _ref_summaries(kv: torch.Tensor, blocks: torch.Tensor, estimator: str) -> torch.Tensor:
    r = moira.estimator_num_top(estimator)
    if r == 0:
        return ref.summarize_pages(kv, blocks)
    return ref.summarize_pages_top(kv, blocks, r)


def _plant_outliers(kv: torch.Tensor, blocks: list[int], count: int, gen: torch.Generator):
    """Give ``count`` random tokens of each (page, KV head) a large offset of
    decreasing size (8, 7, 6, ... x a random unit direction x sqrt(D)), so that
    the farthest keys and their order are unambiguous."""
    head_size = kv.shape[-1] // 2
    for block in blocks:
        for h in range(kv.shape[1]):
            tokens = torch.randperm(PAGE, generator=gen)[:count]
            for i, t in enumerate(tokens.tolist()):
                direction = torch.randn(head_size, generator=gen)
                direction = direction / direction.norm() * head_size**0.5
                key = kv[block, h, t, :head_size].float() + (8.0 - i) * direction
                kv[block, h, t, :head_size] = key.to(kv.dtype)


_batch = make_decode_batch


# --------------------------------------------------------------------------
# Summary writer
# --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_write_top_summaries_matches_reference(layout, head_size, estimator="mvar_top8"):
    gen = torch.Generator().manual_seed(head_size)
    r = moira.estimator_num_top(estimator)
    kv = make_kv_cache(6, 2, head_size, layout, generator=gen)
    _plant_outliers(kv, [2, 5], r + 1, gen)
    summaries = torch.full((6, 2, 2 + r, head_size), float("nan"), dtype=torch.bfloat16)
    slots = torch.tensor([-1, 2 * PAGE + 63, 3 * PAGE + 10, 5 * PAGE + 63, 4 * PAGE])
    moira.write_page_summaries(kv, summaries, slots)
    expected = ref.summarize_pages_top(kv, torch.tensor([2, 5]), r)
    got = summaries[[2, 5]].float()
    # Stored keys: bit-exact copies of the cache's keys, farthest first.
    assert torch.equal(got[:, :, 2:], expected[:, :, 2:])
    # Bulk mean / variance: one bf16 step from the fp32 values.
    assert torch.all((got[:, :, :2] - expected[:, :, :2]).abs() <= _bf16_ulp(expected[:, :, :2])
                     + 1e-6)  # fmt: skip
    assert torch.isnan(summaries[[0, 1, 3, 4]].float()).all(), "pages that did not fill"


def test_write_top_summaries_ties_go_to_lower_token(estimator="mvar_top8"):
    """Tokens t and 63 - t hold keys +c_t e and -c_t e (c_t = (t + 1) / 8): the mean is
    exactly 0 and the two distances are exactly equal. The kernel must store the lower
    token first: k_31, k_32, k_30, k_33 (= +c e, -c e, ...); the reverse tie rule stores
    the same keys with the signs swapped."""
    r = moira.estimator_num_top(estimator)
    head_size = 64
    gen = torch.Generator().manual_seed(3)
    sign = torch.where(torch.rand(head_size, generator=gen) < 0.5, -1.0, 1.0)
    kv = make_kv_cache(3, 1, head_size, "head_major", generator=gen)
    for t in range(32):
        c = (t + 1) / 8
        kv[1, 0, t, :head_size] = (c * sign).to(torch.bfloat16)
        kv[1, 0, 63 - t, :head_size] = (-c * sign).to(torch.bfloat16)
    summaries = torch.zeros(3, 1, 2 + r, head_size, dtype=torch.bfloat16)
    moira.write_page_summaries(kv, summaries, torch.tensor([PAGE + 63]))
    order = [31, 32, 30, 33, 29, 34, 28, 35][:r]
    assert torch.equal(summaries[1, 0, 2:], kv[1, 0, order, :head_size])
    expected = ref.summarize_pages_top(kv, torch.tensor([1]), r)[0, 0]
    assert torch.equal(summaries[1, 0, 2:].float(), expected[2:])
    # Bulk: the pairs t, 63 - t for t < 32 - r / 2 remain; mean exactly 0.
    assert torch.equal(summaries[1, 0, 0].float(), torch.zeros(head_size))
    torch.testing.assert_close(summaries[1, 0, 1].float(), expected[1], rtol=8e-3, atol=0)


def test_write_summaries_rejects_unknown_slot_count():
    kv = make_kv_cache(2, 1, 64, "head_major")
    with pytest.raises(ValueError, match="slots"):
        moira.write_page_summaries(kv, torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16),
                                   torch.tensor([63]))  # fmt: skip


# --------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", moira.MOIRA_ESTIMATORS)
@pytest.mark.parametrize(
    ("layout", "group", "head_size", "pattern"),
    [
        ("token_major", 1, 64, "random"),
        ("head_major", 3, 64, "concentrated"),
        ("token_major", 4, 128, "outlier"),
        ("head_major", 8, 128, "diffuse"),
    ],
)
@pytest.mark.slow
def test_estimate_matches_reference(estimator, layout, group, head_size, pattern):
    # 16-page tiles: the sink, middle tiles and the current page fall in
    # different programs.
    seq_lens = [1, 64, 65, 300, 64 * 40 + 7]
    # Queries x3: the spread x^2.var of random pages is ~9, around REM's knee 2 ln m
    # (~8.2), so both of its branches are taken (checked below).
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, head_size, layout, estimator,
                                              pattern, query_scale=3.0)  # fmt: skip
    scale = head_size**-0.5
    config = moira.MoiraConfig.paper(estimator=estimator)
    ws = moira.MoiraWorkspace(8, 2 * group, 2, head_size, table.shape[1], config, "cpu")
    ws.logmass.fill_(float("nan"))
    moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, scale, estimator,
                                launch={"estimate": {"tile_pages": 16}})  # fmt: skip
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        expected = ref.estimate_row_logmass(query[row], kv, summaries, table[row], seq_len,
                                            scale, estimator)  # fmt: skip
        torch.testing.assert_close(ws.logmass[row, :, :, :n], expected, atol=3e-5, rtol=3e-5)
    if pattern != "diffuse" and estimator != "mvar":
        # Both REM branches occur among the middle pages of the longest row.
        row, n = len(seq_lens) - 1, math.ceil(seq_lens[-1] / PAGE)
        x = query[row].float().view(2, group, head_size) * scale
        var = summaries[table[row, 1 : n - 1].long(), :, 1].float()  # [pages, H, D]
        v = torch.einsum("hgd,phd->hgp", x * x, var)
        knee = 2 * math.log(PAGE - moira.estimator_num_top(estimator))
        assert (v > knee).any() and (v <= knee).any()


def test_estimators_differ_on_outlier_pages():
    """Guard against a variant silently running another one's formula: on pages with
    planted outliers, mvar and mvar_top8 give different log-masses (queries x4, so that
    the spread x^2.var exceeds REM's 2 ln 56 on some pages)."""
    seq_lens = [64 * 6]
    results = {}
    for estimator in moira.MOIRA_ESTIMATORS:
        kv, summaries, table, seq, query = _batch(seq_lens, 1, 4, 64, "token_major", estimator,
                                                  "outlier", seed=5)  # fmt: skip
        query = (query.float() * 4).to(torch.bfloat16)
        ws = moira.MoiraWorkspace(1, 4, 1, 64, table.shape[1],
                                  moira.MoiraConfig.paper(estimator=estimator), "cpu")  # fmt: skip
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    estimator)  # fmt: skip
        results[estimator] = ws.logmass[0, :, :, 1:5].clone()
    assert not torch.allclose(results["mvar"], results["mvar_top8"])


def test_estimate_rejects_wrong_summary_layout():
    kv, summaries, table, seq, query = _batch([200], 1, 2, 64, "head_major", "mvar")
    ws = moira.MoiraWorkspace(1, 2, 1, 64, table.shape[1], moira.MoiraConfig.paper(), "cpu")
    with pytest.raises(ValueError, match="needs a summary of 10 slots"):
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    "mvar_top8")  # fmt: skip
    with pytest.raises(ValueError, match="estimator must be one of"):
        moira.estimate_page_logmass(query, kv, summaries, table, seq, ws.logmass, 0.125,
                                    "mvar_top3")  # fmt: skip


# --------------------------------------------------------------------------
# The whole step
# --------------------------------------------------------------------------
# The whole sparse step against ref.sparse_decode for every estimator:
# test_moira_kernels.py::test_sparse_decode_matches_reference.


@pytest.mark.parametrize("estimator", moira.MOIRA_ESTIMATORS)
def test_gamma_one_equals_dense(estimator):
    config = moira.MoiraConfig.paper(gamma=1.0, estimator=estimator, **SMALL_FILL)
    seq_lens = [1, 64, 7 * PAGE, 64 * 4 + 17, 0]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, 4, 128, "head_major", estimator)
    ws = moira.MoiraWorkspace(8, 8, 2, 128, table.shape[1], config, "cpu")
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    scale = 128**-0.5
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, scale)
    dense = ref.dense_decode(query, kv, table, seq, scale)
    torch.testing.assert_close(out[:-1].float(), dense[:-1], atol=BF16_ATOL, rtol=BF16_RTOL)
    assert torch.all(out[-1] == 7.0)


def test_moira_decode_refuses_summaries_of_another_estimator():
    kv, summaries, table, seq, query = _batch([300], 1, 2, 64, "head_major", "mvar")
    config = moira.MoiraConfig.paper(estimator="mvar_top8")
    ws = moira.MoiraWorkspace(1, 2, 1, 64, table.shape[1], config, "cpu")
    with pytest.raises(ValueError, match="'mvar_top8' needs a summary of 10 slots"):
        moira.moira_decode(query, kv, summaries, table, seq, torch.empty_like(query), ws, 0.125)


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
def test_estimator_constants_match_reference():
    # The kernels carry the paper's estimator and the default; the research estimators
    # are the reference's only.
    assert moira.MOIRA_ESTIMATORS == ("mvar", "mvar_top8")
    # Default: mvar_top8 on int8 summaries, the estimator that met the study's targets and
    # kept gamma = 0.99 within a point of dense in vLLM (docs/estimator.md, "The default").
    assert moira.MoiraConfig().estimator == moira.MOIRA_DEFAULT_ESTIMATOR == "mvar_top8"
    assert moira.MoiraConfig().summary_dtype == moira.MOIRA_DEFAULT_SUMMARY_DTYPE == "int8"
    for estimator in moira.MOIRA_ESTIMATORS:
        assert moira.summary_slots(estimator) == ref.summary_slots(estimator)
        assert moira.MoiraConfig.paper(estimator=estimator).summary_slots == ref.summary_slots(
            estimator
        )


def test_config_rejects_unknown_estimator():
    with pytest.raises(ValueError, match=r"estimator must be one of \('mvar', 'mvar_top8'\)"):
        moira.MoiraConfig.paper(estimator="mvar_top3").validate()
    # A research estimator of the reference is no kernel option.
    with pytest.raises(ValueError, match=r"estimator must be one of .*got 'mvar_rem'"):
        moira.MoiraConfig.paper(estimator="mvar_rem").validate()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MOIRA_ESTIMATOR": "MVAR_TOP8"}, "mvar_top8"),
        ({"MOIRA_ESTIMATOR": " mvar "}, "mvar"),
        ({"MOIRA_ESTIMATOR": ""}, None),
        ({}, None),
    ],
)
def test_config_from_env_estimator(env, expected):
    expected = expected or moira.MOIRA_DEFAULT_ESTIMATOR
    assert moira.moira_config_from_env(env).estimator == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MOIRA_ESTIMATOR": "quest"}, r"MOIRA_ESTIMATOR must be one of .*got 'quest'"),
        ({"MOIRA_ESTIMATOR": "mvar_top4"}, r"MOIRA_ESTIMATOR must be one of .*got 'mvar_top4'"),
        ({"MOIRA_ESTIMATER": "mvar"}, r"unknown environment variable.*MOIRA_ESTIMATER"),
    ],
)
def test_config_from_env_estimator_errors(env, message):
    with pytest.raises(ValueError, match=message):
        moira.moira_config_from_env(env)


def test_set_selector_cannot_change_estimator():
    ws = moira.MoiraWorkspace(1, 2, 1, 64, 4, moira.MoiraConfig.paper(estimator="mvar_top8"), "cpu")
    ws.set_selector(moira.MoiraConfig.paper(gamma=0.9, estimator="mvar_top8"))
    with pytest.raises(ValueError, match="cannot change.*estimator"):
        ws.set_selector(moira.MoiraConfig.paper(gamma=0.9, estimator="mvar"))
