# SPDX-License-Identifier: Apache-2.0
"""Float32 PyTorch reference of Moira's sparse decode (paper §3, Alg. 1-2).

Readable over fast: every function works on one row (one decode request) and
plain tensors, so tests can compare each Triton kernel of
``vllm.v1.attention.backends.moira`` against the same math step by step. It
holds the estimators the kernels implement; the ones only studied live in
benchmarks/probes/research_estimators.py.

Conventions shared with the kernels:
- ``kv_cache`` is vLLM's per-layer view ``[num_blocks, H_kv, 64, 2*D]`` (any
  strides); K is ``[..., :D]`` and V is ``[..., D:]``.
- ``summaries`` is ``[num_blocks, H_kv, 2, D]``: per-channel mean and
  (population) variance of the 64 keys of a page.
- An fp8 cache (vLLM's ``--kv-cache-dtype fp8``, e4m3 with per-layer K and V
  scales) is compared through :func:`dequantize_kv_cache`: every function
  here then runs on the values the kernels compute with.
- Query head ``i`` attends with KV head ``i // G``.
- Page lists hold *logical* page indices ``0 .. n_pages - 1`` of the row; the
  physical block is ``block_table[row, page]``. Page 0 is the sink, page
  ``n_pages - 1`` the current (possibly partial) page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

PAGE_SIZE = 64


# --------------------------------------------------------------------------
# fp8 KV cache
# --------------------------------------------------------------------------
#: Largest finite e4m3 value (vLLM's fp8 KV cache format, ``float8_e4m3fn``).
FP8_E4M3_MAX = 448.0


def quantize_kv_cache_fp8(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """vLLM's fp8 cache write for a ``[..., 2D]`` cache: K / k_scale and
    V / v_scale, saturated to +-448 and rounded to e4m3 (``torch.float8_e4m3fn``,
    in the strides of ``kv_cache``: a token- or head-major view stays one)."""
    head_size = kv_cache.shape[-1] // 2
    x = kv_cache.float()
    x = torch.cat([x[..., :head_size] / k_scale, x[..., head_size:] / v_scale], dim=-1)
    out = torch.empty_like(kv_cache, dtype=torch.float8_e4m3fn)
    return out.copy_(x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))


def dequantize_kv_cache(
    kv_cache: torch.Tensor, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor
) -> torch.Tensor:
    """An fp8 (e4m3) ``[..., 2D]`` cache as fp32 values: K x k_scale and
    V x v_scale, what the kernels read from fp8 pages (same shape)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn cache, got {kv_cache.dtype}")
    head_size = kv_cache.shape[-1] // 2
    x = kv_cache.float()
    x[..., :head_size] *= float(k_scale)
    x[..., head_size:] *= float(v_scale)
    return x


# --------------------------------------------------------------------------
# Page summaries
# --------------------------------------------------------------------------
def summarize_pages(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Mean and variance of the keys of full pages: ``[n, H_kv, 2, D]`` fp32."""
    head_size = kv_cache.shape[-1] // 2
    keys = kv_cache[block_ids.long(), :, :, :head_size].float()  # [n, H, 64, D]
    mean = keys.mean(dim=2)
    var = ((keys - mean.unsqueeze(2)) ** 2).mean(dim=2)
    return torch.stack([mean, var], dim=2)


#: How summaries are stored (``MOIRA_SUMMARY_DTYPE``): bf16 values, or int8
#: values with one fp32 scale per slot vector (absmax / 127).
SUMMARY_DTYPES = ("bfloat16", "int8", "int4")
INT8_LEVELS = 127.0


def _quantize_symmetric(
    summaries: torch.Tensor, levels: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot vector (the last dim) symmetric: ``scale = absmax / levels``, ``q =
    floor(x / scale + 0.5)`` clamped to [-levels, levels]; ``(q int8, scale fp32)``."""
    x = summaries.float()
    scale = x.abs().amax(dim=-1) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe.unsqueeze(-1) + 0.5).clamp(-levels, levels)
    return q.to(torch.int8), scale


def quantize_summaries_int8(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot vector (the last dim, D values) symmetric int8: ``scale = absmax / 127``,
    ``q = floor(x / scale + 0.5)`` clamped to [-127, 127] (an all-zero vector: scale 0,
    q 0). Returns ``(q int8 [..., S, D], scale fp32 [..., S])``; the kernel's rule."""
    return _quantize_symmetric(summaries, INT8_LEVELS)


#: int4 summaries: the stored keys in 4 bits, one fp32 scale per slot vector (absmax / 7),
#: two keys a byte (:func:`pack_int4_summaries`); mean and variance stay int8.
INT4_LEVELS = 7.0


def quantize_summaries_int4(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot vector symmetric 4-bit: ``scale = absmax / 7``, ``q = floor(x / scale +
    0.5)`` clamped to [-7, 7] (an all-zero vector: scale 0, q 0). Returns ``(q [..., S, D],
    scale fp32 [..., S])``, q unpacked in int8; :func:`dequantize_summaries_int8` reads
    them back."""
    return _quantize_symmetric(summaries, INT4_LEVELS)


def pack_int4_summaries(summaries: torch.Tensor) -> torch.Tensor:
    """fp32 summaries ``[..., 2 + r, D]`` (r > 0 even) as the kernels store int4 summaries:
    ``[..., 2 + r / 2 + 1, D]`` uint8 = the mean and variance rows in int8 (two's complement
    bytes), then row 2 + i holding stored key 2i + 1 in the high nibble (4-bit two's
    complement) and stored key 2i plus 8 in the low one (offset binary, 1..15), i.e. the
    byte ``16 * key[2i+1] + key[2i] + 8`` per channel, then one row whose first 4 (2 + r)
    bytes are the slots' fp32 scales."""
    num_keys = summaries.shape[-2] - 2
    if num_keys <= 0 or num_keys % 2:
        raise ValueError(f"int4 summaries need an even number of stored keys, got {num_keys}")
    q8, scale8 = quantize_summaries_int8(summaries[..., :2, :])
    q4, scale4 = quantize_summaries_int4(summaries[..., 2:, :])
    low, high = q4[..., 0::2, :].int(), q4[..., 1::2, :].int()
    packed = (high * 16 + low + 8).to(torch.int8)  # in [-111, 127]: an int8 byte
    scales = torch.cat([scale8, scale4], dim=-1).contiguous().view(torch.int8)
    rows = torch.zeros((*summaries.shape[:-2], 1, summaries.shape[-1]), dtype=torch.int8,
                       device=summaries.device)  # fmt: skip
    rows[..., 0, : scales.shape[-1]] = scales
    return torch.cat([q8, packed, rows], dim=-2).view(torch.uint8)


def split_int4_summaries(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 int4 summary tensor as the kernels store it (:func:`pack_int4_summaries`):
    ``(q int8 [..., 2 + r, D], scale fp32 [..., 2 + r])``, the keys unpacked."""
    x = summaries.view(torch.int8)
    num_slots = 2 + 2 * (summaries.shape[-2] - 3)
    packed = x[..., 2 : summaries.shape[-2] - 1, :].int()
    high = packed >> 4  # arithmetic: floor(byte / 16)
    low = (packed & 15) - 8  # the low nibble holds the key plus 8
    keys = torch.stack([low, high], dim=-2).flatten(-3, -2).to(torch.int8)
    scales = x[..., -1, : 4 * num_slots].clone().view(torch.float32)
    return torch.cat([x[..., :2, :], keys], dim=-2), scales


def dequantize_summaries_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32: the values Estimate computes with."""
    return q.float() * scale.float().unsqueeze(-1)


def split_int8_summaries(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 summary tensor as the kernels store it, ``[..., S + 1, D]`` = S rows of
    values, then one row whose first 4 S bytes are the S fp32 scales: ``(q [..., S, D],
    scale [..., S])``."""
    num_slots = summaries.shape[-2] - 1
    scales = summaries[..., num_slots, : 4 * num_slots].contiguous().view(torch.float32)
    return summaries[..., :num_slots, :], scales


def read_summaries(summaries: torch.Tensor) -> torch.Tensor:
    """A summary tensor as the kernels store it, back as fp32 ``[nb, H_kv, S, D]``
    (bf16 as is; int8 dequantized, :func:`split_int8_summaries`; int4, uint8,
    :func:`split_int4_summaries`)."""
    if summaries.dtype == torch.int8:
        return dequantize_summaries_int8(*split_int8_summaries(summaries))
    if summaries.dtype == torch.uint8:
        return dequantize_summaries_int8(*split_int4_summaries(summaries))
    return summaries.float()


def parse_stored_estimator(name: str) -> tuple[str, str | None]:
    """Benchmark names for an estimator on stored summaries: ``"int8:mvar_top4"`` ->
    ``("mvar_top4", "int8")``, ``"bf16:mvar"`` -> ``("mvar", "bfloat16")``; a plain
    name -> ``(name, None)`` (no storage given)."""
    prefix, _, rest = name.partition(":")
    storage = {"bf16": "bfloat16", "bfloat16": "bfloat16", "int8": "int8", "int4": "int4"}.get(
        prefix
    )
    return (rest, storage) if storage else (name, None)


def stored_summaries(summaries: torch.Tensor, summary_dtype: str) -> torch.Tensor:
    """Summaries as Estimate sees them after storage in ``summary_dtype`` (fp32)."""
    if summary_dtype == "bfloat16":
        return summaries.to(torch.bfloat16).float()
    if summary_dtype == "int8":
        return dequantize_summaries_int8(*quantize_summaries_int8(summaries))
    if summary_dtype == "int4":  # the values read_summaries(pack_int4_summaries(.)) gives
        if summaries.shape[-2] <= 2:
            raise ValueError("int4 summaries store the keys of mvar_top{r}; these have none")
        means = dequantize_summaries_int8(*quantize_summaries_int8(summaries[..., :2, :]))
        keys = dequantize_summaries_int8(*quantize_summaries_int4(summaries[..., 2:, :]))
        return torch.cat([means, keys], dim=-2)
    raise ValueError(f"summary_dtype must be one of {SUMMARY_DTYPES}, got {summary_dtype!r}")


# --------------------------------------------------------------------------
# Gathering one row
# --------------------------------------------------------------------------
def num_pages(seq_len: int) -> int:
    return (seq_len + PAGE_SIZE - 1) // PAGE_SIZE


def row_keys_values(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one row in token order: two ``[H_kv, seq_len, D]`` fp32."""
    head_size = kv_cache.shape[-1] // 2
    n = num_pages(seq_len)
    pages = kv_cache[block_table_row[:n].long()].float()  # [n, H, 64, 2D]
    pages = pages.permute(1, 0, 2, 3).reshape(kv_cache.shape[1], n * PAGE_SIZE, -1)
    pages = pages[:, :seq_len]
    return pages[..., :head_size], pages[..., head_size:]


# --------------------------------------------------------------------------
# Estimate (Eq. 2) and the oracle
# --------------------------------------------------------------------------
def exact_page_logmass(
    query: torch.Tensor, keys: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """Exact log-mass ``log sum_k exp(s q.k)`` of every page: ``[H_kv, G, n]``.

    ``query`` is ``[H_q, D]``, ``keys`` ``[H_kv, seq_len, D]`` (fp32).
    """
    h_kv = keys.shape[0]
    g = query.shape[0] // h_kv
    n = num_pages(seq_len)
    q = query.float().view(h_kv, g, -1) * scale
    logits = torch.einsum("hgd,htd->hgt", q, keys)  # [H, G, T]
    padded = torch.full((h_kv, g, n * PAGE_SIZE), -math.inf, device=keys.device)
    padded[..., :seq_len] = logits
    return torch.logsumexp(padded.view(h_kv, g, n, PAGE_SIZE), dim=-1)


def mvar_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float
) -> torch.Tensor:
    """Eq. 2 for every page: ``s q.mu + 0.5 (s q)^2 . sigma^2 + log 64``.

    ``page_summaries`` is ``[n, H_kv, 2, D]``; returns ``[H_kv, G, n]``.
    """
    h_kv = page_summaries.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale  # [H, G, D]
    mean = page_summaries[:, :, 0].float()  # [n, H, D]
    var = page_summaries[:, :, 1].float()
    mean_term = torch.einsum("hgd,nhd->hgn", q, mean)
    spread_term = 0.5 * torch.einsum("hgd,nhd->hgn", q * q, var)
    return mean_term + spread_term + math.log(PAGE_SIZE)


def estimate_row_logmass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    estimator: str = "mvar",
) -> torch.Tensor:
    """Log-mass per (KV head, query head in group, page): ``[H_kv, G, n]``.

    ``estimator="mvar"``: Eq. 2 from the stored summaries, with the sink page
    and the current page computed exactly (paper §3.1).
    ``estimator="oracle"``: exact masses of every page, for analysis.
    ``"mvar_rem"`` (2-slot summary) and ``"mvar_top{1,2,4}"`` (``2 + r`` slots from
    :func:`summarize_pages_top`): the outlier-robust estimators below.
    """
    keys, _ = row_keys_values(kv_cache, block_table_row, seq_len)
    exact = exact_page_logmass(query, keys, seq_len, scale)
    if estimator == "oracle":
        return exact
    if estimator == "mvar_rem" or estimator in TOP_ESTIMATORS:
        n = num_pages(seq_len)
        est = outlier_page_logmass(query, summaries[block_table_row[:n].long()], scale, estimator)
        est[..., 0] = exact[..., 0]
        est[..., n - 1] = exact[..., n - 1]
        return est
    if estimator != "mvar":
        raise ValueError(
            f"unknown estimator {estimator!r}; expected 'mvar', 'oracle', 'mvar_rem' "
            f"or one of {sorted(TOP_ESTIMATORS)}"
        )
    n = num_pages(seq_len)
    est = mvar_page_logmass(query, summaries[block_table_row[:n].long()], scale)
    est[..., 0] = exact[..., 0]
    est[..., n - 1] = exact[..., n - 1]
    return est


# --------------------------------------------------------------------------
# Select (Eq. 3): exact, by sort
# --------------------------------------------------------------------------
def group_mean_shares(logmass: torch.Tensor) -> torch.Tensor:
    """pi-bar: mean over the G query heads of the per-head softmax over pages.

    ``logmass`` is ``[..., G, n]``; returns ``[..., n]``.
    """
    return torch.softmax(logmass.float(), dim=-1).mean(dim=-2)


def _threshold_keep(middle: torch.Tensor, target: float, by_count: bool) -> torch.Tensor:
    """Mask of ``middle >= tau`` for the largest tau whose kept sum (or count)
    reaches ``target``; all pages if no tau reaches it (Eq. 3's threshold form,
    so pages tied at the threshold are all kept)."""
    if middle.numel() == 0 or target <= 0:
        return torch.zeros_like(middle, dtype=torch.bool)
    values, _ = torch.sort(middle, descending=True)
    acc = torch.ones_like(values).cumsum(0) if by_count else values.cumsum(0)
    reached = torch.nonzero(acc >= target)
    if reached.numel() == 0:
        return torch.ones_like(middle, dtype=torch.bool)
    tau = values[reached[0, 0]]
    return middle >= tau


def _top_count_keep(middle: torch.Tensor, count: int) -> torch.Tensor:
    """Mask of the ``count`` largest values; among equal values the most
    recent (highest page index) pages win."""
    keep = torch.zeros_like(middle, dtype=torch.bool)
    if count <= 0:
        return keep
    if count >= middle.numel():
        return ~keep
    index = torch.arange(middle.numel(), dtype=torch.float64, device=middle.device)
    # Sort by value, then by recency: a stable sort on the index first.
    by_recency = torch.argsort(index, descending=True)
    order = by_recency[torch.sort(middle[by_recency], descending=True, stable=True)[1]]
    keep[order[:count]] = True
    return keep


def select_pages(
    pibar: torch.Tensor,
    gamma: float = 0.98,
    fixed_pages: int | None = None,
    fixed_fraction: float | None = None,
) -> torch.Tensor:
    """Page list of one (row, KV head): logical pages, sink first, current last.

    Coverage rule (default): the sink and the current page are always kept;
    of the other pages, those with ``pibar >= tau`` where tau is the largest
    threshold whose kept share reaches ``gamma - pibar[sink] - pibar[cur]``.
    ``gamma >= 1`` keeps every page. Fixed-count mode (``fixed_pages=K``): the
    K pages in total, sink and current included, with the largest shares
    (ties go to the most recent pages); ``fixed_fraction=f`` means
    K = ceil(f * n) for a row of n pages.
    """
    n = pibar.numel()
    if fixed_fraction is not None:
        fixed_pages = math.ceil(fixed_fraction * n)
    # Lists are CPU tensors whatever the shares' device (the checks compare them as lists).
    if n <= 2:
        return torch.arange(n, dtype=torch.int32, device="cpu")
    pibar = pibar.float().cpu()
    middle = pibar[1 : n - 1].float()
    if fixed_pages is not None:
        keep = _top_count_keep(middle, fixed_pages - 2)
    elif gamma >= 1.0:
        keep = torch.ones_like(middle, dtype=torch.bool)
    else:
        target = gamma - float(pibar[0]) - float(pibar[n - 1])
        keep = _threshold_keep(middle, target, by_count=False)
    kept_middle = torch.nonzero(keep).flatten().cpu() + 1
    first, last = torch.tensor([0], device="cpu"), torch.tensor([n - 1], device="cpu")
    return torch.cat([first, kept_middle, last]).to(torch.int32)


def coverage_threshold(pibar: torch.Tensor, gamma: float) -> float | None:
    """Eq. 3's threshold: the smallest share among the middle pages that the coverage rule
    keeps at ``gamma`` (``select_pages``), or None when it keeps no middle page."""
    n = pibar.numel()
    middle = [p for p in select_pages(pibar, gamma=gamma).tolist() if 0 < p < n - 1]
    return min(float(pibar[p]) for p in middle) if middle else None


# --------------------------------------------------------------------------
# Attend over a page list, and the LSE merge
# --------------------------------------------------------------------------
def attend_pages(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_lists: list[torch.Tensor],
    seq_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one row over each KV head's page list.

    Returns the output ``[H_q, D]`` and its log-sum-exp ``[H_q]`` (fp32).
    """
    h_kv = keys.shape[0]
    g = query.shape[0] // h_kv
    outs, lses = [], []
    for h in range(h_kv):
        tokens = torch.cat(
            [
                torch.arange(p * PAGE_SIZE, min((p + 1) * PAGE_SIZE, seq_len))
                for p in page_lists[h].tolist()
            ]
        ).to(keys.device)
        q = query[h * g : (h + 1) * g].float() * scale  # [G, D]
        logits = q @ keys[h, tokens].T  # [G, t]
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.softmax(logits, dim=-1) @ values[h, tokens])
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def captured_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    head: int,
    pages: torch.Tensor,
    seq_len: int,
    scale: float,
) -> float:
    """The audit's quantity for one (row, KV head) list: the exact softmax of the
    head's G query heads over all ``seq_len`` keys, summed over the tokens of
    ``pages`` and averaged over the group. ``query`` ``[H_q, D]``, ``keys``
    ``[H_kv, seq_len, D]`` fp32 (``row_keys_values``)."""
    g = query.shape[0] // keys.shape[0]
    probs = torch.softmax(query[head * g : (head + 1) * g].float() * scale @ keys[head].T, -1)
    kept = torch.zeros(seq_len, dtype=torch.bool, device=keys.device)
    for p in pages.tolist():
        kept[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = True
    return float(probs[:, kept].sum(-1).mean())


def merge_partials(
    partial_out: torch.Tensor, partial_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine chunk outputs ``[J, ..., D]`` by their log-sum-exp ``[J, ...]``."""
    lse = torch.logsumexp(partial_lse, dim=0)
    weights = torch.exp(partial_lse - lse).unsqueeze(-1)
    return (weights * partial_out).sum(dim=0), lse


# --------------------------------------------------------------------------
# The whole decode step
# --------------------------------------------------------------------------
def sparse_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gamma: float | Sequence[float] = 0.98,
    fixed_pages: int | None = None,
    estimator: str = "mvar",
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Moira's decode step for ``B`` rows: output ``[B, H_q, D]`` fp32 and the
    page list of every (row, KV head). Rows with ``seq_len == 0`` give zeros.

    ``gamma`` is one value for every row, or one per row (requests with their
    own ``moira_gamma`` in one batch)."""
    batch, h_q, head_size = query.shape
    row_gammas = [gamma] * batch if isinstance(gamma, (int, float)) else list(gamma)
    if len(row_gammas) != batch:
        raise ValueError(f"gamma has {len(row_gammas)} values for {batch} rows")
    h_kv = kv_cache.shape[1]
    out = torch.zeros(batch, h_q, head_size, device=query.device)
    lists: list[list[torch.Tensor]] = []
    for b in range(batch):
        seq_len = int(seq_lens[b])
        if seq_len == 0:
            lists.append([torch.zeros(0, dtype=torch.int32)] * h_kv)
            continue
        logmass = estimate_row_logmass(
            query[b], kv_cache, summaries, block_table[b], seq_len, scale, estimator
        )
        pibar = group_mean_shares(logmass)
        row_lists = [select_pages(pibar[h], row_gammas[b], fixed_pages) for h in range(h_kv)]
        keys, values = row_keys_values(kv_cache, block_table[b], seq_len)
        out[b] = attend_pages(query[b], keys, values, row_lists, seq_len, scale)[0]
        lists.append(row_lists)
    return out, lists


def dense_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense decode attention over every token of each row: ``[B, H_q, D]``."""
    batch, h_q, head_size = query.shape
    h_kv = kv_cache.shape[1]
    out = torch.zeros(batch, h_q, head_size, device=query.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        if seq_len == 0:
            continue
        keys, values = row_keys_values(kv_cache, block_table[b], seq_len)
        every_page = [torch.arange(num_pages(seq_len))] * h_kv
        out[b] = attend_pages(query[b], keys, values, every_page, seq_len, scale)[0]
    return out


# --------------------------------------------------------------------------
# Outlier-key estimators (docs/estimator.md)
# --------------------------------------------------------------------------
# ``mvar_rem``: Eq. 2 with the spread term of the random energy model (REM): a
# sample of ``m`` Gaussian logits of standard deviation sigma has log-mean-exp
# ``sigma^2 / 2`` only while ``sigma <= sigma_c = sqrt(2 ln m)``; above, the
# largest sample dominates and it grows linearly, ``sigma_c sigma - sigma_c^2 / 2``
# (same value and slope at sigma_c). Same 2-slot summary as ``mvar``.
#
# ``mvar_top{r}``: the ``r`` keys of the page farthest (L2) from the page's mean
# key are stored exactly; the other ``64 - r`` (the bulk) are summarised by
# their mean and variance. Summary ``[num_blocks, H_kv, 2 + r, D]``:
# slot 0 = bulk mean, slot 1 = bulk (population) variance, slots 2 .. 1 + r =
# the stored keys (farthest first). Log-mass:
# ``logaddexp(x.mu_b + rem(x^2.var_b; 64 - r) + log(64 - r), logsumexp_j x.k_j)``.
# Only ``mvar_top8`` has kernels (moira.MOIRA_ESTIMATORS); the others are studied here.
TOP_ESTIMATORS = {"mvar_top1": 1, "mvar_top2": 2, "mvar_top4": 4, "mvar_top8": 8,
                  "mvar_top16": 16}  # fmt: skip


def summary_slots(estimator: str) -> int:
    """Summary slots an estimator reads: 2 (mean, var) or ``2 + r``."""
    if estimator in TOP_ESTIMATORS:
        return 2 + TOP_ESTIMATORS[estimator]
    return 2


def rem_spread(v: torch.Tensor, count: int) -> torch.Tensor:
    """Spread term of ``count`` logits of variance ``v``: ``v / 2`` below
    ``sigma_c^2 = 2 ln(count)``, ``sigma_c sqrt(v) - sigma_c^2 / 2`` above."""
    sc2 = 2.0 * math.log(count)
    sc = math.sqrt(sc2)
    return torch.where(v <= sc2, 0.5 * v, sc * v.clamp_min(0.0).sqrt() - 0.5 * sc2)


def stored_key_order(pages: torch.Tensor, r: int) -> torch.Tensor:
    """Token indices ``[..., r]`` of the ``r`` keys of each page ``[..., 64, D]`` farthest
    (L2) from the page mean, farthest first (ties: the lower token index first): the keys
    ``mvar_top{r}`` stores; the other ``64 - r`` are the bulk."""
    pages = pages.float()
    dist = ((pages - pages.mean(dim=-2, keepdim=True)) ** 2).sum(dim=-1)  # [..., 64]
    return torch.sort(dist, dim=-1, descending=True, stable=True).indices[..., :r]


def summarize_key_pages_top(pages: torch.Tensor, r: int) -> torch.Tensor:
    """``mvar_top{r}`` summary of full pages of keys ``[..., 64, D]``: ``[..., 2 + r, D]`` fp32.

    Stored keys: the ``r`` largest ``||k - mean||^2`` (ties: lower index first);
    bulk mean/var over the remaining ``64 - r`` keys.
    """
    if not 0 < r < PAGE_SIZE:
        raise ValueError(f"r must be in 1..{PAGE_SIZE - 1}, got {r}")
    return summarize_key_pages_by_order(pages, stored_key_order(pages.float(), r))


def summarize_key_pages_by_order(pages: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``mvar_top{r}``'s layout ``[..., 2 + r, D]`` fp32 with the stored keys the tokens
    ``order`` ``[..., r]`` of each page ``[..., 64, D]`` (in that order), the rest the bulk."""
    pages = pages.float()
    r = order.shape[-1]
    top = torch.gather(pages, -2, order.unsqueeze(-1).expand(*order.shape, pages.shape[-1]))
    bulk = torch.ones(pages.shape[:-1], dtype=torch.bool, device=pages.device)
    bulk = bulk.scatter(-1, order, False).unsqueeze(-1)
    m = bulk.float()
    mu_b = (pages * m).sum(dim=-2) / (PAGE_SIZE - r)
    var_b = (((pages - mu_b.unsqueeze(-2)) * m) ** 2).sum(dim=-2) / (PAGE_SIZE - r)
    return torch.cat([mu_b.unsqueeze(-2), var_b.unsqueeze(-2), top], dim=-2)


def summarize_pages_top(kv_cache: torch.Tensor, block_ids: torch.Tensor, r: int) -> torch.Tensor:
    """``mvar_top{r}`` summaries of full pages of the cache: ``[n, H_kv, 2 + r, D]`` fp32."""
    head_size = kv_cache.shape[-1] // 2
    return summarize_key_pages_top(kv_cache[block_ids.long(), :, :, :head_size], r)


def rem_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float
) -> torch.Tensor:
    """``mvar_rem``: ``x.mu + rem_spread(x^2.var, 64) + log 64``; ``[H_kv, G, n]``."""
    h_kv = page_summaries.shape[1]
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale
    mean_term = torch.einsum("hgd,nhd->hgn", q, page_summaries[:, :, 0].float())
    v = torch.einsum("hgd,nhd->hgn", q * q, page_summaries[:, :, 1].float())
    return mean_term + rem_spread(v, PAGE_SIZE) + math.log(PAGE_SIZE)


def top_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, spread=rem_spread
) -> torch.Tensor:
    """``mvar_top{r}`` from a ``[n, H_kv, 2 + r, D]`` summary: ``[H_kv, G, n]``.
    ``spread(v, count)``: the bulk's spread term (REM's; the estimator study tries others)."""
    h_kv = page_summaries.shape[1]
    r = page_summaries.shape[2] - 2
    count = PAGE_SIZE - r
    q = query.float().view(h_kv, -1, query.shape[-1]) * scale  # [H, G, D]
    summ = page_summaries.float()
    mean_term = torch.einsum("hgd,nhd->hgn", q, summ[:, :, 0])
    v = torch.einsum("hgd,nhd->hgn", q * q, summ[:, :, 1])
    bulk = mean_term + spread(v, count) + math.log(count)
    stored = torch.einsum("hgd,nhrd->hgnr", q, summ[:, :, 2:])
    return torch.logaddexp(bulk, torch.logsumexp(stored, dim=-1))


def outlier_page_logmass(
    query: torch.Tensor, page_summaries: torch.Tensor, scale: float, estimator: str
) -> torch.Tensor:
    """Dispatch for ``mvar_rem`` and ``mvar_top{r}``; checks the summary's slot count."""
    want = summary_slots(estimator)
    if page_summaries.shape[2] != want:
        raise ValueError(
            f"estimator {estimator!r} needs a {want}-slot summary, got {page_summaries.shape[2]}"
        )
    if estimator == "mvar_rem":
        return rem_page_logmass(query, page_summaries, scale)
    return top_page_logmass(query, page_summaries, scale)
