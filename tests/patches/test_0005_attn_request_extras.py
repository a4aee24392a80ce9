"""Patch 0005: per-request attention-backend knobs from SamplingParams.extra_args (CPU).

The backend declares keys and defaults, the frontend validates them, both model
runners keep one value per request and pass the batch's values to the metadata
builders in CommonAttentionMetadata.attn_request_extras.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.v1.attention.moira_backend_utils import make_vllm_config, write_tiny_llama

KEY = "moira_gamma"


def _params(**extra_args):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=4, extra_args=extra_args or None)


# ---------------------------------------------------------------- backend API
def test_backends_declare_nothing_by_default():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    assert FlashAttentionBackend.get_request_extras() == {}
    FlashAttentionBackend.validate_request_extras({KEY: "anything"})  # not its key


@pytest.mark.parametrize("value", [0.9, 1.0, 1, 1e-6])
def test_moira_accepts_gamma_in_range(value):
    from vllm.v1.attention.backends.moira import MoiraBackend

    assert MoiraBackend.get_request_extras() == {KEY: 0.0}
    MoiraBackend.validate_request_extras({KEY: value, "other_plugin_arg": "x"})
    MoiraBackend.validate_request_extras({})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1.5, r"moira_gamma must be in \(0, 1\]"),
        (0, r"moira_gamma must be in \(0, 1\]"),
        (-0.2, r"moira_gamma must be in \(0, 1\]"),
        ("0.9", "moira_gamma must be a finite number"),
        (True, "moira_gamma must be a finite number"),
        (None, "moira_gamma must be a finite number"),
        (math.nan, "moira_gamma must be a finite number"),
        (math.inf, "moira_gamma must be a finite number"),
    ],
)
def test_moira_rejects_bad_gamma_naming_the_key(value, message):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.attention.backends.moira import MoiraBackend

    with pytest.raises(VLLMValidationError, match=message) as info:
        MoiraBackend.validate_request_extras({KEY: value})
    assert info.value.parameter == KEY


def test_moira_rejects_gamma_on_a_fixed_count_server(monkeypatch):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.attention.backends.moira import MoiraBackend

    monkeypatch.setenv("MOIRA_SELECTOR", "fixed")
    monkeypatch.setenv("MOIRA_FIXED_FRACTION", "0.3")
    with pytest.raises(VLLMValidationError, match="coverage selector only") as info:
        MoiraBackend.validate_request_extras({KEY: 0.9})
    assert info.value.parameter == KEY
    MoiraBackend.validate_request_extras({})  # no gamma: nothing to ignore
    monkeypatch.setenv("MOIRA_SELECTOR", "coverage")
    monkeypatch.delenv("MOIRA_FIXED_FRACTION")
    MoiraBackend.validate_request_extras({KEY: 0.9})


def test_validation_error_is_an_http_400_naming_the_parameter():
    from http import HTTPStatus

    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.attention.backends.moira import MoiraBackend

    with pytest.raises(VLLMValidationError) as info:
        MoiraBackend.validate_request_extras({KEY: 1.5})
    error = create_error_response(info.value).error
    assert error.code == HTTPStatus.BAD_REQUEST
    assert error.param == KEY
    assert "(0, 1]" in error.message


def test_openai_vllm_xargs_reach_extra_args():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest(model="m", prompt="hi", vllm_xargs={KEY: 0.9})
    params = request.to_sampling_params(max_tokens=4, default_sampling_params={})
    assert params.extra_args[KEY] == 0.9


# ---------------------------------------------------------------- frontend
def _input_processor(cfg):
    from vllm.v1.engine.input_processor import InputProcessor

    return InputProcessor(cfg)


def test_frontend_rejects_bad_gamma_for_configured_moira(tiny_model):
    from vllm.exceptions import VLLMValidationError

    processor = _input_processor(make_vllm_config(tiny_model))
    tasks = ("generate",)
    processor._validate_params(_params(moira_gamma=0.9), tasks)
    processor._validate_params(_params(), tasks)
    with pytest.raises(VLLMValidationError, match=r"moira_gamma must be in \(0, 1\]"):
        processor._validate_params(_params(moira_gamma=1.5), tasks)
    assert "attn_backends_with_request_extras" in inspect.getsource(
        type(processor)._validate_params
    )


def test_frontend_sees_moira_selected_by_env(tiny_model, monkeypatch):
    from vllm.exceptions import VLLMValidationError

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "MOIRA")
    processor = _input_processor(make_vllm_config(tiny_model, attention_backend=None))
    with pytest.raises(VLLMValidationError, match="moira_gamma"):
        processor._validate_params(_params(moira_gamma=0.0), ("generate",))


def test_frontend_ignores_the_key_for_other_backends(tiny_model, monkeypatch):
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    for backend in ("FLASH_ATTN", None):
        cfg = make_vllm_config(tiny_model, attention_backend=backend)
        processor = _input_processor(cfg)
        assert processor.attn_backends_with_request_extras == []
        processor._validate_params(_params(moira_gamma=1.5), ("generate",))


# ---------------------------------------------------------------- shared helpers
def test_defaults_merge_and_conflict():
    from vllm.v1.worker.utils import get_attn_request_extras_defaults

    def group(extras):
        backend = type("B", (), {"get_request_extras": classmethod(lambda cls: extras)})
        return SimpleNamespace(backend=backend)

    groups = [group({KEY: 0.0}), group({}), group({KEY: 0.0, "x": 2})]
    assert get_attn_request_extras_defaults(groups) == {KEY: 0.0, "x": 2.0}
    with pytest.raises(ValueError, match="different defaults for the request extra 'x'"):
        get_attn_request_extras_defaults([group({"x": 1.0}), group({"x": 2.0})])


def test_values_fall_back_to_default_when_not_numbers():
    from vllm.v1.worker.utils import get_attn_request_extra_values

    defaults = {KEY: 0.0, "x": 2.0}
    assert get_attn_request_extra_values(None, defaults) == [0.0, 2.0]
    assert get_attn_request_extra_values({KEY: 0.5, "z": 1}, defaults) == [0.5, 2.0]
    assert get_attn_request_extra_values({KEY: "0.5", "x": math.nan}, defaults) == [0.0, 2.0]
    assert get_attn_request_extra_values({KEY: True, "x": 7}, defaults) == [0.0, 7.0]


def test_common_metadata_slicing_keeps_rows():
    from vllm.v1.worker.ubatch_utils import UBatchSlice, _make_metadata_with_slice

    from tests.v1.attention.test_moira_backend import _cam

    cam = _cam([1, 1, 1, 1], [70, 80, 90, 100])
    cam.attn_request_extras = {KEY: torch.tensor([0.1, 0.2, 0.3, 0.4])}
    assert cam.unpadded(3, 3).attn_request_extras[KEY].tolist() == pytest.approx([0.1, 0.2, 0.3])
    second = _make_metadata_with_slice(UBatchSlice(slice(2, 4), slice(2, 4)), cam)
    assert second.attn_request_extras[KEY].tolist() == pytest.approx([0.3, 0.4])
    cam.attn_request_extras = None
    assert cam.unpadded(3, 3).attn_request_extras is None


# ---------------------------------------------------------------- V1 runner
def _v1_batch(max_num_reqs=6):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=256,
        max_num_batched_tokens=512,
        device=torch.device("cpu"),
        vocab_size=100,
        block_sizes=[64],
        kernel_block_sizes=[64],
        max_num_blocks_per_req=[4],
    )


def _v1_request(name, **extra_args):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id=name,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=_params(**extra_args),
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


def _column(batch):
    return {rid: float(batch.attn_request_extras[0, i]) for i, rid in enumerate(batch.req_ids)}


def test_v1_input_batch_keeps_and_moves_the_column():
    batch = _v1_batch()
    batch.configure_attn_request_extras({KEY: 0.0})
    for name, gamma in [("a", 0.9), ("b", None), ("c", 1.0), ("d", 0.5)]:
        batch.add_request(_v1_request(name, **({} if gamma is None else {KEY: gamma})))
    assert _column(batch) == pytest.approx({"a": 0.9, "b": 0.0, "c": 1.0, "d": 0.5})
    batch.swap_states(0, 3)  # e.g. the decode-first reorder
    assert batch.req_ids == ["d", "b", "c", "a"]
    assert _column(batch) == pytest.approx({"a": 0.9, "b": 0.0, "c": 1.0, "d": 0.5})
    batch.remove_request("b")
    batch.condense()  # "a" moves into the hole
    assert batch.req_ids == ["d", "a", "c"]
    assert _column(batch) == pytest.approx({"a": 0.9, "c": 1.0, "d": 0.5})
    batch.add_request(_v1_request("e"))  # reuses a freed slot: the default again
    assert _column(batch)["e"] == 0.0


def test_v1_input_batch_without_declared_keys_is_unchanged():
    batch = _v1_batch()
    batch.add_request(_v1_request("a", moira_gamma=0.9))
    batch.add_request(_v1_request("b"))
    batch.swap_states(0, 1)
    assert batch.attn_request_extras.shape == (0, 6)


def _v1_runner_stub(defaults, batch):
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(
        max_num_reqs=batch.max_num_reqs,
        input_batch=batch,
        attn_request_extras_defaults={},
        attn_request_extras=None,
        _attn_group_iterator=lambda: [],
    )
    runner._make_buffer = lambda *size, dtype: CpuGpuBuffer(
        *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False
    )
    groups = [SimpleNamespace(backend=type("B", (), {"get_request_extras": classmethod(
        lambda cls: dict(defaults))}))]  # fmt: skip
    runner._attn_group_iterator = lambda: iter(groups)
    GPUModelRunner._init_attn_request_extras(runner)
    return runner, GPUModelRunner._prepare_attn_request_extras


def test_v1_runner_stages_rows_and_pads_with_defaults():
    batch = _v1_batch()
    runner, prepare = _v1_runner_stub({KEY: 0.0, "x": 2.0}, batch)
    assert batch.attn_request_extras_defaults == {KEY: 0.0, "x": 2.0}
    batch.add_request(_v1_request("a", moira_gamma=0.9, x=5))
    batch.add_request(_v1_request("b", moira_gamma=1.0))
    batch.add_request(_v1_request("c"))
    extras = prepare(runner, 3, 5)
    assert list(extras) == [KEY, "x"]
    assert extras[KEY].tolist() == pytest.approx([0.9, 1.0, 0.0, 0.0, 0.0])
    assert extras["x"].tolist() == pytest.approx([5.0, 2.0, 2.0, 2.0, 2.0])
    # Views of one persistent device buffer: fixed addresses every step.
    assert extras[KEY].data_ptr() == runner.attn_request_extras.gpu.data_ptr()
    # Capture / dummy batches: no real rows, every row gets the defaults.
    extras = prepare(runner, 0, 4)
    assert extras[KEY].tolist() == [0.0] * 4 and extras["x"].tolist() == [2.0] * 4
    runner.attn_request_extras = None
    assert prepare(runner, 3, 3) is None


def test_v1_runner_wires_the_column():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert "self._prepare_attn_request_extras(" in build
    assert "attn_request_extras=attn_request_extras" in build
    assert "self._init_attn_request_extras()" in inspect.getsource(
        GPUModelRunner.initialize_kv_cache
    )


# ---------------------------------------------------------------- V2 runner
def test_v2_request_state_keeps_values_and_gathers_by_index(monkeypatch):
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    # No pinned memory on a CPU-only host: the explicit-copy fallback buffers.
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)

    states = RequestState(
        max_num_reqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        num_speculative_steps=0,
        vocab_size=100,
        device=torch.device("cpu"),
    )
    assert states.attn_request_extras is None
    states.configure_attn_request_extras([0.0, 2.0])
    for name, values in [("a", [0.9, 2.0]), ("b", [0.0, 3.0]), ("c", [1.0, 2.0])]:
        states.add_request(name, 3, [1, 2, 3], 0, 4, attn_request_extras=values)
    states.apply_staged_writes()
    idx = torch.tensor([states.req_id_to_index[r] for r in ("c", "a", "b")])
    gathered = states.attn_request_extras.gpu[:, idx]
    np.testing.assert_allclose(gathered.numpy(), [[1.0, 0.9, 0.0], [2.0, 2.0, 3.0]])
    states.configure_attn_request_extras([])
    assert states.attn_request_extras is None


def test_v2_runner_wires_the_table():
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.gpu.model_states import default, encoder_decoder, mamba_hybrid

    source = inspect.getsource(v2.GPUModelRunner)
    assert "self.req_states.attn_request_extras.gpu[:, idx_mapping]" in source
    assert "attn_request_extras=attn_request_extras" in source
    assert "configure_attn_request_extras(" in source
    assert "attn_request_extras=get_attn_request_extra_values(" in source
    assert "attn_request_extras=attn_request_extras" in inspect.getsource(build_attn_metadata)
    for module in (default, encoder_decoder, mamba_hybrid):
        assert "attn_request_extras=input_batch.attn_request_extras" in inspect.getsource(module)


# ------------------------------------------------------ vLLM's own runner tests
def test_build_attention_metadata_runs_on_a_mock_runner():
    # vLLM's tests/v1/attention/test_attention_splitting.py drives
    # GPUModelRunner._build_attention_metadata with a MagicMock runner (its
    # input_batch counts are mocks, not ints). The patch's call site must not do
    # arithmetic on them: it forwards num_reqs and leaves the clamp to
    # _prepare_attn_request_extras, which a backend without knobs never reaches.
    from unittest.mock import MagicMock, patch

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    num_reqs, num_reqs_padded = 3, 5
    runner = MagicMock()
    runner.kv_cache_config.kv_cache_groups = [MagicMock()]
    runner.attn_groups = [[]]
    runner.input_batch.num_computed_tokens_cpu_tensor = torch.tensor([50, 100, 200, 10, 20])
    runner.input_batch.num_prompt_tokens_cpu_tensor = torch.tensor([50, 200, 200, 100, 200])
    runner.optimistic_seq_lens_cpu = torch.tensor([100, 200, 300, 0, 0])
    runner.query_start_loc.gpu = torch.zeros(num_reqs_padded + 1, dtype=torch.int32)
    runner.query_start_loc.cpu = torch.zeros(num_reqs_padded + 1, dtype=torch.int32)
    runner.seq_lens = torch.zeros(num_reqs_padded, dtype=torch.int32)
    runner.positions = torch.zeros(num_reqs_padded, dtype=torch.int64)
    runner.routed_experts_initialized = False
    runner.use_async_spec_decode = False
    runner.dcp_world_size = 1
    runner.speculative_config = None
    runner.is_mm_prefix_lm = False
    runner._get_encoder_seq_lens.return_value = (None, None)

    built = []
    original_init = CommonAttentionMetadata.__init__

    def recording_init(self, *args, **kwargs):
        built.append(kwargs)
        original_init(self, *args, **kwargs)

    with patch.object(CommonAttentionMetadata, "__init__", recording_init):
        GPUModelRunner._build_attention_metadata(
            runner,
            num_tokens=num_reqs,
            num_reqs=num_reqs,
            max_query_len=1,
            num_tokens_padded=num_reqs_padded,
            num_reqs_padded=num_reqs_padded,
            slot_mappings={0: torch.zeros(num_reqs_padded, dtype=torch.int64)},
        )
    assert built and "attn_request_extras" in built[0]
    runner._prepare_attn_request_extras.assert_called_once_with(num_reqs, num_reqs_padded)


def test_prepare_attn_request_extras_clamps_to_the_live_requests():
    # A dummy run may count more rows than the input batch holds: those rows
    # get the defaults, like padding.
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class Buffer:
        def __init__(self):
            self.np = np.zeros((1, 6), dtype=np.float32)
            self.gpu = None

        def copy_to_gpu(self):
            self.gpu = torch.from_numpy(self.np.copy())

    runner = SimpleNamespace(
        attn_request_extras=Buffer(),
        attn_request_extras_defaults={KEY: 0.0},
        input_batch=SimpleNamespace(
            num_reqs=2, attn_request_extras=np.array([[0.9, 0.8, 0.7, 0.6]], dtype=np.float32)
        ),
    )
    extras = GPUModelRunner._prepare_attn_request_extras(runner, 4, 5)
    assert extras[KEY].tolist() == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.0])
