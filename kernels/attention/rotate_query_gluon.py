"""The Sylvester Walsh-Hadamard product of a 128-dim row held by one warp, in Gluon, and the INT4
query rotation built on it (``_rotate_query_gluon_kernel``, the GPU twin of ``_rotate_query_kernel``).

A row lies across a warp's lanes, lane ``l`` holding dims ``4 l .. 4 l + 3``. ``H x`` is then 7
radix-2 stages in place: the two on bits 0-1 of the dim inside each lane (adds and
subtractions), the five on bits 2-6 between lanes ``l`` and ``l ^ 2^i`` (``shfl.sync.bfly``
and one add or subtraction each): 28 adds and 20 shuffles per lane, no shared memory.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_pdl import gdc_release, gdc_wait

HEAD = gl.constexpr(128)


@gluon.constexpr_function
def _bfly_asm(mask):
    return f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, -1;"


@gluon.jit
def _bfly(x, lane, MASK: gl.constexpr):
    """One radix-2 stage across lanes ``lane`` and ``lane ^ MASK`` (the whole warp takes part):
    ``x' + x`` where the lane's bit is 0, ``x' - x`` where it is 1, as one FMA by a sign of +-1
    (exact, so the same bits as an add and a subtraction; the sign is the same for every value of
    a stage, so the compiler computes it once)."""
    p = gl.inline_asm_elementwise(asm=_bfly_asm(MASK), constraints="=r,r", args=[x], dtype=gl.float32,
                                  is_pure=False, pack=1)
    return p + gl.where((lane & MASK) == 0, 1.0, -1.0) * x


@gluon.jit
def fwht128(x):
    """``H x`` for a row ``x`` [32, 4] fp32 (lane ``l``: dims ``4 l + i``), in the same layout."""
    a, b = gl.split(gl.reshape(x, [32, 2, 2]))   # dims 4 l + 2 j + k; k = 0, 1: [32, 2 (j)]
    p0, p1 = gl.split(a + b)                       # bit 0 done; j = 0, 1: [32]
    q0, q1 = gl.split(a - b)
    y00 = p0 + p1                                  # y_jk: bit 1 done
    y10 = p0 - p1
    y01 = q0 + q1
    y11 = q0 - q1
    lane = gl.arange(0, 32, layout=y00.type.layout)
    for i in gl.static_range(5):                   # bits 2-6: across lanes
        y00 = _bfly(y00, lane, 1 << i)
        y10 = _bfly(y10, lane, 1 << i)
        y01 = _bfly(y01, lane, 1 << i)
        y11 = _bfly(y11, lane, 1 << i)
    z = gl.reshape(gl.permute(gl.join(gl.join(y00, y01), gl.join(y10, y11)), (0, 2, 1)), [32, 4])
    return gl.convert_layout(z, x.type.layout)


@gluon.jit
def _rotate_query_gluon_kernel(
    q_ptr, signs_ptr, q_out_ptr, softmax_scale,
    stride_q_t, stride_q_h, stride_q_d,
    NUM_Q_HEADS: gl.constexpr, PARTS: gl.constexpr,
    PDL: gl.constexpr,              # launched with launch_pdl
    RELEASE: gl.constexpr,          # let the decode kernel be scheduled at the start
):
    """One warp per (token, head): ``softmax_scale * H (s * q)`` in fp32, written in ``PARTS``
    parts as ``_rotate_query_kernel`` writes it (rotated dim ``PARTS * i + x`` at ``x * 128 / PARTS + i``)."""
    R_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                         order=[1, 0])
    tok = gl.program_id(0).to(gl.int64)
    head = gl.program_id(1)
    if PDL:
        gdc_wait(head)
        if RELEASE:
            gdc_release(head)
    d = (4 * gl.arange(0, 32, layout=gl.SliceLayout(1, R_L))[:, None]
         + gl.arange(0, 4, layout=gl.SliceLayout(0, R_L))[None, :])             # [32, 4]
    x = gl.load(q_ptr + tok * stride_q_t + head * stride_q_h + d * stride_q_d).to(gl.float32)
    y = fwht128(x * gl.load(signs_ptr + d)) * softmax_scale
    P: gl.constexpr = HEAD // PARTS
    gl.store(q_out_ptr + (tok * NUM_Q_HEADS + head) * HEAD + (d % PARTS) * P + d // PARTS, y)
