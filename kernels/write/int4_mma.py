"""The tensor-core rotation of path ``int4-mma``: one ``mma.sync`` tile per 32 columns of 16 rows.

``H_d = H_{d/32} ⊗ H_32`` (Sylvester order: column ``i = 32·b + a``), so the rotation of a row
is a 32-point transform of each 32-column *part* ``b`` followed by the ``d/32``-point transform
across parts. The kernels' shared frame (``int4_lanes._int4_rows``) does the second step with
in-lane fp32 adds; here the first is a matrix product on tensor cores instead of 5 butterfly stages and 2 shuffle stages:
``D_b = (s ⊙ x)[:, part b] · H_32`` with ``mma.sync.m16n8k16`` (bf16 or fp16 operands, fp32
accumulation), 2 k-steps × 4 n-tiles = 8 instructions per part of 16 rows.

Where the values are, with Triton's coalesced layout of a ``[ROWS, 32]`` 16-bit load
(``sizePerThread [1, 8]``, ``threadsPerWarp [8, 4]``): lane ``l = 4g + t`` holds columns
``8t .. 8t+7`` of rows ``g`` and ``g + 8`` (of each 16-row group), as 4 + 4 packed pairs, which
``inline_asm_elementwise(pack=16)`` hands over in that order. Those registers *are* the mma's A
fragments if the k index is permuted: in k-step ``ks`` fragment column ``2t + e`` is part
column ``8t + 4ks + e`` and ``2t + 8 + e`` is ``8t + 4ks + 2 + e`` — no data moves. The output
columns are permuted so that the D fragment lands where the load put its inputs: n-tile ``nn``,
fragment column ``2t + e`` is part column ``σ = 8t + 2nn + e``, i.e. lane ``4g + t`` again holds
columns ``8t .. 8t+7`` of its two rows, in order. Both permutations live in the constant B
operand, ``B[k][n] = H_32[a(k)][σ(n)]``: 16 words per lane (:func:`b_words`), loaded once per
program from a small table in the lane's own layout. The sign flip ``s ⊙ x`` is one XOR per
packed pair with the signs' bit 15 (a 16-bit table after B).

Exactness: products are exact (±x) but the tensor core adds 32 of them in its own order (and
its own rounding), not the oracle's butterfly order, so a rotated value can rarely round to the
neighbouring bf16/fp16 — a tie row, as with the fused ``tl.dot`` kernel. Rows whose partial
sums are exact in fp32 (narrow exponent range) come out bit-identical. NaN/Inf propagate (a row
with one non-finite value rotates to all non-finite values) and the kernel stores such rows as
the oracle does.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from layouts import rht_signs

from .device_math import codes_ptx
from .tuning import MMA_COLS

MMA_N = tl.constexpr(MMA_COLS)
B_HALVES = tl.constexpr(32 * 32)  # the B table: 32 lanes × 16 words × 2 halves
PM_HALF = 32 * 32 + 256  # the table's ±1 halves start here (after the sign bits of up to 256 columns)
NZ_HALF = PM_HALF + 256   # then -0 halves for 16 heads x 256 columns: what V programs load as offsets
NZ_HALVES = 16 * 256
PM_AT = tl.constexpr(PM_HALF)
NZ_AT = tl.constexpr(NZ_HALF)
_ONE = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}  # bits of 1.0


def b_word(lane: int, q: int, one: int) -> int:
    """Word ``q`` (0..15) of lane ``lane``'s B fragments: k-step ``q >> 3``, n-tile ``(q >> 1) & 3``,
    register ``q & 1``; two ±1 halves of ``H_32[a][σ]`` (even k in the low half)."""
    g, t = lane >> 2, lane & 3
    ks, nn, r = q >> 3, (q >> 1) & 3, q & 1
    c = 8 * (g >> 1) + 2 * nn + (g & 1)  # σ(8·nn + g): the output column of fragment column g
    word = 0
    for e in (0, 1):
        a = 8 * t + 4 * ks + 2 * r + e  # the part column of fragment row 2t + 8r + e
        word |= (one | (bin(a & c).count("1") & 1) << 15) << (16 * e)
    return word


@functools.lru_cache(maxsize=None)
def mma_table(head_size: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """``[NZ_AT + NZ_HALVES]`` 16-bit table in ``dtype``: lane ``l``'s B words at ``l·32 ..``
    (half ``2q + e`` of word ``q``), then the sign bits (``0x8000`` where ``s = -1``) per column,
    then from ``PM_AT`` the signs as model-dtype values ``±1`` per column, then from ``NZ_AT``
    ``NZ_HALVES`` halves of -0 (what V programs load as their lane offsets).
    Made once per (head_size, dtype, device, sign seed: ``layouts.rotation.rht_sign_seed()``, part of
    the cache key only); bit patterns, not values."""
    one = _ONE[dtype]
    halves = [(b_word(lane, q, one) >> (16 * e)) & 0xFFFF for lane in range(32) for q in range(16) for e in (0, 1)]
    col_signs = rht_signs(head_size).tolist()
    halves += [0x8000 if s < 0 else 0 for s in col_signs] + [0] * (PM_HALF - 32 * 32 - head_size)
    halves += [one | 0x8000 if s < 0 else one for s in col_signs] + [0] * (NZ_HALF - PM_HALF - head_size)
    halves += [0x8000] * NZ_HALVES
    return torch.from_numpy(np.array(halves, dtype=np.uint16).view(np.int16)).view(dtype).to(device)


@triton.constexpr_function
def mma_text(f16, sub=False):
    """PTX for one lane's 16 values of a ``[16, 32]`` part (rows g, g+8; packed pairs $16..$23),
    the sign bits $24..$31 and B words $32..$47 in; ``H_32 · (s ⊙ x)`` out in $0..$15 (row g's
    columns 8t..8t+7, then row g+8's), fp32. ``sub``: $24..$31 hold the signs as ``±1`` pairs
    instead of sign bits and $48..$55 the lane's signed, negated key offsets ``-s ⊙ m`` (the same
    arrangement as x): one ``fma(x, s, -s·m) = RN(s·(x - m)) = s·RN(x - m)`` per pair does the
    subtraction and the sign flip, ``x - m`` rounded once to the model dtype as the oracle rounds
    it (:func:`lane_offsets_text`)."""
    ty = "f16" if f16 else "bf16"
    lines = ["{", ".reg .b32 a<8>;", ".reg .f32 z;", "mov.b32 z, 0f00000000;"]
    if sub:  # fma.rn(x, ±1, -s·m) on packed pairs: the products are exact, one rounding
        lines += [f"fma.rn.{ty}x2 a{w}, ${16 + w}, ${24 + w}, ${48 + w};" for w in range(8)]
    else:
        lines += [f"xor.b32 a{w}, ${16 + w}, ${24 + w};" for w in range(8)]  # a0..3 row g, a4..7 row g+8
    for nn in range(4):
        d = f"${2 * nn}, ${2 * nn + 1}, ${8 + 2 * nn}, ${9 + 2 * nn}"
        for ks in range(2):
            a = f"a{2 * ks}, a{4 + 2 * ks}, a{2 * ks + 1}, a{5 + 2 * ks}"
            b = f"${32 + 8 * ks + 2 * nn}, ${33 + 8 * ks + 2 * nn}"
            c = "z, z, z, z" if ks == 0 else d
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{d}}}, {{{a}}}, {{{b}}}, {{{c}}};")
    lines.append("}")
    return "\n".join(lines)


@triton.constexpr_function
def lane_offsets_text(heads, d, warps, first):
    """PTX that loads one lane's signed, negated key offsets ``-s ⊙ m`` for a part (columns
    ``first ..``): out $0..$7 (16 model-dtype values as packed pairs, rows g and g+8 as the part's
    loads hold them), in: the byte address of head 0's column 0 in $16 (16 "l" operands, all
    equal): of ``offsets.lane_offset_table``'s tensor, or of the table's -0 halves (``NZ_AT``).

    Every row a lane holds has one head: rows ``8·warp + g + 8·warps·k`` of a tile that starts at
    a multiple of ``heads``, head = row mod ``heads``, with ``heads`` dividing ``8·warps`` (the
    plan checks both, ``plan.lane_offsets_fit``). So one 16-byte load at ``2·(head·d +
    first + 8t)`` gives the lane's 8 offsets, copied to both rows' words. V programs load -0
    (``fma(x, s, -0)`` is ``s·x`` exactly, signed zeros included: their rows come out as without
    offsets).

    The subtraction in :func:`mma_text` rounds the exact ``x - m`` once; the oracle rounds
    ``float32(x) - float32(m)`` to the model dtype, the same value: the fp32 difference of two
    bf16/fp16 values is exact unless their exponents are more than 15 apart, and then the exact
    difference lies within far less than half a model-dtype ulp of the larger operand, which is
    on the model-dtype grid, so no rounding tie can differ. NaN and Inf propagate. Only the sign
    of an exact zero can differ (``x = m`` with ``s = -1``: +0 here, -0 in the oracle's
    ``s·(x - m)``), which no code or scale depends on."""
    return "\n".join([
        "{", ".reg .b32 o, l;", ".reg .b64 ad;",
        "mov.u32 o, %tid.x;", "shr.u32 o, o, 5;", "shl.b32 o, o, 3;",  # 8 * warp
        "mov.u32 l, %laneid;", "shr.u32 l, l, 2;", "add.u32 o, o, l;",  # + g
        f"and.b32 o, o, {heads - 1};", f"mul.lo.u32 o, o, {d};",  # head * d
        "mov.u32 l, %laneid;", "and.b32 l, l, 3;", "shl.b32 l, l, 3;", "add.u32 o, o, l;",  # + 8t
        f"add.u32 o, o, {first};", "mul.wide.u32 ad, o, 2;", "add.u64 ad, ad, $16;",
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [ad];",
        "mov.b32 $4, $0;", "mov.b32 $5, $1;", "mov.b32 $6, $2;", "mov.b32 $7, $3;", "}"])


@triton.jit
def mma_b_operands(tab_ptr, ROWS: tl.constexpr, WARPS: tl.constexpr):
    """The B words as two ``[ROWS, 32]`` 16-bit tensors in the parts' layout: element (row, col)
    sits in lane ``4·(row % 8) + col // 8`` as half ``col % 8`` of that lane's words 0..3 (first
    row of the pair) or 4..7 (second); the second tensor holds words 8..15."""
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, MMA_N)[None, :]
    off = ((rows % 8) * 4 + cols // 8) * 32 + ((rows // (8 * WARPS)) % 2) * 8 + cols % 8
    return tl.load(tab_ptr + off), tl.load(tab_ptr + off + 16)


@triton.jit
def signs(tab_ptr, AT: tl.constexpr, first, ROWS: tl.constexpr):
    """``[ROWS, 32]`` 16-bit: the signs of columns ``first ..`` (every row the same) from the
    table's region at ``AT``: ``B_HALVES`` their sign bits, ``PM_AT`` their model-dtype ``±1``;
    loaded in the parts' 2D layout (a 1D load would be converted), as the tensor-core asm takes them."""
    cols = first + tl.arange(0, MMA_N)[None, :] + 0 * tl.arange(0, ROWS)[:, None]
    return tl.load(tab_ptr + AT + cols)


@triton.jit
def mma_part(x, tab_ptr, first, b0, b1):
    """``H_32 · (s ⊙ x)`` of a loaded part ``x: [ROWS, 32]`` (columns ``first ..``), fp32."""
    return tl.inline_asm_elementwise(mma_text(x.dtype == tl.float16), "=f," * 16 + "r," * 31 + "r",
                                     [x, signs(tab_ptr, B_HALVES, first, x.shape[0]), b0, b1], dtype=tl.float32,
                                     is_pure=True, pack=16)


@triton.jit
def mma_part_sub(x, m, tab_ptr, first, b0, b1):
    """``H_32 · (s ⊙ RN(x - m))`` of a loaded part ``x: [ROWS, 32]`` and its lanes' signed, negated
    key offsets ``-s ⊙ m`` (:func:`lane_offsets_part`, same shape and layout), fp32."""
    return tl.inline_asm_elementwise(mma_text(x.dtype == tl.float16, True), "=f," * 16 + "r," * 39 + "r",
                                     [x, signs(tab_ptr, PM_AT, first, x.shape[0]), b0, b1, m], dtype=tl.float32,
                                     is_pure=True, pack=16)


@triton.jit
def lane_offsets_part(base, tab_ptr, first: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
                      D: tl.constexpr, WARPS: tl.constexpr):
    """``[ROWS, 32]`` (the model dtype: the table's) key offsets of part ``first ..`` as each lane needs
    them (:func:`lane_offsets_text`: one 16-byte load per lane), in the parts' layout: the asm
    takes the ``±1`` signs' ``[ROWS, 32]`` load (:func:`signs`, which the part's rotation loads too)
    as a second operand only so that its result has that load's layout, the layout of every
    part. ``base``: int64 address of ``offsets.lane_offset_table``'s tensor, or of the table's -0
    halves (``NZ_AT``) for none."""
    sg = signs(tab_ptr, PM_AT, first, ROWS)
    at = tl.full([ROWS, MMA_N], 0, tl.int64) + base
    return tl.inline_asm_elementwise(lane_offsets_text(HEADS, D, WARPS, first), "=r," * 7 + "=r," + "r," * 8
                                     + "l," * 15 + "l", [sg, at], dtype=sg.dtype, is_pure=True, pack=16)


# --- the row range on rounded pairs (MmaTuning.packed_range) ---


def _packed_codes_text(f16):
    """PTX for 8 values rounded to the model dtype, packed in pairs $2..$5, and their row's
    :func:`~kernels.write.device_math.split_reciprocal` words ``cl`` $6, ``ch`` $14, ``pw`` $22 and
    ``zp + 0.5`` $30: the lanes kernel's ``CODES_ASM`` after an exact widening of each value to
    fp32; the packed word in $0 ($1 unset)."""
    lines = ["{", ".reg .f32 r<8>, u, t;", ".reg .b32 q<8>, w;", ".reg .b16 h<2>;"]
    for j in range(4):
        if f16:
            lines += [f"mov.b32 {{h0, h1}}, ${2 + j};", f"cvt.f32.f16 r{2 * j}, h0;", f"cvt.f32.f16 r{2 * j + 1}, h1;"]
        else:
            lines += [f"shl.b32 r{2 * j}, ${2 + j}, 16;", f"and.b32 r{2 * j + 1}, ${2 + j}, 0xFFFF0000;"]
    return "\n".join(lines + codes_ptx([f"r{i}" for i in range(8)], "$6", "$14", "$22", "$30", "$0") + ["}"])


PACKED_CODES_BF16 = tl.constexpr(_packed_codes_text(False))
PACKED_CODES_F16 = tl.constexpr(_packed_codes_text(True))


@triton.constexpr_function
def range_text(parts, f16):
    """PTX for one lane's ``parts`` x 8 rounded values (packed pairs from $16 on, one row): the
    row's ``max(max, 0)`` in $0..$7 and ``max(-min, 0)`` in $8..$15 (fp32; NaN in all if any value
    of the row is NaN). ``max.NaN`` / ``min.NaN`` on .bf16x2 / .f16x2 pairs (exact, NaN-propagating
    per half); the max and the negated min (sign bits flipped: exact) are paired so one more
    ``max.NaN`` folds the halves, two shuffles combine the row's 4 lanes, and one last ``max.NaN``
    with a zero pair takes both clamps of the zero-inclusive range."""
    ty = "f16x2" if f16 else "bf16x2"
    lines = ["{", ".reg .b32 mx, mn, a, b;", ".reg .b16 h<2>;", "mov.b32 mx, $16;", "mov.b32 mn, $16;"]
    for k in range(1, 4 * parts):
        lines += [f"max.NaN.{ty} mx, mx, ${16 + k};", f"min.NaN.{ty} mn, mn, ${16 + k};"]
    lines += ["xor.b32 mn, mn, 0x80008000;", "prmt.b32 a, mx, mn, 0x5410;", "prmt.b32 b, mx, mn, 0x7632;",
              f"max.NaN.{ty} a, a, b;"]
    for j in range(2):
        lines += [f"shfl.sync.bfly.b32 b, a, {1 << j}, 31, -1;", f"max.NaN.{ty} a, a, b;"]
    lines += ["mov.b32 b, 0;", f"max.NaN.{ty} a, a, b;"]
    if f16:
        lines += ["mov.b32 {h0, h1}, a;", "cvt.f32.f16 $0, h0;", "cvt.f32.f16 $8, h1;"]
    else:
        lines += ["shl.b32 $0, a, 16;", "and.b32 $8, a, 0xFFFF0000;"]
    lines += [f"mov.b32 ${i}, $0;" for i in range(1, 8)] + [f"mov.b32 ${i}, $8;" for i in range(9, 16)] + ["}"]
    return "\n".join(lines)


@triton.jit
def _first(a, b):
    return a


@triton.jit
def packed_range(q0, q1, q2, q3, q4, q5, q6, q7, PARTS: tl.constexpr):
    """Row ``(max(max, 0), max(-min, 0))`` [ROWS] fp32 of the rounded parts (model dtype [ROWS, 32]), NaN-propagating.
    All 8 tensors always: parts past PARTS alias part 0 and the text leaves them unread."""
    asm: tl.constexpr = range_text(PARTS, q0.dtype == tl.float16)
    mx, nmn = tl.inline_asm_elementwise(asm, "=f," * 16 + "r," * 31 + "r", [q0, q1, q2, q3, q4, q5, q6, q7],
                                        dtype=(tl.float32, tl.float32), is_pure=True, pack=8)
    # every value of a row is already the row's: the reduction only changes the layout to [ROWS]
    return tl.reduce(mx, 1, _first), tl.reduce(nmn, 1, _first)

