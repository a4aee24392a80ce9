"""Page summaries inside the KV pages (plugin mode: stock vLLM has no extras hook).

The backend's customize_spec() pads each page by its summaries; vLLM's own planner
and allocator (kv_cache_utils, allocate_kv_cache) lay the cache out; the summaries
are a strided view of the padding. On CPU (Triton interpreter): the summary writer
and the whole decode step give the same bits through that view as through a separate
buffer, and neither touches K/V or another layer's pages. The route is chosen by
whether vLLM has the extras hook; the test venv is the patched build, so the check
is patched to answer "no".
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from tests.v1.attention.moira_backend_utils import make_vllm_config, moira_module
from tests.v1.attention.moira_test_utils import make_block_table

H_KV, HEAD, GROUP, LAYERS, BLOCKS = 2, 64, 2, 2, 12
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


pytestmark = pytest.mark.usefixtures("clean_moira_env")


@pytest.fixture()
def stock(monkeypatch):
    """The backend module, answering as on stock vLLM: no extras hook."""
    mod = moira_module()
    monkeypatch.setattr(mod, "has_kv_cache_extras_hook", lambda: False)
    return mod


def _spec(block_size: int = 64, dtype: torch.dtype = torch.bfloat16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=H_KV, head_size=HEAD, dtype=dtype)


def test_customize_spec_pads_only_without_the_extras_hook(monkeypatch):
    mod = moira_module()
    spec = _spec()
    # Patched build: the extras hook binds the summaries, the page is vLLM's.
    assert mod.MoiraBackend.customize_spec(spec) is spec
    monkeypatch.setattr(mod, "has_kv_cache_extras_hook", lambda: False)
    padded = mod.MoiraBackend.customize_spec(spec)
    # Default summaries: int8 mvar_top8, 10 slots + 1 row of fp32 scales, D bytes each.
    assert padded.page_size_bytes == spec.page_size_bytes + H_KV * 11 * HEAD
    assert padded.unpadded_page_size_bytes == spec.page_size_bytes
    monkeypatch.setenv("MOIRA_SUMMARY_DTYPE", "bfloat16")
    monkeypatch.setenv("MOIRA_ESTIMATOR", "mvar")
    bf16 = mod.MoiraBackend.customize_spec(spec)
    assert bf16.page_size_bytes == spec.page_size_bytes + H_KV * 2 * HEAD * 2
    # An fp8 cache (uint8 storage): same summary bytes on a page half the size.
    fp8 = _spec(dtype=torch.uint8)
    assert mod.MoiraBackend.customize_spec(fp8).page_size_bytes == fp8.page_size_bytes + (
        H_KV * 2 * HEAD * 2
    )


def test_customize_spec_refuses_other_block_sizes(stock):
    with pytest.raises(ValueError, match=r"needs --block-size 64, got block_size=128"):
        stock.MoiraBackend.customize_spec(_spec(block_size=128))


def _allocate(mod, tiny_model, layout: str):
    """Moira's padded specs through vLLM's planner and allocator: (views, config)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = make_vllm_config(tiny_model)
    cfg.cache_config.kv_cache_layout = layout
    specs = {name: mod.MoiraBackend.customize_spec(_spec()) for name in LAYER_NAMES}
    padded_page = specs[LAYER_NAMES[0]].page_size_bytes
    groups = get_kv_cache_groups(cfg, specs)
    kv_config = get_kv_cache_config_from_groups(cfg, groups, BLOCKS * LAYERS * padded_page)
    # The planner budgets the summaries: BLOCKS blocks in exactly that memory.
    assert kv_config.num_blocks == BLOCKS
    views = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout], [64])
    return views, padded_page


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_writer_fills_the_page_padding_through_vllms_allocation(stock, tiny_model, layout):
    views, padded_page = _allocate(stock, tiny_model, layout)
    config = stock.moira_config_from_env()
    slots, dtype = config.summary_slots, config.summary_dtype
    gen = torch.Generator().manual_seed(0)
    for view in views.values():
        assert view.shape == (BLOCKS, H_KV, 64, 2 * HEAD)
        assert view.stride(0) * view.element_size() == padded_page
        view.copy_(torch.randn(view.shape, generator=gen).to(torch.bfloat16))
    kv_before = {name: view.clone() for name, view in views.items()}
    first, second = (views[name] for name in LAYER_NAMES)
    in_pages = stock.summaries_in_kv_pages(first, slots, dtype)
    assert in_pages is not None and not in_pages.is_contiguous()
    stock.rebuild_page_summaries(first, in_pages)
    separate = torch.zeros_like(in_pages.contiguous())
    stock.rebuild_page_summaries(first, separate)
    assert torch.equal(in_pages, separate)
    assert bool(separate.ne(0).any())
    # K/V of both layers untouched; the other layer's padding still empty.
    for name, view in views.items():
        assert torch.equal(view, kv_before[name]), name
    other = stock.summaries_in_kv_pages(second, slots, dtype)
    assert not bool(other.ne(0).any())
    # A cache without padding has no room: the backend falls back to a buffer.
    assert stock.summaries_in_kv_pages(first.contiguous(), slots, dtype) is None


def test_decode_reads_the_page_summaries_like_a_buffer(stock, tiny_model):
    views, _ = _allocate(stock, tiny_model, "LBNHC")
    kv = views[LAYER_NAMES[0]]
    gen = torch.Generator().manual_seed(1)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(torch.bfloat16))
    # Every row through Estimate and Select (no row read whole), a sparse gamma.
    config = stock.MoiraConfig(gamma=0.5, dense_batch_tokens=0)
    in_pages = stock.summaries_in_kv_pages(kv, config.summary_slots, config.summary_dtype)
    separate = torch.zeros_like(in_pages.contiguous())
    for summaries in (in_pages, separate):
        stock.rebuild_page_summaries(kv, summaries)
    seq_lens = [260, 64 * 5 + 3]
    max_pages = max(math.ceil(s / 64) for s in seq_lens)
    table = make_block_table(seq_lens, BLOCKS, max_pages, generator=gen)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), H_KV * GROUP, HEAD, generator=gen).to(torch.bfloat16)
    outputs = []
    # The last: summaries that say nothing, so a decode that reads them differs.
    for summaries in (in_pages, separate, torch.zeros_like(separate)):
        ws = stock.MoiraWorkspace(4, H_KV * GROUP, H_KV, HEAD, max_pages, config, "cpu")
        out = torch.zeros_like(query)
        stock.moira_decode(query, kv, summaries, table, seq, out, ws, HEAD**-0.5)
        outputs.append(out)
    assert bool(outputs[0].ne(0).any())
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], outputs[2])


def test_impl_uses_the_pages_and_drops_them_with_the_cache(stock, tiny_model):
    from vllm.config import set_current_vllm_config

    views, _ = _allocate(stock, tiny_model, "LBNHC")
    cfg = make_vllm_config(tiny_model)
    with set_current_vllm_config(cfg):
        impl = stock.MoiraImpl(
            num_heads=H_KV * GROUP, head_size=HEAD, scale=0.125, num_kv_heads=H_KV,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
        )  # fmt: skip
    kv = views.pop(LAYER_NAMES[0])
    summaries = impl._get_summaries(kv)
    config = impl.moira_config
    expected = stock.summaries_in_kv_pages(kv, config.summary_slots, config.summary_dtype)
    assert summaries.data_ptr() == expected.data_ptr() and summaries.stride() == expected.stride()
    assert impl._get_summaries(kv) is summaries  # cached for this cache object
    assert impl._summaries is None  # no separate buffer
    # vLLM drops the cache (profiling teardown): the impl lets go of its memory.
    del kv, views, summaries, expected
    gc.collect()
    assert impl._page_summaries is None
    # A cache without padding (a direct caller): a separate buffer, as before.
    plain = torch.zeros(BLOCKS, H_KV, 64, 2 * HEAD, dtype=torch.bfloat16)
    buffer = impl._get_summaries(plain)
    assert buffer.is_contiguous() and impl._summaries is buffer
    impl.release_kv_cache_extras(None)
