# SPDX-License-Identifier: Apache-2.0
"""benchmarks/paper_attend.py, the paper's Attend schedule (Alg. 2) that the spread
benchmark compares with the backend's, against the float32 reference (CPU interpreter)."""

from __future__ import annotations

import math

import pytest
import torch
from _load import load

from tests.v1.attention.moira_test_utils import PAGE, make_decode_batch, pack_page_lists
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

pa = load("paper_attend")
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2


def _chunk(n, num_splits, min_chunk_pages, fill_blocks, kept_total):
    """Alg. 2's chunk size with the fill rule, on the host."""
    fill = -(-kept_total // fill_blocks)
    return max(-(-n // num_splits), min(min_chunk_pages, fill), 1)


@pytest.mark.parametrize(
    ("pages", "fill_blocks"), [([24, 25], 1), ([24, 25], 16), ([10, 40], 10), ([3, 1], 2)]
)
def test_paper_attend_chunks_each_list_and_equals_dense(pages, fill_blocks):
    """Every page of two rows: each list is cut into chunks of the fill rule's size
    (C = 24, J from N_J = 3 and N_T = 8), a one-chunk list is written directly and the
    others through Merge's partials, and the output equals dense attention."""
    seq_lens = [n * PAGE for n in pages]
    kv, _, table, seq, query = make_decode_batch(seq_lens, 1, 2, 64, "token_major",
                                                 moira.MOIRA_DEFAULT_ESTIMATOR, seed=3)  # fmt: skip
    lists = [[torch.arange(n)] for n in pages]
    page_list, list_lengths = pack_page_lists(lists, table.shape[1])
    paper = pa.PaperAttend(2, 2, 1, 64, fill_blocks, "cpu", min_splits_per_row=3,
                           min_splits_total=8)  # fmt: skip
    paper.partial_lse.fill_(float("nan"))
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    paper(query, kv, table, seq, page_list, list_lengths, out, 0.125)
    dense = ref.dense_decode(query, kv, table, seq, 0.125)
    torch.testing.assert_close(out.float(), dense, atol=BF16_ATOL, rtol=BF16_RTOL)
    num_splits = paper.num_splits(2)
    assert num_splits == 4
    for row, n in enumerate(pages):
        chunks = math.ceil(n / _chunk(n, num_splits, 24, fill_blocks, sum(pages)))
        lse = paper.partial_lse[row * num_splits : (row + 1) * num_splits, :2]
        assert int(lse.isfinite().all(dim=1).sum()) == (chunks if chunks > 1 else 0)


def test_paper_attend_equals_the_backends_attend_within_rounding():
    """Both schedules attend the same lists (uneven, out of order, a partial last page);
    only the order of the online softmax differs."""
    seq_lens = [64 * 30, 64 * 3 + 9, 64 * 17]
    kv, _, table, seq, query = make_decode_batch(seq_lens, 2, 3, 64, "head_major",
                                                 moira.MOIRA_DEFAULT_ESTIMATOR, seed=4)  # fmt: skip
    lists = [
        [torch.tensor([29, 0, 3, 7, 12, 20, 21, 28]), torch.arange(30)],
        [torch.tensor([3, 0]), torch.tensor([1])],
        [torch.arange(0, 17, 2), torch.tensor([16, 0, 5])],
    ]
    page_list, list_lengths = pack_page_lists(lists, table.shape[1])
    paper = pa.PaperAttend(3, 6, 2, 64, 6, "cpu", min_chunk_pages=4, min_splits_per_row=3,
                           min_splits_total=8)  # fmt: skip
    out_paper = torch.empty_like(query)
    paper(query, kv, table, seq, page_list, list_lengths, out_paper, 0.125)
    ws = moira.MoiraWorkspace(3, 6, 2, 64, table.shape[1],
                              moira.MoiraConfig.paper(attend_fill_blocks=6), "cpu")  # fmt: skip
    out = torch.empty_like(query)
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, 0.125)
    torch.testing.assert_close(out_paper.float(), out.float(), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_paper_attend_refuses_bad_constants():
    with pytest.raises(ValueError, match="min_chunk_pages must be an integer >= 1, got 0"):
        pa.PaperAttend(1, 2, 1, 64, 4, "cpu", min_chunk_pages=0)
