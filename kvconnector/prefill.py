"""Prefill side: owns the caches blocks are served from, leases, and the ROUTER socket.

Flow (see docs/PROTOCOL.md): a decode peer connects and sends HELLO with its descriptor;
this side checks it with :func:`layouts.check_compatible` and answers HELLO_ACK (with the
differing fields on a mismatch, which is also recorded in :attr:`PrefillEndpoint.errors`).
The application :meth:`~PrefillEndpoint.publish`\\ es a transfer id with its block ids;
the blocks are held under a lease until the peer ACKs, ABORTs, or the lease expires, and
then ``on_release(transfer_id, block_ids, reason)`` is called. A PULL starts a stream of
BLOCKS messages, one layer x a run of blocks each, interleaved round-robin with the other
streams so one big or slow transfer never stalls the others.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from layouts import (LayoutDescriptor, LayoutError, LayoutMismatchError, ProtocolVersionError,
                     TransferError, check_compatible)
from .blocks import device_ids, slice_bytes
from .describe import describe_reply
from .metrics import Metrics
from .protocol import ErrorCode, Header, MsgType, decode_header, encode_header
from .security import start_authenticator
from .sender import BufferPool, Stream
from .transport import DEFAULT_HOST, CurveKeys, IOLoop, bind, make_socket


@dataclass
class Lease:
    transfer_id: str
    block_ids: list
    expires_at: float
    ids_dev: tuple = None      # CUDA caches: (block_ids on the device, event after their copy), made at publish


def check_caches(caches, desc: LayoutDescriptor) -> None:
    """Raise :class:`LayoutError` unless ``caches`` is one packed tensor per layer of ``desc``."""
    geo = desc.geometry()
    if len(caches) != desc.num_layers:
        raise LayoutError(f"caches: expected {desc.num_layers} layers (descriptor), got {len(caches)}")
    for i, c in enumerate(caches):
        if tuple(c.shape) != geo.shape(desc.num_blocks) or c.dtype != geo.storage_dtype:
            raise LayoutError(f"caches[{i}]: expected {geo.shape(desc.num_blocks)} {geo.storage_dtype}, "
                              f"got {tuple(c.shape)} {c.dtype}")


class PrefillEndpoint:
    """Serve published blocks to decode peers.

    Parameters
    ----------
    caches : list of [num_blocks, 2, block_size, num_kv_heads, P] tensors, CPU or CUDA
        One packed cache per layer (read only here), matching ``descriptor``.
    descriptor : LayoutDescriptor
    host, port : bind address; port 0 picks a random free port (see :attr:`endpoint`).
    on_release : callable(transfer_id, block_ids, reason), optional
        Called (on the I/O thread) when a lease ends; reason is ``"acked"``, ``"aborted"``,
        ``"expired"`` or ``"released"``.
    lease_s : float
        Default lease of :meth:`publish`.
    chunk_bytes : int
        Target payload bytes of one BLOCKS message (at least one block).
    heartbeat_s, peer_timeout_s : float
        Liveness: a peer silent for ``peer_timeout_s`` loses its streams.
    """

    def __init__(self, caches, descriptor: LayoutDescriptor, *, host: str = DEFAULT_HOST, port: int = 0,
                 on_release: Callable | None = None, lease_s: float = 30.0, chunk_bytes: int = 8 << 20,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0, max_frame_bytes: int = 1 << 20,
                 curve: CurveKeys | None = None) -> None:
        check_caches(caches, descriptor)
        self.caches, self.descriptor, self.geometry = list(caches), descriptor, descriptor.geometry()
        self.on_release, self.lease_s, self.chunk_bytes = on_release, lease_s, chunk_bytes
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.metrics = Metrics("prefill")
        self.errors: list[Exception] = []        # recorded failures (mismatches, bad frames)
        self._leases: dict[str, Lease] = {}
        self._expiry: list = []                  # heap of (expires_at, tid); stale entries skipped
        self._lock = threading.Lock()
        self._peers: dict[bytes, dict] = {}      # ident -> {"ok": bool, "seen": t, "heads": range}
        self._streams: list[Stream] = []
        self._started: dict[str, tuple] = {}     # tid -> (pull time, payload bytes) for metrics
        self._blocked_until = 0.0
        self._pool = BufferPool()
        self.cuda = caches[0].is_cuda
        self._copy_stream = torch.cuda.Stream(device=caches[0].device) if self.cuda else None
        ctx = zmq.Context()
        self._zap = start_authenticator(ctx, curve)  # CURVE client allow-list (CurveServerKeys)
        sock = make_socket(ctx, zmq.ROUTER, max_frame_bytes=max_frame_bytes, curve=curve, server=True)
        self.endpoint, self.port = bind(sock, host, port)
        self._loop = IOLoop(ctx, sock, name=f"kvc-prefill-{self.port}", on_message=self._on_message,
                            on_tick=self._on_tick, on_error=self._on_error)
        self._loop.start()

    # ---- application API (any thread) -------------------------------------------------
    def publish(self, transfer_id: str, block_ids, lease_s: float | None = None) -> None:
        """Hold ``block_ids`` (source blocks, in transfer order) under ``transfer_id``."""
        ids = [int(b) for b in block_ids]
        if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > 256:
            raise ValueError(f"transfer_id: expected a non-empty str of <= 256 chars, got {transfer_id!r}")
        if not ids or min(ids) < 0 or max(ids) >= self.descriptor.num_blocks:
            raise LayoutError(f"block_ids: expected a non-empty list in [0, {self.descriptor.num_blocks}), got {ids[:8]}")
        ids_dev = None
        if self.cuda:   # off the pull's critical path; the copy stream waits for the event
            ready = torch.cuda.Event()
            ids_dev = (device_ids(ids, self.caches[0].device), ready)
            ready.record(torch.cuda.current_stream(self.caches[0].device))
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"transfer_id {transfer_id!r} is already published")
            lease = self._leases[transfer_id] = Lease(transfer_id, ids, time.monotonic() + (lease_s or self.lease_s),
                                                      ids_dev)
            heapq.heappush(self._expiry, (lease.expires_at, transfer_id))
        self._loop.call_soon(lambda: None)  # wake the loop so the new expiry is scheduled

    def release(self, transfer_id: str) -> bool:
        """Drop a lease now (reason ``"released"``); False if it was not held."""
        done = threading.Event()
        out = []
        self._loop.call_soon(lambda: (out.append(self._end_lease(transfer_id, "released")), done.set()))
        done.wait(5.0)
        return bool(out and out[0])

    def held(self) -> list[str]:
        """Transfer ids currently leased."""
        with self._lock:
            return sorted(self._leases)

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        s["leases"] = len(self.held())
        s["streams"] = len(self._streams)
        return s

    def close(self) -> None:
        if self._zap is not None:
            self._zap.stop()  # its socket must close before the loop terminates the context
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- I/O thread ------------------------------------------------------------------
    def _send(self, ident: bytes, frames: list, track: bool = False):
        tracker = self._loop.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False, track=track)
        self.metrics.add("messages_sent")
        return tracker

    def _reply(self, ident: bytes, h: Header) -> None:
        try:
            self._send(ident, [encode_header(h)])
        except zmq.ZMQError:
            pass  # peer gone or its queue full: a control reply is best effort

    def _end_lease(self, tid: str, reason: str) -> bool:
        with self._lock:
            lease = self._leases.pop(tid, None)
        if lease is None:
            return False
        if reason != "acked":
            self._started.pop(tid, None)
        self._streams = [s for s in self._streams if s.tid != tid]
        if reason == "expired":
            self.metrics.fail("lease_expired")
        if self.on_release is not None:
            self.on_release(tid, lease.block_ids, reason)
        return True

    def _on_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.metrics.ignore(f"error:{type(e).__name__}")

    def _on_message(self, frames) -> None:
        ident, rest = frames[0].bytes, frames[1:]
        self.metrics.add("messages_received")
        peer = self._peers.setdefault(ident, {"ok": False, "seen": 0.0, "heads": None})
        peer["seen"] = time.monotonic()
        if not rest:
            return self.metrics.ignore("empty_message")
        try:
            h = decode_header(rest[0].buffer)
        except ProtocolVersionError as e:
            self.errors.append(e)
            self.metrics.fail("protocol_version")
            return self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.BAD_MESSAGE, msg=str(e)))
        except TransferError as e:
            self.errors.append(e)
            self.metrics.ignore("corrupt_header")
            return self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.BAD_MESSAGE, msg=str(e)))
        if h.type == MsgType.HELLO:
            return self._hello(ident, peer, h)
        if h.type == MsgType.PING:
            if not peer["ok"]:  # e.g. this process restarted under a live peer: make it re-handshake
                self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.HANDSHAKE_REQUIRED,
                                          msg="send HELLO with a compatible descriptor first"))
            return self._reply(ident, Header(MsgType.PONG))
        if h.type == MsgType.PONG:
            return None
        if h.type == MsgType.DESCRIBE:   # answered before any handshake: see kvconnector/describe.py
            return self._reply(ident, describe_reply(self.descriptor, self._leases, self._lock))
        if not peer["ok"]:
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.HANDSHAKE_REQUIRED,
                                             msg="send HELLO with a compatible descriptor first"))
        if h.type == MsgType.PULL:
            return self._pull(ident, peer, h)
        if h.type in (MsgType.ACK, MsgType.ABORT):
            reason = "acked" if h.type == MsgType.ACK else "aborted"
            if not self._end_lease(h.tid, reason):
                self.metrics.ignore(f"duplicate_{reason}")
            elif reason == "acked" and h.tid in self._started:
                t0, nbytes, num_blocks = self._started.pop(h.tid)
                self.metrics.completed(nbytes, time.monotonic() - t0, num_blocks)
            return None
        self.metrics.ignore(f"unexpected_{h.type.name}")

    def _hello(self, ident: bytes, peer: dict, h: Header) -> None:
        mine = self.descriptor.to_dict()
        try:
            remote = LayoutDescriptor.from_dict(h.desc)
            peer["heads"] = check_compatible(self.descriptor, remote, context="prefill side")
        except LayoutMismatchError as e:
            self.errors.append(e)
            self.metrics.fail("layout_mismatch")
            self.metrics.handshake_refused(n for n, _, _ in e.differences)
            peer["ok"] = False
            diffs = [[n, a, b] for n, a, b in e.differences]
            return self._reply(ident, Header(MsgType.HELLO_ACK, desc=mine, ok=False, msg=str(e), diffs=diffs))
        except LayoutError as e:
            self.errors.append(e)
            self.metrics.fail("bad_descriptor")
            peer["ok"] = False
            return self._reply(ident, Header(MsgType.HELLO_ACK, desc=mine, ok=False, msg=str(e)))
        peer["ok"] = True
        self._reply(ident, Header(MsgType.HELLO_ACK, desc=mine, ok=True))

    def _pull(self, ident: bytes, peer: dict, h: Header) -> None:
        with self._lock:
            lease = self._leases.get(h.tid)
        if lease is None:
            self.metrics.fail("unknown_transfer")
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.UNKNOWN_TRANSFER,
                                             msg=f"transfer {h.tid!r} is not published (or its lease ended)"))
        if h.nblk != len(lease.block_ids):
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.BLOCK_COUNT,
                                             msg=f"transfer {h.tid!r}: expected {len(lease.block_ids)} "
                                                 f"destination blocks, got {h.nblk}"))
        shared, d = peer["heads"], self.descriptor
        if not (shared.start <= h.heads[0] < h.heads[1] <= shared.stop):
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.BAD_HEADS,
                                             msg=f"heads: expected a range inside [{shared.start}, {shared.stop}), got {list(h.heads)}"))
        self._streams = [s for s in self._streams if s.tid != h.tid]   # a retried pull restarts
        local = range(h.heads[0] - d.head_start, h.heads[1] - d.head_start)
        self._streams.append(Stream(ident, h.tid, lease.block_ids, self.caches, self.geometry, local,
                                    h.heads, self.chunk_bytes, self._copy_stream, self._pool, lease.ids_dev))
        self.metrics.add("transfers_started")
        nbytes = len(self.caches) * slice_bytes(self.geometry, len(lease.block_ids), local)
        self._started[h.tid] = (time.monotonic(), nbytes, len(lease.block_ids) * len(self.caches))

    def _on_tick(self, now: float) -> float:
        with self._lock:
            heap = self._expiry                  # O(log n) per lease instead of a scan per tick
            if len(heap) > 2 * len(self._leases) + 64:   # mostly ended leases: rebuild
                heap[:] = [(lease.expires_at, t) for t, lease in self._leases.items()]
                heapq.heapify(heap)
            expired = []
            while heap and (heap[0][0] <= now or self._leases.get(heap[0][1]) is None
                            or self._leases[heap[0][1]].expires_at != heap[0][0]):
                at, tid = heapq.heappop(heap)
                lease = self._leases.get(tid)
                if lease is not None and lease.expires_at == at:
                    expired.append(tid)
            next_exp = heap[0][0] if heap else now + 1.0
        for tid in expired:
            self._end_lease(tid, "expired")
        for ident, peer in list(self._peers.items()):
            if now - peer["seen"] > self.peer_timeout_s:
                del self._peers[ident]
                dropped = [s for s in self._streams if s.ident == ident]
                if dropped:
                    self.metrics.fail("peer_timeout")
                self._streams = [s for s in self._streams if s.ident != ident]
        return min(max(0.0, next_exp - now), self.heartbeat_s, self._pump(now))

    def _pump(self, now: float) -> float:
        """Send one message per stream, round-robin, until every stream is done or blocked."""
        if not self._streams or now < self._blocked_until:
            return max(0.0, self._blocked_until - now) if self._streams else 1.0
        for _ in range(64):  # bounded so incoming ACK/PULL/PING keep being served
            progressed = False
            for s in list(self._streams):
                frames = s.next_frames()
                if frames is None:
                    self._streams.remove(s)
                    continue
                if not frames:                     # its buffers are still queued in ZeroMQ
                    continue
                try:
                    s.sent(self._send(s.ident, frames, track=s.last_buffer is not None))
                except zmq.Again:
                    s.push_back(frames)            # peer's queue is full: retry shortly
                    continue
                except zmq.ZMQError:               # EHOSTUNREACH: the peer disconnected
                    self._streams.remove(s)
                    self.metrics.fail("peer_unreachable")
                    continue
                progressed = True
                self.metrics.add("bytes_sent", s.last_payload_bytes)
            if not self._streams:
                return 1.0
            if not progressed:
                self._blocked_until = now + 0.001
                return 0.001
        return 0.0
