"""Smoke test of ``kvconnector serve``: a prefill endpoint in its own process, pulled from here.

Starts the command on a random loopback port over a seeded synthetic INT4 cache, reads the
endpoint, descriptor and transfer plan from its first output line, pulls every published
transfer into a decode cache and compares every byte (scale tails included) with the
source rebuilt from the same seed; then closes the server's stdin and checks that it
reports both transfers acknowledged and exits 0. Also: a bad argument exits 2.

Run: python -m pytest tests/test_serve.py -q
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvconnector import DecodeEndpoint
from layouts import LayoutDescriptor
from tools.serve import plan_transfers, synthetic_caches

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
        src = synthetic_caches(desc, info["seed"])
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
