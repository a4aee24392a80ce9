#!/usr/bin/env python3
"""Page summaries written inside vLLM, checked against the keys (H200; not a test).

One MOIRA engine (dummy weights, block_size 64, FULL_AND_PIECEWISE CUDA graphs,
prefix caching off) prefills a few prompts together (chunked: steps with
decode and prefill rows) and decodes past several page boundaries, so pages
fill in all three places that write summaries: the writer kernel on prefill
tokens, Estimate in eager mixed steps, and Estimate in FULL-graph decode
steps. Then every layer's summaries are recomputed from the keys in its cache
(``moira_rpc.check_summaries``) and compared bit for bit, and the number of
summarized pages is compared with the pages the requests filled:
sum over requests of floor((prompt + generated - 1) / 64) per layer (the last
generated token's keys are never written). A page that filled during decode
and was not summarized makes that count fall short; one summarized from the
wrong keys differs beyond rounding; the writer and Estimate run on the same
warps, so the summaries should be equal bit for bit ("mismatched").

It also counts the Triton kernels compiled after the engine is ready (the
engine runs in this process): Moira's kernels are compiled at KV-cache bind
time (the writer), in the V2 runner's warm-up steps (``warmup_kernels``, real
prefill and decode steps before capture) and in graph capture, so none should
compile inside a request's step (there, a compilation stalls every running
request; seconds on a cold cache). ``--enforce-eager`` runs without CUDA
graphs, where only the warm-up steps run the decode kernels before the run.

``--kv-cache-dtype fp8``: the same on vLLM's fp8 KV cache (the summaries are
those of the dequantized keys, rebuilt from the e4m3 keys and the layer's
K scale).

    python benchmarks/summaries_in_vllm.py --out OUT.json [--enforce-eager]
        [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

MODEL_DEFAULT = "shared/gpu/models/Llama-3.1-8B"


class CompileLog:
    """Triton compilations (cache misses of a JIT function) with their wall time,
    through Triton's jit_cache_hook / jit_post_compile_hook."""

    def __init__(self) -> None:
        import triton

        self.knobs = triton.knobs.runtime
        self.events: list[dict] = []
        self.phase = "ready"
        self._started: dict[str, float] = {}

    def __enter__(self) -> CompileLog:
        self._saved = (self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook)
        self.knobs.jit_cache_hook = self._before
        self.knobs.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc: object) -> None:
        self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook = self._saved

    def _before(self, *, key, fn, **_):
        self._started[str(key)] = time.time()
        return None

    def _after(self, *, key, fn, **_):
        start = self._started.pop(str(key), time.time())
        self.events.append({"phase": self.phase, "kernel": fn.name,
                            "seconds": round(time.time() - start, 3)})  # fmt: skip
        return None

    def check_hook(self) -> bool:
        """Whether the hooks see a compilation: a kernel of a specialization
        new to this process (a fresh constexpr) is compiled and must appear."""
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def kernel_hook_check(out_ptr, VALUE: tl.constexpr):
            tl.store(out_ptr, VALUE)

        phase, self.phase = self.phase, "hook_check"
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        kernel_hook_check[(1,)](out, int(time.time()) % 100000 + 1)
        torch.cuda.synchronize()
        self.phase = phase
        return any(e["phase"] == "hook_check" for e in self.events)

    def moira(self, phase: str) -> list[dict]:
        return [e for e in self.events if e["phase"] == phase and "moira" in e["kernel"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=MODEL_DEFAULT)
    ap.add_argument("--prompt-lens", default="1000,1500,2100,700",
                    help="comma list of prompt lengths (not multiples of 64)")  # fmt: skip
    ap.add_argument("--gen", type=int, default=300, help="tokens generated per prompt")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024,
                    help="small, so prefills are chunked and mix with decode rows")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="vLLM's --kv-cache-dtype (fp8: e4m3, per-layer K/V scales)")  # fmt: skip
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs: every decode step runs the kernels eagerly, so only "
                         "the runner's warm-up steps compile them before the run")  # fmt: skip
    a = ap.parse_args()
    prompt_lens = [int(x) for x in a.prompt_lens.split(",") if x]

    # The check is a function sent to the worker (collective_rpc): vLLM's
    # msgpack transport needs pickle for it. In-process engine: nothing else
    # crosses a process boundary.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends import moira
    from vllm.v1.worker import moira_rpc

    graphs: dict = {"enforce_eager": True} if a.enforce_eager else {
        "compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                               "cudagraph_capture_sizes": [1, 2, 4]}}  # fmt: skip
    t_start = time.time()
    llm = LLM(
        model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        block_size=64, max_model_len=max(prompt_lens) + a.gen + 64,
        max_num_seqs=len(prompt_lens), max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=False, seed=0, attention_config={"backend": "MOIRA"},
        kv_cache_dtype=a.kv_cache_dtype,
        **graphs,
    )  # fmt: skip
    engine_s = time.time() - t_start
    print(f"engine ready in {engine_s:.0f} s", flush=True)
    # Whatever warmup and capture summarized (expected: nothing; seq_lens of
    # dummy steps stay below a page).
    compiles = CompileLog().__enter__()
    compiles.phase = "check_before_run"
    before = llm.collective_rpc(moira_rpc.check_summaries)
    print("before the run:", before, flush=True)
    compiles.phase = "generate"
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, size=n).tolist()}
               for n in prompt_lens]  # fmt: skip
    sp = SamplingParams(max_tokens=a.gen, min_tokens=a.gen, ignore_eos=True, temperature=0.0,
                        detokenize=False)  # fmt: skip
    t0 = time.time()
    outputs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.time() - t0
    hook_works = compiles.check_hook()
    compiles.__exit__()
    print("Triton compilations after engine start:", compiles.events, flush=True)
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    per_rank = llm.collective_rpc(moira_rpc.check_summaries)
    expected = sum(math.floor((p + g - 1) / 64) for p, g in zip(prompt_lens, generated))
    decode_filled = sum(math.floor((p + g - 1) / 64) - math.floor(p / 64)
                        for p, g in zip(prompt_lens, generated))  # fmt: skip
    result = per_rank[0]
    config = moira.moira_config_from_env()
    layers = max(result["layers"], 1)
    record = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "model": os.path.basename(a.model.rstrip("/")),
        "moira_env": {k: v for k, v in os.environ.items() if k.startswith("MOIRA_")},
        "estimator": config.estimator,
        "summary_dtype": config.summary_dtype,
        "kv_cache_dtype": a.kv_cache_dtype,
        "prompt_lens": prompt_lens,
        "generated": generated,
        "enforce_eager": a.enforce_eager,
        "engine_init_s": round(engine_s, 1),
        "generate_s": round(gen_s, 1),
        "before_run": before,
        "per_rank": per_rank,
        "expected_pages_per_layer": expected,
        "pages_filled_during_decode_per_layer": decode_filled,
        "summarized_pages_per_layer": result["pages"] / layers,
        "mismatched_pages": result["mismatched"],
        "pages_beyond_rounding": result["beyond_rounding"],
        "triton_compiles_after_ready": compiles.events,
        "moira_compiles_during_generate": compiles.moira("generate"),
        "compile_hook_works": hook_works,
    }
    # Pages summarized before the run (warmup, capture) would still count.
    record["passed"] = (
        result["layers"] > 0
        and result["mismatched"] == 0
        and result["pages"] == expected * result["layers"] + before[0]["pages"]
        and hook_works
        and not record["moira_compiles_during_generate"]
    )
    with open(a.out, "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "command"}), flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
