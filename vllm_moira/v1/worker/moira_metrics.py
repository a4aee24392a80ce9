# SPDX-License-Identifier: Apache-2.0
"""Moira observability: the measured page-read fraction, without a host sync.

Installed as ``vllm.v1.worker.moira_metrics``. Select adds, on the device, the
pages it kept and the pages in its rows to ``MoiraWorkspace.read_stats``
(int64 ``[2]``, accumulated over layers and steps). This module turns those
running totals into the fraction of KV pages that decode actually read:

- ``ReadStatsPoller`` (one per metadata builder / workspace) is polled from
  ``MoiraMetadataBuilder.build()``, which runs on the host every step, outside
  any CUDA graph. It keeps at most one 16-byte device-to-host copy in flight:
  a non-blocking copy into pinned memory followed by a CUDA event. A later
  ``poll()`` reads the copy only once ``event.query()`` says it has landed, so
  the decode step never waits for the device. On CPU (tests) the copy is a
  plain, synchronous one and is read at the next poll.
- ``PageReadMetrics`` (one per worker process) sums the deltas of all pollers
  and publishes them two ways:

  * with patch 0004 (``vllm.v1.metrics.attn_backend_stats``) it is registered
    as an attention-backend stats provider: the worker attaches
    ``{"moira_page_read_fraction": f}`` to its ModelRunnerOutput, the engine
    core forwards it in SchedulerStats, and the frontend exports the gauge
    ``vllm:moira_page_read_fraction`` on /metrics and appends it to
    LoggingStatLogger's periodic line;
  * without patch 0004 (plugin mode, older series) it logs
    ``Moira page reads: X%`` from the worker every ``VLLM_LOG_STATS_INTERVAL``
    seconds (vLLM's stats cadence, default 10 s) while decode is running.

The captured-mass audit (moira_audit.py) adds its int64 counters after the
two read counts in the same device tensor (``MoiraWorkspace.stats_counters``),
so the same copy brings them back: ``PageReadMetrics.observe_audit`` gets the
deltas, reported as the histogram ``vllm:moira_captured_mass`` (a list of
(upper bound, count) pairs in the stats dict) and the counter
``vllm:moira_captured_mass_below_gamma_total``, or logged by the worker as
``Moira captured mass: ...`` without patch 0004.

Warmup and CUDA-graph capture also run Select (on dummy one-page rows, all
kept): the first log interval after startup can include them; the gauge,
which covers only the last few steps, does not after the first decode step.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

#: Key in the attention-backend stats dict (patch 0004); exported as
#: ``vllm:moira_page_read_fraction``.
PAGE_READ_FRACTION_KEY = "moira_page_read_fraction"
#: Histogram of audited lists' captured mass: ``[bound, count, bound, count, ...]``
#: (counts per bucket, not cumulative), exported as ``vllm:moira_captured_mass``.
CAPTURED_MASS_KEY = "moira_captured_mass"
#: Audited lists under their gamma - 0.01 (a counter increment: names ending in
#: ``_total``), exported as ``vllm:moira_captured_mass_below_gamma_total``.
CAPTURED_MASS_BELOW_KEY = "moira_captured_mass_below_gamma_total"
#: In-tree module added by patch 0004.
ATTN_BACKEND_STATS_MODULE = "vllm.v1.metrics.attn_backend_stats"


def _log_interval_s() -> float:
    try:
        import vllm.envs as envs

        return float(envs.VLLM_LOG_STATS_INTERVAL)
    except Exception:  # pragma: no cover - envs always has it in 0.30
        return 10.0


def has_attn_backend_stats_channel() -> bool:
    """True when the running vLLM carries patch 0004 (stats reach /metrics)."""
    try:
        return importlib.util.find_spec(ATTN_BACKEND_STATS_MODULE) is not None
    except (ImportError, ValueError):
        return False


class PageReadMetrics:
    """Process-wide sums of (pages kept, pages in the rows) deltas.

    ``observe`` is called by the pollers; ``take_stats`` is the provider that
    patch 0004's worker hook calls once per step (it drains its window);
    ``maybe_log`` is the worker-side log at vLLM's cadence (its own window).
    """

    def __init__(
        self,
        log_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_fn: Callable[..., None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._log_interval_s = _log_interval_s() if log_interval_s is None else log_interval_s
        self._log_fn = log_fn if log_fn is not None else logger.info
        self._stats_kept = 0
        self._stats_total = 0
        self._log_kept = 0
        self._log_total = 0
        self._last_log = clock()
        # Captured-mass audit: bucket upper bounds, and counts since the last
        # take_stats() / log line.
        self._audit_edges: tuple[float, ...] = ()
        self._stats_buckets: list[int] = []
        self._stats_below = 0
        self._log_buckets: list[int] = []
        self._log_below = 0
        #: Fraction of the last completed poll window (for tests/benchmarks).
        self.last_fraction: float | None = None
        #: Whether the worker-side log is on (off once patch 0004's channel is used).
        self.worker_log = True

    def observe(self, kept: int, total: int) -> None:
        if total <= 0:
            return
        with self._lock:
            self._stats_kept += kept
            self._stats_total += total
            self._log_kept += kept
            self._log_total += total
            self.last_fraction = kept / total

    def observe_audit(self, edges: tuple[float, ...], below: int, buckets: list[int]) -> None:
        """Audited lists since the last poll: ``buckets[i]`` masses in
        (edges[i - 1], edges[i]]; ``below`` of them under their gamma - 0.01."""
        if sum(buckets) <= 0 and below <= 0:
            return
        with self._lock:
            if edges != self._audit_edges:  # first audit (workspaces share the server's gamma)
                self._audit_edges = edges
                self._stats_buckets = [0] * len(edges)
                self._log_buckets = [0] * len(edges)
            for i, count in enumerate(buckets[: len(edges)]):
                self._stats_buckets[i] += count
                self._log_buckets[i] += count
            self._stats_below += below
            self._log_below += below

    def take_stats(self) -> dict[str, float | list[float]] | None:
        """Attention-backend stats since the previous call (None: nothing new)."""
        stats: dict[str, float | list[float]] = {}
        with self._lock:
            if self._stats_total > 0:
                stats[PAGE_READ_FRACTION_KEY] = self._stats_kept / self._stats_total
                self._stats_kept = self._stats_total = 0
            if any(self._stats_buckets):
                stats[CAPTURED_MASS_KEY] = [
                    float(v)
                    for bound, count in zip(self._audit_edges, self._stats_buckets)
                    for v in (bound, count)
                ]
                stats[CAPTURED_MASS_BELOW_KEY] = float(self._stats_below)
                self._stats_buckets = [0] * len(self._audit_edges)
                self._stats_below = 0
        return stats or None

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log ``Moira page reads: X%`` (and ``Moira captured mass: ...`` when lists
        were audited) once per interval; returns the lines logged."""
        if not self.worker_log:
            return None
        now = self._clock() if now is None else now
        with self._lock:
            elapsed = now - self._last_log
            if elapsed < self._log_interval_s:
                return None
            kept, total = self._log_kept, self._log_total
            self._log_kept = self._log_total = 0
            self._last_log = now
            buckets, below = self._log_buckets, self._log_below
            self._log_buckets = [0] * len(self._audit_edges)
            self._log_below = 0
        lines = []
        if total > 0:  # no decode in this interval: stay quiet, like vLLM when idle
            args = (100.0 * kept / total, kept, total, elapsed)
            fmt = "Moira page reads: %.1f%% (%d of %d pages, last %.0f s)"
            self._log_fn(fmt, *args)
            lines.append(fmt % args)
        if sum(buckets) > 0:
            line = "Moira captured mass: " + captured_mass_summary(
                self._audit_edges, buckets, below
            )
            self._log_fn("%s (last %.0f s)", line, elapsed)
            lines.append(f"{line} (last {elapsed:.0f} s)")
        return "\n".join(lines) or None


def mass_quantile(edges: tuple[float, ...], buckets: list[int], q: float) -> float:
    """Upper bound of the bucket that holds quantile ``q`` (what Prometheus's
    histogram_quantile reports at a bucket's top)."""
    n = sum(buckets)
    running = 0
    for bound, count in zip(edges, buckets):
        running += count
        if running >= q * n and count > 0:
            return bound
    return edges[-1] if edges else float("nan")


def captured_mass_summary(edges: tuple[float, ...], buckets: list[int], below: int) -> str:
    """'p10 <= 0.975, p50 <= 0.99; 3 of 120 audited lists below gamma - 0.01'."""
    n = sum(buckets)
    p10, p50 = mass_quantile(edges, buckets, 0.1), mass_quantile(edges, buckets, 0.5)
    return f"p10 <= {p10:.4g}, p50 <= {p50:.4g}; {below} of {n} audited lists below gamma - 0.01"


_METRICS: PageReadMetrics | None = None
_METRICS_LOCK = threading.Lock()


def get_page_read_metrics() -> PageReadMetrics:
    """The worker process's PageReadMetrics; registers it with patch 0004 once."""
    global _METRICS
    with _METRICS_LOCK:
        if _METRICS is None:
            metrics = PageReadMetrics()
            if has_attn_backend_stats_channel():
                from vllm.v1.metrics.attn_backend_stats import (  # type: ignore[import-not-found]
                    register_attn_backend_stats_provider,
                )

                register_attn_backend_stats_provider(metrics.take_stats)
                metrics.worker_log = False  # the frontend's LoggingStatLogger logs it
            _METRICS = metrics
        return _METRICS


def reset_page_read_metrics() -> None:
    """Forget the process-wide instance (tests)."""
    global _METRICS
    with _METRICS_LOCK:
        _METRICS = None


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ReadStatsPoller:
    """Non-blocking reader of one workspace's ``read_stats`` counters (and, with
    ``audit_edges``, the captured-mass audit's counters after them: one copy).

    Call ``poll()`` on the host once per step, outside CUDA graphs (the
    metadata builder's ``build()``). It never synchronizes with the device:
    it reads a copy only after its event completed, then starts the next one.
    Returns the (kept, total) deltas since the previous reading, or None.
    """

    def __init__(
        self,
        read_stats: torch.Tensor,
        metrics: PageReadMetrics | None = None,
        audit_edges: tuple[float, ...] | None = None,
    ) -> None:
        from ..attention.backends.moira_audit import audit_counter_count

        num = 2 + (audit_counter_count(len(audit_edges)) if audit_edges else 0)
        if read_stats.dtype != torch.int64 or read_stats.numel() != num:
            raise ValueError(
                f"Moira: read_stats must be an int64 tensor of {num} elements (2 read counts"
                f"{', then the audit counters' if audit_edges else ''}), got "
                f"{read_stats.dtype} of shape {tuple(read_stats.shape)}"
            )
        self._src = read_stats
        self._audit_edges = tuple(audit_edges or ())
        self._on_device = read_stats.device.type == "cuda"
        self._host = torch.zeros(num, dtype=torch.int64, pin_memory=self._on_device)
        self._event = torch.cuda.Event() if self._on_device else None
        self._pending = False
        self._last = (0, 0)
        self._last_audit = [0] * (num - 2)
        self._metrics = metrics if metrics is not None else get_page_read_metrics()

    def observe_host(self, pages: int) -> None:
        """Pages read whole by a step that counted them on the host (a dense
        step on FA3: kept == total), straight into the metrics."""
        if pages > 0:
            self._metrics.observe(pages, pages)

    def _observe_audit(self, values: list[int]) -> None:
        if not values:
            return
        delta = [v - last for v, last in zip(values, self._last_audit)]
        self._last_audit = values
        if any(d < 0 for d in delta):
            return  # zeroed (a benchmark): new baseline
        self._metrics.observe_audit(self._audit_edges, delta[0], delta[1:])

    def _copy_ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def poll(self) -> tuple[int, int] | None:
        if _is_capturing():
            return None  # build() of a graph capture: no copies or event queries
        delta = None
        if self._pending and self._copy_ready():
            values = [int(v) for v in self._host.tolist()]
            kept, total = values[0], values[1]
            self._pending = False
            self._observe_audit(values[2:])
            dk, dt = kept - self._last[0], total - self._last[1]
            self._last = (kept, total)
            if dt < 0 or dk < 0:
                dk = dt = 0  # counters were zeroed (e.g. by a benchmark): new baseline
            if dt > 0:
                delta = (dk, dt)
                self._metrics.observe(dk, dt)
        if not self._pending:
            # Enqueued on the current stream before this step's kernels: it
            # sees the totals of every step launched so far.
            self._host.copy_(self._src, non_blocking=self._on_device)
            if self._event is not None:
                self._event.record()
            self._pending = True
        self._metrics.maybe_log()
        return delta
