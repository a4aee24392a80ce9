"""The MOIRA builder loads each decode row's moira_gamma into workspace.row_gamma (CPU).

The runner (patch 0005) passes the batch's values in
CommonAttentionMetadata.attn_request_extras["moira_gamma"]; 0 means the server's gamma.
"""

from __future__ import annotations

import pytest
import torch

from tests.v1.attention.moira_backend_utils import (
    make_vllm_config,
    moira_module,
    write_tiny_llama,
)
from tests.v1.attention.test_moira_backend import _cam, _spec

KEY = "moira_gamma"


pytestmark = pytest.mark.usefixtures("clean_moira_env")


@pytest.fixture()
def builder(tmp_path):
    from vllm.config import set_current_vllm_config

    cfg = make_vllm_config(write_tiny_llama(tmp_path / "m"))
    with set_current_vllm_config(cfg):
        return moira_module().MoiraMetadataBuilder(
            _spec(cfg), ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu")
        )


def _with_gamma(cam, values):
    cam.attn_request_extras = {KEY: torch.tensor(values, dtype=torch.float32)}
    return cam


def test_decode_rows_get_their_gamma_and_the_rest_is_reset(builder):
    ws = builder.workspace
    address = ws.row_gamma.data_ptr()
    # Eight decode rows fill the buffer (max_num_seqs = 8) ...
    builder.build(0, _with_gamma(_cam([1] * 8, [100] * 8), [0.5] * 8))
    assert ws.row_gamma.tolist() == [0.5] * 8
    # ... then 3 decode rows and 2 prefill rows: only decode rows are loaded.
    cam = _with_gamma(_cam([1, 1, 1, 5, 7], [100, 200, 70, 5, 40]), [0.9, 0.0, 1.0, 0.6, 0.7])
    md = builder.build(0, cam)
    assert md.num_decodes == 3
    assert ws.row_gamma.tolist() == pytest.approx([0.9, 0.0, 1.0, 0, 0, 0, 0, 0])
    assert ws.row_gamma.data_ptr() == address
    assert md.workspace is ws


def test_padded_rows_use_the_server_gamma(builder):
    ws = builder.workspace
    builder.build(0, _with_gamma(_cam([1] * 4, [100] * 4), [0.7] * 4))
    # FULL-graph padding: padded rows (seq_len 0) carry the default, 0.
    builder.build(0, _with_gamma(_cam([1] * 4, [100, 64, 0, 0]), [0.8, 1.0, 0.0, 0.0]))
    assert ws.row_gamma.tolist() == pytest.approx([0.8, 1.0] + [0.0] * 6)
    # V2 gathers only the real rows: a shorter tensor leaves the padding at 0.
    builder.build(0, _with_gamma(_cam([1] * 4, [100, 64, 0, 0]), [0.95, 0.9]))
    assert ws.row_gamma.tolist() == pytest.approx([0.95, 0.9] + [0.0] * 6)


def test_no_extras_means_server_gamma_everywhere(builder):
    ws = builder.workspace
    builder.build(0, _with_gamma(_cam([1, 1], [100, 100]), [0.3, 0.4]))
    capture = _cam([1, 1, 1, 1], [1, 1, 0, 0])  # capture metadata: no requests
    assert capture.attn_request_extras is None
    builder.build_for_cudagraph_capture(capture)
    assert ws.row_gamma.tolist() == [0.0] * 8


def test_prefill_slice_keeps_the_prefill_rows_extras():
    cam = _with_gamma(_cam([1, 1, 5, 7], [100, 200, 5, 40]), [0.9, 0.8, 0.6, 0.7])
    sliced = moira_module().slice_prefill_common_metadata(cam, 2, 2)
    assert sliced.attn_request_extras[KEY].tolist() == pytest.approx([0.6, 0.7])
    cam.attn_request_extras = None
    assert moira_module().slice_prefill_common_metadata(cam, 2, 2).attn_request_extras is None
