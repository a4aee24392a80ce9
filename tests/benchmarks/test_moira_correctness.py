# SPDX-License-Identifier: Apache-2.0
"""Pure helpers of benchmarks/moira_correctness.py (CPU): how a Select list that differs
from the reference's is classified."""

from __future__ import annotations

import torch
from _load import load

mc = load("moira_correctness")
ref = mc.ref


def _shares(values):
    pibar = torch.tensor(values, dtype=torch.float32)
    return pibar / pibar.sum()


def test_reference_list_is_not_a_near_tie_question():
    pibar = _shares([5, 1, 8, 1, 7, 1, 4])
    expected = ref.select_pages(pibar, gamma=0.8)
    assert mc.is_near_tie(expected, pibar, 0.8)


def test_target_met_within_summation_order_is_a_near_tie():
    # Pages 2 and 4 hold 0.2 and 0.18 of the mass; sink + current hold 0.5. At a target
    # of exactly 0.88 the reference keeps page 4 (0.88 reached); a float32 sum a hair
    # short of it keeps the next page too.
    pibar = torch.tensor([0.25, 0.03, 0.2, 0.03, 0.18, 0.06, 0.25], dtype=torch.float32)
    gamma = float(pibar[[0, 2, 4, 6]].sum())
    exact = ref.select_pages(pibar, gamma=gamma)
    one_more = ref.select_pages(pibar, gamma=gamma + 1e-6)
    assert exact.tolist() != one_more.tolist()
    assert mc.is_near_tie(one_more, pibar, gamma)


def test_real_mismatches_are_not_near_ties():
    pibar = _shares([5, 1, 8, 1, 7, 1, 4])
    expected = ref.select_pages(pibar, gamma=0.8).tolist()
    missing_heavy_page = torch.tensor([p for p in expected if p != 2], dtype=torch.int32)
    assert not mc.is_near_tie(missing_heavy_page, pibar, 0.8)
    extra_light_page = torch.tensor(sorted(set(expected) | {1}), dtype=torch.int32)
    assert not mc.is_near_tie(extra_light_page, pibar, 0.8)
    out_of_order = torch.tensor(expected[::-1], dtype=torch.int32)
    assert not mc.is_near_tie(out_of_order, pibar, 0.8)


def test_pages_within_the_bisection_resolution_are_near_ties():
    # Page 3's share sits 2e-8 below the threshold page's (page 1): Select's bisection
    # (resolution max share / 2^24 ~ 3e-8) cannot separate them, the reference can.
    pibar = torch.tensor([0.3, 0.1, 0.5, 0.1 - 2e-8, 0.0, 0.02], dtype=torch.float64)
    pibar = (pibar / pibar.sum()).float()
    gamma = float(pibar[[0, 1, 2, 5]].sum()) - 1e-3
    expected = ref.select_pages(pibar, gamma=gamma).tolist()
    assert 3 not in expected and 1 in expected
    both = torch.tensor(sorted(set(expected) | {3}), dtype=torch.int32)
    assert mc.is_near_tie(both, pibar, gamma)
    with_light_page = torch.tensor(sorted(set(expected) | {3, 4}), dtype=torch.int32)
    assert not mc.is_near_tie(with_light_page, pibar, gamma)


def test_sweeps_name_only_known_settings():
    # Every key of every Attend candidate is an Attend launch setting or a MoiraConfig
    # field; every Estimate candidate is a valid override.
    import dataclasses

    moira = mc.moira
    fields = {f.name for f in dataclasses.fields(moira.MoiraConfig)}
    assert set(mc.ATTEND_LAUNCH_KEYS) == set(moira.AttendLaunch._fields)
    for changes in mc.ATTEND_SWEEP:
        for key in changes:
            assert key in mc.ATTEND_LAUNCH_KEYS or key in fields, key
    for changes in mc.ESTIMATE_SWEEP:
        moira.estimate_launch(8, True, changes)
    for lanes, warps in mc.SELECT_SWEEP:
        moira.select_launch(4096, 1, {"long_lanes": lanes, "long_num_warps": warps})


def test_with_launch_merges_kernel_by_kernel(monkeypatch):
    monkeypatch.setattr(mc, "LAUNCH", {"estimate": {"key_stages": 2}})
    assert mc.with_launch(estimate={"num_warps": 4}, select={"long_lanes": 4}) == {
        "estimate": {"key_stages": 2, "num_warps": 4}, "select": {"long_lanes": 4}}  # fmt: skip
    assert mc.LAUNCH == {"estimate": {"key_stages": 2}}


def test_split_summary_dtype_names_the_estimator_and_its_storage():
    assert mc.split_summary_dtype("int8:mvar_top8") == ("mvar_top8", "int8")
    assert mc.split_summary_dtype("int4:mvar_top8") == ("mvar_top8", "int4")
    assert mc.split_summary_dtype("mvar_top8") == ("mvar_top8", "bfloat16")


def test_same_lists_after_compares_counts_then_lists_up_to_the_longest():
    import types

    import torch

    lists = torch.tensor([[[0, 3, 5, 9]], [[0, 1, 7, 7]]])
    counts = torch.tensor([[3], [2]])
    ws = types.SimpleNamespace(
        page_list=torch.zeros_like(lists), list_lengths=torch.zeros_like(counts)
    )

    def writes(new_lists, new_counts):
        def run():
            ws.page_list.copy_(new_lists)
            ws.list_lengths.copy_(new_counts)

        return run

    reference = (lists, counts)
    tail_differs = lists.clone()
    tail_differs[0, 0, 3] = 42  # past every list's end: not compared
    assert mc._same_lists_after(writes(tail_differs, counts), ws, 2, reference)
    page_differs = lists.clone()
    page_differs[1, 0, 1] = 2
    assert not mc._same_lists_after(writes(page_differs, counts), ws, 2, reference)
    assert not mc._same_lists_after(writes(lists, counts + 1), ws, 2, reference)
    assert not mc._same_lists_after(lambda: None, ws, 2, reference)  # writes nothing


def test_selected_lists_ignore_entries_past_each_length():
    # Two workspaces allocated with torch.empty hold different bits past each list's
    # end; the lists themselves are what the step computed and what checks compare.
    lengths = torch.tensor([[2, 0], [3, 1]])
    lists = torch.tensor([[[0, 4, 9], [5, 5, 5]], [[0, 2, 3], [7, 1, 1]]])
    other_tail = lists.clone()
    other_tail[0, 0, 2], other_tail[0, 1, 0], other_tail[1, 1, 2] = 42, 42, 42
    assert torch.equal(mc.selected_lists(lists, lengths), mc.selected_lists(other_tail, lengths))
    assert mc.selected_lists(lists, lengths).tolist() == [
        [[0, 4, -1], [-1, -1, -1]],
        [[0, 2, 3], [7, -1, -1]],
    ]
    inside = lists.clone()
    inside[1, 0, 2] = 42
    assert not torch.equal(mc.selected_lists(lists, lengths), mc.selected_lists(inside, lengths))
