"""Wire protocol of the connector: message types, the msgpack header frame, payload checksums.

Pure encode/decode, no sockets (``transport`` and the endpoints send what this module
builds; the dump tools write the same messages to a file).

A **message** is a list of frames::

    frame 0      header: a msgpack map, at most MAX_HEADER_BYTES bytes
    frame 1..n   raw payload frames (only BLOCKS carries any): whole cache rows, scale
                 tails included, exactly ``header.nbytes[i]`` bytes each, checksummed by
                 ``header.checksums[i]`` (xxh3_64 of the frame, or the negotiated
                 algorithm named by ``header.sum``)

Header keys (short on purpose: every BLOCKS message carries one):

========  =========================  ====================================================
key       type                       meaning
========  =========================  ====================================================
``v``     int                        protocol version (== PROTOCOL_VERSION)
``t``     int                        :class:`MsgType`
``seq``   int >= 0                   sender's message counter (per transfer for BLOCKS)
``tid``   str (<= 256 chars)         transfer id ("" when not about a transfer)
``layer`` int >= 0                   BLOCKS: first layer carried
``nlay``  int >= 1                   BLOCKS: layers carried, ``layer .. layer+nlay-1`` (v2)
``first`` int >= 0                   BLOCKS: position of the first block in the transfer
``nblk``  int >= 0                   BLOCKS: number of blocks; PULL: blocks expected
``heads`` [int, int]                 global KV head range [lo, hi) of the rows carried
``nbytes`` [int, ...]                byte count of each payload frame
``xxh``   [int, ...]                 checksum of each payload frame (algorithm ``sum``)
``sum``   str                        BLOCKS / HELLO_ACK: checksum algorithm (absent: xxh3_64)
``sums``  [str, ...]                 HELLO / HELLO_ACK: checksum algorithms the sender accepts / produces
``nixl``  map                        HELLO: NIXL agent metadata + receive region (data plane)
``plane`` str                        HELLO_ACK: data plane the prefill uses (absent: zmq)
``at``    int >= 0                   PULL: the pull's area in the region; BLOCKS: payload offset
``lanes`` int >= 0                   HELLO: data connections the decode side can open; HELLO_ACK: how many
                                     the prefill sends BLOCKS over (this one included); LANE: which
                                     lane this connection is, 1 .. granted - 1
``peer``  bytes                      HELLO_ACK (lanes granted): the routing id the prefill knows the decode
                                     side's first connection by; LANE: that id
``hxx``   int (u64)                  BLOCKS: checksum of the placement fields (:func:`placement_checksum`, v4)
``last``  bool                       BLOCKS: final message of the transfer
``desc``  map                        HELLO / HELLO_ACK: the sender's LayoutDescriptor
``ok``    bool                       HELLO_ACK / ACK: accepted / succeeded
``code``  str                        ERROR / ABORT: machine-readable reason
``msg``   str                        ERROR / ABORT / HELLO_ACK: human-readable detail
``diffs`` [[str, any, any], ...]     HELLO_ACK: differing descriptor fields
``xfers`` [[str, int], ...]          DESCRIBE reply: published transfer ids and block counts (v3)
========  =========================  ====================================================

Version history: :data:`PROTOCOL_HISTORY` below, one line per version (docs/PROTOCOL.md shows
the same list; the full protocol, message numbers and a worked example are documented there).

Compatibility rule: a peer whose ``v`` differs is refused with :class:`ProtocolVersionError`
(no negotiation). Unknown header keys are ignored so that a later version may
add optional keys without a bump; any change to an existing key's meaning bumps the version.
The checksum algorithm is negotiated by optional keys (since v3): a decode side lists what it
accepts in HELLO ``sums``; the prefill answers its choice in HELLO_ACK ``sum`` and names it in
every BLOCKS ``sum``. A peer that sends no ``sums`` gets xxh3_64 and never sees ``sum``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack
import xxhash

from layouts import CorruptFrameError, ProtocolVersionError
from layouts import checksum as mix64_ref

PROTOCOL_VERSION = 4
PROTOCOL_HISTORY = {
    1: "HELLO/HELLO_ACK, PULL, BLOCKS, ACK, ABORT, ERROR, PING/PONG; xxh3_64 per payload frame",
    2: "BLOCKS key 'nlay': one message carries nlay consecutive layers (layer-major payload)",
    3: "DESCRIBE: ask a prefill endpoint for its descriptor and published transfers (no handshake)",
    4: "BLOCKS key 'hxx' (required): a checksum of the fields that say where the payload goes",
}

MAX_HEADER_BYTES = 1 << 20       # a header is a few hundred bytes; refuse to parse more
MAX_TID_CHARS = 256
MAX_LIST_LEN = 1 << 16           # bound on block / frame lists inside one header
MAX_LANES = 64                   # HELLO / HELLO_ACK ``lanes`` bound
MAX_PAYLOAD_BYTES = 1 << 31      # one payload frame (also zmq MAXMSGSIZE on the sockets)
CHECKSUM = "xxh3_64"             # the default algorithm: every peer accepts it, dump files use it
MIX64 = mix64_ref.NAME            # "mix64": per-word hashes summed, computable in parallel on a GPU
CHECKSUMS = (CHECKSUM, MIX64)     # algorithms this implementation can compute and verify


class MsgType(enum.IntEnum):
    """Message types. Direction: D = decode side, P = prefill side."""

    HELLO = 1       # D -> P: version + descriptor
    HELLO_ACK = 2   # P -> D: version + descriptor + ok/diffs
    PULL = 3        # D -> P: send me transfer ``tid`` (rows of ``heads``)
    BLOCKS = 4      # P -> D: header + payload frames for nlay layers (one in v1)
    ACK = 5         # D -> P: transfer landed; release the lease
    ABORT = 6       # D -> P: give up on the transfer; release the lease
    ERROR = 7       # either way: ``code`` + ``msg`` about ``tid``
    PING = 8        # either way: liveness
    PONG = 9
    DESCRIBE = 10   # D -> P: layout request (no keys); P -> D: reply with ``desc`` + ``xfers``
    LANE = 11       # D -> P, on an extra connection: it is lane ``lanes`` of peer ``peer`` (HELLO_ACK ``lanes``)


class ErrorCode(str, enum.Enum):
    """Values of the ``code`` key in ERROR messages (and of ABORT's optional ``code``).

    A receiver treats an unknown code like any other ERROR about its transfer: the pull fails.
    """

    UNKNOWN_TRANSFER = "unknown_transfer"      # PULL: no lease under this tid (never published, or ended)
    HANDSHAKE_REQUIRED = "handshake_required"  # any message before an accepted HELLO: send HELLO
    BLOCK_COUNT = "block_count"                # PULL: nblk differs from the published block count
    BAD_HEADS = "bad_heads"                    # PULL: heads outside the range both sides hold
    BAD_MESSAGE = "bad_message"                # undecodable header, wrong version or missing key
    ABORTED = "aborted"                        # ABORT: the decode side gave up
    SERVE_FAILED = "serve_failed"              # reading, hashing or sending the blocks failed; lease ended
    LEASE_EXPIRED = "lease_expired"            # the lease ran out while the transfer was being served
    RELEASED = "released"                      # the prefill application released the lease mid-transfer
    ALREADY_PULLED = "already_pulled"          # PULL: every pull the transfer was published for is taken, or
                                               # a newer PULL of the same heads (another peer) took this one over
    INTERNAL = "internal"                      # handling the peer's message raised (msg names the error)


@dataclass
class Header:
    """Decoded header frame; every field validated by :func:`decode_header`."""

    type: MsgType
    seq: int = 0
    tid: str = ""
    layer: int = 0
    nlay: int = 1
    first: int = 0
    nblk: int = 0
    heads: tuple = (0, 0)
    nbytes: list = field(default_factory=list)
    checksums: list = field(default_factory=list)
    last: bool = False
    desc: dict | None = None
    ok: bool = True
    code: str = ""
    msg: str = ""
    diffs: list = field(default_factory=list)
    xfers: list = field(default_factory=list)
    sums: list = field(default_factory=list)
    sum: str = ""
    nixl: dict | None = None
    plane: str = ""
    at: int | None = None
    lanes: int = 0
    peer: bytes = b""
    placement: int | None = None     # BLOCKS ``hxx`` as received (encode_header computes its own)
    version: int = PROTOCOL_VERSION

    @property
    def algorithm(self) -> str:
        """Checksum algorithm of the ``xxh`` entries (BLOCKS): ``sum``, or xxh3_64 when absent."""
        return self.sum or CHECKSUM


# header key -> (Header attribute, expected python type(s))
_KEYS = {
    "seq": ("seq", int), "tid": ("tid", str), "layer": ("layer", int), "nlay": ("nlay", int),
    "first": ("first", int),
    "nblk": ("nblk", int), "heads": ("heads", list), "nbytes": ("nbytes", list),
    "xxh": ("checksums", list), "last": ("last", bool), "desc": ("desc", dict), "ok": ("ok", bool),
    "code": ("code", str), "msg": ("msg", str), "diffs": ("diffs", list),
    "xfers": ("xfers", list), "sums": ("sums", list), "sum": ("sum", str),
    "nixl": ("nixl", dict), "plane": ("plane", str), "at": ("at", int), "lanes": ("lanes", int),
    "peer": ("peer", bytes),
}
# keys each message type must carry
_REQUIRED = {
    MsgType.HELLO: ("desc",),
    MsgType.HELLO_ACK: ("desc", "ok"),
    MsgType.PULL: ("tid", "nblk", "heads"),
    MsgType.BLOCKS: ("tid", "layer", "nlay", "first", "nblk", "heads", "nbytes", "xxh", "last"),
    MsgType.ACK: ("tid", "ok"),
    MsgType.ABORT: ("tid",),
    MsgType.ERROR: ("code",),
    MsgType.PING: (),
    MsgType.PONG: (),
    MsgType.DESCRIBE: (),
    MsgType.LANE: ("peer", "lanes"),
}
_DEFAULTS = Header(MsgType.PING)
_MAX_TYPE = max(MsgType)


def placement_checksum(h: Header) -> int:
    """``hxx`` of a BLOCKS header: xxh3_64 (seed 0) of the msgpack array ``[tid, layer, nlay,
    first, nblk, [lo, hi], nbytes, xxh, sum, at]`` (``sum`` "" and ``at`` nil where absent). The
    payload checksums say the bytes are intact; this says the header that places them is: a
    corrupted ``first``, ``layer`` or ``tid`` would otherwise put intact bytes in the wrong blocks."""
    fields = [h.tid, h.layer, h.nlay, h.first, h.nblk, [h.heads[0], h.heads[1]], list(h.nbytes),
              list(h.checksums), h.sum, h.at]
    return xxhash.xxh3_64_intdigest(msgpack.packb(fields, use_bin_type=True))


def checksum(buf, algorithm: str = CHECKSUM) -> int:
    """Checksum of a buffer (bytes, memoryview, numpy array, zmq Frame buffer): xxh3_64, or
    ``mix64`` (docs/PROTOCOL.md, "Checksums"; its host reference is slower than xxh3, so
    endpoints choose it only when a GPU computes it)."""
    if algorithm == CHECKSUM:
        return xxhash.xxh3_64_intdigest(buf)
    if algorithm == MIX64:
        return mix64_ref.mix64(buf)
    raise CorruptFrameError(f"checksum algorithm: expected one of {list(CHECKSUMS)}, got {algorithm!r}")


def choose_checksum(offered: list, supported: tuple) -> str:
    """The algorithm a prefill uses for a peer that offered ``offered`` (HELLO ``sums``, the
    peer's preference order; empty for a peer that does not negotiate): the first offered one
    that this side lists in ``supported``, else xxh3_64 (which every peer accepts)."""
    for name in offered:
        if name in supported:
            return name
    return CHECKSUM


def checksum_stream():
    """Incremental xxh3_64: ``update(piece)`` over consecutive pieces of one frame, then
    ``intdigest()`` equals :func:`checksum` of the whole frame (lets a sender hash each
    piece while it is still in cache, right after copying it)."""
    return xxhash.xxh3_64()


def encode_header(h: Header) -> bytes:
    """Encode a header to its msgpack frame (the keys its type uses, plus ``v, t, seq`` and
    ``tid`` where set)."""
    out = {"v": h.version, "t": int(h.type), "seq": h.seq}
    optional = tuple(k for k, on in (("msg", h.msg), ("diffs", h.diffs), ("code", h.code),
                                     ("desc", h.desc), ("xfers", h.xfers), ("sums", h.sums),
                                     ("sum", h.sum), ("nixl", h.nixl), ("plane", h.plane),
                                     ("lanes", h.lanes), ("peer", h.peer)) if on)
    optional += ("at",) if h.at is not None else ()
    for key in dict.fromkeys(_REQUIRED[MsgType(h.type)] + optional):
        attr = _KEYS[key][0]
        val = getattr(h, attr)
        out[key] = list(val) if key == "heads" else val
    if h.type == MsgType.BLOCKS and h.version >= 4:
        out["hxx"] = placement_checksum(h)
    if h.tid:   # any type may name a transfer (ERROR does when it is about one): sent as decoded
        out["tid"] = h.tid
    return msgpack.packb(out, use_bin_type=True)


def _fail(name: str, expected: str, got) -> CorruptFrameError:
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CorruptFrameError(f"header field {name!r}: expected {expected}, got {shown}")


def _check_int(name: str, v, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _fail(name, f"int in [{lo}, {hi}]", v)
    return v


def _unpack(buf):
    """The msgpack value of a header frame, within the header's bounds (size, string, list and
    map lengths); CorruptFrameError otherwise."""
    n = len(buf)
    if n > MAX_HEADER_BYTES:
        raise CorruptFrameError(f"header frame: expected <= {MAX_HEADER_BYTES} bytes, got {n}")
    try:
        return msgpack.unpackb(bytes(buf), raw=False, strict_map_key=True,
                               max_str_len=1 << 16, max_bin_len=1 << 16, max_array_len=MAX_LIST_LEN,
                               max_map_len=256)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise CorruptFrameError(f"header frame: not valid msgpack ({type(e).__name__}: {e})") from e


def decode_header(buf, versions: tuple = (PROTOCOL_VERSION,)) -> Header:
    """Decode and validate one header frame whose ``v`` is one of ``versions`` (the live
    protocol: only this version; dump files accept older versions with the same BLOCKS framing).

    Raises
    ------
    CorruptFrameError
        Oversized frame, undecodable msgpack, a missing key, or a field of the wrong
        type or range (the message names the field, expected vs got).
    ProtocolVersionError
        The header's ``v`` is not in ``versions``.
    """
    raw = _unpack(buf)
    if not isinstance(raw, dict):
        raise _fail("<header>", "a map", raw)
    version = raw.get("v")
    if version not in versions or type(version) is not int:  # 1.0 and True == 1 too
        if not isinstance(version, int) or isinstance(version, bool):
            raise _fail("v", "int protocol version", version)
        want = " or ".join(map(str, versions))
        raise ProtocolVersionError(f"header field 'v': expected protocol version {want}, got {version}")
    t = raw.get("t")
    try:
        mtype = MsgType(_check_int("t", t, 1, _MAX_TYPE))
    except ValueError as e:
        raise _fail("t", f"a MsgType in {[int(m) for m in MsgType]}", t) from e
    h = Header(mtype, version=version)
    missing = [k for k in _REQUIRED[mtype] + ("seq",) if k not in raw]
    if missing:
        raise CorruptFrameError(f"{mtype.name} header: missing field(s) {missing}")
    for key, (attr, typ) in _KEYS.items():
        if key not in raw:
            continue
        v = raw[key]
        if typ is int:
            v = _check_int(key, v)
        elif not isinstance(v, typ):
            raise _fail(key, typ.__name__, v)
        setattr(h, attr, v)
    if len(h.tid) > MAX_TID_CHARS:
        raise _fail("tid", f"<= {MAX_TID_CHARS} chars", f"{len(h.tid)} chars")
    if "heads" in raw:
        hd = raw["heads"]
        if len(hd) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in hd) \
                or not 0 <= hd[0] <= hd[1] < (1 << 31):
            raise _fail("heads", "[lo, hi] ints with 0 <= lo <= hi", hd)
        h.heads = (hd[0], hd[1])
    for i, v in enumerate(h.nbytes):   # in any message that carries them, not only BLOCKS
        _check_int(f"nbytes[{i}]", v, 0, MAX_PAYLOAD_BYTES)
    for i, v in enumerate(h.checksums):
        _check_int(f"xxh[{i}]", v, 0, (1 << 64) - 1)
    if mtype == MsgType.BLOCKS:
        _check_int("nlay", h.nlay, 1, MAX_LIST_LEN)
        if len(h.nbytes) != len(h.checksums):
            raise _fail("xxh", f"{len(h.nbytes)} checksums (one per nbytes entry)", len(h.checksums))
        if "hxx" in raw or version >= 4:   # required from v4; older dumps' headers have none
            if "hxx" not in raw:
                raise CorruptFrameError("BLOCKS header: missing field(s) ['hxx']")
            h.placement = _check_int("hxx", raw["hxx"], 0, (1 << 64) - 1)
            want = placement_checksum(h)
            if h.placement != want:
                raise CorruptFrameError(
                    f"BLOCKS {h.tid!r} header field 'hxx': expected {want:#018x} (the checksum of tid, layer, "
                    f"nlay, first, nblk, heads, nbytes, xxh, sum, at), got {h.placement:#018x}")
    if "lanes" in raw:
        _check_int("lanes", h.lanes, 0, MAX_LANES)
    if len(h.peer) > 255:   # a ZeroMQ routing id is 1..255 bytes
        raise _fail("peer", "a routing id of at most 255 bytes", f"{len(h.peer)} bytes")
    if len(h.sums) > 16 or not all(isinstance(x, str) and len(x) <= 64 for x in h.sums):
        raise _fail("sums", "at most 16 algorithm names (str)", h.sums)
    return h


def blocks_tid(buf) -> str | None:
    """The transfer a header frame that :func:`decode_header` refused names, where it still
    parses (within a header's bounds) as a BLOCKS header with a ``tid`` string; else None.
    A receiver uses it only to fail that transfer early: its message is lost either way."""
    try:
        raw = _unpack(buf)
    except CorruptFrameError:
        return None
    if not isinstance(raw, dict) or raw.get("t") != int(MsgType.BLOCKS) or type(raw.get("t")) is not int:
        return None
    tid = raw.get("tid")
    return tid if isinstance(tid, str) and 0 < len(tid) <= MAX_TID_CHARS else None


def payload_cells(layer: int, nlay: int, first: int, nblk: int, n: int) -> tuple[int, int] | None:
    """The cells ``[a, b)`` of a pull of ``n`` blocks (cell ``layer·n + position``, layer-major:
    the order of the pull's whole payload, "BLOCKS") that a message of layers ``layer ..
    layer + nlay - 1`` x positions ``first .. first + nblk - 1`` carries, when its payload is one
    stretch of that whole payload (one layer, or every position); None when it is not. Messages
    whose stretches follow each other (``a`` of the next = ``b`` of the one before) concatenate to
    one stretch, whatever layers they cross: one device pass can gather or verify them together."""
    if nlay == 1 or (first == 0 and nblk == n):
        a = layer * n + first
        return a, a + (nlay - 1) * n + nblk
    return None


def encode_message(h: Header, payloads=()) -> list:
    """Frames of one message: the header, then each payload buffer as is (zero copy).

    For BLOCKS, ``nbytes`` and ``checksums`` (algorithm ``h.algorithm``) are filled from
    ``payloads`` here, so a sender cannot announce a count or checksum that differs from what
    it sends.
    """
    payloads = list(payloads)
    if payloads:
        h.nbytes = [memoryview(p).nbytes for p in payloads]
        h.checksums = [checksum(p, h.algorithm) for p in payloads]
    return [encode_header(h), *payloads]


def check_frames(h: Header, payloads, expected_nbytes: list[int] | None = None) -> None:
    """Check the number and byte counts of a BLOCKS message's payload frames (not checksums).

    Raises
    ------
    CorruptFrameError
        Wrong number of frames, or a truncated / oversized frame (named by index).
    """
    if len(payloads) != len(h.nbytes):
        raise CorruptFrameError(
            f"BLOCKS {h.tid!r} layer {h.layer}: expected {len(h.nbytes)} payload frames, got {len(payloads)}")
    if expected_nbytes is not None and list(expected_nbytes) != list(h.nbytes):
        raise CorruptFrameError(
            f"BLOCKS {h.tid!r} layer {h.layer} field 'nbytes': expected {list(expected_nbytes)} "
            f"(from the layout), got {h.nbytes}")
    for i, (p, n) in enumerate(zip(payloads, h.nbytes)):
        got = memoryview(p).nbytes
        if got != n:
            kind = "truncated" if got < n else "oversized"
            raise CorruptFrameError(
                f"BLOCKS {h.tid!r} layer {h.layer} payload frame {i} {kind}: expected {n} bytes, got {got}")


def check_checksum(h: Header, i: int, got: int) -> None:
    """Raise :class:`CorruptFrameError` unless ``got`` is payload frame ``i``'s checksum in ``h``."""
    if got != h.checksums[i]:
        raise CorruptFrameError(
            f"BLOCKS {h.tid!r} layer {h.layer} payload frame {i} checksum ({h.algorithm}): "
            f"expected {h.checksums[i]:#018x}, got {got:#018x}")


def verify_payloads(h: Header, payloads, expected_nbytes: list[int] | None = None) -> None:
    """Check payload frames against their header before a byte is used.

    Parameters
    ----------
    h : Header
        A decoded BLOCKS header.
    payloads : sequence of buffers
        The frames that followed the header.
    expected_nbytes : list of int, optional
        Byte counts the receiver derived from its own layout; each must equal the
        header's, so a header cannot make the receiver accept more or fewer bytes.

    Raises
    ------
    CorruptFrameError
        Naming the frame: wrong number of frames, truncated/oversized frame, bad checksum.
    """
    check_frames(h, payloads, expected_nbytes)
    for i, p in enumerate(payloads):
        check_checksum(h, i, checksum(p, h.algorithm))
