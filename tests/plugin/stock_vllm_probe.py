"""Run by test_stock_vllm_plugin.py in a subprocess whose ``vllm`` is the stock
0.30.0 package and whose ``vllm_moira`` is this project's installed wheel.

Goes through vLLM's own code only: plugin loading, the registry, the attention
config parser, the CUDA platform's selector (on an SM90 capability) and the
logits-processor validation. Prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import sys
import types


def main() -> None:
    out: dict = {}
    import vllm

    import vllm_moira

    out["vllm_file"] = vllm.__file__
    out["vllm_moira_file"] = vllm_moira.__file__
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    out["enum_has_moira"] = "MOIRA" in AttentionBackendEnum.__members__
    out["custom_registered_before"] = AttentionBackendEnum.CUSTOM.is_overridden()

    from vllm.plugins import load_general_plugins

    try:
        load_general_plugins()
    except Exception as err:  # the VLLM_ATTENTION_BACKEND refusal
        out["plugin_error"] = f"{type(err).__name__}: {err}"
        print(json.dumps(out))
        return
    out["custom_path"] = AttentionBackendEnum.CUSTOM.get_path()

    from vllm.config.attention import AttentionConfig

    out["config_backend"] = AttentionConfig.validate_backend_before("custom").name

    # The CUDA platform's selector, as Attention.__init__ runs it on a Hopper
    # GPU. platforms/cuda.py imports a CUDA-built extension at the top, which
    # cannot load here; nothing the selector uses comes from it.
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import torch
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    class Hopper(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

    selector_config = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None
    )
    path = Hopper.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector_config)
    out["selected_path"] = path
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(path)
    out["selected_module_file"] = sys.modules[cls.__module__].__file__
    out["get_name"] = cls.get_name()
    out["name_round_trip"] = AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    try:
        Hopper.get_attn_backend_cls(
            AttentionBackendEnum.CUSTOM, selector_config._replace(head_size=96)
        )
    except ValueError as err:
        out["selector_refusal"] = str(err)

    # Summaries: the backend pads every KV page on stock vLLM.
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    padded = cls.customize_spec(spec)
    out["page_bytes"] = [spec.page_size_bytes, padded.page_size_bytes]
    try:
        cls.customize_spec(
            FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        )
    except ValueError as err:
        out["block_size_refusal"] = str(err)

    # Plugin-mode refusals and the request guard, through vLLM's validation.
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    from vllm_moira.v1.attention.backends.moira_mode import REQUEST_GUARD, plugin_mode_reasons

    no_guard = types.SimpleNamespace(model_config=types.SimpleNamespace(logits_processors=None))
    guarded = types.SimpleNamespace(
        model_config=types.SimpleNamespace(logits_processors=[REQUEST_GUARD])
    )
    out["reasons_without_guard"] = plugin_mode_reasons(no_guard)
    out["reasons_with_guard"] = plugin_mode_reasons(guarded)
    validate_logits_processors_parameters([REQUEST_GUARD], SamplingParams(max_tokens=4))
    try:
        validate_logits_processors_parameters(
            [REQUEST_GUARD], SamplingParams(max_tokens=4, extra_args={"moira_gamma": 0.9})
        )
    except VLLMValidationError as err:
        out["gamma_refusal"] = {"message": str(err), "parameter": err.parameter}

    # The engine configuration as `vllm serve MODEL --attention-backend CUSTOM
    # --logits-processors GUARD` builds it, and Moira's engine-level checks on it.
    from vllm.engine.arg_utils import EngineArgs

    from vllm_moira.v1.attention.backends.moira_config import check_vllm_config_for_moira

    def engine_config(**kwargs):
        return EngineArgs(
            model=os.environ["PROBE_TINY_MODEL"], skip_tokenizer_init=True, max_model_len=1024,
            block_size=64, max_num_seqs=8, attention_backend="CUSTOM", **kwargs,
        ).create_engine_config()  # fmt: skip

    guarded_config = engine_config(logits_processors=[REQUEST_GUARD])
    out["engine_backend"] = guarded_config.attention_config.backend.name
    out["guarded_v2_runner"] = guarded_config.use_v2_model_runner
    check_vllm_config_for_moira(guarded_config)
    try:
        check_vllm_config_for_moira(engine_config())
    except ValueError as err:
        out["unguarded_engine_refusal"] = str(err)

    # A mixed step's prefill rows on stock metadata, which has no per-request
    # extras field (patch 0005 adds it).
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_moira.v1.attention.backends.moira_utils import slice_prefill_common_metadata

    qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    seq = torch.tensor([70, 130, 5], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl.clone(), seq_lens=seq.clone(),
        num_reqs=3, num_actual_tokens=7, max_query_len=5, max_seq_len=130,
        block_table_tensor=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.arange(7, dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=torch.tensor([False, False, True]),
    )  # fmt: skip
    out["stock_metadata_has_extras"] = hasattr(cam, "attn_request_extras")
    sliced = slice_prefill_common_metadata(cam, 2, 2)
    out["sliced_prefill"] = [sliced.num_reqs, sliced.num_actual_tokens, sliced.seq_lens.tolist()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
