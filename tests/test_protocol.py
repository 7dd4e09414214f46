"""Wire protocol codecs and block gather/scatter (no sockets).

Covers header encode/decode round trips, every validation path (each error names the field,
expected vs got), payload verification (truncated, oversized, checksum, frame count), and
byte-exact gather/scatter of whole blocks and head slices for every cache mode.

Run: python -m pytest tests/test_protocol.py -q
"""

import dataclasses

import msgpack
import pytest
import torch

from kvconnector.blocks import gather_blocks, runs, scatter_blocks, slice_bytes
from kvconnector.protocol import (MAX_HEADER_BYTES, PROTOCOL_HISTORY, PROTOCOL_VERSION, ErrorCode, Header,
                                  MsgType, checksum, decode_header, encode_header, encode_message,
                                  payload_cells, placement_checksum, verify_payloads)
from layouts import CacheGeometry, CorruptFrameError, KVQuantMode, LayoutError, ProtocolVersionError

pytestmark = pytest.mark.timeout(60)

MODES = [KVQuantMode.NONE, KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD,
         KVQuantMode.INT4_PER_TOKEN_HEAD]
MODE_IDS = ["bf16", "int8", "fp8", "int4"]


def test_version_has_history():
    assert PROTOCOL_VERSION in PROTOCOL_HISTORY


@pytest.mark.parametrize("h", [
    Header(MsgType.HELLO, desc={"a": 1}),
    Header(MsgType.HELLO_ACK, desc={"a": 1}, ok=False, msg="no", diffs=[["head_size", 64, 128]]),
    Header(MsgType.PULL, seq=3, tid="req-1", nblk=5, heads=(2, 4)),
    Header(MsgType.ACK, tid="t", ok=True),
    Header(MsgType.ABORT, tid="t", code="deadline"),
    Header(MsgType.ERROR, tid="t", code=ErrorCode.UNKNOWN_TRANSFER, msg="gone"),
    Header(MsgType.PING), Header(MsgType.PONG),
    Header(MsgType.LANE, peer=b"\x00k\x8b\x45\x67", lanes=2),
    Header(MsgType.HELLO_ACK, desc={"a": 1}, ok=True, lanes=4, peer=b"\x00k\x8b\x45\x67"),
], ids=lambda h: f"{h.type.name}{'-lanes' if h.lanes else ''}")
def test_header_round_trip(h):
    got = decode_header(encode_header(h))
    for name in ("type", "seq", "tid", "nblk", "heads", "desc", "ok", "code", "msg", "diffs", "peer", "lanes"):
        assert getattr(got, name) == getattr(h, name), name


def test_a_transfer_id_in_any_header_is_sent_again_as_decoded():
    """What a receiver accepts it can re-send unchanged: a ``tid`` on a type that does not need one
    (a PING here, from the long fuzz run) survives a decode / encode / decode round trip."""
    raw = msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.PING), "seq": 1, "tid": "abc", "nblk": 4,
                         "heads": [0, 2]})
    h = decode_header(raw)
    again = decode_header(encode_header(h))
    assert (again.type, again.seq, again.tid) == (MsgType.PING, 1, "abc")
    assert "tid" not in msgpack.unpackb(encode_header(Header(MsgType.PING)))   # none set: none sent


def test_placement_checksum_vectors_and_refusals():
    """``hxx`` matches docs/PROTOCOL.md's vectors; a BLOCKS header whose placement fields changed
    after it was made (tid, layer, nlay, first, nblk, heads, sum, at), or that lacks ``hxx``, is
    refused at decode; a version-3 header (a dump's) without one is read as before."""
    h = Header(MsgType.BLOCKS, tid="req-1", layer=1, nlay=2, first=4, nblk=2, heads=(0, 8), nbytes=[4352, 4352],
               checksums=[0x0123456789abcdef, 0xfedcba9876543210])
    assert placement_checksum(h) == 0xe7da8f05abcb9b88
    assert placement_checksum(dataclasses.replace(h, sum="mix64", at=1048576)) == 0xb474357730ed93ca
    good = msgpack.unpackb(encode_header(h), raw=False)
    assert decode_header(msgpack.packb(good)).placement == good["hxx"] == 0xe7da8f05abcb9b88
    for key, value in (("tid", "req-2"), ("layer", 0), ("nlay", 1), ("first", 5), ("nblk", 1), ("heads", [0, 4]),
                       ("sum", "xxh3_64"), ("at", 0)):
        with pytest.raises(CorruptFrameError, match="header field 'hxx'"):
            decode_header(msgpack.packb({**good, key: value}))
    with pytest.raises(CorruptFrameError, match=r"missing field\(s\) \['hxx'\]"):
        decode_header(msgpack.packb({k: v for k, v in good.items() if k != "hxx"}))
    old = {k: v for k, v in good.items() if k != "hxx"} | {"v": 3}
    assert decode_header(msgpack.packb(old), versions=(3, 4)).first == 4


def test_blocks_message_fills_counts_and_checksums():
    payloads = [bytes(range(7)), bytearray(b"xyz")]
    frames = encode_message(Header(MsgType.BLOCKS, tid="t", layer=2, nlay=3, first=4, nblk=2, heads=(0, 1),
                                   last=True), payloads)
    h = decode_header(frames[0])
    assert (h.layer, h.nlay, h.first, h.nblk, h.last, h.nbytes) == (2, 3, 4, 2, True, [7, 3])
    assert h.checksums == [checksum(p) for p in payloads]
    verify_payloads(h, frames[1:])


def _raw(**over):
    d = {"v": PROTOCOL_VERSION, "t": int(MsgType.PULL), "seq": 0, "tid": "t", "nblk": 1, "heads": [0, 1]}
    d.update(over)
    return msgpack.packb({k: v for k, v in d.items() if v is not ...})


@pytest.mark.parametrize("raw,match", [
    (b"\xc1\x00", "not valid msgpack"),
    (msgpack.packb([1, 2]), "expected a map"),
    (_raw(t=99), "field 't'"),
    (_raw(t="PULL"), "field 't'"),
    (_raw(nblk=-1), "field 'nblk'.*expected int in"),
    (_raw(nblk="3"), "field 'nblk'"),
    (_raw(nblk=True), "field 'nblk'"),
    (_raw(tid=5), "field 'tid'.*expected str"),
    (_raw(tid="x" * 300), "field 'tid'"),
    (_raw(heads=[3, 1]), "field 'heads'"),
    (_raw(heads=[0, 1, 2]), "field 'heads'"),
    (_raw(nblk=...), r"missing field\(s\) \['nblk'\]"),
    (_raw(t=int(MsgType.LANE)), r"LANE header: missing field\(s\) \['peer', 'lanes'\]"),
    (_raw(t=int(MsgType.LANE), peer="kvc", lanes=1), "field 'peer'.*expected bytes"),
    (_raw(t=int(MsgType.LANE), peer=b"x" * 256, lanes=1), "field 'peer'.*at most 255 bytes"),
    (_raw(lanes=65), "field 'lanes'.*expected int in \\[0, 64\\]"),
    (_raw(lanes=-1), "field 'lanes'"),
    (_raw(v="1"), "field 'v'"),
    (_raw(t=int(MsgType.BLOCKS), layer=0, nlay=1, first=0, nbytes=[4, 4], xxh=[1], last=True), "field 'xxh'"),
    (_raw(t=int(MsgType.BLOCKS), layer=0, nlay=1, first=0, nbytes=[1 << 40], xxh=[1], last=True), r"nbytes\[0\]"),
    (_raw(t=int(MsgType.BLOCKS), layer=0, nlay=1, first=0, nbytes=[4], xxh=[-1], last=True), r"xxh\[0\]"),
    (_raw(t=int(MsgType.BLOCKS), layer=0, nlay=0, first=0, nbytes=[4], xxh=[1], last=True), "field 'nlay'"),
    (_raw(t=int(MsgType.BLOCKS), layer=0, first=0, nbytes=[4], xxh=[1], last=True), r"missing field\(s\) \['nlay'\]"),
    # found by the long fuzz run: the lists were checked only in BLOCKS headers
    (_raw(t=int(MsgType.HELLO), desc={}, nbytes=[{"a": 1}, 1 << 62]), r"nbytes\[0\]"),
    (_raw(nbytes=[4], xxh=["x"]), r"xxh\[0\]"),
], ids=["garbage", "array", "bad-type", "type-str", "neg-nblk", "str-nblk", "bool-nblk", "int-tid",
        "long-tid", "heads-reversed", "heads-3", "missing", "lane-without-peer", "lane-peer-str",
        "lane-peer-256", "lanes-65", "lanes-negative", "version-str", "xxh-count", "hostile-nbytes",
        "neg-checksum", "zero-nlay", "v1-blocks-without-nlay", "hello-nbytes-map", "pull-xxh-str"])
def test_decode_rejects_bad_headers(raw, match):
    with pytest.raises(CorruptFrameError, match=match):
        decode_header(raw)


def test_decode_rejects_other_version_and_oversized_header():
    for other in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1):   # an older and a newer peer
        with pytest.raises(ProtocolVersionError, match=f"expected protocol version {PROTOCOL_VERSION}, got {other}"):
            decode_header(_raw(v=other))
    with pytest.raises(CorruptFrameError, match="header frame: expected <="):
        decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))


def test_verify_payloads_names_the_problem():
    frames = encode_message(Header(MsgType.BLOCKS, tid="t", nblk=1, heads=(0, 1)), [b"abcdefgh"])
    h = decode_header(frames[0])
    with pytest.raises(CorruptFrameError, match="truncated: expected 8 bytes, got 7"):
        verify_payloads(h, [b"abcdefg"])
    with pytest.raises(CorruptFrameError, match="oversized: expected 8 bytes, got 9"):
        verify_payloads(h, [b"abcdefghi"])
    with pytest.raises(CorruptFrameError, match="checksum"):
        verify_payloads(h, [b"abcdefgX"])
    with pytest.raises(CorruptFrameError, match="expected 1 payload frames, got 2"):
        verify_payloads(h, [b"abcdefgh", b""])
    with pytest.raises(CorruptFrameError, match="from the layout"):
        verify_payloads(h, [b"abcdefgh"], expected_nbytes=[16])


def _filled(geo, num_blocks, seed):
    c = geo.new_cache(num_blocks)
    g = torch.Generator().manual_seed(seed)
    c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return c


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_gather_scatter_whole_blocks_byte_exact(mode):
    geo = CacheGeometry(mode, 64, 3, 4)
    src, dst = _filled(geo, 10, 0), _filled(geo, 10, 1)
    before = dst.clone()
    src_ids, dst_ids = [7, 2, 3, 4, 0], [1, 9, 5, 6, 8]
    payload = gather_blocks(src, geo, src_ids)
    # bytes per block come from the layout (2·N·H·P), scale tails included
    assert payload.numel() == len(src_ids) * 2 * geo.block_size * geo.num_kv_heads * geo.row_bytes
    scatter_blocks(dst, geo, dst_ids, payload)
    db, sb, bb = dst.view(torch.uint8), src.view(torch.uint8), before.view(torch.uint8)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(db[d], sb[s])
    for untouched in set(range(10)) - set(dst_ids):
        assert torch.equal(db[untouched], bb[untouched])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_head_slice_round_trip(mode):
    geo_src = CacheGeometry(mode, 32, 4, 4)
    geo_dst = CacheGeometry(mode, 32, 2, 4)
    src, dst = _filled(geo_src, 6, 2), _filled(geo_dst, 6, 3)
    before = dst.clone()
    payload = gather_blocks(src, geo_src, [5, 1], heads=range(2, 4))
    assert payload.numel() == slice_bytes(geo_src, 2, range(2, 4)) == 2 * geo_dst.block_bytes
    scatter_blocks(dst, geo_dst, [0, 3], payload, heads=range(0, 2))
    sb, db = src.view(torch.uint8), dst.view(torch.uint8)
    assert torch.equal(db[0], sb[5][:, :, 2:4])
    assert torch.equal(db[3], sb[1][:, :, 2:4])
    assert torch.equal(db[1], before.view(torch.uint8)[1])


def test_gather_scatter_refuse_bad_input():
    geo = CacheGeometry(KVQuantMode.INT8_PER_TOKEN_HEAD, 16, 2, 4)
    cache = _filled(geo, 4, 0)
    with pytest.raises(LayoutError, match=r"block_ids: expected values in \[0, 4\)"):
        gather_blocks(cache, geo, [0, 4])
    with pytest.raises(LayoutError, match="payload: expected"):
        scatter_blocks(cache, geo, [0], torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="kv_cache: expected shape"):
        gather_blocks(cache[:, :, :, :, :8], geo, [0])
    with pytest.raises(LayoutError, match="heads: expected a range"):
        gather_blocks(cache, geo, [0], heads=range(1, 3))


def test_runs_groups_consecutive_ids():
    assert runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]


def test_payload_cells_are_the_stretch_of_the_pulls_payload_a_message_carries():
    """A message's cells [a, b) (layer·n + position) are where its payload sits in the pull's whole
    layer-major payload, checked against the byte layout: one layer or every position is one
    stretch, several layers of some positions are not; messages whose stretches follow each
    other (across layers too) concatenate to the stretch they cover together."""
    n = 8
    rows = torch.arange(4 * n).view(4, n)        # one "block" per (layer, position)
    whole = rows.reshape(-1)

    def payload(layer, nlay, first, nblk):
        return rows[layer:layer + nlay, first:first + nblk].reshape(-1)
    cases = {(1, 1, 2, 3): (10, 13), (1, 1, 0, 8): (8, 16), (1, 2, 0, 8): (8, 24), (0, 4, 0, 8): (0, 32),
             (3, 1, 7, 1): (31, 32), (1, 2, 2, 3): None, (0, 2, 0, 7): None, (2, 2, 1, 7): None}
    for msg, want in cases.items():
        got = payload_cells(*msg, n)
        assert got == want, msg
        if got is not None:
            assert torch.equal(whole[got[0]:got[1]], payload(*msg))
    # consecutive messages of a plan that splits layers in runs: one stretch across the layer boundary
    plan = [(1, 1, 0, 3), (1, 1, 3, 3), (1, 1, 6, 2), (2, 1, 0, 3), (2, 1, 3, 3)]
    spans = [payload_cells(*m, n) for m in plan]
    assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:]))
    assert torch.equal(torch.cat([payload(*m) for m in plan]), whole[spans[0][0]:spans[-1][1]])
