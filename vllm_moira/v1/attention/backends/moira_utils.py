# SPDX-License-Identifier: Apache-2.0
"""Helpers on vLLM's attention metadata for the Moira builder.

The builder gives FA3 the rows after the decode rows (decode rows come first
in the batch) as a ``CommonAttentionMetadata`` of their own, so FA3 never sees
the decode rows. Nothing here is specific to Moira's kernels; upstream it could
move to ``v1/attention/backends/utils.py``.

Installed as ``vllm.v1.attention.backends.moira_utils`` on the patched build;
imported as ``vllm_moira.v1.attention.backends.moira_utils`` in plugin mode.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata


def _sliced_request_extras(cam: CommonAttentionMetadata, rows: Any) -> dict[str, Any]:
    """The prefill rows' per-request extras (patch 0005's field), or nothing on a
    stock vLLM, whose metadata has no such field."""
    if not hasattr(cam, "attn_request_extras"):
        return {}
    extras = cam.attn_request_extras
    return {
        "attn_request_extras": None
        if extras is None
        else {key: rows(values) for key, values in extras.items()}
    }


def slice_prefill_common_metadata(
    cam: CommonAttentionMetadata,
    num_decodes: int,
    num_decode_tokens: int,
) -> CommonAttentionMetadata:
    """The CommonAttentionMetadata of the rows after the decode rows.

    Runs in eager (mixed) steps only, so the small new tensors it creates
    (query_start_loc rebased to 0) are fine. Uses CPU copies for every
    Python-side value: no device sync.
    """
    nd, ndt = num_decodes, num_decode_tokens
    num_reqs = cam.num_reqs - nd
    num_tokens = cam.num_actual_tokens - ndt
    qsl_cpu = cam.query_start_loc_cpu[nd : cam.num_reqs + 1] - ndt
    seq_ub = cam.seq_lens_cpu_upper_bound
    if seq_ub is not None:
        seq_ub = seq_ub[nd : cam.num_reqs]
        max_seq_len = int(seq_ub.max()) if num_reqs > 0 else 0
    else:
        # No CPU upper bound: the whole-batch maximum is a safe bound for FA.
        max_seq_len = cam.max_seq_len
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    max_query_len = int(query_lens.max()) if num_reqs > 0 else 0

    def rows(t: Any) -> Any:
        return None if t is None else t[nd : cam.num_reqs]

    causal = cam.causal
    if isinstance(causal, torch.Tensor) and causal.dim() > 0:
        causal = causal[nd : cam.num_reqs]
    return cam.replace(
        query_start_loc=cam.query_start_loc[nd : cam.num_reqs + 1] - ndt,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=cam.seq_lens[nd : cam.num_reqs],
        seq_lens_cpu_upper_bound=seq_ub,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_table_tensor=cam.block_table_tensor[nd : cam.num_reqs],
        slot_mapping=cam.slot_mapping[ndt : ndt + num_tokens],
        causal=causal,
        is_prefilling=rows(cam.is_prefilling),
        positions=None if cam.positions is None else cam.positions[ndt:],
        req_idx=None if cam.req_idx is None else cam.req_idx[nd : cam.num_reqs],
        **_sliced_request_extras(cam, rows),
        logits_indices_padded=None,
        num_logits_indices=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
