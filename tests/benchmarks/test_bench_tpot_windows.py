# SPDX-License-Identifier: Apache-2.0
"""bench_tpot.run_shape's window logic against a fake engine (CPU, no vLLM engine)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from _load import load

bt = load("bench_tpot")
pytest.importorskip("vllm", reason="run_shape builds vLLM SamplingParams")


class FakeEngine:
    """Chunked prefill (``chunk`` tokens per step, in order), then one token
    per decoding request per step; outputs in DELTA mode."""

    def __init__(self, chunk=1000):
        self.chunk, self.reqs, self.log = chunk, {}, []

    def add_request(self, rid, inp, sp):
        self.reqs[rid] = {"left": len(inp["prompt_token_ids"]), "gen": 0, "max": sp.max_tokens}

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def abort_request(self, ids):
        for rid in ids:
            self.reqs.pop(rid, None)

    def step(self):
        budget, outs = self.chunk, []
        for rid, r in list(self.reqs.items()):
            if r["left"] > 0:
                take = min(budget, r["left"])
                r["left"] -= take
                budget -= take
                if r["left"] > 0:
                    continue
            elif budget <= 0:
                continue
            r["gen"] += 1
            outs.append(types.SimpleNamespace(
                request_id=rid, outputs=[types.SimpleNamespace(token_ids=[1])]))  # fmt: skip
            if r["gen"] >= r["max"]:
                del self.reqs[rid]
        return outs


class FakeSelector:
    def __init__(self):
        self.calls, self.can_switch, self.note = [], True, None

    def apply(self, arm):
        self.calls.append(("apply", arm.get("selector"), arm.get("fixed_fraction")))

    def zero(self):
        self.calls.append(("zero",))

    def reads(self):
        return 0.25


def test_windows_switch_zero_and_time():
    arms = bt.plan_arms("MOIRA", "llama", 8192, 32, [0.98])
    a = types.SimpleNamespace(settle=2, gen=5, breakdown=[], profile_steps=3,
                              max_num_batched_tokens=1000, backend="MOIRA")  # fmt: skip
    ctx = {"model": "m", "vocab": 1000, "num_layers": 2, "kv_capacity_tokens": 10**9,
           "max_model_len": 10**6, "breakdown": []}  # fmt: skip
    rows, sel = [], FakeSelector()
    eng = FakeEngine(chunk=1000)
    llm = types.SimpleNamespace()  # no _preprocess_cmpl_one: prompts go in as they are
    bt.run_shape(eng, llm, a, ctx, sel, 300, 4, arms, lambda r: r and rows.append(r),
                 np.random.default_rng(0))  # fmt: skip
    assert [r["selector"] for r in rows] == ["coverage", "fixed"]
    for r in rows:
        bt.validate_tpot_row(r)
        assert r["steps"] == 5 and r["tpot_ms"] > 0 and r["reads"] == 0.25
        assert not r.get("incomplete")
    assert sel.calls == [("apply", "coverage", None), ("zero",),
                         ("apply", "fixed", 0.42), ("zero",)]  # fmt: skip
    assert not eng.reqs  # aborted after the last window


def test_skips_when_kv_does_not_fit():
    arms = bt.plan_arms("FLASH_ATTN", None, 8192, 32, [0.98])
    a = types.SimpleNamespace(settle=2, gen=5, breakdown=[], profile_steps=3,
                              max_num_batched_tokens=1000, backend="FLASH_ATTN")  # fmt: skip
    ctx = {"model": "m", "vocab": 1000, "num_layers": 2, "kv_capacity_tokens": 100,
           "max_model_len": 10**6, "breakdown": []}  # fmt: skip
    rows = []
    bt.run_shape(FakeEngine(), types.SimpleNamespace(), a, ctx, FakeSelector(), 300, 4, arms,
                 lambda r: r and rows.append(r), np.random.default_rng(0))  # fmt: skip
    assert rows[0]["skipped"] == "kv capacity" and rows[0]["tpot_ms"] is None


class FakeLLM:
    """collective_rpc as vLLM's single-rank engine runs it: ``fn(worker, **kwargs)``
    per rank, here in this process (the engine's profilers run where it steps)."""

    def collective_rpc(self, fn, args=(), kwargs=None):
        return [fn(None, *args, **(kwargs or {}))]


def test_breakdown_shape_ends_with_a_host_python_window():
    # A profiled shape gets, after its arms, the CUDA-profiler window and then a
    # cProfile window whose hotspots name the engine's own Python code.
    arms = bt.plan_arms("FLASH_ATTN", None, 300, 4, [0.98])
    a = types.SimpleNamespace(settle=2, gen=5, breakdown=[(300, 4)], profile_steps=4,
                              max_num_batched_tokens=1000, backend="FLASH_ATTN")  # fmt: skip
    ctx = {"model": "m", "vocab": 1000, "num_layers": 2, "kv_capacity_tokens": 10**9,
           "max_model_len": 10**6, "breakdown": [],
           "geometry": bt.model_geometry({"num_attention_heads": 4, "hidden_size": 256,
                                          "num_key_value_heads": 2, "num_hidden_layers": 2},
                                         "auto", "FLASH_ATTN")}  # fmt: skip
    rows, eng = [], FakeEngine(chunk=1000)
    bt.run_shape(eng, FakeLLM(), a, ctx, FakeSelector(), 300, 4, arms,
                 lambda r: r and rows.append(r), np.random.default_rng(0))  # fmt: skip
    assert len(rows) == len(arms)
    cuda, host = ctx["breakdown"][-2:]
    # No GPU here: the CUDA window reports its steps and no kernels, and says so.
    assert cuda["profiled_steps"] == 4 and cuda["kernel_events"] == 0
    assert cuda["error"] == "profiler recorded no CUDA kernels"
    assert host["kind"] == "host_python" and host["steps"] == 4
    step = [k for k in host["functions"]["total"] if k.endswith("(step)")]
    assert step and host["functions"]["total"][step[0]]["calls_per_step"] == pytest.approx(
        1.0, abs=0.3
    )
    assert not eng.reqs
