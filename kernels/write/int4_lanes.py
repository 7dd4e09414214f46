"""INT4 writers with the rotation in registers: paths ``int4-lanes`` and ``int4-mma``.

Both read a row once and write it once (codes and scale, the fewest bytes the format allows),
and share one frame (``_int4_rows``): a row of ``d`` bf16/fp16 values is loaded as PARTS
(1, 2, 4 or 8) column ranges of ``N = d / PARTS`` values; each part is read by ``N / 8`` lanes
of one warp, 8 consecutive values (16 bytes) per lane, and the same lane holds element ``i`` of
every part. What differs is how a part is rotated:

- ``int4-lanes`` (GPU default at head_size 16 and 32): the oracle's fast Walsh–Hadamard
  transform (``kernels.reference.fwht``: stage ``k`` pairs elements ``2**k`` apart, smallest
  first, fp32 ``a + b`` / ``a - b``) where the load puts the data. Stages 1, 2 and 4 pair values
  inside a lane; stages ``8 .. N/2`` pair lane ``l`` with lane ``l ^ 2**j`` (``shfl.sync.bfly``);
  stages ``N .. d/2`` pair parts held by the same lane (plain adds). The same additions in the
  same order give the oracle's codes and scales bit for bit, with no ``tl.dot``, no shared
  memory and no barrier. On the GPU the sign flip and the widening to fp32 are inside the
  butterfly asm (:func:`fwht_text`).
- ``int4-mma`` (GPU default at head_size 64, 128 and 256, the fastest measured there): parts of
  32 columns, each rotated by ``mma.sync`` on tensor cores (``int4_mma``), joined by the same
  in-lane stages. The tensor cores add in their own order, so a rare row differs from the oracle
  by one rounding of a rotated value (a tie row, within one code step). Its row range folds the
  parts in-lane before one row reduction; ``PACKED`` takes it on rounded bf16x2 / f16x2 pairs.

On the GPU one asm per part divides, codes and packs (``CODES_ASM``). The shuffle stages assume
Triton's coalesced layout for a ``[ROWS, N]`` 16-byte-vector load: ``sizePerThread [1, 8]``,
``threadsPerWarp [32·8/N, N/8]``, warps along rows, columns fastest, so that
``inline_asm_elementwise(pack=8)`` receives one lane's 8 consecutive values of one row and lane
bit ``j`` is column-group bit ``j``. ``tuning.resolve_tuning`` refuses tilings whose warps would
not tile whole rows, and ``plan.write_plan`` sends rows Triton would not load in 16-byte vectors
to ``int4-fused``; the CUDA tests compare every byte with the oracle, which any other layout
would fail. Through the interpreter (CPU) both kernels run the oracle's butterfly per part
instead (``fwht_rows``), bit-identical by construction.

The module holds two kernels and their shared body with its PTX builders (over 300 lines): the
rotation, range and code steps of one row belong together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layouts import rht_signs
from layouts.rotation import rht_sign_seed

from .._jit import cdiv, dual_jit
from .checks import cache_alignment, packed_rows, stride_args
from .device_math import (NAN_SCALE, _max_nan, _min_nan, codes_ptx, fneg, fwht_rows, int4_codes, int4_scale_zp,
                          pack_nibbles, round_to_model_f32, row_min_max, split_reciprocal, to_model_dtype)
from .int4_mma import (PACKED_CODES_BF16, PACKED_CODES_F16, lane_part, mma_part, mma_part_sub, packed_range,
                       sign_bits, sign_table)
from .offsets import lane_offset_table
from .plan import WriteArgs, WritePlan, launch
from .tuning import MMA_COLS


@triton.constexpr_function
def fwht_text(log2_n, f16):
    """PTX for one lane's 8 values: packed bf16 (or fp16) pairs $8..$11 and the fp32 signs' bits
    $12..$19 in, ``H·(s ⊙ x)`` out in $0..$7: the oracle's 3 in-lane stages, then ``lane_bits``
    shuffle stages (``N = 2**log2_n`` values per part, ``N/8`` lanes). Every add is ``.rn`` so ptxas cannot contract it into an FMA; the partner's
    update ``fma(mine, ±1, theirs)`` is exactly ``theirs ± mine`` (one rounding).

    The sign flip costs nothing per element (the oracle's ``x.float() * s`` is exact, a sign
    change): the odd element's sign is XORed into its bf16 -> fp32 unpack, ``lop3(p, s, c)`` =
    ``(p & 0xFFFF0000) ^ (bits(s) & 0x80000000)`` (``bits(±1.0)`` differ only in bit 31, bits
    23..29 set, the rest clear, so ``c = 0xC07F0000`` with LUT 0x68 = ``c ? p ^ s : p & s``
    selects it in one instruction); fp16 multiplies the odd element by ±1 (exact). The even
    element's sign goes into stage 1: ``fma(x0, s0, y1)`` rounds the exact ``s0·x0 + y1`` once,
    the oracle's ``RN(a + b)`` with the same signed-zero rule, and ``fma(x0, s0, -y1)`` its
    ``RN(a - b)``."""
    lines = ["{", ".reg .f32 a<8>, b<8>, p, s, lo, hi, nh;", ".reg .b32 l;", ".reg .b16 h<2>;"]
    for j in range(4):  # pair j: element 2j in the low half of $8+j, 2j+1 in the high half
        if f16:
            lines += [f"mov.b32 {{h0, h1}}, ${8 + j};", "cvt.f32.f16 lo, h0;", "cvt.f32.f16 hi, h1;",
                      f"mul.rn.f32 hi, hi, ${13 + 2 * j};"]
        else:
            lines += [f"shl.b32 lo, ${8 + j}, 16;", f"lop3.b32 hi, ${8 + j}, ${13 + 2 * j}, 0xC07F0000, 0x68;"]
        lines += ["neg.f32 nh, hi;", f"fma.rn.f32 b{2 * j}, lo, ${12 + 2 * j}, hi;",
                  f"fma.rn.f32 b{2 * j + 1}, lo, ${12 + 2 * j}, nh;"]
    cur, banks = [f"b{i}" for i in range(8)], ("a", "b")
    for k in (1, 2):  # in-lane stages 2 and 4: pairs (i, i + 2**k)
        h, out = 1 << k, banks[k - 1]
        for i in range(8):
            if not i & h:
                lines.append(f"add.rn.f32 {out}{i}, {cur[i]}, {cur[i + h]};")
                lines.append(f"sub.rn.f32 {out}{i + h}, {cur[i]}, {cur[i + h]};")
        cur = [f"{out}{i}" for i in range(8)]
    for j in range(log2_n - 3):  # lane l pairs with l ^ 2**j: lower lane a + b, upper lane a - b
        lines += ["mov.u32 l, %laneid;", f"bfe.u32 l, l, {j}, 1;", "cvt.rn.f32.u32 s, l;",
                  "fma.rn.f32 s, s, 0fC0000000, 0f3F800000;"]  # s = 1 - 2·bit: +1 lower, -1 upper
        for i in range(8):
            lines.append(f"shfl.sync.bfly.b32 p, b{i}, {1 << j}, 31, -1;")
            lines.append(f"fma.rn.f32 b{i}, b{i}, s, p;")
    lines += [f"mov.b32 ${i}, b{i};" for i in range(8)] + ["}"]
    return "\n".join(lines)


def _codes_text():
    """PTX for 8 rounded values $2..$9 (fp32) and their row's ``split_reciprocal`` words ``cl`` $10,
    ``ch`` $18, ``pw`` $26 and ``zp + 0.5`` $34: the codes of ``int4_codes`` (:func:`codes_ptx`),
    packed into one word $0 ($1, the other four bytes of the pack, is left unset)."""
    lines = ["{", ".reg .f32 u, t;", ".reg .b32 q<8>, w;"]
    return "\n".join(lines + codes_ptx([f"${2 + i}" for i in range(8)], "$10", "$18", "$26", "$34", "$0") + ["}"])


CODES_ASM = tl.constexpr(_codes_text())


@triton.jit
def _codes_store(r, scale, zph, rcp, c_row, mask, DTYPE: tl.constexpr, ROWS: tl.constexpr, N: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Codes of ``r: [ROWS, N]`` (rotated, fp32; or already rounded to the model dtype on the
    GPU) packed into ``N // 2`` bytes per row at ``c_row``."""
    if INTERPRET:
        packed = pack_nibbles(int4_codes(round_to_model_f32(r, DTYPE, INTERPRET), scale, zph, rcp, INTERPRET),
                              ROWS, N)
    else:
        ch, cl, pw = split_reciprocal(scale, rcp, INTERPRET)  # per row (the parts' calls share it)
        row = [cl[:, None], ch[:, None], pw[:, None], zph[:, None]]
        if r.dtype == tl.float32:
            y = tl.inline_asm_elementwise(CODES_ASM, "=r,=r," + "f," * 39 + "f",
                                          [round_to_model_f32(r, DTYPE, INTERPRET)] + row,
                                          dtype=tl.uint8, is_pure=True, pack=8)  # bytes 0..3 of each 8: the codes
        else:
            asm: tl.constexpr = PACKED_CODES_F16 if r.dtype == tl.float16 else PACKED_CODES_BF16
            y = tl.inline_asm_elementwise(asm, "=r,=r," + "r," * 4 + "f," * 31 + "f",
                                          [r] + row, dtype=tl.uint8, is_pure=True, pack=8)
        y = tl.permute(tl.reshape(y, (ROWS, N // 8, 2, 4)), (0, 1, 3, 2))
        packed = tl.reshape(tl.split(y)[0], (ROWS, N // 2))
    tl.store(c_row + tl.arange(0, N // 2)[None, :], packed, mask=mask[:, None])


@triton.jit
def _rotated_part(x_row, sign_ptr, first, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr,
                  INTERPRET: tl.constexpr, MMA: tl.constexpr, tab_ptr,
                  m_row, smooth, OFFSET: tl.constexpr, LANE_M: tl.constexpr):
    """Columns ``first .. first+N`` of each row, sign-flipped and Walsh–Hadamard transformed (fp32).

    ``MMA`` (N = 32): the transform on tensor cores (``int4_mma``; ``tab_ptr`` its sign table).
    ``OFFSET`` and ``smooth`` (this program writes K): the rows' key offsets at ``m_row`` (model
    dtype) are subtracted first, in fp32, rounded back to the model dtype (the oracle's
    ``smooth_keys``), so the rotation below takes the same model-dtype rows either way. The
    offsets are loaded with the same shape, element size and contiguity as ``x``, hence in its
    layout: the rotation's inline asm receives the same lane arrangement.
    ``LANE_M`` (MMA on the GPU, every row of a lane of one head): ``m_row`` is this part's entries
    of the lane table (signs and ``-s ⊙ m``), loaded once per program (``int4_mma.lane_part``),
    subtracted inside the tensor-core asm on packed pairs."""
    cols = first + tl.arange(0, N)
    x = tl.load(x_row + cols[None, :])  # [ROWS, N] model dtype; every row's address in bounds (clamped)
    if LANE_M and MMA and not INTERPRET:
        r = mma_part_sub(x, m_row)
    else:
        if OFFSET:  # predicated, not branched: V programs load nothing and subtract 0 (exact)
            m = tl.load(m_row + cols[None, :], mask=tl.full([ROWS, N], 1, tl.int1) & smooth, other=0.0)  # [ROWS, N]
            x = to_model_dtype(x.to(tl.float32) - m.to(tl.float32), x.dtype, INTERPRET)
        if INTERPRET:
            r = fwht_rows(x.to(tl.float32) * tl.load(sign_ptr + cols)[None, :], ROWS, N, LOG2_N)
        elif MMA:  # the sign bits from the sign table
            r = mma_part(x, tab_ptr, first)
        else:
            sgn = tl.load(sign_ptr + cols)[None, :]
            r = tl.inline_asm_elementwise(fwht_text(LOG2_N, x.dtype == tl.float16), "=f," * 8 + "r," * 11 + "r",
                                          [x, sgn.to(tl.int32, bitcast=True)], dtype=tl.float32, is_pure=True,
                                          pack=8)
    return r


@triton.jit
def _rotated_quad(x_row, sign_ptr, first, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr,
                  INTERPRET: tl.constexpr, MMA: tl.constexpr, tab_ptr,
                  ma, mb, mc, md, smooth, OFFSET: tl.constexpr, LANE_M: tl.constexpr):
    """Parts ``first + k·N`` (k = 0..3) rotated, then the oracle's stages N and 2N across them
    (``ma .. md``: the parts' offsets, see ``_rotated_part``'s ``m_row``)."""
    r0 = _rotated_part(x_row, sign_ptr, first, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                       ma, smooth, OFFSET, LANE_M)
    r1 = _rotated_part(x_row, sign_ptr, first + N, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                       mb, smooth, OFFSET, LANE_M)
    r2 = _rotated_part(x_row, sign_ptr, first + 2 * N, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                       mc, smooth, OFFSET, LANE_M)
    r3 = _rotated_part(x_row, sign_ptr, first + 3 * N, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                       md, smooth, OFFSET, LANE_M)
    r0, r1 = r0 + r1, r0 - r1  # stage N: parts 0 and 1, 2 and 3
    r2, r3 = r2 + r3, r2 - r3
    r0, r2 = r0 + r2, r0 - r2  # stage 2N: parts 0 and 2, 1 and 3
    r1, r3 = r1 + r3, r1 - r3
    return r0, r1, r2, r3


@triton.jit
def _min_max2(lo, hi, r, INTERPRET: tl.constexpr):
    lo2, hi2 = row_min_max(r, INTERPRET)
    return tl.minimum(lo, lo2, propagate_nan=tl.PropagateNan.ALL), tl.maximum(hi, hi2, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _codes_stores(r0, r1, r2, r3, r4, r5, r6, r7, scale, zph, rcp, c_row, mask, DTYPE: tl.constexpr,
                  ROWS: tl.constexpr, N: tl.constexpr, PARTS: tl.constexpr, INTERPRET: tl.constexpr):
    """Each part's codes stored by itself (N // 2 bytes per row and part)."""
    _codes_store(r0, scale, zph, rcp, c_row, mask, DTYPE, ROWS, N, INTERPRET)
    if PARTS >= 2:
        _codes_store(r1, scale, zph, rcp, c_row + N // 2, mask, DTYPE, ROWS, N, INTERPRET)
    if PARTS >= 4:
        _codes_store(r2, scale, zph, rcp, c_row + N, mask, DTYPE, ROWS, N, INTERPRET)
        _codes_store(r3, scale, zph, rcp, c_row + 3 * N // 2, mask, DTYPE, ROWS, N, INTERPRET)
    if PARTS == 8:
        _codes_store(r4, scale, zph, rcp, c_row + 2 * N, mask, DTYPE, ROWS, N, INTERPRET)
        _codes_store(r5, scale, zph, rcp, c_row + 5 * N // 2, mask, DTYPE, ROWS, N, INTERPRET)
        _codes_store(r6, scale, zph, rcp, c_row + 3 * N, mask, DTYPE, ROWS, N, INTERPRET)
        _codes_store(r7, scale, zph, rcp, c_row + 7 * N // 2, mask, DTYPE, ROWS, N, INTERPRET)


@triton.jit
def _parts_range_each(r0, r1, r2, r3, r4, r5, r6, r7, PARTS: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-row (min, max) over the first PARTS parts, one row reduction per part (NaN-propagating)."""
    lo, hi = row_min_max(r0, INTERPRET)
    if PARTS >= 2:
        lo, hi = _min_max2(lo, hi, r1, INTERPRET)
    if PARTS >= 4:
        lo, hi = _min_max2(lo, hi, r2, INTERPRET)
        lo, hi = _min_max2(lo, hi, r3, INTERPRET)
    if PARTS == 8:
        lo, hi = _min_max2(lo, hi, r4, INTERPRET)
        lo, hi = _min_max2(lo, hi, r5, INTERPRET)
        lo, hi = _min_max2(lo, hi, r6, INTERPRET)
        lo, hi = _min_max2(lo, hi, r7, INTERPRET)
    return lo, hi


@triton.jit
def _parts_range(r0, r1, r2, r3, r4, r5, r6, r7, PARTS: tl.constexpr):
    """The same on the GPU with the parts folded elementwise first (in-lane) and one row
    reduction at the end: fewer cross-lane steps when several lanes share a row."""
    lo = r0
    hi = r0
    if PARTS >= 2:
        lo = _min_nan(lo, r1)
        hi = _max_nan(hi, r1)
    if PARTS >= 4:
        lo = _min_nan(lo, _min_nan(r2, r3))
        hi = _max_nan(hi, _max_nan(r2, r3))
    if PARTS == 8:
        lo = _min_nan(lo, _min_nan(_min_nan(r4, r5), _min_nan(r6, r7)))
        hi = _max_nan(hi, _max_nan(_max_nan(r4, r5), _max_nan(r6, r7)))
    return tl.reduce(lo, 1, _min_nan), tl.reduce(hi, 1, _max_nan)


@triton.jit
def _lane_entries(base, like, PARTS: tl.constexpr, HEADS: tl.constexpr):
    """The lanes' entries of the lane table for parts 0 .. PARTS-1 (``int4_mma.lane_part``; parts
    past PARTS alias part 0, unread). ``base``: int64 address of the table's K half, or V half."""
    m0 = lane_part(base, like, 0, HEADS)
    m1, m2, m3, m4, m5, m6, m7 = m0, m0, m0, m0, m0, m0, m0
    if PARTS >= 2:
        m1 = lane_part(base, like, 1, HEADS)
    if PARTS >= 4:
        m2 = lane_part(base, like, 2, HEADS)
        m3 = lane_part(base, like, 3, HEADS)
    if PARTS == 8:
        m4 = lane_part(base, like, 4, HEADS)
        m5 = lane_part(base, like, 5, HEADS)
        m6 = lane_part(base, like, 6, HEADS)
        m7 = lane_part(base, like, 7, HEADS)
    return m0, m1, m2, m3, m4, m5, m6, m7


@triton.jit
def _int4_rows(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, sign_ptr,
    tab_ptr, key_offset_ptr, num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, LOG2_N: tl.constexpr, INTERPRET: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONTIG: tl.constexpr,
    MMA: tl.constexpr, PACKED: tl.constexpr, FAST_RCP: tl.constexpr, OFFSET: tl.constexpr,
    LANE_M: tl.constexpr, LOOP: tl.constexpr,
):
    """The body of both kernels below (their arguments; ``MMA`` picks the rotation of a part).
    Program ``(t, 0)`` quantizes rows ``t·ROWS ..`` of K, ``(t, 1)`` the same rows of V (small
    per-program state: many programs hide latency); with ``LOOP`` program ``(p, kv)`` does tiles
    ``p, p + P, ..`` (``P`` programs along axis 0), so what it loads once serves many tiles.

    ``LANE_M`` (int4-mma on the GPU, every row a lane holds of one head, see
    ``int4_mma.lane_text``): each program loads its lanes' entries of the lane table once, 32
    bytes per lane and part (the signs and ``-s ⊙ m``; V programs the table's V half, whose
    offsets are -0 and change nothing), before its tiles.
    """
    kv = tl.program_id(1) == 0
    m0, m1, m2, m3, m4, m5, m6, m7 = 0, 0, 0, 0, 0, 0, 0, 0
    if LANE_M and MMA and not INTERPRET:  # the V half follows the K half: PARTS x heads x 4 entries of 16 halves
        base = tl.where(kv, key_offset_ptr, key_offset_ptr + PARTS * NUM_KV_HEADS * 64).to(tl.int64)
        m0, m1, m2, m3, m4, m5, m6, m7 = _lane_entries(base, sign_bits(tab_ptr, 0, ROWS), PARTS, NUM_KV_HEADS)
    a = (key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, sign_ptr,
         tab_ptr, key_offset_ptr, num_rows, num_slots,
         stride_key_token, stride_key_head, stride_value_token, stride_value_head,
         stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
         stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head)
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(num_rows, ROWS), tl.num_programs(0)):
            _int4_tile(tile, kv, m0, m1, m2, m3, m4, m5, m6, m7, a, ROWS, D, PARTS, LOG2_N, INTERPRET,
                       CACHE_ALIGN, NUM_KV_HEADS, BLOCK_SIZE, CONTIG, MMA, PACKED, FAST_RCP, OFFSET, LANE_M)
    else:
        _int4_tile(tl.program_id(0), kv, m0, m1, m2, m3, m4, m5, m6, m7, a, ROWS, D, PARTS, LOG2_N,
                   INTERPRET, CACHE_ALIGN, NUM_KV_HEADS, BLOCK_SIZE, CONTIG, MMA, PACKED, FAST_RCP, OFFSET, LANE_M)


@triton.jit
def _int4_tile(
    tile, kv, m0, m1, m2, m3, m4, m5, m6, m7, a,
    ROWS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, LOG2_N: tl.constexpr, INTERPRET: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONTIG: tl.constexpr,
    MMA: tl.constexpr, PACKED: tl.constexpr, FAST_RCP: tl.constexpr, OFFSET: tl.constexpr, LANE_M: tl.constexpr,
):
    """Rows ``tile·ROWS ..`` of K (``kv``) or V: load, rotate, range, codes, scale.

    PARTS (1, 2, 4 or 8): the row is loaded as PARTS column ranges of ``N = D/PARTS``; the same
    lanes hold element ``i`` of every part, each part is transformed by the lanes (or one
    tensor-core product, MMA), and the oracle's last ``log2(PARTS)`` stages (pairs ``N``, ``2N``,
    ``4N`` apart) are in-lane adds and subtracts: fewer shuffle stages, and the per-row work is
    shared by fewer lanes. ``OFFSET``: K programs subtract each row's key offset right after
    its load (``_rotated_part``; ``m0 .. m7`` the parts' lane offsets with ``LANE_M``, else each
    row's offsets are loaded there), V programs subtract nothing. ``a``: ``_int4_rows``'s
    pointers, row counts and strides, in its order.
    """
    (key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, sign_ptr,
     tab_ptr, key_offset_ptr, num_rows, num_slots,
     stride_key_token, stride_key_head, stride_value_token, stride_value_head,
     stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
     stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head) = a
    N: tl.constexpr = D // PARTS
    x_ptr = tl.where(kv, key_ptr, value_ptr)
    cache_ptr = tl.where(kv, key_cache_ptr, value_cache_ptr)
    scale_ptr = tl.where(kv, k_scale_ptr, v_scale_ptr)
    dtype = x_ptr.dtype.element_ty
    rows = tile * ROWS + tl.arange(0, ROWS)  # the launcher keeps rows < 2**31
    valid = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # a partial tile reads the last row again: no masked loads
    token = rows // NUM_KV_HEADS
    head = rows - token * NUM_KV_HEADS
    smooth = kv  # only keys are smoothed
    if not LANE_M:  # OFFSET: each row's head offsets, [NUM_KV_HEADS, D], for every part
        m_row = key_offset_ptr + (head * D)[:, None]
        m0, m1, m2, m3, m4, m5, m6, m7 = m_row, m_row, m_row, m_row, m_row, m_row, m_row, m_row
    if CONTIG:  # [num_tokens, num_kv_heads, D] contiguous: the tile is one stretch of memory
        x_row = x_ptr + (rows.to(tl.int64) * D)[:, None]
    else:
        x_row = x_ptr + (token.to(tl.int64) * tl.where(kv, stride_key_token, stride_value_token)
                         + head * tl.where(kv, stride_key_head, stride_value_head))[:, None]
    if PARTS <= 2:
        r0 = _rotated_part(x_row, sign_ptr, 0, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                           m0, smooth, OFFSET, LANE_M)  # [ROWS, N] fp32
        r1 = r0
        if PARTS == 2:
            r1 = _rotated_part(x_row, sign_ptr, N, ROWS, N, LOG2_N, INTERPRET, MMA, tab_ptr,
                               m1, smooth, OFFSET, LANE_M)
            r0, r1 = r0 + r1, r0 - r1  # the oracle's last stage: pairs N apart, in one lane
        r2 = r0
        r3 = r0
    else:
        r0, r1, r2, r3 = _rotated_quad(x_row, sign_ptr, 0, ROWS, N, LOG2_N, INTERPRET, MMA,
                                       tab_ptr, m0, m1, m2, m3, smooth, OFFSET, LANE_M)
    r4 = r0
    r5 = r0
    r6 = r0
    r7 = r0
    if PARTS == 8:
        r4, r5, r6, r7 = _rotated_quad(x_row, sign_ptr, 4 * N, ROWS, N, LOG2_N, INTERPRET, MMA,
                                       tab_ptr, m4, m5, m6, m7, smooth, OFFSET, LANE_M)
        r0, r4 = r0 + r4, r0 - r4  # stage 4N: part k with part k + 4
        r1, r5 = r1 + r5, r1 - r5
        r2, r6 = r2 + r6, r2 - r6
        r3, r7 = r3 + r7, r3 - r7
    if MMA and PACKED and not INTERPRET:  # round once (pairs), the range of the rounded parts
        r0, r1, r2, r3 = r0.to(dtype), r1.to(dtype), r2.to(dtype), r3.to(dtype)  # RNE, cvt.rn.*x2 pairs
        r4, r5, r6, r7 = r4.to(dtype), r5.to(dtype), r6.to(dtype), r7.to(dtype)
        hi, nlo = packed_range(r0, r1, r2, r3, r4, r5, r6, r7, PARTS)  # rounded, and clamped at 0 already
        lo = fneg(nlo, INTERPRET)  # -max(-min, 0) == min(min, 0)
    else:
        if MMA and not INTERPRET:  # elementwise across parts first: one cross-lane reduction per row
            lo, hi = _parts_range(r0, r1, r2, r3, r4, r5, r6, r7, PARTS)
        else:
            lo, hi = _parts_range_each(r0, r1, r2, r3, r4, r5, r6, r7, PARTS, INTERPRET)
        # range from the fp32 rotation: rounding to the model dtype is monotone, so the rounded
        # row's min/max is the rounded min/max; NaN anywhere makes both NaN
        lo = tl.minimum(round_to_model_f32(lo, dtype, INTERPRET), 0.0, propagate_nan=tl.PropagateNan.ALL)
        hi = tl.maximum(round_to_model_f32(hi, dtype, INTERPRET), 0.0, propagate_nan=tl.PropagateNan.ALL)
    slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1)
    mask = valid & (slot >= 0) & (slot < num_slots)  # never write outside, checked or not
    slot = slot.to(tl.int32)  # rows outside the mask compute offsets that no access uses
    blk = (slot // BLOCK_SIZE).to(tl.int64)
    off = slot % BLOCK_SIZE
    ok = (hi <= 3.4028234663852886e38) & (lo >= -3.4028234663852886e38)  # false for NaN/Inf rows
    scale, zp, rcp = int4_scale_zp(lo, hi, INTERPRET, FAST_RCP)
    zph = tl.where(ok, zp + 0.5, float("-inf"))  # -inf: every code clamps to 0
    c_row = cache_ptr + ((blk * tl.where(kv, stride_kc_block, stride_vc_block)
                          + off * tl.where(kv, stride_kc_slot, stride_vc_slot)
                          + head * tl.where(kv, stride_kc_head, stride_vc_head)) * CACHE_ALIGN)[:, None]
    _codes_stores(r0, r1, r2, r3, r4, r5, r6, r7, scale, zph, rcp, c_row, mask, dtype, ROWS, N, PARTS, INTERPRET)
    bits = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)  # -16 == ~0xF
    bits = tl.where(ok, bits, NAN_SCALE)
    s_off = (blk * tl.where(kv, stride_ks_block, stride_vs_block) + off * tl.where(kv, stride_ks_slot, stride_vs_slot)
             + head * tl.where(kv, stride_ks_head, stride_vs_head))
    tl.store(scale_ptr + s_off, bits, mask=mask)


@dual_jit
def _reshape_and_cache_int4_lanes_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, D] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, D // 2] uint8
    k_scale_ptr, v_scale_ptr,        # [num_blocks, block_size, num_kv_heads] int32 (float32 bits)
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    sign_ptr,                        # [D] fp32 RHT signs
    tab_ptr,                         # unused (the int4-mma kernel's table): both kernels take one argument list
    key_offset_ptr,                  # OFFSET: [NUM_KV_HEADS, D] model dtype key offsets; else unused
    num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, LOG2_N: tl.constexpr, INTERPRET: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONTIG: tl.constexpr,
    FAST_RCP: tl.constexpr, OFFSET: tl.constexpr,
):
    """Path ``int4-lanes``. Grid ``(cdiv(num_rows, ROWS), 2)``: program ``(t, kv)`` writes rows
    ``t·ROWS ..`` of K (kv 0) or V (kv 1); each part rotated by butterflies in registers and warp
    shuffles, the oracle's additions in its order (bit-identical codes and scales)."""
    _int4_rows(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
               sign_ptr, tab_ptr, key_offset_ptr, num_rows, num_slots,
               stride_key_token, stride_key_head, stride_value_token, stride_value_head,
               stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
               stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
               ROWS, D, PARTS, LOG2_N, INTERPRET, CACHE_ALIGN, NUM_KV_HEADS, BLOCK_SIZE, CONTIG,
               False, False, FAST_RCP, OFFSET, False, False)


@dual_jit
def _reshape_and_cache_int4_mma_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    slot_mapping_ptr,                # as in _reshape_and_cache_int4_lanes_kernel
    sign_ptr,                        # [D] fp32 RHT signs (the interpreter's butterflies)
    tab_ptr,                         # int4_mma.sign_table in the input dtype: the signs' bits
    key_offset_ptr,                  # as in the lanes kernel; LANE_M: offsets.lane_offset_table
    num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
    ROWS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, LOG2_N: tl.constexpr, INTERPRET: tl.constexpr,
    CACHE_ALIGN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CONTIG: tl.constexpr,
    PACKED: tl.constexpr, FAST_RCP: tl.constexpr, OFFSET: tl.constexpr,
    LANE_M: tl.constexpr, LOOP: tl.constexpr,
):
    """Path ``int4-mma``. Grid and programs as the lanes kernel's; parts of 32 columns
    (``PARTS = D / 32``), each rotated by ``mma.sync`` (``int4_mma``); ``PACKED`` takes the row
    range on rounded pairs, ``LANE_M`` (where ``plan.lane_offsets_fit`` holds) loads each lane's
    key offsets once per program and subtracts them in the tensor-core asm, ``LOOP``: each
    program does every ``P``-th tile (the plan's grid)."""
    _int4_rows(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
               sign_ptr, tab_ptr, key_offset_ptr, num_rows, num_slots,
               stride_key_token, stride_key_head, stride_value_token, stride_value_head,
               stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
               stride_ks_block, stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head,
               ROWS, D, PARTS, LOG2_N, INTERPRET, CACHE_ALIGN, NUM_KV_HEADS, BLOCK_SIZE, CONTIG,
               True, PACKED, FAST_RCP, OFFSET, LANE_M, LOOP)


def launch_int4_lanes(plan: WritePlan, t: WriteArgs) -> None:
    """Run an ``int4-lanes`` or ``int4-mma`` plan on ``t`` (validated by ``plan.write_plan``)."""
    shape, tuning, d = plan.shape, plan.tuning, plan.shape.head_size
    mma = plan.path == "int4-mma"
    dev = str(t.key.device)
    ks, vs = t.k_scale_cache.view(torch.int32), t.v_scale_cache.view(torch.int32)
    align = cache_alignment(t.key_cache, t.value_cache)
    parts = d // MMA_COLS if mma else tuning.parts
    signs = rht_signs(d, dev)
    args = dict(
        key_ptr=t.key, value_ptr=t.value, key_cache_ptr=t.key_cache, value_cache_ptr=t.value_cache,
        k_scale_ptr=ks, v_scale_ptr=vs, slot_mapping_ptr=t.slot_mapping, sign_ptr=signs,
        tab_ptr=sign_table(d, t.key.dtype, dev, rht_sign_seed()) if mma else signs,
        key_offset_ptr=t.key if t.key_offset is None else t.key_offset,
        num_rows=shape.num_tokens * shape.num_kv_heads, num_slots=shape.num_blocks * shape.block_size,
        **stride_args(t, align, ks, vs),
        ROWS=tuning.rows, D=d, PARTS=parts, LOG2_N=(d // parts).bit_length() - 1, INTERPRET=plan.interpret,
        CACHE_ALIGN=align, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        CONTIG=packed_rows(t.key) and packed_rows(t.value), FAST_RCP=bool(tuning.fast_rcp),
        OFFSET=t.key_offset is not None,
        num_warps=tuning.num_warps, enable_fp_fusion=False)
    if mma:
        lane = plan.lane_offsets   # the plan saw the key offset (write_plan)
        if lane:   # the lanes load their signs and -s ⊙ m (offsets.lane_offset_table), 32 bytes per part
            args["key_offset_ptr"] = lane_offset_table(t.key_offset, rht_sign_seed())
        extra = {"maxnreg": tuning.maxnreg} if tuning.maxnreg else {}
        launch(_reshape_and_cache_int4_mma_kernel, plan.grid,
               dict(args, PACKED=bool(tuning.packed_range), LANE_M=lane,
                    LOOP=lane and plan.grid[0] < cdiv(args["num_rows"], tuning.rows), **extra))
    else:
        launch(_reshape_and_cache_int4_lanes_kernel, plan.grid, args)
