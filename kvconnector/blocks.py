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

import torch

from layouts import CacheGeometry, LayoutError, check_packed_strides


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


def slice_bytes(geo: CacheGeometry, num_blocks: int, heads: range | None = None) -> int:
    """Bytes of ``num_blocks`` blocks restricted to ``heads`` (all local heads when None)."""
    nh = geo.num_kv_heads if heads is None else len(heads)
    return num_blocks * 2 * geo.block_size * nh * geo.row_bytes


def _ids(block_ids, device, num_blocks: int) -> torch.Tensor:
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


def gather_blocks(kv_cache: torch.Tensor, geo: CacheGeometry, block_ids,
                  heads: range | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the rows of ``block_ids`` (optionally only local ``heads``) into one byte buffer.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, N, H, P] packed cache, CPU or CUDA (read only)
    geo : CacheGeometry
    block_ids : sequence of int
        Source blocks, in transfer order.
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
        dst.copy_(view[ids][:, :, :, heads.start:heads.stop])
        return out
    # CPU: numpy slice copies per run of consecutive ids (much faster than index ops on wide rows)
    src_np, dst_np = view.numpy(), dst.numpy()
    for pos, b, k in runs(block_ids):
        dst_np[pos:pos + k] = src_np[b:b + k, :, :, heads.start:heads.stop]
    return out


def scatter_blocks(kv_cache: torch.Tensor, geo: CacheGeometry, block_ids, payload: torch.Tensor,
                   heads: range | None = None) -> None:
    """Write a byte buffer made by :func:`gather_blocks` into ``block_ids`` of ``kv_cache``.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, N, H, P] packed cache, CPU or CUDA, written in place
    geo : CacheGeometry
    block_ids : sequence of int
        Destination blocks, one per gathered block, in the same order.
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
        view[:, :, :, heads.start:heads.stop].index_copy_(0, ids, src)
        return
    src_np, dst_np = src.numpy(), view.numpy()
    for pos, b, k in runs(block_ids):
        dst_np[b:b + k, :, :, heads.start:heads.stop] = src_np[pos:pos + k]
