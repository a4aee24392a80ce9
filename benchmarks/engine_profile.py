# SPDX-License-Identifier: Apache-2.0
"""Profilers that run inside vLLM's engine process, driven through ``LLM.collective_rpc``.

bench_tpot runs the engine as users run it: the engine core (scheduler, model runner,
CUDA graphs) in its own process, the benchmark's loop in the frontend process, as in
``vllm serve``. A profiler started in the frontend would see neither the kernels nor the
runner's Python, so these module-level functions (pickled by reference; the first
argument is the vLLM worker) start and stop one in the engine process, between steps,
and return the summary only: the kernels by stage and the host's CUDA calls
(``cuda``), or the runner's Python hotspots (``python``).

With tensor parallelism each rank returns its own summary.
"""

from __future__ import annotations

from typing import Any

#: The profiler running in this process: ("cuda" | "python", profiler).
_ACTIVE: dict[str, Any] = {}


def start(_worker: object, kind: str) -> bool:
    """Start a ``kind`` profiler ("cuda": torch.profiler with CPU and CUDA activity;
    "python": cProfile on the engine's busy-loop thread, where RPCs run)."""
    if _ACTIVE:
        raise RuntimeError(f"a {_ACTIVE['kind']} profiler is already running")
    if kind == "cuda":
        from torch.profiler import ProfilerActivity, profile

        prof: Any = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.start()
    elif kind == "python":
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    else:
        raise ValueError(f"engine_profile.start: kind must be 'cuda' or 'python', got {kind!r}")
    _ACTIVE.update(kind=kind, prof=prof)
    return True


def _take(kind: str) -> Any:
    if _ACTIVE.get("kind") != kind:
        raise RuntimeError(f"no {kind} profiler is running (running: {_ACTIVE.get('kind')})")
    prof = _ACTIVE["prof"]
    _ACTIVE.clear()
    return prof


def stop_cuda(_worker: object, num_layers: int, step_calls: int) -> dict:
    """Stop the CUDA profiler; per decode step: the kernels by category
    (``summarize_kernels``) and the host's CUDA calls (``host_calls``)."""
    import torch

    from benchmarks.bench_tpot import (
        HOST_CALLS,
        cpu_events,
        host_calls,
        kernel_events,
        profiled_steps,
        summarize_kernels,
    )

    prof = _take("cuda")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.stop()
    events = kernel_events(prof)
    calls = cpu_events(prof)
    graph_launches = sum(
        1 for name, _ in calls if any(p in name for p in HOST_CALLS["graph_launch"])
    )
    steps = profiled_steps(events, num_layers, step_calls, graph_launches)
    out = {"profiled_steps": steps, "step_calls": step_calls, "kernel_events": len(events)}
    out.update(summarize_kernels(events, steps))
    out["host_calls"] = host_calls(calls, steps)
    return out


def stop_python(_worker: object, steps: int) -> dict:
    """Stop cProfile; the hotspots per step (``python_hotspots``)."""
    from benchmarks.bench_tpot import python_hotspots

    prof = _take("python")
    prof.disable()
    return python_hotspots(prof, max(steps, 1))
