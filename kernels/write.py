"""Cache-write kernels: K/V rows of one step into a paged cache, quantized per (token, head).

Public launchers (names as in vLLM):

- :func:`triton_reshape_and_cache_flash_per_token_head_quant` — INT8 (round half to even) and
  FP8 e4m3fn (clamp ±448, cast) with an inline float32 scale per row; INT4 goes to
- :func:`reshape_and_cache_int4` (``kernels._write_int4``) — rotation, codes and scale fused;
- :func:`reshape_and_cache_flash` — unquantized bf16/fp16 caches.

Every launcher takes four separate tensors or the four views of one packed per-layer cache
(``layouts.split_kv_cache``), validates everything before launching (``LayoutError`` saying
expected vs got; nothing is written on error), skips negative slots, and runs on CUDA
tensors compiled or on CPU tensors through Triton's interpreter. Oracle:
``kernels.reference.reference_reshape_and_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layouts import KVQuantMode, LayoutError

from ._jit import cdiv, dual_jit, interpreting, next_pow2
from ._write_checks import cache_alignment, check_write_args
from ._write_int4 import DIVISIONS, reshape_and_cache_int4
from ._write_math import divide_rows, markstein_div, round_half_even, row_min_max, to_fp8e4m3_bits, to_model_dtype

__all__ = ["reshape_and_cache_flash", "reshape_and_cache_int4",
           "triton_reshape_and_cache_flash_per_token_head_quant"]


@triton.jit
def _tile_rows(tile, num_rows, slot_mapping_ptr, num_slots,
               ROWS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Rows ``tile*ROWS ..``: (write mask, token int64, head, block int64, offset in block), [ROWS] each."""
    rows = tile * ROWS + tl.arange(0, ROWS)  # int32: the launcher keeps rows and slots < 2**31
    valid = rows < num_rows
    token = rows // NUM_KV_HEADS
    head = rows - token * NUM_KV_HEADS
    slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1)
    mask = valid & (slot >= 0) & (slot < num_slots)  # never write outside, checked or not
    slot = slot.to(tl.int32)  # rows outside the mask compute offsets that no access uses
    blk = (slot // BLOCK_SIZE).to(tl.int64)
    off = slot % BLOCK_SIZE
    return mask, token.to(tl.int64), head, blk, off


@triton.jit
def _symmetric_rows(x_ptr, x_off, cache_ptr, c_off, scale_ptr, s_off, mask,
                    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                    DIV: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize rows ``x: [ROWS, HEAD_SIZE]`` to int8 / e4m3 codes and store codes and scales."""
    cols = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (cols[None, :] < HEAD_SIZE)
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)  # [ROWS, BLOCK_D]
    lo, hi = row_min_max(x, INTERPRET)  # NaN anywhere in a row -> NaN
    amax = tl.maximum(-lo, hi)
    ok = amax <= 3.4028234663852886e38  # false for NaN/Inf rows: codes 0, quiet-NaN scale
    if FP8:
        scale = tl.maximum(markstein_div(amax, 448.0, 1.0 / 448.0, INTERPRET), 1e-6)
    else:
        scale = tl.maximum(markstein_div(amax, 127.0, 1.0 / 127.0, INTERPRET), 1e-6)
    rcp = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    v = tl.where(ok[:, None], divide_rows(x, scale, rcp, DIV, INTERPRET), 0.0)
    if FP8:
        q = to_fp8e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0), INTERPRET)
    else:
        q = tl.minimum(tl.maximum(round_half_even(v), -128.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    tl.store(cache_ptr + c_off[:, None] + cols[None, :], q, mask=m2)
    bits = tl.where(ok, scale.to(tl.int32, bitcast=True), 0x7FC00000)  # NAN_SCALE_BITS
    tl.store(scale_ptr + s_off, bits, mask=mask)


@dual_jit
def _reshape_and_cache_symmetric_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, HEAD_SIZE] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_SIZE] uint8 (int8/e4m3 bits)
    k_scale_ptr, v_scale_ptr,        # [num_blocks, block_size, num_kv_heads] int32 (float32 bits)
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    DIV: tl.constexpr, INTERPRET: tl.constexpr, CACHE_ALIGN: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_kv_heads, ROWS),)``: one program quantizes ROWS (token, head)
    rows of K and the same rows of V (shared slot loads); rows are token-major, so a tile is a
    contiguous stretch of ``key``."""
    mask, token, head, blk, off = _tile_rows(tl.program_id(0), num_rows, slot_mapping_ptr, num_slots,
                                             ROWS, NUM_KV_HEADS, BLOCK_SIZE)
    # cache strides arrive divided by CACHE_ALIGN so the compiler knows the rows' alignment
    kc = (blk * stride_kc_block + off * stride_kc_slot + head * stride_kc_head) * CACHE_ALIGN
    _symmetric_rows(key_ptr, token * stride_key_token + head * stride_key_head, key_cache_ptr, kc,
                    k_scale_ptr, blk * stride_ks_block + off * stride_ks_slot + head * stride_ks_head,
                    mask, HEAD_SIZE, BLOCK_D, FP8, DIV, INTERPRET)
    vc = (blk * stride_vc_block + off * stride_vc_slot + head * stride_vc_head) * CACHE_ALIGN
    _symmetric_rows(value_ptr, token * stride_value_token + head * stride_value_head, value_cache_ptr, vc,
                    v_scale_ptr, blk * stride_vs_block + off * stride_vs_slot + head * stride_vs_head,
                    mask, HEAD_SIZE, BLOCK_D, FP8, DIV, INTERPRET)


def _symmetric_tiles(head_size: int, on_cpu: bool, rows, num_warps) -> tuple:
    """(rows, warps) per program for the INT8/FP8 and bf16/fp16 writers. The interpreter runs a
    whole tile per numpy op, so big tiles; on the GPU one warp with 1 KiB of values measured
    fastest for INT8/FP8 on the H200 at 65,536 tokens x 8 heads x 128 (159 / 148 us against
    214 / 197 us with 32 rows and 4 warps; docs/bench/write.md, 2026-11-29). The bf16/fp16 writer
    passes its own ``num_warps`` (default 4) and so gets these rows with 4 warps: 94-95% of copy
    at head_size 64/128/256 in the same runs, as with its earlier 4096 // head_size rows."""
    d = next_pow2(head_size)
    if on_cpu:
        return rows or max(1, 4096 // d), num_warps or 4
    return rows or max(8, 1024 // d), num_warps or 1


def triton_reshape_and_cache_flash_per_token_head_quant(
        key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_quant_mode: KVQuantMode = KVQuantMode.INT8_PER_TOKEN_HEAD, *, check_slots: bool = True,
        rows=None, num_warps=None, div: str = "markstein", **int4_options) -> None:
    """Quantize K/V rows per (token, head) and write codes and inline scales into a paged cache.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU; last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size], written in place
        int8 (INT8), float8_e4m3fn (FP8) or uint8 with ``head_size // 2`` packed codes (INT4);
        separate tensors or the views of one packed cache from ``layouts.split_kv_cache``.
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, written in place
        INT8/FP8: ``scale = max(absmax / QMAX, 1e-6)`` (QMAX 127 / 448); a row holding NaN/Inf
        stores codes 0 and ``NAN_SCALE_BITS`` (a quiet NaN).
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped (cache left as it was).
    kv_quant_mode : INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD or INT4_PER_TOKEN_HEAD.
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
    rows, num_warps, div : tuning overrides (benchmarks only), passed on to INT4 too.
    **int4_options : passed to :func:`reshape_and_cache_int4` (``shrink``, tuning).

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride, head-size or slot-range mismatch; nothing is written.
    """
    mode = KVQuantMode(kv_quant_mode)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        tiles = dict(rows=rows, num_warps=num_warps, div=None if div == "markstein" else div)
        return reshape_and_cache_int4(key, value, key_cache, value_cache, slot_mapping, k_scale_cache,
                                      v_scale_cache, check_slots=check_slots,
                                      **{k: v for k, v in tiles.items() if v is not None}, **int4_options)
    if mode not in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        raise LayoutError(f"kv_quant_mode: expected INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD or "
                          f"INT4_PER_TOKEN_HEAD, got {mode.name}")
    if int4_options:
        raise TypeError(f"options {sorted(int4_options)} apply to INT4 only, got them for {mode.name}")
    shape = check_write_args(key, value, key_cache, value_cache, slot_mapping, mode,
                             k_scale_cache, v_scale_cache, check_slots)
    num_rows = shape.num_tokens * shape.num_kv_heads
    if num_rows == 0:
        return
    cpu = interpreting(key)
    rows, num_warps = _symmetric_tiles(shape.head_size, cpu, rows, num_warps)
    align = cache_alignment(key_cache, value_cache)
    ks, vs = k_scale_cache.view(torch.int32), v_scale_cache.view(torch.int32)
    _reshape_and_cache_symmetric_kernel[(cdiv(num_rows, rows),)](
        key, value, key_cache.view(torch.uint8), value_cache.view(torch.uint8), ks, vs, slot_mapping,
        num_rows, shape.num_blocks * shape.block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *(st // align for st in key_cache.stride()[:3]), *(st // align for st in value_cache.stride()[:3]),
        *ks.stride(), *vs.stride(),
        ROWS=rows, HEAD_SIZE=shape.head_size, BLOCK_D=next_pow2(shape.head_size),
        FP8=mode == KVQuantMode.FP8_PER_TOKEN_HEAD, DIV=DIVISIONS[div], INTERPRET=cpu,
        CACHE_ALIGN=align, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        num_warps=num_warps, enable_fp_fusion=False,
    )


@dual_jit
def _reshape_and_cache_flash_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, HEAD_SIZE] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_SIZE] bf16/fp16
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_kv_heads, ROWS),)``: one program copies ROWS (token, head)
    rows of K and V into their slots, casting to the cache dtype (round to nearest even)."""
    mask, token, head, blk, off = _tile_rows(tl.program_id(0), num_rows, slot_mapping_ptr, num_slots,
                                             ROWS, NUM_KV_HEADS, BLOCK_SIZE)
    xk = token * stride_key_token + head * stride_key_head
    xv = token * stride_value_token + head * stride_value_head
    kc = blk * stride_kc_block + off * stride_kc_slot + head * stride_kc_head
    vc = blk * stride_vc_block + off * stride_vc_slot + head * stride_vc_head
    cols = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (cols[None, :] < HEAD_SIZE)
    # k, v: [ROWS, BLOCK_D]
    k = tl.load(key_ptr + xk[:, None] + cols[None, :], mask=m2)
    v = tl.load(value_ptr + xv[:, None] + cols[None, :], mask=m2)
    dtype = key_cache_ptr.dtype.element_ty
    if k.dtype != dtype:
        k = to_model_dtype(k.to(tl.float32), dtype, INTERPRET)
        v = to_model_dtype(v.to(tl.float32), dtype, INTERPRET)
    tl.store(key_cache_ptr + kc[:, None] + cols[None, :], k, mask=m2)
    tl.store(value_cache_ptr + vc[:, None] + cols[None, :], v, mask=m2)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                            check_slots: bool = True, rows=None, num_warps: int = 4) -> None:
    """Write K/V rows unquantized into a bf16/fp16 paged cache.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU; last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_size] bf16/fp16, written in place
        Cast from the input dtype (round to nearest even) when they differ.
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped (cache left as it was).
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
    rows, num_warps : tuning overrides (benchmarks only).

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride or slot-range mismatch; nothing is written.
    """
    shape = check_write_args(key, value, key_cache, value_cache, slot_mapping, KVQuantMode.NONE,
                             check_slots=check_slots)
    num_rows = shape.num_tokens * shape.num_kv_heads
    if num_rows == 0:
        return
    cpu = interpreting(key)
    rows, num_warps = _symmetric_tiles(shape.head_size, cpu, rows, num_warps)
    _reshape_and_cache_flash_kernel[(cdiv(num_rows, rows),)](
        key, value, key_cache, value_cache, slot_mapping, num_rows, shape.num_blocks * shape.block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        ROWS=rows, HEAD_SIZE=shape.head_size, BLOCK_D=next_pow2(shape.head_size),
        INTERPRET=cpu, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        num_warps=num_warps,
    )
