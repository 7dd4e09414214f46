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
(``Tuning.dequant_max_bytes``): above the cap the call is dequantized and attended for groups of
KV heads in turn (``Tiling.dequant_groups``, one group's scratch at a time), and only where one
KV head's scratch exceeds it does the fused kernel run.
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
_MODES = {KVQuantMode.INT8_PER_TOKEN_HEAD: MODE_INT8.value, KVQuantMode.FP8_PER_TOKEN_HEAD: MODE_FP8.value,
          KVQuantMode.INT4_PER_TOKEN_HEAD: MODE_INT4.value}
TILE_ELEMS = 4096   # output elements per row tile: 32 fp32 values a thread at 4 warps, K and V in flight without spills
# INT4: H_HEAD r = (H_NCH (x) H_DOT_ROT) r: a butterfly over the NCH = HEAD / DOT_ROT chunks of the
# row, then one dot per chunk with the order-32 matrix (K = 16 nibbles, the smallest fp16 MMA):
# 32 x 32 multiply-adds per chunk instead of HEAD x HEAD per row
DOT_ROT = tl.constexpr(32)
# table entries per program: the INT4 program builds its Hadamard operands once for all of them
BLOCKS = {MODE_INT8.value: 4, MODE_FP8.value: 4, MODE_INT4.value: 16}
NUM_WARPS = 4
NUM_STAGES = 2      # INT4: the next entry's codes load (cp.async) while this one's dots run


@triton.jit
def _hadamard_operands(F16: tl.constexpr):
    """``(even, odd)`` [16, 32]: rows ``2i`` / ``2i + 1`` of the Sylvester Hadamard matrix of
    order :data:`DOT_ROT` (entries +-1: exact in fp16; fp32 under the interpreter)."""
    offs_i = tl.arange(0, DOT_ROT // 2)
    offs_j = tl.arange(0, DOT_ROT)
    even = hadamard_sign(2 * offs_i[:, None], offs_j[None, :])
    odd = hadamard_sign(2 * offs_i[:, None] + 1, offs_j[None, :])
    if F16:
        even = even.to(tl.float16)
        odd = odd.to(tl.float16)
    return even, odd


@triton.jit
def _butterfly(t, ROWS: tl.constexpr, HALF: tl.constexpr, S: tl.constexpr):
    """One Walsh-Hadamard stage on the columns of ``t`` [ROWS, HALF] at stride S: ``(a, b)`` ->
    ``(a + b, a - b)`` for each pair of columns ``c``, ``c + S`` (``c & S == 0``)."""
    t = tl.permute(tl.reshape(t, [ROWS, HALF // (2 * S), 2, S]), (0, 1, 3, 2))
    a, b = tl.split(t)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [ROWS, HALF])


@triton.jit
def _chunk_hadamard(t, ROWS: tl.constexpr, HALF: tl.constexpr, LOG_NCH: tl.constexpr):
    """``t`` [ROWS, HALF] (nibbles of HALF bytes) -> each chunk ``j`` of DOT_ROT // 2 columns
    replaced by ``sum_c H_NCH[j, c] * chunk c``: a Walsh-Hadamard transform over the chunk
    index (``H_HEAD = H_NCH (x) H_DOT_ROT``), one butterfly per bit, up to NCH = 16."""
    if LOG_NCH >= 1:
        t = _butterfly(t, ROWS, HALF, HALF // 2)
    if LOG_NCH >= 2:
        t = _butterfly(t, ROWS, HALF, HALF // 4)
    if LOG_NCH >= 3:
        t = _butterfly(t, ROWS, HALF, HALF // 8)
    if LOG_NCH >= 4:
        t = _butterfly(t, ROWS, HALF, HALF // 16)
    return t


@triton.jit
def _store_rows(src, scale_ptr, rows_off, scale_off, out, r_ok, g_even, g_odd, signs, stride_d,
                ROWS: tl.constexpr, HEAD: tl.constexpr, NCH: tl.constexpr, LOG_NCH: tl.constexpr,
                MODE: tl.constexpr, F16: tl.constexpr):
    """Dequantize ``[ROWS, HEAD]`` rows (codes at ``src + rows_off``, scale bits at
    ``scale_ptr + scale_off``) and store them at ``out`` [ROWS, HEAD] (row-major offsets)."""
    offs_d = tl.arange(0, HEAD)
    bits = tl.load(scale_ptr + scale_off, mask=r_ok, other=0)
    if MODE == MODE_INT4:
        HALF: tl.constexpr = HEAD // 2
        offs_c = tl.arange(0, HALF)
        b = tl.load(src + rows_off[:, None] + offs_c[None, :] * stride_d, mask=r_ok[:, None], other=0)
        zp = (bits & 0xF)[:, None]
        lo = (b & 0xF).to(tl.int32) - zp  # rotated dims 2i: [ROWS, HALF]
        hi = (b >> 4).to(tl.int32) - zp   # rotated dims 2i + 1
        if F16:  # integers up to 15 * NCH: exact
            lo = lo.to(tl.float16)
            hi = hi.to(tl.float16)
        else:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        lo = tl.reshape(_chunk_hadamard(lo, ROWS, HALF, LOG_NCH), [ROWS * NCH, DOT_ROT // 2])
        hi = tl.reshape(_chunk_hadamard(hi, ROWS, HALF, LOG_NCH), [ROWS * NCH, DOT_ROT // 2])
        x = tl.dot(lo, g_even)
        x = tl.dot(hi, g_odd, x)  # [ROWS * NCH, DOT_ROT]: H r per chunk, exact
        x = tl.reshape(x, [ROWS, HEAD]) * (bits & -16).to(tl.float32, bitcast=True)[:, None] * signs[None, :]
    else:
        c = tl.load(src + rows_off[:, None] + offs_d[None, :] * stride_d, mask=r_ok[:, None], other=0.0)
        if MODE == MODE_FP8:
            c = c.to(tl.float16)  # e4m3 -> fp16 is exact
        x = c.to(tl.float32) * bits.to(tl.float32, bitcast=True)[:, None]
    tl.store(out + offs_d[None, :], x.to(out.dtype.element_ty), mask=r_ok[:, None])


# Grid: (num_seqs * cdiv(blocks_per_seq, BLOCKS), cdiv(BLOCK_SIZE * NUM_KV_HEADS, ROWS)). One
# program: up to BLOCKS consecutive entries of one sequence's block table, and in each cache
# block the ROWS rows (slot, KV head) numbered ``slot * NUM_KV_HEADS + head`` from
# ``program_id(1) * ROWS`` on, K then V. Those rows are contiguous in the packed cache and in
# the scratch, so a tile is one streak of loads and one of 16-byte stores; the INT4 inverse
# rotation's Hadamard operands are built once per program (for BLOCKS entries). Entries past
# the sequence's length are skipped (never read downstream).
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
    ROWS: tl.constexpr,             # rows (slot, head) per tile, power of two; INT4: >= 16 (a dot's M)
    BLOCKS: tl.constexpr,           # table entries per program
    MODE: tl.constexpr,
    KV_ALIGN: tl.constexpr,         # K/V block/slot/head strides arrive divided by this (vector loads)
    NCH: tl.constexpr,              # INT4: HEAD // DOT_ROT chunks (1 otherwise)
    LOG_NCH: tl.constexpr,          # log2(NCH)
    F16: tl.constexpr,              # INT4 dots on fp16 operands (False: fp32, the interpreter)
):
    seq_idx = tl.program_id(0) // groups_per_seq
    j0 = (tl.program_id(0) % groups_per_seq) * BLOCKS
    seq_blocks = tl.minimum((tl.load(seqused_k_ptr + seq_idx) + BLOCK_SIZE - 1) // BLOCK_SIZE, blocks_per_seq)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # row = slot * NUM_KV_HEADS + head within a block
    r_ok = r < BLOCK_SIZE * NUM_KV_HEADS
    slot = r // NUM_KV_HEADS
    head = r % NUM_KV_HEADS
    k_rows = slot * (stride_k_s * KV_ALIGN) + head * (stride_k_h * KV_ALIGN)
    v_rows = slot * (stride_v_s * KV_ALIGN) + head * (stride_v_h * KV_ALIGN)
    ks_rows = slot * stride_ks_s + head * stride_ks_h
    vs_rows = slot * stride_vs_s + head * stride_vs_h
    if MODE == MODE_INT4:
        # x = s / d * (H r): the dots give H r exactly, the signs and 1/d scale its columns
        g_even, g_odd = _hadamard_operands(F16)
        signs = tl.load(signs_ptr + tl.arange(0, HEAD)) / HEAD
    else:
        g_even = 0.0
        g_odd = 0.0
        signs = 0.0
    offs_out = r[:, None] * HEAD
    for j in range(j0, tl.minimum(j0 + BLOCKS, seq_blocks)):
        blk = tl.load(block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s + j).to(tl.int64)
        out = (seq_idx * blocks_per_seq + j).to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS * HEAD) + offs_out
        _store_rows(k_ptr + blk * (stride_k_b * KV_ALIGN), k_scale_ptr + blk * stride_ks_b, k_rows, ks_rows,
                    k_out_ptr + out, r_ok, g_even, g_odd, signs, stride_k_d, ROWS, HEAD, NCH, LOG_NCH, MODE, F16)
        _store_rows(v_ptr + blk * (stride_v_b * KV_ALIGN), v_scale_ptr + blk * stride_vs_b, v_rows, vs_rows,
                    v_out_ptr + out, r_ok, g_even, g_odd, signs, stride_v_d, ROWS, HEAD, NCH, LOG_NCH, MODE, F16)


def _chunks(mode: int, head_size: int) -> dict:
    nch = head_size // DOT_ROT.value if mode == MODE_INT4.value else 1
    return dict(NCH=nch, LOG_NCH=nch.bit_length() - 1)


def tile_rows(mode: int, head_size: int, block_size: int, num_kv_heads: int) -> int:
    """Rows per tile: about :data:`TILE_ELEMS` output elements, at most a block's rows (INT4: at
    least 16, a dot's smallest M)."""
    rows = min(max(1, TILE_ELEMS // head_size), next_pow2(block_size * num_kv_heads))
    return max(16, rows) if mode == MODE_INT4.value else rows


def reads(call) -> bool:
    """Whether :func:`dequantized_call` serves ``call``: a per-token-head mode and a power-of-two
    head size (its row tiles are powers of two); INT4 from DOT_ROT (32) to 16 DOT_ROT (512)."""
    head = call.head_size
    if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not DOT_ROT.value <= head <= 16 * DOT_ROT.value:
        return False
    return call.mode in _MODES and head >= 16 and head & (head - 1) == 0


def _blocks_per_seq(call) -> int:
    return min(call.block_table.shape[1], cdiv(call.max_seqlen_k, call.k.shape[1]))


def _scratch_dtype(interpreted: bool) -> torch.dtype:
    return torch.float32 if interpreted else torch.float16


def scratch_bytes(call, interpreted: bool = False) -> int:
    """Bytes :func:`dequantized_call` allocates for ``call``: K and V rows of ``num_seqs *
    blocks_per_seq`` blocks (``blocks_per_seq`` from ``max_seqlen_k``), fp16 (fp32 when
    ``interpreted``), and an fp16 copy of a bf16 query."""
    k = call.k
    rows = call.num_seqs * _blocks_per_seq(call) * k.shape[1] * k.shape[2]
    size = _scratch_dtype(interpreted).itemsize
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
    dtype = _scratch_dtype(interpreted)
    shape = (num_seqs * per_seq, block_size, num_kv_heads, call.head_size)
    k_out = torch.empty(shape, dtype=dtype, device=k.device)
    v_out = torch.empty(shape, dtype=dtype, device=k.device)
    ksb, vsb = ks.view(torch.int32), vs.view(torch.int32)
    align = kv_align(k, v)
    signs = call.signs if call.signs is not None else ksb  # unread outside INT4
    mode = _MODES[call.mode]
    blocks = BLOCKS[mode]
    rows = tile_rows(mode, call.head_size, block_size, num_kv_heads)
    groups = cdiv(per_seq, blocks)
    if num_seqs * per_seq > 0:
        _dequant_blocks_kernel[(num_seqs * groups, cdiv(block_size * num_kv_heads, rows))](
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
            NUM_KV_HEADS=num_kv_heads, HEAD=call.head_size, BLOCK_SIZE=block_size, ROWS=rows, BLOCKS=blocks,
            MODE=mode, KV_ALIGN=align, **_chunks(mode, call.head_size), F16=not interpreted, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES)
    table = torch.arange(num_seqs * per_seq, dtype=torch.int32, device=k.device).view(num_seqs, per_seq)
    dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=k.device)
    q = call.q if interpreted else call.q.to(torch.float16)  # the 2D kernel's dots take q's type
    return dataclasses.replace(call, q=q, k=k_out, v=v_out, ks=dummy, vs=dummy, block_table=table, signs=None,
                               mode=KVQuantMode.NONE)
