"""Decode side, device path: lands received ``mix64`` messages on the caches off the I/O thread.

The I/O thread receives a ``mix64`` BLOCKS message (zero copy: ZeroMQ's own frames), checks
its header against the pull and hands it to the endpoint's :class:`Lander`, then goes straight
back to the socket for the next message. The lander (one thread per endpoint, first in first
out, so the device work of messages stays in arrival order on the copy stream), per message:

1. takes a pinned buffer from the pool; when ``max_inflight`` messages are still being read by
   the device it first waits for the oldest (a blocking CUDA event: the thread sleeps) and hands
   its buffer back, so a buffer is never refilled before the device copy that reads it ended;
2. copies the frames into the buffer in pieces of ``piece_bytes`` (``torch`` copies, which
   release the GIL and spread over the intra-op threads), queuing each piece's host-to-device
   copy on the copy stream right after it, so the DMA of one piece overlaps the host copy of the
   next (a payload already in pinned memory, received into the pool or written by NIXL, is only
   copied to the device);
3. queues verify + scatter (:func:`kvconnector.device_frames.land_message`: the scatter writes
   nothing unless every frame matched) and records an event;
4. hands finished messages back to the I/O thread in batches (``report``): their pinned buffers
   go back to the pool first, then the I/O thread marks the blocks landed, or fails the pull with
   the :class:`CorruptFrameError` of the first mismatching frame.

When it has nothing to launch, the lander waits on the oldest queued message's event, so the
last message of a pull is reported as soon as the device has written it. A message of a pull
that is no longer pending (failed, aborted) is dropped before its copy. Every message carries a
future in its pull's ``jobs`` that is set once the lander is done with it (written, failed or
dropped), which :meth:`DecodeEndpoint._fail` waits for (bounded) before it reports blocks.

On CPU caches there is no stream: the kernels run in the call, and no event is recorded
(``_record`` is the seam tests replace with fake events to drive the in-flight logic on CPU).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

import torch

from .device_frames import land_message

PIECE_BYTES = 2 << 20     # host copy -> device copy granularity: small enough for the DMA to overlap, large
#                           enough that a torch copy spreads over the intra-op threads
MAX_INFLIGHT = 4          # messages the device may still be reading (pinned buffers held) before the lander waits


def _record(stream):
    """An event after the work queued so far on ``stream`` (blocking: a waiting thread sleeps), or
    None on CPU where nothing is queued."""
    if stream is None:
        return None
    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    return ev


class LandJob:
    """One received message for the lander.

    ``frames``: the payload frames (ZeroMQ frames or buffers) to copy into a pooled pinned buffer,
    or None when ``host`` ([sum(h.nbytes)] uint8, pinned for CUDA caches) already holds the payload;
    ``owned``: ``host`` came from the pool and goes back to it once the device has read it.
    """

    __slots__ = ("p", "h", "frames", "host", "owned", "caches", "ids", "heads", "future", "write", "event")

    def __init__(self, p, h, frames, host, owned: bool, caches: list, ids: torch.Tensor, heads: range) -> None:
        self.p, self.h, self.frames, self.host, self.owned = p, h, frames, host, owned
        self.caches, self.ids, self.heads = caches, ids, heads
        self.future: Future = Future()
        self.write = self.event = None


class Lander:
    """The landing thread of one decode endpoint (module doc).

    Parameters
    ----------
    ops : FrameOps
        The device kernels (``verify_scatter``).
    stream : torch.cuda.Stream or None
        The endpoint's copy stream (None: CPU caches).
    pool : PinnedPool
        Pinned buffers for frames that were not received into one.
    report : callable(list of (LandJob, Exception or None))
        Called on the lander thread with finished messages (None: written; CorruptFrameError: a
        frame did not match, nothing written; other: the landing failed).
    alive : callable(LandJob) -> bool
        False when the message's pull is no longer pending (the message is dropped unwritten).
    """

    def __init__(self, ops, stream, pool, report: Callable, alive: Callable, *, max_inflight: int = MAX_INFLIGHT,
                 piece_bytes: int = PIECE_BYTES, name: str = "kvc-decode-land") -> None:
        self.ops, self.stream, self.pool, self.report, self.alive = ops, stream, pool, report, alive
        self.max_inflight, self.piece_bytes = max(1, max_inflight), max(1, piece_bytes)
        self.stage_s = {"copy": 0.0, "launch": 0.0, "wait": 0.0, "messages": 0}   # read by bench.transfer
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: deque = deque()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: LandJob) -> None:
        """Queue a message (any thread; the I/O thread in practice)."""
        self._q.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        """Land what is queued, then stop (bounded wait)."""
        self._q.put(None)
        self._thread.join(timeout_s)

    # ---- lander thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                job = self._q.get_nowait() if self._inflight else self._q.get(timeout=1.0)
            except queue.Empty:
                if self._inflight:   # nothing to launch: report the oldest as soon as it is written
                    self._finish(wait=True)
                continue
            if job is None:
                while self._inflight:
                    self._finish(wait=True)
                return
            done = []
            try:
                if not self.alive(job):
                    self._drop(job)
                    continue
                while len(self._inflight) >= self.max_inflight:   # its pinned buffer is needed again
                    done += self._collect(wait=True)
                self._launch(job)
            except Exception as e:
                self._drop(job)
                done.append((job, e))   # the pull fails with it (write_error)
            done += self._collect(wait=False)
            self._send(done)

    def _launch(self, job: LandJob) -> None:
        total = sum(job.h.nbytes)
        if job.host is None:
            job.host, job.owned = self.pool.acquire(total), True
        t0 = time.perf_counter()
        try:
            job.write = land_message(self.ops, job.h, job.host, job.caches, job.ids, job.heads, self.stream,
                                     frames=job.frames, piece_bytes=self.piece_bytes, timings=self.stage_s)
            job.event = _record(self.stream)
        except BaseException:
            if self.stream is not None:
                self.stream.synchronize()   # no device copy may still read the buffer handed back in _drop
            raise
        finally:
            self.stage_s["launch"] += time.perf_counter() - t0
            self.stage_s["messages"] += 1
        job.frames = None               # ZeroMQ's buffers go back now
        self._inflight.append(job)

    def _collect(self, wait: bool) -> list:
        """Finished messages from the front of the queue (the oldest waited for when ``wait``)."""
        out = []
        while self._inflight:
            job = self._inflight[0]
            try:
                if job.event is not None and not job.event.query():
                    if not wait:
                        break
                    t0 = time.perf_counter()
                    job.event.synchronize()
                    self.stage_s["wait"] += time.perf_counter() - t0
                err = job.write.error()
            except Exception as e:   # a device error: this message fails its pull
                err = e
            wait = False
            self._inflight.popleft()
            dropped = self._drop(job)
            out.append((job, err if err is not None else dropped))
        return out

    def _finish(self, wait: bool) -> None:
        self._send(self._collect(wait))

    def _drop(self, job: LandJob) -> Exception | None:
        """The device no longer reads this message's buffers: hand them back, settle its future.
        Returns what handing the buffer back raised, if anything (the message then fails its pull)."""
        job.frames = None
        err = None
        if job.owned and job.host is not None:
            host, job.host = job.host, None
            try:
                self.pool.release(host)
            except Exception as e:
                err = e
        if not job.future.done():
            job.future.set_result(None)
        return err

    def _send(self, done: list) -> None:
        if done:
            try:
                self.report(done)
            except Exception:   # the endpoint is closing (its loop is gone): nobody to tell
                pass
