# SPDX-License-Identifier: Apache-2.0
"""Moira controls for ``LLM.collective_rpc``.

Installed as ``vllm.v1.worker.moira_rpc``. With tensor parallelism (or vLLM's
multiprocess engine) the Moira workspaces live in the worker processes, so
benchmarks and operators reach them through an RPC that runs on every rank:
``llm.collective_rpc(moira_rpc.set_selector, kwargs={"gamma": 0.9})``.
Module-level functions, so they pickle by reference; the first argument is
the vLLM worker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..attention.backends.moira import MoiraImpl, live_workspaces, verify_page_summaries


def set_selector(_worker: object, **changes: Any) -> int:
    """Apply ``dataclasses.replace(config, **changes)`` to every live workspace
    of the rank (between steps; same rules as ``MoiraWorkspace.set_selector``).
    Returns the number of workspaces changed."""
    workspaces = live_workspaces()
    for ws in workspaces:
        ws.set_selector(dataclasses.replace(ws.config, **changes))
    if any(ws.selector_params.is_cuda for ws in workspaces):
        torch.cuda.synchronize()
    return len(workspaces)


def read_stats(_worker: object, reset: bool = False) -> list[int]:
    """[pages kept, pages in the rows] summed over the rank's workspaces since
    they were last reset (a host sync: call it between steps). ``reset=True``
    zeroes the counters after reading."""
    kept = total = 0
    workspaces = live_workspaces()
    if any(ws.read_stats.is_cuda for ws in workspaces):
        torch.cuda.synchronize()
    for ws in workspaces:
        ws_kept, ws_total = ws.read_counts()
        kept += ws_kept
        total += ws_total
        if reset:
            ws.reset_read_counts()
    return [kept, total]


def check_summaries(worker: Any) -> dict[str, int]:
    """``verify_page_summaries`` over every Moira layer of the rank that writes
    its own summaries (not KV-sharing ones), summed: {"layers", "pages",
    "mismatched", "beyond_rounding"}. A host sync; call it between steps."""
    context = worker.vllm_config.compilation_config.static_forward_context
    out = {"layers": 0, "pages": 0, "mismatched": 0, "beyond_rounding": 0}
    for layer in context.values():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, MoiraImpl) or impl.kv_sharing_target_layer_name is not None:
            continue
        kv_cache = layer.kv_cache
        if impl._summaries is None or kv_cache.numel() == 0:
            continue
        # An fp8 cache: its e4m3 view and the layer's K scale, as the kernels read it.
        moira_kv, k_scale, _ = impl._moira_kv(layer, kv_cache)
        found = verify_page_summaries(moira_kv, impl._get_summaries(kv_cache, k_scale), k_scale)
        out["layers"] += 1
        for key, count in found.items():
            out[key] += count
    return out
