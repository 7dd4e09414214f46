"""Decode side, device path: lands received ``mix64`` messages on the caches off the I/O thread.

The I/O thread receives a ``mix64`` BLOCKS message (into a pooled pinned buffer with
``recv_into``, the default for CUDA caches; or zero copy: ZeroMQ's own frames), checks its header
against the pull and hands it to the endpoint's :class:`Lander`, then goes straight back to the
socket for the next message. The lander's launcher thread (first in first out, so
the device work of messages stays in arrival order on the copy stream) works on each message in
two phases, and starts the next message before it finishes this one, so the copy workers copy
message k+1 while the launcher queues message k's device work:

1. start: takes a pinned buffer from the pool and submits the copies of the frames into it, in
   pieces of ``piece_bytes``, to the endpoint's copy workers (NumPy copies, which release the
   GIL; one piece each). Before that, while ``max_inflight`` messages hold pinned buffers
   (started, or landed and still read by the device), it finishes the started ones and then
   waits for the device to end the oldest (its buffer is back in the pool then), so a buffer is
   never refilled before the device copy that reads it ended, and never more than
   ``max_inflight`` are held;
2. finish (once ``lookahead`` later messages are started, or none is waiting): waits for the
   pieces in order, queuing the host-to-device copy of the pieces in on the copy stream as soon
   as they are in, so the DMA of one piece overlaps the host copy of the next, and the pieces
   copied while an earlier message was landed go in one copy (a payload already in pinned
   memory, received into the pool or written by NIXL, is only copied to the device); then queues
   verify + scatter (:func:`kvconnector.device_frames.land_message`: the scatter writes nothing
   unless every frame matched) and records a blocking event.

Without copy workers the launcher copies the pieces itself in the finish phase, right after the
start: there is nothing to overlap.

Every torch call releases and retakes the GIL, a hand-off that waits on the process's other
Python threads (the I/O thread, the watcher, copy workers), so the launcher makes few per
message: it makes the copy stream its current stream and the caches' device its current device
once, reuses pooled checksum buffers whose views were made once (:class:`AuxBuffers`), and makes
the copy stream wait for a pull's start event once, not once per message.

Its watcher thread sleeps on the oldest queued message's event (the thread sleeps, it does not
spin) and, once the device has ended it, completes it and every later message already ended:
their pinned buffers go back to the pool, then one ``report`` hands them to the I/O thread,
which marks the blocks landed, or fails the pull with the :class:`CorruptFrameError` of the
first mismatching frame. So the last message of a pull is reported as soon as the device has
written it, and the launcher never waits on an event unless it needs a buffer back.

A message of a pull that is no longer pending (failed, aborted) is dropped before its copy, or,
once started, before its device work (its buffer goes back once the workers' copies into it
ended). A message whose landing fails fails its pull with that error, nothing of it written.
:meth:`Lander.close` lands what is queued and started first. Every message carries a future in
its pull's ``jobs``, set once the lander is done with it (written, failed or dropped), which
:meth:`DecodeEndpoint._fail` waits for (bounded) before it reports blocks.

On CPU caches there is no stream: the kernels run in the call, and no event is recorded
(``_record`` is the seam tests replace with fake events to drive the in-flight logic on CPU).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

import torch

from .device_frames import AuxBuffers, HostFill, land_message
from .trace import Trace

PIECE_BYTES = 2 << 20     # host copy -> device copy granularity: small enough that the DMA of a piece overlaps the
#                           copy of the next and the copy workers share a message, large enough to amortize each call
MIN_PIECE_BYTES = 512 << 10   # a message shared by the copy workers is cut no finer than this
MAX_INFLIGHT = 4          # messages holding pinned buffers (copies started, or the device may still be reading
#                           them) before the lander waits
LOOKAHEAD = 1             # messages whose host copies run on the copy workers while the launcher lands an earlier one
AUX_FRAMES = 16           # frames per message the pooled checksum/verdict buffers hold (more: one made per message)


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

    __slots__ = ("p", "h", "frames", "host", "owned", "caches", "ids", "heads", "future", "write", "event", "aux",
                 "ready", "fill", "queued_at")

    def __init__(self, p, h, frames, host, owned: bool, caches: list, ids: torch.Tensor, heads: range) -> None:
        self.p, self.h, self.frames, self.host, self.owned = p, h, frames, host, owned
        self.caches, self.ids, self.heads = caches, ids, heads
        self.future: Future = Future()
        self.write = self.event = self.aux = self.fill = None
        self.queued_at = 0.0     # perf_counter when its device work was queued (the trace's "device" span)
        self.ready = getattr(p, "ready", None)   # CUDA: the event of the pull's start (DecodeEndpoint.pull)


class Lander:
    """The landing threads of one decode endpoint (module doc): a launcher that copies and queues
    messages, and a watcher that sleeps on the oldest queued message's event and completes
    messages as the device ends them (so the launcher is never held up by an event unless a
    pinned buffer must be reused).

    Parameters
    ----------
    ops : FrameOps
        The device kernels (``verify_scatter``).
    stream : torch.cuda.Stream or None
        The endpoint's copy stream (None: CPU caches).
    pool : PinnedPool
        Pinned buffers for frames that were not received into one.
    executor : ThreadPoolExecutor, optional
        Threads that copy the pieces of a message into its pinned buffer in parallel (the
        endpoint's copy workers, ``workers`` of them: a message is cut in as many pieces, at most
        ``piece_bytes`` and at least ``MIN_PIECE_BYTES`` each, so all of them copy at once); None:
        the launcher copies them (and ``lookahead`` is 0).
    max_inflight : int
        Messages that may hold pinned buffers at once: started, or landed and not yet ended.
    lookahead : int
        Messages started (buffers taken, copies submitted) beyond the one being landed.
    report : callable(list of (LandJob, Exception or None))
        Called on a landing thread with finished messages (None: written; CorruptFrameError: a
        frame did not match, nothing written; other: the landing failed).
    alive : callable(LandJob) -> bool
        False when the message's pull is no longer pending (the message is dropped unwritten).
    trace : Trace, optional
        The endpoint's :class:`~kvconnector.trace.Trace`: ``land_start``, ``land`` and ``device``
        spans per message while it is enabled (:mod:`kvconnector.trace`).
    """

    def __init__(self, ops, stream, pool, report: Callable, alive: Callable, *, max_inflight: int = MAX_INFLIGHT,
                 piece_bytes: int = PIECE_BYTES, executor=None, workers: int = 0, lookahead: int = LOOKAHEAD,
                 name: str = "kvc-decode-land", trace: Trace | None = None) -> None:
        self.ops, self.stream, self.pool, self.report, self.alive = ops, stream, pool, report, alive
        self.trace = trace
        self.executor, self.workers = executor, workers
        self.max_inflight, self.piece_bytes = max(1, max_inflight), max(1, piece_bytes)
        self.lookahead = 0 if executor is None else max(0, lookahead)   # no workers: nothing to overlap
        # read by bench.transfer (DecodeEndpoint.stage_times): "launch" is all the launcher's work on
        # messages (wall time; "launch_cpu" the CPU time this thread used in it, so the difference is
        # time spent blocked: on host copies, the GIL, driver locks), "copy" the part of "launch"
        # spent waiting for (or running) host copies
        self.stage_s = {"copy": 0.0, "launch": 0.0, "launch_cpu": 0.0, "wait": 0.0, "messages": 0}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._started: deque = deque()     # host copies submitted, device work not queued yet (launcher only)
        self._inflight: deque = deque()    # launched, not yet completed; appended by the launcher only,
        self._cv = threading.Condition()   # popped by the watcher only
        self._closing = False
        self._aux_free: list = []          # AuxBuffers of AUX_FRAMES frames (CUDA caches)
        self._waited = None                # the last pull event the copy stream was made to wait for
        self._threads = [threading.Thread(target=self._launcher, name=name, daemon=True),
                         threading.Thread(target=self._watcher, name=f"{name}-wait", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, job: LandJob) -> None:
        """Queue a message (any thread; the I/O thread in practice)."""
        self._q.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        """Land what is queued, then stop both threads (bounded waits)."""
        self._q.put(None)
        self._threads[0].join(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._threads[1].join(timeout_s)

    # ---- launcher thread -------------------------------------------------------------
    def _launcher(self) -> None:
        if self.stream is not None:   # once for this thread: no stream switch per message (land_message current)
            torch.cuda.set_device(self.stream.device)
            torch.cuda.set_stream(self.stream)
        started = self._started
        while True:
            try:   # with messages started, land the oldest rather than wait for a new one
                job = self._q.get_nowait() if started else self._q.get(timeout=1.0)
            except queue.Empty:
                if started:
                    self._finish(started.popleft())
                continue
            if job is None:
                while started:
                    self._finish(started.popleft())
                return
            try:
                if not self.alive(job):
                    self._drop(job)
                    continue
                self._make_room()
                self._start(job)
            except Exception as e:
                self._fail(job, e)
                continue
            started.append(job)
            while len(started) > self.lookahead:
                self._finish(started.popleft())

    def _make_room(self) -> None:
        """Return once fewer than ``max_inflight`` messages hold pinned buffers: land started
        messages (their buffers are then the device's only), then wait for the device to end the
        oldest landed one."""
        while self._started and len(self._inflight) + len(self._started) >= self.max_inflight:
            self._finish(self._started.popleft())
        t0 = time.perf_counter()
        with self._cv:   # only the watcher shrinks _inflight: the bound holds once this wait is over
            while len(self._inflight) >= self.max_inflight:
                self._cv.wait(1.0)
        self.stage_s["wait"] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _launch_time(self, step: str, job: LandJob):
        """Add the wall and CPU seconds of the block to ``stage_s`` "launch" and "launch_cpu"; a
        ``step`` span of ``job`` in the trace."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.stage_s["launch"] += t1 - t0
            self.stage_s["launch_cpu"] += time.thread_time() - c0
            job.queued_at = t1
            if self.trace is not None and self.trace.enabled:
                self.trace.span(step, t0, t1, tid=job.h.tid, seq=job.h.seq)

    def _start(self, job: LandJob) -> None:
        """Take the message's pinned buffers and submit its host copies to the copy workers."""
        with self._launch_time("land_start", job):
            total = sum(job.h.nbytes)
            if job.host is None:
                job.host, job.owned = self.pool.acquire(total), True
            if self.stream is not None and len(job.h.nbytes) <= AUX_FRAMES:
                try:
                    job.aux = self._aux_free.pop()
                except IndexError:
                    job.aux = AuxBuffers(AUX_FRAMES, self.stream.device)
            if job.frames is not None:
                piece = self.piece_bytes
                if self.executor is not None and self.workers > 1:   # one piece per worker: the whole message at once
                    piece = min(piece, max(MIN_PIECE_BYTES, -(-total // self.workers)))
                job.fill = HostFill(job.host, job.frames, job.h.nbytes, piece, self.executor)

    def _finish(self, job: LandJob) -> None:
        """Wait for the message's host copies, queue its device copies, verify + scatter and event;
        hand it to the watcher (or drop it: its pull died meanwhile; or fail it)."""
        try:
            if not self.alive(job):
                self._drop(job)
                return
            with self._launch_time("land", job):
                try:
                    ready = job.ready if job.ready is not self._waited else None   # the stream waited already
                    job.write = land_message(self.ops, job.h, job.host, job.caches, job.ids, job.heads,
                                             self.stream, fill=job.fill, timings=self.stage_s, aux=job.aux,
                                             ready=ready, current=True)
                    self._waited = job.ready
                    job.event = _record(self.stream)
                except BaseException:
                    if self.stream is not None:
                        self.stream.synchronize()   # no device copy may still read the buffer handed back in _drop
                    raise
                finally:
                    self.stage_s["messages"] += 1
        except Exception as e:
            self._fail(job, e)
            return
        job.frames = job.fill = None    # ZeroMQ's buffers go back now
        with self._cv:
            self._inflight.append(job)
            self._cv.notify_all()

    # ---- watcher thread --------------------------------------------------------------
    def _watcher(self) -> None:
        while True:
            with self._cv:
                while not self._inflight and not self._closing:
                    self._cv.wait(1.0)
                if not self._inflight:
                    return
                oldest = self._inflight[0]
            err = None
            try:
                if oldest.event is not None:
                    oldest.event.synchronize()   # blocking event: this thread sleeps
            except Exception as e:   # a device error: this message fails its pull
                err = e
            with self._cv:   # the oldest and every later message the device has ended too
                done = [oldest]
                for job in list(self._inflight)[1:]:
                    try:
                        if job.event is not None and not job.event.query():
                            break
                    except Exception:   # its error surfaces when it is the oldest (synchronize)
                        break
                    done.append(job)
            out = []
            if self.trace is not None and self.trace.enabled:
                now = time.perf_counter()
                for job in done:
                    self.trace.span("device", job.queued_at, now, tid=job.h.tid, seq=job.h.seq)
            for job in done:
                e = err if job is oldest else None
                if e is None:
                    try:
                        e = job.write.error()
                    except Exception as x:
                        e = x
                dropped = self._drop(job)    # buffer back to the pool before the launcher may need it
                out.append((job, e if e is not None else dropped))
            with self._cv:
                for _ in done:
                    self._inflight.popleft()
                self._cv.notify_all()
            self._send(out)

    # ---- either thread ---------------------------------------------------------------
    def _drop(self, job: LandJob) -> Exception | None:
        """The device no longer reads this message's buffers: once no copy worker writes them
        either, hand them back and settle its future. Returns what handing the buffer back raised,
        if anything (the message then fails its pull)."""
        if job.fill is not None:
            fill, job.fill = job.fill, None
            fill.wait()
        job.frames = None
        err = None
        if job.aux is not None:
            aux, job.aux = job.aux, None
            self._aux_free.append(aux)
        if job.owned and job.host is not None:
            host, job.host = job.host, None
            try:
                self.pool.release(host)
            except Exception as e:
                err = e
        if not job.future.done():
            job.future.set_result(None)
        return err

    def _fail(self, job: LandJob, e: Exception) -> None:
        self._drop(job)
        self._send([(job, e)])   # the pull fails with it (write_error)

    def _send(self, done: list) -> None:
        if done:
            try:
                self.report(done)
            except Exception:   # the endpoint is closing (its loop is gone): nobody to tell
                pass
