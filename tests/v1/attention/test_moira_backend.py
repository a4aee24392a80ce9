"""MOIRA as a vLLM backend (patched vLLM + overlay, CPU): registry, selection,
refusals, configuration, and the decode/prefill split of the metadata builder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.v1.attention.moira_backend_utils import (
    make_vllm_config,
    moira_module,
)

SM90 = None  # filled lazily (import of vllm.platforms happens under conftest env)


def _cap(major: int, minor: int = 0):
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(major, minor)


pytestmark = pytest.mark.usefixtures("clean_moira_env")


# ---------------------------------------------------------------- registry (0001)
def test_enum_member_path():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum["MOIRA"]
    assert member.get_path() == "vllm.v1.attention.backends.moira.MoiraBackend"
    assert AttentionConfig.validate_backend_before("moira") is member


def test_enum_resolves_to_overlay_class():
    """Needs the backend section merged into moira.py (the enum's in-tree path)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum.MOIRA.get_class()
    assert cls.__name__ == "MoiraBackend"
    assert cls.__module__ == "vllm.v1.attention.backends.moira"
    assert issubclass(cls, FlashAttentionBackend)
    assert cls.get_name() == "MOIRA"
    # Attention.__init__ maps the class back through the enum by name.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.MOIRA


def test_not_in_cuda_priority_lists():
    """Opt-in only. platforms/cuda.py cannot be imported without libcuda: read its source."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("vllm")
    src = (pathlib.Path(spec.origin).parent / "platforms" / "cuda.py").read_text()
    start = src.index("def _get_backend_priorities")
    end = src.index("\ndef ", start + 1)
    assert "FLASH_ATTN" in src[start:end]
    assert "MOIRA" not in src[start:end]


# ---------------------------------------------------------------- selection (0002)
def test_cli_selects_moira(tiny_model):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cfg = make_vllm_config(tiny_model, attention_backend="MOIRA")
    assert cfg.attention_config.backend is AttentionBackendEnum.MOIRA


def test_env_selects_moira(tiny_model, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "moira")
    cfg = make_vllm_config(tiny_model, attention_backend=None)
    assert cfg.attention_config.backend is AttentionBackendEnum.MOIRA


def test_env_is_a_known_vllm_variable():
    import vllm.envs as envs

    assert "VLLM_ATTENTION_BACKEND" in envs.environment_variables


def test_env_and_cli_same_value_ok(tiny_model, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "MOIRA")
    cfg = make_vllm_config(tiny_model, attention_backend="moira")
    assert cfg.attention_config.backend is AttentionBackendEnum.MOIRA


def test_env_and_cli_conflict_errors(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "MOIRA")
    with pytest.raises(ValueError, match=r"VLLM_ATTENTION_BACKEND='MOIRA' conflicts.*FLASH_ATTN"):
        make_vllm_config(tiny_model, attention_backend="FLASH_ATTN")


def test_env_and_attention_config_conflict_errors(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    with pytest.raises(ValueError, match="conflicts"):
        make_vllm_config(tiny_model, attention_backend=None, attention_config={"backend": "MOIRA"})


def test_env_invalid_name_errors(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "MOIRAA")
    with pytest.raises(ValueError, match=r"Invalid VLLM_ATTENTION_BACKEND='MOIRAA'.*MOIRA"):
        make_vllm_config(tiny_model, attention_backend=None)


# ---------------------------------------------------------------- backend hooks
def _good(**over):
    kw = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=None,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=_cap(9, 0),
        attn_type="decoder",
    )
    kw.update(over)
    return kw


def test_good_configuration_has_no_reasons():
    backend = moira_module().MoiraBackend
    assert backend.validate_configuration(**_good()) == []
    assert backend.validate_configuration(**_good(head_size=64, kv_cache_dtype="bfloat16")) == []
    assert backend.validate_configuration(**_good(block_size=64)) == []
    # vLLM's fp8 KV cache (e4m3, the format FA3 reads) in both spellings.
    assert backend.validate_configuration(**_good(kv_cache_dtype="fp8")) == []
    assert backend.validate_configuration(**_good(kv_cache_dtype="fp8_e4m3")) == []


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"head_size": 96}, r"head_size=96 .*\[64, 128\]"),
        ({"head_size": 256}, r"head_size=256 .*\[64, 128\]"),
        ({"dtype": torch.float16}, r"dtype=torch.float16 .*bfloat16"),
        (
            {"kv_cache_dtype": "fp8_e5m2"},
            r"--kv-cache-dtype fp8_e5m2 .*not supported by MOIRA; allowed: auto, bfloat16, "
            r"fp8, fp8_e4m3",
        ),
        ({"kv_cache_dtype": "fp8_inc"}, r"--kv-cache-dtype fp8_inc .*allowed: auto"),
        ({"kv_cache_dtype": "nvfp4"}, r"--kv-cache-dtype nvfp4 .*allowed: auto"),
        ({"kv_cache_dtype": "fp8_per_token_head"}, r"--kv-cache-dtype fp8_per_token_head"),
        ({"block_size": 16}, r"block_size=16 .*exactly 64"),
        ({"block_size": 32}, r"block_size=32 .*exactly 64"),
        ({"use_mla": True}, r"MLA"),
        ({"use_sparse": True}, r"sparse"),
        ({"has_sink": True}, r"sinks"),
        ({"use_mm_prefix": True}, r"mm_prefix"),
        ({"use_per_head_quant_scales": True}, r"per-head"),
        ({"device_capability": _cap(8, 0)}, r"compute capability 8\.0 .*SM90"),
        ({"device_capability": _cap(10, 0)}, r"compute capability 10\.0 .*SM90"),
        ({"attn_type": "encoder_only"}, r"attention type 'encoder_only'.*'decoder'"),
        ({"attn_type": "encoder_decoder"}, r"attention type 'encoder_decoder'"),
        ({"has_sliding_window": True}, r"sliding-window"),
        ({"use_rswa": True}, r"R-SWA"),
        ({"use_non_causal": True}, r"non-causal"),
        ({"use_batch_invariant": True}, r"batch invariance"),
        ({"use_kv_connector": True}, r"KV connectors"),
        ({"use_dcp": True}, r"decode context parallelism"),
        ({"use_pcp": True}, r"prefill context parallelism"),
        ({"use_adaptive_verification": True}, r"speculative"),
        ({"use_some_future_flag": True}, r"use_some_future_flag=True"),
    ],
)
def test_each_refusal_names_the_option(override, expected):
    import re

    reasons = moira_module().MoiraBackend.validate_configuration(**_good(**override))
    assert len(reasons) == 1, reasons
    assert re.search(expected, reasons[0]), reasons[0]
    assert "MOIRA" in reasons[0]


def test_selector_flags():
    backend = moira_module().MoiraBackend
    assert backend.get_name() == "MOIRA"
    assert backend.get_supported_kernel_block_sizes() == [64]
    assert backend.get_preferred_block_size(16) == 64
    assert backend.supports_block_size(64) and backend.supports_block_size(128)
    assert not backend.supports_block_size(16)
    assert backend.supported_dtypes == [torch.bfloat16]
    assert backend.supports_kv_cache_dtype("fp8") and backend.supports_kv_cache_dtype("fp8_e4m3")
    assert not backend.supports_kv_cache_dtype("fp8_e5m2")
    # DCP/PCP are read from the impl class by the selector.
    assert not backend.supports_dcp() and not backend.supports_pcp()
    assert not backend.supports_kv_connector()
    assert not backend.is_mla()


# ---------------------------------------------------------------- configuration
def test_config_defaults():
    cfg = moira_module().moira_config_from_env({})
    assert (cfg.gamma, cfg.selector, cfg.fixed_pages) == (0.98, "coverage", None)
    # Rows of small batches are read whole, all-dense steps run FA3, and
    # Attend's blocks are those the GPU holds at once.
    assert (cfg.attend_fill_blocks, cfg.dense_batch_tokens) == (0, 36864)
    assert cfg.dense_steps == "fa3"
    # One set of defaults: the environment's are MoiraConfig's.
    assert cfg == moira_module().MoiraConfig()
    # The paper's decode step is a preset: no dense rows, Moira on every step, no audit.
    paper = moira_module().MoiraConfig.paper(gamma=0.9)
    assert (paper.dense_batch_tokens, paper.dense_steps, paper.audit_every) == (0, "moira", 0)
    assert paper.gamma == 0.9 and paper.estimator == cfg.estimator


def test_config_from_env_values():
    cfg = moira_module().moira_config_from_env(
        {
            "MOIRA_GAMMA": "1",
            "MOIRA_SELECTOR": "FIXED",
            "MOIRA_FIXED_PAGES": "16",
            "MOIRA_ESTIMATOR": "MVAR",
            "MOIRA_SUMMARY_DTYPE": "bfloat16",
            "MOIRA_AUDIT_EVERY": "32",
            # Benchmark-only: every row through the selector.
            "MOIRA_DENSE_BATCH_TOKENS": "0",
            # The project's tooling: not options, left alone.
            "MOIRA_TEST_GPU": "0",
            "MOIRA_VENV": "/tmp/venv",
        }
    )
    assert (cfg.gamma, cfg.selector, cfg.fixed_pages) == (1.0, "fixed", 16)
    assert (cfg.estimator, cfg.summary_dtype, cfg.audit_every) == ("mvar", "bfloat16", 32)
    assert (cfg.dense_batch_tokens, cfg.dense_steps, cfg.attend_fill_blocks) == (0, "fa3", 0)


@pytest.mark.parametrize(
    "name",
    ["MOIRA_DENSE_STEPS", "MOIRA_ATTEND_FILL_BLOCKS", "MOIRA_ATTEND_SCHEDULE",
     "MOIRA_MIN_CHUNK_PAGES", "MOIRA_MIN_SPLITS_PER_ROW", "MOIRA_MIN_SPLITS_TOTAL",
     "MOIRA_REFINE", "MOIRA_GAMA", "MOIRA_WHATEVER"],
)  # fmt: skip
def test_config_refuses_removed_and_unknown_variables_naming_the_supported(name):
    # Options that became internal (dense steps, Attend's blocks and chunks), removed ones
    # (MOIRA_REFINE: the wide refinement), typos and names Moira never had: an error at
    # start-up that names the supported options, so no setting runs silently with the
    # defaults.
    for value in ("1", "wide"):
        with pytest.raises(ValueError) as excinfo:
            moira_module().moira_config_from_env({name: value})
        message = str(excinfo.value)
        assert f"unknown environment variable(s) ['{name}']" in message
        supported = message.split("; supported: ")[1]
        for option in ("MOIRA_GAMMA", "MOIRA_SELECTOR", "MOIRA_FIXED_PAGES",
                       "MOIRA_FIXED_FRACTION", "MOIRA_ESTIMATOR", "MOIRA_SUMMARY_DTYPE",
                       "MOIRA_AUDIT_EVERY"):  # fmt: skip
            assert option in supported
        assert name not in supported


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"MOIRA_GAMMA": "0"}, r"MOIRA_GAMMA must be in \(0, 1\]"),
        ({"MOIRA_GAMMA": "1.5"}, r"MOIRA_GAMMA must be in \(0, 1\]"),
        ({"MOIRA_GAMMA": "high"}, r"MOIRA_GAMMA='high' is not a valid float"),
        ({"MOIRA_SELECTOR": "topk"}, r"MOIRA_SELECTOR must be one of \('coverage', 'fixed'\)"),
        ({"MOIRA_SELECTOR": "fixed"}, r"needs exactly one of MOIRA_FIXED_PAGES"),
        (
            {"MOIRA_FIXED_PAGES": "8"},
            r"MOIRA_FIXED_PAGES / MOIRA_FIXED_FRACTION are only used with "
            r"MOIRA_SELECTOR='fixed'",
        ),
        (
            {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_PAGES": "0"},
            r"MOIRA_FIXED_PAGES, an integer >= 1",
        ),
        ({"MOIRA_MIN_CHUNK_PAGES": "24"}, r"unknown environment variable.*MOIRA_MIN_CHUNK_PAGES"),
        ({"MOIRA_DENSE_BATCH_TOKENS": "-1"}, r"MOIRA_DENSE_BATCH_TOKENS must be an integer >= 0"),
        ({"MOIRA_ATTEND_SCHEDULE": "pages"}, r"unknown environment variable.*ATTEND_SCHEDULE"),
        ({"MOIRA_DENSE_BATCH_TOKENS": "1e3"}, r"MOIRA_DENSE_BATCH_TOKENS='1e3' is not a valid int"),
        ({"MOIRA_GAMA": "0.9"}, r"unknown environment variable.*MOIRA_GAMA.*MOIRA_GAMMA"),
        (
            {"MOIRA_ESTIMATOR": "box"},
            r"MOIRA_ESTIMATOR must be one of \('mvar', 'mvar_top8'\)",
        ),
        (
            {"MOIRA_SUMMARY_DTYPE": "fp8"},
            r"MOIRA_SUMMARY_DTYPE must be one of \('bfloat16', 'int8', 'int4'\)",
        ),
    ],
)
def test_config_errors(env, expected):
    with pytest.raises(ValueError, match=expected):
        moira_module().moira_config_from_env(env)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"gamma": 0.0}, r"Moira: gamma must be in \(0, 1\]"),
        ({"estimator": "box"}, r"Moira: estimator must be one of"),
        ({"selector": "fixed"}, r"Moira: selector='fixed' needs exactly one of fixed_pages"),
    ],
)
def test_api_config_errors_name_the_field(changes, expected):
    with pytest.raises(ValueError, match=expected) as excinfo:
        moira_module().MoiraConfig(**changes).validate()
    assert "MOIRA_" not in str(excinfo.value)


def test_bad_env_config_is_a_selection_refusal(monkeypatch):
    monkeypatch.setenv("MOIRA_GAMMA", "2")
    reasons = moira_module().MoiraBackend.validate_configuration(**_good())
    assert any("MOIRA_GAMMA must be in (0, 1]" in r for r in reasons), reasons


def _fake_vllm_config(**over):
    cfg = SimpleNamespace(
        speculative_config=None,
        kv_transfer_config=None,
        cache_config=SimpleNamespace(kv_offloading_size=None, kv_sharing_fast_prefill=False),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            use_ubatching=False,
        ),
        model_config=SimpleNamespace(dtype=torch.bfloat16, is_hybrid=False),
    )
    for path, value in over.items():
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"speculative_config": object()}, r"speculative decoding"),
        ({"kv_transfer_config": object()}, r"KV connectors"),
        ({"cache_config.kv_offloading_size": 4.0}, r"offloading"),
        ({"cache_config.kv_sharing_fast_prefill": True}, r"kv_sharing_fast_prefill"),
        ({"parallel_config.decode_context_parallel_size": 2}, r"decode_context_parallel_size=2"),
        ({"parallel_config.prefill_context_parallel_size": 2}, r"prefill_context_parallel_size=2"),
        ({"parallel_config.use_ubatching": True}, r"DBO"),
        ({"model_config.dtype": torch.float16}, r"bfloat16"),
        ({"model_config.is_hybrid": True}, r"hybrid"),
        ({"cache_config.cache_dtype": "fp8_e5m2"}, r"--kv-cache-dtype fp8_e5m2 .*allowed"),
    ],
)
def test_engine_level_refusals(override, expected):
    mod = moira_module()
    assert mod._unsupported_vllm_config_reasons(_fake_vllm_config()) == []
    with pytest.raises(ValueError, match=expected):
        mod.check_vllm_config_for_moira(_fake_vllm_config(**override))


def test_builder_refuses_spec_decode(tiny_model):
    mod = moira_module()
    cfg = make_vllm_config(tiny_model)
    cfg.speculative_config = object()
    with pytest.raises(ValueError, match="speculative decoding"):
        mod.MoiraMetadataBuilder(_spec(cfg), ["layers.0.attn"], cfg, torch.device("cpu"))


# ---------------------------------------------------------------- impl refusals
_IMPL_ARGS = dict(
    num_heads=4,
    head_size=64,
    scale=0.125,
    num_kv_heads=2,
    alibi_slopes=None,
    sliding_window=None,
    kv_cache_dtype="auto",
)


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"alibi_slopes": [1.0, 1.0, 1.0, 1.0]}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "soft-capping"),
        ({"sinks": torch.zeros(4)}, "sinks"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"attn_type": "encoder_only"}, "decoder self-attention only"),
        ({"kv_cache_dtype": "fp8_e5m2"}, r"--kv-cache-dtype fp8_e5m2 .*allowed: .*fp8_e4m3"),
        ({"head_size": 80}, r"head sizes \[64, 128\], got 80"),
    ],
)
def test_impl_refusals(override, expected):
    with pytest.raises(ValueError, match=expected):
        moira_module().MoiraImpl(**{**_IMPL_ARGS, **override})


def test_impl_flags():
    impl_cls = moira_module().MoiraImpl
    assert impl_cls.supports_dcp is False and impl_cls.supports_pcp is False
    assert impl_cls.can_return_lse_for_decode is False


# ---------------------------------------------------------------- builder split
def _spec(cfg):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=cfg.model_config.get_num_kv_heads(cfg.parallel_config),
        head_size=cfg.model_config.get_head_size(),
        dtype=cfg.model_config.dtype,
    )


def _cam(query_lens, seq_lens, block_size=64, max_blocks=16):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = len(query_lens)
    # Distinct block ids per row so row slicing mistakes show up.
    bt = (torch.arange(n * max_blocks, dtype=torch.int32) + 1).view(n, max_blocks)
    num_tokens = int(qsl[-1])
    slots = torch.arange(1000, 1000 + num_tokens, dtype=torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq.clone(),
        num_reqs=n,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=bt,
        slot_mapping=slots,
        seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=torch.tensor([q > 1 for q in query_lens]),
    )


@pytest.fixture(scope="module")
def builder(tiny_model):
    from vllm.config import set_current_vllm_config

    cfg = make_vllm_config(tiny_model)
    with set_current_vllm_config(cfg):
        b = moira_module().MoiraMetadataBuilder(
            _spec(cfg), ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu")
        )
    return b


def test_builder_static_setup(builder):
    from vllm.v1.attention.backend import AttentionCGSupport

    mod = moira_module()
    assert builder.reorder_batch_threshold == 1
    assert mod.MoiraMetadataBuilder.get_cudagraph_support(None, None) == (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    assert builder.use_cascade_attention() is False
    ws = builder.workspace
    assert isinstance(ws, mod.MoiraWorkspace)
    assert ws.max_num_seqs == 8 and ws.max_pages == 1024 // 64
    assert (ws.num_q_heads, ws.num_kv_heads, ws.head_size) == (4, 2, 64)


def test_builder_mixed_batch_split(builder):
    # 3 decode rows (1 token) then 2 prefill rows (5 and 7 tokens).
    cam = _cam([1, 1, 1, 5, 7], [100, 200, 70, 5, 40])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens) == (3, 3)
    assert (md.num_prefills, md.num_prefill_tokens) == (2, 12)
    assert md.num_actual_tokens == 15
    # Decode views alias the runner's buffers (no copies: graph-safe).
    assert md.decode_seq_lens.data_ptr() == cam.seq_lens.data_ptr()
    assert md.decode_block_table.data_ptr() == cam.block_table_tensor.data_ptr()
    assert md.decode_seq_lens.tolist() == [100, 200, 70]
    assert torch.equal(md.decode_block_table, cam.block_table_tensor[:3])
    assert md.workspace is builder.workspace
    assert md.workspace.config.gamma == 0.98

    p = md.prefill
    assert p is not None
    assert p.num_actual_tokens == 12
    assert p.query_start_loc.tolist() == [0, 5, 12]
    assert p.seq_lens.tolist() == [5, 40]
    assert p.max_query_len == 7
    assert p.max_seq_len == 40
    assert torch.equal(p.block_table, cam.block_table_tensor[3:])
    assert p.slot_mapping.tolist() == list(range(1003, 1015))
    assert p.use_cascade is False
    # The runner's buffers are not modified.
    assert cam.query_start_loc.tolist() == [0, 1, 2, 3, 8, 15]


def test_builder_pure_decode_batch(builder):
    cam = _cam([1, 1, 1, 1], [65, 64, 1, 300])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (4, 4, 0)
    assert md.prefill is None


def test_builder_pure_prefill_batch(builder):
    cam = _cam([9, 3], [9, 130])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 2, 12)
    assert md.prefill.query_start_loc.tolist() == [0, 9, 12]
    assert md.prefill.seq_lens.tolist() == [9, 130]
    assert md.decode_seq_lens.numel() == 0


def test_builder_capture_metadata_padded_rows(builder):
    """FULL-graph capture metadata: padded rows have seq_len 0 and stay decodes."""
    cam = _cam([1, 1, 1, 1], [1, 1, 0, 0])
    md = builder.build_for_cudagraph_capture(cam)
    assert (md.num_decodes, md.num_prefills) == (4, 0)
    assert md.decode_seq_lens.tolist() == [1, 1, 0, 0]


# ------------------------------------------------ dense steps (patch 0006, V2)
@pytest.fixture
def step_class(builder):
    """Sets the builder's CUDA-graph step class (as the V2 runner does) and
    restores class 0, the selector and the read counters afterwards."""
    config = builder.workspace.config

    def set_class(c):
        builder.cudagraph_step_class = c

    builder.workspace.reset_read_counts()
    yield set_class
    builder.cudagraph_step_class = 0
    builder.workspace.set_selector(config)
    builder.workspace.reset_read_counts()


def test_builder_declares_a_dense_step_class(builder, step_class):
    import dataclasses

    import numpy as np

    assert builder.get_cudagraph_step_classes() == 3  # dense_steps="fa3"
    # Backend default: 36864 tokens = 576 pages per (row x graph rows).
    assert builder.classify_cudagraph_step(8, np.array([1023, 70])) == 1
    # Class 2: a row's new token is the last of its page (length % 64 == 0),
    # so the step must also write that page's summary.
    assert builder.classify_cudagraph_step(8, np.array([1024, 70])) == 2
    assert builder.classify_cudagraph_step(8, np.array([1000, 128])) == 2
    ws = builder.workspace
    # The same rule as Estimate's and Select's per-row test, on the longest row
    # and the rows of the graph that will replay (padding included): 16 pages.
    ws.set_selector(dataclasses.replace(ws.config, dense_batch_tokens=1024))
    assert builder.classify_cudagraph_step(1, np.array([1023])) == 1
    assert builder.classify_cudagraph_step(1, np.array([1025])) == 0  # 17 pages
    assert builder.classify_cudagraph_step(2, np.array([511])) == 1  # 8 x 2
    assert builder.classify_cudagraph_step(2, np.array([511, 513])) == 0  # 9 x 2
    assert builder.classify_cudagraph_step(4, np.array([511])) == 0  # padded rows count
    # Thresholds switched off at runtime (set_selector) turn the class off.
    ws.set_selector(dataclasses.replace(ws.config, dense_batch_tokens=0))
    assert builder.classify_cudagraph_step(1, np.array([64])) == 0
    ws.set_selector(dataclasses.replace(ws.config, dense_batch_tokens=1024, dense_steps="moira"))
    assert builder.classify_cudagraph_step(1, np.array([64])) == 0


def test_builder_dense_step_is_fa_metadata_of_the_whole_batch(builder, step_class):
    cam = _cam([1, 1, 1], [100, 64, 1])
    md = builder.build(0, cam)
    assert md.dense_step is None  # class 0: Moira's decode step
    assert int(builder.workspace.read_stats.sum()) == 0

    step_class(1)
    md = builder.build(0, cam)
    assert md.prefill is None and md.num_decodes == 3
    assert md.dense_step_fills_pages is False
    fa = md.dense_step
    assert fa is not None
    assert fa.num_actual_tokens == 3 and fa.max_query_len == 1
    assert fa.seq_lens.tolist() == [100, 64, 1]
    assert torch.equal(fa.block_table, cam.block_table_tensor)
    assert fa.slot_mapping.tolist() == [1000, 1001, 1002]
    # Every page is read: both counts get pages x KV heads x layers (2 + 1 + 1
    # pages, 2 KV heads, 1 layer), as Select would have added; on the host,
    # so the device counters are untouched.
    ws = builder.workspace
    assert ws.read_counts() == (8, 8) and ws.read_stats.tolist() == [0, 0]
    step_class(2)
    assert builder.build(0, cam).dense_step_fills_pages is True
    assert ws.read_counts() == (16, 16)
    # Capture metadata is not a step: nothing is counted.
    builder.build_for_cudagraph_capture(_cam([1, 1], [1024, 1024]))
    assert ws.read_counts() == (16, 16)
    # Select's device counts add up with them; a reset clears both.
    ws.read_stats.copy_(torch.tensor([3, 5]))
    assert ws.read_counts() == (19, 21)
    ws.reset_read_counts()
    assert ws.read_counts() == (0, 0)


def test_builder_dense_step_refuses_prefill_rows(builder, step_class):
    for c in (1, 2):
        step_class(c)
        with pytest.raises(RuntimeError, match=f"step class {c}.*2 prefill rows"):
            builder.build(0, _cam([1, 5, 7], [100, 5, 40]))


@pytest.mark.parametrize("fills_a_page", [False, True])
def test_forward_dense_step_runs_fa_and_the_summary_writer(
    builder, step_class, monkeypatch, fills_a_page
):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    mod = moira_module()
    step_class(2 if fills_a_page else 1)
    md = builder.build(0, _cam([1, 1], [64 if fills_a_page else 63, 130]))
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**_IMPL_ARGS)
    calls = {}

    def fake_fa(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        calls["fa"] = (query.shape, attn_metadata)
        return output.fill_(2)

    monkeypatch.setattr(mod, "moira_decode", lambda *a, **k: calls.update(decode=True))
    monkeypatch.setattr(
        mod, "write_page_summaries", lambda kv, summ, slots, k_scale: calls.update(writer=slots)
    )
    monkeypatch.setattr(FlashAttentionImpl, "forward", fake_fa)
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.bfloat16)
    impl.bind_kv_cache_extras(None, kv_cache)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    out = impl.forward(None, q, q, q, kv_cache, md, torch.zeros_like(q))
    impl.release_kv_cache_extras(None)
    assert "decode" not in calls  # no Moira kernel in a dense step
    assert tuple(calls["fa"][0]) == (2, 4, 64) and calls["fa"][1] is md.dense_step
    if fills_a_page:
        assert calls["writer"] is md.dense_step.slot_mapping  # the page that filled
    else:
        assert "writer" not in calls  # FA3's launches alone
    assert out.eq(2).all()


def test_rpc_read_stats_includes_dense_steps(builder, step_class):
    from vllm.v1.worker import moira_rpc

    mod = moira_module()
    step_class(1)
    builder.build(0, _cam([1], [130]))  # 3 pages x 2 KV heads x 1 layer
    builder.workspace.read_stats.copy_(torch.tensor([1, 4]))
    kept, total = (sum(v) for v in zip(*[ws.read_counts() for ws in mod.live_workspaces()]))
    assert moira_rpc.read_stats(None, reset=True) == [kept, total]
    assert builder.workspace.read_counts() == (0, 0)


# ---------------------------------------------------------------- impl routing
def test_forward_routes_decode_to_moira_and_prefill_to_fa(builder, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    mod = moira_module()
    cam = _cam([1, 1, 1, 5, 7], [100, 200, 70, 5, 40])
    md = builder.build(0, cam)
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**_IMPL_ARGS)

    calls = {}

    def fake_decode(query, kv_cache, summaries, block_table, seq_lens, output, workspace, scale,
                    write_filled_pages=False, k_scale=None, v_scale=None):  # fmt: skip
        calls["decode"] = (query.shape, summaries.shape, block_table, seq_lens, workspace)
        calls["decode_writes_summaries"] = write_filled_pages
        assert k_scale is None and v_scale is None  # a bf16 cache has no scales
        output.fill_(1)

    def fake_writer(kv_cache, summaries, slot_mapping, k_scale):
        assert k_scale is None
        calls.setdefault("writer", []).append(slot_mapping)

    def fake_fa(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        calls["fa"] = (query.shape, key.shape, attn_metadata)
        output.fill_(2)
        return output

    monkeypatch.setattr(mod, "moira_decode", fake_decode)
    monkeypatch.setattr(mod, "write_page_summaries", fake_writer)
    monkeypatch.setattr(FlashAttentionImpl, "forward", fake_fa)
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.bfloat16)
    impl.bind_kv_cache_extras(None, kv_cache)
    q = torch.randn(15, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(15, 2, 64, dtype=torch.bfloat16)
    out = torch.zeros(15, 4, 64, dtype=torch.bfloat16)
    impl.forward(None, q, k, k, kv_cache, md, out)
    impl.release_kv_cache_extras(None)

    qshape, sshape, bt, sl, ws = calls["decode"]
    assert tuple(qshape) == (3, 4, 64)
    _, summary_rows = mod.summary_storage(
        mod.summary_slots(mod.MOIRA_DEFAULT_ESTIMATOR), mod.MOIRA_DEFAULT_SUMMARY_DTYPE
    )
    assert tuple(sshape) == (16, 2, summary_rows, 64)
    assert bt is md.decode_block_table and sl is md.decode_seq_lens
    assert ws is builder.workspace
    fq, fk, fmd = calls["fa"]
    assert tuple(fq) == (12, 4, 64) and tuple(fk) == (12, 2, 64)
    assert fmd is md.prefill
    assert out[:3].eq(1).all() and out[3:].eq(2).all()
    # Summaries: Estimate writes the decode rows' filled pages; the writer
    # kernel runs once, on the prefill tokens' slots only.
    assert calls["decode_writes_summaries"] is True
    assert len(calls["writer"]) == 1 and calls["writer"][0] is md.prefill.slot_mapping
    assert calls["writer"][0].tolist() == list(range(1003, 1015))


def test_forward_pure_decode_launches_no_summary_writer(builder, monkeypatch):
    # A pure decode step (the FULL-graph case): the summaries of the pages
    # that filled are Estimate's job, so the writer kernel is not launched.
    from vllm.config import set_current_vllm_config

    mod = moira_module()
    md = builder.build(0, _cam([1, 1], [64, 130]))
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**_IMPL_ARGS)
    seen = {}
    monkeypatch.setattr(
        mod,
        "moira_decode",
        lambda *a, write_filled_pages=False, **scales: seen.update(decode=write_filled_pages),
    )
    monkeypatch.setattr(mod, "write_page_summaries", lambda *a: seen.update(writer=True))
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.bfloat16)
    impl.bind_kv_cache_extras(None, kv_cache)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    impl.forward(None, q, q, q, kv_cache, md, torch.zeros_like(q))
    impl.release_kv_cache_extras(None)
    assert seen == {"decode": True}


class _Fp8Layer(torch.nn.Module):
    """The scales vLLM's attention layer holds (set_default_quant_scales)."""

    def __init__(self, q_scale=1.0, k_scale=0.5, v_scale=0.25):
        super().__init__()
        self._q_scale = torch.tensor(q_scale)
        self._k_scale = torch.tensor(k_scale)
        self._v_scale = torch.tensor(v_scale)


@pytest.fixture
def fa3_fp8(monkeypatch):
    """FlashAttentionImpl accepts an fp8 cache only where FA3 runs (SM90);
    CPU tests stand in for the H200."""
    from vllm.v1.attention.backends import flash_attn

    monkeypatch.setattr(flash_attn, "flash_attn_supports_kv_cache_dtype", lambda *a, **k: True)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_impl_fp8_keeps_the_query_in_bf16(builder, fa3_fp8, kv_cache_dtype):
    # The attention layer quantizes the query for impls that declare
    # supports_quant_query_input; Moira's decode reads it in bf16.
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(builder.vllm_config):
        impl = moira_module().MoiraImpl(**{**_IMPL_ARGS, "kv_cache_dtype": kv_cache_dtype})
        bf16 = moira_module().MoiraImpl(**_IMPL_ARGS)
    assert impl.kv_cache_fp8 and impl.supports_quant_query_input is False
    assert not bf16.kv_cache_fp8 and bf16.supports_quant_query_input is False


def test_forward_fp8_reads_e4m3_with_the_layer_scales(builder, monkeypatch, fa3_fp8):
    # A mixed step on an fp8 cache: Moira's decode and the summary writer get
    # the cache viewed as e4m3 and the layer's scales; FA3 gets the prefill
    # rows' query quantized to e4m3 with q_scale (and reads q_scale as its
    # q_descale: supports_quant_query_input is on during its call only).
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    mod = moira_module()
    md = builder.build(0, _cam([1, 1, 5], [100, 64, 5]))
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**{**_IMPL_ARGS, "kv_cache_dtype": "fp8"})
    layer = _Fp8Layer(q_scale=0.5)
    calls = {}

    def fake_decode(query, kv_cache, summaries, block_table, seq_lens, output, workspace, scale,
                    write_filled_pages=False, k_scale=None, v_scale=None):  # fmt: skip
        calls["decode"] = (query.dtype, kv_cache.dtype, kv_cache.data_ptr(), k_scale, v_scale)
        output.fill_(1)

    def fake_writer(kv_cache, summaries, slot_mapping, k_scale):
        calls["writer"] = (kv_cache.dtype, k_scale)

    def fake_fa(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        calls["fa"] = (query.clone(), self.supports_quant_query_input, kv_cache.dtype)
        return output.fill_(2)

    monkeypatch.setattr(mod, "moira_decode", fake_decode)
    monkeypatch.setattr(mod, "write_page_summaries", fake_writer)
    monkeypatch.setattr(FlashAttentionImpl, "forward", fake_fa)
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.uint8)  # vLLM's fp8 cache storage
    impl.bind_kv_cache_extras(layer, kv_cache)
    q = torch.randn(7, 4, 64, dtype=torch.bfloat16)
    out = torch.zeros(7, 4, 64, dtype=torch.bfloat16)
    impl.forward(layer, q, q[:, :2], q[:, :2], kv_cache, md, out)
    impl.release_kv_cache_extras(layer)
    query_dtype, kv_dtype, kv_ptr, k_scale, v_scale = calls["decode"]
    assert (query_dtype, kv_dtype, kv_ptr) == (torch.bfloat16, torch.float8_e4m3fn,
                                              kv_cache.data_ptr())  # fmt: skip
    assert k_scale is layer._k_scale and v_scale is layer._v_scale
    assert calls["writer"] == (torch.float8_e4m3fn, layer._k_scale)
    fa_query, quantized_input, fa_kv_dtype = calls["fa"]
    assert quantized_input and impl.supports_quant_query_input is False
    assert fa_kv_dtype == torch.uint8  # FlashAttentionImpl views it as fp8 itself
    assert fa_query.dtype == torch.float8_e4m3fn and fa_query.shape == (5, 4, 64)
    torch.testing.assert_close(fa_query.float(), (q[2:].float() / 0.5).to(torch.float8_e4m3fn)
                               .float())  # fmt: skip
    assert out[:2].eq(1).all() and out[2:].eq(2).all()


def test_fp8_cache_summary_bytes_match_the_allocation(builder, fa3_fp8):
    # An fp8 cache holds twice the pages of a bf16 one in the same bytes: the
    # summaries reserved for it are what acquire_summaries allocates.
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import moira_summaries as ms

    mod = moira_module()
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**{**_IMPL_ARGS, "kv_cache_dtype": "fp8"})
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.uint8)
    summaries = ms.acquire_summaries(kv_cache, impl.moira_config.summary_slots,
                                     impl.moira_config.summary_dtype)  # fmt: skip
    try:
        expected = summaries.numel() * summaries.element_size()
        assert impl.get_kv_cache_extras_bytes(kv_cache.numel()) == expected
    finally:
        ms.release_summaries(ms.summary_key(kv_cache))
    with pytest.raises(ValueError, match=r"kv_element_bytes must be 2 \(bf16 KV\) or 1"):
        ms.summary_bytes_for_kv_bytes(1 << 20, 2, "bfloat16", kv_element_bytes=4)


def test_bind_kv_cache_extras_warms_up_the_summary_writer(builder, monkeypatch):
    # The writer is compiled when the KV cache is bound (before capture and the
    # first request), on that layer's cache and summaries; a KV-sharing layer
    # writes no summaries and warms nothing.
    from vllm.config import set_current_vllm_config

    mod = moira_module()
    seen = []
    monkeypatch.setattr(mod, "warm_up_summary_writer", lambda kv, s, k: seen.append((kv, s)))
    kv_cache = torch.zeros(16, 2, 64, 128, dtype=torch.bfloat16)
    with set_current_vllm_config(builder.vllm_config):
        impl = mod.MoiraImpl(**_IMPL_ARGS)
        sharing = mod.MoiraImpl(**_IMPL_ARGS, kv_sharing_target_layer_name="layers.0")
    impl.bind_kv_cache_extras(None, kv_cache)
    sharing.bind_kv_cache_extras(None, kv_cache)
    assert len(seen) == 1 and seen[0][0] is kv_cache and seen[0][1] is impl._summaries
    impl.release_kv_cache_extras(None)
    sharing.release_kv_cache_extras(None)


def test_warm_up_summary_writer_is_a_no_op_off_the_gpu(monkeypatch):
    mod = moira_module()
    monkeypatch.setattr(mod, "write_page_summaries", lambda *a: pytest.fail("launched"))
    mod.warm_up_summary_writer(torch.zeros(4, 2, 64, 128, dtype=torch.bfloat16),
                               torch.zeros(4, 2, 3, 64, dtype=torch.int8))  # fmt: skip


def test_forward_profiling_run_fills_zero(builder):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(builder.vllm_config):
        impl = moira_module().MoiraImpl(**_IMPL_ARGS)
    out = torch.ones(3, 4, 64)
    impl.forward(None, out, out, out, torch.empty(0), None, out)
    assert out.eq(0).all()
