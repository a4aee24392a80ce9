# SPDX-License-Identifier: Apache-2.0
"""The captured-mass audit (moira_audit.py) on the CPU interpreter: its masses
against the float32 reference, its sampling and period, its counters, per-row
gamma, the off switch and the option's errors. Real shapes and graph replay:
test_moira_audit_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.v1.attention.moira_test_utils import make_decode_batch, pack_page_lists
from vllm_moira.v1.attention.backends import moira, moira_audit
from vllm_moira.v1.attention.ops import moira_reference as ref

SCALE = 0.125
# Several programs per list, so the partial sums are combined across programs.
LAUNCH = {"audit": {"samples": 3, "list_programs": 3}}


def _batch(seq_lens, pattern="concentrated", group=3):
    return make_decode_batch(seq_lens, 2, group, 64, "token_major", moira.MOIRA_DEFAULT_ESTIMATOR,
                             pattern=pattern, summary_dtype="int8")  # fmt: skip


def _workspace(table, config, group=3, launch=LAUNCH):
    return moira.MoiraWorkspace(4, 2 * group, 2, 64, table.shape[1], config, "cpu", launch=launch)


def _reference_mass(query, kv, table, seq_lens, ws, row, head):
    keys, _ = ref.row_keys_values(kv, table[row], seq_lens[row])
    n = int(ws.list_lengths[row, head])
    return ref.captured_mass(query[row], keys, head, ws.page_list[row, head, :n], seq_lens[row],
                             SCALE)  # fmt: skip


def _buckets(ws):
    return ws.audit.below_and_buckets(ws.stats_counters[2:].tolist())


@pytest.mark.parametrize(("pattern", "gamma"), [("concentrated", 0.9), ("outlier", 0.8)])
def test_audited_masses_equal_the_reference_and_fill_the_counters(pattern, gamma):
    seq_lens = [64 * 11 + 5, 64 * 7, 64 * 9 + 40, 0]  # a padding row last
    kv, summaries, table, seq, query = _batch(seq_lens, pattern)
    config = moira.MoiraConfig.paper(gamma=gamma, attend_fill_blocks=5, audit_every=1)
    ws = _workspace(table, config)
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    masses, below = [], 0
    for sample, (row, head, mass, row_gamma) in enumerate(ws.audit.recent.tolist()):
        # The kernel's hash picks the list that the host's copy of it names,
        # among the 3 live rows (the padding row is never audited).
        assert (int(row), int(head)) == moira_audit.audit_list(0, 0, sample, 3, 2)
        expected = _reference_mass(query, kv, table, seq_lens, ws, int(row), int(head))
        assert mass == pytest.approx(min(expected, 1.0), abs=2e-5)
        assert row_gamma == pytest.approx(gamma)
        masses.append(mass)
        below += mass < gamma - 0.01
    # The lists are sparse: the audit measures something below 1.
    assert min(masses) < 0.999
    count_below, buckets = _buckets(ws)
    expected_buckets = [0] * len(ws.audit.edges)
    for mass in masses:
        expected_buckets[sum(edge < mass for edge in ws.audit.edges)] += 1
    assert buckets == expected_buckets
    assert count_below == below
    # The read counts are untouched by the audit.
    kept, total = ws.read_counts()
    assert total == sum(-(-s // 64) for s in seq_lens) * 2 and 0 < kept < total
    assert ws.audit.state.tolist() == [1, 0, 1]  # one launch counted; the ticket reset


def test_audit_runs_every_n_steps_of_all_layers():
    seq_lens = [64 * 6 + 1, 64 * 4]
    kv, summaries, table, seq, query = _batch(seq_lens)
    config = moira.MoiraConfig.paper(gamma=0.9, audit_every=3)
    ws = _workspace(table, config, launch={"audit": {"samples": 1, "list_programs": 2}})
    ws.audit.num_layers = 2  # two layers share the workspace: two launches per step
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    audited = []
    for _launch in range(8):  # steps 0, 1, 2, 3 (two layers each)
        moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
        audited.append(sum(_buckets(ws)[1]))
    # Steps 0 and 3 are audited, each in both of its layers.
    assert audited == [1, 2, 2, 2, 2, 2, 3, 4]
    assert int(ws.audit.state[0]) == 8


def _hand_lists(table, seq_lens, pages):
    lists = [[torch.tensor(pages[:1] if s > 64 * 3 else list(range(-(-s // 64)))) for _ in range(2)]
             for s in seq_lens]  # fmt: skip
    return pack_page_lists(lists, table.shape[1])


def _run_audit(ws, query, kv, table, seq, page_list, list_lengths):
    ws.page_list[: page_list.shape[0]].copy_(page_list)  # hand-made lists in the workspace
    ws.list_lengths[: list_lengths.shape[0]].copy_(list_lengths)
    ws.audit.run(query, kv, table, seq, ws, SCALE, False, ws.selector_params, {})


def test_below_gamma_compares_each_list_with_its_rows_gamma():
    # Every list keeps the sink page only: a mass well under the server's gamma.
    seq_lens = [64 * 8, 64 * 8]
    kv, _, table, seq, query = _batch(seq_lens, "diffuse")
    config = moira.MoiraConfig.paper(gamma=0.98, audit_every=1)
    ws = _workspace(table, config, launch={"audit": {"samples": 4, "list_programs": 2}})
    page_list, list_lengths = _hand_lists(table, seq_lens, [0])
    _run_audit(ws, query, kv, table, seq, page_list, list_lengths)
    assert _buckets(ws)[0] == 4  # every audited list is below 0.98 - 0.01
    masses = ws.audit.recent[:, 2].clone()
    assert float(masses.max()) < 0.5
    # A request's own gamma, below what its lists hold: not counted.
    low_gamma = float(masses.min()) / 2
    ws.row_gamma[:2] = low_gamma
    _run_audit(ws, query, kv, table, seq, page_list, list_lengths)
    assert _buckets(ws)[0] == 4 and sum(_buckets(ws)[1]) == 8
    assert ws.audit.recent[:, 3].tolist() == pytest.approx([low_gamma] * 4)
    # A fixed count has no gamma: the histogram only.
    ws.set_selector(dataclasses.replace(config, selector="fixed", fixed_pages=1))
    ws.row_gamma.zero_()
    _run_audit(ws, query, kv, table, seq, page_list, list_lengths)
    assert _buckets(ws)[0] == 4 and sum(_buckets(ws)[1]) == 12


def test_dense_rows_and_empty_steps_are_not_audited():
    seq_lens = [64 * 3, 64 * 2]
    kv, _, table, seq, query = _batch(seq_lens)
    config = moira.MoiraConfig.paper(gamma=0.9, audit_every=1, dense_batch_tokens=64 * 3 * 2)
    ws = _workspace(table, config)
    page_list, list_lengths = _hand_lists(table, seq_lens, [0])
    _run_audit(ws, query, kv, table, seq, page_list, list_lengths)
    assert ws.audit.recent[:, 0].tolist() == [-1.0] * 3
    _run_audit(ws, query, kv, table, torch.zeros_like(seq), page_list, list_lengths)
    assert ws.stats_counters[2:].tolist() == [0] * (1 + len(ws.audit.edges))
    assert int(ws.audit.state[0]) == 2


class _CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("every", [0, 5])
def test_audit_off_launches_nothing(monkeypatch, every):
    seq_lens = [64 * 4 + 3]
    kv, summaries, table, seq, query = _batch(seq_lens)
    counting = _CountingKernel(moira_audit.kernel_moira_audit)
    monkeypatch.setattr(moira_audit, "kernel_moira_audit", counting)
    ws = _workspace(table, moira.MoiraConfig.paper(audit_every=every))
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    moira.moira_decode(query, kv, summaries, table, seq, out, ws, SCALE)
    assert counting.launches == (1 if every else 0)
    if every == 0:
        assert ws.audit is None and ws.stats_counters.numel() == 2
        with pytest.raises(ValueError, match="cannot turn the captured-mass audit on"):
            ws.set_selector(moira.MoiraConfig.paper(audit_every=4))
    else:
        ws.set_selector(dataclasses.replace(ws.config, audit_every=0))  # pauses on the device
        assert int(ws.audit.state[2]) == 0


def test_captured_mass_buckets_are_fine_around_gamma():
    assert moira_audit.captured_mass_buckets(0.98) == (
        0.5, 0.8, 0.88, 0.93, 0.95, 0.96, 0.97, 0.975, 0.98, 0.99, 1.0,
    )  # fmt: skip
    assert moira_audit.captured_mass_buckets(1.0)[-4:] == (0.98, 0.99, 0.995, 1.0)
    assert moira_audit.captured_mass_buckets(0.05) == (0.02, 0.03, 0.04, 0.045, 0.05, 0.525, 1.0)


def test_audit_option_default_and_errors():
    assert moira.moira_config_from_env({}).audit_every == moira.MOIRA_DEFAULT_AUDIT_EVERY == 0
    assert moira.moira_config_from_env({"MOIRA_AUDIT_EVERY": "64"}).audit_every == 64
    assert moira.moira_config_from_env({"MOIRA_AUDIT_EVERY": "0"}).audit_every == 0
    assert moira.MoiraConfig.paper().audit_every == 0
    with pytest.raises(ValueError, match=r"MOIRA_AUDIT_EVERY must be an integer >= 0.*0 = off"):
        moira.moira_config_from_env({"MOIRA_AUDIT_EVERY": "-1"})
    with pytest.raises(ValueError, match=r"MOIRA_AUDIT_EVERY='often' is not a valid int.*0 = off"):
        moira.moira_config_from_env({"MOIRA_AUDIT_EVERY": "often"})
    with pytest.raises(ValueError, match="audit_every must be an integer >= 0"):
        moira.MoiraConfig(audit_every=2.5).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="audit_every must be an integer >= 0"):
        moira.MoiraConfig(audit_every=True).validate()
    for launch, message in (
        ({"samples": 0}, "samples must be an integer in 1..64"),
        ({"list_programs": 512}, "list_programs must be an integer in 1..256"),
        ({"pages": 4}, r"audit launch overrides \['pages'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            moira.check_launch_overrides({"audit": launch})
    assert moira.audit_launch(3) == moira.AuditLaunch(2, 3)  # at most one program per page
