"""The ``mix64`` checksum: the document's test vectors, its defining properties, negotiation.

Covers ``layouts.checksum`` (the NumPy reference) against the test vectors in
docs/PROTOCOL.md "Checksums" (read from the document) and against a word-by-word Python twin;
that a single-bit flip, swapped blocks, truncation and appended zero bytes change it; that
partial word sums of any 8-byte-aligned split add up to the frame's sum (what lets the kernels
hash tiles independently); and the negotiation in the handshake: a decode side that offers
``mix64`` gets it from a prefill that produces it, a peer that offers nothing (every earlier
client) gets xxh3_64 and no ``sum`` key, and a BLOCKS message with an algorithm the receiver
did not offer is a corrupt frame.

Run: python -m pytest tests/test_checksum.py -q
"""

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from connector_fakes import FakePrefill, filled_caches, make_desc, refused_pull
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import CHECKSUM, MIX64, Header, MsgType, checksum, choose_checksum, decode_header, encode_header
from layouts import CorruptFrameError
from layouts.checksum import finish, mix64, mix64_scalar, word_sum

pytestmark = pytest.mark.timeout(60)
DOC = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()


def _vector_input(desc: str, length: int) -> bytes:
    """The input a row of the document's vector table describes."""
    if desc == "empty":
        return b""
    if "0x61" in desc:
        return b"a"
    m = re.fullmatch(r"bytes 0, 1, \.\.\., (\d+)", desc)
    if m:
        return bytes(range(int(m.group(1)) + 1))
    m = re.fullmatch(r"byte i = \((\d+)·i \+ (\d+)\) mod 256, i = 0 \.\. (\d+)", desc)
    a, b, last = map(int, m.groups())
    return bytes((a * i + b) % 256 for i in range(last + 1))


def test_document_vectors():
    section = DOC[DOC.index("## Checksums"):DOC.index("## Leases")]
    rows = re.findall(r"^\| (.+?) \| (\d+) \| `(0x[0-9a-f]{16})` \|$", section, re.M)
    assert len(rows) >= 6, "docs/PROTOCOL.md lists the mix64 test vectors"
    for desc, length, want in rows:
        data = _vector_input(desc, int(length))
        assert len(data) == int(length), desc
        assert mix64(data) == int(want, 16), desc
        if len(data) < 5000:
            assert mix64_scalar(data) == int(want, 16), desc


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 1000, 4096, 4099], ids=lambda n: f"{n}B")
def test_reference_equals_word_by_word_twin(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert mix64(data) == mix64_scalar(data)


def test_every_single_bit_flip_changes_it():
    data = bytearray(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes())
    base = mix64(bytes(data))
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        assert mix64(bytes(data)) != base, f"flip of bit {bit} undetected"
        data[bit // 8] ^= 1 << (bit % 8)


def test_swaps_truncation_and_padding_change_it():
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, 96, dtype=np.uint8).tobytes() for _ in range(4)]
    frame = b"".join(blocks)
    base = mix64(frame)
    assert mix64(b"".join([blocks[1], blocks[0], *blocks[2:]])) != base      # swapped blocks
    assert mix64(frame[:-1]) != base and mix64(frame[:-96]) != base          # truncated
    assert mix64(frame + b"\0") != base and mix64(frame + b"\0" * 8) != base  # zero bytes appended
    assert mix64(b"\0" * 8) != mix64(b"\0" * 16) != mix64(b"")               # zero words are positional


def test_partial_sums_of_any_aligned_split_add_up():
    data = np.random.default_rng(2).integers(0, 256, 5003, dtype=np.uint8).tobytes()
    for cuts in ([], [8], [4096], [8, 16, 4000], [5000]):
        edges = [0, *cuts, len(data)]
        s = sum(word_sum(data[a:b], a // 8) for a, b in zip(edges, edges[1:])) % (1 << 64)
        assert finish(s, len(data)) == mix64(data), cuts


def test_protocol_checksum_dispatch():
    data = b"kv" * 100
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(data, MIX64) == mix64(data)
    with pytest.raises(CorruptFrameError, match="expected one of"):
        checksum(data, "crc32c")
    assert choose_checksum([], (MIX64, CHECKSUM)) == CHECKSUM
    assert choose_checksum([MIX64, CHECKSUM], (CHECKSUM,)) == CHECKSUM
    assert choose_checksum(["crc32c", MIX64], (MIX64, CHECKSUM)) == MIX64
    h = decode_header(encode_header(Header(MsgType.HELLO, desc={}, sums=[MIX64, CHECKSUM])))
    assert h.sums == [MIX64, CHECKSUM]
    assert b"sums" not in encode_header(Header(MsgType.HELLO, desc={"k": 1}))   # no offer: no key
    assert decode_header(encode_header(Header(MsgType.BLOCKS, tid="t", nbytes=[1], checksums=[2]))).algorithm == CHECKSUM


def _pull(pre_sums, dec_sums):
    """Pull through real endpoints computing checksums on the host; return the negotiated algorithm."""
    desc = make_desc(num_layers=2, num_blocks=6)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc, checksums=pre_sums, chunk_bytes=1) as pre, \
            DecodeEndpoint(dst, desc, checksums=dec_sums) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("t", [4, 1, 2])
        dec.pull("t", [0, 3, 5], deadline_s=10).result(timeout=10)
        for s, d in zip(src, dst):
            assert torch.equal(d.view(torch.uint8)[[0, 3, 5]], s.view(torch.uint8)[[4, 1, 2]])
        assert dec.peer_checksums == (tuple(pre_sums) if dec_sums != (CHECKSUM,) else ())   # the prefill's list
        return dec.checksum


@pytest.mark.parametrize("pre_sums,dec_sums,want", [
    ((MIX64, CHECKSUM), (MIX64, CHECKSUM), MIX64),
    ((CHECKSUM,), (MIX64, CHECKSUM), CHECKSUM),       # the prefill cannot produce mix64
    ((MIX64, CHECKSUM), (CHECKSUM,), CHECKSUM),       # an old client: offers nothing
], ids=["both-mix64", "prefill-xxh3-only", "decode-offers-nothing"])
def test_negotiation_in_the_handshake(pre_sums, dec_sums, want):
    assert _pull(pre_sums, dec_sums) == want


def test_old_client_gets_no_sum_key_and_xxh3():
    """A HELLO without ``sums`` (every earlier client) is answered without ``sum``, and BLOCKS are xxh3_64."""
    import msgpack
    import zmq
    desc = make_desc(num_layers=1, num_blocks=2)
    with PrefillEndpoint(filled_caches(desc, 0), desc, checksums=(MIX64, CHECKSUM)) as pre:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        try:
            s.connect(pre.endpoint)
            s.send(encode_header(Header(MsgType.HELLO, desc=desc.to_dict())))
            assert s.poll(5000)
            ack = msgpack.unpackb(s.recv())
            assert ack["ok"] is True and "sum" not in ack
            pre.publish("t", [1])
            s.send(encode_header(Header(MsgType.PULL, tid="t", nblk=1, heads=(0, desc.num_kv_heads))))
            assert s.poll(5000)
            frames = s.recv_multipart()
            raw = msgpack.unpackb(frames[0])
            assert raw["t"] == int(MsgType.BLOCKS) and "sum" not in raw
            assert raw["xxh"] == [xxhash.xxh3_64_intdigest(frames[1])]
        finally:
            s.close(0)
            ctx.term()


def test_blocks_with_an_algorithm_not_offered_is_corrupt():
    desc = make_desc(num_layers=1, num_blocks=4)

    def script(send, h, fake):
        send(fake.blocks(h.tid, 0, 0, 2, sum=MIX64))   # the decode side offered only xxh3_64

    _, dst, before = refused_pull(desc, script, "field 'sum'")
    assert torch.equal(dst[0], before[0])


def test_host_mix64_mismatch_is_named():
    desc = make_desc(num_layers=1, num_blocks=4)

    def script(send, h, fake):
        fr = fake.blocks(h.tid, 0, 0, 2, sum=MIX64)
        bad = bytearray(fr[1])
        bad[5] ^= 1
        send([fr[0], bytes(bad)])

    fake = FakePrefill(desc, filled_caches(desc, 0), script)
    dst = filled_caches(desc, 1)
    before = dst[0].clone()
    try:
        with DecodeEndpoint(dst, desc, checksums=(MIX64, CHECKSUM)) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            t0 = time.monotonic()
            with pytest.raises(CorruptFrameError, match=r"checksum \(mix64\)"):
                dec.pull("t", [2, 3], deadline_s=5).result(timeout=5)
            assert time.monotonic() - t0 < 5
            assert torch.equal(dst[0], before)
    finally:
        fake.close()
