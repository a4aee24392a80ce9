# SPDX-License-Identifier: Apache-2.0
"""run_accuracy_vllm's arms, chunks, reads and merge on the CPU: the ``run`` step drives a
stand-in engine (the LLM, SamplingParams and Moira's RPCs replaced by fakes that answer
according to the selector they were given), so the plumbing of per-request gamma, the
fixed-count arm at the measured reads, per-context read fractions, the time budget and
--resume is checked without a GPU."""

from __future__ import annotations

import gzip
import json
import sys
import types
from dataclasses import dataclass

import pytest

from benchmarks.accuracy import run_accuracy_vllm as R


def _doc(task, ctx, i, answers, haystack="essays", n_tokens=10):
    sample = {
        "task": task,
        "context": ctx,
        "prompt": "p",
        "answers": answers,
        "answer_prefix": "",
        "haystack": haystack,
    }
    return {
        "id": f"{task}|{ctx}|{i}",
        "doc": i,
        "sample": sample,
        "prompt_token_ids": [7] * n_tokens,
    }


def _prompts():
    docs = []
    for ctx in (4096, 8192):
        for i in range(4):
            docs.append(
                _doc(
                    "niah_single",
                    ctx,
                    i,
                    [str(1000 + i)],
                    ["essays", "austen"][i % 2],
                    n_tokens=ctx // 4,
                )
            )
    return {"stop_token_ids": [0], "max_new": 16, "max_model_len": 8192, "docs": docs}


# --------------------------------------------------------------------------
# A stand-in engine
# --------------------------------------------------------------------------
@dataclass
class _Selector:
    selector: str = "coverage"
    gamma: float = 0.98
    fixed_fraction: float | None = None


class FakeEngine:
    """Answers right when the row reads at least 60% of its pages; reads 100 pages per
    document: gamma * 100 (coverage, the request's gamma) or the fixed fraction."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.selector = _Selector()
        self.counts = [0, 0]
        self.calls = []
        FakeEngine.instances.append(self)

    def generate(self, inputs, params, use_tqdm=False):
        gamma = (params.extra_args or {}).get("moira_gamma")
        self.calls.append((len(inputs), gamma, self.selector.selector))
        if self.kwargs["attention_backend"] == "FLASH_ATTN":
            frac = 1.0
        elif self.selector.selector == "fixed":
            frac = self.selector.fixed_fraction
        else:
            frac = gamma if gamma is not None else self.selector.gamma
        outs = []
        for prompt in inputs:
            self.counts[0] += round(100 * frac)
            self.counts[1] += 100
            text = prompt["answer"] if frac >= 0.6 else "no idea"
            outs.append(
                types.SimpleNamespace(outputs=[types.SimpleNamespace(text=text, token_ids=[1, 2])])
            )
        return outs

    def collective_rpc(self, fn, kwargs=None):
        return [fn(self, **(kwargs or {}))]


def _install_fakes(monkeypatch, prompts):
    class SamplingParams:
        def __init__(self, temperature, max_tokens, stop_token_ids, extra_args=None):
            assert temperature == 0.0
            self.max_tokens, self.extra_args = max_tokens, extra_args

    # the fake engine finds a document's answer through its ids list (the same object)
    by_ids = {id(d["prompt_token_ids"]): d["sample"]["answers"][0] for d in prompts["docs"]}

    def tokens_prompt(prompt_token_ids):
        return {"prompt_token_ids": prompt_token_ids, "answer": by_ids[id(prompt_token_ids)]}

    def set_selector(engine, **changes):
        for k, v in changes.items():
            if hasattr(engine.selector, k):
                setattr(engine.selector, k, v)
        return 1

    def read_stats(engine, reset=False):
        out = list(engine.counts)
        if reset:
            engine.counts = [0, 0]
        return out

    @dataclass
    class Cfg:
        estimator: str = "mvar_top8"
        summary_dtype: str = "int8"

    def from_env():
        import os

        return Cfg(
            os.environ.get("MOIRA_ESTIMATOR", "mvar_top8"),
            os.environ.get("MOIRA_SUMMARY_DTYPE", "int8"),
        )

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeEngine, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = tokens_prompt
    moira = types.ModuleType("vllm.v1.attention.backends.moira")
    moira.moira_config_from_env = from_env
    moira_rpc = types.ModuleType("vllm.v1.worker.moira_rpc")
    moira_rpc.set_selector, moira_rpc.read_stats = set_selector, read_stats
    worker = types.ModuleType("vllm.v1.worker")
    worker.moira_rpc = moira_rpc
    backends = types.ModuleType("vllm.v1.attention.backends")
    backends.moira = moira
    for name, mod in {
        "vllm": vllm,
        "vllm.inputs": inputs,
        "vllm.v1": types.ModuleType("v1"),
        "vllm.v1.attention": types.ModuleType("a"),
        "vllm.v1.attention.backends": backends,
        "vllm.v1.attention.backends.moira": moira,
        "vllm.v1.worker": worker,
        "vllm.v1.worker.moira_rpc": moira_rpc,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("MOIRA_ESTIMATOR", raising=False)
    monkeypatch.delenv("MOIRA_SUMMARY_DTYPE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    FakeEngine.instances = []


@pytest.fixture
def suite(tmp_path, monkeypatch):
    prompts = _prompts()
    _install_fakes(monkeypatch, prompts)
    path = tmp_path / "prompts.json.gz"
    R.dump_json(path, prompts)
    # load_json gives new lists; the fake engine maps ids objects back to answers
    monkeypatch.setattr(R, "load_json", _loader(prompts, R.load_json))
    return prompts, path


def _loader(prompts, real):
    def load(path):
        return prompts if str(path).endswith("prompts.json.gz") else real(path)

    return load


def test_dump_and_load_gzip(tmp_path):
    R.dump_json(tmp_path / "a.json.gz", {"x": [1, 2]})
    assert gzip.decompress((tmp_path / "a.json.gz").read_bytes()).startswith(b'{"x"')
    R.dump_json(tmp_path / "a.json", {"x": [1, 2]})
    assert R.load_json(tmp_path / "a.json.gz") == R.load_json(tmp_path / "a.json") == {"x": [1, 2]}


def test_plan_arms_and_their_checks():
    labels = [a["label"] for a in R.plan_arms("MOIRA", "mvar_top8", [0.99, 0.98], True, 0.98)]
    assert labels == [
        "moira[mvar_top8]@0.99",
        "moira[mvar_top8]@0.98",
        "moira[mvar_top8]@1.0",
        "fixed[mvar_top8]@reads(0.98)",
    ]
    assert [a["label"] for a in R.plan_arms("FLASH_ATTN", None, [0.98], True, 0.98)] == ["dense"]
    with pytest.raises(SystemExit, match="--fixed-at 0.98 must be one of --gammas"):
        R.plan_arms("MOIRA", "mvar", [0.99], False, 0.98)
    with pytest.raises(SystemExit, match="--gammas must be distinct values in"):
        R.plan_arms("MOIRA", "mvar", [0.99, 1.0], False, None)


def test_chunks_keep_contexts_apart_and_fit_the_budget():
    docs = _prompts()["docs"]
    chunks = R.make_chunks(docs, 2500)
    assert [[d["id"] for d in c] for c in chunks] == [
        ["niah_single|4096|0", "niah_single|4096|1"],
        ["niah_single|4096|2", "niah_single|4096|3"],
        ["niah_single|8192|0"],
        ["niah_single|8192|1"],
        ["niah_single|8192|2"],
        ["niah_single|8192|3"],
    ]
    assert sum(len(c) for c in R.make_chunks(docs, 10**9)) == len(docs)


def _run(tmp_path, path, *extra):
    out = tmp_path / "moira.json"
    R.main(
        [
            "run",
            "--backend",
            "MOIRA",
            "--prompts",
            str(path),
            "--model",
            "m",
            "--out",
            str(out),
            "--gammas",
            "0.99",
            "0.98",
            "0.5",
            *extra,
        ]
    )
    return json.loads(out.read_text())


def test_run_moira_arms(tmp_path, suite):
    _, path = suite
    record = _run(tmp_path, path)
    assert record["complete"] and record["prefix_caching"]
    engine = FakeEngine.instances[-1]
    assert engine.kwargs["enable_prefix_caching"] and engine.kwargs["max_model_len"] == 8192
    arms = {a["label"]: a for a in record["arms"]}
    assert list(arms) == [
        "moira[mvar_top8]@0.99",
        "moira[mvar_top8]@0.98",
        "moira[mvar_top8]@0.5",
        "moira[mvar_top8]@1.0",
        "fixed[mvar_top8]@reads(0.98)",
    ]
    # one generate per arm and chunk (2 contexts, one chunk each), the request's gamma set
    assert [c[1:] for c in engine.calls[:5]] == [
        (0.99, "coverage"),
        (0.98, "coverage"),
        (0.5, "coverage"),
        (1.0, "coverage"),
        (None, "fixed"),
    ]
    assert arms["moira[mvar_top8]@0.98"]["pages_by_context"] == {
        "4096": [392, 400],
        "8192": [392, 400],
    }
    fixed = arms["fixed[mvar_top8]@reads(0.98)"]
    assert set(fixed["fixed_fraction_by_chunk"].values()) == {0.98}
    assert fixed["reads"] == pytest.approx(0.98)
    assert arms["moira[mvar_top8]@0.5"]["outputs"]["niah_single|4096|0"]["text"] == "no idea"
    assert arms["moira[mvar_top8]@0.99"]["outputs"]["niah_single|4096|0"]["text"] == "1000"


def test_run_budget_then_resume(tmp_path, suite):
    _, path = suite
    record = _run(tmp_path, path, "--chunk-tokens", "1", "--budget-s", "1e-9")
    assert not record["complete"]
    assert all(len(a["outputs"]) == 1 for a in record["arms"])  # one chunk, then stopped
    record = _run(tmp_path, path, "--resume", "--chunk-tokens", "5000")
    assert record["complete"] and "resumed_from" in record
    assert all(len(a["outputs"]) == 8 for a in record["arms"])
    assert record["arms"][1]["pages_by_context"] == {"4096": [392, 400], "8192": [392, 400]}
    with pytest.raises(SystemExit, match="--resume: .* has arms"):
        _run(tmp_path, path, "--resume", "--no-control")


def test_merge_pools_contexts_and_haystacks(tmp_path, suite, capsys):
    prompts, path = suite
    R.main(
        [
            "run",
            "--backend",
            "FLASH_ATTN",
            "--prompts",
            str(path),
            "--model",
            "m",
            "--out",
            str(tmp_path / "dense.json"),
        ]
    )
    _run(tmp_path, path)
    out = tmp_path / "merged.json"
    R.main(
        [
            "merge",
            str(tmp_path / "dense.json"),
            str(tmp_path / "moira.json"),
            "--prompts",
            str(path),
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    key = {(r["task"], r["context"], r["haystack"], r["label"]): r for r in rows}
    low = key[("all", 4096, None, "moira[mvar_top8]@0.5")]
    assert low["score"] == 0.0 and low["dense_score"] == 100.0 and low["docs"] == 4
    assert low["diff_vs_dense"] == -100.0 and low["diff_vs_dense_ci95"] == [-100.0, -100.0]
    assert low["reads"] == 0.5
    assert key[("all", 8192, "austen", "moira[mvar_top8]@0.5")]["docs"] == 2
    assert key[("all", 8192, "essays", "fixed[mvar_top8]@reads(0.98)")]["diff_vs_dense"] == 0.0
    assert key[("niah_single", 4096, None, "dense")]["reads"] is None
    printed = capsys.readouterr().out
    assert "moira[mvar_top8]@0.98 score=100.0 diff= +0.0 [+0.0, +0.0] reads=0.980" in printed


def test_combine_arms_adds_disjoint_records():
    a = {
        "arms": [
            {
                "label": "x",
                "arm": "moira",
                "gamma": 0.98,
                "outputs": {"d1": {"text": ""}},
                "pages_by_context": {"4096": [10, 20]},
            }
        ]
    }
    b = {
        "arms": [
            {
                "label": "x",
                "arm": "moira",
                "gamma": 0.98,
                "outputs": {"d2": {"text": ""}},
                "pages_by_context": {"4096": [5, 20], "8192": [1, 4]},
            }
        ]
    }
    (arm,) = R.combine_arms([a, b])
    assert set(arm["outputs"]) == {"d1", "d2"}
    assert arm["pages_by_context"] == {"4096": [15, 40], "8192": [1, 4]}
    assert a["arms"][0]["pages_by_context"] == {"4096": [10, 20]}  # inputs untouched


def test_help_lists_the_gpu_sequence(capsys):
    with pytest.raises(SystemExit):
        R.main(["--help"])
    text = capsys.readouterr().out
    assert "gpu_carry_model.py receive" in text and "--estimator mvar" in text


@pytest.mark.slow
def test_export_qwen_fits_the_contexts(tmp_path):
    """The Qwen suite's documents with the real tokenizer: every prompt plus the answer
    budget within its context, niah_multiquery's four numbers within the budget."""
    from pathlib import Path

    pytest.importorskip("transformers")
    model_dir = Path(R.REPO) / ".cache" / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    if not (model_dir / "tokenizer.json").is_file():
        pytest.skip("scripts/prepare_model.py --model qwen2.5-coder-1.5b has not been run")
    out = tmp_path / "prompts.json.gz"
    R.main(
        [
            "export",
            "--model",
            "qwen2.5-coder-1.5b",
            "--model-dir",
            str(model_dir),
            "--contexts",
            "4096",
            "--docs",
            "2",
            "--tasks",
            "niah_single",
            "niah_multiquery",
            "--haystacks",
            "austen",
            "mobydick",
            "--out",
            str(out),
        ]
    )
    data = R.load_json(out)
    assert data["max_new"] >= 4 * 7  # Qwen writes numbers digit by digit
    assert {d["sample"]["haystack"] for d in data["docs"]} == {"austen", "mobydick"}
    for d in data["docs"]:
        assert 3500 < len(d["prompt_token_ids"]) <= 4096 - data["max_new"]
        assert d["sample"]["context"] == 4096


def test_run_on_int4_summaries_labels_its_arms_apart(tmp_path, suite, monkeypatch):
    monkeypatch.setenv("MOIRA_SUMMARY_DTYPE", "int8")  # restored after the run sets it
    record = _run(tmp_path, suite[1], "--no-control", "--no-fixed", "--summary-dtype", "int4")
    assert [a["label"] for a in record["arms"]] == [
        "moira[int4:mvar_top8]@0.99",
        "moira[int4:mvar_top8]@0.98",
        "moira[int4:mvar_top8]@0.5",
    ]
