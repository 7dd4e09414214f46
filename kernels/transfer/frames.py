"""Payload frames on the device: gather + ``mix64`` in one pass, and verify-then-scatter.

``mix64`` (``layouts.checksum``, docs/PROTOCOL.md "Checksums") is a sum of independent word
hashes, so every program hashes its own tile of a frame and writes one partial sum; a
one-program kernel adds the partials of each frame and applies the final mix. Three kernels:

- :func:`_frame_sums_kernel` (``GATHER=True``): copies the rows of the requested blocks of
  ``nlay`` layers into a contiguous message buffer (layer-major, then block, then K/V half,
  token and head, as docs/PROTOCOL.md "BLOCKS" lays out a payload) and hashes the same bytes
  while they are in registers. ``GATHER=False``: hashes a received buffer.
- :func:`_finish_kernel`: per frame, partials -> checksum; when verifying, compares with the
  header's value, writes ``ok[f]`` and the count of mismatching frames in ``ok[num_frames]``.
- :func:`_scatter_kernel`: writes the message's rows into the destination blocks, masked off
  entirely unless that count is 0, so a corrupt message leaves the cache as it was and the
  host never has to look at a flag between verify and scatter.

Addressing: every layer is its own tensor, so the kernels take one base pointer (the first
layer's bytes) and a table of byte offsets of each layer from it; a payload byte ``go`` is
block ``g = go // blk_out`` (layer ``g // k``, position ``g % k``), row ``r // row_out`` of that
block slice, byte ``r % row_out`` of the row group; in the cache, the same byte sits at
``layer_off + block_id·block_stride + row·row_cache + head_off + within``. A buffer may hold a
stretch of that payload that starts at any (layer, position) cell (``start``: consecutive
messages of a pull, whatever layers they cross): the kernels add ``start`` to ``g``, so only
offsets inside the buffer are int32 arithmetic. Byte-granular
addressing keeps one kernel for every mode, head slice and row size (``P`` need not be a
multiple of 8); the GPU does this far faster than a socket moves the bytes.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from layouts import LayoutError
from layouts import checksum as ref

from .._jit import cdiv, dual_jit

# the checksum's constants (layouts/checksum.py) as constexpr globals, the only globals a kernel may read
FMIX_M1 = tl.constexpr(ref.FMIX_M1)
FMIX_M2 = tl.constexpr(ref.FMIX_M2)
K_WORD = tl.constexpr(ref.K_WORD)
K_LENGTH = tl.constexpr(ref.K_LENGTH)

TILE_WORDS = 512        # words hashed by one program: 4 KiB, [512, 8] bytes in registers
SCATTER_BYTES = 4096    # bytes written by one scatter program
FINISH_BLOCK = 256      # partials added per step of the finishing loop


@triton.jit
def _fmix(z):
    """The 64-bit finalizer of ``mix64`` on uint64 values (a bijection)."""
    z = (z ^ (z >> 30)) * FMIX_M1
    z = (z ^ (z >> 27)) * FMIX_M2
    return z ^ (z >> 31)


@triton.jit
def _cache_offsets(go, mask, ids_ptr, layer_off_ptr, k, blk_out, row_out, row_cache, head_off, block_stride,
                   first_cell):
    """Byte offset (int64, from the base pointer) in the cache of byte ``go`` (int32) of a buffer
    that starts at payload cell ``first_cell``."""
    g = go // blk_out
    r = go - g * blk_out
    g += first_cell
    li = g // k
    pos = g - li * k
    row = r // row_out
    within = r - row * row_out
    bid = tl.load(ids_ptr + pos, mask=mask, other=0)              # int64 block id
    loff = tl.load(layer_off_ptr + li, mask=mask, other=0)        # int64 layer offset
    return loff + bid * block_stride + (row * row_cache + head_off + within).to(tl.int64)


# Every launch differs in block counts, frame sizes and buffer offsets: specializing on them
# (divisibility by 16, value 1, pointer alignment) would compile a new variant in the middle of
# a transfer, on an endpoint's I/O thread. One variant per constexpr set, compiled by warmup().
_SUMS_INTS = ["k", "blk_out", "row_out", "row_cache", "head_off", "block_stride", "tiles_per_frame", "first_cell"]
_SUMS_PTRS = ["cache_ptr", "layer_off_ptr", "ids_ptr", "buf_ptr", "frame_off_ptr", "frame_len_ptr", "partial_ptr"]


@dual_jit(do_not_specialize=_SUMS_INTS, do_not_specialize_on_alignment=_SUMS_PTRS)
def _frame_sums_kernel(
    cache_ptr,          # uint8 bytes of the first layer (GATHER only; base of the offsets)
    layer_off_ptr,      # [nlay] int64 byte offset of each layer's cache from cache_ptr
    ids_ptr,            # [k] int64 block ids, in transfer order
    buf_ptr,            # [total] uint8 message buffer: written (GATHER) or read
    frame_off_ptr,      # [num_frames] int64 byte offset of each frame in buf
    frame_len_ptr,      # [num_frames] int64 byte count of each frame
    partial_ptr,        # [num_frames, tiles_per_frame] int64 word sums (uint64 bits), written
    k, blk_out, row_out, row_cache, head_off, block_stride, tiles_per_frame,
    first_cell,         # payload cell (layer·k + position) buf starts at (GATHER)
    TILE_WORDS: tl.constexpr, GATHER: tl.constexpr,
):
    """Grid ``(num_frames, tiles_per_frame)``: program (f, t) takes words
    ``t·TILE_WORDS ..`` of frame f (one tile per program keeps every load independent; the
    partial sums are added by :func:`_finish_kernel`)."""
    f = tl.program_id(0)
    t = tl.program_id(1)
    flen = tl.load(frame_len_ptr + f).to(tl.int32)
    foff = tl.load(frame_off_ptr + f).to(tl.int32)
    w = t * TILE_WORDS + tl.arange(0, TILE_WORDS)                 # word index in the frame
    b = tl.arange(0, 8)
    o = w[:, None] * 8 + b[None, :]                               # byte in the frame: [TILE_WORDS, 8]
    m = o < flen
    go = foff + o
    if GATHER:
        src = _cache_offsets(go, m, ids_ptr, layer_off_ptr, k, blk_out, row_out, row_cache, head_off,
                             block_stride, first_cell)
        x = tl.load(cache_ptr + src, mask=m, other=0)
        tl.store(buf_ptr + go, x, mask=m)
    else:
        x = tl.load(buf_ptr + go, mask=m, other=0)
    # bytes hold disjoint bits of the little-endian word, so their sum is the word
    word = tl.sum(x.to(tl.uint64) << (b[None, :] * 8).to(tl.uint64), axis=1)   # [TILE_WORDS]
    mixed = _fmix(word + (w + 1).to(tl.uint64) * K_WORD)
    mixed = tl.where(w * 8 < flen, mixed, 0)                      # past the frame: no word
    tl.store(partial_ptr + f * tiles_per_frame + t, tl.sum(mixed, axis=0).to(tl.int64, bitcast=True))


@dual_jit(do_not_specialize=["num_frames", "tiles_per_frame"],
          do_not_specialize_on_alignment=["partial_ptr", "frame_len_ptr", "sums_ptr", "expected_ptr", "ok_ptr"])
def _finish_kernel(
    partial_ptr,        # [num_frames, tiles_per_frame] int64 word sums
    frame_len_ptr,      # [num_frames] int64
    sums_ptr,           # [num_frames] int64 checksums (uint64 bits), written
    expected_ptr,       # [num_frames] int64 checksums from the header (VERIFY only)
    ok_ptr,             # [num_frames + 1] int32, written (VERIFY only): 1 per matching frame, then the bad count
    num_frames, tiles_per_frame,
    BLOCK: tl.constexpr, VERIFY: tl.constexpr,
):
    """Grid ``(1,)``: frames are few per message (usually one), and one program can write the
    message's single mismatch count without atomics."""
    bad = 0
    for f in range(0, num_frames):
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for t0 in range(0, tiles_per_frame, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            p = tl.load(partial_ptr + f * tiles_per_frame + t, mask=t < tiles_per_frame, other=0)
            acc += p.to(tl.uint64, bitcast=True)
        length = tl.load(frame_len_ptr + f).to(tl.uint64)
        h = _fmix(tl.sum(acc, axis=0) ^ (length * K_LENGTH))
        tl.store(sums_ptr + f, h.to(tl.int64, bitcast=True))
        if VERIFY:
            want = tl.load(expected_ptr + f).to(tl.uint64, bitcast=True)
            good = (h == want).to(tl.int32)
            tl.store(ok_ptr + f, good)
            bad += 1 - good
    if VERIFY:
        tl.store(ok_ptr + num_frames, bad)


@dual_jit(do_not_specialize=["total", "k", "blk_out", "row_out", "row_cache", "head_off", "block_stride",
                              "first_cell"],
          do_not_specialize_on_alignment=["cache_ptr", "layer_off_ptr", "ids_ptr", "buf_ptr", "bad_ptr"])
def _scatter_kernel(
    cache_ptr,          # uint8 bytes of the first destination layer (base of the offsets)
    layer_off_ptr,      # [nlay] int64
    ids_ptr,            # [k] int64 destination block ids
    buf_ptr,            # [total] uint8 verified message
    bad_ptr,            # [1] int32 mismatching frames (from _finish_kernel): nothing is written unless 0
    total, k, blk_out, row_out, row_cache, head_off, block_stride,
    first_cell,         # payload cell (layer·k + position) buf starts at
    TILE: tl.constexpr,
):
    """Grid ``(cdiv(total, TILE),)``: program i writes message bytes ``i·TILE ..``."""
    o = tl.program_id(0) * TILE + tl.arange(0, TILE)
    bad = tl.full([TILE], 0, tl.int32) + tl.load(bad_ptr)        # as a tile: the interpreter refuses a scalar in a mask
    m = (o < total) & (bad == 0)
    x = tl.load(buf_ptr + o, mask=m, other=0)
    dst = _cache_offsets(o, m, ids_ptr, layer_off_ptr, k, blk_out, row_out, row_cache, head_off, block_stride,
                         first_cell)
    tl.store(cache_ptr + dst, x, mask=m)


# ---- launchers ----------------------------------------------------------------------------

_offset_tables: dict = {}     # (device, data_ptrs) -> int64 offsets on the device, built once per layer set


_side_streams: dict = {}


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A table kept across launches, copied on a side stream and waited for there, so it is
    complete for any stream that reads it later and the caller's (busy) stream is not drained."""
    if device.type != "cuda":
        return host
    side = _side_streams.setdefault(device, torch.cuda.Stream(device=device))
    with torch.cuda.stream(side):
        out = host.pin_memory().to(device, non_blocking=True)
    side.synchronize()
    out.record_stream(torch.cuda.current_stream(device))   # freed only after the caller's reads
    return out


class _LayerSet(NamedTuple):
    """What the kernels need of a list of per-layer caches, checked once for those tensor objects."""
    refs: tuple              # weak references to the tensors checked (a hit must be the same objects)
    row_bytes: int
    row_out: int             # one (half, token) row group of the payload
    row_cache: int
    head_off: int
    blk_out: int
    block_stride: int
    offsets: torch.Tensor    # [nlay] int64 byte offsets of each layer from layer 0, on the caches' device


_layer_sets: dict = {}        # (data_ptrs, heads) -> _LayerSet of the last tensors checked at those addresses


def _layer_set(caches, heads, what: str) -> _LayerSet:
    """The checked geometry of ``caches`` (a non-empty list) and ``heads``: made once per list of
    tensor objects and head range, so the connector's per-message launches skip the per-layer
    checks (each a few torch attribute calls; 70 µs for 32 layers) and make no torch call per layer
    (a hit compares object identities only). A cache moved or reshaped in place afterwards
    (``set_``, ``resize_``, ``as_strided_``) is not noticed, which the connector never does to its
    caches."""
    key = (tuple(map(id, caches)), heads)
    s = _layer_sets.get(key)
    if s is not None and len(s.refs) == len(caches) and all(r() is c for r, c in zip(s.refs, caches)):
        return s
    ptrs = tuple(c.data_ptr() for c in caches)
    c0 = caches[0]
    shape0, stride0, dtype0, device0 = c0.shape, c0.stride(), c0.dtype, c0.device
    for i, c in enumerate(caches):
        if c.dim() != 5 or c.shape != shape0 or c.dtype != dtype0 or c.device != device0 or c.stride() != stride0:
            raise LayoutError(f"{what}[{i}]: expected {tuple(shape0)} {dtype0} on {device0} with the "
                              f"strides of layer 0, got {tuple(c.shape)} {c.dtype} on {c.device}")
    es = c0.element_size()
    _, two, n, h_all, p = shape0
    if two != 2 or stride0[4] != 1 or stride0[3] != p or stride0[2] != h_all * p or stride0[1] != n * h_all * p:
        raise LayoutError(f"{what}: expected packed [num_blocks, 2, N, H, P] caches, got shape "
                          f"{tuple(shape0)} strides {stride0}")
    lo, hi = (0, h_all) if heads is None else (heads[0], heads[1])
    if not 0 <= lo < hi <= h_all:
        raise LayoutError(f"heads: expected a range inside [0, {h_all}), got [{lo}, {hi})")
    row_bytes = p * es
    row_out = (hi - lo) * row_bytes
    okey = (device0, ptrs)
    offs = _offset_tables.get(okey)
    if offs is None:
        if len(_offset_tables) > 256:
            _offset_tables.clear()
        host = torch.tensor([ptr - ptrs[0] for ptr in ptrs], dtype=torch.int64)
        offs = _offset_tables[okey] = _to_device(host, device0)
    if len(_layer_sets) > 256:
        _layer_sets.clear()
    s = _layer_sets[key] = _LayerSet(tuple(weakref.ref(c) for c in caches), row_bytes, row_out, h_all * row_bytes,
                                     lo * row_bytes, 2 * n * row_out, stride0[0] * es, offs)
    return s


class _Layers:
    """The byte geometry the kernels need for one launch over a buffer of ``nbytes`` bytes: the
    caches' (:func:`_layer_set`), the block ids', and where the buffer starts in their payload.

    ``start`` None: the buffer is the whole layer-major payload of ``caches`` x ``block_ids``;
    else it holds whole (layer, position) cells of it from cell ``start`` (``layer·k + position``,
    kept as ``first_cell``) on."""

    def __init__(self, caches, heads, block_ids: torch.Tensor, what: str, nbytes: int, name: str,
                 start: int | None = None) -> None:
        if not caches:
            raise LayoutError(f"{what}: expected at least one layer, got none")
        s = _layer_set(caches, None if heads is None else (heads[0], heads[1]), what)
        c0 = caches[0]
        if block_ids.dtype != torch.int64 or block_ids.dim() != 1 or block_ids.device != c0.device:
            raise LayoutError(f"block_ids: expected a 1-D int64 tensor on {c0.device}, got "
                              f"{block_ids.dtype} {tuple(block_ids.shape)} on {block_ids.device}")
        self.row_bytes, self.row_out, self.row_cache, self.head_off = s.row_bytes, s.row_out, s.row_cache, s.head_off
        self.blk_out, self.block_stride, self.offsets = s.blk_out, s.block_stride, s.offsets
        self.k = int(block_ids.numel())
        cells = len(caches) * self.k
        self.total, self.first_cell = cells * self.blk_out, 0
        if start is not None:
            n_cells = nbytes // self.blk_out if self.blk_out else 0
            if not (0 <= start < cells and n_cells > 0 and n_cells * self.blk_out == nbytes
                    and start + n_cells <= cells):
                raise LayoutError(f"{name}: expected whole cells of {self.blk_out} bytes from cell {start} within "
                                  f"{cells} cells ({len(caches)} layers x {self.k} blocks), got {nbytes} bytes")
            self.first_cell, self.total = start, nbytes
        self.base = c0.view(torch.uint8)     # int8 / fp8 caches too: bytes must not sign-extend in the hash


_frame_tables: dict = {}      # (device, frame byte counts) -> (offsets, lengths) on the device, built once


def _frames(frame_nbytes, total: int, device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(offsets [nf] int64, lengths [nf] int64, nf, tiles per frame)`` of the frames of a message on
    ``device``. On a CUDA device the table is made once per distinct set of frame sizes (messages of
    a pull mostly share theirs) and kept, so a launch queues no copy of it."""
    lens = (total,) if frame_nbytes is None else tuple(int(n) for n in frame_nbytes)
    if not lens or any(n <= 0 for n in lens) or sum(lens) != total:
        raise LayoutError(f"frame_nbytes: expected positive byte counts summing to {total}, got {list(lens[:8])}")
    if total >= 1 << 31:
        raise LayoutError(f"message: expected fewer than 2**31 bytes (int32 addressing), got {total}")
    tiles = cdiv(max(lens), 8 * TILE_WORDS)
    offs = [0]
    for n in lens[:-1]:
        offs.append(offs[-1] + n)
    device = torch.device(device)
    if device.type != "cuda":
        table = torch.tensor([offs, list(lens)], dtype=torch.int64)
        return table[0], table[1], len(lens), tiles
    key = (device, lens)
    table = _frame_tables.get(key)
    if table is None:
        if len(_frame_tables) >= 1024:   # kernels queued on any stream may still read a table: let them end
            torch.cuda.synchronize(device)
            _frame_tables.clear()
        table = _frame_tables[key] = _to_device(torch.tensor([offs, list(lens)], dtype=torch.int64), device)
    return table[0], table[1], len(lens), tiles


def _check_out(t: torch.Tensor, n: int, dtype, device, name: str) -> None:
    if t.numel() != n or t.dtype != dtype or t.device != torch.device(device) or not t.is_contiguous():
        raise LayoutError(f"{name}: expected {n} contiguous {dtype} on {device}, got {t.numel()} {t.dtype} "
                          f"on {t.device}")


def gather_frames(caches, block_ids: torch.Tensor, *, out: torch.Tensor, checksums: torch.Tensor,
                  heads: tuple | None = None, frame_nbytes=None, start: int | None = None) -> None:
    """Gather the rows of ``block_ids`` from each layer of ``caches`` into ``out`` and write each
    frame's ``mix64`` into ``checksums``; queued on the current stream, no synchronization.

    Parameters
    ----------
    caches : list of [num_blocks, 2, N, H, P] packed caches (one per layer of the message), read only
    block_ids : [k] int64, same device
        Source blocks, in transfer order (used unchecked: callers validated them).
    out : [nlay·k·2·N·h·P] uint8, same device, written
        The payload, layer-major (docs/PROTOCOL.md "BLOCKS"); with ``start``, only whole
        (layer, position) cells of it from that cell on.
    checksums : [num_frames] int64, same device, written
        ``mix64`` of each frame, as the bits of a uint64.
    heads : (lo, hi), optional
        Local head range to send (default all heads).
    frame_nbytes : list of int, optional
        How ``out`` splits into frames (default one frame).
    start : int, optional
        The payload cell ``out`` starts at, ``layer·k + position`` (consecutive messages of a pull
        in one launch, whatever layers they cross); default: ``out`` is the whole payload.
    """
    dev = caches[0].device if caches else None
    g = _Layers(caches, heads, block_ids, "caches", out.numel(), "out", start)
    _check_out(out, g.total, torch.uint8, dev, "out")
    f_off, f_len, nf, tiles = _frames(frame_nbytes, g.total, dev)
    _check_out(checksums, nf, torch.int64, dev, "checksums")
    partial = torch.empty(nf * tiles, dtype=torch.int64, device=dev)
    _frame_sums_kernel[(nf, tiles)](
        g.base, g.offsets, block_ids, out, f_off, f_len, partial,
        g.k, g.blk_out, g.row_out, g.row_cache, g.head_off, g.block_stride, tiles, g.first_cell,
        TILE_WORDS=TILE_WORDS, GATHER=True)
    _finish_kernel[(1,)](partial, f_len, checksums, checksums, partial, nf, tiles,
                         BLOCK=FINISH_BLOCK, VERIFY=False)


def frame_checksums(buf: torch.Tensor, checksums: torch.Tensor, frame_nbytes=None) -> None:
    """``mix64`` of each frame of ``buf`` ([total] uint8, CPU or CUDA) into ``checksums``
    ([num_frames] int64, same device); queued on the current stream."""
    dev = buf.device
    f_off, f_len, nf, tiles = _frames(frame_nbytes, buf.numel(), dev)
    _check_out(checksums, nf, torch.int64, dev, "checksums")
    partial = torch.empty(nf * tiles, dtype=torch.int64, device=dev)
    _frame_sums_kernel[(nf, tiles)](buf, f_off, f_off, buf, f_off, f_len, partial,
                                    1, 1, 1, 1, 0, 0, tiles, 0, TILE_WORDS=TILE_WORDS, GATHER=False)
    _finish_kernel[(1,)](partial, f_len, checksums, checksums, partial, nf, tiles,
                         BLOCK=FINISH_BLOCK, VERIFY=False)


def verify_scatter(staging: torch.Tensor, expected: torch.Tensor, caches, block_ids: torch.Tensor, *,
                   ok: torch.Tensor, checksums: torch.Tensor | None = None, heads: tuple | None = None,
                   frame_nbytes=None, start: int | None = None) -> None:
    """Check every frame of a received message against ``expected`` and, only if all match,
    write its rows into ``block_ids`` of ``caches``; queued on the current stream (verify and
    scatter are ordered on it, so no host round trip sits between them).

    Parameters
    ----------
    staging : [nlay·k·2·N·h·P] uint8, on the caches' device
        The message's payload frames, concatenated; with ``start``, whole (layer, position) cells
        of the payload from that cell on.
    expected : [num_frames] int64, same device
        The header's checksums (uint64 bits).
    caches : list of [num_blocks, 2, N, H, P] packed caches, written in place (only on success)
    block_ids : [k] int64, same device
        Destination blocks (used unchecked: callers validated them).
    ok : [num_frames + 1] int32, same device, written
        ``ok[f]`` is 1 where frame f matched, ``ok[num_frames]`` the number of frames that did not;
        the caller reads it once the stream reaches this point and raises on a mismatch.
    checksums : [num_frames] int64, optional, written
        The checksums computed here (for the error message).
    heads : (lo, hi), optional
        Local heads the message carries (default all); the other heads are not written.
    frame_nbytes : list of int, optional
        Frame byte counts (default one frame).
    start : int, optional
        The payload cell ``staging`` starts at, ``layer·k + position`` (as :func:`gather_frames`).
    """
    dev = caches[0].device if caches else None
    g = _Layers(caches, heads, block_ids, "caches", staging.numel(), "staging", start)
    _check_out(staging, g.total, torch.uint8, dev, "staging")
    f_off, f_len, nf, tiles = _frames(frame_nbytes, g.total, dev)
    _check_out(expected, nf, torch.int64, dev, "expected")
    _check_out(ok, nf + 1, torch.int32, dev, "ok")
    if checksums is None:
        checksums = torch.empty(nf, dtype=torch.int64, device=dev)
    _check_out(checksums, nf, torch.int64, dev, "checksums")
    partial = torch.empty(nf * tiles, dtype=torch.int64, device=dev)
    _frame_sums_kernel[(nf, tiles)](staging, f_off, f_off, staging, f_off, f_len, partial,
                                    1, 1, 1, 1, 0, 0, tiles, 0, TILE_WORDS=TILE_WORDS, GATHER=False)
    _finish_kernel[(1,)](partial, f_len, checksums, expected, ok, nf, tiles, BLOCK=FINISH_BLOCK, VERIFY=True)
    _scatter_kernel[(cdiv(g.total, SCATTER_BYTES),)](
        g.base, g.offsets, block_ids, staging, ok[nf:],
        g.total, g.k, g.blk_out, g.row_out, g.row_cache, g.head_off, g.block_stride, g.first_cell,
        TILE=SCATTER_BYTES)


_warm: set = set()


def warmup(device) -> None:
    """Compile every kernel variant for ``device`` now (a CUDA device; a no-op on CPU and on a
    device already warm), so no compile happens inside a transfer. Endpoints call it at
    construction (``FrameOps.warmup``)."""
    device = torch.device(device)
    if device.type != "cuda" or device in _warm:
        return
    cache = torch.zeros(2, 2, 1, 1, 8, dtype=torch.uint8, device=device)
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    buf = torch.empty(16, dtype=torch.uint8, device=device)
    sums = torch.empty(1, dtype=torch.int64, device=device)
    gather_frames([cache], ids, out=buf, checksums=sums)
    verify_scatter(buf, sums, [cache], ids, ok=torch.empty(2, dtype=torch.int32, device=device))
    frame_checksums(buf, sums)
    torch.cuda.synchronize(device)
    _warm.add(device)
