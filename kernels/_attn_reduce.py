"""Reduction of the split-KV segments into the final attention output."""

from __future__ import annotations

import triton.language as tl

from ._attn_common import hadamard_sign, pdl_enter
from ._jit import dual_jit


# Grid: (num_tokens, num_q_heads). One program merges the NUM_SEGMENTS partial results of one
# (token, query head): rescale each segment's accumulator and sum by exp2(max_s - max), divide
# by the merged sum. Past 16K values (the launcher picks SEG_CHUNK) segments are merged
# SEG_CHUNK at a time; each chunk costs a load latency, so smaller tiles (head_size 128 with up
# to 128 segments) keep the single load.
#
# ROTATE (INT4): the merged accumulator is in the rotated domain; the inverse rotation
# o[j] = s[j] / d * sum_k H[j, k] acc[k] is applied once here, through the Kronecker split of the
# Sylvester matrix: with k = k_hi * LO + k_lo (and j alike), H[j, k] = H_hi[j_hi, k_hi] H_lo[j_lo, k_lo]
# (popcount(j & k) adds over the two bit fields), so on acc as an [HI, LO] matrix A the product is
# H_hi A H_lo: HEAD_PAD * (HI + LO) products (2,048 + 1,024 at head_size 128) instead of
# HEAD_PAD^2 (16,384), and signs of [LO, LO] and [HI, HI] tiles only. The full product cost INT4
# 7.0 us of reduction at b8@32k and 20.2 us at b32@32k, INT8's reduction 3.1 / 4.8 (H200,
# docs/bench/attention.md, session 13). HEAD_PAD > HEAD (a power of two) is exact too: the
# padded dims of acc are 0, and H_HEAD is the top-left block of H_HEAD_PAD.
@dual_jit
def _attn_reduce_kernel(
    out_ptr,                        # [T, Hq, HEAD] written
    segm_out_ptr,                   # [T, Hq, NUM_SEGMENTS, HEAD_PAD] fp32
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32, max in log2 units
    signs_ptr,                      # [HEAD] fp32 rotation signs (ROTATE only)
    stride_o_t, stride_o_h, stride_o_d,
    NUM_Q_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEG_PAD: tl.constexpr, ROTATE: tl.constexpr,
    SEG_CHUNK: tl.constexpr,        # segments merged per step (a power of two <= SEG_PAD)
    HI: tl.constexpr, LO: tl.constexpr,  # ROTATE: HI x LO = HEAD_PAD, the Kronecker split
    PDL: tl.constexpr,              # launched with launch_pdl (pdl_enter)
):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row0 = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS
    offs_s = tl.arange(0, SEG_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < NUM_SEGMENTS
    d_ok = offs_d < HEAD
    seg_max = tl.load(segm_max_ptr + row0 + offs_s, mask=s_ok, other=float("-inf"))
    seg_sum = tl.load(segm_sum_ptr + row0 + offs_s, mask=s_ok, other=0.0)
    m = tl.max(seg_max, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(seg_max - m)  # empty segments: exp2(-inf) = 0
    total = tl.sum(seg_sum * w, 0)
    if SEG_CHUNK >= SEG_PAD:  # all segments in one load: its latency once, not once per chunk
        part = tl.load(segm_out_ptr + (row0 + offs_s)[:, None] * HEAD_PAD + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [SEG_PAD, HEAD_PAD]
        acc = tl.sum(part * w[:, None], 0)
    else:
        acc = tl.zeros([HEAD_PAD], tl.float32)
        for s0 in tl.range(0, NUM_SEGMENTS, SEG_CHUNK):
            offs_c = s0 + tl.arange(0, SEG_CHUNK)
            c_ok = offs_c < NUM_SEGMENTS
            wc = tl.exp2(tl.load(segm_max_ptr + row0 + offs_c, mask=c_ok, other=float("-inf")) - m)
            part = tl.load(segm_out_ptr + (row0 + offs_c)[:, None] * HEAD_PAD + offs_d[None, :],
                           mask=c_ok[:, None] & d_ok[None, :], other=0.0)  # [SEG_CHUNK, HEAD_PAD]
            acc += tl.sum(part * wc[:, None], 0)
    acc = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)  # no visible key -> 0 (as the oracle)
    out_row = out_ptr + tok * stride_o_t + head * stride_o_h
    if ROTATE:
        jh = tl.arange(0, HI)
        jl = tl.arange(0, LO)
        # signs by selects, not products: Triton turns a sum of a broadcast product of [16, 16]
        # tiles into a TF32 dot (head_size 256: 4e-4 relative error on the H200, session 13)
        a = tl.reshape(acc, [HI, LO])                                          # A[k_hi, k_lo]
        neg_lo = (hadamard_sign(jl[:, None], jl[None, :]) < 0)[None, :, :]
        b = tl.sum(tl.where(neg_lo, -a[:, None, :], a[:, None, :]), 2)         # A H_lo: [k_hi, j_lo]
        neg_hi = (hadamard_sign(jh[:, None], jh[None, :]) < 0)[:, :, None]
        o = tl.sum(tl.where(neg_hi, -b[None, :, :], b[None, :, :]), 1)         # H_hi A H_lo: [j_hi, j_lo]
        offs_o = jh[:, None] * LO + jl[None, :]                                # j = j_hi * LO + j_lo
        o_ok = offs_o < HEAD
        o = o * (tl.load(signs_ptr + offs_o, mask=o_ok, other=0.0) / HEAD)
        tl.store(out_row + offs_o * stride_o_d, o.to(out_ptr.dtype.element_ty), mask=o_ok)
    else:
        tl.store(out_row + offs_d * stride_o_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
