"""docs/PROTOCOL.md is enough to write a client: a client built from it alone pulls byte-exact.

The client below uses raw pyzmq + msgpack + xxhash and constants written here as the document
states them (message numbers, header keys, descriptor fields and values, the row-bytes
formula, the checksum); it imports nothing from ``kvconnector``. The message-number table and
the protocol version are read from the document itself, and every descriptor field the client
sends must appear in the document's descriptor table, so the test and the document cannot
drift apart. The live server is a real :class:`kvconnector.PrefillEndpoint`; each mode is
pulled, plus a head slice. A second test checks that the worked example in the document is
what ``python -m kvconnector.testing.wire_example`` prints now, and that the document's
history lists every ``PROTOCOL_HISTORY`` version.

Run: python -m pytest tests/test_protocol_doc.py
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash
import zmq

DOC = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
pytestmark = pytest.mark.timeout(120)

# ---- the client's table, from the document --------------------------------------------------
VERSION = int(re.search(r"^# kvconnector wire protocol \(version (\d+)\)", DOC, re.M).group(1))
T = {name: int(num) for name, num in re.findall(r"^\| ([A-Z_]+) \| (\d+) \|", DOC, re.M)}
# "Descriptor map" table: values per quant_mode, as the document lists them
STORAGE = {0: None, 1: "float8_e4m3fn", 2: "int8", 3: "float8_e4m3fn", 4: "uint8"}   # None: same as model_dtype
ITEMSIZE = {"bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}


def doc_descriptor(mode, head_size, *, model_dtype="bfloat16", block_size, num_layers, total_heads,
                   head_start, num_heads, num_blocks):
    """The ``desc`` map exactly as the document's table says a sender fills it."""
    scaled, int4 = mode in (2, 3, 4), mode == 4
    return {
        "format_version": 1, "quant_mode": mode, "model_dtype": model_dtype,
        "storage_dtype": STORAGE[mode] or model_dtype, "head_size": head_size,
        "data_head_size": head_size // 2 if int4 else head_size, "scale_pad": 4 if scaled else 0,
        "scale_dtype": "float32" if scaled else "none", "scale_position": "row_tail" if scaled else "none",
        "zero_point": "scale_low4_bits" if int4 else "none", "rotation": "hadamard_signed" if int4 else "none",
        "sign_seed": 2654435769 if int4 else 0, "nibble_order": "even_low" if int4 else "none",
        "byte_order": "little", "block_size": block_size, "num_layers": num_layers,
        "total_num_kv_heads": total_heads, "head_start": head_start, "num_kv_heads": num_heads,
        "num_blocks": num_blocks,
    }


def row_bytes(d: dict) -> int:
    """``P = data_head_size * itemsize + scale_pad`` (document, "Descriptor map")."""
    return d["data_head_size"] * ITEMSIZE[d["storage_dtype"]] + d["scale_pad"]


def header(name, **keys) -> bytes:
    return msgpack.packb({"v": VERSION, "t": T[name], "seq": 0, **keys}, use_bin_type=True)


def doc_client_pull(endpoint, desc, tid, nblk, heads, timeout_s=10.0, lanes=1, on_lanes=None):
    """HELLO, PULL, verify every BLOCKS message, ACK; return {(layer, position): block bytes}.
    ``lanes`` > 1: offer that many connections ("Lanes") and take BLOCKS on every one granted;
    ``on_lanes`` (a list) then gets one entry per BLOCKS message that came on an extra connection."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    socks = [sock]
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        sock.connect(endpoint)

        def recv():
            ready = dict(poller.poll(int(timeout_s * 1000)))
            assert ready, "no reply"
            s = next(s for s in socks if s in ready)
            frames = s.recv_multipart()
            if s is not sock and on_lanes is not None:
                on_lanes.append(1)
            return msgpack.unpackb(frames[0], raw=False), frames[1:]

        sock.send(header("HELLO", desc=desc, **({"lanes": lanes} if lanes > 1 else {})))
        ack, _ = recv()
        assert ack["t"] == T["HELLO_ACK"] and ack["ok"] is True, ack
        for k in range(1, ack.get("lanes", 1)):
            lane = ctx.socket(zmq.DEALER)
            lane.setsockopt(zmq.LINGER, 0)
            lane.connect(endpoint)
            lane.send(header("LANE", peer=ack["peer"], lanes=k))
            socks.append(lane)
            poller.register(lane, zmq.POLLIN)
        time.sleep(0.1)   # the LANEs reach the prefill before the PULL (else BLOCKS keep to the first connection)
        sock.send(header("PULL", tid=tid, nblk=nblk, heads=list(heads)))
        h = heads[1] - heads[0]
        per_block = 2 * desc["block_size"] * h * row_bytes(desc)
        got = {}
        while len(got) < desc["num_layers"] * nblk:
            m, payload = recv()
            assert m["t"] == T["BLOCKS"], m
            assert m["tid"] == tid and m["heads"] == list(heads)
            assert len(payload) == len(m["nbytes"]) == len(m["xxh"])
            placement = [m["tid"], m["layer"], m["nlay"], m["first"], m["nblk"], m["heads"], m["nbytes"], m["xxh"],
                         m.get("sum", ""), m.get("at")]   # "Placement checksum"
            assert xxhash.xxh3_64_intdigest(msgpack.packb(placement, use_bin_type=True)) == m["hxx"], "hxx"
            for f, n, x in zip(payload, m["nbytes"], m["xxh"]):
                assert len(f) == n and n % per_block == 0
                assert xxhash.xxh3_64_intdigest(f) == x, "checksum"   # XXH3-64, seed 0, unsigned
            blob = b"".join(payload)
            assert len(blob) == m["nlay"] * m["nblk"] * per_block
            for li in range(m["nlay"]):                    # layer-major
                for k in range(m["nblk"]):
                    off = (li * m["nblk"] + k) * per_block
                    got[(m["layer"] + li, m["first"] + k)] = blob[off:off + per_block]
        sock.send(header("ACK", tid=tid, ok=True))
        return got
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def test_document_states_what_the_client_needs():
    assert set(T) >= {"HELLO", "HELLO_ACK", "PULL", "BLOCKS", "ACK", "ABORT", "ERROR", "PING", "PONG"}, T
    assert len(set(T.values())) == len(T), f"two messages share a number: {T}"
    table = DOC[DOC.index("## Descriptor map"):DOC.index("## A pull, step by step")]
    for mode in (0, 1, 2, 3, 4):
        d = doc_descriptor(mode, 64, block_size=4, num_layers=1, total_heads=1, head_start=0, num_heads=1,
                           num_blocks=1)
        for key, value in d.items():
            assert f"| `{key}` |" in table, key
            if isinstance(value, str):
                assert f"'{value}'" in table, (key, value)
    assert "seed 0" in DOC and "XXH3 64-bit" in DOC and "unsigned" in DOC


# (quant_mode, head_size, model dtype, prefill heads, client heads [start, count])
CASES = {
    "bf16": (0, 64, "bfloat16", 2, (0, 2)),
    "fp16": (0, 32, "float16", 2, (0, 2)),
    "fp8-per-tensor": (1, 64, "bfloat16", 2, (0, 2)),
    "int8": (2, 64, "bfloat16", 2, (0, 2)),
    "fp8": (3, 64, "bfloat16", 2, (0, 2)),
    "int4": (4, 64, "bfloat16", 2, (0, 2)),
    "int4-head-slice": (4, 32, "bfloat16", 4, (1, 2)),
}


@pytest.mark.parametrize("chunk", [600, 1 << 20], ids=["one-block-messages", "layers-packed"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_client_from_the_document_pulls_byte_exact(case, chunk):
    from kvconnector import PrefillEndpoint          # the live server only; the client is above
    from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor

    mode, head_size, dtype, pre_heads, (lo, n) = CASES[case]
    geo = CacheGeometry(KVQuantMode(mode), head_size, pre_heads, 4, getattr(torch, dtype))
    pre_desc = LayoutDescriptor.from_geometry(geo, num_layers=3, num_blocks=10)
    g = torch.Generator().manual_seed(mode)
    src = []
    for _ in range(3):
        c = geo.new_cache(10)
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        src.append(c)
    src_ids = [7, 2, 3, 9, 0]
    released = []
    with PrefillEndpoint(src, pre_desc, chunk_bytes=chunk,
                         on_release=lambda t, ids, why: released.append((t, why))) as pre:
        pre.publish("t", src_ids)
        desc = doc_descriptor(mode, head_size, model_dtype=dtype, block_size=4, num_layers=3,
                              total_heads=pre_heads, head_start=lo, num_heads=n, num_blocks=6)
        got = doc_client_pull(pre.endpoint, desc, "t", len(src_ids), (lo, lo + n))
        for layer in range(3):
            for pos, b in enumerate(src_ids):
                want = src[layer].view(torch.uint8)[b][:, :, lo:lo + n].contiguous().numpy().tobytes()
                assert got[(layer, pos)] == want, f"layer {layer} position {pos}"
        end = time.monotonic() + 5
        while not released and time.monotonic() < end:
            time.sleep(0.01)
        assert released == [("t", "acked")]


def test_worked_example_and_history_are_current():
    from kvconnector.protocol import PROTOCOL_HISTORY, PROTOCOL_VERSION
    from kvconnector.testing.wire_example import run_example

    assert VERSION == PROTOCOL_VERSION
    assert run_example() in DOC, "regenerate: python -m kvconnector.testing.wire_example"
    for v in PROTOCOL_HISTORY:
        assert re.search(rf"^- \*\*{v}\*\* — ", DOC, re.M), f"docs/PROTOCOL.md history lacks version {v}"


def test_client_from_the_document_pulls_over_lanes():
    """The same client offering 3 lanes: the prefill grants them, deals the BLOCKS over the three
    connections and every block still arrives byte exact."""
    from kvconnector import PrefillEndpoint
    from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor

    geo = CacheGeometry(KVQuantMode(4), 64, 2, 4, torch.bfloat16)
    pre_desc = LayoutDescriptor.from_geometry(geo, num_layers=3, num_blocks=10)
    g = torch.Generator().manual_seed(4)
    src = [geo.new_cache(10) for _ in range(3)]
    for c in src:
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    src_ids = [7, 2, 3, 9, 0]
    on_lanes = []
    with PrefillEndpoint(src, pre_desc, chunk_bytes=600, lanes=4) as pre:
        pre.publish("t", src_ids)
        desc = doc_descriptor(4, 64, block_size=4, num_layers=3, total_heads=2, head_start=0, num_heads=2,
                              num_blocks=6)
        got = doc_client_pull(pre.endpoint, desc, "t", len(src_ids), (0, 2), lanes=3, on_lanes=on_lanes)
        for layer in range(3):
            for pos, b in enumerate(src_ids):
                assert got[(layer, pos)] == src[layer].view(torch.uint8)[b].numpy().tobytes()
    assert len(on_lanes) == 10   # 15 BLOCKS (one per layer and block), 2 of every 3 on the lanes
