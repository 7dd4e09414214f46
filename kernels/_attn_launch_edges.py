"""Launch of the kernels at the edges of a split decode: the INT4 query rotation before it and
the reduction of its segments after it.

On CUDA GPUs at head_size 128 both are Gluon kernels whose Hadamard products are a warp's lane
butterflies (``_hadamard_gluon``; the reduction with at most ``GLUON_MAX_SEGMENTS`` segments);
everywhere else, and on the CPU, the Triton kernels (``_prep_q_kernel``, ``_attn_reduce``). Each
Gluon kernel has its own switch-off, as v6 and v7: if it does not compile with the installed
Triton, the first call warns once and the process keeps the Triton kernel.
"""

from __future__ import annotations

import torch

from . import _attn_launch_v6 as L6
from ._attn_reduce import _attn_reduce_kernel
from ._jit import next_pow2

GLUON = True                        # the Gluon kernel where it applies
GLUON_MAX_SEGMENTS = 64             # every segment's row loaded at once (16 rows of 4 floats per thread at most)
GLUON_ROWS = 16                     # segments per thread: a warp per ROWS segments (H200, session 18: 16
                                    # against 8 / 32 / 4, INT4 b8@32k 93.4-93.9 vs 95.5 / 94.4 / 98.5 µs)
_DISABLED: list = []                # why the Gluon reduction was switched off in this process, if it was
_PREP_DISABLED: list = []           # why the Gluon query rotation was, if it was


# the Triton reduction holds up to this many values in one tile (segments x padded head size),
# in chunks above it (``_attn_reduce``; v4's segments keep to it)
REDUCE_ONE_LOAD = 16384


def _gluon_kernel():
    return L6.gluon_kernel("._attn_reduce_gluon", "_attn_reduce_gluon_kernel")


def _prep_kernel():
    return L6.gluon_kernel("._hadamard_gluon", "_prep_q_gluon_kernel")


def _usable(t: torch.Tensor, disabled: list, kernel) -> bool:
    """Whether a Gluon edge kernel can run on ``t``'s device: ``GLUON`` on, not switched off
    (``disabled``), CUDA sm_80+, and ``kernel()`` imported."""
    return (GLUON and not disabled and t.device.type == "cuda" and L6._capable(t.device.index or 0)
            and kernel() is not None)


def prep_fit(q: torch.Tensor) -> bool:
    """Whether the Gluon kernel rotates this query: CUDA (sm_80+), head_size 128, not switched off."""
    return q.shape[2] == 128 and _usable(q, _PREP_DISABLED, _prep_kernel)


def prep_q_gluon(q, signs, qp, softmax_scale, parts, use_pdl, release) -> bool:
    """Rotate the INT4 query into ``qp`` (``_prep_q_kernel``'s output: [T, Hq, 128] fp32 in
    ``parts`` parts) with the Gluon kernel, one warp per token and head, where it applies
    (:func:`prep_fit`); False where it does not (the caller runs the Triton kernel), and once,
    with a warning, where it does not compile here."""
    return prep_fit(q) and L6.gluon_ran(
        lambda e: L6.disable(e, _PREP_DISABLED, "INT4 query rotation", "the Triton rotation runs instead"),
        lambda: _prep_kernel()[q.shape[:2]](
            q, signs, qp, float(softmax_scale), q.stride(0), q.stride(1), q.stride(2),
            NUM_Q_HEADS=q.shape[1], PARTS=parts, PDL=use_pdl, RELEASE=use_pdl and release,
            num_warps=1, launch_pdl=use_pdl))


def gluon_fit(out: torch.Tensor, segm_output: torch.Tensor, head_size: int, num_segments: int) -> bool:
    """Whether the Gluon kernel merges this call: CUDA (sm_80+), head_size 128 (rows of 128
    fp32 in ``segm_output``), at most ``GLUON_MAX_SEGMENTS`` segments, not switched off."""
    return (head_size == 128 and segm_output.shape[-1] == 128 and num_segments <= GLUON_MAX_SEGMENTS
            and _usable(out, _DISABLED, _gluon_kernel))


def launch_reduce(out, segm_output, segm_max, segm_expsum, head_size, num_segments, signs=None, use_pdl=False):
    """Merge the split path's segments into ``out`` [T, Hq, head_size]: ``segm_output``
    [>= T, Hq, segments, head_pad] fp32, ``segm_max`` / ``segm_expsum`` [>= T, Hq, segments] fp32
    (max in log2 units); ``signs`` (INT4, [head_size] fp32): apply the inverse rotation."""
    num_tokens, num_q_heads = out.shape[:2]
    if gluon_fit(out, segm_output, head_size, num_segments) and _gluon_ran(
            out, segm_output, segm_max, segm_expsum, num_segments, signs, use_pdl):
        return
    head_pad = segm_output.shape[-1]
    # one load of every segment while the tile holds at most 16K values, else chunks of 4K values
    # (measured: bench/attention.md)
    seg_pad = next_pow2(num_segments)
    seg_chunk = seg_pad if seg_pad * head_pad <= REDUCE_ONE_LOAD else max(1, 4096 // head_pad)
    lo = 1 << (head_pad.bit_length() // 2)  # INT4's Kronecker split: LO >= HI
    _attn_reduce_kernel[(num_tokens, num_q_heads)](
        out_ptr=out, segm_out_ptr=segm_output, segm_max_ptr=segm_max, segm_sum_ptr=segm_expsum,
        signs_ptr=segm_max if signs is None else signs,
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        NUM_Q_HEADS=num_q_heads, HEAD=head_size, HEAD_PAD=head_pad,
        NUM_SEGMENTS=num_segments, SEG_PAD=seg_pad, SEG_CHUNK=seg_chunk,
        ROTATE=signs is not None, HI=head_pad // lo, LO=lo, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=4,
    )


def _gluon_ran(out, segm_output, segm_max, segm_expsum, num_segments, signs, use_pdl) -> bool:
    """Launch the Gluon kernel (a program per token and head, a warp per ``GLUON_ROWS``
    segments); False, and the kernel switched off with one warning, where it does not compile
    with this Triton (``_attn_launch_v6.gluon_ran``)."""
    seg_pad = next_pow2(num_segments)
    return L6.gluon_ran(
        lambda e: L6.disable(e, _DISABLED, "split-KV reduction", "the Triton reduction runs instead"),
        lambda: _gluon_kernel()[out.shape[:2]](
            out, segm_output, segm_max, segm_expsum, segm_max if signs is None else signs,
            out.stride(0), out.stride(1), out.stride(2),
            NUM_Q_HEADS=out.shape[1], NUM_SEGMENTS=num_segments, SEG_PAD=seg_pad, ROTATE=signs is not None,
            PDL=use_pdl, num_warps=max(1, seg_pad // GLUON_ROWS), launch_pdl=use_pdl))
