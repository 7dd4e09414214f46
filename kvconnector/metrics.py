"""Counters and histograms every endpoint keeps, as a Python dict and (optionally) for Prometheus.

Each endpoint owns one :class:`Metrics` (``role`` ``"prefill"`` or ``"decode"``). Its
:meth:`Metrics.snapshot` is what ``endpoint.stats()`` returns. When the optional package
``prometheus-client`` is installed, the same events also move process-wide Prometheus
collectors labelled by role; :func:`start_metrics_server` serves them over HTTP (what
``kvconnector serve --metrics-port`` runs). The Prometheus name of a snapshot key ``k`` in
:data:`PROMETHEUS_KEYS` is ``kvconnector_`` + ``k`` (docs/DEPLOY.md, "Operations", lists them).

Events come in through four calls made by the endpoints:

- ``add(key, n)``: plain counters (``bytes_sent``, ``bytes_received``, messages, ...);
- ``completed(nbytes, seconds, num_blocks)``: a pull that landed (decode) or was acknowledged
  (prefill): outcome ``ok``, its latency and size;
- ``fail(reason)``: a failure; pull-ending reasons count as that pull's outcome, and
  ``checksum`` / ``lease_expired`` also feed their own counters;
- ``handshake_refused(fields)``: a layout mismatch, one count per differing descriptor field.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, deque

# fail() reasons that are about the handshake or a lease, not the outcome of one pull
NOT_PULL_OUTCOMES = frozenset({"layout_mismatch", "bad_descriptor", "protocol_version", "handshake_timeout",
                               "lease_expired"})
# seconds; a pull of a few blocks over loopback takes ~1 ms, a long prompt over TCP ~1 s
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# snapshot key -> (Prometheus type, label names, help); Prometheus name = "kvconnector_" + key
PROMETHEUS_KEYS = {
    "bytes_total": ("counter", ("role", "direction"),
                    "Payload bytes moved (direction: sent by prefill, received by decode)"),
    "blocks_total": ("counter", ("role",),
                     "Per-layer blocks of completed pulls (one block id of one layer: 2*N*H*P bytes)"),
    "pulls_total": ("counter", ("role", "outcome"), "Pulls ended, by outcome (ok or the failure reason)"),
    "checksum_failures_total": ("counter", ("role",), "Payload frames whose xxh3_64 did not match"),
    "lease_expiries_total": ("counter", ("role",), "Published transfers whose lease ran out before an ACK"),
    "handshake_refusals_total": ("counter", ("role", "field"),
                                 "Handshakes refused for a layout mismatch, one count per differing field"),
    "transfer_seconds": ("histogram", ("role",), "Wall time of completed pulls (PULL to last block landed / ACK)"),
}


MAX_LABEL_VALUES = 32         # distinct outcome / field label values per metric; more become "other"
_LABEL_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")


def prometheus_available() -> bool:
    """True when ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class _Prometheus:
    """The process-wide collectors (created once, on first use, in the default registry)."""

    _lock = threading.Lock()
    _made: dict | None = None
    _seen: dict = {}     # metric key -> label values used so far

    @classmethod
    def label(cls, key: str, value: str) -> str:
        """``value`` as a label of metric ``key``: reasons and field names come partly from the
        peer (ERROR codes, HELLO_ACK diffs), so odd or too many distinct values become "other"."""
        value = str(value)
        with cls._lock:
            seen = cls._seen.setdefault(key, set())
            if value in seen:
                return value
            if not _LABEL_RE.fullmatch(value) or len(seen) >= MAX_LABEL_VALUES:
                return "other"
            seen.add(value)
            return value

    @classmethod
    def collectors(cls) -> dict | None:
        with cls._lock:
            if cls._made is None:
                try:
                    import prometheus_client as pc
                except ImportError:
                    cls._made = {}
                    return None
                made = {}
                for key, (kind, labels, doc) in PROMETHEUS_KEYS.items():
                    name = "kvconnector_" + key
                    if kind == "histogram":
                        made[key] = pc.Histogram(name, doc, labels, buckets=LATENCY_BUCKETS)
                    else:   # prometheus_client appends _total itself
                        made[key] = pc.Counter(name.removesuffix("_total"), doc, labels)
                cls._made = made
            return cls._made or None


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve every endpoint's Prometheus metrics at ``http://host:port/metrics``; return the port.

    ``port`` 0 picks a free port. Raises ``ModuleNotFoundError`` (with the pip command) when
    ``prometheus-client`` is not installed, ``OSError`` when the port cannot be bound.
    """
    try:
        import prometheus_client as pc
    except ImportError as e:
        raise ModuleNotFoundError("--metrics-port needs prometheus-client: pip install prometheus-client "
                                  "(or the 'metrics' extra)", name="prometheus_client") from e
    _Prometheus.collectors()
    server, _thread = pc.start_http_server(port, addr=host)
    return int(server.server_port)


class Metrics:
    """Thread-safe counters of one endpoint; :meth:`snapshot` returns a plain dict.

    Keys of the snapshot: ``bytes_sent``, ``bytes_received``, ``messages_sent``,
    ``messages_received``, ``transfers_started``, ``transfers_completed``,
    ``transfers_failed``, ``failures`` (reason -> count), ``ignored`` (reason -> count:
    duplicate, late, ...), ``throughput_gbps`` (payload bytes of completed transfers over
    their summed wall time, GB/s = 1e9 B/s), ``latency_ms`` (p50/p99/max over the last
    1024 completed transfers), ``uptime_s``; and the keys of :data:`PROMETHEUS_KEYS`:
    ``bytes_total`` (direction -> bytes), ``blocks_total``, ``pulls_total`` (outcome ->
    count), ``checksum_failures_total``, ``lease_expiries_total``,
    ``handshake_refusals_total`` (field -> count), ``transfer_seconds`` (``count``, ``sum``).
    """

    def __init__(self, role: str = "endpoint") -> None:
        self.role = role
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.c = Counter()
        self.failures = Counter()
        self.ignored = Counter()
        self.outcomes = Counter()
        self.refused_fields = Counter()
        self._lat = deque(maxlen=1024)
        self._done_bytes = 0
        self._done_s = 0.0
        self._prom = _Prometheus.collectors()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.c[key] += n
        if self._prom and key in ("bytes_sent", "bytes_received"):
            self._prom["bytes_total"].labels(self.role, key.removeprefix("bytes_")).inc(n)

    def fail(self, reason: str) -> None:
        with self._lock:
            self.c["transfers_failed"] += 1
            self.failures[reason] += 1
            if reason not in NOT_PULL_OUTCOMES:
                self.outcomes[reason] += 1
        if self._prom:
            if reason not in NOT_PULL_OUTCOMES:
                self._prom["pulls_total"].labels(self.role, _Prometheus.label("pulls_total", reason)).inc()
            if reason == "checksum":
                self._prom["checksum_failures_total"].labels(self.role).inc()
            elif reason == "lease_expired":
                self._prom["lease_expiries_total"].labels(self.role).inc()

    def handshake_refused(self, fields) -> None:
        """A layout mismatch: one count per differing descriptor field name."""
        fields = list(fields) or ["descriptor"]
        with self._lock:
            self.refused_fields.update(fields)
        if self._prom:
            for f in fields:
                self._prom["handshake_refusals_total"].labels(
                    self.role, _Prometheus.label("handshake_refusals_total", f)).inc()

    def ignore(self, reason: str) -> None:
        with self._lock:
            self.ignored[reason] += 1

    def completed(self, nbytes: int, seconds: float, num_blocks: int = 0) -> None:
        """A pull that ended well: ``nbytes`` payload bytes, ``num_blocks`` per-layer blocks."""
        with self._lock:
            self.c["transfers_completed"] += 1
            self.c["blocks"] += num_blocks
            self.outcomes["ok"] += 1
            self._done_bytes += nbytes
            self._done_s += seconds
            self._lat.append(seconds)
        if self._prom:
            self._prom["pulls_total"].labels(self.role, "ok").inc()
            self._prom["blocks_total"].labels(self.role).inc(num_blocks)
            self._prom["transfer_seconds"].labels(self.role).observe(seconds)

    def snapshot(self) -> dict:
        with self._lock:
            lat = sorted(self._lat)
            out = {k: self.c.get(k, 0) for k in (
                "bytes_sent", "bytes_received", "messages_sent", "messages_received",
                "transfers_started", "transfers_completed", "transfers_failed", "lanes_opened",
                "messages_sent_on_lanes")}
            out["failures"] = dict(self.failures)
            out["ignored"] = dict(self.ignored)
            out["throughput_gbps"] = self._done_bytes / self._done_s / 1e9 if self._done_s else 0.0
            pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: 0.0)
            out["latency_ms"] = {"p50": pick(0.5), "p99": pick(0.99), "max": lat[-1] * 1e3 if lat else 0.0}
            out["uptime_s"] = time.monotonic() - self._t0
            out["bytes_total"] = {"sent": out["bytes_sent"], "received": out["bytes_received"]}
            out["blocks_total"] = self.c.get("blocks", 0)
            out["pulls_total"] = dict(self.outcomes)
            out["checksum_failures_total"] = self.failures.get("checksum", 0)
            out["lease_expiries_total"] = self.failures.get("lease_expired", 0)
            out["handshake_refusals_total"] = dict(self.refused_fields)
            out["transfer_seconds"] = {"count": self.c["transfers_completed"], "sum": self._done_s}
            return out
