"""The INT4 writer for every layout and encoder (path ``int4-fused``): K then V rows of a tile
in one program, rotation by ``tl.dot`` against ±1 Hadamard tiles (GPU) or the oracle's
butterfly (CPU), and the MSE encoder.

It runs on CPU (the interpreter runs its whole tiles per numpy operation, fastest there) and,
on the GPU, for what the register paths (``int4_lanes``) cannot write: the MSE encoder (several
range factors per row), head sizes above 256, and K/V rows Triton cannot load in 16-byte
vectors. The ``tl.dot`` rotation adds its exact ±1 products in another order than the oracle,
so a rare rotated value rounds to the neighbouring bf16/fp16 (a tie row, within one code step);
the butterfly rotation is bit-identical to the oracle. With a key offset each K row loses its
head's offset (model dtype, rounded once) right after its load, before the rotation.
"""

from __future__ import annotations

import triton
import triton.language as tl

import functools

import torch

from layouts import rht_signs
from layouts.rotation import rht_sign_seed

from .._jit import dual_jit
from .checks import cache_alignment, stride_args
from .device_math import (NAN_SCALE, int4_codes, int4_scale_zp, int4_sq_err, pack_nibbles, rotate_chunk,
                          row_min_max, to_model_dtype)
from .plan import WriteArgs, WritePlan, launch


@triton.jit
def _smoothed(x, m_row, mask, OFFSET: tl.constexpr, INTERPRET: tl.constexpr):
    """``x: [ROWS, CH]`` (model dtype) minus its rows' key offsets at ``m_row`` (model dtype),
    subtracted in fp32 and rounded to the model dtype, as ``kernels.reference.smooth_keys``."""
    if OFFSET:
        m = tl.load(m_row, mask=mask[:, None], other=0.0)  # m: [ROWS, CH] model dtype
        x = to_model_dtype(x.to(tl.float32) - m.to(tl.float32), x.dtype, INTERPRET)
    return x


@triton.jit
def _int4_write_rows(x_ptr, x_off, cache_ptr, c_off, scale_ptr, s_off, rot_a, rot_b, shrink_ptr, mask,
                     m_ptr, m_off, ROWS: tl.constexpr, CH: tl.constexpr, LOG2_CH: tl.constexpr,
                     SPLIT: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr, NUM_SHRINK: tl.constexpr,
                     OFFSET: tl.constexpr):
    """Quantize ROWS rows of K (or V) and store codes and scales where ``mask`` holds.

    A row is one chunk of CH values, or two (SPLIT) whose rotations are joined by the
    oracle's last butterfly stage, so head_size 256 needs only 128x128 rotation tiles.
    ``OFFSET``: subtract the rows' key offsets (``m_ptr + m_off``, model dtype) before the
    rotation, in the same pass.
    """
    cols = tl.arange(0, CH)
    x_row = x_ptr + x_off[:, None]
    m_row = m_ptr + m_off[:, None]
    xa = tl.load(x_row + cols[None, :], mask=mask[:, None], other=0.0)  # xa: [ROWS, CH] model dtype
    xa = _smoothed(xa, m_row + cols[None, :], mask, OFFSET, INTERPRET)
    ra = rotate_chunk(xa, rot_a, ROWS, CH, LOG2_CH, DOT, INTERPRET)    # ra: [ROWS, CH] fp32
    if SPLIT:
        xb = tl.load(x_row + CH + cols[None, :], mask=mask[:, None], other=0.0)
        xb = _smoothed(xb, m_row + CH + cols[None, :], mask, OFFSET, INTERPRET)
        rb = rotate_chunk(xb, rot_b, ROWS, CH, LOG2_CH, DOT, INTERPRET)
        ra, rb = ra + rb, ra - rb
        rb = to_model_dtype(rb, xa.dtype, INTERPRET).to(tl.float32)
    ra = to_model_dtype(ra, xa.dtype, INTERPRET).to(tl.float32)  # the rotation is rounded to the model dtype

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
    qa = int4_codes(ra, scale, zph, rcp, INTERPRET)
    if SPLIT:
        qb = int4_codes(rb, scale, zph, rcp, INTERPRET)
    if NUM_SHRINK > 1:  # the MSE encoder: per row, keep the shrunk range with the least squared error
        err = int4_sq_err(qa, ra, scale, zp)
        if SPLIT:
            err += int4_sq_err(qb, rb, scale, zp)
        for i in tl.static_range(1, NUM_SHRINK):
            f = tl.load(shrink_ptr + i)
            scale2, zp2, rcp2 = int4_scale_zp(lo * f, hi * f, INTERPRET, False)
            zph2 = tl.where(ok, zp2 + 0.5, float("-inf"))
            qa2 = int4_codes(ra, scale2, zph2, rcp2, INTERPRET)
            err2 = int4_sq_err(qa2, ra, scale2, zp2)
            if SPLIT:
                qb2 = int4_codes(rb, scale2, zph2, rcp2, INTERPRET)
                err2 += int4_sq_err(qb2, rb, scale2, zp2)
            take = err2 < err
            if SPLIT:
                qb = tl.where(take[:, None], qb2, qb)
            qa = tl.where(take[:, None], qa2, qa)
            scale = tl.where(take, scale2, scale)
            zp = tl.where(take, zp2, zp)
            err = tl.where(take, err2, err)

    bits = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)  # -16 == ~0xF
    bits = tl.where(ok, bits, NAN_SCALE)
    half = tl.arange(0, CH // 2)
    c_row = cache_ptr + c_off[:, None]
    # codes: [ROWS, CH // 2] uint8 per chunk
    tl.store(c_row + half[None, :], pack_nibbles(qa, ROWS, CH), mask=mask[:, None])
    if SPLIT:
        tl.store(c_row + CH // 2 + half[None, :], pack_nibbles(qb, ROWS, CH),
                 mask=mask[:, None])
    tl.store(scale_ptr + s_off, bits, mask=mask)


@dual_jit
def _reshape_and_cache_int4_fused_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, head_size] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size // 2] uint8
    k_scale_ptr, v_scale_ptr,        # [num_blocks, block_size, num_kv_heads] int32 (float32 bits)
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    rot_ptr,                         # DOT: [head_size // CH, CH, CH] diag(s)·H tiles; else [head_size] fp32 signs
    shrink_ptr,                      # [NUM_SHRINK] fp32 range factors (entry 0 is 1.0)
    key_offset_ptr,                  # OFFSET: [NUM_KV_HEADS, CH * (1 + SPLIT)] model dtype; else unused
    num_rows, num_tiles, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, CH: tl.constexpr, LOG2_CH: tl.constexpr, SPLIT: tl.constexpr,
    DOT: tl.constexpr, INTERPRET: tl.constexpr, NUM_SHRINK: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, OFFSET: tl.constexpr,
):
    """Grid ``(min(num_tiles, programs),)``: each program loads the rotation once, then loops
    over tiles of ROWS (token, head) rows, quantizing the K rows (less their head's key offset,
    OFFSET) and the same V rows. Rows are
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
        m_off = head * (CH * (1 + SPLIT))  # the key offset row of each row's head
        _int4_write_rows(key_ptr, token * stride_key_token + head * stride_key_head, key_cache_ptr, kc_off,
                         k_scale_ptr, ks_off, rot_a, rot_b, shrink_ptr, mask, key_offset_ptr, m_off,
                         ROWS, CH, LOG2_CH, SPLIT, DOT, INTERPRET, NUM_SHRINK, OFFSET)
        _int4_write_rows(value_ptr, token * stride_value_token + head * stride_value_head, value_cache_ptr,
                         vc_off, v_scale_ptr, vs_off, rot_a, rot_b, shrink_ptr, mask, key_offset_ptr, m_off,
                         ROWS, CH, LOG2_CH, SPLIT, DOT, INTERPRET, NUM_SHRINK, False)  # values: never smoothed


def chunk_size(head_size: int) -> int:
    """Rotation chunk: the whole row up to 128, else half of it (joined by one last butterfly stage)."""
    return head_size if head_size <= 128 else head_size // 2


@functools.lru_cache(maxsize=None)
def signed_hadamard_chunks(head_size: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """[head_size // CH, CH, CH] ±1 tiles ``diag(s_c)·H_CH`` so ``x_c @ M_c`` rotates chunk ``c``
    (``seed``: ``layouts.rotation.rht_sign_seed()``, part of the cache key only)."""
    ch = chunk_size(head_size)
    h = torch.ones(1, 1)
    while h.shape[0] < ch:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    s = rht_signs(head_size).view(-1, ch, 1)
    return (s * h).to(dtype=dtype, device=device).contiguous()


@functools.lru_cache(maxsize=64)
def device_shrink(shrink: tuple, device: str) -> torch.Tensor:
    """The MSE range factors as a float32 tensor on ``device``, made once per tuple (a pageable
    host-to-device copy per call would synchronize the stream and idle the GPU between writes)."""
    return torch.tensor(shrink, dtype=torch.float32, device=device)


def launch_int4_fused(plan: WritePlan, t: WriteArgs) -> None:
    """Run an ``int4-fused`` plan on ``t`` (validated by ``plan.write_plan``)."""
    shape, tuning, d = plan.shape, plan.tuning, plan.shape.head_size
    dev = str(t.key.device)
    ks, vs = t.k_scale_cache.view(torch.int32), t.v_scale_cache.view(torch.int32)
    align = cache_alignment(t.key_cache, t.value_cache)
    num_rows = shape.num_tokens * shape.num_kv_heads
    ch = chunk_size(d)
    dot = tuning.rotation == "dot"  # tuning.resolve_tuning allows it for chunks of at most 128
    launch(_reshape_and_cache_int4_fused_kernel, plan.grid, dict(
        key_ptr=t.key, value_ptr=t.value, key_cache_ptr=t.key_cache, value_cache_ptr=t.value_cache,
        k_scale_ptr=ks, v_scale_ptr=vs, slot_mapping_ptr=t.slot_mapping,
        rot_ptr=signed_hadamard_chunks(d, t.key.dtype, dev, rht_sign_seed()) if dot else rht_signs(d, dev),
        shrink_ptr=device_shrink(plan.shrink, dev),
        key_offset_ptr=t.key if t.key_offset is None else t.key_offset,
        num_rows=num_rows, num_tiles=-(-num_rows // tuning.rows), num_slots=shape.num_blocks * shape.block_size,
        **stride_args(t, align, ks, vs),
        ROWS=tuning.rows, CH=ch, LOG2_CH=ch.bit_length() - 1, SPLIT=ch != d, DOT=dot,
        INTERPRET=plan.interpret, NUM_SHRINK=len(plan.shrink), CACHE_ALIGN=align,
        NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size, OFFSET=t.key_offset is not None,
        num_warps=tuning.num_warps, enable_fp_fusion=False))  # keep the oracle's separate roundings
