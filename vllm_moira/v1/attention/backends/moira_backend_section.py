from vllm.v1.attention.backends.moira import (MOIRA_PAGE_SIZE, MoiraConfig, MoiraWorkspace, write_page_summaries, moira_decode)  # noqa: E501, I001
# ---- end of section imports ----
# SPDX-License-Identifier: Apache-2.0
# ==========================================================================
# vLLM backend: MoiraBackend -> MoiraMetadata -> MoiraMetadataBuilder ->
# MoiraImpl (same order as flash_attn.py).
#
# Moira reuses FlashAttention for everything it does not replace: the KV
# cache layout and scatter (do_kv_cache_update), and FA3 for prefill rows.
# Decode rows (one query token each) go to moira_decode. Decode rows come
# first in the batch (reorder threshold 1), so the split is two contiguous
# slices and FA3 never sees the decode rows (FA3 writes zeros for rows with
# nothing to attend to, so it must not be handed zero-length decode rows).
# ==========================================================================
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)

#: Head sizes the Moira kernels are built and tested for.
MOIRA_BACKEND_HEAD_SIZES: tuple[int, ...] = (64, 128)

# --------------------------------------------------------------------------
# Configuration (MOIRA_* environment variables)
#
# Environment variables reach every process vLLM starts (API server, engine
# core, workers) for both `vllm serve` and `LLM(...)`, and need no change to
# vLLM's config classes. They are not VLLM_* names, so vLLM's unknown-variable
# check leaves them alone. Every knob is read and validated once, when the
# backend is selected, and a malformed value is an error, never a default.
# --------------------------------------------------------------------------
_MOIRA_ENV_FIELDS: dict[str, tuple[str, type]] = {
    "MOIRA_GAMMA": ("gamma", float),
    "MOIRA_SELECTOR": ("selector", str),
    "MOIRA_FIXED_PAGES": ("fixed_pages", int),
    "MOIRA_MIN_CHUNK_PAGES": ("min_chunk_pages", int),
    "MOIRA_MIN_SPLITS_PER_ROW": ("min_splits_per_row", int),
    "MOIRA_MIN_SPLITS_TOTAL": ("min_splits_total", int),
}


def moira_config_from_env(environ: Mapping[str, str] | None = None) -> MoiraConfig:
    """Build and validate the MoiraConfig from MOIRA_* environment variables.

    Unset variables keep the paper's defaults (gamma 0.98, coverage selector,
    C=24, N_J=32, N_T=4096). Unknown MOIRA_* names are rejected so a typo
    (e.g. MOIRA_GAMA) cannot silently run with the default.
    """
    environ = os.environ if environ is None else environ
    unknown = sorted(
        k for k in environ if k.startswith("MOIRA_") and k not in _MOIRA_ENV_FIELDS
    )
    if unknown:
        raise ValueError(
            f"Moira: unknown environment variable(s) {unknown}; "
            f"supported: {sorted(_MOIRA_ENV_FIELDS)}"
        )
    kwargs: dict[str, Any] = {}
    for env_name, (field_name, kind) in _MOIRA_ENV_FIELDS.items():
        raw = environ.get(env_name)
        if raw is None or raw.strip() == "":
            continue
        raw = raw.strip()
        try:
            kwargs[field_name] = kind(raw.lower() if kind is str else raw)
        except ValueError:
            raise ValueError(
                f"Moira: {env_name}={raw!r} is not a valid {kind.__name__}"
            ) from None
    config = MoiraConfig(**kwargs)
    config.validate()
    return config


def _unsupported_vllm_config_reasons(vllm_config: VllmConfig) -> list[str]:
    """Engine features Moira cannot serve correctly, as refusal messages.

    These are properties of the whole engine rather than of one layer, so
    the per-layer selector hooks cannot see all of them. Each one would
    otherwise make Moira silently idle (spec-decode verify rows go to FA3)
    or read pages without summaries (KV loaded by a connector/offloader).
    """
    reasons: list[str] = []
    if vllm_config.speculative_config is not None:
        reasons.append(
            "speculative decoding (speculative_config) is not supported by "
            "MOIRA: verification rows have several query tokens and would "
            "bypass the sparse decode; disable speculative decoding"
        )
    if vllm_config.kv_transfer_config is not None:
        reasons.append(
            "KV connectors (kv_transfer_config) are not supported by MOIRA: "
            "externally loaded KV blocks carry no page summaries"
        )
    cache_config = vllm_config.cache_config
    if getattr(cache_config, "kv_offloading_size", None):
        reasons.append(
            "KV cache offloading (kv_offloading_size) is not supported by "
            "MOIRA: reloaded KV blocks carry no page summaries"
        )
    if getattr(cache_config, "kv_sharing_fast_prefill", False):
        reasons.append(
            "kv_sharing_fast_prefill is not supported by MOIRA; leave it off"
        )
    parallel_config = vllm_config.parallel_config
    if parallel_config.decode_context_parallel_size > 1:
        reasons.append(
            "decode context parallelism (decode_context_parallel_size="
            f"{parallel_config.decode_context_parallel_size}) is not supported "
            "by MOIRA; only 1 is supported"
        )
    if parallel_config.prefill_context_parallel_size > 1:
        reasons.append(
            "prefill context parallelism (prefill_context_parallel_size="
            f"{parallel_config.prefill_context_parallel_size}) is not supported "
            "by MOIRA; only 1 is supported"
        )
    if parallel_config.use_ubatching:
        reasons.append(
            "micro-batching (enable_dbo / ubatch_size > 1) is not supported by "
            "MOIRA; disable DBO"
        )
    model_config = vllm_config.model_config
    if model_config is not None:
        if model_config.dtype != torch.bfloat16:
            reasons.append(
                f"model dtype {model_config.dtype} is not supported by MOIRA; "
                "only bfloat16 is supported (--dtype bfloat16)"
            )
        try:
            is_hybrid = bool(model_config.is_hybrid)
        except Exception:  # config-only test models may lack registry info
            is_hybrid = False
        if is_hybrid:
            reasons.append(
                "hybrid (Mamba/linear-attention) models are not supported by "
                "MOIRA; only full-attention decoder models are supported"
            )
    return reasons


def check_vllm_config_for_moira(vllm_config: VllmConfig | None) -> None:
    """Raise a ValueError listing every unsupported engine feature."""
    if vllm_config is None:
        return
    reasons = _unsupported_vllm_config_reasons(vllm_config)
    if reasons:
        raise ValueError(
            "MOIRA attention backend cannot run this configuration: "
            + "; ".join(reasons)
        )


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------
class MoiraBackend(FlashAttentionBackend):
    """Sparse decode (Moira kernels) + FA3 prefill, for SM90 and bf16 KV.

    Subclasses FlashAttentionBackend to inherit the KV cache spec/layout and
    the FA3 prefill path; every capability FA advertises beyond Moira's is
    switched off here so the selector refuses it instead of falling back.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16"]
    # The layer scatters K/V through do_kv_cache_update before forward();
    # Moira hooks the summary write there.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "MOIRA"

    @staticmethod
    def get_impl_cls() -> type["MoiraImpl"]:
        return MoiraImpl

    @staticmethod
    def get_builder_cls() -> type["MoiraMetadataBuilder"]:
        return MoiraMetadataBuilder

    # Kernel pages are exactly 64 tokens (one summary per page). A manager
    # block that is a multiple of 64 is split into 64-token kernel blocks.
    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [MOIRA_PAGE_SIZE]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # Used when the user did not pass --block-size (default 16).
        return MOIRA_PAGE_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(MOIRA_BACKEND_HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in MOIRA_BACKEND_HEAD_SIZES

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # Prefill rows run on FA3, which vLLM only picks on SM90.
        return capability.major == 9

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_combination(cls, *args: Any, **kwargs: Any) -> str | None:
        return None

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: DeviceCapability,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
        **unknown_flags: Any,
    ) -> list[str]:
        """Same contract as AttentionBackend.validate_configuration, but every
        reason names the offending option and what MOIRA supports (the base
        class only says e.g. "head_size not supported")."""
        r: list[str] = []
        if not cls.supports_head_size(head_size):
            r.append(
                f"head_size={head_size} is not supported by MOIRA; supported "
                f"head sizes: {list(MOIRA_BACKEND_HEAD_SIZES)}"
            )
        if not cls.supports_dtype(dtype):
            r.append(
                f"dtype={dtype} is not supported by MOIRA; only torch.bfloat16 "
                "is supported (--dtype bfloat16)"
            )
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            r.append(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by MOIRA; "
                "supported: 'auto' or 'bfloat16' (no fp8/quantized KV cache)"
            )
        if block_size is not None and block_size % MOIRA_PAGE_SIZE != 0:
            r.append(
                f"block_size={block_size} is not supported by MOIRA; the kernel "
                f"block size is exactly {MOIRA_PAGE_SIZE} (use --block-size "
                f"{MOIRA_PAGE_SIZE}, or a multiple of it, or leave it unset)"
            )
        if use_mla:
            r.append("MLA models are not supported by MOIRA; only MHA/GQA/MQA")
        if use_sparse:
            r.append("sparse (indexer) attention is not supported by MOIRA")
        if has_sink:
            r.append("attention sinks (learned sinks) are not supported by MOIRA")
        if use_mm_prefix:
            r.append(
                "multimodal prefix (mm_prefix) bidirectional attention is not "
                "supported by MOIRA"
            )
        if use_per_head_quant_scales:
            r.append("per-head KV quantization scales are not supported by MOIRA")
        if not cls.supports_compute_capability(device_capability):
            r.append(
                f"compute capability {device_capability.major}."
                f"{device_capability.minor} is not supported by MOIRA; only "
                "SM90 (9.x, Hopper) is supported (FA3 prefill)"
            )
        if not cls.supports_attn_type(attn_type):
            r.append(
                f"attention type {attn_type!r} is not supported by MOIRA; only "
                f"{AttentionType.DECODER.value!r} is supported"
            )
        if has_sliding_window:
            r.append(
                "sliding-window attention is not supported by MOIRA; only full "
                "attention (for mixed models use attention_config."
                'backend_per_kind={"sliding_window": "FLASH_ATTN"})'
            )
        if use_rswa:
            r.append("R-SWA attention is not supported by MOIRA")
        if use_non_causal:
            r.append("non-causal attention is not supported by MOIRA; causal only")
        if use_batch_invariant:
            r.append(
                "batch invariance (VLLM_BATCH_INVARIANT=1) is not supported by "
                "MOIRA: its split-K decode is not batch invariant"
            )
        if use_kv_connector:
            r.append(
                "KV connectors / KV offloading are not supported by MOIRA: "
                "externally loaded KV blocks carry no page summaries"
            )
        if use_dcp:
            r.append(
                "decode context parallelism (DCP) is not supported by MOIRA; "
                "use decode_context_parallel_size=1"
            )
        if use_pcp:
            r.append(
                "prefill context parallelism (PCP) is not supported by MOIRA; "
                "use prefill_context_parallel_size=1"
            )
        if use_adaptive_verification:
            r.append(
                "adaptive verification (speculative decoding) is not supported "
                "by MOIRA"
            )
        for flag, value in unknown_flags.items():
            # A newer vLLM passed a feature flag this backend does not know:
            # refuse it if set rather than ignore it.
            if value:
                r.append(f"{flag}={value!r} is not supported by MOIRA")
        try:
            moira_config_from_env()
        except ValueError as e:
            r.append(str(e))
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            r.extend(_unsupported_vllm_config_reasons(vllm_config))
        return r


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------
@dataclass
class MoiraMetadata:
    """Per-step metadata: decode rows for Moira, prefill rows for FA3.

    Rows are ordered decode-first; rows [0, num_decodes) hold one query token
    each (tokens [0, num_decode_tokens)). The tensors below are views of
    runner-persistent buffers (CUDA-graph safe): FULL decode graphs replay
    with the same addresses and read the lengths the runner wrote on device.
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    # [num_decodes] int32 context lengths incl. the new token (0 = padding).
    decode_seq_lens: torch.Tensor
    # [num_decodes, max_blocks] int32 kernel block ids.
    decode_block_table: torch.Tensor
    # Slot mapping of all tokens (the summary write covers prefill pages too).
    slot_mapping: torch.Tensor
    # FA metadata for the prefill rows only (sliced batch), None if none.
    prefill: FlashAttentionMetadata | None
    workspace: MoiraWorkspace
    config: MoiraConfig


def slice_prefill_common_metadata(
    cam: CommonAttentionMetadata,
    num_decodes: int,
    num_decode_tokens: int,
) -> CommonAttentionMetadata:
    """The CommonAttentionMetadata of the rows after the decode rows.

    Runs in eager (mixed) steps only, so the small new tensors it creates
    (query_start_loc rebased to 0) are fine. Uses CPU copies for every
    Python-side value: no device sync.
    """
    nd, ndt = num_decodes, num_decode_tokens
    num_reqs = cam.num_reqs - nd
    num_tokens = cam.num_actual_tokens - ndt
    qsl_cpu = cam.query_start_loc_cpu[nd : cam.num_reqs + 1] - ndt
    seq_ub = cam.seq_lens_cpu_upper_bound
    if seq_ub is not None:
        seq_ub = seq_ub[nd : cam.num_reqs]
        max_seq_len = int(seq_ub.max()) if num_reqs > 0 else 0
    else:
        # No CPU upper bound: the whole-batch maximum is a safe bound for FA.
        max_seq_len = cam.max_seq_len
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    max_query_len = int(query_lens.max()) if num_reqs > 0 else 0

    def rows(t: Any) -> Any:
        return None if t is None else t[nd : cam.num_reqs]

    causal = cam.causal
    if isinstance(causal, torch.Tensor) and causal.dim() > 0:
        causal = causal[nd : cam.num_reqs]
    return cam.replace(
        query_start_loc=cam.query_start_loc[nd : cam.num_reqs + 1] - ndt,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=cam.seq_lens[nd : cam.num_reqs],
        seq_lens_cpu_upper_bound=seq_ub,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_table_tensor=cam.block_table_tensor[nd : cam.num_reqs],
        slot_mapping=cam.slot_mapping[ndt : ndt + num_tokens],
        causal=causal,
        is_prefilling=rows(cam.is_prefilling),
        positions=None if cam.positions is None else cam.positions[ndt:],
        req_idx=None if cam.req_idx is None else cam.req_idx[nd : cam.num_reqs],
        logits_indices_padded=None,
        num_logits_indices=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


class MoiraMetadataBuilder(FlashAttentionMetadataBuilder):
    """Splits each batch into Moira decode rows and FA3 prefill rows.

    UNIFORM_SINGLE_TOKEN_DECODE: pure one-token decode batches are captured
    in FULL CUDA graphs (the whole Moira step), mixed batches run eagerly
    (FULL_AND_PIECEWISE keeps attention outside the piecewise graphs).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    # build() returns a new metadata object; the in-place block-table update
    # path of FA (spec-decode drafting) does not apply.
    supports_update_block_table: bool = False

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: Any
    ) -> AttentionCGSupport:
        return cls._cudagraph_support

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        # Refuse before allocating anything (spec decode is only visible in
        # the full config, not in the per-layer selector flags).
        check_vllm_config_for_moira(vllm_config)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decode rows first (V1 reorders only if a builder asks; V2 always
        # does). Short extends (query_len 1 while prefilling) count as
        # decodes: a one-token query over a cached context is a decode step.
        self._init_reorder_batch_threshold(1)
        self.supports_draft_decode_metadata_update = False
        self.moira_config = moira_config_from_env()
        if kv_cache_spec.block_size % MOIRA_PAGE_SIZE != 0:
            raise ValueError(
                f"MOIRA needs a KV cache block size that is a multiple of "
                f"{MOIRA_PAGE_SIZE}, got {kv_cache_spec.block_size}"
            )
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_pages = cdiv(vllm_config.model_config.max_model_len, MOIRA_PAGE_SIZE)
        # Persistent buffers, allocated once here: builders are created in
        # initialize_kv_cache, before warmup and CUDA-graph capture, so
        # captured graphs see these addresses for the life of the engine.
        self.workspace = MoiraWorkspace(
            self.max_num_seqs,
            self.num_heads_q,
            self.num_heads_kv,
            self.headdim,
            self.max_pages,
            self.moira_config,
            device,
        )

    def use_cascade_attention(self, *args: Any, **kwargs: Any) -> bool:
        # FA's cascade path would process every row, decode rows included.
        return False

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MoiraMetadata:
        cam = common_attn_metadata
        nd, npf, ndt, npt = split_decodes_and_prefills(cam, decode_threshold=1)
        if nd > self.max_num_seqs:
            raise ValueError(
                f"MOIRA: {nd} decode rows exceed max_num_seqs={self.max_num_seqs}"
            )
        prefill = None
        if npf > 0:
            prefill = super().build(
                0, slice_prefill_common_metadata(cam, nd, ndt), fast_build
            )
        return MoiraMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=npf,
            num_prefill_tokens=npt,
            decode_seq_lens=cam.seq_lens[:nd],
            decode_block_table=cam.block_table_tensor[:nd],
            slot_mapping=cam.slot_mapping,
            prefill=prefill,
            workspace=self.workspace,
            config=self.moira_config,
        )


# --------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------
class MoiraImpl(FlashAttentionImpl):
    """FA impl whose decode rows go to moira_decode and whose cache update
    also writes page summaries."""

    # Moira produces no LSE for DCP and has no context-parallel path; these
    # class flags feed the selector's supports_dcp()/supports_pcp().
    supports_dcp: bool = False
    supports_pcp: bool = False
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        # Refuse what the kernels do not implement before FA sets anything up.
        if alibi_slopes is not None:
            raise ValueError("MOIRA does not support ALiBi; use FLASH_ATTN")
        if logits_soft_cap:
            raise ValueError(
                f"MOIRA does not support logits soft-capping "
                f"(logits_soft_cap={logits_soft_cap}); use FLASH_ATTN"
            )
        if sinks is not None:
            raise ValueError("MOIRA does not support attention sinks; use FLASH_ATTN")
        if sliding_window is not None:
            raise ValueError(
                f"MOIRA does not support sliding-window attention "
                f"(sliding_window={sliding_window}); only full attention"
            )
        if attn_type != AttentionType.DECODER:
            raise ValueError(
                f"MOIRA supports decoder self-attention only, got attn_type="
                f"{attn_type!r}"
            )
        if kv_cache_dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"MOIRA needs a bfloat16 KV cache, got kv_cache_dtype="
                f"{kv_cache_dtype!r}; use 'auto' or 'bfloat16'"
            )
        if head_size not in MOIRA_BACKEND_HEAD_SIZES:
            raise ValueError(
                f"MOIRA supports head sizes {list(MOIRA_BACKEND_HEAD_SIZES)}, "
                f"got {head_size}"
            )
        check_vllm_config_for_moira(get_current_vllm_config_or_none())
        self.moira_config = moira_config_from_env()
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        self._summaries: torch.Tensor | None = None
        self._summaries_key: tuple | None = None

    # ---- KV-cache extras hook (patch 0003) --------------------------------
    def bind_kv_cache_extras(
        self, layer: torch.nn.Module, kv_cache: torch.Tensor
    ) -> None:
        from vllm.v1.worker.moira_summaries import (
            acquire_summaries,
            release_summaries,
            summary_key,
        )

        if self._summaries_key is not None:
            release_summaries(self._summaries_key)
        self._summaries = acquire_summaries(kv_cache)
        self._summaries_key = summary_key(kv_cache)

    def release_kv_cache_extras(self, layer: torch.nn.Module) -> None:
        from vllm.v1.worker.moira_summaries import release_summaries

        if self._summaries_key is not None:
            release_summaries(self._summaries_key)
        self._summaries = None
        self._summaries_key = None

    def get_kv_cache_extras_bytes(self, kv_cache_bytes: int) -> int:
        from vllm.v1.worker.moira_summaries import summary_bytes_for_kv_bytes

        if self.kv_sharing_target_layer_name is not None:
            return 0  # shares the target layer's KV view and summaries
        return summary_bytes_for_kv_bytes(kv_cache_bytes)

    def get_shared_kv_cache_extras_bytes(self) -> dict[str, int]:
        from vllm.v1.worker.moira_summaries import workspace_bytes

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return {}
        return {
            "moira_workspace": workspace_bytes(
                vllm_config, self.num_heads, self.num_kv_heads, self.head_size
            )
        }

    def _get_summaries(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Summaries for this KV view. Normally bound by the worker hook; the
        lazy path covers a vLLM without patch 0003 (plugin mode)."""
        from vllm.v1.worker.moira_summaries import (
            acquire_summaries,
            release_summaries,
            summary_key,
        )

        key = summary_key(kv_cache)
        if self._summaries is not None and self._summaries_key == key:
            return self._summaries
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "MOIRA: page summaries were not allocated before CUDA-graph "
                "capture (the KV-cache extras hook did not run for this layer); "
                "apply the Moira patch series or run with enforce_eager=True"
            )
        if self._summaries_key is not None:
            release_summaries(self._summaries_key)  # KV view was replaced
        self._summaries = acquire_summaries(kv_cache)
        self._summaries_key = key
        return self._summaries

    # ---- cache update and forward -----------------------------------------
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if kv_cache.numel() == 0:
            return
        # After the scatter, so the summary kernel reads all 64 keys of each
        # page that this step filled (slot % 64 == 63), prefill and decode.
        write_page_summaries(kv_cache, self._get_summaries(kv_cache), slot_mapping)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MoiraMetadata,  # type: ignore[override]
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by MOIRA"
            )
        if attn_metadata is None:
            # Profiling run.
            return output.fill_(0)

        # Padded FULL-graph batches may have more (padded) rows than real
        # tokens; the runner's buffers are padded to the graph size.
        nd = min(attn_metadata.num_decodes, query.shape[0])
        if nd > 0:
            # One token per decode row: rows [0, nd) are tokens [0, nd).
            # No host sync: lengths and tables are read on device.
            moira_decode(
                query[:nd].view(nd, self.num_heads, self.head_size),
                kv_cache,
                self._get_summaries(kv_cache),
                attn_metadata.decode_block_table,
                attn_metadata.decode_seq_lens,
                output[:nd].view(nd, self.num_heads, self.head_size),
                attn_metadata.workspace,
                self.scale,
                attn_metadata.config,
            )
        prefill = attn_metadata.prefill
        if prefill is not None:
            ndt = attn_metadata.num_decode_tokens
            # FA3 on the prefill slice only (its metadata was built for the
            # sliced batch); the decode rows' output is left as Moira wrote it.
            super().forward(
                layer,
                query[ndt:],
                key[ndt:],
                value[ndt:],
                kv_cache,
                prefill,
                output[ndt:],
            )
        return output
