# SPDX-License-Identifier: Apache-2.0
"""Moira kernels at real shapes on a Hopper GPU: correctness record + timing sanity.

Llama-3.1-8B geometry (32 query heads, 8 KV heads, D=128; ``--heads`` for another, e.g.
``12,2`` for Qwen2.5-Coder-1.5B), 64-token pages in shuffled blocks (block 0 = vLLM's null
block), ragged row lengths.

Correctness (written to --json):
- gamma=1 keeps every page and matches vLLM's FA3 (flash_attn_varlen_func over
  the same paged cache) within one bf16 ulp, and a float32 dense reference;
- CUDA-graph replay equals eager execution bit for bit, also after the row
  lengths and queries change under the captured graph;
- Select's lists equal the float32 reference lists (from the same log-masses);
- Estimate matches the float32 reference; sparse output matches the reference
  on the kernel's lists; head-major and token-major layouts give identical bits.

Timing sanity (--timing-json, not a test): Estimate+Select per layer, Attend +
Merge on the kept pages with their achieved bandwidth, dense FA3, and the
device-to-device copy rate measured in the same run.

fp8 KV cache (--kv-cache-dtype fp8): the same checks and timings on the cache
quantized to e4m3 with per-layer K and V scales (amax / 448, as a checkpoint's
calibration gives them). FA3 runs on the same fp8 cache with its query in e4m3
(q_scale 1, vLLM's default) and the scales as descales; the float32 reference
reads the dequantized cache with the bf16 query, as Moira does.

Page-mass estimators (--estimators mvar,int8:mvar_top8): per
estimator and shape, summaries written by the kernel writer of that estimator
(checked against the reference on a few pages), Estimate checked against the
reference on a few rows and Select's lists against the reference lists, and
(timing) Estimate, Select, Estimate+Select and the summary write.

    python benchmarks/moira_correctness.py --json correctness.json \
        --timing-json kernel_timing.json
    python benchmarks/moira_correctness.py --estimators mvar,int8:mvar_top8 \
        --only-estimators --json estimator_kernels.json \
        --timing-json estimator_timing.json
    python benchmarks/moira_correctness.py --kv-cache-dtype fp8 \
        --json correctness_fp8.json --timing-json kernel_timing_fp8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm.v1.attention.backends import moira  # noqa: E402

from benchmarks.paper_attend import PaperAttend  # noqa: E402
from tests.v1.attention.moira_test_utils import (  # noqa: E402
    PAGE,
    make_block_table,
    make_kv_cache,
    shape_attention,
)
from vllm_moira.v1.attention.ops import moira_reference as ref  # noqa: E402

#: Query and KV heads of the cases (Llama-3.1-8B's) unless build_case is given others
#: (--heads), and the head size.
HQ, HKV, D = 32, 8, 128
#: Launch overrides by kernel (moira.check_launch_overrides) that every workspace and
#: launch of this run uses: --estimate-launch, or a GPU test's candidate
#: (tests/v1/attention/moira_test_utils.py). Sweeps add their candidate on top.
LAUNCH: dict[str, dict] = {}


def with_launch(**changes: dict) -> dict[str, dict]:
    """LAUNCH with ``changes`` (overrides by kernel) merged into it, kernel by kernel."""
    merged = {kernel: dict(values) for kernel, values in LAUNCH.items()}
    for kernel, values in changes.items():
        merged[kernel] = {**merged.get(kernel, {}), **values}
    return merged


SCALE = D**-0.5


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------
def build_case(batch, context, layout="token_major", pattern="concentrated", seed=0,
               ragged=True, kv_cache_dtype="auto", heads=(HQ, HKV)):  # fmt: skip
    """A decode batch; ``kv_cache_dtype="fp8"``: its cache quantized to e4m3
    with per-layer scales (``case["scales"]``, the kernels' k_scale / v_scale)."""
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context] * batch
    if ragged:  # partial last pages, different per row
        seq_lens = [context - int(x) for x in torch.randint(0, 200, (batch,), generator=gen)]
    max_pages = math.ceil(context / PAGE)
    num_blocks = batch * max_pages + 17
    torch.manual_seed(seed)
    kv = make_kv_cache(num_blocks, heads[1], D, layout, device="cuda")
    table = make_block_table(seq_lens, num_blocks, max_pages, generator=gen, device="cuda")
    query = torch.randn(batch, heads[0], D, device="cuda").to(torch.bfloat16)
    shape_attention(kv, query, table, seq_lens, pattern, generator=gen)
    scales = {}
    if kv_cache_dtype == "fp8":
        k_scale = float(kv[..., :D].abs().amax()) / ref.FP8_E4M3_MAX
        v_scale = float(kv[..., D:].abs().amax()) / ref.FP8_E4M3_MAX
        kv = ref.quantize_kv_cache_fp8(kv, k_scale, v_scale)
        scales = {name: torch.tensor([value], dtype=torch.float32, device="cuda")
                  for name, value in (("k_scale", k_scale), ("v_scale", v_scale))}  # fmt: skip
    # Summaries of the default estimator (MoiraConfig() below); other
    # estimators' summaries: estimator_case().
    summaries = write_summaries(kv, moira.MoiraConfig().estimator, k_scale=scales.get("k_scale"))
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return dict(kv=kv, summaries=summaries, table=table, seq=seq, query=query,
                seq_lens=seq_lens, max_pages=max_pages, scales=scales,
                kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def heads_of(case):
    """The case's (query heads, KV heads)."""
    return case["query"].shape[1], case["kv"].shape[1]


def k_scale_of(case):
    """The kernels' ``k_scale`` argument for the case's cache (None: bf16)."""
    return case["scales"].get("k_scale")


def reference_cache(case):
    """The cache as the float32 reference reads it: the bf16 cache, or the
    fp8 cache dequantized (fp32, made once per case)."""
    if not case["scales"]:
        return case["kv"]
    if "kv_dequantized" not in case:
        case["kv_dequantized"] = ref.dequantize_kv_cache(
            case["kv"], case["scales"]["k_scale"], case["scales"]["v_scale"]
        )
    return case["kv_dequantized"]


def split_summary_dtype(name):
    """``"int8:mvar_top8"`` -> ``("mvar_top8", "int8")``; a plain estimator -> bf16."""
    estimator, storage = ref.parse_stored_estimator(name)
    return estimator, storage or "bfloat16"


def write_summaries(kv, estimator, summary_dtype="bfloat16", k_scale=None):
    """Summaries of every block of ``kv`` by the kernel writer of ``estimator``
    (an fp8 ``kv``: with its ``k_scale``)."""
    num_blocks = kv.shape[0]
    dtype, rows = moira.summary_storage(moira.summary_slots(estimator), summary_dtype)
    summaries = torch.zeros(num_blocks, kv.shape[1], rows, D, device="cuda", dtype=dtype)
    all_last_slots = torch.arange(num_blocks, device="cuda", dtype=torch.int64) * PAGE + 63
    moira.write_page_summaries(kv, summaries, all_last_slots, k_scale, launch=LAUNCH)
    return summaries


def estimator_case(case, name):
    """The case with the summaries of ``name`` (an estimator, ``int8:`` for int8
    summaries; same cache, queries, rows)."""
    if name == case.get("estimator", moira.MoiraConfig().estimator):
        return case
    estimator, summary_dtype = split_summary_dtype(name)
    summaries = write_summaries(case["kv"], estimator, summary_dtype, k_scale_of(case))
    return dict(case, summaries=summaries, estimator=name)


def workspace(case, config, launch=None):
    """A workspace for ``case`` under ``config``, with LAUNCH or ``launch``'s overrides."""
    launch = LAUNCH if launch is None else launch
    return moira.MoiraWorkspace(case["query"].shape[0], *heads_of(case), D, case["max_pages"],
                                config, "cuda", launch=launch)  # fmt: skip


def run_moira(case, config, ws=None):
    ws = ws or workspace(case, config)
    out = torch.full_like(case["query"], float("nan"))
    moira.moira_decode(case["query"], case["kv"], case["summaries"], case["table"],
                       case["seq"], out, ws, SCALE, **case["scales"])  # fmt: skip
    torch.cuda.synchronize()
    return out, ws


def fa3_kwargs(case):
    """flash_attn_varlen_func's arguments for one decode step of the case, as
    vLLM's FlashAttentionImpl passes them (an fp8 cache: the query in e4m3
    with q_scale 1, vLLM's default, and the layer's scales as descales)."""
    kv, query = case["kv"], case["query"]
    batch = query.shape[0]
    kwargs = dict(
        q=query, k=kv.transpose(1, 2)[..., :D], v=kv.transpose(1, 2)[..., D:], max_seqlen_q=1,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_k=max(case["seq_lens"]), seqused_k=case["seq"],
        block_table=case["table"], softmax_scale=SCALE, causal=True, fa_version=3,
    )  # fmt: skip
    if case["scales"]:
        descale = (batch, case["kv"].shape[1])
        kwargs.update(
            q=query.float().clamp(-ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX).to(torch.float8_e4m3fn),
            q_descale=torch.ones(descale, dtype=torch.float32, device="cuda"),
            k_descale=case["scales"]["k_scale"].expand(descale),
            v_descale=case["scales"]["v_scale"].expand(descale),
        )
    return kwargs


def fa3_decode(case):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(case["query"])
    flash_attn_varlen_func(out=out, **fa3_kwargs(case))
    torch.cuda.synchronize()
    return out


#: One bf16 ulp at unit magnitude (2^-8): the paper's bound for gamma=1 vs FA3.
ONE_BF16_ULP = 3.90625e-3
#: vLLM's own tolerance for attention on an fp8 KV cache (its backend tests).
FP8_ATOL, FP8_RTOL = 6e-2, 1e-1


def dense_reference_rows(case, rows):
    out = {}
    for row in rows:
        keys, values = ref.row_keys_values(reference_cache(case), case["table"][row],
                                           case["seq_lens"][row])  # fmt: skip
        every = [torch.arange(math.ceil(case["seq_lens"][row] / PAGE))] * case["kv"].shape[1]
        out[row] = ref.attend_pages(case["query"][row], keys, values, every,
                                    case["seq_lens"][row], SCALE)[0]  # fmt: skip
    return out


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------
def selected_lists(page_list, list_lengths):
    """Page lists as Select left them: each (row, KV head) list up to its length, -1 past
    it. Entries past a list's length are not part of the step's output (the workspace is
    allocated with torch.empty and Select writes only the list), so lists compare by this,
    never by the raw buffer."""
    positions = torch.arange(page_list.shape[-1], device=page_list.device)
    return torch.where(positions < list_lengths[..., None], page_list, -1)


def check_gamma_one(case, config=None):
    """``config`` (gamma must be 1): default MoiraConfig.paper(gamma=1.0)."""
    config = config or moira.MoiraConfig.paper(gamma=1.0)
    assert config.gamma == 1.0 and config.selector == "coverage"
    out, ws = run_moira(case, config)
    batch = out.shape[0]
    counts = ws.list_lengths[:batch].cpu()
    pages = torch.tensor([math.ceil(s / PAGE) for s in case["seq_lens"]])
    fa3 = fa3_decode(case)
    rows = [0, batch - 1]
    dense = dense_reference_rows(case, rows)
    return {
        "kv_cache_dtype": case["kv_cache_dtype"],
        "keeps_every_page": bool(torch.all(counts == pages[:, None])),
        "max_abs_diff_vs_fa3": float((out.float() - fa3.float()).abs().max()),
        "bound_one_bf16_ulp": ONE_BF16_ULP,
        "fa3_close_at_fp8_tolerance": bool(torch.allclose(out.float(), fa3.float(),
                                                          atol=FP8_ATOL, rtol=FP8_RTOL)),
        "max_abs_diff_fa3_vs_fp32": max(
            float((fa3[r].float() - dense[r]).abs().max()) for r in rows),
        "max_abs_diff_moira_vs_fp32": max(
            float((out[r].float() - dense[r]).abs().max()) for r in rows),
        "all_finite": bool(torch.isfinite(out).all()),
    }  # fmt: skip


def check_graph_replay(case, gamma=0.98, config=None):
    """Capture at the case's lengths, replay at the same and at shorter
    lengths (changed in place under the graph), compare with eager bits.
    ``config`` overrides ``MoiraConfig.paper(gamma=gamma)``."""
    config = config or moira.MoiraConfig.paper(gamma=gamma)
    ws = workspace(case, config)
    out = torch.zeros_like(case["query"])
    args = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])

    def step():
        moira.moira_decode(*args, out, ws, SCALE, **case["scales"])

    step()  # compile + warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = {}
    original_seq = case["seq"].clone()
    original_query = case["query"].clone()
    gen = torch.Generator().manual_seed(3)
    for name in ("same_lengths", "shorter_lengths", "mixed_lengths"):
        if name == "shorter_lengths":
            case["seq"].copy_((original_seq // 3).clamp_min(1))
            case["query"].copy_(torch.randn_like(original_query.float()).bfloat16())
        elif name == "mixed_lengths":
            lengths = torch.randint(1, int(original_seq.max()) + 1, original_seq.shape,
                                    generator=gen)  # fmt: skip
            case["seq"].copy_(torch.minimum(lengths.to("cuda", torch.int32), original_seq))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        lists_replayed = (selected_lists(ws.page_list, ws.list_lengths),
                          ws.list_lengths.clone())  # fmt: skip
        out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        results[name] = {
            "bitwise_equal": bool(torch.equal(replayed, out)),
            "lists_equal": bool(
                torch.equal(lists_replayed[1], ws.list_lengths)
                and torch.equal(lists_replayed[0], selected_lists(ws.page_list, ws.list_lengths))
            ),
        }
    case["seq"].copy_(original_seq)
    case["query"].copy_(original_query)
    return results


def check_dependent_launches(case, config=None):
    """Dependent launches (the "step" launch override pdl) change when blocks are
    scheduled, never what they compute. Two steps of different lengths on one
    workspace, back to back (so that each kernel's blocks may start while the
    previous kernel, of the same or the previous step, still runs), eager and
    replayed from one graph, equal the same steps launched plainly, bit for
    bit, lists included."""
    config = config or moira.MoiraConfig.paper(gamma=0.98)
    seqs = (case["seq"], (case["seq"] // 3).clamp_min(1))
    gen = torch.Generator().manual_seed(5)
    queries = (case["query"], torch.randn(case["query"].shape, generator=gen).to("cuda",
               torch.bfloat16))  # fmt: skip
    outs = tuple(torch.empty_like(case["query"]) for _ in seqs)

    def two_steps(ws):
        for seq, query, out in zip(seqs, queries, outs):
            moira.moira_decode(query, case["kv"], case["summaries"], case["table"], seq, out,
                               ws, SCALE, **case["scales"])  # fmt: skip

    def run(ws, replay=None):
        for out in outs:
            out.fill_(float("nan"))
        if replay:
            replay.replay()
        else:
            two_steps(ws)
        torch.cuda.synchronize()
        return [o.clone() for o in outs] + [selected_lists(ws.page_list, ws.list_lengths),
                                            ws.list_lengths.clone()]  # fmt: skip

    plain = run(workspace(case, config, with_launch(step={"pdl": False})))
    ws = workspace(case, config, with_launch(step={"pdl": True}))
    result = {"dependent_launch_on": bool(moira._dependent_launch(ws.launch))}
    eager = run(ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        two_steps(ws)
    replayed = run(ws, graph)
    result["eager_equal_bits"] = all(map(torch.equal, plain, eager))
    result["graph_equal_bits"] = all(map(torch.equal, plain, replayed))
    return result


#: How far (in share of the group-mean mass) the kernel's float32 sums may sit from the
#: reference's: both add up to 2048 shares < 1 in different orders, a few fp32 ulps each.
NEAR_TIE_SHARE = 1e-5
#: Select's bisection shrinks [0, max middle share] 2^24-fold (Alg. 1, moira.py pass 3), so
#: pages whose shares differ by less than that resolution land on the same side of tau.
BISECTION_SHRINK = 2.0**24


def is_near_tie(got: torch.Tensor, pibar: torch.Tensor, gamma: float) -> bool:
    """A kernel list that differs from the reference's only where float32 cannot tell: the
    kept share meets the coverage target within summation order (``NEAR_TIE_SHARE``), or
    extra pages' shares are within the bisection's resolution of the reference's threshold.
    It must hold the reference's list at gamma - NEAR_TIE_SHARE and be held by the union of
    its list at gamma + NEAR_TIE_SHARE and the pages within two resolutions of its
    threshold. Any other difference (a missing sink or current page, pages out of order, an
    extra page clearly below the threshold) is a real mismatch."""
    n = pibar.numel()
    pages = got.tolist()
    low = set(ref.select_pages(pibar, gamma=gamma - NEAR_TIE_SHARE).tolist())
    high = set(ref.select_pages(pibar, gamma=min(gamma + NEAR_TIE_SHARE, 1.0)).tolist())
    tau = ref.coverage_threshold(pibar, gamma)
    if tau is not None:
        resolution = float(pibar[1 : n - 1].max()) / BISECTION_SHRINK
        high |= {p for p in range(1, n - 1) if float(pibar[p]) >= tau - 2 * resolution}
    return pages == sorted(pages) and low <= set(pages) <= high


def check_select_and_estimate(case, gamma=0.98, estimate_rows=2, estimator=None):
    """Select's lists on the kernel's own log-masses vs the float32 reference's rule
    (``rows_equal``; ``rows_near_tie``: differences explained by summation order at the
    coverage target, see ``is_near_tie``), Estimate's log-masses vs the reference on
    ``estimate_rows`` rows, and the sparse output vs float32 attention over the same lists."""
    name = estimator or moira.MoiraConfig().estimator
    estimator, summary_dtype = split_summary_dtype(name)
    config = moira.MoiraConfig.paper(gamma=gamma, estimator=estimator, summary_dtype=summary_dtype)
    out, ws = run_moira(case, config)
    batch = out.shape[0]
    logmass = ws.logmass[:batch].cpu()
    page_list, list_lengths = ws.page_list[:batch].cpu(), ws.list_lengths[:batch].cpu()
    rows_checked = rows_equal = rows_near_tie = 0
    kept, total = 0, 0
    lists = []
    for row in range(batch):
        n = math.ceil(case["seq_lens"][row] / PAGE)
        pibar = ref.group_mean_shares(logmass[row, :, :, :n])
        row_lists = []
        for h in range(case["kv"].shape[1]):
            expected = ref.select_pages(pibar[h], gamma=gamma)
            got = page_list[row, h, : int(list_lengths[row, h])]
            rows_checked += 1
            if got.tolist() == expected.tolist():
                rows_equal += 1
            else:
                rows_near_tie += int(is_near_tie(got, pibar[h], gamma))
            kept += int(list_lengths[row, h])
            total += n
            row_lists.append(got)
        lists.append(row_lists)
    est_err = 0.0
    sparse_err = 0.0
    fp32_summaries = ref.read_summaries(case["summaries"])
    for row in range(min(estimate_rows, batch)):
        seq_len = case["seq_lens"][row]
        n = math.ceil(seq_len / PAGE)
        expected = ref.estimate_row_logmass(
            case["query"][row], reference_cache(case), fp32_summaries,
            case["table"][row], seq_len, SCALE, estimator)  # fmt: skip
        diff = (logmass[row, :, :, :n] - expected.cpu()).abs()
        est_err = max(est_err, float(diff.max()))
        keys, values = ref.row_keys_values(reference_cache(case), case["table"][row], seq_len)
        sparse = ref.attend_pages(case["query"][row], keys, values, lists[row],
                                  seq_len, SCALE)[0]  # fmt: skip
        sparse_err = max(sparse_err, float((out[row].float() - sparse).abs().max()))
    return {
        "estimator": estimator,
        "summary_dtype": summary_dtype,
        "gamma": gamma,
        "rows_checked": rows_checked,
        "rows_equal": rows_equal,
        "rows_near_tie": rows_near_tie,
        "kept_fraction": kept / total,
        "estimate_max_abs_err": est_err,
        "sparse_vs_fp32_max_abs_diff": sparse_err,
    }


def check_estimator_summaries(case, name, num_pages=64):
    """Kernel summaries of ``num_pages`` blocks vs the float32 reference: stored keys
    (slots 2..) must be bit-exact copies (a page may differ only on a near-tie of the
    distances, counted), slots 0-1 within bf16 rounding (max error relative to one bf16
    ulp of the value). int8 summaries (and int4 ones, unpacked): every stored value vs the
    reference's quantization of the fp32 summary (largest difference in integer steps, and
    the share that is equal)."""
    estimator, summary_dtype = split_summary_dtype(name)
    num_pages = min(num_pages, case["kv"].shape[0] - 1)
    blocks = torch.arange(1, 1 + num_pages, device="cuda")
    r = moira.estimator_num_top(estimator)
    if r == 0:
        expected = ref.summarize_pages(reference_cache(case), blocks)
    else:
        expected = ref.summarize_pages_top(reference_cache(case), blocks, r)
    if summary_dtype in ("int8", "int4"):
        if summary_dtype == "int8":
            q_ref, scale_ref = ref.quantize_summaries_int8(expected)
            q, scales = ref.split_int8_summaries(case["summaries"][blocks])
        else:  # the keys' int4 values unpacked (int8 steps: the int4 ones)
            q_ref, scale_ref = ref.split_int4_summaries(ref.pack_int4_summaries(expected))
            q, scales = ref.split_int4_summaries(case["summaries"][blocks])
        steps = (q.int() - q_ref.int()).abs()
        return {
            "pages_checked": num_pages * case["kv"].shape[1],
            "int8_max_step_diff": int(steps.max()),
            "int8_equal_fraction": float((steps == 0).float().mean()),
            "scale_max_rel_err": float(((scales - scale_ref).abs()
                                        / scale_ref.clamp_min(1e-30)).max()),
        }  # fmt: skip
    got = case["summaries"][blocks].float()
    same_keys = torch.ones(num_pages, case["kv"].shape[1], dtype=torch.bool, device="cuda")
    if r:
        # Bit copies of the (dequantized, for fp8) keys, as bf16 stores them.
        stored = expected[:, :, 2:].to(torch.bfloat16).float()
        same_keys = (got[:, :, 2:] == stored).flatten(2).all(-1)
    # One bf16 ulp of each value, but never below 2^-16 of the channel's scale (mean |k|
    # for the mean, mean k^2 for the variance): float32 sums of 64 keys in two orders
    # differ by up to ~2^-18 of that scale, which swamps a value that cancels to near 0
    # (a channel whose keys are all equal, common in an e4m3 cache, has variance exactly 0
    # in the reference and ~1e-8 in the kernel). 2^-16 is 1/512 of a bf16 ulp of the scale.
    keys = reference_cache(case)[blocks.long(), :, :, :D].float()
    floor = torch.stack([keys.abs().mean(dim=2), (keys * keys).mean(dim=2)], dim=2) * 2.0**-16
    magnitude = torch.maximum(expected[:, :, :2].abs(), floor).clamp_min(2.0**-126)
    ulp = torch.pow(2.0, torch.floor(torch.log2(magnitude)) - 7)
    rel = ((got[:, :, :2] - expected[:, :, :2]).abs() / ulp).amax(dim=(2, 3))
    return {
        "pages_checked": num_pages * case["kv"].shape[1],
        "stored_keys_equal": int(same_keys.sum()),
        "bulk_max_err_in_bf16_ulps": float(rel[same_keys].max()) if same_keys.any() else None,
    }


def time_estimator(case, name, gamma=0.98, sweep_launch=False):
    """Estimate / Select / Estimate+Select / summary write of one estimator;
    ``sweep_launch``: also Estimate under every ESTIMATE_SWEEP candidate, each
    checked against the default's log-masses."""
    estimator, summary_dtype = split_summary_dtype(name)
    batch = case["query"].shape[0]
    config = moira.MoiraConfig.paper(gamma=gamma, estimator=estimator, summary_dtype=summary_dtype)
    ws = workspace(case, config)
    args = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])
    k_scale = k_scale_of(case)
    row = {"estimator": estimator, "summary_dtype": summary_dtype,
           "summary_slots": moira.summary_slots(estimator)}  # fmt: skip
    row["estimate_select_us"] = graph_time_us(
        lambda: moira.estimate_and_select(*args, ws, SCALE, k_scale=k_scale)
    )
    row["estimate_us"] = graph_time_us(
        lambda: moira.estimate_page_logmass(
            *args, ws.logmass, SCALE, estimator, k_scale=k_scale, launch=ws.launch
        )
    )
    row["select_us"] = graph_time_us(
        lambda: moira.select_pages(
            ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths, ws.selector_params,
            batch, case["max_pages"], ws.read_stats, launch=ws.launch)
    )  # fmt: skip
    if sweep_launch:

        def estimate(launch):
            moira.estimate_page_logmass(*args, ws.logmass, SCALE, estimator, k_scale=k_scale,
                                        launch=launch)  # fmt: skip

        def select(launch):
            moira.select_pages(ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths,
                               ws.selector_params, batch, case["max_pages"], ws.read_stats,
                               launch=launch)  # fmt: skip

        row["estimate_sweep"] = sweep_estimate_launch(case, estimate, ws)
        estimate(ws.launch)
        row["select_sweep"] = sweep_select_launch(ws, select, batch)
    pages = sum(math.ceil(n / PAGE) for n in case["seq_lens"])
    # Bytes Estimate reads per (page, KV head): the slot vectors (and, for int8 and int4
    # keys, the slots' fp32 scales; int4: two keys per row of D bytes).
    num_slots = row["summary_slots"]
    per_page = {
        "int8": num_slots * (D + 4),
        "int4": (2 + (num_slots - 2) // 2) * D + 4 * num_slots,
    }.get(summary_dtype, num_slots * 2 * D)
    row["estimate_summary_gbytes_per_s"] = (
        pages * case["kv"].shape[1] * per_page / (row["estimate_us"] * 1e-6) / 1e9
    )
    summaries = case["summaries"]
    slots = torch.arange(summaries.shape[0], device="cuda", dtype=torch.int64) * PAGE + 63
    row["write_all_blocks_us"] = graph_time_us(
        lambda: moira.write_page_summaries(case["kv"], summaries, slots, k_scale, launch=LAUNCH),
        reps=3,
        iters=5,
    )
    row["blocks"] = int(summaries.shape[0])
    return row


def check_layouts(case_token_major):
    """Head-major copy of the same cache gives bit-identical output."""
    kv = case_token_major["kv"]
    head_major = dict(case_token_major)
    head_major["kv"] = kv.contiguous()  # logical [B, H, N, C] stored head-major
    config = moira.MoiraConfig.paper(gamma=0.98)
    a, _ = run_moira(case_token_major, config)
    b, _ = run_moira(head_major, config)
    del head_major
    return {"bitwise_equal": bool(torch.equal(a, b))}


# --------------------------------------------------------------------------
# Timing sanity
# --------------------------------------------------------------------------
def graph_time_us(fn, reps=20, iters=15):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_tbps(nbytes=4 << 30):
    """Device-to-device copy rate, read + write bytes (as shared/gpu measures it)."""
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300,
                                 return_mode="median")  # fmt: skip
    return 2 * nbytes / (ms * 1e-3) / 1e12


# Estimate launch candidates: key pipeline depths at the default tile, other
# tiles at the default depth, and other register caps.
ESTIMATE_SWEEP = [
    *({"key_stages": s} for s in (1, 2, 3, 4)),
    *({"tile_pages": t, "num_warps": w}
      for t, w in ((16, 2), (16, 4), (32, 2), (32, 4), (64, 2), (64, 4), (128, 4))),
    *({"maxnreg": r} for r in (None, 112, 96)),
    # Few (row, KV head) lists (2 KV heads): the smallest tile with each pipeline depth
    # and register cap, for more programs per SM.
    *({"tile_pages": 16, "num_warps": 2, "key_stages": s} for s in (2, 4)),
    *({"tile_pages": 16, "num_warps": w, "maxnreg": None} for w in (1, 2)),
    {"tile_pages": 16, "num_warps": 1},
]  # fmt: skip


# Select launch candidates: (thresholds per bisection pass, warps).
SELECT_SWEEP = [(lanes, warps) for lanes in (1, 2, 4, 8, 16) for warps in (4, 8, 16)]
# Attend candidates: launch changes (moira.attend_launch's num_warps, num_stages,
# maxnreg) and N_F (MoiraConfig.attend_fill_blocks); {} = the default.
ATTEND_SWEEP = [
    {},
    {"num_stages": 2},
    {"num_stages": 4},
    {"num_stages": 5},
    {"num_warps": 8},
    {"num_warps": 8, "num_stages": 4},
    {"maxnreg": 128},
    {"maxnreg": None},
    *({"attend_fill_blocks": f} for f in (264, 396, 792, 1024)),
]
#: ATTEND_SWEEP keys that change Attend's launch; the others change MoiraConfig.
ATTEND_LAUNCH_KEYS = ("num_warps", "num_stages", "maxnreg")


def sweep_estimate_launch(case, estimate, ws):
    """Time ``estimate(launch)`` under each ESTIMATE_SWEEP change of Estimate's launch;
    each result is compared with the default launch's log-masses (in ``ws``)."""
    batch = case["query"].shape[0]
    num_top = moira.estimator_num_top(ws.config.estimator)
    int8 = ws.config.summary_dtype != "bfloat16"
    rows = []
    estimate(ws.launch)
    reference_logmass = ws.logmass[:batch].clone()
    for change in ESTIMATE_SWEEP:
        launch = with_launch(estimate=change)
        ws.logmass[:batch].fill_(float("nan"))
        estimate(launch)
        same = all(
            torch.allclose(ws.logmass[row, ..., : math.ceil(n / PAGE)],
                           reference_logmass[row, ..., : math.ceil(n / PAGE)],
                           rtol=1e-5, atol=1e-4)
            for row, n in enumerate(case["seq_lens"])
        )  # fmt: skip
        us = graph_time_us(lambda launch=launch: estimate(launch))
        resolved = moira.estimate_launch(num_top, int8, launch["estimate"])._asdict()
        rows.append({**resolved, "us": us, "matches_default": same})
        print("estimate", resolved, f"{us:.2f} us", same, flush=True)
    return rows


def sweep_estimate_and_select(case, ws):
    """Time Estimate and Select launch configurations on this case; every Select
    configuration must give the same page lists and counts as the default (checked,
    not assumed)."""
    batch = case["query"].shape[0]

    def estimate(launch):
        moira.estimate_page_logmass(case["query"], case["kv"], case["summaries"], case["table"],
                                    case["seq"], ws.logmass, SCALE, ws.config.estimator,
                                    k_scale=k_scale_of(case), launch=launch)  # fmt: skip

    def select(launch):
        moira.select_pages(ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths,
                           ws.selector_params, batch, case["max_pages"], ws.read_stats,
                           launch=launch)  # fmt: skip

    out = {"estimate_sweep": sweep_estimate_launch(case, estimate, ws)}
    estimate(ws.launch)
    out["select_sweep"] = sweep_select_launch(ws, select, batch)
    return out


def _same_lists_after(run, ws, batch, reference) -> bool:
    """Runs ``run`` (which writes ws's page lists) and says whether the counts of
    rows ``[:batch]``, and their lists (``selected_lists``), equal ``reference`` =
    (lists, counts); the counts are poisoned first, so a run that writes nothing
    does not pass."""
    ws.list_lengths[:batch].fill_(-1)
    run()
    counts = ws.list_lengths[:batch]
    if not torch.equal(counts, reference[1]):
        return False
    return bool(torch.equal(selected_lists(ws.page_list[:batch], counts),
                            selected_lists(*reference)))  # fmt: skip


def sweep_select_launch(ws, select, batch):
    """Time ``select(launch)`` under each SELECT_SWEEP candidate on the log-masses in
    ``ws``; each must give the default launch's page lists and counts."""
    rows = []
    select(ws.launch)
    reference_lists = (ws.page_list[:batch].clone(), ws.list_lengths[:batch].clone())
    for lanes, warps in SELECT_SWEEP:
        launch = with_launch(select={"long_lanes": lanes, "long_num_warps": warps})
        same = _same_lists_after(lambda launch=launch: select(launch), ws, batch, reference_lists)
        us = graph_time_us(lambda launch=launch: select(launch))
        rows.append({"long_lanes": lanes, "long_num_warps": warps, "us": us,
                     "same_lists": same})  # fmt: skip
        print("select", lanes, warps, f"{us:.2f} us", same, flush=True)
    return rows


#: Dependent-launch settings ("step" launch overrides) that --step-launches times.
STEP_LAUNCH_VARIANTS = {
    "no_pdl": {"pdl": False},
    "pdl": {"pdl": True},
}


def time_step_launches(case, kept_fraction=0.22, fill_blocks=()):
    """The whole decode step per layer (one graph of 20 steps) under each
    STEP_LAUNCH_VARIANTS setting, for three selectors: the coverage rule on
    every row, fixed count at ``kept_fraction``, and the dense-row path
    (every row read whole, as the backend's dense_batch_tokens does at batch
    1); and Estimate + Select. ``fill_blocks``: N_F values to time the
    dense-row and fixed steps under as well (default launch). Outputs are
    compared with the first variant's (same kernels, same arithmetic: equal
    bit for bit)."""
    batch = case["query"].shape[0]
    args = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])
    configs = {
        "coverage": moira.MoiraConfig.paper(gamma=0.98),
        "fixed": moira.MoiraConfig.paper(
            selector="fixed", fixed_pages=max(2, round(kept_fraction * case["max_pages"]))
        ),
        "dense_rows": moira.MoiraConfig.paper(dense_batch_tokens=case["max_pages"] * PAGE * batch),
    }
    rows = {}
    outputs = {}
    for variant, step in STEP_LAUNCH_VARIANTS.items():
        launch = with_launch(step=step)
        for name, config in configs.items():
            ws = workspace(case, config, launch)
            out = torch.full_like(case["query"], float("nan"))
            rows[f"step_{name}_{variant}_us"] = graph_time_us(
                lambda ws=ws, out=out: moira.moira_decode(*args, out, ws, SCALE, **case["scales"])
            )
            if name in outputs:
                rows[f"step_{name}_{variant}_equal_bits"] = bool(torch.equal(out, outputs[name]))
            else:
                outputs[name] = out
        ws = workspace(case, configs["coverage"], launch)
        rows[f"estimate_select_{variant}_us"] = graph_time_us(
            lambda ws=ws: moira.estimate_and_select(*args, ws, SCALE, k_scale=k_scale_of(case))
        )
    for fill in fill_blocks:
        for name in ("dense_rows", "fixed"):
            ws = workspace(case, dataclasses.replace(configs[name], attend_fill_blocks=fill))
            out = torch.full_like(case["query"], float("nan"))
            rows[f"step_{name}_fill{fill}_us"] = graph_time_us(
                lambda ws=ws, out=out: moira.moira_decode(*args, out, ws, SCALE, **case["scales"])
            )
    return rows


def sweep_attend_launch(case, out, ws, scales) -> list[dict]:
    """Attend + Merge µs of every ATTEND_SWEEP entry on the lists already in ``ws``,
    each on a workspace of its own, with the largest difference from the default's
    output (same pages, another summation order: within bf16 rounding)."""
    rows = []
    reference = None
    # The default first: the reference every candidate's output is compared with.
    for changes in [{}, *(c for c in ATTEND_SWEEP if c)]:
        launch = {k: v for k, v in changes.items() if k in ATTEND_LAUNCH_KEYS}
        config_changes = {k: v for k, v in changes.items() if k not in ATTEND_LAUNCH_KEYS}
        ws_c = workspace(case, dataclasses.replace(ws.config, **config_changes),
                         with_launch(attend=launch))  # fmt: skip
        ws_c.page_list.copy_(ws.page_list)
        ws_c.list_lengths.copy_(ws.list_lengths)
        candidate = torch.full_like(out, float("nan"))
        us = graph_time_us(
            lambda ws_c=ws_c, candidate=candidate: moira.attend(
                case["query"], case["kv"], case["table"], case["seq"],
                ws_c.page_list, ws_c.list_lengths, candidate, ws_c, SCALE, **scales)
        )  # fmt: skip
        if reference is None:
            reference = candidate.clone()
        diff = (candidate.float() - reference.float()).abs().max().item()
        rows.append({**changes, "us": us, "max_abs_diff_vs_default": diff})
        print("attend", changes, f"{us:.2f} us", f"diff {diff:.2e}", flush=True)
    return rows


def time_case(case, kept_fraction=0.22, sweep_attend=False, sweep_estimate_select=False):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    batch = case["query"].shape[0]
    rows = {"kv_cache_dtype": case["kv_cache_dtype"]}
    coverage = moira.MoiraConfig.paper(gamma=0.98)
    ws = workspace(case, coverage)
    args = (case["query"], case["kv"], case["summaries"], case["table"], case["seq"])
    scales, k_scale = case["scales"], k_scale_of(case)
    rows["estimate_select_us"] = graph_time_us(
        lambda: moira.estimate_and_select(*args, ws, SCALE, k_scale=k_scale)
    )
    rows["estimate_us"] = graph_time_us(
        lambda: moira.estimate_page_logmass(
            case["query"], case["kv"], case["summaries"], case["table"], case["seq"],
            ws.logmass, SCALE, ws.config.estimator, k_scale=k_scale)
    )  # fmt: skip
    rows["select_us"] = graph_time_us(
        lambda: moira.select_pages(
            ws.logmass, case["seq"], ws.pibar, ws.page_list, ws.list_lengths, ws.selector_params,
            batch, case["max_pages"], ws.read_stats, launch=ws.launch)
    )  # fmt: skip
    out = torch.empty_like(case["query"])
    # Attend + Merge on a fixed-count list (kept_fraction of the pages).
    fixed = moira.MoiraConfig.paper(
        selector="fixed", fixed_pages=max(2, round(kept_fraction * case["max_pages"]))
    )
    ws_fixed = workspace(case, fixed)
    moira.estimate_and_select(*args, ws_fixed, SCALE, k_scale=k_scale)
    torch.cuda.synchronize()
    counts = ws_fixed.list_lengths[:batch]
    # K and V of the kept pages, in the cache's bytes (fp8: one per value).
    kept_bytes = int(counts.sum()) * PAGE * 2 * D * case["kv"].element_size()
    # The paper's Alg. 2 (benchmarks/paper_attend.py) on the same lists.
    paper = PaperAttend(batch, *heads_of(case), D, ws_fixed.attend_fill_blocks, "cuda")
    attend_us = graph_time_us(
        lambda: paper(case["query"], case["kv"], case["table"], case["seq"], ws_fixed.page_list,
                      ws_fixed.list_lengths, out, SCALE, **scales)
    )  # fmt: skip
    rows["attend_merge_us"] = attend_us
    # The backend's Attend (even pages per block).
    attend_pages_us = graph_time_us(
        lambda: moira.attend(case["query"], case["kv"], case["table"], case["seq"],
                             ws_fixed.page_list, ws_fixed.list_lengths, out, ws_fixed, SCALE,
                             **scales)
    )  # fmt: skip
    rows["attend_pages_merge_us"] = attend_pages_us
    rows["attend_pages_tbps"] = kept_bytes / (attend_pages_us * 1e-6) / 1e12
    if sweep_attend:
        rows["attend_sweep"] = sweep_attend_launch(case, out, ws_fixed, scales)
    if sweep_estimate_select:
        rows.update(sweep_estimate_and_select(case, ws))
    rows["attend_kept_fraction"] = int(counts.sum()) / (
        case["max_pages"] * batch * case["kv"].shape[1]
    )
    rows["attend_tbps"] = kept_bytes / (attend_us * 1e-6) / 1e12
    rows["moira_step_fixed_us"] = graph_time_us(
        lambda: moira.moira_decode(*args, out, ws_fixed, SCALE, **scales)
    )
    rows["moira_step_coverage_us"] = graph_time_us(
        lambda: moira.moira_decode(*args, out, ws, SCALE, **scales)
    )
    counts_cov = ws.list_lengths[:batch]
    rows["coverage_kept_fraction"] = int(counts_cov.sum()) / sum(
        math.ceil(s / PAGE) * case["kv"].shape[1] for s in case["seq_lens"]
    )
    fa_out = torch.empty_like(case["query"])
    fa_kwargs = fa3_kwargs(case)  # fp8: the query quantized once, outside the timing
    rows["dense_fa3_us"] = graph_time_us(lambda: flash_attn_varlen_func(out=fa_out, **fa_kwargs))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4x131072,32x8192")
    parser.add_argument("--heads", default=f"{HQ},{HKV}",
                        help="QUERY_HEADS,KV_HEADS of every case (head size 128)")  # fmt: skip
    parser.add_argument("--json", help="correctness record")
    parser.add_argument("--timing-json", help="timing sanity record")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument(
        "--sweep-attend",
        action="store_true",
        help="time Attend launch configs (outputs checked against the default's)",
    )
    parser.add_argument("--attend-sweep", default=None,
                        help="JSON list of launch and MoiraConfig changes for "
                        "--sweep-attend (default: ATTEND_SWEEP)")  # fmt: skip
    parser.add_argument("--sweep-estimate-select", action="store_true",
                        help="time Estimate (also per --estimators entry) and Select launch "
                        "configs (log-masses and lists checked)")  # fmt: skip
    parser.add_argument("--estimate-sweep", default=None,
                        help="JSON list of Estimate launch changes for --sweep-estimate-select "
                        "(default: ESTIMATE_SWEEP)")  # fmt: skip
    parser.add_argument("--estimate-launch", default=None,
                        help="JSON of Estimate launch overrides for the whole run (every "
                        "check and timing runs under it), e.g. "
                        "'{\"key_stages\": 2}'")  # fmt: skip
    parser.add_argument(
        "--no-select-sweep",
        action="store_true",
        help="with --sweep-estimate-select: Estimate candidates only",
    )
    parser.add_argument(
        "--estimators",
        default="",
        help=f"comma list of {moira.MOIRA_ESTIMATORS} to check and time; prefix 'int8:' "
        "or 'int4:' (e.g. int4:mvar_top8) for int8 summaries or int4 stored keys "
        "(MOIRA_SUMMARY_DTYPE)",
    )
    parser.add_argument("--only-estimators", action="store_true",
                        help="with --estimators: skip the other checks and timings")  # fmt: skip
    parser.add_argument("--skip-checks", action="store_true",
                        help="timing only (no gamma=1, graph, Select, layout checks)")  # fmt: skip
    parser.add_argument("--step-launches", action="store_true",
                        help="time the whole decode step with and without dependent launches "
                        "(coverage, fixed count, dense rows)")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="fp8: the cache in e4m3 with per-layer K/V scales (vLLM's "
                        "--kv-cache-dtype fp8); FA3 on the same fp8 cache")  # fmt: skip
    parser.add_argument("--step-fill-blocks", default="",
                        help="with --step-launches: comma list of N_F to time the dense-row "
                        "and fixed steps under")  # fmt: skip
    args = parser.parse_args()
    if args.estimate_launch is not None:
        try:
            LAUNCH.update(moira.check_launch_overrides(
                {"estimate": json.loads(args.estimate_launch)}))  # fmt: skip
        except ValueError as exc:
            parser.error(f"--estimate-launch: {exc}")
    if args.estimate_sweep is not None:
        ESTIMATE_SWEEP[:] = json.loads(args.estimate_sweep)
    if args.attend_sweep is not None:
        ATTEND_SWEEP[:] = json.loads(args.attend_sweep)
    if args.no_select_sweep:
        SELECT_SWEEP.clear()
    estimators = [e for e in args.estimators.split(",") if e]
    for name in estimators:
        estimator, summary_dtype = split_summary_dtype(name)
        moira.estimator_num_top(estimator)  # unknown name: error before any work
        moira.MoiraConfig.paper(estimator=estimator, summary_dtype=summary_dtype).validate()
    if args.only_estimators and not estimators:
        parser.error("--only-estimators needs --estimators")
    command = "python " + " ".join(sys.argv)
    try:
        heads = tuple(int(v) for v in args.heads.split(","))
        if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]:
            raise ValueError
    except ValueError:
        parser.error(f"--heads must be QUERY_HEADS,KV_HEADS with KV heads dividing query heads, "
                     f"got {args.heads!r}")  # fmt: skip
    gpu = torch.cuda.get_device_name()
    record = {"command": command, "gpu": gpu, "torch": torch.__version__,
              "kv_cache_dtype": args.kv_cache_dtype, "heads": list(heads),
              "launch_overrides": LAUNCH, "cases": []}  # fmt: skip
    timing = {"command": command, "gpu": gpu, "launch_overrides": LAUNCH,
              "kv_cache_dtype": args.kv_cache_dtype, "heads": list(heads), "rows": []}  # fmt: skip
    if not args.skip_timing:
        timing["d2d_copy_tbps"] = copy_bandwidth_tbps()
        print(f"device-to-device copy: {timing['d2d_copy_tbps']:.2f} TB/s", flush=True)
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        t0 = time.time()
        case = build_case(batch, context, kv_cache_dtype=args.kv_cache_dtype, heads=heads)
        entry = {"shape": shape, "seq_lens": case["seq_lens"]}
        if not args.only_estimators and not args.skip_checks:
            entry["gamma_one"] = check_gamma_one(case)
            print(shape, "gamma=1", entry["gamma_one"], flush=True)
            entry["graph_replay"] = check_graph_replay(case)
            print(shape, "graph", entry["graph_replay"], flush=True)
            entry["dependent_launches"] = check_dependent_launches(case)
            print(shape, "dependent launches", entry["dependent_launches"], flush=True)
            entry["select"] = check_select_and_estimate(case)
            print(shape, "select", entry["select"], flush=True)
            entry["layouts"] = check_layouts(case)
            print(shape, "layouts", entry["layouts"], flush=True)
        timing_estimators = []
        for estimator in estimators:
            case_e = estimator_case(case, estimator)
            check = {"summaries": check_estimator_summaries(case_e, estimator)}
            check.update(check_select_and_estimate(case_e, estimator=estimator))
            entry.setdefault("estimators", []).append(check)
            print(shape, "estimator", json.dumps(check), flush=True)
            if not args.skip_timing:
                timing_estimators.append(
                    time_estimator(case_e, estimator, sweep_launch=args.sweep_estimate_select)
                )
                print(shape, "estimator timing", json.dumps(timing_estimators[-1]), flush=True)
            del case_e
        record["cases"].append(entry)
        if timing_estimators:
            timing["rows"].append({"shape": shape, "estimators": timing_estimators})
        if not args.skip_timing and not args.only_estimators:
            row = {
                "shape": shape,
                **time_case(
                    case,
                    sweep_attend=args.sweep_attend,
                    sweep_estimate_select=args.sweep_estimate_select,
                ),
            }
            row["attend_fraction_of_copy_bw"] = row["attend_tbps"] / timing["d2d_copy_tbps"]
            row["attend_pages_fraction_of_copy_bw"] = (
                row["attend_pages_tbps"] / timing["d2d_copy_tbps"]
            )
            if args.step_launches:
                fills = [int(f) for f in args.step_fill_blocks.split(",") if f]
                row.update(time_step_launches(case, fill_blocks=fills))
            timing["rows"].append(row)
            print(shape, "timing", json.dumps(row), flush=True)
        print(shape, f"done in {time.time() - t0:.1f}s", flush=True)
        del case
        torch.cuda.empty_cache()
    for path, data in ((args.json, record), (args.timing_json, timing)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
