"""Reduction of the split-KV segments into the final attention output."""

from __future__ import annotations

import triton.language as tl

from ._attn_common import hadamard_sign, pdl_enter
from ._jit import dual_jit


# Grid: (num_tokens, num_q_heads). One program merges the NUM_SEGMENTS partial results of one
# (token, query head): rescale each segment's accumulator and sum by exp2(max_s - max), divide
# by the merged sum. ROTATE (INT4): the merged accumulator is in the rotated domain; apply the
# inverse rotation o[j] = s[j] / d * sum_k H[j, k] acc[k] once here (a [HEAD] x [HEAD, HEAD]
# product on CUDA cores, Hadamard signs from bit parity). The work is tiny next to the KV read.
@dual_jit
def _attn_reduce_kernel(
    out_ptr,                        # [T, Hq, HEAD] written
    segm_out_ptr,                   # [T, Hq, NUM_SEGMENTS, HEAD_PAD] fp32
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32, max in log2 units
    signs_ptr,                      # [HEAD] fp32 rotation signs (ROTATE only)
    stride_o_t, stride_o_h, stride_o_d,
    NUM_Q_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEG_PAD: tl.constexpr, ROTATE: tl.constexpr,
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
    part = tl.load(segm_out_ptr + (row0 + offs_s)[:, None] * HEAD_PAD + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [SEG_PAD, HEAD_PAD]
    acc = tl.sum(part * w[:, None], 0)
    acc = tl.where(total > 0, acc / total, 0.0)  # no visible key -> 0 (as the oracle)
    if ROTATE:
        # g[k, j] = H[j, k] s[j] / d; o[j] = sum_k acc[k] g[k, j]
        signs = tl.load(signs_ptr + offs_d) / HEAD
        g = hadamard_sign(offs_d[:, None], offs_d[None, :]) * signs[None, :]  # [HEAD, HEAD]
        acc = tl.sum(acc[:, None] * g, 0)
    tl.store(out_ptr + tok * stride_o_t + head * stride_o_h + offs_d * stride_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=d_ok)
