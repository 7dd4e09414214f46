"""Mutation fuzzer for every decoder that reads bytes from a peer or a file.

Targets (each takes a *case*, a list of byte frames, and either accepts it or raises one of
its typed errors; anything else, or a case slower than ``--slow-ms``, is a failure):

==============  ==================================================================  ===========================
target          decoder                                                              allowed errors
==============  ==================================================================  ===========================
``header``      ``protocol.decode_header`` (+ re-encode round trip when accepted)   CorruptFrame, ProtocolVersion
``blocks``      ``decode_header`` + ``verify_payloads`` against the layout's bytes   CorruptFrame, ProtocolVersion
``descriptor``  HELLO header -> ``LayoutDescriptor.from_dict`` -> ``check_compatible``  + LayoutError
``dump``        ``kvconnector.dumpfile.DumpReader``: open, iterate, ``read_block``          + LayoutError
==============  ==================================================================  ===========================

An accepted ``blocks`` case must carry exactly the original payload bytes (a mutated
payload that passes verification would be written into a cache), under the original placement
(transfer, layers, positions, heads: intact bytes in the wrong blocks are as wrong).

Run: ``python -m kvconnector.testing.fuzz --seconds 60`` or ``--cases 100000``; prints cases tried,
accepted, typed errors, failures and the slowest case per target; exit code 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import tempfile
import time

import msgpack
import torch

from kvconnector.blocks import gather_blocks, slice_bytes
from kvconnector.protocol import (Header, MsgType, decode_header, encode_header, encode_message,
                                  verify_payloads)
from layouts import (CacheGeometry, CorruptFrameError, KVQuantMode, LayoutDescriptor, LayoutError,
                     ProtocolVersionError, check_compatible)

WIRE_ERRORS = (CorruptFrameError, ProtocolVersionError)
FILE_ERRORS = WIRE_ERRORS + (LayoutError,)
# values a hostile peer would try in any field: bounds, overflow, wrong types
HOSTILE = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), True, False,
           None, 1.0, float("nan"), float("inf"), "", "x" * 300, "\x00", b"\xff" * 8, [], [0] * 3,
           [2**62, 2**62], {}, {"a": 1}]
GEO = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 16, 2, 2, torch.bfloat16)  # 96-byte blocks
DESC = LayoutDescriptor.from_geometry(GEO, num_layers=2, num_blocks=3)


# ---------------------------------------------------------------- seed corpus
def seed_cases(rng: random.Random) -> dict[str, list[list[bytes]]]:
    """Valid messages / files for each target (the starting points of mutation)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    cache = torch.randint(0, 256, (3, 2, 2, 2, 12), dtype=torch.uint8, generator=gen)
    frames = []
    for nblk, heads in ((1, None), (2, range(0, 1)), (3, range(1, 2))):
        payload = gather_blocks(cache, GEO, list(range(nblk)), heads).numpy().tobytes()
        hr = (0, 2) if heads is None else (heads.start, heads.stop)
        h = Header(MsgType.BLOCKS, seq=nblk, tid=f"t{nblk}", layer=1, first=0, nblk=nblk, heads=hr,
                   last=nblk == 3)
        frames.append([bytes(f) for f in encode_message(h, [payload[: len(payload) // 2],
                                                             payload[len(payload) // 2:]])])
    small = [Header(MsgType.PULL, seq=1, tid="abc", nblk=4, heads=(0, 2)),
             Header(MsgType.ACK, seq=2, tid="abc", ok=True), Header(MsgType.ABORT, tid="abc"),
             Header(MsgType.ERROR, code="unknown_transfer", msg="no such id", tid="z"),
             Header(MsgType.PING), Header(MsgType.PONG, seq=9),
             Header(MsgType.HELLO_ACK, desc=DESC.to_dict(), ok=False, diffs=[["block_size", 2, 4]])]
    hello = [[encode_header(Header(MsgType.HELLO, desc=DESC.to_dict()))],
             [encode_header(Header(MsgType.HELLO, desc=DESC.with_(head_start=1, num_kv_heads=1).to_dict()))]]
    return {"header": [[encode_header(h)] for h in small] + [f[:1] for f in frames] + hello,
            "blocks": frames, "descriptor": hello, "dump": [[_dump_bytes(cache)]]}


def _dump_bytes(cache) -> bytes:
    from kvconnector.dumpfile import write_dump
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "seed.kvdump")
        write_dump(p, [cache, cache.flip(0).contiguous()], DESC, block_ids=[2, 0])
        with open(p, "rb") as f:
            return f.read()


# ---------------------------------------------------------------- mutators
def _mutate_value(rng: random.Random, obj):
    """Replace, drop or add one value somewhere inside a decoded msgpack object."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        k = rng.choice(list(obj))
        r = rng.random()
        if r < 0.15:
            del obj[k]
        elif r < 0.25:
            obj[rng.choice(["v", "t", "x", "nbytes", "desc", "offsets", "n"])] = rng.choice(HOSTILE)
        elif isinstance(obj[k], (dict, list)) and obj[k] and r < 0.6:
            obj[k] = _mutate_value(rng, obj[k])
        else:
            obj[k] = rng.choice(HOSTILE)
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        i = rng.randrange(len(obj))
        r = rng.random()
        if r < 0.2:
            del obj[i]
        elif r < 0.3:
            obj.append(rng.choice(HOSTILE))
        else:
            obj[i] = _mutate_value(rng, obj[i]) if isinstance(obj[i], (dict, list)) else rng.choice(HOSTILE)
        return obj
    return rng.choice(HOSTILE)


def mutate_bytes(rng: random.Random, buf: bytes) -> bytes:
    """One random byte-level edit: flip, set, insert, delete, truncate, duplicate, length field."""
    b = bytearray(buf)
    op = rng.randrange(8)
    i = rng.randrange(len(b) + 1)
    if op == 0 and b:
        b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[min(i, len(b) - 1)] = rng.choice([0, 0x7F, 0x80, 0xFF, 0xC1, 0xDD, 0xDF, 0xDB])
    elif op == 2:
        b[i:i] = rng.randbytes(rng.randrange(1, 9))
    elif op == 3:
        del b[i:i + rng.randrange(1, 17)]
    elif op == 4:
        del b[i:]
    elif op == 5:
        j = rng.randrange(len(b) + 1)
        b[j:j] = b[i:i + rng.randrange(1, 33)]
    elif op == 6 and len(b) >= 8:  # a plausible little/big-endian length field gone hostile
        j = rng.randrange(len(b) - 7)
        b[j:j + 8] = struct.pack(rng.choice("<>") + "Q", rng.choice([2**31, 2**32 - 1, 2**62, 2**64 - 1]))
    else:
        b = bytearray(rng.randbytes(rng.randrange(64)))
    return bytes(b)


def mutate_msgpack(rng: random.Random, buf: bytes) -> bytes:
    """Structured edit of a msgpack frame (falls back to a byte edit when it does not decode)."""
    try:
        obj = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception:
        return mutate_bytes(rng, buf)
    return msgpack.packb(_mutate_value(rng, obj), use_bin_type=True)


def mutate_dump(rng: random.Random, blob: bytes) -> bytes:
    """Edit a dump's file header (re-checksummed), a message header, a length field, or bytes."""
    from kvconnector.protocol import checksum
    if len(blob) < 24 or blob[:8] != seed_magic():
        return mutate_bytes(rng, blob)
    (hdr_len,) = struct.unpack_from("<I", blob, 12)
    r = rng.random()
    if r < 0.3:  # structured header edit that still passes the header checksum
        hdr = mutate_msgpack(rng, blob[16:16 + hdr_len])
        return blob[:12] + struct.pack("<I", len(hdr)) + hdr + struct.pack("<Q", checksum(hdr)) \
            + blob[24 + hdr_len:]
    lengths, at = [12], 24 + hdr_len  # offsets of every length field, walking the frames
    while at + 8 <= len(blob) - 16:
        lengths.append(at)
        at += 8 + struct.unpack_from("<Q", blob, at)[0]
    at = rng.choice(lengths)
    if r < 0.55:
        size = 4 if at == 12 else 8
        v = rng.choice([0, 1, 2**31, 2**32 - 1, 2**62, 2**64 - 1]) % (1 << (8 * size))
        return blob[:at] + v.to_bytes(size, "little") + blob[at + size:]
    if r < 0.75 and at != 12:  # structured edit of one frame, length prefix kept consistent
        n = struct.unpack_from("<Q", blob, at)[0]
        new = mutate_msgpack(rng, blob[at + 8:at + 8 + n])
        return blob[:at] + struct.pack("<Q", len(new)) + new + blob[at + 8 + n:]
    return mutate_bytes(rng, blob)


def seed_magic() -> bytes:
    from kvconnector.dumpfile import MAGIC
    return MAGIC


def mutate_case(rng: random.Random, target: str, case: list[bytes], rounds: int = 1) -> list[bytes]:
    """Apply ``rounds`` random edits to a case (frame-list edits included for wire targets)."""
    case = list(case)
    for _ in range(rounds):
        if target == "dump":
            case = [mutate_dump(rng, case[0])]
            continue
        r = rng.random()
        if target == "blocks" and r < 0.2 and len(case) > 1:  # frame list: drop, dup, swap, add
            i, j = rng.randrange(1, len(case)), rng.randrange(1, len(case))
            op = rng.randrange(4)
            if op == 0:
                del case[i]
            elif op == 1:
                case.insert(i, case[j])
            elif op == 2:
                case[i], case[j] = case[j], case[i]
            else:
                case.append(rng.randbytes(rng.randrange(16)))
            continue
        i = 0 if target != "blocks" or r < 0.6 else rng.randrange(len(case))
        edit = mutate_msgpack if i == 0 and rng.random() < 0.6 else mutate_bytes
        case[i] = edit(rng, case[i])
    return case


# ---------------------------------------------------------------- targets
def run_header(case, original=None) -> bool:
    h = decode_header(case[0])
    ints = (h.version, h.seq, h.layer, h.first, h.nblk, *h.heads, *h.nbytes, *h.checksums)
    if any(type(v) is not int for v in ints) or not all(type(v) is bool for v in (h.last, h.ok)):
        raise AssertionError(f"accepted a header with a mistyped field: {h}")
    again = decode_header(encode_header(h))  # what we accept we can re-send unchanged
    if (again.type, again.seq, again.tid) != (h.type, h.seq, h.tid):
        raise AssertionError(f"header round trip changed {h} -> {again}")
    return True


def run_blocks(case, original) -> bool:
    h = decode_header(case[0])
    if h.type != MsgType.BLOCKS:
        raise CorruptFrameError(f"expected BLOCKS, got {h.type.name}")
    o = decode_header(original[0])
    expected = [len(p) for p in original[1:]]  # what the receiver derived from its PULL
    verify_payloads(h, case[1:], expected)
    if [bytes(p) for p in case[1:]] != [bytes(p) for p in original[1:]]:
        raise AssertionError("verify_payloads accepted payload bytes that differ from the sent ones")
    placed = lambda x: (x.tid, x.layer, x.nlay, x.first, x.nblk, x.heads, x.sum, x.at)  # where the bytes go
    if placed(h) != placed(o):
        raise AssertionError(f"accepted intact payload bytes under another placement: {placed(h)} for {placed(o)}")
    if sum(expected) != slice_bytes(GEO, o.nblk, range(*o.heads)):
        raise AssertionError("seed case inconsistent with the layout")
    return True


def run_descriptor(case, original=None) -> bool:
    h = decode_header(case[0])
    if h.desc is None:
        raise CorruptFrameError("HELLO without desc")
    d = LayoutDescriptor.from_dict(h.desc)
    if LayoutDescriptor.from_dict(d.to_dict()) != d or d.geometry().block_bytes <= 0:
        raise AssertionError(f"accepted descriptor does not round trip: {d}")
    try:
        check_compatible(DESC, d)
    except LayoutError:
        pass
    return True


def run_dump(case, original=None, _dir=[None]) -> bool:
    from kvconnector.dumpfile import DumpReader
    if _dir[0] is None:
        _dir[0] = tempfile.mkdtemp(prefix="kvfuzz-")
    path = os.path.join(_dir[0], "case.kvdump")
    with open(path, "wb") as f:
        f.write(case[0])
    with DumpReader(path) as r:
        records = list(r)
        for rec in records[:2]:
            again = r.read_block(rec.layer, rec.block_id)
            if bytes(again.payload) != bytes(rec.payload):
                raise AssertionError("read_block and iteration disagree")
    return True


TARGETS = {"header": (run_header, WIRE_ERRORS), "blocks": (run_blocks, WIRE_ERRORS),
           "descriptor": (run_descriptor, FILE_ERRORS), "dump": (run_dump, FILE_ERRORS)}


def check(target: str, case, original) -> str:
    """Run one case: 'accepted' or 'typed'; any other exception propagates."""
    fn, allowed = TARGETS[target]
    try:
        fn(case, original)
        return "accepted"
    except allowed:
        return "typed"


def fuzz(targets, cases: int, seconds: float, seed: int, slow_ms: float, out=sys.stdout) -> int:
    rng = random.Random(seed)
    seeds = seed_cases(rng)
    stats = {t: {"cases": 0, "accepted": 0, "typed": 0, "failures": 0, "slow": 0, "max_ms": 0.0}
             for t in targets}
    t_end = time.monotonic() + seconds
    n, seen = 0, set()
    while n < cases and time.monotonic() < t_end:
        t = targets[n % len(targets)]
        original = rng.choice(seeds[t])
        case = mutate_case(rng, t, original, rounds=rng.choice([1, 1, 1, 2, 3]))
        s = stats[t]
        t0 = time.perf_counter()
        try:
            s[check(t, case, original)] += 1
        except Exception as e:  # the whole point: anything untyped is a finding
            s["failures"] += 1
            kind = (t, type(e).__name__, str(e)[:60])
            if kind not in seen:  # one report per distinct failure
                seen.add(kind)
                print(f"FAILURE {t}: {type(e).__name__}: {str(e)[:200]}\n  case: "
                      f"{[bytes(f[:96]).hex() for f in case]}", file=out)
        ms = (time.perf_counter() - t0) * 1e3
        s["max_ms"] = max(s["max_ms"], ms)
        s["slow"] += ms > slow_ms
        s["cases"] += 1
        n += 1
    print("| target | cases | accepted | typed errors | failures | slow | max ms |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    for t, s in stats.items():
        print(f"| {t} | {s['cases']} | {s['accepted']} | {s['typed']} | {s['failures']} | "
              f"{s['slow']} | {s['max_ms']:.1f} |", file=out)
    bad = sum(s["failures"] + s["slow"] for s in stats.values())
    print(f"total: {n} cases, {bad} failures (untyped errors or slower than {slow_ms} ms)", file=out)
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10**9, help="stop after this many cases")
    p.add_argument("--seconds", type=float, default=30.0, help="stop after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    p.add_argument("--slow-ms", type=float, default=1000.0, help="a case slower than this is a hang")
    a = p.parse_args(argv)
    return fuzz(a.targets.split(","), a.cases, a.seconds, a.seed, a.slow_ms)


if __name__ == "__main__":
    sys.exit(main())
