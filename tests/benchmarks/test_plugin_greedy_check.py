# SPDX-License-Identifier: Apache-2.0
from benchmarks.plugin_greedy_check import compare


def test_compare_names_the_first_diverging_token():
    rows = compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert rows == [
        {"prompt": 0, "tokens": 3, "identical": True, "first_divergence": None},
        {"prompt": 1, "tokens": 3, "identical": False, "first_divergence": 1},
    ]
