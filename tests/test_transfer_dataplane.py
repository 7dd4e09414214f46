"""Data planes: the same pulls over ZeroMQ payload frames and over NIXL (``kvconnector.dataplane``).

For each plane (``nixl`` is skipped where the ``nixl`` package is not installed): byte-exact
pulls on CPU caches with xxh3_64 (inline and with copy workers, head slices) and with the device
kernels (``mix64``, interpreter on CPU, compiled on CUDA when present); a payload corrupted in
flight fails the pull with CorruptFrameError and leaves the destination untouched; a decode side
that offers NIXL to a prefill without it still pulls over ZeroMQ frames.

Run: python -m pytest tests/test_transfer_dataplane.py -q   (NIXL: pip install nixl)
"""

import importlib.util

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kernels.transfer import FRAME_OPS
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector import dataplane
from kvconnector.prefill import NIXL_INFLIGHT
from kvconnector.protocol import CHECKSUM, MIX64
from layouts import CorruptFrameError, KVQuantMode, PeerError, TransferError

pytestmark = pytest.mark.timeout(120)
HAVE_NIXL = importlib.util.find_spec("nixl") is not None
PLANES = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="needs the nixl package"))]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]


def _b(c):
    return c.view(torch.uint8)


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("kernels", [False, True], ids=["xxh3-host", "mix64-kernels"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_threads", [0, 2], ids=["inline", "workers"])
def test_pull_byte_exact_on_every_plane(plane, kernels, device, copy_threads):
    desc = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=10)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    ops = FRAME_OPS if kernels else None
    src_ids, dst_ids = [9, 3, 4, 5, 0], [2, 7, 1, 8, 3]
    with PrefillEndpoint(src, desc, chunk_bytes=2 * desc.block_bytes, frame_ops=ops, data_plane=plane) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=ops, data_plane=plane, copy_threads=copy_threads,
                           nixl_region_bytes=1 << 20) as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        assert (dec.plane, dec.checksum) == (plane, MIX64 if kernels else CHECKSUM)
        for r in range(2):     # the second pull reuses the region area the first one gave back
            pre.publish(f"r{r}", src_ids)
            dec.pull(f"r{r}", dst_ids, deadline_s=60).result(timeout=60)
        if device == "cuda":
            torch.cuda.synchronize()
        for s, d, b in zip(src, dst, before):
            assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
            rest = sorted(set(range(10)) - set(dst_ids))
            assert torch.equal(_b(d)[rest], _b(b)[rest])
        assert not pre.errors and not dec.errors


@pytest.mark.parametrize("plane", PLANES)
def test_head_slice_on_every_plane(plane):
    full = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=4, num_blocks=6)
    half = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=2, num_blocks=6, head_start=2,
                     total_num_kv_heads=4)
    src, dst = filled_caches(full, 0), filled_caches(half, 1)
    with PrefillEndpoint(src, full, data_plane=plane) as pre, DecodeEndpoint(dst, half, data_plane=plane) as dec:
        assert dec.connect(pre.endpoint, timeout_s=10) == range(2, 4)
        pre.publish("t", [1, 4])
        dec.pull("t", [5, 0], deadline_s=30).result(timeout=30)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[5], _b(s)[1][:, :, 2:4])
            assert torch.equal(_b(d)[0], _b(s)[4][:, :, 2:4])


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("kernels", [False, True], ids=["xxh3-host", "mix64-kernels"])
def test_payload_corrupted_in_flight_never_lands(plane, kernels, monkeypatch):
    """One byte of the second message's payload flips on its way (in the frame for ZeroMQ, in the
    region after the NIXL write): the pull fails with CorruptFrameError, that message's block
    keeps its old bytes and no block holds anything but its old or its source bytes."""
    desc = make_desc(num_layers=2, num_blocks=6)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    ops = FRAME_OPS if kernels else None
    sent = []
    if plane == "nixl":
        real = dataplane.NixlWrite.poll

        def poll(self):   # once a write is in the region, before its header goes
            done = real(self)
            if done and self.at not in sent:
                sent.append(self.at)
                if len(sent) == 2:
                    dec_region[self.at + 5] ^= 0x20
            return done
        monkeypatch.setattr(dataplane.NixlWrite, "poll", poll)
    with PrefillEndpoint(src, desc, chunk_bytes=1, frame_ops=ops, data_plane=plane) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=ops, data_plane=plane, nixl_region_bytes=1 << 20) as dec:
        dec_region = dec._nixl.region if plane == "nixl" else None
        if plane == "zmq":
            real_send = pre._send

            def send(ident, frames, track=False):
                if len(frames) > 1:
                    sent.append(1)
                    if len(sent) == 2:
                        bad = bytearray(frames[1])
                        bad[5] ^= 0x20
                        frames = [frames[0], bytes(bad)]
                return real_send(ident, frames, track)
            pre._send = send
        dec.connect(pre.endpoint, timeout_s=10)
        pre.publish("t", [4, 1])
        # chunk_bytes=1: one block per message; message 2 is layer 0, position 1 (destination block 3)
        with pytest.raises(CorruptFrameError, match="checksum"):
            dec.pull("t", [0, 3], deadline_s=30).result(timeout=30)
        assert torch.equal(_b(dst[0])[3], _b(before[0])[3])     # the corrupted message: nothing landed
        # other messages were verified on their own: each block holds its old bytes or the source's
        # (the device path learns of the mismatch after later messages were queued)
        for layer in range(2):
            for d, sid in ((0, 4), (3, 1)):
                got = _b(dst[layer])[d]
                assert torch.equal(got, _b(before[layer])[d]) or torch.equal(got, _b(src[layer])[sid])
        for c, b in zip(dst, before):
            assert torch.equal(_b(c)[[1, 2, 4, 5]], _b(b)[[1, 2, 4, 5]])


@pytest.mark.skipif(not HAVE_NIXL, reason="needs the nixl package")
def test_nixl_offer_to_a_zmq_prefill_falls_back_to_frames():
    desc = make_desc(num_layers=2, num_blocks=4)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc) as pre, DecodeEndpoint(dst, desc, data_plane="nixl") as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        assert dec.plane == "zmq"
        pre.publish("t", [3, 0])
        dec.pull("t", [1, 2], deadline_s=30).result(timeout=30)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[[1, 2]], _b(s)[[3, 0]])


def test_unknown_plane_is_refused():
    desc = make_desc(num_layers=1, num_blocks=2)
    with pytest.raises(ValueError, match="data_plane: expected one of"):
        DecodeEndpoint(filled_caches(desc, 0), desc, data_plane="rdma")


@pytest.mark.skipif(not HAVE_NIXL, reason="needs the nixl package")
def test_nixl_writes_overlap_and_a_failed_one_fails_the_pull(monkeypatch):
    """The prefill keeps several NIXL writes of a transfer in flight (a BLOCKS header goes once its
    write is in the region, in order), and a write NIXL reports failed fails that pull with the
    prefill's typed error while the next pull still lands byte-exact."""
    desc = make_desc(num_layers=2, num_blocks=12)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    posted, fail = [], []
    real_start, real_poll = dataplane.NixlWriter.start, dataplane.NixlWrite.poll

    def start(self, peer, frames, at):
        posted.append(sum(not w.done for w in posted_writes))     # writes still in flight at this start
        w = real_start(self, peer, frames, at)
        posted_writes.append(w)
        return w

    def poll(self):
        if fail and fail[0] < len(posted_writes) and self is posted_writes[fail[0]]:
            raise TransferError("nixl write: transfer failed (injected)")
        return real_poll(self)
    posted_writes = []
    monkeypatch.setattr(dataplane.NixlWriter, "start", start)
    monkeypatch.setattr(dataplane.NixlWrite, "poll", poll)
    with PrefillEndpoint(src, desc, chunk_bytes=1, data_plane="nixl") as pre, \
            DecodeEndpoint(dst, desc, data_plane="nixl", nixl_region_bytes=1 << 20) as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        pre.publish("ok", list(range(8)))
        dec.pull("ok", list(range(4, 12)), deadline_s=30).result(timeout=30)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[4:12], _b(s)[0:8])
        assert 1 <= max(posted) < NIXL_INFLIGHT, posted    # posted while earlier ones were in flight, up to the bound
        fail.append(len(posted_writes) + 1)   # the second write of the next pull
        pre.publish("bad", [0, 1, 2])
        with pytest.raises(PeerError, match="injected"):
            dec.pull("bad", [0, 1, 2], deadline_s=30).result(timeout=30)
        fail.clear()
        pre.publish("again", [3, 2])
        dec.pull("again", [0, 1], deadline_s=30).result(timeout=30)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[[0, 1]], _b(s)[[3, 2]])


class _Agent:
    """The three NIXL agent calls a posted write makes (``check_xfer_state``, ``release_xfer_handle``,
    ``deregister_memory``), answering a fixed state and recording the releases."""

    def __init__(self, state):
        self.state, self.released, self.deregistered = state, [], []

    def check_xfer_state(self, handle):
        return self.state

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def deregister_memory(self, reg):
        self.deregistered.append(reg)


@pytest.mark.parametrize("state", ["ERR", "DONE"])
def test_nixl_write_keeps_its_verdict_after_release(state):
    """A write NIXL reports failed raises TransferError at every poll, not only the first (its
    handle and registration are released once); a finished one polls True every time."""
    agent = _Agent("PROC")
    w = dataplane.NixlWrite(agent, "h", "reg", [], at=64, total=128, peer="p", deadline=float("inf"), state="PROC")
    assert w.poll() is False and not w.done
    agent.state = state
    for _ in range(3):
        if state == "ERR":
            with pytest.raises(TransferError, match="transfer failed"):
                w.poll()
        else:
            assert w.poll() is True
    assert w.done and agent.released == ["h"] and agent.deregistered == ["reg"]
    assert w.finish_quietly() is True
