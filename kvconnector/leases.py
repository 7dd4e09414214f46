"""Leases of the prefill side: published source blocks, held until the transfer ends.

A lease ends on ACK (``"acked"``: of each of its ``pulls`` head ranges), ABORT (``"aborted"``),
its deadline (``"expired"``), the application's release (``"released"``) or a failure while
serving it (``"failed"``). An ended
lease first *drains*: it stays listed by :meth:`LeaseTable.held` until none of its streams
may still read the blocks (a staging job running, a zero-copy frame still queued in ZeroMQ;
see :meth:`kvconnector.sender.Stream.busy`). Only then is it *released*: the endpoint calls
``on_release``, then drops it from ``held()`` and sets :attr:`Lease.released`, so a transfer id
gone from ``held()`` has had its callback run. docs/PROTOCOL.md ("Leases") states the rule for
peers.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field


@dataclass
class Lease:
    """One published transfer: its source blocks (in transfer order) and its state."""

    transfer_id: str
    block_ids: list
    expires_at: float                             # time.monotonic() deadline
    ids_dev: tuple = None      # CUDA caches: (block_ids on the device, event after their copy), made at publish
    streams: list = field(default_factory=list)   # every Stream started for it (retried pulls too)
    peers: dict = field(default_factory=dict)     # ident that pulled it -> the heads (lo, hi) it pulled
    pulls: int = 1                                # pulls of distinct head ranges it serves (decode TP ranks)
    acked: set = field(default_factory=set)       # head ranges whose pull was acknowledged
    waiting: set = field(default_factory=set)     # idents whose latest pull is not acknowledged yet
    reason: str = ""                              # why it ended, once it has
    layers_ready: int | None = None               # layers written so far (layer-wise publish); None: all
    prestaged: object = None   # a Stream whose first message was staged at publish, until a pull takes it
    released: threading.Event = field(default_factory=threading.Event)   # on_release has run


class LeaseTable:
    """Live and draining leases. :meth:`add` and :meth:`held` from any thread; the rest on
    the endpoint's I/O thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Lease] = {}
        self._expiry: list = []       # heap of (expires_at, tid); entries of ended leases are skipped
        self._draining: list[Lease] = []

    def add(self, lease: Lease) -> None:
        """Hold ``lease``; ValueError when its transfer id is live already."""
        with self._lock:
            if lease.transfer_id in self._live:
                raise ValueError(f"transfer_id {lease.transfer_id!r} is already published")
            self._live[lease.transfer_id] = lease
            heapq.heappush(self._expiry, (lease.expires_at, lease.transfer_id))

    def get(self, tid: str) -> Lease | None:
        """The live lease of ``tid`` (None when not published or ended)."""
        with self._lock:
            return self._live.get(tid)

    def listing(self, limit: int) -> list[list]:
        """``[transfer id, block count]`` of up to ``limit`` live leases, oldest first."""
        with self._lock:
            return [[tid, len(lease.block_ids)] for tid, lease in itertools.islice(self._live.items(), limit)]

    def held(self) -> list[str]:
        """Transfer ids whose blocks are leased: live, or ended and still draining."""
        with self._lock:
            return sorted(set(self._live) | {lease.transfer_id for lease in self._draining})

    @property
    def draining(self) -> bool:
        return bool(self._draining)

    def end(self, tid: str, reason: str) -> Lease | None:
        """Move the live lease of ``tid`` to draining with ``reason``; None when not live."""
        with self._lock:
            lease = self._live.pop(tid, None)
            if lease is not None:
                lease.reason = reason
                self._draining.append(lease)
            return lease

    def drained(self) -> list[Lease]:
        """The draining leases none of whose streams still reads the blocks. They stay in
        :meth:`held` until :meth:`forget` (after their ``on_release``), so a lease that left
        ``held()`` has had its callback run."""
        return [lease for lease in self._draining if not any(s.busy() for s in lease.streams)]

    def forget(self, lease: Lease) -> None:
        """Drop a drained lease (its ``on_release`` has run)."""
        with self._lock:
            self._draining = [d for d in self._draining if d is not lease]

    def expired(self, now: float) -> tuple[list[str], float | None]:
        """Transfer ids of live leases whose deadline is ``<= now`` (still live: the caller ends
        them), and the next deadline after those (None when there is none)."""
        with self._lock:
            heap = self._expiry                  # O(log n) per lease instead of a scan per tick
            if len(heap) > 2 * len(self._live) + 64:   # mostly ended leases: rebuild
                heap[:] = [(lease.expires_at, t) for t, lease in self._live.items()]
                heapq.heapify(heap)
            out = []
            while heap and (heap[0][0] <= now or self._live.get(heap[0][1]) is None
                            or self._live[heap[0][1]].expires_at != heap[0][0]):
                at, tid = heapq.heappop(heap)
                lease = self._live.get(tid)
                if lease is not None and lease.expires_at == at:
                    out.append(tid)
            return out, (heap[0][0] if heap else None)
