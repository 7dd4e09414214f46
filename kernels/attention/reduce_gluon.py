"""The split-KV reduction at head_size 128 on the GPU, in Gluon: ``_attn_reduce_kernel``'s merge,
with the INT4 inverse rotation as a warp's lane butterflies (``rotate_query_gluon.fwht128``).

One program per (token, query head), a warp per ``SEG_PAD / num_warps`` segments. The whole
``[SEG_PAD, 128]`` tile of segment rows is one load, so every row is in flight at once; each
thread takes the maximum and the weighted sum of ``l`` over all segments itself, so the only
exchange between warps is the sum of the weighted rows. The Triton kernel changes layouts
through shared memory behind 16 barriers for its Kronecker products (offline sm_90: 672 SASS
instructions); this one has 2 barriers. On the H200: INT4
b32@32k's reduction 2.5 µs against 11.3, b12@32k 3.4 against 5.9.

Up to 64 segments each thread holds every segment's max and sum (``STAT_SPREAD`` 1); past that
the warp's lanes share them and merge by shuffles (``STAT_SPREAD`` 32, 64-84 registers where
holding 128 would spill), up to 512 segments in 32 warps. One token, 32 query heads, warm:
128 segments 3.7 µs against the Triton kernel's 4.0, 256 5.9 against 13.4 (which merges more
than 128 in chunks), 512 11.3 against 19.7; at 32 and 64 segments sharing or not is within
0.2 µs.

Without the rotation (bf16 / INT8 / FP8, and INT4 where the staged kernel unrotated its split
output) a row's dims need not meet in one program: with ``DSPLIT`` > 1 (``Plan.reduce_split``)
each of ``DSPLIT`` programs merges ``128 / DSPLIT`` dims, ``DSPLIT`` lanes of a warp along the
segments. A batch-1 call has only its 32 query heads' rows, each loading every segment's whole
row; split 4 ways they fill 128 SMs. On the H200, one token, 32 query heads, warm, CUDA graph
of 50 launches (µs per launch; unsplit / split 4, one warp per 64 segments): 16 segments 1.68 /
1.48, 64 2.53 / 2.14, 128 3.33 / 2.15 (3.43 with the rotation), 264 8.26 / 2.86.

The CPU (Triton's interpreter) and other head sizes keep ``reduce._attn_reduce_kernel``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_pdl import gdc_wait
from .rotate_query_gluon import HEAD, fwht128


@gluon.jit
def _attn_reduce_gluon_kernel(
    out_ptr,                        # [T, Hq, 128] written
    segm_out_ptr,                   # [T, Hq, NUM_SEGMENTS, 128] fp32
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32, max in log2 units
    signs_ptr,                      # [128] fp32 rotation signs (ROTATE only)
    stride_o_t, stride_o_h, stride_o_d,
    NUM_Q_HEADS: gl.constexpr, NUM_SEGMENTS: gl.constexpr, SEG_PAD: gl.constexpr,
    ROTATE: gl.constexpr,           # INT4: the merged row is in the rotated domain
    STAT_SPREAD: gl.constexpr,      # lanes sharing the segment statistics (1 or 32; SEG_PAD / it >= 1)
    PDL: gl.constexpr,              # launched with launch_pdl
    DSPLIT: gl.constexpr = 1,       # programs per (token, head), each merging 128 / DSPLIT dims (not ROTATE)
):
    # [segment, lane, 4]: lane l holds dims 4 l .. 4 l + 3 of every segment of its warp (segment s
    # in warp s % NW): one load of the whole tile, so every segment's row is in flight at once
    # DSPLIT > 1: a program merges dims DP c .. DP c + DP - 1 (c = program_id(2)), DP / 4 lanes
    # along the dims and the others along the segments
    NW: gl.constexpr = gl.num_warps()
    DP: gl.constexpr = HEAD // DSPLIT
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[128 // DP, DP // 4, 1],
                                        warps_per_cta=[NW, 1, 1], order=[2, 1, 0])
    S_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))             # [SEG_PAD]
    R_L: gl.constexpr = gl.SliceLayout(0, L3)                                  # [DP / 4, 4]: the row's dims
    tok = gl.program_id(0).to(gl.int64)
    head = gl.program_id(1)
    if PDL:
        gdc_wait(head)
    row0 = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS
    offs_s = gl.arange(0, SEG_PAD, layout=S_L)
    s_ok = offs_s < NUM_SEGMENTS
    d = (DP * gl.program_id(2) + 4 * gl.arange(0, DP // 4, layout=gl.SliceLayout(1, R_L))[:, None]
         + gl.arange(0, 4, layout=gl.SliceLayout(0, R_L))[None, :])             # [DP / 4, 4]
    part = gl.load(segm_out_ptr + (row0 + offs_s)[:, None, None] * HEAD + d[None, :, :],
                   mask=s_ok[:, None, None], other=0.0)                         # [SEG_PAD, DP / 4, 4]
    # every warp takes the maximum and the weighted sum of l over all segments itself (no
    # exchange between warps): each thread holds STAT_SPREAD-th of them (1: all, in registers;
    # 32: across the warp's lanes, merged by shuffles); the weights of its warp's segments again in
    # the tile's layout
    A_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[SEG_PAD // STAT_SPREAD], threads_per_warp=[32],
                                         warps_per_cta=[NW], order=[0])
    offs_a = gl.arange(0, SEG_PAD, layout=A_L)
    a_ok = offs_a < NUM_SEGMENTS
    all_max = gl.load(segm_max_ptr + row0 + offs_a, mask=a_ok, other=float("-inf"))
    m = gl.max(all_max, 0)
    m = gl.where(m == float("-inf"), 0.0, m)
    total = gl.sum(gl.load(segm_sum_ptr + row0 + offs_a, mask=a_ok, other=0.0) * gl.exp2(all_max - m), 0)
    w = gl.exp2(gl.load(segm_max_ptr + row0 + offs_s, mask=s_ok, other=float("-inf")) - m)  # empty segments: 0
    acc = gl.sum(part * w[:, None, None], 0)                                    # [DP / 4, 4]
    inv = gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), 0.0)       # no visible key -> 0
    out_row = out_ptr + tok * stride_o_t + head * stride_o_h
    if ROTATE:
        acc = fwht128(acc) * (gl.load(signs_ptr + d) * (inv / HEAD))
    else:
        acc = acc * inv
    gl.store(out_row + d * stride_o_d, acc.to(out_ptr.dtype.element_ty))
