# SPDX-License-Identifier: Apache-2.0
"""The vLLM accuracy runner's CPU steps: scoring and bootstrap of run records
(``merge``), and the document export with the real tokenizer (slow: needs the
model directory that the real-model check prepares)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.accuracy import run_accuracy_vllm as R


def _doc(task, ctx, doc, answers):
    sample = {"task": task, "context": ctx, "prompt": "p", "answers": answers,
              "answer_prefix": ""}  # fmt: skip
    return {"id": f"{task}|{ctx}|{doc}", "doc": doc, "sample": sample, "prompt_token_ids": [1]}


def _arm(arm, gamma, texts, reads=None):
    return {"arm": arm, "gamma": gamma, "reads": reads,
            "outputs": {k: {"text": v, "token_ids": []} for k, v in texts.items()}}  # fmt: skip


def test_merge_scores_against_dense():
    prompts = {"docs": [_doc("niah_single", 2048, 0, ["123"]),
                        _doc("niah_single", 2048, 1, ["456"]),
                        _doc("niah_multivalue", 2048, 0, ["7", "8"])]}  # fmt: skip
    dense = _arm("dense", None, {"niah_single|2048|0": "123.", "niah_single|2048|1": "456",
                                 "niah_multivalue|2048|0": "7 and 8"})  # fmt: skip
    moira = _arm("moira", 0.98, {"niah_single|2048|0": "123", "niah_single|2048|1": "999",
                                 "niah_multivalue|2048|0": "only 7"}, reads=0.4)  # fmt: skip
    rows = R.merge_records(prompts, [{"arms": [dense]}, {"arms": [moira]}])
    by = {(r["task"], r["arm"]): r for r in rows}
    assert by[("niah_single", "dense")]["score"] == 100.0
    assert by[("niah_single", "moira")]["score"] == 50.0
    assert by[("niah_multivalue", "moira")]["score"] == 50.0  # one of two answers
    pooled = by[("all", "moira")]
    assert pooled["docs"] == 3 and pooled["reads"] == 0.4 and pooled["kl"] is None
    assert pooled["diff_vs_dense"] == pytest.approx((0 - 100 - 50) / 3)
    lo, hi = pooled["diff_vs_dense_ci95"]
    assert lo <= pooled["diff_vs_dense"] <= hi <= 0.0
    with pytest.raises(SystemExit, match="no dense arm"):
        R.merge_records(prompts, [{"arms": [moira]}])


@pytest.mark.slow
def test_export_writes_chat_token_ids(tmp_path):
    if os.environ.get("MOIRA_SKIP_REAL_MODEL") == "1":
        pytest.skip("MOIRA_SKIP_REAL_MODEL=1")
    for mod in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(mod)
    # The suite's default tasks and reserve: every prompt plus the answer budget (set by
    # the task with the longest answers) fits the context.
    out = tmp_path / "prompts.json"
    args = R.build_parser().parse_args(["export", "--contexts", "2048", "--docs", "2",
                                        "--out", str(out)])  # fmt: skip
    R.export(args)
    data = json.loads(out.read_text())
    ids = [d["id"] for d in data["docs"]]
    assert ids[:2] == ["niah_single|2048|0", "niah_single|2048|1"] and len(ids) == 10
    assert data["reserve"] == R.SUITES["smollm2-135m"]["reserve"]
    for d in data["docs"]:
        assert 1500 < len(d["prompt_token_ids"]) <= 2048 - data["max_new"]
        assert d["sample"]["answers"] and d["sample"]["context"] == 2048
    assert len(data["stop_token_ids"]) == 2


def test_merge_uses_reads_of_each_context():
    prompts = {"docs": [_doc("niah_single", 2048, 0, ["1"]), _doc("niah_single", 4096, 0, ["2"])]}
    dense = _arm("dense", None, {"niah_single|2048|0": "1", "niah_single|4096|0": "2"})
    moira = _arm("moira", 0.98, {"niah_single|2048|0": "1", "niah_single|4096|0": "2"}, reads=0.5)
    moira["pages_by_context"] = {"2048": [60, 100], "4096": [30, 100]}
    rows = R.merge_records(prompts, [{"arms": [dense, moira]}])
    reads = {(r["task"], r["context"]): r["reads"] for r in rows if r["arm"] == "moira"}
    assert reads == {("niah_single", 2048): 0.6, ("all", 2048): 0.6,
                     ("niah_single", 4096): 0.3, ("all", 4096): 0.3}  # fmt: skip
    # Records without per-context counters fall back to the pooled fraction.
    del moira["pages_by_context"]
    rows = R.merge_records(prompts, [{"arms": [dense, moira]}])
    assert {r["reads"] for r in rows if r["arm"] == "moira"} == {0.5}


def test_recheck_refuses_unknown_documents():
    from benchmarks.accuracy import recheck_docs

    prompts = {"stop_token_ids": [0], "docs": [_doc("niah_single", 2048, 0, ["1"])]}
    with pytest.raises(SystemExit, match=r"not in the prompts file: \['niah_single\|2048\|7'\]"):
        recheck_docs.recheck(prompts, ["niah_single|2048|7"], [0.99], ["mvar_top4"], 12)


def test_merge_compares_runs_of_one_kv_cache_dtype(tmp_path):
    """--kv-cache-dtype fp8 runs merge with each other (the record says fp8); a
    dense bf16 run next to an fp8 MOIRA run is refused."""
    import argparse

    prompts = {"docs": [_doc("niah_single", 2048, 0, ["123"])]}
    dense = _arm("dense", None, {"niah_single|2048|0": "123"})
    moira = _arm("moira", 0.99, {"niah_single|2048|0": "123"}, reads=0.5)
    paths = {}
    for name, arm, kv in (("dense_fp8", dense, "fp8"), ("moira_fp8", moira, "fp8"),
                          ("dense_auto", dense, "auto")):  # fmt: skip
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"command": name, "kv_cache_dtype": kv,
                                           "arms": [arm]}))  # fmt: skip
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "out.json"

    def args(*names):
        return argparse.Namespace(runs=[str(paths[n]) for n in names],
                                  prompts=str(tmp_path / "prompts.json"), out=str(out))  # fmt: skip

    R.merge(args("dense_fp8", "moira_fp8"))
    record = json.loads(out.read_text())
    assert record["kv_cache_dtype"] == "fp8" and "fp8 KV cache" in record["where"]
    with pytest.raises(SystemExit, match=r"different --kv-cache-dtype \['auto', 'fp8'\]"):
        R.merge(args("dense_auto", "moira_fp8"))
