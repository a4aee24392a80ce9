# SPDX-License-Identifier: Apache-2.0
"""benchmarks/yarn_dense.py's CPU parts: the YaRN overrides, the qualification rule, the
record check, the token packing and the prompts file round trip, the perplexity summary,
and the run_gpu.sh / serve.sh wiring (no GPU, no engine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks._load import ROOT, load

Y = load("yarn_dense")

QWEN = {
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
}


# ------------------------------------------------------------------ overrides
@pytest.mark.parametrize("factor", [2, 4, "4", 4.0])
def test_overrides_name_rope_parameters_with_the_models_theta(factor):
    ov = Y.yarn_overrides(factor, QWEN)
    f = int(float(factor))
    assert ov == {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": float(f),
            "original_max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
        },
        "max_position_embeddings": 32768 * f,
    }
    assert Y.engine_len(factor, QWEN) == 32768 * f
    json.dumps(ov)  # a valid --hf-overrides value


def test_overrides_of_the_unscaled_model_and_a_legacy_config():
    assert Y.yarn_overrides(1, QWEN) is None
    assert Y.engine_len(1, QWEN) == 32768
    legacy = {"max_position_embeddings": 8192, "rope_theta": 10000.0}
    ov = Y.yarn_overrides(2, legacy)
    assert ov["rope_parameters"]["rope_theta"] == 10000.0
    assert ov["max_position_embeddings"] == 16384


@pytest.mark.parametrize("factor", [0, 3, 8, -2, 2.5, "x", None, True])
def test_bad_factors_are_refused(factor):
    with pytest.raises(ValueError, match="must be one of"):
        Y.yarn_overrides(factor, QWEN)


def test_an_already_scaled_or_theta_less_config_is_refused():
    scaled = {**QWEN, "rope_parameters": {**QWEN["rope_parameters"], "rope_type": "yarn"}}
    with pytest.raises(ValueError, match="already scaled"):
        Y.yarn_overrides(4, scaled)
    with pytest.raises(ValueError, match="rope_theta"):
        Y.yarn_overrides(4, {"max_position_embeddings": 32768})


def test_overrides_command_prints_json_and_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    run = [sys.executable, str(ROOT / "benchmarks" / "yarn_dense.py"), "overrides",
           "--model", str(tmp_path), "--factor"]  # fmt: skip
    ok = subprocess.run([*run, "4"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    text, length = ok.stdout.strip().split("\n")
    assert json.loads(text) == Y.yarn_overrides(4, QWEN) and length == "131072"
    for bad in ("1", "3"):
        proc = subprocess.run([*run, bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "must be one of [2, 4]" in proc.stderr


# ------------------------------------------------------------------ verdicts
def _row(factor, length, single, multikey, docs=20):
    needle = {
        "niah_single": {"score": single, "docs": docs},
        "niah_multikey": {"score": multikey, "docs": docs},
        "all": {"score": (single + multikey) / 2, "docs": 2 * docs},
    }
    return {
        "arm": "unscaled" if factor == 1 else f"yarn_f{factor}",
        "factor": factor,
        "length": length,
        "hf_overrides": Y.yarn_overrides(factor, QWEN),
        "needle": needle,
        "ppl": {"ppl": 8.0, "tokens": 100},
    }


def test_qualify_is_within_ten_points_of_the_unscaled_32k_score():
    rows = [
        _row(1, 32768, 100, 90),  # baseline 95
        _row(2, 32768, 95, 95),
        _row(4, 65536, 85, 85),  # exactly 10 below: qualifies
        _row(4, 98304, 85, 84),  # 10.5 below: does not
        _row(2, 65536, 60, 60),
        {**_row(4, 131072, 0, 0), "needle": None},  # not measured
    ]
    verdict = Y.qualify(rows)
    assert verdict["baseline"] == 95
    assert [r["qualifies"] for r in rows] == [True, True, True, False, False, None]
    assert rows[3]["drop_vs_baseline"] == pytest.approx(10.5)
    assert verdict["by_length"] == {
        "32768": {"qualifies": True, "factors": [2]},
        "65536": {"qualifies": True, "factors": [4]},
        "98304": {"qualifies": False, "factors": []},
        "131072": {"qualifies": None, "factors": []},
    }


def test_without_the_baseline_nothing_qualifies_or_fails():
    rows = [_row(4, 32768, 90, 90)]
    verdict = Y.qualify(rows)
    assert verdict["baseline"] is None and rows[0]["qualifies"] is None
    assert verdict["by_length"]["32768"]["qualifies"] is None


# ------------------------------------------------------------------ record
def _part(factor, scores):
    by_length = {}
    for length, (single, multikey) in scores.items():
        row = _row(factor, length, single, multikey)
        by_length[str(length)] = {
            "needle": row["needle"],
            "outputs": {},
            "ppl": {"ppl": 7.5, "tokens": 10},
            "seconds": 1.0,
        }
    return {
        "factor": factor,
        "hf_overrides": Y.yarn_overrides(factor, QWEN),
        "max_model_len": Y.engine_len(factor, QWEN),
        "by_length": by_length,
    }


def test_merged_record_passes_its_check_and_catches_tampering():
    parts = [
        _part(4, {32768: (100, 100), 65536: (95, 90), 98304: (90, 70), 131072: (50, 40)}),
        _part(1, {32768: (100, 100)}),
        _part(2, {32768: (100, 95), 65536: (95, 95)}),
    ]
    record = Y.merge_parts(parts)
    assert Y.check_record(record) == []
    assert record["complete"] is True
    assert [(r["factor"], r["length"]) for r in record["rows"]][:3] == [
        (1, 32768), (2, 32768), (2, 65536)]  # fmt: skip
    assert record["verdict"]["by_length"]["131072"] == {"qualifies": False, "factors": []}
    assert record["verdict"]["by_length"]["98304"]["qualifies"] is False
    assert record["verdict"]["by_length"]["65536"] == {"qualifies": True, "factors": [2, 4]}

    bad = json.loads(json.dumps(record))
    bad["rows"][-1]["qualifies"] = True
    assert "verdict does not follow the rule" in Y.check_record(bad)
    bad = json.loads(json.dumps(record))
    bad["rows"][0]["hf_overrides"] = bad["rows"][1]["hf_overrides"]
    assert any("hf_overrides" in p for p in Y.check_record(bad))
    bad = json.loads(json.dumps(record))
    bad["rows"][1]["length"] = 131072  # factor 2 stops at 64k
    assert any("not an arm" in p for p in Y.check_record(bad))
    bad = json.loads(json.dumps(record))
    bad["rows"][2]["needle"]["all"]["docs"] = 3
    assert any("pooled docs" in p for p in Y.check_record(bad))

    partial = Y.merge_parts(parts[:2])
    assert partial["complete"] is False and Y.check_record(partial) == []


def test_needle_scores_per_task_and_pooled():
    samples = {
        "a": Y.D.Sample("niah_single", 32768, "", ["1234567"]),
        "b": Y.D.Sample("niah_single", 32768, "", ["7654321"]),
        "c": Y.D.Sample("niah_multikey", 32768, "", ["1111111"]),
    }
    got = Y.needle_scores(samples, {"a": "1234567.", "b": "nope", "c": "It is 1111111"})
    assert got == {
        "niah_single": {"score": 50.0, "docs": 2},
        "niah_multikey": {"score": 100.0, "docs": 1},
        "all": {"score": pytest.approx(200 / 3), "docs": 3},
    }


# ------------------------------------------------------------------ perplexity
class _Logprob:
    def __init__(self, value):
        self.logprob = value


def test_token_logprobs_from_dicts_and_ppl_summary():
    ids = [5, 6, 7, 8]
    prompt_logprobs = [None] + [{t: _Logprob(-0.5 * k)} for k, t in enumerate(ids[1:], 1)]
    assert Y.token_logprobs(prompt_logprobs, ids) == [-0.5, -1.0, -1.5]
    summary = Y.ppl_summary([[1.0, 2.0, 3.0], [1.0]], head=3, segment=2)
    assert summary["tokens"] == 4 and summary["ppl"] == pytest.approx(math.exp(7 / 4))
    # head=3: the first two predicted tokens of each window
    assert summary["ppl_head"] == pytest.approx(math.exp(4 / 3)) and summary["head_tokens"] == 3
    assert summary["nll_by_segment"] == [pytest.approx(4 / 3, abs=1e-4), 3.0]
    assert summary["nll_by_window"] == [2.0, 1.0]
    with pytest.raises(ValueError):
        Y.ppl_summary([[]], head=2)


def test_token_logprobs_from_vllm_flat_logprobs():
    logprobs = pytest.importorskip("vllm.logprobs")
    flat = logprobs.FlatLogprobs()
    ids = [10, 11, 12]
    flat.append(None)
    for k, t in enumerate(ids[1:], 1):
        flat.append({t: logprobs.Logprob(logprob=-float(k), rank=1, decoded_token=None)})
    assert Y.token_logprobs(flat, ids) == [-1.0, -2.0]


# ------------------------------------------------------------------ prompts file
def test_pack_round_trip_and_corruption():
    seqs = [[0, 1, 151935, 151645], [], [7] * 1000, list(range(50000, 50100))]
    blob = Y.pack_ids(seqs)
    assert blob["codec"] == Y.CODEC and blob["lengths"] == [4, 0, 1000, 100]
    assert Y.unpack_ids(json.loads(json.dumps(blob))) == seqs
    bad = dict(blob, sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        Y.unpack_ids(bad)
    with pytest.raises(ValueError, match="codec"):
        Y.unpack_ids(dict(blob, codec="gzip"))


def test_prompts_file_round_trip(tmp_path):
    docs = [
        {"id": f"niah_single|32768|{i}", "doc": i, "n_tokens": 3,
         "sample": {"task": "niah_single", "context": 32768, "prompt": "", "answers": ["1"],
                    "answer_prefix": "", "haystack": "essays"}}
        for i in range(2)
    ]  # fmt: skip
    prompts = {
        "format": Y.FORMAT,
        "lengths": [32768],
        "docs": docs,
        "doc_tokens": Y.pack_ids([[1, 2, 3], [4, 5, 6]]),
        "ppl_windows": [{"id": "ppl|0", "offset": 0, "n_tokens": 4}],
        "ppl_tokens": Y.pack_ids([[9, 8, 7, 6]]),
    }
    path = tmp_path / "p.json.gz"
    Y.RA.dump_json(path, prompts)
    got = Y.load_prompts(path)
    assert [d["prompt_token_ids"] for d in got["docs"]] == [[1, 2, 3], [4, 5, 6]]
    assert got["ppl_windows"][0]["token_ids"] == [9, 8, 7, 6]
    Y.RA.dump_json(path, {**prompts, "format": "other"})
    with pytest.raises(SystemExit, match="not a yarn_dense export"):
        Y.load_prompts(path)


def test_ppl_offsets_spread_over_the_haystack():
    assert Y.ppl_offsets(287721, 131008, 3) == [0, 78356, 156713]
    assert Y.ppl_offsets(100, 100, 1) == [0]
    with pytest.raises(ValueError):
        Y.ppl_offsets(10, 11, 2)


def test_prefill_flops_grow_quadratically():
    a, b = Y.prefill_flops(QWEN, 32768), Y.prefill_flops(QWEN, 131072)
    assert 4 < b / a < 16


def test_part_paths_sit_beside_the_record():
    assert Y.part_path("/o/yarn_dense.json", 4) == Path("/o/yarn_dense_f4.json")


# ------------------------------------------------------------------ shell wiring
def _run_gpu(tmp_path, *args):
    return subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "--out", str(tmp_path / "out"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_run_gpu_yarn_dense_needs_its_prompts_before_installing(tmp_path):
    (tmp_path / "model").mkdir()
    result = _run_gpu(tmp_path, "--acc-model", str(tmp_path / "model"), "--yarn-prompts",
                      str(tmp_path / "missing.json.gz"), "yarn-dense")  # fmt: skip
    assert result.returncode == 2 and "yarn-dense needs --yarn-prompts" in result.stderr
    assert not (tmp_path / "out").exists()


def test_run_gpu_yarn_dense_command(tmp_path):
    bin_dir, prefix = tmp_path / "bin", tmp_path / "prefix"
    bin_dir.mkdir()
    prefix.mkdir()
    calls = tmp_path / "calls.log"
    fake = bin_dir / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    (prefix / "env.sh").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (tmp_path / "y.json.gz").write_bytes(b"")
    (tmp_path / "model").mkdir()
    result = _run_gpu(
        tmp_path, "--no-install", "--prefix", str(prefix), "--step-timeout", "500",
        "--acc-model", str(tmp_path / "model"), "--yarn-prompts", str(tmp_path / "y.json.gz"),
        "yarn-dense", "yarn-dense:1,2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first, second = calls.read_text().splitlines()
    out = tmp_path / "out"
    assert first == (
        f"benchmarks/yarn_dense.py run --prompts {tmp_path / 'y.json.gz'} --model "
        f"{tmp_path / 'model'} --budget-s 470 --out {out}/yarn_dense.json"
    )
    assert "--factors 1 2 --budget-s 470" in second


def _serve(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOIRA_")}
    env["MOIRA_SKIP_GPU_CHECK"] = "1"
    return subprocess.run(["bash", str(ROOT / "scripts" / "serve.sh"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (("--yarn", "3", "/models/m"), "the factor must be 2 or 4"),
        (("/models/m", "--yarn=8"), "the factor must be 2 or 4"),
        (("/models/m", "--yarn"), "--yarn needs a factor"),
    ],
)
def test_serve_refuses_bad_yarn_factors_before_installing(tmp_path, args, message):
    result = _serve(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr
    assert "[build.sh]" not in result.stdout


# ------------------------------------------------------------------ the GPU steps, faked
class _Params:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Out:
    def __init__(self, text="", prompt_logprobs=None):
        self.outputs = [type("C", (), {"text": text})()]
        self.prompt_logprobs = prompt_logprobs


def _fake_vllm(monkeypatch, answers: dict, engines: list):
    """A stand-in vllm: answers every needle right except at 131072 tokens (wrong), and
    gives every perplexity token logprob -2 (-1 on the unscaled engine)."""
    import types

    class LLM:
        def __init__(self, **kw):
            engines.append(kw)
            self.kw = kw

        def generate(self, prompts, params, use_tqdm=False):
            outs = []
            for p in prompts:
                ids = p["prompt_token_ids"]
                if getattr(params, "prompt_logprobs", None) is not None:
                    lp = -1.0 if not self.kw["hf_overrides"] else -2.0
                    outs.append(_Out(prompt_logprobs=[None] + [{t: _Logprob(lp)} for t in ids[1:]]))
                else:
                    outs.append(_Out("wrong" if ids[0] == 131072 else answers[tuple(ids)]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, _Params
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def _tiny_prompts(tmp_path) -> tuple[Path, dict]:
    docs, ids, answers = [], [], {}
    for length in Y.LENGTHS:
        for task in Y.TASKS:
            for i in range(2):
                seq = [length, i, len(docs)]
                answers[tuple(seq)] = f"{1000000 + len(docs)}"
                docs.append({"id": f"{task}|{length}|{i}", "doc": i, "n_tokens": 3,
                             "sample": {"task": task, "context": length, "prompt": "",
                                        "answers": [answers[tuple(seq)]],
                                        "answer_prefix": "", "haystack": "essays"}})  # fmt: skip
                ids.append(seq)
    prompts = {
        "format": Y.FORMAT, "lengths": list(Y.LENGTHS), "tasks": list(Y.TASKS),
        "stop_token_ids": [2], "max_new": 15, "ppl_reserve": 64,
        "docs": docs, "doc_tokens": Y.pack_ids(ids),
        "ppl_windows": [{"id": f"ppl|{w}", "offset": w, "n_tokens": 9} for w in range(2)],
        "ppl_tokens": Y.pack_ids([list(range(w, w + 9)) for w in range(2)]),
    }  # fmt: skip
    path = tmp_path / "prompts.json.gz"
    Y.RA.dump_json(path, prompts)
    return path, answers


def test_run_writes_parts_then_the_merged_record_and_resumes(tmp_path, monkeypatch):
    path, answers = _tiny_prompts(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN))
    engines: list = []
    _fake_vllm(monkeypatch, answers, engines)
    # the children run in-process
    monkeypatch.setattr(Y.subprocess, "call", lambda cmd: Y.main(cmd[2:]) or 0)
    out = tmp_path / "out" / "yarn_dense.json"
    argv = ["run", "--prompts", str(path), "--model", str(model), "--out", str(out)]
    Y.main(argv)
    assert [e["max_model_len"] for e in engines] == [32768, 65536, 131072]
    assert [e["hf_overrides"] for e in engines] == [
        {},
        *(Y.yarn_overrides(f, QWEN) for f in (2, 4)),
    ]
    assert all(e["attention_backend"] == "FLASH_ATTN" and not e["enable_prefix_caching"]
               and e["enforce_eager"] for e in engines)  # fmt: skip
    record = Y.RA.load_json(out)
    assert Y.check_record(record) == [] and record["complete"] is True
    rows = {(r["factor"], r["length"]): r for r in record["rows"]}
    assert len(rows) == 7 and rows[(4, 131072)]["needle"]["all"] == {"score": 0.0, "docs": 4}
    assert rows[(2, 65536)]["needle"]["all"] == {"score": 100.0, "docs": 4}
    assert rows[(1, 32768)]["ppl"]["ppl"] == pytest.approx(math.e)
    assert rows[(4, 98304)]["ppl"]["ppl"] == pytest.approx(math.e**2)
    assert record["verdict"]["by_length"] == {
        "32768": {"qualifies": True, "factors": [2, 4]},
        "65536": {"qualifies": True, "factors": [2, 4]},
        "98304": {"qualifies": True, "factors": [4]},
        "131072": {"qualifies": False, "factors": []},
    }
    # Every part complete: a second run starts no engine.
    Y.main(argv)
    assert len(engines) == 3
    # A part missing a length: only that factor's engine starts again, for that length.
    part = Y.RA.load_json(Y.part_path(out, 4))
    del part["by_length"]["131072"]
    Y.RA.dump_json(Y.part_path(out, 4), part)
    Y.main(argv)
    assert len(engines) == 4 and engines[-1]["max_model_len"] == 131072
    assert Y.RA.load_json(out)["complete"] is True


def test_serve_adds_the_overrides_and_length(tmp_path):
    # python3 is a stand-in (as in tests/plugin/test_serve_sh.py): the test interpreter,
    # printing the vllm command instead of serving.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "python3"
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -m && "$2" == vllm.entrypoints.cli.main ]]; then echo "RAN $*"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    stand_in.chmod(0o755)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOIRA_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", MOIRA_SKIP_GPU_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serve.sh"), str(model), "--yarn", "4", "--port", "8011"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = next(line for line in proc.stdout.splitlines() if line.startswith("RAN "))
    words = ran.split()
    overrides = json.loads(words[words.index("--hf-overrides") + 1])
    assert overrides == Y.yarn_overrides(4, QWEN)
    assert words[words.index("--max-model-len") + 1] == "131072"
    assert words[-2:] == ["--port", "8011"] and "--yarn" not in words
