"""Paged attention kernel for unquantized, INT8 and FP8 per-token-head caches.

One kernel serves the 2D path (prefill, mixed batches) and the split-KV path (decode): a
program owns a tile of ``BLOCK_M`` query rows = ``BLOCK_Q`` tokens x the ``GROUP`` query heads
sharing one KV head, so every K/V byte it loads feeds all heads of the group (GQA/MQA).
"""

from __future__ import annotations

import torch
import triton.language as tl

from layouts import KVQuantMode

from .._jit import dual_jit, interpreting
from .call import kv_align
from .common import (DOT_BF16, DOT_FP16, DOT_FP32, LOG2E, apply_softcap, full_tiles, int8_to_dot, mask_scores,
                     pdl_release, q_block_program, to_dot)
from .plan import Rotate
from . import prefill_wgmma
from .prefill_2d_int4 import _attn_int4_kernel
from .rotate_query import rotated_query


# Grid: (num_tokens // BLOCK_Q - q_block_base + num_seqs, num_kv_heads, NUM_SEGMENTS), program 0 at q block
# q_block_base (the chunk half of a mixed call starts after the decode rows). One program: one q
# tile of one sequence x one KV head x one segment of the visible keys, streamed TILE keys at a
# time with an online softmax. Scores: S = (q . codes) * k_scale[column] (the per-token scale
# scales score columns, never elements); P is multiplied by v_scale / max(v_scale) per column
# before the P.V dot and the dot's result by max(v_scale), so fp16 operands never underflow.
# SPLIT: write the unnormalised accumulator, running max (log2 units) and sum per segment;
# a reduction kernel combines them. Otherwise normalise and write ``out``.
@dual_jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr,            # q [T, Hq, D]; k, v [num_blocks, block_size, Hkv, D]
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] fp32 (unused for NONE)
    out_ptr,                        # out [T, Hq, D] or segm_output [T, Hq, NUM_SEGMENTS, HEAD_PAD]
    segm_max_ptr, segm_sum_ptr,     # [T, Hq, NUM_SEGMENTS] fp32 (SPLIT only)
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    softmax_scale, softcap, window_left, window_right, num_seqs, q_block_base,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_v_b, stride_v_s, stride_v_h, stride_v_d,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_o_t, stride_o_h, stride_o_d,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    SCALED: tl.constexpr,           # per-token-head scales present (INT8 / FP8)
    IS_INT8: tl.constexpr, DOT: tl.constexpr,
    CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    KV_ALIGN: tl.constexpr,         # K/V strides arrive divided by this (so loads vectorise)
    PDL: tl.constexpr,              # launched with launch_pdl (waits in its prologue)
    MASK_EDGES: tl.constexpr = False,  # mask only the tiles that cross the causal / window / length edges
    OFFS_I64: tl.constexpr = True,     # K/V element offsets need int64 (else int32 address math)
    SAME_KV_STRIDES: tl.constexpr = False,  # K and V share every stride: one offset tensor serves both
    RELEASE: tl.constexpr = False,  # let the reduction be scheduled at the start (Plan.reduce_early)
):
    kv_head, seg_idx, seq_idx, has_rows, tok, head, row_ok, q_pos, k_lo, k_hi, t0, t1 = q_block_program(
        cu_seqlens_q_ptr, seqused_k_ptr, num_seqs, q_block_base, window_left, window_right, CAUSAL, BLOCK_Q, BLOCK_M,
        GROUP, TILE, NUM_SEGMENTS, PDL)
    if RELEASE:  # the grid is resident at once: the reduction's programs wait in their own pdl_enter
        pdl_release(PDL)
    if not has_rows:
        return

    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE)
    d_ok = offs_d < HEAD

    # q: [BLOCK_M, HEAD_PAD]
    q = tl.load(q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = to_dot(q, DOT)
    if USE_SOFTCAP:
        qk_scale = softmax_scale
    else:
        qk_scale = softmax_scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s
    f0 = t0  # [f0, f1): the tiles no row needs masked (MASK_EDGES), else none
    f1 = t0
    if MASK_EDGES:
        f0, f1 = full_tiles(q_pos, row_ok, k_lo, k_hi, t0, t1, window_left, window_right, CAUSAL, TILE)
    # The part of every K/V element's offset that does not depend on the key's block, computed
    # once: tiles start at a multiple of BLOCK_SIZE when TILE is one, so column n of every tile
    # sits in slot n % BLOCK_SIZE of the tile's block n // BLOCK_SIZE.
    slot_t = offs_t % BLOCK_SIZE
    k_in = slot_t[:, None] * (stride_k_s * KV_ALIGN) + kv_head * (stride_k_h * KV_ALIGN) + offs_d[None, :] * stride_k_d
    if SAME_KV_STRIDES:
        v_in = k_in
    else:
        v_in = slot_t[:, None] * (stride_v_s * KV_ALIGN) + kv_head * (stride_v_h * KV_ALIGN) \
            + offs_d[None, :] * stride_v_d
    for t in range(t0, t1):
        k_pos = t * TILE + offs_t
        n_ok = (k_pos < k_hi) & (k_pos >= k_lo)
        if TILE % BLOCK_SIZE == 0:
            slot = slot_t
            blk = tl.load(bt_row + (t * (TILE // BLOCK_SIZE) + offs_t // BLOCK_SIZE), mask=n_ok, other=0)
        else:
            slot = k_pos % BLOCK_SIZE
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0)
        if OFFS_I64:  # else every K/V element offset fits in int32 (the launcher checks)
            blk = blk.to(tl.int64)
        # k, v: [TILE, HEAD_PAD] gathers of TILE rows (K enters the dot transposed in shared memory)
        if TILE % BLOCK_SIZE == 0:
            k_off = blk[:, None] * (stride_k_b * KV_ALIGN) + k_in
            v_off = blk[:, None] * (stride_v_b * KV_ALIGN) + v_in
        else:
            k_off = blk[:, None] * (stride_k_b * KV_ALIGN) + slot[:, None] * (stride_k_s * KV_ALIGN) \
                + kv_head * (stride_k_h * KV_ALIGN) + offs_d[None, :] * stride_k_d
            v_off = blk[:, None] * (stride_v_b * KV_ALIGN) + slot[:, None] * (stride_v_s * KV_ALIGN) \
                + kv_head * (stride_v_h * KV_ALIGN) + offs_d[None, :] * stride_v_d
        if SAME_KV_STRIDES:
            v_off = k_off
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + v_off, mask=kv_ok, other=0.0)
        if IS_INT8:
            k = int8_to_dot(k, DOT)
            v = int8_to_dot(v, DOT)
        else:
            k = to_dot(k, DOT)
            v = to_dot(v, DOT)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, TILE] fp32
        # s_scale: the factor still to apply to s (log2 units); unscaled scores fold it into
        # the exp2's FMA (and the row max), scaled or soft-capped ones are scaled here
        if SCALED:
            ks = tl.load(k_scale_ptr + blk * stride_ks_b + slot * stride_ks_s + kv_head * stride_ks_h,
                         mask=n_ok, other=0.0)
            s = s * (ks * qk_scale)[None, :]
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if USE_SOFTCAP:
            s = apply_softcap(s * s_scale, softcap) * LOG2E
            s_scale = 1.0
        s = mask_scores(s, t, f0, f1, q_pos, k_pos, k_hi, n_ok, window_left, window_right, CAUSAL, MASK_EDGES)
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)  # s_scale > 0: the max commutes with it
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s * s_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SCALED:
            vs = tl.load(v_scale_ptr + blk * stride_vs_b + slot * stride_vs_s + kv_head * stride_vs_h,
                         mask=n_ok, other=0.0)
            vs_max = tl.maximum(tl.max(vs, 0), 1e-30)
            p = p * (vs / vs_max)[None, :]
            acc = acc * alpha[:, None] + tl.dot(to_dot(p, DOT), v) * vs_max
        else:
            acc = acc * alpha[:, None] + tl.dot(to_dot(p, DOT), v)
        m_i = m_new

    if SPLIT:
        row = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg_idx
        tl.store(out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(segm_max_ptr + row, m_i, mask=row_ok)
        tl.store(segm_sum_ptr + row, l_i, mask=row_ok)
    else:
        o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # no visible key -> 0 (as the oracle)
        tl.store(out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


OFFS_I32_MAX = 2 ** 31 - 1  # K/V/scale element offsets up to this are computed in int32 (OFFS_I64 off)


# Register caps (per thread) that let two programs of a tiling share an H200 SM (65,536 registers):
# (block_m, tile, num_warps) -> cap, for 16-bit caches (bf16 / fp16 and dequant_first) of head size
# <= 128. sm_90 SASS (triton 3.6): 128 x 32 with 8 warps compiles to 158 registers uncapped (one
# program per SM) and to 128 with no spill and the same wgmma issue under the cap.
REG_CAPS = {(128, 32, 8): 128}


def reg_cap(tiling, mode: KVQuantMode, head_pad: int):
    """The :data:`REG_CAPS` entry ``_attn_kernel`` compiles under for ``tiling`` over a cache of
    ``mode`` (after any dequant_first conversion) and padded head size ``head_pad``, else None."""
    if mode != KVQuantMode.NONE or head_pad > 128:
        return None
    return REG_CAPS.get((tiling.block_m, tiling.tile, tiling.num_warps))


def max_offset(x: torch.Tensor) -> int:
    """Largest element offset from ``x``'s first element to any of its elements."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0)


INT4_ROT_WHOLE = 128  # largest head size whose in-kernel INT4 rotations take the whole head at once


def launch_2d(call, plan) -> None:
    """Launch the 2D kernel (``_attn_kernel``, or ``prefill_2d_int4._attn_int4_kernel`` on INT4
    caches) on ``call``: grid (q tiles, KV heads, segments); with more than one segment it writes
    ``call``'s segment buffers (allocated), else ``call.out``. A ``Tiling.dequant_first`` plan
    arrives as the call over its 16-bit scratch cache (``run.run_plan`` converted it). INT4 with
    ``plan.rotate`` TRITON / GLUON: the query is rotated first (``rotate_query``) and the kernel
    reads it (``Q_ROTATED``)."""
    tiling = plan.tiling
    if tiling.wgmma:
        return prefill_wgmma.launch(call, plan)
    q, k, v, out = call.q, call.k, call.v, call.out
    num_tokens, num_q_heads = q.shape[:2]
    num_seqs = call.num_seqs
    split = tiling.num_segments > 1
    block_q = tiling.block_m // call.group
    align = kv_align(k, v)
    if interpreting(q):
        dot = DOT_FP32.value
    elif call.mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        dot = DOT_FP16.value  # int8 / e4m3 codes convert exactly and cheaply to fp16
    elif call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and call.head_size < 128:
        # 32-wide nibble halves: the 16-bit dots of the INT4 kernel compile wrong on sm_90 (wrong
        # scores, out-of-bounds reads; tests/test_attention_kernels.py's CUDA cases show it), so
        # its dots take fp32 operands, as 3 tf32 products each (F32_PREC): one tf32 product
        # truncates the rotated query and the probabilities to 10 mantissa bits, and over 8k keys
        # that measured 1.9e-2 relative L2 on the H200 (tf32x3: 1.6e-3)
        dot = DOT_FP32.value
    else:  # the rows' 16-bit type (an fp16 scratch under a bf16 query: the query converts as it loads)
        rows = k.dtype if k.element_size() == 2 else q.dtype
        dot = (DOT_BF16 if rows == torch.bfloat16 else DOT_FP16).value
    ks, vs = call.ks, call.vs
    base = call.first_token // block_q  # the q block that cu_seqlens_q[0] falls in (host int, no sync)
    grid = (num_tokens // block_q - base + num_seqs, k.shape[2], tiling.num_segments)
    common = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, k_scale_ptr=ks, v_scale_ptr=vs, out_ptr=call.segm_output if split else out,
        segm_max_ptr=call.segm_max if split else out, segm_sum_ptr=call.segm_expsum if split else out,
        block_table_ptr=call.block_table, cu_seqlens_q_ptr=call.cu_seqlens_q.contiguous(),
        seqused_k_ptr=call.seqused_k.contiguous(),
        softmax_scale=call.softmax_scale, softcap=call.softcap,
        window_left=int(call.window_size[0]), window_right=int(call.window_size[1]), num_seqs=num_seqs,
        q_block_base=base,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align,
        stride_k_h=k.stride(2) // align, stride_k_d=k.stride(3),
        stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align,
        stride_v_h=v.stride(2) // align, stride_v_d=v.stride(3),
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_bt_s=call.block_table.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=call.group, HEAD=call.head_size, BLOCK_SIZE=k.shape[1],
        BLOCK_Q=block_q, BLOCK_M=tiling.block_m, TILE=tiling.tile, DOT=dot,
        CAUSAL=call.causal, USE_SOFTCAP=call.softcap > 0,
        SPLIT=split, NUM_SEGMENTS=tiling.num_segments, KV_ALIGN=align, PDL=plan.pdl, launch_pdl=plan.pdl,
        MASK_EDGES=tiling.mask_edges_only,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        rotated = plan.rotate in (Rotate.TRITON, Rotate.GLUON)
        if rotated:  # [num_tokens, num_q_heads, head_size] fp32, softmax_scale folded in
            qr, _ = rotated_query(call, plan)
            common.update(q_ptr=qr, stride_q_t=qr.stride(0), stride_q_h=qr.stride(1), stride_q_d=qr.stride(2))
        # above head_size 128 the fp32 Hadamard operands of the in-kernel rotations would need
        # 256 KiB of shared memory at once (more than an H200 has): chunks of 64 dims instead
        prec = "tf32x3" if dot == DOT_FP32.value and not interpreting(q) else None
        _attn_int4_kernel[grid](signs_ptr=call.signs, Q_ROTATED=rotated, CODE_ZP=tiling.code_zp, F32_PREC=prec,
                                ASM=tiling.code_asm and not interpreting(q) and dot != DOT_FP32.value,  # 16-bit only
                                ROT_CHUNK=0 if call.head_size <= INT4_ROT_WHOLE else 64, **common)
    else:
        cap = tiling.max_registers or reg_cap(tiling, call.mode, call.head_pad)  # a tiling's own cap wins
        if cap and not interpreting(q):
            common.update(maxnreg=cap)
        _attn_kernel[grid](HEAD_PAD=call.head_pad, SCALED=call.mode.per_token_head,
                           OFFS_I64=max(max_offset(x) for x in (k, v, ks, vs)) > OFFS_I32_MAX,
                           SAME_KV_STRIDES=k.stride() == v.stride(),
                           IS_INT8=call.mode == KVQuantMode.INT8_PER_TOKEN_HEAD, RELEASE=plan.reduce_early, **common)
