# SPDX-License-Identifier: Apache-2.0
"""benchmarks/engine_profile.py: the profilers bench_tpot starts in the engine process
(here called directly, as collective_rpc calls them: the worker first)."""

from __future__ import annotations

import pytest
from _load import load

load("bench_tpot")  # puts the checkout on sys.path for benchmarks.*
from benchmarks import engine_profile  # noqa: E402


def test_one_profiler_at_a_time_and_kinds_named():
    with pytest.raises(ValueError, match="'cuda' or 'python'"):
        engine_profile.start(None, "nsys")
    assert engine_profile.start(None, "python")
    with pytest.raises(RuntimeError, match="python profiler is already running"):
        engine_profile.start(None, "cuda")
    with pytest.raises(RuntimeError, match="no cuda profiler is running"):
        engine_profile.stop_cuda(None, num_layers=2, step_calls=1)
    sum(i * i for i in range(1000))
    hot = engine_profile.stop_python(None, steps=1)
    assert {"self", "total", "calls_per_step"} <= set(hot) and hot["total"]
    # No engine here: steps are the frontend's.
    assert hot["steps"] == 1 and hot["steps_counted_by"] == "frontend"
    assert hot["calls_per_step"] >= 1000  # the generator's calls at least
    with pytest.raises(RuntimeError, match="no python profiler is running"):
        engine_profile.stop_python(None, steps=1)


def test_cuda_window_without_a_gpu_counts_the_frontend_steps():
    engine_profile.start(None, "cuda")
    out = engine_profile.stop_cuda(None, num_layers=2, step_calls=3)
    assert out["profiled_steps"] == 3.0 and out["kernel_events"] == 0
    assert out["host_calls"]["graph_launch"] == {"per_step": 0.0, "us_per_step": 0.0}


def test_python_window_counts_the_engine_steps(tmp_path, monkeypatch):
    # A stand-in for vLLM's gpu_worker.py: its execute_model marks each engine step.
    (tmp_path / "gpu_worker.py").write_text("def execute_model():\n    return sum(range(100))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gpu_worker

    engine_profile.start(None, "python")
    for _ in range(3):
        gpu_worker.execute_model()
    hot = engine_profile.stop_python(None, steps=5)
    assert hot["steps"] == 3 and hot["steps_counted_by"] == "engine"
    step = next(v for k, v in hot["total"].items() if k.endswith("(execute_model)"))
    assert step["calls_per_step"] == 1.0
