# SPDX-License-Identifier: Apache-2.0
"""Which vLLM Moira runs on, and what plugin mode refuses.

Two installations run the same backend code:

- the patched build: ``patches/series`` applied to vLLM 0.30.0 and the overlay
  copied into it (``build.sh``); the backend is the enum member ``MOIRA``
  (patch 0001) and the series' hooks are there;
- plugin mode: the stock ``vllm==0.30.0`` wheel with this package installed;
  the ``vllm.general_plugins`` entry point (``vllm_moira.plugin:register``)
  registers the backend in vLLM's ``CUSTOM`` slot.

Each answer here is read from vLLM's own classes (the enum's members, the
hooks' presence), which do not change in a running process. Installed as
``vllm.v1.attention.backends.moira_mode`` on the patched build; imported as
``vllm_moira.v1.attention.backends.moira_mode`` in plugin mode.
"""

from __future__ import annotations

from typing import Any

#: How error messages name the installation that has every feature.
PATCHED_BUILD = (
    "Moira's patched build of vLLM 0.30.0 (bash build.sh: patches/series applied, "
    "then --attention-backend MOIRA)"
)
#: The V1 custom logits processor that refuses per-request Moira knobs in plugin
#: mode (``--logits-processors`` takes ``module:Class``).
REQUEST_GUARD = "vllm_moira.request_guard:MoiraRequestGuard"
#: SamplingParams.extra_args key of a request's own coverage gamma.
MOIRA_GAMMA_EXTRA_ARG = "moira_gamma"


def backend_enum_name() -> str:
    """The ``AttentionBackendEnum`` member Moira is selected through: ``MOIRA``
    where the enum has it (patch 0001), else the plugin slot ``CUSTOM``.
    ``Attention.__init__`` maps the backend class back through
    ``AttentionBackendEnum[get_name()]``, so this is also ``get_name()``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return "MOIRA" if "MOIRA" in AttentionBackendEnum.__members__ else "CUSTOM"


def is_patched_build() -> bool:
    return backend_enum_name() == "MOIRA"


def has_kv_cache_extras_hook() -> bool:
    """vLLM binds backend state next to the KV cache (patch 0003); without it the
    page summaries are stored in padded KV pages (``customize_spec``)."""
    from vllm.v1.attention.backend import AttentionImplBase

    return hasattr(AttentionImplBase, "bind_kv_cache_extras")


def _names_request_guard(processor: Any) -> bool:
    if isinstance(processor, str):
        return processor.strip() == REQUEST_GUARD
    module, _, qualname = REQUEST_GUARD.partition(":")
    return any(
        (getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)) == (module, qualname)
        for cls in getattr(processor, "__mro__", ())
    )


def plugin_mode_reasons(vllm_config: Any) -> list[str]:
    """Why a plugin-mode engine must not start with this configuration (empty on
    the patched build). Each reason names what to change and the patched build,
    which has the feature."""
    if is_patched_build():
        return []
    reasons = []
    model_config = getattr(vllm_config, "model_config", None)
    processors = list(getattr(model_config, "logits_processors", None) or ())
    if not any(_names_request_guard(p) for p in processors):
        # Stock vLLM hands the backend no per-request values, so a request's
        # moira_gamma would be dropped; the guard turns it into an HTTP 400.
        reasons.append(
            "MOIRA as a plugin on stock vLLM cannot apply a request's "
            f"{MOIRA_GAMMA_EXTRA_ARG}; start the engine with --logits-processors "
            f"{REQUEST_GUARD} (LLM(..., logits_processors=[{REQUEST_GUARD!r}])), which "
            f"refuses such requests with HTTP 400, or use {PATCHED_BUILD}"
        )
    return reasons
