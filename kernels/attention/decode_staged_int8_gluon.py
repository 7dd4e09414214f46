"""Split-KV INT8 / FP8 decode, whole cache blocks staged in shared memory: the INT4 staged
kernel's design (``decode_staged_int4_gluon``) for 132-byte rows.

The INT8 / FP8 default at head_size 128 for large decode batches on CUDA (host side:
``decode_staged.py``). One program per (sequence, segment) holds every KV head, one warp each;
each cache block (docs/LAYOUT.md: ``2 x 16 x num_kv_heads x 132`` contiguous bytes, K half then
V half; a row is 128 code
bytes and the f32 scale) is copied whole (one bulk copy on sm_90+, else 16-byte ``cp.async``)
into a ring in dynamic shared memory (reserved by the launcher after Triton's own), and each
warp reads its head's words with ``ld.shared.b32`` at immediate offsets from one address per
thread. The ring, its copies and the tile range are the INT4 kernel's helpers (8 copy rounds
per thread for the 132-byte rows where INT4 has 4).

**Maths.** Codes go to fp16 for ``mma.m16n8k16``:

- INT8: byte ``b = c + 128`` (``xor 0x80``) under exponent byte ``0x64`` is ``1152 + c`` exactly;
  the offset enters the dots' accumulators: ``-1152 sum(q)`` per query head for the scores, and
  for the values a dot of the probabilities with a constant operand of ``-1152``.
- FP8 e4m3: ``cvt.rn.f16x2.e4m3x2``, no offset.

The scores' K axis (head dims) is permuted so that each loaded word feeds two dots: K index
``k = 2 p + e`` of dot ``i`` is byte ``2 (i % 2) + e`` of word ``8 (i // 2) + p``; the query is
loaded in the same order. The values' M axis (head dims) likewise: row ``M`` of value dot ``m``
is dim ``16 (M % 8) + 4 (M // 8 + 2 (m // 4)) + m % 4``, undone at the store. Per-token scales:
the key scale on the score tile (with the softmax scale and ``log2 e``), the value scale in the
probabilities; the softmax keeps its max over ``s + log2(v_scale)`` as the INT4 kernel does.

**Output stores**: value dots 0-3 hold 4 adjacent dims of each output element, dots 4-7 the 4
after the next 4, so each element is two 16-byte stores (``_store4``), not eight 4-byte ones:
on the H200 (cold L2, call times) INT8 b1@64k 45.0-45.1 -> 41.3-41.7 µs, b8@32k 140.0-140.3 ->
132.9, b32@32k 499.9-500.7 -> 495.3-495.9.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_pdl import gdc_release, gdc_wait
from .decode_staged_int4_gluon import (_ids_ahead, _ld8, _ld_scales, _lds_lines, _out_rows, _ring_advance, _ring_fill,
                              _ring_start, _sequence, _softmax_tile, _store4, _store_stats,
                              _tile_range)

HEAD = gl.constexpr(128)        # head_size this kernel reads
ROW = gl.constexpr(33)          # words per row: 32 code words and the scale word
BLOCK = gl.constexpr(16)        # tokens per cache block (the tile)


@gluon.constexpr_function
def _lds_asm(nkv, kind):
    """PTX of ``ld.shared.b32`` at constant offsets from a thread's first address (key pitch
    ``ks = 132 x nkv`` bytes), in dot-operand register order:

    - "k": key rows r, r + 8; element pairs (k = 2c, 2c + 1) and (2c + 8, 2c + 9) hold words
      (c, c + 8) and (c + 4, c + 12) (the bytes of dots 4 j .. 4 j + 3 come from words c + 8 j ...);
      "k2": the same 64 bytes further (words + 16);
    - "v": value words 4r, 4r + 1 (M rows r, r + 8) of keys 2c, 2c + 1, 2c + 8, 2c + 9; "v2": words
      4r + 2, 4r + 3."""
    ks = 132 * nkv
    offsets = {"k": [0, 32, 8 * ks, 8 * ks + 32, 16, 48, 8 * ks + 16, 8 * ks + 48],
               "k2": [64, 96, 8 * ks + 64, 8 * ks + 96, 80, 112, 8 * ks + 80, 8 * ks + 112],
               "v": [0, ks, 4, ks + 4, 8 * ks, 9 * ks, 8 * ks + 4, 9 * ks + 4],
               "v2": [8, ks + 8, 12, ks + 12, 8 * ks + 8, 9 * ks + 8, 8 * ks + 12, 9 * ks + 12]}[kind]
    return _lds_lines(offsets)


@gluon.constexpr_function
def _kconv_asm(fp8):
    """PTX: two key words (``$4``: word w of dot pair j, ``$5``: word w + 8 of pair j + 1) -> the
    fp16x2 A registers of dots 4 j .. 4 j + 3 (bytes 0-1, then 2-3, of each word)."""
    if fp8:
        return ("{ .reg .b16 a0, a1, b0, b1; mov.b32 {a0, a1}, $4; mov.b32 {b0, b1}, $5; "
                "cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; "
                "cvt.rn.f16x2.e4m3x2 $2, b0; cvt.rn.f16x2.e4m3x2 $3, b1; }")
    return ("{ .reg .b32 a, b; xor.b32 a, $4, 0x80808080; xor.b32 b, $5, 0x80808080; "
            "prmt.b32 $0, a, 0x64646464, 0x4140; prmt.b32 $1, a, 0x64646464, 0x4342; "
            "prmt.b32 $2, b, 0x64646464, 0x4140; prmt.b32 $3, b, 0x64646464, 0x4342; }")


@gluon.constexpr_function
def _vconv_asm(fp8):
    """PTX: the same value word of keys 2c and 2c + 1 (``$4``, ``$5``) -> 4 fp16x2 A registers:
    register j holds byte j of both (the keys along the dot's K axis), for the dots with
    ``m % 4 = j``. ``prmt`` source bytes 0-3 are ``$4``'s, 4-7 ``$5``'s."""
    if fp8:  # bytes j, j of the two words as one 16-bit pair (low byte: key 2c)
        return ("{ .reg .b32 x; .reg .b16 lo, hi; " + " ".join(
            f"prmt.b32 x, $4, $5, {hex((4 + j) << 4 | j)}; mov.b32 {{lo, hi}}, x; cvt.rn.f16x2.e4m3x2 ${j}, lo;"
            for j in range(4)) + " }")
    # bytes j of the two words to bytes 0 and 2, then (x & 0x00FF00FF) ^ 0x00800080 | 0x64006400
    # in one lop3: f(x, M, C) = M ? x ^ C : C with M = 0x00FF00FF, C = 0x64806480 (lut 0x6A)
    return ("{ .reg .b32 x; " + " ".join(
        f"prmt.b32 x, $4, $5, {hex((4 + j) << 8 | j)}; lop3.b32 ${j}, x, 0x00FF00FF, 0x64806480, 0x6A;"
        for j in range(4)) + " }")


CONV = gl.constexpr("=r,=r,=r,=r,r,r")


@gluon.jit
def _ld(addr, NKV: gl.constexpr, KIND: gl.constexpr):
    """8 words per thread of a block of 132-byte rows (the INT4 kernel's :func:`_ld8` with :func:`_lds_asm`)."""
    return _ld8(addr, _lds_asm(NKV, KIND))


@gluon.jit
def _kconv(w, FP8: gl.constexpr):
    """Key words -> the A operands of four score dots (:func:`_kconv_asm`)."""
    return gl.inline_asm_elementwise(asm=_kconv_asm(FP8), constraints=CONV, args=[w],
                                     dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _vconv(w, FP8: gl.constexpr):
    """Value words -> the A operands of four value dots (:func:`_vconv_asm`)."""
    return gl.inline_asm_elementwise(asm=_vconv_asm(FP8), constraints=CONV, args=[w],
                                     dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _values_half(addr, KIND: gl.constexpr, v_ok, p_b, c_v, a3, acc_a, acc_b, acc_c, acc_d, NKV: gl.constexpr,
                 FP8: gl.constexpr):
    """Four of the eight value dots (``KIND`` "v": dots 0-3, "v2": 4-7) added into their rescaled
    accumulators; FP8 zeroes the words of masked keys (``v_ok``) first."""
    vw = _ld(addr, NKV, KIND)
    if FP8:
        vw = gl.where(v_ok, vw, 0)
    v_a, v_b, v_c, v_d = _vconv(vw, FP8)
    return (acc_a * a3 + mma_v2(v_a, p_b, c_v), acc_b * a3 + mma_v2(v_b, p_b, c_v),
            acc_c * a3 + mma_v2(v_c, p_b, c_v), acc_d * a3 + mma_v2(v_d, p_b, c_v))


@gluon.jit
def _q_dot(q_row, q_ok, k_dim, I: gl.constexpr):
    """Score dot ``I``'s query operand: K index ``k = 2 p + e`` is dim ``4 (8 (I // 2) + p) + 2 (I % 2) + e``."""
    return gl.load(q_row + 4 * (8 * (I // 2)) + 2 * (I % 2) + k_dim, mask=q_ok, other=0.0).to(gl.float32).to(gl.float16)


# Grid: (num_seqs, NUM_SEGMENTS); num_warps = NKV. A tile is one cache block (16 keys).
@gluon.jit(do_not_specialize=["ring_off"])
def _decode_staged_int8_kernel(
    q_ptr,                          # [T, Hq, 128] bf16 / fp16, as given
    kv_ptr,                         # the packed cache as int32 words
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    qk_scale,                       # softmax scale x (log2 e, or 1 with softcap)
    softcap, window_left, window_right,
    stride_q_t, stride_q_h,
    stride_blk,                     # words from one block to the next
    stride_bt_s,
    ring_off,                       # bytes from the dynamic shared memory's base to the ring
    NUM_Q_HEADS: gl.constexpr, NKV: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr,
    USE_SOFTCAP: gl.constexpr, NUM_SEGMENTS: gl.constexpr, STAGES: gl.constexpr,
    BULK: gl.constexpr = False,     # sm_90: one bulk copy (TMA) per block and mbarriers, not cp.async
    SPREAD: gl.constexpr = False,   # launched one program per SM (decode_staged.launch); the code is the same
    RELEASE: gl.constexpr = False,  # let the reduction be scheduled at the start (Plan.reduce_early)
    PDL: gl.constexpr = False,      # launched with launch_pdl: everything is read after griddepcontrol.wait
):
    HALF_B: gl.constexpr = BLOCK * NKV * ROW * 4     # bytes of one half (K or V) of a block
    STAGE_BYTES: gl.constexpr = 2 * HALF_B
    TILE: gl.constexpr = BLOCK
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
    if RELEASE:  # the grid is resident at once: the reduction's programs wait in their own gdc_wait
        gdc_release(seg_idx)
    if PDL:  # launched before the previous kernel ended: its outputs (the query, the cache) are read after this
        gdc_wait(seg_idx)
    ring = _ring_start(ring_off, NKV)
    tok, _, seq_len, live = _sequence(cu_seqlens_q_ptr, seqused_k_ptr, seq_idx)
    if not live:
        return
    k_lo, k_hi, t0, t1 = _tile_range(seq_len, seg_idx, window_left, window_right, TILE, NUM_SEGMENTS)

    tid = gl.arange(0, 32 * NKV, layout=ch_l)
    tail = tid < 8 * NKV
    # each thread's first address (the same in all its elements; :func:`_lds_asm` adds the rest)
    kh = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    kt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    kk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    # keys: key r, word c (c = k // 2 of the thread's first element: (k & 6) // 2)
    k_off = (((kt & 7)[None, :, None] * NKV + kh[:, None, None]) * ROW + ((kk & 6) // 2)[None, None, :]) * 4
    vm_ = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    vt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    # values: key 2c, word 4r (r = M % 8)
    v_off = (((vt & 6)[None, None, :] * NKV + kh[:, None, None]) * ROW + 4 * (vm_ & 7)[None, :, None]) * 4 + HALF_B
    sh = gl.arange(0, NKV, layout=gl.SliceLayout(1, tok_l))
    st = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))
    s_off = (((st & 7)[None, :] * NKV + sh[:, None]) * ROW + 32) * 4                             # [NKV, TILE]

    bt_row = block_table_ptr + seq_idx.to(gl.int64) * stride_bt_s
    bars = ring + STAGES * STAGE_BYTES          # BULK: one 8-byte mbarrier per slot, after the ring
    first = tid == 0
    _ring_fill(ring, bars, kv_ptr, bt_row, t0, t1, tid, tail, first, stride_blk, STAGE_BYTES, NKV, 8, STAGES, BULK,
               STAGES - 1)
    b0, b1, b2, b3 = _ids_ahead(bt_row, t0 + STAGES - 1, t1)

    # the query, B operand of the 8 score dots: [NKV, 16, 8] fp16 in the keys' dim order
    q_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
    q_k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
    q_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
    head = q_h[:, None, None] * GROUP + q_g[None, None, :]
    q_ok = (q_g < GROUP)[None, None, :] & (q_h >= 0)[:, None, None] & (q_k >= 0)[None, :, None]
    q_row = q_ptr + tok.to(gl.int64) * stride_q_t + head * stride_q_h
    k_dim = (4 * (q_k // 2) + q_k % 2)[None, :, None]
    q0 = _q_dot(q_row, q_ok, k_dim, 0)
    q1 = _q_dot(q_row, q_ok, k_dim, 1)
    q2 = _q_dot(q_row, q_ok, k_dim, 2)
    q3 = _q_dot(q_row, q_ok, k_dim, 3)
    q4 = _q_dot(q_row, q_ok, k_dim, 4)
    q5 = _q_dot(q_row, q_ok, k_dim, 5)
    q6 = _q_dot(q_row, q_ok, k_dim, 6)
    q7 = _q_dot(q_row, q_ok, k_dim, 7)
    zero_s = gl.zeros([NKV, TILE, 8], gl.float32, layout=mma)
    if FP8:
        s_init = zero_s
    else:  # INT8 codes come as 1152 + c: each score starts from -1152 sum(q) (the operands as rounded)
        q_all = (gl.sum(q0.to(gl.float32), 1) + gl.sum(q1.to(gl.float32), 1) + gl.sum(q2.to(gl.float32), 1)
                 + gl.sum(q3.to(gl.float32), 1) + gl.sum(q4.to(gl.float32), 1) + gl.sum(q5.to(gl.float32), 1)
                 + gl.sum(q6.to(gl.float32), 1) + gl.sum(q7.to(gl.float32), 1))
        s_init = gl.convert_layout(-1152.0 * q_all, row_l)[:, None, :] + zero_s
    neg_off = gl.full([NKV, 16, TILE], -1152.0, gl.float16, layout=a_l)     # INT8: the values' offset

    m_i = gl.full([NKV, 8], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([NKV, TILE, 8], gl.float32, layout=mma)
    acc0 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc1 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc2 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc3 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc4 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc5 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc6 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    acc7 = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    zero_o = gl.zeros([NKV, 16, 8], gl.float32, layout=mma)
    tok_i = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))

    for t in range(t0, t1):
        j = t - t0
        slot = j % STAGES
        _ring_advance(ring, bars, kv_ptr, b0, t, t1, j, slot, first, tid, tail, stride_blk, STAGE_BYTES, NKV, 8, STAGES,
                      BULK)
        n = t + STAGES + 3
        b0, b1, b2, b3 = b1, b2, b3, gl.load(bt_row + n, mask=n < t1, other=0)
        sb = ring + slot * STAGE_BYTES
        ksw = _ld_scales(sb + s_off, NKV, 132)                               # [NKV, TILE]
        vsw = _ld_scales(sb + HALF_B + s_off, NKV, 132)
        k_pos = t * TILE + tok_i
        n_ok = ((k_pos < k_hi) & (k_pos >= k_lo))[None, :]
        k_sc = gl.where(n_ok, ksw.to(gl.float32, bitcast=True), 0.0) * qk_scale
        v_sc = gl.where(n_ok, vsw.to(gl.float32, bitcast=True), 0.0)
        kw = _ld(sb + k_off, NKV, "k")
        k0, k1, k2, k3 = _kconv(kw, FP8)
        s = mma_v2(k0, q0, s_init)
        s = mma_v2(k1, q1, s)
        s = mma_v2(k2, q2, s)
        s = mma_v2(k3, q3, s)
        kw = _ld(sb + k_off, NKV, "k2")
        k4, k5, k6, k7 = _kconv(kw, FP8)
        s = mma_v2(k4, q4, s)
        s = mma_v2(k5, q5, s)
        s = mma_v2(k6, q6, s)
        s = mma_v2(k7, q7, s)                                               # [NKV, TILE, 8]
        pv, alpha, m_i, l_acc = _softmax_tile(s, k_sc, v_sc, n_ok, m_i, l_acc, softcap, USE_SOFTCAP)
        p_b = gl.convert_layout(pv, b_l)
        if FP8:
            c_v = zero_o
        else:  # -1152 sum_k p'_k in every row, as the value dots' accumulator input
            c_v = mma_v2(neg_off, p_b, zero_o)
        a3 = alpha[:, None, :]
        # a block's unused rows may hold NaN codes (FP8 0x7F / 0xFF): 0 x NaN would reach the sums
        v_ok = ((t * TILE + vt >= k_lo) & (t * TILE + vt < k_hi))[None, None, :]
        acc0, acc1, acc2, acc3 = _values_half(sb + v_off, "v", v_ok, p_b, c_v, a3, acc0, acc1, acc2, acc3, NKV, FP8)
        acc4, acc5, acc6, acc7 = _values_half(sb + v_off, "v2", v_ok, p_b, c_v, a3, acc4, acc5, acc6, acc7, NKV,
                                              FP8)
    if not BULK:
        async_copy.wait_group(0)

    row3, ok3, o_m = _out_rows(tok, seg_idx, mma, NKV, 16, GROUP, NUM_Q_HEADS, NUM_SEGMENTS)
    # value dot M's row R is dim 16 (R % 8) + 4 (R // 8 + 2 (M // 4)) + M % 4: dots 0-3 hold 4
    # adjacent dims of each element, dots 4-7 the 4 after the next 4: two 16-byte stores an element
    base = segm_out_ptr + row3 * HEAD + (16 * (o_m % 8) + 4 * (o_m // 8))[None, :, None]
    _store4(base, acc0, acc1, acc2, acc3, ok3)
    _store4(base + 8, acc4, acc5, acc6, acc7, ok3)
    _store_stats(segm_max_ptr, segm_sum_ptr, tok, seg_idx, m_i, l_acc, NUM_Q_HEADS, NKV, GROUP, NUM_SEGMENTS, row_l)
