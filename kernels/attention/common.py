"""Device helpers shared by the paged attention kernels (plain ``@triton.jit`` functions).

Dot operand kinds (constexpr ``DOT``): ``DOT_FP16`` / ``DOT_BF16`` feed the tensor cores with
16-bit operands and fp32 accumulation; ``DOT_FP32`` is the interpreter's choice, because
Triton 3.9's interpreter gets bf16 dots (and bf16 bit casts) wrong.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Triton only lets jitted code read module globals that are ``tl.constexpr``.
DOT_FP16 = tl.constexpr(0)
DOT_BF16 = tl.constexpr(1)
DOT_FP32 = tl.constexpr(2)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+; the launcher sets ``launch_pdl``): wait until the
    previous kernel of the stream has finished and its writes are visible. Called first in a
    program, before any global load or store, so it is safe after any kernel; what it saves is
    the gap between the previous kernel's last program and this kernel's first."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel of the stream be scheduled now rather than when this one's programs
    exit (it still waits in its own :func:`pdl_enter`). Only for small grids: the next kernel's
    programs then hold SM slots while they wait (H200: calling this in
    every decode kernel made INT4 at batch 8, 32k context 6-8% slower)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def find_seq_idx(cu_seqlens_q_ptr, q_block_global_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning q block ``q_block_global_idx``; sequence ``i`` owns the blocks from
    ``cu_seqlens_q[i] // BLOCK_Q + i`` on (a bound that never needs a host sync)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        mid_start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if mid_start <= q_block_global_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def key_range(seq_len, q_pos_lo, q_pos_hi, window_left, window_right, CAUSAL: tl.constexpr):
    """Half-open range ``[k_lo, k_hi)`` of keys any query in ``[q_pos_lo, q_pos_hi]`` may see."""
    k_hi = seq_len
    if CAUSAL:
        k_hi = tl.minimum(k_hi, q_pos_hi + 1)
    if window_right >= 0:
        k_hi = tl.minimum(k_hi, q_pos_hi + window_right + 1)
    k_lo = 0
    if window_left >= 0:
        k_lo = tl.maximum(q_pos_lo - window_left, 0)
    return k_lo, k_hi


@triton.jit
def visible(q_pos, k_pos, k_hi, window_left, window_right, CAUSAL: tl.constexpr):
    """[BLOCK_M, TILE] mask of the (query, key) pairs that attend (q_pos [M], k_pos [TILE])."""
    ok = (k_pos[None, :] < k_hi) & (k_pos[None, :] >= 0)
    if CAUSAL:
        ok &= k_pos[None, :] <= q_pos[:, None]
    ok &= (window_left < 0) | (q_pos[:, None] - k_pos[None, :] <= window_left)
    ok &= (window_right < 0) | (k_pos[None, :] - q_pos[:, None] <= window_right)
    return ok


@triton.jit
def full_tiles(q_pos, row_ok, k_lo, k_hi, t0, t1, window_left, window_right, CAUSAL: tl.constexpr,
               TILE: tl.constexpr):
    """Tiles ``[f0, f1)`` of ``[t0, t1)`` whose every key is visible to every valid row
    (``q_pos``, ``row_ok``: [BLOCK_M]) of a 2D program, so they need no mask; ``f0 <= f1``."""
    q_lo = tl.min(tl.where(row_ok, q_pos, 2147483647), 0)
    q_hi = tl.max(tl.where(row_ok, q_pos, -1), 0)
    lo_key = k_lo
    if window_left >= 0:
        lo_key = tl.maximum(lo_key, q_hi - window_left)
    hi_key = k_hi
    if CAUSAL:
        hi_key = tl.minimum(hi_key, q_lo + 1)
    if window_right >= 0:
        hi_key = tl.minimum(hi_key, q_lo + window_right + 1)
    f0 = tl.minimum(tl.maximum(t0, (lo_key + TILE - 1) // TILE), t1)
    f1 = tl.maximum(tl.minimum(t1, hi_key // TILE), f0)
    return f0, f1


@triton.jit
def mask_scores(s, t, f0, f1, q_pos, k_pos, k_hi, n_ok, window_left, window_right, CAUSAL: tl.constexpr,
                MASK_EDGES: tl.constexpr):
    """2D-path scores ``s`` [BLOCK_M, TILE] of key tile ``t`` with every key a row must not see
    (causal, window, past the length, outside the segment: ``n_ok``) set to -inf. ``MASK_EDGES``:
    tiles inside ``[f0, f1)`` (:func:`full_tiles`) are returned as they are."""
    if MASK_EDGES:  # only tiles outside [f0, f1) hold keys some row must not see
        if (t < f0) | (t >= f1):
            s = tl.where(visible(q_pos, k_pos, k_hi, window_left, window_right, CAUSAL) & n_ok[None, :],
                         s, float("-inf"))
    else:
        s = tl.where(visible(q_pos, k_pos, k_hi, window_left, window_right, CAUSAL) & n_ok[None, :],
                     s, float("-inf"))
    return s


@triton.jit
def apply_softcap(s, softcap):
    """``softcap * tanh(s / softcap)`` via exp (tanh is not in every Triton build's core)."""
    x = s / softcap
    t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # exp overflow -> inf -> t = 1, as tanh
    return softcap * t


@triton.jit
def hadamard_sign(r, c):
    """Entry ``(r, c)`` of the Sylvester Walsh-Hadamard matrix, ``(-1)^popcount(r & c)``, fp32."""
    x = r & c
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1.0 - 2.0 * (x & 1).to(tl.float32)


@triton.jit
def nibble_to_dot(n, DOT: tl.constexpr):
    """Codes 0..15 (any int dtype) -> exact floats for ``tl.dot``, by bit tricks, no I2F:
    ``n | 0x6400`` read as fp16 is ``1024 + n``; ``n | 0x4300`` read as bf16 is ``128 + n``."""
    n16 = n.to(tl.int16)
    if DOT == DOT_BF16:
        x = (n16 | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    elif DOT == DOT_FP32:
        x = ((n16 | 0x6400).to(tl.float16, bitcast=True) - 1024.0).to(tl.float32)
    else:
        x = (n16 | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return x


@triton.jit
def int8_to_dot(c, DOT: tl.constexpr):
    """int8 codes -> exact fp16 (``c + 0x6480`` read as fp16 is ``1152 + c``), fp32 if DOT_FP32."""
    if DOT == DOT_FP32:
        x = ((c.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0).to(tl.float32)
    else:
        x = (c.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
    return x


@triton.jit
def to_dot(x, DOT: tl.constexpr):
    if DOT == DOT_FP16:
        y = x.to(tl.float16)
    elif DOT == DOT_BF16:
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def segment_tiles(k_lo, k_hi, seg_idx, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """Tiles ``[t0, t1)`` of key range ``[k_lo, k_hi)`` handled by segment ``seg_idx``."""
    tile_lo = k_lo // TILE
    tile_hi = (k_hi + TILE - 1) // TILE
    per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    t0 = tile_lo + seg_idx * per_seg
    t1 = tl.minimum(t0 + per_seg, tile_hi)
    return t0, t1


@triton.jit
def decode_tile_softmax(s, n_ok, k_zp, k_sc, q_sum, v_zp, v_sc, m_i, l_i, col_scale, softcap,
                        USE_SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    """One key tile of the swapped-operand decode kernels' online softmax (decode_split, decode_code_units).

    ``s [TILE, GP]`` is the raw code dot ``codes_K . q^T`` (code offset included); per key, zero
    point ``k_zp`` (offset folded in) and scale ``k_sc``; ``q_sum [GP]`` is the sum of the rounded
    query operand. Returns ``(pv, alpha, m_new, l_i, vs_max, zp_term)``: the probability tile times
    ``v_sc / vs_max`` as the value dot's operand ``[TILE, GP]``, the rescale of the old
    accumulator, the new running max and sum ``[GP]``, the tile's largest value scale, and
    ``zp_term [GP]`` = sum over keys of the rounded ``pv`` times ``v_zp`` (to subtract from the dot).
    """
    s = (s - k_zp[:, None] * q_sum[None, :]) * (k_sc * col_scale)[:, None]
    if USE_SOFTCAP:
        s = apply_softcap(s, softcap) * LOG2E
    s = tl.where(n_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 0)
    vs_max = tl.maximum(tl.max(v_sc, 0), 1e-30)  # keeps p * v_scale inside fp16's range
    pv = to_dot(p * (v_sc / vs_max)[:, None], DOT)
    zp_term = tl.sum(pv.to(tl.float32) * v_zp[:, None], 0)
    return pv, alpha, m_new, l_i, vs_max, zp_term


@triton.jit
def decode_program(cu_seqlens_q_ptr, seqused_k_ptr, window_left, window_right,
                   CAUSAL: tl.constexpr, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, PDL: tl.constexpr):
    """Split-KV decode program of grid ``(sequences, KV heads, segments)``, after
    :func:`pdl_enter` (before its first load): ``seq_idx``, ``kv_head``, ``seg_idx``, the
    sequence's query token ``tok`` (one per sequence), whether it has one, its visible keys
    ``[k_lo, k_hi)`` and the segment's tiles ``[t0, t1)``."""
    pdl_enter(PDL)
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg_idx = tl.program_id(2)
    tok = tl.load(cu_seqlens_q_ptr + seq_idx)
    has_query = tl.load(cu_seqlens_q_ptr + seq_idx + 1) != tok
    seq_len = tl.load(seqused_k_ptr + seq_idx)
    k_lo, k_hi = key_range(seq_len, seq_len - 1, seq_len - 1, window_left, window_right, CAUSAL)
    t0, t1 = segment_tiles(k_lo, k_hi, seg_idx, TILE, NUM_SEGMENTS)
    return seq_idx, kv_head, seg_idx, tok, has_query, k_lo, k_hi, t0, t1


@triton.jit
def q_block_program(cu_seqlens_q_ptr, seqused_k_ptr, num_seqs, q_block_base, window_left, window_right,
                    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                    TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, PDL: tl.constexpr):
    """2D-path program of grid ``(q blocks, KV heads, segments)``, after :func:`pdl_enter` (before
    its first load): ``BLOCK_Q`` query tokens of one sequence x the ``GROUP`` query heads of
    ``kv_head``, as ``BLOCK_M`` rows. Returns ``kv_head``, ``seg_idx``, the sequence, whether the
    block holds any query, per row ``[BLOCK_M]`` the token index, query head, validity and
    position, the visible keys ``[k_lo, k_hi)`` of the whole block and segment ``seg_idx``'s tiles
    ``[t0, t1)``. ``q_block_base``: the q block of program 0 (``cu_seqlens_q[0] // BLOCK_Q``, 0
    unless the sequences start after the first rows of q, as the chunk half of a mixed call)."""
    pdl_enter(PDL)
    q_block_global = tl.program_id(0) + q_block_base
    kv_head = tl.program_id(1)
    seg_idx = tl.program_id(2)
    seq_idx = find_seq_idx(cu_seqlens_q_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq_idx)
    has_rows = q_block * BLOCK_Q < q_len
    seq_len = tl.load(seqused_k_ptr + seq_idx)
    ctx_before = seq_len - q_len  # queries are the last q_len tokens of the sequence
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = ctx_before + q_local
    q_pos_lo = ctx_before + q_block * BLOCK_Q
    q_pos_hi = ctx_before + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    k_lo, k_hi = key_range(seq_len, q_pos_lo, q_pos_hi, window_left, window_right, CAUSAL)
    t0, t1 = segment_tiles(k_lo, k_hi, seg_idx, TILE, NUM_SEGMENTS)
    tok = (q_start + q_local).to(tl.int64)
    return kv_head, seg_idx, seq_idx, has_rows, tok, head, row_ok, q_pos, k_lo, k_hi, t0, t1
