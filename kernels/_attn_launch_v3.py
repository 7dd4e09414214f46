"""Launch of the v3 quantized decode kernel (``_attn_decode_v3``) and its defaults.

Tiling and segment counts come from the H200 sweeps in docs/bench/attention.md (32 query / 8 KV
heads, batch 8 at 32k context; head_size 128 in sessions 3-4, 64 and 256 in session 4): per
mode and head size, keys per tile, warps, stages and the resident programs per SM that the
segment count aims at; segments of at most 2,048 keys.
"""

from __future__ import annotations

import math

import torch

from layouts import KVQuantMode

from ._attn_common import DOT_FP16, DOT_FP32
from ._attn_decode_kernel import _prep_q_kernel
from ._attn_decode_v3 import _attn_decode_v3_kernel
from ._attn_launch_edges import prep_q_gluon
from ._attn_units import MODE_FP8, MODE_INT4, MODE_INT8
from ._jit import cdiv, num_sms, prev_pow2

_INT8_TILING = {128: (32, 1, 2, 8), 256: (32, 2, 2, 16)}
# INT4 at head_size 128 aims at 4 programs per SM (512 programs with 8 KV heads on 132 SMs), not
# the 8 its registers would allow: each program rotates its query in the prologue, so a wave of
# one-tile segments costs more than half as many two-tile ones. H200, session 14
# (tools/exp_session14/probe_small_int4.py): b2 @ 4k 15.6 µs with 32 segments against 18.7 with
# 64, b2 @ 8k 21.3 vs 23.6, b4 @ 2k 15.0 vs 16.5; within 0.6 µs elsewhere (b1 @ 16k 22.6 vs 22.1)
V3_TILING = {  # mode -> head_size -> (keys per tile, warps, stages, programs per SM aimed at)
    KVQuantMode.INT4_PER_TOKEN_HEAD: {64: (32, 1, 2, 16), 128: (64, 2, 2, 4), 256: (64, 4, 2, 4)},
    KVQuantMode.INT8_PER_TOKEN_HEAD: _INT8_TILING,
    KVQuantMode.FP8_PER_TOKEN_HEAD: _INT8_TILING,
}
V3_MAX_KEYS_PER_SEGMENT = 2048
# INT4 up to ROTATE_Q_MAX_HEAD: the v3 decode kernel rotates the query in its prologue (one launch
# fewer) instead of reading _prep_q_kernel's output. At head_size 256 the prologue raises the
# kernel from 128 to 151 registers (sm_90 ptxas), 3 resident programs per SM instead of 4, so
# there it rotates in the prologue only when the grid fills at most half the resident slots
# (small batches, where the launch saved matters and the lost slot does not; v3_segments aims
# there). False restores the rotation kernel everywhere (bench_attention --q-rotation kernel).
ROTATE_Q_IN_DECODE = True
ROTATE_Q_MAX_HEAD = 128
# kernel MODE and code offset OFF of the swapped-operand decode kernels (v2 and v3)
DECODE_MODES = {KVQuantMode.INT8_PER_TOKEN_HEAD: (MODE_INT8.value, 1152.0),
                KVQuantMode.FP8_PER_TOKEN_HEAD: (MODE_FP8.value, 0.0),
                KVQuantMode.INT4_PER_TOKEN_HEAD: (MODE_INT4.value, -8.0)}


def v3_tiling(mode: KVQuantMode, head_size: int) -> tuple:
    """``(tile, warps, stages, programs_per_sm)`` of V3_TILING for ``head_size``, or of the nearest
    measured head size (the smaller one on a tie)."""
    table = V3_TILING[mode]
    return table[min(table, key=lambda h: (abs(math.log2(h) - math.log2(head_size)), h))]


def rotate_q_needs_small_grid(mode: KVQuantMode, head_size: int) -> bool:
    """INT4 above ROTATE_Q_MAX_HEAD: v3 rotates the query in its prologue only on grids that fill
    at most half the resident slots (``launch_v3``), so ``v3_segments`` aims there (``half``)."""
    return mode == KVQuantMode.INT4_PER_TOKEN_HEAD and head_size > ROTATE_Q_MAX_HEAD


def v3_segments(num_sms: int, pairs: int, max_seqlen_k: int, tile: int, programs_per_sm: int,
                half: bool = False) -> int:
    """Segments per (sequence, KV head): about ``programs_per_sm`` programs per SM (``half``: half
    that, so that the INT4 query rotation runs in the prologue above ROTATE_Q_MAX_HEAD), segments
    of at most V3_MAX_KEYS_PER_SEGMENT keys, at least 2 and at most one per tile, a power of two.

    ``half`` at head_size 256 on the H200 (bench/attention.md, session 8): b1 @ 4k 25.7 -> 20.1 µs
    (32 segments instead of 64), b2 @ 4k 31.0 -> 26.7 and b2 @ 2k 26.0 -> 20.4 (16 instead of 32)."""
    target = programs_per_sm * num_sms // (2 if half else 1)
    want = max(target // max(1, pairs), cdiv(max_seqlen_k, V3_MAX_KEYS_PER_SEGMENT))
    segs = max(2, min(want, max(1, max_seqlen_k // tile)))
    return prev_pow2(segs)


def code_units(k: torch.Tensor, v: torch.Tensor, mode: KVQuantMode):
    """``(k, v)`` as int16 code units and the unit alignment (2, 4 or 8) of their block and slot
    strides, or None when v3 cannot read them (units < 16, rows not 4-byte aligned)."""
    if mode not in DECODE_MODES:
        return None
    if k.shape[3] * k.element_size() // 2 < 16 or k.stride(3) != 1 or v.stride(3) != 1:
        return None
    byte_strides = [s * t.element_size() for t in (k, v) for s in t.stride()[:3]]
    offsets = [t.storage_offset() * t.element_size() for t in (k, v)]
    if any(s % 4 for s in byte_strides + offsets):
        return None
    g = 0
    for s in byte_strides[:2] + byte_strides[3:5]:
        g = math.gcd(g, s // 2)
    return k.view(torch.int16), v.view(torch.int16), min(8, g & -g) if g else 8


def decode_query(q, signs, softmax_scale, head_size, mode, softcap, interp, parts, use_pdl, release,
                 prepare=True):
    """What the swapped-operand decode kernels (v2, v3, v4) read as the query, and the scales around it.

    Returns ``(q, q_scale, use_softcap, col_scale)``: INT4 runs ``_prep_q_kernel`` once per token
    and head (``[T, Hq, HEAD]`` fp32, ``softmax_scale * H(s * q)`` in ``parts`` parts of rotated
    dims ``parts * i + x``), so ``q_scale`` is 1; otherwise ``q`` itself and ``softmax_scale``.
    ``col_scale`` multiplies each key's scale (INT4: ``1 / head_size``; ``log2 e`` without softcap).
    ``use_pdl``: launch with programmatic dependent launch (the launcher's ``_jit.pdl(q)``).
    ``prepare=False`` (INT4, v3 with ``ROTATE_Q``): no rotation kernel; ``q`` and ``softmax_scale``
    are returned as they are and the decode kernel rotates.
    ``release``: the rotation kernel lets the decode kernel be scheduled at its start
    (``pdl_release``); the launcher asks for it when the decode grid fills at most half the GPU
    (H200: 0.3-0.8 µs less at batch 1 and 2k-4k context, 6% more at batch 8 and 32k, where the
    decode grid fills the GPU)."""
    is_int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    use_softcap = bool(softcap and softcap > 0)
    col_scale = (1.0 / head_size if is_int4 else 1.0) * (1.0 if use_softcap else math.log2(math.e))
    if not is_int4 or not prepare:
        return q, float(softmax_scale), use_softcap, col_scale
    qp = torch.empty(q.shape[0], q.shape[1], head_size, dtype=torch.float32, device=q.device)
    if not interp and prep_q_gluon(q, signs, qp, softmax_scale, parts, use_pdl, release):
        return qp, 1.0, use_softcap, col_scale
    _prep_q_kernel[(q.shape[0], cdiv(q.shape[1], 16))](
        q_ptr=q, signs_ptr=signs, q_out_ptr=qp, softmax_scale=float(softmax_scale),
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        NUM_Q_HEADS=q.shape[1], HEAD=head_size, BLOCK_H=16,
        DOT=DOT_FP32.value if interp else DOT_FP16.value, PARTS=parts, PDL=use_pdl,
        RELEASE=use_pdl and release, launch_pdl=use_pdl,
        num_warps=4)
    return qp, 1.0, use_softcap, col_scale


def decode_args(q, units, ks, vs, segm_output, segm_max, segm_expsum, block_table, cu_seqlens_q, seqused_k,
                q_scale, col_scale, softcap, window_size) -> dict:
    """The keyword arguments the v3 and v4 decode kernels share: tensors, scalars and strides
    (block / slot code strides divided by the units' alignment, ``ALIGN_BS``)."""
    k16, v16, align = units
    return dict(
        q_ptr=q, k_ptr=k16, v_ptr=v16, k_scale_ptr=ks, v_scale_ptr=vs,
        segm_out_ptr=segm_output, segm_max_ptr=segm_max, segm_sum_ptr=segm_expsum,
        block_table_ptr=block_table, cu_seqlens_q_ptr=cu_seqlens_q.contiguous(),
        seqused_k_ptr=seqused_k.contiguous(),
        softmax_scale=q_scale, col_scale=col_scale, softcap=float(softcap or 0.0),
        window_left=int(window_size[0]), window_right=int(window_size[1]),
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_b=k16.stride(0) // align, stride_k_s=k16.stride(1) // align,
        stride_v_b=v16.stride(0) // align, stride_v_s=v16.stride(1) // align,
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_bt_s=block_table.stride(0))


def launch_v3(q, units, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size, softcap,
              mode, ks, vs, cfg, head_size, group, segm_output, segm_max, segm_expsum, interp, gp, signs, use_pdl):
    """Launch ``_attn_decode_v3_kernel`` (grid: sequences x KV heads x segments) on ``units``, the
    :func:`code_units` of the cache; ``ks`` / ``vs`` are the scale caches as int32 bits."""
    kernel_mode, off = DECODE_MODES[mode]
    k16, v16, align = units
    grid = (cu_seqlens_q.numel() - 1, k16.shape[2], cfg.num_segments)
    fill = v3_tiling(mode, head_size)[3] * num_sms(q.device)  # programs resident at once, about
    small = 2 * math.prod(grid) <= fill
    rotate_q = (mode == KVQuantMode.INT4_PER_TOKEN_HEAD and ROTATE_Q_IN_DECODE
                and (small or not rotate_q_needs_small_grid(mode, head_size)))
    q, q_scale, use_softcap, col_scale = decode_query(q, signs, softmax_scale, head_size, mode, softcap,
                                                      interp, parts=4, use_pdl=use_pdl,
                                                      release=small, prepare=not rotate_q)
    _attn_decode_v3_kernel[grid](
        **decode_args(q, units, ks, vs, segm_output, segm_max, segm_expsum, block_table, cu_seqlens_q, seqused_k,
                      q_scale, col_scale, softcap, window_size),
        signs_ptr=signs if rotate_q else q, stride_k_h=k16.stride(2), stride_v_h=v16.stride(2),
        NUM_Q_HEADS=q.shape[1], GROUP=group, GP=gp, HEAD=head_size, BLOCK_SIZE=k16.shape[1],
        TILE=cfg.tile, MODE=kernel_mode, OFF=off, DOT=DOT_FP32.value if interp else DOT_FP16.value,
        ASM=not interp, CAUSAL=bool(causal), USE_SOFTCAP=use_softcap, NUM_SEGMENTS=cfg.num_segments,
        ALIGN_BS=align, PDL=use_pdl, ROTATE_Q=rotate_q, launch_pdl=use_pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
