"""Reduction of the split-KV segments into the final attention output."""

from __future__ import annotations

import triton.language as tl

from ._attn_common import hadamard_sign, pdl_enter
from ._jit import dual_jit


# Grid: (num_tokens, num_q_heads). One program merges the NUM_SEGMENTS partial results of one
# (token, query head): rescale each segment's accumulator and sum by exp2(max_s - max), divide
# by the merged sum. ROTATE (INT4): the merged accumulator is in the rotated domain; apply the
# inverse rotation o[j] = s[j] / d * sum_k H[j, k] acc[k] once here (a [HEAD] x [HEAD, HEAD]
# product on CUDA cores, Hadamard signs from bit parity). Past 16K values (the launcher picks
# SEG_CHUNK and ROT_CHUNK), segments are merged SEG_CHUNK at a time and the rotation is done
# ROT_CHUNK outputs at a time: all at once, head_size 256 spilled 3 KB per thread (INT4 batch 1
# at 4k: 77.6 us, bf16 22.6; H200, docs/bench/attention.md). Each chunk costs a load latency,
# so smaller tiles (head_size 128 with up to 128 segments) keep the single load.
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
    ROT_CHUNK: tl.constexpr,        # outputs of the inverse rotation per step (divides HEAD)
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
    acc = tl.where(total > 0, acc / total, 0.0)  # no visible key -> 0 (as the oracle)
    out_row = out_ptr + tok * stride_o_t + head * stride_o_h
    if ROTATE:
        # g[k, j] = H[j, k] s[j] / d; o[j] = sum_k acc[k] g[k, j], ROT_CHUNK outputs j at a time
        for j0 in tl.static_range(0, HEAD, ROT_CHUNK):
            offs_j = j0 + tl.arange(0, ROT_CHUNK)
            g = hadamard_sign(offs_d[:, None], offs_j[None, :]) * (tl.load(signs_ptr + offs_j) / HEAD)[None, :]
            o = tl.sum(acc[:, None] * g, 0)
            tl.store(out_row + offs_j * stride_o_d, o.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_row + offs_d * stride_o_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
