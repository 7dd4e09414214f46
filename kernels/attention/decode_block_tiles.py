"""Split-KV decode on tiles of whole cache blocks, one warp per KV head; its tiling and launcher.

The plan's INT8 / FP8 decode, and INT4's from 8k-32k keys in the batch (``plan.py``). Same maths
as ``decode_code_units`` (16-bit code units, "swap AB" dots with the codes as the
A operand, per-token scale and zero point on the score / probability tiles, the code offset
``OFF`` folded into the zero point); what differs is how a tile is addressed and how many KV
heads a program holds:

- **Block-aligned tiles.** With ``TILE == BLOCK_SIZE`` a tile is one cache block: one block id
  per tile (``decode_code_units`` loads one per key and computes every row address from it), and the slot / head
  offsets of the tile's rows are loop invariants computed once, so a tile's addresses are one
  scalar times a stride plus those offsets (``TILE`` a multiple of the block: one id per key,
  the same invariant offsets; smaller tiles: per-key addressing).
- **No alignment classes.** Rows are read as 4-byte aligned code units (``HEAD_UNITS``, the
  head stride in units, is a constexpr multiple of 2); ``decode_code_units`` branches per program into a 16-, 8-
  or 4-byte loop.
- **HG KV heads per program** (grid ``(sequences, num_kv_heads / HG, segments)``): tensors are
  ``[HG, TILE, ...]`` and the dots are batched over the heads. ``HG = num_kv_heads`` reads
  whole token rows (contiguous ``num_kv_heads * (data + 4)`` bytes); with ``ROWS`` the tiles
  are loaded token-major (``[TILE, HG, U]``, a warp's lanes on a token's adjacent heads) and
  permuted. On the H200 one head per program (``HG = 1``) and one warp was fastest for every
  mode, token-major loads or not, and that is the default tiling (``TILING``).

The INT4 query arrives rotated, in four parts of ``U`` dims (``_rotate_query_kernel``). Code loads are
not masked (FP8 values excepted), as in ``decode_code_units``: a key past the sequence reads its tile's block (or
block 0, per-key ids) and gets a ``-inf`` score. Writes the split buffers of ``_attn_reduce_kernel``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from layouts import KVQuantMode

from .._jit import dual_jit, interpreting, next_pow2, prev_pow2
from .common import DOT_FP16, DOT_FP32, LOG2E, apply_softcap, decode_program, to_dot
from .reduce import REDUCE_ONE_LOAD
from .rotate_query import query_scales, rotated_query
from .units import DECODE_MODES, MODE_FP8, MODE_INT4, decode_args, planned_units, units_to_dot

# Tiling from H200 sweeps (32 query / 8 KV heads, block 16): one KV head per program and one
# warp at every head size; INT8 / FP8 with 16-key tiles (one block: one block id per tile), INT4
# with 64 keys at head_size 64, 32 at 128 and 16 at 256. Several heads per program (whole token
# rows, token-major loads included) were slower. FP8 at head_size 128 pipelines 3 stages (1.3-2.1%
# faster at b8@32k, 3.9-4.9% at b32@32k; INT8 and the other head sizes gained nothing), the
# others 2. Segments aim at 8 resident programs per SM (16 for INT8 / FP8 at head_size 64, whose
# programs hold half the registers).
_INT8 = {64: (16, 1, 2, 16, 1), 128: (16, 1, 2, 8, 1), 256: (16, 1, 2, 8, 1)}
TILING = {  # mode -> head_size -> (keys per tile, warps, stages, programs per SM, KV heads per program)
    KVQuantMode.INT8_PER_TOKEN_HEAD: _INT8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: {**_INT8, 128: (16, 1, 3, 8, 1)},
    KVQuantMode.INT4_PER_TOKEN_HEAD: {64: (64, 1, 2, 8, 1), 128: (32, 1, 2, 8, 1), 256: (16, 1, 2, 8, 1)},
}
# INT4 rotates its query in a separate kernel here (about 2 µs; the code-unit kernel does it in
# its prologue), so INT4 takes this kernel from this many keys in the batch (sequences x
# context) on; below it the code-unit kernel wins or ties (H200, head_size 128: b1 @ 4k 13.7 us
# against 16.1; 256: b2 @ 4k 30.9 vs 31.4; 64: this kernel faster at b2 @ 4k, 11.7 vs 12.9)
INT4_MIN_KEYS = {64: 8192, 128: 32768, 256: 32768}


@triton.jit
def _block_query(q_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h, stride_q_d,
              U: tl.constexpr, NOUT: tl.constexpr, MODE: tl.constexpr, DOT: tl.constexpr):
    """Query parts ``[HG, U, GP]`` (part x: dim ``NOUT * u + x``; INT4: ``_rotate_query_kernel``'s
    rotated parts at ``x * U + u``) times ``softmax_scale``; ``head`` is ``[HG, GP]``."""
    offs_u = tl.arange(0, U)
    q_row = q_ptr + tok.to(tl.int64) * stride_q_t + head[:, None, :] * stride_q_h   # [HG, 1, GP]
    m = g_ok[:, None, :]
    if MODE == MODE_INT4:
        q_u = q_row + offs_u[None, :, None]
        q0 = tl.load(q_u, mask=m, other=0.0) * softmax_scale
        q1 = tl.load(q_u + U, mask=m, other=0.0) * softmax_scale
        q2 = tl.load(q_u + 2 * U, mask=m, other=0.0) * softmax_scale
        q3 = tl.load(q_u + 3 * U, mask=m, other=0.0) * softmax_scale
    else:
        q_u = q_row + (NOUT * offs_u[None, :, None]) * stride_q_d
        q0 = tl.load(q_u, mask=m, other=0.0).to(tl.float32) * softmax_scale
        q1 = tl.load(q_u + stride_q_d, mask=m, other=0.0).to(tl.float32) * softmax_scale
        q2, q3 = q0, q1
    return to_dot(q0, DOT), to_dot(q1, DOT), to_dot(q2, DOT), to_dot(q3, DOT)


@triton.jit
def _block_softmax(s, n_ok, kw, vw, q_sum, m_i, l_i, col_scale, softcap, MODE: tl.constexpr,
                OFF: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    """``decode_tile_softmax`` over ``[HG, TILE, GP]``: scale words ``kw``, ``vw`` ``[HG, TILE]``
    (INT4: scale | zero point bits), ``q_sum``, ``m_i``, ``l_i`` ``[HG, GP]``. Returns the value
    dot's operand ``pv [HG, TILE, GP]``, ``alpha``, the new max and sum ``[HG, GP]``, the largest
    value scale ``[HG]`` and the zero-point term ``[HG, GP]``."""
    if MODE == MODE_INT4:
        k_zp = (kw & 0xF).to(tl.float32) + OFF
        k_sc = (kw & -16).to(tl.float32, bitcast=True)
        v_zp = (vw & 0xF).to(tl.float32) + OFF
        v_sc = (vw & -16).to(tl.float32, bitcast=True)
    else:
        k_zp = tl.zeros(kw.shape, tl.float32) + OFF
        k_sc = kw.to(tl.float32, bitcast=True)
        v_zp = tl.zeros(vw.shape, tl.float32) + OFF
        v_sc = vw.to(tl.float32, bitcast=True)
    s = (s - k_zp[:, :, None] * q_sum[:, None, :]) * (k_sc * col_scale)[:, :, None]
    if USE_SOFTCAP:
        s = apply_softcap(s, softcap) * LOG2E
    s = tl.where(n_ok[None, :, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None, :])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    vs_max = tl.maximum(tl.max(v_sc, 1), 1e-30)  # keeps p * v_scale inside fp16's range
    pv = to_dot(p * (v_sc / vs_max[:, None])[:, :, None], DOT)
    zp_term = tl.sum(pv.to(tl.float32) * v_zp[:, :, None], 1)
    return pv, alpha, m_new, l_i, vs_max, zp_term


@triton.jit
def _block_tile_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, k_base, k_off, v_base, v_off, ks_base, ks_off, vs_base, vs_off,
                   n_ok, MODE: tl.constexpr):
    """One tile's code units K ``[HG, TILE, U]``, V^T ``[HG, U, TILE]`` and scale words
    ``[HG, TILE]``, each at ``ptr + base + off`` (base: a scalar for a one-block tile, else per
    key). An e4m3 byte can be NaN, and NaN * (p = 0) is NaN: FP8 masks V."""
    kc = tl.load(k_ptr + k_base + k_off)
    if MODE == MODE_FP8:
        vc = tl.load(v_ptr + v_base + v_off, mask=n_ok[None, None, :], other=0)
    else:
        vc = tl.load(v_ptr + v_base + v_off)
    kw = tl.load(ks_ptr + ks_base + ks_off, mask=n_ok[None, :], other=0)
    vw = tl.load(vs_ptr + vs_base + vs_off, mask=n_ok[None, :], other=0)
    return kc, vc, kw, vw


@triton.jit
def _block_row_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, k_base, v_base, ks_base, vs_base, hu, hks, hvs, n_ok,
                  MODE: tl.constexpr):
    """Like :func:`_block_tile_loads`, but addressed token-major: ``[TILE, HG, U]`` (``hu``: the
    ``[HG, U]`` head / unit offsets, ``hks`` / ``hvs`` the ``[HG]`` scale offsets; bases ``[TILE]``), so
    the lanes of a load walk each token's adjacent heads (whole rows when ``HG`` is every KV
    head); the tiles are then permuted to the dots' ``[HG, ...]`` order."""
    kc = tl.load(k_ptr + k_base[:, None, None] + hu[None, :, :])
    if MODE == MODE_FP8:
        vc = tl.load(v_ptr + v_base[:, None, None] + hu[None, :, :], mask=n_ok[:, None, None], other=0)
    else:
        vc = tl.load(v_ptr + v_base[:, None, None] + hu[None, :, :])
    kw = tl.load(ks_ptr + ks_base[:, None] + hks[None, :], mask=n_ok[:, None], other=0)
    vw = tl.load(vs_ptr + vs_base[:, None] + hvs[None, :], mask=n_ok[:, None], other=0)
    return tl.permute(kc, (1, 0, 2)), tl.permute(vc, (1, 2, 0)), tl.trans(kw), tl.trans(vw)


# Grid: (num_seqs, num_kv_heads // HG, NUM_SEGMENTS).
@dual_jit
def _decode_block_tiles_kernel(
    q_ptr,                          # [T, Hq, HEAD]; INT4: fp32, rotated, 4 parts (``_rotate_query_kernel``)
    k_ptr, v_ptr,                   # [num_blocks, block_size, num_kv_heads, U] int16 code units
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, num_kv_heads] int32 (scale bits; INT4: | zp)
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    softmax_scale, col_scale, softcap, window_left, window_right,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s,         # units, divided by ALIGN_BS
    stride_v_b, stride_v_s,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr,
    HG: tl.constexpr,               # KV heads per program (a power of two dividing num_kv_heads)
    GROUP: tl.constexpr, GP: tl.constexpr,
    HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr,
    OFF: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    ALIGN_BS: tl.constexpr,         # units dividing every block / slot stride
    HEAD_UNITS: tl.constexpr,       # K and V head stride in units (a multiple of 2: 4-byte rows)
    ROWS: tl.constexpr,             # token-major loads (adjacent heads of a token together)
    PDL: tl.constexpr,
):
    # the grid's second axis is the head group here (decode_program calls it kv_head)
    seq_idx, group_idx, seg_idx, tok, has_query, k_lo, k_hi, t0, t1 = decode_program(
        cu_seqlens_q_ptr, seqused_k_ptr, window_left, window_right, CAUSAL, TILE, NUM_SEGMENTS, PDL)
    if not has_query:
        return

    NOUT: tl.constexpr = 4 if MODE == MODE_INT4 else 2
    U: tl.constexpr = HEAD // NOUT
    offs_h = group_idx * HG + tl.arange(0, HG)                          # this program's KV heads
    offs_g = tl.arange(0, GP)
    offs_u = tl.arange(0, U)
    g_ok = (offs_g < GROUP)[None, :] & (offs_h >= 0)[:, None]           # [HG, GP] (the heads: always true)
    head = offs_h[:, None] * GROUP + offs_g[None, :]                    # [HG, GP]
    q0, q1, q2, q3 = _block_query(q_ptr, tok, head, g_ok, softmax_scale, stride_q_t, stride_q_h, stride_q_d,
                               U, NOUT, MODE, DOT)
    q_sum = tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)  # [HG, GP], of the rounded operands
    if MODE == MODE_INT4:
        q_sum += tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1)

    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s
    k_hu = offs_h[:, None, None] * HEAD_UNITS + offs_u[None, None, :]   # [HG, 1, U]
    v_hu = offs_h[:, None, None] * HEAD_UNITS + offs_u[None, :, None]   # [HG, U, 1]
    m_i = tl.full([HG, GP], float("-inf"), tl.float32)
    l_i = tl.zeros([HG, GP], tl.float32)
    acc0 = tl.zeros([HG, U, GP], tl.float32)
    acc1 = tl.zeros([HG, U, GP], tl.float32)
    acc2 = tl.zeros([HG, U, GP], tl.float32)
    acc3 = tl.zeros([HG, U, GP], tl.float32)
    slot = tl.arange(0, TILE) % BLOCK_SIZE
    k_off = (slot * (stride_k_s * ALIGN_BS))[None, :, None] + k_hu                 # [HG, TILE, U]
    v_off = (slot * (stride_v_s * ALIGN_BS))[None, None, :] + v_hu                 # [HG, U, TILE]
    ks_off = (slot * stride_ks_s)[None, :] + offs_h[:, None] * stride_ks_h          # [HG, TILE]
    vs_off = (slot * stride_vs_s)[None, :] + offs_h[:, None] * stride_vs_h
    hu = offs_h[:, None] * HEAD_UNITS + offs_u[None, :]                  # [HG, U] (ROWS)
    for t in range(t0, t1):
        k_pos = t * TILE + tl.arange(0, TILE)
        n_ok = (k_pos < k_hi) & (k_pos >= k_lo)
        if ROWS:  # token-major loads
            if TILE == BLOCK_SIZE:
                blk = tl.load(bt_row + t).to(tl.int64)
            else:
                blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            sl = k_pos % BLOCK_SIZE
            kc, vc, kw, vw = _block_row_loads(
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, blk * (stride_k_b * ALIGN_BS) + sl * (stride_k_s * ALIGN_BS),
                blk * (stride_v_b * ALIGN_BS) + sl * (stride_v_s * ALIGN_BS), blk * stride_ks_b + sl * stride_ks_s,
                blk * stride_vs_b + sl * stride_vs_s, hu, offs_h * stride_ks_h, offs_h * stride_vs_h, n_ok, MODE)
        elif TILE == BLOCK_SIZE:  # one block per tile (tiles start at multiples of TILE): one id
            blk = tl.load(bt_row + t).to(tl.int64)
            kc, vc, kw, vw = _block_tile_loads(
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, blk * (stride_k_b * ALIGN_BS), k_off,
                blk * (stride_v_b * ALIGN_BS), v_off, blk * stride_ks_b, ks_off, blk * stride_vs_b, vs_off, n_ok, MODE)
        elif TILE % BLOCK_SIZE == 0:  # whole blocks: the slot offsets do not change
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            kc, vc, kw, vw = _block_tile_loads(
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, (blk * (stride_k_b * ALIGN_BS))[None, :, None], k_off,
                (blk * (stride_v_b * ALIGN_BS))[None, None, :], v_off, (blk * stride_ks_b)[None, :], ks_off,
                (blk * stride_vs_b)[None, :], vs_off, n_ok, MODE)
        else:  # tiles smaller than a block
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            sl = k_pos % BLOCK_SIZE
            kc, vc, kw, vw = _block_tile_loads(
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
                (blk * (stride_k_b * ALIGN_BS) + sl * (stride_k_s * ALIGN_BS))[None, :, None], k_hu,
                (blk * (stride_v_b * ALIGN_BS) + sl * (stride_v_s * ALIGN_BS))[None, None, :], v_hu,
                (blk * stride_ks_b + sl * stride_ks_s)[None, :], offs_h[:, None] * stride_ks_h,
                (blk * stride_vs_b + sl * stride_vs_s)[None, :], offs_h[:, None] * stride_vs_h, n_ok, MODE)
        k0, k1, k2, k3 = units_to_dot(kc, MODE, DOT, ASM)
        s = tl.dot(k0, q0)
        s = tl.dot(k1, q1, s)
        if MODE == MODE_INT4:
            s = tl.dot(k2, q2, s)
            s = tl.dot(k3, q3, s)                                                    # [HG, TILE, GP]
        pv, alpha, m_i, l_i, vs_max, zp_term = _block_softmax(
            s, n_ok, kw, vw, q_sum, m_i, l_i, col_scale, softcap, MODE, OFF, USE_SOFTCAP, DOT)
        a = alpha[:, None, :]
        zp = zp_term[:, None, :]
        vm = vs_max[:, None, None]
        v0, v1, v2, v3 = units_to_dot(vc, MODE, DOT, ASM)
        acc0 = acc0 * a + (tl.dot(v0, pv) - zp) * vm
        acc1 = acc1 * a + (tl.dot(v1, pv) - zp) * vm
        if MODE == MODE_INT4:
            acc2 = acc2 * a + (tl.dot(v2, pv) - zp) * vm
            acc3 = acc3 * a + (tl.dot(v3, pv) - zp) * vm

    row = (tok.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx      # [HG, GP]
    base = segm_out_ptr + row[:, None, :] * HEAD + NOUT * offs_u[None, :, None]  # dim NOUT * u + x <- acc x
    ok = g_ok[:, None, :]
    tl.store(base, acc0, mask=ok)
    tl.store(base + 1, acc1, mask=ok)
    if MODE == MODE_INT4:
        tl.store(base + 2, acc2, mask=ok)
        tl.store(base + 3, acc3, mask=ok)
    tl.store(segm_max_ptr + row, m_i, mask=g_ok)
    tl.store(segm_sum_ptr + row, l_i, mask=g_ok)


def tiling(mode: KVQuantMode, head_size: int):
    """The measured tiling of ``mode`` at ``head_size`` (see ``TILING``), or None."""
    return TILING.get(mode, {}).get(head_size)


def wants(mode: KVQuantMode, head_size: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """Whether a quantized decode batch takes this kernel by default (else the code-unit kernel)."""
    if tiling(mode, head_size) is None:
        return False
    return mode != KVQuantMode.INT4_PER_TOKEN_HEAD or num_seqs * max_seqlen_k >= INT4_MIN_KEYS[head_size]


def segments(num_sms: int, pairs: int, max_seqlen_k: int, tile: int, programs_per_sm: int,
             head_size: int = 128) -> int:
    """Segments per (sequence, head group): about ``programs_per_sm`` programs per SM (``pairs`` =
    sequences x head groups), at least 2, at most one per tile, a power of two (unlike the
    code-unit kernel no cap on the keys per segment). Past the reduction's one load
    (``REDUCE_ONE_LOAD`` values: 64 segments at head_size 256) segments must hold 8 tiles or
    more: on the H200 at head_size 256, b1 @ 4k took 25.2 µs with 128 segments of 2 tiles and
    17.7 with 64, while b1 @ 32k took 65.4 with 128 segments of 16 tiles and 80.8 with 64."""
    segs = max(2, min(programs_per_sm * num_sms // max(1, pairs), max(1, max_seqlen_k // tile)))
    one_load = REDUCE_ONE_LOAD // max(16, next_pow2(head_size))  # the reduction's head_pad
    segs = min(segs, max(one_load, max_seqlen_k // (8 * tile), 2))
    return prev_pow2(segs)


def heads_per_program(num_kv_heads: int, wanted: int) -> int:
    """KV heads per program: ``wanted`` (0 = all of them)."""
    return wanted or num_kv_heads


def reads(units, num_kv_heads: int, wanted: int = 0) -> bool:
    """Whether this kernel reads the cache: its :func:`units.code_units` exist, K and V share one
    head stride, and the heads per program (the batch dimension of its dots) are a power of two
    that divides the KV heads."""
    if units is None:
        return False
    k16, v16, _ = units
    hg = heads_per_program(num_kv_heads, wanted)
    return k16.stride(2) == v16.stride(2) and hg & (hg - 1) == 0 and num_kv_heads % hg == 0


def launch_block_tiles(call, plan) -> None:
    """Launch ``_decode_block_tiles_kernel`` (grid: sequences x head groups x segments) on ``call``
    (its segment buffers allocated; :func:`reads` true). An INT4 query is rotated first."""
    kernel_mode, off = DECODE_MODES[call.mode]
    units = planned_units(call, plan)
    k16, v16, align = units
    tiling, interp = plan.tiling, interpreting(call.q)
    hg = heads_per_program(k16.shape[2], tiling.heads_per_program)
    grid = (call.num_seqs, k16.shape[2] // hg, tiling.num_segments)
    query, q_scale = rotated_query(call, plan)
    use_softcap, col_scale = query_scales(call)
    _decode_block_tiles_kernel[grid](
        **decode_args(call, query, units, q_scale, col_scale),
        NUM_Q_HEADS=query.shape[1], HG=hg, GROUP=call.group, GP=max(8, next_pow2(call.group)), HEAD=call.head_size,
        BLOCK_SIZE=k16.shape[1], TILE=tiling.tile, MODE=kernel_mode, OFF=off,
        DOT=DOT_FP32.value if interp else DOT_FP16.value, ASM=not interp, CAUSAL=call.causal,
        USE_SOFTCAP=use_softcap, NUM_SEGMENTS=tiling.num_segments, ALIGN_BS=align, HEAD_UNITS=k16.stride(2),
        ROWS=bool(tiling.row_loads and hg > 1), PDL=plan.pdl, launch_pdl=plan.pdl,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        **({"maxnreg": tiling.max_registers} if tiling.max_registers and not interp else {}),
    )
