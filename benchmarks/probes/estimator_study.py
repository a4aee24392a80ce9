# SPDX-License-Identifier: Apache-2.0
"""Page-mass estimators on a real model's queries/keys (CPU, float32 reference).

    python -m benchmarks.probes.estimator_study [--model smollm2-135m|qwen2.5-coder-1.5b]
        [--contexts 4096] [--haystacks essays austen mobydick]
        [--tasks niah_single niah_multikey niah_multiquery] [--last-k 16]

``--model``: a key of ``scripts/prepare_model.py`` (SmolLM2-135M by default; Qwen2.5-Coder-1.5B:
12 query / 2 KV heads, head dim 128), prepared there if missing and run in float32.

For needle prompts (``data.ruler_samples``: one needle, four confusable needles with one
asked for, or four asked for at once; in any haystack), the post-RoPE q/k/v of every
layer at the last ``K`` prompt positions (teacher-forced decode steps) are captured once
(cached per model under ``benchmarks/scratch/``, git-ignored) and every estimator x gamma is
evaluated on the same rows, one page list per (row, layer, KV head):

- reads: mean kept fraction of pages (sink and current page included), and x oracle;
- captured mass: true group-mean share (oracle pi-bar) of the kept pages, mean/p10/min;
- needle drops: needle-attending lists (true share of some needle page >= 0.05) whose list
  misses such a page, with the (layer, KV head) of each drop;
- out_err: mean relative L2 error of the attention output vs dense, and x oracle;
- two-stage estimators (``2s/...``): the fraction of middle pages stage 2 refines.

Writes one JSON record (``--out``); ``--heatmaps`` also writes kept-fraction heat maps
per (layer, KV head) to ``docs/img/``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import torch

from benchmarks.accuracy import data as D
from benchmarks.accuracy import harness as H
from benchmarks.accuracy.run_accuracy_vllm import _prepare_module
from benchmarks.probes import research_estimators as research
from vllm_moira.v1.attention.ops import moira_reference as ref

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "benchmarks" / "scratch" / "estimator_cache"
ESTIMATORS = ["oracle", "mvar", "mvar_rem", "mvar_top2", "mvar_top4", "mvar_bennett", "box"]
# earlier candidates, still selectable with --estimators: mvar_box mvar_cap vscale:2 ext:8 mvar_top1
GAMMAS = [0.95, 0.98, 0.99]
NEEDLE_SHARE = 0.05


NEEDLE_RE = re.compile(r"(?:One of the|The) special magic numbers? for [A-Za-z]+ is \d+\.")
#: ``needle_mid``: the earlier study's prompt (one needle at 50% depth, ``data.needle_prompt``);
#: the others: ``data.ruler_samples`` (random depths; multikey: four confusable needles, one
#: asked for; multiquery: four asked for at once).
TASKS = ("needle_mid", "niah_single", "niah_multikey", "niah_multiquery")


def needle_spans(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token spans ``(first, last)`` of every needle sentence (``NEEDLE_RE``) in ``text``.

    ``offsets`` are the tokenizer's character offsets of each token. The question
    at the end names a key but has no number, so it does not match.
    """
    spans = []
    for m in NEEDLE_RE.finditer(text):
        toks = [i for i, (a, b) in enumerate(offsets) if b > m.start() and a < m.end()]
        if toks:
            spans.append((min(toks), max(toks)))
    return spans


def needle_pages(spans: list[tuple[int, int]], page: int) -> list[int]:
    """Sorted pages that hold a token of any needle span."""
    return sorted({p for a, b in spans for p in range(a // page, b // page + 1)})


def cache_path(model_key: str, task: str, haystack: str, context: int, seed: int,
               last_k: int) -> Path:  # fmt: skip
    """Capture file of one prompt; the model key is in the name because the prompts (and so
    every other part of the name) are the same for every model."""
    return CACHE / f"{model_key}_{task}_{haystack}_{context}_s{seed}_k{last_k}.pt"


def capture(tok, model, model_key: str, context: int, seed: int, last_k: int,
            task: str = "niah_single", haystack: str = "essays") -> dict:  # fmt: skip
    """q/k/v of every layer at the last ``last_k`` prompt positions of one needle prompt
    (``data.ruler_samples``: task, haystack, seed) through ``model`` (prepare_model.py's
    ``model_key``), cached under ``CACHE``."""
    path = cache_path(model_key, task, haystack, context, seed, last_k)
    if path.is_file():
        return torch.load(path)
    if task == "needle_mid":
        sample, _ = D.needle_prompt(tok, context, depth=0.5, seed=seed, haystack=haystack)
    else:
        sample = D.ruler_samples(tok, task, context, 1, seed=seed, haystacks=(haystack,))[0]
    msgs = [{"role": "user", "content": sample.prompt}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    text += sample.answer_prefix
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([enc["input_ids"]])
    spans = needle_spans(text, enc["offset_mapping"])
    if not spans:
        raise RuntimeError(f"{task}/{haystack}: no needle found in the prompt")
    t0 = time.time()
    H.forward_logits(model, ids, "capture", last_k)
    secs = time.time() - t0
    blob = {
        "layers": H.STATE.captured,
        "needle_spans": spans,
        "needle_tokens": spans[0],  # estimator_lab reads the first needle
        "seq_len": ids.shape[1],
        "forward_s": secs,
        "answers": sample.answers,
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(blob, path)
    print(f"[capture] {model_key} {task}/{haystack} ctx={context} seed={seed}: "
          f"{ids.shape[1]} tokens, {len(spans)} needles, {secs:.1f}s", flush=True)  # fmt: skip
    return blob


CAPPED = {  # research.capped_spread_logmass variants: (REM spread?, radius cap?, channel cap?)
    "rem_capr": (True, True, False),
    "mvar_capr": (False, True, False),
    "rem_capc": (True, False, True),
    "mvar_capc": (False, False, True),
}


#: ``<storage>:top<r>_<spread>``: ``mvar_top{r}``'s summary as that storage gives it back, its
#: bulk's spread term ``research.SPREADS[spread]`` instead of REM (e.g. ``int8:top8_uniform``)
SPREAD_RE = re.compile(r"^(?:(int8|int4|bf16):)?top(\d+)_([a-z]+)$")


def parse_spread(name: str) -> tuple[str, str] | None:
    """``(summary estimator, spread)`` of a ``SPREAD_RE`` name, e.g. ``("int8:mvar_top8",
    "uniform")``; None for other names."""
    m = SPREAD_RE.match(name)
    if m is None:
        return None
    if m.group(3) not in research.SPREADS:
        raise ValueError(f"unknown spread {m.group(3)!r} in {name!r}: {sorted(research.SPREADS)}")
    return f"{m.group(1) + ':' if m.group(1) else ''}mvar_top{m.group(2)}", m.group(3)


#: ``top<r>_pc<k>``: ``mvar_top{r}`` with the bulk's variance along ``x`` from its ``k``
#: principal axes (``research.top_pc_logmass``; float32 summaries)
#: ``top<r>_pc<k>_<max|bennett>``: the same with the spread capped by the bulk's bound
#: along the axes and the remainder (``research.top_pc_bound_logmass``)
PC_RE = re.compile(r"^top(\d+)_pc(\d+)(?:_(max|bennett))?$")


#: ``samp<stride>_top<r>``: ``research.sampled_logmass`` (stored keys exact, every
#: ``stride``-th other key sampled), a cheaper stage 2 for two-stage names
SAMPLED_RE = re.compile(r"^samp(\d+)_top(\d+)$")


#: ``keyq<bits>[c][_f<percent>|_p<percent>]``: ``research.quantized_key_logmass`` (every key
#: of the page, rounded to ``bits`` bits per channel; ``c``: around the page mean; ``_f``: only
#: that percentage of the channels, those of the largest variance in the page; ``_p``: that
#: percentage of D principal axes of the head's keys in the row's context instead of channels;
#: ``v``: plus the residual's spread term):
#: a stage 2 that reads a quantized key copy, or alone the ceiling of any estimator on one
KEYQ_RE = re.compile(r"^keyq(\d+)(c?)(?:_(f|p)(\d+)(v?))?$")


#: ``sub<parts>`` / ``subrem<parts>``: Eq. 2 on each of a page's ``parts`` runs of
#: consecutive keys, the runs' masses added (``research.sub_page_logmass``; float32
#: summaries of ``2 * parts`` slots), with mvar's or REM's spread term
SUB_RE = re.compile(r"^sub(rem)?(\d+)$")


#: ``ub<slack>/<base>``: ``base`` floored by its page's per-channel key box (int8, rounded
#: outward): ``research.box_floor_logmass(base, box_max_logit, slack)``; ``ubb<slack>/<base>``:
#: the box of the bulk only (``base`` a ``mvar_top{r}`` name; its ``r`` stored keys left out)
BOX_FLOOR_RE = re.compile(r"^ub(b?)(\d+(?:\.\d+)?)/(.+)$")


#: ``<storage>:ztop<r>``: ``mvar_top{r}`` with the stored keys chosen by their standardized
#: distance from the page mean (``research.summarize_top_standardized``)
ZTOP_RE = re.compile(r"^(?:(int8|int4|bf16):)?ztop(\d+)$")


#: ``<storage>:qtop<r>``: ``mvar_top{r}`` with the stored keys the row's largest logits
#: (``research.query_chosen_logmass``): the ceiling of any stored-key choice, not a writer
QTOP_RE = re.compile(r"^(?:(int8|int4|bf16):)?qtop(\d+)$")


#: ``<storage>:wtop<r>[_<l>]``: ``mvar_top{r}`` with the stored keys chosen at the end of
#: prefill by the prompt's last queries, the rows ``--warmup-rows`` runs but does not count
#: (``research.summarize_top_window``; the first ``l`` of them by L2 distance as mvar_top's)
WTOP_RE = re.compile(r"^(?:(int8|int4|bf16):)?wtop(\d+)(?:_(\d+))?$")


#: ``<storage>:ptop<r>_<k>``: ``mvar_top{r}`` with the stored keys the farthest from the page
#: mean once the head's ``k`` leading key axes are projected out
#: (``research.summarize_top_projected``)
PTOP_RE = re.compile(r"^(?:(int8|int4|bf16):)?ptop(\d+)_(\d+)$")


def parse_box_floor(name: str) -> tuple[str, float, bool] | None:
    """``(base, slack, bulk box?)`` of a ``BOX_FLOOR_RE`` name, None for other names."""
    m = BOX_FLOOR_RE.match(name)
    if m is None:
        return None
    base = m.group(3)
    if m.group(1) and ref.parse_stored_estimator(base)[0] not in ref.TOP_ESTIMATORS:
        raise ValueError(f"ubb needs a mvar_top{{r}} base, got {base!r}")
    return base, float(m.group(2)), bool(m.group(1))


def parse_pc(name: str) -> tuple[int, int, str | None] | None:
    """``(r, k, cap rule or None)`` of a ``PC_RE`` name, None for other names."""
    m = PC_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def parse_two_stage(name: str) -> tuple[str, str, float, float] | None:
    """Two-stage estimators: ``(stage 1, stage 2, below, above)``, ``above = nan`` for ``2u``.

    ``2s/<stage 1>/<stage 2>/<below>/<above>`` (e.g. ``2s/int8:mvar_rem/oracle/2/inf``):
    stage 1 over every page, stage 2 for the pages of ``research.refine_band``;
    ``2u/<stage 1>/<stage 2>/<slack>``: stage 2 for the pages stage 1 drops that the
    radius bound cannot rule out (``research.bound_gated_logmass``).
    """
    parts = name.split("/")
    if parts[0] == "2s" and len(parts) == 5:
        return parts[1], parts[2], float(parts[3]), float(parts[4])
    if parts[0] == "2u" and len(parts) == 4:
        return parts[1], parts[2], float(parts[3]), math.nan
    if parts[0] in ("2s", "2u"):
        raise ValueError(f"expected 2s/<s1>/<s2>/<below>/<above> or 2u/<s1>/<s2>/<slack>: {name!r}")
    return None


ANCHOR_MODES = {  # mode -> (seeded, horizon in steps (0: none), only lower estimates)
    "seed": (True, 0, False),
    "noseed": (False, 0, False),
    "h1": (False, 1, False),
    "h1down": (False, 1, True),
    "down": (False, 0, True),
}


def parse_anchored(name: str) -> tuple[str, tuple[bool, int, bool]] | None:
    """Anchored estimators: ``(base, mode)`` for ``fb/<base>/<mode>`` (``ANCHOR_MODES``).

    The base estimate of a page is corrected by its error at the last step whose list kept
    the page (``research.AnchoredEstimate``): Attend computes the exact log-mass of every
    kept page anyway, so the correction costs a store per kept page and a load per page.
    ``seed``: the first row keeps every page (one dense step), so every page has an anchor;
    ``h1``: anchors from the previous step only; ``down``: only lowering corrections.
    """
    parts = name.split("/")
    if parts[0] != "fb":
        return None
    if len(parts) != 3 or parts[2] not in ANCHOR_MODES:
        raise ValueError(f"expected fb/<base>/<{'|'.join(ANCHOR_MODES)}>: {name!r}")
    return parts[1], ANCHOR_MODES[parts[2]]


def parse_spread_gated(name: str) -> tuple[str, str, float, float, float] | None:
    """``2v/<stage 1>/<stage 2>/<below>/<vmult>[/<cap>]``: ``(stage 1, stage 2, below,
    vmult, cap)``.

    Stage 2 for the pages of ``research.refine_band`` (``above = inf``: every page stage 1
    keeps and the band ``below`` nats under its threshold) whose bulk variance along ``x``
    (stage 1's summary, mean over the group) is at least ``vmult`` times REM's critical
    variance ``2 ln m``: the wide pages, where the spread term can over-estimate. ``cap``
    (default inf): at most that fraction of a list's middle pages, the largest shares first
    (``research.cap_refined``).
    """
    parts = name.split("/")
    if parts[0] != "2v":
        return None
    if len(parts) not in (5, 6):
        raise ValueError(f"expected 2v/<s1>/<s2>/<below>/<vmult>[/<cap>]: {name!r}")
    cap = float(parts[5]) if len(parts) == 6 else math.inf
    return parts[1], parts[2], float(parts[3]), float(parts[4]), cap


def base_estimators(estimators) -> list[str]:
    """Every single-stage estimator the list needs (two-stage and anchored names expanded)."""
    out = []
    for e in estimators:
        two = parse_two_stage(e) or parse_spread_gated(e)
        anchored = parse_anchored(e)
        floor = parse_box_floor(e)
        for b in (
            (two[0], two[1]) if two else (anchored[0],) if anchored
            else (floor[0], e) if floor else (e,)
        ):  # fmt: skip
            if b not in out:
                out.append(b)
    return out


def _new_stats() -> dict:
    return {"kept": [], "cap": [], "err": [], "needle_lists": 0, "needle_drop": 0, "drops": {},
            "drop_share_max": 0.0, "prompts_with_drop": set(), "refined": [],
            "refined_out": []}  # fmt: skip


def analyse(blob: dict, scale: float, estimators, gammas, stats: dict, label: str = "",
            heat: dict | None = None, warmup_rows: int = 0) -> None:  # fmt: skip
    """Add one captured prompt's rows to ``stats[(estimator, gamma)]``.

    A (row, KV head) list is needle-attending when the true group-mean share of some
    needle page is >= ``NEEDLE_SHARE``; it drops a needle when its list misses such a page.
    The first ``warmup_rows`` rows of each prompt are run (anchored estimators learn from
    them) but counted for no estimator.
    """
    seq_total = blob["seq_len"]
    spans = blob.get("needle_spans") or [tuple(blob["needle_tokens"])]
    pages_of_needles = needle_pages(spans, H.PAGE)
    bases = base_estimators(estimators)
    for layer, cap in blob["layers"].items():
        keys_all = cap["k"].float()
        vals_all = cap["v"].float()
        q_rows = cap["q"].float()  # [Hq, K, D]
        k_rows = q_rows.shape[1]
        n_full = seq_total // H.PAGE
        h_kv, _, d = keys_all.shape
        pages = keys_all[:, : n_full * H.PAGE].reshape(h_kv, n_full, H.PAGE, d).transpose(0, 1)
        summaries = {}
        for e in bases:  # "int8:mvar_top4": the summary as stored, then read back
            floor = parse_box_floor(e)
            if floor:  # the base's own summary is the base's entry
                r = ref.TOP_ESTIMATORS[ref.parse_stored_estimator(floor[0])[0]] if floor[2] else 0
                summaries[e] = research.store_box_int8(research.summarize_key_box(pages, r))
                continue
            if QTOP_RE.match(e):  # summarized per row, from the row's query
                continue
            ptop = PTOP_RE.match(e)
            if ptop:
                summ = research.summarize_top_projected(
                    pages, int(ptop.group(2)), int(ptop.group(3))
                )
                storage = ref.parse_stored_estimator(e)[1]
                summaries[e] = summ if storage is None else ref.stored_summaries(summ, storage)
                continue
            wtop = WTOP_RE.match(e)
            if wtop:  # the window: the uncounted rows, at their absolute positions
                if warmup_rows <= 0:
                    raise ValueError(f"{e} needs --warmup-rows > 0 (its observation window)")
                pos = torch.arange(warmup_rows) + seq_total - k_rows
                summ = research.summarize_top_window(
                    pages, q_rows[:, :warmup_rows], pos, scale, int(wtop.group(2)),
                    int(wtop.group(3) or 0),
                )  # fmt: skip
                storage = ref.parse_stored_estimator(e)[1]
                summaries[e] = summ if storage is None else ref.stored_summaries(summ, storage)
                continue
            ztop = ZTOP_RE.match(e)
            if ztop:
                summ = research.summarize_top_standardized(pages, int(ztop.group(2)))
                storage = ref.parse_stored_estimator(e)[1]
                summaries[e] = summ if storage is None else ref.stored_summaries(summ, storage)
                continue
            sub = SUB_RE.match(e)
            if sub:
                summaries[e] = research.summarize_sub_pages(pages, int(sub.group(2)))
                continue
            pc = parse_pc(e)
            if pc:
                make = research.summarize_top_pc_bound if pc[2] else research.summarize_top_pc
                summaries[e] = make(pages, pc[0], pc[1])
                continue
            spread = parse_spread(e)
            if spread:
                summaries[e] = H.page_summaries_for(keys_all, n_full, spread[0])
                continue
            base, storage = ref.parse_stored_estimator(e)
            if base in ref.TOP_ESTIMATORS or storage is not None:
                summaries[e] = H.page_summaries_for(keys_all, n_full, e)
        summaries[None] = H.page_summaries_ext(keys_all, n_full)
        radius, chan_dev = research.page_spread_bounds(pages)  # [n, H], [n, H, D]
        anchors: dict = {}  # (estimator, gamma) -> research.AnchoredEstimate, per layer
        for i in range(k_rows):
            seq_len = seq_total - k_rows + i + 1
            q = q_rows[:, i]
            keys = keys_all[:, :seq_len]
            vals = vals_all[:, :seq_len]
            n = ref.num_pages(seq_len)
            exact = ref.exact_page_logmass(q, keys, seq_len, scale)
            true_pibar = ref.group_mean_shares(exact)  # [H, n]
            dense = [torch.arange(n, dtype=torch.int32)] * keys.shape[0]
            o_dense, _ = ref.attend_pages(q, keys, vals, dense, seq_len, scale)
            # the row's n pages of a summary; the current page (partial or not) padded with
            # the last full one, its estimate replaced by the exact mass below
            page_rows = torch.arange(n).clamp_max(n_full - 1)
            ests = {}
            for e in bases:
                spread = parse_spread(e)
                pc = parse_pc(e)
                sampled = SAMPLED_RE.match(e)
                sub = SUB_RE.match(e)
                floor = parse_box_floor(e)
                if floor:  # its base comes first in ``bases``
                    bound = research.box_max_logit(q, summaries[e][page_rows], scale)
                    est = research.box_floor_logmass(ests[floor[0]], bound, floor[1])
                elif QTOP_RE.match(e):
                    n_in = seq_len // H.PAGE  # full pages; the current page is exact below
                    est = exact.clone()
                    if n_in > 0:
                        est[..., :n_in] = research.query_chosen_logmass(
                            q, pages[:n_in], scale, int(QTOP_RE.match(e).group(2)),
                            ref.parse_stored_estimator(e)[1],
                        )  # fmt: skip
                elif ZTOP_RE.match(e) or WTOP_RE.match(e) or PTOP_RE.match(e):
                    est = ref.top_page_logmass(q, summaries[e][page_rows], scale)
                elif sub:
                    summ = summaries[e][page_rows]
                    est = research.sub_page_logmass(q, summ, scale, rem=bool(sub.group(1)))
                elif sampled:
                    n_in = seq_len // H.PAGE  # full pages; the current page is exact below
                    est = exact.clone()
                    if n_in > 0:
                        est[..., :n_in] = research.sampled_logmass(
                            q, pages[:n_in], scale, int(sampled.group(2)), int(sampled.group(1))
                        )
                elif KEYQ_RE.match(e):
                    n_in = seq_len // H.PAGE  # full pages; the current page is exact below
                    est = exact.clone()
                    if n_in > 0:
                        keyq = KEYQ_RE.match(e)
                        part = pages.shape[-1] * int(keyq.group(4) or 0) // 100
                        axes = (research.principal_key_axes(pages[:n_in], part)
                                if keyq.group(3) == "p" else None)  # fmt: skip
                        est[..., :n_in] = research.quantized_key_logmass(
                            q, pages[:n_in], scale, int(keyq.group(1)), bool(keyq.group(2)),
                            part if keyq.group(3) == "f" else None, axes, bool(keyq.group(5)),
                        )  # fmt: skip
                elif pc and pc[2]:
                    summ = summaries[e][page_rows]
                    est = research.top_pc_bound_logmass(q, summ, scale, pc[1], pc[2])
                elif pc:
                    est = research.top_pc_logmass(q, summaries[e][page_rows], scale, pc[1])
                elif spread:
                    summ = summaries[e][page_rows]
                    est = research.top_spread_logmass(q, summ, scale, spread[1])
                elif e in CAPPED:
                    rem, use_r, use_c = CAPPED[e]
                    summ = summaries[None][page_rows]
                    est = research.capped_spread_logmass(
                        q, summ[:, :, 0], summ[:, :, 1], scale,
                        radius=radius[page_rows] if use_r else None,
                        chan_dev=chan_dev[page_rows] if use_c else None, rem=rem,
                    )  # fmt: skip
                else:
                    summ = summaries.get(e, summaries[None])
                    base = ref.parse_stored_estimator(e)[0]
                    est, _ = H.estimate_logmass(q, keys, seq_len, scale, base, summ, exact)
                # The sink and the current page (partial, or padded above) are exact.
                est[..., 0] = exact[..., 0]
                est[..., n - 1] = exact[..., n - 1]
                ests[e] = est
            upper = None  # the radius bound of this row's pages, for 2u estimators
            for est_name in estimators:
                two = parse_two_stage(est_name)
                gated = parse_spread_gated(est_name)
                anchored = parse_anchored(est_name)
                for gamma in gammas:
                    lists = None
                    mask = None
                    if gated:
                        summ = summaries[gated[0]][page_rows]
                        wide = research.wide_pages(q, summ, scale, summ.shape[2] - 2, gated[3])
                        est, mask = research.two_stage_logmass(
                            ests[gated[0]], ests[gated[1]], gamma, gated[2], math.inf, wide
                        )
                        if not math.isinf(gated[4]):
                            pibar = ref.group_mean_shares(ests[gated[0]])
                            mask = research.cap_refined(mask, pibar, gated[4])
                            est = torch.where(mask.unsqueeze(1), ests[gated[1]], ests[gated[0]])
                    elif anchored:
                        anchor = anchors.setdefault(
                            (est_name, gamma),
                            research.AnchoredEstimate(
                                h_kv, n_full + 1, anchored[1][1], anchored[1][2]
                            ),
                        )
                        if anchored[1][0] and i == 0:  # the seed step: every page, exact
                            est = exact
                            lists = [torch.arange(n, dtype=torch.int32)] * h_kv
                        else:
                            est = anchor.correct(ests[anchored[0]])
                    elif two and math.isnan(two[3]):
                        if upper is None:
                            upper = research.radius_upper_logmass(
                                q, summaries[None][page_rows][:, :, 0], radius[page_rows],
                                scale,
                            )  # fmt: skip
                        est, mask = research.bound_gated_logmass(
                            ests[two[0]], upper, ests[two[1]], gamma, two[2]
                        )
                    elif two:  # 2s
                        est, mask = research.two_stage_logmass(
                            ests[two[0]], ests[two[1]], gamma, two[2], two[3]
                        )
                    else:
                        est = ests[est_name]
                    if lists is None:
                        pibar = ref.group_mean_shares(est)
                        lists = [ref.select_pages(pibar[h], gamma=gamma) for h in range(h_kv)]
                    if anchored:
                        anchor.update(lists, exact, ests[anchored[0]])
                    if i < warmup_rows:
                        continue
                    o, _ = ref.attend_pages(q, keys, vals, lists, seq_len, scale)
                    err = (
                        (o - o_dense).norm(dim=-1) / o_dense.norm(dim=-1).clamp_min(1e-12)
                    ).mean()
                    s = stats.setdefault((est_name, gamma), _new_stats())
                    s["err"].append(float(err))
                    if mask is not None:  # fraction of the middle pages stage 2 refines,
                        # and of those Attend does not read anyway (extra key reads)
                        s["refined"] += mask[:, 1 : n - 1].float().mean(dim=1).tolist()
                        for h, lst in enumerate(lists):
                            out = mask[h].clone()
                            out[lst.long()] = False
                            s["refined_out"].append(float(out[1 : n - 1].float().mean()))
                    for h, lst in enumerate(lists):
                        kept = set(lst.tolist())
                        s["kept"].append(len(kept) / n)
                        if heat is not None:
                            heat.setdefault((est_name, gamma, layer, h), []).append(len(kept) / n)
                        s["cap"].append(float(true_pibar[h, lst.long()].sum()))
                        hot = [p for p in pages_of_needles
                               if p < n and float(true_pibar[h, p]) >= NEEDLE_SHARE]  # fmt: skip
                        if not hot:
                            continue
                        s["needle_lists"] += 1
                        missed = [p for p in hot if p not in kept]
                        if missed:
                            s["needle_drop"] += 1
                            key = f"L{layer}/H{h}"
                            s["drops"][key] = s["drops"].get(key, 0) + 1
                            s["prompts_with_drop"].add(label)
                            top = max(float(true_pibar[h, p]) for p in missed)
                            s["drop_share_max"] = max(s["drop_share_max"], top)


def quantile(xs, q):
    t = torch.tensor(xs)
    return float(torch.quantile(t, q)) if len(xs) else math.nan


def summarize(stats) -> list[dict]:
    """One row per (estimator, gamma); ``*_x_oracle`` against the oracle at the same gamma
    (when it was run)."""
    rows = []
    for (est, gamma), s in sorted(stats.items(), key=lambda x: (x[0][1], x[0][0])):
        nl = s["needle_lists"]
        row = {
            "estimator": est,
            "gamma": gamma,
            "lists": len(s["kept"]),
            "kept_mean": sum(s["kept"]) / len(s["kept"]),
            "captured_mean": sum(s["cap"]) / len(s["cap"]),
            "captured_p10": quantile(s["cap"], 0.10),
            "captured_min": min(s["cap"]),
            "out_err_mean": sum(s["err"]) / len(s["err"]),
            "needle_lists": nl,
            "needle_dropped": s["needle_drop"],
            "needle_dropped_pct": 100.0 * s["needle_drop"] / nl if nl else math.nan,
            "needle_drop_share_max": s["drop_share_max"],
            "prompts_with_drop": sorted(s["prompts_with_drop"]),
            "drops_by_layer_head": dict(sorted(s["drops"].items(), key=lambda kv: -kv[1])),
        }
        if s["refined"]:
            row["stage2_fraction_mean"] = sum(s["refined"]) / len(s["refined"])
            row["stage2_fraction_p90"] = quantile(s["refined"], 0.90)
            row["stage2_outside_list_mean"] = sum(s["refined_out"]) / len(s["refined_out"])
        oracle = stats.get(("oracle", gamma))
        if oracle is not None:
            row["kept_x_oracle"] = row["kept_mean"] / (sum(oracle["kept"]) / len(oracle["kept"]))
            row["err_x_oracle"] = row["out_err_mean"] / (sum(oracle["err"]) / len(oracle["err"]))
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (what docs/estimator.md shows)."""
    out = ["| estimator | γ | reads (× oracle) | captured p10 | error (× oracle) | needle "
           "dropped / lists (%) | stage-2 pages |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        stage2 = f"{r['stage2_fraction_mean']:.3f}" if "stage2_fraction_mean" in r else "—"
        out.append(
            f"| {r['estimator']} | {r['gamma']} | {r['kept_mean']:.3f} "
            f"({r.get('kept_x_oracle', math.nan):.2f}) | {r['captured_p10']:.3f} | "
            f"{r['out_err_mean']:.4f} ({r.get('err_x_oracle', math.nan):.2f}) | "
            f"{r['needle_dropped']}/{r['needle_lists']} ({r['needle_dropped_pct']:.1f}) | "
            f"{stage2} |"
        )
    return "\n".join(out)


def write_png(path: Path, grid: torch.Tensor, cell: int = 12) -> None:
    """Tiny dependency-free PNG heat map (rows = layers, cols = KV heads), viridis-like."""
    import struct
    import zlib

    stops = torch.tensor(
        [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
        dtype=torch.float32,
    )
    rows_px = []
    for r in range(grid.shape[0]):
        line = bytearray()
        for c in range(grid.shape[1]):
            v = float(grid[r, c]) * (len(stops) - 1)
            i = min(int(v), len(stops) - 2)
            f = v - i
            rgb = (stops[i] * (1 - f) + stops[i + 1] * f).round().to(torch.uint8).tolist()
            line += bytes(rgb) * cell
        rows_px += [bytes(line)] * cell
    w, h = grid.shape[1] * cell, grid.shape[0] * cell
    raw = b"".join(b"\x00" + row for row in rows_px)

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


def cv(xs: torch.Tensor) -> float:
    return float(xs.std() / xs.mean()) if xs.numel() > 1 and xs.mean() > 0 else math.nan


def model_label(spec) -> str:
    """The record's "model": the weights as prepare_model.py makes them (a GGUF dequantized
    to bf16) and as they run here, e.g. "SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16 -> fp32,
    CPU)"; the quantization is the GGUF file name's suffix, when it has one."""
    quant = spec.gguf_name.removesuffix(".gguf").removeprefix(spec.name).lstrip(".")
    return f"{spec.name} ({' '.join(filter(None, ('GGUF', quant)))} -> bf16 -> fp32, CPU)"


def add_prompt_arguments(ap: argparse.ArgumentParser, prepare, default_task: str) -> None:
    """--model, --contexts, --haystacks and --tasks: which captured prompts a probe reads
    (this study's and ``estimator_errors.py``'s)."""
    ap.add_argument("--model", default=prepare.DEFAULT_MODEL, choices=sorted(prepare.MODELS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--haystacks", nargs="+", default=["essays"], choices=sorted(D.HAYSTACKS))
    ap.add_argument("--tasks", nargs="+", default=[default_task], choices=TASKS)


def main() -> None:
    prepare = _prepare_module()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_arguments(ap, prepare, "needle_mid")
    ap.add_argument("--prompts", type=int, default=1, help="seeds per (context, haystack, task)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seeds first-seed .. first-seed + prompts - 1: other needles and "
                    "haystack stretches than seed 0's, for held-out prompts")  # fmt: skip
    ap.add_argument("--last-k", type=int, default=16, help="teacher-forced rows per prompt")
    ap.add_argument("--estimators", nargs="+", default=ESTIMATORS)
    ap.add_argument("--gammas", type=float, nargs="+", default=GAMMAS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--warmup-rows", type=int, default=0, help="rows per prompt run but not counted"
    )
    ap.add_argument("--heatmaps", action="store_true",
                    help="write kept-fraction heat maps (gamma 0.98) to docs/img/")  # fmt: skip
    ap.add_argument(
        "--out", default=str(REPO / "benchmarks/results/estimator/estimator_study.json")
    )
    args = ap.parse_args()
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    weights: list = []  # (tokenizer, model): loaded only when a prompt has no capture yet

    def tok_and_model() -> list:
        if not weights:
            weights.extend(
                H.load_model(prepare.prepare(model=args.model), threads=args.threads or None)
            )
        return weights

    results, captures = [], []
    heat_all: dict | None = {} if args.heatmaps else None
    runs = [(c, hay, task, seed) for c in args.contexts for hay in args.haystacks
            for task in args.tasks
            for seed in range(args.first_seed, args.first_seed + args.prompts)]  # fmt: skip
    stats_by_ctx: dict = {}
    for j, (ctx, hay, task, seed) in enumerate(runs):
        label = f"{task}/{hay}/{ctx}/s{seed}"
        cached = cache_path(args.model, task, hay, ctx, seed, args.last_k).is_file()
        tok, model = (None, None) if cached else tok_and_model()
        blob = capture(tok, model, args.model, ctx, seed, args.last_k, task, hay)
        # the softmax scale 1 / sqrt(head dim), from the captured queries [H_q, K, D]: the
        # same as the config's (Qwen2's config has no head_dim; hidden_size / query heads)
        scale = next(iter(blob["layers"].values()))["q"].shape[-1] ** -0.5
        captures.append(
            {
                "prompt": label,
                "tokens": blob["seq_len"],
                "needle_spans": [list(x) for x in blob["needle_spans"]],
                "forward_s": round(blob["forward_s"], 1),
            }
        )
        t0 = time.time()
        stats = stats_by_ctx.setdefault(ctx, {})
        analyse(blob, scale, args.estimators, args.gammas, stats, label, heat_all,
                args.warmup_rows)  # fmt: skip
        print(f"[analyse {j + 1}/{len(runs)}] {label}: {time.time() - t0:.1f}s "
              f"(total {time.time() - t_start:.0f}s)", flush=True)  # fmt: skip
    for ctx, stats in stats_by_ctx.items():
        for row in summarize(stats):
            row["context"] = ctx
            results.append(row)
        print(f"context {ctx}:\n" + table([r for r in results if r["context"] == ctx]))
    out = {
        "command": "python -m benchmarks.probes.estimator_study "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("out", "heatmaps")
        )
        + (" --heatmaps" if args.heatmaps else ""),
        "model": model_label(prepare.MODELS[args.model]),
        "needle_share_threshold": NEEDLE_SHARE,
        "captures": captures,
        "rows": results,
        "seconds": round(time.time() - t_start, 1),
    }
    if heat_all is not None:
        out["kept_fraction_variation_gamma_0.98"] = heat_maps(
            tok_and_model()[1].config, heat_all, args
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({time.time() - t_start:.0f}s)")


def heat_maps(config, heat_all: dict, args) -> dict:
    """Heat maps (docs/img/) and CV of the kept fraction per (layer, KV head) at gamma 0.98."""
    n_layers = config.num_hidden_layers
    h_kv = config.num_key_value_heads
    variation = {}
    for est in ("oracle", "mvar", "mvar_top4", "mvar_top2"):
        if est not in args.estimators:
            continue
        grid = torch.zeros(n_layers, h_kv)
        per_step = []
        for layer in range(n_layers):
            for h in range(h_kv):
                vals = torch.tensor(heat_all.get((est, 0.98, layer, h), [math.nan]))
                grid[layer, h] = vals.mean()
                per_step.append(cv(vals))
        # SmolLM2's maps keep their published names; another model's get its key.
        tag = "" if args.model == "smollm2-135m" else f"_{args.model}"
        write_png(REPO / f"docs/img/kept_fraction{tag}_{est}_g098.png", grid)
        variation[est] = {
            "kept_per_layer_head": [[round(float(x), 4) for x in r] for r in grid],
            "cv_across_layers": cv(grid.mean(1)),
            "cv_across_heads_within_layer_mean": float(
                torch.tensor([cv(r) for r in grid]).nanmean()
            ),
            "cv_across_steps_mean": float(torch.tensor(per_step).nanmean()),
        }
    return variation


if __name__ == "__main__":
    main()
