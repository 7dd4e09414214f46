"""Counters every endpoint keeps: bytes, transfers, failures by reason, throughput, latency."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque


class Metrics:
    """Thread-safe counters; :meth:`snapshot` returns a plain dict.

    Keys of the snapshot: ``bytes_sent``, ``bytes_received``, ``messages_sent``,
    ``messages_received``, ``transfers_started``, ``transfers_completed``,
    ``transfers_failed``, ``failures`` (reason -> count), ``ignored`` (reason -> count:
    duplicate, late, ...), ``throughput_gbps`` (payload bytes of completed transfers over
    their summed wall time, GB/s = 1e9 B/s), ``latency_ms`` (p50/p99/max over the last
    1024 completed transfers), ``uptime_s``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.c = Counter()
        self.failures = Counter()
        self.ignored = Counter()
        self._lat = deque(maxlen=1024)
        self._done_bytes = 0
        self._done_s = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.c[key] += n

    def fail(self, reason: str) -> None:
        with self._lock:
            self.c["transfers_failed"] += 1
            self.failures[reason] += 1

    def ignore(self, reason: str) -> None:
        with self._lock:
            self.ignored[reason] += 1

    def completed(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.c["transfers_completed"] += 1
            self._done_bytes += nbytes
            self._done_s += seconds
            self._lat.append(seconds)

    def snapshot(self) -> dict:
        with self._lock:
            lat = sorted(self._lat)
            out = {k: self.c.get(k, 0) for k in (
                "bytes_sent", "bytes_received", "messages_sent", "messages_received",
                "transfers_started", "transfers_completed", "transfers_failed")}
            out["failures"] = dict(self.failures)
            out["ignored"] = dict(self.ignored)
            out["throughput_gbps"] = self._done_bytes / self._done_s / 1e9 if self._done_s else 0.0
            pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: 0.0)
            out["latency_ms"] = {"p50": pick(0.5), "p99": pick(0.99), "max": lat[-1] * 1e3 if lat else 0.0}
            out["uptime_s"] = time.monotonic() - self._t0
            return out
