# SPDX-License-Identifier: Apache-2.0
"""vLLM's attention-backend contract, as its own backend tests exercise it (CPU).

vLLM's ``tests/v1/attention/test_attention_backends.py`` drives a backend without an
engine: it builds the metadata, fills the paged cache for the context itself, calls
``impl.do_kv_cache_update(..., attn_metadata.slot_mapping)`` for the new tokens and then
``impl.forward``. The GPU run of that suite is ``tests/upstream/run_vllm_tests.py``; these
tests pin the two pieces of MOIRA it relies on.
"""

from __future__ import annotations

import pytest
import torch

from tests.v1.attention.moira_backend_utils import (
    make_vllm_config,
    moira_module,
    write_tiny_llama,
)
from tests.v1.attention.test_moira_backend import _IMPL_ARGS, _cam, _spec
from vllm_moira.v1.attention.ops import moira_reference as ref


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    from vllm.config import set_current_vllm_config

    cfg = make_vllm_config(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    with set_current_vllm_config(cfg):
        return moira_module().MoiraMetadataBuilder(
            _spec(cfg), ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu")
        )


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [([1, 1, 1, 5, 7], [100, 200, 70, 5, 40]), ([1, 1], [64, 130]), ([9, 3], [9, 130])],
    ids=["mixed", "decode", "prefill"],
)
def test_metadata_carries_the_steps_slot_mapping(builder, query_lens, seq_lens):
    # The slots of every token of the step, decode and prefill rows alike: the tensor
    # the runner built (no copy, so a FULL graph sees the runner's buffer).
    cam = _cam(query_lens, seq_lens)
    md = builder.build(0, cam)
    assert md.slot_mapping is cam.slot_mapping
    assert md.slot_mapping.shape[0] == md.num_actual_tokens == sum(query_lens)


def test_summaries_acquired_outside_the_hook_describe_the_cache(builder):
    # A cache whose pages were written behind the backend's back (no worker hook, no
    # writer launch): the first forward acquires the summaries and rebuilds them from
    # the keys, so Estimate reads the summaries of the keys actually there.
    from vllm.config import set_current_vllm_config

    mod = moira_module()
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**_IMPL_ARGS)
    torch.manual_seed(0)
    kv_cache = torch.randn(3, 2, 64, 128).to(torch.bfloat16)  # 3 pages, 2 KV heads, D 64
    summaries = impl._get_summaries(kv_cache)
    try:
        assert summaries.flatten(1).ne(0).any(dim=1).all()  # every page summarized
        # the same bits as the writer summarizing each page as it fills
        assert mod.verify_page_summaries(kv_cache, summaries) == {
            "pages": 3,
            "mismatched": 0,
            "beyond_rounding": 0,
        }
        # and the float32 reference's summaries within int8 storage
        num_top = mod.estimator_num_top(impl.moira_config.estimator)
        want = ref.summarize_pages_top(kv_cache, torch.arange(3), num_top)
        got = ref.read_summaries(summaries)
        step = want.abs().amax(dim=-1, keepdim=True) / ref.INT8_LEVELS
        assert ((got - want).abs() <= step).all()
    finally:
        impl.release_kv_cache_extras(None)


def test_rebuild_page_summaries_covers_every_page():
    mod = moira_module()
    torch.manual_seed(1)
    kv_cache = torch.randn(2, 1, 64, 128).to(torch.bfloat16)
    summaries = torch.zeros(2, 1, 2 + 1, 64, dtype=torch.int8)  # int8 mvar layout
    mod.rebuild_page_summaries(kv_cache, summaries)
    want = ref.summarize_pages(kv_cache, torch.arange(2))
    got = ref.read_summaries(summaries)
    step = want.abs().amax(dim=-1, keepdim=True) / ref.INT8_LEVELS
    assert ((got - want).abs() <= step).all()
