"""Shared launcher logic of the paged attention kernels: validation, tiling heuristics, launch.

``unified_attention`` (kernels/attention.py) and ``unified_attention_int4``
(kernels/attention_int4.py) both go through :func:`attend` (validate, pick the path, launch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from layouts import KVQuantMode, LayoutError

from . import _attn_launch_v6 as L6
from ._attn_common import DOT_BF16, DOT_FP16, DOT_FP32
from ._attn_decode_kernel import _attn_decode_kernel
from ._attn_int4_kernel import _attn_int4_kernel
from ._attn_kernel import _attn_kernel
from ._attn_launch_v6 import STAGES as V6_STAGES
from ._attn_launch_v6 import gluon_ran, launch_v6, v6_default, v6_fit, v6_segments
from ._attn_launch_v6 import disable as disable_v6
from ._attn_launch_v7 import STAGES as V7_STAGES
from ._attn_launch_v7 import disable as disable_v7
from ._attn_launch_v7 import launch_v7, v7_default, v7_fit
from ._attn_launch_v4 import launch_v4, v4_default, v4_fit, v4_segments, v4_tiling
from ._attn_launch_v3 import (DECODE_MODES, code_units, decode_query, launch_v3, rotate_q_needs_small_grid,
                              v3_segments, v3_tiling)
from ._attn_launch_edges import launch_reduce
from ._jit import interpreting, next_pow2, num_sms, pdl, prev_pow2
from layouts import rht_signs

_CODE_DTYPES = {
    KVQuantMode.INT8_PER_TOKEN_HEAD: torch.int8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: torch.float8_e4m3fn,
    KVQuantMode.INT4_PER_TOKEN_HEAD: torch.uint8,
}
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttnConfig:
    """Tiling of one launch (``num_segments`` 1 = 2D path, > 1 = split-KV path)."""

    block_m: int        # query rows per program (tokens x heads of one KV group), power of two >= 16
    tile: int           # keys per inner iteration, power of two >= 16
    num_segments: int = 1
    num_warps: int = 4
    num_stages: int = 2
    v2: int = 0         # quantized decode (max_seqlen_q == 1): 1 = _attn_decode_kernel,
                        # 3 = _attn_decode_v3_kernel (16-bit code units; where it cannot read the cache, as 1),
                        # 4 = _attn_decode_v4_kernel (block-aligned tiles; where it cannot read the cache, as 3)
                        # 6 = _attn_decode_v6_kernel (INT4, Gluon: whole blocks, every KV head; where it
                        # cannot read the cache, as 4 with v4's tiling, else as 1, or 0 for other head sizes)
                        # 7 = _attn_decode_v7_kernel (INT8 / FP8, Gluon, v6's design; fallbacks as 6)
    heads_per_program: int = 0  # v2 = 4: KV heads per program (0 = all)
    row_loads: bool = True      # v2 = 4 with several heads per program: token-major loads
    max_registers: int = 0      # v2 = 4 on a GPU: ptxas register cap per thread (0 = none)


# Decode defaults from the H200 sweep in docs/bench/attention.md (quantized tiles: 128 keys
# beat 64 by 15-25% at 32k context; bf16: 64); prefill defaults untuned.
DECODE_TILE = {KVQuantMode.NONE: 64, KVQuantMode.INT8_PER_TOKEN_HEAD: 128,
               KVQuantMode.FP8_PER_TOKEN_HEAD: 128, KVQuantMode.INT4_PER_TOKEN_HEAD: 128}
DECODE_WARPS = 4
DECODE_STAGES = 3
PREFILL_BLOCK_M = 64
PREFILL_TILE = 64
# Quantized decode kernel per mode: 0 = _attn_kernel / _attn_int4_kernel (v1), 1 = _attn_decode_kernel
# (v2), 3 = _attn_decode_v3_kernel (tiling and segments in _attn_launch_v3). Where v3 applies,
# _attn_launch_v4.v4_default picks the v4 kernel instead (head_size 64 / 128 / 256; INT4 above a batch size).
# H200, docs/bench/attention.md (session 3): v3 beats v2 by 1.5x for INT4 at b8@32k (159 vs 235 us) and
# v1 by 1.5-2.4x for INT8/FP8. Register prefetch of the next tile was slower everywhere, in v2 (session 2)
# and in v3 (session 4), and was removed.
DECODE_V2 = {KVQuantMode.INT8_PER_TOKEN_HEAD: 3, KVQuantMode.FP8_PER_TOKEN_HEAD: 3,
             KVQuantMode.INT4_PER_TOKEN_HEAD: 3}
DECODE_V2_ASM = True  # v2 on the GPU: PTX code conversion (the interpreter always uses plain ops)
DECODE_V2_MIN_GP = 8  # v2: the query-head (N) side of the dots is padded to at least this
TARGET_PROGRAMS_PER_SM = 16  # split decode until the grid holds about this many programs per SM
MIN_TILES_PER_SEGMENT = 4    # a segment shorter than this costs more in reduction than it saves
# v2 (INT4, when chosen explicitly) decode: segments for about this many programs per SM (at least 2
# segments, at least one tile each). H200, 32 q / 8 kv heads, d 128 (docs/bench/attention.md, 2026-11-29): b8@32k 4 segments
# 235 us vs 254 at 32; b1@4k 32 segments 15.3 vs 22.3 at 8; b32@32k 2-4 segments 905-908 vs 918 at 8.
V2_PROGRAMS_PER_SM = 2


def _fail(msg: str):
    raise LayoutError(f"unified_attention: {msg}")


def validate(q, k, v, out, cu_seqlens_q, seqused_k, block_table, mode, k_scale_cache, v_scale_cache,
             window_size, softcap, max_seqlen_q):
    """Check every input; return ``(head_size, num_kv_heads, group)``. Raises LayoutError."""
    if mode == KVQuantMode.FP8_PER_TENSOR:
        raise LayoutError("unified_attention: fp8 per-tensor caches (FP8_PER_TENSOR) are not implemented; "
                          "use fp8_per_token_head")
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16):
        _fail(f"q must be [num_tokens, num_q_heads, head_size] bf16/fp16, got {tuple(q.shape)} {q.dtype}")
    num_tokens, num_q_heads, head_size = q.shape
    for name, t in (("k", k), ("v", v), ("out", out), ("cu_seqlens_q", cu_seqlens_q),
                    ("seqused_k", seqused_k), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != q.device:
            _fail(f"{name} is on {t.device}, expected q's device {q.device}")
    if k.dim() != 4 or k.shape != v.shape:
        _fail(f"k, v must both be [num_blocks, block_size, num_kv_heads, data_head_size], "
              f"got {tuple(k.shape)} and {tuple(v.shape)}")
    expected = q.dtype if mode == KVQuantMode.NONE else _CODE_DTYPES[mode]
    if k.dtype != expected or v.dtype != expected:
        _fail(f"{mode.name} cache dtype: expected {expected}, got k {k.dtype}, v {v.dtype}")
    num_kv_heads = k.shape[2]
    data_head = head_size // 2 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else head_size
    if k.shape[3] != data_head:
        _fail(f"cache last dim: expected {data_head} for {mode.name} head_size {head_size}, got {k.shape[3]}")
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD and (head_size < 32 or head_size & (head_size - 1)):
        _fail(f"INT4 attention needs head_size a power of two >= 32, got {head_size}")
    if num_q_heads % num_kv_heads:
        _fail(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out.shape != q.shape or out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail(f"out must be {tuple(q.shape)} bf16/fp16/fp32, got {tuple(out.shape)} {out.dtype}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in _INDEX_DTYPES or cu_seqlens_q.numel() < 2:
        _fail(f"cu_seqlens_q must be [num_seqs + 1] int32/int64, got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    num_seqs = cu_seqlens_q.numel() - 1
    if seqused_k.shape != (num_seqs,) or seqused_k.dtype not in _INDEX_DTYPES:
        _fail(f"seqused_k must be [{num_seqs}] int32/int64, got {tuple(seqused_k.shape)} {seqused_k.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] < num_seqs or block_table.dtype not in _INDEX_DTYPES:
        _fail(f"block_table must be [num_seqs={num_seqs}, max_blocks] int32/int64, "
              f"got {tuple(block_table.shape)} {block_table.dtype}")
    if mode.per_token_head:
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if t is None:
                _fail(f"{mode.name} needs {name} [num_blocks, block_size, num_kv_heads] float32, got None")
            if t.shape != k.shape[:3] or t.dtype != torch.float32 or t.device != q.device:
                _fail(f"{name} must be {tuple(k.shape[:3])} float32 on {q.device}, "
                      f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if len(tuple(window_size)) != 2 or not all(isinstance(w, int) for w in window_size):
        _fail(f"window_size must be (left, right) ints (-1 = unbounded), got {window_size!r}")
    if softcap is not None and softcap < 0:
        _fail(f"softcap must be >= 0 (0 = off), got {softcap}")
    if max_seqlen_q < 0:
        _fail(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    return head_size, num_kv_heads, num_q_heads // num_kv_heads


def pick_config(mode, q, group, num_seqs, max_seqlen_q, max_seqlen_k, segm_output, num_segments,
                seq_threshold_3d) -> AttnConfig:
    """2D tiles for prefill / mixed batches; split-KV for decode when it fills the GPU better."""
    block_m = max(16, next_pow2(group))
    decode = max_seqlen_q == 1
    if decode and seq_threshold_3d is not None and num_seqs > seq_threshold_3d:
        decode = False
    if not decode:
        return AttnConfig(block_m=max(PREFILL_BLOCK_M, block_m), tile=PREFILL_TILE)
    tile = DECODE_TILE[mode]
    pow2 = q.shape[2] & (q.shape[2] - 1) == 0
    v3 = v3_tiling(mode, q.shape[2]) if DECODE_V2.get(mode, 0) == 3 and pow2 else None  # (tile, warps, stages, per SM)
    v4 = v4_tiling(mode, q.shape[2]) if v3 and v4_default(mode, q.shape[2], num_seqs, max_seqlen_k) else None
    v6 = v6_default(mode, q, group, num_seqs, max_seqlen_k) or v7_default(mode, q, group, num_seqs, max_seqlen_k)
    if segm_output is not None:
        segs = segm_output.shape[2]
    elif num_segments is not None:
        segs = num_segments
    elif v6:  # v6 / v7: exactly their segments (about 2 programs per SM, not a power of two)
        segs = v6_segments(num_sms(q.device), num_seqs, max_seqlen_k)
    else:
        pairs = max(1, num_seqs * (q.shape[1] // group))
        if v4:  # programs per sequence: KV heads / heads per program
            groups = max(1, pairs // max(1, v4[4] or q.shape[1] // group))
            want = v4_segments(num_sms(q.device), groups, max_seqlen_k, v4[0], v4[3], q.shape[2])
            cap = max_seqlen_k
        elif v3:
            half = rotate_q_needs_small_grid(mode, q.shape[2])
            want, cap = v3_segments(num_sms(q.device), pairs, max_seqlen_k, v3[0], v3[3], half), max_seqlen_k
        elif DECODE_V2.get(mode, 0) and pow2:  # ~2 resident programs per SM; one tile per segment at least
            want = max(2, V2_PROGRAMS_PER_SM * num_sms(q.device) // pairs)
            cap = max(1, max_seqlen_k // tile)
        else:
            want = TARGET_PROGRAMS_PER_SM * num_sms(q.device) // pairs
            cap = max(1, max_seqlen_k // (tile * MIN_TILES_PER_SEGMENT))
        segs = prev_pow2(max(1, min(want, cap)))
    v2 = DECODE_V2.get(mode, 0) if segs > 1 and pow2 else 0
    if v2 == 3 and v6:  # the Gluon kernels: v6 (INT4), v7 (INT8 / FP8)
        int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
        return AttnConfig(block_m=block_m, tile=16, num_segments=int(segs), num_warps=q.shape[1] // group,
                          num_stages=V6_STAGES if int4 else V7_STAGES, v2=6 if int4 else 7)
    if v2 == 3 and v4:  # also when the caller fixed the segment count
        return AttnConfig(block_m=block_m, tile=v4[0], num_segments=int(segs), num_warps=v4[1],
                          num_stages=v4[2], v2=4, heads_per_program=v4[4])
    if v2 == 3:
        return AttnConfig(block_m=block_m, tile=v3[0], num_segments=int(segs), num_warps=v3[1],
                          num_stages=v3[2], v2=3)
    return AttnConfig(block_m=block_m, tile=tile, num_segments=int(segs),
                      num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, v2=v2)


def _segment_buffers(q, head_pad, segs, segm_output, segm_max, segm_expsum):
    num_tokens, num_q_heads = q.shape[:2]
    if segm_output is None:
        segm_output = torch.empty(num_tokens, num_q_heads, segs, head_pad, dtype=torch.float32, device=q.device)
        segm_max = torch.empty(num_tokens, num_q_heads, segs, dtype=torch.float32, device=q.device)
        segm_expsum = torch.empty_like(segm_max)
        return segm_output, segm_max, segm_expsum
    for name, t, tail in (("softmax_segm_output", segm_output, (num_q_heads, segs, head_pad)),
                          ("softmax_segm_max", segm_max, (num_q_heads, segs)),
                          ("softmax_segm_expsum", segm_expsum, (num_q_heads, segs))):
        if (t is None or t.dtype != torch.float32 or t.device != q.device or not t.is_contiguous()
                or tuple(t.shape[1:]) != tail or t.shape[0] < num_tokens):
            got = None if t is None else (tuple(t.shape), t.dtype, str(t.device))
            _fail(f"{name} must be a contiguous float32 [>= {num_tokens}, {', '.join(map(str, tail))}] "
                  f"tensor on {q.device}, got {got}")
    return segm_output, segm_max, segm_expsum


def _kv_align(k, v) -> int:
    """Largest element count (<= 16 bytes) dividing every K/V block/slot/head stride.

    Packed rows are ``data + 4`` bytes (68 for INT4 d=128, 132 for INT8), a multiple of 4 but
    not of 16, which Triton's argument specialisation cannot see: it would fall back to 1-byte
    loads. Passing ``stride // align`` and multiplying by a constexpr restores word loads.
    """
    elem = k.element_size()
    g = 0
    for t in (k, v):
        for s in t.stride()[:3]:
            g = math.gcd(g, s)
    align = 16 // elem
    while align > 1 and g % align:
        align //= 2
    return align


def attend(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
           window_size, block_table, softcap, mode, k_scale_cache, v_scale_cache, *, seq_threshold_3D=None,
           num_par_softmax_segments=None, segm_output=None, segm_max=None, segm_expsum=None,
           config: "AttnConfig | None" = None):
    """Validate, pick the path (unless ``config`` is given) and launch; the body of both public
    entry points (``kernels.unified_attention``, ``kernels.unified_attention_int4``)."""
    head_size, _, group = validate(q, k, v, out, cu_seqlens_q, seqused_k, block_table, mode,
                                   k_scale_cache, v_scale_cache, window_size, softcap, max_seqlen_q)
    cfg = config or pick_config(mode, q, group, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k,
                                segm_output, num_par_softmax_segments, seq_threshold_3D)
    signs = rht_signs(head_size, q.device) if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else None
    return launch_attention(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
                            window_size, softcap, mode, k_scale_cache, v_scale_cache, cfg, head_size,
                            group, signs=signs, segm_output=segm_output, segm_max=segm_max,
                            segm_expsum=segm_expsum)


def launch_attention(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
                     window_size, softcap, mode, k_scale_cache, v_scale_cache, cfg: AttnConfig,
                     head_size, group, signs=None, segm_output=None, segm_max=None, segm_expsum=None):
    """Launch the attention kernel (and the reduction for the split path) with keyword arguments."""
    if cfg.v2 not in (0, 1, 3, 4, 6, 7):
        raise ValueError(f"AttnConfig.v2: expected 0 (v1), 1 (v2), 3 (v3), 4 (v4), 6 (v6) or 7 (v7), got {cfg.v2}")
    num_tokens, num_q_heads = q.shape[:2]
    if num_tokens == 0:
        return out
    is_int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    head_pad = max(16, next_pow2(head_size))
    if interpreting(q):
        dot = DOT_FP32.value
    elif mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        dot = DOT_FP16.value  # int8 / e4m3 codes convert exactly and cheaply to fp16
    else:
        dot = (DOT_BF16 if q.dtype == torch.bfloat16 else DOT_FP16).value
    split = cfg.num_segments > 1
    use_pdl = pdl(q)
    if split:
        segm_output, segm_max, segm_expsum = _segment_buffers(q, head_pad, cfg.num_segments,
                                                              segm_output, segm_max, segm_expsum)
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    if is_int4:  # the kernel reads the scale words as int32 bits (scale | zero point)
        ks, vs = k_scale_cache.view(torch.int32), v_scale_cache.view(torch.int32)
    elif mode.per_token_head:
        ks, vs = k_scale_cache, v_scale_cache
    else:
        ks = vs = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    align = _kv_align(k, v)
    gluon = split and cfg.v2 == 6 and v6_fit(mode, q, k, v, ks, vs) and _v6_launched(
        q, k, cu_seqlens_q, seqused_k, block_table, softmax_scale, window_size, softcap, mode, cfg, head_size, group,
        signs, segm_output, segm_max, segm_expsum, use_pdl)
    if split and cfg.v2 == 7 and v7_fit(mode, q, k, v, ks, vs):
        _, q_scale, use_softcap, col_scale = decode_query(q, None, softmax_scale, head_size, mode, softcap, False,
                                                          parts=4, use_pdl=False, release=False)
        gluon = gluon_ran(disable_v7, lambda: launch_v7(q, k, mode, cu_seqlens_q, seqused_k, block_table, window_size,
                                                         softcap, cfg, group, segm_output, segm_max, segm_expsum,
                                                         q_scale * col_scale, use_softcap))
    if split and cfg.v2 in (6, 7) and not gluon:  # v6 / v7 cannot read this cache: v4 with its tiling, else v2 / v1
        t = v4_tiling(mode, head_size)
        cfg = (dataclasses.replace(cfg, tile=t[0], num_warps=t[1], num_stages=t[2], v2=4, heads_per_program=t[4])
               if t else _generic_decode(cfg, mode, v2=1 if head_size & (head_size - 1) == 0 else 0))
    units = code_units(k, v, mode) if split and cfg.v2 in (3, 4) else None
    gp, interp = max(DECODE_V2_MIN_GP, next_pow2(group)), dot == DOT_FP32.value
    try:
        if gluon:
            pass  # a Gluon decode ran (v6 or v7); the reduction follows
        elif cfg.v2 == 4 and v4_fit(units, k.shape[2], cfg.heads_per_program):
            launch_v4(q, units, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size, softcap,
                      mode, ks.view(torch.int32), vs.view(torch.int32), cfg, head_size, group, segm_output,
                      segm_max, segm_expsum, interp, gp, signs, use_pdl)
        elif units is not None:
            launch_v3(q, units, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size, softcap,
                      mode, ks.view(torch.int32), vs.view(torch.int32), cfg, head_size, group, segm_output,
                      segm_max, segm_expsum, interp, gp, signs, use_pdl)
        elif split and cfg.v2 and mode != KVQuantMode.NONE:
            if cfg.v2 >= 3:  # v3 cannot read this cache (head_size, alignment): v2 with its own tiling
                cfg = _generic_decode(cfg, mode, v2=1)
            _launch_v2(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size,
                       softcap, mode, ks, vs, cfg, head_size, group, signs, segm_output, segm_max, segm_expsum,
                       align, interp, use_pdl)
        else:
            _launch_v1(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size,
                       softcap, mode, ks, vs, cfg, head_size, group, signs, segm_output, segm_max, segm_expsum,
                       align, dot, head_pad, split, use_pdl)
    except OutOfResources as e:  # a caller's AttnConfig too large for this GPU: say which, before any output
        raise ValueError(f"{cfg} does not fit this GPU ({e}); use fewer keys per tile, KV heads per "
                         "program or stages") from e
    if split:
        launch_reduce(out, segm_output, segm_max, segm_expsum, head_size, cfg.num_segments,
                      signs if is_int4 else None, use_pdl)
    return out


def _generic_decode(cfg: AttnConfig, mode: KVQuantMode, v2: int) -> AttnConfig:
    """``cfg`` with the generic decode kernel ``v2`` (1 or 0) and its default tiling: where the
    chosen kernel (v3, v4, v6) cannot read the cache."""
    return dataclasses.replace(cfg, tile=DECODE_TILE[mode], num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, v2=v2)


def _v6_launched(q, k, cu_seqlens_q, seqused_k, block_table, softmax_scale, window_size, softcap, mode, cfg,
                 head_size, group, signs, segm_output, segm_max, segm_expsum, use_pdl) -> bool:
    """Run the v6 decode (the query rotation, then the kernel) on a cache :func:`v6_fit` accepts;
    False (and v6 switched off) where the kernel does not compile here (:func:`_attn_launch_v6.gluon_ran`).
    ``use_pdl``: both launched with programmatic dependent launch; the rotation waits for the
    previous kernel before anything, v6 before it reads the rotated query (its first block copies
    start earlier: the cache's writer finished before the rotation did). With ``L6.PDL_EARLY``
    the rotation releases v6 right after its own wait (v6's programs may start while it runs;
    its grid is a handful of programs, all resident at once)."""
    early = use_pdl and L6.PDL and L6.PDL_EARLY
    qp, _, use_softcap, col_scale = decode_query(q, signs, softmax_scale, head_size, mode, softcap, False,
                                                 parts=4, use_pdl=use_pdl, release=early)
    return gluon_ran(disable_v6, lambda: launch_v6(q, k, cu_seqlens_q, seqused_k, block_table, window_size, softcap,
                                                    cfg, group, segm_output, segm_max, segm_expsum, qp, col_scale,
                                                    use_softcap, use_pdl and L6.PDL))


def _launch_v2(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size,
               softcap, mode, ks, vs, cfg, head_size, group, signs, segm_output, segm_max, segm_expsum,
               align, interp, use_pdl):
    """Quantized decode (one query per sequence): _attn_decode_kernel, INT4 after _prep_q_kernel."""
    num_q_heads = q.shape[1]
    is_int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    grid = (cu_seqlens_q.numel() - 1, k.shape[2], cfg.num_segments)
    qp, q_scale, use_softcap, col_scale = decode_query(q, signs, softmax_scale, head_size, mode, softcap,
                                                       interp, parts=2, use_pdl=use_pdl, release=False)
    code_dim = head_size // 2 if is_int4 else head_size
    mode_id, off = DECODE_MODES[mode]
    _attn_decode_kernel[grid](
        q_ptr=qp, k_ptr=k, v_ptr=v, k_scale_ptr=ks, v_scale_ptr=vs, segm_out_ptr=segm_output,
        segm_max_ptr=segm_max, segm_sum_ptr=segm_expsum, block_table_ptr=block_table,
        cu_seqlens_q_ptr=cu_seqlens_q.contiguous(), seqused_k_ptr=seqused_k.contiguous(),
        q_scale=q_scale, col_scale=col_scale, softcap=float(softcap or 0.0),
        window_left=int(window_size[0]), window_right=int(window_size[1]),
        stride_q_t=qp.stride(0), stride_q_h=qp.stride(1), stride_q_d=qp.stride(2),
        stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align, stride_k_h=k.stride(2) // align,
        stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align, stride_v_h=v.stride(2) // align,
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_bt_s=block_table.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GP=max(DECODE_V2_MIN_GP, next_pow2(group)),
        HEAD=head_size, D=code_dim, OFF=off, BLOCK_SIZE=k.shape[1], TILE=cfg.tile, MODE=mode_id,
        DOT=DOT_FP32.value if interp else DOT_FP16.value, ASM=not interp and DECODE_V2_ASM,
        CAUSAL=bool(causal), USE_SOFTCAP=use_softcap, NUM_SEGMENTS=cfg.num_segments, KV_ALIGN=align,
        PDL=use_pdl, launch_pdl=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_v1(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size,
               softcap, mode, ks, vs, cfg, head_size, group, signs, segm_output, segm_max, segm_expsum,
               align, dot, head_pad, split, use_pdl):
    num_tokens, num_q_heads = q.shape[:2]
    num_seqs = cu_seqlens_q.numel() - 1
    block_q = cfg.block_m // group
    is_int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    grid = (num_tokens // block_q + num_seqs, k.shape[2], cfg.num_segments)
    target = segm_output if split else out
    common = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, k_scale_ptr=ks, v_scale_ptr=vs, out_ptr=target,
        segm_max_ptr=segm_max if split else out, segm_sum_ptr=segm_expsum if split else out,
        block_table_ptr=block_table, cu_seqlens_q_ptr=cu_seqlens_q.contiguous(),
        seqused_k_ptr=seqused_k.contiguous(),
        softmax_scale=float(softmax_scale), softcap=float(softcap or 0.0),
        window_left=int(window_size[0]), window_right=int(window_size[1]), num_seqs=num_seqs,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align,
        stride_k_h=k.stride(2) // align, stride_k_d=k.stride(3),
        stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align,
        stride_v_h=v.stride(2) // align, stride_v_d=v.stride(3),
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_bt_s=block_table.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD=head_size, BLOCK_SIZE=k.shape[1],
        BLOCK_Q=block_q, BLOCK_M=cfg.block_m, TILE=cfg.tile, DOT=dot,
        CAUSAL=bool(causal), USE_SOFTCAP=bool(softcap and softcap > 0),
        SPLIT=split, NUM_SEGMENTS=cfg.num_segments, KV_ALIGN=align, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if is_int4:
        _attn_int4_kernel[grid](signs_ptr=signs, **common)
    else:
        _attn_kernel[grid](HEAD_PAD=head_pad, SCALED=mode.per_token_head,
                           IS_INT8=mode == KVQuantMode.INT8_PER_TOKEN_HEAD, **common)
