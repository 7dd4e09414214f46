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
operand, ``B[k][n] = H_32[a(k)][σ(n)]``: 16 words per lane (:func:`b_word`), which are all
``±B0``, one word per lane that the asm computes from the lane id (:func:`b_text`): no table, no
load, two registers. The sign flip ``s ⊙ x`` is one XOR per packed pair with the signs' bit 15
(:func:`sign_table`).

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


@triton.constexpr_function
def b_negated(q: int) -> bool:
    """Whether word ``q`` of every lane is ``-B0`` (both halves' signs flipped) rather than ``B0``,
    its word 0. The sign of ``H_32[a][c]`` is the parity of ``a & c``; across words only ``a``'s
    bits 1 and 2 (``r``, ``ks``) and ``c``'s bits 1 and 2 (``nn``) change, so the word's sign
    pattern is word 0's times ``(-1)^(r·nn₀ + ks·nn₁)``, the same for every lane and both halves."""
    ks, nn, r = q >> 3, (q >> 1) & 3, q & 1
    return bool((r & nn & 1) ^ (ks & (nn >> 1)))


@triton.constexpr_function
def b_text(one: int) -> list:
    """PTX lines that set ``bp`` to the lane's ``B0`` (:func:`b_word` ``(lane, 0)``) and ``bn`` to
    ``-B0``: half ``e`` of ``B0`` is ``±1`` with sign parity ``(t & (g >> 1)) ^ (e & g)``, for lane
    ``l = 4g + t``, i.e. ``p0 = parity(l & (l >> 3) & 3)`` and ``p1 = p0 ^ bit 2 of l``."""
    return ["mov.u32 l, %laneid;", "shr.u32 p, l, 3;", "and.b32 p, p, l;", "and.b32 p, p, 3;",
            "popc.b32 p, p;", "and.b32 p, p, 1;",                      # p0
            "shr.u32 q, l, 2;", "xor.b32 q, q, p;", "and.b32 q, q, 1;",  # p1
            "shl.b32 p, p, 15;", "shl.b32 q, q, 31;", "or.b32 bp, p, q;", f"or.b32 bp, bp, {one * 0x10001:#x};",
            "xor.b32 bn, bp, 0x80008000;"]


@functools.lru_cache(maxsize=None)
def sign_table(head_size: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """``[head_size]`` 16-bit in ``dtype``: the rotation signs' bits (``0x8000`` where ``s = -1``), bit
    patterns, not values. Made once per (head_size, dtype, device, sign seed:
    ``layouts.rotation.rht_sign_seed()``, part of the cache key only)."""
    bits = np.where(rht_signs(head_size).numpy() < 0, 0x8000, 0).astype(np.uint16)
    return torch.from_numpy(bits.view(np.int16)).view(dtype).to(device)


@triton.constexpr_function
def mma_text(f16, sub=False):
    """PTX for one lane's 16 values of a ``[16, 32]`` part (rows g, g+8; packed pairs $16..$23)
    and the sign bits $24..$31 in; ``H_32 · (s ⊙ x)`` out in $0..$15 (row g's columns 8t..8t+7,
    then row g+8's), fp32; the B words are ``±B0`` (:func:`b_text`, :func:`b_negated`). ``sub``:
    $24..$31 hold the lane's entry of the lane table instead (:func:`lane_text`): the signs of its
    8 columns as ``±1`` pairs in $24..$27, the signed, negated key offsets ``-s ⊙ m`` of them in
    $28..$31; one ``fma(x, s, -s·m) = RN(s·(x - m)) = s·RN(x - m)`` per pair of either row does
    the subtraction and the sign flip, ``x - m`` rounded once to the model dtype as the oracle
    rounds it (see :func:`lane_text`)."""
    ty = "f16" if f16 else "bf16"
    lines = ["{", ".reg .b32 a<8>, l, p, q, bp, bn;", ".reg .f32 z;", "mov.b32 z, 0f00000000;"]
    lines += b_text(0x3C00 if f16 else 0x3F80)  # bits of 1.0
    if sub:  # fma.rn(x, ±1, -s·m) on packed pairs: the products are exact, one rounding
        lines += [f"fma.rn.{ty}x2 a{w}, ${16 + w}, ${24 + w % 4}, ${28 + w % 4};" for w in range(8)]
    else:
        lines += [f"xor.b32 a{w}, ${16 + w}, ${24 + w};" for w in range(8)]  # a0..3 row g, a4..7 row g+8
    for nn in range(4):
        d = f"${2 * nn}, ${2 * nn + 1}, ${8 + 2 * nn}, ${9 + 2 * nn}"
        for ks in range(2):
            a = f"a{2 * ks}, a{4 + 2 * ks}, a{2 * ks + 1}, a{5 + 2 * ks}"
            b = ", ".join("bn" if b_negated(8 * ks + 2 * nn + r) else "bp" for r in (0, 1))
            c = "z, z, z, z" if ks == 0 else d
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{d}}}, {{{a}}}, {{{b}}}, {{{c}}};")
    lines.append("}")
    return "\n".join(lines)


@triton.constexpr_function
def lane_text(heads, part):
    """PTX that loads one lane's entry of part ``part`` of ``offsets.lane_offset_table``: 32 bytes
    out in $0..$7 (the ``±1`` signs of the lane's 8 columns ``32·part + 8t ..``, then ``-s ⊙ m`` of
    them), in: the byte address of the table's K or V half in $16 (16 "l" operands, all equal).

    Every row a lane holds has one head: rows ``8·warp + g + 8·warps·k`` of a tile that starts at
    a multiple of ``heads`` (a power of two dividing ``8·warps``, ``plan.lane_offsets_fit``), so
    its head is ``(tid >> 2) mod heads`` and its entry ``e = tid mod 4·heads`` (head ``e >> 2``,
    column group ``t = e & 3``): two 16-byte loads at ``32·(4·heads·part + e)``.

    The subtraction in :func:`mma_text` rounds the exact ``x - m`` once; the oracle rounds
    ``float32(x) - float32(m)`` to the model dtype, the same value: the fp32 difference of two
    bf16/fp16 values is exact unless their exponents are more than 15 apart, and then the exact
    difference lies within far less than half a model-dtype ulp of the larger operand, which is
    on the model-dtype grid, so no rounding tie can differ. NaN and Inf propagate. Only the sign
    of an exact zero can differ (``x = m`` with ``s = -1``: +0 here, -0 in the oracle's
    ``s·(x - m)``), which no code or scale depends on. V programs load the V half, whose offsets
    are -0 (``fma(x, s, -0)`` is ``s·x`` exactly, signed zeros included)."""
    at = 32 * 4 * heads * part
    return "\n".join([
        "{", ".reg .b32 e;", ".reg .b64 ad;",
        "mov.u32 e, %tid.x;", f"and.b32 e, e, {4 * heads - 1};", "mul.wide.u32 ad, e, 32;", "add.s64 ad, ad, $16;",
        f"ld.global.nc.v4.b32 {{$0, $1, $2, $3}}, [ad+{at}];",
        f"ld.global.nc.v4.b32 {{$4, $5, $6, $7}}, [ad+{at + 16}];", "}"])


@triton.jit
def sign_bits(tab_ptr, first, ROWS: tl.constexpr):
    """``[ROWS, 32]`` 16-bit: the sign bits of columns ``first ..`` (every row the same, from
    :func:`sign_table` at ``tab_ptr``), loaded in the parts' 2D layout (a 1D load would be
    converted), as the tensor-core asm takes them."""
    cols = first + tl.arange(0, MMA_N)[None, :] + 0 * tl.arange(0, ROWS)[:, None]
    return tl.load(tab_ptr + cols)


@triton.jit
def mma_part(x, tab_ptr, first):
    """``H_32 · (s ⊙ x)`` of a loaded part ``x: [ROWS, 32]`` (columns ``first ..``), fp32."""
    return tl.inline_asm_elementwise(mma_text(x.dtype == tl.float16), "=f," * 16 + "r," * 15 + "r",
                                     [x, sign_bits(tab_ptr, first, x.shape[0])], dtype=tl.float32,
                                     is_pure=True, pack=16)


@triton.jit
def mma_part_sub(x, lane):
    """``H_32 · (s ⊙ RN(x - m))`` of a loaded part ``x: [ROWS, 32]``, given its lanes' entries of
    the lane table (:func:`lane_part`, same shape and layout), fp32."""
    return tl.inline_asm_elementwise(mma_text(x.dtype == tl.float16, True), "=f," * 16 + "r," * 15 + "r",
                                     [x, lane], dtype=tl.float32, is_pure=True, pack=16)


@triton.jit
def lane_part(base, like, PART: tl.constexpr, HEADS: tl.constexpr):
    """``[ROWS, 32]`` 16-bit: each lane's entry of part ``PART`` of the lane table (:func:`lane_text`:
    two 16-byte loads per lane), in the parts' layout: ``like`` (a ``[ROWS, 32]`` 16-bit tensor in
    that layout, a part's sign bits) is an operand only so that the result has its layout. ``base``:
    int64 address of the table's K half, or of its V half in V programs."""
    at = tl.full(like.shape, 0, tl.int64) + base
    return tl.inline_asm_elementwise(lane_text(HEADS, PART), "=r," * 7 + "=r," + "r," * 8 + "l," * 15 + "l",
                                     [like, at], dtype=like.dtype, is_pure=True, pack=16)


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

