"""Decode-side staging for CUDA caches (kvconnector.staging): every received frame is copied
into pinned host memory and hashed there; a message reaches the device only when every frame
matched its checksum.

Covers: staged bytes equal the frames exactly (several frames, odd sizes, a 17-byte frame);
a flipped last byte of the second frame, a truncated frame and a missing frame each raise
CorruptFrameError naming the problem, with every staged buffer handed back to the pool; the pool reuses released buffers (smallest that
fits) and keeps at most ``max_free_bytes`` of them, dropping the smallest wherever they sit. Without a GPU the pool's buffers are pageable, so this
runs in CI; the CUDA path through it is ``test_connector.py::test_cuda_caches_byte_exact``.

Run: python -m pytest tests/test_decode_staging.py -q
"""

import numpy as np
import pytest
import torch

from kvconnector.protocol import Header, MsgType, checksum
from kvconnector.staging import PinnedPool, stage_verified
from layouts import CorruptFrameError

MIB = 1 << 20


def _message(sizes, seed=0):
    rng = np.random.default_rng(seed)
    frames = [bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]  # writable, like ZeroMQ's
    h = Header(MsgType.BLOCKS, tid="t", layer=0, nlay=1, first=0, nblk=1, heads=(0, 1))
    h.nbytes, h.checksums = [len(f) for f in frames], [checksum(f) for f in frames]
    return h, frames


@pytest.mark.parametrize("sizes", [[2 * MIB + 4097, 1000], [17], [MIB]])
def test_staged_bytes_equal_frames(sizes):
    h, frames = _message(sizes)
    pool = PinnedPool()
    staged = stage_verified(h, frames, pool)
    assert [t.numel() for t in staged] == sizes
    for t, f in zip(staged, frames):
        assert t.numpy().tobytes() == f


@pytest.mark.parametrize("problem", ["flip", "truncate", "missing"])
def test_bad_message_raises_and_returns_buffers(problem):
    h, frames = _message([MIB + 300, 3 * MIB + 5], seed=1)
    if problem == "flip":     # last byte of the second frame
        frames[1][-1] ^= 0x01
        want = "payload frame 1 checksum"
    elif problem == "truncate":
        frames[1] = frames[1][:-1]
        want = "payload frame 1 truncated"
    else:
        frames = frames[:1]
        want = "expected 2 payload frames, got 1"
    pool = PinnedPool()
    with pytest.raises(CorruptFrameError, match=want):
        stage_verified(h, frames, pool)
    # buffers staged before the failure went back (none were taken for a size error)
    assert len(pool.free) == (2 if problem == "flip" else 0)


def test_pool_reuses_smallest_fit_and_is_bounded():
    pool = PinnedPool(max_free_bytes=4 * MIB)
    a, b = pool.acquire(3 << 20), pool.acquire(1 << 20)
    pa, pb = a.data_ptr(), b.data_ptr()
    pool.release(a)
    pool.release(b)
    c = pool.acquire(1000)             # the 1 MiB buffer fits and is the smallest
    assert c.data_ptr() == pb and c.numel() == 1000
    d = pool.acquire(2 << 20)          # only the 3 MiB one fits
    assert d.data_ptr() == pa
    assert pool.acquire(5 << 20).data_ptr() not in (pa, pb)   # nothing fits: a new buffer
    assert pool.allocations == 3
    for t in (c, d, torch.empty(1 << 20, dtype=torch.uint8)):
        pool.release(t)
    # 1 + 3 + 1 MiB released into a 4 MiB bound: one 1 MiB buffer dropped
    assert [t.numel() for t in pool.free] == [1 << 20, 3 << 20] and pool.free_bytes == 4 * MIB


def test_pool_over_its_bound_drops_the_smallest_whatever_its_position():
    """More buffers released than the pool keeps, of different sizes, the smallest not first (a
    pull of 8 MiB and 264 KiB messages with many in flight): the smallest is dropped. Tensors in
    the free list are never compared with ``==`` (elementwise: raises for other sizes)."""
    pool = PinnedPool(max_free_bytes=11 * MIB)
    big, other, small = pool.acquire(8 * MIB), pool.acquire(3 * MIB), pool.acquire(270336)
    keep = {big.data_ptr(), other.data_ptr()}
    for t in (big, other, small):
        pool.release(t)
    assert len(pool.free) == 2 and {t.data_ptr() for t in pool.free} == keep and pool.free_bytes == 11 * MIB
