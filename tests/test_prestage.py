"""Staging at publish: with the device kernels (``frame_ops``) and ``mix64`` offered, the prefill
endpoint stages each published transfer's first message (gather + checksum, copy to pinned
memory) before any pull asks for it, within ``prestage_bytes``; a pull of every head in ``mix64``
sends that message and stages the rest as usual, byte-exact, with no message gathered twice. A
prestaged message that no pull takes (another head range, xxh3_64 peer, lease released or
expired) is dropped and its bytes counted back; the lease still ends only once nothing reads its
blocks. The default is on for CUDA caches and off for CPU caches, whose kernels would run on
the I/O thread at publish. Runs on CPU caches (kernels through Triton's interpreter, staging at
publish switched on) and on CUDA caches.

Run: python -m pytest tests/test_prestage.py -q
"""

import time

import pytest
import torch

from connector_fakes import filled_caches, make_desc, until
from kernels.transfer import FRAME_OPS
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.prefill import PRESTAGE_BYTES
from layouts import KVQuantMode

pytestmark = pytest.mark.timeout(120)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]
SRC, DST = [7, 2, 5, 0], [1, 6, 3, 4]


class Gathers:
    """The kernels, counting the messages gathered (one checksum each; a gather launch may cover
    several consecutive messages). On CPU caches the gather runs on a thread of its own: the
    count follows the staging a moment later."""

    def __init__(self) -> None:
        self.n = 0

    def gather(self, caches, block_ids, *, checksums, **kw) -> None:
        self.n += checksums.numel()
        FRAME_OPS.gather(caches, block_ids, checksums=checksums, **kw)

    def warmup(self, device) -> None:
        FRAME_OPS.warmup(device)


def _rig(device, chunk_bytes, **pre_kw):
    """Endpoints on ``device``; staging at publish on (CPU caches default to off) unless ``pre_kw`` says."""
    pre_kw.setdefault("prestage_bytes", PRESTAGE_BYTES)
    desc = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=8)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    released = []
    hook = Gathers()
    pre = PrefillEndpoint(src, desc, chunk_bytes=chunk_bytes, frame_ops=hook,
                          on_release=lambda t, ids, why: released.append((t, why)), **pre_kw)
    return desc, src, dst, pre, hook, released


def _exact(src, dst, device):
    if device == "cuda":
        torch.cuda.synchronize()
    for s, d in zip(src, dst):
        assert torch.equal(d.view(torch.uint8)[DST], s.view(torch.uint8)[SRC])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 1 << 20], ids=["message-per-block", "one-message"])
def test_first_message_staged_at_publish(device, chunk):
    desc, src, dst, pre, hook, _ = _rig(device, chunk)
    with pre, DecodeEndpoint(dst, desc, frame_ops=FRAME_OPS) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.trace.enabled = True
        pre.publish("t", SRC)
        assert until(lambda: pre.stats()["prestaged_bytes"] > 0 and hook.n == 1, 30)   # staged before any pull
        time.sleep(0.05)
        assert hook.n == 1                              # the first message only
        dec.pull("t", DST, deadline_s=60).result(timeout=60)
        _exact(src, dst, device)
        sent = pre.stage_times()["sent"]
        assert sent == (1 if chunk > 1 else desc.num_layers * len(SRC))
        assert hook.n == sent                           # no message gathered twice
        assert pre.stats()["prestaged_bytes"] == 0
        spans = pre.trace.take()
        pre_t = [t0 for name, _, t0, _, a in spans if name == "prestage" and a["tid"] == "t"]
        send_t = [t0 for name, _, t0, _, a in spans if name == "send" and a["tid"] == "t"]
        assert len(pre_t) == 1 and pre_t[0] < min(send_t)
        assert not pre.errors and not dec.errors


@pytest.mark.parametrize("device", DEVICES)
def test_prestage_budget(device):
    desc, src, dst, pre, hook, _ = _rig(device, 1 << 20, prestage_bytes=1)   # room for one message
    with pre:
        pre.publish("a", SRC)
        pre.publish("b", SRC)
        assert until(lambda: pre.stats()["prestaged_bytes"] > 0 and hook.n == 1, 30)
        time.sleep(0.1)
        assert hook.n == 1                              # "b" waits for its pull
    desc, src, dst, pre, hook, _ = _rig(device, 1 << 20, prestage_bytes=0)   # off
    with pre, DecodeEndpoint(dst, desc, frame_ops=FRAME_OPS) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", SRC)
        time.sleep(0.1)
        assert hook.n == 0 and pre.stats()["prestaged_bytes"] == 0
        dec.pull("t", DST, deadline_s=60).result(timeout=60)
        _exact(src, dst, device)
        assert hook.n == 1


@pytest.mark.parametrize("device", DEVICES)
def test_prestage_default_follows_the_caches(device):
    """On by default for CUDA caches (staging queues device work), off for CPU caches (the kernels
    would run on the I/O thread at publish, holding up handshakes and other pulls meanwhile)."""
    desc = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=8)
    hook = Gathers()
    with PrefillEndpoint([c.to(device) for c in filled_caches(desc, 0)], desc, frame_ops=hook) as pre:
        assert pre.prestage_bytes == (PRESTAGE_BYTES if device == "cuda" else 0)
        pre.publish("t", SRC)
        assert until(lambda: hook.n > 0, 1.0) == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("end", ["release", "expire", "other-heads", "xxh3-peer", "serve-fails"])
def test_prestaged_message_not_taken_is_dropped(device, end):
    desc, src, dst, pre, hook, released = _rig(device, 1 << 20)
    with pre:
        pre.publish("t", SRC, lease_s=0.5 if end == "expire" else 30)
        assert until(lambda: pre.stats()["prestaged_bytes"] > 0 and hook.n == 1, 30)
        if end == "release":
            assert pre.release("t") is True
        elif end == "expire":
            assert until(lambda: not pre.held() and released, 10)
        elif end == "serve-fails":   # the pull takes the prestaged stream, then serving it fails
            def fail_at_stream(stage):
                if stage == "stream":
                    raise RuntimeError("injected at stream")
            pre._fault_hook = fail_at_stream
            with DecodeEndpoint(dst, desc, frame_ops=FRAME_OPS) as dec:
                dec.connect(pre.endpoint, timeout_s=5)
                err = dec.pull("t", DST, deadline_s=60).exception(timeout=60)
                assert err is not None and "injected at stream" in str(err)
            assert until(lambda: not pre.held() and released, 10)
            assert len(pre._pool._free) == 1      # its pinned buffer went back to the pool
        else:
            if end == "other-heads":
                half = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=1, block_size=4, num_layers=3,
                                 num_blocks=8, head_start=1, total_num_kv_heads=2)
                dst = [c.to(device) for c in filled_caches(half, 1)]
                dec = DecodeEndpoint(dst, half, frame_ops=FRAME_OPS)
            else:
                dec = DecodeEndpoint(dst, desc)             # no kernels: xxh3_64
            with dec:
                dec.connect(pre.endpoint, timeout_s=5)
                dec.pull("t", DST, deadline_s=60).result(timeout=60)
                if device == "cuda":
                    torch.cuda.synchronize()
                for s, d in zip(src, dst):
                    want = s.view(torch.uint8)[SRC]
                    assert torch.equal(d.view(torch.uint8)[DST], want[:, :, :, 1:2] if end == "other-heads" else want)
            assert until(lambda: not pre.held() and released, 10)
        assert pre.held() == [] and pre.stats()["prestaged_bytes"] == 0
        reason = {"release": "released", "expire": "expired", "serve-fails": "failed"}.get(end, "acked")
        assert released == [("t", reason)]
        assert len(pre.errors) == (end == "serve-fails")
