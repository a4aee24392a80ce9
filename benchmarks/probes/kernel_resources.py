# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and shared memory of Moira's decode-step kernels,
compiled for sm_90 on a machine without a GPU.

The decode step's kernels are launched through their real launchers
(``write_page_summaries`` and ``moira_decode``) on CPU tensors of the shape
asked for, with every ``kernel_moira_*[grid](...)`` call intercepted: nothing
runs, but each launch's arguments, constexprs and launch options are those of
the real step. Each captured launch is compiled by Triton for an H100/H200
(``GPUTarget("cuda", 90, 32)``) with Triton's own argument specialization
(pointers and integers divisible by 16, integers equal to 1) and dependent
launches on, and ``cuobjdump --dump-resource-usage`` (shipped with Triton)
reads the cubin (and its SASS, for GPU-wide fences). Blocks per SM follow
from the registers, warps and shared memory (65,536 registers and 228 KB per
SM, 1 KB reserved per block).

What it is for: checking how a kernel change moves registers and occupancy
before spending GPU time on it (the Merge-inside-Attend variant, docs/design.md,
"Tried, not kept", took Attend from 148 to 114 registers). The numbers depend on
the Triton version: the H200 host runs Triton 3.6; to match it here,

    pip install triton==3.6.0 --no-deps --target /tmp/triton36
    python benchmarks/probes/kernel_resources.py --triton-path /tmp/triton36

At 4x131072, Llama-3.1-8B geometry, Triton 3.6 gives Attend 148 registers
(Nsight Compute on the H200: 148, 3 blocks per SM), the same as the H200's
own compile.

    python benchmarks/probes/kernel_resources.py [--rows 4] [--context 131072]
        [--estimator mvar_top8] [--summary-dtype int8] [--src DIR] [--json OUT]

``--kv-cache-dtype fp8`` compiles the kernels' fp8 KV cache variants (e4m3
pages with K/V scales). ``--src DIR`` imports ``vllm_moira`` from DIR instead of this checkout (a
copy with a variant applied, to compare against).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The decode step's kernels, in launch order.
KERNEL_NAMES = (
    "kernel_moira_write_summaries",
    "kernel_moira_estimate",
    "kernel_moira_select",
    "kernel_moira_attend",
    "kernel_moira_merge",
)
#: The kernels that write page summaries (the prefill writer, and Estimate for
#: the pages that decode rows fill): their per-channel sums must be reduced in
#: the same order (summary_sum_layouts).
SUMMARY_KERNEL_NAMES = ("kernel_moira_write_summaries", "kernel_moira_estimate")
#: Launch options of Triton's launcher, not kernel arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")
#: Per SM on sm_90 (H100 / H200).
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_MAX_BLOCKS = 32
BLOCK_RESERVED_SHARED = 1024

_TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float8_e4m3fn": "fp8e4nv",
    "torch.float32": "fp32",
    "torch.int8": "i8",
    "torch.int32": "i32",
    "torch.int64": "i64",
}


def _import_moira(src: str | None, triton_path: str | None):
    # An empty CUDA_VISIBLE_DEVICES makes vLLM keep Triton without a driver
    # (its "distributed environment" rule) instead of a placeholder module.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.pop("TRITON_INTERPRET", None)
    if triton_path:
        sys.path.insert(0, triton_path)
    sys.path.insert(0, src or str(Path(__file__).resolve().parents[2]))
    from vllm_moira.v1.attention.backends import moira

    return moira


@contextlib.contextmanager
def captured_launches(moira):
    """Replace each kernel in ``moira`` by a stand-in whose ``[grid](...)``
    records (kernel, grid, args, kwargs) instead of launching."""
    launches: list[tuple[Any, tuple, tuple, dict]] = []

    class _Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                launches.append((self.fn, tuple(grid), args, kwargs))

            return record

    # (--src trees from before the "pages" schedule have no such kernels.)
    originals = {name: getattr(moira, name) for name in KERNEL_NAMES if hasattr(moira, name)}
    dependent = moira._dependent_launch
    try:
        for name, fn in originals.items():
            setattr(moira, name, _Recorder(fn))
        # As on the H200: every kernel waits on the previous one (gdc_wait).
        moira._dependent_launch = lambda *_: {"USE_GDC": True}
        yield launches
    finally:
        for name, fn in originals.items():
            setattr(moira, name, fn)
        moira._dependent_launch = dependent


def decode_step_launches(moira, rows: int, context: int, estimator: str, summary_dtype: str,
                         num_q_heads: int = 32, num_kv_heads: int = 8, head_size: int = 128,
                         kv_cache_dtype: str = "auto",
                         launch: dict | None = None) -> list:  # fmt: skip
    """The launches of one decode layer (summary writer, Estimate, Select,
    Attend, Merge) at ``rows`` x ``context`` tokens. Tensors are small where
    the kernels' specialization allows (a few KV blocks): only shapes the
    launchers read reach the constexprs. ``kv_cache_dtype="fp8"``: on vLLM's
    fp8 cache (e4m3 with K/V scales). ``launch``: launch overrides by kernel
    (moira.check_launch_overrides)."""
    import torch

    config = moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype)
    max_pages = -(-context // moira.MOIRA_PAGE_SIZE)
    num_blocks = 16
    kv = torch.zeros(num_blocks, num_kv_heads, moira.MOIRA_PAGE_SIZE, 2 * head_size,
                     dtype=torch.bfloat16)  # fmt: skip
    scales: dict[str, torch.Tensor] = {}
    if kv_cache_dtype == "fp8":
        kv = kv.to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    dtype, summary_rows = moira.summary_storage(config.summary_slots, summary_dtype)
    summaries = torch.zeros(num_blocks, num_kv_heads, summary_rows, head_size, dtype=dtype)
    table = torch.zeros(rows, max_pages, dtype=torch.int32)
    seq = torch.full((rows,), context, dtype=torch.int32)
    query = torch.zeros(rows, num_q_heads, head_size, dtype=torch.bfloat16)
    out = torch.zeros_like(query)
    slots = torch.zeros(rows, dtype=torch.int64)
    # (--src trees from before launch overrides take none.)
    overrides = {"launch": launch} if launch else {}
    ws = moira.MoiraWorkspace(rows, num_q_heads, num_kv_heads, head_size, max_pages, config,
                              "cpu", **overrides)  # fmt: skip
    with captured_launches(moira) as launches:
        # The writer runs on prefill tokens; in the decode step Estimate writes
        # the pages that filled (write_filled_pages, as the backend calls it).
        if scales:
            moira.write_page_summaries(kv, summaries, slots, scales["k_scale"], **overrides)
        else:
            moira.write_page_summaries(kv, summaries, slots, **overrides)
        # (--src trees from before it have no such option.)
        decode_options = ({"write_filled_pages": True} if "write_filled_pages"
                          in inspect.signature(moira.moira_decode).parameters else {})  # fmt: skip
        moira.moira_decode(
            query, kv, summaries, table, seq, out, ws, head_size**-0.5, **decode_options, **scales
        )
    return launches


def compile_signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attributes, options) of one launch, specialized
    as Triton's launcher would: tensors by dtype, 16-byte-aligned pointers and
    integers divisible by 16 marked so, integers equal to 1 constant."""
    import torch

    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    values = dict(zip((p.name for p in fn.params), args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = values.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TORCH_TO_TRITON[str(value.dtype)]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constexprs[param.name] = 1
                continue
            signature[param.name] = param.annotation or ("i32" if abs(value) < 2**31 else "i64")
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {param.name}={value!r}")
    return signature, constexprs, attrs, options


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of a one-kernel cubin (cuobjdump),
    ``membar``: its GPU-wide memory fences (MEMBAR.*.GPU / .SYS in the SASS,
    which an acquire-release atomic brings with it), ``sass``: its static SASS
    instruction count, and ``sass_loops``: the instruction count of each loop's
    body."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([str(tool), "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in fields:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{text}")
    usage = {k.lower(): int(v) for k, v in fields.items()}
    # GPU- or system-scope only: MEMBAR.ALL.CTA (with FENCE.VIEW.ASYNC, before
    # warpgroup MMAs read shared memory) orders the block's own accesses.
    usage["membar"] = len(re.findall(r"\bMEMBAR\.[A-Z.]*\b(?:GPU|SYS)\b", sass))
    usage["sass"], usage["sass_loops"], usage["sass_loop_memory"] = sass_instruction_counts(sass)
    return usage


def sass_instruction_counts(sass: str) -> tuple[int, list[int], list[dict[str, int]]]:
    """Static instruction counts of cuobjdump's SASS (each instruction a line
    ``/*0a40*/  OPCODE ...;``): the total; each loop body's, a loop being a
    backward branch and its body the instructions from the branch's target to
    the branch (Estimate's stored-key loop: one key per iteration, or one pair
    of int4 keys); and each loop body's memory instructions by opcode (LDG:
    a global load into registers, LDGSTS: an asynchronous copy into shared
    memory, as software pipelining issues them; LDS / LDSM: shared-memory
    loads, LDSM the tensor cores' ldmatrix). A proxy for a change's
    instruction work before timing it on the GPU."""
    code = [(int(address, 16), op) for address, op in
            re.findall(r"^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]  # fmt: skip
    loops, memory = [], []
    for address, op in code:
        branch = re.match(r"(?:@!?U?P\w+\s+)?BRA\b.*?(0x[0-9a-f]+)", op)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for a, o in code
                    if start <= a <= address]  # fmt: skip
            loops.append(len(body))
            ops: dict[str, int] = {}
            for opcode in body:
                if opcode.startswith(("LD", "ST")):
                    ops[opcode] = ops.get(opcode, 0) + 1
            memory.append(dict(sorted(ops.items())))
    return len(code), loops, memory


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident blocks per SM allowed by registers (allocated per warp in
    units of 256, i.e. 8 per thread) and shared memory."""
    regs_per_warp = -(-registers // 8) * 8 * 32
    by_regs = SM_REGISTERS // (regs_per_warp * num_warps)
    by_shared = SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED)
    return max(0, min(by_regs, by_shared, SM_MAX_BLOCKS))


def summary_sum_layouts(ttgir: str, page_size: int, head_size: int) -> list[str]:
    """The register layouts (definitions, not names) of every fp32
    [page_size, head_size] reduction in a kernel's TTGIR: the page summary's
    per-channel sums. On the GPU their order of additions follows the layout,
    so the writer's and Estimate's summaries have the same bits only if these
    are the same in both kernels."""
    defs = dict(re.findall(r"^(#[A-Za-z_]\w*) = (.*)$", ttgir, re.M))
    shape = rf"tensor<{page_size}x{head_size}xf32, (#[A-Za-z_]\w*)>"
    names = re.findall(rf"^\s*\}}\) : \({shape}\) ->", ttgir, re.M)
    return sorted({defs.get(name, name) for name in names})


def kernel_resources(launches: list, page_size: int = 64) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for fn, grid, args, kwargs in launches:
        signature, constexprs, attrs, options = compile_signature(fn, args, kwargs)
        options.setdefault("num_warps", 4)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
        usage = resource_usage(compiled.asm["cubin"])
        shared = int(compiled.metadata.shared)
        layouts = {}
        if fn.__name__ in SUMMARY_KERNEL_NAMES:
            layouts["summary_sum_layouts"] = summary_sum_layouts(
                compiled.asm["ttgir"], page_size, constexprs["HEAD_SIZE"]
            )
        rows.append({
            "kernel": fn.__name__,
            "grid": list(grid),
            "num_warps": options["num_warps"],
            "maxnreg": options.get("maxnreg"),
            "registers": usage["reg"],
            "spill_bytes": usage.get("local", 0),
            "stack_bytes": usage.get("stack", 0),
            "shared_bytes": shared,
            "blocks_per_sm": blocks_per_sm(usage["reg"], options["num_warps"], shared),
            "gpu_fences": usage["membar"],
            "sass_instructions": usage["sass"],
            "sass_loop_instructions": usage["sass_loops"],
            "sass_loop_memory_ops": usage["sass_loop_memory"],
            **layouts,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--estimator", default=None, help="default: the backend's")
    ap.add_argument("--summary-dtype", default=None, help="default: the backend's")
    ap.add_argument("--src", default=None, help="import vllm_moira from this directory")
    ap.add_argument("--triton-path", default=None, help="a directory holding another Triton")
    ap.add_argument(
        "--estimate-launch",
        default=None,
        help="JSON of Estimate launch overrides (moira.estimate_launch), e.g. "
        "'{\"key_stages\": 2}'",
    )
    ap.add_argument(
        "--attend-launch",
        default=None,
        help="JSON of Attend launch overrides (moira.attend_launch), e.g. '{\"num_stages\": 4}'",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="fp8: the kernels' fp8 KV cache variant (e4m3, K/V scales)")  # fmt: skip
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    moira = _import_moira(a.src, a.triton_path)
    import triton

    launch = {kernel: json.loads(text) for kernel, text in (
        ("estimate", a.estimate_launch), ("attend", a.attend_launch),
    ) if text}  # fmt: skip
    if launch:
        try:
            moira.check_launch_overrides(launch)
        except ValueError as exc:
            ap.error(str(exc))

    estimator = a.estimator or moira.MOIRA_DEFAULT_ESTIMATOR
    summary_dtype = a.summary_dtype or moira.MOIRA_DEFAULT_SUMMARY_DTYPE
    launches = decode_step_launches(moira, a.rows, a.context, estimator, summary_dtype,
                                    kv_cache_dtype=a.kv_cache_dtype, launch=launch)  # fmt: skip
    rows = kernel_resources(launches, moira.MOIRA_PAGE_SIZE)
    for r in rows:
        print(f"{r['kernel']:32s} warps {r['num_warps']:2d}  registers {r['registers']:3d}  "
              f"spills {r['spill_bytes']:4d} B  shared {r['shared_bytes']:6d} B  "
              f"blocks/SM {r['blocks_per_sm']:2d}  GPU fences {r['gpu_fences']}  "
              f"SASS {r['sass_instructions']} (loops {r['sass_loop_instructions']})")  # fmt: skip
    summary_layouts = [r["summary_sum_layouts"] for r in rows if "summary_sum_layouts" in r]
    same_summary_layouts = len(summary_layouts) == 2 and summary_layouts[0] == summary_layouts[1]
    print(f"writer and Estimate reduce the page summary's sums in the same layout: "
          f"{same_summary_layouts} {summary_layouts[0] if summary_layouts else ''}")  # fmt: skip
    if a.json:
        record = {
            "command": "python benchmarks/probes/kernel_resources.py "
            + " ".join(argv or sys.argv[1:]),
            "triton": triton.__version__,
            "target": "cuda sm_90",
            "shape": f"{a.rows}x{a.context}",
            "estimator": estimator,
            "summary_dtype": summary_dtype,
            "kv_cache_dtype": a.kv_cache_dtype,
            "estimate_launch": moira.estimate_launch(
                moira.estimator_num_top(estimator),
                summary_dtype != "bfloat16",
                launch.get("estimate"),
            )._asdict(),
            "attend_launch": moira.attend_launch(
                a.kv_cache_dtype == "fp8", launch.get("attend")
            )._asdict(),
            "same_summary_sum_layouts": same_summary_layouts,
            "rows": rows,
        }
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
