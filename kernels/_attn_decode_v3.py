"""Split-KV decode kernel "v3" for the quantized caches: 16-bit code units, alignment classes.

Same maths as the v2 kernel (``_attn_decode_kernel``: one query per sequence, "swap AB" dots
with the codes as the A operand, per-token scale and zero point on the score / probability
tiles, the code offset ``OFF`` folded into the zero point), with the changes that the sm_90
SASS and an H200 sweep of v2 pointed to (docs/bench/attention.md):

- **16-bit code units.** K and V rows are read as ``int16`` units: 4 INT4 nibbles (dims
  ``4u .. 4u+3``) or 2 INT8 / FP8 bytes (dims ``2u, 2u+1``). One 32-bit register of two units
  becomes NOUT (4 or 2) fp16x2 registers, output ``x`` holding dim ``NOUT * u + x``, without
  byte permutes for INT4 (:func:`nib4`). Every dot runs over the units, so the query is split
  the same way, and the accumulators are written back in natural dim order.
- **V transposed in 16-bit units.** ``V^T [units, keys]`` needs two keys per register of the dot
  operand: with 16-bit units that is ``ldmatrix.trans``, where v2 gathered single bytes from
  shared memory (64 ``LDS.U8`` + ``PRMT`` per warp and tile for INT4).
- **Alignment classes.** A packed row is ``data + 4`` bytes (68 for INT4 d=128, 132 for INT8),
  so row starts are 4-byte aligned in general and v2 issued 4-byte copies. The row of KV head
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

from ._attn_common import DOT_FP32, decode_tile_softmax, key_range, segment_tiles, to_dot
from ._jit import dual_jit

MODE_INT8 = tl.constexpr(1)
MODE_FP8 = tl.constexpr(2)
MODE_INT4 = tl.constexpr(3)


@triton.jit
def _nib4_asm(u):
    """Two int16 units per 32-bit register ``r = [b0 b1 | b2 b3]`` -> 4 fp16x2, nibble ``x`` of
    both units minus 8: ``r & 0x000F000F`` is nibble 0, ``r & 0x00F000F0`` nibble 1 (times 16),
    ``r >> 8`` the same for nibbles 2 and 3; ``| 0x6400`` makes fp16 ``1024 + n`` (``1024 +
    16 n``), then minus 1032, or times 1/16 (0x2C00) minus 72 (0xD480): exact."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 h, c, r, m;
        mov.b32 c, 0x64086408;
        mov.b32 r, 0x2C002C00;
        mov.b32 m, 0xD480D480;
        shr.b32 h, $4, 8;
        lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $2, h, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $3, h, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, $0, c;
        fma.rn.f16x2 $1, $1, r, m;
        sub.f16x2 $2, $2, c;
        fma.rn.f16x2 $3, $3, r, m;
        }""",
        constraints="=r,=r,=r,=r,r", args=[u], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=2)


@triton.jit
def _int8x2_asm(u):
    """Two int16 units ``[b0 b1 | b2 b3]`` of int8 codes -> fp16x2 ``1152 + c`` of bytes (0, 2)
    and (1, 3): ``(c ^ 0x80) | 0x6400`` is fp16 ``1024 + c + 128``."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, h;
        mov.b32 h, 0x64646464;
        xor.b32 x, $2, 0x80808080;
        prmt.b32 $0, x, h, 0x4240;
        prmt.b32 $1, x, h, 0x4341;
        }""",
        constraints="=r,=r,r", args=[u], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _fp8x2_asm(u):
    """Two int16 units ``[b0 b1 | b2 b3]`` of e4m3 codes -> fp16x2 of bytes (0, 2) and (1, 3)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, z;
        .reg .b16 lo, hi;
        mov.b32 z, 0;
        prmt.b32 x, $2, z, 0x3120;
        mov.b32 {lo, hi}, x;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[u], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def units_to_dot(u, MODE: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr):
    """int16 code units -> (c0, c1, c2, c3) dot operands, ``cx`` = dim ``NOUT * unit + x`` plus
    the mode's offset (INT4 -8, INT8 1152, FP8 0); c2 = c3 = c0 unless INT4 (unused there)."""
    if ASM:
        if MODE == MODE_INT4:
            c0, c1, c2, c3 = _nib4_asm(u)
        elif MODE == MODE_INT8:
            c0, c1 = _int8x2_asm(u)
            c2, c3 = c0, c1
        else:
            c0, c1 = _fp8x2_asm(u)
            c2, c3 = c0, c1
    else:  # interpreter: plain integer ops, the same values
        w = u.to(tl.int32)
        if MODE == MODE_INT4:
            c0 = ((w & 0xF) - 8).to(tl.float32)
            c1 = (((w >> 4) & 0xF) - 8).to(tl.float32)
            c2 = (((w >> 8) & 0xF) - 8).to(tl.float32)
            c3 = (((w >> 12) & 0xF) - 8).to(tl.float32)
        elif MODE == MODE_INT8:
            c0 = (((w & 0xFF) ^ 0x80) + 1024).to(tl.float32)
            c1 = ((((w >> 8) & 0xFF) ^ 0x80) + 1024).to(tl.float32)
            c2, c3 = c0, c1
        else:
            c0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c2, c3 = c0, c1
        c0, c1, c2, c3 = to_dot(c0, DOT), to_dot(c1, DOT), to_dot(c2, DOT), to_dot(c3, DOT)
    return c0, c1, c2, c3


@triton.jit
def _segment_loop(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, t0, t1, k_lo, k_hi, k_head, v_head, kv_head,
                  q0, q1, q2, q3, q_sum, col_scale, softcap,
                  stride_k_b, stride_k_s, stride_v_b, stride_v_s,
                  stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
                  U: tl.constexpr, GP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  MODE: tl.constexpr, OFF: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                  USE_SOFTCAP: tl.constexpr, ALIGN_BS: tl.constexpr, ALIGN: tl.constexpr):
    """Online softmax over tiles ``[t0, t1)``; row offsets are multiples of ``ALIGN`` units."""
    offs_t = tl.arange(0, TILE)
    offs_u = tl.arange(0, U)
    k_head = (k_head // ALIGN) * ALIGN  # exact in this branch; tells Triton's alignment analysis
    v_head = (v_head // ALIGN) * ALIGN
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([U, GP], tl.float32)
    acc1 = tl.zeros([U, GP], tl.float32)
    acc2 = tl.zeros([U, GP], tl.float32)
    acc3 = tl.zeros([U, GP], tl.float32)
    for t in range(t0, t1):
        k_pos = t * TILE + offs_t
        n_ok = (k_pos < k_hi) & (k_pos >= k_lo)
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_row = blk * (stride_k_b * ALIGN_BS) + slot * (stride_k_s * ALIGN_BS) + k_head
        v_row = blk * (stride_v_b * ALIGN_BS) + slot * (stride_v_s * ALIGN_BS) + v_head
        kc = tl.load(k_ptr + k_row[:, None] + offs_u[None, :])   # [TILE, U] int16
        if MODE == MODE_FP8:  # an e4m3 byte can be NaN, and NaN * (p = 0) is NaN: mask V
            vc = tl.load(v_ptr + v_row[None, :] + offs_u[:, None], mask=n_ok[None, :], other=0)
        else:
            vc = tl.load(v_ptr + v_row[None, :] + offs_u[:, None])   # [U, TILE] int16
        kw = tl.load(ks_ptr + blk * stride_ks_b + slot * stride_ks_s + kv_head * stride_ks_h, mask=n_ok, other=0)
        vw = tl.load(vs_ptr + blk * stride_vs_b + slot * stride_vs_s + kv_head * stride_vs_h, mask=n_ok, other=0)
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
        m_i = m_new
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _query_parts(q_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h, stride_q_d,
                 U: tl.constexpr, NOUT: tl.constexpr, MODE: tl.constexpr, DOT: tl.constexpr):
    """Query parts ``q_x^T [U, GP]`` (dim ``NOUT * u + x``) times ``softmax_scale``. INT4: ``q_ptr``
    is ``_prep_q_kernel``'s output, rotated and in parts already (``stride_q_d`` = 1)."""
    offs_u = tl.arange(0, U)
    q_row = q_ptr + tok.to(tl.int64) * stride_q_t + head[None, :] * stride_q_h
    if MODE == MODE_INT4:
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
def _attn_decode_v3_kernel(
    q_ptr,                          # [T, Hq, HEAD]; INT4: fp32, rotated, 4 parts (``_prep_q_kernel``)
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
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg_idx = tl.program_id(2)
    tok = tl.load(cu_seqlens_q_ptr + seq_idx)
    if tl.load(cu_seqlens_q_ptr + seq_idx + 1) == tok:
        return
    seq_len = tl.load(seqused_k_ptr + seq_idx)
    q_pos = seq_len - 1
    k_lo, k_hi = key_range(seq_len, q_pos, q_pos, window_left, window_right, CAUSAL)
    t0, t1 = segment_tiles(k_lo, k_hi, seg_idx, TILE, NUM_SEGMENTS)

    NOUT: tl.constexpr = 4 if MODE == MODE_INT4 else 2
    U: tl.constexpr = HEAD // NOUT
    offs_g = tl.arange(0, GP)
    offs_u = tl.arange(0, U)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    row = (tok.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx  # [GP]
    q0, q1, q2, q3 = _query_parts(q_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h, stride_q_d,
                                  U, NOUT, MODE, DOT)
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
