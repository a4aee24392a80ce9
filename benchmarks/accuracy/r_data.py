# SPDX-License-Identifier: Apache-2.0
"""Read character vectors out of an R package's lazy-load data base, in pure Python.

An installed R package keeps its data sets in ``data/Rdata.rdx`` (a compressed, serialized
map: object name -> (offset, length) in the ``.rdb`` file) and ``data/Rdata.rdb`` (each
object: a 4-byte big-endian uncompressed length, then zlib data, or a type byte and bzip2,
xz or raw data, then the object in R's XDR serialization format, versions 2 and 3). This
reads the types that plain data sets use (vectors, lists, pairlists, symbols, attributes,
references, R >= 3.5's compact sequences and wrappers), enough for the text corpora that
Debian's ``r-cran-janeaustenr`` and ``r-cran-tokenizers`` ship (no R needed).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

NILVALUE_SXP = 254
REFSXP = 255
ALTREP_SXP = 238
ATTRLISTSXP = 239
ATTRLANGSXP = 240
#: Special markers that stand for a fixed object and carry no payload.
SPECIALS = {253: "globalenv", 252: "unbound", 251: "missingarg", 250: "basenamespace",
            242: "emptyenv", 241: "baseenv"}  # fmt: skip
PAIRLIST_TYPES = {2, 3, 5, 6, 17, ATTRLISTSXP, ATTRLANGSXP}
NA_INTEGER = -(2**31)


class RDataError(ValueError):
    """The bytes are not an R serialization this reader understands."""


@dataclass
class RObject:
    """An R object that is neither a plain vector nor a list (kept for completeness)."""

    rtype: int
    value: object = None
    attributes: dict = field(default_factory=dict)


class RVector(list):
    """A vector or list with its R attributes (``names``, ``class``, ...)."""

    def __init__(self, items=(), attributes: dict | None = None) -> None:
        super().__init__(items)
        self.attributes = attributes or {}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.refs: list = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError("truncated R serialization")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise RDataError(f"only XDR serializations are read, got format {fmt!r}")
        version = self.int()
        self.int()  # writer's R version
        self.int()  # oldest R that reads it
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise RDataError(f"R serialization version {version} (2 and 3 are read)")

    def item(self):
        flags = self.int()
        rtype = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if rtype == NILVALUE_SXP:
            return None
        if rtype in SPECIALS:
            return RObject(rtype, SPECIALS[rtype])
        if rtype == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if rtype in (247, 248, 249):  # persistent name, package, namespace: a string vector
            self.int()  # 0
            obj = RObject(rtype, [self.item() for _ in range(self.int())])
            self.refs.append(obj)
            return obj
        if rtype == 1:  # symbol: its name, shared through the reference table
            name = self.item()
            self.refs.append(name)
            return name
        if rtype == 4:  # environment
            env = RObject(4)
            self.refs.append(env)
            self.int()  # locked
            enclos, frame, table, attrs = self.item(), self.item(), self.item(), self.item()
            env.value = {"enclos": enclos, "frame": frame, "hashtab": table}
            env.attributes = attrs if isinstance(attrs, dict) else {}
            return env
        if rtype in PAIRLIST_TYPES:
            return self.pairlist(rtype, has_attr, has_tag)
        if rtype == ALTREP_SXP:
            return self.altrep()
        if rtype == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", "replace")
        if rtype in (10, 13):  # logical, integer
            n = self.length()
            vals = struct.unpack(f">{n}i", self.take(4 * n))
            value = RVector(None if v == NA_INTEGER else v for v in vals)
        elif rtype == 14:  # double
            n = self.length()
            value = RVector(struct.unpack(f">{n}d", self.take(8 * n)))
        elif rtype == 15:  # complex
            n = self.length()
            raw = struct.unpack(f">{2 * n}d", self.take(16 * n))
            value = RVector(complex(raw[i], raw[i + 1]) for i in range(0, 2 * n, 2))
        elif rtype in (16, 19, 20):  # character, list, expression
            n = self.length()
            value = RVector(self.item() for _ in range(n))
        elif rtype == 24:  # raw
            value = RVector(self.take(self.length()))
        else:
            raise RDataError(f"R type {rtype} is not read here")
        if has_attr:
            value.attributes = self.attributes()
        return value

    def attributes(self) -> dict:
        attrs = self.item()
        return attrs if isinstance(attrs, dict) else {}

    def pairlist(self, rtype: int, has_attr: bool, has_tag: bool):
        """A pairlist as a dict tag -> value (untagged cells under their position)."""
        out: dict = {}
        while True:
            if has_attr:
                self.attributes()
            tag = self.item() if has_tag else None
            car = self.item()
            out[tag if tag is not None else len(out)] = car
            flags = self.int()
            nxt = flags & 0xFF
            if nxt == NILVALUE_SXP:
                break
            if nxt not in PAIRLIST_TYPES:  # a CDR that is not a pairlist (rare): keep it
                self.pos -= 4
                out["__cdr__"] = self.item()
                break
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        return out

    def altrep(self):
        info, state, attrs = self.item(), self.item(), self.item()
        kind = info.get(0) if isinstance(info, dict) else None
        if kind == "compact_intseq" or kind == "compact_realseq":
            n, start, step = (int(x) if kind == "compact_intseq" else x for x in state[:3])
            value = RVector(start + i * step for i in range(int(n)))
        elif isinstance(kind, str) and kind.startswith("wrap_"):
            value = RVector(state[0])
        elif kind == "deferred_string":
            source = state.get(0) if isinstance(state, dict) else state[0]
            value = RVector(None if v is None else _r_number_string(v) for v in source)
        else:
            raise RDataError(f"ALTREP class {kind!r} is not read here")
        if isinstance(attrs, dict):
            value.attributes = attrs
        return value


def _r_number_string(v) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def unserialize(data: bytes):
    """One object from R's serialization bytes (XDR, version 2 or 3)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def _decompress_rdb_entry(blob: bytes) -> bytes:
    """An .rdb entry: 4-byte big-endian output length, then the compressed bytes."""
    size = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    kind = body[:1]
    if kind == b"Z":
        out = zlib.decompress(body[1:])
    elif kind == b"2":
        out = bz2.decompress(body[1:])
    elif kind == b"X":
        out = lzma.decompress(body[1:])
    elif kind == b"0":
        out = body[1:]
    else:  # compress = TRUE: zlib with no type byte
        out = zlib.decompress(body)
    if len(out) != size:
        raise RDataError(f"an .rdb entry inflated to {len(out)} bytes, expected {size}")
    return out


def _read_compressed_file(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        return gzip.decompress(raw)
    if raw[:3] == b"BZh":
        return bz2.decompress(raw)
    if raw[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(raw)
    return raw


def read_lazyload_db(base: str | Path, names: list[str] | None = None) -> dict:
    """Objects of the lazy-load data base ``base`` (``base.rdx`` + ``base.rdb``), all or
    the ``names`` asked for."""
    base = Path(base)
    index = unserialize(_read_compressed_file(base.with_suffix(".rdx")))
    variables = index[0] if isinstance(index, list) else None
    if not isinstance(index, RVector) or not isinstance(variables, RVector):
        raise RDataError(f"{base}.rdx is not a lazy-load index")
    keys = variables.attributes.get("names", [])
    wanted = keys if names is None else names
    missing = [n for n in wanted if n not in keys]
    if missing:
        raise RDataError(f"{base}: no object(s) {missing}; it holds {list(keys)}")
    out = {}
    with open(base.with_suffix(".rdb"), "rb") as f:
        for name in wanted:
            offset, length = (int(x) for x in variables[keys.index(name)])
            f.seek(offset)
            out[name] = unserialize(_decompress_rdb_entry(f.read(length)))
    return out
