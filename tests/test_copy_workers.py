"""The decode side's copy workers and the CPU block-copy fast path.

Messages of at least ``INLINE_BYTES`` are verified and written by worker threads when a
DecodeEndpoint has ``copy_threads > 0`` (the default on hosts with more than four cores);
these tests force both settings on this machine. Covers: byte-exact pulls (all heads and a
head slice, scattered source and destination ids, other blocks and heads untouched), a
multi-frame message whose second frame is corrupted (checksum error, not one byte of the
first frame written), and ``copy_runs`` against a plain index copy.

Run: python -m pytest tests/test_copy_workers.py -q
"""

import numpy as np
import pytest
import torch

from connector_fakes import FakePrefill, filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.blocks import as_bytes, copy_runs
from kvconnector.decode import INLINE_BYTES
from kvconnector.protocol import Header, MsgType, encode_message
from layouts import CorruptFrameError, KVQuantMode

pytestmark = pytest.mark.timeout(60)

# 64 KiB blocks: 8-block messages are 512 KiB, above INLINE_BYTES, so workers get them
KW = dict(mode=KVQuantMode.NONE, head_size=128, num_kv_heads=8, block_size=16, num_layers=3, num_blocks=24)


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("copy_threads", [0, 2], ids=["inline", "workers2"])
@pytest.mark.parametrize("heads", [None, range(2, 5)], ids=["all-heads", "heads2-5"])
def test_pull_byte_exact(copy_threads, heads):
    desc = make_desc(**KW)
    assert 8 * desc.geometry().block_bytes > INLINE_BYTES
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    src_ids = [5, 6, 7, 20, 1, 0, 13, 12, 11, 10, 3, 2]
    dst_ids = [23, 0, 1, 2, 9, 4, 5, 6, 17, 16, 15, 8]
    with PrefillEndpoint(src, desc, chunk_bytes=8 * desc.geometry().block_bytes) as pre, \
            DecodeEndpoint(dst, desc, copy_threads=copy_threads) as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        pre.publish("t", src_ids)
        res = dec.pull("t", dst_ids, deadline_s=20, heads=heads).result(timeout=30)
    nh = 8 if heads is None else len(heads)
    assert res.nbytes == desc.num_layers * len(src_ids) * 2 * 16 * nh * desc.geometry().row_bytes
    hs = slice(None) if heads is None else slice(heads.start, heads.stop)
    for s, d, b in zip(src, dst, before):
        s, d, b = _bytes(s), _bytes(d), _bytes(b)
        for si, di in zip(src_ids, dst_ids):
            assert torch.equal(d[di][:, :, hs], s[si][:, :, hs]), (si, di)
        if heads is not None:   # heads outside the slice keep their old bytes
            assert torch.equal(d[dst_ids][:, :, :, :heads.start], b[dst_ids][:, :, :, :heads.start])
            assert torch.equal(d[dst_ids][:, :, :, heads.stop:], b[dst_ids][:, :, :, heads.stop:])
        untouched = [i for i in range(desc.num_blocks) if i not in dst_ids]
        assert torch.equal(d[untouched], b[untouched])


@pytest.mark.parametrize("copy_threads", [0, 2], ids=["inline", "workers2"])
def test_corrupt_second_frame_writes_nothing(copy_threads):
    desc = make_desc(**KW)
    geo = desc.geometry()

    def script(send, h, fake):
        view = as_bytes(fake.caches[0], geo).numpy()
        frames = [view[0:4].reshape(-1).copy(), view[4:8].reshape(-1).copy()]   # 2 frames, 4 blocks each
        msg = encode_message(Header(MsgType.BLOCKS, tid=h.tid, layer=0, first=0, nblk=8, heads=(0, 8)), frames)
        frames[1][12345] ^= 0x01                                                     # after the checksum
        send(msg)
    fake = FakePrefill(desc, filled_caches(desc, 0), script)
    dst = filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    try:
        with DecodeEndpoint(dst, desc, copy_threads=copy_threads) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            handle = dec.pull("t", list(range(8, 16)), deadline_s=5)
            with pytest.raises(CorruptFrameError, match="payload frame 1 checksum"):
                handle.result(timeout=10)
            assert handle.failed_block_ids == list(range(8, 16))
        for d, b in zip(dst, before):
            assert torch.equal(_bytes(d), _bytes(b))
    finally:
        fake.close()


@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 0, 7, 2], list(range(40))[::-1][:20]],
                         ids=["one-run", "short-runs", "many-runs"])
@pytest.mark.parametrize("heads", [None, range(1, 3)], ids=["all-heads", "heads1-3"])
def test_copy_runs_matches_index_copy(ids, heads):
    rng = np.random.default_rng(0)
    cache = rng.integers(0, 256, (40, 2, 4, 4, 12), dtype=np.uint8)
    hs = slice(None) if heads is None else slice(heads.start, heads.stop)
    nh = 4 if heads is None else len(heads)
    packed = np.empty((len(ids), 2, 4, nh, 12), np.uint8)
    copy_runs(packed, None, cache, ids, heads, head_side="src")            # gather
    assert np.array_equal(packed, cache[ids][:, :, :, hs])
    out = rng.integers(0, 256, cache.shape, dtype=np.uint8)
    want = out.copy()
    want[np.asarray(ids)[:, None], :, :, np.arange(4)[hs]] = packed.transpose(0, 3, 1, 2, 4)
    copy_runs(out, ids, packed, None, heads, head_side="dst")              # scatter
    assert np.array_equal(out, want)
