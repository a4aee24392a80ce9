# SPDX-License-Identifier: Apache-2.0
"""The captured-mass audit at real shapes on the GPU: masses against the
float32 reference, and graph replay with the audit on equal to eager, bit for bit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SHAPES = [(4, 131072), (32, 8192)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def case(request):
    from benchmarks import moira_correctness as mc

    batch, context = request.param
    return mc.build_case(batch, context)


def test_audited_masses_equal_the_reference(case):
    import torch

    from benchmarks import moira_correctness as mc
    from vllm_moira.v1.attention.backends import moira, moira_audit
    from vllm_moira.v1.attention.ops import moira_reference as ref

    config = moira.MoiraConfig.paper(gamma=0.98, audit_every=1)
    ws = mc.workspace(case, config)
    out = torch.zeros_like(case["query"])
    args = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])
    moira.moira_decode(*args, out, ws, mc.SCALE, **case["scales"])
    torch.cuda.synchronize()
    num_heads = case["kv"].shape[1]
    masses = []
    for sample, (row, head, mass, _gamma) in enumerate(ws.audit.recent.tolist()):
        assert (int(row), int(head)) == moira_audit.audit_list(0, 0, sample, len(case["seq_lens"]),
                                                               num_heads)  # fmt: skip
        row, head = int(row), int(head)
        seq_len = case["seq_lens"][row]
        keys, _ = ref.row_keys_values(case["kv"], case["table"][row], seq_len)
        n = int(ws.list_lengths[row, head])
        expected = ref.captured_mass(case["query"][row], keys, head,
                                     ws.page_list[row, head, :n], seq_len, mc.SCALE)  # fmt: skip
        assert mass == pytest.approx(min(expected, 1.0), abs=1e-4)
        masses.append(mass)
    assert min(masses) < 1.0  # sparse lists: something to measure
    assert sum(ws.stats_counters[3:].tolist()) == len(masses)


def test_graph_replay_with_the_audit_on_equals_eager_bitwise(case):
    from benchmarks import moira_correctness as mc
    from vllm_moira.v1.attention.backends import moira

    config = moira.MoiraConfig.paper(gamma=0.98, audit_every=1)
    for name, result in mc.check_graph_replay(case, config=config).items():
        assert result["bitwise_equal"] and result["lists_equal"], name
