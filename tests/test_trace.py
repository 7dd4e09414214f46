"""Per-message spans of the endpoints' threads (``kvconnector.trace``), on a real pull.

Covers: with tracing on at both ends of a ``mix64`` pull (the device path's threads, here with
the plain-PyTorch frame ops on CPU caches), every message has its prefill spans (stage,
copy_wait, send) and its decode spans (receive, land_start, land, the verify pass that covered
it, device) in causal order on the shared clock, and the pull one span of its bytes; the Chrome
trace file holds every span with its thread named; tracing off records nothing; the trace keeps only the newest spans.

Run: python -m pytest tests/test_trace.py -q
"""

import json

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.testing.frame_ops import TORCH_FRAME_OPS
from kvconnector.trace import Trace, write_chrome
from layouts import KVQuantMode

pytestmark = pytest.mark.timeout(120)


def _by(spans, name):
    """{(tid, seq): (t0, t1)} of the spans called ``name``."""
    return {(a.get("tid"), a.get("seq")): (t0, t1) for n, _, t0, t1, a in spans if n == name}


def test_a_traced_pull_has_every_message_in_causal_order(tmp_path):
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=4, block_size=16, num_layers=3,
                     num_blocks=12)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, chunk_bytes=2 * desc.block_bytes, frame_ops=TORCH_FRAME_OPS) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=TORCH_FRAME_OPS, recv_into=True) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", [5, 0, 7, 2])
        pre.trace.enabled = dec.trace.enabled = True
        res = dec.pull("t", [1, 3, 8, 11], deadline_s=30).result(timeout=30)
        n = dec.metrics.c["blocks_messages"]
        pre.trace.enabled = dec.trace.enabled = False
        sent, got = pre.trace.take(), dec.trace.take()
        assert n == 6      # 3 layers x 2 chunks of 2 blocks

        pre.publish("t2", [5, 0, 7, 2])
        dec.pull("t2", [1, 3, 8, 11], deadline_s=30).result(timeout=30)   # tracing off: nothing recorded
        assert pre.trace.take() == [] and dec.trace.take() == []

    for s, d in zip(src, dst):
        assert torch.equal(d.view(torch.uint8)[[1, 3, 8, 11]], s.view(torch.uint8)[[5, 0, 7, 2]])
    keys = {("t", seq) for seq in range(n)}
    stage, wait, send = _by(sent, "stage"), _by(sent, "copy_wait"), _by(sent, "send")
    start, land, device = _by(got, "land_start"), _by(got, "land"), _by(got, "device")
    verify = {(a["tid"], a["seq"]): (t0, t1, a["messages"]) for name, _, t0, t1, a in got if name == "verify"}
    for spans in (stage, wait, send, start, land, device):
        assert set(spans) == keys
    assert set(verify) <= keys and sum(m for _, _, m in verify.values()) == n    # one span per verify pass
    for k in keys:
        assert stage[k][1] <= wait[k][0] <= wait[k][1] <= send[k][0] <= send[k][1]
        assert send[k][0] <= start[k][0] <= start[k][1] <= land[k][0] <= land[k][1] <= device[k][0] <= device[k][1]
        first = max(v for v in verify if v[1] <= k[1])     # the pass that covered message k
        assert land[k][1] <= verify[first][0] <= verify[first][1] <= device[k][0]
    payload = [a["bytes"] for name, _, _, _, a in got if name == "receive" and a["bytes"]]
    assert len(payload) == n and sum(payload) == res.nbytes == sum(a["bytes"] for _, _, _, _, a in
                                                                     (s for s in sent if s[0] == "copy_wait"))
    (pull,) = [s for s in got if s[0] == "pull"]
    assert pull[4] == {"tid": "t", "bytes": res.nbytes} and pull[2] <= min(t0 for _, t0 in stage.values())
    assert max(t1 for _, t1 in device.values()) <= pull[3]

    path = tmp_path / "trace.json"
    assert write_chrome(str(path), [("prefill", sent), ("decode", got)]) == len(sent) + len(got)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(sent) + len(got)
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"kvc-decode", "kvc-decode-land", "kvc-decode-land-wait"} <= threads
    assert any(t.startswith("kvc-prefill") for t in threads)


def test_trace_keeps_the_newest_spans():
    tr = Trace(max_spans=3)
    tr.span("off", 0.0, 1.0)
    tr.enabled = True
    for i in range(5):
        tr.span("x", i, i + 1, seq=i)
    assert [a["seq"] for _, _, _, _, a in tr.take()] == [2, 3, 4]
    assert tr.take() == []
