"""Dequantize the blocks a 2D call reads into a scratch cache, so the unquantized 2D kernel runs on it.

A prefill chunk of ``q_len`` tokens is read by ``q_len / BLOCK_Q`` programs per KV head, and
each of them converts every code of the context it reads: the conversion is paid once per query
tile. Converting the context once per call instead (``Tiling.dequant_first``) costs one read of
the quantized blocks and one write of 16-bit rows; the attention then runs at the unquantized
kernel's speed. Worth it where query tiles per sequence are many (long chunks), not for decode
rows (``plan._prefill_tiling`` decides).

Rows are dequantized to the original domain: INT8 / FP8 ``c * scale``; INT4 ``(c - zp) * scale``
is the rotated row, inverse-rotated here (``s * (H r) / d``, the 2D INT4 kernel's epilogue
applied per key), so the scratch is an ordinary 16-bit cache. It is fp16, and the query is
read as fp16 (a copy when it is bf16): the operand type of the fused INT8 / FP8 kernels' dots.
bf16 rows would round every key and value to 8 bits of mantissa, fp16 keeps 11: on the prefill
benchmark's random codes bf16 rows measured 4.9e-3 / 8.0e-3 relative L2 (INT8 / FP8) against
the oracle where the fused kernels reach 1.7e-3. The price is fp16's range: a dequantized
element beyond 65,504 becomes inf, as in an fp16 cache. Under the interpreter the scratch is
fp32 (its 16-bit rounding is not the GPU's).

Memory: :func:`scratch_bytes` (K and V rows of ``num_seqs * blocks_per_seq`` blocks, plus the
fp16 query); allocated per call from torch's caching allocator; the planner caps it
(``Tuning.dequant_max_bytes``) and runs the fused kernel above the cap.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from layouts import KVQuantMode

from .._jit import cdiv, dual_jit, interpreting, next_pow2
from .call import kv_align
from .common import hadamard_sign

MODE_INT8 = tl.constexpr(1)
MODE_FP8 = tl.constexpr(2)
MODE_INT4 = tl.constexpr(3)
DEQUANT_BLOCKS = 32  # table entries per program: the INT4 rotation operands are generated once for these
_MODES = {KVQuantMode.INT8_PER_TOKEN_HEAD: MODE_INT8.value, KVQuantMode.FP8_PER_TOKEN_HEAD: MODE_FP8.value,
          KVQuantMode.INT4_PER_TOKEN_HEAD: MODE_INT4.value}


@triton.jit
def _dequant_rows(src, scale_ptr, rows, r_ok, g_even, g_odd, stride_s, stride_d, stride_ss,
                  HEAD: tl.constexpr, MODE: tl.constexpr):
    """``[ROWS, HEAD]`` fp32 rows of one block and head (``src`` at slot 0, slots ``rows``);
    INT4: ``g_even`` / ``g_odd`` [HEAD // 2, HEAD] are the inverse rotation's operands."""
    offs_d = tl.arange(0, HEAD)
    bits = tl.load(scale_ptr + rows * stride_ss, mask=r_ok, other=0)
    if MODE == MODE_INT4:
        HALF: tl.constexpr = HEAD // 2
        offs_h = tl.arange(0, HALF)
        b = tl.load(src + rows[:, None] * stride_s + offs_h[None, :] * stride_d, mask=r_ok[:, None], other=0)
        zp = (bits & 0xF).to(tl.float32)[:, None]
        sc = (bits & -16).to(tl.float32, bitcast=True)[:, None]
        lo = ((b & 0xF).to(tl.float32) - zp) * sc  # rotated dims 2i: [ROWS, HALF]
        hi = ((b >> 4).to(tl.float32) - zp) * sc   # rotated dims 2i + 1
        x = tl.dot(lo, g_even)
        x = tl.dot(hi, g_odd, x)
    else:
        c = tl.load(src + rows[:, None] * stride_s + offs_d[None, :] * stride_d, mask=r_ok[:, None], other=0.0)
        x = c.to(tl.float32) * bits.to(tl.float32, bitcast=True)[:, None]
    return x


# Grid: (num_seqs * cdiv(blocks_per_seq, BLOCKS), num_kv_heads). One program: BLOCKS consecutive
# entries of one sequence's block table, one KV head, K and V; the INT4 inverse rotation's
# operands are generated once per program (per block they would cost more than the rows).
# Blocks past the sequence's length are skipped (never read downstream).
@dual_jit
def _dequant_blocks_kernel(
    k_ptr, v_ptr,                   # [num_blocks, block_size, Hkv, data_head_size] codes
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] int32 bits (fp32 scale; INT4: | zp)
    signs_ptr,                      # [HEAD] fp32 rotation signs (INT4)
    block_table_ptr, seqused_k_ptr,
    k_out_ptr, v_out_ptr,           # [num_seqs * blocks_per_seq, block_size, Hkv, HEAD], written
    blocks_per_seq, groups_per_seq,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_v_b, stride_v_s, stride_v_h, stride_v_d,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt_s,
    NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,             # next_pow2(BLOCK_SIZE), at least 16 (a dot's smallest M)
    BLOCKS: tl.constexpr,           # table entries per program
    MODE: tl.constexpr,
    KV_ALIGN: tl.constexpr,         # K/V block/slot/head strides arrive divided by this (vector loads)
):
    seq_idx = tl.program_id(0) // groups_per_seq
    j0 = (tl.program_id(0) % groups_per_seq) * BLOCKS
    kv_head = tl.program_id(1)
    seq_blocks = tl.minimum((tl.load(seqused_k_ptr + seq_idx) + BLOCK_SIZE - 1) // BLOCK_SIZE, blocks_per_seq)
    rows = tl.arange(0, ROWS)
    r_ok = rows < BLOCK_SIZE
    offs_d = tl.arange(0, HEAD)
    if MODE == MODE_INT4:
        # x[j] = s[j] / d * sum_k H[j, k] r[k], k = 2i (low nibbles) or 2i + 1 (high)
        offs_h = tl.arange(0, HEAD // 2)
        signs = tl.load(signs_ptr + offs_d) / HEAD
        g_even = hadamard_sign(2 * offs_h[:, None], offs_d[None, :]) * signs[None, :]  # [HALF, HEAD]
        g_odd = hadamard_sign(2 * offs_h[:, None] + 1, offs_d[None, :]) * signs[None, :]
    else:
        g_even = 0.0
        g_odd = 0.0
    for j in range(j0, tl.minimum(j0 + BLOCKS, seq_blocks)):
        blk = tl.load(block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s + j).to(tl.int64)
        out = ((seq_idx * blocks_per_seq + j).to(tl.int64) * BLOCK_SIZE + rows[:, None]) * (NUM_KV_HEADS * HEAD) \
            + kv_head * HEAD + offs_d[None, :]
        k = _dequant_rows(k_ptr + blk * (stride_k_b * KV_ALIGN) + kv_head * (stride_k_h * KV_ALIGN),
                          k_scale_ptr + blk * stride_ks_b + kv_head * stride_ks_h, rows, r_ok, g_even, g_odd,
                          stride_k_s * KV_ALIGN, stride_k_d, stride_ks_s, HEAD, MODE)
        tl.store(k_out_ptr + out, k.to(k_out_ptr.dtype.element_ty), mask=r_ok[:, None])
        v = _dequant_rows(v_ptr + blk * (stride_v_b * KV_ALIGN) + kv_head * (stride_v_h * KV_ALIGN),
                          v_scale_ptr + blk * stride_vs_b + kv_head * stride_vs_h, rows, r_ok, g_even, g_odd,
                          stride_v_s * KV_ALIGN, stride_v_d, stride_vs_s, HEAD, MODE)
        tl.store(v_out_ptr + out, v.to(v_out_ptr.dtype.element_ty), mask=r_ok[:, None])


def reads(call) -> bool:
    """Whether :func:`dequantized_call` serves ``call``: a per-token-head mode and a power-of-two
    head size (its row tiles are powers of two)."""
    head = call.head_size
    return call.mode in _MODES and head >= 16 and head & (head - 1) == 0


def _blocks_per_seq(call) -> int:
    return min(call.block_table.shape[1], cdiv(call.max_seqlen_k, call.k.shape[1]))


def _scratch_dtype(call, interpreted: bool) -> torch.dtype:
    return torch.float32 if interpreted else torch.float16


def scratch_bytes(call, interpreted: bool = False) -> int:
    """Bytes :func:`dequantized_call` allocates for ``call``: K and V rows of ``num_seqs *
    blocks_per_seq`` blocks (``blocks_per_seq`` from ``max_seqlen_k``), fp16 (fp32 when
    ``interpreted``), and an fp16 copy of a bf16 query."""
    k = call.k
    rows = call.num_seqs * _blocks_per_seq(call) * k.shape[1] * k.shape[2]
    size = _scratch_dtype(call, interpreted).itemsize
    q_copy = 0 if interpreted or call.q.dtype == torch.float16 else call.q.numel() * 2
    return 2 * rows * call.head_size * size + q_copy


def dequantized_call(call):
    """``call`` over a quantized cache -> the same call over a scratch unquantized cache holding
    every block its sequences read (``[num_seqs * blocks_per_seq, block_size, num_kv_heads,
    head_size]`` fp16; fp32 under the interpreter) with an identity block table, its query fp16
    (a copy of a bf16 one; ``out`` is the caller's); mode NONE. Launches
    :func:`_dequant_blocks_kernel` on the current stream (no host sync)."""
    k, v, ks, vs = call.k, call.v, call.ks, call.vs
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    per_seq = _blocks_per_seq(call)
    num_seqs = call.num_seqs
    interpreted = interpreting(call.q)
    dtype = _scratch_dtype(call, interpreted)
    shape = (num_seqs * per_seq, block_size, num_kv_heads, call.head_size)
    k_out = torch.empty(shape, dtype=dtype, device=k.device)
    v_out = torch.empty(shape, dtype=dtype, device=k.device)
    ksb, vsb = ks.view(torch.int32), vs.view(torch.int32)
    align = kv_align(k, v)
    signs = call.signs if call.signs is not None else ksb  # unread outside INT4
    groups = cdiv(per_seq, DEQUANT_BLOCKS)
    if num_seqs * per_seq > 0:
        _dequant_blocks_kernel[(num_seqs * groups, num_kv_heads)](
            k_ptr=k, v_ptr=v, k_scale_ptr=ksb, v_scale_ptr=vsb, signs_ptr=signs,
            block_table_ptr=call.block_table, seqused_k_ptr=call.seqused_k.contiguous(),
            k_out_ptr=k_out, v_out_ptr=v_out, blocks_per_seq=per_seq, groups_per_seq=groups,
            stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align, stride_k_h=k.stride(2) // align,
            stride_k_d=k.stride(3),
            stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align, stride_v_h=v.stride(2) // align,
            stride_v_d=v.stride(3),
            stride_ks_b=ksb.stride(0), stride_ks_s=ksb.stride(1), stride_ks_h=ksb.stride(2),
            stride_vs_b=vsb.stride(0), stride_vs_s=vsb.stride(1), stride_vs_h=vsb.stride(2),
            stride_bt_s=call.block_table.stride(0),
            NUM_KV_HEADS=num_kv_heads, HEAD=call.head_size, BLOCK_SIZE=block_size,
            ROWS=max(16, next_pow2(block_size)), BLOCKS=DEQUANT_BLOCKS, MODE=_MODES[call.mode], KV_ALIGN=align,
            num_warps=4)
    table = torch.arange(num_seqs * per_seq, dtype=torch.int32, device=k.device).view(num_seqs, per_seq)
    dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=k.device)
    q = call.q if interpreted else call.q.to(torch.float16)  # the 2D kernel's dots take q's type
    return dataclasses.replace(call, q=q, k=k_out, v=v_out, ks=dummy, vs=dummy, block_table=table, signs=None,
                               mode=KVQuantMode.NONE)
