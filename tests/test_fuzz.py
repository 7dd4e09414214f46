"""Property-based fuzzing of every decoder that reads bytes from a peer or a file.

Covers ``kvconnector.protocol.decode_header`` (arbitrary bytes, arbitrary msgpack maps,
mutated valid headers), payload framing and checksum verification (``verify_payloads``),
``LayoutDescriptor.from_dict`` reached through a msgpack HELLO header, and the dump file
reader (``kvconnector.dumpfile.DumpReader``). Contract: a case decodes or raises a typed error
(``CorruptFrameError``, ``ProtocolVersionError``, ``LayoutError``), never anything else; no
case hangs (pytest-timeout and a per-case time bound); a hostile length field allocates
nothing in proportion to the length it claims (tracemalloc). Live endpoints get mutated
messages over real sockets: they keep serving, write nothing they should not, and record
only typed errors (their I/O threads catch everything, so an untyped one would hide there).

Example counts are bounded so CI stays fast; ``python -m kvconnector.testing.fuzz --seconds 300`` runs the
same targets for longer (numbers in docs/RELIABILITY.md).

Run: python -m pytest tests/test_fuzz.py
"""

import os
import random
import re
import struct
import time
import tracemalloc
from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnector.protocol import (MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, PROTOCOL_VERSION, Header, MsgType, checksum,
                                  decode_header, encode_header, encode_message, placement_checksum, verify_payloads)
from layouts import CorruptFrameError, LayoutDescriptor, LayoutError, ProtocolVersionError
from kvconnector.testing import fuzz

pytestmark = pytest.mark.timeout(120)
WIRE = (CorruptFrameError, ProtocolVersionError)
FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEDS = fuzz.seed_cases(random.Random(0))
CASE_S = 1.0  # a decoder taking longer than this on a few hundred bytes is a hang candidate

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=12)
header_keys = st.sampled_from(["v", "t", "seq", "tid", "layer", "nlay", "first", "nblk", "heads", "nbytes",
                               "xxh", "last", "desc", "ok", "code", "msg", "diffs"]) | st.text(max_size=4)


def _timed(fn, *args):
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        assert time.perf_counter() - t0 < CASE_S, f"decoder took over {CASE_S} s"


@FAST
@given(st.binary(max_size=512))
def test_header_arbitrary_bytes(buf):
    try:
        h = _timed(decode_header, buf)
    except WIRE:
        return
    assert isinstance(h.type, MsgType)


@FAST
@given(st.dictionaries(header_keys, values, max_size=12),
       st.integers(1, 9), st.booleans())
def test_header_arbitrary_maps(raw, t, set_vt):
    if set_vt:  # most maps would die at 'v'/'t'; give half of them a valid start
        raw = {**raw, "v": PROTOCOL_VERSION, "t": t}
    try:
        fuzz.run_header([_timed(msgpack.packb, raw)])
    except WIRE:
        pass


@FAST
@given(st.sampled_from(["header", "blocks", "descriptor"]), st.randoms(use_true_random=False),
       st.integers(1, 4))
def test_wire_mutations(target, rng, rounds):
    original = rng.choice(SEEDS[target])
    case = fuzz.mutate_case(rng, target, original, rounds)
    _timed(fuzz.check, target, case, original)  # raises on anything but a typed error


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.randoms(use_true_random=False), st.integers(1, 3))
def test_dump_reader_mutations(rng, rounds):
    original = SEEDS["dump"][0]
    case = fuzz.mutate_case(rng, "dump", original, rounds)
    _timed(fuzz.check, "dump", case, original)


def test_seed_cases_are_accepted():
    """The mutators start from valid inputs, so an all-typed-errors run is not vacuous."""
    for target, cases in SEEDS.items():
        for case in cases:
            assert fuzz.check(target, case, case) == "accepted", target


@FAST
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4), st.data())
def test_verify_payloads_accepts_only_the_sent_bytes(payloads, data):
    h = Header(MsgType.BLOCKS, tid="t", nblk=1, heads=(0, 1), last=True)
    frames = encode_message(h, payloads)
    hdr = decode_header(frames[0])
    got = [bytearray(p) for p in payloads]
    op = data.draw(st.sampled_from(["none", "flip", "truncate", "extend", "drop", "add", "swap"]))
    i = data.draw(st.integers(0, len(got) - 1))
    if op == "flip" and got[i]:
        got[i][data.draw(st.integers(0, len(got[i]) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "truncate" and got[i]:
        del got[i][data.draw(st.integers(0, len(got[i]) - 1)):]
    elif op == "extend":
        got[i] += data.draw(st.binary(min_size=1, max_size=8))
    elif op == "drop":
        del got[i]
    elif op == "add":
        got.append(bytearray(data.draw(st.binary(max_size=8))))
    elif op == "swap":
        got[0], got[i] = got[i], got[0]
    same = [bytes(p) for p in got] == [bytes(p) for p in payloads]
    if same:
        verify_payloads(hdr, got, [len(p) for p in payloads])
    else:  # any change is caught: count, length or xxh3 checksum
        with pytest.raises(CorruptFrameError, match="payload frame|frames"):
            verify_payloads(hdr, got, [len(p) for p in payloads])


def test_verify_payloads_refuses_header_counts_the_layout_did_not_ask_for():
    h = Header(MsgType.BLOCKS, tid="t", nblk=1, heads=(0, 1), last=True)
    hdr = decode_header(encode_message(h, [b"x" * 96])[0])
    with pytest.raises(CorruptFrameError, match="from the layout"):
        verify_payloads(hdr, [b"x" * 96], [48])


@FAST
@given(st.sampled_from(sorted(LayoutDescriptor.__dataclass_fields__)), values)
def test_descriptor_from_msgpack_field_values(name, value):
    d = {**fuzz.DESC.to_dict(), name: value}
    try:
        raw = decode_header(encode_header(Header(MsgType.HELLO, desc=d))).desc
    except WIRE:
        return
    try:
        back = LayoutDescriptor.from_dict(raw)
    except LayoutError:
        return
    assert back.to_dict() == raw and back.geometry().block_bytes > 0


# --------------------------------------------------------------- hostile length fields
def _blocks_header(**over) -> bytes:
    """A raw BLOCKS header with its placement checksum right, so the hostile field is what fails."""
    raw = {"v": PROTOCOL_VERSION, "t": 4, "seq": 0, "tid": "a", "layer": 0, "nlay": 1, "first": 0, "nblk": 1,
           "heads": [0, 1], "nbytes": [96], "xxh": [0], "last": True, **over}
    raw["hxx"] = placement_checksum(Header(MsgType.BLOCKS, tid=raw["tid"], layer=raw["layer"], nlay=raw["nlay"],
                                           first=raw["first"], nblk=raw["nblk"], heads=tuple(raw["heads"]),
                                           nbytes=raw["nbytes"], checksums=raw["xxh"]))
    return msgpack.packb(raw)


def _dump_with(edit) -> bytes:
    return edit(bytearray(SEEDS["dump"][0][0]))


def _hdr_len(blob) -> int:
    return struct.unpack_from("<I", blob, 12)[0]


def _set_u64(blob, at, v):
    blob[at:at + 8] = struct.pack("<Q", v)
    return bytes(blob)


def _many_messages(blob):
    """A valid, checksummed file header listing 10^8 messages in a tiny file."""
    desc = fuzz.DESC.with_(num_layers=10**4, num_blocks=10**4).to_dict()
    hdr = msgpack.packb({"format": 1, "protocol": 1, "checksum": "xxh3_64", "desc": desc,
                         "fingerprint": LayoutDescriptor.from_dict(desc).fingerprint(), "tid": "x",
                         "layers": list(range(10**4)), "block_ids": list(range(10**4)), "meta": {}})
    return bytes(blob[:12]) + struct.pack("<I", len(hdr)) + hdr + struct.pack("<Q", checksum(hdr)) + b"\0" * 64


def _run_dump(blob):
    """Open + iterate, then open + read_block (which builds the index from the header)."""
    import tempfile
    from kvconnector.dumpfile import DumpReader
    typed = (CorruptFrameError, ProtocolVersionError, LayoutError)
    errors = []
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "h.kvdump")
        with open(p, "wb") as f:
            f.write(blob)
        for use in (lambda r: list(r), lambda r: r.read_block(*r.info.where(0))):
            try:
                with DumpReader(p) as r:
                    use(r)
            except typed as e:
                errors.append(e)
    if len(errors) == 2:
        raise errors[-1]


def _truncated(h):
    """The header decodes (its claim is in range); the 3-byte frame is refused as truncated."""
    with pytest.raises(CorruptFrameError, match="truncated"):
        verify_payloads(h, [b"abc"])
    raise CorruptFrameError("refused as truncated")


HOSTILE = [
    ("header-nbytes-2^62", lambda: decode_header(_blocks_header(nbytes=[2**62]))),
    ("header-nbytes-2^64-1", lambda: decode_header(_blocks_header(nbytes=[2**64 - 1]))),
    ("payload-claims-2^31", lambda: _truncated(decode_header(_blocks_header(nbytes=[MAX_PAYLOAD_BYTES])))),
    ("msgpack-array32-claim", lambda: decode_header(b"\x81\xa1v\xdd\xff\xff\xff\xff" + b"\x00" * 16)),
    ("msgpack-str32-claim", lambda: decode_header(b"\x81\xa1v\xdb\x7f\xff\xff\xff" + b"a" * 16)),
    ("msgpack-bin32-claim", lambda: decode_header(b"\x81\xa1v\xc6\xff\xff\xff\xff" + b"a" * 16)),
    ("msgpack-map32-claim", lambda: decode_header(b"\xdf\xff\xff\xff\xff" + b"\xa1v" * 8)),
    ("header-over-1MiB", lambda: decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))),
    ("dump-file-header-len-2^32-1", lambda: _run_dump(_dump_with(
        lambda b: bytes(b[:12]) + b"\xff\xff\xff\xff" + bytes(b[16:])))),
    ("dump-frame-len-2^62", lambda: _run_dump(_dump_with(
        lambda b: _set_u64(b, 24 + _hdr_len(b), 2**62)))),
    ("dump-10^8-messages", lambda: _run_dump(_dump_with(_many_messages))),
]


@pytest.mark.parametrize("make", [m for _, m in HOSTILE], ids=[n for n, _ in HOSTILE])
def test_hostile_length_field_allocates_nothing_big(make):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises((CorruptFrameError, ProtocolVersionError, LayoutError)):
            make()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the inputs are <= ~1 MiB; 16 MiB leaves room for msgpack/torch bookkeeping while any
    # allocation sized by the claimed length (>= 2^31 bytes, or 10^8 index entries) shows
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert time.perf_counter() - t0 < 5.0


# --------------------------------------------------------------- live endpoints
def _typed_only(errors):
    """Handlers' exceptions land in ``endpoint.errors``; a non-KVCacheError there is a bug."""
    from layouts import KVCacheError
    assert errors.total == len(errors), "errors dropped before they were checked"
    bad = [e for e in errors if not isinstance(e, KVCacheError)]
    assert not bad, f"untyped errors inside the endpoint: {bad[:3]!r}"


def test_live_decode_endpoint_under_mutated_blocks():
    """A fake prefill sends one mutated BLOCKS message, then the valid ones, per pull: the pull
    succeeds byte exact or fails typed; nothing outside its blocks is written; no untyped error."""
    import torch
    from connector_fakes import FakePrefill, filled_caches, make_desc
    from kvconnector import DecodeEndpoint
    from layouts import KVCacheError
    desc = make_desc(num_layers=1, num_blocks=8)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    rng = random.Random(7)

    def script(send, h, fake):
        valid = [fake.blocks(h.tid, 0, i, 1, seq=i, last=i == h.nblk - 1) for i in range(h.nblk)]
        original = [bytes(f) for f in valid[rng.randrange(h.nblk)]]
        send(fuzz.mutate_case(rng, "blocks", original, rng.choice([1, 2])))
        for fr in valid:
            send(fr)

    fake = FakePrefill(desc, src, script)
    outcomes = Counter()
    try:
        with DecodeEndpoint(dst, desc, peer_timeout_s=5) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            for k in range(40):
                before = dst[0].view(torch.uint8).clone()
                h = dec.pull(f"t{k}", [3, 5], deadline_s=1.0)
                err = h.exception(timeout=3)
                outcomes[type(err).__name__ if err else "ok"] += 1
                assert err is None or isinstance(err, KVCacheError), repr(err)
                now, s8 = dst[0].view(torch.uint8), src[0].view(torch.uint8)
                for pos, b in enumerate([3, 5]):
                    assert torch.equal(now[b], s8[pos]) or (err is not None and torch.equal(now[b], before[b]))
                others = [b for b in range(8) if b not in (3, 5)]
                assert torch.equal(now[others], before[others])
            _typed_only(dec.errors)
    finally:
        fake.close()
    # both paths exercised: mutations that are harmless (or caught and ignored) and typed failures
    assert outcomes["ok"] > 0 and len(outcomes) > 1 and sum(outcomes.values()) == 40, outcomes


def test_live_prefill_endpoint_under_mutated_messages():
    """A raw peer handshakes, then sends mutated HELLO/PULL/ACK/BLOCKS messages: the endpoint
    keeps answering, records only typed errors, and still serves a real decode peer."""
    import zmq
    from connector_fakes import filled_caches, make_desc
    from kvconnector import DecodeEndpoint, PrefillEndpoint
    from kvconnector.error_log import ErrorLog
    desc = make_desc(num_layers=1, num_blocks=8)
    rng = random.Random(11)
    with PrefillEndpoint(filled_caches(desc, 0), desc) as pre:
        pre.errors = ErrorLog(keep=1000)      # every error of the 300 messages kept, so every one is checked
        pre.publish("real", [1, 2])
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(pre.endpoint)
            s.send(encode_header(Header(MsgType.HELLO, desc=desc.to_dict())))
            assert s.poll(5000)
            seeds = SEEDS["header"] + SEEDS["blocks"] + SEEDS["descriptor"]
            for _ in range(300):
                original = rng.choice(seeds)
                target = "blocks" if len(original) > 1 else "header"
                s.send_multipart(fuzz.mutate_case(rng, target, original, rng.choice([1, 2])))
            s.send(encode_header(Header(MsgType.PING)))
            end, alive = time.monotonic() + 10, False
            while time.monotonic() < end and not alive:
                if s.poll(100):
                    try:
                        alive = decode_header(s.recv_multipart()[0]).type == MsgType.PONG
                    except WIRE:
                        pass
            assert alive, "prefill stopped answering"
        finally:
            s.close(0)
            ctx.term()
        dst = filled_caches(desc, 1)
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(pre.endpoint, timeout_s=5)
            dec.pull("real", [4, 6], deadline_s=5).result(timeout=6)
        _typed_only(pre.errors)


@pytest.mark.parametrize("frame_ops", [False, True], ids=["host-path", "device-path"])
def test_live_fuzz_tool_finds_nothing_and_has_power(monkeypatch, frame_ops):
    """``kvconnector.testing.live_fuzz`` (mutated BLOCKS / PULL / ACK copies between real
    endpoints, on the host path or the device path with its grouped gathers and verify passes):
    600 pulls end byte exact or typed with nothing misplaced. With the placement checksum
    neutralized (0 on both sides) and every BLOCKS copy moved one position on, the same checks
    report blocks holding another position's bytes: the tool can fail."""
    from kvconnector import protocol
    from kvconnector.testing import live_fuzz
    from kvconnector.testing.faultproxy import reheader

    logs = []
    assert live_fuzz.run(120, seed=3, rate=0.3, log=logs.append, max_pulls=600, frame_ops=frame_ops) == 0, logs[-5:]
    assert "ok" in logs[-1] and "CorruptFrameError" in logs[-1], logs[-1]
    if frame_ops:   # messages were verified in passes of several, and gathered in groups
        passes, landed = (int(x) for x in re.search(r"(\d+) messages staged, (\d+) verify", logs[-2]).groups()[::-1])
        gathers, sent = (int(x) for x in re.search(r"(\d+) gather launches for (\d+) messages", logs[-2]).groups())
        assert passes < landed and gathers < sent, logs[-2]

    def one_on(rng, target, frames, rounds):
        if target != "blocks":
            return frames
        return reheader(frames, first=(decode_header(frames[0]).first + 1) % live_fuzz.PULLED)

    monkeypatch.setattr(protocol, "placement_checksum", lambda h: 0)
    logs = []
    assert live_fuzz.run(120, seed=3, rate=1.0, log=logs.append, max_pulls=20, mutate=one_on, frame_ops=frame_ops) > 0
    assert any("not the source bytes, yet the pull succeeded" in m for m in logs), logs[-3:]
