"""What an engine's per-layer KV cache tensor really holds, and copies to and from the packed layout.

A serving engine hands the connector one tensor per attention layer whose *nominal* shape does
not say where a (K/V, slot, head, element) value lives. vLLM's CPU backend allocates
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; its writer (ISA ``vec``) stores, per
block and head, K **transposed** (``[head_size, block_size]``: element ``i`` of slot ``t`` at
``i * block_size + t``) followed by V as ``[block_size, head_size]``. vLLM's CUDA backends use
other orders again, and an AMX build may tile the block differently.

So the order is never assumed: :func:`probe_block_map` writes coordinates through the engine's
own cache writer into a scratch tensor of the same shape and dtype (three passes: slot, head,
element index, each as small exact integers; K positive, V negative) and reads back, for every
element of a block, which (K/V, slot, head, element) landed there. The result, a
:class:`BlockMap`, is a permutation of one block's elements: ``packed[j] = engine[perm[j]]``
converts an engine block to the project's packed layout ``[2, block_size, num_kv_heads,
head_size]`` and back. A block interior that is not a bijection (padding, duplicated values,
scales) is refused.

Only torch is imported here; the engine-specific writer is passed in as a callable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from layouts import LayoutError


@dataclass(frozen=True)
class BlockMap:
    """Element permutation of one block between an engine's cache and the packed layout.

    perm : [2 * block_size * num_kv_heads * head_size] int64, CPU
        ``packed_block.flatten()[j] == engine_block.flatten()[perm[j]]``.
    name : str
        Readable description, e.g. ``"H,{K:D,N | V:N,D}"`` (outermost first) or ``"irregular"``.
    """

    perm: torch.Tensor
    block_size: int
    num_kv_heads: int
    head_size: int
    name: str

    @property
    def block_elems(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size

    def is_identity(self) -> bool:
        return bool(torch.equal(self.perm, torch.arange(self.block_elems)))


def _describe(perm: torch.Tensor, n: int, h: int, d: int) -> str:
    """Axis order of each half by stride, when every half is an affine (strided) map."""
    pos = perm.view(2, n, h, d)
    parts = []
    for kv, label in ((0, "K"), (1, "V")):
        p = pos[kv]
        base = int(p[0, 0, 0])
        strides = {"N": int(p[1, 0, 0]) - base if n > 1 else 0, "H": int(p[0, 1, 0]) - base if h > 1 else 0,
                   "D": int(p[0, 0, 1]) - base if d > 1 else 0}
        t, hh, i = torch.meshgrid(torch.arange(n), torch.arange(h), torch.arange(d), indexing="ij")
        if not torch.equal(p, base + t * strides["N"] + hh * strides["H"] + i * strides["D"]):
            return "irregular"
        parts.append((base, label, ",".join(sorted(strides, key=lambda a: -strides[a]))))
    return " | ".join(f"{label}@{base}:{order}" for base, label, order in sorted(parts))


def probe_block_map(write: Callable, shape: tuple, dtype: torch.dtype, block_size: int,
                    num_kv_heads: int, head_size: int, device="cpu", strides: tuple | None = None) -> BlockMap:
    """Find where the engine's writer puts every K/V element of a block.

    Parameters
    ----------
    write : callable(key, value, cache, slot_mapping)
        The engine's own cache writer: ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
        of ``dtype``, ``cache`` a scratch tensor of ``(2, *shape[1:])`` (written in place),
        ``slot_mapping [num_tokens]`` int64.
    shape, dtype : the engine's per-layer cache tensor shape (any ``num_blocks``) and dtype
        (bf16 or fp16: coordinates up to 256 are exact integers in both).
    strides : the engine tensor's strides (default: contiguous). The scratch tensor gets the
        same strides, so the map is of the block's *memory* order, whatever the logical shape.

    Raises
    ------
    LayoutError
        The writer does not place each (K/V, slot, head, element) in exactly one element of
        the block, or a coordinate cannot be represented exactly in ``dtype``.
    """
    n, h, d = block_size, num_kv_heads, head_size
    if dtype not in (torch.bfloat16, torch.float16) or max(n, h, d) > 256:
        raise LayoutError(f"engine cache probe: expected bf16/fp16 and block_size, heads, head_size <= 256, "
                          f"got {dtype}, {n}, {h}, {d}")
    per_block = 2 * n * h * d
    coords = []
    if int(torch.Size(shape[1:]).numel()) != per_block:
        raise LayoutError(f"engine cache {tuple(shape)}: expected {per_block} elements per block "
                          f"(2 x {n} x {h} x {d}), got {torch.Size(shape[1:]).numel()}")
    inner = tuple(strides[1:]) if strides is not None else torch.empty(shape[1:], device="meta").stride()
    for axis in range(3):       # slot, head, element index, one pass each
        scratch = torch.empty_strided((2, *shape[1:]), (per_block, *inner), dtype=dtype, device=device)
        block_rows(scratch, per_block).zero_()
        grid = torch.meshgrid(torch.arange(n), torch.arange(h), torch.arange(d), indexing="ij")[axis]
        val = (grid + 1).to(dtype=dtype, device=device)          # 1..256: exact, never 0
        write(val.contiguous(), (-val).contiguous(), scratch, torch.arange(n, 2 * n, dtype=torch.int64, device=device))
        rows = block_rows(scratch, per_block)
        if rows[0].any():
            raise LayoutError("engine cache probe: the writer touched block 0 (slots were in block 1)")
        coords.append(rows[1].float().cpu())
    t, hh, i = coords
    kv = (t < 0).long()
    if not ((t != 0) & (hh != 0) & (i != 0)).all() or not ((hh < 0) == (t < 0)).all():
        raise LayoutError("engine cache probe: some block elements were not written once per value "
                          "(padding or an inline scale); refusing to move its bytes")
    packed_index = ((kv * n + t.abs().long() - 1) * h + hh.abs().long() - 1) * d + i.abs().long() - 1
    perm = torch.full((per_block,), -1, dtype=torch.int64)
    perm[packed_index] = torch.arange(per_block)
    if (perm < 0).any():
        raise LayoutError("engine cache probe: two elements of the block hold the same (K/V, slot, head, "
                          "element); refusing to move its bytes")
    return BlockMap(perm, n, h, d, _describe(perm, n, h, d))


def _dense_block(cache: torch.Tensor, block_elems: int) -> bool:
    """True when each block's elements fill one dense range of memory (any order of the inner
    axes: a permuted layout is fine, padding or overlap is not); blocks may lie further apart
    (e.g. one layer's blocks interleaved with the other layers')."""
    if cache.numel() != cache.shape[0] * block_elems or (cache.shape[0] > 1 and cache.stride(0) < block_elems):
        return False
    expect = 1
    for size, stride in sorted(((int(z), int(t)) for z, t in zip(cache.shape[1:], cache.stride()[1:]) if z > 1),
                               key=lambda p: p[1]):
        if stride != expect:
            return False
        expect *= size
    return expect == block_elems


def block_rows(cache: torch.Tensor, block_elems: int) -> torch.Tensor:
    """``[num_blocks, block_elems]`` view, in memory order, of an engine cache tensor whose blocks
    are dense ranges (its logical axes may be permuted in memory); never a copy."""
    num_blocks = int(cache.shape[0])
    if not _dense_block(cache, block_elems):
        raise LayoutError(f"engine cache: expected {num_blocks} blocks of {block_elems} elements, each one dense "
                          f"range of memory, got shape {tuple(cache.shape)} strides {cache.stride()}")
    return cache.as_strided((num_blocks, block_elems), (cache.stride(0) if num_blocks > 1 else block_elems, 1),
                            cache.storage_offset())


def gather_packed(engine: torch.Tensor, bmap: BlockMap, block_ids, out: torch.Tensor, out_ids) -> None:
    """Copy engine blocks into a packed cache, reordering each block's elements.

    Parameters
    ----------
    engine : the engine's per-layer cache tensor (read)
    block_ids : list of int, engine blocks
    out : [num_blocks', 2, N, H, D] packed cache, same dtype and device (written in place)
    out_ids : list of int, destination blocks of ``out``, one per ``block_ids``
    """
    rows = block_rows(engine, bmap.block_elems)
    src = torch.as_tensor(list(block_ids), dtype=torch.int64, device=engine.device)
    dst = torch.as_tensor(list(out_ids), dtype=torch.int64, device=out.device)
    picked = rows.index_select(0, src)[:, bmap.perm.to(engine.device)]
    out.view(out.shape[0], -1).index_copy_(0, dst, picked)


def scatter_packed(packed: torch.Tensor, bmap: BlockMap, packed_ids, engine: torch.Tensor, engine_ids) -> None:
    """Copy packed blocks into the engine's tensor in its own element order (inverse of
    :func:`gather_packed`); ``engine`` is written in place."""
    rows = block_rows(engine, bmap.block_elems)
    src = torch.as_tensor(list(packed_ids), dtype=torch.int64, device=packed.device)
    dst = torch.as_tensor(list(engine_ids), dtype=torch.int64, device=engine.device)
    values = packed.view(packed.shape[0], -1).index_select(0, src)
    reordered = torch.empty_like(values)
    reordered[:, bmap.perm.to(engine.device)] = values
    rows.index_copy_(0, dst, reordered)
