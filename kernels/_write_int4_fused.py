"""The fused INT4 write kernel: K then V rows of a tile in one program, rotation by ``tl.dot``
against ±1 Hadamard tiles (GPU) or the oracle's butterfly (CPU), and the MSE encoder.

It is the CPU default, and on the GPU the kernel for the MSE encoder and head sizes above 256;
the shuffle kernel in ``_write_int4_lanes`` is the GPU default otherwise. Launched by
``kernels._write_int4.reshape_and_cache_int4``; the math and the rotation/division options are
described there and in ``_write_math``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import dual_jit
from ._write_math import (int4_codes, int4_scale_zp, int4_sq_err, pack_nibbles, rotate_chunk, row_min_max,
                          to_model_dtype)


@triton.jit
def _int4_write_rows(x_ptr, x_off, cache_ptr, c_off, scale_ptr, s_off, rot_a, rot_b, shrink_ptr, mask,
                     ROWS: tl.constexpr, CH: tl.constexpr, LOG2_CH: tl.constexpr, SPLIT: tl.constexpr,
                     DOT: tl.constexpr, DIV: tl.constexpr, INTERPRET: tl.constexpr,
                     NUM_SHRINK: tl.constexpr):
    """Quantize ROWS rows of K (or V) and store codes and scales where ``mask`` holds.

    A row is one chunk of CH values, or two (SPLIT) whose rotations are joined by the
    oracle's last butterfly stage, so head_size 256 needs only 128x128 rotation tiles.
    """
    cols = tl.arange(0, CH)
    x_row = x_ptr + x_off[:, None]
    xa = tl.load(x_row + cols[None, :], mask=mask[:, None], other=0.0)  # xa: [ROWS, CH] model dtype
    ra = rotate_chunk(xa, rot_a, ROWS, CH, LOG2_CH, DOT, INTERPRET)    # ra: [ROWS, CH] fp32
    if SPLIT:
        xb = tl.load(x_row + CH + cols[None, :], mask=mask[:, None], other=0.0)
        rb = rotate_chunk(xb, rot_b, ROWS, CH, LOG2_CH, DOT, INTERPRET)
        ra, rb = ra + rb, ra - rb
        rb = to_model_dtype(rb, xa.dtype, INTERPRET).to(tl.float32)
    ra = to_model_dtype(ra, xa.dtype, INTERPRET).to(tl.float32)  # SPEC §3: rounded to the model dtype

    lo, hi = row_min_max(ra, INTERPRET)
    if SPLIT:
        lo_b, hi_b = row_min_max(rb, INTERPRET)
        lo = tl.minimum(lo, lo_b, propagate_nan=tl.PropagateNan.ALL)
        hi = tl.maximum(hi, hi_b, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(lo, 0.0, propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(hi, 0.0, propagate_nan=tl.PropagateNan.ALL)
    # false for NaN/Inf rows: those store codes 0 and a quiet-NaN scale, never plausible numbers
    ok = (hi <= 3.4028234663852886e38) & (lo >= -3.4028234663852886e38)
    scale, zp, rcp = int4_scale_zp(lo, hi, INTERPRET, False)
    zph = tl.where(ok, zp + 0.5, float("-inf"))
    qa = int4_codes(ra, scale, zph, rcp, DIV, INTERPRET)
    if SPLIT:
        qb = int4_codes(rb, scale, zph, rcp, DIV, INTERPRET)
    if NUM_SHRINK > 1:  # SPEC §8: per row, keep the shrunk range with the least squared error
        err = int4_sq_err(qa, ra, scale, zp)
        if SPLIT:
            err += int4_sq_err(qb, rb, scale, zp)
        for i in tl.static_range(1, NUM_SHRINK):
            f = tl.load(shrink_ptr + i)
            scale2, zp2, rcp2 = int4_scale_zp(lo * f, hi * f, INTERPRET, False)
            zph2 = tl.where(ok, zp2 + 0.5, float("-inf"))
            qa2 = int4_codes(ra, scale2, zph2, rcp2, DIV, INTERPRET)
            err2 = int4_sq_err(qa2, ra, scale2, zp2)
            if SPLIT:
                qb2 = int4_codes(rb, scale2, zph2, rcp2, DIV, INTERPRET)
                err2 += int4_sq_err(qb2, rb, scale2, zp2)
            take = err2 < err
            if SPLIT:
                qb = tl.where(take[:, None], qb2, qb)
            qa = tl.where(take[:, None], qa2, qa)
            scale = tl.where(take, scale2, scale)
            zp = tl.where(take, zp2, zp)
            err = tl.where(take, err2, err)

    bits = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)  # -16 == ~0xF
    bits = tl.where(ok, bits, 0x7FC00000)  # NAN_SCALE_BITS
    half = tl.arange(0, CH // 2)
    c_row = cache_ptr + c_off[:, None]
    # codes: [ROWS, CH // 2] uint8 per chunk
    tl.store(c_row + half[None, :], pack_nibbles(qa, ROWS, CH), mask=mask[:, None])
    if SPLIT:
        tl.store(c_row + CH // 2 + half[None, :], pack_nibbles(qb, ROWS, CH),
                 mask=mask[:, None])
    tl.store(scale_ptr + s_off, bits, mask=mask)


@dual_jit
def _reshape_and_cache_int4_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, head_size] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size // 2] uint8
    k_scale_ptr, v_scale_ptr,        # [num_blocks, block_size, num_kv_heads] int32 (float32 bits)
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    rot_ptr,                         # DOT: [head_size // CH, CH, CH] diag(s)·H tiles; else [head_size] fp32 signs
    shrink_ptr,                      # [NUM_SHRINK] fp32 range factors (entry 0 is 1.0)
    num_rows, num_tiles, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, CH: tl.constexpr, LOG2_CH: tl.constexpr, SPLIT: tl.constexpr,
    DOT: tl.constexpr, DIV: tl.constexpr, INTERPRET: tl.constexpr, NUM_SHRINK: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(min(num_tiles, programs),)``: each program loads the rotation once, then loops
    over tiles of ROWS (token, head) rows, quantizing the K rows and the same V rows. Rows are
    flattened token-major so a tile is a contiguous stretch of ``key``; K and V share a
    program so the slot loads and the rotation tiles serve both."""
    cols = tl.arange(0, CH)
    if DOT:
        rot_a = tl.load(rot_ptr + cols[:, None] * CH + cols[None, :])  # [CH, CH] model dtype
        rot_b = rot_a
        if SPLIT:
            rot_b = tl.load(rot_ptr + CH * CH + cols[:, None] * CH + cols[None, :])
    else:
        rot_a = tl.load(rot_ptr + cols)  # [CH] fp32 signs
        rot_b = rot_a
        if SPLIT:
            rot_b = tl.load(rot_ptr + CH + cols)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)  # int32: the launcher keeps rows and slots < 2**31
        valid = rows < num_rows
        token = rows // NUM_KV_HEADS  # constexpr divisors: shifts or multiply-highs, not divisions
        head = rows - token * NUM_KV_HEADS
        slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1)
        mask = valid & (slot >= 0) & (slot < num_slots)  # the launcher checks the range; never write outside
        slot = slot.to(tl.int32)  # rows outside the mask compute junk offsets that no access uses
        blk = (slot // BLOCK_SIZE).to(tl.int64)
        off = slot % BLOCK_SIZE
        token = token.to(tl.int64)
        # cache strides arrive divided by CACHE_ALIGN so the compiler knows the rows' alignment
        kc_off = (blk * stride_kc_block + off * stride_kc_slot + head * stride_kc_head) * CACHE_ALIGN
        vc_off = (blk * stride_vc_block + off * stride_vc_slot + head * stride_vc_head) * CACHE_ALIGN
        ks_off = blk * stride_ks_block + off * stride_ks_slot + head * stride_ks_head
        vs_off = blk * stride_vs_block + off * stride_vs_slot + head * stride_vs_head
        _int4_write_rows(key_ptr, token * stride_key_token + head * stride_key_head, key_cache_ptr, kc_off,
                         k_scale_ptr, ks_off, rot_a, rot_b, shrink_ptr, mask,
                         ROWS, CH, LOG2_CH, SPLIT, DOT, DIV, INTERPRET, NUM_SHRINK)
        _int4_write_rows(value_ptr, token * stride_value_token + head * stride_value_head, value_cache_ptr,
                         vc_off, v_scale_ptr, vs_off, rot_a, rot_b, shrink_ptr, mask,
                         ROWS, CH, LOG2_CH, SPLIT, DOT, DIV, INTERPRET, NUM_SHRINK)
