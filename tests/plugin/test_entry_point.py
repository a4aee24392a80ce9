"""The plugin's declarations: the entry point in pyproject.toml names a real
callable, and on the patched build (the test venv) it leaves vLLM as it is."""

from __future__ import annotations

import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _resolve(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def test_pyproject_declares_the_general_plugin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"moira": "vllm_moira.plugin:register"}
    register = _resolve(plugins["moira"])
    assert callable(register)
    from vllm_moira import plugin

    assert register is plugin.register


def test_declared_class_paths_resolve():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from vllm_moira import plugin
    from vllm_moira.v1.attention.backends import moira_mode

    backend = _resolve(plugin.MOIRA_BACKEND_CLASS.replace(".MoiraBackend", ":MoiraBackend"))
    assert backend.__module__ == "vllm_moira.v1.attention.backends.moira"
    guard = _resolve(moira_mode.REQUEST_GUARD)
    assert issubclass(guard, LogitsProcessor)


def test_register_is_a_no_op_on_the_patched_build(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_moira import plugin

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "MOIRA")  # read by the patched build itself
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    plugin.register()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    # Both copies of the backend name themselves after the enum member.
    from vllm.v1.attention.backends.moira import MoiraBackend as Installed

    from vllm_moira.v1.attention.backends.moira import MoiraBackend as Packaged

    assert Installed.get_name() == Packaged.get_name() == "MOIRA"


def test_guard_lets_moira_gamma_through_on_the_patched_build():
    from vllm import SamplingParams

    from vllm_moira.request_guard import MoiraRequestGuard

    MoiraRequestGuard.validate_params(SamplingParams(extra_args={"moira_gamma": 0.9}))
