"""Device helpers of the write kernels: row addressing, rounding, rotation, division and INT4 codes.

Each helper gives the same bits on the GPU and in Triton's interpreter. On the GPU,
``fp32 -> bf16`` and ``fp32 -> float8e4nv`` casts are the hardware's round-to-nearest-even
conversions, like ``torch``'s; Triton 3.9's interpreter instead truncates ``fp32 -> bf16``
and rounds fp8 half-up without carrying into the exponent, so under ``INTERPRET`` the value
is first rounded in fp32 with exact integer or magic-number arithmetic and only then cast.
"""

import triton
import triton.language as tl

from layouts.geometry import NAN_SCALE_BITS

# the scale word stored for a row whose input holds NaN/Inf (codes 0): a quiet NaN, zero point 0
NAN_SCALE = tl.constexpr(NAN_SCALE_BITS)


@triton.jit
def tile_rows(tile, num_rows, slot_mapping_ptr, num_slots,
              ROWS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Rows ``tile*ROWS ..``: (write mask, token int64, head, block int64, offset in block), [ROWS] each."""
    rows = tile * ROWS + tl.arange(0, ROWS)  # int32: the launcher keeps rows and slots < 2**31
    valid = rows < num_rows
    token = rows // NUM_KV_HEADS
    head = rows - token * NUM_KV_HEADS
    slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1)
    mask = valid & (slot >= 0) & (slot < num_slots)  # never write outside, checked or not
    slot = slot.to(tl.int32)  # rows outside the mask compute offsets that no access uses
    blk = (slot // BLOCK_SIZE).to(tl.int64)
    off = slot % BLOCK_SIZE
    return mask, token.to(tl.int64), head, blk, off


@triton.jit
def round_bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32; NaN/Inf stay non-finite."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_model_dtype(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast fp32 ``x`` to ``DTYPE`` (bf16/fp16), rounding to nearest even on both back ends."""
    if INTERPRET and DTYPE == tl.bfloat16:
        x = round_bf16_rne(x)
    return x.to(DTYPE)


@triton.jit
def round_half_even(v):
    """fp32 round half to even for ``|v| < 2**22``: adding 1.5·2**23 leaves no fraction bits."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def to_fp8e4m3_bits(v, INTERPRET: tl.constexpr):
    """fp32 in [-448, 448] -> float8_e4m3fn bits as uint8, round to nearest even (torch's cast)."""
    if INTERPRET:
        # e4m3's quantum at |v| is 2**(max(exponent, -6) - 3); adding 1.5·2**(23 + that) rounds to it
        # (on |v|, then the sign put back, so a negative value that rounds to 0 stays -0 like torch's)
        bits = v.to(tl.int32, bitcast=True)
        q = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
        magic = (((q + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
        a = (tl.abs(v) + magic) - magic
        v = (a.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr):
    """Unnormalised Walsh–Hadamard transform of each row of ``x: [ROWS, N]`` fp32.

    Stage ``k`` pairs elements ``2**k`` apart, smallest first, exactly as the oracle's
    ``fwht``; the same fp32 additions in the same order give the same bits.
    """
    for k in tl.static_range(LOG2_N):
        # y: [ROWS, N // 2**(k+1), 2**k, 2]; the butterfly pair sits in the last axis
        y = tl.permute(tl.reshape(x, (ROWS, N // (2 << k), 2, 1 << k)), (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, N))
    return x


@triton.jit
def rotate_chunk(x, rot, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr,
                 DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """``H·(s ⊙ x)`` per row of ``x: [ROWS, N]`` (model dtype) as fp32 [ROWS, N].

    ``rot`` is ``diag(s)·H`` [N, N] in the model dtype for DOT, else the signs ``s`` [N] fp32.
    """
    if DOT:
        if INTERPRET:  # Triton 3.9's interpreter gets bf16 dots wrong; fp32 "ieee" is exact here
            r = tl.dot(x.to(tl.float32), rot.to(tl.float32), input_precision="ieee")
        else:  # ±1 products are exact; only the fp32 accumulation order differs from fwht
            r = tl.dot(x, rot)
    else:
        r = fwht_rows(x.to(tl.float32) * rot[None, :], ROWS, N, LOG2_N)
    return r


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_min_max(r, INTERPRET: tl.constexpr):
    """Per-row (min, max) of ``r: [ROWS, N]`` fp32; a NaN anywhere in a row makes both NaN.

    The GPU reduces with NaN-propagating min/max (free). The interpreter runs such a custom
    reduction element by element in Python, so there ``sum(r * 0)`` (NaN exactly when the row
    holds a NaN or an Inf) is added to plain min/max instead.
    """
    if INTERPRET:
        poison = tl.sum(r * 0.0, axis=1)
        return tl.min(r, axis=1) + poison, tl.max(r, axis=1) + poison
    else:
        return tl.reduce(r, 1, _min_nan), tl.reduce(r, 1, _max_nan)


@triton.jit
def fneg(x, INTERPRET: tl.constexpr):
    """``-x`` (fp32). Triton writes a float negation as ``0 - x``, an ``FADD`` that ptxas may not fold
    (``0 - (+0)`` is ``+0``); PTX ``neg.f32`` folds into the consuming ``FFMA`` / ``FADD`` as an operand
    sign. Every use here is a per-row value whose zero sign no code or scale can see."""
    if INTERPRET:
        return -x
    else:
        return tl.inline_asm_elementwise("neg.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def markstein_div(a, b, rcp_b, INTERPRET: tl.constexpr):
    """``RN(a / b)`` given ``rcp_b = RN(1 / b)``: Markstein's correction of ``a·rcp_b`` is exact
    (no overflow or underflow here). The residual is written ``-(q·b - a)`` so ``a = ±0`` keeps its sign.

    The correction needs a fused multiply-add. Triton 3.6's interpreter computes ``tl.fma`` as a
    multiply and an add, two roundings (3.9's is fused), so interpreted kernels divide instead:
    the interpreter's ``/`` is NumPy's float32 division, correctly rounded, the same ``RN(a / b)``."""
    if INTERPRET:
        q = a / b
    else:
        q = a * rcp_b
        q = tl.fma(fneg(tl.fma(q, b, fneg(a, INTERPRET)), INTERPRET), rcp_b, q)
    return q


@triton.jit
def split_reciprocal(scale, rcp, INTERPRET: tl.constexpr):
    """A row's ``1/scale`` as ``pw · (ch + cl)`` for :func:`div_split` (fp32, [ROWS]), given ``rcp = RN(1/scale)``.

    ``pw`` is rcp's power of two and ``ch = rcp / pw`` its significand in [1, 2), both taken from
    rcp's bits, so ``ch = RN(1/sp)`` for ``sp = scale·pw`` (exact). ``e = 1 - sp·ch`` is exact in one
    FMA and ``cl = RN(e / sp) = RN(1/sp - ch)`` by :func:`markstein_div` with ``ch`` as the reciprocal: a 48-bit reciprocal whose
    low word stays a normal number whatever the row's exponent (``1/scale`` itself would give a
    subnormal low word above ``scale = 2**101``). A row with ``rcp = 0`` or NaN gives NaN in
    ``cl`` (its codes are 0 through ``zph = -inf`` anyway)."""
    rb = rcp.to(tl.int32, bitcast=True)
    pw = (rb & 0x7F800000).to(tl.float32, bitcast=True)
    ch = ((rb & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    sp = scale * pw
    e = tl.fma(fneg(sp, INTERPRET), ch, 1.0)
    return ch, markstein_div(e, sp, ch, INTERPRET), pw


@triton.jit
def div_split(r, ch, cl):
    """``RN(r / sp)`` in two operations for values ``r`` of at most 11 significant bits (bf16 or fp16
    values, as the INT4 writer's rotated and rounded rows are), given :func:`split_reciprocal`'s
    ``ch`` and ``cl``: ``fma(r, ch, RN(r·cl))`` rounds ``r·(ch + cl)`` plus an error below
    ``2**-47·|r/sp|`` once. No bound proves that equal to ``RN(r / sp)`` (a quotient can sit
    ``2**-48`` of itself from a rounding boundary); ``bench/check_int4_division.py`` checks every
    fp32 scale significand against every bf16 and fp16 significand of ``r`` on the GPU, and a
    quotient that differs by one unit only matters if it moves an INT4 code. The result times
    ``pw`` (exact) is ``RN(r / scale)``."""
    return tl.fma(r, ch, r * cl)


# RN(1/s) for a normal s with a normal reciprocal: rcp.approx, one Newton step, then Markstein's
# correction (e = 1 - s·y exact, y + y·e rounded once). No slow path, unlike div.rn / rcp.rn, whose
# branch to a subnormal handler costs register moves around it; bench/check_int4_division.py
# compares it with div_rn for every significand at seven exponents on the GPU: identical.
RCP_PTX = tl.constexpr("{ .reg .f32 y, e, ns; neg.f32 ns, $1; rcp.approx.ftz.f32 y, $1; fma.rn.f32 e, ns, y, 1.0; "
                       "fma.rn.f32 y, y, e, y; fma.rn.f32 e, ns, y, 1.0; fma.rn.f32 $0, y, e, y; }")


@triton.jit
def rcp_fast(x):
    """:data:`RCP_PTX` elementwise (GPU only): ``RN(1/x)`` for a normal ``x`` with a normal reciprocal."""
    return tl.inline_asm_elementwise(RCP_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def int4_scale_zp(lo, hi, INTERPRET: tl.constexpr, FAST_RCP: tl.constexpr):
    """The INT4 scale and zero point of one zero-inclusive range per row: ``scale``, ``zp`` and ``RN(1/scale)``
    (fp32, [ROWS]). One correctly rounded reciprocal per row; the divisions are exact Markstein
    corrections. ``FAST_RCP`` (GPU): the reciprocal is :data:`RCP_PTX` instead of ``div_rn``.
    For a finite rotated row ``scale`` lies in [1e-6, 2·FLT_MAX / (15·sqrt(head_size))] (the
    transform's fp32 sums overflow before a range could), where both agree; a row with a NaN or
    an Inf gets NaN there instead of 0 (or NaN), and stores codes 0 and the NaN scale either way."""
    scale = tl.maximum(markstein_div(hi - lo, 15.0, 1.0 / 15.0, INTERPRET), 1e-6)
    if FAST_RCP and not INTERPRET:
        rcp = rcp_fast(scale)
    else:
        rcp = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    # rha(w) for w = -lo / scale >= 0 is floor(w + 0.5); fmax/fmin also map NaN to 0
    zp = tl.floor(tl.minimum(tl.maximum(markstein_div(fneg(lo, INTERPRET), scale, rcp, INTERPRET) + 0.5, 0.0), 15.0))
    return scale, zp, rcp


@triton.jit
def divide_rows(x, scale, rcp, INTERPRET: tl.constexpr):
    """``RN(x / scale[:, None])`` for ``x: [ROWS, N]`` fp32, given ``rcp = RN(1/scale)`` per row:
    Markstein's correction of ``x·rcp``, exact here (no overflow or underflow), one multiply and
    two FMAs per element instead of a division."""
    return markstein_div(x, scale[:, None], rcp[:, None], INTERPRET)


@triton.jit
def int4_codes(r, scale, zph, rcp, INTERPRET: tl.constexpr):
    """Codes ``clamp(rha(r / scale + zp), 0, 15)`` as int32 [ROWS, N], given ``zph = zp + 0.5``
    per row (``-inf`` for a row that must store codes 0: every code then clamps to 0)."""
    t = divide_rows(r, scale, rcp, INTERPRET)
    # rha(t + zp) on the clamped range is floor(t + zp + 0.5). One rounding of t + (zp + 0.5)
    # floors like the oracle's two: t + zp and t + zp + 0.5 share a binade whose ulp divides
    # 0.5, or straddle a power of two >= 1 that both reach; the one window where they differ
    # (just below 0.5) holds no exact t + zp, a multiple of ulp(t) >= 2**-25 there.
    # v < 0 and NaN clamp to code 0; truncation is floor for v >= 0.
    v = t + zph[:, None]
    return tl.minimum(tl.maximum(v, 0.0), 15.0).to(tl.int32)


@triton.jit
def int4_sq_err(q, r, scale, zp):
    """Per-row squared error ``sum(((q - zp) * scale - r)**2)`` of codes ``q`` [ROWS, N]."""
    d = (q.to(tl.float32) - zp[:, None]) * scale[:, None] - r
    return tl.sum(d * d, axis=1)


@triton.jit
def pack_nibbles(q, ROWS: tl.constexpr, N: tl.constexpr):
    """int32 codes [ROWS, N] -> uint8 [ROWS, N // 2], even element in the low nibble."""
    even, odd = tl.split(tl.reshape(q, (ROWS, N // 2, 2)))
    return (even | (odd << 4)).to(tl.uint8)


# --- helpers of the INT4 lanes / mma kernels (fewer instructions per element on the GPU) ---


@triton.jit
def round_to_model_f32(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to the nearest ``DTYPE`` value (ties to even), returned as fp32.

    On the GPU a bf16 pair costs one ``cvt.rn.bf16x2.f32`` and two bit operations (the
    plain cast is one conversion plus one shift per element); fp16 and the interpreter
    take the plain path.
    """
    if INTERPRET or DTYPE != tl.bfloat16:
        y = to_model_dtype(x, DTYPE, INTERPRET).to(tl.float32)
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
            "=r,=r,f,f", [x], dtype=tl.int32, is_pure=True, pack=2).to(tl.float32, bitcast=True)
    return y


def codes_ptx(vals, cl: str, ch: str, pw: str, zph: str, out: str) -> list[str]:
    """PTX lines of the INT4 codes of 8 fp32 values (register names ``vals``, bf16 or fp16 values)
    of one row: ``RN(v / scale)`` as :func:`div_split` from the row's ``cl`` and ``ch`` (one
    multiply, one FMA), ``fma(t, pw, zph)`` (``t·pw`` exact: one rounding of the quotient plus
    ``zp + 0.5``, as ``t + zph`` in :func:`int4_codes`), ``cvt.rzi.s32`` (NaN and -inf give 0;
    truncation is floor on >= 0), then ``cvt.pack.sat.u4.s32`` clamps pairs to [0, 15] into one
    word ``out`` (element 0 in the low nibble). ``sat_u4(trunc_s32(v))`` equals
    ``min(trunc_u32_sat(v), 15)`` for every v. Uses the registers ``u, t`` (.f32) and ``q0..q7,
    w`` (.b32), which the caller declares."""
    lines = []
    for i, v in enumerate(vals):
        lines += [f"mul.rn.f32 u, {v}, {cl};", f"fma.rn.f32 t, {v}, {ch}, u;", f"fma.rn.f32 t, t, {pw}, {zph};",
                  f"cvt.rzi.s32.f32 q{i}, t;"]
    return lines + ["cvt.pack.sat.u4.s32.b32 w, q7, q6, 0;", "cvt.pack.sat.u4.s32.b32 w, q5, q4, w;",
                    "cvt.pack.sat.u4.s32.b32 w, q3, q2, w;", f"cvt.pack.sat.u4.s32.b32 {out}, q1, q0, w;"]
