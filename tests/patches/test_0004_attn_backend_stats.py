"""Patch 0004: attention-backend stats from the worker to /metrics and the stats log (CPU)."""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import pytest

from tests.v1.attention.moira_backend_utils import make_vllm_config, write_tiny_llama

KEY = "moira_page_read_fraction"


@pytest.fixture()
def abs_mod():
    from vllm.v1.metrics import attn_backend_stats as mod

    mod.clear_attn_backend_stats_providers()
    yield mod
    mod.clear_attn_backend_stats_providers()


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return make_vllm_config(write_tiny_llama(tmp_path_factory.mktemp("m")))


def test_collect_merges_providers_and_skips_bad_ones(abs_mod, caplog):
    abs_mod.register_attn_backend_stats_provider(lambda: {KEY: 0.25})
    abs_mod.register_attn_backend_stats_provider(lambda: None)
    abs_mod.register_attn_backend_stats_provider(lambda: {"bad name!": 1.0, "other": 2})

    def broken():
        raise RuntimeError("boom")

    abs_mod.register_attn_backend_stats_provider(broken)
    with caplog.at_level(logging.ERROR):
        assert abs_mod.collect_attn_backend_stats() == {KEY: 0.25, "other": 2.0}


def test_attach_to_sync_output_copies_the_shared_empty_output(abs_mod):
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    assert abs_mod.attach_attn_backend_stats(EMPTY_MODEL_RUNNER_OUTPUT) is (
        EMPTY_MODEL_RUNNER_OUTPUT
    )  # no provider: unchanged
    abs_mod.register_attn_backend_stats_provider(lambda: {KEY: 0.5})
    out = abs_mod.attach_attn_backend_stats(EMPTY_MODEL_RUNNER_OUTPUT)
    assert out.attn_backend_stats == {KEY: 0.5}
    assert EMPTY_MODEL_RUNNER_OUTPUT.attn_backend_stats is None
    assert abs_mod.attach_attn_backend_stats(None) is None


def test_attach_to_async_output_sets_stats_at_get_output(abs_mod):
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    class _Async(AsyncModelRunnerOutput):
        def get_output(self):
            return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0})

    abs_mod.register_attn_backend_stats_provider(lambda: {KEY: 0.3})
    wrapped = abs_mod.attach_attn_backend_stats(_Async())
    assert isinstance(wrapped, AsyncModelRunnerOutput)
    out = wrapped.get_output()
    assert out.req_ids == ["r"] and out.attn_backend_stats == {KEY: 0.3}


def test_worker_attaches_on_both_return_paths():
    from vllm.v1.worker.gpu_worker import Worker

    assert "attach_attn_backend_stats(" in inspect.getsource(Worker.sample_tokens)
    assert "attach_attn_backend_stats(output)" in inspect.getsource(Worker.execute_model)


def test_scheduler_forwards_stats_into_scheduler_stats():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.stats import PrefixCacheStats

    fake = SimpleNamespace(
        log_stats=True,
        kv_cache_manager=SimpleNamespace(make_prefix_cache_stats=PrefixCacheStats, usage=0.5),
        connector_prefix_cache_stats=None,
        kv_metrics_collector=None,
        running=[],
        waiting=[],
        skipped_waiting=[],
    )
    stats = Scheduler.make_stats(fake, attn_backend_stats={KEY: 0.4})
    assert stats.attn_backend_stats == {KEY: 0.4}
    assert "model_runner_output.attn_backend_stats" in inspect.getsource(
        Scheduler.update_from_output
    )


def test_logging_stat_logger_line(vllm_config):
    from vllm.v1.metrics.loggers import LoggingStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    stat_logger = LoggingStatLogger(vllm_config)
    stat_logger.record(SchedulerStats(attn_backend_stats={KEY: 0.3125, "x_count": 7}), None)
    messages = []
    stat_logger.engine_is_idle = False
    stat_logger._update_stats = lambda: None  # keep engine_is_idle as set
    import vllm.v1.metrics.loggers as loggers_mod

    orig = loggers_mod.logger

    class _Capture:
        def info(self, fmt, *args):
            messages.append(fmt % args)

        debug = info

    loggers_mod.logger = _Capture()
    try:
        stat_logger.log()
    finally:
        loggers_mod.logger = orig
    line = messages[0]
    assert "Moira page read fraction: 31.2%" in line
    assert "X count: 7" in line


def test_prometheus_gauge(vllm_config):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    prom = PrometheusStatLogger(vllm_config)
    prom.record(SchedulerStats(attn_backend_stats={KEY: 0.25}), None)
    labels = {"model_name": vllm_config.model_config.served_model_name, "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:" + KEY, labels) == 0.25
    prom.record(SchedulerStats(attn_backend_stats={KEY: 0.75}), None)
    assert REGISTRY.get_sample_value("vllm:" + KEY, labels) == 0.75
    prom.record(SchedulerStats(), None)  # no report this step: gauge keeps its value
    assert REGISTRY.get_sample_value("vllm:" + KEY, labels) == 0.75
    # A new logger (e.g. engine restart in one process) re-registers cleanly.
    prom2 = PrometheusStatLogger(vllm_config)
    prom2.record(SchedulerStats(attn_backend_stats={KEY: 0.5}), None)
    assert REGISTRY.get_sample_value("vllm:" + KEY, labels) == 0.5


def test_moira_metrics_registers_as_provider(abs_mod):
    import torch
    from vllm.v1.worker import moira_metrics as mm

    mm.reset_page_read_metrics()
    try:
        metrics = mm.get_page_read_metrics()
        assert metrics.worker_log is False  # the frontend logs it
        stats = torch.zeros(2, dtype=torch.int64)
        poller = mm.ReadStatsPoller(stats)
        poller.poll()
        stats += torch.tensor([1, 4])
        poller.poll()
        poller.poll()
        assert abs_mod.collect_attn_backend_stats() == {KEY: 0.25}
        assert abs_mod.collect_attn_backend_stats() is None
    finally:
        mm.reset_page_read_metrics()


MASS = "moira_captured_mass"
BELOW = "moira_captured_mass_below_gamma_total"


def _log_line(stat_logger) -> str:
    import vllm.v1.metrics.loggers as loggers_mod

    messages = []
    stat_logger.engine_is_idle = False
    stat_logger._update_stats = lambda: None

    class _Capture:
        def info(self, fmt, *args):
            messages.append(fmt % args)

        debug = info

    orig, loggers_mod.logger = loggers_mod.logger, _Capture()
    try:
        stat_logger.log()
    finally:
        loggers_mod.logger = orig
    return messages[0]


def test_histogram_and_counter_reach_prometheus_and_the_log(vllm_config):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    prom = PrometheusStatLogger(vllm_config)
    stat_logger = LoggingStatLogger(vllm_config)
    labels = {"model_name": vllm_config.model_config.served_model_name, "engine": "0"}
    for stats in (
        {MASS: [0.9, 1.0, 0.98, 0.0, 1.0, 3.0], BELOW: 1.0},
        {MASS: [0.9, 0.0, 0.98, 2.0, 1.0, 4.0], BELOW: 0.0},
    ):
        prom.record(SchedulerStats(attn_backend_stats=stats), None)
        stat_logger.record(SchedulerStats(attn_backend_stats=stats), None)

    def bucket(le):
        return REGISTRY.get_sample_value(f"vllm:{MASS}_bucket", {**labels, "le": le})

    assert (bucket("0.9"), bucket("0.98"), bucket("1.0"), bucket("+Inf")) == (1, 3, 10, 10)
    assert REGISTRY.get_sample_value(f"vllm:{MASS}_count", labels) == 10
    assert REGISTRY.get_sample_value(f"vllm:{BELOW}", labels) == 1
    line = _log_line(stat_logger)
    # Summed since the last line: 10 lists, the 10% quantile in the 0.9 bucket.
    assert "Moira captured mass: p10 <= 0.9, p50 <= 1 (n=10)" in line
    assert "Moira captured mass below gamma: 1" in line
    assert "n=" not in _log_line(stat_logger)  # nothing new: no histogram part


def test_histogram_stats_survive_the_engine_core_encoding():
    """SchedulerStats travels from the engine core to the frontend by msgpack,
    decoded by type: a histogram value (a list) must decode."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = {KEY: 0.5, MASS: [0.9, 1.0, 1.0, 2.0], BELOW: 1.0}
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(attn_backend_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.scheduler_stats.attn_backend_stats == stats
