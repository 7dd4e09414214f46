"""Cross-process connector tests: prefill and decode in separate spawned processes on random
loopback ports, with hard timeouts.

Covers a byte-exact INT4 transfer across processes, a prefill process killed mid-transfer
(the decode waiter gets TransferTimeoutError within its deadline), a decode process killed
mid-transfer (the prefill lease is released by expiry), and the bench-transfer --quick smoke run.

Run: python -m pytest tests/test_connector_procs.py -q
"""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import Header, MsgType, decode_header, encode_header
from layouts import TransferTimeoutError

pytestmark = pytest.mark.timeout(90)
CTX = mp.get_context("spawn")


def _prefill_proc(q, stop, num_blocks, chunk_bytes, publish):
    from connector_fakes import filled_caches, make_desc
    from kvconnector import PrefillEndpoint
    desc = make_desc(num_layers=4, num_blocks=num_blocks, head_size=64, num_kv_heads=4, block_size=16)
    with PrefillEndpoint(filled_caches(desc, 7), desc, chunk_bytes=chunk_bytes) as pre:
        pre.publish("x", publish)
        q.put(pre.endpoint)
        stop.wait(60)


def test_cross_process_byte_exact():
    q, stop = CTX.Queue(), CTX.Event()
    p = CTX.Process(target=_prefill_proc, args=(q, stop, 32, 1 << 20, [31, 0, 5, 6, 7]), daemon=True)
    p.start()
    try:
        endpoint = q.get(timeout=60)
        desc = make_desc(num_layers=4, num_blocks=32, head_size=64, num_kv_heads=4, block_size=16)
        src, dst = filled_caches(desc, 7), filled_caches(desc, 8)   # same seed: the prefill's bytes
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(endpoint, timeout_s=10)
            dec.pull("x", [1, 2, 3, 4, 30], deadline_s=20).result()
        for s, d in zip(src, dst):
            for si, di in zip([31, 0, 5, 6, 7], [1, 2, 3, 4, 30]):
                assert torch.equal(d.view(torch.uint8)[di], s.view(torch.uint8)[si])
    finally:
        stop.set()
        p.join(10)


def test_prefill_killed_mid_transfer_times_out_within_deadline():
    q, stop = CTX.Queue(), CTX.Event()
    # a big transfer in 1-block messages so the kill lands mid-stream
    p = CTX.Process(target=_prefill_proc, args=(q, stop, 512, 1, list(range(512))), daemon=True)
    p.start()
    endpoint = q.get(timeout=60)
    desc = make_desc(num_layers=4, num_blocks=512, head_size=64, num_kv_heads=4, block_size=16)
    dst = filled_caches(desc, 8)
    with DecodeEndpoint(dst, desc, peer_timeout_s=30) as dec:
        dec.connect(endpoint, timeout_s=10)
        killed = []
        h = dec.pull("x", list(range(512)), deadline_s=2.0,
                     on_layer=lambda t, layer: killed or (os.kill(p.pid, signal.SIGKILL), killed.append(1)))
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            h.result(timeout=10)
        assert killed, "the prefill process was not killed mid-transfer"
        assert time.monotonic() - t0 < 3.0          # deadline 2 s plus scheduling slack
        assert 0 < len(h.failed_block_ids) and set(h.failed_block_ids) <= set(range(512))
    p.join(10)


def _dying_decode(endpoint, desc_kw, ready, go):
    """Handshake, PULL, read one BLOCKS message, then die without ACK."""
    from connector_fakes import make_desc
    desc = make_desc(**desc_kw)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send(encode_header(Header(MsgType.HELLO, desc=desc.to_dict())))
    assert decode_header(s.recv_multipart()[0]).ok
    ready.set()
    go.wait(30)
    s.send(encode_header(Header(MsgType.PULL, tid="x", nblk=desc.num_blocks, heads=(0, desc.num_kv_heads))))
    while s.poll(10000):
        t = decode_header(s.recv_multipart()[0]).type
        if t == MsgType.BLOCKS:
            break
        if t == MsgType.ERROR:
            os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def test_decode_killed_mid_transfer_lease_released():
    kw = dict(num_layers=4, num_blocks=256, head_size=64, num_kv_heads=4, block_size=16)
    desc = make_desc(**kw)
    released = []
    with PrefillEndpoint(filled_caches(desc, 0), desc, chunk_bytes=1, peer_timeout_s=1.0,
                         on_release=lambda *a: released.append((a[0], a[2], time.monotonic()))) as pre:
        ready, go = CTX.Event(), CTX.Event()
        p = CTX.Process(target=_dying_decode, args=(pre.endpoint, kw, ready, go), daemon=True)
        p.start()
        assert ready.wait(60)
        pre.publish("x", list(range(256)), lease_s=1.5)
        go.set()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r[:2] for r in released] == [("x", "expired")]
        assert pre.held() == [] and pre.stats()["streams"] == 0


def test_bench_transfer_quick_runs():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench-transfer", "--quick"], capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert "| int4_per_token_head | 16 |" in out.stdout and "ratio connector/pyzmq" in out.stdout


def test_bench_transfer_preset_keeps_the_shape_given():
    """A preset (``--quick``, like ``--cuda``) fills only the shape options the command line left
    out: ``--modes`` and ``--layers`` given are the rows measured."""
    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench-transfer", "--quick", "--modes",
                          "int4_per_token_head", "--layers", "3"], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| auto |", "| int", "| fp8"))]
    assert rows and all(r.startswith("| int4_per_token_head |") for r in rows), out.stdout
    assert "layers=3 kv_heads=2 head_size=64" in out.stdout


def test_bench_transfer_times_the_burst_from_its_own_request(monkeypatch):
    """The pyzmq ceiling excludes the benchmark's bookkeeping between a pull and the burst (the
    sender's CPU-time and thread reads): with each of those taking 0.25 s, the burst of a few KiB
    still measures far less, and the connector's own time is unaffected by the reads after it."""
    import bench.transfer as bt
    from layouts import CacheGeometry, KVQuantMode
    sender = bt.Sender(in_process=True)
    slow = 0.25
    real_cpu, real_threads = sender.cpu_s, sender.threads
    monkeypatch.setattr(sender, "cpu_s", lambda: (time.sleep(slow), real_cpu())[1])
    monkeypatch.setattr(sender, "threads", lambda: (time.sleep(slow), real_threads())[1])
    try:
        geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 64, 2, 16)
        r = bt.bench_row(sender, geo, 2, 4, 2, 1 << 20, False, "cpu", torch.Generator().manual_seed(0),
                         threads=True)
    finally:
        sender.close()
    assert r["zmq"] < slow / 2 and r["hot"] < slow / 2 and r["conn"] < slow, r
    assert r["nbytes"] == 2 * 4 * geo.block_bytes


def test_bench_transfer_burst_message_size_is_its_own():
    """``burst_bytes`` sets the bursts' message size apart from the connector's: one 1 MiB-chunk
    pull of 2 x 4 INT4 blocks is one connector message, and the burst of the same bytes in
    one-block messages is eight."""
    import bench.transfer as bt
    from layouts import CacheGeometry, KVQuantMode
    sender = bt.Sender(in_process=True)
    geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 64, 2, 16)
    try:
        gen = torch.Generator().manual_seed(0)
        same = bt.bench_row(sender, geo, 2, 4, 1, 1 << 20, False, "cpu", gen)
        small = bt.bench_row(sender, geo, 2, 4, 1, 1 << 20, False, "cpu", gen, burst_bytes=geo.block_bytes)
    finally:
        sender.close()
    assert (same["messages"], same["burst_messages"]) == (1, 1)
    assert (small["messages"], small["burst_messages"]) == (1, 8)


@pytest.mark.parametrize("order", [[], ["--contiguous"]])
def test_probe_transfer_floor_moves_the_bytes(order):
    # two layers, 70 INT4-sized blocks: two messages per layer at 1 MiB (60 + 10 blocks); the probe
    # itself raises unless every destination row of each checksummed transfer equals its source row
    out = subprocess.run([sys.executable, "-m", "bench.transfer_floor", "--layers", "2", "--blocks", "4,70",
                          "--block-kib", "17", "--chunk-mib", "1", "--rounds", "2", *order], capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 17 KiB")]
    assert [r.split("|")[2:5] for r in rows] == [[" 4 ", " 0.1 ", " 2 "], [" 70 ", " 2.3 ", " 4 "]]
    assert "floor / plain: median" in out.stdout
