"""One outgoing transfer: turns (layers x block runs) into BLOCKS messages, with GPU staging.

A message carries one layer x a run of positions, or, when a whole layer is smaller than
``PACK_BYTES``, several consecutive layers of all positions (protocol v2 ``nlay``,
layer-major), spread evenly over the fewest messages of at most ``PACK_BYTES``. Measured on 2
cores (16-block transfers, 8 layers): one message per layer pays ~50 µs of Python per message
on each side; one 8 MiB message for everything loses the overlap of gather, socket and write;
4 MiB packs were fastest (1, 2 and 8 MiB tried; docs/DESIGN_NOTES.md). With the device kernels
(``frame_ops``) the host runs no pass over the payload, so what a message costs is its fixed
host work on both sides (kernel launches, copies queued, events, hand-offs), and whole layers
are packed up to ``chunk_bytes`` instead.

CPU caches, all heads: when the runs of consecutive source blocks are long, each run is one
payload frame sent straight from the cache (zero copy; the lease guarantees the blocks do not
change); short runs and head slices are gathered into a pooled buffer (one frame). CUDA caches:
each chunk is gathered on the GPU and copied into pinned host memory on a side stream.

A gathered frame is built and hashed piece by piece (``HASH_PIECE_BYTES``, sized to stay in
the core's L2 cache): each piece is copied, then fed to a streaming xxh3_64 while it is still
hot, so the checksum costs a cache read instead of a second pass over memory.

With ``mix64`` negotiated and the device kernels given (``frame_ops``), chunks are instead
gathered and checksummed on the GPU in groups: one kernel launch covers consecutive messages
(their payloads follow each other in the pull's layer-major payload, whatever layers they cross:
:func:`~kvconnector.protocol.payload_cells`; up to ``GROUP_BYTES``), each message then copied to
its own pinned buffer on the copy stream (:func:`kvconnector.device_frames.gather_messages`); the
host never reads the payload, and the two Triton launches a gather costs (~20-35 µs each from
Python) are paid once a group, so messages can be small (the decode side then copies one to the
GPU while the next is on the wire) without the host work per message outgrowing the wire time.

Staging (gather or device-to-host copy, then the checksum of every frame) runs ahead of the
socket: up to ``ahead`` chunks are prepared while earlier ones are being sent (device kernels:
the first message of a pull leaves as soon as its own copy has landed, with nothing staged
behind it, since the socket is idle until then; later the next group is gathered once no more
than one group's messages are left staged; the prefill endpoint may have staged the first
message at publish already, :meth:`Stream.prestage`).
When a layer takes several messages, their runs of positions are of nearly equal size (no small
tail message that pays a message's fixed work for a few blocks). On hosts with spare cores (see
:func:`stage_threads`) the staging runs on a small shared thread pool (numpy copies and xxh3
release the GIL), so gather and hash overlap the I/O thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from layouts import CacheGeometry
from .blocks import as_bytes, block_rows, copy_runs, device_rows, gather_blocks, runs, slice_bytes
from .device_frames import GROUP_BYTES, gather_messages
from .protocol import CHECKSUM, Header, MsgType, checksum, checksum_stream, encode_header, payload_cells
from .staging import FREE_BYTES
from .trace import Trace


MIN_FRAME_BYTES = 256 << 10  # below this mean run size, gathering beats per-run frames
HASH_PIECE_BYTES = 512 << 10  # gather + hash in pieces this big (hot in L2), see module doc
PACK_BYTES = 4 << 20         # whole layers smaller than this share a message (up to this size)
INFLIGHT_BYTES = 24 << 20     # gathered bytes per stream queued in ZeroMQ before staging waits
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def stage_threads() -> int:
    """Staging threads per process: none on small hosts (every core is already busy with
    the two I/O threads), else one per four cores, at most four."""
    cores = os.cpu_count() or 1
    return 0 if cores <= 4 else min(4, cores // 4)


def _stage_executor() -> ThreadPoolExecutor | None:
    global _executor
    with _executor_lock:
        if _executor is None and stage_threads():
            _executor = ThreadPoolExecutor(stage_threads(), thread_name_prefix="kvc-stage")
        return _executor


class _JobDone:
    """A staging future seen as a tracker (``done`` property), for :meth:`BufferPool.release`."""

    def __init__(self, job) -> None:
        self.job = job

    @property
    def done(self) -> bool:
        return self.job.done()


class BufferPool:
    """Reusable host byte buffers for gathered payloads (fresh allocations page-fault).

    A buffer handed to ZeroMQ with zero copy is reused only once its ``MessageTracker``
    says the socket no longer reads it. Released buffers are kept up to ``max_free_bytes``
    (:data:`~kvconnector.staging.FREE_BYTES`: 8 buffers of 8 MiB messages, 64 of 1 MiB).
    """

    def __init__(self, max_free_bytes: int = FREE_BYTES) -> None:
        self._free: list = []     # [tensor, tracker or None]
        self.max_free_bytes = max_free_bytes
        self.free_bytes = 0       # bytes of the buffers in ``_free``
        self.allocations = 0      # buffers allocated (not reused) so far
        self._views: dict = {}    # id(cache) -> (cache, numpy byte view); one endpoint's caches
        self._rows: dict = {}     # id(cache) -> (cache, torch row view), CUDA caches

    @staticmethod
    def _once(table: dict, cache: torch.Tensor, make):
        """``make()`` for ``cache``, made once per cache (keyed by identity; a new tensor at a
        reused address is a new cache)."""
        hit = table.get(id(cache))
        if hit is None or hit[0] is not cache:
            hit = table[id(cache)] = (cache, make())
        return hit[1]

    def cpu_view(self, cache: torch.Tensor, geo: CacheGeometry):
        """Numpy byte view ``[num_blocks, 2, N, H, P]`` of a CPU cache, made once per cache."""
        return self._once(self._views, cache, lambda: as_bytes(cache, geo).numpy())

    def device_rows(self, cache: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
        """Row view ``[num_blocks, block_bytes]`` of a CUDA cache (:func:`blocks.device_rows`), made once per cache."""
        return self._once(self._rows, cache, lambda: device_rows(cache, geo))

    def acquire(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        for i, (buf, tracker) in enumerate(self._free):
            if buf.numel() >= nbytes and (tracker is None or tracker.done):
                del self._free[i]
                self.free_bytes -= buf.numel()
                return buf[:nbytes]
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def release(self, buf: torch.Tensor, tracker) -> None:
        """Keep ``buf`` (a view of a pooled buffer, or one) for reuse once ``tracker`` (None: now) is
        done; over ``max_free_bytes``, the oldest buffers ZeroMQ no longer reads are dropped."""
        base = buf._base if buf._base is not None else buf
        self._free.append([base, tracker])
        self.free_bytes += base.numel()
        i = 0
        while self.free_bytes > self.max_free_bytes and i < len(self._free):
            b, t = self._free[i]
            if t is None or t.done:
                del self._free[i]
                self.free_bytes -= b.numel()
            else:
                i += 1


class Stream:
    """Produces the frames of one transfer's BLOCKS messages in order (layer-major).

    Parameters
    ----------
    ident : bytes
        ROUTER identity of the peer.
    tid : str
    block_ids : list of int
        Source blocks, in transfer order.
    caches : list of packed per-layer tensors
    geo : CacheGeometry
    local_heads : range
        Local head indices to send.
    global_heads : (int, int)
        The same heads as global indices (goes in the header).
    chunk_bytes : int
        Target payload size of one message.
    copy_stream : torch.cuda.Stream or None
        Side stream for device-to-host staging (CUDA caches only).
    pool : BufferPool, optional
        The endpoint's buffers and cache views.
    ids_dev : (torch.Tensor, torch.cuda.Event)
        CUDA caches (required with ``copy_stream``): ``block_ids`` already on the device
        (:func:`blocks.device_ids`, made at publish) and the event after their copy.
    fault_hook : callable(stage: str), optional
        Test hook called at the ``"gather"`` and ``"checksum"`` stages of every chunk (it may
        raise to simulate a failure there); None in production.
    algorithm : str
        Checksum algorithm negotiated with the peer (``xxh3_64`` or ``mix64``).
    frame_ops : FrameOps, optional
        Device kernels (:mod:`kvconnector.device_frames`); with ``mix64``, every chunk is
        gathered and checksummed by them.
    layers_ready : callable() -> int or None, optional
        Layer-wise publish: how many layers (from 0) hold their K/V now; chunks of later layers
        wait (one layer per message then). None: every layer is ready.
    timings : dict, optional
        Seconds spent staging (``"stage"``) and waiting for staged bytes (``"copy_wait"``) are
        added to it (the endpoint's :meth:`~PrefillEndpoint.stage_times`).
    trace : Trace, optional
        The endpoint's :class:`~kvconnector.trace.Trace`: the same two steps as spans, per message.
    at_base : int, optional
        ``nixl`` data plane (:mod:`kvconnector.dataplane`): the pull's area in the peer's region;
        each header then carries ``at`` = where its payload goes (transfer layout, layer-major).

    Any failure to stage a chunk surfaces as an exception from :meth:`next_frames`. Once the
    transfer ends early, :meth:`cancel` drops what is not yet sent and :meth:`busy` says
    whether the cache is still being read (a staging job, or a zero-copy frame still queued
    in ZeroMQ), so the lease is not reported released before it is not.
    """

    def __init__(self, ident: bytes, tid: str, block_ids: list, caches: list, geo: CacheGeometry,
                 local_heads: range, global_heads: tuple, chunk_bytes: int, copy_stream=None,
                 pool: BufferPool | None = None, ids_dev: tuple | None = None, fault_hook=None,
                 algorithm: str = CHECKSUM, frame_ops=None, at_base: int | None = None,
                 layers_ready=None, timings: dict | None = None, trace: Trace | None = None) -> None:
        self.ident, self.tid, self.block_ids, self.caches, self.geo = ident, tid, block_ids, caches, geo
        self.local_heads, self.global_heads = local_heads, tuple(global_heads)
        per_block = slice_bytes(geo, 1, local_heads)
        self.chunk_blocks = max(1, chunk_bytes // per_block)
        if self.chunk_blocks < len(block_ids):   # a layer in several messages: as many, of nearly equal size
            self.chunk_blocks = -(-len(block_ids) // -(-len(block_ids) // self.chunk_blocks))
        self.full_heads = len(local_heads) == geo.num_kv_heads
        self.copy_stream = copy_stream
        self.algorithm, self.frame_ops, self.at_base = algorithm, frame_ops, at_base
        self._ready = layers_ready if layers_ready is not None and layers_ready() is not None else None
        self._per_block = slice_bytes(geo, 1, local_heads)
        # CUDA: the source ids on the device, copied at publish (ids were checked there)
        self._ids_dev = None
        if copy_stream is not None:
            self._ids_dev, ready = ids_dev
            copy_stream.wait_event(ready)
        elif frame_ops is not None:   # CPU caches through the kernels: ids as a host tensor
            self._ids_dev = torch.as_tensor(block_ids, dtype=torch.int64)
        self.pool = pool or BufferPool()
        self.last_buffer = None         # pooled buffer inside the last frames (tracked when sent)
        # layers per message: a whole layer smaller than the chunk shares its message with the
        # next layers (protocol v2 ``nlay``); otherwise one layer x a run of positions
        n, nl = len(block_ids), len(caches)
        pack = chunk_bytes if frame_ops is not None else min(chunk_bytes, PACK_BYTES)   # module doc
        lpm = max(1, pack // (n * per_block)) if self.chunk_blocks >= n else 1
        if self._ready is not None:   # layer-wise: a message never waits for a later layer
            lpm = 1
        self.layers_per_msg = -(-nl // -(-nl // lpm))      # same message count, layers spread evenly
        self._plan = deque((layer, min(self.layers_per_msg, nl - layer), first)
                           for layer in range(0, nl, self.layers_per_msg)
                           for first in range(0, n, self.chunk_blocks))
        self._total = len(self._plan)
        self._seq = 0
        self._staged: deque = deque()    # (layer, nlay, first, count, job, pooled buffer, job args)
        self._executor = _stage_executor()
        # chunks staged ahead: one per staging thread (a CUDA chunk's device copies are queued by the
        # thread that prepares it, so without threads nothing is gained by staging ahead)
        self.ahead = 1 + (stage_threads() if self._executor else 0)
        if frame_ops is not None:   # queued device work: keep the next group gathering while one is sent
            per_msg = self.layers_per_msg * min(self.chunk_blocks, n) * per_block
            self._refill = max(1, GROUP_BYTES // max(1, per_msg))    # messages a group holds
            self.ahead = max(self.ahead, 4, 2 * self._refill)
        self._retry = None
        self.last_payload_bytes = 0
        self._chunks: dict = {}          # first position -> chunk plan (see _chunk)
        self._inflight: deque = deque()  # (tracker, bytes) of gathered buffers queued in ZeroMQ
        self._reading: deque = deque()   # trackers of zero-copy messages (frames inside the cache)
        self.last_reads_cache = False    # the last frames are views of the cache (zero copy)
        self._hook = fault_hook or (lambda stage: None)
        self._timings = timings if timings is not None else {}
        self._trace = trace
        self._running: list = []         # staging jobs still running after cancel()
        self.prestaged = 0               # bytes staged by prestage() (its pooled buffer)

    @property
    def last_seq(self) -> int:
        """Sequence number of the frames last returned by :meth:`next_frames` (a retry returns those again)."""
        return self._seq - 1

    def push_back(self, frames: list) -> None:
        """Keep frames the socket refused; they go first next time."""
        self._retry = frames

    def sent(self, tracker) -> None:
        """The last frames were queued; their pooled buffer is free (or, zero copy, the cache no
        longer read by ZeroMQ) once ``tracker`` is done."""
        if self.last_reads_cache and tracker is not None:
            while self._reading and self._reading[0].done:
                self._reading.popleft()
            self._reading.append(tracker)
        if self.last_buffer is not None:
            self.pool.release(self.last_buffer, tracker)
            if self.copy_stream is None and tracker is not None:
                self._inflight.append((tracker, self.last_buffer.numel()))
            self.last_buffer = None

    def cancel(self) -> None:
        """Send nothing more: drop the plan and the refused frames; staging jobs not yet
        started are cancelled, running ones finish (see :meth:`busy`) and their buffers go back
        to the pool once they have."""
        self._plan.clear()
        self._retry = None
        while self._staged:
            job, buf = self._staged.popleft()[4:6]
            if job is not None and not job.cancel() and not job.done():
                self._running.append(job)
            if buf is not None:
                self.pool.release(buf, None if job is None else _JobDone(job))

    def busy(self) -> bool:
        """True while this stream may still read the cache: a staging job is running, or a
        zero-copy message is still queued in ZeroMQ."""
        self._running = [j for j in self._running if not j.done()]
        while self._reading and self._reading[0].done:
            self._reading.popleft()
        return bool(self._running or self._reading
                    or any(j is not None and not j.done() for j in (st[4] for st in self._staged)))

    def _layer_ready(self) -> bool:
        """The next planned chunk's layer is written (always, unless published layer by layer)."""
        return self._ready is None or self._plan[0][0] < self._ready()

    def _may_stage(self) -> bool:
        """CPU gathers: stage the next chunk only while fewer than ``INFLIGHT_BYTES`` of this
        stream's gathered buffers are still queued in ZeroMQ, so the pool hands the same few
        buffers back while they are still in cache (fresh buffers page-fault and start cold)."""
        q = self._inflight
        while q and q[0][0].done:
            q.popleft()
        return not q or sum(n for _, n in q) < max(INFLIGHT_BYTES, 2 * q[0][1])

    def _chunk(self, first: int) -> tuple:
        """Plan of the chunk starting at position ``first``, made once per stream (every layer
        sends the same source blocks): (ids, runs of consecutive ids or None, ids as intp)."""
        plan = self._chunks.get(first)
        if plan is None:
            ids = self.block_ids[first:first + self.chunk_blocks]
            block_runs = runs(ids)
            zero_copy = (self.full_heads and self.copy_stream is None
                         and len(ids) * self.geo.block_bytes // len(block_runs) >= MIN_FRAME_BYTES)
            plan = self._chunks[first] = (ids, block_runs if zero_copy else None, np.asarray(ids, dtype=np.intp))
        return plan

    def _cpu_payload(self, layer: int, nlay: int, first: int) -> tuple:
        """Payload frames of one chunk (``nlay`` layers) and the pooled buffer they use (None
        when zero copy)."""
        ids, zero_copy_runs, idx = self._chunk(first)
        views = [self.pool.cpu_view(self.caches[la], self.geo) for la in range(layer, layer + nlay)]
        if zero_copy_runs is not None:
            # zero copy out of the cache: one frame per layer and run of consecutive ids
            return [v[b:b + k].reshape(-1) for v in views for _, b, k in zero_copy_runs], None
        # small runs: one gathered frame costs less than many tiny frames
        buf = self.pool.acquire(nlay * slice_bytes(self.geo, len(ids), self.local_heads))
        return [buf.numpy()], (buf, views, ids, idx)

    def _device_copy(self, host: torch.Tensor, layer: int, nlay: int, first: int, k: int) -> None:
        """CUDA caches: every layer of one chunk into one device buffer (one ``index_select`` per
        layer on the cached row view), then one copy into the pinned ``host`` buffer; returns
        when ``host`` holds the bytes."""
        n = slice_bytes(self.geo, k, self.local_heads)
        ids_dev = self._ids_dev[first:first + k]
        device = self.caches[layer].device
        self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.copy_stream):   # allocated on this stream: reuse is stream-ordered
            dev = torch.empty(nlay * n, dtype=torch.uint8, device=device)
            for li in range(nlay):   # layer-major, like the CPU payload
                out = dev[li * n:(li + 1) * n]
                if self.full_heads:
                    torch.index_select(self.pool.device_rows(self.caches[layer + li], self.geo), 0, ids_dev,
                                       out=out.view(k, -1))
                else:
                    gather_blocks(self.caches[layer + li], self.geo, ids_dev, self.local_heads, out=out)
            host.copy_(dev, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)   # the waiting thread sleeps instead of spinning a core
            ev.record(self.copy_stream)
        ev.synchronize()

    def _prepare(self, frames: list, gather, device) -> tuple:
        """Worker side of staging: gather (CPU) or device-to-host copy (CUDA, ``device`` =
        (pinned buffer, layer, nlay, first, count)), then hash every frame."""
        self._hook("gather")
        if gather is not None:   # ids were checked against the cache at publish
            buf, views, ids, idx = gather
            n, v0 = len(ids), views[0]
            packed = buf.numpy().reshape(len(views) * n, *v0.shape[1:3], len(self.local_heads), v0.shape[4])
            step = max(1, HASH_PIECE_BYTES // max(1, packed[0].nbytes))
            h = checksum_stream() if step < len(packed) and self.algorithm == CHECKSUM else None
            if h is not None:    # hashed piece by piece below, while gathering
                self._hook("checksum")
            for li, view in enumerate(views):    # layer-major
                out = packed[li * n:(li + 1) * n]
                if self.full_heads:   # whole blocks: one C-level row gather per piece (ids in range)
                    flat, rows = out.reshape(n, -1), block_rows(view)
                    copy = lambda a, b: np.take(rows, idx[a:b], axis=0, out=flat[a:b], mode="clip")  # noqa: E731
                else:
                    copy = lambda a, b: copy_runs(out[a:b], None, view, ids[a:b], self.local_heads,  # noqa: E731
                                                  head_side="src")
                if h is None:
                    copy(0, n)
                    continue
                for i in range(0, n, step):    # copy a piece, hash it while it is still in cache
                    copy(i, i + step)
                    h.update(out[i:i + step])
            if h is None:
                self._hook("checksum")
            return frames, [checksum(packed, self.algorithm) if h is None else h.intdigest()]
        if device is not None:
            self._device_copy(*device)
        self._hook("checksum")
        return frames, [checksum(f, self.algorithm) for f in frames]

    def _group(self, head: tuple, limit: int | None) -> tuple[list, int]:
        """``head`` (layer, nlay, first, count), the message popped from the plan, and the planned
        messages after it that one gather can stage with it: each one's payload follows the one
        before in the pull's layer-major payload (:func:`~kvconnector.protocol.payload_cells`; the
        plan's order, across layers too), their layers are written, and the group stays within
        ``GROUP_BYTES`` (and ``limit`` messages). Returns the group's messages and the payload cell
        it starts at."""
        n = len(self.block_ids)
        group, span = [head], payload_cells(*head, n)   # never None: several layers only with every position
        size = head[1] * head[3] * self._per_block
        while self._plan and (limit is None or len(group) < limit):
            la, nl, f = self._plan[0]
            k = min(self.chunk_blocks, n - f)
            more = nl * k * self._per_block
            nxt = payload_cells(la, nl, f, k, n)
            if nxt is None or nxt[0] != span[1] or size + more > GROUP_BYTES or not self._layer_ready():
                break
            self._plan.popleft()
            group.append((la, nl, f, k))
            span, size = (span[0], nxt[1]), size + more
        return group, span[0]

    def _stage(self, limit: int | None = None) -> None:
        layer, nlay, first = self._plan.popleft()
        k = min(self.chunk_blocks, len(self.block_ids) - first)
        if self.frame_ops is not None:   # gather + mix64 on the device, queued (device_frames)
            self._hook("gather")
            group, start = self._group((layer, nlay, first, k), limit)
            pin = self.copy_stream is not None
            bufs = [self.pool.acquire(nl * kk * self._per_block, pin=pin) for _, nl, _, kk in group]
            jobs = gather_messages(self.frame_ops, self.caches, self._ids_dev, self.local_heads, bufs,
                                   self.copy_stream, start=start)
            for (la, nl, f, kk), job, buf in zip(group, jobs, bufs):
                self._staged.append((la, nl, f, kk, job, buf, None))
            self._timings["gathers"] = self._timings.get("gathers", 0) + 1
            return
        if self.copy_stream is None:
            frames, gather = self._cpu_payload(layer, nlay, first)
            buf, device = (gather[0] if gather else None), None
        else:   # CUDA: the device copies are queued by whoever prepares the chunk
            buf = self.pool.acquire(nlay * slice_bytes(self.geo, k, self.local_heads), pin=True)
            frames, gather, device = [buf.numpy()], None, (buf, layer, nlay, first, k)
        ex = self._executor if self._staged else None   # the next chunk to send: the I/O thread
        job = ex.submit(self._prepare, frames, gather, device) if ex else None   # would only wait for a worker
        self._staged.append((layer, nlay, first, k, job, buf, (frames, gather, device)))

    def prestage(self) -> int:
        """Queue the staging of the first message now, before any pull asks for it (the
        prefill endpoint calls it at publish, see :meth:`~kvconnector.PrefillEndpoint.publish`),
        so that a pull's first message leaves as soon as the pull arrives. Returns the bytes of
        its pooled buffer (0 when nothing was staged: already staged, or nothing to send), also
        kept as :attr:`prestaged`."""
        if self._staged or self._seq or not self._plan or not self._layer_ready():
            return 0
        t0 = time.perf_counter()
        self._stage(limit=1)
        if self._trace is not None and self._trace.enabled:
            self._trace.span("prestage", t0, time.perf_counter(), tid=self.tid, seq=0)
        buf = self._staged[0][5]
        self.prestaged = 0 if buf is None else buf.numel() * buf.element_size()
        return self.prestaged

    def serve(self, ident: bytes, fault_hook=None) -> None:
        """Send to peer ``ident`` from now on (a stream prestaged before any pull asked for it)."""
        self.ident, self._hook = ident, fault_hook or (lambda stage: None)

    def next_frames(self) -> list | None:
        """Frames of the next message; ``[]`` when it must wait (see :meth:`_may_stage`);
        None when the transfer is fully sent."""
        if self._retry is not None:
            frames, self._retry = self._retry, None
            return frames
        if not self._staged and not self._plan:
            return None
        t0 = time.perf_counter()
        while len(self._staged) < self.ahead and self._plan and self._may_stage() and self._layer_ready():
            if self.frame_ops is not None and self._staged and (self._seq == 0 or len(self._staged) > self._refill):
                break       # the first message: send it first; later, a group ahead of the one being sent
            self._stage()   # keep later chunks staging
        t1 = time.perf_counter()
        self._timings["stage"] = self._timings.get("stage", 0.0) + t1 - t0
        if not self._staged:
            return []      # waiting for ZeroMQ to release a buffer, or for a layer to be published
        head = self._staged[0][4]
        if getattr(head, "background", False) and not head.done():
            return []      # a CPU-cache gather still on its thread: serve heartbeats meanwhile
        layer, nlay, first, count, job, self.last_buffer, work = self._staged.popleft()
        self.last_reads_cache = work is not None and work[1] is None and work[2] is None   # no gather, no copy
        if work is None:
            self._hook("checksum")
        payload, sums = job.result() if job is not None else self._prepare(*work)
        t2 = time.perf_counter()
        self._timings["copy_wait"] = self._timings.get("copy_wait", 0.0) + t2 - t1
        if self._trace is not None and self._trace.enabled:
            self._trace.span("stage", t0, t1, tid=self.tid, seq=self._seq)
            self._trace.span("copy_wait", t1, t2, tid=self.tid, seq=self._seq, bytes=sum(p.nbytes for p in payload))
        self._seq += 1
        h = Header(MsgType.BLOCKS, seq=self._seq - 1, tid=self.tid, layer=layer, nlay=nlay, first=first,
                   nblk=count, heads=self.global_heads, last=self._seq == self._total,
                   sum="" if self.algorithm == CHECKSUM else self.algorithm,
                   at=None if self.at_base is None else     # transfer layout, layer-major (dataplane)
                   self.at_base + (layer * len(self.block_ids) + first) * self._per_block)
        h.nbytes, h.checksums = [p.nbytes for p in payload], sums   # from the frames sent, as encode_message
        self.last_payload_bytes = sum(h.nbytes)
        return [encode_header(h), *payload]
