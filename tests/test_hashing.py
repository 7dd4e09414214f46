"""Parallel hashing of one message's frames (kvconnector.hashing), on hosts with spare cores.

This machine has 2 cores, so the pool is off by default; the tests turn it on (4 threads) by
patching ``hash_threads`` and check: ``split_frames`` cuts whole blocks into views of about
equal size and never below ``SPLIT_MIN_BYTES``; ``verify`` and the CUDA path's ``stage_verified``
name the corrupted frame of a wide message (and the staging hands every buffer back); and a real
in-process pull of one 3 MiB message goes out as 4 frames hashed in parallel on both sides and
lands byte for byte, while a 3-message pull is not split.

Run: python -m pytest tests/test_hashing.py -q
"""

import numpy as np
import pytest
import torch

import kvconnector.hashing as hashing
import kvconnector.sender as sender
import kvconnector.staging as staging
from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import Header, MsgType, checksum
from layouts import CorruptFrameError, KVQuantMode

pytestmark = pytest.mark.timeout(60)
KIB = 1 << 10


@pytest.fixture
def pool4(monkeypatch):
    """Hash pool of 4 threads; records (frames, parallel) of every checksums() call."""
    calls = []
    real = hashing.checksums

    def spy(frames, parallel=True):
        calls.append((len(frames), parallel))
        return real(frames, parallel)

    monkeypatch.setattr(hashing, "hash_threads", lambda: 4)
    monkeypatch.setattr(sender, "hash_threads", lambda: 4)
    monkeypatch.setattr(hashing, "_pool", None)
    for mod in (hashing, sender, staging):
        monkeypatch.setattr(mod, "checksums", spy)
    yield calls
    if hashing._pool is not None:
        hashing._pool.shutdown()


@pytest.mark.parametrize("nbytes,unit,parts,sizes", [
    (3 * 1024 * KIB, 64 * KIB, 4, [768 * KIB] * 4),
    (100 * 17 * KIB, 17 * KIB, 4, [17 * KIB * k for k in (33, 33, 34)]),   # 1,700 KiB: 3 frames of >= 512 KiB
    (99 * 17 * KIB, 17 * KIB, 4, [17 * KIB * 33] * 3),
    (48 * 17 * KIB, 17 * KIB, 4, [48 * 17 * KIB]),          # 816 KiB: two frames would be < 512 KiB
    (8 * 1024 * KIB, 64 * KIB, 1, [8 * 1024 * KIB]),        # parts 1: one frame
])
def test_split_frames_whole_blocks_about_equal(nbytes, unit, parts, sizes):
    buf = np.arange(nbytes, dtype=np.uint8)
    frames = hashing.split_frames(buf, unit, parts)
    assert [len(f) for f in frames] == sizes
    assert all(len(f) % unit == 0 and np.shares_memory(f, buf) for f in frames)
    assert np.array_equal(np.concatenate(frames), buf)


def _message(sizes, seed=0):
    rng = np.random.default_rng(seed)
    frames = [bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    h = Header(MsgType.BLOCKS, tid="t", layer=0, nlay=1, first=0, nblk=1, heads=(0, 1))
    h.nbytes, h.checksums = [len(f) for f in frames], [checksum(f) for f in frames]
    return h, frames


def test_verify_wide_message_names_the_bad_frame(pool4):
    h, frames = _message([600 * KIB, 600 * KIB, 600 * KIB])
    hashing.verify(h, frames)
    assert pool4[-1] == (3, True)
    frames[2][12345] ^= 0x01
    with pytest.raises(CorruptFrameError, match="payload frame 2 checksum"):
        hashing.verify(h, frames)
    small, sframes = _message([1000, 2000])        # not wide: hashed on this thread
    hashing.verify(small, sframes)
    assert pool4[-1] == (2, False)


def test_stage_verified_wide_message(pool4):
    h, frames = _message([520 * KIB, 700 * KIB, 600 * KIB], seed=3)
    pool = staging.PinnedPool()
    staged = staging.stage_verified(h, frames, pool)
    assert pool4[-1] == (3, True)
    assert [t.numpy().tobytes() for t in staged] == [bytes(f) for f in frames]
    for t in staged:
        pool.release(t)
    frames[1][-1] ^= 0x80
    with pytest.raises(CorruptFrameError, match="payload frame 1 checksum"):
        staging.stage_verified(h, frames, pool)
    assert len(pool._free) == 3                     # every staged buffer handed back


@pytest.mark.parametrize("blocks,chunk_mib,messages", [(24, 8, 1), (64, 3, 4)])
def test_pull_split_into_frames_hashed_in_parallel(pool4, blocks, chunk_mib, messages):
    # bf16, 8 KV heads x head_size 128 x block 16: 64 KiB blocks. 24 blocks x 2 layers = 3 MiB in
    # one message (both layers packed): fewer messages than hash threads, so 4 frames of 768 KiB,
    # hashed in parallel on both sides. 64 blocks x 2 layers with 3 MiB chunks: 4 messages of one
    # frame each, hashed on their own threads.
    desc = make_desc(KVQuantMode.NONE, 128, num_kv_heads=8, block_size=16, num_layers=2, num_blocks=2 * blocks)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    rng = np.random.default_rng(blocks)
    src_ids = rng.permutation(2 * blocks)[:blocks].tolist()
    dst_ids = rng.permutation(2 * blocks)[:blocks].tolist()
    with PrefillEndpoint(src, desc, chunk_bytes=chunk_mib << 20) as pre, DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", src_ids)
        res = dec.pull("t", dst_ids, deadline_s=20).result()
        assert res.nbytes == 2 * blocks * desc.block_bytes
        assert dec.metrics.c["blocks_messages"] == messages
    for s, d in zip(src, dst):
        assert torch.equal(d.view(torch.uint8)[dst_ids], s.view(torch.uint8)[src_ids])
    if messages == 1:
        assert pool4 == [(4, True), (4, True)]     # the sender's and the receiver's
    else:
        assert pool4 and all(c == (1, False) for c in pool4)
