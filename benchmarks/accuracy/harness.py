# SPDX-License-Identifier: Apache-2.0
"""CPU capture / sparse-replay harness for SmolLM2 (transformers, fp32).

A custom attention function (registered as ``"moira_harness"`` in transformers'
``AttentionInterface``) runs SDPA for every query row and, depending on the
module-level :data:`STATE`:

- **capture**: records the post-RoPE queries of the last ``K`` rows and the
  post-RoPE keys and values of the whole sequence for every layer (GQA: the
  keys/values are per KV head, before ``repeat_kv``);
- **sparse**: replaces the output of the last ``K`` rows (teacher-forced decode
  steps; with a KV cache, the single decode row) with Moira's float32
  reference sparse attention (64-token pages, per-KV-head page lists) under a
  chosen selector (see :class:`Selector`).

One forward with sparse replay of the last K rows is exactly K teacher-forced
decode steps with every layer sparse: row t's keys/values in layer l already
come from sparse attention in layers < l.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.probes import research_estimators as research
from vllm_moira.v1.attention.ops import moira_reference as ref

PAGE = ref.PAGE_SIZE
REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------
# Selectors: which pages each (row, KV head) reads
# --------------------------------------------------------------------------
@dataclass
class Selector:
    """``arm``: dense | moira | oracle | fixed_k | proportional | quest."""

    arm: str = "moira"
    gamma: float | None = 0.98
    estimator: str = "mvar"
    fixed_pages: int | None = None  # fixed_k / quest
    fraction: float | None = None  # proportional

    def label(self) -> str:
        if self.arm in ("moira",):
            return f"moira[{self.estimator}]@{self.gamma}"
        if self.arm == "oracle":
            return f"oracle@{self.gamma}"
        if self.arm in ("fixed_k", "quest"):
            return f"{self.arm}@{self.fixed_pages}"
        if self.arm == "proportional":
            return f"proportional@{self.fraction}"
        return self.arm


def page_summaries_ext(keys: torch.Tensor, n_full: int) -> torch.Tensor:
    """4-slot summaries ``[n_full, H, 4, D]`` of the full pages of ``keys [H, T, D]``."""
    h, _, d = keys.shape
    pages = keys[:, : n_full * PAGE].reshape(h, n_full, PAGE, d).permute(1, 0, 2, 3).float()
    mean = pages.mean(2)
    var = ((pages - mean.unsqueeze(2)) ** 2).mean(2)
    return torch.stack([mean, var, pages.amin(2), pages.amax(2)], dim=2)


def page_summaries_for(keys: torch.Tensor, n_full: int, estimator: str) -> torch.Tensor:
    """Summaries an estimator reads: ``mvar_top{r}`` layout ``[n_full, H, 2 + r, D]``,
    else the 4-slot ext layout (slots 0-1 = the paper's mean/var). ``int8:`` / ``int4:`` /
    ``bf16:`` before the name (e.g. ``int8:mvar_top8``, the backend's default): the summaries as
    that storage gives them back to Estimate (``ref.stored_summaries``)."""
    estimator, storage = ref.parse_stored_estimator(estimator)
    if storage == "int4" and estimator not in ref.TOP_ESTIMATORS:
        raise ValueError(f"int4 summaries store the keys of {sorted(ref.TOP_ESTIMATORS)}, "
                         f"not {estimator!r}")  # fmt: skip
    if estimator in ref.TOP_ESTIMATORS:
        h, _, d = keys.shape
        pages = keys[:, : n_full * PAGE].reshape(h, n_full, PAGE, d).permute(1, 0, 2, 3)
        summaries = ref.summarize_key_pages_top(pages, ref.TOP_ESTIMATORS[estimator])
    else:
        summaries = page_summaries_ext(keys, n_full)
    return summaries if storage is None else ref.stored_summaries(summaries, storage)


def estimate_logmass(
    query: torch.Tensor,
    keys: torch.Tensor,
    seq_len: int,
    scale: float,
    estimator: str,
    summaries: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(estimated, exact) log-masses ``[H, G, n]`` of one row, sink/current exact.

    Same math as ``ref.estimate_row_logmass`` without the paged cache
    (``summaries`` covers at least the row's full pages).
    """
    n = ref.num_pages(seq_len)
    if exact is None:
        exact = ref.exact_page_logmass(query, keys[:, :seq_len], seq_len, scale)
    if estimator == "oracle" or n <= 2:
        return exact.clone(), exact
    if summaries is None:
        summaries = page_summaries_for(keys, seq_len // PAGE, estimator)
    estimator, _ = ref.parse_stored_estimator(estimator)  # storage: in the summaries
    summ = summaries[:n]
    if summ.shape[0] < n:  # current page partial: pad (overwritten below)
        summ = torch.cat([summ, summ[-1:].expand(n - summ.shape[0], -1, -1, -1)])
    if estimator == "mvar":
        est = ref.mvar_page_logmass(query, summ[:, :, :2], scale)
    elif estimator == "mvar_rem":
        est = ref.rem_page_logmass(query, summ[:, :, :2], scale)
    elif estimator in ref.TOP_ESTIMATORS:
        est = ref.top_page_logmass(query, summ, scale)
    elif ":" in estimator:
        est = _param_estimator(query, summ, scale, estimator)
    else:
        est = research.robust_page_logmass(query, summ, scale, estimator)
    est[..., 0] = exact[..., 0]
    est[..., n - 1] = exact[..., n - 1]
    return est, exact


def _param_estimator(query, summ, scale, name):
    """Exploration-only parametrised estimators (``ext:delta``, ``vscale:alpha``)."""
    kind, val = name.split(":")
    val = float(val)
    mvar = ref.mvar_page_logmass(query, summ[:, :, :2], scale)
    if kind == "ext":  # mvar plus one key at the box's max-logit bound, minus delta
        box_max = research.box_max_logit(query, summ[:, :, 2:4], scale)
        return torch.logaddexp(mvar, box_max - val)
    if kind == "vscale":  # variance term scaled by alpha
        base = ref.mvar_page_logmass(
            query, torch.stack([summ[:, :, 0], summ[:, :, 1] * 0], 2), scale
        )
        return base + val * (mvar - base)
    raise ValueError(name)


def select_lists(sel: Selector, est: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Page list per KV head from estimated log-masses ``[H, G, n]``."""
    n = est.shape[-1]
    h_kv = est.shape[0]
    if sel.arm == "dense" or (sel.arm in ("moira", "oracle") and (sel.gamma or 1) >= 1):
        return [torch.arange(n, dtype=torch.int32)] * h_kv
    if sel.arm == "quest":
        # Quest-style: group-max of the box bound, fixed page count per KV head
        score = est.max(dim=1).values  # [H, n]
        return [ref.select_pages(score[h], fixed_pages=sel.fixed_pages) for h in range(h_kv)]
    pibar = ref.group_mean_shares(est)
    if sel.arm == "fixed_k":
        return [ref.select_pages(pibar[h], fixed_pages=sel.fixed_pages) for h in range(h_kv)]
    if sel.arm == "proportional":
        k = max(2, math.ceil(float(sel.fraction) * n))
        return [ref.select_pages(pibar[h], fixed_pages=k) for h in range(h_kv)]
    return [ref.select_pages(pibar[h], gamma=float(sel.gamma)) for h in range(h_kv)]


def estimator_for(sel: Selector) -> str:
    if sel.arm == "oracle":
        return "oracle"
    if sel.arm == "quest":
        return "box"
    return sel.estimator


def sparse_row(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_len: int,
    scale: float,
    sel: Selector,
    summaries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output ``[H_q, D]`` and page lists of one decode row over ``keys[:, :seq_len]``."""
    if sel.arm == "dense":
        n = ref.num_pages(seq_len)
        lists = [torch.arange(n, dtype=torch.int32)] * keys.shape[0]
    else:
        est, _ = estimate_logmass(query, keys, seq_len, scale, estimator_for(sel), summaries)
        lists = select_lists(sel, est, seq_len)
    out, _ = ref.attend_pages(query, keys[:, :seq_len], values[:, :seq_len], lists, seq_len, scale)
    return out, lists


# --------------------------------------------------------------------------
# The attention function and its state
# --------------------------------------------------------------------------
@dataclass
class HarnessState:
    mode: str = "off"  # off | capture | sparse
    last_k: int = 1
    selector: Selector = field(default_factory=Selector)
    captured: dict = field(default_factory=dict)  # layer -> dict(q, k, v)
    reads: list = field(default_factory=list)  # (layer, pos, head, kept, n)


STATE = HarnessState()


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )  # [B, T, Hq, D]
    st = STATE
    if st.mode == "off" or query.shape[0] != 1:
        return out, None
    layer = module.layer_idx
    t_q, t_k = query.shape[2], key.shape[2]
    k_rows = min(st.last_k, t_q)
    if st.mode == "capture":
        st.captured[layer] = {
            "q": query[0, :, t_q - k_rows :].detach().to(torch.float16).clone(),
            "k": key[0].detach().to(torch.float16).clone(),
            "v": value[0].detach().to(torch.float16).clone(),
        }
        return out, None
    # sparse: rows t_q - k_rows .. t_q - 1 sit at absolute positions t_k - k_rows .. t_k - 1
    keys = key[0].float()
    vals = value[0].float()
    summaries = None
    if st.selector.arm != "dense" and estimator_for(st.selector) != "oracle":
        summaries = page_summaries_for(keys, t_k // PAGE, estimator_for(st.selector))
    out = out.clone()
    for i in range(k_rows):
        pos = t_k - k_rows + i
        seq_len = pos + 1
        q = query[0, :, t_q - k_rows + i].float()
        o, lists = sparse_row(q, keys, vals, seq_len, scaling, st.selector, summaries)
        out[0, t_q - k_rows + i] = o.to(out.dtype)
        n = ref.num_pages(seq_len)
        for h, lst in enumerate(lists):
            st.reads.append((layer, pos, h, int(lst.numel()), n))
    return out, None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("moira_harness", _attention)
    # Without a registered mask function transformers builds no mask for a custom attention
    # name, and SDPA's is_causal is top-left aligned: several query rows on top of a KV cache
    # (forced_logits) would then see only the first keys. Use SDPA's own mask.
    AttentionMaskInterface.register("moira_harness", sdpa_mask)
    return "moira_harness"


def load_model(model_dir: str | Path | None = None, threads: int | None = None):
    """fp32 SmolLM2 with the harness attention; prepares the model if missing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir or DEFAULT_MODEL_DIR)
    if not (model_dir / "config.json").is_file():
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "prepare_model", REPO / "scripts" / "prepare_model.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.prepare(model_dir)
    if threads:
        torch.set_num_threads(threads)
    name = register()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=name
    )
    model.eval()
    return tok, model


def chat_ids(tok, user_text: str, answer_prefix: str = "") -> torch.Tensor:
    msgs = [{"role": "user", "content": user_text}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok(text + answer_prefix, return_tensors="pt", add_special_tokens=False)["input_ids"]


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor, mode: str, last_k: int, selector=None):
    """Logits ``[last_k, V]`` of the last rows under ``mode`` (off/capture/sparse)."""
    STATE.mode, STATE.last_k = mode, last_k
    STATE.captured, STATE.reads = {}, []
    if selector is not None:
        STATE.selector = selector
    try:
        out = model(input_ids=ids, use_cache=False, logits_to_keep=last_k)
    finally:
        STATE.mode = "off"
    return out.logits[0].float()


@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """Dense prefill: (KV cache, first greedy token). Shared by every arm of a document."""
    from transformers import DynamicCache

    cache = DynamicCache()
    STATE.mode = "off"
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, int(out.logits[0, -1].argmax())


@torch.no_grad()
def generate_from(model, cache, first: int, max_new: int, selector: Selector, stop_ids=()):
    """Greedy decode from a prefilled ``cache`` (copied, left untouched) and its first
    token: every decode step sparse in every layer."""
    cache = copy.deepcopy(cache)
    nxt = first
    toks = [nxt]
    STATE.reads = []
    STATE.selector, STATE.last_k = selector, 1
    try:
        for _ in range(max_new - 1):
            if nxt in stop_ids:
                break
            STATE.mode = "sparse" if selector.arm != "dense" else "off"
            out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            toks.append(nxt)
    finally:
        STATE.mode = "off"
    return toks


@torch.no_grad()
def generate(model, ids: torch.Tensor, max_new: int, selector: Selector, stop_ids=()):
    """Greedy decode: dense prefill, then every decode step sparse in every layer."""
    cache, first = prefill(model, ids)
    return generate_from(model, cache, first, max_new, selector, stop_ids)


@torch.no_grad()
def forced_logits(model, cache, tokens: list[int], mode: str, selector=None) -> torch.Tensor:
    """Logits ``[len(tokens), V]`` of ``tokens`` teacher-forced after a prefilled ``cache``
    (copied), every row sparse in every layer under ``mode="sparse"``. Same rows and
    positions as :func:`forward_logits` on ``ids + tokens`` with ``last_k=len(tokens)``,
    without recomputing the prompt."""
    cache = copy.deepcopy(cache)
    STATE.mode, STATE.last_k = mode, len(tokens)
    STATE.captured, STATE.reads = {}, []
    if selector is not None:
        STATE.selector = selector
    try:
        out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    finally:
        STATE.mode = "off"
    return out.logits[0].float()


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, p = dense."""
    lp = torch.log_softmax(logits_p.double(), -1)
    lq = torch.log_softmax(logits_q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)
