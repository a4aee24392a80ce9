# SPDX-License-Identifier: Apache-2.0
"""The RULER-style suite in vLLM on the GPU: MOIRA arms against FLASH_ATTN (dense).

The CPU harness (``run_accuracy.py``) decodes through the float32 reference and also
measures token KL; here the same kind of documents run through vLLM with real weights
(``scripts/prepare_model.py``: SmolLM2-135M at 2k-8k, Qwen2.5-Coder-1.5B at 4k-32k). vLLM
prefills with FA3 (dense), so rows carry scores and reads; ``kl`` is null.

Three steps:

1. ``export`` (CPU, where the tokenizer and the haystacks are): every document as
   chat-template token ids plus its expected answers (``.json`` or ``.json.gz``). The
   model's defaults: ``smollm2-135m`` 2k/4k/8k, five tasks, the essays;
   ``qwen2.5-coder-1.5b`` 4k/8k/16k/32k, six tasks (``data.LONG_TASKS``, with
   niah_multiquery), documents alternating between the essays and Jane Austen. Twenty
   documents per task and context. The answer budget (``max_new``) is the longest answer in
   the model's tokens plus 8; every prompt plus that budget fits its context.

2. ``run`` (GPU host, vLLM 0.30 with Moira built in), one engine per backend and estimator,
   greedy. ``--backend FLASH_ATTN``: the dense arm. ``--backend MOIRA``: coverage arms at
   each ``--gammas`` value (default 0.99 0.98 0.95; a request's own gamma, SamplingParams
   ``extra_args={"moira_gamma": g}``), gamma 1 (``--control``: every page, the bf16 noise
   floor against FLASH_ATTN), then the fixed-count selector (switched in place with
   ``moira_rpc.set_selector``) at the read fraction that the ``--fixed-at`` arm (0.98) measured
   on the same documents. The estimator is fixed when the KV cache is allocated
   (``--estimator`` sets ``MOIRA_ESTIMATOR``), so the paper's ``mvar`` is its own engine:
   ``--estimator mvar --gammas 0.99 0.98 --no-control --no-fixed`` (and ``--summary-dtype
   int4`` likewise, its arms labelled ``moira[int4:mvar_top8]@g``). Documents run in
   chunks of one context (``--chunk-tokens``) and every arm runs on a chunk before the next
   chunk: with prefix caching (on by default) the later arms reuse the first arm's prefill,
   so an arm costs little more than its decode steps. Reads: Select's counters, reset
   before every arm and chunk (``MOIRA_DENSE_BATCH_TOKENS=0``: every row follows its arm's
   rule). The record is rewritten after every chunk; ``--budget-s`` stops after the chunk
   that would leave less time than the slowest chunk took (``"complete": false``), and
   ``--resume`` continues such a record. ``--kv-cache-dtype fp8`` runs either backend on
   vLLM's fp8 KV cache (e4m3, per-layer K/V scales); ``merge`` compares runs of one KV dtype.

3. ``merge`` (anywhere): scores, the paired bootstrap (95%, by document) of each arm
   against dense per (task, context), pooled per context, and pooled per context and
   haystack; reads per arm and context.

The ``suite`` step runs the three engines (dense, MOIRA default, MOIRA ``mvar``) side by
side on one GPU, each with a fixed KV cache (``--kv-cache-memory-gib``) and its own compile
cache, and merges their records into ``accuracy.json``.

The Qwen2.5-Coder-1.5B run on one H200 is a chain of device calls that follow each other
at once (the pieces must all reach one machine: it stays warm 30 s after a call and goes
back after 30 minutes held). Work that needs no new transfer runs in the background
(``setsid``), so the transfers overlap it. ``C`` is ``.stage/carry/qwen2.5-coder-1.5b``::

    # here (CPU, network once; done and cached under .cache/ and .stage/):
    python scripts/prepare_model.py --model qwen2.5-coder-1.5b --gguf-only  # 1.1 GB, sha256
    python -m benchmarks.accuracy.data fetch                                # haystacks
    python -m benchmarks.accuracy.run_accuracy_vllm export --model qwen2.5-coder-1.5b \\
        --out .stage/accuracy_qwen/prompts.json.gz                # 480 documents, 21 MiB
    python scripts/gpu_carry_model.py split   # 20 pieces of 55 MiB; prints every carry list
    # call 1, carry [.stage/vllm030, .shared, C/manifest.json, C/wheels]:
    #   bash .shared/gpu/install_vllm_bundle.sh .stage/vllm030 /opt/vllm030 &&
    #   source /opt/vllm030/env.sh && bash build.sh --use-active-env
    # calls 2-20, carry [C/manifest.json, C/piece_NN] for NN = 01..19, ~20-30 s each:
    #   python3 scripts/gpu_carry_model.py receive
    # call 21, carry [C/manifest.json, C/piece_20, .stage/accuracy_qwen]:
    #   python3 scripts/gpu_carry_model.py receive && python3 scripts/gpu_carry_model.py
    #   assemble && mkdir -p /root/acc && cp .stage/accuracy_qwen/prompts.json.gz /root/acc/ &&
    #   source /opt/vllm030/env.sh && setsid nohup python -m benchmarks.accuracy.run_accuracy_vllm
    #   suite --model /root/moira-model/qwen2.5-coder-1.5b/hf --prompts /root/acc/prompts.json.gz
    #   --out-dir /root/acc/suite >/root/acc/suite.log 2>&1 &
    # then calls that wait and look (sleep 90; tail /root/acc/suite/*.log) until it exits,
    # each copying /root/acc/suite/*.json to $OUT: a machine can go back between calls, and
    # what is not under $OUT then is lost
    # a record that came back with "complete": false: the suite again with --resume
    # here: python -m benchmarks.accuracy.run_accuracy_vllm merge dense.json moira.json \\
    #   moira_mvar.json --prompts .stage/accuracy_qwen/prompts.json.gz --out RESULT.json

Measured on one H200 (7.3M prompt tokens): call 1 about 10 s after the machine's start,
each piece's call about 6 s, ``assemble`` 75-90 s, and the suite 330 s (every engine's start
about 120 s of it, side by side): about 11 minutes of device time in all.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import data as D  # noqa: E402
from benchmarks.accuracy.run_accuracy import bootstrap  # noqa: E402

GAMMAS = (0.99, 0.98, 0.95)
#: The coverage arm whose measured reads the fixed-count arm matches.
FIXED_AT = 0.98
#: gamma = 1 keeps every page: dense attention through Moira's kernels. Its
#: score difference to FLASH_ATTN is the run-to-run noise of bf16 rounding
#: alone (different kernels, same math), the floor for the sparse arms' gaps.
CONTROL_GAMMA = 1.0
#: Suite defaults per model (scripts/prepare_model.py's keys).
SUITES = {
    # Every document is generated `reserve` tokens short of its context, so that the chat
    # template and the answer budget (the longest answer of any task, e.g. common_words'
    # list) fit: SmolLM2's niah_single prompt alone comes to 2,026 of 2,048 tokens.
    "smollm2-135m": {
        "contexts": [2048, 4096, 8192],
        "tasks": D.TASKS,
        "haystacks": ["essays"],
        "reserve": 32,
    },
    # Qwen's chat template (with its default system prompt) and its digit-by-digit numbers
    # need room: the documents are generated 64 tokens short of each context.
    "qwen2.5-coder-1.5b": {
        "contexts": [4096, 8192, 16384, 32768],
        "tasks": D.LONG_TASKS,
        "haystacks": ["essays", "austen"],
        "reserve": 64,
    },
    "qwen2.5-coder-0.5b": {  # the fallback model: the same suite
        "contexts": [4096, 8192, 16384, 32768],
        "tasks": D.LONG_TASKS,
        "haystacks": ["essays", "austen"],
        "reserve": 64,
    },
}
PAGE = 64


def load_json(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def dump_json(path: str | Path, obj: dict, indent: int | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(obj, indent=indent) + "\n").encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(text, 6, mtime=0) if path.suffix == ".gz" else text)
    tmp.replace(path)


def _prepare_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prepare_model", REPO / "scripts" / "prepare_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------
def answer_budget(tok, samples) -> int:
    """Tokens to generate: the longest answer list in this tokenizer, plus 8 (at least 12)."""
    longest = max(
        len(tok(", ".join(s.answers), add_special_tokens=False)["input_ids"]) for s in samples
    )
    return max(12, longest + 8)


def build_docs(
    tok, contexts, tasks, haystacks, reserve: int, n_docs: int
) -> tuple[list[dict], int]:
    """``export``'s documents (``{"id", "doc", "sample", "prompt_token_ids"}``: the chat
    template's token ids, each document generated ``reserve`` tokens short of its context)
    and the answer budget ``max_new``; every prompt plus that budget fits its context."""
    from benchmarks.accuracy import harness as H

    t0 = time.time()
    samples = []
    for ctx in contexts:
        for task in tasks:
            generated = D.ruler_samples(tok, task, ctx - reserve, n_docs, haystacks=haystacks)
            for doc, sample in enumerate(generated):
                sample.context = ctx  # the nominal context (the row it is reported under)
                samples.append((f"{task}|{ctx}|{doc}", doc, sample))
            print(f"[export {time.time() - t0:.0f}s] {task} {ctx}", file=sys.stderr, flush=True)
    max_new = answer_budget(tok, [s for _, _, s in samples])
    docs = []
    for doc_id, doc, sample in samples:
        ids = H.chat_ids(tok, sample.prompt, sample.answer_prefix)[0].tolist()
        if len(ids) + max_new > sample.context:
            raise SystemExit(
                f"export: {doc_id}: {len(ids)} prompt tokens + {max_new} to "
                f"generate exceed the context {sample.context}"
            )
        docs.append({"id": doc_id, "doc": doc, "sample": asdict(sample), "prompt_token_ids": ids})
    return docs, max_new


def export(args) -> None:
    from transformers import AutoTokenizer

    prepare = _prepare_module()
    suite = SUITES[args.model]
    contexts = args.contexts or suite["contexts"]
    tasks = args.tasks or suite["tasks"]
    haystacks = args.haystacks or suite["haystacks"]
    reserve = suite["reserve"] if args.reserve is None else args.reserve
    model_dir = Path(args.model_dir) if args.model_dir else prepare.prepare(model=args.model)
    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs, max_new = build_docs(tok, contexts, tasks, haystacks, reserve, args.docs)
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    spec = prepare.MODELS[args.model]
    out = {
        "command": "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:]),
        "model": args.model,
        "model_name": spec.name,
        "tokenizer": spec.name,
        "haystacks": haystacks,
        "reserve": reserve,
        "stop_token_ids": stop,
        "max_new": max_new,
        "max_model_len": max(contexts),
        "docs": docs,
    }
    dump_json(args.out, out)
    longest = max(len(d["prompt_token_ids"]) for d in docs)
    print(
        f"wrote {args.out}: {len(docs)} documents, longest prompt {longest} tokens, "
        f"max_new {max_new}"
    )


# --------------------------------------------------------------------------
# run (GPU)
# --------------------------------------------------------------------------
def arm_label(arm: dict) -> str:
    """``dense``, ``moira[EST]@GAMMA`` or ``fixed[EST]@reads(GAMMA)`` (older records: the
    arm's name and gamma)."""
    if arm.get("label"):
        return arm["label"]
    return arm["arm"] if arm.get("gamma") is None else f"{arm['arm']}@{arm['gamma']}"


def plan_arms(
    backend: str, estimator: str | None, gammas, control: bool, fixed_at: float | None
) -> list[dict]:
    """The arms one engine runs, in order (the fixed-count arm after the arm it matches)."""
    if backend == "FLASH_ATTN":
        return [
            {"label": "dense", "arm": "dense", "gamma": None, "selector": None, "estimator": None}
        ]
    if fixed_at is not None and fixed_at not in gammas:
        raise SystemExit(
            f"--fixed-at {fixed_at} must be one of --gammas {list(gammas)} "
            "(the fixed-count arm matches that arm's reads), or --no-fixed"
        )
    if len(set(gammas)) != len(gammas) or not all(0.0 < g < 1.0 for g in gammas):
        raise SystemExit(
            f"--gammas must be distinct values in (0, 1), got {list(gammas)} "
            "(gamma 1 is the --control arm)"
        )
    arms = [
        {
            "label": f"moira[{estimator}]@{g}",
            "arm": "moira",
            "gamma": g,
            "selector": "coverage",
            "estimator": estimator,
        }
        for g in gammas
    ]
    if control:
        arms.append(
            {
                "label": f"moira[{estimator}]@{CONTROL_GAMMA}",
                "arm": "moira",
                "gamma": CONTROL_GAMMA,
                "selector": "coverage",
                "estimator": estimator,
            }
        )
    if fixed_at is not None:
        arms.append(
            {
                "label": f"fixed[{estimator}]@reads({fixed_at})",
                "arm": "fixed_k",
                "gamma": None,
                "selector": "fixed",
                "estimator": estimator,
                "matches": fixed_at,
                "fixed_fraction_by_chunk": {},
            }
        )
    return arms


def make_chunks(docs: list[dict], chunk_tokens: int) -> list[list[dict]]:
    """Documents by context (ascending), cut into runs of at most ``chunk_tokens`` prompt
    tokens (at least one document each), in export order."""
    chunks = []
    for ctx in sorted({d["sample"]["context"] for d in docs}):
        current, tokens = [], 0
        for d in (d for d in docs if d["sample"]["context"] == ctx):
            n = len(d["prompt_token_ids"])
            if current and tokens + n > chunk_tokens:
                chunks.append(current)
                current, tokens = [], 0
            current.append(d)
            tokens += n
        if current:
            chunks.append(current)
    return chunks


def _generate(
    llm, docs: list[dict], stop: list[int], max_new: int, gamma: float | None = None
) -> dict[str, dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"extra_args": {"moira_gamma": gamma}} if gamma is not None else {}
    params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=stop, **extra)
    inputs = [TokensPrompt(prompt_token_ids=d["prompt_token_ids"]) for d in docs]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return {
        d["id"]: {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
        for d, o in zip(docs, outputs)
    }


def _engine_len(prompts: dict, docs: list[dict], max_new: int) -> int:
    longest = max(len(d["prompt_token_ids"]) for d in docs) + max_new
    return max(prompts.get("max_model_len") or 0, math.ceil(longest / PAGE) * PAGE)


def run(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: collective_rpc
    if args.backend == "MOIRA":
        os.environ["MOIRA_DENSE_BATCH_TOKENS"] = "0"
        if args.estimator:
            os.environ["MOIRA_ESTIMATOR"] = args.estimator
        if args.summary_dtype:
            os.environ["MOIRA_SUMMARY_DTYPE"] = args.summary_dtype
    t_start = time.time()
    prompts = load_json(args.prompts)
    docs = [
        d for d in prompts["docs"] if not args.contexts or d["sample"]["context"] in args.contexts
    ]
    if not docs:
        raise SystemExit(f"run: no documents at --contexts {args.contexts}")
    max_new = args.max_new or prompts.get("max_new", 12)
    stop = prompts["stop_token_ids"]
    moira = moira_rpc = None
    estimator = None
    if args.backend == "MOIRA":
        from vllm.v1.attention.backends import moira
        from vllm.v1.worker import moira_rpc

        config = moira.moira_config_from_env()
        # Arms of an engine on int4 summaries are labelled apart
        # ("moira[int4:mvar_top8]@0.99"), as the estimator study names them.
        estimator = config.estimator
        if config.summary_dtype == "int4":
            estimator = f"int4:{estimator}"
    arms = plan_arms(
        args.backend, estimator, args.gammas, args.control, None if args.no_fixed else args.fixed_at
    )
    command = "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:])
    record = {
        "command": command,
        "backend": args.backend,
        "model": args.model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_new": max_new,
        "prefix_caching": not args.no_prefix_cache,
        "complete": False,
        "arms": arms,
    }
    done: set[str] = set()
    if args.resume and Path(args.out).is_file():
        old = load_json(args.out)
        by_label = {arm_label(a): a for a in old["arms"]}
        if [a["label"] for a in arms] != list(by_label):
            raise SystemExit(
                f"--resume: {args.out} has arms {list(by_label)}, this run "
                f"{[a['label'] for a in arms]}"
            )
        record["arms"] = arms = [by_label[a["label"]] for a in arms]
        done = set.intersection(*(set(a["outputs"]) for a in arms))
        record["resumed_from"] = old["command"]
    for arm in arms:
        arm.setdefault("outputs", {})
        arm.setdefault("pages_by_context", {})
        arm.setdefault("seconds", 0.0)
    todo = [d for d in docs if d["id"] not in done]
    chunks = make_chunks(todo, args.chunk_tokens)

    from vllm import LLM

    t0 = time.time()
    llm = LLM(
        model=args.model,
        attention_backend=args.backend,
        dtype="bfloat16",
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=PAGE,
        max_model_len=_engine_len(prompts, docs, max_new),
        seed=0,
        enable_prefix_caching=not args.no_prefix_cache,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **_kv_memory_kwargs(args.kv_cache_memory_gib),
    )
    record["engine_start_s"] = round(time.time() - t0, 1)
    if moira is not None:
        # The engine's settings (estimator, summary storage, ...) say what made the record.
        record["moira_config"] = asdict(moira.moira_config_from_env())
    slowest = 0.0
    for n, chunk in enumerate(chunks):
        t_chunk = time.time()
        ctx = chunk[0]["sample"]["context"]
        key = f"{ctx}:{chunk[0]['id']}"
        reads: dict[float, float] = {}
        for arm in arms:
            t_arm = time.time()
            gamma = None
            if moira_rpc is not None:
                if arm["selector"] == "fixed":
                    fraction = reads[arm["matches"]]
                    arm["fixed_fraction_by_chunk"][key] = fraction
                    changes = dict(selector="fixed", fixed_fraction=fraction, fixed_pages=None)
                else:  # the request's own gamma (moira_gamma) decides
                    changes = dict(selector="coverage", fixed_fraction=None, fixed_pages=None)
                    gamma = arm["gamma"]
                llm.collective_rpc(moira_rpc.set_selector, kwargs=changes)
                llm.collective_rpc(moira_rpc.read_stats, kwargs={"reset": True})
            arm["outputs"].update(_generate(llm, chunk, stop, max_new, gamma))
            if moira_rpc is not None:
                kept, total = llm.collective_rpc(moira_rpc.read_stats)[0]
                if not total:
                    raise RuntimeError(f"{arm['label']}: Select counted no pages on {key}")
                old = arm["pages_by_context"].get(str(ctx), [0, 0])
                arm["pages_by_context"][str(ctx)] = [old[0] + kept, old[1] + total]
                if arm["selector"] == "coverage":
                    reads[arm["gamma"]] = kept / total
            arm["seconds"] += time.time() - t_arm
        for arm in arms:
            pages = arm["pages_by_context"].values()
            kept, total = sum(p[0] for p in pages), sum(p[1] for p in pages)
            arm["reads"] = kept / total if total else None
        took = time.time() - t_chunk
        slowest = max(slowest, took)
        record["seconds"] = round(time.time() - t_start, 1)
        left = len(chunks) - n - 1
        record["complete"] = left == 0
        dump_json(args.out, record)
        print(
            f"[{args.backend} {record['seconds']:.0f}s] chunk {n + 1}/{len(chunks)} ctx {ctx} "
            f"{len(chunk)} docs {took:.0f}s reads "
            f"{ {g: round(r, 3) for g, r in reads.items()} }",
            flush=True,
        )
        if left and args.budget_s and time.time() - t_start + slowest > args.budget_s:
            print(
                f"stopping: {left} chunks left within --budget-s {args.budget_s} "
                "(run again with --resume)",
                flush=True,
            )
            break
    if not chunks:
        record["complete"] = True
        dump_json(args.out, record)
    print(f"wrote {args.out} (complete: {record['complete']})")


def _kv_memory_kwargs(gib: float) -> dict:
    return {"kv_cache_memory_bytes": int(gib * 2**30)} if gib > 0 else {}


# --------------------------------------------------------------------------
# suite: every engine at once on one GPU
# --------------------------------------------------------------------------
# The suite's engines (record name -> ``run`` arguments). A 1.5B model leaves most of an
# H200 idle, and each engine spends minutes starting (compile, graph capture) on the CPU;
# run side by side they share the GPU for the prefills and overlap their starts, so the
# three cost little more than the slowest one.
SUITE_ENGINES: dict[str, list[str]] = {
    "dense": ["--backend", "FLASH_ATTN"],
    "moira": ["--backend", "MOIRA"],
    "moira_mvar": [
        "--backend", "MOIRA", "--estimator", "mvar", "--gammas", "0.99", "0.98",
        "--no-control", "--no-fixed",
    ],
    # The default estimator on int4 summaries (4-bit stored keys: 7/256 of the KV cache).
    "moira_int4": [
        "--backend", "MOIRA", "--summary-dtype", "int4", "--gammas", "0.99", "0.98",
        "--no-control", "--no-fixed",
    ],
}  # fmt: skip


DEFAULT_SUITE_ENGINES = ("dense", "moira", "moira_mvar")
#: What the engines' KV caches may take together: at most 90 GiB (three engines at the
#: 30 GiB default beside their weights on one H200) and at most this share of the GPU's
#: memory (the rest is weights, activations and graphs; 78 GiB H100s take 47 GiB).
SUITE_KV_CACHE_GIB = 90.0
SUITE_KV_CACHE_SHARE = 0.6
SUITE_DEFAULT_KV_CACHE_GIB = 30.0
SUITE_DEFAULT_CHUNK_TOKENS = 800_000


def suite_kv_total_gib() -> float:
    """The engines' KV caches together (GiB): SUITE_KV_CACHE_GIB, less on a smaller GPU.
    The GPU's memory comes from NVML (vLLM's vendored pynvml), which opens no CUDA context
    in this process, whose engines need that memory; no GPU or no NVML: the H200's 90."""
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # ImportError, NVMLError: no GPU to size for
        return SUITE_KV_CACHE_GIB
    return min(SUITE_KV_CACHE_GIB, round(SUITE_KV_CACHE_SHARE * total, 1))


def suite_kv_sizes(args: argparse.Namespace, total_gib: float | None = None) -> tuple[float, int]:
    """Each engine's KV cache (GiB) and chunk (prompt tokens): the options where given,
    else 30 GiB and 800,000 tokens, both scaled down where the engines' caches together
    would exceed ``total_gib`` (suite_kv_total_gib; the chunk must stay within the cache,
    or later arms find their prefill evicted)."""
    if total_gib is None:
        total_gib = suite_kv_total_gib()
    scale = min(1.0, total_gib / SUITE_DEFAULT_KV_CACHE_GIB / len(args.engines))
    kv_gib = args.kv_cache_memory_gib or round(SUITE_DEFAULT_KV_CACHE_GIB * scale, 2)
    chunk = args.chunk_tokens or int(SUITE_DEFAULT_CHUNK_TOKENS * scale)
    return kv_gib, chunk


def suite_commands(
    args: argparse.Namespace, total_gib: float | None = None
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each engine's ``run`` command line and its extra environment. Every engine gets its
    own compile cache (``VLLM_CACHE_ROOT``): two engines of one model whose configs hash
    alike (MOIRA with two estimators) would otherwise write one cache entry at once."""
    out_dir = Path(args.out_dir)
    # Engines side by side: a share of the GPU each, and the KV cache sized, not profiled.
    share = round(min(0.9 / len(args.engines), 0.85), 2)
    kv_gib, chunk = suite_kv_sizes(args, total_gib)
    commands = {}
    for name in args.engines:
        cmd = [
            sys.executable, "-m", "benchmarks.accuracy.run_accuracy_vllm", "run",
            *SUITE_ENGINES[name],
            "--prompts", args.prompts, "--model", args.model,
            "--kv-cache-dtype", args.kv_cache_dtype,
            "--gpu-memory-utilization", str(share),
            "--kv-cache-memory-gib", str(kv_gib),
            "--chunk-tokens", str(chunk),
            "--out", str(out_dir / f"{name}.json"),
        ]  # fmt: skip
        if args.contexts:
            cmd += ["--contexts", *map(str, args.contexts)]
        if args.budget_s:
            cmd += ["--budget-s", str(args.budget_s)]
        if args.resume:
            cmd.append("--resume")
        env = {"VLLM_CACHE_ROOT": str(out_dir / f"cache_{name}"), "PYTHONUNBUFFERED": "1"}
        commands[name] = (cmd, env)
    return commands


def suite(args: argparse.Namespace) -> None:
    import subprocess

    if "dense" not in args.engines:
        raise SystemExit("suite: --engines must include dense (every arm is compared to it)")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, (cmd, env) in suite_commands(args).items():
        log = open(out_dir / f"{name}.log", "a")  # noqa: SIM115 (closed on exit)
        procs[name] = (subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log,
                                        stderr=subprocess.STDOUT), log)  # fmt: skip
        print(f"suite: started {name} (log {out_dir / f'{name}.log'})", flush=True)
    t0 = time.time()
    failed = []
    while procs:
        time.sleep(10)
        for name, (proc, log) in list(procs.items()):
            if proc.poll() is not None:
                log.close()
                del procs[name]
                print(f"suite: {name} exited {proc.returncode} after {time.time() - t0:.0f} s",
                      flush=True)  # fmt: skip
                if proc.returncode:
                    failed.append(name)
    if failed:
        raise SystemExit(f"suite: {failed} failed; see their logs in {out_dir}")
    records = [str(out_dir / f"{name}.json") for name in args.engines]
    merge(argparse.Namespace(runs=records, prompts=args.prompts,
                             out=str(out_dir / "accuracy.json")))  # fmt: skip


# --------------------------------------------------------------------------
# merge
# --------------------------------------------------------------------------
def _summary(arm: dict, scores: list[float], dense: list[float], reads) -> dict:
    diffs = [100 * (a - b) for a, b in zip(scores, dense)]
    lo, hi = bootstrap(diffs)
    return {
        "label": arm_label(arm),
        "arm": arm["arm"],
        "estimator": arm.get("estimator"),
        "gamma": arm["gamma"],
        "docs": len(scores),
        "score": 100 * sum(scores) / len(scores),
        "dense_score": 100 * sum(dense) / len(dense),
        "kl": None,
        "reads": reads,
        "diff_vs_dense": sum(diffs) / len(diffs),
        "diff_vs_dense_ci95": [lo, hi],
    }


def _reads(arm: dict, ctx: int) -> float | None:
    """The arm's read fraction at this context (Select's counters), else its pooled one."""
    pages = arm.get("pages_by_context", {}).get(str(ctx))
    if pages is not None:
        kept, total = pages
        return kept / total if total else None
    return arm.get("reads")


def combine_arms(runs: list[dict]) -> list[dict]:
    """Arms of several run records, one per label: outputs united and page counts added
    (records of one arm cover disjoint documents, e.g. a run and its --resume)."""
    combined: dict[str, dict] = {}
    for r in runs:
        for arm in r["arms"]:
            label = arm_label(arm)
            if label not in combined:
                combined[label] = {
                    **arm,
                    "outputs": dict(arm["outputs"]),
                    "pages_by_context": dict(arm.get("pages_by_context", {})),
                }
                continue
            into = combined[label]
            into["outputs"].update(arm["outputs"])
            for ctx, (kept, total) in arm.get("pages_by_context", {}).items():
                old = into["pages_by_context"].get(ctx, [0, 0])
                into["pages_by_context"][ctx] = [old[0] + kept, old[1] + total]
    return list(combined.values())


def merge_records(prompts: dict, runs: list[dict]) -> list[dict]:
    """Rows per (task, context, arm), pooled per (context, arm) (``task: "all"``) and, with
    several haystacks, pooled per (context, haystack, arm). Documents that an arm or dense
    did not finish are left out of that arm's rows."""
    samples = {d["id"]: D.Sample(**d["sample"]) for d in prompts["docs"]}
    arms = combine_arms(runs)
    dense = next((a for a in arms if a["arm"] == "dense"), None)
    if dense is None:
        raise SystemExit("merge: no dense arm (run --backend FLASH_ATTN first)")
    keys = sorted({(s.task, s.context) for s in samples.values()})
    haystacks = sorted({s.haystack for s in samples.values() if s.haystack != "none"})
    rows = []
    for arm in arms:
        pooled: dict[tuple, tuple[list, list]] = {}
        for task, ctx in keys:
            ids = [
                i
                for i, s in samples.items()
                if (s.task, s.context) == (task, ctx)
                and i in arm["outputs"]
                and i in dense["outputs"]
            ]
            if not ids:
                continue
            scores = [D.score(samples[i], arm["outputs"][i]["text"]) for i in ids]
            base = [D.score(samples[i], dense["outputs"][i]["text"]) for i in ids]
            rows.append(
                {
                    "task": task,
                    "context": ctx,
                    "haystack": None,
                    **_summary(arm, scores, base, _reads(arm, ctx)),
                }
            )
            groups = [(ctx, None)]
            if len(haystacks) > 1:
                groups += [(ctx, h) for h in haystacks]
            for group in groups:
                pick = [j for j, i in enumerate(ids) if group[1] in (None, samples[i].haystack)]
                if pick:
                    pool = pooled.setdefault(group, ([], []))
                    pool[0].extend(scores[j] for j in pick)
                    pool[1].extend(base[j] for j in pick)
        for (ctx, hay), (scores, base) in sorted(
            pooled.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
        ):
            rows.append(
                {
                    "task": "all",
                    "context": ctx,
                    "haystack": hay,
                    **_summary(arm, scores, base, _reads(arm, ctx)),
                }
            )
    return rows


def merge(args) -> None:
    runs = [load_json(p) for p in args.runs]
    prompts = load_json(args.prompts)
    kv_cache_dtypes = {r.get("kv_cache_dtype", "auto") for r in runs}
    if len(kv_cache_dtypes) != 1:
        raise SystemExit(
            f"merge: runs of different --kv-cache-dtype {sorted(kv_cache_dtypes)}; merge the "
            "runs of one KV cache dtype (dense and MOIRA on the same cache)"
        )
    (kv_cache_dtype,) = kv_cache_dtypes
    kv = "bf16 KV cache" if kv_cache_dtype == "auto" else f"{kv_cache_dtype} KV cache"
    out = {
        "command": "python -m benchmarks.accuracy.run_accuracy_vllm " + " ".join(sys.argv[1:]),
        "where": f"vLLM 0.30 on the GPU (bf16, {kv}, FA3 prefill); reads: Select's counters "
        "per arm and context",
        "kv_cache_dtype": kv_cache_dtype,
        "model": prompts.get("model_name", "SmolLM2-135M-Instruct"),
        "complete": all(r.get("complete", True) for r in runs),
        "sources": [r["command"] for r in runs],
        "rows": merge_records(prompts, runs),
    }
    dump_json(args.out, out, indent=1)
    for row in out["rows"]:
        if row["task"] == "all" and row["haystack"] is None:
            lo, hi = row["diff_vs_dense_ci95"]
            reads = "-" if row["reads"] is None else f"{row['reads']:.3f}"
            print(
                f"{row['context']:>6} {row['label']:>28} score={row['score']:5.1f} "
                f"diff={row['diff_vs_dense']:+5.1f} [{lo:+.1f}, {hi:+.1f}] reads={reads} "
                f"docs={row['docs']}"
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="step", required=True)
    ex = sub.add_parser("export", help="documents as token ids (CPU)")
    ex.add_argument(
        "--model",
        default="smollm2-135m",
        choices=sorted(SUITES),
        help="whose tokenizer and suite defaults (prepared if missing)",
    )
    ex.add_argument("--model-dir", help="the model's HF directory (default: prepare_model.py's)")
    ex.add_argument("--contexts", type=int, nargs="+", help="default: the model's suite")
    ex.add_argument("--tasks", nargs="+", choices=D.LONG_TASKS, help="default: the model's suite")
    ex.add_argument(
        "--haystacks",
        nargs="+",
        choices=sorted(D.HAYSTACKS),
        help="documents alternate between these (default: the model's suite)",
    )
    ex.add_argument("--docs", type=int, default=20, help="documents per task and context")
    ex.add_argument(
        "--reserve",
        type=int,
        help="generate each document this many tokens short of its context, for the chat "
        "template and the answer (default: the model's suite)",
    )
    ex.add_argument("--out", required=True, help="a .json or .json.gz file")
    rn = sub.add_parser("run", help="greedy answers through vLLM (GPU)")
    rn.add_argument("--backend", choices=["FLASH_ATTN", "MOIRA"], required=True)
    rn.add_argument("--prompts", required=True)
    rn.add_argument("--model", required=True, help="the model's local HF directory")
    rn.add_argument("--contexts", type=int, nargs="+", help="only these contexts")
    rn.add_argument("--max-new", type=int, default=0, help="default: the export's max_new")
    rn.add_argument("--estimator", help="MOIRA_ESTIMATOR for this engine (default: the env's)")
    rn.add_argument("--summary-dtype", help="MOIRA_SUMMARY_DTYPE (default: the env's)")
    rn.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="vLLM's --kv-cache-dtype: auto (bf16) or fp8 (e4m3, per-layer K/V "
                    "scales); merge compares runs of one KV dtype")  # fmt: skip
    rn.add_argument("--gammas", type=float, nargs="+", default=list(GAMMAS))
    rn.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"the gamma={CONTROL_GAMMA} arm (default on)",
    )
    rn.add_argument(
        "--fixed-at",
        type=float,
        default=FIXED_AT,
        help="the fixed-count arm reads what this gamma's arm read",
    )
    rn.add_argument("--no-fixed", action="store_true", help="no fixed-count arm")
    rn.add_argument(
        "--chunk-tokens",
        type=int,
        default=1_500_000,
        help="prompt tokens per chunk (all arms run on a chunk in turn)",
    )
    rn.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every arm anew (default: later arms reuse the prefill)",
    )
    rn.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    rn.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=0.0,
        help="a fixed KV cache size (vLLM's kv_cache_memory_bytes) instead of profiling the "
        "free memory: engines that share one GPU (the suite step) must not size their cache "
        "from memory the others are still taking",
    )
    rn.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop after the chunk that leaves less than the slowest chunk's time",
    )
    rn.add_argument("--resume", action="store_true", help="continue an incomplete --out")
    rn.add_argument("--out", required=True)
    su = sub.add_parser("suite", help="the dense and MOIRA engines at once on one GPU, then merge")
    su.add_argument("--prompts", required=True)
    su.add_argument("--model", required=True, help="the model's local HF directory")
    su.add_argument(
        "--engines",
        nargs="+",
        default=list(DEFAULT_SUITE_ENGINES),
        choices=sorted(SUITE_ENGINES),
        help=f"which engines (default: {' '.join(DEFAULT_SUITE_ENGINES)}; three fit one H200 "
        "at the default KV cache; more, or a smaller GPU, share less)",
    )
    su.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    su.add_argument("--contexts", type=int, nargs="+", help="only these contexts")
    su.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=0.0,
        help="each engine's KV cache (default 30, scaled down where the engines' caches "
        "together would exceed 90 GiB or 0.6 of the GPU's memory)",
    )
    su.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="each engine's --chunk-tokens; keep a chunk within the KV cache, or the later "
        "arms find their prefill evicted (default 800000, scaled as the KV cache: 1.5B "
        "Qwen's 28 KiB per token fill 22 GiB)",
    )
    su.add_argument("--budget-s", type=float, default=0.0, help="each engine's --budget-s")
    su.add_argument("--resume", action="store_true", help="continue incomplete records")
    su.add_argument("--out-dir", required=True, help="records, logs and compile caches")
    mg = sub.add_parser("merge", help="scores and bootstrap against dense")
    mg.add_argument("runs", nargs="+")
    mg.add_argument("--prompts", required=True)
    mg.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    {"export": export, "run": run, "suite": suite, "merge": merge}[args.step](args)


if __name__ == "__main__":
    main()
