# SPDX-License-Identifier: Apache-2.0
"""Bad-input matrix: every unsupported option and out-of-range value, through the
user-facing path, is refused with a message naming the option and what is allowed.

Path, per row (CPU):

1. ``EngineArgs(model=<tiny local config.json>, attention_backend="MOIRA", ...)
   .create_engine_config()``, with MOIRA_* knobs set as environment variables.
2. vLLM's own backend selection, ``vllm.v1.attention.selector.get_attn_backend`` with the
   layer's parameters taken from that config (head size, dtype, KV cache dtype, sliding
   window, MLA), inside ``set_current_vllm_config``. This is where a real engine refuses
   (model construction). The CUDA platform cannot be imported without libcuda, so
   ``current_platform`` is a stand-in that runs the selected-backend branch of
   ``CudaPlatform.get_attn_backend_cls`` (validate_configuration, then the same
   ``Selected backend ... is not valid ... Reason: [...]`` error) with a chosen compute
   capability.
3. For engine-level options and MOIRA_* values, also the MOIRA metadata builder, which
   repeats the checks (it sees the whole config).

The flag-level unit tests of the same messages are in test_moira_backend.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.v1.attention.moira_backend_utils import (
    make_vllm_config,
    moira_module,
    write_tiny_llama,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("bad-inputs-models")
    return {
        "llama": write_tiny_llama(base / "llama"),
        "head96": write_tiny_llama(base / "head96", head_dim=96, hidden_size=384),
        "head256": write_tiny_llama(base / "head256", head_dim=256, hidden_size=512),
        "sliding": write_tiny_llama(
            base / "mistral",
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            sliding_window=256,
        ),
    }


pytestmark = pytest.mark.usefixtures("clean_moira_env")


class _HopperStandIn:
    """current_platform for the selector: the selected-backend branch of
    vllm/platforms/cuda.py get_attn_backend_cls, with a chosen capability."""

    device_name = "cuda"

    def __init__(self, capability: tuple[int, int], real_platform):
        from vllm.platforms.interface import DeviceCapability

        self.capability = DeviceCapability(*capability)
        self._real = real_platform

    def __getattr__(self, name):  # everything else: the real (CPU) platform
        return getattr(self._real, name)

    def get_device_capability(self, device_id: int = 0):
        return self.capability

    def get_attn_backend_cls(self, selected_backend, attn_selector_config, num_heads=None):
        assert selected_backend is not None, "MOIRA must be the selected backend"
        backend_class = selected_backend.get_class()
        invalid_reasons = backend_class.validate_configuration(
            device_capability=self.capability, **attn_selector_config._asdict()
        )
        if invalid_reasons:
            raise ValueError(
                f"Selected backend {selected_backend} is not valid for "
                f"this configuration. Reason: {invalid_reasons}"
            )
        return selected_backend.get_path()


def _select(monkeypatch, cfg, capability=(9, 0), use_mla=None):
    import vllm.platforms
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector

    moira_module()  # import the backend (and its platform-dependent imports) first
    real = vllm.platforms.current_platform
    monkeypatch.setattr(vllm.platforms, "_current_platform", _HopperStandIn(capability, real))
    selector._cached_get_attn_backend.cache_clear()
    mc = cfg.model_config
    try:
        with set_current_vllm_config(cfg):
            return selector.get_attn_backend(
                mc.get_head_size(),
                mc.dtype,
                cfg.cache_config.cache_dtype,
                use_mla=mc.use_mla if use_mla is None else use_mla,
                has_sliding_window=mc.get_sliding_window() is not None,
            )
    finally:
        selector._cached_get_attn_backend.cache_clear()


def _build(cfg):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=cfg.model_config.get_num_kv_heads(cfg.parallel_config),
        head_size=cfg.model_config.get_head_size(),
        dtype=cfg.model_config.dtype,
    )
    with set_current_vllm_config(cfg):
        return moira_module().MoiraMetadataBuilder(
            spec, ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu")
        )


_GAMMA = r"MOIRA_GAMMA must be in \(0, 1\] \(default 0\.98\), got "
_NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
_CONNECTOR = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}

# (id, model, engine kwargs, MOIRA_* env, selector extras, expected message regex,
#  builder: also refused by the metadata builder: True (same message), a regex, or False)
# Every regex names the option and the allowed values (or what is supported).
MATRIX = [
    ("gamma-0", "llama", {}, {"MOIRA_GAMMA": "0"}, {}, _GAMMA + "0.0", True),
    ("gamma-neg", "llama", {}, {"MOIRA_GAMMA": "-0.5"}, {}, _GAMMA + "-0.5", True),
    ("gamma-gt1", "llama", {}, {"MOIRA_GAMMA": "1.0001"}, {}, _GAMMA + "1.0001", True),
    ("gamma-nan", "llama", {}, {"MOIRA_GAMMA": "nan"}, {}, _GAMMA + "nan", True),
    ("gamma-text", "llama", {}, {"MOIRA_GAMMA": "high"}, {},
     r"MOIRA_GAMMA='high' is not a valid float", True),
    ("selector-name", "llama", {}, {"MOIRA_SELECTOR": "topk"}, {},
     r"MOIRA_SELECTOR must be one of \('coverage', 'fixed'\), got 'topk'", True),
    ("K-0", "llama", {}, {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_PAGES": "0"}, {},
     r"MOIRA_SELECTOR='fixed' needs MOIRA_FIXED_PAGES, an integer >= 1", True),
    ("K-neg", "llama", {}, {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_PAGES": "-3"}, {},
     r"MOIRA_FIXED_PAGES, an integer >= 1", True),
    ("K-text", "llama", {}, {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_PAGES": "4.5"}, {},
     r"MOIRA_FIXED_PAGES='4.5' is not a valid int", True),
    ("K-missing", "llama", {}, {"MOIRA_SELECTOR": "fixed"}, {},
     r"MOIRA_SELECTOR='fixed' needs exactly one of MOIRA_FIXED_PAGES .*or "
     r"MOIRA_FIXED_FRACTION \(in \(0, 1\]\)",
     True),
    ("K-without-fixed", "llama", {}, {"MOIRA_FIXED_PAGES": "8"}, {},
     r"MOIRA_FIXED_PAGES / MOIRA_FIXED_FRACTION are only used with MOIRA_SELECTOR='fixed'",
     True),
    ("fraction-gt1", "llama", {},
     {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_FRACTION": "1.5"}, {},
     r"MOIRA_FIXED_FRACTION must be in \(0, 1\], got 1\.5", True),
    ("chunk-removed", "llama", {}, {"MOIRA_MIN_CHUNK_PAGES": "24"}, {},
     r"unknown environment variable\(s\) \['MOIRA_MIN_CHUNK_PAGES'\]; supported: \[", True),
    ("schedule-removed", "llama", {}, {"MOIRA_ATTEND_SCHEDULE": "lists"}, {},
     r"unknown environment variable\(s\) \['MOIRA_ATTEND_SCHEDULE'\]; supported: \[", True),
    ("dense-steps-internal", "llama", {}, {"MOIRA_DENSE_STEPS": "moira"}, {},
     r"unknown environment variable\(s\) \['MOIRA_DENSE_STEPS'\]; supported: \[.*"
     r"'MOIRA_SUMMARY_DTYPE'", True),
    # The wide refinement was removed: its variable is refused with the options there are.
    ("refine-removed", "llama", {}, {"MOIRA_REFINE": "wide"}, {},
     r"unknown environment variable\(s\) \['MOIRA_REFINE'\]; supported: \['MOIRA_AUDIT_EVERY', "
     r"'MOIRA_ESTIMATOR', 'MOIRA_FIXED_FRACTION', 'MOIRA_FIXED_PAGES', 'MOIRA_GAMMA', "
     r"'MOIRA_SELECTOR', 'MOIRA_SUMMARY_DTYPE'\]", True),
    ("estimator-name", "llama", {}, {"MOIRA_ESTIMATOR": "box"}, {},
     r"MOIRA_ESTIMATOR must be one of \('mvar', 'mvar_top8'\) \(default 'mvar_top8'\), "
     r"got 'box'", True),
    ("summary-dtype", "llama", {}, {"MOIRA_SUMMARY_DTYPE": "fp8"}, {},
     r"MOIRA_SUMMARY_DTYPE must be one of \('bfloat16', 'int8', 'int4'\)", True),
    ("summary-int4-no-keys", "llama", {},
     {"MOIRA_SUMMARY_DTYPE": "int4", "MOIRA_ESTIMATOR": "mvar"}, {},
     r"MOIRA_SUMMARY_DTYPE 'int4' stores the keys of .* MOIRA_ESTIMATOR 'mvar' stores none",
     True),
    ("env-typo", "llama", {}, {"MOIRA_GAMA": "0.9"}, {},
     r"unknown environment variable\(s\) \['MOIRA_GAMA'\]; supported: \[.*'MOIRA_GAMMA'", True),
    ("block-16", "llama", {"block_size": 16}, {}, {},
     r"block_size=16 is not supported by MOIRA; the kernel block size is exactly 64 "
     r"\(use --block-size 64", False),
    ("block-32", "llama", {"block_size": 32}, {}, {}, r"block_size=32 .*exactly 64", False),
    ("block-96", "llama", {"block_size": 96}, {}, {}, r"block_size=96 .*exactly 64", False),
    ("kv-fp8-e5m2", "llama", {"kv_cache_dtype": "fp8_e5m2"}, {}, {},
     r"--kv-cache-dtype fp8_e5m2 \(kv_cache_dtype='fp8_e5m2'\) is not supported by MOIRA; "
     r"allowed: auto, bfloat16, fp8, fp8_e4m3", True),
    ("kv-fp8-inc", "llama", {"kv_cache_dtype": "fp8_inc"}, {}, {},
     r"--kv-cache-dtype fp8_inc .*allowed: auto, bfloat16, fp8, fp8_e4m3", True),
    ("kv-int8-per-token-head", "llama", {"kv_cache_dtype": "int8_per_token_head"}, {}, {},
     r"--kv-cache-dtype int8_per_token_head .*allowed: auto, bfloat16, fp8, fp8_e4m3", True),
    ("kv-nvfp4", "llama", {"kv_cache_dtype": "nvfp4"}, {}, {},
     r"--kv-cache-dtype nvfp4 .*allowed: auto, bfloat16, fp8, fp8_e4m3", True),
    ("sliding-window", "sliding", {}, {}, {},
     r"sliding-window attention is not supported by MOIRA; only full attention", False),
    ("mla", "llama", {}, {}, {"use_mla": True},
     r"MLA models are not supported by MOIRA; only MHA/GQA/MQA", False),
    ("spec-decode", "llama", {"speculative_config": _NGRAM}, {}, {},
     r"speculative decoding \(speculative_config\) is not supported by MOIRA.*disable "
     r"speculative decoding", True),
    ("kv-connector", "llama", {"kv_transfer_config": _CONNECTOR}, {}, {},
     r"KV connectors .*not supported by MOIRA", True),
    ("sm80", "llama", {}, {}, {"capability": (8, 0)},
     r"compute capability 8\.0 is not supported by MOIRA; only SM90 \(9\.x, Hopper\)", False),
    ("sm100", "llama", {}, {}, {"capability": (10, 0)},
     r"compute capability 10\.0 is not supported by MOIRA; only SM90", False),
    ("dtype-fp16", "llama", {"dtype": "float16"}, {}, {},
     r"dtype=torch\.float16 is not supported by MOIRA; only torch\.bfloat16",
     r"model dtype torch\.float16 is not supported by MOIRA; only bfloat16"),
    ("dtype-fp32", "llama", {"dtype": "float32"}, {}, {},
     r"dtype=torch\.float32 is not supported by MOIRA; only torch\.bfloat16",
     r"model dtype torch\.float32 is not supported by MOIRA; only bfloat16"),
    ("head-96", "head96", {}, {}, {},
     r"head_size=96 is not supported by MOIRA; supported head sizes: \[64, 128\]", False),
    ("head-256", "head256", {}, {}, {}, r"head_size=256 .*\[64, 128\]", False),
]  # fmt: skip

# Accepted configurations next to the refused ones (the matrix is not vacuous).
ACCEPTED = [
    ("default", "llama", {}, {}),
    ("block-128", "llama", {"block_size": 128}, {}),
    ("kv-bf16", "llama", {"kv_cache_dtype": "bfloat16"}, {}),
    ("kv-fp8", "llama", {"kv_cache_dtype": "fp8"}, {}),
    ("kv-fp8-e4m3", "llama", {"kv_cache_dtype": "fp8_e4m3"}, {}),
    ("gamma-1", "llama", {}, {"MOIRA_GAMMA": "1"}),
    ("gamma-tiny", "llama", {}, {"MOIRA_GAMMA": "1e-6"}),
    ("fixed-K", "llama", {}, {"MOIRA_SELECTOR": "Fixed", "MOIRA_FIXED_PAGES": "1"}),
    ("fixed-fraction", "llama", {}, {"MOIRA_SELECTOR": "fixed", "MOIRA_FIXED_FRACTION": "1"}),
    ("tooling-var", "llama", {}, {"MOIRA_TEST_GPU": "0"}),
    ("summary-int4", "llama", {}, {"MOIRA_SUMMARY_DTYPE": "int4"}),
]


@pytest.mark.parametrize(
    ("model", "engine_kwargs", "env", "extra", "expected", "builder"),
    [pytest.param(*row[1:], id=row[0]) for row in MATRIX],
)
def test_bad_input_is_refused_naming_option(
    models, monkeypatch, model, engine_kwargs, env, extra, expected, builder
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = make_vllm_config(models[model], **engine_kwargs)
    with pytest.raises(ValueError) as excinfo:
        _select(monkeypatch, cfg, extra.get("capability", (9, 0)), extra.get("use_mla"))
    message = str(excinfo.value)
    assert re.search(r"Selected backend \S*MOIRA is not valid for this configuration", message)
    assert re.search(expected, message), message
    if builder:
        with pytest.raises(ValueError) as built:
            _build(cfg)
        builder_expected = expected if builder is True else builder
        assert re.search(builder_expected, str(built.value)), str(built.value)


@pytest.mark.parametrize(
    ("model", "engine_kwargs", "env"), [pytest.param(*row[1:], id=row[0]) for row in ACCEPTED]
)
def test_accepted_inputs_select_moira(models, monkeypatch, model, engine_kwargs, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = make_vllm_config(models[model], **engine_kwargs)
    backend = _select(monkeypatch, cfg)
    assert backend.get_name() == "MOIRA"
    assert _build(cfg).workspace is not None


def test_matrix_covers_the_issue_list():
    """Each option of the refusal list is present in the matrix (fp8 KV, served,
    is in ACCEPTED; the fp8 formats FA3 cannot read are refused)."""
    ids = {row[0] for row in MATRIX}
    required = {
        "gamma-0", "gamma-gt1", "selector-name", "K-0", "block-16", "kv-fp8-e5m2",
        "sliding-window", "mla", "spec-decode", "kv-connector", "sm80", "dtype-fp16",
        "head-96",
    }  # fmt: skip
    assert required <= ids, required - ids
