"""The INT8 / FP8 per-token-head writer (path ``symmetric``): one scale per row, no rotation.

``scale = max(absmax(x) / QMAX, 1e-6)`` (QMAX 127 / 448); INT8 codes round half to even and
clamp to [-128, 127], FP8 codes clamp to ±448 and cast to e4m3fn (round to nearest even). The
division is correctly rounded (``device_math.divide_rows``), so codes and scales equal the
oracle's (``kernels.reference.quantize_symmetric_rows``) bit for bit. A row holding NaN/Inf
stores codes 0 and the quiet-NaN scale ``NAN_SCALE_BITS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layouts import KVQuantMode

from .._jit import dual_jit, next_pow2
from .checks import cache_alignment, stride_args
from .device_math import (NAN_SCALE, divide_rows, markstein_div, round_half_even, row_min_max, tile_rows,
                          to_fp8e4m3_bits)
from .plan import WriteArgs, WritePlan, launch


@triton.jit
def _symmetric_rows(x_ptr, x_off, cache_ptr, c_off, scale_ptr, s_off, mask,
                    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                    INTERPRET: tl.constexpr):
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
    v = tl.where(ok[:, None], divide_rows(x, scale, rcp, INTERPRET), 0.0)
    if FP8:
        q = to_fp8e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0), INTERPRET)
    else:
        q = tl.minimum(tl.maximum(round_half_even(v), -128.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    tl.store(cache_ptr + c_off[:, None] + cols[None, :], q, mask=m2)
    bits = tl.where(ok, scale.to(tl.int32, bitcast=True), NAN_SCALE)
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
    INTERPRET: tl.constexpr, CACHE_ALIGN: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_kv_heads, ROWS),)``: one program quantizes ROWS (token, head)
    rows of K and the same rows of V (shared slot loads); rows are token-major, so a tile is a
    contiguous stretch of ``key``."""
    mask, token, head, blk, off = tile_rows(tl.program_id(0), num_rows, slot_mapping_ptr, num_slots,
                                            ROWS, NUM_KV_HEADS, BLOCK_SIZE)
    # cache strides arrive divided by CACHE_ALIGN so the compiler knows the rows' alignment
    kc = (blk * stride_kc_block + off * stride_kc_slot + head * stride_kc_head) * CACHE_ALIGN
    _symmetric_rows(key_ptr, token * stride_key_token + head * stride_key_head, key_cache_ptr, kc,
                    k_scale_ptr, blk * stride_ks_block + off * stride_ks_slot + head * stride_ks_head,
                    mask, HEAD_SIZE, BLOCK_D, FP8, INTERPRET)
    vc = (blk * stride_vc_block + off * stride_vc_slot + head * stride_vc_head) * CACHE_ALIGN
    _symmetric_rows(value_ptr, token * stride_value_token + head * stride_value_head, value_cache_ptr, vc,
                    v_scale_ptr, blk * stride_vs_block + off * stride_vs_slot + head * stride_vs_head,
                    mask, HEAD_SIZE, BLOCK_D, FP8, INTERPRET)


def launch_symmetric(plan: WritePlan, t: WriteArgs) -> None:
    """Run a ``symmetric`` plan on ``t`` (validated by :func:`~kernels.write.plan.write_plan`)."""
    shape, tuning = plan.shape, plan.tuning
    align = cache_alignment(t.key_cache, t.value_cache)
    ks, vs = t.k_scale_cache.view(torch.int32), t.v_scale_cache.view(torch.int32)
    launch(_reshape_and_cache_symmetric_kernel, plan.grid, dict(
        key_ptr=t.key, value_ptr=t.value,
        key_cache_ptr=t.key_cache.view(torch.uint8), value_cache_ptr=t.value_cache.view(torch.uint8),
        k_scale_ptr=ks, v_scale_ptr=vs, slot_mapping_ptr=t.slot_mapping,
        num_rows=shape.num_tokens * shape.num_kv_heads, num_slots=shape.num_blocks * shape.block_size,
        **stride_args(t, align, ks, vs),
        ROWS=tuning.rows, HEAD_SIZE=shape.head_size, BLOCK_D=next_pow2(shape.head_size),
        FP8=plan.mode == KVQuantMode.FP8_PER_TOKEN_HEAD, INTERPRET=plan.interpret,
        CACHE_ALIGN=align, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        num_warps=tuning.num_warps, enable_fp_fusion=False))
