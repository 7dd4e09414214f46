"""Reduction of the split-KV segments into the final attention output, and its launcher.

Two kernels merge the segments (``Plan.reduce`` says which): ``_attn_reduce_kernel`` below
(Triton, any device and head size) and ``reduce_gluon._attn_reduce_gluon_kernel`` (Gluon, CUDA,
head_size 128, at most ``GLUON_MAX_SEGMENTS`` segments). For INT4 both apply the inverse rotation.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_jit, next_pow2
from . import gluon_probe
from .common import hadamard_sign, pdl_enter

# the Triton reduction holds up to this many values in one tile (segments x padded head size),
# in chunks above it (decode_block_tiles' segments keep to it)
REDUCE_ONE_LOAD = 16384
GLUON_MAX_SEGMENTS = 512            # every segment's row loaded at once (16 rows of 4 floats per thread, 32 warps)
GLUON_STATS_IN_THREAD = 64          # up to this many segments each thread holds every segment's max and sum
GLUON_ROWS = 16                     # segments per warp (16 against 8 / 32 / 4: INT4 b8@32k 93.4-93.9 vs
                                    # 95.5 / 94.4 / 98.5 µs on the H200)
DIM_SPLIT_MAX = 4                   # programs per (token, head) of the unrotated Gluon reduction
UNROTATE_MIN_SEGMENTS = 128         # the staged INT4 kernel unrotates its split output from this many segments
_GLUON = ("reduce_gluon", "_attn_reduce_gluon_kernel")


# Grid: (num_tokens, num_q_heads). One program merges the NUM_SEGMENTS partial results of one
# (token, query head): rescale each segment's accumulator and sum by exp2(max_s - max), divide
# by the merged sum. Past 16K values (the launcher picks SEG_CHUNK) segments are merged
# SEG_CHUNK at a time; each chunk costs a load latency, so smaller tiles (head_size 128 with up
# to 128 segments) keep the single load.
#
# ROTATE (INT4): the merged accumulator is in the rotated domain; the inverse rotation o[j] = s[j] /
# d * sum_k H[j, k] acc[k] is applied once here, through the Kronecker split of the Sylvester
# matrix: with k = k_hi * LO + k_lo (and j alike), H[j, k] = H_hi[j_hi, k_hi] H_lo[j_lo, k_lo]
# (popcount(j & k) adds over the two bit fields), so on acc as an [HI, LO] matrix A the product is
# H_hi A H_lo: HEAD_PAD * (HI + LO) products (2,048 + 1,024 at head_size 128) instead of HEAD_PAD^2
# (16,384), and signs of [LO, LO] and [HI, HI] tiles only. The full product cost INT4 7.0 us of
# reduction at b8@32k and 20.2 us at b32@32k, INT8's reduction 3.1 / 4.8 (H200). HEAD_PAD > HEAD (a
# power of two) is exact too: the padded dims of acc are 0, and H_HEAD is the top-left block of
# H_HEAD_PAD.
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
        # tiles into a TF32 dot (head_size 256: 4e-4 relative error on the H200)
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


def reduce_segments(call, plan) -> None:
    """Merge ``call``'s segments into ``call.out`` [T, Hq, head_size]: ``segm_output``
    [>= T, Hq, segments, head_pad] fp32, ``segm_max`` / ``segm_expsum`` [>= T, Hq, segments] fp32
    (max in log2 units); INT4: the inverse rotation too, unless the decode kernel applied it
    (``plan.unrotated``)."""
    from .plan import Reduce
    out, segs = call.out, plan.tiling.num_segments
    signs = None if plan.unrotated else call.signs
    num_tokens, num_q_heads = out.shape[:2]
    seg_pad = next_pow2(segs)
    if plan.reduce == Reduce.GLUON:  # a program per token, head and dim split, a warp per GLUON_ROWS segments
        dsplit = plan.reduce_split
        gluon_probe.require(*_GLUON)[(num_tokens, num_q_heads, dsplit)](
            out, call.segm_output, call.segm_max, call.segm_expsum, call.segm_max if signs is None else signs,
            out.stride(0), out.stride(1), out.stride(2),
            NUM_Q_HEADS=num_q_heads, NUM_SEGMENTS=segs, SEG_PAD=seg_pad, ROTATE=signs is not None,
            STAT_SPREAD=stat_spread(seg_pad), PDL=plan.pdl, DSPLIT=dsplit,
            num_warps=max(1, seg_pad // (GLUON_ROWS * dsplit)), launch_pdl=plan.pdl)
        return
    head_pad = call.segm_output.shape[-1]
    # one load of every segment while the tile holds at most 16K values, else chunks of 4K values
    seg_chunk = seg_pad if seg_pad * head_pad <= REDUCE_ONE_LOAD else max(1, 4096 // head_pad)
    lo = 1 << (head_pad.bit_length() // 2)  # INT4's Kronecker split: LO >= HI
    _attn_reduce_kernel[(num_tokens, num_q_heads)](
        out_ptr=out, segm_out_ptr=call.segm_output, segm_max_ptr=call.segm_max, segm_sum_ptr=call.segm_expsum,
        signs_ptr=call.segm_max if signs is None else signs,
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        NUM_Q_HEADS=num_q_heads, HEAD=call.head_size, HEAD_PAD=head_pad,
        NUM_SEGMENTS=segs, SEG_PAD=seg_pad, SEG_CHUNK=seg_chunk,
        ROTATE=signs is not None, HI=head_pad // lo, LO=lo, PDL=plan.pdl, launch_pdl=plan.pdl,
        num_warps=4,
    )


def dim_split(rows: int, num_sms: int) -> int:
    """Programs per (token, head) of the Gluon reduction without the rotation (``Plan.reduce_split``):
    doubled, up to ``DIM_SPLIT_MAX``, while ``rows`` (tokens x query heads) times it leaves SMs
    idle; each merges ``128 / split`` dims."""
    split = 1
    while split < DIM_SPLIT_MAX and rows * split < num_sms:
        split *= 2
    return split


def stat_spread(seg_pad: int) -> int:
    """Lanes of a warp that share the Gluon reduction's segment statistics: none up to
    ``GLUON_STATS_IN_THREAD`` segments (each thread holds all of them), past it the whole warp
    (``seg_pad / 32`` per thread, merged by shuffles), which keeps 128-512 segments in registers."""
    return 1 if seg_pad <= GLUON_STATS_IN_THREAD else 32


def probe(dev: torch.device, num_q_heads: int, num_segments: int, rotate: bool, pdl: bool) -> bool:
    """Whether the Gluon reduction compiles on device ``dev`` (once per process and ``(rotate,
    pdl, stat_spread)``; ``gluon_probe.compiles``)."""
    def compile_once():
        out = torch.empty(1, num_q_heads, 128, dtype=torch.bfloat16, device=dev)
        segm = torch.empty(1, num_q_heads, num_segments, 128, dtype=torch.float32, device=dev)  # never launched
        stats = torch.empty(1, num_q_heads, num_segments, dtype=torch.float32, device=dev)
        signs = torch.empty(128, dtype=torch.float32, device=dev)
        seg_pad = next_pow2(num_segments)
        gluon_probe.require(*_GLUON).warmup(
            out, segm, stats, stats, signs if rotate else stats, out.stride(0), out.stride(1), out.stride(2),
            NUM_Q_HEADS=num_q_heads, NUM_SEGMENTS=num_segments, SEG_PAD=seg_pad, ROTATE=rotate,
            STAT_SPREAD=stat_spread(seg_pad), PDL=pdl,
            num_warps=max(1, seg_pad // GLUON_ROWS), launch_pdl=pdl, grid=(1, num_q_heads))
    key = (rotate, pdl, stat_spread(next_pow2(num_segments)))
    return gluon_probe.compiles(_GLUON[1], dev.index, key, compile_once, "the Triton reduction runs instead")
