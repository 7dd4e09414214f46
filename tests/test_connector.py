"""In-process connector tests: real ZeroMQ sockets on random loopback ports, hard timeouts.

Covers byte-exact transfer for every cache mode (every byte of every block, scale tails
included, other blocks untouched), head slices for heterogeneous tensor parallelism, the
layout-mismatch matrix refused on both sides with no KV byte sent, protocol-version refusal,
and a fault-injecting prefill peer (corrupted byte, truncated, oversized, duplicate, late,
wrong-layer frames, silence) plus lease expiry, abort, duplicate ACK, unknown transfer and
many concurrent transfers.

Run: python -m pytest tests/test_connector.py -q
"""

import threading
import time

import pytest
import torch
import zmq

from connector_fakes import FakePrefill, filled_caches, make_desc, refused_pull
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import PROTOCOL_VERSION, Header, MsgType, decode_header, encode_header, encode_message
from kvconnector.testing.faultproxy import reheader
from layouts import (CorruptFrameError, KVQuantMode, LayoutMismatchError, PeerError, ProtocolVersionError,
                     TransferTimeoutError)

pytestmark = pytest.mark.timeout(30)

MODES = [(KVQuantMode.NONE, 64), (KVQuantMode.INT8_PER_TOKEN_HEAD, 64), (KVQuantMode.FP8_PER_TOKEN_HEAD, 64),
         (KVQuantMode.INT4_PER_TOKEN_HEAD, 64)]


def _bytes(c):
    return c.view(torch.uint8)


@pytest.mark.parametrize("mode,head_size", MODES, ids=["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("chunk", [1, 1 << 20], ids=["chunk-1block", "chunk-1MiB"])
def test_byte_exact_every_mode(mode, head_size, chunk):
    desc = make_desc(mode, head_size, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=12)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    released = []
    src_ids, dst_ids = [9, 3, 4, 5, 0, 11], [2, 7, 1, 10, 3, 4]
    with PrefillEndpoint(src, desc, chunk_bytes=chunk, on_release=lambda *a: released.append(a)) as pre, \
            DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("req-0", src_ids)
        layers_seen = []
        res = dec.pull("req-0", dst_ids, deadline_s=10, on_layer=lambda t, l: layers_seen.append(l)).result()
        assert res.nbytes == desc.num_layers * len(src_ids) * desc.block_bytes
        assert sorted(layers_seen) == [0, 1, 2]
        for s, d, b in zip(src, dst, before):
            for si, di in zip(src_ids, dst_ids):
                assert torch.equal(_bytes(d)[di], _bytes(s)[si])
            for other in set(range(12)) - set(dst_ids):
                assert torch.equal(_bytes(d)[other], _bytes(b)[other])
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released == [("req-0", src_ids, "acked")]
        assert pre.held() == []
        assert dec.stats()["bytes_received"] == res.nbytes


def test_head_slice_for_heterogeneous_tp():
    full = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=4, num_blocks=6)
    half = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=2, num_blocks=6, head_start=2,
                     total_num_kv_heads=4)
    src, dst = filled_caches(full, 0), filled_caches(half, 1)
    with PrefillEndpoint(src, full) as pre, DecodeEndpoint(dst, half) as dec:
        assert dec.connect(pre.endpoint) == range(2, 4)
        pre.publish("t", [1, 4])
        dec.pull("t", [5, 0], deadline_s=10).result()
        for s, d in zip(src, dst):
            assert torch.equal(_bytes(d)[5], _bytes(s)[1][:, :, 2:4])
            assert torch.equal(_bytes(d)[0], _bytes(s)[4][:, :, 2:4])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,head_size", MODES, ids=["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("chunk", [1, 1 << 20], ids=["chunk-1block", "chunk-1MiB"])
@pytest.mark.parametrize("copy_threads", [0, 2], ids=["inline", "workers"])
def test_cuda_caches_byte_exact(mode, head_size, chunk, copy_threads):
    """CUDA caches on both sides (pinned staging, device gather / scatter): whole blocks, several
    layers per message or one block per message, then a head slice (heterogeneous TP); the
    decode side stages on its I/O thread or on copy workers."""
    desc = make_desc(mode, head_size, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=12)
    src = [c.cuda() for c in filled_caches(desc, 0)]
    dst = [c.cuda() for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    src_ids, dst_ids = [9, 3, 4, 5, 0, 11], [2, 7, 1, 10, 3, 4]
    with PrefillEndpoint(src, desc, chunk_bytes=chunk) as pre, \
            DecodeEndpoint(dst, desc, copy_threads=copy_threads) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("req-0", src_ids)
        dec.pull("req-0", dst_ids, deadline_s=10).result()
        torch.cuda.synchronize()
        for s, d, b in zip(src, dst, before):
            for si, di in zip(src_ids, dst_ids):
                assert torch.equal(_bytes(d)[di], _bytes(s)[si])
            for other in set(range(12)) - set(dst_ids):
                assert torch.equal(_bytes(d)[other], _bytes(b)[other])
    full = make_desc(mode, head_size, num_kv_heads=4, num_blocks=6)
    half = make_desc(mode, head_size, num_kv_heads=2, num_blocks=6, head_start=2, total_num_kv_heads=4)
    src = [c.cuda() for c in filled_caches(full, 2)]
    dst = [c.cuda() for c in filled_caches(half, 3)]
    with PrefillEndpoint(src, full, chunk_bytes=chunk) as pre, \
            DecodeEndpoint(dst, half, copy_threads=copy_threads) as dec:
        assert dec.connect(pre.endpoint) == range(2, 4)
        pre.publish("t", [1, 4])
        dec.pull("t", [5, 0], deadline_s=10).result()
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            assert torch.equal(_bytes(d)[5], _bytes(s)[1][:, :, 2:4])
            assert torch.equal(_bytes(d)[0], _bytes(s)[4][:, :, 2:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pull_request_leaves_before_the_ids_are_on_the_device(monkeypatch):
    """pull() sends the PULL before it copies the destination ids to the device: the prefill has the
    request while the copy is still held back here, its BLOCKS arrive before the ids exist, and the I/O
    thread waits for them and lands every byte."""
    import kvconnector.decode as decode_mod
    desc = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=12)
    src = [c.cuda() for c in filled_caches(desc, 0)]
    dst = [c.cuda() for c in filled_caches(desc, 1)]
    src_ids, dst_ids = [9, 3, 4, 5], [2, 7, 1, 10]
    seen = []
    real = decode_mod.device_ids
    with PrefillEndpoint(src, desc) as pre, DecodeEndpoint(dst, desc) as dec:
        def held_back(ids, device):
            deadline = time.monotonic() + 5
            while pre.stats()["transfers_started"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen.append(pre.stats()["transfers_started"])
            time.sleep(0.2)             # the BLOCKS are on their way meanwhile
            return real(ids, device)
        monkeypatch.setattr(decode_mod, "device_ids", held_back)
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", src_ids)
        dec.pull("t", dst_ids, deadline_s=10).result(timeout=10)
        torch.cuda.synchronize()
        assert seen == [1]
        for s, d in zip(src, dst):
            for si, di in zip(src_ids, dst_ids):
                assert torch.equal(_bytes(d)[di], _bytes(s)[si])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pull_fails_in_the_caller_when_its_ids_cannot_reach_the_device(monkeypatch):
    """A failure making the pull's device ids raises from pull() itself; the PULL already sent is
    aborted (the prefill releases its lease) and no destination byte changes."""
    import kvconnector.decode as decode_mod
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=4, num_layers=2, num_blocks=8)
    src = [c.cuda() for c in filled_caches(desc, 0)]
    dst = [c.cuda() for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    released = []

    def broken(ids, device):
        raise RuntimeError("CUDA error: out of memory (injected)")
    with PrefillEndpoint(src, desc, on_release=lambda *a: released.append(a)) as pre, \
            DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", [1, 2])
        monkeypatch.setattr(decode_mod, "device_ids", broken)
        with pytest.raises(RuntimeError, match="injected"):
            dec.pull("t", [3, 4], deadline_s=10)
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released == [("t", [1, 2], "aborted")]
        torch.cuda.synchronize()
        for d, b in zip(dst, before):
            assert torch.equal(_bytes(d), _bytes(b))
        assert dec.stats()["pending"] == 0


MISMATCHES = [
    ("quant_mode", dict(mode=KVQuantMode.INT8_PER_TOKEN_HEAD)),
    ("head_size", dict(head_size=64)),
    ("block_size", dict(block_size=8)),
    ("num_layers", dict(num_layers=3)),
    ("total_num_kv_heads", dict(num_kv_heads=4)),
]


@pytest.mark.parametrize("field,change", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatch_refused_on_both_sides(field, change):
    local, remote = make_desc(), make_desc(**change)
    with PrefillEndpoint(filled_caches(local, 0), local) as pre, \
            DecodeEndpoint(filled_caches(remote, 1), remote) as dec:
        with pytest.raises(LayoutMismatchError, match=field) as exc:
            dec.connect(pre.endpoint, timeout_s=5)
        assert field in exc.value.fields
        assert any(isinstance(e, LayoutMismatchError) and field in e.fields for e in pre.errors)
        with pytest.raises(PeerError, match="connect"):
            dec.pull("t", [0])
        pre.publish("t", [0])
        time.sleep(0.1)
        assert pre.stats()["bytes_sent"] == 0


def test_protocol_version_refused():
    desc = make_desc()
    fake = FakePrefill(desc, filled_caches(desc, 0), lambda *a: None, version=PROTOCOL_VERSION_NEXT)
    try:
        with DecodeEndpoint(filled_caches(desc, 1), desc) as dec:
            with pytest.raises(ProtocolVersionError, match=f"got {PROTOCOL_VERSION_NEXT}"):
                dec.connect(fake.endpoint, timeout_s=5)
    finally:
        fake.close()


PROTOCOL_VERSION_NEXT = PROTOCOL_VERSION + 1


def _corrupt(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2)
    bad = bytearray(fr[1])
    bad[len(bad) // 2] ^= 0x10
    send([fr[0], bytes(bad)])


def _truncated(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2)
    send([fr[0], fr[1][:-1]])


def _oversized(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2)
    send([fr[0], fr[1] + b"\x00"])


def _wrong_layer(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2)
    hh = decode_header(fr[0])
    hh.layer = 7
    send([encode_header(hh), fr[1]])


def _layers_past_the_end(send, h, fake):
    fr = fake.blocks(h.tid, 1, 0, 2)              # claims layers 1..2 of a 2-layer pull
    hh = decode_header(fr[0])
    hh.nlay = 2
    send(encode_message(hh, [fr[1] + fr[1]]))


def _silent(send, h, fake):
    send(fake.blocks(h.tid, 0, 0, 2))   # layer 0 only, then nothing


FAULTS = [(_corrupt, CorruptFrameError, "checksum"), (_truncated, CorruptFrameError, "truncated"),
          (_oversized, CorruptFrameError, "oversized"), (_wrong_layer, CorruptFrameError, "fields 'layer'/'nlay'"),
          (_layers_past_the_end, CorruptFrameError, "fields 'layer'/'nlay'"),
          (_silent, TransferTimeoutError, "deadline")]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("script,err,match", FAULTS, ids=["corrupt-byte", "truncated", "oversized",
                                                          "wrong-layer", "nlay-past-end", "silent"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_threads", [0, 2], ids=["inline", "workers"])
def test_faulty_peer_never_writes_bad_bytes(script, err, match, device, copy_threads):
    """Every bad message fails the pull before a byte lands, on the I/O thread or a copy
    worker, for CPU caches and for CUDA caches (pinned staging verified before any device copy)."""
    desc = make_desc(num_layers=2, num_blocks=4)
    fake = FakePrefill(desc, filled_caches(desc, 0), script)
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    try:
        with DecodeEndpoint(dst, desc, peer_timeout_s=10, copy_threads=copy_threads) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            t0 = time.monotonic()
            handle = dec.pull("t", [2, 3], deadline_s=1.0)
            with pytest.raises(err, match=match) as exc:
                handle.result(timeout=5)
            assert time.monotonic() - t0 < 2.0
            assert handle.failed_block_ids == [2, 3]
            assert exc.value.failed_block_ids == [2, 3]
            if device == "cuda":
                torch.cuda.synchronize()
            # layer 1 never arrived; layer 0 only if its frame was good
            assert torch.equal(dst[1], before[1])
            if script is not _silent:
                assert torch.equal(_bytes(dst[0]), _bytes(before[0]))
            deadline = time.monotonic() + 3
            while MsgType.ABORT not in fake.received and time.monotonic() < deadline:
                time.sleep(0.01)
            assert MsgType.ABORT in fake.received   # the prefill side is told to release
    finally:
        fake.close()


def test_multi_layer_messages_frames_across_layers_and_duplicates():
    # protocol v2: one message carries 3 layers; its second frame starts inside layer 1
    desc = make_desc(num_layers=3, num_blocks=4)
    src = filled_caches(desc, 0)

    def script(send, h, fake):
        send(fake.multi_blocks(h.tid, 0, 3, 0, 2, cut=3, last=True))
        send(fake.multi_blocks(h.tid, 0, 3, 0, 2))       # duplicate of the whole message
    fake = FakePrefill(desc, src, script)
    dst = filled_caches(desc, 1)
    landed = []
    try:
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            dec.pull("t", [3, 1], deadline_s=5, on_layer=lambda t, la: landed.append(la)).result()
            for s, d in zip(src, dst):
                assert torch.equal(_bytes(d)[3], _bytes(s)[0]) and torch.equal(_bytes(d)[1], _bytes(s)[1])
            assert sorted(landed) == [0, 1, 2]
            time.sleep(0.2)
            assert dec.stats()["ignored"].get("late", 0) + dec.stats()["ignored"].get("duplicate", 0) == 1
    finally:
        fake.close()


def test_multi_layer_message_overlapping_a_received_layer_fails():
    desc = make_desc(num_layers=2, num_blocks=4)

    def script(send, h, fake):
        send(fake.blocks(h.tid, 1, 0, 2))                # layer 1, both positions
        send(fake.multi_blocks(h.tid, 0, 2, 0, 2))       # layers 0..1: layer 1 again
    err, dst, before = refused_pull(desc, script, "overlap")
    assert err.failed_block_ids == [2, 3]        # layer 0 never landed
    assert torch.equal(_bytes(dst[0]), _bytes(before[0]))


def _exact_pull(desc, src, script, settle_s: float = 0.0):
    """Pull transfer "t" into blocks [3, 1] from a FakePrefill running ``script`` over ``src``; the
    pull must succeed byte exact. Returns the closed decode endpoint (its stats and errors stay
    readable), ``settle_s`` after the pull so that late messages were handled."""
    fake = FakePrefill(desc, src, script)
    dst = filled_caches(desc, 1)
    try:
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            dec.pull("t", [3, 1], deadline_s=5).result()
            for s, d in zip(src, dst):
                assert torch.equal(_bytes(d)[3], _bytes(s)[0]) and torch.equal(_bytes(d)[1], _bytes(s)[1])
            time.sleep(settle_s)
        return dec
    finally:
        fake.close()


def test_duplicate_reordered_and_late_frames_are_ignored():
    desc = make_desc(num_layers=2, num_blocks=4)
    src = filled_caches(desc, 0)

    def script(send, h, fake):
        send(fake.blocks(h.tid, 1, 1, 1, seq=3))       # reordered: layer 1 first
        send(fake.blocks(h.tid, 0, 0, 2, seq=0))
        send(fake.blocks(h.tid, 0, 0, 2, seq=0))       # duplicate
        send(fake.blocks(h.tid, 1, 0, 1, seq=2, last=True))
        send(fake.blocks(h.tid, 1, 0, 1, seq=2))       # late: transfer already complete
    dec = _exact_pull(desc, src, script, settle_s=0.2)
    ignored = dec.stats()["ignored"]
    assert ignored.get("duplicate") == 1 and ignored.get("late") == 1


@pytest.mark.parametrize("misplace", ["position", "layer", "transfer"])
def test_intact_payload_under_a_corrupted_placement_is_refused(misplace):
    """A BLOCKS message whose header says another position (``first``), layer or transfer than
    the one it was made for, payload and payload checksums intact: the decode side refuses it
    at decode (its placement checksum 'hxx' differs) and, as nothing is sent twice, fails the
    pull it names at once (CorruptFrameError, not at the deadline), the destination untouched.
    Without the placement checksum position 1's bytes landed in position 0's block, the true
    position 0 was ignored as a duplicate, and the pull succeeded with the wrong bytes (found by a
    long run of the live fuzzer)."""
    desc = make_desc(num_layers=2, num_blocks=4)

    def script(send, h, fake):
        if misplace == "position":
            send(reheader(fake.blocks(h.tid, 0, 1, 1), first=0))       # position 1's bytes at 0
        elif misplace == "layer":
            send(reheader(fake.blocks(h.tid, 1, 0, 1), layer=0))       # layer 1's bytes as layer 0
        else:
            send(reheader(fake.blocks("other", 0, 0, 1), tid=h.tid))   # another transfer's message
        for layer in range(2):
            send(fake.blocks(h.tid, layer, 0, 2, last=layer == 1))
    t0 = time.monotonic()
    err, dst, before = refused_pull(desc, script, "BLOCKS headers arrived corrupt.*'hxx'")
    assert time.monotonic() - t0 < 3.0                    # the pull's deadline is 5 s
    assert sorted(err.failed_block_ids) == [2, 3]
    for d, b in zip(dst, before):
        assert torch.equal(_bytes(d), _bytes(b))


def test_lease_expiry_abort_duplicate_ack_and_unknown_transfer():
    desc = make_desc()
    released = []
    with PrefillEndpoint(filled_caches(desc, 0), desc, on_release=lambda *a: released.append(a[::2])) as pre, \
            DecodeEndpoint(filled_caches(desc, 1), desc) as dec:
        dec.connect(pre.endpoint)
        pre.publish("short", [0], lease_s=0.2)
        pre.publish("ab", [1])
        pre.publish("ok", [2])
        dec.abort("ab")
        dec.pull("ok", [5], deadline_s=5).result()
        with pytest.raises(PeerError, match="unknown_transfer"):
            dec.pull("nope", [0], deadline_s=5).result()
        dec._loop.call_soon(dec._send, Header(MsgType.ACK, tid="ok", ok=True))   # duplicate ack
        deadline = time.monotonic() + 5
        while len(released) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        assert sorted(released) == [("ab", "aborted"), ("ok", "acked"), ("short", "expired")]
        assert pre.held() == []
        assert pre.stats()["ignored"].get("duplicate_acked") == 1


def test_a_lease_leaves_held_only_after_its_on_release_ran():
    """A caller polling ``held()`` may reuse the blocks once the id is gone: by then ``on_release``
    has returned (it runs on the I/O thread; here it takes 0.3 s)."""
    desc = make_desc()
    ran = []

    def on_release(tid, block_ids, reason):
        time.sleep(0.3)
        ran.append((tid, reason))

    with PrefillEndpoint(filled_caches(desc, 0), desc, on_release=on_release) as pre, \
            DecodeEndpoint(filled_caches(desc, 1), desc) as dec:
        dec.connect(pre.endpoint)
        for tid, end in (("acked", lambda: dec.pull("acked", [3], deadline_s=5).result()),
                         ("aborted", lambda: dec.abort("aborted"))):
            pre.publish(tid, [1])
            end()
            deadline = time.monotonic() + 5
            while tid in pre.held() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert tid not in pre.held()
            assert ran[-1:] == [(tid, tid)]


def test_lease_expiry_ignores_ended_and_replaced_leases():
    # the expiry heap keeps an entry per publish; an ended lease's entry must never expire
    # a later lease published under the same id, and ended entries must not pile up
    desc = make_desc()
    released = []
    with PrefillEndpoint(filled_caches(desc, 0), desc, on_release=lambda *a: released.append(a[::2])) as pre:
        pre.publish("a", [0], lease_s=0.2)
        swapped = threading.Event()

        def swap():   # end and re-publish in one loop callback: no tick between them
            pre._end_lease("a", "released")
            pre.publish("a", [1], lease_s=30)       # same id, long lease
            swapped.set()
        pre._loop.call_soon(swap)
        assert swapped.wait(5)
        for i in range(300):
            pre.publish(f"x{i}", [2], lease_s=60)
        for i in range(300):
            assert pre.release(f"x{i}")
        pre.publish("short", [3], lease_s=0.3)
        deadline = time.monotonic() + 5
        while ("short", "expired") not in released and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert pre.held() == ["a"]
        assert [r for r in released if r[1] == "expired"] == [("short", "expired")]
        assert len(pre._leases._expiry) <= 2 * len(pre.held()) + 64 + 1


def test_many_concurrent_transfers():
    desc = make_desc(num_layers=2, num_blocks=64)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=1) as pre, DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint)
        handles = []
        for i in range(16):
            pre.publish(f"t{i}", [63 - 2 * i, 62 - 2 * i])
            handles.append(dec.pull(f"t{i}", [2 * i, 2 * i + 1], deadline_s=10))
        for h in handles:
            h.result(timeout=10)
        for s, d in zip(src, dst):
            for i in range(16):
                assert torch.equal(_bytes(d)[2 * i], _bytes(s)[63 - 2 * i])
        assert dec.stats()["transfers_completed"] == 16


def test_hostile_header_does_not_kill_the_endpoint():
    desc = make_desc()
    with PrefillEndpoint(filled_caches(desc, 0), desc) as pre:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(pre.endpoint)
        for junk in ([b"\xc1garbage"], [b"\x00" * (2 << 20)], []):
            if junk:
                s.send_multipart(junk)
        # The 2 MiB frame exceeds the prefill's 1 MiB message limit, so libzmq drops that
        # connection and the DEALER reconnects; a PING sent meanwhile can be lost. Ping again
        # until a PONG comes back: what is under test is that the endpoint still answers.
        types = []
        deadline = time.monotonic() + 10
        while MsgType.PONG not in types and time.monotonic() < deadline:
            s.send(encode_header(Header(MsgType.PING)))
            while s.poll(200):
                types.append(decode_header(s.recv_multipart()[0]).type)
        s.close(0)
        ctx.term()
        assert MsgType.PONG in types   # the I/O thread survived and still answers
        assert pre._loop._thread.is_alive()


@pytest.mark.parametrize("side, kw, says", [
    ("prefill", {"lease_s": float("nan")}, "lease_s: expected a positive number of seconds (or inf), got nan"),
    ("prefill", {"lease_s": 0}, "lease_s: expected a positive number"),
    ("prefill", {"peer_timeout_s": 0}, "peer_timeout_s: expected a positive number of seconds, got 0"),
    ("prefill", {"heartbeat_s": -1}, "heartbeat_s: expected a positive number"),
    ("prefill", {"port": 70000}, "port: expected an integer in [0, 65535], got 70000"),
    ("prefill", {"chunk_bytes": 0}, "chunk_bytes: expected an integer >= 1, got 0"),
    ("prefill", {"prestage_bytes": -1}, "prestage_bytes: expected an integer >= 0"),
    ("decode", {"peer_timeout_s": float("inf")}, "peer_timeout_s: expected a positive number of seconds, got inf"),
    ("decode", {"max_frame_bytes": 0}, "max_frame_bytes: expected an integer >= 1"),
    ("prefill", {"lanes": 0}, "lanes: expected an integer in [1, 64], got 0"),
    ("decode", {"lanes": 65}, "lanes: expected an integer in [1, 64], got 65"),
    ("publish", {"lease_s": float("nan")}, "lease_s: expected a positive number of seconds (or inf), got nan"),
    ("publish", {"lease_s": -5}, "lease_s: expected a positive number"),
    ("publish", {"pulls": 0}, "pulls: expected an integer in [1, 1024], got 0"),
    ("pull", {"deadline_s": float("nan")}, "deadline_s: expected a positive number of seconds, got nan"),
    ("connect", {"timeout_s": 0}, "timeout_s: expected a positive number of seconds, got 0"),
])
def test_bad_numeric_arguments_are_one_line_errors(side, kw, says):
    """A NaN lease would never expire, a zero peer timeout drop every peer at once, port 70000 bind
    another port than the endpoint string says: each is refused where it is given, naming it, and
    nothing is published or started."""
    desc = make_desc(num_layers=1, num_blocks=8)
    with PrefillEndpoint(filled_caches(desc, 0), desc) as pre, DecodeEndpoint(filled_caches(desc, 1), desc) as dec:
        calls = {"prefill": lambda: PrefillEndpoint(filled_caches(desc, 0), desc, **kw),
                 "decode": lambda: DecodeEndpoint(filled_caches(desc, 1), desc, **kw),
                 "publish": lambda: pre.publish("t", [1], **kw),
                 "connect": lambda: dec.connect(pre.endpoint, **kw)}
        if side == "pull":
            dec.connect(pre.endpoint, timeout_s=5)
            calls["pull"] = lambda: dec.pull("t", [2], **kw)
        with pytest.raises(ValueError) as e:
            calls[side]()
        assert says in str(e.value) and "\n" not in str(e.value)
        assert pre.held() == [] and dec.stats()["pending"] == 0


def _until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def _pull_checked(pre, dec, src, dst, tid, src_ids, dst_ids):
    pre.publish(tid, src_ids)
    dec.pull(tid, dst_ids, deadline_s=10).result()
    for s, d in zip(src, dst):
        for si, di in zip(src_ids, dst_ids):
            assert torch.equal(_bytes(d)[di], _bytes(s)[si])


@pytest.mark.parametrize("path", ["xxh3", "mix64-recv-into"])
def test_lanes_carry_blocks_byte_exact(path):
    """A decode side offering 3 lanes to a prefill granting up to 4 opens 2 more connections before
    connect() returns; the prefill deals the first pull's BLOCKS over all three (out of order across
    them) and every block lands byte exact, through the host path (xxh3) and the device path's
    receive into pooled buffers."""
    from kvconnector.testing.frame_ops import TORCH_FRAME_OPS
    desc = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=40)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    ops = dict(frame_ops=TORCH_FRAME_OPS) if path != "xxh3" else {}
    with PrefillEndpoint(src, desc, chunk_bytes=1, lanes=4, **ops) as pre, \
            DecodeEndpoint(dst, desc, lanes=3, recv_into=path != "xxh3", **ops) as dec:
        dec.connect(pre.endpoint, timeout_s=5)     # returns once the lanes are up: the first pull has them
        assert dec.checksum == ("xxh3_64" if path == "xxh3" else "mix64")
        _pull_checked(pre, dec, src, dst, "t", list(range(20)), list(range(20, 40)))
        st = pre.stats()
        assert st["messages_sent"] >= 60 and st["messages_sent_on_lanes"] >= 30   # 60 BLOCKS, 2 of 3 on lanes
        assert dec.stats()["lanes_opened"] == 2 and not st["ignored"]


def test_lanes_are_granted_by_the_smaller_side_and_ignored_for_unknown_peers():
    """A prefill granting 1 lane gets no LANE (the pull keeps one connection); a LANE naming no
    handshaken peer is ignored without a reply, and that connection is no peer of the prefill."""
    desc = make_desc(num_layers=2, num_blocks=8)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=1, lanes=1) as pre, DecodeEndpoint(dst, desc, lanes=4) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        _pull_checked(pre, dec, src, dst, "t", [1, 2, 3], [5, 6, 7])
        assert pre.stats()["lanes_opened"] == 0 and pre.stats()["messages_sent_on_lanes"] == 0
        assert dec.stats()["lanes_opened"] == 0
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        try:
            rogue.connect(pre.endpoint)
            rogue.send(encode_header(Header(MsgType.LANE, peer=b"kvc-nobody")))
            assert _until(lambda: pre.stats()["ignored"].get("lane") == 1)
            assert not rogue.poll(200)
        finally:
            rogue.close(0)
            ctx.term()


def test_lanes_come_back_after_the_prefill_restarts():
    """The prefill restarts on the same port: the decode side re-handshakes (its PING is answered
    HANDSHAKE_REQUIRED), says LANE again on the connections it kept, and the next pull uses them."""
    desc = make_desc(num_layers=2, num_blocks=16)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    pre = PrefillEndpoint(src, desc, chunk_bytes=1, lanes=3)
    port = pre.port
    with DecodeEndpoint(dst, desc, lanes=3, heartbeat_s=0.05) as dec:
        try:
            dec.connect(pre.endpoint, timeout_s=5)
            _pull_checked(pre, dec, src, dst, "a", [0, 1, 2, 3], [8, 9, 10, 11])
            pre.close()
            pre = PrefillEndpoint(src, desc, chunk_bytes=1, lanes=3, port=port)
            assert _until(lambda: pre.stats()["lanes_opened"] == 2)
            _pull_checked(pre, dec, src, dst, "b", [4, 5, 6, 7], [12, 13, 14, 15])
            assert pre.stats()["messages_sent_on_lanes"] >= 4   # 8 BLOCKS, 2 of 3 on lanes
        finally:
            pre.close()


class _Relay:
    """A TCP relay to ``target`` (host, port): each accepted connection is forwarded on a
    connection of its own; :meth:`cut` closes the ``i``-th one both ways, as a dropped link."""

    def __init__(self, target):
        import socket
        self._socket, self.target, self.conns = socket, target, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = self._socket.create_connection(self.target)
            self.conns.append((a, b))
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x, y):
        try:
            while data := x.recv(1 << 16):
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            try:
                s.shutdown(2)
            except OSError:
                pass

    def cut(self, i):
        for s in self.conns[i]:
            try:
                s.shutdown(2)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        for i in range(len(self.conns)):
            self.cut(i)


def test_a_dropped_lane_mid_pull_is_pulled_again_and_reconnected():
    """A lane's TCP connection drops while a pull streams over it: the decode side sends the PULL
    again (the BLOCKS on that connection are lost), the prefill restarts the stream, the lane
    reconnects and says LANE again, and every block lands byte exact long before the deadline."""
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=40)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=1, lanes=3) as pre:
        relay = _Relay(("127.0.0.1", pre.port))
        sends = []

        def cut_a_lane(stage):
            if stage == "send":
                sends.append(1)
                if len(sends) == 10:       # BLOCKS are going out over all three connections now
                    relay.cut(1)           # the second connection accepted: the first lane
                    time.sleep(0.05)
        try:
            with DecodeEndpoint(dst, desc, lanes=3) as dec:
                dec.connect(relay.endpoint, timeout_s=5)
                assert _until(lambda: pre.stats()["lanes_opened"] == 2)
                pre._fault_hook = cut_a_lane
                t0 = time.monotonic()
                _pull_checked(pre, dec, src, dst, "t", list(range(20)), list(range(20, 40)))
                assert time.monotonic() - t0 < 5
                assert dec.stats()["ignored"].get("lane_disconnected", 0) >= 1
                def live():   # the prefill's lanes that carry BLOCKS now
                    return [lane for peer in list(pre._peers.values()) for lane in peer["lanes"] if lane is not None]
                assert _until(lambda: len(live()) == 2), (pre.stats()["ignored"], dec.stats()["ignored"])
                assert pre.stats()["lanes_opened"] >= 3   # the lane's new connection replaced the dropped one
        finally:
            pre._fault_hook = None
            relay.close()
