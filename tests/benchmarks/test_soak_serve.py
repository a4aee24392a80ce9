# SPDX-License-Identifier: Apache-2.0
"""Pure helpers of benchmarks/soak_serve.py (CPU)."""

from __future__ import annotations

from _load import load

soak = load("soak_serve")


def _phase(outputs=None, gamma_check=None):
    phase = {"status": "done"}
    if outputs is not None:
        phase["outputs"] = {str(i): {"token_ids": t, "prompt_len": 1000 + i}
                            for i, t in enumerate(outputs)}  # fmt: skip
    if gamma_check is not None:
        phase["gamma_check"] = gamma_check
    return phase


def test_compare_counts_mismatches_and_first_difference():
    record = {"phases": {"moira1": _phase([[1, 2, 3], [4, 5, 6], [7]]),
                         "dense": _phase([[1, 2, 3], [4, 0, 6], [7]])}}  # fmt: skip
    cmp = soak.compare(record, "moira1", "dense")
    assert cmp["compared"] == 3 and cmp["mismatches"] == 1
    assert cmp["mismatch_examples"] == [{"index": 1, "prompt_len": 1001, "first_diff": 1}]
    assert soak.compare({"phases": {"moira1": _phase([[1]])}}, "moira1", "dense") is None


def test_gamma_check_comparison_uses_the_gamma_one_request():
    moira = {"concurrent": [{"gamma": 1.0, "text": "abc"}, {"gamma": 0.9, "text": "abd"}],
             "checks": {"invalid_gamma_is_400": True}}  # fmt: skip
    record = {"phases": {"moira1": _phase(gamma_check=moira),
                         "dense": _phase(gamma_check={"dense_text": "abc"})}}  # fmt: skip
    assert soak.compare_gamma_checks(record)["gamma_1_equals_dense"] is True
    record["phases"]["dense"]["gamma_check"]["dense_text"] = "abd"
    assert soak.compare_gamma_checks(record)["gamma_1_equals_dense"] is False
    del record["phases"]["dense"]
    assert soak.compare_gamma_checks(record) is None


def test_budget_problem_names_the_option_and_the_budget_needed():
    # The budget is split evenly: 430 s over three phases is 143 s each.
    problem = soak.budget_problem(430, ["moira1", "dense", "moira098"])
    assert problem is not None
    assert "--budget-s 430" in problem and "143 s" in problem and ">= 720" in problem
    assert "moira1, dense, moira098" in problem
    assert soak.budget_problem(525, ["moira1", "dense"]) is None
    assert soak.budget_problem(239, ["dense"]) is not None
    assert soak.budget_problem(240, ["dense"]) is None
    assert soak.budget_problem(10, []) is None


def test_plugin_phase_is_selected_by_flags_and_compared_with_dense():
    args = type("Args", (), {"model": "m", "tokenizer": "t", "max_model_len": 4096,
                             "gpu_memory_utilization": 0.8, "num_gpu_blocks": 64,
                             "max_num_seqs": 8, "port": 1})()  # fmt: skip
    plugin = soak.server_command(args, "plugin1")
    assert plugin.index("serve") < plugin.index("--attention-backend")  # serve's own flags
    assert plugin[plugin.index("--attention-backend") + 1] == "CUSTOM"
    assert "vllm_moira.request_guard:MoiraRequestGuard" in plugin
    assert "VLLM_ATTENTION_BACKEND" not in soak.PHASES["plugin1"]  # the plugin refuses it
    assert "--attention-backend" not in soak.server_command(args, "moira1")
    record = {"phases": {"plugin1": _phase(gamma_check={"dense_text": "abc", "ok": True}),
                         "dense": _phase(gamma_check={"dense_text": "abc"})}}  # fmt: skip
    assert soak.compare_gamma_checks(record) == {"plugin_equals_dense": True,
                                                 "plugin_refuses_moira_gamma": True}  # fmt: skip
    record["phases"]["plugin1"]["gamma_check"]["ok"] = False  # moira_gamma not refused
    assert soak.compare_gamma_checks(record)["plugin_refuses_moira_gamma"] is False
