"""xxh3_64 of one message's payload frames on several threads, on hosts with spare cores.

One thread hashes 6–17 GB/s on the H200 host (cold / hot memory), so in a pull of one or two
messages each side's hash runs in series with the socket. A sender with spare cores therefore
splits such a message's payload into a few frames at block boundaries (protocol v2 allows any
number of whole-block frames per BLOCKS message, see PROTOCOL.md), and both sides hash the
frames of one message in parallel here (xxhash releases the GIL). Every frame still carries its
own checksum and is verified before a byte of the message is written.

Hosts with at most 4 cores get no pool: the two I/O threads already fill them, and nothing
changes there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .protocol import Header, check_checksum, check_frames, checksum

SPLIT_MIN_BYTES = 512 << 10   # a split never makes a frame smaller than this
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def hash_threads() -> int:
    """Threads that hash the frames of one message: none on small hosts, else one per four
    cores, at most four (the same policy as the staging threads and copy workers)."""
    cores = os.cpu_count() or 1
    return 0 if cores <= 4 else min(4, cores // 4)


def _get_pool() -> ThreadPoolExecutor | None:
    global _pool
    with _lock:
        if _pool is None and hash_threads():
            _pool = ThreadPoolExecutor(hash_threads(), thread_name_prefix="kvc-hash")
        return _pool


def checksums(frames, parallel: bool = True) -> list[int]:
    """xxh3_64 of each frame (buffers, numpy arrays or ZeroMQ frames), in order; on the hash
    threads when ``parallel``, there are several frames and this host has a pool."""
    pool = _get_pool() if parallel and len(frames) > 1 else None
    if pool is None:
        return [checksum(f) for f in frames]
    return list(pool.map(checksum, frames))


def split_frames(buf: np.ndarray, unit: int, parts: int) -> list[np.ndarray]:
    """``buf`` (1-D uint8, a whole number of ``unit``-byte blocks) as at most ``parts``
    consecutive views (never copies), each a whole number of blocks and, when there are
    several, :data:`SPLIT_MIN_BYTES` or more (less at most one block); sizes differ by at most
    one block."""
    blocks = len(buf) // unit
    k = max(1, min(parts, len(buf) // SPLIT_MIN_BYTES, blocks))
    ends = [blocks * i // k * unit for i in range(k + 1)]
    return [buf[a:b] for a, b in zip(ends, ends[1:])]


def wide(h: Header) -> bool:
    """Whether the frames of a received message are worth hashing in parallel: several, of
    :data:`SPLIT_MIN_BYTES` or more on average (a sender's split, or long zero-copy runs)."""
    return len(h.nbytes) > 1 and sum(h.nbytes) >= len(h.nbytes) * SPLIT_MIN_BYTES


def verify(h: Header, payloads) -> None:
    """:func:`protocol.verify_payloads`, with the frames of a :func:`wide` message hashed in
    parallel. Raises CorruptFrameError (the first bad frame named) before a byte is used."""
    check_frames(h, payloads)
    for i, got in enumerate(checksums(payloads, parallel=wide(h))):
        check_checksum(h, i, got)
