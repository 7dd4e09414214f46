"""The connector's device path: ``mix64`` negotiated, gather + checksum and verify + scatter
by the injected kernels (``kernels.transfer.FRAME_OPS``), payload received zero copy and landed by
the decode side's landing thread (or received with ``recv_into`` into pinned buffers).

Runs on CPU caches (the kernels through Triton's interpreter: the same logic, no GPU) and on
CUDA caches when a GPU is present (pinned buffers, copy streams). Covers byte-exact pulls (every
mode, head slices, one block per message and many), interoperation with endpoints that have no
kernels (xxh3_64 is used, still byte-exact), and a faulty peer: a corrupted byte in a ``mix64``
frame fails the pull with CorruptFrameError naming the device check, truncated / oversized
frames are named (received zero copy, or into fixed buffers), and no destination byte changes. Pulls of many
messages of mixed sizes, all received before any write completes, use the plain-PyTorch twin of
the kernels on CPU (``kvconnector.testing.frame_ops``: the interpreter would take minutes at these sizes); a
failure while completing a device write fails the pull at once instead of by its deadline; the
landing thread keeps at most ``max_inflight`` messages on the device and refills a pinned buffer
only after the device copy that read it ended (fake gated events on CPU).

Run: python -m pytest tests/test_transfer_device_path.py -q
"""

import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import kvconnector.decode as decode_mod
import kvconnector.landing as landing_mod
import kvconnector.sender as sender_mod
from connector_fakes import FakePrefill, GatedEvent, filled_caches, make_desc, until
from kernels.transfer import FRAME_OPS
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.decode import RECV_INTO
from kvconnector.device_frames import DeviceWrite, _ok_view, aux_words
from kvconnector.protocol import CHECKSUM, MIX64, Header, MsgType
from kvconnector.staging import PinnedPool
from kvconnector.testing.frame_ops import TORCH_FRAME_OPS
from layouts import CorruptFrameError, KVQuantMode, TransferError

pytestmark = pytest.mark.timeout(120)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]


def _b(c):
    return c.view(torch.uint8)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD,
                                  KVQuantMode.NONE], ids=["int4", "int8", "bf16"])
@pytest.mark.parametrize("chunk", [1, 1 << 20], ids=["chunk-1block", "chunk-1MiB"])
def test_device_path_byte_exact(device, mode, chunk):
    desc = make_desc(mode, 32, num_kv_heads=2, block_size=4, num_layers=3, num_blocks=10)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    src_ids, dst_ids = [9, 3, 4, 5, 0], [2, 7, 1, 8, 3]
    with PrefillEndpoint(src, desc, chunk_bytes=chunk, frame_ops=FRAME_OPS) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=FRAME_OPS) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        assert dec.checksum == MIX64
        pre.publish("r", src_ids)
        res = dec.pull("r", dst_ids, deadline_s=60).result(timeout=60)
        _sync(device)
        assert res.nbytes == desc.num_layers * len(src_ids) * desc.block_bytes
        for s, d, b in zip(src, dst, before):
            assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
            rest = sorted(set(range(10)) - set(dst_ids))
            assert torch.equal(_b(d)[rest], _b(b)[rest])
        # by default CUDA caches receive into pooled pinned buffers (recv_into), CPU caches zero copy
        assert (dec.metrics.c["frames_received_into"] > 0) == (RECV_INTO and device == "cuda")
        assert not pre.errors and not dec.errors


@pytest.mark.parametrize("device", DEVICES)
def test_device_path_head_slice(device):
    full = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=4, num_blocks=6)
    half = make_desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, num_kv_heads=2, num_blocks=6, head_start=1,
                     total_num_kv_heads=4)
    src = [c.to(device) for c in filled_caches(full, 0)]
    dst = [c.to(device) for c in filled_caches(half, 1)]
    with PrefillEndpoint(src, full, frame_ops=FRAME_OPS) as pre, DecodeEndpoint(dst, half, frame_ops=FRAME_OPS) as dec:
        assert dec.connect(pre.endpoint) == range(1, 3)
        pre.publish("t", [1, 4])
        dec.pull("t", [5, 0], deadline_s=60).result(timeout=60)
        _sync(device)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[5], _b(s)[1][:, :, 1:3])
            assert torch.equal(_b(d)[0], _b(s)[4][:, :, 1:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side", ["prefill", "decode"], ids=["kernels-on-prefill-only", "kernels-on-decode-only"])
def test_endpoint_without_kernels_gets_xxh3(device, side):
    desc = make_desc(num_layers=2, num_blocks=6)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    ops_pre, ops_dec = (FRAME_OPS, None) if side == "prefill" else (None, FRAME_OPS)
    with PrefillEndpoint(src, desc, frame_ops=ops_pre) as pre, DecodeEndpoint(dst, desc, frame_ops=ops_dec) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        assert dec.checksum == CHECKSUM
        pre.publish("t", [4, 1])
        dec.pull("t", [0, 3], deadline_s=30).result(timeout=30)
        _sync(device)
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[[0, 3]], _b(s)[[4, 1]])


def _flipped(frames, at, bits):
    """A BLOCKS message's header and its payload frame with byte ``at`` XORed by ``bits``."""
    bad = bytearray(frames[1])
    bad[at] ^= bits
    return [frames[0], bytes(bad)]


def _corrupt(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2, sum=MIX64)
    send(_flipped(fr, len(fr[1]) // 2, 0x10))


def _truncated(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2, sum=MIX64)
    send([fr[0], fr[1][:-1]])


def _oversized(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2, sum=MIX64)
    send([fr[0], fr[1] + b"\x00"])


def _extra_frame(send, h, fake):
    fr = fake.blocks(h.tid, 0, 0, 2, sum=MIX64)
    send([*fr, b"\x00" * 8])


def _good_then_corrupt(send, h, fake):
    send(fake.blocks(h.tid, 0, 0, 2, sum=MIX64))          # layer 0 lands
    _corrupt_layer1(send, h, fake)


def _corrupt_layer1(send, h, fake):
    send(_flipped(fake.blocks(h.tid, 1, 0, 2, sum=MIX64), 3, 0x01))


def _corrupt_whole_pull(send, h, fake):
    """The pull's only message (both layers in one), one byte of layer 1 flipped: no layer of it lands."""
    send(_flipped(fake.multi_blocks(h.tid, 0, 2, 0, 2, sum=MIX64), -5, 0x02))


FAULTS = [(_corrupt, r"checksum \(mix64, verified on"), (_truncated, "truncated"), (_oversized, "oversized"),
          (_extra_frame, "expected 1 payload frames, got 2"), (_good_then_corrupt, r"checksum \(mix64"),
          (_corrupt_whole_pull, r"checksum \(mix64, verified on")]


@pytest.mark.parametrize("script,match", FAULTS, ids=["corrupt-byte", "truncated", "oversized", "extra-frame",
                                                      "good-then-corrupt", "corrupt-whole-pull"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recv_into", [False, pytest.param(True, marks=pytest.mark.skipif(
    not RECV_INTO, reason="pyzmq without Socket.recv_into"))], ids=["zero-copy", "recv_into"])
def test_faulty_mix64_peer_never_writes_bad_bytes(script, match, device, recv_into):
    desc = make_desc(num_layers=2, num_blocks=4)
    src = filled_caches(desc, 0)
    fake = FakePrefill(desc, src, script)
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    try:
        with DecodeEndpoint(dst, desc, peer_timeout_s=10, frame_ops=FRAME_OPS, recv_into=recv_into) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            handle = dec.pull("t", [2, 3], deadline_s=30)
            with pytest.raises(CorruptFrameError, match=match):
                handle.result(timeout=30)
            _sync(device)
            assert torch.equal(_b(dst[1]), _b(before[1]))          # the bad message's layer: untouched
            if script is _good_then_corrupt:   # the good message before it landed, or was verified with
                got = _b(dst[0])[[2, 3]]         # the bad one (one group) and left untouched with it
                assert torch.equal(got, _b(src[0])[[0, 1]].to(device)) or torch.equal(got, _b(before[0])[[2, 3]])
                assert torch.equal(_b(dst[0])[[0, 1]], _b(before[0])[[0, 1]])
            else:
                assert torch.equal(_b(dst[0]), _b(before[0]))
            assert until(lambda: MsgType.ABORT in fake.received, 3)
    finally:
        fake.close()


def test_bench_transfer_kernels_quick_runs(tmp_path):
    """``bench.transfer --kernels`` with the layer-wise measurement (the ``--cuda`` preset's paths) runs
    end to end and checks its bytes, at two message sizes (one row each, one-block messages: four
    messages of two layers x two blocks, gathered in one launch); ``--trace`` writes each row's
    last pull with both sides' spans."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "bench.transfer", "--quick", "--kernels", "--in-process",
                          "--layerwise-tokens", "32", "--layer-ms", "2", "--threads", "--trace", str(tmp_path),
                          "--chunk-mb", "0.001,1"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split("|")[1:7] for ln in out.stdout.splitlines() if "| mix64 |" in ln]
    want = [["2", "0.0", "0.001", "4", "4"], ["2", "0.0", "1", "1", "1"]] * 2    # blocks, MiB, chunk, msgs, burst msgs
    assert [[c.strip() for c in r[1:]] for r in rows] == want
    assert "ratio connector/pyzmq" in out.stdout
    assert "connector CPU ms/MiB by thread; decode process: " in out.stdout and "kvc-decode" in out.stdout
    stages = [ln for ln in out.stdout.splitlines() if "ms per pull by stage" in ln]
    assert len(stages) == 4 and all("decode: receive" in ln and "host_copy" in ln and "prefill: stage" in ln
                                    for ln in stages), stages
    assert all(("landed 4" in ln and "sent 4" in ln and "gathers 1" in ln) == (" 0.001 MiB messages" in ln)
               for ln in stages), stages
    for ln in stages:   # the landing thread's CPU time in its work on messages is at most its wall time
        ms = {k: float(v) for k, v in re.findall(r"(host_copy|launch|launch_cpu) ([0-9.]+)", ln.split("; prefill")[0])}
        assert 0 < ms["launch_cpu"] <= ms["host_copy"] + ms["launch"] + 0.05, ln
    assert re.search(r"^\| 0\.001 \| [0-9.]+ \| [0-9.]+ \|$", out.stdout, re.M)     # the layer-wise rows
    assert re.search(r"^\| 1 \| [0-9.]+ \| [0-9.]+ \|$", out.stdout, re.M)
    traced = re.findall(r"last pull traced: (\S+) \((\d+) spans\)", out.stdout)
    assert len(traced) == len(stages) and sorted(p for p, _ in traced) == sorted(map(str, tmp_path.iterdir()))
    for path, n in traced:
        events = [e for e in json.loads(open(path).read())["traceEvents"] if e["ph"] == "X"]
        assert len(events) == int(n) > 0
        names = {(e["pid"], e["name"]) for e in events}
        assert {(1, "stage"), (1, "send"), (2, "receive"), (2, "land"), (2, "device"), (2, "pull")} <= names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recv_into", [RECV_INTO, None], ids=["recv_into-if-pyzmq-has-it", "default"])
def test_multi_frame_multi_layer_mix64_message(device, recv_into):
    """A peer may split a message into frames anywhere on block boundaries, across layers: one
    3-layer message in 2 frames (the second starting inside layer 1) lands byte-exact. Left to
    its default, the endpoint receives into pinned buffers (``recv_into``) for CUDA caches where
    pyzmq can, and zero copy for CPU caches."""
    desc = make_desc(num_layers=3, num_blocks=4)
    src = filled_caches(desc, 0)

    def script(send, h, fake):
        send(fake.multi_blocks(h.tid, 0, 3, 0, 2, cut=3, sum=MIX64))

    fake = FakePrefill(desc, src, script)
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    want = RECV_INTO if recv_into is not None else RECV_INTO and device == "cuda"
    try:
        with DecodeEndpoint(dst, desc, frame_ops=FRAME_OPS, recv_into=recv_into) as dec:
            assert dec.recv_into is want
            dec.connect(fake.endpoint, timeout_s=5)
            dec.pull("t", [3, 1], deadline_s=30).result(timeout=30)
            _sync(device)
            for s, d in zip(src, dst):
                assert torch.equal(_b(d)[[3, 1]].cpu(), _b(s)[[0, 1]])
            assert dec.metrics.c["frames_received_into"] == (2 if want else 0)
    finally:
        fake.close()


def _ops(device):
    """The device kernels on CUDA; on CPU their plain-PyTorch twin (same contract, checked
    against the kernels below), so realistic message sizes run in seconds."""
    return FRAME_OPS if device == "cuda" else TORCH_FRAME_OPS


def test_slow_cpu_gather_does_not_read_as_a_dead_peer():
    """CPU caches: the prefill runs each message's gather + mix64 on its gather thread, not on its
    I/O thread, so a gather slower than the decode side's peer timeout (here 1.2 s of busy Python
    per gather, which holds the GIL between switches as Triton's interpreter does; the pull's four
    one-block messages in one gather) leaves the prefill answering heartbeats: the pull lands
    byte-exact, no ``peer silent``."""
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=2, block_size=4, num_layers=2,
                     num_blocks=10)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    gathers = []

    def slow_gather(*args, **kw):
        gathers.append(threading.current_thread().name)
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            pass
        return TORCH_FRAME_OPS.gather(*args, **kw)

    slow = SimpleNamespace(gather=slow_gather, verify_scatter=TORCH_FRAME_OPS.verify_scatter)
    src_ids, dst_ids = [9, 3], [2, 7]
    with PrefillEndpoint(src, desc, chunk_bytes=1, frame_ops=slow, heartbeat_s=0.1) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=TORCH_FRAME_OPS, heartbeat_s=0.1, peer_timeout_s=0.6) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        assert dec.checksum == MIX64
        pre.publish("r", src_ids)
        res = dec.pull("r", dst_ids, deadline_s=60).result(timeout=60)
        assert res.nbytes == desc.num_layers * len(src_ids) * desc.block_bytes
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
        assert not pre.errors and not dec.errors
    assert len(gathers) == 1 and gathers[0].startswith("kvc-frames"), gathers


def test_torch_frame_ops_match_the_kernels():
    """The CPU test double computes the kernels' payload, checksums and verify + scatter."""
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=4, num_layers=2, num_blocks=6)
    src, ids = filled_caches(desc, 0), torch.tensor([4, 1, 2], dtype=torch.int64)
    total = 2 * 3 * desc.block_bytes // 4 * 2          # heads (1, 3): half of each block
    outs, sums = [], []
    for ops in (FRAME_OPS, TORCH_FRAME_OPS):
        out, s = torch.empty(total, dtype=torch.uint8), torch.empty(2, dtype=torch.int64)
        ops.gather(src, ids, out=out, checksums=s, heads=(1, 3), frame_nbytes=[total // 3, total - total // 3])
        outs.append(out)
        sums.append(s)
    assert torch.equal(outs[0], outs[1]) and torch.equal(sums[0], sums[1])
    for bad in (False, True):
        staged = outs[0].clone()
        staged[5] ^= int(bad)
        dsts = []
        for ops in (FRAME_OPS, TORCH_FRAME_OPS):
            dst, ok = filled_caches(desc, 1), torch.empty(3, dtype=torch.int32)
            ops.verify_scatter(staged, sums[0], dst, ids, ok=ok, heads=(1, 3),
                               frame_nbytes=[total // 3, total - total // 3])
            assert ok.tolist() == ([0, 1, 1] if bad else [1, 1, 0])
            dsts.append(dst)
        for a, b in zip(*dsts):
            assert torch.equal(_b(a), _b(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recv_into,copy_threads", [(True, None), (False, 0), (False, 2)],
                         ids=["recv_into", "zero-copy-landing-thread-copies", "zero-copy-2-copy-workers"])
def test_many_mixed_size_messages_in_flight(device, recv_into, copy_threads):
    """A pull of more messages than the decode side's pinned pool keeps (each layer as two
    20-block messages of 0.66 MiB, the 40 blocks a layer split evenly under a 32-block chunk),
    all received while the I/O thread is held, so every buffer is handed back in one tick: every
    message lands, byte-exact, and the pull completes; both ways of filling the
    pinned buffers (``recv_into``, or zero-copy frames copied by the landing thread in ten pieces,
    or by two copy workers, half a message each)."""
    if recv_into and not RECV_INTO:
        pytest.skip("pyzmq without Socket.recv_into")
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 128, num_kv_heads=8, block_size=16, num_layers=8,
                     num_blocks=80)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    g = torch.Generator().manual_seed(2)
    src_ids, dst_ids = torch.randperm(80, generator=g)[:40].tolist(), torch.randperm(80, generator=g)[:40].tolist()
    with PrefillEndpoint(src, desc, chunk_bytes=32 * desc.block_bytes, frame_ops=_ops(device)) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=_ops(device), recv_into=recv_into, copy_threads=copy_threads) as dec:
        if not copy_threads:   # ten pieces per message, cut anywhere (not on blocks); with workers: one piece each
            dec._lander.piece_bytes = 100_003
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", src_ids)
        handle = dec.pull("t", dst_ids, deadline_s=30)
        dec._loop.call_soon(time.sleep, 1.0)      # the messages pile up in the socket meanwhile
        res = handle.result(timeout=60)
        _sync(device)
        assert res.nbytes == 8 * 40 * desc.block_bytes
        assert dec.metrics.c["blocks_messages"] == 16
        into, backlog = dec.metrics.c["frames_received_into"], dec.metrics.c["frames_received_zero_copy_backlog"]
        if recv_into:   # into pinned buffers while they hold less than RECV_BYTES: 16 MiB here, all of them
            assert into == 16 and backlog == 0
        else:
            assert into == backlog == 0
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
        assert not pre.errors and not dec.errors


@pytest.mark.skipif(not RECV_INTO, reason="pyzmq without Socket.recv_into")
def test_receive_backlog_holds_at_most_recv_bytes_of_pinned_buffers(monkeypatch):
    """With ``recv_into``, while the landing thread is held (a slow device, say) the I/O thread
    receives into pooled pinned buffers until they hold RECV_BYTES (here 8 MiB: eight 1 MiB
    buffers, the pool's smallest) and takes later messages zero copy, so a backlog never makes it
    allocate pinned memory message by message; once the landing thread goes on, every message
    lands byte-exact, the pool holds nothing and keeps its bound."""
    gate = threading.Event()
    monkeypatch.setattr(decode_mod, "RECV_BYTES", 8 << 20)
    into = 8
    n = into + 4
    desc = make_desc(num_layers=n, num_blocks=4)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=desc.block_bytes, frame_ops=TORCH_FRAME_OPS) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=TORCH_FRAME_OPS, recv_into=True) as dec:
        alive = dec._lander.alive
        dec._lander.alive = lambda job: gate.wait(30) and alive(job)   # takes nothing before the gate opens
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", [2, 0])
        handle = dec.pull("t", [1, 3], deadline_s=30)   # one message per layer and block: 2n messages
        c, t0 = dec.metrics.c, time.monotonic()
        try:
            while c["frames_received_into"] + c["frames_received_zero_copy_backlog"] < 2 * n \
                    and time.monotonic() - t0 < 20:
                time.sleep(0.01)
            assert c["frames_received_into"] == into
            assert c["frames_received_zero_copy_backlog"] == 2 * n - into == dec.stage_times()["backlog"]
            assert dec._pinned.outstanding == into and dec._pinned.outstanding_bytes == 8 << 20
        finally:
            gate.set()   # the landing thread goes on (also when an assertion failed: the endpoints close)
        res = handle.result(timeout=30)
        assert res.nbytes == n * 2 * desc.block_bytes
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[[1, 3]], _b(s)[[2, 0]])
        assert dec._pinned.outstanding == 0 and dec._pinned.free_bytes <= decode_mod.RECV_BYTES
        assert not pre.errors and not dec.errors


@pytest.mark.parametrize("device", DEVICES)
def test_failure_completing_a_device_write_fails_the_pull_now(device):
    """An exception while a finished device write is completed (handing its buffer back, reading
    its check) fails the pull with TransferError at once; the pull does not wait for its deadline."""
    desc = make_desc(num_layers=2, num_blocks=6)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    with PrefillEndpoint(src, desc, frame_ops=_ops(device)) as pre, DecodeEndpoint(dst, desc, frame_ops=_ops(device)) as dec:
        dec.connect(pre.endpoint, timeout_s=5)

        def broken(buf):
            raise RuntimeError("pool broken")
        dec._pinned.release = broken
        pre.publish("t", [4, 1])
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="pool broken"):
            dec.pull("t", [0, 3], deadline_s=30).result(timeout=40)
        assert time.monotonic() - t0 < 10


class _WatchedPool(PinnedPool):
    """A pinned pool that records, per buffer, when it is handed out and back."""

    def __init__(self, events):
        super().__init__()
        self.events, self.held, self.acquired, self.early = events, {}, [], []

    def acquire(self, nbytes):
        buf = super().acquire(nbytes)
        base = buf._base if buf._base is not None else buf
        assert base.data_ptr() not in self.held, "a buffer handed out twice"
        self.held[base.data_ptr()] = len(self.events)      # the event recorded after its use comes next
        self.acquired.append(base.data_ptr())
        return buf

    def release(self, buf):
        base = buf._base if buf._base is not None else buf
        ev = self.events[self.held.pop(base.data_ptr())]
        if not ev.query():
            self.early.append(base.data_ptr())             # handed back while the device may still read it
        super().release(buf)


def test_lander_reuses_a_pinned_buffer_only_after_its_device_copy(monkeypatch):
    """The landing thread keeps at most ``max_inflight`` messages on the device: with their events
    held (fake events on CPU), it launches two messages, then waits; releasing the first event lets
    exactly the third launch, into the first message's buffer. No buffer goes back to the pool
    before its event has passed, the I/O thread keeps receiving meanwhile, and the pull lands
    byte-exact (16 messages, real sockets, the plain-PyTorch kernels)."""
    monkeypatch.setattr(landing_mod, "WHOLE_BYTES", 0)   # pulls too large to stage whole: runs of messages
    events = []

    def record(stream):
        events.append(GatedEvent())
        return events[-1]
    monkeypatch.setattr(landing_mod, "_record", record)
    calls = []
    ops = SimpleNamespace(gather=TORCH_FRAME_OPS.gather,
                          verify_scatter=lambda *a, **k: (calls.append(1), TORCH_FRAME_OPS.verify_scatter(*a, **k)))
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=16, num_layers=4,
                     num_blocks=80)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=10 * desc.block_bytes, frame_ops=TORCH_FRAME_OPS) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=ops, copy_threads=0) as dec:
        pool = dec._pinned = dec._lander.pool = _WatchedPool(events)
        dec._lander.max_inflight = 2
        dec._lander.group_bytes = 0      # every message verified alone (one event each)
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", list(range(40)))
        handle = dec.pull("t", list(range(40, 80)), deadline_s=30)

        def state(what):
            return (what, len(calls), handle.done(), handle.error, dec.errors, pre.errors,
                    len(dec._lander._inflight), [e.query() for e in events])
        assert until(lambda: dec.metrics.c["blocks_messages"] == 16), state("the I/O thread received every message")
        assert until(lambda: len(calls) == 2), state("two messages launched")
        time.sleep(0.2)
        assert len(calls) == 2 and not handle.done()        # the third waits for a buffer's device copy
        events[0].gate.set()
        assert until(lambda: len(calls) == 3), state("the third launched once the first ended")
        assert pool.acquired[2] == pool.acquired[0]          # into the buffer the first one used
        while not handle.done():
            for ev in list(events):
                ev.gate.set()
            time.sleep(0.01)
        handle.result(timeout=30)
        assert len(calls) == 16 and not pool.early and not pool.held
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[40:], _b(s)[:40])


@pytest.mark.parametrize("bad", [False, True], ids=["match", "mismatch"])
def test_verdict_buffer_layout_with_the_kernels(bad):
    """The one buffer the CUDA landing path sends the header's checksums in and reads the verdict
    back from (``land_message``'s ``aux``: expected | computed | ok flags + bad count) is what the
    kernels write, and DeviceWrite reads it back: the bad frame is named, nothing is written."""
    desc = make_desc(num_layers=2, num_blocks=4)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    ids, total = torch.tensor([1, 2]), 2 * 2 * desc.block_bytes
    split = [total // 2, total - total // 2]
    payload, sums = torch.empty(total, dtype=torch.uint8), torch.empty(2, dtype=torch.int64)
    FRAME_OPS.gather(src, ids, out=payload, checksums=sums, frame_nbytes=split)
    aux = torch.full((aux_words(2) + 3,), -1, dtype=torch.int64)[:aux_words(2)]    # poisoned, and a view
    aux[:2] = sums
    payload[total // 2 + 5] ^= int(bad)
    FRAME_OPS.verify_scatter(payload, aux[:2], dst, ids, ok=_ok_view(aux, 2), checksums=aux[2:4], frame_nbytes=split)
    h = Header(MsgType.BLOCKS, tid="t", layer=0, sum=MIX64)
    h.nbytes, h.checksums = split, [int(v) & ((1 << 64) - 1) for v in sums]
    err = DeviceWrite(True, h, _ok_view(aux, 2), aux[2:4]).error()
    assert _ok_view(aux, 2).tolist() == ([1, 0, 1] if bad else [1, 1, 0])
    if bad:
        assert isinstance(err, CorruptFrameError) and "payload frame 1 checksum (mix64, verified on the GPU)" in str(err)
        assert all(torch.equal(_b(d), _b(b)) for d, b in zip(dst, before))
    else:
        assert err is None and all(torch.equal(_b(d)[[1, 2]], _b(s)[[1, 2]]) for d, s in zip(dst, src))


def test_transfer_floor_probe_splits_like_the_burst_and_lands_every_byte():
    """bench.transfer_floor_cuda: the plain kind's messages are bench.transfer's burst (whole blocks up to
    the chunk size), the pieces kinds cut the same bytes finer, and a CPU-destination run receives every
    kind end to end, checking the destination byte for byte each round (``landed``: verified and
    scattered by the connector's kernels, a corrupted layer failing with nothing written)."""
    import argparse
    from bench import transfer_floor_cuda as F
    assert F.burst_sizes(32 * 16 * 17408, 17408, 8 << 20) == [481 * 17408, 32 * 16 * 17408 - 481 * 17408]
    assert F.burst_sizes(1000, 4096, 8 << 20) == [1000]
    for total, piece in ((8912896, 1 << 20), (34 << 20, 2 << 20), (100, 1 << 20)):
        sizes = F.piece_sizes(total, piece)
        assert sum(sizes) == total and max(sizes) - min(sizes[:-1] or sizes) == 0
        assert abs(len(sizes) - total / piece) <= 1
    args = argparse.Namespace(chunk_mb=0.25, pieces=[0.1], landed=[0.2], rounds=2, device="cpu", layers=4)
    r = F.run_row(40 * 17408, 17408, args)
    assert r["msgs"] == {"plain": 3, "pinned": 3, "pageable": 3, "pinned-0.1": 7, "landed-0.2": 3}
    assert all(r[k] > 0 for k in ("plain", "pinned", "pageable", "pinned-0.1", "landed-0.2"))
    sent = torch.from_numpy(F.payload(8 * 17408))
    landing = F.Landing(sent, 17408, 4)   # a corrupted byte: typed failure, destination untouched
    staging = sent.clone()
    staging[5 * 17408 + 3] ^= 1
    with pytest.raises(RuntimeError, match="1 of 4 layers failed their checksum"):
        landing.land(staging)
    assert all(int(c.count_nonzero()) == 0 for c in landing.caches)


@pytest.mark.parametrize("device", DEVICES)
def test_small_messages_are_gathered_and_verified_in_groups(device, monkeypatch):
    """A pull of one message per block and layer (4 layers x 4 blocks: 16 messages), both sides'
    groups bounded at 6 messages' bytes: the prefill gathers them with 3 launches (6, 6 and 4
    messages, across layer boundaries, each message its own checksum), and the decode side, its
    landing thread held until every message has arrived, verifies them in as many passes; every
    block lands byte-exact."""
    monkeypatch.setattr(landing_mod, "WHOLE_BYTES", 0)   # pulls too large to stage whole: runs of messages
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=16, num_layers=4,
                     num_blocks=12)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    ops, gate, launches = _ops(device), threading.Event(), {"gather": [], "verify": []}

    def gather(caches, block_ids, *, checksums, **kw):
        launches["gather"].append(checksums.numel())
        ops.gather(caches, block_ids, checksums=checksums, **kw)

    def verify(staging, expected, caches, block_ids, **kw):
        launches["verify"].append(expected.numel())
        ops.verify_scatter(staging, expected, caches, block_ids, **kw)
    pre_ops = SimpleNamespace(gather=gather, warmup=lambda d: None)
    dec_ops = SimpleNamespace(verify_scatter=verify, warmup=lambda d: None)
    src_ids, dst_ids = [7, 2, 9, 0], [1, 11, 4, 6]
    monkeypatch.setattr(sender_mod, "GROUP_BYTES", 6 * desc.block_bytes)
    with PrefillEndpoint(src, desc, chunk_bytes=desc.block_bytes, frame_ops=pre_ops, prestage_bytes=0) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=dec_ops, lanes=1) as dec:   # one connection: messages in order
        dec._lander.max_inflight = 64     # no group cut short by the buffer bound
        dec._lander.group_bytes = 6 * desc.block_bytes
        alive = dec._lander.alive
        dec._lander.alive = lambda job: gate.wait(30) and alive(job)   # takes nothing before the gate opens
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", src_ids)
        handle = dec.pull("t", dst_ids, deadline_s=30)
        try:
            assert until(lambda: dec.metrics.c["blocks_messages"] == 16)
        finally:
            gate.set()
        handle.result(timeout=30)
        _sync(device)
        assert launches["gather"] == [6, 6, 4] and pre.stage_times()["sent"] == 16
        assert launches["verify"] == [6, 6, 4]
        assert dec.stage_times()["passes"] == 3 and dec.stage_times()["landed"] == 16
        for s, d in zip(src, dst):
            assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
        assert not pre.errors and not dec.errors


@pytest.mark.skipif(not RECV_INTO, reason="pyzmq without Socket.recv_into")
def test_many_small_messages_in_flight_reuse_pooled_buffers():
    """24 messages of one block held by the landing thread until all are in (24 buffers out at
    once on each side): the second such pull allocates no buffer on either side (the pools keep
    released buffers up to a byte bound, far above 24 small ones), and lands byte-exact."""
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=2, block_size=16, num_layers=6,
                     num_blocks=12)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=desc.block_bytes, frame_ops=TORCH_FRAME_OPS, prestage_bytes=0) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=TORCH_FRAME_OPS, recv_into=True) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        alive = dec._lander.alive
        allocs = []
        for r, (src_ids, dst_ids) in enumerate([([7, 2, 9, 0], [1, 11, 4, 6]), ([3, 8, 5, 10], [0, 2, 9, 7])]):
            gate = threading.Event()
            dec._lander.alive = lambda job, gate=gate: gate.wait(30) and alive(job)   # holds every message
            pre.publish(f"t{r}", src_ids)
            handle = dec.pull(f"t{r}", dst_ids, deadline_s=30)
            try:
                assert until(lambda: dec.metrics.c["frames_received_into"] == 24 * (r + 1))
                assert dec._pinned.outstanding == 24
            finally:
                gate.set()
            handle.result(timeout=30)
            for s, d in zip(src, dst):
                assert torch.equal(_b(d)[dst_ids], _b(s)[src_ids])
            allocs.append((pre._pool.allocations, dec._pinned.allocations))
        assert allocs[0][1] >= 24 and allocs[1] == allocs[0]
        assert not pre.errors and not dec.errors
