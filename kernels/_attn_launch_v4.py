"""Launch of the v4 decode kernel (``_attn_decode_v4``), its tiling and when it is the default.

Tiling from the H200 sweeps in docs/bench/attention.md (sessions 6 and 7; 32 query / 8 KV heads,
block 16; ``bench/bench_decode_v4.py``): one KV head per program and one warp at every head size;
INT8 / FP8 with 16-key tiles (one block: one block id per tile), INT4 with 64 keys at head_size 64,
32 at 128 and 16 at 256. Several heads per program (whole token rows, token-major loads included)
were slower. FP8 at head_size 128 pipelines 3 stages (session 10), the others 2. Segments aim
at 8 resident programs per SM (16 for INT8 / FP8 at head_size 64, whose programs hold half the
registers; ``v4_segments``). INT4 rotates its query in a separate kernel
here (v3 does it in its prologue), which costs about 2 µs: INT4 keeps v3 for small decode
batches (``V4_INT4_MIN_KEYS``).
"""

from __future__ import annotations

from layouts import KVQuantMode

from ._attn_common import DOT_FP16, DOT_FP32
from ._attn_decode_v4 import _attn_decode_v4_kernel
from ._attn_launch_edges import REDUCE_ONE_LOAD
from ._attn_launch_v3 import DECODE_MODES, decode_args, decode_query
from ._jit import next_pow2, prev_pow2

# mode -> head_size -> (keys per tile, warps, stages, programs per SM, KV heads per program)
_INT8_V4 = {64: (16, 1, 2, 16, 1), 128: (16, 1, 2, 8, 1), 256: (16, 1, 2, 8, 1)}
# FP8 at head_size 128 with 3 stages (session 10, H200, interleaved with 2 over four cache placements):
# 1.3-2.1% faster at b8@32k, 3.9-4.9% at b32@32k, within 1% elsewhere; INT8 and the other head sizes
# gained nothing
_FP8_V4 = {**_INT8_V4, 128: (16, 1, 3, 8, 1)}
V4_TILING = {KVQuantMode.INT8_PER_TOKEN_HEAD: _INT8_V4, KVQuantMode.FP8_PER_TOKEN_HEAD: _FP8_V4,
             KVQuantMode.INT4_PER_TOKEN_HEAD: {64: (64, 1, 2, 8, 1), 128: (32, 1, 2, 8, 1), 256: (16, 1, 2, 8, 1)}}
# INT4 takes the v4 kernel from this many keys in the batch (sequences x context) on; below it
# v3's fused query rotation wins or ties (H200, head_size 128: b1 @ 4k v3 13.7 us, v4 16.1;
# 256: b2 @ 4k 30.9 vs 31.4; 64: v4 faster at b2 @ 4k, 11.7 vs 12.9, smaller batches not timed)
V4_INT4_MIN_KEYS = {64: 8192, 128: 32768, 256: 32768}


def v4_segments(num_sms: int, pairs: int, max_seqlen_k: int, tile: int, programs_per_sm: int,
                head_size: int = 128) -> int:
    """Segments per (sequence, head group) for the v4 kernel: about ``programs_per_sm`` programs
    per SM (``pairs`` = sequences x head groups), at least 2, at most one per tile, a power of two
    (as measured; unlike v3 no cap on the keys per segment). Past the reduction's one load
    (``REDUCE_ONE_LOAD`` values: 64 segments at head_size 256) segments must hold 8 tiles or more:
    on the H200 at head_size 256, b1 @ 4k took 25.2 µs with 128 segments of 2 tiles and 17.7 with
    64, while b1 @ 32k took 65.4 with 128 segments of 16 tiles and 80.8 with 64."""
    segs = max(2, min(programs_per_sm * num_sms // max(1, pairs), max(1, max_seqlen_k // tile)))
    one_load = REDUCE_ONE_LOAD // max(16, next_pow2(head_size))  # the reduction's head_pad
    segs = min(segs, max(one_load, max_seqlen_k // (8 * tile), 2))
    return prev_pow2(segs)


def v4_tiling(mode: KVQuantMode, head_size: int):
    """The measured v4 tiling of ``mode`` at ``head_size`` (see ``V4_TILING``), or None."""
    return V4_TILING.get(mode, {}).get(head_size)


def v4_default(mode: KVQuantMode, head_size: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """Whether a decode batch takes the v4 kernel by default (else v3)."""
    if v4_tiling(mode, head_size) is None:
        return False
    return mode != KVQuantMode.INT4_PER_TOKEN_HEAD or num_seqs * max_seqlen_k >= V4_INT4_MIN_KEYS[head_size]


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
        ALIGN_BS=align, HEAD_UNITS=k16.stride(2), ROWS=bool(cfg.row_loads and hg > 1), PDL=use_pdl,
        launch_pdl=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers and not interp else {}),
    )
