"""Paged attention kernel that reads INT4 per-token-head caches directly from nibble codes.

The cache holds codes ``c`` of the *rotated* rows ``r = H(s*x)``, with ``r ~ (c - zp) * scale``
and ``x = s*(H r) / d``. Attention is invariant under that orthogonal-up-to-``d`` map, so:

- the query is rotated once per program in-kernel (``q_rot = H(s*q)``, an fp32 dot against
  Hadamard signs generated from bit parity, no table in memory), or (``Q_ROTATED``) read already
  rotated, ``softmax_scale`` folded in, from the rotation kernel that ran once over the chunk
  (``rotate_query``, 2 parts: even dims, then odd dims); ``1/d`` is folded into the softmax scale;
- score of key ``n``: ``(q_rot . c_n - zp_n * sum(q_rot)) * scale_n`` -- one dot on raw codes,
  then one multiply-add per score column; or (``CODE_ZP``) ``(q_rot . (c_n - zp_n)) * scale_n``,
  the zero point subtracted in the same instruction that turns a code into a float (exact:
  small integers), so no per-score correction is left;
- the value accumulator stays rotated: ``acc = sum_n p_n scale_n (c_n - zp_n)``, the zero point
  folded in through the row sums of the scaled probability tile (``CODE_ZP``: in the codes, as K);
- the output is inverse-rotated once per query row (here for the 2D path, in the reduction
  kernel for the split path).

Codes are never interleaved in registers: even and odd dimensions are the low and high nibbles,
so the query and the accumulator are kept as even/odd halves and each dot is split in two. On a
GPU (``ASM``) the codes become dot operands through :func:`nibbles_asm` (PTX on 4 bytes at a
time) instead of per-element integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import DOT_BF16, DOT_FP32, LOG2E, apply_softcap, full_tiles, hadamard_sign, mask_scores, \
    nibble_to_dot, q_block_program, to_dot
from .._jit import dual_jit


@triton.jit
def nibble_minus_zp(n, zp, DOT: tl.constexpr):
    """Codes 0..15 minus their zero point ``zp`` (int32, broadcast against ``n``) as exact floats
    for ``tl.dot``: ``n | 0x4300`` read as bf16 is ``128 + n`` (fp16: ``n | 0x6400`` is ``1024 +
    n``), so one subtraction of ``128 + zp`` both converts and removes the zero point."""
    n16 = n.to(tl.int16)
    if DOT == DOT_BF16:
        x = (n16 | 0x4300).to(tl.bfloat16, bitcast=True) - (zp + 128).to(tl.bfloat16)
    elif DOT == DOT_FP32:
        x = ((n16 | 0x6400).to(tl.float16, bitcast=True) - 1024.0).to(tl.float32) - zp.to(tl.float32)
    else:
        x = (n16 | 0x6400).to(tl.float16, bitcast=True) - (zp + 1024).to(tl.float16)
    return x


def _nibbles_asm(one: str, pos: str, neg: str, fma: str) -> str:
    return f"""{{
        .reg .b32 t0, t1, h0, h1, z0, z1, o, z;
        mov.b32 o, {one};
        mov.b32 z, 0;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        prmt.b32 z0, $5, z, 0x4140;
        prmt.b32 z1, $5, z, 0x4342;
        shr.b32 h0, t0, 4;
        shr.b32 h1, t1, 4;
        lop3.b32 z0, z0, 0x000F000F, {neg}, 0xEA;
        lop3.b32 z1, z1, 0x000F000F, {neg}, 0xEA;
        lop3.b32 $0, t0, 0x000F000F, {pos}, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, {pos}, 0xEA;
        lop3.b32 $2, h0, 0x000F000F, {pos}, 0xEA;
        lop3.b32 $3, h1, 0x000F000F, {pos}, 0xEA;
        {fma} $0, $0, o, z0;
        {fma} $1, $1, o, z1;
        {fma} $2, $2, o, z0;
        {fma} $3, $3, o, z1;
        }}"""


# (value 1, the float of 0 | bits, its negation, packed fma) per dot dtype
_NIBBLES_BF16 = tl.constexpr(_nibbles_asm("0x3F803F80", "0x43004300", "0xC300C300", "fma.rn.bf16x2"))
_NIBBLES_FP16 = tl.constexpr(_nibbles_asm("0x3C003C00", "0x64006400", "0xE400E400", "fma.rn.f16x2"))


@triton.jit
def nibbles_asm(b, zp, DOT: tl.constexpr):
    """CUDA only: code bytes ``b`` (uint8, two nibbles) and zero points ``zp`` (uint8 0..15, same
    shape) -> ``(low nibble - zp, high nibble - zp)`` as exact fp16 / bf16 (DOT), 4 bytes per
    32-bit register: the bytes are spread into 16-bit lanes (``prmt``), ``(lane & 0xF) | 0x6400``
    is fp16 ``1024 + n`` (bf16: ``| 0x4300`` is ``128 + n``; the high nibble is shifted down
    first, bf16 has no room for ``16 n``), ``zp | 0xE400`` is fp16 ``-(1024 + zp)`` (bf16
    ``0xC300``), and one packed ``fma`` by 1 adds the two: about 2 instructions a nibble."""
    if DOT == DOT_BF16:
        lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_BF16, constraints="=r,=r,=r,=r,r,r", args=[b, zp],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_FP16, constraints="=r,=r,=r,=r,r,r", args=[b, zp],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


# Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, NUM_SEGMENTS), as _attn_kernel.
@dual_jit
def _attn_int4_kernel(
    q_ptr, k_ptr, v_ptr,            # q [T, Hq, D]; k, v [num_blocks, block_size, Hkv, D // 2] uint8
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] int32 bits (scale | zp)
    signs_ptr,                      # [D] fp32 rotation signs s
    out_ptr,                        # out [T, Hq, D] or segm_output [T, Hq, NUM_SEGMENTS, D] (rotated)
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32 (SPLIT only)
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    softmax_scale, softcap, window_left, window_right, num_seqs, q_block_base,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_v_b, stride_v_s, stride_v_h, stride_v_d,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_o_t, stride_o_h, stride_o_d,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr,
    CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    KV_ALIGN: tl.constexpr,         # K/V strides arrive divided by this (so loads vectorise)
    PDL: tl.constexpr,              # launched with launch_pdl (waits in its prologue)
    Q_ROTATED: tl.constexpr = False,  # q is rotate_query's output: [T, Hq, D] fp32, even dims then odd, scaled
    CODE_ZP: tl.constexpr = False,  # zero points subtracted from the codes as they convert (no per-score term)
    ASM: tl.constexpr = False,      # CUDA: codes converted by nibbles_asm (PTX), 4 bytes per instruction group
    MASK_EDGES: tl.constexpr = False,  # mask only the tiles that cross the causal / window / length edges
    ROT_CHUNK: tl.constexpr = 0,    # > 0: the in-kernel rotations in chunks of this many dims (large heads)
    F32_PREC: tl.constexpr = None,  # input_precision of the dots on fp32 operands (None: Triton's default)
):
    HALF: tl.constexpr = HEAD // 2
    kv_head, seg_idx, seq_idx, has_rows, tok, head, row_ok, q_pos, k_lo, k_hi, t0, t1 = q_block_program(
        cu_seqlens_q_ptr, seqused_k_ptr, num_seqs, q_block_base, window_left, window_right, CAUSAL, BLOCK_Q, BLOCK_M,
        GROUP, TILE, NUM_SEGMENTS, PDL)
    if not has_rows:
        return

    offs_d = tl.arange(0, HEAD)
    offs_h = tl.arange(0, HALF)
    offs_t = tl.arange(0, TILE)

    if Q_ROTATED:
        # q_even / q_odd: [BLOCK_M, HALF], already H(s*q) * softmax_scale, rounded to the dot dtype
        q_row = q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h
        q_even = to_dot(tl.load(q_row + offs_h[None, :] * stride_q_d, mask=row_ok[:, None], other=0.0), DOT)
        q_odd = to_dot(tl.load(q_row + (HALF + offs_h[None, :]) * stride_q_d, mask=row_ok[:, None], other=0.0), DOT)
        q_scale = 1.0
    else:
        # Rotate q: q_rot[j] = sum_k H[j, k] s[k] q[k], split into even / odd j.
        if ROT_CHUNK == 0:
            q = tl.load(q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
            q = q * tl.load(signs_ptr + offs_d)[None, :]  # q: [BLOCK_M, HEAD]
            h_even = hadamard_sign(offs_d[:, None], 2 * offs_h[None, :])  # [HEAD, HALF]
            h_odd = hadamard_sign(offs_d[:, None], 2 * offs_h[None, :] + 1)
            # [BLOCK_M, HALF], rounded to the dot dtype
            q_even = to_dot(tl.dot(q, h_even, input_precision=F32_PREC), DOT)
            q_odd = to_dot(tl.dot(q, h_odd, input_precision=F32_PREC), DOT)
        else:  # k in chunks of ROT_CHUNK: the Hadamard operands [ROT_CHUNK, HALF] fit shared memory
            offs_c = tl.arange(0, ROT_CHUNK)
            q_even_f = tl.zeros([BLOCK_M, HALF], tl.float32)
            q_odd_f = tl.zeros([BLOCK_M, HALF], tl.float32)
            for c in tl.static_range(HEAD // ROT_CHUNK):
                k_dims = c * ROT_CHUNK + offs_c
                qc = tl.load(q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h
                             + k_dims[None, :] * stride_q_d, mask=row_ok[:, None], other=0.0).to(tl.float32)
                qc = qc * tl.load(signs_ptr + k_dims)[None, :]  # [BLOCK_M, ROT_CHUNK]
                q_even_f = tl.dot(qc, hadamard_sign(k_dims[:, None], 2 * offs_h[None, :]), q_even_f,
                                  input_precision=F32_PREC)
                q_odd_f = tl.dot(qc, hadamard_sign(k_dims[:, None], 2 * offs_h[None, :] + 1), q_odd_f,
                                 input_precision=F32_PREC)
            q_even = to_dot(q_even_f, DOT)
            q_odd = to_dot(q_odd_f, DOT)
        q_scale = softmax_scale
    if not CODE_ZP:
        q_sum = tl.sum(q_even.to(tl.float32), 1) + tl.sum(q_odd.to(tl.float32), 1)  # of the rounded q_rot
    if USE_SOFTCAP:
        qk_scale = q_scale / HEAD
    else:
        qk_scale = q_scale / HEAD * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_even = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_odd = tl.zeros([BLOCK_M, HALF], tl.float32)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s
    f0 = t0  # [f0, f1): the tiles no row needs masked (MASK_EDGES), else none
    f1 = t0
    if MASK_EDGES:
        f0, f1 = full_tiles(q_pos, row_ok, k_lo, k_hi, t0, t1, window_left, window_right, CAUSAL, TILE)
    for t in range(t0, t1):
        k_pos = t * TILE + offs_t
        n_ok = (k_pos < k_hi) & (k_pos >= k_lo)
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        # k: [HALF, TILE] bytes (transposed gather); v: [TILE, HALF] bytes
        kb = tl.load(k_ptr + blk[None, :] * (stride_k_b * KV_ALIGN) + slot[None, :] * (stride_k_s * KV_ALIGN)
                    + kv_head * (stride_k_h * KV_ALIGN)
                     + offs_h[:, None] * stride_k_d, mask=n_ok[None, :], other=0)
        vb = tl.load(v_ptr + blk[:, None] * (stride_v_b * KV_ALIGN) + slot[:, None] * (stride_v_s * KV_ALIGN)
                    + kv_head * (stride_v_h * KV_ALIGN)
                     + offs_h[None, :] * stride_v_d, mask=n_ok[:, None], other=0)
        kbits = tl.load(k_scale_ptr + blk * stride_ks_b + slot * stride_ks_s + kv_head * stride_ks_h,
                        mask=n_ok, other=0)
        vbits = tl.load(v_scale_ptr + blk * stride_vs_b + slot * stride_vs_s + kv_head * stride_vs_h,
                        mask=n_ok, other=0)
        k_zp = (kbits & 0xF).to(tl.float32)
        k_sc = (kbits & -16).to(tl.float32, bitcast=True)
        v_zp = (vbits & 0xF).to(tl.float32)
        v_sc = (vbits & -16).to(tl.float32, bitcast=True)

        if ASM:
            if CODE_ZP:
                kc_lo, kc_hi = nibbles_asm(kb, tl.broadcast_to((kbits & 0xF).to(tl.uint8)[None, :], kb.shape), DOT)
            else:
                kc_lo, kc_hi = nibbles_asm(kb, tl.zeros(kb.shape, tl.uint8), DOT)
            s = tl.dot(q_even, kc_lo, input_precision=F32_PREC)
            s = tl.dot(q_odd, kc_hi, s, input_precision=F32_PREC)
        elif CODE_ZP:
            s = tl.dot(q_even, nibble_minus_zp(kb & 0xF, (kbits & 0xF)[None, :], DOT), input_precision=F32_PREC)
            s = tl.dot(q_odd, nibble_minus_zp(kb >> 4, (kbits & 0xF)[None, :], DOT), s, input_precision=F32_PREC)
        else:
            s = tl.dot(q_even, nibble_to_dot(kb & 0xF, DOT), input_precision=F32_PREC)
            # [BLOCK_M, TILE] = q_rot . codes
            s = tl.dot(q_odd, nibble_to_dot(kb >> 4, DOT), s, input_precision=F32_PREC)
        if CODE_ZP:  # s = q_rot . (codes - zp)
            s = s * (k_sc * qk_scale)[None, :]
        else:
            s = (s - q_sum[:, None] * k_zp[None, :]) * (k_sc * qk_scale)[None, :]
        if USE_SOFTCAP:
            s = apply_softcap(s, softcap) * LOG2E
        s = mask_scores(s, t, f0, f1, q_pos, k_pos, k_hi, n_ok, window_left, window_right, CAUSAL, MASK_EDGES)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vs_max = tl.maximum(tl.max(v_sc, 0), 1e-30)  # keeps p * v_scale inside fp16's range
        pv = to_dot(p * (v_sc / vs_max)[None, :], DOT)
        if CODE_ZP:
            if ASM:
                v_lo, v_hi = nibbles_asm(vb, tl.broadcast_to((vbits & 0xF).to(tl.uint8)[:, None], vb.shape), DOT)
            else:
                v_lo = nibble_minus_zp(vb & 0xF, (vbits & 0xF)[:, None], DOT)
                v_hi = nibble_minus_zp(vb >> 4, (vbits & 0xF)[:, None], DOT)
            acc_even = acc_even * alpha[:, None] + tl.dot(pv, v_lo, input_precision=F32_PREC) * vs_max
            acc_odd = acc_odd * alpha[:, None] + tl.dot(pv, v_hi, input_precision=F32_PREC) * vs_max
        else:
            zp_term = tl.sum(pv.to(tl.float32) * v_zp[None, :], 1)  # [BLOCK_M], of the rounded tile
            if ASM:
                v_lo, v_hi = nibbles_asm(vb, tl.zeros(vb.shape, tl.uint8), DOT)
                acc_even = acc_even * alpha[:, None] + (
                    tl.dot(pv, v_lo, input_precision=F32_PREC) - zp_term[:, None]) * vs_max
                acc_odd = acc_odd * alpha[:, None] + (
                    tl.dot(pv, v_hi, input_precision=F32_PREC) - zp_term[:, None]) * vs_max
            else:
                acc_even = acc_even * alpha[:, None] + (
                    tl.dot(pv, nibble_to_dot(vb & 0xF, DOT), input_precision=F32_PREC) - zp_term[:, None]) * vs_max
                acc_odd = acc_odd * alpha[:, None] + (
                    tl.dot(pv, nibble_to_dot(vb >> 4, DOT), input_precision=F32_PREC) - zp_term[:, None]) * vs_max
        m_i = m_new

    if SPLIT:
        # rotated accumulator, dimension 2i <- even half, 2i + 1 <- odd half
        row = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx
        base = out_ptr + row[:, None] * HEAD + 2 * offs_h[None, :]
        tl.store(base, acc_even, mask=row_ok[:, None])
        tl.store(base + 1, acc_odd, mask=row_ok[:, None])
        tl.store(segm_max_ptr + row, m_i, mask=row_ok)
        tl.store(segm_sum_ptr + row, l_i, mask=row_ok)
    else:
        # inverse rotation: o[j] = s[j] / d * sum_k H[j, k] acc[k], k = 2i (even) or 2i + 1 (odd)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        if ROT_CHUNK == 0:
            signs = tl.load(signs_ptr + offs_d) / HEAD
            g_even = hadamard_sign(2 * offs_h[:, None], offs_d[None, :]) * signs[None, :]  # [HALF, HEAD]
            g_odd = hadamard_sign(2 * offs_h[:, None] + 1, offs_d[None, :]) * signs[None, :]
            o = tl.dot(acc_even * inv_l[:, None], g_even, input_precision=F32_PREC)
            o = tl.dot(acc_odd * inv_l[:, None], g_odd, o, input_precision=F32_PREC)  # [BLOCK_M, HEAD]
            tl.store(out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:  # output dims in chunks of ROT_CHUNK (operands [HALF, ROT_CHUNK])
            offs_c = tl.arange(0, ROT_CHUNK)
            a_even = acc_even * inv_l[:, None]
            a_odd = acc_odd * inv_l[:, None]
            for c in tl.static_range(HEAD // ROT_CHUNK):
                o_dims = c * ROT_CHUNK + offs_c
                signs = tl.load(signs_ptr + o_dims) / HEAD
                o = tl.dot(a_even, hadamard_sign(2 * offs_h[:, None], o_dims[None, :]) * signs[None, :],
                           input_precision=F32_PREC)
                o = tl.dot(a_odd, hadamard_sign(2 * offs_h[:, None] + 1, o_dims[None, :]) * signs[None, :], o,
                           input_precision=F32_PREC)
                tl.store(out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h
                         + o_dims[None, :] * stride_o_d, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
