"""Prefill side: owns the caches blocks are served from, leases, and the ROUTER socket.

Flow (see docs/PROTOCOL.md): a decode peer connects and sends HELLO with its descriptor;
this side checks it with :func:`layouts.check_compatible` and answers HELLO_ACK (with the
differing fields on a mismatch, which is also recorded in :attr:`PrefillEndpoint.errors`).
The application :meth:`~PrefillEndpoint.publish`\\ es a transfer id with its block ids;
the blocks are held under a lease until the peer ACKs, ABORTs, or the lease expires, and
then ``on_release(transfer_id, block_ids, reason)`` is called. A PULL starts a stream of
BLOCKS messages, one layer x a run of blocks each, interleaved round-robin with the other
streams so one big or slow transfer never stalls the others.

Nothing fails silently. Any exception while serving a pull (reading, hashing or sending its
blocks) sends the peer ERROR ``serve_failed`` naming the cause and ends the lease
(``"failed"``); a lease that expires or is released mid-transfer stops its stream and sends
ERROR ``lease_expired`` / ``released``; a message handler that raises answers ERROR
``internal``. Errors are recorded in :attr:`PrefillEndpoint.errors` (typed; the most recent
ones and a count, :mod:`kvconnector.error_log`), exceptions of the
application's ``on_release`` in :attr:`PrefillEndpoint.callback_errors` (they change nothing).

A lease is reported ended (``on_release``, :meth:`~PrefillEndpoint.held`) only once no byte of
its blocks can still be read: messages not yet handed to ZeroMQ are dropped, and the release
waits for staging jobs still running and for zero-copy messages still queued in ZeroMQ.

The module is over 400 lines because it is one state machine run by one I/O thread (handshake,
dispatch, streams, failures and lease ends, which must be read together); leases, frame
building and DESCRIBE are their own modules.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import torch
import zmq

from layouts import (KVCacheError, LayoutDescriptor, LayoutError, LayoutMismatchError, ProtocolVersionError,
                     TransferError, TransferTimeoutError, check_compatible)
from .args import count, seconds
from .blocks import check_caches, device_ids, slice_bytes
from .describe import MAX_LISTED, describe_reply
from .dataplane import NIXL, ZMQ, NixlWriter, check_plane
from .device_frames import warm
from .error_log import ErrorLog, raised_at
from .leases import Lease, LeaseTable
from .metrics import Metrics
from .protocol import (CHECKSUM, MAX_LANES, MIX64, ErrorCode, Header, MsgType, choose_checksum, decode_header,
                       encode_header)
from .security import start_authenticator
from .sender import BufferPool, Stream
from .trace import Trace
from .transport import DEFAULT_HOST, CurveKeys, IOLoop, bind, make_socket


NIXL_INFLIGHT = 4   # NIXL writes a stream keeps in flight before it stages more
PUMP_S = 0.01   # longest send burst before the loop serves incoming messages and expiries again
LANES = 4   # connections a decode peer may send BLOCKS over (HELLO / HELLO_ACK ``lanes``), its first included
PRESTAGE_BYTES = 64 << 20   # CUDA caches: pinned bytes of first messages staged at publish, not yet pulled


def default_prestage_bytes(device) -> int:
    """``PrefillEndpoint``'s ``prestage_bytes`` when none is given: ``PRESTAGE_BYTES`` for caches
    on a CUDA ``device`` (staging only queues device work), else 0 (the kernels would run on the
    I/O thread at publish)."""
    return PRESTAGE_BYTES if torch.device(device).type == "cuda" else 0


def _typed(e: Exception, what: str) -> KVCacheError:
    """``e`` itself when typed, else a TransferError naming ``what`` failed, why and where (the
    innermost frame of ``e``'s traceback, which the endpoint's error log does not keep)."""
    if isinstance(e, KVCacheError):
        return e
    err = TransferError(f"{what}: {type(e).__name__}: {e}{raised_at(e)}")
    err.__cause__ = e
    return err


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
    frame_ops : FrameOps, optional
        Device kernels (``kernels.transfer.FRAME_OPS``): with them this side offers ``mix64``
        and, for peers that accept it, gathers and checksums on the device
        (:mod:`kvconnector.device_frames`).
    checksums : tuple of str, optional
        Checksum algorithms this side produces (default ``("mix64", "xxh3_64")`` with
        ``frame_ops``, else ``("xxh3_64",)``; ``mix64`` without ``frame_ops`` is computed by the
        host reference, slower than xxh3). A peer gets the first algorithm of its HELLO ``sums``
        listed here, else xxh3_64 (docs/PROTOCOL.md, "Checksums").
    data_plane : str
        ``"zmq"`` (payload frames in the BLOCKS messages), or ``"nixl"``: peers that offer a NIXL
        receive region get their payloads written there (:mod:`kvconnector.dataplane`); other
        peers still get ZeroMQ frames.
    prestage_bytes : int, optional
        With ``frame_ops`` and ``mix64`` offered first: :meth:`publish` stages each transfer's
        first message (gather + checksum on the device, copy to pinned memory) right away, while
        fewer than this many bytes of such messages wait for their pull; a pull of every head in
        ``mix64`` then sends it as soon as it arrives. 0: stage at the pull only. Default
        (:func:`default_prestage_bytes`): ``PRESTAGE_BYTES`` (64 MiB) for CUDA caches, where
        staging only queues device work, and 0 for CPU caches, where the kernels run on the I/O
        thread and would hold it up (a peer's handshake included) for as long as they take.
    lanes : int
        The most connections a decode peer may receive its BLOCKS on, its first included
        (docs/PROTOCOL.md, "Lanes"; 1: one connection per peer). Also the ZeroMQ I/O threads of
        this endpoint, so the lanes of a peer are served in parallel. Default ``LANES`` (4).

    Caches are checked at construction with :func:`kvconnector.blocks.check_caches` (the
    decode side applies the same rules). ``on_release`` is called with reason ``"failed"``
    when serving the transfer failed (the peer got ERROR ``serve_failed``).
    """

    def __init__(self, caches, descriptor: LayoutDescriptor, *, host: str = DEFAULT_HOST, port: int = 0,
                 on_release: Callable | None = None, lease_s: float = 30.0, chunk_bytes: int = 8 << 20,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0, max_frame_bytes: int = 1 << 20,
                 curve: CurveKeys | None = None, frame_ops=None, checksums: tuple | None = None,
                 data_plane: str = ZMQ, prestage_bytes: int | None = None, lanes: int = LANES) -> None:
        check_caches(caches, descriptor)
        count("port", port, 0, 65535), count("chunk_bytes", chunk_bytes, 1), count("max_frame_bytes", max_frame_bytes, 1)
        count("lanes", lanes, 1, MAX_LANES)
        self.lanes = lanes
        seconds("lease_s", lease_s, infinite=True), seconds("heartbeat_s", heartbeat_s)
        seconds("peer_timeout_s", peer_timeout_s)
        if prestage_bytes is not None:
            count("prestage_bytes", prestage_bytes, 0)
        self._nixl = NixlWriter() if check_plane(data_plane) == NIXL else None
        self._nixl_pending: dict = {}    # stream -> deque of (NIXL write or None, header frames) not yet sent
        self.frame_ops = frame_ops
        self.prestage_bytes = int(default_prestage_bytes(caches[0].device) if prestage_bytes is None
                                  else prestage_bytes)
        self._prestaged = 0      # bytes of first messages staged at publish and not yet pulled or dropped
        if frame_ops is not None:
            warm(frame_ops, caches[0].device)
        self.checksums = tuple(checksums or ((MIX64, CHECKSUM) if frame_ops is not None else (CHECKSUM,)))
        self.caches, self.descriptor, self.geometry = list(caches), descriptor, descriptor.geometry()
        self.on_release, self.lease_s, self.chunk_bytes = on_release, lease_s, chunk_bytes
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.metrics = Metrics("prefill")
        self.errors = ErrorLog()   # recorded failures (mismatches, bad frames), typed: the most recent
        self.callback_errors: list[tuple] = []   # (transfer_id, exception) raised by on_release
        self._fault_hook = None                  # tests: callable(stage) that may raise, see _hook
        self._leases = LeaseTable()
        self._outbox: list = []                  # (ident, frames, give_up_at): ERRORs the pipe refused
        self._peers: dict[bytes, dict] = {}      # ident -> {"ok": bool, "seen": t, "heads": range}
        self._streams: list[Stream] = []
        self._started: dict[tuple, tuple] = {}   # (tid, ident) -> (pull time, payload bytes, blocks) for metrics
        self._blocked_until = 0.0
        self._pool = BufferPool()
        self._stage_s = {"stage": 0.0, "copy_wait": 0.0, "send": 0.0, "sent": 0}   # see stage_times
        self.trace = Trace()                     # per-message spans while trace.enabled (kvconnector.trace)
        self.cuda = caches[0].is_cuda
        self._copy_stream = torch.cuda.Stream(device=caches[0].device) if self.cuda else None
        ctx = zmq.Context(io_threads=lanes)    # a peer's lanes on ZeroMQ I/O threads of their own
        self._zap = start_authenticator(ctx, curve)  # CURVE client allow-list (CurveServerKeys)
        sock = make_socket(ctx, zmq.ROUTER, max_frame_bytes=max_frame_bytes, curve=curve, server=True)
        self.endpoint, self.port = bind(sock, host, port)
        self._loop = IOLoop(ctx, sock, name=f"kvc-prefill-{self.port}", on_message=self._on_message,
                            on_tick=self._on_tick, on_error=self._on_error, trace=self.trace)
        self._loop.start()

    # ---- application API (any thread) -------------------------------------------------
    def publish(self, transfer_id: str, block_ids, lease_s: float | None = None, *,
                layers_ready: int | None = None, pulls: int = 1) -> None:
        """Hold ``block_ids`` (source blocks, in transfer order) under ``transfer_id``.

        ``pulls``: how many pulls of distinct head ranges the transfer serves, e.g. 2 when two
        decode ranks each pull their half of the heads; the lease ends once each has been
        acknowledged (or on ABORT, expiry, release). A PULL of a further head range is refused
        (ERROR ``already_pulled``); a PULL of heads already pulled restarts that pull (a retry).

        With ``frame_ops``, the first message is staged now (``prestage_bytes``): a serving engine
        publishes when the prompt's forward has written the blocks, some time before the decode
        worker's pull arrives, and that time hides the first message's gather and copy.

        ``layers_ready``: publish layer by layer: only layers ``0 .. layers_ready - 1`` hold
        their K/V yet; the rest are announced with :meth:`publish_layers` as the forward writes
        them, and a pull already streaming sends each layer as soon as it is announced. None
        (default): every layer is written.
        """
        ids = [int(b) for b in block_ids]
        if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > 256:
            raise ValueError(f"transfer_id: expected a non-empty str of <= 256 chars, got {transfer_id!r}")
        if not ids or min(ids) < 0 or max(ids) >= self.descriptor.num_blocks:
            raise LayoutError(f"block_ids: expected a non-empty list in [0, {self.descriptor.num_blocks}), got {ids[:8]}")
        count("pulls", pulls, 1, 1024)
        if lease_s is not None:
            seconds("lease_s", lease_s, infinite=True)
        ids_dev = None
        if self.cuda:   # off the pull's critical path; the copy stream waits for the event
            ready = torch.cuda.Event()
            ids_dev = (device_ids(ids, self.caches[0].device), ready)
            ready.record(torch.cuda.current_stream(self.caches[0].device))
        ready = None if layers_ready is None else max(0, min(int(layers_ready), self.descriptor.num_layers))
        lease = Lease(transfer_id, ids, time.monotonic() + (self.lease_s if lease_s is None else lease_s), ids_dev,
                      layers_ready=ready,
                      pulls=pulls)
        self._leases.add(lease)
        if ready is None and self.frame_ops is not None and self.checksums[0] == MIX64 and self.prestage_bytes > 0:
            self._loop.call_soon(self._prestage, lease)
        else:
            self._loop.call_soon(lambda: None)  # wake the loop so the new expiry is scheduled

    def publish_layers(self, transfer_id: str, layers_ready: int) -> None:
        """Layers ``0 .. layers_ready - 1`` of a layer-wise :meth:`publish` now hold their K/V (CUDA
        caches: written by work already queued on the current stream); a pull streaming the
        transfer sends them next. Raises TransferError when ``transfer_id`` is not published."""
        lease = self._leases.get(transfer_id)
        if lease is None:
            raise TransferError(f"publish_layers: transfer {transfer_id!r} is not published (or its lease ended)")
        ready = None
        if self.cuda:   # the gathers of these layers must follow the writes queued so far
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.caches[0].device))
        n = min(int(layers_ready), self.descriptor.num_layers)

        def mark():
            if ready is not None:
                self._copy_stream.wait_event(ready)
            if lease.layers_ready is not None and n > lease.layers_ready:
                lease.layers_ready = n
            self._blocked_until = 0.0   # streams waiting for a layer: try them now
        self._loop.call_soon(mark)

    def release(self, transfer_id: str, timeout_s: float = 5.0) -> bool:
        """End a lease now (reason ``"released"``); False if it was not held.

        A transfer being served stops (its peer gets ERROR ``released``). Returns once
        ``on_release`` has run, i.e. once no byte of the blocks can still be read (see the
        module doc); raises :class:`TransferTimeoutError` if that takes over ``timeout_s``
        (the release then completes later, ``on_release`` still runs once).
        """
        done = threading.Event()
        out = []

        def end():
            out.append(self._leases.get(transfer_id))
            self._end_lease(transfer_id, "released")
            done.set()
        self._loop.call_soon(end)
        t_end = time.monotonic() + timeout_s
        if not done.wait(timeout_s) or (out[0] is not None
                                        and not out[0].released.wait(max(0.0, t_end - time.monotonic()))):
            raise TransferTimeoutError(f"release {transfer_id!r}: blocks still being read after {timeout_s} s")
        return out[0] is not None

    def held(self) -> list[str]:
        """Transfer ids whose blocks are leased: published and not ended, or ended but still
        being read (a release waiting for ZeroMQ to let go of its messages)."""
        return self._leases.held()

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        s["leases"] = len(self.held())
        s["streams"] = len(self._streams)
        s["prestaged_bytes"] = self._prestaged   # first messages staged at publish, not yet pulled
        return s

    def stage_times(self) -> dict:
        """Seconds the I/O thread spent so far per stage of sending (``bench.transfer --threads``):
        ``stage`` (queue gathers and device-to-host copies, or gather and hash on the host),
        ``copy_wait`` (wait for a message's bytes to be in host memory; CPU caches without staging
        threads: gather and hash them), ``send`` (hand it to ZeroMQ); ``sent`` counts the messages,
        ``gathers`` (device kernels) the gather launches that staged them (one a group)."""
        return dict(self._stage_s)

    def close(self) -> None:
        if self._zap is not None:
            self._zap.stop()  # its socket must close before the loop terminates the context
        self._loop.close()
        if self._nixl is not None:
            self._nixl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- I/O thread ------------------------------------------------------------------
    def _send(self, ident: bytes, frames: list, track: bool = False):
        """Queue one message (zero copy); with ``track``, return a tracker that is done once
        ZeroMQ has let go of every payload frame (pyzmq's own tracks the last frame only)."""
        if not track:
            self._loop.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
            self.metrics.add("messages_sent")
            return None
        sock = self._loop.sock     # frames under the copy threshold are copied, as send_multipart does
        payload = [zmq.Frame(f, track=True, copy=None, copy_threshold=sock.copy_threshold) for f in frames[1:]]
        sock.send_multipart([ident, frames[0], *payload], zmq.NOBLOCK, copy=False)
        self.metrics.add("messages_sent")
        return zmq.MessageTracker(*payload)

    def _hook(self, stage: str) -> None:
        """Fault injection for tests: ``_fault_hook(stage)`` at each stage of serving a pull
        (``hello``, ``lookup``, ``stream``, ``gather``, ``checksum``, ``send``, ``release``)."""
        if self._fault_hook is not None:
            self._fault_hook(stage)

    def _reply(self, ident: bytes, h: Header) -> None:
        """Send a control message; one the peer's full pipe refuses (ERROR, PONG, HELLO_ACK, ...)
        waits in the outbox, as does every later one to that peer, so replies keep their order
        (sent once the peer reads again, given up after ``peer_timeout_s``): a peer that reads its
        replies late still gets the PONG or HELLO_ACK it waits for."""
        frames = [encode_header(h)]
        if any(i == ident for i, _, _ in self._outbox):
            self._outbox.append((ident, frames, time.monotonic() + self.peer_timeout_s))
            return None
        try:
            self._send(ident, frames)
        except zmq.Again:
            self._outbox.append((ident, frames, time.monotonic() + self.peer_timeout_s))
        except zmq.ZMQError:
            pass  # peer gone (ROUTER_MANDATORY): nobody to tell

    def _flush_outbox(self, now: float) -> None:
        keep = []
        for ident, frames, give_up_at in self._outbox:
            if now > give_up_at or any(i == ident for i, _, _ in keep):
                if now <= give_up_at:
                    keep.append((ident, frames, give_up_at))
                continue
            try:
                self._send(ident, frames)
            except zmq.Again:
                keep.append((ident, frames, give_up_at))
            except zmq.ZMQError:
                pass
        self._outbox = keep

    def _end_lease(self, tid: str, reason: str, code: ErrorCode | None = None, msg: str = "",
                   by: bytes | None = None) -> bool:
        """End the lease of ``tid``: its streams stop; peers still being served get ERROR
        ``code`` (default: from the reason; on ACK / ABORT from peer ``by``, the other peers whose
        pull was not acknowledged); ``on_release`` runs once no byte of the blocks can still be
        read (:meth:`_drain`). False when ``tid`` holds no lease."""
        lease = self._leases.end(tid, reason)
        if lease is None:
            return False
        for key in [k for k in self._started if k[0] == tid]:
            del self._started[key]
        unpulled = self._detach_prestaged(lease)   # staged at publish and never pulled
        if unpulled is not None:
            unpulled.cancel()
        for s in [s for s in self._streams if s.tid == tid]:
            self._streams.remove(s)
            s.cancel()
        code = code or {"expired": ErrorCode.LEASE_EXPIRED, "released": ErrorCode.RELEASED}.get(reason)
        if code is not None:   # every peer that pulled it: a pull still waiting fails now, not by deadline
            for ident in lease.peers:
                self._reply(ident, Header(MsgType.ERROR, tid=tid, code=code,
                                          msg=msg or f"transfer {tid!r}: lease ended ({reason}) before it was sent"))
        else:                  # ACK / ABORT from ``by``: the other pulls not acknowledged cannot complete
            code = ErrorCode.ALREADY_PULLED if reason == "acked" else ErrorCode.ABORTED
            for ident in lease.waiting - {by}:
                self._reply(ident, Header(MsgType.ERROR, tid=tid, code=code,
                                          msg=f"transfer {tid!r}: {reason} by another peer before it was sent"))
        if reason == "expired":
            self.metrics.fail("lease_expired")
        self._drain()
        return True

    def _drain(self) -> None:
        """Run ``on_release`` for each ended lease whose blocks are no longer read."""
        for lease in self._leases.drained():
            lease.streams.clear()
            try:
                self._hook("release")
            except Exception as e:
                self.errors.append(_typed(e, f"releasing transfer {lease.transfer_id!r}"))
            try:
                if self.on_release is not None:
                    self.on_release(lease.transfer_id, lease.block_ids, lease.reason)
            except Exception as e:  # the application's callback: recorded, the lease is ended anyway
                self.callback_errors.append((lease.transfer_id, e))
                self.metrics.ignore("callback_error")
            self._leases.forget(lease)
            lease.released.set()

    def _on_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.metrics.ignore(f"error:{type(e).__name__}")

    def _on_message(self, frames) -> None:
        ident = frames[0].bytes
        try:
            self._dispatch(ident, frames[1:])
        except Exception as e:  # a handler failed: the peer hears it now instead of waiting out a deadline
            err = _typed(e, "handling a message")
            self.errors.append(err)
            self.metrics.ignore(f"error:{type(e).__name__}")
            tid = getattr(e, "tid", "")
            self._reply(ident, Header(MsgType.ERROR, tid=tid, code=ErrorCode.INTERNAL, msg=str(err)[:500]))

    def _dispatch(self, ident: bytes, rest) -> None:
        self.metrics.add("messages_received")
        if not rest:
            self._seen(ident)
            return self.metrics.ignore("empty_message")
        try:
            h = decode_header(rest[0].buffer)
        except ProtocolVersionError as e:
            self._seen(ident)
            self.errors.append(e)
            self.metrics.fail("protocol_version")
            return self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.BAD_MESSAGE, msg=str(e)))
        except TransferError as e:
            self._seen(ident)
            self.errors.append(e)
            self.metrics.ignore("corrupt_header")
            return self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.BAD_MESSAGE, msg=str(e)))
        if h.type == MsgType.LANE:    # a lane is no peer of its own: it only carries BLOCKS to one
            return self._lane(ident, h)
        peer = self._seen(ident)
        if h.type == MsgType.HELLO:
            self._hook("hello")
            return self._hello(ident, peer, h)
        if h.type == MsgType.PING:
            if not peer["ok"]:  # e.g. this process restarted under a live peer: make it re-handshake
                self._reply(ident, Header(MsgType.ERROR, code=ErrorCode.HANDSHAKE_REQUIRED,
                                          msg="send HELLO with a compatible descriptor first"))
            return self._reply(ident, Header(MsgType.PONG))
        if h.type == MsgType.PONG:
            return None
        if h.type == MsgType.DESCRIBE:   # answered before any handshake: see kvconnector/describe.py
            return self._reply(ident, describe_reply(self.descriptor, self._leases.listing(MAX_LISTED)))
        if not peer["ok"]:
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.HANDSHAKE_REQUIRED,
                                             msg="send HELLO with a compatible descriptor first"))
        if h.type == MsgType.PULL:
            try:
                return self._pull(ident, peer, h)
            except Exception as e:
                e.tid = h.tid   # _on_message names the transfer in its ERROR
                raise
        if h.type == MsgType.ACK:
            return self._ack(ident, h.tid)
        if h.type == MsgType.ABORT:
            if not self._end_lease(h.tid, "aborted", by=ident):
                self.metrics.ignore("duplicate_aborted")
            return None
        self.metrics.ignore(f"unexpected_{h.type.name}")

    def _seen(self, ident: bytes) -> dict:
        peer = self._peers.setdefault(ident, {"ok": False, "seen": 0.0, "heads": None, "lanes": [], "rr": 0})
        peer["seen"] = time.monotonic()
        return peer

    def _lane(self, ident: bytes, h: Header) -> None:
        """LANE: connection ``ident`` is lane ``h.lanes`` (1 .. granted - 1) of peer ``h.peer`` and
        carries its BLOCKS too, in place of any earlier connection of that lane (a lane that
        reconnected has a new routing id); ignored for no accepted peer or a lane not granted."""
        main = self._peers.get(h.peer)
        if main is None or not main["ok"] or ident in self._peers or not 1 <= h.lanes <= len(main["lanes"]):
            return self.metrics.ignore("lane")
        if main["lanes"][h.lanes - 1] != ident:
            main["lanes"][h.lanes - 1] = ident
            self.metrics.add("lanes_opened")

    def _route(self, ident: bytes) -> bytes:
        """The connection a peer's next BLOCKS goes out on: its first one and its open lanes in turn."""
        peer = self._peers.get(ident)
        if peer is None or not peer["lanes"]:
            return ident
        ways = [ident, *(lane for lane in peer["lanes"] if lane is not None)]
        peer["rr"] = (peer["rr"] + 1) % len(ways)
        return ways[peer["rr"]]

    def _drop_lane(self, ident: bytes, lane: bytes) -> None:
        """A lane the ROUTER can no longer reach (its connection is gone) carries nothing more
        until a LANE names its new connection."""
        peer = self._peers.get(ident)
        if peer is not None and lane in peer["lanes"]:
            peer["lanes"][peer["lanes"].index(lane)] = None
            self.metrics.ignore("lane_unreachable")

    def _ack(self, ident: bytes, tid: str) -> None:
        """Peer ``ident`` has every block of its pull of ``tid``: the lease ends once every
        head range it was published for (``pulls``) is acknowledged."""
        lease = self._leases.get(tid)
        heads = None if lease is None else lease.peers.get(ident)
        if heads is None:      # the lease ended already (a duplicate), or this peer never pulled it
            return self.metrics.ignore("duplicate_acked" if lease is None else "ack_without_pull")
        started = self._started.pop((tid, ident), None)
        if started is not None:
            t0, nbytes, num_blocks = started
            self.metrics.completed(nbytes, time.monotonic() - t0, num_blocks)
        lease.acked.add(heads)
        lease.waiting.discard(ident)
        if len(lease.acked) >= lease.pulls:
            self._end_lease(tid, "acked", by=ident)

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
        peer["sum"] = choose_checksum(h.sums, self.checksums)
        peer["nixl"] = None
        if self._nixl is not None and h.nixl:
            try:
                peer["nixl"] = self._nixl.add_peer(h.nixl)
            except TransferError as e:   # this peer gets ZeroMQ frames
                self.errors.append(e)
        # lanes: extra connections of this peer that BLOCKS go out on too (ZeroMQ frames only); a
        # handshake starts them over (the peer sends LANE again on each after this HELLO_ACK)
        granted = 1 if peer["nixl"] else max(1, min(h.lanes, self.lanes))
        peer["lanes"] = [None] * (granted - 1)     # lane k's connection, once its LANE came
        self._reply(ident, Header(MsgType.HELLO_ACK, desc=mine, ok=True, sum=peer["sum"] if h.sums else "",
                                  sums=list(self.checksums) if h.sums else [], plane=NIXL if peer["nixl"] else "",
                                  lanes=granted if h.lanes else 0, peer=ident if granted > 1 else b""))

    def _pull(self, ident: bytes, peer: dict, h: Header) -> None:
        self._hook("lookup")
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
        heads = tuple(h.heads)
        taken = set(lease.peers.values()) | lease.acked
        if heads not in taken and len(taken) >= lease.pulls:
            return self._reply(ident, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.ALREADY_PULLED,
                                             msg=f"transfer {h.tid!r}: published for {lease.pulls} pull(s), taken "
                                                 f"by heads {sorted(map(list, taken))}"))
        for s in [s for s in self._streams if s.tid == h.tid and s.global_heads == heads]:   # a retried pull restarts
            self._streams.remove(s)
            s.cancel()
        for other in [i for i, hd in lease.peers.items() if hd == heads and i != ident]:   # another peer's: taken over
            del lease.peers[other]
            lease.waiting.discard(other)
            self._reply(other, Header(MsgType.ERROR, tid=h.tid, code=ErrorCode.ALREADY_PULLED,
                                      msg=f"transfer {h.tid!r}: a newer pull of the same heads took over"))
        local = range(h.heads[0] - d.head_start, h.heads[1] - d.head_start)
        lease.peers[ident] = heads
        lease.waiting.add(ident)
        algorithm = peer.get("sum", CHECKSUM)
        stream = self._take_prestaged(lease, ident, local, algorithm, peer)
        try:
            self._hook("stream")
            stream = stream or self._stream(ident, lease, local, h.heads, algorithm,
                                            at_base=h.at if peer.get("nixl") else None)
        except Exception as e:
            return self._serve_failed(ident, h.tid, e, stream)   # a prestaged stream is cancelled
        if stream not in lease.streams:
            lease.streams.append(stream)
        self._streams.append(stream)
        self.metrics.add("transfers_started")
        nbytes = len(self.caches) * slice_bytes(self.geometry, len(lease.block_ids), local)
        self._started[(h.tid, ident)] = (time.monotonic(), nbytes, len(lease.block_ids) * len(self.caches))

    def _prestage(self, lease: Lease) -> None:
        """I/O thread, after :meth:`publish`: stage the first message of every head in ``mix64``
        (:meth:`Stream.prestage`) while the bytes so staged stay within ``prestage_bytes``. A
        failure here only costs the head start: the pull stages again and reports its own."""
        if (self._leases.get(lease.transfer_id) is not lease or lease.streams
                or self._prestaged >= self.prestage_bytes):
            return   # ended, or already pulled, or the budget is spent
        n, start = self.geometry.num_kv_heads, self.descriptor.head_start
        try:
            s = self._stream(b"", lease, range(n), (start, start + n), MIX64)
            s.prestage()
        except Exception as e:
            self.metrics.ignore(f"prestage_failed:{type(e).__name__}")
            return
        lease.streams.append(s)   # read the blocks: the lease drains only once it no longer does
        lease.prestaged = s
        self._prestaged += s.prestaged

    def _stream(self, ident: bytes, lease: Lease, local: range, heads: tuple, algorithm: str,
                at_base: int | None = None) -> Stream:
        """A stream of ``lease``'s blocks to peer ``ident``: ``local`` heads of this endpoint's
        caches (global ``heads``), checksummed with ``algorithm`` (by the device kernels for
        ``mix64``), payloads into the peer's NIXL region at ``at_base`` when given."""
        return Stream(ident, lease.transfer_id, lease.block_ids, self.caches, self.geometry, local, heads,
                      self.chunk_bytes, self._copy_stream, self._pool, lease.ids_dev, fault_hook=self._fault_hook,
                      algorithm=algorithm, frame_ops=self.frame_ops if algorithm == MIX64 else None,
                      at_base=at_base, timings=self._stage_s, trace=self.trace,
                      layers_ready=(lambda: lease.layers_ready) if lease.layers_ready is not None else None)

    def _detach_prestaged(self, lease: Lease) -> Stream | None:
        """The lease's stream staged at publish, now held by neither the lease nor the budget
        (``prestage_bytes``); None when it has none."""
        s, lease.prestaged = lease.prestaged, None
        if s is not None:
            self._prestaged -= s.prestaged
        return s

    def _take_prestaged(self, lease: Lease, ident: bytes, local: range, algorithm: str, peer: dict) -> Stream | None:
        """The lease's prestaged stream when this pull asks for what it holds (every head, ``mix64``,
        ZeroMQ frames), else None; either way the lease holds none afterwards (one not taken is
        cancelled, and drains as any stream)."""
        s = self._detach_prestaged(lease)
        if s is None:
            return None
        if (algorithm == MIX64 and not peer.get("nixl") and local == s.local_heads
                and lease.layers_ready is None):
            s.serve(ident, self._fault_hook)
            return s
        s.cancel()
        return None

    def _on_tick(self, now: float) -> float:
        expired, next_exp = self._leases.expired(now)
        next_exp = now + 1.0 if next_exp is None else next_exp
        for tid in expired:
            self._end_lease(tid, "expired")
        if self._leases.draining:
            self._drain()
        for ident, peer in list(self._peers.items()):
            if now - peer["seen"] > self.peer_timeout_s:
                del self._peers[ident]
                dropped = [s for s in self._streams if s.ident == ident]
                if dropped:
                    self.metrics.fail("peer_timeout")
                for s in dropped:
                    self._streams.remove(s)
                    s.cancel()
        if self._outbox:
            self._flush_outbox(now)
        wait = min(max(0.0, next_exp - now), self.heartbeat_s, self._pump(now))
        return min(wait, 0.002) if self._leases.draining or self._outbox else wait

    def _serve_failed(self, ident: bytes, tid: str, e: Exception, stream: Stream | None = None) -> None:
        """Serving ``tid`` to ``ident`` raised ``e``: record it, end the lease (``"failed"``) and
        tell the peer at once (ERROR serve_failed naming the cause)."""
        err = _typed(e, f"serving transfer {tid!r}")
        self.errors.append(err)
        self.metrics.fail("serve_failed")
        if stream is not None:
            if stream in self._streams:
                self._streams.remove(stream)
            stream.cancel()
        msg = f"transfer {tid!r}: serving failed: {type(err).__name__}: {err}"[:500]
        if not self._end_lease(tid, "failed", ErrorCode.SERVE_FAILED, msg):   # lease already gone
            self._reply(ident, Header(MsgType.ERROR, tid=tid, code=ErrorCode.SERVE_FAILED, msg=msg))

    def _flush_nixl(self, s: Stream) -> bool:
        """Send the BLOCKS headers of stream ``s`` whose NIXL writes are in the peer's region, in
        order; True if any went. Raises what a failed write raises."""
        pending, sent = self._nixl_pending[s], False
        while pending and (pending[0][0] is None or pending[0][0].poll()):
            try:
                self._send(s.ident, pending[0][1])
            except zmq.Again:                      # the peer's queue is full: the header stays first
                break
            pending.popleft()
            sent = True
        return sent

    def _drop_nixl(self) -> None:
        """Writes of streams no longer served (failed, cancelled, peer gone) are abandoned: their
        handles are released once NIXL has finished them."""
        for s in [s for s in self._nixl_pending if s not in self._streams]:
            for w, _ in self._nixl_pending.pop(s):
                if w is not None:
                    self._nixl.abandon(w)
        self._nixl.reap()

    def _pump(self, now: float) -> float:
        """Send one message per stream, round-robin, until every stream is done or blocked."""
        if self._nixl is not None:
            self._drop_nixl()
        if not self._streams or now < self._blocked_until:
            return max(0.0, self._blocked_until - now) if self._streams else 1.0
        for _ in range(64):  # bounded (rounds and time) so ACK/PULL/PING and lease expiry keep being served
            if time.monotonic() - now > PUMP_S:
                break
            progressed = False
            for s in list(self._streams):
                if s in self._nixl_pending:
                    try:
                        progressed |= self._flush_nixl(s)
                    except Exception as e:
                        self._serve_failed(s.ident, s.tid, e, s)
                        continue
                    if len(self._nixl_pending[s]) >= NIXL_INFLIGHT:
                        continue
                try:
                    frames = s.next_frames()
                    if frames:
                        self._hook("send")
                except Exception as e:
                    self._serve_failed(s.ident, s.tid, e, s)
                    continue
                if frames is None:
                    if not self._nixl_pending.get(s):  # every header sent
                        self._streams.remove(s)
                        self._nixl_pending.pop(s, None)
                    continue
                if not frames:                     # its buffers are still queued in ZeroMQ
                    continue
                to = s.ident
                try:
                    nixl = s.at_base is not None and self._peers.get(s.ident, {}).get("nixl")
                    if nixl:   # payload into the peer's region first; the header follows once it is there
                        write = self._nixl.start(nixl, frames[1:], decode_header(frames[0]).at) if len(frames) > 1 \
                            else None
                        s.sent(write)              # the pooled buffer is free once NIXL has read it
                        self._nixl_pending.setdefault(s, deque()).append((write, frames[:1]))
                        self._flush_nixl(s)
                    else:
                        t0 = time.perf_counter()
                        to = self._route(s.ident)
                        s.sent(self._send(to, frames, track=s.last_buffer is not None or s.last_reads_cache))
                        if to != s.ident:
                            self.metrics.add("messages_sent_on_lanes")
                        t1 = time.perf_counter()
                        self._stage_s["send"] += t1 - t0
                        self._stage_s["sent"] += 1
                        if self.trace.enabled:
                            self.trace.span("send", t0, t1, tid=s.tid, seq=s.last_seq)
                except zmq.Again:
                    s.push_back(frames)            # peer's queue is full: retry shortly
                    continue
                except zmq.ZMQError:               # EHOSTUNREACH: the peer (or that lane) disconnected
                    if to != s.ident:              # a lane: the message goes out on the peer's others
                        self._drop_lane(s.ident, to)
                        s.push_back(frames)
                        continue
                    self._streams.remove(s)
                    s.cancel()
                    self.metrics.fail("peer_unreachable")
                    continue
                except Exception as e:
                    self._serve_failed(s.ident, s.tid, e, s)
                    continue
                progressed = True
                self.metrics.add("bytes_sent", s.last_payload_bytes)
            if not self._streams:
                return 1.0
            if not progressed:
                self._blocked_until = now + 0.001
                return 0.001
        return 0.0
