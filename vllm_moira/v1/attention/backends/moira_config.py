# SPDX-License-Identifier: Apache-2.0
"""Moira's configuration: the user's options, the kernels' launch parameters,
and what the engine must not be configured with.

Nothing here launches a kernel. ``moira.py`` (the backend: the Triton kernels,
their launchers and the vLLM classes) imports these names and re-exports the
public ones, so ``moira.MoiraConfig`` and the rest stay where callers find them.

- Options: ``MoiraConfig`` (the decode step's settings) and its validation,
  ``moira_config_from_env`` (the MOIRA_* variables a user sets), the allowed
  values and defaults (``MOIRA_*``), and the summary layout an estimator fixes
  (``estimator_num_top``, ``summary_slots``).
- Launch parameters: each kernel's launch as a function of the shapes and
  dtypes it runs on, with explicit overrides; N_F on a device.
- The engine's configuration: the vLLM features and settings Moira refuses,
  as messages that name the option and what Moira supports.

Installed as ``vllm.v1.attention.backends.moira_config`` on the patched build;
imported as ``vllm_moira.v1.attention.backends.moira_config`` in plugin mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from vllm.config import VllmConfig

from ...worker.moira_summaries import MOIRA_PAGE_SIZE, MOIRA_SUMMARY_DTYPES
from .moira_mode import plugin_mode_reasons

# ==========================================================================
# Options, their allowed values and defaults
# ==========================================================================

#: Head sizes the kernels are built and tested for.
MOIRA_SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 128)
#: Largest GQA group (query heads per KV head) the kernels support.
MOIRA_MAX_GROUP_SIZE = 16
#: vLLM's --kv-cache-dtype values Moira serves: the model's bf16, or fp8
#: e4m3 ("fp8" is e4m3 on CUDA) with vLLM's per-layer K and V scales, the
#: fp8 format FA3 serves for the prefill rows. The kernels dequantize (the
#: stored value times the layer's scale) wherever they read K or V.
MOIRA_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
MOIRA_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
MOIRA_SELECTORS = ("coverage", "fixed")
#: What a decode step whose rows are all dense runs. "moira": Moira's kernels,
#: Estimate and Select skipping the rows. "fa3": vLLM's FA3 decode in FULL
#: CUDA graphs of its own (vLLM patch 0006), plus the summary writer.
MOIRA_DENSE_STEPS = ("moira", "fa3")
#: Page-mass estimator -> r, the keys stored exactly per page and KV head.
#: "mvar": the paper's Eq. 2; "mvar_top8": the 8 keys farthest from the page
#: mean stored exactly, the other 56 summarized by their mean and variance with
#: the random-energy-model spread term. The research estimators live in the
#: float32 reference (ops/moira_reference.py) and benchmarks/probes/.
MOIRA_ESTIMATOR_NUM_TOP = {"mvar": 0, "mvar_top8": 8}
MOIRA_ESTIMATORS = tuple(MOIRA_ESTIMATOR_NUM_TOP)
MOIRA_DEFAULT_ESTIMATOR = "mvar_top8"
#: int8 summaries: half the memory of bf16 at the same accuracy.
MOIRA_DEFAULT_SUMMARY_DTYPE = "int8"
#: The captured-mass audit (moira_audit.py): every this many decode steps, a
#: few lists per layer get their exact captured mass (0 = off). Off by default:
#: on, it adds a launch per layer to every decode step, and the default decode
#: step changes only with its cost measured end to end. 64 keeps its key reads
#: near 0.1% of a step's KV reads at 32k x 16 (docs/observability.md).
MOIRA_DEFAULT_AUDIT_EVERY = 0

#: The paper's decode step (§3.3) less its Attend schedule: no dense rows,
#: Moira's kernels on every step, the estimate alone. ``MoiraConfig.paper()``;
#: the kernel tests and benchmarks/moira_correctness.py use it.
MOIRA_PAPER_SETTINGS: dict[str, Any] = {
    "dense_batch_tokens": 0,
    "dense_steps": "moira",
    "audit_every": 0,
}


@dataclass(frozen=True)
class MoiraConfig:
    """Settings of the Moira decode step. The defaults are what the backend
    serves; ``MoiraConfig.paper()`` is the paper's decode step (§3.3). The
    first seven are the user's options (the MOIRA_* variables,
    ``moira_config_from_env``); the rest are the backend's settings, which
    benchmarks and tests change in process."""

    #: Coverage: keep the fewest pages whose estimated share reaches gamma.
    gamma: float = 0.98
    #: "coverage" (Eq. 3) or "fixed" (the K largest pages).
    selector: str = "coverage"
    #: K for ``selector="fixed"``: pages per (row, KV head), sink and current
    #: page included.
    fixed_pages: int | None = None
    #: Or, for ``selector="fixed"``, K = ceil(fixed_fraction * pages of the row).
    fixed_fraction: float | None = None
    #: Page-mass estimator (one of MOIRA_ESTIMATORS); fixes the summary
    #: layout (``summary_slots``) when the KV cache is allocated.
    estimator: str = MOIRA_DEFAULT_ESTIMATOR
    #: Storage of the summaries (one of MOIRA_SUMMARY_DTYPES); fixed when the
    #: KV cache is allocated, like the estimator.
    summary_dtype: str = MOIRA_DEFAULT_SUMMARY_DTYPE
    #: Captured-mass audit period in decode steps (0 = off: no audit launches).
    audit_every: int = MOIRA_DEFAULT_AUDIT_EVERY
    #: N_F: Attend blocks of a step, which share its pages evenly. 0 = the
    #: blocks the device holds at once (resolve_attend_fill_blocks).
    attend_fill_blocks: int = 0
    #: Rows with (context tokens) x (decode rows in the batch) at or below
    #: this read every page, skipping Estimate and Select, whose fixed latency
    #: a small batch's few pages do not repay. Decided per row on the GPU;
    #: 0 = off.
    dense_batch_tokens: int = 36864
    #: One of MOIRA_DENSE_STEPS: what a step whose rows are all dense runs.
    #: Either way those rows read every page; "fa3" drops the fixed cost of
    #: Moira's launches. Decided per step on the host (V2 runner).
    dense_steps: str = "fa3"

    @classmethod
    def paper(cls, **changes: Any) -> MoiraConfig:
        """The paper's algorithm (MOIRA_PAPER_SETTINGS), with ``changes``."""
        return cls(**{**MOIRA_PAPER_SETTINGS, **changes})

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """Raise ``ValueError`` naming the option and its allowed values.
        ``names`` maps fields to the names the user gave them (the MOIRA_*
        variables, for moira_config_from_env); other fields are named as is."""
        names = names or {}

        def n(field: str) -> str:
            return names.get(field, field)

        if not isinstance(self.gamma, (int, float)) or not 0.0 < self.gamma <= 1.0:
            raise ValueError(
                f"Moira: {n('gamma')} must be in (0, 1] (default 0.98), got {self.gamma!r}"
            )
        if self.selector not in MOIRA_SELECTORS:
            raise ValueError(
                f"Moira: {n('selector')} must be one of {MOIRA_SELECTORS}, got {self.selector!r}"
            )
        if self.selector == "fixed":
            if (self.fixed_pages is None) == (self.fixed_fraction is None):
                raise ValueError(
                    f"Moira: {n('selector')}='fixed' needs exactly one of {n('fixed_pages')} "
                    f"(an integer >= 1, pages kept per row and KV head) or "
                    f"{n('fixed_fraction')} (in (0, 1]), got {n('fixed_pages')}="
                    f"{self.fixed_pages!r}, {n('fixed_fraction')}={self.fixed_fraction!r}"
                )
            if self.fixed_pages is not None and (
                not isinstance(self.fixed_pages, int) or self.fixed_pages < 1
            ):
                raise ValueError(
                    f"Moira: {n('selector')}='fixed' needs {n('fixed_pages')}, an integer >= 1 "
                    f"(pages kept per row and KV head), got {self.fixed_pages!r}"
                )
            if self.fixed_fraction is not None and not 0.0 < self.fixed_fraction <= 1.0:
                raise ValueError(
                    f"Moira: {n('fixed_fraction')} must be in (0, 1], got {self.fixed_fraction!r}"
                )
        elif self.fixed_pages is not None or self.fixed_fraction is not None:
            raise ValueError(
                f"Moira: {n('fixed_pages')} / {n('fixed_fraction')} are only used with "
                f"{n('selector')}='fixed', got {n('fixed_pages')}={self.fixed_pages!r}, "
                f"{n('fixed_fraction')}={self.fixed_fraction!r} with "
                f"{n('selector')}={self.selector!r}"
            )
        if not isinstance(self.attend_fill_blocks, int) or self.attend_fill_blocks < 0:
            raise ValueError(
                f"Moira: {n('attend_fill_blocks')} must be an integer >= 0 (0 = the blocks "
                f"the GPU holds at once), got {self.attend_fill_blocks!r}"
            )
        if not isinstance(self.dense_batch_tokens, int) or self.dense_batch_tokens < 0:
            raise ValueError(
                f"Moira: {n('dense_batch_tokens')} must be an integer >= 0 (0 = off), "
                f"got {self.dense_batch_tokens!r}"
            )
        if self.dense_steps not in MOIRA_DENSE_STEPS:
            raise ValueError(
                f"Moira: {n('dense_steps')} must be one of {MOIRA_DENSE_STEPS}, "
                f"got {self.dense_steps!r}"
            )
        if self.estimator not in MOIRA_ESTIMATORS:
            raise ValueError(
                f"Moira: {n('estimator')} must be one of {MOIRA_ESTIMATORS} "
                f"(default {MOIRA_DEFAULT_ESTIMATOR!r}), got {self.estimator!r}"
            )
        if self.summary_dtype not in MOIRA_SUMMARY_DTYPES:
            raise ValueError(
                f"Moira: {n('summary_dtype')} must be one of {MOIRA_SUMMARY_DTYPES} "
                f"(default {MOIRA_DEFAULT_SUMMARY_DTYPE!r}), got {self.summary_dtype!r}"
            )
        if self.summary_dtype == "int4" and estimator_num_top(self.estimator) == 0:
            with_keys = tuple(e for e in MOIRA_ESTIMATORS if MOIRA_ESTIMATOR_NUM_TOP[e])
            raise ValueError(
                f"Moira: {n('summary_dtype')} 'int4' stores the keys of {with_keys} in 4 "
                f"bits; {n('estimator')} {self.estimator!r} stores none (use 'int8')"
            )
        if (
            not isinstance(self.audit_every, int)
            or isinstance(self.audit_every, bool)
            or self.audit_every < 0
        ):
            raise ValueError(
                f"Moira: {n('audit_every')} must be an integer >= 0 (decode steps between "
                f"captured-mass audits; 0 = off, default {MOIRA_DEFAULT_AUDIT_EVERY}), "
                f"got {self.audit_every!r}"
            )

    @property
    def summary_slots(self) -> int:
        """Slots of the page summary this config's estimator reads."""
        return summary_slots(self.estimator)

    def selector_values(self) -> tuple[float, float, float, float]:
        """(gamma, K, fraction, dense batch pages) as Estimate and Select read
        them; 0 turns a field off."""
        fixed = self.selector == "fixed"
        fixed_pages = float(self.fixed_pages or 0) if fixed else 0.0
        fixed_fraction = float(self.fixed_fraction or 0.0) if fixed else 0.0
        dense_pages = float(self.dense_batch_tokens // MOIRA_PAGE_SIZE)
        return (self.gamma, fixed_pages, fixed_fraction, dense_pages)


def estimator_num_top(estimator: str) -> int:
    """r: keys per page and KV head that ``estimator`` stores exactly."""
    if estimator not in MOIRA_ESTIMATOR_NUM_TOP:
        raise ValueError(f"Moira: estimator must be one of {MOIRA_ESTIMATORS}, got {estimator!r}")
    return MOIRA_ESTIMATOR_NUM_TOP[estimator]


def summary_slots(estimator: str) -> int:
    """Slots of the page summary ``[num_blocks, H_kv, slots, D]``: 2 + r
    (slot 0 mean, slot 1 variance of the summarized keys, then r keys)."""
    return 2 + estimator_num_top(estimator)


# MOIRA_* environment variable -> (MoiraConfig field, type): the options a user
# sets. Environment variables reach every process vLLM starts
# (API server, engine core, workers) without changes to vLLM's config classes,
# and vLLM's check of VLLM_* names leaves them alone.
_MOIRA_ENV_FIELDS: dict[str, tuple[str, type]] = {
    "MOIRA_GAMMA": ("gamma", float),
    "MOIRA_SELECTOR": ("selector", str),
    "MOIRA_FIXED_PAGES": ("fixed_pages", int),
    "MOIRA_FIXED_FRACTION": ("fixed_fraction", float),
    "MOIRA_ESTIMATOR": ("estimator", str),
    "MOIRA_SUMMARY_DTYPE": ("summary_dtype", str),
    "MOIRA_AUDIT_EVERY": ("audit_every", int),
}
# Benchmark-only: the accuracy runs read every row through the selector (0),
# where serving reads short rows whole.
_MOIRA_BENCHMARK_ENV_FIELDS: dict[str, tuple[str, type]] = {
    "MOIRA_DENSE_BATCH_TOKENS": ("dense_batch_tokens", int),
}
# MOIRA_* names of the project's tooling (build, tests, scripts), not options.
_MOIRA_TOOLING_ENV = frozenset({
    "MOIRA_BUILD_ARGS", "MOIRA_CACHE_DIR", "MOIRA_NO_PIP", "MOIRA_PATCHES_DIR",
    "MOIRA_PATCH_TOOL", "MOIRA_SKIP_GPU_CHECK", "MOIRA_SKIP_LINT", "MOIRA_SKIP_REAL_MODEL",
    "MOIRA_TEST_ATTEND_LAUNCH", "MOIRA_TEST_ESTIMATE_LAUNCH", "MOIRA_TEST_GPU",
    "MOIRA_USE_ACTIVE_ENV", "MOIRA_VENV", "MOIRA_VLLM_SDIST", "MOIRA_VLLM_TESTS_REPORT",
})  # fmt: skip


def moira_config_from_env(environ: Mapping[str, str] | None = None) -> MoiraConfig:
    """Build and validate the MoiraConfig from MOIRA_* environment variables.

    Unset variables keep MoiraConfig's defaults. Errors name the variable and
    its allowed values. Any other MOIRA_* name that is not the project's
    tooling (a typo, or an option that no longer exists) is refused with the
    supported ones, so it cannot silently run with the defaults.
    """
    environ = os.environ if environ is None else environ
    fields = {**_MOIRA_ENV_FIELDS, **_MOIRA_BENCHMARK_ENV_FIELDS}
    unknown = sorted(
        k for k in environ
        if k.startswith("MOIRA_") and k not in fields and k not in _MOIRA_TOOLING_ENV
    )  # fmt: skip
    if unknown:
        raise ValueError(
            f"Moira: unknown environment variable(s) {unknown}; supported: "
            f"{sorted(_MOIRA_ENV_FIELDS)} (benchmarks: {sorted(_MOIRA_BENCHMARK_ENV_FIELDS)})"
        )
    kwargs: dict[str, Any] = {}
    for env_name, (field_name, kind) in fields.items():
        raw = environ.get(env_name)
        if raw is None or raw.strip() == "":
            continue
        raw = raw.strip()
        try:
            kwargs[field_name] = kind(raw.lower() if kind is str else raw)
        except ValueError:
            raise ValueError(
                f"Moira: {env_name}={raw!r} is not a valid {kind.__name__}"
                + (" (an integer >= 0; 0 = off)" if env_name == "MOIRA_AUDIT_EVERY" else "")
            ) from None
    config = MoiraConfig(**kwargs)
    config.validate({field: env for env, (field, _) in fields.items()})
    return config


# ==========================================================================
# Launch parameters
# ==========================================================================
# Each kernel's launch comes from a function of the shapes and dtypes it runs
# on. Benchmarks and probes pass overrides, by kernel (``LAUNCH_KERNELS``), to
# MoiraWorkspace(launch=...) or to a launcher's ``launch`` argument; a
# workspace keeps its overrides, so a graph captured on it replays them.

#: Kernels whose launch a ``launch`` mapping overrides ("step": the whole
#: decode step's dependent launches).
LAUNCH_KERNELS = ("writer", "estimate", "select", "attend", "audit", "step")
#: Attend blocks resident per SM at Attend's register cap; N_F = 0 aims a step
#: at this many blocks per SM, one full wave.
ATTEND_BLOCKS_PER_SM = 3
# Estimate's warps. The summary writer runs on them too: the per-channel sums
# of a page summary are reduced in the order of the warps' layout, and the
# writer and Estimate must store the same bits for the same page.
_ESTIMATE_NUM_WARPS = 4
# Largest page tile Select keeps in registers; longer rows loop over tiles.
_SELECT_MAX_TILE_PAGES = 4096


# The launches, as the functions below resolve them.
class WriterLaunch(NamedTuple):
    window_tokens: int  # slot-mapping tokens per program (about one page end each)
    num_warps: int  # Estimate's


class EstimateLaunch(NamedTuple):
    tile_pages: int  # pages per summary program
    num_warps: int  # per program
    key_stages: int  # software-pipeline depth of the stored-key loop
    maxnreg: int | None  # register cap per thread (None: ptxas's choice)


class SelectLaunch(NamedTuple):
    lanes: int  # K_B: thresholds per bisection pass in one 2D reduction (1: one each)
    num_warps: int  # per (row, KV head) program


class AuditLaunch(NamedTuple):
    samples: int  # lists audited per layer of an audited step
    list_programs: int  # programs that share one audited list's pages


class AttendLaunch(NamedTuple):
    num_warps: int  # per block
    num_stages: int  # software-pipeline depth of the K/V page loop
    maxnreg: int | None  # register cap per thread (None: ptxas's choice)


def _overridden(kernel: str, defaults: dict[str, Any], overrides: Mapping[str, Any] | None):
    """``defaults`` with ``overrides``; a key that ``kernel``'s launch does not have is
    refused, naming the ones it has."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(
            f"Moira: {kernel} launch overrides {unknown} are not among {sorted(defaults)}"
        )
    return {**defaults, **overrides}


def _power_of_two(kernel: str, name: str, value: Any, allowed: range) -> None:
    if not isinstance(value, int) or value & (value - 1) or value not in allowed:
        raise ValueError(
            f"Moira: {kernel} launch {name} must be a power of two in "
            f"[{allowed.start}, {allowed.stop - 1}], got {value!r}"
        )


def writer_launch(overrides: Mapping[str, Any] | None = None) -> WriterLaunch:
    """The summary writer's launch: 64-token windows on Estimate's warps."""
    values = _overridden(
        "writer", {"window_tokens": 64, "num_warps": _ESTIMATE_NUM_WARPS}, overrides
    )
    _power_of_two("writer", "window_tokens", values["window_tokens"], range(1, 1025))
    return WriterLaunch(**values)


def estimate_launch(
    num_top: int, int8: bool, overrides: Mapping[str, Any] | None = None
) -> EstimateLaunch:
    """Estimate's launch for an estimator with ``num_top`` stored keys on int8 (or bf16)
    summaries. int8 summaries take 64-page programs of 4 warps: each warp's share of
    the tile's int8 products is the same as with 32 pages on 2 warps, and half as many
    programs repeat the fixed work (the query's digits, the block-table reads); 128
    registers per thread keep several programs per SM."""
    defaults = {
        "tile_pages": 64 if int8 else 32,
        "num_warps": _ESTIMATE_NUM_WARPS,
        "key_stages": 3,
        "maxnreg": 128,
    }
    values = _overridden("estimate", defaults, overrides)
    _power_of_two("estimate", "tile_pages", values["tile_pages"], range(16, 1025))
    return EstimateLaunch(**values)


def select_launch(
    tile_pages: int, num_tiles: int, overrides: Mapping[str, Any] | None = None
) -> SelectLaunch:
    """Select's launch for rows of ``num_tiles`` register tiles of ``tile_pages`` pages.
    Rows of one tile test ``long_lanes`` thresholds per pass in one 2D reduction, which
    needs the whole row in registers; tiles of 1024+ pages take ``long_num_warps``."""
    values = _overridden("select", {"long_lanes": 8, "long_num_warps": 16}, overrides)
    _power_of_two("select", "long_lanes", values["long_lanes"], range(1, 17))
    return SelectLaunch(
        lanes=values["long_lanes"] if num_tiles == 1 else 1,
        num_warps=values["long_num_warps"] if tile_pages >= 1024 else 4,
    )


def attend_launch(kv_fp8: bool, overrides: Mapping[str, Any] | None = None) -> AttendLaunch:
    """Attend's launch on a bf16 or fp8 KV cache: the paper's 4 warps and 3 stages on
    bf16 pages; 5 on fp8 pages, half a bf16 page's bytes, so the same shared memory
    keeps more pages in flight; a register cap that fits ATTEND_BLOCKS_PER_SM blocks
    per SM without spills."""
    defaults = {"num_warps": 4, "num_stages": 5 if kv_fp8 else 3, "maxnreg": 168}
    return AttendLaunch(**_overridden("attend", defaults, overrides))


def audit_launch(max_pages: int, overrides: Mapping[str, Any] | None = None) -> AuditLaunch:
    """The captured-mass audit's launch (moira_audit.py) for rows of up to ``max_pages``
    pages: ``samples`` lists per layer of an audited step, each read by ``list_programs``
    programs (at most one per page) so that an audited step's extra reads take a few
    microseconds per layer instead of one program's walk over a whole row."""
    values = _overridden("audit", {"samples": 2, "list_programs": 64}, overrides)
    for name, top in (("samples", 64), ("list_programs", 256)):
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
            raise ValueError(
                f"Moira: audit launch {name} must be an integer in 1..{top}, got {value!r}"
            )
    return AuditLaunch(values["samples"], min(values["list_programs"], max(max_pages, 1)))


def check_launch_overrides(
    launch: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, Mapping[str, Any]]:
    """``launch`` (overrides by kernel, LAUNCH_KERNELS) checked: an unknown kernel or
    setting, or a value out of range, is refused before anything is launched."""
    launch = dict(launch or {})
    unknown = sorted(set(launch) - set(LAUNCH_KERNELS))
    if unknown:
        raise ValueError(f"Moira: launch overrides for {unknown}; kernels: {LAUNCH_KERNELS}")
    writer_launch(launch.get("writer"))
    estimate_launch(0, True, launch.get("estimate"))
    select_launch(_SELECT_MAX_TILE_PAGES, 1, launch.get("select"))
    attend_launch(False, launch.get("attend"))
    audit_launch(1, launch.get("audit"))
    _overridden("step", {"pdl": True}, launch.get("step"))
    return launch


# SMs assumed off the GPU (CPU tests): a Hopper SXM part's.
_DEFAULT_SM_COUNT = 132


def resolve_attend_fill_blocks(config: MoiraConfig, device: torch.device | str) -> int:
    """N_F that Attend uses on ``device``: ``config.attend_fill_blocks``, or for
    0 ATTEND_BLOCKS_PER_SM per SM (off a CUDA device, _DEFAULT_SM_COUNT SMs)."""
    if config.attend_fill_blocks:
        return config.attend_fill_blocks
    device = torch.device(device)
    sms = _DEFAULT_SM_COUNT
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return ATTEND_BLOCKS_PER_SM * sms


# ==========================================================================
# The engine's configuration: what Moira refuses
# ==========================================================================
#: MoiraBackend.validate_configuration's feature flags that MOIRA refuses,
#: with the reason (an unknown flag that is set gets a generic one).
_REFUSED_FEATURES = {
    "use_mla": "MLA models are not supported by MOIRA; only MHA/GQA/MQA",
    "use_sparse": "sparse (indexer) attention is not supported by MOIRA",
    "has_sink": "attention sinks (learned sinks) are not supported by MOIRA",
    "use_mm_prefix": (
        "multimodal prefix (mm_prefix) bidirectional attention is not supported by MOIRA"
    ),
    "use_per_head_quant_scales": "per-head KV quantization scales are not supported by MOIRA",
    "has_sliding_window": (
        "sliding-window attention is not supported by MOIRA; only full attention (for "
        'mixed models use attention_config.backend_per_kind={"sliding_window": "FLASH_ATTN"})'
    ),
    "use_rswa": "R-SWA attention is not supported by MOIRA",
    "use_non_causal": "non-causal attention is not supported by MOIRA; causal only",
    "use_batch_invariant": (
        "batch invariance (VLLM_BATCH_INVARIANT=1) is not supported by MOIRA: its split-K "
        "decode is not batch invariant"
    ),
    "use_kv_connector": (
        "KV connectors / KV offloading are not supported by MOIRA: externally loaded KV "
        "blocks carry no page summaries"
    ),
    "use_dcp": (
        "decode context parallelism (DCP) is not supported by MOIRA; use "
        "decode_context_parallel_size=1"
    ),
    "use_pcp": (
        "prefill context parallelism (PCP) is not supported by MOIRA; use "
        "prefill_context_parallel_size=1"
    ),
    "use_adaptive_verification": (
        "adaptive verification (speculative decoding) is not supported by MOIRA"
    ),
}


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
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    if cache_dtype not in MOIRA_KV_CACHE_DTYPES:
        reasons.append(unsupported_kv_cache_dtype_message(cache_dtype))
    if getattr(cache_config, "kv_offloading_size", None):
        reasons.append(
            "KV cache offloading (kv_offloading_size) is not supported by "
            "MOIRA: reloaded KV blocks carry no page summaries"
        )
    if getattr(cache_config, "kv_sharing_fast_prefill", False):
        reasons.append("kv_sharing_fast_prefill is not supported by MOIRA; leave it off")
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
            "micro-batching (enable_dbo / ubatch_size > 1) is not supported by MOIRA; disable DBO"
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
    # Stock vLLM (plugin mode): features that need the patch series.
    reasons.extend(plugin_mode_reasons(vllm_config))
    return reasons


def unsupported_kv_cache_dtype_message(kv_cache_dtype: Any) -> str:
    """The refusal of a --kv-cache-dtype that Moira does not serve."""
    allowed = ", ".join(MOIRA_KV_CACHE_DTYPES)
    return (
        f"--kv-cache-dtype {kv_cache_dtype} (kv_cache_dtype={kv_cache_dtype!r}) is not "
        f"supported by MOIRA; allowed: {allowed} (fp8 is e4m3 with the layers' K/V "
        "scales, the fp8 format FA3 reads)"
    )


def check_vllm_config_for_moira(vllm_config: VllmConfig | None) -> None:
    """Raise a ValueError listing every unsupported engine feature."""
    if vllm_config is None:
        return
    reasons = _unsupported_vllm_config_reasons(vllm_config)
    if reasons:
        raise ValueError(
            "MOIRA attention backend cannot run this configuration: " + "; ".join(reasons)
        )
