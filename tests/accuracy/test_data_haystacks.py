# SPDX-License-Identifier: Apache-2.0
"""The haystack sources and the RULER-style generators of benchmarks/accuracy/data.py on
tiny hand-made inputs: R's serialization format and lazy-load data bases (r_data.py), a
Debian package's data archive, the text clean-up, and the multi-query needle task (with a
byte-level stand-in tokenizer, no model needed)."""

from __future__ import annotations

import gzip
import io
import lzma
import struct
import tarfile
import zlib

import pytest

from benchmarks.accuracy import data as D
from benchmarks.accuracy import r_data as R


# --------------------------------------------------------------------------
# A minimal R serializer (XDR, version 3) for the test inputs
# --------------------------------------------------------------------------
def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _charsxp(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)
    raw = s.encode()
    return _i(9 | (1 << 15)) + _i(len(raw)) + raw  # UTF-8 flag in the levels


def _names_attr(names: list[str]) -> bytes:
    # pairlist cell with a tag: flags LISTSXP | has_tag; tag = SYMSXP "names"
    return _i(2 | (1 << 10)) + _i(1) + _charsxp("names") + _strsxp(names) + _i(254)


def _strsxp(items, names=None) -> bytes:
    flags = 16 | ((1 << 9) if names else 0)
    out = _i(flags) + _i(len(items)) + b"".join(_charsxp(s) for s in items)
    return out + (_names_attr(names) if names else b"")


def _intsxp(vals) -> bytes:
    return _i(13) + _i(len(vals)) + b"".join(_i(v) for v in vals)


def _vecsxp(items: list[bytes], names=None) -> bytes:
    flags = 19 | ((1 << 9) if names else 0)
    out = _i(flags) + _i(len(items)) + b"".join(items)
    return out + (_names_attr(names) if names else b"")


def _serialize(body: bytes) -> bytes:
    return b"X\n" + _i(3) + _i(0x040300) + _i(0x030500) + _i(5) + b"UTF-8" + body


def test_unserialize_vectors_names_and_na():
    obj = R.unserialize(
        _serialize(
            _vecsxp([_strsxp(["a", None, "ü"]), _intsxp([1, -(2**31)])], names=["text", "n"])
        )
    )
    assert obj == [["a", None, "ü"], [1, None]]
    assert obj.attributes["names"] == ["text", "n"]
    with pytest.raises(R.RDataError, match="XDR"):
        R.unserialize(b"A\n" + _i(3))
    with pytest.raises(R.RDataError, match="truncated"):
        R.unserialize(_serialize(_strsxp(["abc"]))[:-2])


def test_compact_intseq_altrep():
    # info: pairlist (class symbol, package symbol, type); state: c(length, first, step)
    info = (
        _i(2)
        + _i(1)
        + _charsxp("compact_intseq")
        + _i(2)
        + _i(1)
        + _charsxp("base")
        + _i(2)
        + _intsxp([13])
        + _i(254)
    )
    state = _i(14) + _i(3) + struct.pack(">3d", 4.0, 10.0, 1.0)
    body = _i(238) + info + state + _i(254)
    assert R.unserialize(_serialize(body)) == [10, 11, 12, 13]


def test_read_lazyload_db(tmp_path):
    """An .rdx map (gzip) of two objects in an .rdb: one zlib (compress=TRUE), one xz."""
    first = _serialize(_strsxp(["It is a truth", "universally acknowledged"]))
    second = _serialize(_strsxp(["Call me Ishmael."]))
    blob1 = struct.pack(">I", len(first)) + zlib.compress(first)
    blob2 = struct.pack(">I", len(second)) + b"X" + lzma.compress(second)
    (tmp_path / "Rdata.rdb").write_bytes(blob1 + blob2)
    variables = _vecsxp(
        [_intsxp([0, len(blob1)]), _intsxp([len(blob1), len(blob2)])], names=["pp", "md"]
    )
    index = _vecsxp(
        [variables, _vecsxp([]), _intsxp([1])], names=["variables", "references", "compressed"]
    )
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index)))
    got = R.read_lazyload_db(tmp_path / "Rdata")
    assert got == {"pp": ["It is a truth", "universally acknowledged"], "md": ["Call me Ishmael."]}
    assert R.read_lazyload_db(tmp_path / "Rdata", ["md"]) == {"md": ["Call me Ishmael."]}
    with pytest.raises(R.RDataError, match=r"no object\(s\) \['emma'\]"):
        R.read_lazyload_db(tmp_path / "Rdata", ["emma"])


def _ar_member(name: str, data: bytes) -> bytes:
    header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
    return header + data + (b"\n" if len(data) % 2 else b"")


def test_deb_members(tmp_path):
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        for name, payload in (
            ("./usr/lib/R/site-library/x/data/Rdata.rdb", b"rdb"),
            ("./usr/share/doc/x/README", b"doc"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    deb = tmp_path / "x.deb"
    deb.write_bytes(
        b"!<arch>\n"
        + _ar_member("debian-binary", b"2.0\n")
        + _ar_member("control.tar.xz", b"c")
        + _ar_member("data.tar.xz", tar_bytes.getvalue())
    )
    assert D.deb_members(deb, ("/data/Rdata.rdb",)) == {
        "./usr/lib/R/site-library/x/data/Rdata.rdb": b"rdb"
    }
    (tmp_path / "bad.deb").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a Debian package"):
        D.deb_members(tmp_path / "bad.deb", (".rdb",))


def test_text_cleanup():
    lines = ["CHAPTER 1", "", "It is a truth universally", "acknowledged, that a", "", "", "End."]
    assert D.unwrap_lines(lines) == (
        "CHAPTER 1\n\nIt is a truth universally acknowledged, that a\n\nEnd."
    )
    book = (
        "Header\n*** START OF THIS PROJECT GUTENBERG EBOOK MOBY DICK ***\nCall me Ishmael."
        "\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\nLicense"
    )
    assert D.strip_gutenberg(book) == "Call me Ishmael.\n"
    assert D.strip_gutenberg("no markers") == "no markers"


# --------------------------------------------------------------------------
# Generators, with a byte-level stand-in tokenizer
# --------------------------------------------------------------------------
class ByteTokenizer:
    """One token per UTF-8 byte: enough for the generators' length arithmetic."""

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": list(text.encode())}

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


@pytest.fixture
def fake_haystacks(monkeypatch):
    texts = {"essays": "Essays say things. " * 400, "austen": "Emma was handsome. " * 400}
    monkeypatch.setattr(D, "haystack_text", lambda source: texts[source])
    monkeypatch.setattr(D, "_HAY_IDS", {})
    return texts


def test_multiquery_asks_for_every_needle(fake_haystacks):
    tok = ByteTokenizer()
    samples = D.ruler_samples(tok, "niah_multiquery", 2048, 4, haystacks=("essays", "austen"))
    assert [s.haystack for s in samples] == ["essays", "austen", "essays", "austen"]
    for s in samples:
        assert len(s.answers) == D.MULTIQUERY_KEYS and len(set(s.answers)) == D.MULTIQUERY_KEYS
        body = s.prompt.split("\n\nWhat are")[0]
        for number in s.answers:
            assert body.count(number) == 1  # each needle once, in the haystack part
        # the haystack part keeps 100 tokens of the context for question and chat template
        # (+2 spaces around each needle)
        assert len(tok(body)["input_ids"]) <= 2048 - 100 + 2 * D.MULTIQUERY_KEYS
        assert ("Emma was handsome" in body) == (s.haystack == "austen")
        assert D.score(s, " ".join(s.answers)) == 1.0
        assert D.score(s, s.answers[0]) == 1 / D.MULTIQUERY_KEYS
    # The same questions whatever the haystack list (documents depend on the index only).
    alone = D.ruler_samples(tok, "niah_multiquery", 2048, 4)
    assert [s.answers for s in alone] == [s.answers for s in samples]
    assert {s.haystack for s in alone} == {"essays"}


def test_every_task_fits_its_context(fake_haystacks):
    tok = ByteTokenizer()
    for task in D.LONG_TASKS:
        for s in D.ruler_samples(tok, task, 1024, 2, haystacks=("austen",)):
            # a byte per token: a question of ~150 bytes is ~40 real tokens
            assert len(tok(s.prompt)["input_ids"]) <= 1024 + 150, task
            assert s.task == task and s.answers
    with pytest.raises(ValueError, match="task must be one of"):
        D.ruler_samples(tok, "qa", 1024, 1)
    with pytest.raises(ValueError, match="has 7600 tokens, 20000 asked for"):
        D.haystack_tokens(tok, 20000, source="austen")
