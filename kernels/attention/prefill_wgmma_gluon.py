"""Prefill attention over a 16-bit paged cache on sm_90: TMA block copies, warpgroup MMAs and
warp specialization.

The 2D path's kernel for chunks of new tokens over bf16 / fp16 caches and over the fp16 scratch
a quantized context is dequantized into first (``prefill_dequant``), on Hopper GPUs. It computes
what ``prefill_2d._attn_kernel`` computes without a split (causal or not, no sliding window, no
soft cap):

- **Program**: one tile of ``2 x 64`` query rows (``BLOCK_Q`` tokens x the ``GROUP`` query
  heads of one KV head, packed as the Triton kernel packs them) x one KV head, in three
  partitions: two consumer warpgroups, each owning 64 of the rows, and one producer warp.
- **Producer**: for each tile of ``TILE`` keys, the keys then the values: waits until both
  consumers released that half of the ring stage it goes to (an "empty" mbarrier per stage and
  half, two arrivals), then copies each of the tile's cache blocks (``BLOCK_SIZE`` rows x
  ``HEAD`` dims of the KV head: one box of a 2D tensor descriptor over the cache's slot rows)
  by TMA into its slice of the stage, counted on the half's "ready" mbarrier. A block id past
  the sequence's last block becomes a row past the descriptor's end, which TMA fills with zeros.
- **Consumers**: ``S = Q K^T`` (both operands in shared memory) and ``O += P V`` (``P`` in
  registers) as warpgroup MMAs with fp32 accumulators; each step issues tile ``j``'s scores and
  tile ``j - 1``'s values together and runs tile ``j``'s softmax while the values' MMA runs.
  A consumer holds tile ``j``'s keys and tile ``j - 1``'s values at once, so keys and values
  are released separately (the keys when their scores are in registers): with two stages the
  next tile's keys load during this step, and the values a step before they are used.
  Masks only on tiles that cross the causal edge or the sequence's end; value rows past the
  sequence's end (a block's unused slots may hold NaN, and 0 x NaN is NaN) are set to zero in
  shared memory by each consumer before its ``P V`` of that tile (both write the same zeros).
  The output rows go to global memory through the consumer's slice of the query tile: no
  layout-conversion scratch, which at head 128 would not fit beside a third stage.
- **Int8 keys** (``K8``, INT4 rows kept rotated: ``prefill_dequant``'s ``int8_keys``): the keys
  are int8 codes ``c - zp`` with one fp32 scale per key, which the producer copies by TMA with
  each tile's keys (a 1D descriptor); each consumer quantizes its query rows to int8 (one scale
  per row, ``amax / 127``) and takes the scores as int8 MMAs (twice the 16-bit rate) into int32,
  turned into fp32 through the bits of ``1.5 x 2^23`` and scaled per key in one FMA, per row
  with the softmax scale. The values stay 16-bit, and the output leaves through a 16-bit buffer
  of its own (the int8 query tile is half the size).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import find_seq_idx  # a scalar @triton.jit helper: Gluon calls it as it is

ROWS = gl.constexpr(64)         # query rows per consumer warpgroup (prefill_wgmma.BLOCK_M: two of them)


@gluon.jit
def _producer(k_desc, v_desc, ks_desc, k_ring, v_ring, ks_ring, ready, empty, bt_row, past_end, row_pitch, col,
              ks_first, n_tiles, seq_len, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, STAGES: gl.constexpr,
              K8: gl.constexpr):
    """One warp: the TMA copies of every tile's K and V blocks (with ``K8`` and the tile's key scales,
    ``TILE`` of them from element ``ks_first + j * TILE`` of ``ks_desc``) into the ring (barriers
    ``ready`` / ``empty`` ``[2 * STAGES]``: the keys' of stage ``s`` at ``s``, the values' at
    ``STAGES + s``). Block ``b``'s rows start at row ``b * row_pitch`` of both descriptors, its
    KV head's dims at column ``col``."""
    NB: gl.constexpr = TILE // BLOCK_SIZE
    ids_layout: gl.constexpr = gl.BlockedLayout([NB], [32], [1], [0])  # every lane holds the tile's ids
    offs = gl.arange(0, NB, layout=ids_layout)
    n_blocks = gl.cdiv(seq_len, BLOCK_SIZE)
    k_bytes: gl.constexpr = NB * k_desc.block_type.nbytes + (ks_desc.block_type.nbytes if K8 else 0)
    v_bytes: gl.constexpr = NB * v_desc.block_type.nbytes
    idx = offs
    ids = gl.load(bt_row + idx, mask=idx < n_blocks, other=past_end)
    for j in range(n_tiles):
        stage = j % STAGES
        free_phase = ((j // STAGES) & 1) ^ 1  # the first round finds every stage free
        mbarrier.wait(empty.index(stage), free_phase)
        bar = ready.index(stage)
        mbarrier.expect(bar, k_bytes)
        k_stage = k_ring.index(stage)
        rows = ()  # the blocks' descriptor rows, extracted once for the keys' and the values' copies
        for b in gl.static_range(NB):
            rows = rows + (gl.sum(gl.where(offs == b, ids, 0), axis=0) * row_pitch,)
            tma.async_copy_global_to_shared(k_desc, [rows[b], col], bar, k_stage.slice(b * BLOCK_SIZE, BLOCK_SIZE))
        if K8:  # the tile's key scales, with its keys
            tma.async_copy_global_to_shared(ks_desc, [ks_first + j * TILE], bar, ks_ring.index(stage))
        mbarrier.wait(empty.index(STAGES + stage), free_phase)
        bar = ready.index(STAGES + stage)
        mbarrier.expect(bar, v_bytes)
        v_stage = v_ring.index(stage)
        for b in gl.static_range(NB):
            tma.async_copy_global_to_shared(v_desc, [rows[b], col], bar, v_stage.slice(b * BLOCK_SIZE, BLOCK_SIZE))
        idx = (j + 1) * NB + offs
        ids = gl.load(bt_row + idx, mask=idx < n_blocks, other=past_end)


@gluon.jit
def _softmax_tile(s, j, n_full, seq_len, q_pos, s_cols, m_i, l_i, qk_scale, CAUSAL: gl.constexpr, TILE: gl.constexpr):
    """Online softmax of score tile ``j`` ``[ROWS, TILE]`` (``qk_scale``: per row, log2 units):
    masked where tile ``j`` crosses the causal edge or the sequence's end; returns the
    probabilities, the accumulator's rescale ``alpha`` and the new running max and sum (log2 units)."""
    if j >= n_full:
        k_pos = j * TILE + s_cols
        keep = (k_pos < seq_len)[None, :]
        if CAUSAL:
            keep = keep & (k_pos[None, :] <= q_pos[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = gl.exp2(s * qk_scale[:, None] - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _zero_tail(v_tile, j, seq_len, TILE: gl.constexpr, layout: gl.constexpr):
    """Value rows of tile ``j`` past the sequence's end set to zero in shared memory."""
    rows = j * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, layout))
    v = v_tile.load(layout)
    v_tile.store(gl.where((rows < seq_len)[:, None], v, 0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _rni_s8(x):
    """``x`` (fp32, within +-127) rounded to the nearest integer (ties to even), as int8."""
    r = gl.inline_asm_elementwise(asm="cvt.rni.s32.f32 $0, $1;", constraints="=r,r", args=[x], dtype=gl.int32,
                                  is_pure=True, pack=1)
    return r.to(gl.int8)


@gluon.jit
def _load_scales(ks_ring, stage, layout: gl.constexpr, K8: gl.constexpr):
    """With ``K8`` the key scales of ring stage ``stage``, as the score tile's columns; else 0."""
    if K8:
        return ks_ring.index(stage).load(layout)
    else:
        return 0.0


@gluon.jit
def _scores(s, ks, K8: gl.constexpr):
    """Tile scores from the MMA's accumulator: with ``K8`` the int32 sums of int8 codes as fp32
    times each key's scale (the row's query scale is applied with the softmax scale), else ``s``."""
    if K8:
        # |s| < 2^22 (127 x 15 x 256): s in the low mantissa bits of f = 1.5 x 2^23 + s, exact; then
        # (f - 1.5 x 2^23) x ks as one FMA with 1.5 x 2^23 x ks rounded once per key (an offset of at
        # most 0.75 x ks, the same for every row: far under the query's int8 rounding)
        f = (s + 0x4B400000).to(gl.float32, bitcast=True)
        return f * ks[None, :] - (ks * 12582912.0)[None, :]
    else:
        return s


@gluon.jit
def _consumer(q_ptr, out_ptr, ks_ring, q_smem, o_smem, k_ring, v_ring, ready, empty, n_tiles, n_full, seq_len, q_start,
              q_len, q_block, ctx_before, kv_head, qk_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
              GROUP: gl.constexpr, HEAD: gl.constexpr, BLOCK_Q: gl.constexpr, TILE: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, K8: gl.constexpr, ROW0: gl.constexpr):
    """One warpgroup: rows ``ROW0 .. ROW0 + 63`` of the program's query tile over every tile.
    ``K8``: int8 keys, their scales in ``ks_ring`` beside them; the query rows are quantized to
    int8 here, one scale per row, and the scores are int8 MMAs."""
    KSTEP: gl.constexpr = 32 if K8 else 16  # the MMA's K per instruction: 32 one-byte or 16 two-byte elements
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE, KSTEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = v_ring.dtype      # the values' and probabilities' 16-bit type

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout)) + ROW0
    dims = gl.arange(0, HEAD, layout=gl.SliceLayout(0, io_layout))
    q_local = q_block * BLOCK_Q + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    tok = (q_start + q_local).to(gl.int64)
    head = kv_head * GROUP + rows % GROUP
    q = gl.load(q_ptr + (tok * stride_q_t + head * stride_q_h)[:, None] + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    q_mine = q_smem.slice(ROW0, ROWS)
    if K8:  # symmetric per-row int8: q = q8 * amax / 127, the row's scale (with qk_scale) kept for the scores
        qf = q.to(gl.float32)
        amax = gl.max(gl.abs(qf), 1)
        inv = gl.where(amax > 0, 127.0 / amax, 0.0)
        q_mine.store(_rni_s8(qf * inv[:, None]))
        sm_scale = gl.convert_layout(amax * (qk_scale / 127.0), gl.SliceLayout(1, s_layout))
    else:
        q_mine.store(q.to(dtype))
        sm_scale = gl.full([ROWS], qk_scale, gl.float32, layout=gl.SliceLayout(1, s_layout))
    fence_async_shared()
    gl.thread_barrier()

    s_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) + ROW0
    q_pos = ctx_before + q_block * BLOCK_Q + s_rows // GROUP
    s_cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, TILE], gl.int32 if K8 else gl.float32, layout=s_layout)

    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_mine, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    ks = _load_scales(ks_ring, 0, gl.SliceLayout(0, s_layout), K8)
    mbarrier.arrive(empty.index(0), count=1)
    s = _scores(s, ks, K8)
    p, alpha, m_i, l_i = _softmax_tile(s, 0, n_full, seq_len, q_pos, s_cols, m_i, l_i, sm_scale, CAUSAL, TILE)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(ready.index(STAGES + prev), ((j - 1) // STAGES) & 1)
        if j * TILE > seq_len:
            _zero_tail(v_ring.index(prev), j - 1, seq_len, TILE, io_layout)
        s_tok = warpgroup_mma(q_mine, k_ring.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        ks = _load_scales(ks_ring, stage, gl.SliceLayout(0, s_layout), K8)
        mbarrier.arrive(empty.index(stage), count=1)  # this warpgroup is done with tile j's keys (and scales)
        s = _scores(s, ks, K8)
        p, alpha, m_i, l_i = _softmax_tile(s, j, n_full, seq_len, q_pos, s_cols, m_i, l_i, sm_scale, CAUSAL, TILE)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
        mbarrier.arrive(empty.index(STAGES + prev), count=1)  # and with tile j - 1's values
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(ready.index(STAGES + last), ((n_tiles - 1) // STAGES) & 1)
    if n_tiles * TILE > seq_len:
        _zero_tail(v_ring.index(last), n_tiles - 1, seq_len, TILE, io_layout)
    acc = warpgroup_mma(p_op, v_ring.index(last), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    mbarrier.arrive(empty.index(STAGES + last), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = gl.where(l_o[:, None] > 0, acc / l_o[:, None], 0.0)
    # the rows go out through shared memory as the output's type: this warpgroup's query slice
    # (its last score MMA has completed; no layout-conversion scratch, which would not fit beside 3
    # stages), or with int8 queries a 16-bit buffer of its own (the keys' ring is half as large)
    out_ty: gl.constexpr = out_ptr.dtype.element_ty
    o_mine = o_smem._reinterpret(out_ty, [2 * ROWS, HEAD], o_smem.layout).slice(ROW0, ROWS)
    o_mine.store(o.to(out_ty))
    gl.thread_barrier()
    o = o_mine.load(io_layout)
    gl.store(out_ptr + (tok * stride_o_t + head * stride_o_h)[:, None] + dims[None, :], o, mask=row_ok[:, None])


@gluon.jit
def _prefill_wgmma_kernel(
    q_ptr, k_desc, v_desc, out_ptr,         # q, out [T, Hq, HEAD]; k_desc / v_desc: 2D [rows, Hkv * HEAD], boxes [BLOCK_SIZE, HEAD]
    ks_desc,                                # K8: 1D over the key scales, [Hkv, num_seqs x ks_seq] fp32 flat, boxes [TILE]
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    qk_scale,                               # softmax_scale * log2(e)
    num_seqs, q_block_base,
    past_end,                               # a block id whose rows lie past the descriptors' ends
    row_pitch,                              # descriptor rows from one cache block to the next
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_bt_s,
    stride_ks_h, ks_seq,                    # K8: key scales from one KV head / sequence to the next
    GROUP: gl.constexpr, HEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
    TILE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    K8: gl.constexpr = False,               # int8 keys (INT4 codes c - zp) and their scales (ks_desc)
):
    """Grid ``(q blocks - q_block_base + num_seqs, num_kv_heads)``, as ``prefill_2d._attn_kernel``
    without segments, the first axis in reverse: program ``(i, h)`` attends q block
    ``n - 1 - i + q_block_base`` (``n`` the first axis's size; ``BLOCK_Q`` tokens of one
    sequence) over KV head ``h`` and writes its rows of ``out``; a block past its sequence's
    queries returns at once. ``CONSUMER_REGS``: registers per consumer thread."""
    # the last q blocks first: under a causal mask a sequence's last blocks see the most keys, so
    # the longest programs start in the first wave rather than trail in the last
    q_block_global = gl.num_programs(0) - 1 - gl.program_id(0) + q_block_base
    kv_head = gl.program_id(1)
    seq_idx = find_seq_idx(cu_seqlens_q_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = gl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = gl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = gl.load(seqused_k_ptr + seq_idx)
    ctx_before = seq_len - q_len            # the queries are the sequence's last q_len tokens
    q_pos_lo = ctx_before + q_block * BLOCK_Q
    if CAUSAL:
        k_hi = gl.minimum(seq_len, ctx_before + gl.minimum((q_block + 1) * BLOCK_Q, q_len))
        n_full = gl.minimum(q_pos_lo + 1, seq_len) // TILE  # tiles every row sees whole
    else:
        k_hi = seq_len
        n_full = seq_len // TILE
    n_tiles = gl.cdiv(k_hi, TILE)
    bt_row = block_table_ptr + seq_idx.to(gl.int64) * stride_bt_s

    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * ROWS, HEAD], k_desc.layout)
    if K8:
        o_smem = gl.allocate_shared_memory(v_desc.dtype, [2 * ROWS, HEAD], v_desc.layout)
    else:
        o_smem = q_smem
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, TILE, HEAD], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, TILE, HEAD], v_desc.layout)
    if K8:
        ks_ring = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], ks_desc.layout)
    else:
        ks_ring = q_smem
    ks_first = kv_head * stride_ks_h + seq_idx * ks_seq
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup

    # the default partition (the launch's 4 warps) is consumer 0, the workers consumer 1 (4 warps) and
    # the producer (1 warp); each argument tuple is written out whole (a tuple built by concatenation
    # does not keep its constexprs constant in Triton 3.6's frontend)
    gl.warp_specialize([
        (_consumer, (q_ptr, out_ptr, ks_ring, q_smem, o_smem, k_ring, v_ring, ready, empty, n_tiles, n_full, seq_len,
                     q_start, q_len, q_block, ctx_before, kv_head, qk_scale, stride_q_t, stride_q_h, stride_o_t,
                     stride_o_h, GROUP, HEAD, BLOCK_Q, TILE, STAGES, CAUSAL, K8, 0)),
        (_consumer, (q_ptr, out_ptr, ks_ring, q_smem, o_smem, k_ring, v_ring, ready, empty, n_tiles, n_full, seq_len,
                     q_start, q_len, q_block, ctx_before, kv_head, qk_scale, stride_q_t, stride_q_h, stride_o_t,
                     stride_o_h, GROUP, HEAD, BLOCK_Q, TILE, STAGES, CAUSAL, K8, ROWS)),
        (_producer, (k_desc, v_desc, ks_desc, k_ring, v_ring, ks_ring, ready, empty, bt_row, past_end, row_pitch,
                     kv_head * HEAD, ks_first, n_tiles, seq_len, BLOCK_SIZE, TILE, STAGES, K8)),
    ], [4, 1], [CONSUMER_REGS, 24])
