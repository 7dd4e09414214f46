"""Per-message spans of an endpoint's threads: where a transfer's time goes, message by message.

Each endpoint has a :class:`Trace` (``endpoint.trace``), off by default. Switched on, the
threads that handle a transfer record one span per message and step:

- prefill: ``prestage`` (at publish: queuing the first message's gather / copy before any pull),
  ``stage`` (queuing the next messages' gather / copies), ``copy_wait`` (waiting for a
  message's bytes to be in host memory), ``send`` (handing the message to ZeroMQ);
- decode: ``request`` (from :meth:`~kvconnector.DecodeEndpoint.pull` to its PULL handed to
  ZeroMQ), ``receive`` (taking a whole message off the socket, the copy into pinned memory
  included with ``recv_into``), ``handle`` (checks, hand-off to the landing thread or the host
  write), ``land_start`` / ``land`` (the landing thread: host copies submitted; device copy
  queued), ``verify`` (one per verify + scatter pass, named by its first message, with the
  ``messages`` it covers), ``device`` (from its pass queued to seen done by the watcher thread),
  ``pull`` (a whole pull, from :meth:`~kvconnector.DecodeEndpoint.pull` to its last block landed).

Times are ``time.perf_counter()`` seconds, which on Linux is ``CLOCK_MONOTONIC``: spans of two
processes on one host share a clock and merge into one timeline (:func:`write_chrome`, the
Chrome trace event format that ``chrome://tracing`` and Perfetto open). Off, a call site costs
one attribute test; on, one tuple appended to a bounded deque (the oldest spans go first).
"""

from __future__ import annotations

import json
import threading
from collections import deque

MAX_SPANS = 1 << 16


class Trace:
    """Spans ``(name, thread name, t0, t1, args)`` recorded while :attr:`enabled`."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self.enabled = False
        self._spans: deque = deque(maxlen=max_spans)

    def span(self, name: str, t0: float, t1: float, **args) -> None:
        """Record ``name`` from ``t0`` to ``t1`` (perf_counter seconds) on the calling thread."""
        if self.enabled:
            self._spans.append((name, threading.current_thread().name, t0, t1, args))

    def take(self) -> list:
        """The spans recorded so far, oldest first; the trace is left empty."""
        out = []
        while True:
            try:
                out.append(self._spans.popleft())
            except IndexError:
                return out


def chrome_events(spans: list, pid: int, process: str) -> list:
    """``spans`` (from :meth:`Trace.take`) as Chrome trace events of process ``pid`` named
    ``process``: one complete event (``ph: X``, microseconds) per span, a thread per thread name."""
    tids: dict = {}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}]
    for name, thread, t0, t1, args in spans:
        tid = tids.setdefault(thread, len(tids) + 1)
        events.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": t0 * 1e6,
                       "dur": max(0.0, t1 - t0) * 1e6, "args": args})
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
               for thread, tid in tids.items()]
    return events


def write_chrome(path: str, processes: list) -> int:
    """Write ``processes`` (``(process name, spans)`` pairs) as one Chrome trace JSON file at
    ``path``; returns the number of spans written."""
    events, n = [], 0
    for pid, (process, spans) in enumerate(processes, start=1):
        events += chrome_events(spans, pid, process)
        n += len(spans)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return n
