"""Moira page-read metrics (overlay vllm/v1/worker/moira_metrics.py), on CPU."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture()
def mm():
    """The installed module (overlay copy inside vLLM), state reset around each test."""
    module = importlib.import_module("vllm.v1.worker.moira_metrics")
    module.reset_page_read_metrics()
    yield module
    module.reset_page_read_metrics()


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _metrics(mm, interval=10.0):
    clock = _Clock()
    lines = []
    metrics = mm.PageReadMetrics(
        log_interval_s=interval, clock=clock, log_fn=lambda fmt, *a: lines.append(fmt % a)
    )
    return metrics, clock, lines


def test_poller_reports_deltas_one_poll_late(mm):
    metrics, _, _ = _metrics(mm)
    stats = torch.zeros(2, dtype=torch.int64)
    poller = mm.ReadStatsPoller(stats, metrics)
    assert poller.poll() is None  # first copy started, nothing to read yet
    stats += torch.tensor([3, 10])  # a decode step's Select
    # The copy taken at the previous poll saw (0, 0): nothing new yet.
    assert poller.poll() is None
    stats += torch.tensor([2, 10])
    assert poller.poll() == (3, 10)  # the copy from the 2nd poll
    assert poller.poll() == (2, 10)
    assert poller.poll() is None  # no new Select launches
    assert metrics.take_stats() == {mm.PAGE_READ_FRACTION_KEY: pytest.approx(0.25)}
    assert metrics.take_stats() is None  # drained
    assert metrics.last_fraction == pytest.approx(0.2)


def test_poller_adds_dense_steps_counted_on_the_host(mm):
    # Steps that ran FA3 (every page read) never touch the device counters:
    # their pages go straight to the metrics, kept == total.
    metrics, _, _ = _metrics(mm)
    stats = torch.zeros(2, dtype=torch.int64)
    poller = mm.ReadStatsPoller(stats, metrics)
    poller.observe_host(0)
    assert metrics.take_stats() is None
    poller.observe_host(30)
    poller.poll()
    stats += torch.tensor([5, 10])
    poller.poll()
    assert poller.poll() == (5, 10)
    assert metrics.take_stats() == {mm.PAGE_READ_FRACTION_KEY: pytest.approx(35 / 40)}


def test_poller_new_baseline_when_counters_are_zeroed(mm):
    metrics, _, _ = _metrics(mm)
    stats = torch.tensor([50, 100], dtype=torch.int64)
    poller = mm.ReadStatsPoller(stats, metrics)
    poller.poll()
    assert poller.poll() == (50, 100)
    stats.zero_()
    poller.poll()
    assert poller.poll() is None  # negative delta: re-baselined, not reported
    stats += torch.tensor([1, 4])
    poller.poll()
    assert poller.poll() == (1, 4)


def test_poller_rejects_wrong_buffer(mm):
    with pytest.raises(ValueError, match="int64 tensor of 2"):
        mm.ReadStatsPoller(torch.zeros(3, dtype=torch.int64), mm.PageReadMetrics())
    with pytest.raises(ValueError, match="int64"):
        mm.ReadStatsPoller(torch.zeros(2, dtype=torch.int32), mm.PageReadMetrics())


def test_several_pollers_share_the_process_window(mm):
    metrics, _, _ = _metrics(mm)
    a, b = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    pa, pb = mm.ReadStatsPoller(a, metrics), mm.ReadStatsPoller(b, metrics)
    pa.poll(), pb.poll()
    a += torch.tensor([1, 10])
    b += torch.tensor([9, 10])
    pa.poll(), pb.poll()
    pa.poll(), pb.poll()
    assert metrics.take_stats() == {mm.PAGE_READ_FRACTION_KEY: pytest.approx(0.5)}


def test_worker_log_at_interval_and_quiet_when_idle(mm):
    metrics, clock, lines = _metrics(mm, interval=10.0)
    metrics.observe(30, 100)
    assert metrics.maybe_log() is None  # interval not over
    clock.t += 10.0
    line = metrics.maybe_log()
    assert line == "Moira page reads: 30.0% (30 of 100 pages, last 10 s)"
    assert lines == [line]
    clock.t += 10.0
    assert metrics.maybe_log() is None  # idle interval: no line
    metrics.observe(1, 4)
    clock.t += 12.0
    assert metrics.maybe_log().startswith("Moira page reads: 25.0% (1 of 4 pages, last 12 s)")
    # The stats provider has its own window: both intervals are still in it.
    assert metrics.take_stats() == {mm.PAGE_READ_FRACTION_KEY: pytest.approx(31 / 104)}


def test_worker_log_off_when_stats_channel_is_used(mm):
    metrics, clock, lines = _metrics(mm)
    metrics.worker_log = False
    metrics.observe(1, 2)
    clock.t += 60
    assert metrics.maybe_log() is None and lines == []


def test_poller_logs_from_poll(mm):
    metrics, clock, lines = _metrics(mm, interval=10.0)
    stats = torch.zeros(2, dtype=torch.int64)
    poller = mm.ReadStatsPoller(stats, metrics)
    poller.poll()
    stats += torch.tensor([1, 2])
    poller.poll()
    poller.poll()
    clock.t += 10.0
    poller.poll()
    assert lines == ["Moira page reads: 50.0% (1 of 2 pages, last 10 s)"]


def test_process_metrics_follow_the_patch_channel(mm):
    metrics = mm.get_page_read_metrics()
    assert mm.get_page_read_metrics() is metrics
    assert metrics.worker_log == (not mm.has_attn_backend_stats_channel())


def test_poll_does_nothing_while_capturing(mm, monkeypatch):
    metrics, _, _ = _metrics(mm)
    stats = torch.zeros(2, dtype=torch.int64)
    poller = mm.ReadStatsPoller(stats, metrics)
    monkeypatch.setattr(mm, "_is_capturing", lambda: True)
    poller.poll()
    assert not poller._pending  # no copy was started inside a capture


def test_poller_reads_the_audit_counters_in_the_same_copy():
    import torch
    from vllm.v1.worker import moira_metrics as mm

    edges = (0.9, 0.98, 1.0)
    lines: list[str] = []
    metrics = mm.PageReadMetrics(log_interval_s=0.0, log_fn=lambda fmt, *a: lines.append(fmt % a))
    counters = torch.zeros(2 + 1 + len(edges), dtype=torch.int64)
    with pytest.raises(ValueError, match="6 elements"):
        mm.ReadStatsPoller(counters[:2], metrics, audit_edges=edges)
    poller = mm.ReadStatsPoller(counters, metrics, audit_edges=edges)
    poller.poll()
    counters += torch.tensor([3, 8, 1, 1, 0, 3])  # 4 audited lists, 1 below gamma
    poller.poll()
    poller.poll()
    stats = metrics.take_stats()
    assert stats == {
        mm.PAGE_READ_FRACTION_KEY: 3 / 8,
        mm.CAPTURED_MASS_KEY: [0.9, 1.0, 0.98, 0.0, 1.0, 3.0],
        mm.CAPTURED_MASS_BELOW_KEY: 1.0,
    }
    assert metrics.take_stats() is None
    assert any(
        line.startswith("Moira captured mass: p10 <= 0.9, p50 <= 1; 1 of 4 audited lists")
        for line in lines
    ), lines
    counters.zero_()  # a benchmark zeroed the counters: a new baseline, nothing reported
    poller.poll()
    poller.poll()
    assert metrics.take_stats() is None
