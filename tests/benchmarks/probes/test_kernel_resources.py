# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/kernel_resources.py: the decode step's kernels compiled for
sm_90 without a GPU (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _load import ROOT, load

kr = load("probes.kernel_resources")
SCRIPT = "benchmarks/probes/kernel_resources.py"


def test_blocks_per_sm_from_registers_warps_and_shared_memory():
    # Attend on the H200 (Nsight Compute): 148 registers, 4 warps, 38.9 KB.
    assert kr.blocks_per_sm(148, 4, 38916) == 3
    # Registers are allocated 8 per thread at a time: 114 -> 120 -> 4 blocks.
    assert kr.blocks_per_sm(114, 4, 38916) == 4
    # Estimate under its 128-register cap: 2 warps, 16 KB -> 8 blocks.
    assert kr.blocks_per_sm(128, 2, 16384) == 8
    # Shared memory bounds it (1 KB reserved per block), and so does the
    # 32-block limit.
    assert kr.blocks_per_sm(32, 1, 100 * 1024) == 2
    assert kr.blocks_per_sm(16, 1, 0) == 32


def test_sass_instruction_counts_total_and_loop_bodies():
    sass = """
        Function : kernel_example
        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_CTAID.X ;        /* 0x0000000000007919 */
        /*0020*/                   IADD3 R2, R0, 0x1, RZ ;     /* 0x0000000100027810 */
        /*0030*/              @!P2 LDS.U8 R3, [R2+0x10] ;
        /*0040*/               @P0 BRA 0x20 ;                  /* 0x0000000000000947 */
        /*0050*/              @!P1 BRA 0x70 ;                  /* forward: not a loop */
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70 ;                  /* the padding after EXIT */
    """
    total, loops, memory = kr.sass_instruction_counts(sass)
    assert total == 8
    assert loops == [3]  # 0x20..0x40; the padding's branch to itself is no loop
    assert memory == [{"LDS.U8": 1}]


@pytest.mark.slow
def test_decode_step_compiles_for_sm90_without_a_gpu(tmp_path):
    """The real launchers' five launches (writer, Estimate, Select, Attend,
    Merge) are captured, compiled for sm_90 and read back with cuobjdump. A
    subprocess: the tests' own import runs Triton in interpreter mode."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, SCRIPT, "--rows", "2", "--context", "4096",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["target"] == "cuda sm_90" and record["shape"] == "2x4096"
    kernels = [row["kernel"] for row in record["rows"]]
    assert kernels == list(kr.KERNEL_NAMES)
    by_name = {row["kernel"]: row for row in record["rows"]}
    for row in record["rows"]:
        assert 16 <= row["registers"] <= 255 and row["blocks_per_sm"] >= 1, row
        # No GPU-wide fence in the decode step: Select's counters are relaxed
        # atomics (Triton's default acq_rel put a MEMBAR before each).
        assert row["gpu_fences"] == 0, row
    # Launch options reach the compile: Estimate's warps and register cap.
    estimate = by_name["kernel_moira_estimate"]
    assert estimate["maxnreg"] == 128 and estimate["registers"] <= 128
    assert estimate["num_warps"] == 4
    # One loop in Estimate: the stored keys' (the sink/current-page and summary
    # tile programs are straight-line code).
    assert len(estimate["sass_loop_instructions"]) == 1, estimate
    assert 0 < estimate["sass_loop_instructions"][0] < estimate["sass_instructions"]
    # Attend's grid is one block per N_F (396 off the GPU).
    assert by_name["kernel_moira_attend"]["grid"] == [396]
    # The writer and Estimate reduce a page summary's sums in one layout.
    assert record["same_summary_sum_layouts"] is True
    assert by_name["kernel_moira_estimate"]["summary_sum_layouts"]


@pytest.mark.slow
def test_two_slot_estimate_sums_page_summaries_in_the_writers_layout(tmp_path):
    """int8 mvar: Estimate's 64-page [64, D] int8 summary tiles once gave the
    page's key tile their layout (Triton's coalescing merges accesses of one
    shape), and on the H200 Estimate's summaries then differed from the
    writer's in the last bits. The compiled layouts of both kernels' sums must
    agree (the check that this test runs reported False on that tree)."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, SCRIPT, "--rows", "2", "--context", "4096",
           "--estimator", "mvar", "--summary-dtype", "int8", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    by_name = {row["kernel"]: row for row in record["rows"]}
    writer = by_name["kernel_moira_write_summaries"]["summary_sum_layouts"]
    assert writer and writer == by_name["kernel_moira_estimate"]["summary_sum_layouts"]
    assert record["same_summary_sum_layouts"] is True


def test_summary_sum_layouts_reads_layout_definitions():
    ttgir = "\n".join([
        "#blocked = #ttg.blocked<{sizePerThread = [1, 8]}>",
        "#blocked1 = #ttg.blocked<{sizePerThread = [1, 16]}>",
        "    }) : (tensor<64x128xf32, #blocked1>) -> tensor<128xf32, #ttg.slice<{dim = 0}>>",
        "    }) : (tensor<32x128xf32, #blocked>) -> tensor<128xf32, #ttg.slice<{dim = 0}>>",
    ])  # fmt: skip
    # Only the [64, 128] fp32 reductions count, by their layouts' definitions.
    assert kr.summary_sum_layouts(ttgir, 64, 128) == ["#ttg.blocked<{sizePerThread = [1, 16]}>"]
    assert kr.summary_sum_layouts(ttgir, 64, 64) == []


def test_decode_step_launches_no_writer_and_writer_shares_estimates_warps():
    # The captured decode step (kernel_resources' interception, nothing runs):
    # the writer is launched for the prefill tokens' slots only, the decode
    # step itself is Estimate (writing the filled pages), Select, Attend,
    # Merge; and the writer runs on Estimate's warps, the condition for their
    # summaries to be equal bit for bit on the GPU.
    sys.path.insert(0, str(ROOT))
    from vllm_moira.v1.attention.backends import moira

    launches = kr.decode_step_launches(moira, 2, 4096, moira.MOIRA_DEFAULT_ESTIMATOR,
                                       moira.MOIRA_DEFAULT_SUMMARY_DTYPE)  # fmt: skip
    names = [fn.__name__ for fn, _, _, _ in launches]
    assert names == [
        "kernel_moira_write_summaries",  # the prefill writer the tool launches first
        "kernel_moira_estimate",
        "kernel_moira_select",
        "kernel_moira_attend",
        "kernel_moira_merge",
    ]
    warps = {fn.__name__: kwargs.get("num_warps") for fn, _, _, kwargs in launches}
    assert warps["kernel_moira_write_summaries"] == warps["kernel_moira_estimate"]
    assert warps["kernel_moira_estimate"] == moira.estimate_launch(8, True).num_warps
    estimate_kwargs = launches[1][3]
    assert estimate_kwargs["WRITE_FILLED_PAGE"] is True


@pytest.mark.slow
def test_fp8_kv_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """--kv-cache-dtype fp8: the writer, Estimate and Attend compiled with
    their fp8 page loads (KV_FP8) for sm_90, without spills or GPU-wide
    fences, and the writer's and Estimate's page sums in one layout (so their
    summaries of the same fp8 page agree bit for bit on the GPU)."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, SCRIPT, "--rows", "2", "--context", "4096", "--kv-cache-dtype", "fp8",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["kv_cache_dtype"] == "fp8" and record["same_summary_sum_layouts"] is True
    for row in record["rows"]:
        assert row["spill_bytes"] == 0 and row["gpu_fences"] == 0, row
        assert row["blocks_per_sm"] >= 1, row


def test_fp8_decode_step_launches_read_the_scales():
    sys.path.insert(0, str(ROOT))
    from vllm_moira.v1.attention.backends import moira

    launches = kr.decode_step_launches(moira, 2, 4096, moira.MOIRA_DEFAULT_ESTIMATOR,
                                       moira.MOIRA_DEFAULT_SUMMARY_DTYPE,
                                       kv_cache_dtype="fp8")  # fmt: skip
    fp8 = {fn.__name__: kwargs.get("KV_FP8") for fn, _, _, kwargs in launches}
    assert fp8 == {"kernel_moira_write_summaries": True, "kernel_moira_estimate": True,
                   "kernel_moira_select": None, "kernel_moira_attend": True,
                   "kernel_moira_merge": None}  # fmt: skip


def _kernel_row(tmp_path, kernel: str, *args: str) -> dict:
    """One kernel's row of the probe's record at 2x4096 (a subprocess, no interpreter)."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, SCRIPT, "--rows", "2", "--context", "4096", *args, "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    return next(row for row in rows if row["kernel"] == kernel)


@pytest.mark.slow
def test_int4_key_pair_costs_no_more_instructions_than_two_int8_keys(tmp_path):
    """int4 summaries: Estimate's loop takes a pair of stored keys per iteration, their
    nibbles in place on the int8 tensor cores (_int4_pair_digit_dots); unpacking the two
    keys first took 2.6 times the instructions of two int8 iterations (928 against 352,
    Triton 3.6), and the int4 Estimate ran at under half the int8 one's byte rate."""
    estimate = "kernel_moira_estimate"
    int8 = _kernel_row(tmp_path, estimate, "--estimator", "mvar_top8", "--summary-dtype", "int8")
    int4 = _kernel_row(tmp_path, estimate, "--estimator", "mvar_top8", "--summary-dtype", "int4")
    (int8_key,) = int8["sass_loop_instructions"]
    (int4_pair,) = int4["sass_loop_instructions"]
    assert int4_pair <= 2 * int8_key, (int4_pair, int8_key)
    assert int4["spill_bytes"] == 0 and int4["registers"] <= 128, int4
