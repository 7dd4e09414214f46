"""Prefill-side staging (kvconnector.sender): gather + hash in cache-sized pieces, layer
packing (protocol v2), bounded in-flight buffers, and the no-copy block-row views both sides
copy through.

Covers: the streamed xxh3_64 of a gathered frame equals the one-shot checksum of exactly the
bytes ``gather_blocks`` produces (all heads and a head slice; chunks spanning several hash
pieces and chunks smaller than one); small layers packed several per message, each layer
sent exactly once, layer-major, gathered or as zero-copy runs; a layer over several messages
split into runs of nearly equal size; a pull much larger than the in-flight limit completes
byte-exact while the stream waits for ZeroMQ to release its buffers (the limit forced down
to one message); ``block_rows`` is a view that writes through, also at a storage offset.

Run: python -m pytest tests/test_sender_staging.py -q
"""

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvconnector.sender as sender
from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.blocks import as_bytes, block_rows, gather_blocks
from kvconnector.protocol import checksum, decode_header
from layouts import KVQuantMode

pytestmark = pytest.mark.timeout(60)

KW = dict(mode=KVQuantMode.INT4_PER_TOKEN_HEAD, head_size=64, num_kv_heads=4, block_size=8,
          num_layers=2, num_blocks=40)


def _messages(stream):
    """Yield each message's frames; its pooled buffer is released only after the caller
    has looked at it (as ZeroMQ would release it once sent)."""
    while True:
        f = stream.next_frames()
        if f is None:
            return
        yield f
        stream.sent(None)


@pytest.mark.parametrize("piece_blocks", [1, 3, 1000], ids=["piece1", "piece3", "one-piece"])
@pytest.mark.parametrize("heads", [range(4), range(1, 3)], ids=["all-heads", "heads1-3"])
def test_streamed_hash_matches_gathered_bytes(monkeypatch, piece_blocks, heads):
    desc = make_desc(**KW)
    geo, caches = desc.geometry(), filled_caches(desc, 3)
    per_block = 2 * geo.block_size * len(heads) * geo.row_bytes
    monkeypatch.setattr(sender, "HASH_PIECE_BYTES", piece_blocks * per_block)
    ids = [17, 3, 4, 5, 39, 0, 22, 21, 8, 30, 31]          # scattered, short runs: gathered
    s = sender.Stream(b"p", "t", ids, caches, geo, heads, (heads.start, heads.stop),
                      chunk_bytes=7 * per_block)            # 11 blocks in 2 runs: 6 and 5, not 7 and 4
    n, runs = 0, []
    for frames in _messages(s):
        n += 1
        h = decode_header(frames[0])
        runs.append((h.first, h.nblk))
        assert len(frames) == 2
        want = gather_blocks(caches[h.layer], geo, ids[h.first:h.first + h.nblk], heads).numpy()
        assert np.array_equal(np.asarray(frames[1]).reshape(-1), want)
        assert h.checksums == [checksum(want)] and h.nbytes == [want.nbytes]
    assert n == desc.num_layers * 2 and runs == [(0, 6), (6, 5)] * desc.num_layers


@pytest.mark.parametrize("zero_copy", [False, True], ids=["gathered", "zero-copy-runs"])
@pytest.mark.parametrize("pack_layers", [1, 2, 5], ids=["pack1", "pack2", "pack5"])
def test_layer_packing_covers_every_layer_once(monkeypatch, zero_copy, pack_layers):
    # protocol v2: whole small layers share a message; the payload is layer-major
    desc = make_desc(**{**KW, "num_layers": 5})
    geo, caches = desc.geometry(), filled_caches(desc, 4)
    ids = [6, 7, 8, 9, 30, 31, 32] if zero_copy else [17, 3, 4, 5, 39, 0]
    layer_bytes = len(ids) * geo.block_bytes
    monkeypatch.setattr(sender, "PACK_BYTES", pack_layers * layer_bytes)
    monkeypatch.setattr(sender, "MIN_FRAME_BYTES", geo.block_bytes if zero_copy else 1 << 40)
    s = sender.Stream(b"p", "t", ids, caches, geo, range(4), (0, 4), chunk_bytes=1 << 20)
    seen = []
    for frames in _messages(s):
        h = decode_header(frames[0])
        assert h.nlay <= pack_layers and h.first == 0 and h.nblk == len(ids)
        assert len(frames) == 1 + (h.nlay * 2 if zero_copy else 1)      # 2 runs per layer when zero copy
        want = b"".join(gather_blocks(caches[la], geo, ids).numpy().tobytes()
                        for la in range(h.layer, h.layer + h.nlay))
        assert b"".join(bytes(np.asarray(f).reshape(-1)) for f in frames[1:]) == want
        assert h.checksums == [checksum(np.asarray(f).reshape(-1)) for f in frames[1:]]
        seen += range(h.layer, h.layer + h.nlay)
    assert seen == list(range(5))
    want_msgs = -(-5 // min(pack_layers, 5))
    assert s._total == want_msgs


def test_staging_waits_while_two_messages_are_queued(monkeypatch):
    """_may_stage: with the limit at its floor, a third message waits until ZeroMQ has released
    the oldest queued buffer (fake trackers: deterministic, unlike timing a real socket)."""
    monkeypatch.setattr(sender, "INFLIGHT_BYTES", 1)
    t1, t2 = SimpleNamespace(done=False), SimpleNamespace(done=False)
    stream = SimpleNamespace(_inflight=deque([(t1, 100), (t2, 100)]))
    assert not sender.Stream._may_stage(stream)
    t1.done = True
    assert sender.Stream._may_stage(stream)
    assert list(stream._inflight) == [(t2, 100)]  # released buffers leave the queue
    assert sender.Stream._may_stage(SimpleNamespace(_inflight=deque()))


def test_large_pull_with_the_inflight_limit_at_its_floor(monkeypatch):
    # at most two messages queued in ZeroMQ: staging waits for released buffers (how often
    # depends on the socket's timing) and every byte still lands
    monkeypatch.setattr(sender, "INFLIGHT_BYTES", 1)
    # 64 KiB blocks: pyzmq copies frames below 64 KiB instead of tracking them
    desc = make_desc(mode=KVQuantMode.NONE, head_size=128, num_kv_heads=8, block_size=16, num_layers=3,
                     num_blocks=40)
    src, dst = filled_caches(desc, 5), filled_caches(desc, 6)
    src_ids = [int(i) for i in torch.randperm(40, generator=torch.Generator().manual_seed(1))[:24]]
    dst_ids = [int(i) for i in torch.randperm(40, generator=torch.Generator().manual_seed(2))[:24]]
    per_block = desc.geometry().block_bytes
    with PrefillEndpoint(src, desc, chunk_bytes=2 * per_block) as pre, DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        pre.publish("t", src_ids)
        res = dec.pull("t", dst_ids, deadline_s=20).result(timeout=30)
        assert pre.stats()["messages_sent"] >= desc.num_layers * 12
    assert res.nbytes == desc.num_layers * 24 * per_block
    for s, d in zip(src, dst):
        assert torch.equal(d.view(torch.uint8)[dst_ids], s.view(torch.uint8)[src_ids])


def test_block_rows_is_a_view_at_any_offset():
    desc = make_desc(**KW)
    geo = desc.geometry()
    assert geo.storage_dtype == torch.uint8      # so a 5-byte storage offset is a valid view
    storage = torch.zeros(3 * geo.block_bytes + 5, dtype=torch.uint8)
    cache = storage[5:].view(geo.shape(3))
    rows = block_rows(as_bytes(cache, geo).numpy())
    assert rows.shape == (3, geo.block_bytes)
    rows[1] = 7
    assert torch.all(storage[5 + geo.block_bytes:5 + 2 * geo.block_bytes] == 7)
    assert int(storage[:5 + geo.block_bytes].sum()) == 0 and int(storage[5 + 2 * geo.block_bytes:].sum()) == 0
