"""One outgoing transfer: turns (layers x block runs) into BLOCKS messages, with GPU staging.

CPU caches: a run of consecutive source blocks with all heads is sent straight from the
cache (zero copy; the lease guarantees the blocks do not change); anything else is
gathered into a fresh buffer. CUDA caches: each chunk is gathered on the GPU and copied
into pinned host memory on a side stream; the copy of chunk ``i + 1`` is queued before
chunk ``i`` is sent, so the device-to-host copy overlaps the socket.
"""

from __future__ import annotations

from collections import deque

import torch

from layouts import CacheGeometry
from .blocks import as_bytes, contiguous_run, gather_blocks, slice_bytes
from .protocol import Header, MsgType, encode_message


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
    """

    def __init__(self, ident: bytes, tid: str, block_ids: list, caches: list, geo: CacheGeometry,
                 local_heads: range, global_heads: tuple, chunk_bytes: int, copy_stream=None) -> None:
        self.ident, self.tid, self.block_ids, self.caches, self.geo = ident, tid, block_ids, caches, geo
        self.local_heads, self.global_heads = local_heads, tuple(global_heads)
        per_block = slice_bytes(geo, 1, local_heads)
        self.chunk_blocks = max(1, chunk_bytes // per_block)
        self.full_heads = len(local_heads) == geo.num_kv_heads
        self.copy_stream = copy_stream
        self._plan = deque((layer, first) for layer in range(len(caches))
                           for first in range(0, len(block_ids), self.chunk_blocks))
        self._total = len(self._plan)
        self._seq = 0
        self._staged: deque = deque()    # (layer, first, count, host tensor, cuda event)
        self._retry = None
        self.last_payload_bytes = 0

    def push_back(self, frames: list) -> None:
        """Keep frames the socket refused; they go first next time."""
        self._retry = frames

    def _cpu_payload(self, layer: int, ids: list):
        run = contiguous_run(ids)
        if run is not None and self.full_heads:
            view = as_bytes(self.caches[layer], self.geo)
            return view[run[0]:run[0] + run[1]].reshape(-1).numpy()   # zero copy out of the cache
        return gather_blocks(self.caches[layer], self.geo, ids, self.local_heads).numpy()

    def _stage(self) -> None:
        layer, first = self._plan.popleft()
        ids = self.block_ids[first:first + self.chunk_blocks]
        if self.copy_stream is None:
            self._staged.append((layer, first, len(ids), self._cpu_payload(layer, ids), None))
            return
        n = slice_bytes(self.geo, len(ids), self.local_heads)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        cache = self.caches[layer]
        self.copy_stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self.copy_stream):
            dev = gather_blocks(cache, self.geo, ids, self.local_heads)
            host.copy_(dev, non_blocking=True)
            dev.record_stream(self.copy_stream)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        self._staged.append((layer, first, len(ids), host, ev))

    def next_frames(self) -> list | None:
        """Frames of the next message, or None when the transfer is fully sent."""
        if self._retry is not None:
            frames, self._retry = self._retry, None
            return frames
        if not self._staged and not self._plan:
            return None
        while len(self._staged) < 2 and self._plan:   # keep one chunk's copy in flight ahead
            self._stage()
        layer, first, count, payload, ev = self._staged.popleft()
        if ev is not None:
            ev.synchronize()
            payload = payload.numpy()
        self._seq += 1
        h = Header(MsgType.BLOCKS, seq=self._seq - 1, tid=self.tid, layer=layer, first=first, nblk=count,
                   heads=self.global_heads, last=self._seq == self._total)
        self.last_payload_bytes = payload.nbytes
        return encode_message(h, [payload])
