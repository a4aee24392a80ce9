# SPDX-License-Identifier: Apache-2.0
"""bench_serving.py's pieces that need no server: the set definitions, the
`vllm bench serve` command line and the --moira-env parser."""

from __future__ import annotations

import json
import types

import pytest
from _load import load

bs = load("bench_serving")


@pytest.mark.parametrize(("name", "low", "high"), [("A", 4096, 65536), ("B", 65536, 129024)])
def test_sets_span_the_paper_ranges(name, low, high):
    mean, ratio = bs.SETS[name]
    assert abs(mean * (1 - ratio) - low) <= 64
    assert abs(mean * (1 + ratio) - high) <= 64


def test_bench_command_fixes_output_length_and_prompt_count():
    args = types.SimpleNamespace(set="A", model="M", tokenizer="T", output_len=1024, waves=2,
                                 min_prompts=4, seed=0, detailed=False)  # fmt: skip
    cmd = bs.bench_command(args, "http://127.0.0.1:1", 16, "/tmp/r", "x.json")
    value = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--")}
    assert value["--num-prompts"] == "32" and value["--max-concurrency"] == "16"
    assert value["--random-output-len"] == "1024" and "--ignore-eos" in cmd
    assert json.loads(value["--random-range-ratio"]) == {"input": 0.8823, "output": 0.0}
    low = bs.bench_command(args, "http://127.0.0.1:1", 1, "/tmp/r", "y.json")
    assert low[low.index("--num-prompts") + 1] == "4"  # min_prompts
    assert "--save-detailed" not in cmd
    args.detailed = True  # per-request TTFTs
    assert "--save-detailed" in bs.bench_command(args, "http://127.0.0.1:1", 16, "/tmp/r", "z")


def test_moira_env_parser():
    assert bs.parse_env("MOIRA_SELECTOR=fixed,MOIRA_FIXED_FRACTION=0.3") == {
        "MOIRA_SELECTOR": "fixed",
        "MOIRA_FIXED_FRACTION": "0.3",
    }
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        bs.parse_env("MOIRA_GAMMA")


def _row(arm, concurrency, tok_s):
    return {"arm": arm, "concurrency": concurrency, "output_tok_s": tok_s}


def test_merge_joins_runs_and_recomputes_gains(tmp_path):
    moira_run = {"command": "c1", "set": "A", "gpu": "G",
                 "rows": [_row("moira", 16, 150.0), _row("moira", 1, 100.0)],
                 "errors": ["dense: TimeoutExpired(...)"]}  # fmt: skip
    dense_run = {"command": "c2", "set": "A", "gpu": "G",
                 "rows": [_row("dense", 16, 100.0)]}  # fmt: skip
    paths = []
    for name, run in (("m.json", moira_run), ("d.json", dense_run)):
        (tmp_path / name).write_text(json.dumps(run))
        paths.append(str(tmp_path / name))
    out = tmp_path / "merged.json"
    bs.merge(paths, str(out))
    merged = json.loads(out.read_text())
    assert merged["sources"] == ["c1", "c2"] and len(merged["rows"]) == 3
    # c16 has both arms; c1 only moira; the dense error is superseded by dense's run
    assert merged["gains"] == {"c16": pytest.approx(0.5)}
    assert "errors" not in merged


def test_serving_phases_split_at_the_last_first_token():
    # Two requests sent at t=10 (times exact in binary): A answered at 11, then
    # a token every 0.125 s; B answered at 12 (the end of prefill), then every
    # 0.0625 s. The tail is A's tokens after 12.0 (not the one at 12.0) and B's.
    result = {"start_times": [10.0, 10.0], "ttfts": [1.0, 2.0],
              "itls": [[0.125] * 20, [0.0625] * 4]}  # fmt: skip
    phases = bs.serving_phases(result)
    assert phases["prefill_phase_s"] == 2.0
    assert phases["decode_tail_s"] == 1.5  # A ends at 13.5, B at 12.25
    assert phases["decode_tail_tokens"] == 12 + 4
    assert phases["decode_tail_median_itl_ms"] == 125.0
    # Without --save-detailed's lists there is nothing to split.
    assert bs.serving_phases({"ttfts": [1.0]})["decode_tail_s"] is None


def test_decode_tail_speedups_need_both_arms():
    rows = [dict(_row("dense", 16, 1.0), decode_tail_median_itl_ms=24.0),
            dict(_row("moira", 16, 2.0), decode_tail_median_itl_ms=12.0),
            dict(_row("dense", 1, 1.0), decode_tail_median_itl_ms=8.0)]  # fmt: skip
    assert bs.decode_tail_speedups(rows) == {"c16": pytest.approx(2.0)}
