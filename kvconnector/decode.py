"""Decode side: owns the caches blocks land in; DEALER socket; pulls with deadlines.

Every BLOCKS message is checked before one byte reaches a cache: its transfer must be
pending (else it is *late* and ignored), its layer / positions / head range must fit the
pull, positions already received are *duplicates* and ignored, the payload byte count must
equal what the local layout says (``2·N·h·P`` per block) and the xxh3_64 checksum must
match. A failed check fails the pull with a typed error, reports the destination blocks
that did not land, and sends ABORT so the prefill side releases its lease.

With the device kernels given (``frame_ops``) this side offers ``mix64`` in its HELLO; a
prefill that accepts sends ``mix64`` BLOCKS, which the I/O thread receives zero copy, checks and
hands to the endpoint's landing thread (:mod:`kvconnector.landing`): it copies the payload into a
pooled pinned buffer piece by piece behind the device copies, and the device verifies + scatters
it (:mod:`kvconnector.device_frames`), while the I/O thread already receives the next message. A
frame that does not match fails the pull with :class:`CorruptFrameError` and none of that
message's rows is written.

An ERROR from the prefill side about a pending pull fails it at once with :class:`PeerError`
(its ``code`` attribute holds the ERROR's code); an ERROR while the handshake is waiting
fails :meth:`DecodeEndpoint.connect` the same way. Any other exception while writing a
pull's blocks fails that pull (``write_error``) instead of leaving it to its deadline.

The module is over 400 lines because it is one state machine run by one I/O thread: the
handshake, the pull table, the checks above and which path lands a message (host-verified,
device-verified, from frames or from a NIXL region) read top to bottom in one place; the
writes themselves (:mod:`kvconnector.host_writes`, :mod:`kvconnector.landing`) and the other
reusable pieces (frames, staging, the device passes, the data planes, the handle) are their own
modules.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from layouts import (CorruptFrameError, LayoutDescriptor, LayoutError, LayoutMismatchError, PeerError,
                     ProtocolVersionError, TransferError, TransferTimeoutError, check_compatible)
from .args import count, seconds
from .blocks import check_caches, device_ids, slice_bytes
from .handle import PullHandle
from .metrics import Metrics
from .dataplane import NIXL, ZMQ, NixlReceiver, check_plane
from .device_frames import frame_views, warm
from .error_log import ErrorLog, raised_at
from .host_writes import HostWrites
from .landing import Lander, LandJob
from .protocol import (CHECKSUM, MAX_LANES, MIX64, ErrorCode, Header, MsgType, blocks_tid, check_frames,
                       decode_header, encode_header)
from .staging import PinnedPool, stage_verified
from .trace import Trace
from .transport import CurveKeys, IOLoop, make_socket

INLINE_BYTES = 256 << 10   # smaller messages are written on the I/O thread (a hand-off costs more)
RECV_BYTES = 64 << 20      # recv_into: pooled pinned bytes held at once (received or landing, not yet landed; 8
#                            messages of 8 MiB, 64 of 1 MiB); while as many are held, messages arrive zero copy
#                            (ZeroMQ's own memory), so a backlog behind a slow device never makes the I/O thread
#                            allocate pinned memory message by message; the pool keeps as many bytes for reuse
# pyzmq >= 26.4 can receive a frame into a caller's buffer (``recv_into``: mix64 frames straight into a
# pooled pinned buffer, one memcpy inside libzmq with the GIL released, on the I/O thread); without it
# they arrive as zero-copy zmq Frames and the landing thread has the copy workers copy them into that
# buffer, which costs the Python threads of the process GIL hand-offs per piece (docs/DESIGN_NOTES.md).
RECV_INTO = hasattr(zmq.Socket, "recv_into")
CUDA_LANES = 4      # connections to the prefill that BLOCKS come over, CUDA caches (default_lanes)
PREPARE_S = 5.0     # the I/O thread waits at most this long at a pull's first BLOCKS for pull() to have made its
#                     device ids and start event (CUDA caches; pull() makes them just after the PULL leaves)
LANE_WAIT_S = 1.0   # connect() waits at most this long (within its timeout) for the granted lanes' handshakes


def default_recv_into(device) -> bool:
    """``DecodeEndpoint``'s ``recv_into`` when none is given: True for caches on a CUDA ``device``
    where pyzmq has ``Socket.recv_into`` (the faster receive there, docs/BENCHMARKS.md), else False."""
    return RECV_INTO and torch.device(device).type == "cuda"


def default_lanes(device) -> int:
    """``DecodeEndpoint``'s ``lanes`` when none is given: ``CUDA_LANES`` connections for caches on a
    CUDA ``device`` on a host of 8 cores or more (one TCP connection is ZeroMQ's pace on loopback;
    several carry more, docs/BENCHMARKS.md), else 1."""
    return CUDA_LANES if torch.device(device).type == "cuda" and (os.cpu_count() or 1) >= 8 else 1


def default_copy_threads() -> int:
    """Copy workers per endpoint: none on small hosts (the I/O thread writes; a hand-off
    only adds work when every core is busy), else one per four cores, at most four."""
    cores = os.cpu_count() or 1
    return 0 if cores <= 4 else min(4, cores // 4)


class DecodeEndpoint:
    """Pull published blocks from one prefill endpoint into local caches.

    Parameters
    ----------
    caches : list of [num_blocks, 2, block_size, num_kv_heads, P] tensors, CPU or CUDA
        One packed cache per layer, written in place by pulls; matching ``descriptor``.
    descriptor : LayoutDescriptor
    heartbeat_s, peer_timeout_s : float
        PING period; a peer silent for ``peer_timeout_s`` fails every pending pull with
        :class:`TransferTimeoutError`.
    max_frame_bytes : int
        Largest frame accepted from the peer (ZeroMQ drops the connection beyond it).
    copy_threads : int, optional
        Threads that verify and write BLOCKS messages in parallel with the I/O thread (each
        message is still verified before any of its bytes is written); for CUDA caches they
        also stage, launch the device copies and wait for them; for ``mix64`` messages received
        zero copy (``recv_into`` off, or a receive backlog) they copy the pieces of a payload into
        pinned memory for the landing thread. 0 does it all on the I/O thread (``mix64``: on the
        landing thread). Default :func:`default_copy_threads`.
    frame_ops : FrameOps, optional
        Device kernels (``kernels.transfer.FRAME_OPS``): this side then offers ``mix64`` and
        verifies + scatters such messages on the device (module doc).
    checksums : tuple of str, optional
        Algorithms offered in HELLO, preferred first (default ``("mix64", "xxh3_64")`` with
        ``frame_ops``, else ``("xxh3_64",)``, which sends no offer at all, like earlier clients).
    data_plane : str
        ``"zmq"``, or ``"nixl"``: offer a NIXL receive region of ``nixl_region_bytes`` (each pending
        pull holds ``num_layers · blocks · 2·N·h·P`` of it); a prefill that accepts writes the
        payloads there (:mod:`kvconnector.dataplane`), else frames arrive as usual.
    recv_into : bool, optional
        ``mix64`` payloads: True receives them with ``Socket.recv_into`` straight into a pooled
        pinned buffer (one memcpy inside libzmq, on the I/O thread; pyzmq 26.4+); False receives
        them zero copy and the landing thread copies them into that buffer (with the copy workers
        where there are some). Default: :func:`default_recv_into` (True for CUDA caches where
        pyzmq has ``recv_into``, the faster of the two there, docs/BENCHMARKS.md "CUDA caches with
        the device passes"; else False).
    lanes : int, optional
        Connections BLOCKS may arrive on, this endpoint's first included (1..64; docs/PROTOCOL.md,
        "Lanes"): offered in HELLO; the prefill grants at most its own ``lanes``, and the extra
        connections are opened after the handshake, all received by the I/O thread;
        :meth:`connect` returns once they are up too (waiting at most ``LANE_WAIT_S`` for them), so
        the first pull has them. Default: :func:`default_lanes`.
    """

    def __init__(self, caches, descriptor: LayoutDescriptor, *, heartbeat_s: float = 0.5,
                 peer_timeout_s: float = 3.0, max_frame_bytes: int = 1 << 30,
                 curve: CurveKeys | None = None, copy_threads: int | None = None, frame_ops=None,
                 checksums: tuple | None = None, data_plane: str = ZMQ, nixl_region_bytes: int = 256 << 20,
                 recv_into: bool | None = None, lanes: int | None = None) -> None:
        check_caches(caches, descriptor)
        self.lanes = default_lanes(caches[0].device) if lanes is None else lanes
        count("lanes", self.lanes, 1, MAX_LANES)
        self._lane_socks: list = []   # extra DEALER connections BLOCKS may arrive on (HELLO_ACK ``lanes``)
        self._lane_peer, self._lanes_granted = b"", 1
        self._lanes_said: set = set()           # lanes that said LANE since their connection's handshake
        self._lanes_up = threading.Event()      # set once every granted lane said LANE (connect waits, bounded)
        seconds("heartbeat_s", heartbeat_s), seconds("peer_timeout_s", peer_timeout_s)
        count("max_frame_bytes", max_frame_bytes, 1), count("nixl_region_bytes", nixl_region_bytes, 1)
        self._nixl = NixlReceiver(nixl_region_bytes) if check_plane(data_plane) == NIXL else None
        self.plane = ZMQ              # what the prefill said it uses (HELLO_ACK ``plane``)
        self.frame_ops = frame_ops
        if frame_ops is not None:
            warm(frame_ops, caches[0].device)
        if recv_into and not RECV_INTO:
            raise ValueError(f"recv_into=True: pyzmq {zmq.__version__} has no Socket.recv_into (26.4+ has)")
        if recv_into is None:
            recv_into = default_recv_into(caches[0].device)
        self.recv_into = bool(recv_into)
        self.checksums = tuple(checksums or ((MIX64, CHECKSUM) if frame_ops is not None else (CHECKSUM,)))
        self.checksum = CHECKSUM      # what the prefill said it uses (HELLO_ACK ``sum``)
        self.peer_checksums: tuple = ()   # what the prefill said it can produce (HELLO_ACK ``sums``)
        self._rx = None               # (pinned buffer, header) the payload of the message being handled went into
        self.caches, self.descriptor, self.geometry = list(caches), descriptor, descriptor.geometry()
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.max_frame_bytes, self.curve = max_frame_bytes, curve
        self.metrics = Metrics("decode")
        self.trace = Trace()                 # per-message spans while trace.enabled (kvconnector.trace)
        self.errors = ErrorLog()   # recorded failures (mismatches, bad frames), typed: the most recent
        self.remote: LayoutDescriptor | None = None
        self.shared_heads: range | None = None
        self._pending: dict[str, PullHandle] = {}
        self._gpu_writes: deque = deque()    # queued xxh3 device writes, in order: (event, handle, BLOCKS header,
        #                                      pinned buffers to hand back)
        self._hs_done = threading.Event()
        self._hs_error: Exception | None = None
        self._last_seen = self._last_ping = 0.0
        self._loop: IOLoop | None = None
        self.cuda = caches[0].is_cuda
        self._copy_stream = torch.cuda.Stream(device=caches[0].device) if self.cuda else None
        self._head_block_bytes = slice_bytes(self.geometry, 1, range(1))   # one head of one block
        self._pinned = PinnedPool(RECV_BYTES) if self.cuda or frame_ops is not None else None
        self._host = HostWrites(self.caches, self.geometry, self._copy_stream, self._pinned)   # xxh3 messages
        n = default_copy_threads() if copy_threads is None else copy_threads
        self._workers = ThreadPoolExecutor(n, thread_name_prefix="kvc-decode-copy") if n else None
        self._lander = None if frame_ops is None else Lander(
            frame_ops, self._copy_stream, self._pinned, report=lambda done: self._loop.call_soon(self._landed_jobs, done),
            alive=lambda job: self._pending.get(job.p.transfer_id) is job.p, executor=self._workers, workers=n,
            trace=self.trace)

    # ---- application API --------------------------------------------------------------
    def connect(self, endpoint: str, timeout_s: float = 5.0) -> range:
        """Connect and handshake; return the global KV heads both sides hold.

        Raises
        ------
        LayoutMismatchError
            Listing every differing field (this side's check, or the peer's diffs).
        ProtocolVersionError
            The peer speaks another protocol version.
        TransferTimeoutError
            No HELLO_ACK within ``timeout_s``.
        """
        seconds("timeout_s", timeout_s)
        if self._loop is not None:
            raise TransferError("already connected; use a new DecodeEndpoint per prefill peer")
        ctx = zmq.Context(io_threads=self.lanes)    # each lane's TCP connection on a ZeroMQ I/O thread of its own
        sock = make_socket(ctx, zmq.DEALER, max_frame_bytes=self.max_frame_bytes, curve=self.curve)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            ctx.term()
            raise TransferError(f"cannot connect to {endpoint}: {e}") from e
        self.peer_endpoint = endpoint
        self._loop = IOLoop(ctx, sock, name="kvc-decode", on_message=self._on_message,
                            on_tick=self._on_tick, on_error=self._on_error,
                            on_header=self._receive_into if self.frame_ops is not None and self.recv_into else None,
                            trace=self.trace)
        self._loop.start()
        self._loop.call_soon(self._send_hello)
        t0 = time.monotonic()
        if not self._hs_done.wait(timeout_s):
            self.metrics.fail("handshake_timeout")
            raise TransferTimeoutError(f"handshake with {endpoint}: no HELLO_ACK within {timeout_s} s")
        if self._hs_error is not None:
            raise self._hs_error
        # the granted lanes' own handshakes, so the first pull has them too (a lane slower than this
        # joins later: BLOCKS keep to the others meanwhile)
        self._lanes_up.wait(max(0.0, min(LANE_WAIT_S, timeout_s - (time.monotonic() - t0))))
        return self.shared_heads

    def pull(self, transfer_id: str, dst_block_ids, *, deadline_s: float = 30.0, heads: range | None = None,
             on_layer: Callable | None = None) -> PullHandle:
        """Start pulling ``transfer_id`` into ``dst_block_ids`` (one per published block).

        Parameters
        ----------
        heads : range, optional
            Global KV heads to fetch; default: every head both sides hold.
        on_layer : callable(transfer_id, layer), optional
            Called on the I/O thread as each layer has fully landed; an exception it raises
            goes to the handle's ``callback_errors`` and changes nothing else.

        CUDA caches: the blocks are written after the work queued on the caller's current stream
        before this call (e.g. kernels still reading the blocks' old contents), not after work
        queued later.
        """
        seconds("deadline_s", deadline_s)
        if self.shared_heads is None:
            raise PeerError("pull before a successful connect()")
        ids = [int(b) for b in dst_block_ids]
        nb = self.descriptor.num_blocks
        if not ids or min(ids) < 0 or max(ids) >= nb or len(set(ids)) != len(ids):
            raise LayoutError(f"dst_block_ids: expected distinct ids in [0, {nb}), got {ids[:8]}...")
        heads = self.shared_heads if heads is None else heads
        if not (self.shared_heads.start <= heads.start < heads.stop <= self.shared_heads.stop):
            raise LayoutError(f"heads: expected a range inside {self.shared_heads}, got {heads}")
        h = PullHandle(transfer_id, ids, self.descriptor.num_layers, (heads.start, heads.stop),
                       time.monotonic() + deadline_s, on_layer)
        if not self.cuda:
            self._loop.call_soon(self._start_pull, h)
            return h
        # CUDA: the PULL leaves first; meanwhile this thread copies the ids to the device and records the
        # event every write of this pull waits for (the ids' copy and the work queued so far on the caller's
        # stream, e.g. reads of these blocks' old contents). The I/O thread waits for both at the first BLOCKS.
        h.preparing = threading.Event()
        self._loop.call_soon(self._start_pull, h)
        try:
            device = self.caches[0].device
            h.dst_dev = device_ids(ids, device)
            h.ready = torch.cuda.Event()
            h.ready.record(torch.cuda.current_stream(device))
        except BaseException as e:
            h.prepare_error = e
            self._loop.call_soon(self._abort_prepared, h)
            raise
        finally:
            h.preparing.set()
        return h

    def abort(self, transfer_id: str) -> None:
        """Give up on a transfer: its pull fails with PeerError and the prefill lease is released."""
        self._loop.call_soon(self._abort, transfer_id)

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        s["pending"] = len(self._pending)
        return s

    def peer_silent_s(self) -> float:
        """Seconds since the prefill was last heard from (a PONG every ``heartbeat_s`` while it
        lives, pulls pending or not)."""
        return time.monotonic() - self._last_seen

    def stage_times(self) -> dict:
        """Seconds spent so far per stage of receiving (``bench.transfer --threads``): ``receive``
        (I/O thread: receive and check messages, hand them off), and for ``mix64`` messages on the
        landing thread ``host_copy`` (frames into pinned memory), ``launch`` (queue the device
        copies and kernels, host copy excluded), ``launch_cpu`` (the landing thread's CPU seconds
        in all of its work on messages: less than ``host_copy + launch`` by the time it was
        blocked), ``device_wait`` (waiting for the device to end the oldest of ``max_inflight``
        messages, to reuse its pinned buffer); ``landed`` counts them, ``passes`` the verify +
        scatter passes that covered them (consecutive messages of a pull share a pass),
        ``backlog`` the payload frames received zero copy because ``RECV_BYTES`` of pinned buffers
        were held (the landing thread then copies them)."""
        out = {"receive": 0.0 if self._loop is None else self._loop.handled_s}
        if self._lander is not None:
            st = self._lander.stage_s
            out.update(host_copy=st.get("copy", 0.0), launch=st["launch"] - st.get("copy", 0.0),
                       launch_cpu=st["launch_cpu"], device_wait=st["wait"], landed=st["messages"],
                       passes=st["groups"], backlog=self.metrics.c["frames_received_zero_copy_backlog"])
        return out

    def close(self) -> None:
        if self._loop is not None:
            for h in list(self._pending.values()):
                wait(list(h.jobs), timeout=10)
                h.fail(PeerError(f"pull {h.transfer_id!r}: endpoint closed"))
        if self._lander is not None:
            self._lander.close()
        if self._loop is not None:
            self._loop.close()
        if self._workers is not None:
            self._workers.shutdown(wait=True)
        if self._nixl is not None:
            self._nixl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- I/O thread --------------------------------------------------------------------
    def _send(self, h: Header) -> None:
        try:
            self._loop.sock.send(encode_header(h), zmq.NOBLOCK)
            self.metrics.add("messages_sent")
        except zmq.ZMQError as e:
            self.errors.append(TransferError(f"send {h.type.name}: {e}"))

    def _send_hello(self) -> None:
        offer = list(self.checksums) if self.checksums != (CHECKSUM,) else []
        self._send(Header(MsgType.HELLO, desc=self.descriptor.to_dict(), sums=offer,
                          nixl=None if self._nixl is None else self._nixl.offer(),
                          lanes=self.lanes if self.lanes > 1 and self._nixl is None else 0))

    def _open_lanes(self, granted: int, peer: bytes) -> None:
        """Open the connections the prefill granted beyond the first (HELLO_ACK ``lanes``), once, and
        say LANE on each after every handshake, naming this side by ``peer``, the routing id the
        prefill gave its first connection (ZeroMQ's own: a reconnected first connection gets a new
        one, so the prefill asks for a new handshake and every pending PULL is sent again); a lane
        that cannot be opened is only recorded: BLOCKS then keep to the others. Each lane's socket
        events come to :meth:`_lane_event`."""
        self._lane_peer, self._lanes_granted = peer, min(granted, self.lanes)
        try:
            while len(self._lane_socks) < self._lanes_granted - 1:
                k = len(self._lane_socks)
                lane = make_socket(self._loop.ctx, zmq.DEALER, max_frame_bytes=self.max_frame_bytes,
                                   curve=self.curve)
                events = lane.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
                self._loop.add_socket(events, on_message=lambda frames, k=k: self._lane_event(k, frames))
                lane.connect(self.peer_endpoint)
                self._loop.add_socket(lane)
                self._lane_socks.append(lane)
                self.metrics.add("lanes_opened")
            for k in range(self._lanes_granted - 1):
                self._say_lane(k)
        except zmq.ZMQError as e:
            self.errors.append(TransferError(f"opening a lane to {self.peer_endpoint}: {e}"))
            self._lanes_up.set()

    def _say_lane(self, k: int) -> None:
        self._lane_socks[k].send(encode_header(Header(MsgType.LANE, peer=self._lane_peer, lanes=k + 1)), zmq.NOBLOCK)

    def _lane_event(self, k: int, frames) -> None:
        """Lane ``k``'s connection dropped: the BLOCKS on their way over it are lost, so every
        pending pull is asked for again (the prefill restarts its stream; what already landed comes
        again as duplicates). It connected (again): the prefill knows it by a new routing id, so
        it says LANE again."""
        event = parse_monitor_message([f.bytes for f in frames])["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.metrics.ignore("lane_disconnected")
            self._lanes_said.discard(k)
            for p in list(self._pending.values()):
                self._send_pull(p)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and k < self._lanes_granted - 1:
            self._say_lane(k)
            self._lanes_said.add(k)
            if len(self._lanes_said) >= self._lanes_granted - 1:
                self._lanes_up.set()

    def _receive_into(self, frame) -> list | None:
        """IOLoop ``on_header``: for a ``mix64`` BLOCKS message of a pending pull, a pooled pinned
        buffer that receives its payload frames back to back (views, one per frame); else None
        (received zero copy), also while ``RECV_BYTES`` of pooled buffers are held."""
        try:
            h = decode_header(frame.buffer)
        except Exception:
            return None     # _on_message decodes it again and reports the problem
        total = sum(h.nbytes) if h.type == MsgType.BLOCKS else 0
        if h.algorithm != MIX64 or h.tid not in self._pending or not 0 < total <= self.max_frame_bytes:
            return None
        if self._pinned.outstanding_bytes >= RECV_BYTES:
            self.metrics.add("frames_received_zero_copy_backlog", len(h.nbytes))
            return None
        buf = self._pinned.acquire(total)
        views = frame_views(buf, h.nbytes)
        self._rx = (buf, h)
        self.metrics.add("frames_received_into", len(views))
        return views

    def _on_error(self, e: Exception) -> None:
        self.errors.append(e)
        self.metrics.ignore(f"error:{type(e).__name__}")

    def _start_pull(self, h: PullHandle) -> None:
        if h.transfer_id in self._pending:
            return h.fail(PeerError(f"pull {h.transfer_id!r} is already in flight"))
        if self.plane == NIXL:   # the pull's area of the receive region, in transfer layout
            need = h.num_layers * slice_bytes(self.geometry, len(h.dst_block_ids), range(h.heads[1] - h.heads[0]))
            try:
                h.area = (self._nixl.reserve(need), need)
            except TransferError as e:
                return h.fail(e)
        self._pending[h.transfer_id] = h
        self.metrics.add("transfers_started")
        self._send_pull(h)

    def _send_pull(self, h: PullHandle) -> None:
        area = getattr(h, "area", None)
        self._send(Header(MsgType.PULL, tid=h.transfer_id, nblk=len(h.dst_block_ids), heads=h.heads,
                          at=None if area is None else area[0]))
        if self.trace.enabled:   # from pull() to the PULL handed to ZeroMQ
            t1 = time.perf_counter()
            self.trace.span("request", t1 - (time.monotonic() - h.t0), t1, tid=h.transfer_id)

    def _release_area(self, h: PullHandle, failed: bool) -> None:
        """Give a pull's area of the NIXL region back; after a failure, only once the prefill can
        no longer be writing into it (``peer_timeout_s`` later)."""
        area = getattr(h, "area", None)
        if area is not None:
            h.area = None
            self._nixl.release(*area, after_s=self.peer_timeout_s if failed else 0.0)

    def _fail(self, h: PullHandle, err: Exception, reason: str, tell_peer: bool = True) -> None:
        if self._pending.pop(h.transfer_id, None) is None:
            return
        self._release_area(h, failed=True)
        self.metrics.fail(reason)
        if tell_peer:
            self._send(Header(MsgType.ABORT, tid=h.transfer_id, code=reason, msg=str(err)[:200]))
        wait(list(h.jobs), timeout=10)   # verified writes still running: let them end before blocks are reported failed
        h.fail(err)

    def _fail_corrupt(self, h: PullHandle, err: CorruptFrameError) -> None:
        """Fail a pull on a frame that did not pass its checks; the metrics reason is
        ``checksum`` for a checksum mismatch, else ``corrupt_frame``."""
        self._fail(h, err, "checksum" if "checksum" in str(err) else "corrupt_frame")

    def _abort_prepared(self, h: PullHandle) -> None:
        """pull() raised making ``h``'s device ids or start event after its PULL left: that pull (and
        no other of the same id) ends, the prefill told to release."""
        if self._pending.get(h.transfer_id) is h:
            self._fail(h, PeerError(f"pull {h.transfer_id!r} aborted: preparing it raised "
                                    f"{type(h.prepare_error).__name__}: {h.prepare_error}"), "aborted")

    def _abort(self, tid: str) -> None:
        h = self._pending.get(tid)
        if h is not None:
            self._fail(h, PeerError(f"pull {tid!r} aborted by the caller"), "aborted")
        else:
            self._send(Header(MsgType.ABORT, tid=tid, code="aborted"))

    def _on_message(self, frames) -> None:
        rx, self._rx = self._rx, None
        self._rx_kept = False
        try:
            self._handle(frames, rx)
        finally:
            if rx is not None and not self._rx_kept:   # not taken over by a device write
                self._pinned.release(rx[0])

    _rx_kept = False    # a device write took over the buffer the message was received into

    def _handle(self, frames, rx) -> None:
        self._last_seen = time.monotonic()
        self.metrics.add("messages_received")
        try:   # received into a pooled buffer: its header was decoded (and checked) to choose that buffer
            h = rx[1] if rx is not None else decode_header(frames[0].buffer)
        except (ProtocolVersionError, CorruptFrameError) as e:
            self.errors.append(e)
            self.metrics.ignore("corrupt_header")
            if not self._hs_done.is_set():
                self._hs_error = e
                self._hs_done.set()
            p = self._pending.get(blocks_tid(frames[0].buffer) or "")
            if p is not None:   # a message of that pull is lost (nothing is sent twice): fail it now
                self._fail(p, CorruptFrameError(f"pull {p.transfer_id!r}: one of its BLOCKS headers arrived corrupt, "
                                                f"so its blocks cannot all land: {e}"), "corrupt_frame")
            return
        if h.type == MsgType.BLOCKS:
            return self._blocks(h, frames[1:], None if rx is None else rx[0])
        if h.type == MsgType.HELLO_ACK:
            return self._hello_ack(h)
        if h.type == MsgType.PING:
            return self._send(Header(MsgType.PONG))
        if h.type == MsgType.ERROR:
            return self._peer_error(h)
        if h.type != MsgType.PONG:
            self.metrics.ignore(f"unexpected_{h.type.name}")

    def _hello_ack(self, h: Header) -> None:
        self.checksum = h.sum or CHECKSUM
        self.peer_checksums = tuple(h.sums)
        self.plane = NIXL if h.plane == NIXL and self._nixl is not None else ZMQ
        err = None
        try:
            self.remote = LayoutDescriptor.from_dict(h.desc)
            self.shared_heads = check_compatible(self.descriptor, self.remote, context="decode side")
        except LayoutError as e:
            err = e
        if err is None and not h.ok:   # the peer refused although this side agrees
            err = LayoutMismatchError([tuple(d) for d in h.diffs] or [("descriptor", "?", h.msg)],
                                      context="refused by the prefill side")
        if err is not None:
            self.shared_heads = None
            self.errors.append(err)
            self.metrics.fail("layout_mismatch")
            self.metrics.handshake_refused(d[0] for d in getattr(err, "differences", ()))
        if err is None and self.plane == ZMQ and h.lanes > 1 and h.peer and self.lanes > 1:
            self._open_lanes(h.lanes, h.peer)
        else:
            self._lanes_up.set()      # no lanes: connect() has none to wait for
        first = not self._hs_done.is_set()
        self._hs_error = err
        self._hs_done.set()
        if err is None and not first:     # re-handshake after the peer restarted: resume pulls
            for p in self._pending.values():
                self._send_pull(p)

    def _peer_error(self, h: Header) -> None:
        if h.code == ErrorCode.HANDSHAKE_REQUIRED:
            return self._send_hello()
        if not self._hs_done.is_set():   # e.g. the prefill side failed handling HELLO
            err = PeerError(f"handshake: peer says {h.code}: {h.msg}")
            err.code = h.code
            self.errors.append(err)
            self._hs_error = err
            self._hs_done.set()
            return None
        p = self._pending.get(h.tid)
        if p is None:
            return self.metrics.ignore(f"peer_error:{h.code}")
        err = PeerError(f"pull {h.tid!r}: peer says {h.code}: {h.msg}")
        err.code = h.code
        self._fail(p, err, h.code, tell_peer=False)

    def _blocks(self, h: Header, payloads, received=None) -> None:
        p = self._pending.get(h.tid)
        if p is None:
            return self.metrics.ignore("late")
        if p.preparing is not None and not p.preparing.wait(PREPARE_S):   # set by pull() just after the PULL
            return self._fail(p, TransferError(f"pull {p.transfer_id!r}: the caller's thread did not finish "
                                               f"preparing it (device ids, start event) within {PREPARE_S} s"),
                              "write_error")
        if p.prepare_error is not None:   # pull() raised it; the pull is being aborted
            return self.metrics.ignore("aborted")
        try:
            return self._accept(p, h, payloads, received)
        except Exception as e:
            self._write_failed(p, h, e)

    def _write_failed(self, p: PullHandle, h: Header, e: Exception) -> None:
        """A failure handling or completing this pull's blocks fails it now, not by its deadline."""
        err = TransferError(f"pull {p.transfer_id!r}: handling BLOCKS layer {h.layer} failed: "
                            f"{type(e).__name__}: {e}{raised_at(e)}")
        err.__cause__ = e
        self.errors.append(err)
        self._fail(p, err, "write_error")

    def _accept(self, p: PullHandle, h: Header, payloads, received=None) -> None:
        """Check one BLOCKS message against its pull, then write it (inline, on a worker, or,
        for ``mix64`` with the device kernels, verified + scattered on the device).
        ``received``: the pinned buffer the payload frames were received into, if any."""
        n = len(p.dst_block_ids)
        problem = None
        layers = range(h.layer, h.layer + h.nlay)
        if h.algorithm not in self.checksums:
            problem = f"field 'sum': expected an algorithm this side offered {list(self.checksums)}, got {h.sum!r}"
        elif h.layer + h.nlay > p.num_layers:
            problem = (f"fields 'layer'/'nlay': expected layers inside [0, {p.num_layers}), "
                       f"got {h.layer}+{h.nlay}")
        elif h.heads != p.heads:
            problem = f"field 'heads': expected {list(p.heads)}, got {list(h.heads)}"
        elif h.nblk == 0 or h.first + h.nblk > n:
            problem = f"fields 'first'/'nblk': expected a run inside [0, {n}), got {h.first}+{h.nblk}"
        if problem:
            return self._fail(p, CorruptFrameError(f"BLOCKS {h.tid!r} {problem}"), "corrupt_frame")
        got = b"".join(p.received[la][h.first:h.first + h.nblk] for la in layers)
        if all(got):
            return self.metrics.ignore("duplicate")
        if any(got):
            return self._fail(p, CorruptFrameError(
                f"BLOCKS {h.tid!r} layers {h.layer}+{h.nlay}: positions {h.first}+{h.nblk} overlap a run "
                f"already received"), "corrupt_frame")
        local = range(h.heads[0] - self.descriptor.head_start, h.heads[1] - self.descriptor.head_start)
        per_block = len(local) * self._head_block_bytes
        bad = [n for n in h.nbytes if n <= 0 or n % per_block]
        want = h.nlay * h.nblk * per_block
        if bad or sum(h.nbytes) != want:
            return self._fail(p, CorruptFrameError(
                f"BLOCKS {h.tid!r} layer {h.layer} field 'nbytes': expected positive multiples of "
                f"{per_block} (one block of the layout) summing to {want}, got {h.nbytes}"),
                "corrupt_frame")
        if self.plane == NIXL:   # the payload is in the region, where this side expects it
            want_at = self._nixl.area(p.area[0], h.layer, h.first, n, per_block)
            if h.at != want_at or payloads:
                return self._fail(p, CorruptFrameError(
                    f"BLOCKS {h.tid!r} layer {h.layer} field 'at': expected {want_at} (the payload in the nixl "
                    f"region, no frames), got {h.at} and {len(payloads)} frames"), "corrupt_frame")
            received = self._nixl.view(h.at, want)
            payloads = frame_views(received, h.nbytes)
        for la in layers:
            p.received[la][h.first:h.first + h.nblk] = b"\x01" * h.nblk
        self.metrics.add("bytes_received", sum(h.nbytes))
        self.metrics.add("blocks_messages")
        p.nbytes += sum(h.nbytes)
        if h.algorithm == MIX64 and self.frame_ops is not None:
            return self._write_device(p, h, payloads, local, received, owned=self.plane != NIXL)
        if self.cuda and self._workers is None:   # stage on this thread; _on_tick sees the copies end
            try:
                staged = stage_verified(h, payloads, self._pinned)
            except CorruptFrameError as e:
                return self._fail_corrupt(p, e)
            self._gpu_writes.append((self._host.launch_cuda(p, h, staged, local), p, h, staged))
            return None
        if self._workers is None or (not self.cuda and sum(h.nbytes) < INLINE_BYTES):
            try:
                self._host.write_cpu(p, h, payloads, local)
            except CorruptFrameError as e:
                return self._fail_corrupt(p, e)
            return self._landed_all(p, h)
        job = self._workers.submit(self._host.write_cuda if self.cuda else self._host.write_cpu, p, h, payloads, local)
        p.jobs.add(job)
        job.add_done_callback(lambda f: self._loop.call_soon(self._written, p, h, f))

    def _write_device(self, p: PullHandle, h: Header, payloads, local: range, received, owned: bool = True) -> None:
        """Hand one checked ``mix64`` message to the landing thread (:mod:`kvconnector.landing`),
        which copies it to the device, verifies and scatters it there and reports back in
        :meth:`_landed_jobs`. ``received``: the payload back to back in host memory already (a
        pooled buffer when ``owned``, handed back once the device has read it; else the NIXL
        region, which the pull's area keeps), or None: the lander copies ``payloads`` into one."""
        try:
            check_frames(h, payloads)
        except CorruptFrameError as e:
            return self._fail_corrupt(p, e)
        if p.dst_dev is None:
            p.dst_dev = torch.as_tensor(p.dst_block_ids, dtype=torch.int64)
        job = LandJob(p, h, None if received is not None else list(payloads),
                      None if received is None else received[:sum(h.nbytes)], owned and received is not None,
                      self.caches[h.layer:h.layer + h.nlay], p.dst_dev[h.first:h.first + h.nblk], local,
                      layers=self.caches, pull_ids=p.dst_dev)
        p.jobs.add(job.future)
        self._rx_kept = received is not None and owned    # the lander hands the buffer back
        self._lander.submit(job)
        return None

    def _landed_jobs(self, done: list) -> None:
        """Landing thread report: each message written (its blocks land), or failed (its pull fails)."""
        for job, err in done:
            p, h = job.p, job.h
            p.jobs.discard(job.future)
            try:
                if err is None:
                    self._landed_all(p, h)
                elif isinstance(err, CorruptFrameError):
                    self._fail_corrupt(p, err)
                else:
                    self._write_failed(p, h, err)
            except Exception as e:
                self._write_failed(p, h, e)

    def _written(self, p: PullHandle, h: Header, job) -> None:
        p.jobs.discard(job)
        err = job.exception()
        if err is None:
            return self._landed_all(p, h)
        if isinstance(err, CorruptFrameError):
            return self._fail_corrupt(p, err)
        self._on_error(err)
        self._fail(p, TransferError(f"pull {p.transfer_id!r}: writing layer {h.layer} failed: {err}"), "write_error")

    def _landed_all(self, p: PullHandle, h: Header) -> None:
        for layer in range(h.layer, h.layer + h.nlay):
            self._landed(p, layer, h.first, h.nblk)

    def _landed(self, p: PullHandle, layer: int, first: int, count: int) -> None:
        if self._pending.get(p.transfer_id) is not p:
            return
        if p.land(layer, first, count):
            del self._pending[p.transfer_id]
            self._release_area(p, failed=False)
            self._send(Header(MsgType.ACK, tid=p.transfer_id, ok=True))
            r = p.finish()
            self.metrics.completed(r.nbytes, r.elapsed_s, len(r.dst_block_ids) * p.num_layers)
            if self.trace.enabled:
                t1 = time.perf_counter()
                self.trace.span("pull", t1 - r.elapsed_s, t1, tid=p.transfer_id, bytes=r.nbytes)

    def _on_tick(self, now: float) -> float:
        while self._gpu_writes and self._gpu_writes[0][0].query():
            _, p, h, staged = self._gpu_writes.popleft()
            try:   # the write is off the queue: it lands or fails its pull here, never neither
                for b in staged:
                    self._pinned.release(b)
                self._landed_all(p, h)
            except Exception as e:
                self._write_failed(p, h, e)
        if self._hs_done.is_set() and self._hs_error is None and now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._send(Header(MsgType.PING))
        silent = now - self._last_seen > self.peer_timeout_s
        for p in list(self._pending.values()):
            if now >= p.deadline_at:
                self._fail(p, TransferTimeoutError(
                    f"pull {p.transfer_id!r}: deadline passed after {now - p.t0:.2f} s"), "deadline")
            elif silent:
                self._fail(p, TransferTimeoutError(
                    f"pull {p.transfer_id!r}: peer silent for {now - self._last_seen:.2f} s"), "peer_timeout")
        nxt = min((p.deadline_at for p in self._pending.values()), default=now + self.heartbeat_s)
        wait = min(nxt - now, self.heartbeat_s - (now - self._last_ping))
        if self._nixl is not None and self.plane == NIXL and self._pending:
            self._nixl.progress()   # payloads may be on their way into the region: progressed every ms
            return min(0.001, max(0.0, wait))
        return 0.001 if self._gpu_writes else max(0.0, wait)   # queued xxh3 device writes: polled every ms
