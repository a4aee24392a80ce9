# SPDX-License-Identifier: Apache-2.0
"""What Estimate would cost on a 4-bit centered key copy (the study's ``keyq4c``).

The estimator study finds that page masses from every key of the page, rounded to 4 bits
around the page mean with one scale per channel (``research.quantized_key_logmass(...,
bits=4, centered=True)``), meet the whole accuracy bar, at about 3.4x the bytes Estimate
reads today. Whether that is affordable is a question of one kernel's speed, which this
probe answers before any backend change: a writer (torch), the Triton kernel, a float32
reference of the kernel's math, and a GPU timing beside the backend's Estimate on the
same batch::

    python -m benchmarks.probes.keyq_estimate --shapes 4x131072,32x8192 --out keyq.json

Layout per (block, KV head): ``codes`` ``[64, D // 2]`` uint8, byte ``c`` holding channel
``c`` in its low nibble and channel ``c + D / 2`` in its high one, each as code + 8 (codes in
[-7, 7]); ``scales`` and ``means`` ``[D]`` (``--meta-dtype``). A key is
``code * scale + mean``, so a logit is ``x . (code * scale) + x . mean``: the kernel rounds
``code * scale`` and the query to fp16 and multiplies them on the tensor cores, several pages
per product.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.probes import research_estimators as research

BITS = 4
LEVELS = 2 ** (BITS - 1) - 1
PAGE = 64


def quantize_key_pages(keys: torch.Tensor, meta_dtype: torch.dtype = torch.float16):
    """``keys`` ``[blocks, H_kv, 64, D]`` -> ``(codes, scales, means)`` in the layout above;
    the rounding of ``research.quantized_key_logmass(..., 4, centered=True)``."""
    keys = keys.float()
    means = keys.mean(dim=2, keepdim=True)  # [blocks, H, 1, D]
    codes, scales = research.round_over_tokens(keys - means, BITS)
    codes = codes.to(torch.int16) + LEVELS + 1  # as stored: code + 8, in [1, 15]
    half = keys.shape[-1] // 2
    packed = (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)
    return packed.contiguous(), scales[:, :, 0].to(meta_dtype), means[:, :, 0].to(meta_dtype)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` ``[..., 64, D // 2]`` uint8 -> ``[..., 64, D]`` int8 codes in [-7, 7]."""
    wide = codes.to(torch.int16)
    return (torch.cat([wide & 15, wide >> 4], dim=-1) - LEVELS - 1).to(torch.int8)


def keyq_logmass_reference(query, codes, scales, means, block_table, seq_lens, scale):
    """Float32 reference of the kernel's math: ``[B, H_kv, G, max_pages]`` log-masses of each
    row's full pages (-inf elsewhere). The tensor-core operands are rounded to fp16 as the
    kernel rounds them: the scaled query, and each key's codes times its channel scales."""
    batch, num_q_heads, head_size = query.shape
    num_kv_heads = codes.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.full((batch, num_kv_heads, group, block_table.shape[1]), float("-inf"))
    x = query.float().cpu().view(batch, num_kv_heads, group, head_size) * scale
    for row in range(batch):
        xq = x[row].half().float()  # [H, G, D]
        for page in range(int(seq_lens[row]) // PAGE):
            block = int(block_table[row, page])
            s, m = scales[block].float().cpu(), means[block].float().cpu()  # [H, D]
            k = (unpack_codes(codes[block].cpu()).float() * s[:, None, :]).half().float()
            logits = (
                torch.einsum("hgd,htd->hgt", xq, k)
                + torch.einsum("hgd,hd->hg", x[row], m)[..., None]
            )
            out[row, :, :, page] = torch.logsumexp(logits, dim=-1)
    return out


@triton.jit
def kernel_keyq_estimate(
    query_ptr,  # [B, H_q, D] bf16
    codes_ptr,  # [blocks, H_kv, 64, D // 2] uint8 (layout in the module docstring)
    scales_ptr,  # [blocks, H_kv, D] fp16 / fp32
    means_ptr,  # [blocks, H_kv, D] fp16 / fp32
    block_table_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32
    logmass_ptr,  # [B, H_kv, G, max_pages] fp32 (full pages written)
    scale,
    stride_q_row, stride_q_head, stride_c_block, stride_c_head, stride_m_block, stride_m_head,
    stride_bt_row, stride_l_row, stride_l_head, stride_l_group,
    GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    PIPELINE_STAGES: tl.constexpr,
):  # fmt: skip
    # One program: TILES_PER_PROGRAM tiles of TILE_PAGES consecutive pages of one (row, KV
    # head). A tile is one [ROWS, D] x [D, TILE_PAGES * 64] product: the codes times their
    # page's channel scales are the keys (fp16), so every page of the tile shares the query
    # operand, and the pipelined loop keeps the next tiles' code loads in flight while this
    # one computes: the bytes per page are few, so latency, not bandwidth, bounds one page.
    row = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.program_id(2) * (TILES_PER_PROGRAM * TILE_PAGES)
    num_full = tl.load(seq_lens_ptr + row) // PAGE_SIZE
    last = tl.minimum(first + TILES_PER_PROGRAM * TILE_PAGES, num_full)
    HALF: tl.constexpr = HEAD_SIZE // 2
    offs_g = tl.arange(0, ROWS)
    offs_h = tl.arange(0, HALF)
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_p = tl.arange(0, TILE_PAGES)
    mask_g = offs_g < GROUP_SIZE
    q_rows = query_ptr + row * stride_q_row + (head * GROUP_SIZE + offs_g)[:, None] * stride_q_head
    # The two halves of the channels, as the codes' two nibbles hold them.
    x_lo = tl.load(q_rows + offs_h[None, :], mask=mask_g[:, None], other=0.0).to(tl.float32) * scale
    x_hi = tl.load(q_rows + HALF + offs_h[None, :], mask=mask_g[:, None], other=0.0).to(
        tl.float32) * scale  # fmt: skip
    xq_lo = x_lo.to(tl.float16)
    xq_hi = x_hi.to(tl.float16)
    for start in tl.range(first, last, TILE_PAGES, num_stages=PIPELINE_STAGES):
        pages = start + offs_p  # [TILE]
        valid = pages < last
        blocks = tl.load(block_table_ptr + row * stride_bt_row + pages, mask=valid,
                         other=0).to(tl.int64)  # fmt: skip
        meta = (blocks * stride_m_block + head * stride_m_head)[:, None] + offs_h[None, :]
        s_lo = tl.load(scales_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(scales_ptr + meta + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        m_lo = tl.load(means_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)
        m_hi = tl.load(means_ptr + meta + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        code_rows = (blocks * stride_c_block + head * stride_c_head)[:, None, None] + (
            offs_t[None, :, None] * HALF + offs_h[None, None, :])  # fmt: skip
        packed = tl.load(codes_ptr + code_rows, mask=valid[:, None, None], other=0).to(tl.int32)
        k_lo = (((packed & 15) - 8).to(tl.float32) * s_lo[:, None, :]).to(tl.float16)
        k_hi = (((packed >> 4) - 8).to(tl.float32) * s_hi[:, None, :]).to(tl.float16)
        k_lo = tl.reshape(k_lo, (TILE_PAGES * PAGE_SIZE, HALF))
        k_hi = tl.reshape(k_hi, (TILE_PAGES * PAGE_SIZE, HALF))
        logits = tl.dot(xq_lo, tl.trans(k_lo))  # [ROWS, TILE * PAGE]
        logits = tl.dot(xq_hi, tl.trans(k_hi), logits)
        offset = tl.sum(x_lo[:, None, :] * m_lo[None, :, :], axis=2) + tl.sum(
            x_hi[:, None, :] * m_hi[None, :, :], axis=2)  # [ROWS, TILE]  # fmt: skip
        logits3 = tl.reshape(logits, (ROWS, TILE_PAGES, PAGE_SIZE)) + offset[:, :, None]
        peak = tl.max(logits3, axis=2)
        logmass = peak + tl.log(tl.sum(tl.exp(logits3 - peak[:, :, None]), axis=2))
        tl.store(logmass_ptr + row * stride_l_row + head * stride_l_head
                 + offs_g[:, None] * stride_l_group + pages[None, :], logmass,
                 mask=mask_g[:, None] & valid[None, :])  # fmt: skip


#: Launch parameters (tile_pages, tiles_per_program, pipeline_stages, num_warps): the default
#: and the candidates ``--sweep`` times beside it.
KEYQ_LAUNCH = (4, 4, 3, 4)
KEYQ_SWEEP = ((2, 8, 3, 4), (4, 2, 3, 4), (4, 4, 2, 4), (4, 8, 3, 4), (8, 2, 3, 8), (4, 4, 4, 8))


def keyq_estimate(query, codes, scales, means, block_table, seq_lens, logmass, scale,
                  launch: tuple[int, int, int, int] = KEYQ_LAUNCH) -> None:  # fmt: skip
    """Launch ``kernel_keyq_estimate`` over ``[B, H_kv, ceil(max_pages / pages per program)]``;
    ``launch``: (tile_pages, tiles_per_program, pipeline_stages, num_warps)."""
    tile_pages, tiles_per_program, stages, num_warps = launch
    batch, num_q_heads, head_size = query.shape
    num_kv_heads = codes.shape[1]
    group = num_q_heads // num_kv_heads
    grid = (batch, num_kv_heads,
            triton.cdiv(block_table.shape[1], tile_pages * tiles_per_program))  # fmt: skip
    kernel_keyq_estimate[grid](
        query, codes, scales, means, block_table, seq_lens, logmass, scale,
        query.stride(0), query.stride(1), codes.stride(0), codes.stride(1), scales.stride(0),
        scales.stride(1), block_table.stride(0), logmass.stride(0), logmass.stride(1),
        logmass.stride(2),
        GROUP_SIZE=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_SIZE=head_size,
        PAGE_SIZE=PAGE, TILE_PAGES=tile_pages, TILES_PER_PROGRAM=tiles_per_program,
        PIPELINE_STAGES=stages, num_warps=num_warps,
    )  # fmt: skip


def time_launch(launch_args, rows, reference, launch) -> tuple[float, float]:
    """CUDA-graph µs of one launch config, and its max |error| against ``reference`` (the
    log-masses of ``rows``) on the full pages."""
    from benchmarks import moira_correctness as mc

    logmass = launch_args[6]
    logmass.fill_(float("-inf"))
    us = mc.graph_time_us(lambda: keyq_estimate(*launch_args, launch=launch))
    finite = torch.isfinite(reference)
    got = logmass[rows].cpu()
    return us, float((got[finite] - reference[finite]).abs().max())


def main() -> None:
    from benchmarks import moira_correctness as mc

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x131072,32x8192", help="BATCHxCONTEXT,...")
    parser.add_argument("--meta-dtype", choices=("float16", "float32"), default="float16")
    parser.add_argument("--sweep", action="store_true",
                        help="also time every KEYQ_SWEEP launch, each checked against the "
                        "reference")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    meta_dtype = getattr(torch, args.meta_dtype)
    record = {"command": "python -m benchmarks.probes.keyq_estimate --shapes "
              f"{args.shapes} --meta-dtype {args.meta_dtype}" + (" --sweep" * args.sweep),
              "launch": list(KEYQ_LAUNCH),
              "gpu": torch.cuda.get_device_name(), "d2d_copy_tbps": mc.copy_bandwidth_tbps(),
              "rows": []}  # fmt: skip
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        case = mc.build_case(batch, context)
        codes, scales, means = quantize_key_pages(case["kv"][..., : mc.D], meta_dtype)
        logmass = torch.full((batch, mc.HKV, mc.HQ // mc.HKV, case["max_pages"]), float("-inf"),
                             device="cuda")  # fmt: skip
        launch_args = (case["query"], codes, scales, means, case["table"], case["seq"], logmass,
                       mc.SCALE)  # fmt: skip
        rows = [0, batch - 1]
        sub = {k: v[rows] for k, v in (("query", case["query"]), ("table", case["table"]),
                                       ("seq", case["seq"]))}  # fmt: skip
        reference = keyq_logmass_reference(sub["query"], codes, scales, means, sub["table"],
                                           sub["seq"].cpu(), mc.SCALE)  # fmt: skip
        keyq_us, max_err = time_launch(launch_args, rows, reference, KEYQ_LAUNCH)
        full_pages = sum(n // PAGE for n in case["seq_lens"])
        per_page = PAGE * mc.D // 2 + 2 * mc.D * torch.finfo(meta_dtype).bits // 8
        row = {
            "shape": shape, "meta_dtype": args.meta_dtype, "keyq_estimate_us": keyq_us,
            "bytes_per_page_head": per_page,
            "keyq_tbps": full_pages * mc.HKV * per_page / (keyq_us * 1e-6) / 1e12,
            "max_abs_err_vs_reference": max_err,
            "default_estimate": mc.time_estimator(case, "int8:mvar_top8"),
        }  # fmt: skip
        if args.sweep:
            row["sweep"] = []
            for launch in KEYQ_SWEEP:
                us, err = time_launch(launch_args, rows, reference, launch)
                row["sweep"].append({"launch": list(launch), "keyq_estimate_us": us,
                                     "max_abs_err_vs_reference": err})  # fmt: skip
        row["keyq_fraction_of_copy_bw"] = row["keyq_tbps"] / record["d2d_copy_tbps"]
        print(json.dumps({k: v for k, v in row.items() if k != "default_estimate"}), flush=True)
        print("  default:", {k: row["default_estimate"][k] for k in ("estimate_us", "select_us")})
        record["rows"].append(row)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
