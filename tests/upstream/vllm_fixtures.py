# SPDX-License-Identifier: Apache-2.0
"""Pytest plugin for running vLLM's own test files (``run_vllm_tests.py``).

``run_vllm_tests.py`` runs vLLM's test files with ``--noconftest`` (vLLM's top-level conftest
imports packages and assets an offline GPU host lacks) and loads this plugin instead. It
provides the one fixture those files use, ``default_vllm_config`` (a default ``VllmConfig``
made current for the test, as vLLM's does), and, when ``MOIRA_VLLM_TESTS_REPORT`` names a
file, records how far every backend's output is from the test's reference: each
``torch.testing.assert_close`` call of the tests appends one JSON line (test, backend, max
absolute difference, tolerances, whether it was within them) and then asserts as before. A
run below gamma=1 reads these lines for MOIRA's distance, which it reports, not asserts.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

_REPORT = os.environ.get("MOIRA_VLLM_TESTS_REPORT")


@pytest.fixture()
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def _backend_of(msg) -> str:
    keywords = getattr(msg, "keywords", None) or {}
    backend = keywords.get("backend_name")
    return getattr(backend, "name", str(backend)) if backend is not None else ""


@pytest.fixture(autouse=True)
def _record_distances(request, monkeypatch):
    if not _REPORT:
        yield
        return
    original = torch.testing.assert_close

    def recording_assert_close(actual, expected, *args, **kwargs):
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            a, e = actual.detach().float(), expected.detach().float()
            diff = (a - e).abs()
            row = {
                "test": request.node.nodeid,
                "backend": _backend_of(kwargs.get("msg")),
                "max_abs": float(diff.max()) if diff.numel() else 0.0,
                "atol": kwargs.get("atol"),
                "rtol": kwargs.get("rtol"),
                "gamma": os.environ.get("MOIRA_GAMMA"),
            }
            try:
                original(actual, expected, *args, **kwargs)
                row["within_tolerance"] = True
            except AssertionError:
                row["within_tolerance"] = False
                raise
            finally:
                with open(_REPORT, "a") as f:
                    f.write(json.dumps(row) + "\n")
            return None
        return original(actual, expected, *args, **kwargs)

    monkeypatch.setattr(torch.testing, "assert_close", recording_assert_close)
    yield
