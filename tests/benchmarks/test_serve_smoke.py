# SPDX-License-Identifier: Apache-2.0
"""Offline parts of benchmarks/serve_smoke.py: arguments, prompt, gauge, dense file (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

from _load import ROOT, load

smoke = load("serve_smoke")

METRICS = """# HELP vllm:moira_page_read_fraction Attention backend stat moira_page_read_fraction
# TYPE vllm:moira_page_read_fraction gauge
vllm:moira_page_read_fraction{engine="0",model_name="m"} 0.4375
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_import_is_gpu_free():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import benchmarks.serve_smoke; "
        "bad = [m for m in ('torch', 'vllm', 'triton') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arguments():
    args = smoke.build_parser().parse_args(["--out", "x.json"])
    assert (args.backend, args.gamma_check, args.gamma_values) == ("MOIRA", False, [1.0, 0.9])
    assert args.dense_output is None
    args = smoke.build_parser().parse_args(
        ["--out", "x.json", "--backend", "flash_attn", "--gamma-check",
         "--gamma-values", "1,0.8,0.5", "--dense-output", "d.json"]
    )  # fmt: skip
    assert (args.backend, args.gamma_check, args.gamma_values) == (
        "FLASH_ATTN",
        True,
        [1.0, 0.8, 0.5],
    )
    assert args.dense_output == "d.json"


def test_long_prompt_is_deterministic_and_long():
    prompt = smoke.long_prompt(600)
    assert prompt == smoke.long_prompt(600)
    assert prompt.count("Fact ") == 600 and len(prompt.split()) > 8192 // 2


def test_read_gauge():
    assert smoke.read_gauge(METRICS) == 0.4375
    assert smoke.read_gauge("vllm:moira_page_read_fraction 1.0\n") == 1.0
    assert smoke.read_gauge("vllm:other 1\n") is None


def test_dense_output_from_json_record_or_text(tmp_path):
    record = tmp_path / "dense.json"
    record.write_text(json.dumps({"gamma_check": {"dense_text": " 42, and"}}))
    assert smoke.load_dense_text(str(record)) == " 42, and"
    plain = tmp_path / "dense.txt"
    plain.write_text(" 42, and")
    assert smoke.load_dense_text(str(plain)) == " 42, and"


def test_informative_checks_on_dummy_and_real_weights():
    # Dummy weights tie every page, so a smaller gamma cannot read less there;
    # on real (or random-init) weights it must.
    assert smoke.informative_checks("dummy") == {"batch_independent", "smaller_gamma_reads_less"}
    assert smoke.informative_checks("auto") == {"batch_independent"}
    # A prompt the backend reads whole at batch 1: gamma cannot change the reads.
    assert smoke.informative_checks("auto", rows_read_whole=True) == {
        "batch_independent",
        "smaller_gamma_reads_less",
    }


def test_dense_batch_tokens_is_the_servers_threshold(monkeypatch):
    from benchmarks import serve_smoke as smoke

    monkeypatch.delenv("MOIRA_DENSE_BATCH_TOKENS", raising=False)
    assert smoke.dense_batch_tokens() == 36864  # the backend default
    monkeypatch.setenv("MOIRA_DENSE_BATCH_TOKENS", "0")
    assert smoke.dense_batch_tokens() == 0
