"""Launch of the v4 decode kernel (``_attn_decode_v4``), its tiling and when it is the default.

Tiling from the H200 sweeps in docs/bench/attention.md (session 6; 32 query / 8 KV heads,
head_size 128, block 16; ``tools/bench_decode_v4.py``): one KV head per program and one warp;
INT8 / FP8 with 16-key tiles (one block: one block id per tile), INT4 with 32. Several heads per
program (whole token rows) were slower, except INT4 with all 8 heads and 4 warps at batch 8-32
and 32k context, which 32-key one-head programs beat. Segments aim at 8 resident programs per
SM (``v4_segments``). Only head_size 128 was measured, so only it takes this kernel by default.
INT4 rotates its query in a separate kernel here (v3 does it in its prologue), which costs about
2 µs: INT4 keeps v3 for small decode batches.
"""

from __future__ import annotations

from layouts import KVQuantMode

from ._attn_common import DOT_FP16, DOT_FP32
from ._attn_decode_v4 import _attn_decode_v4_kernel
from ._attn_launch_v3 import DECODE_MODES, decode_args, decode_query

# mode -> (keys per tile, warps, stages, programs per SM, KV heads per program)
V4_TILING = {KVQuantMode.INT8_PER_TOKEN_HEAD: (16, 1, 2, 8, 1), KVQuantMode.FP8_PER_TOKEN_HEAD: (16, 1, 2, 8, 1),
             KVQuantMode.INT4_PER_TOKEN_HEAD: (32, 1, 2, 8, 1)}
V4_HEAD_SIZES = (128,)  # measured on the H200; other head sizes keep v3
# INT4 takes the v4 kernel from this many keys in the batch (sequences x context) on; below it
# v3's fused query rotation wins (H200, b1 @ 4k: v3 13.7 us, v4 16.1; b1 @ 32k: 32.9 vs 31.1)
V4_INT4_MIN_KEYS = 32768


def v4_segments(num_sms: int, pairs: int, max_seqlen_k: int, tile: int, programs_per_sm: int) -> int:
    """Segments per (sequence, head group) for the v4 kernel: about ``programs_per_sm`` programs
    per SM (``pairs`` = sequences x head groups), at least 2, at most one per tile, a power of two (as
    measured; unlike v3 no cap on the keys per segment)."""
    segs = max(2, min(programs_per_sm * num_sms // max(1, pairs), max(1, max_seqlen_k // tile)))
    return 1 << (segs.bit_length() - 1)


def v4_default(mode: KVQuantMode, head_size: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """Whether a decode batch takes the v4 kernel by default (else v3)."""
    if mode not in V4_TILING or head_size not in V4_HEAD_SIZES:
        return False
    return mode != KVQuantMode.INT4_PER_TOKEN_HEAD or num_seqs * max_seqlen_k >= V4_INT4_MIN_KEYS


def heads_per_program(num_kv_heads: int, wanted: int) -> int:
    """KV heads per program: ``wanted`` (0 = all of them)."""
    return wanted or num_kv_heads


def v4_fit(units, num_kv_heads: int, wanted: int = 0) -> bool:
    """Whether the v4 kernel can read the cache: the :func:`code_units` of K and V share one head
    stride, and the heads per program (the batch dimension of its dots) are a power of two that
    divides the KV heads."""
    if units is None:
        return False
    k16, v16, _ = units
    hg = heads_per_program(num_kv_heads, wanted)
    return k16.stride(2) == v16.stride(2) and hg & (hg - 1) == 0 and num_kv_heads % hg == 0


def launch_v4(q, units, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size, softcap,
              mode, ks, vs, cfg, head_size, group, segm_output, segm_max, segm_expsum, interp, gp, signs, use_pdl):
    """Launch ``_attn_decode_v4_kernel`` (grid: sequences x head groups x segments) on ``units``, the
    :func:`code_units` of the cache (:func:`v4_fit` true); ``ks`` / ``vs`` are the scale caches
    as int32 bits. INT4 queries are rotated first by ``_prep_q_kernel``."""
    kernel_mode, off = DECODE_MODES[mode]
    k16, v16, align = units
    hg = heads_per_program(k16.shape[2], cfg.heads_per_program)
    grid = (cu_seqlens_q.numel() - 1, k16.shape[2] // hg, cfg.num_segments)
    q, q_scale, use_softcap, col_scale = decode_query(q, signs, softmax_scale, head_size, mode, softcap, interp,
                                                      parts=4, use_pdl=use_pdl, release=False)
    _attn_decode_v4_kernel[grid](
        **decode_args(q, units, ks, vs, segm_output, segm_max, segm_expsum, block_table, cu_seqlens_q, seqused_k,
                      q_scale, col_scale, softcap, window_size),
        NUM_Q_HEADS=q.shape[1], HG=hg, GROUP=group, GP=gp, HEAD=head_size, BLOCK_SIZE=k16.shape[1],
        TILE=cfg.tile, MODE=kernel_mode, OFF=off, DOT=DOT_FP32.value if interp else DOT_FP16.value,
        ASM=not interp, CAUSAL=bool(causal), USE_SOFTCAP=use_softcap, NUM_SEGMENTS=cfg.num_segments,
        ALIGN_BS=align, HEAD_UNITS=k16.stride(2), PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
