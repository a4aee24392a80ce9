"""collective_rpc entry points of vllm.v1.worker.moira_rpc, on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.v1.attention.moira_backend_utils import moira_module


def test_rpc_controls_reach_every_live_workspace():
    """Switch the selector on every workspace of the process and read / reset
    the summed read counters (tensor parallelism: one call per rank)."""
    from vllm.v1.worker import moira_rpc

    moira = moira_module()
    workspaces = [
        moira.MoiraWorkspace(2, 4, 2, 64, 8, moira.MoiraConfig.paper(), "cpu") for _ in range(2)
    ]
    assert moira_rpc.set_selector(None, gamma=0.5) >= 2
    for ws in workspaces:
        assert ws.selector_params[0].item() == pytest.approx(0.5)
        assert ws.config.gamma == 0.5
    with pytest.raises(ValueError, match="gamma"):
        moira_rpc.set_selector(None, gamma=1.5)
    for k, ws in enumerate(workspaces):
        ws.read_stats.copy_(torch.tensor([k + 1, 10]))
    kept, total = moira_rpc.read_stats(None, reset=True)
    assert kept >= 3 and total >= 20
    assert all(ws.read_stats.tolist() == [0, 0] for ws in workspaces)


def test_rpc_check_summaries_counts_moira_layers():
    """check_summaries recomputes the summaries of each Moira layer that owns
    them and sums what differs; other layers are skipped."""
    from types import SimpleNamespace

    from vllm.v1.worker import moira_rpc

    moira = moira_module()
    impl = object.__new__(moira.MoiraImpl)
    impl.kv_sharing_target_layer_name = None
    impl.kv_cache_fp8 = False
    kv = torch.randn(3, 1, 64, 128).to(torch.bfloat16)
    summaries = torch.zeros(3, 1, 2, 64, dtype=torch.bfloat16)
    moira.write_page_summaries(kv, summaries, torch.tensor([64 + 63], dtype=torch.int64))
    impl._summaries = summaries
    impl._summaries_key = None
    impl._get_summaries = lambda kv_cache, k_scale=None: summaries
    layers = {
        "moira": SimpleNamespace(impl=impl, kv_cache=kv),
        "other": SimpleNamespace(impl=object(), kv_cache=kv),
    }
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context=layers)
        )
    )
    assert moira_rpc.check_summaries(worker) == {
        "layers": 1, "pages": 1, "mismatched": 0, "beyond_rounding": 0
    }  # fmt: skip
    summaries[1, 0, 0, 0] += 1.0  # one value of the written page off
    found = moira_rpc.check_summaries(worker)
    assert (found["pages"], found["mismatched"], found["beyond_rounding"]) == (1, 1, 1)
