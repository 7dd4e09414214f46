"""Split-KV decode on 16-bit code units, a loop per row-alignment class; its tiling and launcher.

The plan's quantized decode for small INT4 batches and for head sizes without a block-tile
tiling (``plan.py``). Same maths as ``decode_split`` (one query per sequence, "swap AB" dots
with the codes as the A operand, per-token scale and zero point on the score / probability
tiles, the code offset ``OFF`` folded into the zero point), read differently:

- **16-bit code units.** K and V rows are read as ``int16`` units: 4 INT4 nibbles (dims
  ``4u .. 4u+3``) or 2 INT8 / FP8 bytes (dims ``2u, 2u+1``). One 32-bit register of two units
  becomes NOUT (4 or 2) fp16x2 registers, output ``x`` holding dim ``NOUT * u + x``, without
  byte permutes for INT4 (``units.py``). Every dot runs over the units, so the query is split
  the same way, and the accumulators are written back in natural dim order.
- **V transposed in 16-bit units.** ``V^T [units, keys]`` needs two keys per register of the dot
  operand: with 16-bit units that is ``ldmatrix.trans``, where byte codes need single bytes gathered
  from shared memory (64 ``LDS.U8`` + ``PRMT`` per warp and tile for INT4).
- **Alignment classes.** A packed row is ``data + 4`` bytes (68 for INT4 d=128, 132 for INT8),
  so row starts are 4-byte aligned in general and byte-strided reads issue 4-byte copies. The row of KV head
  ``h`` starts ``h * stride_h`` past 16-byte-aligned block and slot offsets: each program
  branches once on that offset's alignment (16, 8 or 4 bytes) into a loop compiled for it.
- **Small programs.** The tile's softmax reductions run across the program's warps (shared
  memory and barriers); the launcher's defaults (1-2 warps, 32-64 keys, more segments) come
  from the H200 sweep.

Code loads are not masked (FP8 values excepted): a key past the sequence reads block 0 (the
block-table load is masked to 0), whatever it holds, and its score is set to ``-inf`` before
the softmax, so its probability is 0; INT8 / INT4 codes are finite, so their product with 0 is
0, but an e4m3 byte can be NaN, so FP8 value loads keep their mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

import math

from layouts import KVQuantMode

from .._jit import cdiv, dual_jit, interpreting, next_pow2, prev_pow2
from .common import DOT_FP16, DOT_FP32, decode_program, decode_tile_softmax, hadamard_sign, to_dot
from .rotate_query import query_scales, rotated_query
from .units import DECODE_MODES, MODE_FP8, MODE_INT4, decode_args, planned_units, units_to_dot

# Tiling from H200 sweeps (32 query / 8 KV heads, batch 8 at 32k context; head_size 64, 128 and
# 256): per mode and head size, keys per tile, warps, stages and the resident programs per SM
# that the segment count aims at; segments of at most MAX_KEYS_PER_SEGMENT keys. INT4 at
# head_size 128 aims at 4 programs per SM, not the 8 its registers would allow: each program
# rotates its query in the prologue, so a wave of one-tile segments costs more than half as
# many two-tile ones (H200: b2 @ 4k 15.6 µs with 32 segments against 18.7 with 64, b2 @ 8k 21.3
# vs 23.6, b4 @ 2k 15.0 vs 16.5; within 0.6 µs elsewhere).
_INT8_TILING = {128: (32, 1, 2, 8), 256: (32, 2, 2, 16)}
TILING = {  # mode -> head_size -> (keys per tile, warps, stages, programs per SM aimed at)
    KVQuantMode.INT4_PER_TOKEN_HEAD: {64: (32, 1, 2, 16), 128: (64, 2, 2, 4), 256: (64, 4, 2, 4)},
    KVQuantMode.INT8_PER_TOKEN_HEAD: _INT8_TILING,
    KVQuantMode.FP8_PER_TOKEN_HEAD: _INT8_TILING,
}
MAX_KEYS_PER_SEGMENT = 2048
# INT4 up to ROTATE_Q_MAX_HEAD: the kernel rotates the query in its prologue (one launch fewer)
# instead of reading the rotation kernel's output. At head_size 256 the prologue raises the
# kernel from 128 to 151 registers (sm_90 ptxas), 3 resident programs per SM instead of 4, so
# there it rotates in the prologue only when the grid fills at most half the resident slots
# (small batches, where the launch saved matters and the lost slot does not; ``segments`` aims
# there). ``Tuning(rotate_q_in_decode=False)`` keeps the rotation kernel everywhere.
ROTATE_Q_MAX_HEAD = 128


@triton.jit
def _tile_rows(bt_row, t, k_lo, k_hi, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache block, slot and mask ``[TILE]`` of the keys of tile ``t``."""
    k_pos = t * TILE + tl.arange(0, TILE)
    n_ok = (k_pos < k_hi) & (k_pos >= k_lo)
    blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    return blk, k_pos % BLOCK_SIZE, n_ok


@triton.jit
def _tile_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, blk, slot, n_ok, k_head, v_head, kv_head,
                stride_k_b, stride_k_s, stride_v_b, stride_v_s,
                stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
                U: tl.constexpr, MODE: tl.constexpr, ALIGN_BS: tl.constexpr):
    """Code units K ``[TILE, U]``, V^T ``[U, TILE]`` and the scale words ``[TILE]`` of one tile."""
    offs_u = tl.arange(0, U)
    k_row = blk * (stride_k_b * ALIGN_BS) + slot * (stride_k_s * ALIGN_BS) + k_head
    v_row = blk * (stride_v_b * ALIGN_BS) + slot * (stride_v_s * ALIGN_BS) + v_head
    kc = tl.load(k_ptr + k_row[:, None] + offs_u[None, :])
    if MODE == MODE_FP8:  # an e4m3 byte can be NaN, and NaN * (p = 0) is NaN: mask V
        vc = tl.load(v_ptr + v_row[None, :] + offs_u[:, None], mask=n_ok[None, :], other=0)
    else:
        vc = tl.load(v_ptr + v_row[None, :] + offs_u[:, None])
    kw = tl.load(ks_ptr + blk * stride_ks_b + slot * stride_ks_s + kv_head * stride_ks_h, mask=n_ok, other=0)
    vw = tl.load(vs_ptr + blk * stride_vs_b + slot * stride_vs_s + kv_head * stride_vs_h, mask=n_ok, other=0)
    return kc, vc, kw, vw


@triton.jit
def _tile_update(kc, vc, kw, vw, n_ok, q0, q1, q2, q3, q_sum, m_i, l_i, acc0, acc1, acc2, acc3,
                 col_scale, softcap, TILE: tl.constexpr, MODE: tl.constexpr, OFF: tl.constexpr,
                 DOT: tl.constexpr, ASM: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """Scores, online softmax and value accumulation of one tile."""
    if MODE == MODE_INT4:  # int32 bits: scale | zero point in the low 4 bits
        k_zp = (kw & 0xF).to(tl.float32) + OFF
        k_sc = (kw & -16).to(tl.float32, bitcast=True)
        v_zp = (vw & 0xF).to(tl.float32) + OFF
        v_sc = (vw & -16).to(tl.float32, bitcast=True)
    else:
        k_zp = tl.full([TILE], OFF, tl.float32)
        k_sc = kw.to(tl.float32, bitcast=True)
        v_zp = tl.full([TILE], OFF, tl.float32)
        v_sc = vw.to(tl.float32, bitcast=True)
    k0, k1, k2, k3 = units_to_dot(kc, MODE, DOT, ASM)
    s = tl.dot(k0, q0)
    s = tl.dot(k1, q1, s)
    if MODE == MODE_INT4:
        s = tl.dot(k2, q2, s)
        s = tl.dot(k3, q3, s)  # [TILE, GP]
    pv, alpha, m_new, l_i, vs_max, zp_term = decode_tile_softmax(
        s, n_ok, k_zp, k_sc, q_sum, v_zp, v_sc, m_i, l_i, col_scale, softcap, USE_SOFTCAP, DOT)
    zp_term = zp_term[None, :]  # [1, GP]
    v0, v1, v2, v3 = units_to_dot(vc, MODE, DOT, ASM)
    acc0 = acc0 * alpha[None, :] + (tl.dot(v0, pv) - zp_term) * vs_max
    acc1 = acc1 * alpha[None, :] + (tl.dot(v1, pv) - zp_term) * vs_max
    if MODE == MODE_INT4:
        acc2 = acc2 * alpha[None, :] + (tl.dot(v2, pv) - zp_term) * vs_max
        acc3 = acc3 * alpha[None, :] + (tl.dot(v3, pv) - zp_term) * vs_max
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _segment_loop(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, t0, t1, k_lo, k_hi, k_head, v_head, kv_head,
                  q0, q1, q2, q3, q_sum, col_scale, softcap,
                  stride_k_b, stride_k_s, stride_v_b, stride_v_s,
                  stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
                  U: tl.constexpr, GP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  MODE: tl.constexpr, OFF: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                  USE_SOFTCAP: tl.constexpr, ALIGN_BS: tl.constexpr, ALIGN: tl.constexpr):
    """Online softmax over tiles ``[t0, t1)``; row offsets are multiples of ``ALIGN`` units.

    Triton pipelines the loads (``num_stages=2``); prefetching the next tile's codes or block ids
    into registers, or loading the 4- and 8-byte classes in their own shapes, cost registers and
    time on the H200. About 26% of the warps' time waits for the tile's copies and 22% for the
    softmax's shuffles and shared memory (Nsight Compute)."""
    k_head = (k_head // ALIGN) * ALIGN  # exact in this branch; tells Triton's alignment analysis
    v_head = (v_head // ALIGN) * ALIGN
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([U, GP], tl.float32)
    acc1 = tl.zeros([U, GP], tl.float32)
    acc2 = tl.zeros([U, GP], tl.float32)
    acc3 = tl.zeros([U, GP], tl.float32)
    for t in range(t0, t1):
        blk, slot, n_ok = _tile_rows(bt_row, t, k_lo, k_hi, TILE, BLOCK_SIZE)
        kc, vc, kw, vw = _tile_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, blk, slot, n_ok, k_head, v_head, kv_head,
                                     stride_k_b, stride_k_s, stride_v_b, stride_v_s, stride_ks_b, stride_ks_s,
                                     stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h, U, MODE, ALIGN_BS)
        m_i, l_i, acc0, acc1, acc2, acc3 = _tile_update(
            kc, vc, kw, vw, n_ok, q0, q1, q2, q3, q_sum, m_i, l_i, acc0, acc1, acc2, acc3,
            col_scale, softcap, TILE, MODE, OFF, DOT, ASM, USE_SOFTCAP)
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _query_parts(q_ptr, signs_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h, stride_q_d,
                 U: tl.constexpr, NOUT: tl.constexpr, HEAD: tl.constexpr, MODE: tl.constexpr,
                 DOT: tl.constexpr, ROTATE_Q: tl.constexpr):
    """Query parts ``q_x^T [U, GP]`` (dim ``NOUT * u + x``) times ``softmax_scale``. INT4: the
    rotated query, either rotated here (``ROTATE_Q``) or read from ``_rotate_query_kernel``'s output
    (rotated and in parts already, ``stride_q_d`` = 1)."""
    offs_u = tl.arange(0, U)
    q_row = q_ptr + tok.to(tl.int64) * stride_q_t + head[None, :] * stride_q_h
    if MODE == MODE_INT4 and ROTATE_Q:
        # (H (s * q))[4u + x] with H[4u + x, d] = H_U[u, d >> 2] * H_4[x, d & 3] (Sylvester): one
        # [U, HEAD] matrix serves the four parts, part x multiplies the query by H_4[x, d & 3]
        # instead; every product is exact (+-1 times a 16-bit value), the sum is fp32 as in
        # _rotate_query_kernel (DOT_FP32, interpreter: everything in fp32)
        offs_d = tl.arange(0, HEAD)
        qt = tl.load(q_row + offs_d[:, None] * stride_q_d, mask=g_ok[None, :], other=0.0)   # [HEAD, GP]
        if DOT == DOT_FP32:
            qt = qt.to(tl.float32)
        qt = qt * tl.load(signs_ptr + offs_d).to(qt.dtype)[:, None]
        h_u = hadamard_sign(offs_u[:, None], offs_d[None, :] >> 2).to(qt.dtype)          # [U, HEAD]
        q0 = tl.dot(h_u, qt) * softmax_scale
        q1 = tl.dot(h_u, qt * hadamard_sign(1, offs_d & 3).to(qt.dtype)[:, None]) * softmax_scale
        q2 = tl.dot(h_u, qt * hadamard_sign(2, offs_d & 3).to(qt.dtype)[:, None]) * softmax_scale
        q3 = tl.dot(h_u, qt * hadamard_sign(3, offs_d & 3).to(qt.dtype)[:, None]) * softmax_scale
    elif MODE == MODE_INT4:
        q_u = q_row + offs_u[:, None]
        q0 = tl.load(q_u, mask=g_ok[None, :], other=0.0) * softmax_scale
        q1 = tl.load(q_u + U, mask=g_ok[None, :], other=0.0) * softmax_scale
        q2 = tl.load(q_u + 2 * U, mask=g_ok[None, :], other=0.0) * softmax_scale
        q3 = tl.load(q_u + 3 * U, mask=g_ok[None, :], other=0.0) * softmax_scale
    else:
        q_u = q_row + (NOUT * offs_u[:, None]) * stride_q_d
        q0 = tl.load(q_u, mask=g_ok[None, :], other=0.0).to(tl.float32) * softmax_scale
        q1 = tl.load(q_u + stride_q_d, mask=g_ok[None, :], other=0.0).to(tl.float32) * softmax_scale
        q2, q3 = q0, q1
    return to_dot(q0, DOT), to_dot(q1, DOT), to_dot(q2, DOT), to_dot(q3, DOT)


# Grid: (num_seqs, num_kv_heads, NUM_SEGMENTS). Writes the split buffers of _attn_reduce_kernel
# (accumulator rows [T, Hq, NUM_SEGMENTS, HEAD], INT4 still rotated, natural dim order).
@dual_jit
def _decode_code_units_kernel(
    q_ptr,                          # [T, Hq, HEAD]; INT4 without ROTATE_Q: fp32, rotated, 4 parts (rotate_query)
    signs_ptr,                      # [HEAD] the rotation's signs (INT4 with ROTATE_Q)
    k_ptr, v_ptr,                   # [num_blocks, block_size, Hkv, U] int16 code units
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] int32 (scale bits; INT4: | zp)
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    softmax_scale, col_scale, softcap, window_left, window_right,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h,   # units; block / slot strides divided by ALIGN_BS
    stride_v_b, stride_v_s, stride_v_h,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr, OFF: tl.constexpr,
    DOT: tl.constexpr, ASM: tl.constexpr, CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    ALIGN_BS: tl.constexpr,         # units dividing every block / slot stride (2, 4 or 8)
    PDL: tl.constexpr,              # launched with launch_pdl (waits in its prologue)
    ROTATE_Q: tl.constexpr,         # INT4: rotate the raw query here instead of reading _rotate_query_kernel's
):
    seq_idx, kv_head, seg_idx, tok, has_query, k_lo, k_hi, t0, t1 = decode_program(
        cu_seqlens_q_ptr, seqused_k_ptr, window_left, window_right, CAUSAL, TILE, NUM_SEGMENTS, PDL)
    if not has_query:
        return

    NOUT: tl.constexpr = 4 if MODE == MODE_INT4 else 2
    U: tl.constexpr = HEAD // NOUT
    offs_g = tl.arange(0, GP)
    offs_u = tl.arange(0, U)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    row = (tok.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx  # [GP]
    q0, q1, q2, q3 = _query_parts(q_ptr, signs_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h,
                                  stride_q_d, U, NOUT, HEAD, MODE, DOT, ROTATE_Q)
    q_sum = tl.sum(q0.to(tl.float32), 0) + tl.sum(q1.to(tl.float32), 0)  # of the rounded operands
    if MODE == MODE_INT4:
        q_sum += tl.sum(q2.to(tl.float32), 0) + tl.sum(q3.to(tl.float32), 0)

    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s
    k_head = kv_head * stride_k_h
    v_head = kv_head * stride_v_h
    cls = tl.where((k_head | v_head) % 8 == 0, 8, tl.where((k_head | v_head) % 4 == 0, 4, 2))
    cls = tl.minimum(cls, ALIGN_BS)  # the launcher guarantees 2-unit (4-byte) rows at least
    if cls == 8:
        m_i, l_i, acc0, acc1, acc2, acc3 = _segment_loop(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, t0, t1, k_lo, k_hi, k_head, v_head, kv_head,
            q0, q1, q2, q3, q_sum, col_scale, softcap, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
            U, GP, BLOCK_SIZE, TILE, MODE, OFF, DOT, ASM, USE_SOFTCAP, ALIGN_BS, 8)
    elif cls == 4:
        m_i, l_i, acc0, acc1, acc2, acc3 = _segment_loop(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, t0, t1, k_lo, k_hi, k_head, v_head, kv_head,
            q0, q1, q2, q3, q_sum, col_scale, softcap, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
            U, GP, BLOCK_SIZE, TILE, MODE, OFF, DOT, ASM, USE_SOFTCAP, ALIGN_BS, 4)
    else:
        m_i, l_i, acc0, acc1, acc2, acc3 = _segment_loop(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, t0, t1, k_lo, k_hi, k_head, v_head, kv_head,
            q0, q1, q2, q3, q_sum, col_scale, softcap, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
            U, GP, BLOCK_SIZE, TILE, MODE, OFF, DOT, ASM, USE_SOFTCAP, ALIGN_BS, 2)

    base = segm_out_ptr + row[None, :] * HEAD + NOUT * offs_u[:, None]  # dim NOUT * u + x <- acc x
    tl.store(base, acc0, mask=g_ok[None, :])
    tl.store(base + 1, acc1, mask=g_ok[None, :])
    if MODE == MODE_INT4:
        tl.store(base + 2, acc2, mask=g_ok[None, :])
        tl.store(base + 3, acc3, mask=g_ok[None, :])
    tl.store(segm_max_ptr + row, m_i, mask=g_ok)
    tl.store(segm_sum_ptr + row, l_i, mask=g_ok)


def tiling(mode: KVQuantMode, head_size: int) -> tuple:
    """``(tile, warps, stages, programs_per_sm)`` of ``TILING`` for ``head_size``, or of the nearest
    measured head size (the smaller one on a tie)."""
    table = TILING[mode]
    return table[min(table, key=lambda h: (abs(math.log2(h) - math.log2(head_size)), h))]


def rotate_needs_small_grid(mode: KVQuantMode, head_size: int) -> bool:
    """INT4 above ROTATE_Q_MAX_HEAD: the kernel rotates the query in its prologue only on grids
    that fill at most half the resident slots, so :func:`segments` aims there (``half``)."""
    return mode == KVQuantMode.INT4_PER_TOKEN_HEAD and head_size > ROTATE_Q_MAX_HEAD


def segments(num_sms: int, pairs: int, max_seqlen_k: int, tile: int, programs_per_sm: int,
             half: bool = False) -> int:
    """Segments per (sequence, KV head): about ``programs_per_sm`` programs per SM (``half``: half
    that, so that the INT4 query rotation runs in the prologue above ROTATE_Q_MAX_HEAD), segments
    of at most MAX_KEYS_PER_SEGMENT keys, at least 2 and at most one per tile, a power of two.

    ``half`` at head_size 256 on the H200: b1 @ 4k 25.7 -> 20.1 µs (32 segments instead of 64),
    b2 @ 4k 31.0 -> 26.7 and b2 @ 2k 26.0 -> 20.4 (16 instead of 32)."""
    target = programs_per_sm * num_sms // (2 if half else 1)
    want = max(target // max(1, pairs), cdiv(max_seqlen_k, MAX_KEYS_PER_SEGMENT))
    segs = max(2, min(want, max(1, max_seqlen_k // tile)))
    return prev_pow2(segs)


def launch_code_units(call, plan) -> None:
    """Launch ``_decode_code_units_kernel`` (grid: sequences x KV heads x segments) on ``call`` (its
    segment buffers allocated; the cache readable as :func:`units.code_units`). An INT4 query is
    rotated in the prologue or by the rotation kernel first (``plan.rotate``)."""
    from .plan import Rotate
    kernel_mode, off = DECODE_MODES[call.mode]
    units = planned_units(call, plan)
    k16, v16, align = units
    tiling, interp = plan.tiling, interpreting(call.q)
    grid = (call.num_seqs, k16.shape[2], tiling.num_segments)
    rotate_q = plan.rotate == Rotate.PROLOGUE
    query, q_scale = rotated_query(call, plan)
    use_softcap, col_scale = query_scales(call)
    _decode_code_units_kernel[grid](
        **decode_args(call, query, units, q_scale, col_scale),
        signs_ptr=call.signs if rotate_q else query, stride_k_h=k16.stride(2), stride_v_h=v16.stride(2),
        NUM_Q_HEADS=query.shape[1], GROUP=call.group, GP=max(8, next_pow2(call.group)), HEAD=call.head_size,
        BLOCK_SIZE=k16.shape[1], TILE=tiling.tile, MODE=kernel_mode, OFF=off,
        DOT=DOT_FP32.value if interp else DOT_FP16.value, ASM=not interp, CAUSAL=call.causal,
        USE_SOFTCAP=use_softcap, NUM_SEGMENTS=tiling.num_segments, ALIGN_BS=align, PDL=plan.pdl,
        ROTATE_Q=rotate_q, launch_pdl=plan.pdl, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
