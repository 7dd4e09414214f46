"""The experimental INT4 write kernel with K and V in separate programs (``kernel="split"``).

Same math and bytes as the fused kernel in ``_write_int4`` (the oracle is
``kernels.reference.quantize_int4_rows``); half the registers per thread (offline ptxas: 224 ->
117 at head_size 128), but on the H200 no faster at 64k token-heads and, with two pipeline
stages, one row of a 65,536-token check off the oracle, so it is opt-in; see docs/bench/write.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import dual_jit
from ._write_math import (int4_codes_fast, int4_scale_zp, pack_nibbles, rotate_chunk, round_to_model_f32,
                          row_min_max)


@triton.jit
def _int4_split_rows(x_ptr, stride_x_token, stride_x_head, cache_ptr, stride_c_block, stride_c_slot,
                     stride_c_head, scale_ptr, stride_s_block, stride_s_slot, stride_s_head,
                     slot_mapping_ptr, rot_a, rot_b, num_rows, num_tiles, num_slots,
                     ROWS: tl.constexpr, CH: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                     CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     CONTIG: tl.constexpr):
    """Persistent loop over tiles of ROWS rows of one of K or V (``tl.dot`` rotation, SPLIT as in
    ``_int4_write_rows``). Range from the fp32 rotation (rounding is monotone, so min/max of the
    rounded row is the rounded min/max), then one rounded copy of the tile, then codes."""
    cols = tl.arange(0, CH)
    half = tl.arange(0, CH // 2)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        valid = rows < num_rows
        token = rows // NUM_KV_HEADS
        head = rows - token * NUM_KV_HEADS
        if CONTIG:  # [num_tokens, num_kv_heads, head_size] contiguous: a tile is one stretch of memory
            x_row = x_ptr + (rows.to(tl.int64) * (CH * (1 + SPLIT)))[:, None]
        else:
            x_row = x_ptr + (token.to(tl.int64) * stride_x_token + head * stride_x_head)[:, None]
        # the input tile does not depend on the slots: its load (and the pipeliner's prefetch) comes first
        xa = tl.load(x_row + cols[None, :], mask=valid[:, None], other=0.0)  # [ROWS, CH] model dtype
        slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1)
        mask = valid & (slot >= 0) & (slot < num_slots)
        slot = slot.to(tl.int32)
        blk = (slot // BLOCK_SIZE).to(tl.int64)
        off = slot % BLOCK_SIZE
        ra = rotate_chunk(xa, rot_a, ROWS, CH, 0, True, INTERPRET)  # [ROWS, CH] fp32
        if SPLIT:
            xb = tl.load(x_row + CH + cols[None, :], mask=valid[:, None], other=0.0)
            rb = rotate_chunk(xb, rot_b, ROWS, CH, 0, True, INTERPRET)
            ra, rb = ra + rb, ra - rb
        lo, hi = row_min_max(ra, INTERPRET)
        if SPLIT:
            lo_b, hi_b = row_min_max(rb, INTERPRET)
            lo = tl.minimum(lo, lo_b, propagate_nan=tl.PropagateNan.ALL)
            hi = tl.maximum(hi, hi_b, propagate_nan=tl.PropagateNan.ALL)
        lo = tl.minimum(round_to_model_f32(lo, xa.dtype, INTERPRET), 0.0, propagate_nan=tl.PropagateNan.ALL)
        hi = tl.maximum(round_to_model_f32(hi, xa.dtype, INTERPRET), 0.0, propagate_nan=tl.PropagateNan.ALL)
        ok = (hi <= 3.4028234663852886e38) & (lo >= -3.4028234663852886e38)  # false for NaN/Inf rows
        scale, zp, rcp = int4_scale_zp(lo, hi)
        zph = tl.where(ok, zp + 0.5, float("-inf"))
        qa = int4_codes_fast(round_to_model_f32(ra, xa.dtype, INTERPRET), scale, zph, rcp, INTERPRET)
        c_row = cache_ptr + ((blk * stride_c_block + off * stride_c_slot + head * stride_c_head)
                             * CACHE_ALIGN)[:, None]
        tl.store(c_row + half[None, :], pack_nibbles(qa, ROWS, CH), mask=mask[:, None])
        if SPLIT:
            qb = int4_codes_fast(round_to_model_f32(rb, xa.dtype, INTERPRET), scale, zph, rcp, INTERPRET)
            tl.store(c_row + CH // 2 + half[None, :], pack_nibbles(qb, ROWS, CH), mask=mask[:, None])
        bits = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)
        bits = tl.where(ok, bits, 0x7FC00000)  # NAN_SCALE_BITS
        tl.store(scale_ptr + blk * stride_s_block + off * stride_s_slot + head * stride_s_head, bits, mask=mask)


@dual_jit
def _reshape_and_cache_int4_split_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    slot_mapping_ptr, rot_ptr,       # as in _reshape_and_cache_int4_kernel (DOT tiles only)
    num_rows, num_tiles, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, CH: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONTIG: tl.constexpr,
):
    """Grid ``(programs, 2)``: axis 1 picks K (0) or V (1), so a program keeps one tile's state
    live instead of two and twice as many programs share the work; each loops over tiles."""
    cols = tl.arange(0, CH)
    rot_a = tl.load(rot_ptr + cols[:, None] * CH + cols[None, :])  # [CH, CH] model dtype
    rot_b = rot_a
    if SPLIT:
        rot_b = tl.load(rot_ptr + CH * CH + cols[:, None] * CH + cols[None, :])
    kv = tl.program_id(1) == 0  # one loop for both (two loops would double the pipeliner's buffers)
    _int4_split_rows(tl.where(kv, key_ptr, value_ptr), tl.where(kv, stride_key_token, stride_value_token),
                     tl.where(kv, stride_key_head, stride_value_head),
                     tl.where(kv, key_cache_ptr, value_cache_ptr), tl.where(kv, stride_kc_block, stride_vc_block),
                     tl.where(kv, stride_kc_slot, stride_vc_slot), tl.where(kv, stride_kc_head, stride_vc_head),
                     tl.where(kv, k_scale_ptr, v_scale_ptr), tl.where(kv, stride_ks_block, stride_vs_block),
                     tl.where(kv, stride_ks_slot, stride_vs_slot), tl.where(kv, stride_ks_head, stride_vs_head),
                     slot_mapping_ptr, rot_a, rot_b, num_rows, num_tiles, num_slots,
                     ROWS, CH, SPLIT, INTERPRET, CACHE_ALIGN, NUM_KV_HEADS, BLOCK_SIZE, CONTIG)
