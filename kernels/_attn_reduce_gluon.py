"""The split-KV reduction at head_size 128 on the GPU, in Gluon: ``_attn_reduce_kernel``'s merge
with the inverse rotation as a butterfly network across a warp's lanes.

Each lane holds 4 consecutive dims of the merged row (dims ``4 l + 2 j + k`` of lane ``l``), so
the Sylvester Walsh-Hadamard product ``H acc`` is 7 radix-2 stages on the row in place: the two
on bits 0-1 inside each lane (adds and subtractions), the five on bits 2-6 between lanes
``l`` and ``l ^ 2^i`` (``shfl.sync.bfly`` and one add or subtraction each). That is 4 x 7 adds
and 20 shuffles per lane, against the Triton kernel's Kronecker products over ``[8, 16, 16]``
and ``[8, 8, 16]`` tiles, whose layout changes go through shared memory behind 16 barriers
(offline sm_90: 672 SASS instructions, 16 ``BAR``). The merge is the Triton kernel's: the
segments' maxima, weights ``exp2(max_s - max)``, the weighted sums of the accumulators and of
``l``, then one division.

The CPU (Triton's interpreter) and other head sizes keep ``_attn_reduce._attn_reduce_kernel``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

HEAD = gl.constexpr(128)        # the row this kernel merges: 32 lanes x 4 dims


@gluon.constexpr_function
def _bfly_asm(mask):
    return f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, -1;"


@gluon.jit
def _bfly(x, lane, MASK: gl.constexpr):
    """One radix-2 stage across lanes ``lane`` and ``lane ^ MASK`` (the whole warp takes part):
    ``x + x'`` where the lane's bit is 0, ``x' - x`` where it is 1."""
    p = gl.inline_asm_elementwise(asm=_bfly_asm(MASK), constraints="=r,r", args=[x], dtype=gl.float32,
                                  is_pure=False, pack=1)
    return gl.where((lane & MASK) == 0, x + p, p - x)


@gluon.jit
def _gdc_wait(x):
    """``griddepcontrol.wait`` (launched with ``launch_pdl``: the decode kernel's writes are visible)."""
    return gl.inline_asm_elementwise(asm="griddepcontrol.wait; mov.b32 $0, 0;", constraints="=r,r", args=[x],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _attn_reduce_gluon_kernel(
    out_ptr,                        # [T, Hq, 128] written
    segm_out_ptr,                   # [T, Hq, NUM_SEGMENTS, 128] fp32
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32, max in log2 units
    signs_ptr,                      # [128] fp32 rotation signs (ROTATE only)
    stride_o_t, stride_o_h, stride_o_d,
    NUM_Q_HEADS: gl.constexpr, NUM_SEGMENTS: gl.constexpr, SEG_PAD: gl.constexpr,
    ROTATE: gl.constexpr,           # INT4: the merged row is in the rotated domain
    PDL: gl.constexpr,              # launched with launch_pdl
):
    # [segment, lane, 4]: lane l holds dims 4 l .. 4 l + 3 of every segment of its warp (segment s
    # in warp s % NW): one load of the whole tile, so every segment's row is in flight at once
    NW: gl.constexpr = gl.num_warps()
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 32, 1],
                                        warps_per_cta=[NW, 1, 1], order=[2, 1, 0])
    S_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))             # [SEG_PAD]
    R_L: gl.constexpr = gl.SliceLayout(0, L3)                                  # [32, 4]: the row
    tok = gl.program_id(0).to(gl.int64)
    head = gl.program_id(1)
    if PDL:
        _gdc_wait(head)
    row0 = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS
    offs_s = gl.arange(0, SEG_PAD, layout=S_L)
    s_ok = offs_s < NUM_SEGMENTS
    d = (4 * gl.arange(0, 32, layout=gl.SliceLayout(1, R_L))[:, None]
         + gl.arange(0, 4, layout=gl.SliceLayout(0, R_L))[None, :])             # [32, 4]
    part = gl.load(segm_out_ptr + (row0 + offs_s)[:, None, None] * HEAD + d[None, :, :],
                   mask=s_ok[:, None, None], other=0.0)                         # [SEG_PAD, 32, 4]
    # every thread takes the maximum and the weighted sum of l over all segments itself (no
    # exchange between warps); the weights of its warp's segments again in the tile's layout
    A_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[SEG_PAD], threads_per_warp=[32], warps_per_cta=[NW],
                                         order=[0])
    offs_a = gl.arange(0, SEG_PAD, layout=A_L)
    a_ok = offs_a < NUM_SEGMENTS
    all_max = gl.load(segm_max_ptr + row0 + offs_a, mask=a_ok, other=float("-inf"))
    m = gl.max(all_max, 0)
    m = gl.where(m == float("-inf"), 0.0, m)
    total = gl.sum(gl.load(segm_sum_ptr + row0 + offs_a, mask=a_ok, other=0.0) * gl.exp2(all_max - m), 0)
    w = gl.exp2(gl.load(segm_max_ptr + row0 + offs_s, mask=s_ok, other=float("-inf")) - m)  # empty segments: 0
    acc = gl.sum(part * w[:, None, None], 0)                                    # [32, 4]
    inv = gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), 0.0)       # no visible key -> 0
    out_row = out_ptr + tok * stride_o_t + head * stride_o_h
    if ROTATE:
        a, b = gl.split(gl.reshape(acc, [32, 2, 2]))   # k = 0, 1: [32, 2 (j)]
        p0, p1 = gl.split(a + b)                   # bit 0 done; j = 0, 1: [32]
        q0, q1 = gl.split(a - b)
        y00 = p0 + p1                              # y_jk: bit 1 done
        y10 = p0 - p1
        y01 = q0 + q1
        y11 = q0 - q1
        lane = gl.arange(0, 32, layout=y00.type.layout)
        for i in gl.static_range(5):               # bits 2-6: across lanes
            y00 = _bfly(y00, lane, 1 << i)
            y10 = _bfly(y10, lane, 1 << i)
            y01 = _bfly(y01, lane, 1 << i)
            y11 = _bfly(y11, lane, 1 << i)
        z = gl.reshape(gl.permute(gl.join(gl.join(y00, y01), gl.join(y10, y11)), (0, 2, 1)), [32, 4])
        acc = gl.convert_layout(z, R_L) * (gl.load(signs_ptr + d) * (inv / HEAD))
    else:
        acc = acc * inv
    gl.store(out_row + d * stride_o_d, acc.to(out_ptr.dtype.element_ty))
