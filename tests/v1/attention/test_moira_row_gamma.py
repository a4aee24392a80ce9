# SPDX-License-Identifier: Apache-2.0
"""Per-request gamma (``moira_gamma``): Select reads ``MoiraWorkspace.row_gamma``.

Rows of one batch use different coverage targets; 0 means the server's gamma.
Checked against the float32 reference with one gamma per row (CPU interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import PAGE
from tests.v1.attention.test_moira_kernels import (
    BF16_ATOL,
    BF16_RTOL,
    SMALL_FILL,
    _batch,
    _random_logmass,
)
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

SERVER_GAMMA = 0.9


def _select(logmass, seq_lens, config, row_gamma):
    num_rows, num_kv_heads, group, max_pages = logmass.shape
    ws = moira.MoiraWorkspace(num_rows, num_kv_heads * group, num_kv_heads, 64,
                              max_pages, config, "cpu")  # fmt: skip
    ws.logmass.copy_(logmass)
    ws.set_row_gamma(torch.tensor(row_gamma, dtype=torch.float32), num_rows)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    moira.select_pages(ws.logmass, seq, ws.pibar, ws.page_list, ws.list_lengths,
                       ws.selector_params, num_rows, max_pages, ws.read_stats,
                       row_gamma=ws.row_gamma)  # fmt: skip
    return ws


def test_select_per_row_gamma_matches_reference():
    """Each row keeps the pages of its own gamma; 0 falls back to the server's.
    A gamma=1 row keeps every page while the rows around it are sparse."""
    max_pages = 300
    seq_lens = [max_pages * PAGE, 64 * 200 + 7, 64 * 120, 64 * 250, 64 * 90 + 1, 64 * 40]
    row_gamma = [0.0, 1.0, 0.5, 0.98, 0.0, 1.0]
    logmass = _random_logmass(len(seq_lens), 2, 4, max_pages, seed=17)
    ws = _select(logmass, seq_lens, moira.MoiraConfig.paper(gamma=SERVER_GAMMA), row_gamma)
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        effective = row_gamma[row] if row_gamma[row] > 0 else SERVER_GAMMA
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            expected = ref.select_pages(pibar[h], gamma=effective)
            assert ws.page_list[row, h, :count].tolist() == expected.tolist(), (row, h)
            if effective >= 1.0:
                assert count == n
            else:
                assert count < n, "sparse row kept every page: the data is too flat"
    # Server-gamma rows select what a workspace without row_gamma selects.
    plain = moira.MoiraWorkspace(len(seq_lens), 8, 2, 64, max_pages,
                                 moira.MoiraConfig.paper(gamma=SERVER_GAMMA), "cpu")  # fmt: skip
    plain.logmass.copy_(logmass)
    moira.select_pages(plain.logmass, torch.tensor(seq_lens, dtype=torch.int32), plain.pibar,
                       plain.page_list, plain.list_lengths, plain.selector_params,
                       len(seq_lens), max_pages, plain.read_stats)  # fmt: skip
    for row in (0, 4):
        assert torch.equal(ws.list_lengths[row], plain.list_lengths[row])


def test_fixed_count_selector_ignores_row_gamma():
    """moira_gamma only changes the coverage rule; fixed-count rows keep K."""
    max_pages = 64
    seq_lens = [64 * 64, 64 * 20 + 3, 64 * 33]
    logmass = _random_logmass(len(seq_lens), 2, 3, max_pages, seed=5)
    config = moira.MoiraConfig.paper(selector="fixed", fixed_pages=5)
    ws = _select(logmass, seq_lens, config, [1.0, 0.5, 0.0])
    for row, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        for h in range(2):
            expected = ref.select_pages(pibar[h], fixed_pages=5)
            assert int(ws.list_lengths[row, h]) == 5
            assert ws.page_list[row, h, :5].tolist() == expected.tolist()


def test_set_row_gamma_resets_later_rows_in_place():
    ws = moira.MoiraWorkspace(6, 4, 2, 64, 8, moira.MoiraConfig.paper(), "cpu")
    address = ws.row_gamma.data_ptr()
    ws.set_row_gamma(torch.tensor([0.5, 1.0, 0.7, 0.9, 0.6, 0.8]), 6)
    assert ws.row_gamma.tolist() == pytest.approx([0.5, 1.0, 0.7, 0.9, 0.6, 0.8])
    # Fewer rows next step: rows past them return to the server's gamma.
    ws.set_row_gamma(torch.tensor([0.95, 0.0, 0.3, 0.3]), 2)
    assert ws.row_gamma.tolist() == pytest.approx([0.95, 0.0, 0, 0, 0, 0])
    # Values shorter than the rows (e.g. padded FULL-graph rows): the rest get 0.
    ws.set_row_gamma(torch.tensor([0.4]), 3)
    assert ws.row_gamma.tolist() == pytest.approx([0.4, 0, 0, 0, 0, 0])
    ws.set_row_gamma(None, 4)
    assert ws.row_gamma.tolist() == [0.0] * 6
    assert ws.row_gamma.data_ptr() == address


@pytest.mark.parametrize(("layout", "group"), [("token_major", 3), ("head_major", 4)])
def test_decode_with_mixed_row_gamma_matches_reference(layout, group):
    """The whole step with one gamma per row: lists and outputs follow the
    reference, the gamma=1 row equals dense attention, the padded row is untouched."""
    config = moira.MoiraConfig.paper(gamma=SERVER_GAMMA, **SMALL_FILL)
    seq_lens = [64 * 12, 64 * 12, 64 * 7 + 3, 100, 0]
    row_gamma = [1.0, 0.0, 0.5, 0.95, 0.0]
    kv, summaries, table, seq, query = _batch(seq_lens, 2, group, 64, layout, "concentrated")
    ws = moira.MoiraWorkspace(8, 2 * group, 2, 64, table.shape[1], config, "cpu")
    ws.set_row_gamma(torch.tensor(row_gamma), len(seq_lens))
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, 0.125)
    effective = [g if g > 0 else SERVER_GAMMA for g in row_gamma]
    expected, lists = ref.sparse_decode(query, kv, summaries, table, seq, 0.125, effective,
                                        estimator=moira.MOIRA_DEFAULT_ESTIMATOR)  # fmt: skip
    for row in range(len(seq_lens) - 1):
        for h in range(2):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist(), (row, h)
    assert ws.list_lengths[0].tolist() == [12, 12]
    assert ws.list_lengths[1].min() < 12, "server-gamma row should be sparse here"
    torch.testing.assert_close(out[:-1].float(), expected[:-1], atol=BF16_ATOL, rtol=BF16_RTOL)
    dense = ref.dense_decode(query, kv, table, seq, 0.125)
    torch.testing.assert_close(out[0].float(), dense[0], atol=BF16_ATOL, rtol=BF16_RTOL)
    assert torch.all(out[-1] == 7.0), "padded row was written"


def test_reference_rejects_wrong_number_of_gammas():
    kv, summaries, table, seq, query = _batch([64, 70], 1, 1, 64, "token_major")
    with pytest.raises(ValueError, match="gamma has 3 values for 2 rows"):
        ref.sparse_decode(query, kv, summaries, table, seq, 0.125, [0.9, 0.9, 0.9])
