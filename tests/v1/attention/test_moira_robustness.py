# SPDX-License-Identifier: Apache-2.0
"""Robustness of one Moira decode step at the edges of its inputs (CPU interpreter).

Empty batch, one-token contexts, rows that fill their block table, a batch of exactly
the workspace's rows (what an eager step larger than every captured graph runs) and one
more (must be refused before any kernel writes), padded rows and empty page lists,
and run-to-run determinism of the eager step.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.v1.attention.moira_test_utils import PAGE, make_block_table, make_kv_cache
from vllm_moira.v1.attention.backends import moira
from vllm_moira.v1.attention.ops import moira_reference as ref

# Few Attend blocks, so that CPU-sized lists are cut over several blocks (Merge runs).
SMALL_FILL = dict(attend_fill_blocks=5)
BF16_ATOL, BF16_RTOL = 8e-3, 1.6e-2
HKV, GROUP, D = 2, 2, 64
SCALE = D**-0.5


def _batch(seq_lens, width=None, layout="token_major", seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / PAGE) for s in seq_lens) + 2
    width = width or max(1, max(math.ceil(s / PAGE) for s in seq_lens))
    kv = make_kv_cache(num_blocks, HKV, D, layout, generator=gen)
    table = make_block_table(seq_lens, num_blocks, width, generator=gen)
    query = torch.randn(len(seq_lens), HKV * GROUP, D, generator=gen).to(torch.bfloat16)
    slots = moira.summary_slots(moira.MOIRA_DEFAULT_ESTIMATOR)  # the default's summaries
    summaries = torch.zeros(num_blocks, HKV, slots, D, dtype=torch.bfloat16)
    full = [
        int(table[r, p]) * PAGE + PAGE - 1 for r, s in enumerate(seq_lens) for p in range(s // PAGE)
    ]
    if full:
        moira.write_page_summaries(kv, summaries, torch.tensor(full, dtype=torch.int64))
    return kv, summaries, table, torch.tensor(seq_lens, dtype=torch.int32), query


def _workspace(rows, width, **config):
    cfg = moira.MoiraConfig.paper(**{**SMALL_FILL, **config})
    return moira.MoiraWorkspace(rows, HKV * GROUP, HKV, D, width, cfg, "cpu")


def _check_against_reference(ws, out, kv, summaries, table, seq, query, gamma):
    expected, lists = ref.sparse_decode(query, kv, summaries, table, seq, SCALE, gamma,
                                        estimator=moira.MOIRA_DEFAULT_ESTIMATOR)  # fmt: skip
    for row, seq_len in enumerate(seq.tolist()):
        if seq_len == 0:
            continue
        for h in range(HKV):
            count = int(ws.list_lengths[row, h])
            assert ws.page_list[row, h, :count].tolist() == lists[row][h].tolist(), (row, h)
        torch.testing.assert_close(out[row].float(), expected[row], atol=BF16_ATOL, rtol=BF16_RTOL)


def test_empty_batch_is_a_noop():
    """B = 0 (a step with no decode rows): no launch, no error, nothing written."""
    kv, summaries, _, _, _ = _batch([PAGE])
    ws = _workspace(4, 3)
    ws.list_lengths.fill_(-5)
    query = torch.empty(0, HKV * GROUP, D, dtype=torch.bfloat16)
    out = torch.empty(0, HKV * GROUP, D, dtype=torch.bfloat16)
    table = torch.zeros(0, 3, dtype=torch.int32)
    seq = torch.zeros(0, dtype=torch.int32)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    moira.attend(query, kv, table, seq, ws.page_list, ws.list_lengths, out, ws, SCALE)
    assert ws.list_lengths.eq(-5).all()
    assert ws.read_stats.tolist() == [0, 0]
    moira.write_page_summaries(kv, summaries, torch.zeros(0, dtype=torch.int64))


def test_all_rows_padded():
    """Every row seq_len 0 (a padded CUDA-graph batch): outputs untouched, counts 0."""
    kv, summaries, table, _, query = _batch([3 * PAGE, PAGE, 1])
    seq = torch.zeros(3, dtype=torch.int32)
    ws = _workspace(3, table.shape[1])
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    assert out.eq(7.0).all()
    assert ws.list_lengths[:3].eq(0).all()
    assert ws.read_stats.tolist() == [0, 0]


@pytest.mark.parametrize("config", [dict(gamma=0.98), dict(gamma=1.0),
                                    dict(selector="fixed", fixed_pages=1)])  # fmt: skip
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_one_token_context(config, layout):
    """A context of one token: the output is exactly that token's value vector."""
    kv, summaries, table, seq, query = _batch([1, 1, 1], layout=layout)
    ws = _workspace(3, table.shape[1], **config)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    assert ws.list_lengths[:3].eq(1).all() and ws.page_list[:3, :, 0].eq(0).all()
    for row in range(3):
        v0 = kv[int(table[row, 0]), :, 0, D:]  # [H_kv, D]
        assert torch.equal(out[row], v0.repeat_interleave(GROUP, dim=0)), row


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_rows_at_block_table_capacity(gamma):
    """Rows that use every entry of their block table (max length), next to short rows;
    the workspace is sized for exactly that many pages."""
    width = 6
    seq_lens = [width * PAGE, width * PAGE - 63, 2, width * PAGE]
    kv, summaries, table, seq, query = _batch(seq_lens, width=width)
    ws = _workspace(len(seq_lens), width, gamma=gamma)
    out = torch.empty_like(query)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    _check_against_reference(ws, out, kv, summaries, table, seq, query, gamma)
    if gamma == 1.0:
        dense = ref.dense_decode(query, kv, table, seq, SCALE)
        torch.testing.assert_close(out.float(), dense, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_batch_of_exactly_max_rows():
    """B == max_num_seqs: the largest eager batch (beyond every captured graph size)."""
    seq_lens = [PAGE * 3 + 5, 1, PAGE * 2, 70, PAGE * 4]
    kv, summaries, table, seq, query = _batch(seq_lens)
    ws = _workspace(len(seq_lens), table.shape[1], gamma=0.9)
    out = torch.empty_like(query)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    _check_against_reference(ws, out, kv, summaries, table, seq, query, 0.9)


def _forbid_launches(monkeypatch):
    launched = []
    for name in ("kernel_moira_estimate", "kernel_moira_select", "kernel_moira_attend",
                 "kernel_moira_merge"):  # fmt: skip

        class _Trap:
            def __init__(self, kernel_name):
                self.kernel_name = kernel_name

            def __getitem__(self, grid):
                launched.append(self.kernel_name)
                raise AssertionError(f"{self.kernel_name} launched for an invalid batch")

        monkeypatch.setattr(moira, name, _Trap(name))
    return launched


def test_more_rows_than_workspace_is_refused_before_any_launch(monkeypatch):
    """B > max_num_seqs would write past the workspace: a clear ValueError, raised
    before any kernel runs, output untouched."""
    seq_lens = [PAGE, PAGE, PAGE]
    kv, summaries, table, seq, query = _batch(seq_lens)
    ws = _workspace(2, table.shape[1])
    out = torch.full(query.shape, 3.0, dtype=torch.bfloat16)
    launched = _forbid_launches(monkeypatch)
    with pytest.raises(ValueError, match=r"3 rows exceed the workspace \(2 rows"):
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    with pytest.raises(ValueError, match=r"3 decode rows exceed the workspace's max_num_seqs=2"):
        moira.attend(query, kv, table, seq, ws.page_list, ws.list_lengths, out, ws, SCALE)
    assert launched == [] and out.eq(3.0).all()


def test_block_table_wider_than_workspace(monkeypatch):
    """vLLM's block tables can carry spare columns past max_model_len: a table
    wider than the workspace works as long as the rows fit the workspace."""
    seq_lens = [PAGE * 3, PAGE * 2 + 5]
    kv, summaries, table, seq, query = _batch(seq_lens)
    wide = torch.zeros(table.shape[0], table.shape[1] + 4, dtype=table.dtype)
    wide[:, : table.shape[1]] = table
    ws = _workspace(2, table.shape[1])
    out = torch.empty_like(query)
    moira.moira_decode(query, kv, summaries, wide, seq, out, ws, SCALE)
    ref_out = torch.empty_like(query)
    moira.moira_decode(query, kv, summaries, table, seq, ref_out, _workspace(2, table.shape[1]),
                       SCALE)  # fmt: skip
    assert torch.equal(out, ref_out)


def test_empty_page_lists_leave_output_untouched():
    """attend() over lists of length 0 (a selector that keeps nothing for a head):
    those heads' outputs are not written; the others are correct."""
    seq_lens = [PAGE * 3, PAGE * 2 + 1]
    kv, _, table, seq, query = _batch(seq_lens)
    ws = _workspace(2, table.shape[1])
    page_list = torch.zeros(2, HKV, table.shape[1], dtype=torch.int32)
    list_lengths = torch.zeros(2, HKV, dtype=torch.int32)
    page_list[0, 1, :3] = torch.tensor([0, 1, 2])
    list_lengths[0, 1] = 3  # row 0: KV head 0 empty, head 1 every page; row 1: all empty
    out = torch.full(query.shape, 5.0, dtype=torch.bfloat16)
    moira.attend(query, kv, table, seq, page_list, list_lengths, out, ws, SCALE)
    assert out[0, :GROUP].eq(5.0).all() and out[1].eq(5.0).all()
    dense = ref.dense_decode(query, kv, table, seq, SCALE)
    torch.testing.assert_close(out[0, GROUP:].float(), dense[0, GROUP:], atol=BF16_ATOL,
                               rtol=BF16_RTOL)  # fmt: skip


def test_eager_step_is_deterministic():
    """The same step twice gives bitwise-equal outputs and lists (no state leaks
    between calls other than the read counters)."""
    seq_lens = [PAGE * 5 + 3, PAGE, 9]
    kv, summaries, table, seq, query = _batch(seq_lens, layout="head_major")
    ws = _workspace(3, table.shape[1], gamma=0.8)
    outs, lists = [], []
    for _ in range(2):
        out = torch.empty_like(query)
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
        outs.append(out)
        lists.append((ws.page_list.clone(), ws.list_lengths.clone()))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(lists[0][1], lists[1][1])
    for row in range(3):
        for h in range(HKV):
            n = int(lists[0][1][row, h])
            assert torch.equal(lists[0][0][row, h, :n], lists[1][0][row, h, :n])
    kept, total = ws.read_stats.tolist()
    assert total == 2 * HKV * sum(math.ceil(s / PAGE) for s in seq_lens) and 0 < kept <= total
