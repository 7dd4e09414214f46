"""Cache geometry: shapes and the byte position of every code and scale.

Per layer the cache is one tensor of shape ``(num_blocks, 2, block_size, num_kv_heads, P)``
where ``P = data_head_size + scale_pad`` storage elements. Index 0 of axis 1 is K, 1 is V.

Byte diagram of one (token, head) row, for ``head_size = d`` (offsets in bytes):

``auto`` / ``bfloat16`` / ``float16`` (NONE), ``P = d`` elements of 2 bytes::

    0                                                2d
    | x[0] | x[1] | ...                     | x[d-1] |     little-endian 16-bit floats

``int8_per_token_head`` / ``fp8_per_token_head``, ``P = d + 4`` bytes::

    0                                  d              d+4
    | q[0] | q[1] | ... | q[d-1]       | scale (f32 LE) |   q: int8 or float8_e4m3fn

``int4_per_token_head``, ``P = d/2 + 4`` bytes; codes are of the *rotated* row::

    0                                       d/2                   d/2+4
    | q1 q0 | q3 q2 | ... | q[d-1] q[d-2]   | scale bits, f32 LE     |
      ^hi ^lo  (even element in the low nibble)   low 4 bits = zero point

A block is ``2·N·H·P`` contiguous bytes (``N = block_size``, ``H = num_kv_heads``): the K
half first, the V half at ``+N·H·P``; row (slot ``t``, head ``h``) starts at ``t·H·P + h·P``
inside its half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LayoutError
from .modes import KVQuantMode, get_kv_quant_mode, storage_dtype

SCALE_BYTES = 4  # one little-endian float32 per (token, head) row
NAN_SCALE_BITS = 0x7FC00000  # the scale word of a row whose input held NaN/Inf (a quiet NaN, zero point 0)
ZP_MASK = 0xF  # INT4: the zero point sits in the scale word's low 4 bits


def check_head_size(mode: KVQuantMode, head_size: int) -> None:
    """Raise :class:`LayoutError` when ``head_size`` cannot be stored in ``mode``."""
    if not isinstance(head_size, int) or head_size <= 0:
        raise LayoutError(f"head_size must be a positive int, got {head_size!r}")
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        if head_size < 16 or head_size & (head_size - 1):
            raise LayoutError(
                f"int4_per_token_head needs head_size a power of two >= 16 "
                f"(Hadamard rotation), got {head_size}"
            )
    elif mode.per_token_head and head_size % 4:
        # the inline float32 scale must stay 4-byte aligned
        raise LayoutError(f"{mode.name} needs head_size % 4 == 0, got {head_size}")


def data_head_size(mode: KVQuantMode, head_size: int) -> int:
    """Storage elements of data per row: ``head_size // 2`` for INT4, else ``head_size``."""
    return head_size // 2 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else head_size


def scale_pad(mode: KVQuantMode) -> int:
    """Storage elements holding the inline scale: ``4 // element_size = 4`` or 0."""
    return SCALE_BYTES if mode.per_token_head else 0


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's packed cache, ``(num_blocks, 2, block_size, num_kv_heads, P)``."""
    mode = get_kv_quant_mode(cache_dtype_str)
    check_head_size(mode, head_size)
    return (num_blocks, 2, block_size, num_kv_heads, data_head_size(mode, head_size) + scale_pad(mode))


@dataclass(frozen=True)
class CacheGeometry:
    """Byte arithmetic of one layer's cache.

    Parameters
    ----------
    mode : KVQuantMode
    head_size : int
        Logical head size ``d`` (before packing).
    num_kv_heads : int
        KV heads held by this cache (the local slice under tensor parallelism).
    block_size : int
        Tokens per block ``N``.
    model_dtype : torch.dtype
        bf16 or fp16; the storage dtype when unquantized, the K/V input dtype otherwise.
    """

    mode: KVQuantMode
    head_size: int
    num_kv_heads: int
    block_size: int
    model_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        object.__setattr__(self, "mode", KVQuantMode(self.mode))
        check_head_size(self.mode, self.head_size)
        for name in ("num_kv_heads", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise LayoutError(f"{name} must be a positive int, got {v!r}")
        if self.model_dtype not in (torch.bfloat16, torch.float16):
            raise LayoutError(f"model_dtype must be bfloat16 or float16, got {self.model_dtype}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return storage_dtype(self.mode, self.model_dtype)

    @property
    def data_head_size(self) -> int:
        return data_head_size(self.mode, self.head_size)

    @property
    def scale_pad(self) -> int:
        return scale_pad(self.mode)

    @property
    def row_elems(self) -> int:
        """``P``: storage elements per (token, head) row, scale included."""
        return self.data_head_size + self.scale_pad

    @property
    def elem_bytes(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.elem_bytes

    @property
    def data_bytes(self) -> int:
        """Bytes of codes (or raw values) at the start of each row."""
        return self.data_head_size * self.elem_bytes

    @property
    def half_bytes(self) -> int:
        """Bytes of the K (or V) half of one block: ``N·H·P``."""
        return self.block_size * self.num_kv_heads * self.row_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block, K and V halves with their scales: ``2·N·H·P``."""
        return 2 * self.half_bytes

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.row_elems)

    def row_offset(self, kv: int, slot_idx: int, head_idx: int) -> int:
        """Byte offset, inside its block, of the row (K if ``kv == 0`` else V, slot, head)."""
        if kv not in (0, 1) or not 0 <= slot_idx < self.block_size or not 0 <= head_idx < self.num_kv_heads:
            raise LayoutError(f"row (kv={kv}, slot={slot_idx}, head={head_idx}) outside the block")
        return kv * self.half_bytes + (slot_idx * self.num_kv_heads + head_idx) * self.row_bytes

    def scale_offset(self, kv: int, slot_idx: int, head_idx: int) -> int:
        """Byte offset, inside its block, of the row's little-endian float32 scale."""
        if not self.mode.per_token_head:
            raise LayoutError(f"{self.mode.name} rows carry no scale")
        return self.row_offset(kv, slot_idx, head_idx) + self.data_bytes

    def new_cache(self, num_blocks: int, device="cpu") -> torch.Tensor:
        """Allocate an uninitialised packed cache for one layer."""
        return torch.empty(self.shape(num_blocks), dtype=self.storage_dtype, device=device)
