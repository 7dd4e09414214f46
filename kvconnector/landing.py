"""Decode side, device path: lands received ``mix64`` messages on the caches off the I/O thread.

The I/O thread receives a ``mix64`` BLOCKS message (into a pooled pinned buffer with
``recv_into``, the default for CUDA caches; or zero copy: ZeroMQ's own frames), checks its header
against the pull and hands it to the endpoint's :class:`Lander`, then goes straight back to the
socket for the next message. The lander's launcher thread (first in first out, so the device work
of messages stays in arrival order on the copy stream) works on each message in two phases, and
starts the next message before it stages this one, so the copy workers copy message k+1 while
the launcher queues message k's device copy:

1. start: takes a pinned buffer from the pool and submits the copies of the frames into it, in
   pieces of ``piece_bytes``, to the endpoint's copy workers (NumPy copies, which release the
   GIL; one piece each). Before that, while ``max_inflight`` messages or ``max_inflight_bytes``
   of payload hold pinned buffers (started, staged, or verified and still read by the device),
   it stages the started ones, queues the open group's verify + scatter, and waits for the
   device to end the oldest group (its buffers are back in the pool then), so a buffer is never
   refilled before the device copy that reads it ended, and no more than those bounds are held;
2. stage (once ``lookahead`` later messages are started, or none is waiting): queues the copy of
   the message into the open group's device staging buffer (a payload already in pinned memory,
   received into the pool or written by NIXL, in one copy; otherwise piece by piece right behind
   the workers' host copies, :func:`kvconnector.device_frames.stage_payload`).

A group is the messages of one pull staged back to back whose payloads follow each other in the
pull's layer-major payload (:func:`kvconnector.protocol.payload_cells`: the next positions of a
layer, the next layers, across layer boundaries too), up to ``group_bytes`` and ``AUX_FRAMES``
frames. It is closed, its verify + scatter queued (:func:`kvconnector.device_frames.verify_group`:
the scatter writes nothing unless every frame of the group matched) and a blocking event
recorded, as soon as the next message does not extend it, it has no room for one more message of
its last one's size, it holds its stream's ``last`` message, or no message has come for
``linger_s`` (2 ms: longer than a few MiB take on the wire). So the three Triton launches of a
verify + scatter (~0.1 ms of host time) are paid once a group, not once a message, also by a
landing thread that keeps up with the socket; each message's copy to the device is still queued
as soon as it is in, and the pull's last message closes its group at once.

A pull of at most ``whole_bytes`` (32 MiB) of payload in more than one message is staged
*whole*: its first message to come makes a device buffer of the pull's whole payload, each message
is copied to its own place in it (the payload cells it carries), in whatever order the messages
come (lanes deliver them out of order), and the pull's last message to come queues one verify +
scatter of all of them: one pass a pull instead of one a message. A whole pull that gets no message
for ``linger_s`` is verified as it is, each run of messages that follow each other in the payload
in a pass of its own, so a bad message still fails its pull at once when the rest does not come.

Without copy workers the launcher copies the pieces itself in the stage phase, right after the
start: there is nothing to overlap.

Every torch call releases and retakes the GIL, a hand-off that waits on the process's other
Python threads (the I/O thread, the watcher, copy workers), so the launcher makes few per
message: it makes the copy stream its current stream and the caches' device its current device
once, reuses pooled checksum buffers whose views were made once (:class:`AuxBuffers`), and makes
the copy stream wait for a pull's start event once, not once per group.

Its watcher thread sleeps on the oldest queued group's event (the thread sleeps, it does not
spin) and, once the device has ended it, completes it and every later group already ended:
their pinned buffers go back to the pool, then one ``report`` hands their messages to the I/O
thread, which marks the blocks landed, or fails the pull with the :class:`CorruptFrameError` of
the first mismatching frame (every message of that group reports it: none was written). So the
last message of a pull is reported as soon as the device has written it, and the launcher never
waits on an event unless it needs a buffer back.

A message of a pull that is no longer pending (failed, aborted) is dropped before its copy, or,
once staged, its group's verify + scatter is not queued (its buffers go back once the device copies
that read them ended). A message whose landing fails fails its pull with that error, nothing of
its group written. :meth:`Lander.close` lands what is queued and started first. Every message
carries a future in its pull's ``jobs``, set once the lander is done with it (written, failed or
dropped), which :meth:`DecodeEndpoint._fail` waits for (bounded) before it reports blocks.

On CPU caches there is no stream: the group's staging buffer is host memory, the kernels run in
the call, and no event is recorded (``_record`` is the seam tests replace with fake events to
drive the in-flight logic on CPU).
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

from .device_frames import GROUP_BYTES, AuxBuffers, HostFill, stage_payload, verify_group
from .protocol import payload_cells
from .trace import Trace

PIECE_BYTES = 2 << 20     # host copy -> device copy granularity: small enough that the DMA of a piece overlaps the
#                           copy of the next and the copy workers share a message, large enough to amortize each call
MIN_PIECE_BYTES = 512 << 10   # a message shared by the copy workers is cut no finer than this
# messages holding pinned buffers (copies started, or the device may still be reading them), and their
# payload bytes, before the lander waits
MAX_INFLIGHT = 64
MAX_INFLIGHT_BYTES = 64 << 20
LINGER_S = 0.002          # an open group that may still grow waits this long for its next message
LOOKAHEAD = 1             # messages whose host copies run on the copy workers while the launcher stages an earlier one
AUX_FRAMES = 64           # frames per group the pooled checksum/verdict buffers hold (a group holds no more)
WHOLE_BYTES = 32 << 20    # a pull of at most this many payload bytes is staged whole and verified in one pass


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
    ``owned``: ``host`` came from the pool and goes back to it once the device has read it;
    ``caches`` / ``ids``: the message's layers and destination blocks; ``layers`` / ``pull_ids``
    (optional): every layer of the endpoint and the pull's destination blocks (``[n]`` int64, the
    tensor ``ids`` is a slice of), which let it share a group with the pull's next messages.
    """

    __slots__ = ("p", "h", "frames", "host", "owned", "caches", "ids", "heads", "future", "fill", "queued_at",
                 "ready", "layers", "pull_ids")

    def __init__(self, p, h, frames, host, owned: bool, caches: list, ids: torch.Tensor, heads: range, *,
                 layers: list | None = None, pull_ids: torch.Tensor | None = None) -> None:
        self.p, self.h, self.frames, self.host, self.owned = p, h, frames, host, owned
        self.caches, self.ids, self.heads = caches, ids, heads
        self.layers, self.pull_ids = layers, pull_ids
        self.future: Future = Future()
        self.fill = None
        self.queued_at = 0.0     # perf_counter when its device work was queued (the trace's "device" span)
        self.ready = getattr(p, "ready", None)   # CUDA: the event of the pull's start (DecodeEndpoint.pull)


def _cells(job: LandJob) -> tuple | None:
    """The pull's payload cells ``[a, b)`` the message carries (:func:`payload_cells`), or None
    when it cannot share a group (no pull-wide tensors given, or not one stretch)."""
    if job.pull_ids is None or job.layers is None:
        return None
    h = job.h
    return payload_cells(h.layer, h.nlay, h.first, h.nblk, job.pull_ids.numel())


def _whole(job: LandJob, limit: int) -> tuple | None:
    """``(cells, cell_bytes)``: the pull's payload cells and the bytes of one, when the message's
    pull is staged whole (its payload at most ``limit`` bytes, more than this message); else None."""
    cells = _cells(job)
    if cells is None or cells[1] <= cells[0]:
        return None
    size = sum(job.h.nbytes)
    cell = size // (cells[1] - cells[0])
    total = len(job.layers) * job.pull_ids.numel()
    return (total, cell) if size < total * cell <= limit and cell * (cells[1] - cells[0]) == size else None


class _Group:
    """Messages of one pull staged back to back in one device buffer, verified + scattered in one
    pass; ``span``: the payload cells ``[a, b)`` of the pull they cover, or None for a message
    verified alone on its own layers and blocks. A whole pull's group (``cell``: bytes per cell)
    holds each message at its own place in the pull's payload, in whatever order they come."""

    __slots__ = ("jobs", "staging", "used", "frames", "span", "aux", "write", "event", "live", "cell", "added")

    def __init__(self, staging: torch.Tensor) -> None:
        self.jobs, self.staging, self.used, self.frames, self.span = [], staging, 0, 0, None
        self.cell, self.added = 0, 0.0
        self.aux = self.write = self.event = None
        self.live = True      # False: the pull died before the verify + scatter was queued (none queued)

    def extended(self, job: LandJob) -> tuple | None:
        """The span the group covers with ``job`` added (its payload follows the group's: same
        pull and heads, room left), else None."""
        j0 = self.jobs[0]
        if self.span is None or job.p is not j0.p or job.heads != j0.heads or not self.has_room(job.h):
            return None
        cells = _cells(job)
        return None if cells is None or cells[0] != self.span[1] else (self.span[0], cells[1])

    def has_room(self, h) -> bool:
        """Whether a message with header ``h`` fits beside the group's: its frames in the pooled
        checksum buffers (``AUX_FRAMES``), its payload in the staging buffer."""
        return self.frames + len(h.nbytes) <= AUX_FRAMES and self.used + sum(h.nbytes) <= self.staging.numel()

    def add(self, job: LandJob, span: tuple | None) -> None:
        self.jobs.append(job)
        self.span = span
        self.used += sum(job.h.nbytes)
        self.frames += len(job.h.nbytes)


class Lander:
    """The landing threads of one decode endpoint (module doc): a launcher that copies, stages and
    queues messages in groups, and a watcher that sleeps on the oldest queued group's event and
    completes groups as the device ends them (so the launcher is never held up by an event unless
    a pinned buffer must be reused).

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
    max_inflight, max_inflight_bytes : int
        Messages, and their payload bytes, that may hold pinned buffers at once: started, staged,
        or verified and not yet ended (one message at least, whatever its size).
    lookahead : int
        Messages started (buffers taken, copies submitted) beyond the one being staged.
    group_bytes : int
        Device staging bytes of a group (0: every message verified alone).
    linger_s : float
        How long an open group that may still grow waits for its next message before its
        verify + scatter is queued (0: as soon as nothing more is waiting); a whole pull's group
        too, before the messages it holds are verified by runs.
    whole_bytes : int, optional
        Pulls of at most this many payload bytes are staged whole (module doc); 0: never. Default
        ``WHOLE_BYTES``, read when the lander is made.
    report : callable(list of (LandJob, Exception or None))
        Called on a landing thread with finished messages (None: written; CorruptFrameError: a
        frame of its group did not match, nothing of the group written; other: the landing failed).
    alive : callable(LandJob) -> bool
        False when the message's pull is no longer pending (the message is dropped unwritten).
    trace : Trace, optional
        The endpoint's :class:`~kvconnector.trace.Trace`: ``land_start``, ``land`` and ``device``
        spans per message and a ``verify`` span per group (named by its first message, with its
        ``messages``) while it is enabled (:mod:`kvconnector.trace`).
    """

    def __init__(self, ops, stream, pool, report: Callable, alive: Callable, *, max_inflight: int = MAX_INFLIGHT,
                 max_inflight_bytes: int = MAX_INFLIGHT_BYTES, piece_bytes: int = PIECE_BYTES, executor=None,
                 workers: int = 0, lookahead: int = LOOKAHEAD, group_bytes: int = GROUP_BYTES,
                 linger_s: float = LINGER_S, whole_bytes: int | None = None, name: str = "kvc-decode-land",
                 trace: Trace | None = None) -> None:
        self.ops, self.stream, self.pool, self.report, self.alive = ops, stream, pool, report, alive
        self.trace = trace
        self.executor, self.workers = executor, workers
        self.max_inflight, self.piece_bytes = max(1, max_inflight), max(1, piece_bytes)
        self.max_inflight_bytes = max(1, max_inflight_bytes)
        self.group_bytes, self.linger_s = max(0, group_bytes), max(0.0, linger_s)
        self.whole_bytes = max(0, WHOLE_BYTES if whole_bytes is None else whole_bytes)
        self.lookahead = 0 if executor is None else max(0, lookahead)   # no workers: nothing to overlap
        # read by bench.transfer (DecodeEndpoint.stage_times): "launch" is all the launcher's work on
        # messages (wall time; "launch_cpu" the CPU time this thread used in it, so the difference is
        # time spent blocked: on host copies, the GIL, driver locks), "copy" the part of "launch"
        # spent waiting for (or running) host copies; "groups" the verify + scatter passes queued
        self.stage_s = {"copy": 0.0, "launch": 0.0, "launch_cpu": 0.0, "wait": 0.0, "messages": 0, "groups": 0}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._started: deque = deque()     # host copies submitted, not staged yet (launcher only)
        self._group: _Group | None = None  # staged, verify + scatter not queued yet (launcher only)
        self._wholes: dict = {}            # id(pull) -> its whole-pull group, messages still to come (launcher only)
        self._inflight: deque = deque()    # groups queued, not yet completed; appended by the launcher only,
        self._held = self._held_bytes = 0  # popped by the watcher only; _held(_bytes): their messages (bytes)
        self._cv = threading.Condition()
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
        if self.stream is not None:   # once for this thread: no stream switch per message (verify_group current)
            torch.cuda.set_device(self.stream.device)
            torch.cuda.set_stream(self.stream)
        started = self._started
        while True:
            try:   # with messages started, go on with them rather than wait for a new one
                wait = 0.0 if started else 1.0 if self._group is None else self._linger()
                if self._wholes:
                    wait = min(wait, max(0.0, min(g.added for g in self._wholes.values()) + self.linger_s
                                         - time.perf_counter()))
                job = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
            except queue.Empty:
                if started:
                    self._stage(started.popleft())
                else:
                    self._close_group()    # nothing more waiting: verify what is staged
                    self._sweep_wholes()
                continue
            if job is None:
                while started:
                    self._stage(started.popleft())
                self._close_group()
                self._sweep_wholes(closing=True)
                return
            try:
                if not self.alive(job):
                    self._drop(job)
                    continue
                self._make_room(sum(job.h.nbytes))
                self._start(job)
            except Exception as e:
                self._fail(job, e)
                continue
            started.append(job)
            while len(started) > self.lookahead:
                self._stage(started.popleft())

    def _linger(self) -> float:
        """Seconds the open group waits for its next message: ``linger_s`` while it may still grow
        (room for another message of its last one's size, not its stream's last message), else 0."""
        g = self._group
        h = g.jobs[-1].h
        return self.linger_s if g.span is not None and not h.last and g.has_room(h) else 0.0

    def _make_room(self, nbytes: int) -> None:
        """Return once a message of ``nbytes`` fits the bounds (``max_inflight`` messages,
        ``max_inflight_bytes``) beside the messages holding pinned buffers: stage the started
        messages and queue the open group's verify + scatter (their buffers are then the device's
        only), then wait for the device to end the oldest groups."""
        g, started = self._group, self._started
        n = len(started) + (len(g.jobs) if g else 0)
        if self._full(n, sum(sum(j.h.nbytes) for j in started) + (g.used if g else 0), nbytes):
            while self._started:
                self._stage(self._started.popleft())
            self._close_group()
        t0 = time.perf_counter()
        with self._cv:   # only the watcher shrinks _held: the bound holds once this wait is over
            while self._full(0, 0, nbytes):
                self._cv.wait(1.0)
        self.stage_s["wait"] += time.perf_counter() - t0

    def _full(self, n: int, held_bytes: int, nbytes: int) -> bool:
        """Whether one more message of ``nbytes`` would pass a bound, with ``n`` messages of
        ``held_bytes`` held besides the queued groups' (none held: it always fits)."""
        n, held_bytes = n + self._held, held_bytes + self._held_bytes
        return n >= self.max_inflight or (n > 0 and held_bytes + nbytes > self.max_inflight_bytes)

    @contextlib.contextmanager
    def _launch_time(self, step: str, job: LandJob, **args):
        """Add the wall and CPU seconds of the block to ``stage_s`` "launch" and "launch_cpu"; a
        ``step`` span of ``job`` (and ``args``) in the trace."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.stage_s["launch"] += t1 - t0
            self.stage_s["launch_cpu"] += time.thread_time() - c0
            if self.trace is not None and self.trace.enabled:
                self.trace.span(step, t0, t1, tid=job.h.tid, seq=job.h.seq, **args)

    def _start(self, job: LandJob) -> None:
        """Take the message's pinned buffer and submit its host copies to the copy workers."""
        with self._launch_time("land_start", job):
            total = sum(job.h.nbytes)
            if job.host is None:
                job.host, job.owned = self.pool.acquire(total), True
            if job.frames is not None:
                piece = self.piece_bytes
                if self.executor is not None and self.workers > 1:   # one piece per worker: the whole message at once
                    piece = min(piece, max(MIN_PIECE_BYTES, -(-total // self.workers)))
                job.fill = HostFill(job.host, job.frames, job.h.nbytes, piece, self.executor)

    def _stage(self, job: LandJob) -> None:
        """Queue the message's copy into the open group's staging buffer (closing that group
        first when the message does not extend it); drop it if its pull died meanwhile, fail it
        (alone) if staging fails."""
        if not self.alive(job):
            self._close_group()   # before _drop, which may wait for this message's copies
            self._drop(job)
            return
        whole = _whole(job, self.whole_bytes) if self.whole_bytes else None
        if whole is not None:
            return self._stage_whole(job, *whole)
        g = self._group
        span = None if g is None else g.extended(job)
        if span is None:
            self._close_group()
            g, span = None, _cells(job)
        size = max(sum(job.h.nbytes), self.group_bytes if span is not None else 0)
        g = self._copy_in(job, g, 0 if g is None else g.used, size)
        if g is not None:
            g.add(job, span)
            self._group = g

    def _stage_whole(self, job: LandJob, cells: int, cell: int) -> None:
        """Queue the message's copy to its place in its pull's whole staging buffer (``cells`` of
        ``cell`` bytes), made by the pull's first message to come; the pull's last message to come
        queues the verify + scatter of all of them (headers in payload order). A failed copy fails
        the message's pull; the sweep then hands the group's other messages back."""
        g = self._copy_in(job, self._wholes.get(id(job.p)), _cells(job)[0] * cell, cells * cell)
        if g is None:
            return
        if g.span is None:       # made for this message
            g.span, g.cell = (0, cells), cell
            self._wholes[id(job.p)] = g
        g.add(job, g.span)
        g.added = time.perf_counter()
        if g.used == g.staging.numel():
            del self._wholes[id(job.p)]
            g.jobs.sort(key=lambda j: _cells(j)[0])
            self._queue(g)

    def _copy_in(self, job: LandJob, g: _Group | None, at: int, size: int) -> _Group | None:
        """Queue the copy of the message's payload into group ``g``'s staging buffer at byte ``at``
        (``g`` None: into a new group of ``size`` bytes); the group, or None when the copy failed
        (the message failed, alone)."""
        total = sum(job.h.nbytes)
        try:
            with self._launch_time("land", job):
                try:
                    if g is None:
                        device = "cpu" if self.stream is None else self.stream.device
                        g = _Group(torch.empty(size, dtype=torch.uint8, device=device))   # on the copy stream
                    stage_payload(job.host, g.staging[at:at + total], fill=job.fill, timings=self.stage_s)
                except BaseException:
                    if self.stream is not None:
                        self.stream.synchronize()   # no device copy may still read the buffer handed back in _drop
                    raise
                finally:
                    self.stage_s["messages"] += 1
        except Exception as e:
            self._fail(job, e)
            return None
        job.frames = job.fill = None    # ZeroMQ's buffers go back now
        return g

    def _sweep_wholes(self, closing: bool = False) -> None:
        """Whole-pull groups whose pull died go to the watcher unverified (their messages are
        dropped once the device copies that read them ended); those that got no message for
        ``linger_s`` (all, when ``closing``) are verified as they are: each run of messages that
        follow each other in the pull's payload, one pass each (so a bad message of a pull whose
        other messages do not come still fails it now)."""
        now = time.perf_counter()
        for p, g in list(self._wholes.items()):
            live = all(self.alive(j) for j in g.jobs)
            if live and not closing and now - g.added < self.linger_s:
                continue
            del self._wholes[p]
            if not live:
                self._queue(g, dead=True)
                continue
            g.jobs.sort(key=lambda j: _cells(j)[0])
            run = None
            for j in g.jobs:
                a, b = _cells(j)
                if run is not None and run.span[1] == a and run.has_room(j.h):
                    run.add(j, (run.span[0], b))
                    continue
                if run is not None:
                    self._queue(run)
                run = _Group(g.staging[a * g.cell:])      # a view: the pull's buffer, from this message on
                run.add(j, (a, b))
            self._queue(run)

    def _close_group(self) -> None:
        """Queue the open group's verify + scatter (:meth:`_queue`)."""
        g, self._group = self._group, None
        if g is not None:
            self._queue(g)

    def _queue(self, g: _Group, dead: bool = False) -> None:
        """Queue a group's verify + scatter and its event and hand it to the watcher (its pull died
        meanwhile, or ``dead``: only the event, its messages are dropped once the copies ended)."""
        j0 = g.jobs[0]
        g.live = not dead and all(self.alive(j) for j in g.jobs)
        try:
            with self._launch_time("verify", j0, messages=len(g.jobs)):
                try:
                    if g.live:
                        if self.stream is not None:
                            try:
                                g.aux = self._aux_free.pop() if g.frames <= AUX_FRAMES else None
                            except IndexError:
                                g.aux = AuxBuffers(AUX_FRAMES, self.stream.device)
                        caches, ids, start = ((j0.caches, j0.ids, None) if g.span is None
                                              else (j0.layers, j0.pull_ids, g.span[0]))
                        ready = j0.ready if j0.ready is not self._waited else None   # the stream waited already
                        g.write = verify_group(self.ops, [j.h for j in g.jobs], g.staging[:g.used], caches, ids,
                                               j0.heads, self.stream, aux=g.aux, ready=ready, current=True,
                                               start=start)
                        self._waited = j0.ready
                        self.stage_s["groups"] += 1
                    g.event = _record(self.stream)
                except BaseException:
                    if self.stream is not None:
                        self.stream.synchronize()
                    raise
        except Exception as e:
            self._release_aux(g)
            for j in g.jobs:
                self._fail(j, e)
            return
        now = time.perf_counter()
        for j in g.jobs:
            j.queued_at = now
        with self._cv:
            self._inflight.append(g)
            self._held += len(g.jobs)
            self._held_bytes += g.used
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
            except Exception as e:   # a device error: this group fails its pull
                err = e
            with self._cv:   # the oldest and every later group the device has ended too
                done = [oldest]
                for g in list(self._inflight)[1:]:
                    try:
                        if g.event is not None and not g.event.query():
                            break
                    except Exception:   # its error surfaces when it is the oldest (synchronize)
                        break
                    done.append(g)
            out = []
            if self.trace is not None and self.trace.enabled:
                now = time.perf_counter()
                for g in done:
                    for job in g.jobs:
                        self.trace.span("device", job.queued_at, now, tid=job.h.tid, seq=job.h.seq)
            for g in done:
                e = err if g is oldest else None
                if e is None and g.live:
                    try:
                        e = g.write.error()
                    except Exception as x:
                        e = x
                self._release_aux(g)
                for job in g.jobs:     # buffers back to the pool before the launcher may need them
                    dropped = self._drop(job)
                    if g.live or dropped is not None:
                        out.append((job, e if e is not None else dropped))
            with self._cv:
                for g in done:
                    self._inflight.popleft()
                    self._held -= len(g.jobs)
                    self._held_bytes -= g.used
                self._cv.notify_all()
            self._send(out)

    # ---- either thread ---------------------------------------------------------------
    def _release_aux(self, g: _Group) -> None:
        if g.aux is not None:
            aux, g.aux = g.aux, None
            self._aux_free.append(aux)

    def _drop(self, job: LandJob) -> Exception | None:
        """The device no longer reads this message's buffers: once no copy worker writes them
        either, hand them back and settle its future. Returns what handing the buffer back raised,
        if anything (the message then fails its pull)."""
        if job.fill is not None:
            fill, job.fill = job.fill, None
            fill.wait()
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

    def _fail(self, job: LandJob, e: Exception) -> None:
        self._drop(job)
        self._send([(job, e)])   # the pull fails with it (write_error)

    def _send(self, done: list) -> None:
        if done:
            try:
                self.report(done)
            except Exception:   # the endpoint is closing (its loop is gone): nobody to tell
                pass
