"""Views over one layer's packed cache: the four tensors the kernels take."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .errors import LayoutError
from .geometry import CacheGeometry
from .modes import KVQuantMode


class KVCacheViews(NamedTuple):
    """The kernels' view of one layer's cache (all views share the cache's storage).

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size]
        Codes (or raw bf16/fp16 values), strided into the packed rows.
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, or None
        Strided onto the 4-byte tails; None when the mode carries no scale.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale_cache: Optional[torch.Tensor]
    v_scale_cache: Optional[torch.Tensor]


def geometry_of(kv_cache: torch.Tensor, kv_quant_mode: KVQuantMode, head_size: int,
                model_dtype: torch.dtype = torch.bfloat16) -> CacheGeometry:
    """Geometry implied by a packed cache tensor, checked against its shape and dtype."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise LayoutError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, P], got {tuple(kv_cache.shape)}"
        )
    mode = KVQuantMode(kv_quant_mode)
    if mode == KVQuantMode.NONE and kv_cache.dtype in (torch.bfloat16, torch.float16):
        model_dtype = kv_cache.dtype
    geo = CacheGeometry(mode, head_size, int(kv_cache.shape[3]), int(kv_cache.shape[2]), model_dtype)
    if kv_cache.dtype != geo.storage_dtype:
        raise LayoutError(f"kv_cache dtype: expected {geo.storage_dtype} for {mode.name}, got {kv_cache.dtype}")
    if kv_cache.shape[4] != geo.row_elems:
        raise LayoutError(
            f"kv_cache last dim: expected {geo.row_elems} (data {geo.data_head_size} + scale_pad "
            f"{geo.scale_pad}) for {mode.name} head_size {head_size}, got {kv_cache.shape[4]}"
        )
    return geo


def check_packed_strides(kv_cache: torch.Tensor) -> None:
    """Refuse a cache whose strides differ from the contiguous packed layout.

    The storage offset may be anything (e.g. one layer inside a larger allocation); the
    block stride must be exactly ``2·N·H·P`` so that block ``b`` lives at byte ``b·2·N·H·P``.
    """
    expected = []
    acc = 1
    for size in reversed(kv_cache.shape):
        expected.append(acc)
        acc *= size
    expected = tuple(reversed(expected))
    got = tuple(kv_cache.stride())
    # a dimension of size 1 may carry any stride without changing the bytes
    if any(e != g and s != 1 for e, g, s in zip(expected, got, kv_cache.shape)):
        raise LayoutError(f"kv_cache strides: expected {expected} (packed layout), got {got}")


def split_kv_cache(kv_cache: torch.Tensor, kv_quant_mode: KVQuantMode = KVQuantMode.NONE,
                   head_size: Optional[int] = None) -> KVCacheViews:
    """Split one layer's packed cache into the four views the kernels take.

    Parameters
    ----------
    kv_cache : [num_blocks, 2, block_size, num_kv_heads, P], storage dtype of the mode
        Must have packed strides; may start at any storage offset that keeps the scale
        tails 4-byte aligned.
    kv_quant_mode : KVQuantMode
    head_size : int, optional
        Logical head size; inferred from ``P`` when omitted.

    Returns
    -------
    KVCacheViews
        Views sharing ``kv_cache``'s storage; writing through them writes the cache.
    """
    mode = KVQuantMode(kv_quant_mode)
    if mode == KVQuantMode.FP8_PER_TENSOR:
        raise LayoutError("fp8 per-tensor caches are parsed but not supported by these views/kernels")
    if head_size is None:
        p = int(kv_cache.shape[-1])
        head_size = {KVQuantMode.NONE: p, KVQuantMode.INT4_PER_TOKEN_HEAD: 2 * (p - 4)}.get(mode, p - 4)
    geo = geometry_of(kv_cache, mode, head_size)
    check_packed_strides(kv_cache)
    d = geo.data_head_size
    key_cache = kv_cache[:, 0, :, :, :d]
    value_cache = kv_cache[:, 1, :, :, :d]
    if not mode.per_token_head:
        return KVCacheViews(key_cache, value_cache, None, None)
    if kv_cache.storage_offset() % 4:
        raise LayoutError(
            f"kv_cache storage offset {kv_cache.storage_offset()} bytes: scale tails would not be 4-byte aligned"
        )
    # Reinterpret the same bytes as float32 words: rows are P bytes, P % 4 == 0.
    words = kv_cache.view(torch.uint8).view(torch.float32)
    k_scale_cache = words[:, 0, :, :, d // 4]
    v_scale_cache = words[:, 1, :, :, d // 4]
    return KVCacheViews(key_cache, value_cache, k_scale_cache, v_scale_cache)
