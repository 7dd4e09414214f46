"""Conversion on the wire: an unquantized prefill cache serving a quantized decode cache.

The one layout mismatch that may be bridged, because it is exact with respect to the decode
side: a prefill worker whose cache holds bf16/fp16 K/V can produce, for a decode worker whose
cache is INT8, FP8 or INT4 per token-head, exactly the bytes the decode side's own writer
would have produced from the same K/V, by running that writer on the prefill side. Every
other difference (block size, heads, head size, model dtype, layers, ...) stays refused by the
handshake, because :class:`ConvertingPrefill` serves a staging cache whose descriptor is the
decode side's format and nothing else.

The writer is injected (``kvconnector`` does not import ``kernels``): any callable
``write(key, value, kv_cache, slot_mapping)`` that quantizes ``key``/``value``
``[num_tokens, num_kv_heads, head_size]`` (model dtype) into one packed layer ``kv_cache`` at
``slot_mapping`` (``[num_tokens]`` int64). ``tools.wire_writer.kernel_writer(mode)`` builds the
project's Triton writer; the decode side must use the same writer for byte equality.
"""

from __future__ import annotations

from typing import Callable

import torch

from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor, LayoutMismatchError, get_kv_quant_mode
from .prefill import PrefillEndpoint, check_caches

WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def wire_descriptor(src: LayoutDescriptor, wire_kv_cache_dtype: str) -> LayoutDescriptor:
    """The descriptor of ``src``'s blocks converted to ``wire_kv_cache_dtype`` (same model, heads,
    block size, layers, blocks).

    Raises
    ------
    LayoutMismatchError
        ``src`` is quantized, or the target is not a per-token-head mode (those are the only
        conversions that are exact with respect to the decode side's writer).
    """
    mode = get_kv_quant_mode(wire_kv_cache_dtype)
    if KVQuantMode(src.quant_mode) != KVQuantMode.NONE or not mode.per_token_head:
        raise LayoutMismatchError([("quant_mode", src.quant_mode, int(mode))],
                                  context="conversion on the wire needs an unquantized source and a "
                                          "per-token-head target")
    geo = src.geometry()
    wire = CacheGeometry(mode, geo.head_size, geo.num_kv_heads, geo.block_size, geo.model_dtype)
    return LayoutDescriptor.from_geometry(wire, num_layers=src.num_layers, num_blocks=src.num_blocks,
                                          head_start=src.head_start, total_num_kv_heads=src.total_num_kv_heads)


def convert_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_ids, write: WriteFn,
                   dst_block_ids=None, num_tokens: int | None = None) -> None:
    """Quantize whole blocks of one unquantized layer into a packed quantized layer.

    Parameters
    ----------
    src_cache : [num_blocks, 2, block_size, num_kv_heads, head_size] bf16/fp16, CPU or CUDA (read)
    dst_cache : [num_blocks', 2, block_size, num_kv_heads, P] storage dtype of the target mode, same
        device (written in place, only the rows of ``dst_block_ids``)
    block_ids : list of int, source blocks
    write : WriteFn
    dst_block_ids : list of int, optional; default ``block_ids``
    num_tokens : int, optional
        Tokens held by the blocks (in order); slots past it are not written (the writer skips
        negative slots), so they hold what the decode side's writer would have left there.
    """
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=src_cache.device)
    dst_ids = ids if dst_block_ids is None else torch.as_tensor(list(dst_block_ids), dtype=torch.int64,
                                                                device=src_cache.device)
    blocks = src_cache.index_select(0, ids)                  # [n, 2, N, H, D]
    n, _, block_size, num_kv_heads, head_size = blocks.shape
    key = blocks[:, 0].reshape(n * block_size, num_kv_heads, head_size).contiguous()
    value = blocks[:, 1].reshape(n * block_size, num_kv_heads, head_size).contiguous()
    slots = (dst_ids[:, None] * block_size + torch.arange(block_size, device=ids.device)[None, :]).reshape(-1)
    if num_tokens is not None:
        slots[num_tokens:] = -1
    write(key, value, dst_cache, slots)


class ConvertingPrefill:
    """A :class:`PrefillEndpoint` that serves unquantized caches converted to a quantized format.

    The endpoint serves a staging cache in the wire format (block ``b`` of staging holds block
    ``b`` of the source, converted); decode peers handshake against the wire descriptor, so a
    peer with any other layout is refused on both ends as usual.

    Parameters
    ----------
    caches : list of [num_blocks, 2, block_size, num_kv_heads, head_size] bf16/fp16 tensors
        The prefill side's own caches (read only).
    descriptor : LayoutDescriptor of ``caches``
    wire_kv_cache_dtype : str
        The decode side's cache dtype, e.g. ``"int4_per_token_head"``.
    write : WriteFn
        The target mode's writer, the same one the decode side uses.
    **endpoint_kwargs : passed to :class:`PrefillEndpoint` (host, port, lease_s, curve, ...)
    """

    def __init__(self, caches, descriptor: LayoutDescriptor, wire_kv_cache_dtype: str, write: WriteFn,
                 **endpoint_kwargs) -> None:
        check_caches(caches, descriptor)
        self.caches, self.write = list(caches), write
        self.wire = wire_descriptor(descriptor, wire_kv_cache_dtype)
        geo = self.wire.geometry()
        self.staging = [geo.new_cache(descriptor.num_blocks, caches[0].device).zero_() for _ in caches]
        self.endpoint = PrefillEndpoint(self.staging, self.wire, **endpoint_kwargs)

    def convert_layer(self, layer: int, block_ids, num_tokens: int | None = None) -> None:
        """Convert one layer's blocks now (a serving engine calls this as each layer finishes)."""
        convert_blocks(self.caches[layer], self.staging[layer], block_ids, self.write, num_tokens=num_tokens)

    def publish(self, transfer_id: str, block_ids, lease_s: float | None = None, *, num_tokens: int | None = None,
                converted: bool = False) -> None:
        """Convert every layer of ``block_ids`` (unless ``converted``: done layer by layer with
        :meth:`convert_layer`) and publish them; ``num_tokens`` as in :func:`convert_blocks`."""
        if not converted:
            for layer in range(len(self.caches)):
                self.convert_layer(layer, block_ids, num_tokens)
        self.endpoint.publish(transfer_id, block_ids, lease_s)

    def __getattr__(self, name):      # release, held, stats, errors, metrics, endpoint address, port
        return getattr(self.__dict__["endpoint"], name)

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
