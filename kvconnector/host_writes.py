"""Decode side, host-verified messages: xxh3_64 payloads checked on the host, then written.

Every payload frame of a BLOCKS message is verified against its checksum before any byte of
the message is written (:func:`kvconnector.protocol.verify_payloads`, or, for CUDA caches,
:func:`kvconnector.staging.stage_verified`, which checks each frame in pinned staging). Then:

- CPU caches (:meth:`HostWrites.write_cpu`): one row scatter per layer piece into the cache's
  ``[num_blocks, block_bytes]`` row view (whole blocks), or per-head copies (a head slice);
- CUDA caches (:meth:`HostWrites.launch_cuda`): each staged frame to the device on the copy
  stream (one copy each), then one ``index_copy_`` per layer piece (or a head-slice scatter); the
  returned event marks the end. :meth:`HostWrites.write_cuda` does both and waits (copy workers).

``mix64`` messages with the device kernels take the device path instead
(:mod:`kvconnector.landing`).
"""

from __future__ import annotations

import numpy as np
import torch

from layouts import CacheGeometry
from .blocks import as_bytes, block_rows, copy_runs, device_rows, scatter_blocks, slice_bytes
from .protocol import Header, verify_payloads
from .staging import PinnedPool, stage_verified


def _segments(h: Header, per_block: int):
    """Split a BLOCKS payload into per-layer pieces: yields ``(frame index, byte offset in
    the frame, layer, first position, block count)``. Frames hold whole blocks in
    (layer, position) order and may cross a layer boundary (byte counts checked already)."""
    g = 0                                   # blocks before this piece, over all layers
    for i, n in enumerate(h.nbytes):
        left, off = n // per_block, 0
        while left:
            li, pos = divmod(g, h.nblk)
            k = min(left, h.nblk - pos)
            yield i, off, h.layer + li, h.first + pos, k
            g, left, off = g + k, left - k, off + k * per_block


class HostWrites:
    """Writes host-verified messages into one endpoint's caches.

    Parameters
    ----------
    caches : list of [num_blocks, 2, block_size, num_kv_heads, P] packed caches, CPU or CUDA (written)
    geo : CacheGeometry
    copy_stream : torch.cuda.Stream or None (CPU caches)
    pinned : PinnedPool or None (CPU caches)
    """

    def __init__(self, caches: list, geo: CacheGeometry, copy_stream, pinned: PinnedPool | None) -> None:
        self.caches, self.geo, self.copy_stream, self.pinned = caches, geo, copy_stream, pinned
        self.head_block_bytes = slice_bytes(geo, 1, range(1))   # one head of one block
        cuda = caches[0].is_cuda
        self.views = None if cuda else [as_bytes(c, geo).numpy() for c in caches]
        # [num_blocks, block bytes] row views: numpy (CPU) or torch (CUDA), made once
        self.rows = [device_rows(c, geo) for c in caches] if cuda else [block_rows(v) for v in self.views]

    def write_cpu(self, p, h: Header, payloads, local: range) -> None:
        """Verify every payload frame of one message (pull ``p``), then copy it into the CPU cache.

        Runs on the I/O thread or a copy worker (xxh3 and numpy copies release the GIL).
        Raises CorruptFrameError before any byte is written.
        """
        verify_payloads(h, payloads)
        v0 = self.views[h.layer]
        full, per_block = len(local) == v0.shape[3], len(local) * self.head_block_bytes
        for i, off, layer, pos, k in _segments(h, per_block):
            src = np.frombuffer(getattr(payloads[i], "buffer", payloads[i]), dtype=np.uint8, count=k * per_block,
                                offset=off)
            if full:   # whole blocks: one C-level row scatter (ids were checked by pull())
                self.rows[layer][p.dst_index[pos:pos + k]] = src.reshape(k, -1)
            else:
                src = src.reshape(k, *v0.shape[1:3], len(local), v0.shape[4])
                copy_runs(self.views[layer], p.dst_block_ids[pos:pos + k], src, None, local, head_side="dst")

    def write_cuda(self, p, h: Header, payloads, local: range) -> None:
        """Copy worker, CUDA caches: stage and verify every frame (raises CorruptFrameError
        before anything leaves host memory), launch the device copies, wait for them."""
        staged = stage_verified(h, payloads, self.pinned)
        try:
            self.launch_cuda(p, h, staged, local).synchronize()
        except BaseException:
            self.copy_stream.synchronize()   # no DMA may still read a buffer handed back below
            raise
        finally:
            for b in staged:
                self.pinned.release(b)

    def launch_cuda(self, p, h: Header, staged: list, local: range):
        """Queue one verified message on the copy stream: each staged frame ([nbytes_i] uint8,
        pinned) to the device (one copy each), then one row scatter per layer piece into the
        destination blocks ``p.dst_dev``; return the event that marks the end."""
        device = self.caches[0].device
        s = self.copy_stream
        s.wait_stream(torch.cuda.current_stream(device))
        if getattr(p, "ready", None) is not None:   # the pull's start on the caller's stream (DecodeEndpoint.pull)
            s.wait_event(p.ready)
        full = len(local) == self.geo.num_kv_heads
        per_block = len(local) * self.head_block_bytes
        with torch.cuda.stream(s):
            on_device = [t.to(device, non_blocking=True) for t in staged]
            for i, off, layer, pos, k in _segments(h, per_block):
                ids, src = p.dst_dev[pos:pos + k], on_device[i][off:off + k * per_block]
                if full:   # whole blocks: one index_copy_ on the cached row view
                    self.rows[layer].index_copy_(0, ids, src.view(k, -1))
                else:
                    scatter_blocks(self.caches[layer], self.geo, ids, src, local)
            ev = torch.cuda.Event(blocking=True)   # a copy worker waiting in write_cuda sleeps instead of spinning
            ev.record(s)
        return ev
