"""Dump file format: the connector's BLOCKS messages written to a file, with a header and an index.

A dump is what the connector would have sent for a transfer of the chosen (layer, block)
pairs, one BLOCKS message per pair, each frame preceded by its length (see docs/DUMP.md)::

    magic     8 bytes  b"\\x93KVDUMP\\n"
    version   u32 LE   DUMP_FORMAT_VERSION
    hdr_len   u32 LE   <= MAX_FILE_HEADER_BYTES
    header    msgpack  {"format", "protocol", "checksum", "desc", "fingerprint", "tid",
                        "layers", "block_ids", "meta"[, "key_offsets"]}
    hdr_xxh   u64 LE   xxh3_64(header)
    messages  for each layer in "layers", for each block in "block_ids" (position p):
                u64 LE len + BLOCKS header frame (kvconnector.protocol), then
                u64 LE len + payload frame: the block's bytes, 2·N·H·P, all local heads
    footer    u64 LE len + msgpack {"n": messages, "offsets": [byte offset of each message]}
    trailer   u64 LE offset of the footer's length field, then b"\\nPMUDVK\\x93"

Every length is checked against its bound (header frames: ``MAX_HEADER_BYTES``; payloads:
exactly the layout's block bytes) and against the bytes left in the file *before* anything
is allocated; every failure is a :class:`~layouts.CorruptFrameError` (or
:class:`~layouts.ProtocolVersionError` / :class:`~layouts.LayoutError`) naming the layer,
block, frame and byte offset.

A dump of a smoothed INT4 cache (descriptor ``key_offset`` set) may carry the offsets themselves
in ``"key_offsets"`` (``layouts.KeyOffsets`` JSON, checked against the descriptor's fingerprint
on read), so ``kvconnector inspect`` can add ``m`` back to the keys it shows.
"""

from __future__ import annotations

import operator
import os
import struct
from dataclasses import dataclass, field

import msgpack
import torch

from kvconnector.blocks import gather_blocks
from kvconnector.files import PartFile
from kvconnector.protocol import (CHECKSUM, MAX_HEADER_BYTES, PROTOCOL_VERSION, Header, MsgType,
                                  checksum, decode_header, encode_message, verify_payloads)
from layouts import CorruptFrameError, KeyOffsets, LayoutDescriptor, LayoutError, ProtocolVersionError

MAGIC = b"\x93KVDUMP\n"          # high bit and newline catch 7-bit and text-mode mangling
END_MAGIC = b"\nPMUDVK\x93"
DUMP_FORMAT_VERSION = 1
# Protocol versions a dump may follow: their BLOCKS framing is the same (3 added DESCRIBE only;
# 4 the BLOCKS header's placement checksum, checked wherever a header carries one).
READABLE_PROTOCOLS = (2, 3, 4)
MAX_FILE_HEADER_BYTES = 64 << 20  # a header lists layers and block ids: 64 MiB is ~10M ids
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class DumpInfo:
    """What a dump's file header says."""

    desc: LayoutDescriptor
    layers: list[int]
    block_ids: list[int]
    tid: str = "dump"
    meta: dict = field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION
    key_offsets: KeyOffsets | None = None  # the offsets named by desc.key_offset, when the dump carries them

    @property
    def fingerprint(self) -> str:
        return self.desc.fingerprint()

    @property
    def num_messages(self) -> int:
        return len(self.layers) * len(self.block_ids)

    def where(self, message_idx: int) -> tuple[int, int]:
        """(layer, block id) that message ``message_idx`` must carry."""
        nb = len(self.block_ids)
        return self.layers[message_idx // nb], self.block_ids[message_idx % nb]


@dataclass
class DumpRecord:
    """One verified (layer, block) of a dump: the decoded header and the payload bytes."""

    layer: int
    block_id: int
    message_idx: int
    offset: int               # byte offset of the message's first length field
    header: Header
    payload: bytearray        # 2·N·H·P bytes, the block as stored in the cache

    def block(self, desc: LayoutDescriptor) -> torch.Tensor:
        """``[2, block_size, num_kv_heads, P]`` storage-dtype CPU tensor over the payload."""
        geo = desc.geometry()
        t = torch.frombuffer(self.payload, dtype=torch.uint8)
        return t.view(geo.storage_dtype).view(geo.shape(1)[1:])


def _check_selection(desc: LayoutDescriptor, layers, block_ids) -> tuple[list[int], list[int]]:
    try:  # operator.index: ints (numpy/torch ints too), never floats, strs or lists
        layers, block_ids = [operator.index(x) for x in layers], [operator.index(x) for x in block_ids]
    except TypeError as e:
        raise LayoutError(f"dump layers/block_ids: expected lists of ints ({e})") from e
    for name, ids, n in (("layers", layers, desc.num_layers), ("block_ids", block_ids, desc.num_blocks)):
        if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
            raise LayoutError(f"dump {name}: expected distinct ids in [0, {n}), got {ids[:16]}"
                              + ("..." if len(ids) > 16 else ""))
    return layers, block_ids


class DumpWriter:
    """Write a dump file block by block (context manager; the footer is written on close).

    Blocks must come in the header's order: for each layer, each block id. The file is written
    whole or not at all (:mod:`kvconnector.files`): it appears at ``path`` on close.
    """

    def __init__(self, path, desc: LayoutDescriptor, layers, block_ids, tid: str = "dump",
                 meta: dict | None = None, key_offsets: KeyOffsets | None = None):
        layers, block_ids = _check_selection(desc, layers, block_ids)
        _check_key_offsets(desc, key_offsets, LayoutError)
        self.info = DumpInfo(desc, layers, block_ids, tid, dict(meta or {}), key_offsets=key_offsets)
        self.geo = desc.geometry()
        self._offsets: list[int] = []
        self._file = PartFile(path)
        self._f = self._file.f
        try:
            self._write_header(desc, layers, block_ids, tid, key_offsets)
        except BaseException:
            self._file.discard()
            raise

    def _write_header(self, desc, layers, block_ids, tid, key_offsets) -> None:
        fields = {
            "format": DUMP_FORMAT_VERSION, "protocol": PROTOCOL_VERSION, "checksum": CHECKSUM,
            "desc": desc.to_dict(), "fingerprint": desc.fingerprint(), "tid": tid,
            "layers": layers, "block_ids": block_ids, "meta": self.info.meta,
        }
        if key_offsets is not None:
            fields["key_offsets"] = key_offsets.to_json()
        hdr = msgpack.packb(fields, use_bin_type=True)
        self._f.write(MAGIC + _U32.pack(DUMP_FORMAT_VERSION) + _U32.pack(len(hdr)) + hdr
                      + _U64.pack(checksum(hdr)))

    def write_block(self, layer: int, block_id: int, payload) -> None:
        """Append the BLOCKS message of (``layer``, ``block_id``).

        Parameters
        ----------
        payload : buffer or uint8 tensor of ``2·N·H·P`` bytes (CPU; a CUDA tensor is copied)
        """
        i = len(self._offsets)
        if i >= self.info.num_messages or (layer, block_id) != self.info.where(i):
            want = self.info.where(i) if i < self.info.num_messages else "nothing (all written)"
            raise LayoutError(f"dump message {i}: expected (layer, block) {want}, got {(layer, block_id)}")
        if isinstance(payload, torch.Tensor):
            payload = payload.detach().cpu().contiguous().view(torch.uint8).numpy()
        if memoryview(payload).nbytes != self.geo.block_bytes:
            raise LayoutError(f"dump layer {layer} block {block_id}: expected {self.geo.block_bytes} "
                              f"bytes, got {memoryview(payload).nbytes}")
        d = self.info.desc
        h = Header(MsgType.BLOCKS, version=PROTOCOL_VERSION, seq=i, tid=self.info.tid, layer=layer, first=i % len(self.info.block_ids),
                   nblk=1, heads=(d.head_start, d.head_start + d.num_kv_heads),
                   last=i == self.info.num_messages - 1)
        self._offsets.append(self._f.tell())
        for frame in encode_message(h, [payload]):
            self._f.write(_U64.pack(memoryview(frame).nbytes))
            self._f.write(frame)

    def close(self) -> None:
        """Write the footer and put the file in place (``path``); on any failure the part file
        is removed and the error raised."""
        if self._f.closed:
            return
        try:
            if len(self._offsets) != self.info.num_messages:
                raise LayoutError(f"dump closed after {len(self._offsets)} of {self.info.num_messages} blocks")
            footer_at = self._f.tell()
            footer = msgpack.packb({"n": len(self._offsets), "offsets": self._offsets}, use_bin_type=True)
            self._f.write(_U64.pack(len(footer)) + footer + _U64.pack(footer_at) + END_MAGIC)
        except BaseException:
            self._file.discard()
            raise
        self._file.commit()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._file.discard()


def _check_key_offsets(desc: LayoutDescriptor, key_offsets, error) -> None:
    """Offsets go with a descriptor that names them, and only with one (``error``: the type raised)."""
    if key_offsets is not None and key_offsets.fingerprint != desc.key_offset:
        raise error(f"dump key_offsets: fingerprint {key_offsets.fingerprint}, expected the descriptor's "
                    f"key_offset {desc.key_offset!r}")


def write_dump(path, caches, desc: LayoutDescriptor, layers=None, block_ids=None, tid: str = "dump",
               meta: dict | None = None, progress: bool = False, key_offsets: KeyOffsets | None = None) -> DumpInfo:
    """Dump chosen layers and blocks of a cache held in this process.

    Parameters
    ----------
    caches : sequence (indexed by layer) of [num_blocks, 2, block_size, num_kv_heads, P]
        Packed per-layer caches in ``desc``'s storage dtype, CPU or CUDA (read only).
    desc : LayoutDescriptor of the caches
    layers, block_ids : sequences of int, optional
        What to dump (all layers / all ``desc.num_blocks`` blocks when None).
    progress : bool
        Show a tqdm bar (to stderr).
    key_offsets : layouts.KeyOffsets, optional
        The offsets a smoothed INT4 cache was written with (fingerprint = ``desc.key_offset``),
        stored in the header so readers can add ``m`` back to the keys.
    """
    layers = range(desc.num_layers) if layers is None else layers
    block_ids = range(desc.num_blocks) if block_ids is None else block_ids
    geo = desc.geometry()
    with DumpWriter(path, desc, layers, block_ids, tid, meta, key_offsets) as w:
        pairs = [(l, b) for l in w.info.layers for b in w.info.block_ids]
        if progress:
            from tqdm import tqdm
            pairs = tqdm(pairs, desc="dump", unit="block")
        for layer, b in pairs:
            w.write_block(layer, b, gather_blocks(caches[layer], geo, [b]))
    return w.info


class DumpReader:
    """Read a dump: its header on open, then its verified blocks in file order.

    Nothing is trusted: lengths are bounded before allocation, every header frame is
    decoded by :func:`kvconnector.protocol.decode_header`, every payload checked by
    :func:`~kvconnector.protocol.verify_payloads` against the layout's byte count.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._f = open(self.path, "rb")
        self.size = os.fstat(self._f.fileno()).st_size
        try:
            self.info = self._read_file_header()
        except BaseException:
            self._f.close()
            raise
        self._body_at = self._f.tell()
        self._offsets: list[int] | None = None
        self._index: dict | None = None

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def close(self) -> None:
        self._f.close()

    def _read(self, n: int, what: str) -> bytes:
        at = self._f.tell()
        if n > self.size - at:
            raise CorruptFrameError(f"{what} at byte {at}: truncated, expected {n} bytes, "
                                    f"file has {self.size - at} left")
        return self._f.read(n)

    def _read_file_header(self) -> DumpInfo:
        magic = self._read(len(MAGIC), "magic") if self.size >= len(MAGIC) else self._f.read()
        if magic != MAGIC:
            raise CorruptFrameError(f"not a kvconnector dump: magic expected {MAGIC!r}, got {magic!r}")
        version, n = _U32.unpack(self._read(4, "format version"))[0], _U32.unpack(self._read(4, "header length"))[0]
        if version != DUMP_FORMAT_VERSION:
            raise ProtocolVersionError(f"dump format version: expected {DUMP_FORMAT_VERSION}, got {version}")
        if n > MAX_FILE_HEADER_BYTES:
            raise CorruptFrameError(f"file header length: expected <= {MAX_FILE_HEADER_BYTES}, got {n}")
        blob = self._read(n, "file header")
        want = _U64.unpack(self._read(8, "file header checksum"))[0]
        if checksum(blob) != want:
            raise CorruptFrameError(f"file header checksum ({CHECKSUM}): expected {want:#018x}, "
                                    f"got {checksum(blob):#018x}")
        try:
            h = msgpack.unpackb(blob, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on bad input
            raise CorruptFrameError(f"file header: not valid msgpack ({type(e).__name__}: {e})") from e
        if not isinstance(h, dict) or not {"protocol", "desc", "fingerprint", "tid", "layers",
                                           "block_ids"} <= set(h):
            raise CorruptFrameError("file header: missing fields (protocol, desc, fingerprint, tid, layers, block_ids)")
        if h["protocol"] not in READABLE_PROTOCOLS:
            raise ProtocolVersionError(f"dump protocol version: expected one of {list(READABLE_PROTOCOLS)}, "
                                       f"got {h['protocol']}")
        desc = LayoutDescriptor.from_dict(h["desc"])
        if desc.fingerprint() != h["fingerprint"]:
            raise CorruptFrameError(f"file header fingerprint: descriptor hashes to {desc.fingerprint()}, "
                                    f"header says {h['fingerprint']!r}")
        if not isinstance(h["tid"], str) or not all(isinstance(x, list) for x in (h["layers"], h["block_ids"])):
            raise CorruptFrameError("file header: tid must be a str, layers and block_ids lists")
        layers, block_ids = _check_selection(desc, h["layers"], h["block_ids"])
        n_msg, left = len(layers) * len(block_ids), self.size - self._f.tell()
        if n_msg * (16 + desc.block_bytes) > left:  # bound index()/footer sizes by the file's
            raise CorruptFrameError(f"file header lists {n_msg} messages of >= {16 + desc.block_bytes} "
                                    f"bytes each, file has {left} bytes left")
        meta = h.get("meta") if isinstance(h.get("meta"), dict) else {}
        key_offsets = None
        if "key_offsets" in h:
            try:
                key_offsets = KeyOffsets.from_json(h["key_offsets"], "file header key_offsets")
            except LayoutError as e:
                raise CorruptFrameError(str(e)) from e
            _check_key_offsets(desc, key_offsets, CorruptFrameError)
        return DumpInfo(desc, layers, block_ids, h["tid"], meta, h["protocol"], key_offsets)

    def _frame(self, bound: int, what: str) -> bytearray:
        at = self._f.tell()
        n = _U64.unpack(self._read(8, f"{what} length"))[0]
        if n > bound:
            raise CorruptFrameError(f"{what} at byte {at}: length {n} exceeds the bound {bound}")
        left = self.size - self._f.tell()
        if n > left:
            raise CorruptFrameError(f"{what} at byte {at}: truncated, expected {n} bytes, file has {left} left")
        buf = bytearray(n)
        self._f.readinto(buf)
        return buf

    def _message(self, i: int) -> DumpRecord:
        layer, block_id = self.info.where(i)
        at = self._f.tell()
        where = f"layer {layer} block {block_id} (message {i}, frame {2 * i}, byte {at})"
        try:
            h = decode_header(self._frame(MAX_HEADER_BYTES, "header frame"), versions=READABLE_PROTOCOLS)
            if h.type != MsgType.BLOCKS:
                raise CorruptFrameError(f"message type: expected BLOCKS, got {h.type.name}")
            d = self.info.desc
            expect = {"layer": layer, "nlay": 1, "first": i % len(self.info.block_ids), "nblk": 1, "seq": i,
                      "tid": self.info.tid, "heads": (d.head_start, d.head_start + d.num_kv_heads),
                      "last": i == self.info.num_messages - 1}
            for k, v in expect.items():
                if getattr(h, k) != v:
                    raise CorruptFrameError(f"header field {k!r}: expected {v!r}, got {getattr(h, k)!r}")
            where = f"layer {layer} block {block_id} (message {i}, frame {2 * i + 1}, byte {self._f.tell()})"
            payload = self._frame(d.block_bytes, "payload frame")
            verify_payloads(h, [payload], [d.block_bytes])
        except (CorruptFrameError, ProtocolVersionError) as e:
            raise type(e)(f"{where}: {e}") from e
        return DumpRecord(layer, block_id, i, at, h, payload)

    def __iter__(self):
        """Yield every :class:`DumpRecord` in file order, then check the footer and trailer."""
        self._f.seek(self._body_at)
        offsets = []
        for i in range(self.info.num_messages):
            offsets.append(self._f.tell())
            yield self._message(i)
        self._check_footer(offsets)

    def _check_footer(self, offsets: list[int]) -> None:
        footer_at = self._f.tell()
        want = msgpack.packb({"n": len(offsets), "offsets": offsets}, use_bin_type=True)
        if self._read_footer(footer_at)[1] != want:   # byte-exact: every flipped byte is caught
            raise CorruptFrameError(f"footer at byte {footer_at}: index does not match the messages "
                                    f"(expected n={len(offsets)}, offsets {offsets[:4]}...)")
        trailer = self._read(16, "trailer")
        if _U64.unpack(trailer[:8])[0] != footer_at or trailer[8:] != END_MAGIC:
            raise CorruptFrameError(f"trailer: expected footer offset {footer_at} and end magic, got {trailer!r}")
        if self.size != self._f.tell():
            raise CorruptFrameError(f"{self.size - self._f.tell()} unexpected bytes after the trailer")

    def _read_footer(self, footer_at: int) -> tuple[list[int], bytearray]:
        """The footer's message offsets (checked to lie inside the message section) and bytes."""
        self._f.seek(footer_at)
        blob = self._frame(64 + 10 * self.info.num_messages, "footer")  # msgpack: <= 9 bytes per offset
        try:
            offsets = [int(x) for x in msgpack.unpackb(bytes(blob), raw=False)["offsets"]]
        except Exception as e:  # malformed footer: any decode/key/type failure
            raise CorruptFrameError(f"footer at byte {footer_at}: unreadable index ({e})") from e
        if len(offsets) != self.info.num_messages or any(not self._body_at <= o < footer_at for o in offsets):
            raise CorruptFrameError(f"footer at byte {footer_at}: expected {self.info.num_messages} offsets "
                                    f"inside the message section, got {len(offsets)}")
        return offsets, blob

    def index(self) -> dict[tuple[int, int], int]:
        """(layer, block id) -> message index, from the header's order (no I/O)."""
        return {self.info.where(i): i for i in range(self.info.num_messages)}

    def read_block(self, layer: int, block_id: int) -> DumpRecord:
        """Read and verify one (layer, block) by seeking to its message via the footer index."""
        if self._index is None:
            self._index = self.index()
        i = self._index.get((layer, block_id))
        if i is None:
            raise LayoutError(f"dump holds no (layer {layer}, block {block_id})")
        if self._offsets is None:
            self._f.seek(max(self._body_at, self.size - 16))
            footer_at = _U64.unpack(self._read(8, "trailer"))[0]
            if self._read(8, "end magic") != END_MAGIC or not self._body_at <= footer_at < self.size:
                raise CorruptFrameError("trailer: no end magic or footer offset outside the file (truncated?)")
            self._offsets = self._read_footer(footer_at)[0]
        self._f.seek(self._offsets[i])
        return self._message(i)
