"""The device path of a payload: gather + checksum on the GPU, verify + scatter on the GPU.

Used when both endpoints negotiated ``mix64`` (docs/PROTOCOL.md, "Checksums") and the caller
gave the endpoint the device kernels as :class:`FrameOps` (``kvconnector`` does not import
``kernels``; ``kernels.transfer.FRAME_OPS`` is the implementation, injected like the writer of
``kvconnector/convert.py``). Then the host runs no pass over the payload at all:

- prefill (:func:`gather_messages`): one kernel gathers the blocks of a group of consecutive
  messages (one stretch of the pull's layer-major payload, across layers too) into a device
  buffer and computes each message's ``mix64``; one device-to-host copy per message puts its
  payload in a pinned buffer that is sent with zero copy, the checksums follow in one small copy.
  All is queued on the endpoint's copy stream, so the next group is gathered and copied while
  this one is on the wire.
- decode (run by the endpoint's landing thread, :mod:`kvconnector.landing`): each message's
  payload is copied to its place in a device staging buffer (:func:`stage_payload`: received
  straight into pinned memory, one host-to-device copy; else copied piece by piece into one pinned
  buffer first, :class:`HostFill`, the device copy of each piece queued right behind it); the
  consecutive messages of a pull are staged back to back, and one kernel pass verifies
  every frame of them against their headers and a scatter kernel writes their blocks only if all
  matched (:func:`verify_group`; it reads the mismatch count on the device). The host reads the
  count once the copy stream passes that point (:meth:`DeviceWrite.error`) and fails the pull with
  a :class:`CorruptFrameError`; the destination blocks of those messages were not written.

On CPU caches the same kernels run through Triton's interpreter on host memory (how the path
is tested without a GPU), nothing queued on a stream: the prefill's gather runs on one gather
thread (:func:`_cpu_gather_thread`; seconds a message through the interpreter, which the I/O
thread must spend answering heartbeats instead), the decode side's steps complete in the call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple, Protocol

import numpy as np
import torch

from layouts import CorruptFrameError

from .protocol import Header

_MASK = (1 << 64) - 1
GROUP_BYTES = 8 << 20     # payload bytes one device pass covers: a prefill gather of consecutive messages, a
#                           decode verify + scatter of consecutive messages (kvconnector.sender, .landing)
_cpu_gathers: ThreadPoolExecutor | None = None
_cpu_gathers_lock = threading.Lock()


def _cpu_gather_thread() -> ThreadPoolExecutor:
    """The one thread that runs CPU-cache gathers (:func:`gather_messages`): through Triton's
    interpreter a message takes seconds, which on the prefill's I/O thread would leave its peer
    without an answer to its heartbeats for as long."""
    global _cpu_gathers
    with _cpu_gathers_lock:
        if _cpu_gathers is None:
            _cpu_gathers = ThreadPoolExecutor(1, thread_name_prefix="kvc-frames")
        return _cpu_gathers


class FrameOps(Protocol):
    """Device kernels the endpoints call (``kernels.transfer.FRAME_OPS``); every call is queued on
    the current stream and returns at once. Tensors are on the caches' device; checksums are
    ``mix64`` values stored as the bits of int64."""

    def gather(self, caches: list, block_ids: torch.Tensor, *, out: torch.Tensor, checksums: torch.Tensor,
               heads: tuple | None = None, frame_nbytes=None, start: int | None = None) -> None: ...

    def verify_scatter(self, staging: torch.Tensor, expected: torch.Tensor, caches: list,
                       block_ids: torch.Tensor, *, ok: torch.Tensor, checksums: torch.Tensor | None = None,
                       heads: tuple | None = None, frame_nbytes=None, start: int | None = None) -> None: ...

    # ``start`` (both): the buffer holds whole (layer, position) cells of the layer-major payload
    # of ``caches`` x ``block_ids`` from cell ``layer·k + position`` on; None: the whole payload.

    def warmup(self, device) -> None:
        """Compile the kernels for ``device`` (endpoints call it at construction, when present)."""


def warm(ops, device) -> None:
    """Let ``ops`` compile for ``device`` now (its optional ``warmup``), off the I/O thread."""
    fn = getattr(ops, "warmup", None)
    if fn is not None:
        fn(device)


def frame_views(buf: torch.Tensor, nbytes: list) -> list:
    """Numpy views of consecutive frames of ``nbytes`` bytes at the start of host buffer ``buf``."""
    arr, views, off = buf.numpy(), [], 0
    for n in nbytes:
        views.append(arr[off:off + n])
        off += n
    return views


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class DeviceGather:
    """A gathered message being copied to host memory; future-like (``done``, ``cancel``,
    ``result``) so the sender treats it like a staging job."""

    def __init__(self, event, frames: list, sums: torch.Tensor, future=None) -> None:
        self.event, self.frames, self.sums, self.future = event, frames, sums, future

    @property
    def background(self) -> bool:
        """Whether a host thread computes it (CPU caches): the sender waits for :meth:`done`
        instead of blocking in :meth:`result`."""
        return self.future is not None

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()

    def cancel(self) -> bool:
        if self.future is not None:
            return self.future.cancel()   # not started yet
        return False      # queued device work cannot be recalled; busy() waits for it

    def result(self) -> tuple[list, list]:
        """``(payload frames, checksums)`` once the copies have landed (waits for the event or
        the gather thread; raises what the gather raised)."""
        if self.future is not None:
            self.future.result()
        elif self.event is not None:
            self.event.synchronize()
        return self.frames, [int(v) & _MASK for v in self.sums.tolist()]


def gather_messages(ops: FrameOps, caches: list, block_ids: torch.Tensor, heads: range, hosts: list,
                    copy_stream, *, start: int | None = None) -> list:
    """Queue one gather + ``mix64`` of consecutive messages (one frame each) whose payloads
    concatenate to the layer-major payload of ``caches`` x ``block_ids`` (or, with ``start``, to the
    stretch of it from that cell on), then each message's copy into its host buffer; one
    :class:`DeviceGather` per message, each ready once its own copy has landed (the first message
    can leave while the later ones are still copied).

    Parameters
    ----------
    caches : list of packed per-layer caches (read only): the messages' layers in order, or, with
        ``start``, every layer of the pull
    block_ids : [k] int64 on the caches' device, source blocks in transfer order
    heads : range of local heads to send
    hosts : list of [n_i] uint8, CPU (pinned for CUDA caches), the messages' payloads in order
        (``sum(n_i) = nlay·k·2·N·h·P``, or whole cells from ``start``), each written once its
        event fires
    copy_stream : torch.cuda.Stream, or None for CPU caches (the kernels then write the payloads
        directly, on one gather thread of the process: :func:`_cpu_gather_thread`)
        Already ordered after the writes of the blocks (it waited for the event recorded at
        publish): nothing else queued on other streams since, e.g. the next forward pass, holds
        the gather back.
    start : int, optional
        The payload cell (``layer·k + position``) the first message starts at.
    """
    hd = (heads.start, heads.stop)
    sizes = [h.numel() for h in hosts]
    split = sizes if len(sizes) > 1 else None
    if copy_stream is None:   # on the gather thread, so the caller's thread keeps serving its socket
        sums = torch.empty(len(hosts), dtype=torch.int64)

        def run():
            out = hosts[0] if split is None else torch.empty(sum(sizes), dtype=torch.uint8)
            ops.gather(caches, block_ids, out=out, checksums=sums, heads=hd, frame_nbytes=split, start=start)
            if split is not None:
                off = 0
                for h, n in zip(hosts, sizes):
                    h.copy_(out[off:off + n])
                    off += n
        job = _cpu_gather_thread().submit(run)
        return [DeviceGather(None, [h.numpy()], sums[j:j + 1], job) for j, h in enumerate(hosts)]
    device = caches[0].device
    out, off = [], 0
    with torch.cuda.stream(copy_stream):   # allocated on this stream: reuse is ordered after these copies
        dev = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dev_sums = torch.empty(len(hosts), dtype=torch.int64, device=device)
        ops.gather(caches, block_ids, out=dev, checksums=dev_sums, heads=hd, frame_nbytes=split, start=start)
        sums = torch.empty(len(hosts), dtype=torch.int64, pin_memory=True)
        sums.copy_(dev_sums, non_blocking=True)
        for j, (h, n) in enumerate(zip(hosts, sizes)):
            h.copy_(dev[off:off + n], non_blocking=True)
            off += n
            event = torch.cuda.Event(blocking=True)   # the I/O thread sleeps in result() instead of spinning
            event.record(copy_stream)
            out.append(DeviceGather(event, [h.numpy()], sums[j:j + 1]))
    return out


class DeviceWrite:
    """A received message, or a group of them staged back to back, queued for verify + scatter;
    :meth:`error` once the device work queued with it has ended.

    ``headers``: the message's :class:`Header`, or the group's, in staging order (their frames
    are the verified frames, in that order); ``ok`` / ``sums``: the verdict and computed checksums
    (host tensors, readable once the device work ended)."""

    def __init__(self, on_device: bool, headers, ok: torch.Tensor, sums: torch.Tensor) -> None:
        self.on_device, self.ok, self.sums = on_device, ok, sums
        self.headers = [headers] if isinstance(headers, Header) else list(headers)

    def error(self) -> CorruptFrameError | None:
        """The checksum mismatch of the first bad frame (nothing of the message, or of its group,
        was written), or None."""
        ok = self.ok.tolist()
        if ok[-1] == 0:
            return None
        i = ok.index(0)
        got = int(self.sums[i]) & _MASK
        for h in self.headers:   # the message holding frame i, and its frame index there
            if i < len(h.nbytes):
                break
            i -= len(h.nbytes)
        where = "the GPU" if self.on_device else "the host"
        grouped = f" (verified with {len(self.headers) - 1} other message(s) of the pull, none written)" \
            if len(self.headers) > 1 else ""
        return CorruptFrameError(f"BLOCKS {h.tid!r} layer {h.layer} payload frame {i} checksum ({h.algorithm}, "
                                 f"verified on {where}): expected {h.checksums[i]:#018x}, got {got:#018x}{grouped}")


def stage_payload(host: torch.Tensor, staging: torch.Tensor, *, fill: HostFill | None = None,
                  timings: dict | None = None) -> None:
    """Copy one received message's payload into its place in a group's staging buffer.

    Parameters
    ----------
    host : [n] uint8, CPU (pinned for CUDA caches)
        The payload back to back: received into it already (``fill`` None) or filled by ``fill``;
        untouched until the device has read it (the group's event).
    staging : [n] uint8, on the caches' device (CPU caches: host memory)
        The message's slice of the group's staging buffer; CUDA: the copy is queued on the
        current stream (the landing thread's copy stream), the host-to-device copy of each
        piece right behind its host copy (:meth:`HostFill.run`).
    """
    if fill is not None:
        fill.run(staging if staging.is_cuda else None, timings)
        if staging.is_cuda:
            return
    staging.copy_(host, non_blocking=staging.is_cuda)


def verify_group(ops: FrameOps, headers: list, staging: torch.Tensor, caches: list, block_ids: torch.Tensor,
                 heads: range, copy_stream, *, aux: AuxBuffers | None = None, ready=None,
                 current: bool = False, start: int | None = None) -> DeviceWrite:
    """Queue verify + scatter of messages staged back to back in ``staging`` (one, or a group whose
    payloads follow each other in the pull's layer-major payload,
    :func:`~kvconnector.protocol.payload_cells`); the scatter writes nothing unless every frame of
    every message matched.

    Parameters
    ----------
    headers : list of Header
        The BLOCKS headers in staging order (frame byte counts already checked against the
        frames received); their frames, in order, are the frames verified.
    staging : [sum of every header's nbytes] uint8, on the caches' device (CPU caches: host memory)
    caches : list of the packed per-layer caches the message covers, or with ``start`` every layer
        of the pull (written only on a match, only the cells staged)
    block_ids : [nblk] int64 on the caches' device, destination blocks of the message's positions
        (with ``start``: of the whole pull)
    heads : range of local heads the messages carry
    copy_stream : torch.cuda.Stream, or None for CPU caches (everything completes in the call)
    aux : AuxBuffers, optional (CUDA caches)
        Where the headers' checksums go to the device from and the verdict comes back to, in one
        copy each way (made here when None or holding fewer frames); untouched until the device
        work ended and :meth:`DeviceWrite.error` was read.
    ready : torch.cuda.Event, optional
        What the device work waits for (the pull's: work queued before it started, e.g. reads of
        the destination blocks' old contents, and the copy of ``block_ids``).
    current : bool
        ``copy_stream`` is already the calling thread's current stream and ``caches``' device its
        current device (the landing thread sets both once): every torch call releases and retakes
        the GIL, so the per-call stream switch is left out.
    start : int, optional
        The payload cell (``layer·nblk + position``) ``staging`` starts at.
    """
    nbytes = [n for h in headers for n in h.nbytes]
    expected = [_signed(c) for h in headers for c in h.checksums]
    nf, hd = len(nbytes), (heads.start, heads.stop)
    if copy_stream is None:
        ok, sums = torch.empty(nf + 1, dtype=torch.int32), torch.empty(nf, dtype=torch.int64)
        ops.verify_scatter(staging, torch.tensor(expected, dtype=torch.int64), caches, block_ids, ok=ok,
                           checksums=sums, heads=hd, frame_nbytes=nbytes, start=start)
        return DeviceWrite(False, headers, ok, sums)
    device = caches[0].device
    if aux is None or aux.max_frames < nf:
        aux = AuxBuffers(nf, device)
    v = aux.views(nf)
    aux.host_np[:nf] = expected
    if ready is not None:
        copy_stream.wait_event(ready)
    elif not current:
        copy_stream.wait_stream(torch.cuda.current_stream(device))
    with contextlib.nullcontext() if current else torch.cuda.stream(copy_stream):
        v.dev_expected.copy_(v.host_expected, non_blocking=True)
        ops.verify_scatter(staging, v.dev_expected, caches, block_ids, ok=v.dev_ok, checksums=v.dev_sums,
                           heads=hd, frame_nbytes=nbytes, start=start)
        v.host_back.copy_(v.dev_back, non_blocking=True)
    return DeviceWrite(True, headers, v.host_ok, v.host_sums)


class _AuxViews(NamedTuple):
    host_expected: torch.Tensor   # [nf] int64, pinned
    dev_expected: torch.Tensor    # [nf] int64
    dev_ok: torch.Tensor          # [nf + 1] int32
    dev_sums: torch.Tensor        # [nf] int64
    dev_back: torch.Tensor        # computed sums + verdict, device side
    host_back: torch.Tensor       # the same words, pinned
    host_ok: torch.Tensor         # [nf + 1] int32, pinned
    host_sums: torch.Tensor       # [nf] int64, pinned


class AuxBuffers:
    """The checksum words of a message on both sides of the bus, reused message after message
    (the landing thread pools them): pinned ``host`` and device ``dev``, each
    ``[aux_words(max_frames)]`` int64 laid out as [expected (nf) | computed (nf) | ok flags + bad
    count (nf + 1 int32)], and their views for each frame count, made once (each view is a
    call into torch, which releases and retakes the GIL)."""

    def __init__(self, max_frames: int, device) -> None:
        n = aux_words(max_frames)
        self.max_frames = max_frames
        self.host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty(n, dtype=torch.int64, device=device)
        self.host_np = self.host.numpy()
        self._views: dict = {}

    def views(self, nf: int) -> _AuxViews:
        """The views of a message of ``nf`` frames (``nf <= max_frames``)."""
        v = self._views.get(nf)
        if v is None:
            n, host, dev = aux_words(nf), self.host, self.dev
            v = self._views[nf] = _AuxViews(host[:nf], dev[:nf], _ok_view(dev, nf), dev[nf:2 * nf], dev[nf:n],
                                            host[nf:n], _ok_view(host, nf), host[nf:2 * nf])
        return v


def aux_words(num_frames: int) -> int:
    """int64 words of :func:`verify_group`'s ``aux`` for a message of ``num_frames`` frames."""
    return 2 * num_frames + (num_frames + 2) // 2


def _ok_view(aux: torch.Tensor, nf: int) -> torch.Tensor:
    """The ``[nf + 1]`` int32 verdict inside ``aux`` (after the expected and computed sums)."""
    return aux[2 * nf:].view(torch.int32)[:nf + 1]


class HostFill:
    """The host copies of one message's payload frames back to back into its pinned buffer, cut in
    pieces of ``piece_bytes``: submitted to ``executor``'s threads at construction (all at once,
    so they run while the caller does other work), or, without one, run by :meth:`run`'s thread.

    Parameters
    ----------
    host : [sum(nbytes)] uint8, CPU (pinned for CUDA caches), written by the copies
    frames : list of ZeroMQ frames or buffers, sizes ``nbytes`` (checked: as the header says)
    executor : ThreadPoolExecutor, optional
        NumPy copies on its threads: they release the GIL and use one core each, where a
        ``torch`` copy would wake, and keep spinning, every intra-op thread.
    """

    def __init__(self, host: torch.Tensor, frames, nbytes: list, piece_bytes: int = 2 << 20, executor=None) -> None:
        dst, self.pieces, off = host.numpy(), [], 0
        for f, n in zip(frames, nbytes):
            src = np.frombuffer(getattr(f, "buffer", f), dtype=np.uint8)
            self.pieces += [(off + a, off + min(n, a + piece_bytes), src[a:a + piece_bytes])
                            for a in range(0, n, piece_bytes)]
            off += n
        self.host, self._dst = host, dst
        self.jobs = [None] * len(self.pieces)
        if executor is not None:
            try:
                for i, (a, b, piece) in enumerate(self.pieces):
                    self.jobs[i] = executor.submit(np.copyto, dst[a:b], piece)
            except BaseException:   # e.g. the executor shut down: none of the pieces submitted may still run
                self.wait()
                raise

    def run(self, staging: torch.Tensor | None = None, timings: dict | None = None) -> None:
        """Wait for (or run) the pieces in order; with ``staging`` (a device buffer, on the current
        stream) queue a device copy as soon as a piece is in host memory, covering it and every
        later piece the workers have already copied too: the DMA of one piece overlaps the host
        copy of the next, and a message whose pieces were all copied ahead goes in one copy (one
        call, instead of one per piece). ``timings["copy"]`` gains the seconds spent here waiting
        for or running the host copies (the device copies' queuing excluded)."""
        t_copy, n, i = 0.0, len(self.pieces), 0
        try:
            while i < n:
                t0 = time.perf_counter()
                a, b, piece = self.pieces[i]
                if self.jobs[i] is None:
                    np.copyto(self._dst[a:b], piece)
                else:
                    self.jobs[i].result()
                t_copy += time.perf_counter() - t0
                i += 1
                while i < n and self.jobs[i] is not None and self.jobs[i].done():
                    b = self.pieces[i][1]      # pieces are back to back
                    self.jobs[i].result()
                    i += 1
                if staging is not None:
                    staging[a:b].copy_(self.host[a:b], non_blocking=True)
        finally:
            self.wait()   # on a failure: no worker may still write into host once it is handed back
            if timings is not None:
                timings["copy"] = timings.get("copy", 0.0) + t_copy

    def wait(self) -> None:
        """Return once no worker writes into ``host`` any more (copies ended, or never started)."""
        futures_wait([j for j in self.jobs if j is not None])
