"""Split-KV INT4 decode kernel "v6": whole cache blocks in shared memory, every KV head, one warp each.

Written in Gluon (``triton.experimental.gluon``, Triton >= 3.6, NVIDIA sm_80+) with inline PTX
for the shared-memory ring; the Triton kernels v3 / v4 serve everything else (and the CPU).

**Why.** The v4 kernel reads each KV head's 68-byte rows on their own, 544 bytes apart, and
runs at that access pattern's rate (docs/bench/attention.md, sessions 6-10). Here one program
per (sequence, segment) holds every KV head, and each cache block is copied as it lies in the
packed cache (SPEC §4: ``2 x 16 x num_kv_heads x 68`` contiguous bytes: K half, then V half) by
16-byte ``cp.async`` into a two-stage ring. Each warp then reads its head's rows, codes and
scale words, with ``ld.shared.b32`` at their 4-byte offsets. Gluon's shared layouts cannot state
the 17-word row pitch in Triton 3.6 (the padded layout is not lowered on NVIDIA, and TMA boxes
cannot start at 68-byte offsets), so the ring is a PTX ``.shared`` array (``kv6_ring``) declared
and addressed by the kernel's own inline PTX. Triton's allocator never sees it: the kernel's
other shared memory (layout conversions) is Triton's dynamic shared memory, a separate region.
A static array is limited to 48 KB: two stages of 8-head blocks (34,816 bytes).

**Maths** (as v4; SPEC §3). The query arrives rotated and scaled (``_prep_q_kernel``, 4
parts). Nibble ``n`` of 32-bit code word ``w`` is dim ``8 w + n``. Scores are
``sum_n N_n . Q_n^T``, where ``N_n`` holds nibble ``n`` of every word: one
``mma.m16n8k16`` k-step per nibble position, with the words as the K axis, so words go from
shared memory straight into the A operand's registers. One PTX block turns two words into 8
fp16x2 registers: ``1024 + c`` for even ``n``, ``1024 + 16 c`` for odd ``n`` (the query's odd
parts are pre-divided by 16). Each dot starts from minus its offset and zero-point share: per key
for the scores, per tile for the values. The tensor cores add that share to the products, so no
large offset is left to cancel in the fp32 sums. Cancelling it once per segment instead gave a
relative L2 of 2.9e-3 at b32@32k against v4's 1.6e-3. The per-token scale is applied to the
score tile. The value product is ``N_n^T . P'`` per nibble position, with the keys as the K axis and
``P' = p * v_scale / max(v_scale)``. The query heads of a KV head are the N axis (8, ``GROUP``
used).

Writes the split buffers of ``_attn_reduce_kernel`` (rotated dims, natural order). Masked keys
(past the sequence, outside the window) get a ``-inf`` score and a zero value scale, so
poisoned bytes in a block's unused rows never reach the output.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

HEAD = gl.constexpr(128)        # head_size this kernel reads
WORDS = gl.constexpr(16)        # 32-bit code words per row (HEAD / 8)
ROW = gl.constexpr(17)          # words per row: the codes and the scale word
BLOCK = gl.constexpr(16)        # tokens per cache block (the tile)
# the ring: 2 stages of 8-head blocks, 34,816 bytes (a static array stops at 48 KB); the size is
# also written out in _ring_base's PTX
RING_BYTES = gl.constexpr(2 * 2 * 16 * 8 * 68)


@gluon.jit
def _ring_base(x):
    """Shared-window address of the ring ``kv6_ring`` (declares it: called once, first).
    ``x`` is any scalar (inline PTX takes at least one operand)."""
    return gl.inline_asm_elementwise(
        asm=".shared .align 16 .b8 kv6_ring[34816];\n\tmov.u32 $0, kv6_ring;",
        constraints="=r,r", args=[x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy16(saddr, gaddr, ok):
    """``cp.async.cg`` of 16 bytes from ``gaddr`` to shared ``saddr`` where ``ok``."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.cg.shared.global [$1], [$2], 16; mov.b32 $0, 0; }",
        constraints="=r,r,l,r", args=[saddr, gaddr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _lds(addr):
    """``ld.shared.b32`` at each address (ordered after the ring's barrier: not pure)."""
    return gl.inline_asm_elementwise(
        asm="ld.shared.b32 $0, [$1];", constraints="=r,r", args=[addr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _nib8(w):
    """Two 32-bit code words per instance (adjacent along the dot's K axis) -> 8 fp16x2, nibble
    ``n`` of both words as fp16 ``1024 + c`` (even ``n``) or ``1024 + 16 c`` (odd ``n``)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x;
        prmt.b32 x, $8, $9, 0x5410;
        lop3.b32 $0, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, x, 0x00F000F0, 0x64006400, 0xEA;
        shr.b32 x, x, 8;
        lop3.b32 $2, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $3, x, 0x00F000F0, 0x64006400, 0xEA;
        prmt.b32 x, $8, $9, 0x7632;
        lop3.b32 $4, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $5, x, 0x00F000F0, 0x64006400, 0xEA;
        shr.b32 x, x, 8;
        lop3.b32 $6, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $7, x, 0x00F000F0, 0x64006400, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=2)


@gluon.jit
def _issue(ring, kv_ptr, blk, ok, slot, chunk, c_ok, stride_blk, STAGE_BYTES: gl.constexpr):
    """Queue the 16-byte copies of cache block ``blk`` into ring slot ``slot`` (nothing unless ``ok``)."""
    g = kv_ptr + blk.to(gl.int64) * stride_blk + chunk * 4
    _copy16(ring + slot * STAGE_BYTES + chunk * 16, g, c_ok & ok)
    async_copy.commit_group()


# Grid: (num_seqs, NUM_SEGMENTS); num_warps = NKV. A tile is one cache block (16 keys).
@gluon.jit
def _attn_decode_v6_kernel(
    q_ptr,                          # [T, Hq, 128] fp32: rotated, scaled, 4 parts (``_prep_q_kernel``)
    kv_ptr,                         # the packed cache as int32 words
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    col_scale, softcap, window_left, window_right,
    stride_q_t, stride_q_h,
    stride_blk,                     # words from one block to the next
    stride_bt_s,
    NUM_Q_HEADS: gl.constexpr, NKV: gl.constexpr, GROUP: gl.constexpr,
    USE_SOFTCAP: gl.constexpr, NUM_SEGMENTS: gl.constexpr, STAGES: gl.constexpr,
    PROBE: gl.constexpr = False,    # copies only (a read probe: measures the copy ring alone)
):
    HALF_B: gl.constexpr = BLOCK * NKV * ROW * 4     # bytes of one half (K or V) of a block
    STAGE_BYTES: gl.constexpr = 2 * HALF_B
    CHUNKS: gl.constexpr = STAGE_BYTES // 16
    CH_PAD: gl.constexpr = 2048 if CHUNKS > 1024 else (1024 if CHUNKS > 512 else 512)
    TILE: gl.constexpr = BLOCK
    gl.static_assert(STAGES * STAGE_BYTES <= RING_BYTES)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NKV, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    tok_l: gl.constexpr = gl.SliceLayout(2, mma)     # [NKV, TILE]: per key
    row_l: gl.constexpr = gl.SliceLayout(1, mma)     # [NKV, 8]: per query head
    ch_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NKV],
                                          order=[0])

    seq_idx = gl.program_id(0)
    seg_idx = gl.program_id(1)
    ring = _ring_base(seq_idx)
    tok = gl.load(cu_seqlens_q_ptr + seq_idx)
    has_query = gl.load(cu_seqlens_q_ptr + seq_idx + 1) != tok
    if not has_query:
        return
    seq_len = gl.load(seqused_k_ptr + seq_idx)
    k_hi = seq_len
    if window_right >= 0:
        k_hi = gl.minimum(k_hi, seq_len + window_right)
    k_lo = 0
    if window_left >= 0:
        k_lo = gl.maximum(seq_len - 1 - window_left, 0)
    tile_lo = k_lo // TILE
    tile_hi = (k_hi + TILE - 1) // TILE
    per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    t0 = tile_lo + seg_idx * per_seg
    t1 = gl.minimum(t0 + per_seg, tile_hi)

    chunk = gl.arange(0, CH_PAD, layout=ch_l)
    c_ok = chunk < CHUNKS
    # byte offsets (from a stage's start) of the rows each thread reads
    kh = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    kt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    kwi = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    k_off = ((kt[None, :, None] * NKV + kh[:, None, None]) * ROW + kwi[None, None, :]) * 4       # [NKV, TILE, WORDS]
    vw_ = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    vt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    # [NKV, WORDS, TILE]
    v_off = ((vt[None, None, :] * NKV + kh[:, None, None]) * ROW + vw_[None, :, None]) * 4 + HALF_B
    sh = gl.arange(0, NKV, layout=gl.SliceLayout(1, tok_l))
    st = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))
    s_off = ((st[None, :] * NKV + sh[:, None]) * ROW + WORDS) * 4                                # [NKV, TILE]

    bt_row = block_table_ptr + seq_idx.to(gl.int64) * stride_bt_s
    for i in gl.static_range(STAGES - 1):
        ok = t0 + i < t1
        blk = gl.load(bt_row + t0 + i, mask=ok, other=0)
        _issue(ring, kv_ptr, blk, ok, i, chunk, c_ok, stride_blk, STAGE_BYTES)
    # block ids one tile ahead of their copy, so the id load's latency hides behind a tile
    blk_next = gl.load(bt_row + t0 + STAGES - 1, mask=t0 + STAGES - 1 < t1, other=0)

    # the query, B operand: Q_n [NKV, WORDS, 8] fp16, Q_n[h, w, g] = rotated dim 8 w + n of head
    # h * GROUP + g = part n % 4, unit 2 w + n // 4; odd n over 16 (their codes come as 16 c)
    q_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
    q_w = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
    q_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
    head = q_h[:, None, None] * GROUP + q_g[None, None, :]
    q_ok = (q_g < GROUP)[None, None, :] & (q_h >= 0)[:, None, None] & (q_w >= 0)[None, :, None]
    q_row = q_ptr + tok.to(gl.int64) * stride_q_t + head * stride_q_h + 2 * q_w[None, :, None]
    q0 = gl.load(q_row + 0, mask=q_ok, other=0.0).to(gl.float16)
    q1 = (gl.load(q_row + 32, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
    q2 = gl.load(q_row + 64, mask=q_ok, other=0.0).to(gl.float16)
    q3 = (gl.load(q_row + 96, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
    q4 = gl.load(q_row + 1, mask=q_ok, other=0.0).to(gl.float16)
    q5 = (gl.load(q_row + 33, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
    q6 = gl.load(q_row + 65, mask=q_ok, other=0.0).to(gl.float16)
    q7 = (gl.load(q_row + 97, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
    q_even = (gl.sum(q0.to(gl.float32), 1) + gl.sum(q2.to(gl.float32), 1) + gl.sum(q4.to(gl.float32), 1)
              + gl.sum(q6.to(gl.float32), 1))
    q_odd = (gl.sum(q1.to(gl.float32), 1) + gl.sum(q3.to(gl.float32), 1) + gl.sum(q5.to(gl.float32), 1)
             + gl.sum(q7.to(gl.float32), 1))
    # s_raw = sum_n Q_n . (1024 + m_n c) = q . c + 1024 (q_even + q_odd): the dot of the operands as rounded
    q_sum = gl.convert_layout(q_even + 16.0 * q_odd, row_l)                   # [NKV, 8]
    q_off = gl.convert_layout(1024.0 * (q_even + q_odd), row_l)

    m_i = gl.full([NKV, 8], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([NKV, 8], gl.float32, layout=row_l)
    acc0 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc1 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc2 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc3 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc4 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc5 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc6 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc7 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    zero_s = gl.zeros([NKV, TILE, 8], gl.float32, layout=mma)
    zero_o = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    tok_i = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))

    for t in range(t0, t1):
        j = t - t0
        slot = j % STAGES
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        _issue(ring, kv_ptr, blk_next, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, chunk, c_ok, stride_blk,
               STAGE_BYTES)
        blk_next = gl.load(bt_row + t + STAGES, mask=t + STAGES < t1, other=0)
        if not PROBE:
            sb = ring + slot * STAGE_BYTES
            ksw = _lds(sb + s_off)                                              # [NKV, TILE]
            vsw = _lds(sb + HALF_B + s_off)
            k_pos = t * TILE + tok_i
            n_ok = ((k_pos < k_hi) & (k_pos >= k_lo))[None, :] & (ksw == ksw)
            ksw = gl.where(n_ok, ksw, 0)
            vsw = gl.where(n_ok, vsw, 0)
            k_zp = (ksw & 0xF).to(gl.float32)
            k_sc = (ksw & -16).to(gl.float32, bitcast=True) * col_scale
            v_zp = (vsw & 0xF).to(gl.float32)
            v_sc = (vsw & -16).to(gl.float32, bitcast=True)
            # the dots start from minus the code offset's and the zero point's share: the tensor
            # cores sum them with the products, so no large offset is left to cancel later
            kw = _lds(sb + k_off)                                               # [NKV, TILE, WORDS]
            k0, k1, k2, k3, k4, k5, k6, k7 = _nib8(kw)
            s = mma_v2(k0, q0, -(q_off[:, None, :] + k_zp[:, :, None] * q_sum[:, None, :]))
            s = mma_v2(k1, q1, s)
            s = mma_v2(k2, q2, s)
            s = mma_v2(k3, q3, s)
            s = mma_v2(k4, q4, s)
            s = mma_v2(k5, q5, s)
            s = mma_v2(k6, q6, s)
            s = mma_v2(k7, q7, s)                                               # [NKV, TILE, 8]
            s = s * k_sc[:, :, None]
            if USE_SOFTCAP:
                s = softcap * (2.0 / (1.0 + gl.exp(-2.0 * s / softcap)) - 1.0) * 1.4426950408889634
            s = gl.where(n_ok[:, :, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_use[:, None, :])
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            vm = gl.maximum(gl.max(v_sc[:, :, None] + zero_s, 1), 1e-30)       # [NKV, 8]: the tile's largest
            pv = (p * v_sc[:, :, None] / vm[:, None, :]).to(gl.float16)       # value scale (fp16's range)
            pv32 = pv.to(gl.float32)
            p_off = 1024.0 * gl.sum(pv32, 1)                                  # [NKV, 8]: this tile's
            z_sum = gl.sum(pv32 * v_zp[:, :, None], 1)                          # offset and zero point
            c_even = -(p_off + z_sum)[:, None, :] + zero_o                      # even n: codes 1024 + c
            c_odd = -(p_off + 16.0 * z_sum)[:, None, :] + zero_o                # odd n: 1024 + 16 c
            p_b = gl.convert_layout(pv, b_l)
            vw = _lds(sb + v_off)                                               # [NKV, WORDS, TILE]
            v0, v1, v2, v3, v4, v5, v6, v7 = _nib8(vw)
            a3 = alpha[:, None, :]
            ve = vm[:, None, :]
            vo = ve * 0.0625
            acc0 = acc0 * a3 + mma_v2(v0, p_b, c_even) * ve
            acc1 = acc1 * a3 + mma_v2(v1, p_b, c_odd) * vo
            acc2 = acc2 * a3 + mma_v2(v2, p_b, c_even) * ve
            acc3 = acc3 * a3 + mma_v2(v3, p_b, c_odd) * vo
            acc4 = acc4 * a3 + mma_v2(v4, p_b, c_even) * ve
            acc5 = acc5 * a3 + mma_v2(v5, p_b, c_odd) * vo
            acc6 = acc6 * a3 + mma_v2(v6, p_b, c_even) * ve
            acc7 = acc7 * a3 + mma_v2(v7, p_b, c_odd) * vo
    async_copy.wait_group(0)

    # out[row(h, g), 8 w + n] = acc_n[h, w, g]
    o_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    o_w = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    row3 = (tok.to(gl.int64) * NUM_Q_HEADS + o_h[:, None, None] * GROUP + o_g[None, None, :]) * NUM_SEGMENTS + seg_idx
    ok3 = (o_g < GROUP)[None, None, :] & (o_h >= 0)[:, None, None] & (o_w >= 0)[None, :, None]
    base = segm_out_ptr + row3 * HEAD + 8 * o_w[None, :, None]
    gl.store(base + 0, acc0, mask=ok3)
    gl.store(base + 1, acc1, mask=ok3)
    gl.store(base + 2, acc2, mask=ok3)
    gl.store(base + 3, acc3, mask=ok3)
    gl.store(base + 4, acc4, mask=ok3)
    gl.store(base + 5, acc5, mask=ok3)
    gl.store(base + 6, acc6, mask=ok3)
    gl.store(base + 7, acc7, mask=ok3)
    r_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, row_l))
    r_g = gl.arange(0, 8, layout=gl.SliceLayout(0, row_l))
    rows = (tok.to(gl.int64) * NUM_Q_HEADS + r_h[:, None] * GROUP + r_g[None, :]) * NUM_SEGMENTS + seg_idx
    r_ok = (r_g < GROUP)[None, :] & (r_h >= 0)[:, None]
    gl.store(segm_max_ptr + rows, m_i, mask=r_ok)
    gl.store(segm_sum_ptr + rows, l_i, mask=r_ok)
