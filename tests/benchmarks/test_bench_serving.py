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


def test_real_text_dataset_switches_the_bench_to_the_custom_source():
    args = types.SimpleNamespace(set="A", model="M", tokenizer="M", output_len=1024, waves=2,
                                 min_prompts=4, seed=0, detailed=False,
                                 dataset="/d/serve_text.jsonl")  # fmt: skip
    cmd = bs.bench_command(args, "http://127.0.0.1:1", 16, "/tmp/r", "x.json")
    value = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--")}
    assert value["--dataset-name"] == "custom" and value["--dataset-path"] == args.dataset
    assert value["--custom-output-len"] == "1024" and "--skip-chat-template" in cmd
    assert "--random-input-len" not in cmd and "--ignore-eos" in cmd


def _word_tokenizer(path, words):
    """A word-level tokenizer directory that AutoTokenizer loads (no network, no model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(path)
    return str(path)


def test_make_dataset_cuts_documents_and_keeps_their_questions(tmp_path):
    import gzip

    words = [f"w{i}" for i in range(3000)] + ["what", "is", "the", "magic", "number", "answer"]
    tokenizer = _word_tokenizer(tmp_path / "tok", words)
    question = list(range(3001, 3007))  # "what is the magic number answer"
    docs = [{"prompt_token_ids": list(range(1, 2001)) + question},
            {"prompt_token_ids": list(range(1, 3001)) + question}]  # fmt: skip
    path = tmp_path / "p.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"docs": docs}, f)
    rows = bs.make_dataset(str(path), tokenizer, 12, 600, 2900, seed=1)
    assert len(rows) == 12
    for row in rows:
        assert row["prompt"].endswith("magic number answer")  # the question survives the cut
        assert 600 <= row["prompt_tokens"] <= 2900
        assert row["prompt"].startswith("w0 w1 w2")  # the document's own beginning
    assert len({r["prompt_tokens"] for r in rows}) > 6  # lengths spread over the range
    # a prompt longer than 2006 tokens can only come from the longer document
    assert all("w2999" in r["prompt"] for r in rows if r["prompt_tokens"] > 2006)
    with pytest.raises(SystemExit, match="fewer than --max-tokens"):
        bs.make_dataset(str(path), tokenizer, 1, 600, 4000, seed=1)


def test_read_gauge_parser_and_sampler_summary():
    page = (
        "# HELP vllm:moira_page_read_fraction ...\n"
        'vllm:moira_page_read_fraction{engine="0",model_name="m"} 0.3125\n'
        "vllm:num_requests_running 3.0\n"
    )
    assert bs.parse_read_gauge(page) == 0.3125
    assert bs.parse_read_gauge("vllm:num_requests_running 3.0\n") is None
    sampler = bs.ReadFractionSampler("http://127.0.0.1:1")
    with sampler:  # no server: no samples, and no error
        pass
    assert sampler.summary() is None
    sampler.samples = [0.2, 0.4, 0.3]
    assert sampler.summary() == {"mean": 0.3, "median": 0.3, "samples": 3}


@pytest.mark.parametrize("gauge", [None, 0.25])
def test_sampler_scrapes_dense_and_moira_servers_alike(gauge):
    # Both arms' servers get the same /metrics requests; only MOIRA's page has the gauge.
    import http.server
    import threading
    import time

    scrapes = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            scrapes.append(self.path)
            body = "vllm:num_requests_running 1.0\n"
            if gauge is not None:
                body += f'vllm:moira_page_read_fraction{{engine="0"}} {gauge}\n'
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with bs.ReadFractionSampler(f"http://127.0.0.1:{server.server_port}", 0.02) as sampler:
            deadline = time.monotonic() + 10
            while len(scrapes) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        server.shutdown()
    assert len(scrapes) >= 3 and set(scrapes) == {"/metrics"}
    if gauge is None:
        assert sampler.summary() is None
    else:
        assert sampler.summary()["mean"] == gauge
