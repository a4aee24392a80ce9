# SPDX-License-Identifier: Apache-2.0
"""benchmarks/accuracy/kept_fraction.py on a tiny random Qwen2 model: the chunked capture
gives the same queries and keys as one dense pass, and the kept fraction follows the page
masses (one dominant page: the oracle keeps sink, that page and the current page)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.accuracy import harness as H
from benchmarks.accuracy import kept_fraction as K


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=H.register()
    )
    return model.eval()


def test_chunked_capture_equals_one_pass(tiny_model):
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    whole = {
        k: {n: t.clone() for n, t in v.items()}
        for k, v in K.capture(tiny_model, ids, 3, 10**6).items()
    }
    chunked = K.capture(tiny_model, ids, 3, 64)
    assert sorted(chunked) == [0, 1]
    for layer in (0, 1):
        assert chunked[layer]["k"].shape == (2, 300, 16)
        assert chunked[layer]["q"].shape == (4, 3, 16)
        for name in ("q", "k", "v"):
            torch.testing.assert_close(
                chunked[layer][name], whole[layer][name], atol=2e-3, rtol=2e-3
            )


def test_one_dominant_page_is_all_the_oracle_keeps():
    torch.manual_seed(0)
    keys = 0.1 * torch.randn(2, 64 * 6 + 5, 16)
    query = torch.zeros(4, 16)
    query[:, 0] = 1.0
    keys[:, 64 * 3 : 64 * 4, 0] = 6.0  # page 3 holds ~98% of the mass
    kept = K.kept_by_head(query, keys, 0.9, "oracle", 1.0)
    assert kept == [3 / 7, 3 / 7]  # sink, page 3, current page of 7
    assert K.kept_by_head(query, keys, 0.999, "oracle", 1.0)[0] > 3 / 7
    # mvar sees the same dominant page from the summaries
    assert K.kept_by_head(query, keys, 0.9, "mvar", 1.0) == [3 / 7, 3 / 7]


def test_cli_refuses_an_unknown_document_before_loading(tmp_path, capsys):
    from benchmarks.accuracy.run_accuracy_vllm import dump_json

    dump_json(tmp_path / "p.json.gz", {"docs": [{"id": "niah_single|16384|0"}]})
    with pytest.raises(SystemExit):
        K.main(
            [
                "--model-dir",
                str(tmp_path / "absent"),
                "--prompts",
                str(tmp_path / "p.json.gz"),
                "--doc-id",
                "niah_single|4096|0",
                "--out",
                str(tmp_path / "k.json"),
            ]
        )
    assert "--doc-id 'niah_single|4096|0' is not in" in capsys.readouterr().err
