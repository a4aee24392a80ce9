# SPDX-License-Identifier: Apache-2.0
"""Dense needles and perplexity past 32k with YaRN: which stretched lengths qualify.

Qwen2.5-Coder-1.5B was trained to 32,768 positions. vLLM stretches RoPE with YaRN through
``hf_overrides``; on vLLM 0.30 with transformers 5 the override must name
``rope_parameters`` with ``rope_theta`` inside (the legacy ``rope_scaling`` key replaces
``rope_parameters`` with ``rope_theta: None``, and the rotary embedding cannot be built):

    {"rope_parameters": {"rope_type": "yarn", "factor": F, "original_max_position_embeddings":
     32768, "rope_theta": 1000000.0}, "max_position_embeddings": 32768 * F}

(``yarn_overrides`` builds it from the model's config.json; ``scripts/serve.sh --yarn F``
serves with it). Arms, FLASH_ATTN, one engine each: unscaled at 32k, YaRN factor 2 at
32k/64k, factor 4 at 32k/64k/96k/128k. At every (arm, length): niah_single and
niah_multikey (the accuracy suite's generators and RULER string match, 20 documents per
task, essays alternating with Jane Austen) and the perplexity of Moby Dick (a haystack the
needles never use) over a few windows. A length qualifies where a YaRN arm's needle score
(both tasks pooled) stays within ``QUALIFY_POINTS`` (10) of the unscaled model's at 32k.

Steps:

1. ``export`` (CPU, where the tokenizer and the haystacks are): the documents as chat-template
   token ids (``run_accuracy_vllm.build_docs``; the prompt text is dropped) and the
   perplexity windows, packed into one ``.json.gz`` (token ids as uint32, xz-compressed:
   the documents share most of their haystack text, so ~13M ids come to a few MB)::

       python benchmarks/yarn_dense.py export \\
           --model-dir .cache/models/Qwen2.5-Coder-1.5B-Instruct --out .stage/yarn/prompts.json.gz

2. ``run`` (GPU host, vLLM 0.30): one child process (``arm``) per factor, so each engine's
   memory is freed before the next starts; each writes ``OUT_f{F}.json`` after every length
   and skips the lengths such a file already holds (a run that stopped at ``--budget-s`` or
   a call's time limit continues there). Then ``merge`` writes ``OUT``::

       python benchmarks/yarn_dense.py run --prompts .stage/yarn/prompts.json.gz \\
           --model /root/moira-model/qwen2.5-coder-1.5b/hf --out OUT/yarn_dense.json

   Engines: eager (prefill-bound: no compile or graph capture to wait for), no prefix
   caching, ``max_num_batched_tokens`` 8192 (a prompt-logprobs chunk materializes
   ``[chunk, vocab]`` logits and fp32 logprobs, ~12 GB at 8192, outside the memory vLLM
   profiles; hence ``gpu_memory_utilization`` 0.80). Perplexity: ``prompt_logprobs=0``
   (only the actual token's logprob, flat) over windows that start at the same offsets at
   every length, so the shorter windows are prefixes of the longer ones and ``ppl_head``
   (the first window's tokens) compares every arm on the same text.

3. ``merge`` (anywhere): rows per (arm, length) with the verdicts; ``run`` calls it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy import data as D  # noqa: E402
from benchmarks.accuracy import run_accuracy_vllm as RA  # noqa: E402

FORMAT = "moira-yarn-prompts/1"
RECORD_FORMAT = "moira-yarn-dense/1"
ORIGINAL_MAX = 32768
#: YaRN factors allowed (scripts/serve.sh --yarn uses the same list).
FACTORS = (2, 4)
#: Lengths per factor (1: the unscaled model).
ARMS: dict[int, tuple[int, ...]] = {
    1: (32768,),
    2: (32768, 65536),
    4: (32768, 65536, 98304, 131072),
}
LENGTHS = (32768, 65536, 98304, 131072)
TASKS = ("niah_single", "niah_multikey")
#: A length qualifies where the needle score drops at most this many points.
QUALIFY_POINTS = 10.0
BASELINE = (1, 32768)
PPL_HAYSTACK = "mobydick"
#: Perplexity windows are this many tokens short of their length (room for one generated
#: token; the documents keep the suite's 64 too).
PPL_RESERVE = 64
PPL_SEGMENT = 4096
MODEL_KEY = "qwen2.5-coder-1.5b"


def log(msg: str) -> None:
    print(f"[yarn_dense {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# YaRN overrides
# --------------------------------------------------------------------------
def check_factor(factor) -> int:
    """The factor as an int; 1 (unscaled) or one of FACTORS, else ValueError."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        value = float("nan")
    if value not in (1, *FACTORS) or isinstance(factor, bool):
        raise ValueError(f"YaRN factor must be one of {list(FACTORS)}, got {factor!r}")
    return int(value)


def rope_theta(config: dict) -> float:
    """RoPE base of an HF config.json (transformers 5 ``rope_parameters`` or legacy)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("the model's config.json names no rope_theta")
    return float(theta)


def yarn_overrides(factor, config: dict) -> dict | None:
    """vLLM ``hf_overrides`` that stretch the model's positions ``factor`` times with YaRN
    (None for factor 1). ``config``: the model's config.json, unscaled."""
    factor = check_factor(factor)
    if factor == 1:
        return None
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"the model's RoPE is already scaled ({kind}); give an unscaled config")
    original = int(config["max_position_embeddings"])
    return {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
            "rope_theta": rope_theta(config),
        },
        "max_position_embeddings": original * factor,
    }


def engine_len(factor, config: dict) -> int:
    return int(config["max_position_embeddings"]) * check_factor(factor)


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


# --------------------------------------------------------------------------
# token packing
# --------------------------------------------------------------------------
CODEC = "xz:uint32le:base64"


def pack_ids(seqs: list[list[int]]) -> dict:
    """Token id lists as one xz-compressed uint32 blob (base64), with lengths and sha256."""
    import numpy as np

    lengths = [len(s) for s in seqs]
    flat = np.concatenate([np.asarray(s, dtype="<u4") for s in seqs]) if seqs else []
    raw = np.asarray(flat, dtype="<u4").tobytes()
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9, "dict_size": 128 << 20}]
    data = lzma.compress(raw, format=lzma.FORMAT_XZ, filters=filters)
    return {
        "codec": CODEC,
        "lengths": lengths,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "data": base64.b64encode(data).decode("ascii"),
    }


def unpack_ids(blob: dict) -> list[list[int]]:
    import numpy as np

    if blob.get("codec") != CODEC:
        raise ValueError(f"token blob codec {blob.get('codec')!r}, expected {CODEC!r}")
    raw = lzma.decompress(base64.b64decode(blob["data"]))
    if hashlib.sha256(raw).hexdigest() != blob["sha256"]:
        raise ValueError("token blob: sha256 mismatch (corrupt prompts file)")
    flat = np.frombuffer(raw, dtype="<u4")
    if len(flat) != sum(blob["lengths"]):
        raise ValueError(f"token blob: {len(flat)} ids, lengths add up to {sum(blob['lengths'])}")
    out, pos = [], 0
    for n in blob["lengths"]:
        out.append(flat[pos : pos + n].tolist())
        pos += n
    return out


def load_prompts(path: str | Path) -> dict:
    """The export, with ``prompt_token_ids`` on every document and ``token_ids`` on every
    perplexity window."""
    prompts = RA.load_json(path)
    if prompts.get("format") != FORMAT:
        raise SystemExit(f"{path}: not a yarn_dense export (format {prompts.get('format')!r})")
    for doc, ids in zip(prompts["docs"], unpack_ids(prompts["doc_tokens"]), strict=True):
        doc["prompt_token_ids"] = ids
    for win, ids in zip(prompts["ppl_windows"], unpack_ids(prompts["ppl_tokens"]), strict=True):
        win["token_ids"] = ids
    return prompts


def ppl_offsets(n_haystack: int, n_window: int, windows: int) -> list[int]:
    """Start offsets of ``windows`` windows spread evenly over the haystack."""
    if n_window > n_haystack:
        raise ValueError(f"perplexity window {n_window} > haystack {n_haystack} tokens")
    if windows == 1:
        return [0]
    return [round(i * (n_haystack - n_window) / (windows - 1)) for i in range(windows)]


# --------------------------------------------------------------------------
# export (CPU)
# --------------------------------------------------------------------------
def export(args) -> None:
    from transformers import AutoTokenizer

    suite = RA.SUITES[MODEL_KEY]
    lengths = args.lengths or list(LENGTHS)
    model_dir = Path(args.model_dir) if args.model_dir else RA._prepare_module().prepare(
        model=MODEL_KEY
    )  # fmt: skip
    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs, max_new = RA.build_docs(
        tok, lengths, args.tasks, suite["haystacks"], suite["reserve"], args.docs
    )
    ids = [d.pop("prompt_token_ids") for d in docs]
    for d, seq in zip(docs, ids):
        d["sample"]["prompt"] = ""  # the text is in the ids; scoring needs the answers only
        d["n_tokens"] = len(seq)
    hay = tok(D.haystack_text(PPL_HAYSTACK), add_special_tokens=False)["input_ids"]
    n_max = max(lengths) - PPL_RESERVE
    windows = [
        {"id": f"ppl|{w}", "offset": off, "n_tokens": n_max}
        for w, off in enumerate(ppl_offsets(len(hay), n_max, args.ppl_windows))
    ]
    out = {
        "format": FORMAT,
        "command": "python benchmarks/yarn_dense.py " + " ".join(sys.argv[1:]),
        "model": MODEL_KEY,
        "model_name": RA._prepare_module().MODELS[MODEL_KEY].name,
        "original_max_position_embeddings": int(read_config(model_dir)["max_position_embeddings"]),
        "lengths": lengths,
        "tasks": list(args.tasks),
        "haystacks": suite["haystacks"],
        "reserve": suite["reserve"],
        "stop_token_ids": [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
        "max_new": max_new,
        "docs": docs,
        "doc_tokens": pack_ids(ids),
        "ppl_haystack": PPL_HAYSTACK,
        "ppl_haystack_tokens": len(hay),
        "ppl_reserve": PPL_RESERVE,
        "ppl_windows": windows,
        "ppl_tokens": pack_ids([hay[w["offset"] : w["offset"] + n_max] for w in windows]),
    }
    RA.dump_json(args.out, out)
    size = Path(args.out).stat().st_size
    log(
        f"wrote {args.out}: {len(docs)} documents ({sum(map(len, ids)):,} tokens), "
        f"{len(windows)} perplexity windows of {n_max:,}, max_new {max_new}, "
        f"{size / 2**20:.1f} MiB"
    )


# --------------------------------------------------------------------------
# scoring (pure)
# --------------------------------------------------------------------------
def token_logprobs(prompt_logprobs, ids: list[int]) -> list[float]:
    """The logprob of every prompt token after the first, from vLLM's ``prompt_logprobs``
    (a list of ``{token_id: Logprob}`` or ``FlatLogprobs``; position 0 is None)."""
    out = []
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        out.append(float(entry[ids[i]].logprob))
    return out


def ppl_summary(nll_by_window: list[list[float]], head: int, segment: int = PPL_SEGMENT) -> dict:
    """Perplexity pooled over windows (token-weighted): over all predicted tokens, over the
    first ``head`` positions (the text every length shares), and the mean NLL per
    ``segment`` positions."""
    if not nll_by_window or not all(nll_by_window):
        raise ValueError("no tokens to score")
    total = sum(sum(w) for w in nll_by_window)
    count = sum(len(w) for w in nll_by_window)
    head_vals = [x for w in nll_by_window for x in w[: head - 1]]
    n_seg = math.ceil(max(map(len, nll_by_window)) / segment)
    segments = []
    for s in range(n_seg):
        vals = [x for w in nll_by_window for x in w[s * segment : (s + 1) * segment]]
        segments.append(round(sum(vals) / len(vals), 4) if vals else None)
    return {
        "windows": len(nll_by_window),
        "tokens": count,
        "nll": total / count,
        "ppl": math.exp(total / count),
        "ppl_head": math.exp(sum(head_vals) / len(head_vals)),
        "head_tokens": len(head_vals),
        "nll_by_window": [round(sum(w) / len(w), 4) for w in nll_by_window],
        "segment_tokens": segment,
        "nll_by_segment": segments,
    }


def needle_scores(samples: dict[str, D.Sample], outputs: dict[str, str]) -> dict:
    """Score (0-100) and documents per task and pooled (``all``)."""
    by_task: dict[str, list[float]] = {}
    for doc_id, text in outputs.items():
        s = samples[doc_id]
        by_task.setdefault(s.task, []).append(D.score(s, text))
    out = {t: {"score": 100 * sum(v) / len(v), "docs": len(v)} for t, v in sorted(by_task.items())}
    pooled = [x for v in by_task.values() for x in v]
    if pooled:
        out["all"] = {"score": 100 * sum(pooled) / len(pooled), "docs": len(pooled)}
    return out


def qualify(rows: list[dict], points: float = QUALIFY_POINTS) -> dict:
    """Sets ``drop_vs_baseline`` and ``qualifies`` on every row (None without needle scores
    or without the baseline row) and returns the per-length verdicts: a length qualifies
    where some YaRN factor's pooled needle score is at most ``points`` below the unscaled
    model's at 32k."""
    base = next(
        (r for r in rows if (r["factor"], r["length"]) == BASELINE and r.get("needle")), None
    )
    base_score = base["needle"]["all"]["score"] if base else None
    verdicts: dict[str, dict] = {}
    for r in rows:
        score = (r.get("needle") or {}).get("all", {}).get("score")
        if score is None or base_score is None:
            r["drop_vs_baseline"] = r["qualifies"] = None
        else:
            r["drop_vs_baseline"] = round(base_score - score, 4)
            r["qualifies"] = r["drop_vs_baseline"] <= points + 1e-9
        if r["factor"] == 1:
            continue
        v = verdicts.setdefault(str(r["length"]), {"qualifies": None, "factors": []})
        if r["qualifies"] is not None:
            v["qualifies"] = bool(v["qualifies"]) or r["qualifies"]
            if r["qualifies"]:
                v["factors"].append(r["factor"])
    return {"baseline": base_score, "points": points, "by_length": verdicts}


def check_record(record: dict) -> list[str]:
    """What is wrong with a merged record (empty: nothing)."""
    problems = []
    if record.get("format") != RECORD_FORMAT:
        problems.append(f"format {record.get('format')!r}")
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows:
        return [*problems, "no rows"]
    seen = set()
    for r in rows:
        key = (r.get("factor"), r.get("length"))
        where = f"row {key}"
        if key in seen:
            problems.append(f"{where}: twice")
        seen.add(key)
        if r.get("factor") not in ARMS or r.get("length") not in ARMS.get(r.get("factor"), ()):
            problems.append(f"{where}: not an arm")
            continue
        if (r["factor"] == 1) != (r.get("hf_overrides") is None):
            problems.append(f"{where}: hf_overrides {r.get('hf_overrides')!r}")
        elif r["factor"] != 1 and r["hf_overrides"]["rope_parameters"]["factor"] != r["factor"]:
            problems.append(f"{where}: hf_overrides factor differs")
        needle = r.get("needle")
        if needle is not None:
            if set(needle) != {*TASKS, "all"}:
                problems.append(f"{where}: needle tasks {sorted(needle)}")
            elif needle["all"]["docs"] != sum(needle[t]["docs"] for t in TASKS):
                problems.append(f"{where}: pooled docs differ from the tasks'")
            elif not all(0 <= v["score"] <= 100 for v in needle.values()):
                problems.append(f"{where}: score out of 0..100")
        ppl = r.get("ppl")
        if ppl is not None and not (ppl.get("ppl", 0) >= 1 and ppl.get("tokens", 0) > 0):
            problems.append(f"{where}: perplexity {ppl.get('ppl')!r}")
    if "verdict" in record:
        copy = [dict(r) for r in rows]
        if qualify(copy, record["verdict"]["points"]) != record["verdict"] or any(
            a.get("qualifies") != b.get("qualifies") for a, b in zip(rows, copy)
        ):
            problems.append("verdict does not follow the rule")
    return problems


# --------------------------------------------------------------------------
# arm (GPU, one engine)
# --------------------------------------------------------------------------
def prefill_flops(config: dict, n_tokens: int) -> float:
    """Forward FLOPs of one causal prefill of ``n_tokens`` (linear layers + attention)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * config["intermediate_size"]
    linear = 2 * layers * per_layer
    attention = 2 * layers * heads * hd * n_tokens  # QK and PV, causal: L^2 / 2 pairs x 4
    return n_tokens * linear + attention * n_tokens


def arm(args) -> None:
    factor = check_factor(args.factor)
    config = read_config(args.model)
    overrides = yarn_overrides(factor, config)
    max_len = engine_len(factor, config)
    prompts = load_prompts(args.prompts)
    lengths = [n for n in ARMS[factor] if n in prompts["lengths"] and n <= max_len]
    if args.lengths:
        lengths = [n for n in lengths if n in args.lengths]
    part = RA.load_json(args.out) if Path(args.out).is_file() and not args.fresh else None
    if part and (part.get("factor") != factor or part.get("hf_overrides") != overrides):
        raise SystemExit(f"{args.out} holds another arm; pass --fresh or another --out")
    part = part or {
        "format": RECORD_FORMAT + ":part",
        "factor": factor,
        "hf_overrides": overrides,
        "max_model_len": max_len,
        "model": args.model,
        "prompts": str(args.prompts),
        "by_length": {},
    }
    todo = [L for L in lengths if str(L) not in part["by_length"]]
    part["complete"] = not todo
    if not todo:
        log(f"factor {factor}: every length done in {args.out}")
        RA.dump_json(args.out, part, indent=1)
        return

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=args.model,
        attention_backend="FLASH_ATTN",
        dtype="bfloat16",
        block_size=RA.PAGE,
        max_model_len=max_len,
        hf_overrides=overrides or {},
        seed=0,
        enable_prefix_caching=False,
        enforce_eager=args.eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    part["engine_start_s"] = round(time.time() - t0, 1)
    log(f"factor {factor}: engine up in {part['engine_start_s']} s (max_model_len {max_len})")
    samples = {d["id"]: D.Sample(**d["sample"]) for d in prompts["docs"]}
    needle_params = SamplingParams(
        temperature=0.0, max_tokens=prompts["max_new"], stop_token_ids=prompts["stop_token_ids"]
    )
    ppl_params = SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0, flat_logprobs=True, detokenize=False
    )
    head = min(prompts["lengths"]) - prompts["ppl_reserve"]
    rate = None  # FLOP/s measured so far
    for L in todo:
        docs = [d for d in prompts["docs"] if d["sample"]["context"] == L]
        windows = [w["token_ids"][: L - prompts["ppl_reserve"]] for w in prompts["ppl_windows"]]
        flops = sum(prefill_flops(config, len(d["prompt_token_ids"])) for d in docs)
        flops += sum(prefill_flops(config, len(w)) for w in windows)
        if rate and args.deadline and time.time() + flops / rate > args.deadline:
            log(f"factor {factor}: stopping before {L} ({flops / rate:.0f} s expected, "
                f"{args.deadline - time.time():.0f} s left); run again to continue")  # fmt: skip
            break
        t_len = time.time()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=d["prompt_token_ids"]) for d in docs],
            needle_params,
            use_tqdm=False,
        )
        texts = {d["id"]: o.outputs[0].text for d, o in zip(docs, outs)}
        t_needle = time.time() - t_len
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=w) for w in windows], ppl_params, use_tqdm=False
        )
        nll = [[-x for x in token_logprobs(o.prompt_logprobs, w)] for o, w in zip(outs, windows)]
        took = time.time() - t_len
        rate = flops / took if rate is None else (rate + flops / took) / 2
        needle = needle_scores(samples, texts)
        part["by_length"][str(L)] = {
            "needle": needle,
            "outputs": texts,
            "ppl": ppl_summary(nll, head),
            "seconds": round(took, 1),
            "needle_seconds": round(t_needle, 1),
            "tflops": round(flops / took / 1e12, 1),
        }
        part["complete"] = all(str(x) in part["by_length"] for x in lengths)
        RA.dump_json(args.out, part, indent=1)
        ppl = part["by_length"][str(L)]["ppl"]
        log(
            f"factor {factor} @ {L}: needles "
            + " ".join(f"{t}={v['score']:.1f}" for t, v in needle.items())
            + f" ({len(docs)} docs), ppl {ppl['ppl']:.3f} (head {ppl['ppl_head']:.3f}), "
            f"{took:.0f} s, {flops / took / 1e12:.0f} TFLOP/s"
        )
    log(f"factor {factor}: wrote {args.out} (complete: {part['complete']})")


# --------------------------------------------------------------------------
# merge / run
# --------------------------------------------------------------------------
def part_path(out: str | Path, factor: int) -> Path:
    out = Path(out)
    stem = out.name.split(".")[0]
    return out.with_name(f"{stem}_f{factor}.json")


def merge_parts(parts: list[dict]) -> dict:
    rows = []
    for part in sorted(parts, key=lambda p: p["factor"]):
        for L in sorted(map(int, part["by_length"])):
            got = part["by_length"][str(L)]
            rows.append(
                {
                    "arm": "unscaled" if part["factor"] == 1 else f"yarn_f{part['factor']}",
                    "factor": part["factor"],
                    "length": L,
                    "hf_overrides": part["hf_overrides"],
                    "max_model_len": part["max_model_len"],
                    "docs": got["needle"].get("all", {}).get("docs", 0),
                    "needle": got["needle"],
                    "ppl": got["ppl"],
                    "seconds": got["seconds"],
                    "tflops": got.get("tflops"),
                    "outputs": got["outputs"],
                }
            )
    verdict = qualify(rows)
    expected = {(f, L) for f, ls in ARMS.items() for L in ls}
    return {
        "format": RECORD_FORMAT,
        "where": "vLLM 0.30, FLASH_ATTN (FA3), bf16 weights and KV cache, greedy",
        "rule": f"a length qualifies where a YaRN factor's needle score (niah_single and "
        f"niah_multikey pooled) is at most {QUALIFY_POINTS:g} points below the unscaled "
        "model's at 32768",
        "complete": {(r["factor"], r["length"]) for r in rows} >= expected,
        "engine_start_s": {str(p["factor"]): p.get("engine_start_s") for p in parts},
        "rows": rows,
        "verdict": verdict,
    }


def merge(args) -> None:
    parts = [RA.load_json(p) for p in args.parts]
    record = merge_parts(parts)
    record["command"] = "python benchmarks/yarn_dense.py " + " ".join(sys.argv[1:])
    problems = check_record(record)
    if problems:
        raise SystemExit("merge: " + "; ".join(problems))
    RA.dump_json(args.out, record, indent=1)
    base = record["verdict"]["baseline"]
    for r in record["rows"]:
        score = r["needle"]["all"]["score"]
        log(
            f"{r['arm']:>9} @ {r['length']:>6}: needles {score:5.1f} "
            f"(baseline {base if base is None else round(base, 1)}), ppl {r['ppl']['ppl']:.3f} "
            f"head {r['ppl']['ppl_head']:.3f}, qualifies {r['qualifies']}"
        )
    log(f"wrote {args.out} (complete: {record['complete']}); by length: "
        f"{json.dumps(record['verdict']['by_length'])}")  # fmt: skip


def run(args) -> None:
    t0 = time.time()
    deadline = t0 + args.budget_s if args.budget_s else 0.0
    failed = []
    for factor in args.factors:
        factor = check_factor(factor)
        if deadline and deadline - time.time() < args.min_engine_s:
            log(f"factor {factor}: skipped, {deadline - time.time():.0f} s left of --budget-s")
            failed.append(factor)
            continue
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "arm", "--factor", str(factor),
            "--prompts", args.prompts, "--model", args.model,
            "--out", str(part_path(args.out, factor)),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--deadline", str(deadline),
        ]  # fmt: skip
        if args.lengths:
            cmd += ["--lengths", *map(str, args.lengths)]
        if not args.eager:
            cmd.append("--no-eager")
        if args.fresh:
            cmd.append("--fresh")
        log(f"factor {factor}: {' '.join(cmd)}")
        rc = subprocess.call(cmd)
        if rc:
            log(f"factor {factor}: exited {rc}")
            failed.append(factor)
    parts = [str(part_path(args.out, f)) for f in sorted(ARMS) if part_path(args.out, f).is_file()]
    if parts:
        merge(argparse.Namespace(parts=parts, out=args.out))
    log(f"done in {time.time() - t0:.0f} s")
    if failed or not parts:
        raise SystemExit(f"run: factors {failed} failed or were skipped")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="step", required=True)
    ex = sub.add_parser("export", help="documents and perplexity windows as token ids (CPU)")
    ex.add_argument("--model-dir", help="the model's HF directory (default: prepare_model.py's)")
    ex.add_argument("--lengths", type=int, nargs="+", help=f"default {list(LENGTHS)}")
    ex.add_argument("--tasks", nargs="+", default=list(TASKS), choices=D.LONG_TASKS)
    ex.add_argument("--docs", type=int, default=20, help="documents per task and length")
    ex.add_argument("--ppl-windows", type=int, default=3, help="perplexity windows per length")
    ex.add_argument("--out", required=True, help="a .json.gz file")

    def engine_args(p):
        p.add_argument("--prompts", required=True)
        p.add_argument("--model", required=True, help="the model's local HF directory")
        p.add_argument("--lengths", type=int, nargs="+", help="only these lengths")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.80)
        p.add_argument("--max-num-batched-tokens", type=int, default=8192)
        p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                       help="enforce_eager (default on: no compile wait)")  # fmt: skip
        p.add_argument("--fresh", action="store_true", help="ignore an existing part record")

    rn = sub.add_parser("run", help="every factor's engine in turn, then merge (GPU)")
    engine_args(rn)
    rn.add_argument("--factors", type=int, nargs="+", default=list(ARMS),
                    help="1 (unscaled) and YaRN factors (default 1 2 4)")  # fmt: skip
    rn.add_argument("--budget-s", type=float, default=0.0,
                    help="stop before a length that would end past this many seconds")  # fmt: skip
    rn.add_argument("--min-engine-s", type=float, default=90.0,
                    help="with --budget-s: start no engine with less left")  # fmt: skip
    rn.add_argument("--out", required=True, help="the merged record; parts beside it")
    am = sub.add_parser("arm", help="one factor's engine (run starts it)")
    engine_args(am)
    am.add_argument("--factor", type=int, required=True)
    am.add_argument("--deadline", type=float, default=0.0, help="epoch seconds (0: none)")
    am.add_argument("--out", required=True)
    mg = sub.add_parser("merge", help="part records -> the record with verdicts")
    mg.add_argument("parts", nargs="+")
    mg.add_argument("--out", required=True)
    ov = sub.add_parser("overrides", help="print --hf-overrides JSON and max model length")
    ov.add_argument("--factor", required=True)
    ov.add_argument("--model", required=True, help="the model's HF directory")
    return ap


def overrides(args) -> None:
    try:
        if check_factor(args.factor) == 1:
            raise ValueError(f"YaRN factor must be one of {list(FACTORS)}, got {args.factor!r}")
        config = read_config(args.model)
        print(json.dumps(yarn_overrides(args.factor, config), separators=(",", ":")))
        print(engine_len(args.factor, config))
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"yarn_dense overrides: {err}") from None


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    steps = {"export": export, "run": run, "arm": arm, "merge": merge, "overrides": overrides}
    steps[args.step](args)


if __name__ == "__main__":
    main()
