"""The INT4 query rotation before a split decode: ``softmax_scale * H(s * q)`` in fp32.

An INT4 cache holds rotated rows (``layouts.rht_signs`` and the Sylvester Hadamard), so a decode
kernel that reads raw nibble codes needs the query rotated the same way. The 2D kernel and (at
small grids) the code-unit kernel rotate in their own prologue; otherwise one of these runs
first, once per query token and head, and writes the rotated query in ``parts`` parts (part
``x`` = rotated dims ``parts * i + x``, the order the decode kernels' dots want):

- ``_rotate_query_kernel`` (Triton, any device and head size);
- ``rotate_query_gluon._rotate_query_gluon_kernel`` (Gluon, CUDA, head_size 128): one warp per token
  and head, the Hadamard product in lane butterflies.

``Plan.rotate`` says which; :func:`rotated_query` runs it.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from layouts import KVQuantMode

from .._jit import cdiv, dual_jit, interpreting
from . import gluon_probe
from .common import DOT_FP16, DOT_FP32, hadamard_sign, pdl_enter, pdl_release

_GLUON = ("rotate_query_gluon", "_rotate_query_gluon_kernel")


# Grid: (num_tokens, cdiv(num_q_heads, BLOCK_H)). INT4 query: q_out = softmax_scale * H(s * q), fp32,
# in PARTS parts of HEAD / PARTS dims, part x = rotated dims PARTS * i + x (decode_split: 2, others: 4).
@dual_jit
def _rotate_query_kernel(
    q_ptr, signs_ptr, q_out_ptr, softmax_scale,
    stride_q_t, stride_q_h, stride_q_d,
    NUM_Q_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_H: tl.constexpr, DOT: tl.constexpr,
    PARTS: tl.constexpr,
    PDL: tl.constexpr,              # launched with launch_pdl (pdl_enter)
    RELEASE: tl.constexpr,          # pdl_release at the start
):
    pdl_enter(PDL)
    if RELEASE:  # a handful of programs: the decode kernel may be scheduled at once
        pdl_release(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < NUM_Q_HEADS
    offs_d = tl.arange(0, HEAD)
    # q in its own dtype: times the +-1 signs and Hadamard entries, the 16-bit dot is exact up to
    # the fp32 accumulation (DOT_FP32, interpreter: everything in fp32)
    q = tl.load(q_ptr + tok * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=h_ok[:, None], other=0.0)
    if DOT == DOT_FP32:
        q = q.to(tl.float32)
    out = q_out_ptr + (tok * NUM_Q_HEADS + head)[:, None] * HEAD
    P: tl.constexpr = HEAD // PARTS
    offs_p = tl.arange(0, P)
    q = q * tl.load(signs_ptr + offs_d)[None, :].to(q.dtype)
    for x in tl.static_range(PARTS):
        qx = tl.dot(q, hadamard_sign(offs_d[:, None], PARTS * offs_p[None, :] + x).to(q.dtype)) * softmax_scale
        tl.store(out + x * P + offs_p[None, :], qx, mask=h_ok[:, None])


def query_scales(call) -> tuple:
    """``(use_softcap, col_scale)``: ``col_scale`` multiplies each key's scale (INT4: ``1 /
    head_size``, its rotation's normaliser; ``log2 e`` without softcap, for ``exp2``)."""
    use_softcap = call.softcap > 0
    col_scale = (1.0 / call.head_size if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD else 1.0) * \
        (1.0 if use_softcap else math.log2(math.e))
    return use_softcap, col_scale


def rotated_query(call, plan) -> tuple:
    """What a split decode kernel reads as its query, and the scale it applies to it:
    ``(query, q_scale)``. ``plan.rotate`` TRITON / GLUON: the rotation kernel's output
    ([num_tokens, num_q_heads, head_size] fp32, ``softmax_scale`` folded in, so ``q_scale`` 1),
    launched with programmatic dependent launch where ``plan.pdl`` (``plan.rotate_release``: it
    lets the decode kernel be scheduled at its start); else ``call.q`` and ``softmax_scale``."""
    from .plan import Rotate
    q = call.q
    if plan.rotate not in (Rotate.TRITON, Rotate.GLUON):
        return q, call.softmax_scale
    qp = torch.empty(q.shape[0], q.shape[1], call.head_size, dtype=torch.float32, device=q.device)
    release = plan.pdl and plan.rotate_release
    if plan.rotate == Rotate.GLUON:
        gluon_probe.require(*_GLUON)[q.shape[:2]](
            q, call.signs, qp, call.softmax_scale, q.stride(0), q.stride(1), q.stride(2),
            NUM_Q_HEADS=q.shape[1], PARTS=plan.rotate_parts, PDL=plan.pdl, RELEASE=release,
            num_warps=1, launch_pdl=plan.pdl)
        return qp, 1.0
    _rotate_query_kernel[(q.shape[0], cdiv(q.shape[1], 16))](
        q_ptr=q, signs_ptr=call.signs, q_out_ptr=qp, softmax_scale=call.softmax_scale,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        NUM_Q_HEADS=q.shape[1], HEAD=call.head_size, BLOCK_H=16,
        DOT=DOT_FP32.value if interpreting(q) else DOT_FP16.value, PARTS=plan.rotate_parts, PDL=plan.pdl,
        RELEASE=release, launch_pdl=plan.pdl,
        num_warps=4)
    return qp, 1.0


def probe(dev: torch.device, num_q_heads: int, parts: int, pdl: bool, release: bool) -> bool:
    """Whether the Gluon rotation compiles on device ``dev`` (once per process and ``(parts, pdl,
    release)``; ``gluon_probe.compiles``)."""
    def compile_once():
        q = torch.empty(1, num_q_heads, 128, dtype=torch.bfloat16, device=dev)  # compiled, never launched
        qp = torch.empty(1, num_q_heads, 128, dtype=torch.float32, device=dev)
        signs = torch.empty(128, dtype=torch.float32, device=dev)
        gluon_probe.require(*_GLUON).warmup(
            q, signs, qp, 1.0, q.stride(0), q.stride(1), q.stride(2), NUM_Q_HEADS=num_q_heads, PARTS=parts,
            PDL=pdl, RELEASE=pdl and release, num_warps=1, launch_pdl=pdl, grid=(1, num_q_heads))
    return gluon_probe.compiles(_GLUON[1], dev.index, (parts, pdl, release), compile_once,
                                "the Triton query rotation runs instead")
