"""A replica's counters and histograms, turned into its published ReplicaRecord once a tick."""

from __future__ import annotations

import time
from collections import deque

from grains.serving.batcher import BatchDone
from grains.serving.records import ReplicaRecord, batch_bucket, latency_bucket

WINDOW_TICKS = 10
"""Ticks (about seconds) the 'recent' latency histogram covers."""


def _add(hist: dict[int, int], i: int, n: int = 1) -> None:
    hist[i] = hist.get(i, 0) + n


class ReplicaStats:
    def __init__(self) -> None:
        self.started = time.time()
        self.requests = self.errors = self.rows = self.batches = self.passes = 0
        self.batch_rows: dict[int, int] = {}
        self.queue_ms: dict[int, int] = {}
        self.compute_ms: dict[int, int] = {}
        self.latency_ms: dict[int, int] = {}
        self.sums = {"queue": 0.0, "compute": 0.0, "latency": 0.0}
        self._tick: dict[int, int] = {}
        self._window: deque[dict[int, int]] = deque(maxlen=WINDOW_TICKS)
        self._last_requests = 0
        self._last_at = time.monotonic()

    def on_batch(self, done: BatchDone) -> None:
        self.batches += 1
        self.passes += done.passes
        self.rows += done.rows
        _add(self.batch_rows, batch_bucket(done.rows))
        compute = done.compute_s * 1000
        _add(self.compute_ms, latency_bucket(compute), done.requests)
        self.sums["compute"] += compute * done.requests
        for q in done.queue_s:
            _add(self.queue_ms, latency_bucket(q * 1000))
            self.sums["queue"] += q * 1000

    def on_request(self, seconds: float, *, failed: bool, requests: int = 1) -> None:
        """One call that answered ``requests`` callers' requests (merged by their Predictor)."""
        self.requests += requests
        self.errors += failed * requests
        ms = seconds * 1000
        b = latency_bucket(ms)
        _add(self.latency_ms, b, requests)
        _add(self._tick, b, requests)
        self.sums["latency"] += ms * requests

    def record(self, **fields: object) -> ReplicaRecord:
        """This tick's record (and the start of the next tick's window slot)."""
        now = time.monotonic()
        rate = (self.requests - self._last_requests) / max(1e-6, now - self._last_at)
        self._last_requests, self._last_at = self.requests, now
        self._window.append(self._tick)
        self._tick = {}
        window: dict[int, int] = {}
        for h in self._window:
            for i, n in h.items():
                _add(window, i, n)
        return ReplicaRecord(
            at=time.time(), started=self.started, requests=self.requests, errors=self.errors, rows=self.rows,
            batches=self.batches, passes=self.passes, requests_per_s=rate, batch_rows=dict(self.batch_rows),
            queue_ms=dict(self.queue_ms), compute_ms=dict(self.compute_ms), latency_ms=dict(self.latency_ms), queue_ms_sum=self.sums["queue"],
            compute_ms_sum=self.sums["compute"], latency_ms_sum=self.sums["latency"], window_latency_ms=window,
            window_s=float(len(self._window)), **fields,  # type: ignore[arg-type]
        )  # fmt: skip
