# SPDX-License-Identifier: Apache-2.0
"""Moira as a vLLM plugin on the stock ``vllm==0.30.0`` wheel.

``pip install`` of this package declares ``register`` as a ``vllm.general_plugins``
entry point (pyproject.toml). vLLM calls it in every process (frontend, engine
core, workers) before a model is built. On stock vLLM it registers the backend
in the enum's plugin slot, so ``--attention-backend CUSTOM`` selects Moira. On
the patched build (the enum has ``MOIRA``) it registers nothing: the backend is
selected as ``MOIRA`` there, and the ``CUSTOM`` slot stays free for others.
"""

from __future__ import annotations

import logging
import os

from vllm_moira.v1.attention.backends.moira_mode import (
    PATCHED_BUILD,
    REQUEST_GUARD,
    is_patched_build,
)

logger = logging.getLogger("vllm_moira.plugin")

#: The backend class, imported from this package (no file copied into vLLM).
MOIRA_BACKEND_CLASS = "vllm_moira.v1.attention.backends.moira.MoiraBackend"
#: VLLM_ATTENTION_BACKEND values that mean Moira; stock vLLM ignores the variable.
_MOIRA_ENV_NAMES = ("MOIRA", "CUSTOM")


def _log_through_vllm() -> None:
    """vLLM configures its own logger tree only ("vllm"); give this package's
    loggers (the backend's start-up lines among them) the same handlers and level."""
    import vllm.logger  # noqa: F401  (configures the "vllm" logger on import)

    vllm_root = logging.getLogger("vllm")
    ours = logging.getLogger("vllm_moira")
    if ours.handlers or not vllm_root.handlers:
        return
    for handler in vllm_root.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_root.level)
    ours.propagate = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if is_patched_build():
        logger.debug("Moira: patched vLLM build, the backend is MOIRA; nothing to register")
        return
    _log_through_vllm()
    env_backend = os.environ.get("VLLM_ATTENTION_BACKEND", "").strip()
    if env_backend.upper() in _MOIRA_ENV_NAMES:
        # Stock vLLM 0.30 only warns about the variable and picks another
        # backend: refuse rather than serve without Moira.
        raise ValueError(
            f"VLLM_ATTENTION_BACKEND={env_backend!r} is read only by {PATCHED_BUILD}; "
            "stock vLLM 0.30.0 ignores it. With the Moira plugin, unset it and pass "
            f"--attention-backend CUSTOM --logits-processors {REQUEST_GUARD}"
        )

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != MOIRA_BACKEND_CLASS:
        # Another plugin holds the single CUSTOM slot; taking it would silently
        # swap that plugin's backend for Moira.
        logger.warning(
            "Moira not registered: the CUSTOM attention backend slot already holds %s "
            "(another plugin); set VLLM_PLUGINS to load one of them, or use %s",
            custom.get_path(),
            PATCHED_BUILD,
        )
        return
    register_backend(custom, MOIRA_BACKEND_CLASS)
    logger.info(
        "Moira registered as attention backend CUSTOM (plugin mode on stock vLLM "
        "0.30.0): select it with --attention-backend CUSTOM --logits-processors %s. "
        "Per-request moira_gamma, VLLM_ATTENTION_BACKEND, the /metrics gauge and the "
        "FA3 decode steps need %s",
        REQUEST_GUARD,
        PATCHED_BUILD,
    )
