"""No silent waits: every failure the connector detects reaches the pull at once, typed.

Covers: one cache check for both roles at construction (shape, dtype, strides, storage,
device, layers sharing bytes); a fault sweep over every stage of serving a pull on the prefill
side (``PrefillEndpoint._fault_hook``) with the decode side failing with ``PeerError`` naming
the cause well inside its deadline; application callbacks (``on_layer``, ``on_release``) that
raise without changing the transfer's accounting; a lease that expires or is released
mid-transfer (the pull fails at once; ``on_release`` waits until no byte of the blocks is still
read, including zero-copy frames queued in ZeroMQ).

Every pull here has a 30 s deadline and each failure must arrive within 1 s: an upper bound
on a failure path (a wait for the deadline would take 30 s), not a performance assertion.

Run: python -m pytest tests/test_no_silent_waits.py
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import zmq

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import Header, MsgType, checksum, decode_header, encode_header
from layouts import KVCacheError, KVQuantMode, LayoutError, PeerError, TransferError

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 30.0     # a pull that waited for its deadline would be obvious
FAST_S = 1.0          # every known failure must reach the pull well before that
SRC_IDS, DST_IDS = [7, 2, 3, 4, 9, 0], [1, 5, 6, 8, 10, 11]


def _bytes(t):
    return t.view(torch.uint8)


# ---- item: one cache check, both roles ---------------------------------------------------

def _bad_caches(desc, defect):
    caches = filled_caches(desc, 0)
    geo = desc.geometry()
    if defect == "strides":     # every other block of a bigger tensor: right shape, wrong strides
        big = geo.new_cache(2 * desc.num_blocks)
        caches[1] = big[::2]
    elif defect == "dtype":
        caches[0] = caches[0].view(torch.int8)
    elif defect == "shape":
        caches[0] = geo.new_cache(desc.num_blocks + 1)
    elif defect == "layers":
        caches = caches[:-1]
    elif defect == "shared-storage":   # two layers on the same bytes: a pull into one writes both
        caches[1] = caches[0]
    elif defect == "storage":          # the storage no longer holds the tensor's bytes
        c = geo.new_cache(desc.num_blocks)
        c.untyped_storage().resize_(16)
        caches[0] = c
    elif defect == "device":
        caches[1] = torch.empty(caches[1].shape, dtype=caches[1].dtype, device="meta")
    return caches


DEFECTS = {"strides": "strides: expected", "dtype": "expected .* got .* torch.int8",
           "shape": "caches\\[0\\]: expected", "layers": "expected 3 layers",
           "shared-storage": "overlapping bytes", "storage": "storage: expected >=",
           "device": "device: expected cpu"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("defect", list(DEFECTS), ids=list(DEFECTS))
def test_both_roles_refuse_the_same_bad_caches_at_construction(defect, role):
    desc = make_desc(num_layers=3, num_blocks=8)
    caches = _bad_caches(desc, defect)
    cls = PrefillEndpoint if role == "prefill" else DecodeEndpoint
    with pytest.raises(LayoutError, match=DEFECTS[defect]):
        ep = cls(caches, desc)
        ep.close()


# ---- item: fault sweep over the prefill's serving path -------------------------------------

class Rig:
    """A prefill and a decode endpoint on loopback, 3 layers of 12 blocks."""

    def __init__(self, chunk_bytes=1, mode=KVQuantMode.INT4_PER_TOKEN_HEAD, head_size=32, num_blocks=12,
                 lease_s=30.0, device="cpu"):
        self.desc = make_desc(mode, head_size, num_layers=3, num_blocks=num_blocks)
        self.src = [c.to(device) for c in filled_caches(self.desc, 0)]
        self.dst = [c.to(device) for c in filled_caches(self.desc, 1)]
        self.released = []
        self.pre = PrefillEndpoint(self.src, self.desc, chunk_bytes=chunk_bytes, lease_s=lease_s,
                                   on_release=lambda t, ids, why: self.released.append((t, why)))
        self.dec = DecodeEndpoint(self.dst, self.desc)

    def wait_released(self, n=1, timeout_s=5.0):
        end = time.monotonic() + timeout_s
        while len(self.released) < n and time.monotonic() < end:
            time.sleep(0.01)
        return self.released

    def landed_exact(self, h, src_ids=SRC_IDS, dst_ids=DST_IDS):
        """Blocks not in ``failed_block_ids`` hold the source bytes in every layer."""
        failed = set(h.failed_block_ids if h.error else [])
        for s, d in zip(self.src, self.dst):
            for si, di in zip(src_ids, dst_ids):
                if di not in failed:
                    assert torch.equal(_bytes(d)[di], _bytes(s)[si]), f"block {di} reported landed, differs"

    def close(self):
        self.dec.close()
        self.pre.close()


class Injected(RuntimeError):
    pass


def raise_at(stage):
    def hook(s):
        if s == stage:
            raise Injected(f"injected at {s}")
    return hook


# stage -> the lease's end: "failed" (serving failed, lease ended) or None (still held)
SERVE_STAGES = {"lookup": None, "stream": "failed", "gather": "failed", "checksum": "failed", "send": "failed"}
PATHS = {"gathered": dict(chunk_bytes=1),                                     # one block per message, copied
         "zero-copy": dict(chunk_bytes=1 << 20, mode=KVQuantMode.NONE, head_size=1024,
                           num_blocks=64),                                     # 256 KiB runs straight from the cache
         "cuda": dict(chunk_bytes=1, device="cuda")}                           # device gather + pinned staging
ZC_SRC, ZC_DST = list(range(8, 16)), list(range(40, 48))
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("path", [pytest.param(p, marks=NEEDS_CUDA) if p == "cuda" else p for p in PATHS],
                         ids=list(PATHS))
@pytest.mark.parametrize("stage", list(SERVE_STAGES), ids=list(SERVE_STAGES))
def test_fault_sweep_pull_fails_fast_with_the_cause(stage, path):
    rig = Rig(**PATHS[path])
    src_ids, dst_ids = (ZC_SRC, ZC_DST) if path == "zero-copy" else (SRC_IDS, DST_IDS)
    try:
        rig.dec.connect(rig.pre.endpoint, timeout_s=5)
        rig.pre.publish("t", src_ids)
        rig.pre._fault_hook = raise_at(stage)
        t0 = time.monotonic()
        h = rig.dec.pull("t", dst_ids, deadline_s=DEADLINE_S)
        err = h.exception(timeout=DEADLINE_S + 5)
        elapsed = time.monotonic() - t0
        assert isinstance(err, PeerError), repr(err)
        assert elapsed < FAST_S, f"{stage}: error after {elapsed:.2f} s"
        assert f"injected at {stage}" in str(err) and "Injected" in str(err)
        assert " (at test_no_silent_waits.py:" in str(err) and " in hook)" in str(err)   # where it was raised
        assert err.code == ("internal" if SERVE_STAGES[stage] is None else "serve_failed")
        assert err.failed_block_ids and set(err.failed_block_ids) <= set(dst_ids)
        rig.landed_exact(h, src_ids, dst_ids)
        assert any(isinstance(e, KVCacheError) and f"injected at {stage}" in str(e) for e in rig.pre.errors)
        if SERVE_STAGES[stage] is None:
            assert rig.pre.held() == ["t"] and rig.released == []
        else:
            assert rig.wait_released() == [("t", "failed")] and rig.pre.held() == []
        # the endpoints survive: the same peer pulls another transfer
        rig.pre._fault_hook = None
        rig.pre.publish("t2", src_ids)
        h2 = rig.dec.pull("t2", dst_ids, deadline_s=10)
        h2.result(timeout=10)
        rig.landed_exact(h2, src_ids, dst_ids)
    finally:
        rig.close()


def test_fault_at_hello_fails_connect_fast():
    rig = Rig()
    try:
        rig.pre._fault_hook = raise_at("hello")
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="internal.*injected at hello"):
            rig.dec.connect(rig.pre.endpoint, timeout_s=DEADLINE_S)
        assert time.monotonic() - t0 < FAST_S
    finally:
        rig.close()


def test_fault_at_release_leaves_the_transfer_and_lease_exact():
    """The last stage runs after the decode side has every byte (it ACKed): the pull succeeds,
    the lease is ended once, and the failure is recorded."""
    rig = Rig()
    try:
        rig.dec.connect(rig.pre.endpoint, timeout_s=5)
        rig.pre._fault_hook = raise_at("release")
        rig.pre.publish("t", SRC_IDS)
        h = rig.dec.pull("t", DST_IDS, deadline_s=DEADLINE_S)
        h.result(timeout=FAST_S * 5)
        rig.landed_exact(h)
        assert rig.wait_released() == [("t", "acked")]     # on_release still ran, once
        assert [re.sub(r":\d+ in ", ":N in ", str(e)) for e in rig.pre.errors] == \
            ["releasing transfer 't': Injected: injected at release (at test_no_silent_waits.py:N in hook)"]
        assert rig.pre.held() == [] and rig.pre.stats()["transfers_completed"] == 1
        assert rig.pre.callback_errors == []
    finally:
        rig.close()


# ---- item: application callbacks cannot break the transfer --------------------------------

def test_on_layer_raising_on_layer_0_of_a_3_layer_message():
    rig = Rig(chunk_bytes=8 << 20)   # small layers: one BLOCKS message carries all 3 (nlay=3)
    try:
        rig.dec.connect(rig.pre.endpoint, timeout_s=5)
        rig.pre.publish("t", SRC_IDS)
        seen = []

        def on_layer(tid, layer):
            seen.append(layer)
            if layer == 0:
                raise ValueError("application bug")
        t0 = time.monotonic()
        h = rig.dec.pull("t", DST_IDS, deadline_s=DEADLINE_S, on_layer=on_layer)
        res = h.result(timeout=5)
        assert time.monotonic() - t0 < FAST_S
        assert res.nbytes == 3 * len(SRC_IDS) * rig.desc.block_bytes
        assert sorted(seen) == [0, 1, 2] and all(h.layer_done(la) for la in range(3))
        assert [(la, type(e)) for la, e in h.callback_errors] == [(0, ValueError)]
        assert h.failed_block_ids == []
        rig.landed_exact(h)
        assert rig.wait_released() == [("t", "acked")]
        assert rig.pre.stats()["messages_sent"] >= 1 and rig.dec.stats()["transfers_completed"] == 1
    finally:
        rig.close()


def test_on_release_raising_changes_no_lease_accounting():
    desc = make_desc(num_layers=3, num_blocks=12)
    calls = []

    def on_release(tid, ids, why):
        calls.append((tid, why))
        raise RuntimeError(f"application bug on {tid}")
    with PrefillEndpoint(filled_caches(desc, 0), desc, on_release=on_release) as pre, \
            DecodeEndpoint(filled_caches(desc, 1), desc) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        for tid in ("a", "b"):
            pre.publish(tid, SRC_IDS)
            dec.pull(tid, DST_IDS, deadline_s=DEADLINE_S).result(timeout=5)
        pre.publish("gone", [1], lease_s=0.05)
        end = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.05)
        assert sorted(calls) == [("a", "acked"), ("b", "acked"), ("gone", "expired")]
        assert sorted(t for t, _ in pre.callback_errors) == ["a", "b", "gone"]
        assert pre.held() == [] and pre.stats()["transfers_completed"] == 2
        assert not [e for e in pre.errors if "application bug" in str(e)]


# ---- item: a lease ends only once its blocks can no longer be read -------------------------

@pytest.mark.parametrize("how", ["expired", "released"])
def test_lease_ending_mid_transfer_fails_the_pull_at_once(how):
    """The stream is slowed (20 ms per message) so the lease ends while most of it is unsent:
    the unsent messages are dropped and the pull fails with the cause, not by deadline."""
    rig = Rig(num_blocks=32, lease_s=0.3 if how == "expired" else 30.0)
    src, dst = list(range(24)), list(range(8, 32))
    try:
        rig.dec.connect(rig.pre.endpoint, timeout_s=5)
        rig.pre._fault_hook = lambda stage: time.sleep(0.02) if stage == "send" else None
        rig.pre.publish("t", src)
        t0 = time.monotonic()
        h = rig.dec.pull("t", dst, deadline_s=DEADLINE_S)
        if how == "released":
            end = time.monotonic() + 5
            while not rig.dec.stats()["bytes_received"] and time.monotonic() < end:
                time.sleep(0.005)
            assert rig.pre.release("t") is True
            assert rig.released == [("t", "released")]     # release() returned after on_release
        err = h.exception(timeout=DEADLINE_S + 5)
        elapsed = time.monotonic() - t0
        assert isinstance(err, PeerError) and err.code == ("lease_expired" if how == "expired" else how), repr(err)
        assert elapsed < 0.3 + FAST_S, f"error after {elapsed:.2f} s"
        assert err.failed_block_ids
        rig.landed_exact(h, src, dst)
        assert rig.wait_released() == [("t", how)] and rig.pre.held() == []
        assert rig.pre.stats()["streams"] == 0
    finally:
        rig.close()


def test_expiry_waits_for_zero_copy_frames_still_queued():
    """A peer stops reading; the lease expires while its zero-copy messages (views of the cache)
    are still queued in ZeroMQ. The lease stays held until they have left, so an application
    that reuses the blocks in ``on_release`` cannot change bytes still to be sent; the peer
    then gets every message intact, followed by ERROR lease_expired."""
    # 64 KiB blocks, 16 MiB a layer: 32 zero-copy messages of 1 MiB, far more than the socket buffers hold
    desc = make_desc(KVQuantMode.NONE, 128, num_kv_heads=8, block_size=16, num_layers=2, num_blocks=256)
    src = filled_caches(desc, 0)
    original = [c.clone() for c in src]
    released = []

    def on_release(tid, ids, why):   # the application reuses the blocks at once
        for c in src:
            _bytes(c)[ids] = 0xFF
        released.append((tid, why, time.monotonic()))
    ids = list(range(256))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 << 10)
    try:
        with PrefillEndpoint(src, desc, chunk_bytes=1 << 20, lease_s=0.3, on_release=on_release) as pre:
            sock.connect(pre.endpoint)
            sock.send(encode_header(Header(MsgType.HELLO, desc=desc.to_dict())))
            assert sock.poll(5000) and decode_header(sock.recv()).ok
            pre.publish("t", ids)
            sock.send(encode_header(Header(MsgType.PULL, tid="t", nblk=len(ids), heads=(0, 8))))
            time.sleep(1.0)                              # not reading: the lease expires meanwhile
            assert pre.held() == ["t"] and released == []   # its frames are still queued
            t0 = time.monotonic()
            messages, error = [], None
            while sock.poll(int(FAST_S * 1000)):          # read everything first, check afterwards
                frames = sock.recv_multipart(copy=False)
                h = decode_header(frames[0].buffer)
                if h.type == MsgType.ERROR:
                    error = h
                    break
                messages.append((h, frames[1:]))
            assert error is not None and error.code == "lease_expired" and error.tid == "t"
            assert time.monotonic() - t0 < FAST_S
            assert messages
            per = desc.block_bytes
            for h, payload in messages:
                assert h.type == MsgType.BLOCKS
                for i, f in enumerate(payload):
                    assert checksum(f.buffer) == h.checksums[i], f"BLOCKS seq {h.seq} frame {i}: bytes changed"
                blob = b"".join(bytes(f.buffer) for f in payload)
                for li in range(h.nlay):
                    for k in range(h.nblk):
                        off = (li * h.nblk + k) * per
                        want = _bytes(original[h.layer + li])[ids[h.first + k]].reshape(-1).numpy().tobytes()
                        assert blob[off:off + per] == want
            end = time.monotonic() + 5
            while not released and time.monotonic() < end:
                time.sleep(0.01)
            assert [r[:2] for r in released] == [("t", "expired")] and pre.held() == []
    finally:
        sock.close(0)
        ctx.term()


def test_release_from_another_thread_returns_after_on_release():
    desc = make_desc()
    order = []
    done = threading.Event()
    with PrefillEndpoint(filled_caches(desc, 0), desc,
                         on_release=lambda t, ids, why: (order.append("on_release"), done.set())) as pre:
        pre.publish("t", [0, 1])
        assert pre.release("t") is True
        order.append("returned")
        assert order == ["on_release", "returned"] and pre.held() == []
        assert pre.release("t") is False


def test_a_failing_write_on_the_decode_side_fails_the_pull_at_once_naming_where():
    """Writing a checked message into the destination raises (a bug, a broken device): the pull
    fails at once with a TransferError naming the cause and where it was raised (the decode's
    error log keeps no tracebacks), and the decode side tells the prefill (ABORT)."""
    rig = Rig()
    try:
        rig.dec.connect(rig.pre.endpoint, timeout_s=5)
        rig.pre.publish("t", SRC_IDS)

        def broken(*a, **k):
            raise RuntimeError("destination unwritable")
        rig.dec._host.write_cpu = broken
        t0 = time.monotonic()
        err = rig.dec.pull("t", DST_IDS, deadline_s=DEADLINE_S).exception(timeout=DEADLINE_S + 5)
        assert isinstance(err, TransferError) and time.monotonic() - t0 < FAST_S, repr(err)
        assert "RuntimeError: destination unwritable (at test_no_silent_waits.py:" in str(err) and " in broken)" in str(err)
        assert rig.wait_released() == [("t", "aborted")]
    finally:
        rig.close()
