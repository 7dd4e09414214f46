"""Dequantize the blocks a 2D call reads into a scratch cache, so the unquantized 2D kernel runs on it.

A prefill chunk of ``q_len`` tokens is read by ``q_len / BLOCK_Q`` programs per KV head, and
each of them converts every code of the context it reads: the conversion is paid once per query
tile. Converting the context once per call instead (``Tiling.dequant_first``) costs one read of
the quantized blocks and one write of 16-bit rows; the attention then runs at the unquantized
kernel's speed. Worth it where query tiles per sequence are many (long chunks), not for decode
rows (``plan._prefill_tiling`` decides).

INT8 / FP8 rows are dequantized to the original domain, ``c * scale``. INT4 rows are stored
rotated: ``r = (c - zp) * scale`` is ``H (s * x)`` (``H`` the Sylvester Hadamard matrix of
order ``d``, ``s`` the signs), and the pass writes them in one of two forms (``unrotate``,
:func:`unrotates` picks, ``Tiling.unrotate`` holds the choice):

- *unrotated*, ``x = s * H(r) / d``: one Hadamard product per context row, as two MMAs of order
  ``d / 2`` on the exact small integers ``lo +- hi`` of each byte's two codes; the call then runs
  like an INT8 one. Cheaper where the context has few K / V rows per query / output row (the
  bounds in :data:`UNROTATE`: a chunk over little or nothing cached, where GQA makes the
  context's rows the fewer).
- *rotated*, ``r / d_b``: ``q . x = (H (s * q) / d_a) . (r / d_b)`` with ``d_a * d_b = d``, so
  :func:`_rotate_rows_kernel` rotates the query once before the 2D kernel and the output once
  after it (``s * H(o_r) / d_a``, :func:`restore_output`): two rotations per query row instead
  of one per context row. ``d_a = 2^floor(log2(d) / 2)`` keeps both sides within sqrt(2) of the
  original elements' range (``|r| / d_b <= |x|_2 / d_b``).

The scratch is fp16 (the operand type of the fused INT8 / FP8 kernels' dots); a bf16 query
converts to fp16 as the 2D kernels load it.
bf16 rows would round every key and value to 8 bits of mantissa, fp16 keeps 11: on the prefill
benchmark's random codes bf16 rows measured 4.9e-3 / 8.0e-3 relative L2 (INT8 / FP8) against
the oracle where the fused kernels reach 1.7e-3. The price is fp16's range: a dequantized
element beyond 65,504 becomes inf, as in an fp16 cache. Under the interpreter the scratch is
fp32 (its 16-bit rounding is not the GPU's).

Memory: :func:`scratch_bytes` (K and V rows of ``num_seqs * blocks_per_seq`` blocks, and for
INT4 kept rotated the rotated query and output); allocated per call from torch's caching
allocator; the planner caps it
(``Tuning.dequant_max_bytes``): above the cap the call is dequantized and attended for groups of
KV heads in turn (``Tiling.dequant_groups``, one group's scratch at a time), and only where one
KV head's scratch exceeds it does the fused kernel run.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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
# output elements per row tile (INT4: a whole 16-slot block of 8 KV heads at head 128)
TILE_ELEMS = {MODE_INT8.value: 8192, MODE_FP8.value: 8192, MODE_INT4.value: 16384}


class Unrotate(NamedTuple):
    """INT4 rows written unrotated at one head size: the pass's row tile (output elements), cache
    blocks per program and warps, and the most context rows (K and V) per query row (query and
    output) at which :func:`unrotates` picks that form."""

    tile_elems: int
    blocks: int
    warps: int
    max_rows_per_query_row: float


# By head size (32 takes 64's). H200: the unrotated form is faster up to about 3 context rows
# per query row at heads 64 / 128; at head 256 its order-128 products need more blocks per
# program and 8 warps, and it stops paying near 1.
UNROTATE = {64: Unrotate(8192, 1, 4, 2.0), 128: Unrotate(8192, 1, 4, 2.0), 256: Unrotate(16384, 4, 8, 1.0)}
BLOCKS = 1           # table entries per program (INT4 unrotated: UNROTATE): one, so that the grid fills the GPU
NUM_WARPS = 4
NUM_STAGES = 2      # with BLOCKS > 1: the next entry's codes load (cp.async) while this one's rows convert
INT4_MAX_HEAD = 256  # the rotation kernel's operand: [head, head] up to ROT_WHOLE, one split in halves above
ROT_WHOLE = tl.constexpr(128)  # _rotate_rows_kernel: largest head rotated with one [head, head] operand (32 KiB fp16)
ROTATE_ROWS = 64     # _rotate_rows_kernel: (token, head) rows per program, one dot with the Hadamard operand


def rotation_split(head_size: int) -> tuple:
    """``(d_a, d_b)``: powers of two with ``d_a * d_b = head_size``, ``d_a = 2^floor(log2(d) / 2)``."""
    d_a = 1 << ((head_size.bit_length() - 1) // 2)
    return d_a, head_size // d_a


# Grid: (cdiv(num_tokens - first, ROWS // BLOCK_H), cdiv(num_heads, BLOCK_H)). ROWS rows [token, head]
# of x, ROWS // BLOCK_H tokens from ``first`` (host) on, masked from ``*end_ptr`` (device: the
# call's cu_seqlens_q[-1]) ->
# y = scale * H(s * x) (SIGNS_FIRST) or y = scale * s * H(x), H the Sylvester Hadamard matrix of
# order HEAD (symmetric, entries +-1): one dot of the 16-bit rows with it, exact up to fp32 sums.
@dual_jit
def _rotate_rows_kernel(
    x_ptr, signs_ptr, y_ptr, scale, first, end_ptr,
    stride_x_t, stride_x_h, stride_x_d,
    stride_y_t, stride_y_h, stride_y_d,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    SIGNS_FIRST: tl.constexpr,
    F32: tl.constexpr,              # fp32 operands (the interpreter)
):
    r = tl.arange(0, ROWS)
    tok = first + tl.program_id(0).to(tl.int64) * (ROWS // BLOCK_H) + r // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    ok = ((head < NUM_HEADS) & (tok < tl.load(end_ptr)))[:, None]
    offs_d = tl.arange(0, HEAD)
    signs = tl.load(signs_ptr + offs_d)
    x = tl.load(x_ptr + tok[:, None] * stride_x_t + head[:, None] * stride_x_h + offs_d[None, :] * stride_x_d,
                mask=ok, other=0.0)
    if F32:
        x = x.to(tl.float32)
    if SIGNS_FIRST:
        x = x * signs[None, :].to(x.dtype)
    if HEAD <= ROT_WHOLE:
        y = tl.dot(x, hadamard_sign(offs_d[:, None], offs_d[None, :]).to(x.dtype))
    else:  # x H_2n = [(x1 + x2) H_n, (x1 - x2) H_n] for halves x1, x2: an order-n operand
        HALF: tl.constexpr = HEAD // 2
        offs_h = tl.arange(0, HALF)
        x1, x2 = tl.split(tl.permute(tl.reshape(x.to(tl.float32), [ROWS, 2, HALF]), (0, 2, 1)))
        dt = tl.float32 if F32 else tl.float16  # the fp32 sums rounded once, to fp16's 11 bits
        h = hadamard_sign(offs_h[:, None], offs_h[None, :]).to(dt)
        y1 = tl.dot((x1 + x2).to(dt), h)
        y2 = tl.dot((x1 - x2).to(dt), h)
        y = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), [ROWS, HEAD])
    y = y * scale
    if not SIGNS_FIRST:
        y = y * signs[None, :]
    tl.store(y_ptr + tok[:, None] * stride_y_t + head[:, None] * stride_y_h + offs_d[None, :] * stride_y_d,
             y.to(y_ptr.dtype.element_ty), mask=ok)


def rotate_rows(x: torch.Tensor, signs: torch.Tensor, y: torch.Tensor, scale: float, signs_first: bool,
                first: int, end: torch.Tensor) -> None:
    """``y[t, h] = scale * H(signs * x[t, h])`` (``signs_first``) or ``scale * signs * H(x[t, h])``
    for ``x``, ``y`` [num_tokens, num_heads, head_size] (any strides) and the tokens ``first <= t <
    end[0]`` (``end``: a one-element int32 tensor on x's device, read there), one launch."""
    num_tokens, num_heads, head = x.shape
    if num_tokens <= first:
        return
    block_h = min(next_pow2(num_heads), ROTATE_ROWS)
    _rotate_rows_kernel[(cdiv(num_tokens - first, ROTATE_ROWS // block_h), cdiv(num_heads, block_h))](
        x_ptr=x, signs_ptr=signs, y_ptr=y, scale=scale, first=first, end_ptr=end,
        stride_x_t=x.stride(0), stride_x_h=x.stride(1), stride_x_d=x.stride(2),
        stride_y_t=y.stride(0), stride_y_h=y.stride(1), stride_y_d=y.stride(2),
        NUM_HEADS=num_heads, HEAD=head, BLOCK_H=block_h, ROWS=ROTATE_ROWS, SIGNS_FIRST=signs_first,
        F32=interpreting(x), num_warps=4)


@triton.jit
def _int4_rows(src, scale_ptr, rows_off, scale_off, r_ok, inv_db, stride_d, HEAD: tl.constexpr):
    """INT4 rows as ``(lo, hi, scale)``: the codes of each byte's low / high nibble less the row's
    zero point (rotated dims ``2i`` / ``2i + 1``, int32 ``[ROWS, HEAD / 2]``) and the row's scale
    times ``inv_db`` (fp32 ``[ROWS]``)."""
    offs_c = tl.arange(0, HEAD // 2)
    bits = tl.load(scale_ptr + scale_off, mask=r_ok, other=0)
    b = tl.load(src + rows_off[:, None] + offs_c[None, :] * stride_d, mask=r_ok[:, None], other=0)
    zp = (bits & 0xF)[:, None]
    return (b & 0xF).to(tl.int32) - zp, (b >> 4).to(tl.int32) - zp, (bits & -16).to(tl.float32, bitcast=True) * inv_db


@triton.jit
def _store_rows(src, scale_ptr, rows_off, scale_off, out, r_ok, inv_db, stride_d, h_half, signs,
                ROWS: tl.constexpr, HEAD: tl.constexpr, MODE: tl.constexpr, UNROTATE: tl.constexpr,
                DT: tl.constexpr):
    """Dequantize ``[ROWS, HEAD]`` rows (codes at ``src + rows_off``, scale bits at
    ``scale_ptr + scale_off``) and store them at ``out`` [ROWS, HEAD] (row-major offsets).
    INT4 rows: in the rotated domain times ``inv_db`` (``1 / d_b``, a power of two), or with
    ``UNROTATE`` in the original domain, ``s * scale * H(c - zp) / d`` (``inv_db`` then ``1 / d``,
    ``h_half`` the order-``HEAD / 2`` Hadamard operand in ``DT``, ``signs`` [HEAD])."""
    offs_d = tl.arange(0, HEAD)
    if MODE == MODE_INT4:
        lo, hi, sc = _int4_rows(src, scale_ptr, rows_off, scale_off, r_ok, inv_db, stride_d, HEAD)
        sc = sc[:, None]
        if UNROTATE:
            # H_d[2i + e, 2m + t] = H_{d/2}[i, m] (-1)^(e t): dims 2m / 2m + 1 of H(c - zp) are
            # H_{d/2}(lo + hi) / H_{d/2}(lo - hi). |lo +- hi| <= 30 and the sums are exact.
            even = tl.dot((lo + hi).to(DT), h_half)
            odd = tl.dot((lo - hi).to(DT), h_half)
            x = tl.reshape(tl.join(even, odd), [ROWS, HEAD]) * sc * signs[None, :]
        else:
            x = tl.reshape(tl.join(lo.to(tl.float32) * sc, hi.to(tl.float32) * sc), [ROWS, HEAD])
    else:
        bits = tl.load(scale_ptr + scale_off, mask=r_ok, other=0)
        c = tl.load(src + rows_off[:, None] + offs_d[None, :] * stride_d, mask=r_ok[:, None], other=0.0)
        if MODE == MODE_FP8:
            c = c.to(tl.float16)  # e4m3 -> fp16 is exact
        x = c.to(tl.float32) * bits.to(tl.float32, bitcast=True)[:, None]
    tl.store(out + offs_d[None, :], x.to(out.dtype.element_ty), mask=r_ok[:, None])


@triton.jit
def _store_key_codes(src, scale_ptr, rows_off, scale_off, out, scale_out, r_ok, inv_db, stride_d,
                     ROWS: tl.constexpr, HEAD: tl.constexpr):
    """INT4 key rows kept rotated as int8 codes ``c - zp`` and one fp32 scale each (``scale *
    inv_db``): ``out`` [ROWS, HEAD] (row-major offsets), ``scale_out`` [ROWS]."""
    lo, hi, sc = _int4_rows(src, scale_ptr, rows_off, scale_off, r_ok, inv_db, stride_d, HEAD)
    c = tl.reshape(tl.join(lo, hi), [ROWS, HEAD])
    tl.store(out + tl.arange(0, HEAD)[None, :], c.to(tl.int8), mask=r_ok[:, None])
    tl.store(scale_out, sc, mask=r_ok)


# Grid: (num_seqs * cdiv(blocks_per_seq, BLOCKS), cdiv(BLOCK_SIZE * NUM_KV_HEADS, ROWS)). One
# program: up to BLOCKS consecutive entries of one sequence's block table, and in each cache
# block the ROWS rows (slot, KV head) numbered ``slot * NUM_KV_HEADS + head`` from
# ``program_id(1) * ROWS`` on, K then V. Those rows are contiguous in the packed cache and in
# the scratch, so a tile is one streak of loads and one of 16-byte stores. Entries past the
# sequence's length are skipped (never read downstream).
@dual_jit
def _dequant_blocks_kernel(
    k_ptr, v_ptr,                   # [num_blocks, block_size, Hkv, data_head_size] codes
    k_scale_ptr, v_scale_ptr,       # [num_blocks, block_size, Hkv] int32 bits (fp32 scale; INT4: | zp)
    inv_db,                         # INT4: 1 / d_b (rotation_split), with UNROTATE 1 / HEAD; unread otherwise
    signs_ptr,                      # INT4 with UNROTATE: [HEAD] the rotation's signs (+-1.0); unread otherwise
    block_table_ptr, seqused_k_ptr,
    k_out_ptr, v_out_ptr,           # [num_seqs * blocks_per_seq, block_size, Hkv, HEAD], written
    ks_out_ptr, stride_kso_h,       # INT8_KEYS: [Hkv, num_seqs * blocks_per_seq * block_size] fp32, written
    blocks_per_seq, groups_per_seq,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_v_b, stride_v_s, stride_v_h, stride_v_d,
    stride_ks_b, stride_ks_s, stride_ks_h,
    stride_vs_b, stride_vs_s, stride_vs_h,
    stride_bt_s,
    NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,             # rows (slot, head) per tile, power of two
    BLOCKS: tl.constexpr,           # table entries per program
    MODE: tl.constexpr,
    KV_ALIGN: tl.constexpr,         # K/V block/slot/head strides arrive divided by this (vector loads)
    UNROTATE: tl.constexpr,         # INT4: rows written in the original domain (one Hadamard product each)
    F32: tl.constexpr,              # fp32 dot operands (the interpreter)
    INT8_KEYS: tl.constexpr = False,  # INT4 kept rotated: keys as int8 codes + scales (ks_out_ptr)
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
    offs_out = r[:, None] * HEAD
    DT: tl.constexpr = tl.float32 if F32 else tl.float16
    if UNROTATE:
        offs_c = tl.arange(0, HEAD // 2)
        h_half = hadamard_sign(offs_c[:, None], offs_c[None, :]).to(DT)
        signs = tl.load(signs_ptr + tl.arange(0, HEAD))
    else:
        h_half, signs = 0, 0
    for j in range(j0, tl.minimum(j0 + BLOCKS, seq_blocks)):
        blk = tl.load(block_table_ptr + seq_idx.to(tl.int64) * stride_bt_s + j).to(tl.int64)
        out = (seq_idx * blocks_per_seq + j).to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS * HEAD) + offs_out
        if INT8_KEYS:
            pos = (seq_idx * blocks_per_seq + j).to(tl.int64) * BLOCK_SIZE + slot
            _store_key_codes(k_ptr + blk * (stride_k_b * KV_ALIGN), k_scale_ptr + blk * stride_ks_b, k_rows, ks_rows,
                             k_out_ptr + out, ks_out_ptr + head * stride_kso_h + pos, r_ok, inv_db, stride_k_d,
                             ROWS, HEAD)
        else:
            _store_rows(k_ptr + blk * (stride_k_b * KV_ALIGN), k_scale_ptr + blk * stride_ks_b, k_rows, ks_rows,
                        k_out_ptr + out, r_ok, inv_db, stride_k_d, h_half, signs, ROWS, HEAD, MODE, UNROTATE, DT)
        _store_rows(v_ptr + blk * (stride_v_b * KV_ALIGN), v_scale_ptr + blk * stride_vs_b, v_rows, vs_rows,
                    v_out_ptr + out, r_ok, inv_db, stride_v_d, h_half, signs, ROWS, HEAD, MODE, UNROTATE, DT)


def tile_rows(head_size: int, block_size: int, num_kv_heads: int, mode: int, unrotate: bool = False) -> int:
    """Rows per tile: about ``TILE_ELEMS[mode]`` output elements (INT4 ``unrotate``: its
    :data:`UNROTATE` tile, at least 16 rows for its dots), at most a block's rows."""
    if unrotate:
        elems = _unrotate(head_size).tile_elems
        return max(16, min(elems // head_size, next_pow2(block_size * num_kv_heads)))
    return min(max(1, TILE_ELEMS[mode] // head_size), next_pow2(block_size * num_kv_heads))


def reads(call) -> bool:
    """Whether :func:`dequantized_call` serves ``call``: a per-token-head mode and a power-of-two
    head size (its row tiles are powers of two); INT4 from 32 to :data:`INT4_MAX_HEAD`."""
    head = call.head_size
    if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not 32 <= head <= INT4_MAX_HEAD:
        return False
    return call.mode in _MODES and head >= 16 and head & (head - 1) == 0


def _blocks_per_seq(call) -> int:
    return min(call.block_table.shape[1], cdiv(call.max_seqlen_k, call.k.shape[1]))


def scratch_dtype(interpreted: bool) -> torch.dtype:
    """The scratch's element type: fp16 on a GPU, fp32 under the interpreter (module docstring)."""
    return torch.float32 if interpreted else torch.float16


def _unrotate(head_size: int) -> Unrotate:
    return UNROTATE[max(64, head_size)]


def rows_per_query_row(call) -> float:
    """Context rows the pass converts (K and V of ``num_seqs * blocks_per_seq`` blocks) per query
    row of ``call`` (query and output rows, from ``first_token`` on); inf without query rows."""
    k = call.k
    context = 2 * call.num_seqs * _blocks_per_seq(call) * k.shape[1] * k.shape[2]
    query = 2 * (call.q.shape[0] - call.first_token) * call.q.shape[1]
    return context / query if query else float("inf")


def unrotates(call) -> bool:
    """Whether INT4's pass should write ``call``'s rows in the original domain: where the context
    has at most ``max_rows_per_query_row`` (:data:`UNROTATE`, by head size) rows per query row
    (:func:`rows_per_query_row`), a Hadamard product per context row costs less than the two
    rotations per query row that keeping them rotated needs. False for other modes."""
    if call.mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        return False
    return rows_per_query_row(call) <= unrotate_bound(call.head_size)


def unrotate_bound(head_size: int) -> float:
    """The most context rows per query row at which INT4 rows are written unrotated."""
    return _unrotate(head_size).max_rows_per_query_row


def int8_keys_apply(call, unrotate: bool = False) -> bool:
    """Whether the pass can write ``call``'s keys as int8 codes (``dequantized_call(int8_keys=True)``):
    INT4 rows kept rotated (not ``unrotate``: unrotated rows are not integers). Not INT8: there
    the query's int8 rounding measured 1.3e-2 - 1.7e-2 relative L2 against the oracle on the prefill
    benchmark's random codes (bound 1e-2; INT4's rotated query 1.6e-3 - 1.8e-3)."""
    return call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not unrotate


def scratch_bytes(call, interpreted: bool = False, unrotate: bool = False, int8_keys: bool = False) -> int:
    """Bytes :func:`dequantized_call` allocates for ``call``: K and V rows of ``num_seqs *
    blocks_per_seq`` blocks (``blocks_per_seq`` from ``max_seqlen_k``), fp16 (fp32 when
    ``interpreted``; with ``int8_keys`` the keys one byte a dim and an fp32 scale a row), and for
    INT4 kept rotated (not ``unrotate``) the rotated query and output in the scratch's type."""
    k = call.k
    rows = call.num_seqs * _blocks_per_seq(call) * k.shape[1] * k.shape[2]
    size = scratch_dtype(interpreted).itemsize
    rotated = call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not unrotate
    extra = (call.q.numel() + call.out.numel()) * size if rotated else 0
    keys = rows * (call.head_size + 4) if int8_keys else rows * call.head_size * size
    return keys + rows * call.head_size * size + extra


def dequantized_call(call, unrotate: bool = False, int8_keys: bool = False, block_rows: int = 0):
    """``call`` over a quantized cache -> the same call over a scratch unquantized cache holding
    every block its sequences read (``[num_seqs * blocks_per_seq, block_size, num_kv_heads,
    head_size]`` fp16; fp32 under the interpreter) with an identity block table, mode NONE.
    INT8 / FP8, and INT4 with ``unrotate`` (rows in the original domain): the caller's query and
    ``out`` (the 2D kernels convert a bf16 query to the rows' fp16 as they load it). INT4
    otherwise: rows, query and ``out`` in the rotated domain (the module docstring): the query
    rotated into a scratch, ``out`` a scratch that :func:`restore_output` rotates back into the
    caller's. ``int8_keys`` (INT4 kept rotated, :func:`int8_keys_apply`): the keys as int8 codes
    ``c - zp`` and ``ks`` their scales times ``1 / d_b``, ``[num_kv_heads, num_seqs *
    blocks_per_seq * block_size]`` fp32, for ``prefill_wgmma``'s int8 score MMAs.
    ``block_rows`` (``Tiling.tile_blocks``: a multiple of ``block_size``): each sequence's blocks
    padded to a multiple of ``f = block_rows / block_size`` and the scratch returned viewed as
    blocks of ``block_rows`` slots (``[n, bs, H, D]`` as ``[n / f, f x bs, H, D]``, its identity
    table ``arange(n / f)``): its rows lie one after another, so nothing moves, and the Gluon
    prefill kernel copies a tile of keys or values with one TMA box instead of ``f``. The padding
    (fewer than ``f`` blocks a sequence, never written or read) is not in :func:`scratch_bytes`.
    Launches :func:`_dequant_blocks_kernel` (and the query's rotation) on the current stream
    (no host sync)."""
    k, v, ks, vs = call.k, call.v, call.ks, call.vs
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    per_seq = _blocks_per_seq(call)
    f = block_rows // block_size if block_rows > block_size else 1
    if f * block_size != max(block_rows, block_size):
        raise ValueError(f"block_rows {block_rows}: expected a multiple of the block size {block_size}")
    pitch = cdiv(per_seq, f) * f   # scratch blocks per sequence: the blocks past per_seq are never read
    num_seqs = call.num_seqs
    interpreted = interpreting(call.q)
    dtype = scratch_dtype(interpreted)
    shape = (num_seqs * pitch, block_size, num_kv_heads, call.head_size)
    if int8_keys and not int8_keys_apply(call, unrotate):
        raise ValueError(f"int8 keys: INT4 rows kept rotated only, not {call.mode.name}"
                         + (" rows unrotated" if unrotate else ""))
    k_out = torch.empty(shape, dtype=torch.int8 if int8_keys else dtype, device=k.device)
    v_out = torch.empty(shape, dtype=dtype, device=k.device)
    ks_out = torch.empty((num_kv_heads, num_seqs * pitch * block_size) if int8_keys else (1,), dtype=torch.float32,
                         device=k.device)
    ksb, vsb = ks.view(torch.int32), vs.view(torch.int32)
    align = kv_align(k, v)
    mode = _MODES[call.mode]
    rotated = mode == MODE_INT4.value and not unrotate
    d_a, d_b = rotation_split(call.head_size)
    if rotated:  # the query once: H(s * q) / d_a
        q = torch.empty(call.q.shape, dtype=dtype, device=k.device)
        rotate_rows(call.q, call.signs, q, 1.0 / d_a, True, call.first_token, call.cu_seqlens_q[-1:])
    else:
        q = call.q
    unrotated = mode == MODE_INT4.value and unrotate
    rows = tile_rows(call.head_size, block_size, num_kv_heads, mode, unrotated)
    tuned = _unrotate(call.head_size) if unrotated else None
    blocks, warps = (tuned.blocks, tuned.warps) if unrotated else (BLOCKS, NUM_WARPS)
    groups = cdiv(per_seq, blocks)
    if num_seqs * per_seq > 0:
        _dequant_blocks_kernel[(num_seqs * groups, cdiv(block_size * num_kv_heads, rows))](
            k_ptr=k, v_ptr=v, k_scale_ptr=ksb, v_scale_ptr=vsb,
            inv_db=1.0 / (call.head_size if unrotated else d_b), signs_ptr=call.signs if unrotated else ksb,
            block_table_ptr=call.block_table, seqused_k_ptr=call.seqused_k.contiguous(),
            k_out_ptr=k_out, v_out_ptr=v_out, ks_out_ptr=ks_out, stride_kso_h=ks_out.stride(0),
            blocks_per_seq=pitch, groups_per_seq=groups,
            stride_k_b=k.stride(0) // align, stride_k_s=k.stride(1) // align, stride_k_h=k.stride(2) // align,
            stride_k_d=k.stride(3),
            stride_v_b=v.stride(0) // align, stride_v_s=v.stride(1) // align, stride_v_h=v.stride(2) // align,
            stride_v_d=v.stride(3),
            stride_ks_b=ksb.stride(0), stride_ks_s=ksb.stride(1), stride_ks_h=ksb.stride(2),
            stride_vs_b=vsb.stride(0), stride_vs_s=vsb.stride(1), stride_vs_h=vsb.stride(2),
            stride_bt_s=call.block_table.stride(0),
            NUM_KV_HEADS=num_kv_heads, HEAD=call.head_size, BLOCK_SIZE=block_size, ROWS=rows, BLOCKS=blocks,
            MODE=mode, KV_ALIGN=align, UNROTATE=unrotated, F32=interpreted, INT8_KEYS=int8_keys,
            num_warps=warps, num_stages=NUM_STAGES)
    table = torch.arange(num_seqs * pitch // f, dtype=torch.int32, device=k.device).view(num_seqs, pitch // f)
    if f > 1:
        k_out = k_out.view((num_seqs * pitch // f, f * block_size) + shape[2:])
        v_out = v_out.view(k_out.shape)
    dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=k.device)
    out = torch.empty(call.out.shape, dtype=dtype, device=k.device) if rotated else call.out
    return dataclasses.replace(call, q=q, k=k_out, v=v_out, ks=ks_out if int8_keys else dummy, vs=dummy,
                               block_table=table, signs=None, mode=KVQuantMode.NONE, out=out)


def restore_output(call, dequantized) -> None:
    """After the 2D kernel ran on ``dequantized = dequantized_call(call, ...)``: INT4 kept rotated
    (its output a scratch) writes ``s * H(o_r) / d_a`` of its rotated output into the call's rows
    of ``call.out`` (from ``first_token`` to ``cu_seqlens_q[-1]``: a mixed call's decode rows and
    rows past the last sequence are left alone); otherwise the kernel wrote ``call.out`` already
    (nothing launched)."""
    if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD and dequantized.out is not call.out:
        rotate_rows(dequantized.out, call.signs, call.out, 1.0 / rotation_split(call.head_size)[0], False,
                    call.first_token, call.cu_seqlens_q[-1:])
