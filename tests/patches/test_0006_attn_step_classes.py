"""Patch 0006: FULL CUDA-graph step classes for attention backends (V2 runner, CPU).

A builder may declare several step classes; the V2 runner then captures each
FULL uniform-decode graph once per class, classifies every uniform-decode step
from host-known lengths, swaps the dispatched descriptor for its variant and
tells the builders which class they build for.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch


def _desc(num_tokens, uniform=1, mode=None, **kw):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(
        cg_mode=mode or CUDAGraphMode.FULL,
        num_tokens=num_tokens,
        num_reqs=num_tokens,
        uniform_token_count=uniform,
        **kw,
    )


def _bare_manager(full_descs, cls=None):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    manager = object.__new__(cls or CudaGraphManager)
    manager._capture_descs = {CUDAGraphMode.FULL: list(full_descs)} if full_descs else {}
    manager.graphs = {}
    return manager


class _Builder:
    def __init__(self, classes, answer):
        self.classes, self.answer, self.seen = classes, answer, []

    def get_cudagraph_step_classes(self):
        return self.classes

    def classify_cudagraph_step(self, num_reqs_padded, seq_lens):
        self.seen.append((num_reqs_padded, list(seq_lens)))
        return self.answer


def _groups(*builders):
    return [[SimpleNamespace(metadata_builders=list(builders))]]


def test_builders_declare_one_class_by_default():
    from vllm.v1.attention.backend import AttentionMetadataBuilder
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    assert AttentionMetadataBuilder.cudagraph_step_class == 0
    assert AttentionMetadataBuilder.get_cudagraph_step_classes(None) == 1
    assert AttentionMetadataBuilder.classify_cudagraph_step(None, 4, np.array([9])) == 0
    assert FlashAttentionMetadataBuilder.get_cudagraph_step_classes(None) == 1


def test_variants_are_added_for_full_uniform_decode_graphs_only():
    from vllm.config.compilation import CUDAGraphMode

    uniform = [_desc(8), _desc(1)]
    varlen = _desc(4, uniform=None)
    ubatched = _desc(16, num_ubatches=2)
    manager = _bare_manager([*uniform, varlen, ubatched])
    manager.add_attn_step_classes(3)
    manager.add_attn_step_classes(3)  # idempotent
    full = manager._capture_descs[CUDAGraphMode.FULL]
    assert len(full) == 4 + 2 * 2
    assert [d.num_tokens for d in full] == sorted((d.num_tokens for d in full), reverse=True)
    for d in uniform:
        assert {x.attn_step_class for x in full if x.num_tokens == d.num_tokens} == {0, 1, 2}
    assert [x.attn_step_class for x in full if x.num_tokens in (4, 16)] == [0, 0]
    # One class (no backend declares any) and no FULL graphs: nothing changes.
    one = _bare_manager(uniform)
    one.add_attn_step_classes(1)
    assert one._capture_descs[CUDAGraphMode.FULL] == uniform
    empty = _bare_manager([])
    empty.add_attn_step_classes(2)
    assert empty._capture_descs == {}


def test_dispatched_descriptor_swaps_only_for_a_captured_variant():
    from dataclasses import replace

    from vllm.config.compilation import CUDAGraphMode

    base = _desc(8)
    manager = _bare_manager([base])
    variant = replace(base, attn_step_class=1)
    manager.graphs = {base: object(), variant: object()}
    assert manager.with_attn_step_class(base, 1) == variant
    assert manager.with_attn_step_class(base, 0) is base
    assert manager.with_attn_step_class(base, 2) is base  # class 2 not captured
    other = _desc(4)
    assert manager.with_attn_step_class(other, 1) is other  # size not captured
    piecewise = _desc(8, mode=CUDAGraphMode.PIECEWISE)
    assert manager.with_attn_step_class(piecewise, 1) is piecewise


def test_step_class_is_the_one_the_declaring_builders_agree_on():
    from vllm.v1.worker.gpu.cudagraph_utils import (
        classify_attn_step,
        get_attn_step_classes,
        set_attn_step_class,
    )

    plain, dense_a, dense_b = _Builder(1, 5), _Builder(2, 1), _Builder(2, 1)
    groups = _groups(plain, dense_a, dense_b)
    assert get_attn_step_classes(groups) == 2
    assert classify_attn_step(groups, 4, np.array([10, 20])) == 1
    assert plain.seen == []  # one-class builders are not asked
    assert dense_a.seen == [(4, [10, 20])]
    dense_b.answer = 0
    assert classify_attn_step(groups, 4, np.array([10])) == 0  # disagreement: class 0
    assert get_attn_step_classes(_groups(plain)) == 1
    assert classify_attn_step(_groups(plain), 1, np.array([1])) == 0
    assert get_attn_step_classes([]) == 1
    set_attn_step_class(groups, 1)
    assert [b.cudagraph_step_class for b in (plain, dense_a, dense_b)] == [1, 1, 1]


def test_capture_builds_each_graph_for_its_class(monkeypatch):
    from dataclasses import replace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils as cu

    builder = _Builder(2, 0)
    builder.cudagraph_step_class = 0
    groups = _groups(builder)
    descs = [_desc(2), replace(_desc(2), attn_step_class=1), _desc(1)]
    manager = _bare_manager(descs, cls=cu.ModelCudaGraphManager)
    manager.use_breakable_cg = False
    manager.cudagraph_mode = CUDAGraphMode.FULL
    manager.max_num_reqs = 4
    manager.dp_size = 1
    manager.is_first_pp_rank = True
    built_for = []

    def fake_prepare(*args, **kwargs):
        built_for.append(builder.cudagraph_step_class)
        return cu.AttentionState(None, {})

    def fake_base_capture(self, create_forward_fn, progress_bar_desc):
        for desc in descs:
            create_forward_fn(desc, warmup=False)
        raise RuntimeError("capture failed")  # the builders are reset anyway

    monkeypatch.setattr(cu, "prepare_inputs_to_capture", fake_prepare)
    monkeypatch.setattr(cu.CudaGraphManager, "capture", fake_base_capture)
    buffers = SimpleNamespace(
        input_ids=torch.zeros(4), positions=torch.zeros(4), is_padding=torch.zeros(4)
    )
    state = SimpleNamespace(prepare_dummy_inputs=lambda num_reqs, num_tokens: {})
    with pytest.raises(RuntimeError, match="capture failed"):
        manager.capture(None, state, buffers, None, None, groups, None)
    assert built_for == [0, 1, 0]
    assert builder.cudagraph_step_class == 0


def test_runner_classifies_before_building_and_captures_the_variants():
    # The order matters: the class must reach the builders before prepare_attn
    # builds the step's metadata, and the variants must exist before capture
    # (and before memory profiling counts the FULL graphs).
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    execute = inspect.getsource(GPUModelRunner.execute_model)
    assert execute.index("dispatch_cg_and_sync_dp(") < execute.index("classify_attn_step(")
    assert execute.index("with_attn_step_class(") < execute.index("self.prepare_inputs(")
    assert execute.index("set_attn_step_class(") < execute.index("self.prepare_attn(")
    capture = inspect.getsource(GPUModelRunner.capture_model)
    assert capture.index("add_attn_step_classes(") < capture.index("cudagraph_manager.capture(")
