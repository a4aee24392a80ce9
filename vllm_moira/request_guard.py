# SPDX-License-Identifier: Apache-2.0
"""Refuses per-request Moira knobs that stock vLLM cannot deliver.

On stock vLLM a request's ``SamplingParams.extra_args`` never reach the
attention backend, so ``moira_gamma`` would be dropped without a word. This V1
custom logits processor (``--logits-processors
vllm_moira.request_guard:MoiraRequestGuard``) validates each request in the
frontend, where a ``VLLMValidationError`` becomes an HTTP 400 (or an error from
``LLM.generate``). It leaves the logits untouched. Plugin-mode Moira refuses
to start without it (``moira_mode.plugin_mode_reasons``). On the patched build
the series delivers ``moira_gamma``, and the guard lets it through.

vLLM runs the V1 model runner when custom logits processors are configured
(unless ``VLLM_USE_V2_MODEL_RUNNER=1``); the validation runs in the frontend either way.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_moira.v1.attention.backends.moira_mode import (
    MOIRA_GAMMA_EXTRA_ARG,
    PATCHED_BUILD,
    is_patched_build,
)


class MoiraRequestGuard(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        extra_args = getattr(sampling_params, "extra_args", None) or {}
        if MOIRA_GAMMA_EXTRA_ARG not in extra_args or is_patched_build():
            return
        value = extra_args[MOIRA_GAMMA_EXTRA_ARG]
        raise VLLMValidationError(
            f"{MOIRA_GAMMA_EXTRA_ARG} (a request's own coverage gamma) needs {PATCHED_BUILD}; "
            "this server runs Moira as a plugin on stock vLLM 0.30.0, which passes no "
            f"per-request values to the attention backend: omit {MOIRA_GAMMA_EXTRA_ARG} "
            "(the server's MOIRA_GAMMA applies)",
            parameter=MOIRA_GAMMA_EXTRA_ARG,
            value=value,
        )

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
