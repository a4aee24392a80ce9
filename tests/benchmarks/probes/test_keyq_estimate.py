# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/keyq_estimate.py: the 4-bit centered key copy's writer, its float32
reference against the study's estimator, and the Triton kernel against the reference (CPU,
under the Triton interpreter)."""

from __future__ import annotations

import torch
from _load import load

keyq = load("probes.keyq_estimate")
research = load("probes.research_estimators")

PAGE = 64


def _batch(seed=0, blocks=7, num_kv_heads=2, group=3, head_size=32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, num_kv_heads, PAGE, head_size, generator=gen)
    keys[..., :2] += 6.0  # outlier channels: their offset must cost no levels
    query = torch.randn(2, num_kv_heads * group, head_size, generator=gen).bfloat16()
    table = torch.tensor([[4, 1, 6, 0], [2, 5, 3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([3 * PAGE + 10, 2 * PAGE], dtype=torch.int32)
    return keys, query, table, seq_lens


def test_packed_codes_round_trip_and_match_the_studys_rounding():
    keys, query, table, seq_lens = _batch()
    codes, scales, means = keyq.quantize_key_pages(keys, torch.float32)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == keys.shape[-1] // 2
    unpacked = keyq.unpack_codes(codes).float()
    assert unpacked.abs().max() <= keyq.LEVELS
    rebuilt = unpacked * scales.unsqueeze(2) + means.unsqueeze(2)
    # per page: the same log-masses as the study's keyq4c on the same keys
    scale = keys.shape[-1] ** -0.5
    for row in range(2):
        for page in range(int(seq_lens[row]) // PAGE):
            block = int(table[row, page])
            x = query[row].float().view(keys.shape[1], -1, keys.shape[-1]) * scale
            ours = torch.logsumexp(torch.einsum("hgd,htd->hgt", x, rebuilt[block]), dim=-1)
            study = research.quantized_key_logmass(query[row], keys[block : block + 1], scale,
                                                   4, centered=True)[..., 0]  # fmt: skip
            torch.testing.assert_close(ours, study, atol=1e-4, rtol=1e-5)


def test_kernel_matches_the_reference_on_full_pages_only():
    keys, query, table, seq_lens = _batch(seed=1)
    codes, scales, means = keyq.quantize_key_pages(keys, torch.float16)
    scale = keys.shape[-1] ** -0.5
    logmass = torch.full((2, keys.shape[1], 3, table.shape[1]), float("-inf"))
    reference = keyq.keyq_logmass_reference(query, codes, scales, means, table, seq_lens, scale)
    full = torch.isfinite(reference)
    assert full.sum() == (3 + 2) * keys.shape[1] * 3  # row 0: 3 full pages, row 1: 2
    # The default launch (one tile covers a row), tiles that split a row's pages with a
    # partial last tile, and one page per tile.
    for launch in (keyq.KEYQ_LAUNCH, (2, 1, 2, 4), (1, 2, 1, 4)):
        logmass = torch.full((2, keys.shape[1], 3, table.shape[1]), float("-inf"))
        keyq.keyq_estimate(query, codes, scales, means, table, seq_lens, logmass, scale,
                           launch=launch)  # fmt: skip
        torch.testing.assert_close(logmass[full], reference[full], atol=1e-5, rtol=1e-5)
        assert torch.isinf(logmass[~full]).all()  # partial and unused pages untouched
