"""Helpers for the MOIRA backend tests (CPU: tiny Llama config, hand-built batches)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "rope_theta": 10000.0,
}


def write_tiny_llama(directory: Path, **overrides) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return str(directory)


def moira_module():
    """The installed backend module (the overlay's moira.py inside vLLM)."""
    return importlib.import_module("vllm.v1.attention.backends.moira")


def make_vllm_config(model_dir: str, **engine_kwargs):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=1024,
        block_size=64,
        max_num_seqs=8,
        attention_backend="MOIRA",
    )
    kwargs.update(engine_kwargs)
    return EngineArgs(**kwargs).create_engine_config()
