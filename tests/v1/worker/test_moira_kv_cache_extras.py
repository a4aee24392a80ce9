"""KV-cache extras hook (patch 0003) and Moira's summary allocation (overlay), on CPU."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from tests.v1.attention.moira_backend_utils import make_vllm_config, moira_module, write_tiny_llama


class _RecordingImpl:
    def __init__(self, per_layer=0, shared=None):
        self.events = []
        self.per_layer = per_layer
        self.shared = shared or {}

    def bind_kv_cache_extras(self, layer, kv_cache):
        self.events.append(("bind", layer, kv_cache, _CTX["active"]))

    def release_kv_cache_extras(self, layer):
        self.events.append(("release", layer))

    def get_kv_cache_extras_bytes(self, kv_cache_bytes):
        self.events.append(("bytes", kv_cache_bytes))
        return self.per_layer

    def get_shared_kv_cache_extras_bytes(self):
        return dict(self.shared)


class _Layer:
    def __init__(self, impl):
        self.impl = impl
        self.kv_cache = torch.tensor([])

    def bind_kv_cache(self, kv_cache):
        self.kv_cache = kv_cache


_CTX = {"active": False}


@contextmanager
def _alloc_ctx():
    _CTX["active"] = True
    try:
        yield
    finally:
        _CTX["active"] = False


def test_bind_calls_extras_hook_under_allocation_context():
    from vllm.v1.worker.utils import bind_kv_cache_to_layers

    impls = [_RecordingImpl(), _RecordingImpl()]
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    ctx = {n: _Layer(i) for n, i in zip(names, impls)}
    caches = {n: torch.zeros(4, 2, 64, 128) for n in names}
    bind_kv_cache_to_layers(caches, ctx, kv_cache_allocation_context=_alloc_ctx())
    for n, impl in zip(names, impls):
        (event,) = impl.events
        assert event[0] == "bind" and event[1] is ctx[n]
        assert event[2] is caches[n]  # the bound view
        assert event[3] is True  # inside the KV cache allocation context


def test_bind_without_context_and_layers_without_hook():
    from vllm.v1.worker.utils import bind_kv_cache_to_layers

    plain = SimpleNamespace(impl=object(), kv_cache=None)
    plain.bind_kv_cache = lambda t: setattr(plain, "kv_cache", t)
    impl = _RecordingImpl()
    ctx = {"model.layers.0.attn": plain, "model.layers.1.attn": _Layer(impl)}
    caches = {k: torch.zeros(2, 1, 64, 128) for k in ctx}
    bind_kv_cache_to_layers(caches, ctx)
    assert impl.events[0][0] == "bind" and impl.events[0][3] is False


def test_clear_layer_kv_caches_releases_extras():
    from vllm.v1.worker.utils import clear_layer_kv_caches

    impl = _RecordingImpl()
    layer = _Layer(impl)
    layer.kv_cache = torch.zeros(2, 1, 64, 128)
    clear_layer_kv_caches([layer, SimpleNamespace()])
    assert impl.events == [("release", layer)]
    assert layer.kv_cache.numel() == 0


def test_v1_profiling_cleanup_releases_extras():
    """V1 runner's _cleanup_profiling_kv_cache releases extras (patch 0003)."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner._cleanup_profiling_kv_cache)
    assert "release_layer_kv_cache_extras(layer)" in src


def test_worker_subtracts_extras_from_available_memory():
    import inspect

    from vllm.v1.worker.gpu_worker import Worker

    src = inspect.getsource(Worker.determine_available_memory)
    assert "self.available_kv_cache_memory_bytes -= kv_cache_extras_bytes" in src


def test_extras_bytes_sum_per_layer_and_shared_once():
    from vllm.v1.worker.utils import get_kv_cache_extras_bytes

    a = _RecordingImpl(per_layer=10, shared={"ws": 1000})
    b = _RecordingImpl(per_layer=20, shared={"ws": 700, "other": 5})
    layers = [SimpleNamespace(impl=a), SimpleNamespace(impl=b), SimpleNamespace()]
    assert get_kv_cache_extras_bytes(layers, 1 << 20) == 10 + 20 + 1000 + 5
    # The KV budget is split evenly over the layers with an impl.
    assert a.events == [("bytes", (1 << 20) // 2)]
    assert get_kv_cache_extras_bytes(layers, 0) == 0
    assert get_kv_cache_extras_bytes([SimpleNamespace()], 1 << 20) == 0


# ---------------------------------------------------------------- Moira summaries
def test_summaries_shape_sharing_and_release():
    from vllm.v1.worker import moira_summaries as ms

    base = ms.live_summary_bytes()
    kv = torch.zeros(8, 2, 64, 256, dtype=torch.bfloat16)
    s1 = ms.acquire_summaries(kv)
    assert s1.shape == (8, 2, 2, 128) and s1.dtype == torch.bfloat16
    assert s1.is_contiguous() and s1.eq(0).all()
    # Same view (KV sharing) -> same buffer.
    assert ms.acquire_summaries(kv) is s1
    kv_other = torch.zeros(8, 2, 64, 256, dtype=torch.bfloat16)
    other = ms.acquire_summaries(kv_other)
    assert other is not s1
    key = ms.summary_key(kv)
    ms.release_summaries(key)
    assert ms.acquire_summaries(kv) is s1  # still held once
    ms.release_summaries(key)
    ms.release_summaries(key)
    ms.release_summaries(ms.summary_key(kv_other))
    assert ms.live_summary_bytes() == base
    assert ms.acquire_summaries(kv) is not s1  # freed, re-allocated
    ms.release_summaries(key)


def test_summary_rejects_non_64_kernel_block():
    from vllm.v1.worker import moira_summaries as ms

    with pytest.raises(ValueError, match="kernel block size must be 64"):
        ms.acquire_summaries(torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("heads, head_size", [(8, 128), (2, 64)])
def test_summary_bytes_are_one_64th_of_kv(heads, head_size):
    from vllm.v1.worker import moira_summaries as ms

    kv = torch.zeros(10, heads, 64, 2 * head_size, dtype=torch.bfloat16)
    s = ms.acquire_summaries(kv)
    kv_bytes = kv.numel() * kv.element_size()
    assert s.numel() * s.element_size() == ms.summary_bytes_for_kv_bytes(kv_bytes)
    assert kv_bytes == 64 * ms.summary_bytes_for_kv_bytes(kv_bytes)
    ms.release_summaries(ms.summary_key(kv))


@pytest.mark.parametrize("num_slots, fraction", [(2, (1, 64)), (4, (1, 32)), (6, (3, 64))])
def test_summary_bytes_follow_the_slot_count(num_slots, fraction):
    """2 slots (mvar): 1/64 of the KV bytes; 4: 1/32; 6: 3/64 (the storage follows the slot
    count). Accounting equals the allocation."""
    from vllm.v1.worker import moira_summaries as ms

    kv = torch.zeros(10, 2, 64, 2 * 64, dtype=torch.bfloat16)
    s = ms.acquire_summaries(kv, num_slots)
    assert s.shape == (10, 2, num_slots, 64) and s.eq(0).all()
    kv_bytes = kv.numel() * kv.element_size()
    summary_bytes = s.numel() * s.element_size()
    assert summary_bytes == ms.summary_bytes_for_kv_bytes(kv_bytes, num_slots)
    assert summary_bytes * fraction[1] == kv_bytes * fraction[0]
    # A layer asking for another layout of the same KV view is refused.
    with pytest.raises(ValueError, match="same estimator"):
        ms.acquire_summaries(kv, 2 if num_slots != 2 else 6)
    ms.release_summaries(ms.summary_key(kv))


@pytest.mark.parametrize(
    "estimator, summary_dtype, rows",
    [(None, None, 11), ("mvar", None, 3), ("mvar", "bfloat16", 2), ("mvar_top8", "bfloat16", 10),
     ("mvar_top8", "int8", 11)],
)  # fmt: skip
def test_moira_impl_summaries_follow_estimator(tmp_path, monkeypatch, estimator,
                                               summary_dtype, rows):  # fmt: skip
    """MOIRA_ESTIMATOR and MOIRA_SUMMARY_DTYPE fix the summary layout the impl allocates
    and accounts for (unset: the default, mvar_top8 in int8: 10 slots and one more row of
    D bytes for the scales; bfloat16: the slots only)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import moira_summaries as ms
    from vllm.v1.worker.utils import bind_kv_cache_to_layers, clear_layer_kv_caches

    if estimator is None:
        monkeypatch.delenv("MOIRA_ESTIMATOR", raising=False)
    else:
        monkeypatch.setenv("MOIRA_ESTIMATOR", estimator)
    if summary_dtype is None:
        monkeypatch.delenv("MOIRA_SUMMARY_DTYPE", raising=False)
    else:
        monkeypatch.setenv("MOIRA_SUMMARY_DTYPE", summary_dtype)
    stored_as = summary_dtype or "int8"  # the default storage
    dtype, elem_bytes = (torch.int8, 1) if stored_as == "int8" else (torch.bfloat16, 2)
    mod = moira_module()
    cfg = make_vllm_config(write_tiny_llama(tmp_path / "m"))
    with set_current_vllm_config(cfg):
        impl = mod.MoiraImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                             alibi_slopes=None, sliding_window=None,
                             kv_cache_dtype="auto")  # fmt: skip
        name = "model.layers.0.self_attn.attn"
        kv = torch.zeros(12, 2, 64, 128, dtype=torch.bfloat16)
        base = ms.live_summary_bytes()
        layer = _Layer(impl)
        bind_kv_cache_to_layers({name: kv}, {name: layer})
        assert impl._summaries.shape == (12, 2, rows, 64)
        assert impl._summaries.dtype == dtype
        kv_bytes = kv.numel() * 2
        assert ms.live_summary_bytes() - base == impl.get_kv_cache_extras_bytes(kv_bytes)
        assert impl.get_kv_cache_extras_bytes(kv_bytes) * 256 == kv_bytes * rows * elem_bytes
        clear_layer_kv_caches([layer])
        assert impl._summaries is None
        assert ms.live_summary_bytes() == base


def test_moira_impl_hook_end_to_end(tmp_path):
    """Real MoiraImpl through the generic hook: two layers sharing one KV view share
    the summaries; accounting matches the allocation; release frees."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import moira_summaries as ms
    from vllm.v1.worker.utils import (
        bind_kv_cache_to_layers,
        clear_layer_kv_caches,
        get_kv_cache_extras_bytes,
    )

    mod = moira_module()
    cfg = make_vllm_config(write_tiny_llama(tmp_path / "m"))
    args = dict(
        num_heads=4,
        head_size=64,
        scale=0.125,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    with set_current_vllm_config(cfg):
        impls = [mod.MoiraImpl(**args), mod.MoiraImpl(**args)]
        names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        ctx = {n: _Layer(i) for n, i in zip(names, impls)}
        shared_kv = torch.zeros(12, 2, 64, 128, dtype=torch.bfloat16)
        base = ms.live_summary_bytes()
        bind_kv_cache_to_layers({n: shared_kv for n in names}, ctx)
        assert impls[0]._summaries is impls[1]._summaries
        dtype, rows = mod.summary_storage(
            mod.summary_slots(mod.MOIRA_DEFAULT_ESTIMATOR), mod.MOIRA_DEFAULT_SUMMARY_DTYPE
        )
        summary_bytes = 12 * 2 * rows * 64 * torch.empty((), dtype=dtype).element_size()
        assert impls[0]._summaries.shape == (12, 2, rows, 64)
        assert impls[0]._summaries.dtype == dtype
        assert ms.live_summary_bytes() - base == summary_bytes

        kv_bytes = shared_kv.numel() * 2
        ws_bytes = moira_module().moira_workspace_bytes(cfg, 4, 2, 64)
        # The backend's config (its Attend schedule sizes the partials).
        builder_ws = mod.MoiraWorkspace(8, 4, 2, 64, 1024 // 64, mod.moira_config_from_env(),
                                        "cpu")  # fmt: skip
        assert ws_bytes == builder_ws.nbytes() > 0
        total = get_kv_cache_extras_bytes(list(ctx.values()), 2 * kv_bytes)
        assert total == 2 * summary_bytes + ws_bytes

        clear_layer_kv_caches(ctx.values())
        assert impls[0]._summaries is None and impls[1]._summaries is None
        assert ms.live_summary_bytes() == base


def test_lazy_fallback_allocates_and_follows_view_changes(tmp_path):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import moira_summaries as ms

    mod = moira_module()
    cfg = make_vllm_config(write_tiny_llama(tmp_path / "m"))
    with set_current_vllm_config(cfg):
        impl = mod.MoiraImpl(
            num_heads=4,
            head_size=64,
            scale=0.125,
            num_kv_heads=2,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )
    base = ms.live_summary_bytes()
    kv1 = torch.zeros(4, 2, 64, 128, dtype=torch.bfloat16)
    s1 = impl._get_summaries(kv1)
    assert impl._get_summaries(kv1) is s1
    kv2 = torch.zeros(6, 2, 64, 128, dtype=torch.bfloat16)
    s2 = impl._get_summaries(kv2)
    assert s2.shape[0] == 6
    assert ms.live_summary_bytes() - base == s2.numel() * s2.element_size()  # old one released
    impl.release_kv_cache_extras(None)
    assert ms.live_summary_bytes() == base
