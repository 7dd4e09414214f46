"""``PagedKVCache``: per-layer packed caches, their layout, block allocation, write and attend.

A friendly object on top of the stable low-level functions: it owns one packed
tensor per layer (``layouts.CacheGeometry.new_cache``), the four kernel views of each
(``layouts.split_kv_cache``), the layout descriptor a connector exchanges, and a free list of
block ids. ``write`` and ``attend`` call the project's Triton kernels (``backend="triton"``) or
their plain-PyTorch oracles (``backend="reference"``) with the same arguments, so the two
back ends are interchangeable in one place.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from layouts import (CacheGeometry, KeyOffsets, KVQuantMode, LayoutDescriptor, LayoutError, get_kv_quant_mode,
                     split_kv_cache)

# "triton-write": the Triton write kernel with the oracle attention (dequantize, then fp32
# attention): the quantization under test is the kernel's, the attention costs no interpreter time.
BACKENDS = ("triton", "reference", "triton-write")


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"`` -> ``"triton"`` (the project's kernels); other names are checked and returned."""
    if backend == "auto":
        return "triton"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    return backend


def describe_backend(backend: str) -> str:
    """Human-readable name of what ``write`` and ``attend`` run."""
    return {"triton": "Triton write + Triton paged attention",
            "reference": "PyTorch oracle write + oracle attention",
            "triton-write": "Triton write + oracle attention (dequantized cache, fp32)"}[backend]


class PagedKVCache:
    """Paged KV cache of a whole model, one packed tensor per layer.

    Parameters
    ----------
    kv_cache_dtype : str or KVQuantMode
        vLLM ``--kv-cache-dtype`` string (``"auto"``, ``"int4_per_token_head"``, ...) or a mode.
    num_layers, num_kv_heads, head_size, num_blocks, block_size : int
    model_dtype : torch.dtype
        bf16 or fp16: dtype of the K/V/Q given to ``write``/``attend`` (cast on entry).
    device : torch.device or str
        CPU tensors run the Triton kernels through Triton's interpreter.
    backend : "auto", "triton", "reference" or "triton-write" (see :data:`BACKENDS`)
    int4_shrink : tuple of float, optional
        MSE-optimal INT4 encoder (``kernels.reference.quantize_int4_rows(shrink=...)``): same
        stored format, each row keeps the range shrink factor with the least squared error.
        The Triton INT4 writer takes it as ``shrink=``; the oracle backend uses the same factors.
    key_offsets : layouts.KeyOffsets, optional
        INT4 key smoothing: every layer's writes subtract that layer's per-head offsets from the
        keys (``key_offset=`` of the writers); attention is unchanged (a constant per head
        shifts every logit of a query alike), dequantized keys read back lack ``m``
        (:meth:`key_offset`). The descriptor's ``key_offset`` is the offsets' fingerprint.
    """

    def __init__(self, kv_cache_dtype, num_layers: int, num_kv_heads: int, head_size: int,
                 num_blocks: int, block_size: int = 16, model_dtype: torch.dtype = torch.bfloat16,
                 device="cpu", backend: str = "auto", int4_shrink: Optional[Sequence[float]] = None,
                 key_offsets: Optional[KeyOffsets] = None):
        self.mode = (KVQuantMode(kv_cache_dtype) if isinstance(kv_cache_dtype, (int, KVQuantMode))
                     else get_kv_quant_mode(kv_cache_dtype))
        if self.mode == KVQuantMode.FP8_PER_TENSOR:
            raise LayoutError("PagedKVCache: fp8 per-tensor caches are not supported by the kernels")
        if int4_shrink is not None and self.mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
            raise ValueError(f"int4_shrink needs int4_per_token_head, got {self.mode.name}")
        self.geometry = CacheGeometry(self.mode, head_size, num_kv_heads, block_size, model_dtype)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.backend = resolve_backend(backend)
        self.int4_shrink = tuple(int4_shrink) if int4_shrink is not None else None
        if key_offsets is not None:
            if self.mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
                raise ValueError(f"key_offsets need int4_per_token_head, got {self.mode.name}")
            key_offsets.check_model(num_layers, num_kv_heads, head_size)
        self.key_offsets = key_offsets
        self._offsets = [None if key_offsets is None else key_offsets.layer(i, device=self.device)
                         for i in range(num_layers)]
        self.caches = [self.geometry.new_cache(num_blocks, self.device).zero_() for _ in range(num_layers)]
        self.views = [split_kv_cache(c, self.mode, head_size) for c in self.caches]
        self.descriptor = LayoutDescriptor.from_geometry(
            self.geometry, num_layers=num_layers, num_blocks=num_blocks,
            key_offset=key_offsets.fingerprint if key_offsets is not None else "none")
        self._free = list(range(num_blocks))
        self._write, self._attend = _kernels(self.backend)

    # ---------------------------------------------------------------- blocks
    def key_offset(self, layer_idx: int) -> Optional[torch.Tensor]:
        """``[num_kv_heads, head_size]`` float32 key offsets of a layer on the cache's device, or None."""
        return self._offsets[layer_idx]

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V halves, scales included)."""
        return self.geometry.block_bytes

    def allocate(self, num_tokens: int) -> list[int]:
        """Take enough free blocks for ``num_tokens`` tokens; raises ``LayoutError`` when full."""
        need = -(-num_tokens // self.block_size)
        if need > len(self._free):
            raise LayoutError(f"PagedKVCache: need {need} free blocks, have {len(self._free)}")
        ids, self._free = self._free[:need], self._free[need:]
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(int(b) for b in block_ids)

    def slot_mapping(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` int64 slots of token positions ``start .. start+num_tokens-1``."""
        pos = torch.arange(start, start + num_tokens)
        table = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if start + num_tokens > len(table) * self.block_size:
            raise LayoutError(f"positions up to {start + num_tokens} exceed {len(table)} blocks "
                              f"of {self.block_size} tokens")
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def block_table(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[1, len(block_ids)]`` int32 block table of one sequence."""
        return torch.as_tensor([list(block_ids)], dtype=torch.int32, device=self.device)

    # ---------------------------------------------------------------- kernels
    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize and store K/V rows of one layer.

        Parameters
        ----------
        key, value : [num_tokens, num_kv_heads, head_size], any float dtype (cast to model dtype)
        slot_mapping : [num_tokens] int, ``block_id * block_size + offset``; negative = skip
        """
        v = self.views[layer_idx]
        dt = self.geometry.model_dtype
        key, value = key.to(dt).contiguous(), value.to(dt).contiguous()
        self._write(key, value, v, slot_mapping, self.mode, self.int4_shrink, self._offsets[layer_idx])

    def attend(self, layer_idx: int, q: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
               block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: Optional[float] = None) -> torch.Tensor:
        """Causal paged attention of ``q`` over this layer's cache.

        Parameters
        ----------
        q : [num_tokens, num_q_heads, head_size]; cast to the model dtype
        cu_seqlens_q : [num_seqs + 1] int32; seqused_k : [num_seqs] int32 (queries included)
        block_table : [num_seqs, max_blocks_per_seq] int32

        Returns
        -------
        [num_tokens, num_q_heads, head_size] in the model dtype
        """
        scale = self.geometry.head_size ** -0.5 if softmax_scale is None else softmax_scale
        q = q.to(self.geometry.model_dtype).contiguous()
        return self._attend(q, self.views[layer_idx], cu_seqlens_q, seqused_k, block_table,
                            max_seqlen_q, max_seqlen_k, scale, self.mode)

    # ---------------------------------------------------------------- bytes
    def block_payload(self, layer_idx: int, block_id: int) -> torch.Tensor:
        """The ``2·N·H·P`` bytes of one block of one layer, as a uint8 view (no copy)."""
        return self.caches[layer_idx][block_id].view(torch.uint8).reshape(-1)


def _kernels(backend: str):
    """(write, attend) callables with one signature for every back end."""
    write = _reference_write if backend == "reference" else _triton_write
    attend = _triton_attend if backend == "triton" else _reference_attend
    return write, attend


def _reference_write(key, value, v, slot_mapping, mode, shrink=None, key_offset=None):
    from .reference import reference_reshape_and_cache

    reference_reshape_and_cache(key, value, v.key_cache, v.value_cache, slot_mapping, mode,
                                v.k_scale_cache, v.v_scale_cache, shrink=shrink or (1.0,), key_offset=key_offset)


def _reference_attend(q, v, cu, seqused, table, max_q, max_k, scale, mode):
    from .reference import reference_unified_attention

    out = reference_unified_attention(q, v.key_cache, v.value_cache, cu, seqused, table, scale,
                                      True, (-1, -1), 0.0, mode, v.k_scale_cache, v.v_scale_cache)
    return out.to(q.dtype)


def _triton_write(key, value, v, slot_mapping, mode, shrink=None, key_offset=None):
    from .write import reshape_and_cache_flash, triton_reshape_and_cache_flash_per_token_head_quant

    if mode == KVQuantMode.NONE:
        reshape_and_cache_flash(key, value, v.key_cache, v.value_cache, slot_mapping)
    else:
        extra = {"shrink": shrink} if shrink is not None else {}
        if key_offset is not None:
            extra["key_offset"] = key_offset
        triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache,
            slot_mapping, kv_quant_mode=mode, **extra)


def _triton_attend(q, v, cu, seqused, table, max_q, max_k, scale, mode):
    from .attention import unified_attention

    out = torch.empty_like(q)
    unified_attention(q, v.key_cache, v.value_cache, out, cu, seqused, max_q, max_k, scale,
                      True, (-1, -1), table, 0.0, None, None, None,
                      kv_quant_mode=mode, k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache)
    return out
