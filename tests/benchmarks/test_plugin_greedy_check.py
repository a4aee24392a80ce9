# SPDX-License-Identifier: Apache-2.0
import json

from benchmarks.plugin_greedy_check import compare, load_outputs


def test_compare_names_the_first_diverging_token_and_the_margins_there():
    top2 = [[[1, -0.1], [7, -2.5]], [[5, -0.6], [9, -0.65]], [[6, -0.2], [8, -3.0]]]
    moira = [
        {"tokens": [1, 2, 3], "top2": []},
        {"tokens": [4, 5, 6], "top2": [[[4, -0.1], [1, -3.0]], [[5, -0.6], [9, -0.7]]]},
    ]
    dense = [{"tokens": [1, 2, 3], "top2": []}, {"tokens": [4, 9, 6], "top2": top2}]
    rows = compare(moira, dense)
    assert rows[0] == {
        "prompt": 0,
        "tokens": 3,
        "identical": True,
        "first_divergence": None,
        "dense_margin_at_divergence": None,
        "moira_margin_at_divergence": None,
    }
    assert rows[1]["first_divergence"] == 1 and not rows[1]["identical"]
    assert abs(rows[1]["dense_margin_at_divergence"] - 0.05) < 1e-9
    assert abs(rows[1]["moira_margin_at_divergence"] - 0.1) < 1e-9


def test_load_outputs_reads_bare_token_lists(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps([[1, 2], [3]]))
    assert load_outputs(str(path)) == [{"tokens": [1, 2], "top2": []}, {"tokens": [3], "top2": []}]
