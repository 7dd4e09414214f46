"""Gather and scatter whole cache rows, by block and by head range, as raw bytes.

Geometry comes from :mod:`layouts` only: one block is ``2·N·H·P`` bytes (``N`` tokens per
block, ``H`` local KV heads, ``P`` bytes per row including the 4-byte scale tail), never
a number derived from ``head_size`` alone. Rows are moved as opaque bytes, so codes,
inline float32 scales and the INT4 zero point hidden in the scale's low bits travel
bit for bit.

A head slice ``[lo, hi)`` (local head indices) of ``n`` blocks is laid out as
``[n, 2, N, hi - lo, P]`` bytes: the K half of each block then its V half, rows in
(token, head) order, exactly like a block of a cache that holds only those heads. That
is what lets a decode worker with another tensor-parallel split assemble its heads.
"""

from __future__ import annotations

import numpy as np
import torch

from layouts import CacheGeometry, LayoutDescriptor, LayoutError, check_packed_strides


def check_caches(caches, desc: LayoutDescriptor) -> None:
    """Refuse caches that are not one packed cache per layer of ``desc`` (both endpoint roles
    call this at construction, so a cache either side would mis-read is refused up front).

    Checked, each error naming the layer with expected vs got: one tensor per layer; its
    shape ``[num_blocks, 2, block_size, num_kv_heads, P]`` and storage dtype; packed strides
    (block ``b`` at byte ``b·2·N·H·P`` of the tensor, :func:`layouts.check_packed_strides`);
    its storage holds every byte the tensor addresses; every layer on one CPU or CUDA device;
    no two layers share a byte (a pull into one layer would overwrite another).

    Raises
    ------
    LayoutError
    """
    geo = desc.geometry()
    want = geo.shape(desc.num_blocks)
    if len(caches) != desc.num_layers:
        raise LayoutError(f"caches: expected {desc.num_layers} layers (descriptor), got {len(caches)}")
    spans = []
    for i, c in enumerate(caches):
        if not isinstance(c, torch.Tensor):
            raise LayoutError(f"caches[{i}]: expected a torch.Tensor, got {type(c).__name__}")
        if tuple(c.shape) != want or c.dtype != geo.storage_dtype:
            raise LayoutError(f"caches[{i}]: expected {want} {geo.storage_dtype}, got {tuple(c.shape)} {c.dtype}")
        try:
            check_packed_strides(c)
        except LayoutError as e:
            raise LayoutError(f"caches[{i}]: {e}") from e
        if c.device.type not in ("cpu", "cuda") or c.device != caches[0].device:
            raise LayoutError(f"caches[{i}] device: expected {caches[0].device} (cpu or cuda, one for "
                              f"every layer), got {c.device}")
        nbytes = c.numel() * c.element_size()
        start = c.storage_offset() * c.element_size()
        have = c.untyped_storage().nbytes()
        if start + nbytes > have:
            raise LayoutError(f"caches[{i}] storage: expected >= {start + nbytes} bytes (offset {start} + "
                              f"{nbytes}), got {have}")
        spans.append((c.data_ptr(), c.data_ptr() + nbytes, i))
    spans.sort()
    for (_, end, a), (lo, _, b) in zip(spans, spans[1:]):
        if lo < end:
            raise LayoutError(f"caches[{a}] and caches[{b}]: expected separate memory per layer, got "
                              f"overlapping bytes")


def as_bytes(kv_cache: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
    """Byte view ``[num_blocks, 2, N, H, row_bytes]`` uint8 of one layer's packed cache.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, block_size, num_kv_heads, P], storage dtype, CPU or CUDA
        Must have packed strides (any storage offset).
    geo : CacheGeometry
        The layout the cache claims to follow; shape and dtype are checked against it.
    """
    want = geo.shape(int(kv_cache.shape[0])) if kv_cache.dim() == 5 else None
    if want is None or tuple(kv_cache.shape) != want or kv_cache.dtype != geo.storage_dtype:
        raise LayoutError(
            f"kv_cache: expected shape (num_blocks, {', '.join(map(str, geo.shape(0)[1:]))}) "
            f"dtype {geo.storage_dtype}, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    check_packed_strides(kv_cache)
    nb = int(kv_cache.shape[0])
    return kv_cache.view(torch.uint8).view(nb, 2, geo.block_size, geo.num_kv_heads, geo.row_bytes)


def _rows(view: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` view of a torch byte view made by :func:`as_bytes` (packed
    strides: each block's bytes are contiguous); the CUDA gather / scatter of whole blocks index
    it with one kernel instead of a 5-D strided copy."""
    return view.as_strided((view.shape[0], view[0].numel()), (view.stride(0), 1))


def device_rows(kv_cache: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 view (never a copy) of one layer's packed cache:
    whole blocks are rows, so a block gather / scatter is one ``index_select`` / ``index_copy_``.
    Endpoints make it once per cache (each :func:`as_bytes` call re-checks shape and strides)."""
    return _rows(as_bytes(kv_cache, geo))


def block_rows(view: np.ndarray) -> np.ndarray:
    """``[num_blocks, block_bytes]`` uint8 view (never a copy) of a numpy byte view
    ``[num_blocks, 2, N, H, P]`` made by :func:`as_bytes` (packed strides, so each block's
    bytes are contiguous and blocks are ``block_bytes`` apart)."""
    return np.lib.stride_tricks.as_strided(view, shape=(view.shape[0], view[0].nbytes),
                                           strides=(view.strides[0] if view.shape[0] > 1 else view[0].nbytes, 1),
                                           writeable=view.flags.writeable)


def slice_bytes(geo: CacheGeometry, num_blocks: int, heads: range | None = None) -> int:
    """Bytes of ``num_blocks`` blocks restricted to ``heads`` (all local heads when None)."""
    nh = geo.num_kv_heads if heads is None else len(heads)
    return num_blocks * 2 * geo.block_size * nh * geo.row_bytes


def device_ids(block_ids, device) -> torch.Tensor:
    """``block_ids`` as an int64 tensor on ``device``, copied once through pinned memory without
    a stream synchronization; callers check the values first (publish / pull) and pass slices of
    it to :func:`gather_blocks` / :func:`scatter_blocks` instead of a list per call (a list is a
    synchronous pageable copy on every call)."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _ids(block_ids, device, num_blocks: int) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor) and block_ids.device == device and block_ids.device.type == "cuda":
        # from device_ids: checked by the caller; reading min/max here would synchronize
        if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
            raise LayoutError(f"block_ids: expected a 1-D int64 tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
        return block_ids
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if ids.dim() != 1:
        raise LayoutError(f"block_ids: expected a 1-D list, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise LayoutError(
            f"block_ids: expected values in [0, {num_blocks}), got min {int(ids.min())} max {int(ids.max())}")
    return ids.to(device)


def _heads(geo: CacheGeometry, heads: range | None) -> range:
    if heads is None:
        return range(geo.num_kv_heads)
    if heads.step != 1 or not 0 <= heads.start < heads.stop <= geo.num_kv_heads:
        raise LayoutError(f"heads: expected a range inside [0, {geo.num_kv_heads}), got {heads}")
    return heads


def contiguous_run(block_ids) -> tuple[int, int] | None:
    """``(start, count)`` when ``block_ids`` are consecutive increasing ids, else None."""
    ids = list(block_ids)
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return ids[0], len(ids)
    return None


def runs(block_ids) -> list[tuple[int, int, int]]:
    """Split ``block_ids`` into maximal runs of consecutive ids: ``[(position, first_id, count)]``."""
    out = []
    for pos, b in enumerate(block_ids):
        b = int(b)
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, b, 1))
    return out


def copy_runs(dst: np.ndarray, dst_ids, src: np.ndarray, src_ids, heads: range | None = None,
              head_side: str = "src") -> None:
    """Copy whole blocks ``src[src_ids[i]] -> dst[dst_ids[i]]`` between numpy byte views.

    The CPU fast path of gather and scatter: one slice copy per run of consecutive ids on
    both sides (a memcpy each, no index tensors), or one fancy-index copy when the runs are
    many and short.

    Parameters
    ----------
    dst, src : [*, 2, N, H or h, P] uint8 numpy arrays (``dst`` written in place)
    dst_ids, src_ids : sequences of int (same length), or None for ``0 .. n-1``
    heads : range, optional
        Head slice ``[lo, hi)`` taken on the side named by ``head_side`` (the cache side);
        the other side holds exactly ``hi - lo`` heads. None: all heads on both sides.
    """
    n = len(dst_ids if dst_ids is not None else src_ids)
    dst_ids = range(n) if dst_ids is None else dst_ids
    src_ids = range(n) if src_ids is None else src_ids
    hs = slice(None) if heads is None else slice(heads.start, heads.stop)
    pairs = _paired_runs(dst_ids, src_ids)
    if len(pairs) > 16 and heads is None and dst.flags.c_contiguous and src_ids == range(n):
        # scatter of many short runs from a packed buffer: one fancy-index assignment
        # (a C loop of block memcpys; fancy *reads* would build a temporary, so gathers
        # stay on the slice loop)
        dst.reshape(dst.shape[0], -1)[np.asarray(dst_ids, dtype=np.intp)] = src[:n].reshape(n, -1)
        return
    for d, s_, k in pairs:
        if head_side == "src":
            dst[d:d + k] = src[s_:s_ + k, :, :, hs]
        else:
            dst[d:d + k, :, :, hs] = src[s_:s_ + k]


def _paired_runs(dst_ids, src_ids) -> list[tuple[int, int, int]]:
    """Maximal runs where both id lists advance by one: ``[(dst_first, src_first, count)]``."""
    out = []
    for d, s in zip(dst_ids, src_ids):
        d, s = int(d), int(s)
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def gather_blocks(kv_cache: torch.Tensor, geo: CacheGeometry, block_ids,
                  heads: range | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the rows of ``block_ids`` (optionally only local ``heads``) into one byte buffer.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, N, H, P] packed cache, CPU or CUDA (read only)
    geo : CacheGeometry
    block_ids : sequence of int, or an int64 CUDA tensor from :func:`device_ids`
        Source blocks, in transfer order (a device tensor is used unchecked).
    heads : range, optional
        Local head indices ``[lo, hi)``; all heads when None.
    out : [nbytes] uint8, optional
        Destination on ``kv_cache``'s device; allocated when None.

    Returns
    -------
    torch.Tensor
        ``[slice_bytes(geo, len(block_ids), heads)]`` uint8 on ``kv_cache``'s device.
    """
    view = as_bytes(kv_cache, geo)
    heads = _heads(geo, heads)
    ids = _ids(block_ids, view.device, view.shape[0])
    n = slice_bytes(geo, len(ids), heads)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=view.device)
    elif out.numel() != n or out.dtype != torch.uint8 or out.device != view.device:
        raise LayoutError(f"out: expected {n} uint8 bytes on {view.device}, got {out.numel()} {out.dtype} {out.device}")
    dst = out.view(len(ids), 2, geo.block_size, len(heads), geo.row_bytes)
    if view.is_cuda:
        if len(heads) == geo.num_kv_heads:   # whole blocks: one index_select, no temporary
            torch.index_select(_rows(view), 0, ids, out=out.view(len(ids), -1))
        else:
            dst.copy_(view[ids][:, :, :, heads.start:heads.stop])
        return out
    # CPU: numpy slice copies per run of consecutive ids (much faster than index ops on wide rows)
    copy_runs(dst.numpy(), None, view.numpy(), block_ids, heads, head_side="src")
    return out


def scatter_blocks(kv_cache: torch.Tensor, geo: CacheGeometry, block_ids, payload: torch.Tensor,
                   heads: range | None = None) -> None:
    """Write a byte buffer made by :func:`gather_blocks` into ``block_ids`` of ``kv_cache``.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, N, H, P] packed cache, CPU or CUDA, written in place
    geo : CacheGeometry
    block_ids : sequence of int, or an int64 CUDA tensor from :func:`device_ids`
        Destination blocks, one per gathered block, in the same order (a device tensor is used unchecked).
    payload : [slice_bytes(geo, len(block_ids), heads)] uint8, on ``kv_cache``'s device
    heads : range, optional
        Local head indices ``[lo, hi)`` to overwrite; the other heads are left as they were.
    """
    view = as_bytes(kv_cache, geo)
    heads = _heads(geo, heads)
    ids = _ids(block_ids, view.device, view.shape[0])
    n = slice_bytes(geo, len(ids), heads)
    if payload.numel() != n or payload.dtype != torch.uint8:
        raise LayoutError(f"payload: expected {n} uint8 bytes, got {payload.numel()} {payload.dtype}")
    if payload.device != view.device:
        raise LayoutError(f"payload device: expected {view.device}, got {payload.device}")
    src = payload.view(len(ids), 2, geo.block_size, len(heads), geo.row_bytes)
    if view.is_cuda:
        if len(heads) == geo.num_kv_heads:   # whole blocks: rows of block_bytes
            _rows(view).index_copy_(0, ids, payload.view(len(ids), -1))
        else:
            view[:, :, :, heads.start:heads.stop].index_copy_(0, ids, src)
        return
    copy_runs(view.numpy(), block_ids, src.numpy(), None, heads, head_side="dst")
