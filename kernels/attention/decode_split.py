"""Split-KV decode kernel for any quantized cache (INT8, FP8, INT4 per-token-head), and its launcher.

The portable fallback of the decode family: it reads the cache through byte strides, so it serves
the quantized caches the code-unit and block-tile kernels cannot read (rows not 4-byte aligned).

Decode has one query token per sequence and a small GQA group (4 query heads per KV head in
the benchmark), so the 2D kernel's ``[BLOCK_M = 16, TILE]`` score tile wastes 3/4 of every
MMA row and every softmax element there, with the codes as the dots' B operand. Here the dots are
swapped ("swap AB"): the converted codes are the A operand, the tiny query / probability
tiles the B operand, and every tile is ``[keys, GP]`` with ``GP`` = the group padded to a
power of two (>= 8):

- scores ``s^T [TILE, GP] = codes_K [TILE, D] . q^T [D, GP]``;
- values ``acc^T [D, GP] += codes_V^T [D, TILE] . p^T [TILE, GP]``;
- softmax statistics are per column (one per query head).

Codes become fp16 ``OFF + c`` (``OFF`` = -8 for INT4 nibbles, 1152 for INT8, 0 for FP8) by
bit tricks; ``OFF`` is folded into the zero point, so no subtraction per element. On the GPU
the INT8 / INT4 conversions are PTX (``ASM``): one 32-bit register holds 4 code bytes, ``prmt``
/ ``lop3`` build packed fp16x2 words. The interpreter cannot run PTX: ``ASM`` is False there
and plain integer ops produce the same values.

With one query per sequence, ``visible`` reduces to the key range ``[k_lo, k_hi)``: no
per-(query, key) mask. ``softmax_scale`` is folded into the query (``q_ptr`` holds the scaled,
for INT4 also rotated, query in fp32), which keeps fp16 operands far from overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from layouts import KVQuantMode

from .._jit import dual_jit, interpreting, next_pow2
from .call import kv_align
from .common import DOT_FP16, DOT_FP32, decode_program, decode_tile_softmax, to_dot
from .rotate_query import query_scales, rotated_query
from .units import DECODE_MODES, MODE_INT4, MODE_INT8

MIN_GP = 8  # the query-head (N) side of the dots is padded to at least this


@triton.jit
def _int4_asm(b):
    """uint8 codes -> (low nibble - 8, high nibble - 8) fp16, 4 bytes per 32-bit register.

    ``(w & 0x000F000F) | 0x64006400`` is fp16x2 ``1024 + n``, minus 1032; the high nibbles give
    ``1024 + 16 n``, times 1/16 (0x2C00) minus 72 (0xD480). Centred codes keep the zero-point
    correction small: a 1024 offset folded into it cost ~1e-2 of precision in the fp32 wgmma
    accumulation on the H200."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, z, c, m, r;
        mov.b32 z, 0;
        mov.b32 r, 0x2C002C00;
        mov.b32 c, 0x64086408;
        mov.b32 m, 0xD480D480;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, $0, c;
        sub.f16x2 $1, $1, c;
        fma.rn.f16x2 $2, $2, r, m;
        fma.rn.f16x2 $3, $3, r, m;
        }""",
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int8_asm(c):
    """int8 codes -> fp16 ``1152 + c`` (``(c ^ 0x80) | 0x6400``), 4 bytes per 32-bit register."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, h;
        mov.b32 h, 0x64646464;
        xor.b32 x, $2, 0x80808080;
        prmt.b32 $0, x, h, 0x4140;
        prmt.b32 $1, x, h, 0x4342;
        }""",
        constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _int4_plain(b, DOT: tl.constexpr):
    lo = ((b & 0xF).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    hi = ((b >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    if DOT == DOT_FP32:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return lo, hi


@triton.jit
def _codes(x, MODE: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr):
    """INT8 / FP8 codes -> dot operand ``OFF + c`` (fp16; fp32 when interpreting)."""
    if MODE == MODE_INT8:
        if ASM:
            y = _int8_asm(x)
        else:
            y = (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True)
    else:
        y = x.to(tl.float16)
    if DOT == DOT_FP32:
        y = y.to(tl.float32)
    return y


@triton.jit
def _load_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, t, t_end, k_lo, k_hi, kv_head, offs_t, offs_d,
               stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
               stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
               TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_ALIGN: tl.constexpr):
    """Raw codes of key tile ``t`` (K [TILE, D], V^T [D, TILE]), scale words [TILE], key mask."""
    k_pos = t * TILE + offs_t
    n_ok = (k_pos < tl.minimum(k_hi, t_end * TILE)) & (k_pos >= k_lo)  # tile t_end: all masked
    blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = k_pos % BLOCK_SIZE
    k_row = blk * (stride_k_b * KV_ALIGN) + slot * (stride_k_s * KV_ALIGN) + kv_head * (stride_k_h * KV_ALIGN)
    v_row = blk * (stride_v_b * KV_ALIGN) + slot * (stride_v_s * KV_ALIGN) + kv_head * (stride_v_h * KV_ALIGN)
    kc = tl.load(k_ptr + k_row[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    vc = tl.load(v_ptr + v_row[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
    kw = tl.load(k_scale_ptr + blk * stride_ks_b + slot * stride_ks_s + kv_head * stride_ks_h, mask=n_ok, other=0)
    vw = tl.load(v_scale_ptr + blk * stride_vs_b + slot * stride_vs_s + kv_head * stride_vs_h, mask=n_ok, other=0)
    return kc, vc, kw, vw, n_ok


# Grid: (num_seqs, num_kv_heads, NUM_SEGMENTS). Writes the split buffers of _attn_reduce_kernel
# (accumulator rows [T, Hq, NUM_SEGMENTS, HEAD], INT4 still rotated, in natural element order).
@dual_jit
def _decode_split_kernel(
    q_ptr,                          # [T, Hq, HEAD] fp32 (scaled; INT4: rotated, even half | odd half)
    k_ptr, v_ptr,                   # [num_blocks, block_size, Hkv, HEAD or HEAD // 2] codes
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] fp32 (INT4: int32 bits scale | zp)
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    q_scale, col_scale, softcap, window_left, window_right,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr,
    D: tl.constexpr, OFF: tl.constexpr,  # code dim per row (INT4: HEAD // 2); code offset
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr, DOT: tl.constexpr,
    ASM: tl.constexpr, CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, KV_ALIGN: tl.constexpr,
    PDL: tl.constexpr,              # launched with launch_pdl (waits in its prologue)
):
    seq_idx, kv_head, seg_idx, tok, has_query, k_lo, k_hi, t0, t1 = decode_program(
        cu_seqlens_q_ptr, seqused_k_ptr, window_left, window_right, CAUSAL, TILE, NUM_SEGMENTS, PDL)
    if not has_query:
        return

    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, TILE)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    row = (tok.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx  # [GP]
    # q^T: [D, GP] (INT4: two halves); q_sum of the rounded operand, for the folded offsets
    q_base = q_ptr + tok.to(tl.int64) * stride_q_t + head[None, :] * stride_q_h + offs_d[:, None] * stride_q_d
    qa = to_dot(tl.load(q_base, mask=g_ok[None, :], other=0.0).to(tl.float32) * q_scale, DOT)
    q_sum = tl.sum(qa.to(tl.float32), 0)
    if MODE == MODE_INT4:
        qb = to_dot(tl.load(q_base + D * stride_q_d, mask=g_ok[None, :], other=0.0), DOT)
        q_sum += tl.sum(qb.to(tl.float32), 0)
    else:
        qb = qa

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_a = tl.zeros([D, GP], tl.float32)
    acc_b = tl.zeros([D, GP], tl.float32)  # INT4 odd half (unused otherwise)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s
    for t in range(t0, t1):
        kc_c, vc_c, kw_c, vw_c, n_ok_c = _load_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, t, t1, k_lo, k_hi, kv_head, offs_t, offs_d,
            stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
            stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
            TILE, BLOCK_SIZE, KV_ALIGN)
        if MODE == MODE_INT4:
            k_zp = (kw_c & 0xF).to(tl.float32) + OFF
            k_sc = (kw_c & -16).to(tl.float32, bitcast=True)
            v_zp = (vw_c & 0xF).to(tl.float32) + OFF
            v_sc = (vw_c & -16).to(tl.float32, bitcast=True)
            if ASM:
                k_lo_c, k_hi_c = _int4_asm(kc_c)
                v_lo_c, v_hi_c = _int4_asm(vc_c)
            else:
                k_lo_c, k_hi_c = _int4_plain(kc_c, DOT)
                v_lo_c, v_hi_c = _int4_plain(vc_c, DOT)
            s = tl.dot(k_lo_c, qa)
            s = tl.dot(k_hi_c, qb, s)  # [TILE, GP]
        else:
            k_zp = tl.full([TILE], OFF, tl.float32)
            k_sc = kw_c
            v_zp = tl.full([TILE], OFF, tl.float32)
            v_sc = vw_c
            s = tl.dot(_codes(kc_c, MODE, DOT, ASM), qa)
        pv, alpha, m_new, l_i, vs_max, zp_term = decode_tile_softmax(
            s, n_ok_c, k_zp, k_sc, q_sum, v_zp, v_sc, m_i, l_i, col_scale, softcap, USE_SOFTCAP, DOT)
        if MODE == MODE_INT4:
            acc_a = acc_a * alpha[None, :] + (tl.dot(v_lo_c, pv) - zp_term[None, :]) * vs_max
            acc_b = acc_b * alpha[None, :] + (tl.dot(v_hi_c, pv) - zp_term[None, :]) * vs_max
        else:
            acc_a = acc_a * alpha[None, :] + (tl.dot(_codes(vc_c, MODE, DOT, ASM), pv) - zp_term[None, :]) * vs_max
        m_i = m_new

    if MODE == MODE_INT4:
        base = segm_out_ptr + row[None, :] * HEAD + 2 * offs_d[:, None]  # dim 2i <- even, 2i + 1 <- odd
        tl.store(base, acc_a, mask=g_ok[None, :])
        tl.store(base + 1, acc_b, mask=g_ok[None, :])
    else:
        tl.store(segm_out_ptr + row[None, :] * HEAD + offs_d[:, None], acc_a, mask=g_ok[None, :])
    tl.store(segm_max_ptr + row, m_i, mask=g_ok)
    tl.store(segm_sum_ptr + row, l_i, mask=g_ok)


def launch_split(call, plan) -> None:
    """Launch ``_decode_split_kernel`` (grid: sequences x KV heads x segments) on ``call`` (its
    segment buffers allocated); an INT4 query is rotated first (``plan.rotate``, 2 parts)."""
    q, k, v, tiling = call.q, call.k, call.v, plan.tiling
    interp = interpreting(q)
    align = kv_align(k, v)
    grid = (call.num_seqs, k.shape[2], tiling.num_segments)
    qp, q_scale = rotated_query(call, plan)
    use_softcap, col_scale = query_scales(call)
    code_dim = call.head_size // 2 if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD else call.head_size
    mode_id, off = DECODE_MODES[call.mode]
    ks, vs = call.ks, call.vs
    _decode_split_kernel[grid](
        q_ptr=qp, k_ptr=k, v_ptr=v, k_scale_ptr=ks, v_scale_ptr=vs, segm_out_ptr=call.segm_output,
        segm_max_ptr=call.segm_max, segm_sum_ptr=call.segm_expsum, block_table_ptr=call.block_table,
        cu_seqlens_q_ptr=call.cu_seqlens_q.contiguous(), seqused_k_ptr=call.seqused_k.contiguous(),
        q_scale=q_scale, col_scale=col_scale, softcap=call.softcap,
        window_left=int(call.window_size[0]), window_right=int(call.window_size[1]),
        stride_q_t=qp.stride(0), stride_q_h=qp.stride(1), stride_q_d=qp.stride(2),
        stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align, stride_k_h=k.stride(2) // align,
        stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align, stride_v_h=v.stride(2) // align,
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_bt_s=call.block_table.stride(0),
        NUM_Q_HEADS=q.shape[1], GROUP=call.group, GP=max(MIN_GP, next_pow2(call.group)),
        HEAD=call.head_size, D=code_dim, OFF=off, BLOCK_SIZE=k.shape[1], TILE=tiling.tile, MODE=mode_id,
        DOT=DOT_FP32.value if interp else DOT_FP16.value, ASM=not interp,
        CAUSAL=call.causal, USE_SOFTCAP=use_softcap, NUM_SEGMENTS=tiling.num_segments, KV_ALIGN=align,
        PDL=plan.pdl, launch_pdl=plan.pdl, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
