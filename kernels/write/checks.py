"""Argument checks of the cache writes, run once by ``kernels.write.plan.write_plan``.

Everything here runs before a kernel is launched, so a bad call raises a
:class:`layouts.LayoutError` that says expected vs got and leaves every cache untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from layouts import KVQuantMode, LayoutError, check_head_size
from layouts.geometry import data_head_size

MODEL_DTYPES = (torch.bfloat16, torch.float16)
CACHE_DTYPES = {
    KVQuantMode.INT8_PER_TOKEN_HEAD: (torch.int8,),
    KVQuantMode.FP8_PER_TOKEN_HEAD: (torch.float8_e4m3fn,),
    KVQuantMode.INT4_PER_TOKEN_HEAD: (torch.uint8,),
    KVQuantMode.NONE: MODEL_DTYPES,
}


class WriteShape(NamedTuple):
    """What the launchers need once the arguments are known to be consistent."""

    num_tokens: int        # rows of slot_mapping: tokens actually written
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise LayoutError(f"{name}: expected device {device} (that of key), got {t.device}")


def check_write_args(key, value, key_cache, value_cache, slot_mapping, mode: KVQuantMode,
                     k_scale_cache=None, v_scale_cache=None, check_slots: bool = True) -> WriteShape:
    """Validate one cache write; raise :class:`LayoutError` naming the tensor on any mismatch.

    Parameters
    ----------
    key, value : [>= num_tokens, num_kv_heads, head_size] bf16/fp16, last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size]
        storage dtype of ``mode``, last dim contiguous, any other strides
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped
    mode : KVQuantMode (not FP8_PER_TENSOR)
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, or None
        when ``mode`` is NONE
    check_slots : bool
        Also check ``max(slot_mapping) < num_blocks * block_size`` (one device sync).
    """
    mode = KVQuantMode(mode)
    if mode not in CACHE_DTYPES:
        raise LayoutError(f"kv_quant_mode: expected one of {[m.name for m in CACHE_DTYPES]}, got {mode.name}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _tensor(name, t)
    if key.dim() != 3:
        raise LayoutError(f"key: expected [num_tokens, num_kv_heads, head_size], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise LayoutError(f"value: expected shape {tuple(key.shape)} (that of key), got {tuple(value.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in MODEL_DTYPES:
            raise LayoutError(f"{name}: expected dtype bfloat16 or float16, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise LayoutError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
    if value.dtype != key.dtype:
        raise LayoutError(f"value: expected dtype {key.dtype} (that of key), got {value.dtype}")
    num_kv_heads, head_size = int(key.shape[1]), int(key.shape[2])
    check_head_size(mode, head_size)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise LayoutError(f"slot_mapping: expected a 1-D int32/int64 tensor, got {slot_mapping.dim()}-D "
                          f"{slot_mapping.dtype}")
    num_tokens = int(slot_mapping.shape[0])
    if num_tokens > key.shape[0]:
        raise LayoutError(f"slot_mapping: expected at most {key.shape[0]} entries (tokens in key), got {num_tokens}")

    d = data_head_size(mode, head_size)
    if key_cache.dim() != 4:
        raise LayoutError(f"key_cache: expected [num_blocks, block_size, num_kv_heads, {d}], "
                          f"got shape {tuple(key_cache.shape)}")
    num_blocks, block_size = int(key_cache.shape[0]), int(key_cache.shape[1])
    want = (num_blocks, block_size, num_kv_heads, d)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tuple(t.shape) != want:
            raise LayoutError(f"{name}: expected shape {want} ({mode.name}, head_size {head_size}, "
                              f"{num_kv_heads} kv heads), got {tuple(t.shape)}")
        if t.dtype not in CACHE_DTYPES[mode]:
            raise LayoutError(f"{name}: expected dtype {' or '.join(map(str, CACHE_DTYPES[mode]))} "
                              f"for {mode.name}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise LayoutError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
    if value_cache.dtype != key_cache.dtype:
        raise LayoutError(f"value_cache: expected dtype {key_cache.dtype} (that of key_cache), got {value_cache.dtype}")
    if mode.per_token_head:
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if t is None:
                raise LayoutError(f"{name}: expected a float32 [{num_blocks}, {block_size}, {num_kv_heads}] "
                                  f"tensor for {mode.name}, got None")
            _tensor(name, t)
            if tuple(t.shape) != want[:3] or t.dtype != torch.float32:
                raise LayoutError(f"{name}: expected float32 {want[:3]}, got {t.dtype} {tuple(t.shape)}")
    _same_device(key.device, value=value, key_cache=key_cache, value_cache=value_cache,
                 slot_mapping=slot_mapping, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
    if num_tokens * num_kv_heads >= 2**31 or num_blocks * block_size >= 2**31:
        raise LayoutError(f"rows ({num_tokens} x {num_kv_heads}) and slots ({num_blocks} x {block_size}): "
                          f"expected fewer than 2**31 each (kernels index them in int32)")
    if check_slots and num_tokens:
        top = int(slot_mapping.max())
        if top >= num_blocks * block_size:
            raise LayoutError(f"slot_mapping: expected slots < num_blocks * block_size = "
                              f"{num_blocks * block_size}, got max slot {top}")
    return WriteShape(num_tokens, num_kv_heads, head_size, num_blocks, block_size)


def cache_alignment(*caches: torch.Tensor) -> int:
    """4 when every block/slot/head stride of the caches is a multiple of 4 elements, else 1.

    Packed rows are ``P = data_head_size + 4`` bytes, never a multiple of 16, so the compiler
    would otherwise assume byte alignment and store codes one byte at a time. Launchers pass
    ``stride // align`` and multiply by ``align`` in the kernel, which proves the alignment.
    """
    return 4 if all(st % 4 == 0 for c in caches for st in c.stride()[:3]) else 1


def stride_args(t, align: int = 1, ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> dict:
    """The stride arguments every write kernel takes: K / V input rows (token, head), the
    caches' (block, slot, head) strides in units of ``align`` elements (:func:`cache_alignment`),
    and, with ``ks`` / ``vs``, the scale views' (block, slot, head) strides."""
    kcs = [st // align for st in t.key_cache.stride()[:3]]
    vcs = [st // align for st in t.value_cache.stride()[:3]]
    args = dict(
        stride_key_token=t.key.stride(0), stride_key_head=t.key.stride(1),
        stride_value_token=t.value.stride(0), stride_value_head=t.value.stride(1),
        stride_kc_block=kcs[0], stride_kc_slot=kcs[1], stride_kc_head=kcs[2],
        stride_vc_block=vcs[0], stride_vc_slot=vcs[1], stride_vc_head=vcs[2])
    if ks is not None:
        args.update(stride_ks_block=ks.stride(0), stride_ks_slot=ks.stride(1), stride_ks_head=ks.stride(2),
                    stride_vs_block=vs.stride(0), stride_vs_slot=vs.stride(1), stride_vs_head=vs.stride(2))
    return args


def packed_rows(t: torch.Tensor) -> bool:
    """Whether ``[num_tokens, num_kv_heads, head_size]`` ``t`` is one stretch of rows (head stride
    ``head_size``, token stride ``num_kv_heads · head_size``)."""
    return t.stride(0) == t.shape[1] * t.shape[2] and t.stride(1) == t.shape[2]


def lane_layout_ok(*inputs: torch.Tensor) -> bool:
    """Whether Triton will load ``[num_tokens, num_kv_heads, head_size]`` rows of ``inputs`` in
    16-byte vectors, the layout the ``int4-lanes`` and ``int4-mma`` writers hand to their inline
    asm: every base address 16-byte aligned, and rows packed (:func:`packed_rows`) or both row
    strides multiples of 16 elements (the divisibility Triton specializes on). Otherwise the
    compiler may spread a row's columns over other lanes and the asm would combine wrong values,
    so :func:`~kernels.write.plan.write_plan` takes the layout-agnostic ``int4-fused`` path instead."""
    return all(t.data_ptr() % 16 == 0 and (packed_rows(t) or (t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0))
               for t in inputs)


def check_key_offset(key_offset, mode: KVQuantMode, shape: WriteShape, device: torch.device) -> None:
    """Validate the INT4 key offset: float32 (or bf16/fp16) ``[num_kv_heads, head_size]`` on the
    device of ``key``, or None. Raises :class:`LayoutError` naming ``key_offset``."""
    if key_offset is None:
        return
    if mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        raise LayoutError(f"key_offset: expected None for {mode.name} (key smoothing is INT4_PER_TOKEN_HEAD only), "
                          f"got a tensor")
    _tensor("key_offset", key_offset)
    want = (shape.num_kv_heads, shape.head_size)
    if tuple(key_offset.shape) != want or key_offset.dtype not in (torch.float32,) + MODEL_DTYPES:
        raise LayoutError(f"key_offset: expected float32 {list(want)} ([num_kv_heads, head_size]), "
                          f"got {key_offset.dtype} {list(key_offset.shape)}")
    _same_device(device, key_offset=key_offset)
