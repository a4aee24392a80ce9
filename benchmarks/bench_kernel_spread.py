# SPDX-License-Identifier: Apache-2.0
"""Attention time per layer vs. the spread of per-(request, KV head) list lengths.

Paper Table 6 / Fig. 4 protocol. Llama-3.1-8B geometry (32 query heads, 8 KV
heads, D=128, 64-token pages, bf16), 22% of the pages kept on average, shapes
8192x32, 32768x16, 65536x8, 131072x4 ("8k x32" ... "131k x4"). For each
(row, KV head) a list length n is drawn so that the lengths have the requested
coefficient of variation (CV = std / mean) around the mean; the list is the sink
page, n - 2 random middle pages and the current page, sorted. Every arm reads
exactly these lists (from one KV cache per shape, head-major, shuffled blocks):

  moira       the paper's Attend + Merge (Alg. 2: J blocks per list;
              benchmarks/paper_attend.py; Estimate/Select excluded)
  moira_pages the backend's moira.attend: N_F blocks share the step's pages
              evenly across lists (the other schedule, side by side)
  fa3_varlen  vLLM's FA3 flash_attn_varlen_func, every (row, KV head) its own
              sequence: Hq = G = 4 query heads, Hkv = 1, block table = the
              kept pages' (block, head) ids in a head-major cache viewed as
              [blocks * Hkv, 64, 1, 2D], seqused_k = kept tokens
  pad         FA3 as fa3_varlen, every list padded to the longest list with
              real (unselected) pages of its row: seqused_k = max for all
  pow2        FA3 as fa3_varlen, lists bucketed by next power of two length,
              one launch per bucket padded (with real pages) to the bucket
              length; the host bucketing and the gather of each bucket's
              queries are not timed, the per-bucket launches are (one graph)
  dense_fa3   FA3 over all pages of every row as vLLM runs it (cv: null)

FA3 arms are timed in two variants and the faster is reported: FA3's own
heuristic (num_splits=0, no metadata) and vLLM's full-CUDA-graph setting
(get_scheduler_metadata precomputed outside the timing, num_splits=32).
Times: CUDA-graph replay median (graph_time_us of moira_correctness.py).

    python benchmarks/bench_kernel_spread.py --out benchmarks/results/kernels_h200.json
    python benchmarks/bench_kernel_spread.py --quick --out /tmp/k.json
    python benchmarks/bench_kernel_spread.py --real-fractions fr.json --out ...

--real-fractions: a JSON list of kept fractions in (0, 1] (per request, layer
and KV head, e.g. from decode steps of Moira), or {"fractions": [...]}; n is
drawn from them (with replacement) and applied to each shape's page count.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PAGE = 64
HQ, HKV, D = 32, 8, 128
G = HQ // HKV
DEFAULT_SHAPES = "8192x32,32768x16,65536x8,131072x4"
QUICK_SHAPES = "8192x32,131072x4"
METHODS = ("moira", "moira_pages", "fa3_varlen", "pad", "pow2", "dense_fa3")
FA3_GRAPH_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph


# --------------------------------------------------------------------------
# Pure helpers (CPU, numpy only; unit-tested in tests/benchmarks/)
# --------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8192x32,131072x4' -> [(context, batch), ...] (context x batch)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item:
            context, batch = item.lower().split("x")
            out.append((int(context), int(batch)))
    return out


def shape_label(context: int, batch: int) -> str:
    """8192, 32 -> '8k x32'; 131072, 4 -> '131k x4' (the paper's labels)."""
    k = context // 1024 if context < 100_000 else context // 1000
    return f"{k}k x{batch}"


def parse_cv(text: str) -> float | str:
    return "real" if text.strip() == "real" else float(text)


def cv_of(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(v.std() / v.mean()) if v.size and v.mean() > 0 else 0.0


def list_lengths(
    count: int, n_pages: int, mean_fraction: float, cv: float, seed: int = 0
) -> np.ndarray:
    """``count`` list lengths (pages) in [2, n_pages], mean ~= mean_fraction *
    n_pages, CV ~= cv (gamma distribution, deterministic quantiles so that even
    32 lengths follow it; shuffled with ``seed``). Clipping at n_pages lowers
    the CV a little for large cv; the caller records the measured CV."""
    target = mean_fraction * n_pages
    if cv <= 0 or count == 1:
        return np.full(count, int(np.clip(round(target), 2, n_pages)), dtype=np.int64)
    shape = 1.0 / (cv * cv)
    quantiles = (np.arange(count) + 0.5) / count
    base = _gamma_quantiles(quantiles, shape) / shape  # mean ~1
    base = base / base.mean()
    scale = target
    lengths = np.clip(np.rint(base * scale), 2, n_pages)
    for _ in range(30):  # re-scale so the mean after clipping hits the target
        mean = lengths.mean()
        if abs(mean - target) <= 0.5:
            break
        scale *= target / max(mean, 1e-9)
        lengths = np.clip(np.rint(base * scale), 2, n_pages)
    rng = np.random.default_rng(seed)
    rng.shuffle(lengths)
    return lengths.astype(np.int64)


def _gamma_quantiles(q: np.ndarray, shape: float) -> np.ndarray:
    """Inverse CDF of Gamma(shape, 1) by bisection on the regularized lower
    incomplete gamma (series/continued fraction; no scipy needed)."""
    lo = np.zeros_like(q)
    hi = np.full_like(q, max(50.0, 20.0 * shape))
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        below = np.array([_gamma_p(shape, x) for x in mid]) < q
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def _gamma_p(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x) (Numerical Recipes)."""
    if x <= 0:
        return 0.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(500):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-12:
                break
        return total * math.exp(log_pre)
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-12:
            break
    return 1.0 - math.exp(log_pre) * h


def lengths_from_fractions(
    count: int, n_pages: int, fractions, seed: int = 0, mean_fraction: float | None = None
) -> np.ndarray:
    """``count`` lengths drawn (with replacement) from real kept fractions;
    with ``mean_fraction`` the fractions are first scaled to that mean (their
    spread, the CV, is kept), so "real" rows compare with the CV 0 / 1 rows
    at the same reads."""
    rng = np.random.default_rng(seed)
    f = np.asarray(fractions, dtype=np.float64)
    if mean_fraction is not None:
        f = f * (mean_fraction / f.mean())
    pick = f[rng.integers(0, f.size, size=count)]
    return np.clip(np.rint(pick * n_pages), 2, n_pages).astype(np.int64)


def load_fractions(path: str) -> list[float]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data["fractions"]
    fractions = [float(x) for x in data]
    if not fractions or not all(0.0 < x <= 1.0 for x in fractions):
        raise ValueError(f"{path}: need a non-empty list of fractions in (0, 1]")
    return fractions


def page_orders(count: int, n_pages: int, seed: int = 0) -> np.ndarray:
    """Per (row, KV head): sink, current page, then the middle pages in random
    order ([count, n_pages] int64). The first n entries, sorted, are the list of
    length n; longer prefixes pad it with real pages of the same row."""
    rng = np.random.default_rng(seed)
    out = np.empty((count, n_pages), dtype=np.int64)
    for i in range(count):
        middle = rng.permutation(np.arange(1, n_pages - 1)) if n_pages > 2 else []
        out[i] = np.concatenate([[0], [n_pages - 1], middle])[:n_pages]
    return out


def padded_lists(orders: np.ndarray, lengths) -> list[np.ndarray]:
    """Sorted page lists: the first lengths[i] pages of orders[i]."""
    return [np.sort(orders[i, : int(n)]) for i, n in enumerate(lengths)]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pow2_buckets(lengths, n_pages: int) -> dict[int, list[int]]:
    """{bucket length: [indices]}: next power of two, capped at n_pages."""
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        buckets.setdefault(min(next_pow2(int(n)), n_pages), []).append(i)
    return dict(sorted(buckets.items()))


ROW_KEYS = {"shape": str, "cv": (int, float, str, type(None)), "method": str}


def validate_row(row: dict) -> None:
    """Schema of one kernels JSON row (raises ValueError)."""
    for key, kind in ROW_KEYS.items():
        if key not in row or not isinstance(row[key], kind):
            raise ValueError(f"row {row!r}: bad or missing {key!r}")
    if row["method"] not in METHODS:
        raise ValueError(f"row {row!r}: method must be one of {METHODS}")
    if isinstance(row["cv"], str) and row["cv"] != "real":
        raise ValueError(f"row {row!r}: cv must be a number, 'real' or null")
    us = row.get("us_per_layer")
    if "error" not in row and not (isinstance(us, (int, float)) and us > 0):
        raise ValueError(f"row {row!r}: us_per_layer must be > 0 (or an 'error' given)")


# --------------------------------------------------------------------------
# GPU part
# --------------------------------------------------------------------------
class Shape:
    """One KV cache (head-major, shuffled blocks), queries and block table."""

    def __init__(self, context: int, batch: int, seed: int = 0):
        import torch

        self.context, self.batch = context, batch
        self.n_pages = math.ceil(context / PAGE)
        self.num_blocks = batch * self.n_pages + 1  # block 0: vLLM's null block
        torch.manual_seed(seed)
        # logical [blocks, Hkv, 64, 2D], head-major storage (contiguous)
        self.kv = torch.empty(
            self.num_blocks, HKV, PAGE, 2 * D, dtype=torch.bfloat16, device="cuda"
        ).normal_()
        perm = torch.randperm(self.num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self.table_cpu = (perm[: batch * self.n_pages] + 1).view(batch, self.n_pages).int()
        self.table = self.table_cpu.cuda()
        self.seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.query = torch.randn(batch, HQ, D, device="cuda").to(torch.bfloat16)
        # one (block, head) page addressable as its own block, 1 KV head
        flat = self.kv.view(self.num_blocks * HKV, PAGE, 1, 2 * D)
        self.k_flat, self.v_flat = flat[..., :D], flat[..., D:]
        self.q_flat = self.query.view(batch * HKV, G, D)  # query head i -> KV head i // G
        self.orders = page_orders(batch * HKV, self.n_pages, seed=seed + 1)

    def flat_block_table(self, lists: list[np.ndarray], width: int | None = None, index=None):
        """Per (row, head) sequence: physical (block * Hkv + head) ids.
        ``index[i]`` = row * Hkv + head of lists[i] (default: i)."""
        import torch

        width = width or max(len(x) for x in lists)
        out = torch.zeros(len(lists), width, dtype=torch.int32)
        for i, pages in enumerate(lists):
            row, head = divmod(int(index[i]) if index is not None else i, HKV)
            blocks = self.table_cpu[row, torch.from_numpy(pages)].long() * HKV + head
            out[i, : len(pages)] = blocks.int()
        return out.cuda()


def fa3_fns(q, k, v, block_table, seqused, out, scale):
    """(heuristic, vLLM-graph) closures of FA3 varlen decode over given tables."""
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    num_seqs, num_heads_q = q.shape[0], q.shape[1]
    cu_q = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    max_k = int(seqused.max())
    common = dict(q=q, k=k, v=v, out=out, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                  seqused_k=seqused, block_table=block_table, softmax_scale=scale, causal=True,
                  fa_version=3)  # fmt: skip
    meta = get_scheduler_metadata(
        batch_size=num_seqs, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=num_heads_q,
        num_heads_kv=k.shape[2], headdim=D, cache_seqlens=seqused, qkv_dtype=torch.bfloat16,
        cu_seqlens_q=cu_q, page_size=PAGE, causal=True, num_splits=FA3_GRAPH_SPLITS,
    )  # fmt: skip
    return {  # vLLM's graph-safe setting first
        "vllm_cg": lambda: flash_attn_varlen_func(
            **common, scheduler_metadata=meta, num_splits=FA3_GRAPH_SPLITS
        ),
        "heur": lambda: flash_attn_varlen_func(**common, num_splits=0),
    }


def time_variants(fns: dict, timer) -> tuple[float, dict]:
    times = {}
    for name, fn in fns.items():
        try:
            times[name] = timer(fn)
        except Exception as exc:  # one variant failing must not lose the other
            times[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    ok = [t for t in times.values() if isinstance(t, float)]
    if not ok:
        raise RuntimeError(f"all variants failed: {times}")
    return min(ok), times


def run_shape(shape: Shape, cv, lengths, args, emit, timer) -> None:
    """All sparse arms of one (shape, cv) on the same lists."""
    import torch
    from vllm.v1.attention.backends import moira

    scale = D**-0.5
    label = shape_label(shape.context, shape.batch)
    lists = padded_lists(shape.orders, lengths)
    n_total = shape.batch * HKV * shape.n_pages
    base = {
        "shape": label, "context": shape.context, "batch": shape.batch, "cv": cv,
        "cv_measured": round(cv_of(lengths), 4),
        "kept_fraction": round(float(np.sum(lengths)) / n_total, 4),
        "max_fraction": round(float(np.max(lengths)) / shape.n_pages, 4),
    }  # fmt: skip

    # moira: logical page lists [B, Hkv, max_len]
    max_len = int(max(lengths))
    page_list = torch.zeros(shape.batch, HKV, max_len, dtype=torch.int32)
    for i, pages in enumerate(lists):
        page_list[i // HKV, i % HKV, : len(pages)] = torch.from_numpy(pages).int()
    page_list = page_list.cuda()
    list_lengths = torch.tensor(lengths, dtype=torch.int32).view(shape.batch, HKV).cuda()
    moira_out = torch.empty_like(shape.query)

    def moira_arm():
        from benchmarks.paper_attend import PaperAttend

        paper = PaperAttend(shape.batch, HQ, HKV, D, args.fill_blocks, "cuda",
                            min_chunk_pages=args.min_chunk_pages)  # fmt: skip
        fn = lambda: paper(shape.query, shape.kv, shape.table, shape.seq, page_list,
                           list_lengths, moira_out, scale)  # fmt: skip
        return timer(fn), {}

    pages_out = torch.empty_like(shape.query)

    def moira_pages_arm():
        # us_per_layer: the tree's register cap; variants_us: every cap of
        # --pages-maxnreg as well (each its own compile).
        def attend_with(launch=None):
            ws = moira.MoiraWorkspace(shape.batch, HQ, HKV, D, shape.n_pages, args.moira_config,
                                      "cuda", launch=launch)  # fmt: skip
            return lambda: moira.attend(shape.query, shape.kv, shape.table, shape.seq,
                                        page_list, list_lengths, pages_out, ws, scale)  # fmt: skip

        variants = {f"maxnreg={cap}": timer(attend_with({"attend": {"maxnreg": cap}}))
                    for cap in args.pages_maxnreg}  # fmt: skip
        return timer(attend_with()), variants

    # fa3_varlen: each (row, KV head) its own sequence over its exact list
    fa3_out = torch.empty_like(shape.q_flat)

    def varlen_arm():
        table = shape.flat_block_table(lists)
        seqused = torch.tensor(lengths * PAGE, dtype=torch.int32, device="cuda")
        fns = fa3_fns(shape.q_flat, shape.k_flat, shape.v_flat, table, seqused, fa3_out, scale)
        return time_variants(fns, timer)

    def pad_arm():
        padded = padded_lists(shape.orders, [max_len] * len(lists))
        table = shape.flat_block_table(padded)
        seqused = torch.full((len(lists),), max_len * PAGE, dtype=torch.int32, device="cuda")
        out = torch.empty_like(shape.q_flat)
        fns = fa3_fns(shape.q_flat, shape.k_flat, shape.v_flat, table, seqused, out, scale)
        return time_variants(fns, timer)

    def pow2_arm():
        per_variant: dict[str, list] = {"vllm_cg": [], "heur": []}
        buckets = pow2_buckets(lengths, shape.n_pages)
        for width, idx in buckets.items():  # host bucketing + gathers: not timed
            sub = padded_lists(shape.orders[idx], [width] * len(idx))
            table = shape.flat_block_table(sub, width, index=idx)
            seqused = torch.full((len(idx),), width * PAGE, dtype=torch.int32, device="cuda")
            q = shape.q_flat[torch.tensor(idx, device="cuda")].contiguous()
            out = torch.empty_like(q)
            fns = fa3_fns(q, shape.k_flat, shape.v_flat, table, seqused, out, scale)
            for name in per_variant:
                per_variant[name].append(fns[name])
        fns = {name: (lambda fs=fs: [f() for f in fs]) for name, fs in per_variant.items()}
        best, times = time_variants(fns, timer)
        times["buckets"] = {str(w): len(i) for w, i in buckets.items()}
        return best, times

    moira_ok = False
    arms = {"moira": moira_arm, "moira_pages": moira_pages_arm, "fa3_varlen": varlen_arm,
            "pad": pad_arm, "pow2": pow2_arm}  # fmt: skip
    for method in args.methods:
        if method not in arms:
            continue
        row = dict(base, method=method)
        t0 = time.time()
        try:
            us, extra = arms[method]()
            row["us_per_layer"] = round(us, 2)
            if extra:
                row["variants_us"] = {
                    k: (round(v, 2) if isinstance(v, float) else v) for k, v in extra.items()
                }
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["wall_s"] = round(time.time() - t0, 2)
        moira_ok = moira_ok or (method == "moira" and "error" not in row)
        compared = {"fa3_varlen": fa3_out, "moira_pages": pages_out}.get(method)
        if compared is not None and "error" not in row and moira_ok:
            # same lists, same pages: the output must match Attend's
            row["max_abs_diff_vs_moira"] = float(
                (compared.view_as(moira_out).float() - moira_out.float()).abs().max()
            )
        emit(row)
        torch.cuda.empty_cache()


def dense_row(shape: Shape, timer) -> dict:
    import torch

    out = torch.empty_like(shape.query)
    row = {"shape": shape_label(shape.context, shape.batch), "context": shape.context,
           "batch": shape.batch, "cv": None, "method": "dense_fa3", "kept_fraction": 1.0,
           "layout": "token-major copy (vLLM's NHD)"}  # fmt: skip
    try:
        # token-major copy of the cache, [blocks, 64, Hkv, 2D], as vLLM's FA backend has it
        nhd = shape.kv.transpose(1, 2).contiguous()
        k, v = nhd[..., :D], nhd[..., D:]
        fns = fa3_fns(shape.query, k, v, shape.table, shape.seq, out, D**-0.5)
        us, times = time_variants(fns, timer)
        row["us_per_layer"] = round(us, 2)
        row["variants_us"] = {k_: (round(t, 2) if isinstance(t, float) else t)
                              for k_, t in times.items()}  # fmt: skip
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        nhd = k = v = None
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    ap.add_argument(
        "--shapes", default=None, help=f"context x batch list (default {DEFAULT_SHAPES})"
    )
    ap.add_argument("--cvs", default="0,1,real", help="CVs; 'real' needs --real-fractions")
    ap.add_argument("--mean-fraction", type=float, default=0.22)
    ap.add_argument(
        "--real-fractions", help="JSON list of kept fractions (or {'fractions': [...]})"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--attend-fill-blocks",
        type=int,
        default=None,
        help="Moira's N_F (MoiraConfig.attend_fill_blocks; default: the blocks the GPU holds)",
    )
    ap.add_argument(
        "--min-chunk-pages",
        type=int,
        default=None,
        help="the paper arm's C (default: the paper's 24)",
    )
    ap.add_argument(
        "--pages-maxnreg",
        default="",
        help="moira_pages: also time these register caps (comma list; 'none' = ptxas's choice)",
    )
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--iters", type=int, default=15, help="graph replays timed (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, cvs 0,1, fewer reps"
    )
    args = ap.parse_args()
    if args.quick:
        args.shapes = args.shapes or QUICK_SHAPES
        args.cvs = "0,1" if args.cvs == "0,1,real" else args.cvs
        args.reps, args.iters = min(args.reps, 10), min(args.iters, 7)
    args.shapes = args.shapes or DEFAULT_SHAPES
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.pages_maxnreg = [None if c.strip() == "none" else int(c)
                          for c in args.pages_maxnreg.split(",") if c.strip()]  # fmt: skip

    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.moira_correctness import graph_time_us

    timer = lambda fn: graph_time_us(fn, reps=args.reps, iters=args.iters)
    from vllm.v1.attention.backends import moira

    from benchmarks.paper_attend import PAPER_MIN_CHUNK_PAGES

    fill_changes = {} if args.attend_fill_blocks is None else {
        "attend_fill_blocks": args.attend_fill_blocks}  # fmt: skip
    moira_config = moira.MoiraConfig.paper(**fill_changes)
    moira_config.validate()
    args.moira_config = moira_config
    args.fill_blocks = moira.resolve_attend_fill_blocks(moira_config, "cuda")
    if args.min_chunk_pages is None:
        args.min_chunk_pages = PAPER_MIN_CHUNK_PAGES
    cvs = [parse_cv(c) for c in args.cvs.split(",") if c.strip()]
    record: dict = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_size": D, "page": PAGE},
        "mean_fraction": args.mean_fraction,
        "moira_split_constants": {
            "min_chunk_pages": args.min_chunk_pages,
            "attend_fill_blocks": moira_config.attend_fill_blocks,
            "attend_fill_blocks_resolved": args.fill_blocks,
            "attend_pages_maxnreg": moira.attend_launch(kv_fp8=False).maxnreg,
        },
        "notes": [
            "FlashInfer is not installed on this host: no flashinfer rows.",
            "pad and pow2 run FA3 (flash_attn_varlen_func) on lists padded with real "
            "(unselected) pages of the same row; pow2: one launch per power-of-two "
            "bucket, host bucketing and query gathers not timed.",
            "FA3 arms: faster of FA3's heuristic (num_splits=0) and vLLM's graph setting "
            f"(scheduler metadata precomputed, num_splits={FA3_GRAPH_SPLITS}); both in "
            "variants_us.",
            f"us_per_layer: CUDA-graph replay median ({args.reps} calls per graph, "
            f"{args.iters} replays).",
            "dense_fa3 reads every page (cv: null), from a token-major (NHD) copy of the "
            "cache as vLLM's FLASH_ATTN backend stores it; sparse arms use the head-major "
            "cache.",
        ],
        "rows": [],
    }
    fractions = None
    if "real" in cvs:
        if args.real_fractions:
            fractions = load_fractions(args.real_fractions)
            record["notes"].append(
                f"cv 'real': {len(fractions)} kept fractions from {args.real_fractions}"
            )
        else:
            cvs = [c for c in cvs if c != "real"]
            record["notes"].append(
                "cv 'real' rows omitted: no --real-fractions file given (per-(request, "
                "layer, KV head) kept fractions from real decode steps are needed)."
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(row):
        try:
            validate_row(row)
        except ValueError as exc:
            row["schema_error"] = str(exc)[:300]
        record["rows"].append(row)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print("ROW", json.dumps(row), flush=True)

    t_start = time.time()
    for context, batch in parse_shapes(args.shapes):
        t0 = time.time()
        shape = Shape(context, batch, seed=args.seed)
        print(f"== {shape_label(context, batch)}: cache {shape.kv.numel() * 2 / 2**30:.2f} GiB, "
              f"{shape.n_pages} pages per row", flush=True)  # fmt: skip
        if "dense_fa3" in args.methods:
            emit(dense_row(shape, timer))
        count = batch * HKV
        for cv in cvs:
            if cv == "real":
                lengths = lengths_from_fractions(count, shape.n_pages, fractions, seed=args.seed,
                                                 mean_fraction=args.mean_fraction)  # fmt: skip
            else:
                lengths = list_lengths(count, shape.n_pages, args.mean_fraction, float(cv),
                                       seed=args.seed + 7)  # fmt: skip
            print(f"-- cv={cv}: mean {lengths.mean():.1f} pages, measured cv "
                  f"{cv_of(lengths):.3f}, max {lengths.max()}", flush=True)  # fmt: skip
            run_shape(shape, cv, lengths, args, emit, timer)
        del shape
        torch.cuda.empty_cache()
        print(
            f"== done in {time.time() - t0:.1f}s (total {time.time() - t_start:.1f}s)", flush=True
        )
    record["wall_s"] = round(time.time() - t_start, 1)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({len(record['rows'])} rows) in {record['wall_s']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
