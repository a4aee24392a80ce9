# SPDX-License-Identifier: Apache-2.0
"""run_accuracy.py's arm list and its command-line checks (no model needed)."""

from __future__ import annotations

import sys

import pytest

from benchmarks.accuracy import run_accuracy as R


def test_arms_follow_estimators_and_gammas():
    labels = [sel.label() for _, sel in R.arms(["mvar_top8"], [0.98, 0.99])]
    assert labels[0] == "dense" and labels[-1] == "oracle@0.98"
    assert labels[1:-1] == ["moira[mvar_top8]@0.98", "moira[mvar_top8]@0.99"]
    assert len(R.arms(["mvar", "mvar_top4"])) == 1 + 2 * len(R.GAMMAS) + 1


def test_equal_read_arms_need_the_098_arm(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["run_accuracy", "--gammas", "0.99"])
    with pytest.raises(SystemExit):
        R.main()
    assert "--gammas must include 0.98" in capsys.readouterr().err
