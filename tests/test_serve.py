"""``kvconnector serve``: a prefill endpoint in its own process, pulled from here.

Starts the command on a random loopback port over a seeded synthetic INT4 cache (Gaussian
K/V written by the write kernel), reads the endpoint, descriptor and transfer plan from its
first output line, pulls every published transfer into a decode cache and compares every byte
(scale tails included) with the source rebuilt from the same seed; then closes the server's
stdin and checks that it reports both transfers acknowledged and exits 0. Also: a bad
argument exits 2; ``dump --endpoint`` / ``inspect --endpoint`` need no layout flags (DESCRIBE)
and the pulled blocks pass ``verify --strict``; ``--from-dump`` serves a dump's blocks; the
``--metrics-port`` page, scraped over HTTP after a pull, shows the counters moved.

Run: python -m pytest tests/test_serve.py -q
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvconnector import DecodeEndpoint
from layouts import LayoutDescriptor
from tools.serve import plan_transfers
from tools.synthetic_cache import written_caches

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(*args):
    return subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_serve_then_pull_every_byte():
    proc = _serve("--mode", "int4_per_token_head", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
                  "--num-blocks", "16", "--transfers", "2", "--blocks-per-transfer", "5", "--seed", "3",
                  "--until-stdin-eof")
    try:
        info = json.loads(proc.stdout.readline())
        desc = LayoutDescriptor.from_dict(info["desc"])
        assert info["endpoint"].startswith("tcp://127.0.0.1:")
        assert info["transfers"] == plan_transfers(16, 2, 5, 3)
        assert info["writer"] == "triton" and "Triton write kernel" in info["cache"]
        src = written_caches(desc, info["seed"], writer=info["writer"])
        dst = [torch.zeros_like(c) for c in src]
        dst_ids = {"t0": [0, 1, 2, 3, 4], "t1": [15, 9, 8, 7, 10]}
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(info["endpoint"], timeout_s=20)
            for tid, ids in dst_ids.items():
                dec.pull(tid, ids, deadline_s=20).result(timeout=30)
        for s, d in zip(src, dst):
            for tid, ids in dst_ids.items():
                for si, di in zip(info["transfers"][tid], ids):
                    assert torch.equal(d.view(torch.uint8)[di], s.view(torch.uint8)[si]), (tid, si, di)
        out, err = proc.communicate("", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    final = json.loads(out.strip().splitlines()[-1])
    assert final["transfers_completed"] == 2
    assert sorted(map(tuple, final["released"])) == [("t0", "acked"), ("t1", "acked")]


def test_serve_rejects_bad_plan():
    proc = _serve("--num-blocks", "4", "--blocks-per-transfer", "9", "--layers", "1", "--duration-s", "1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--blocks-per-transfer" in err


def _start(*args):
    proc = _serve(*args, "--until-stdin-eof")
    return proc, json.loads(proc.stdout.readline())


def _stop(proc):
    try:
        out, err = proc.communicate("", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tools.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


SMALL = ("--layers", "2", "--kv-heads", "2", "--head-size", "64", "--num-blocks", "8", "--blocks-per-transfer", "3")


def test_dump_and_inspect_endpoint_need_no_layout_flags(tmp_path):
    """DESCRIBE gives the layout; the pulled kernel-written blocks are sane (verify --strict)."""
    proc, info = _start(*SMALL, "--transfers", "2", "--seed", "5")
    try:
        r = _cli("dump", "--endpoint", info["endpoint"], "--transfer-id", "t1", "-o", tmp_path / "t1.kvd")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert f"fingerprint {LayoutDescriptor.from_dict(info['desc']).with_(num_blocks=3).fingerprint()}" in r.stdout
        r = _cli("verify", tmp_path / "t1.kvd", "--strict")
        assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
        r = _cli("inspect", "--endpoint", info["endpoint"], "--transfer-id", "t0", "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["mode"] == "INT4_PER_TOKEN_HEAD" and st["layers"] == [0, 1] and st["block_ids"] == [0, 1, 2]
        assert st["layout"] == {**info["desc"], "num_blocks": 3}
        # two transfers published, one already pulled: naming none is refused in one line
        r = _cli("dump", "--endpoint", info["endpoint"], "-o", tmp_path / "x.kvd")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        # an explicit layout override that differs is refused by the handshake (both ends check)
        proc2, info2 = _start(*SMALL, "--seed", "6")
        try:
            r = _cli("dump", "--endpoint", info2["endpoint"], "--kv-cache-dtype", "int8_per_token_head",
                     "-o", tmp_path / "y.kvd")
            assert r.returncode == 1 and "quant_mode" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        finally:
            _stop(proc2)
    finally:
        _stop(proc)


def test_from_dump_serves_the_dumped_blocks(tmp_path):
    proc, info = _start(*SMALL, "--seed", "7")
    try:
        assert _cli("dump", "--endpoint", info["endpoint"], "-o", tmp_path / "a.kvd").returncode == 0
    finally:
        _stop(proc)
    proc, info2 = _start("--from-dump", tmp_path / "a.kvd")
    try:
        assert info2["transfers"] == {"t0": [0, 1, 2]} and "dump" in info2["cache"]
        assert _cli("dump", "--endpoint", info2["endpoint"], "-o", tmp_path / "b.kvd").returncode == 0
    finally:
        _stop(proc)
    from tools.load_dump import load_dump
    (da, ca), (db, cb) = load_dump(tmp_path / "a.kvd"), load_dump(tmp_path / "b.kvd")
    assert da == db and all(torch.equal(ca[i], cb[i]) for i in ca)


@pytest.mark.skipif(not __import__("kvconnector.metrics", fromlist=["x"]).prometheus_available(),
                    reason="prometheus-client not installed (the 'metrics' extra)")
def test_metrics_port_counters_move_after_a_pull():
    import urllib.request

    proc, info = _start(*SMALL, "--transfers", "2", "--metrics-port", "0")
    try:
        url = info["metrics"]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0/metrics")

        def scrape() -> dict:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                    if ln.startswith("kvconnector_")}
        before = scrape()
        desc = LayoutDescriptor.from_dict(info["desc"])
        src = written_caches(desc, info["seed"], writer=info["writer"])
        dst = [torch.zeros_like(c) for c in src]
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(info["endpoint"], timeout_s=20)
            res = dec.pull("t0", [0, 1, 2], deadline_s=20).result(timeout=30)
            stats = dec.stats()
        # the decode side's stats() uses the same names
        assert stats["pulls_total"] == {"ok": 1} and stats["blocks_total"] == 3 * 2
        assert stats["bytes_total"]["received"] == res.nbytes
        # a mismatched decode layout: the prefill side counts the refusal by field
        bad = desc.with_(block_size=8, num_blocks=16)
        with DecodeEndpoint([torch.zeros(bad.geometry().shape(16), dtype=torch.uint8) for _ in range(2)], bad) as dec:
            with pytest.raises(Exception, match="block_size"):
                dec.connect(info["endpoint"], timeout_s=20)
        after, give_up = scrape(), time.monotonic() + 10.0
        while after.get('kvconnector_pulls_total{outcome="ok",role="prefill"}', 0) < 1 and time.monotonic() < give_up:
            time.sleep(0.05)          # the ACK reaches the prefill side asynchronously
            after = scrape()
        sent = 'kvconnector_bytes_total{direction="sent",role="prefill"}'
        assert after[sent] - before.get(sent, 0) == res.nbytes
        assert after['kvconnector_blocks_total{role="prefill"}'] == 6
        assert after['kvconnector_pulls_total{outcome="ok",role="prefill"}'] == 1
        assert after['kvconnector_transfer_seconds_count{role="prefill"}'] == 1
        assert after['kvconnector_handshake_refusals_total{field="block_size",role="prefill"}'] == 1
    finally:
        out = _stop(proc)
    assert json.loads(out.strip().splitlines()[-1])["pulls_total"] == {"ok": 1}


def test_port_given_or_any_is_the_port_printed():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc, info = _start("--fill", "random", "--layers", "1", "--num-blocks", "4", "--blocks-per-transfer", "2",
                        "--port", str(port))
    try:
        assert info["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        _stop(proc)
    proc, info = _start("--fill", "random", "--layers", "1", "--num-blocks", "4", "--blocks-per-transfer", "2")
    try:
        assert 0 < int(info["endpoint"].rsplit(":", 1)[1]) <= 65535 and info["cache"] == "synthetic: random bytes"
    finally:
        _stop(proc)
