"""The INT4 writer's codes PTX (``CODES_ASM``, ``PACKED_CODES_*``) and its two-operation division,
without a GPU.

On the GPU every INT4 code comes from that PTX text; the CPU tests run the interpreter's
division instead. Here the text itself runs through a small emulator of its instructions (fp32
products and additions rounded as IEEE does; ``fma`` rounded once, exactly, through fractions),
fed with the per-row words ``split_reciprocal`` computes in Triton's interpreter, and every nibble
is compared with the PyTorch oracle's codes. ``bench/check_int4_division.py`` is checked here on
a sample of scales (the full check, every scale significand, runs on a GPU:
``python -m bench.check_int4_division``).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton.language as tl

from kernels._jit import dual_jit
from kernels.write.int4_lanes import CODES_ASM
from kernels.write.int4_mma import PACKED_CODES_BF16, PACKED_CODES_F16
from kernels.write.device_math import split_reciprocal
from kernels.reference import quantize_int4_rows, single_rht, unpack_int4_nibbles
from bench import check_int4_division as cid


def _val(bits: int) -> np.float32:
    return np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def _exact(op, *bits: int) -> int:
    """``op`` on fp32 operands, computed exactly and rounded once; IEEE's NaN / Inf rules when
    an operand or the result is not finite (there float64 gives the same answer)."""
    v = [_val(b) for b in bits]
    if all(np.isfinite(v)):
        x = op(*(Fraction(float(a)) for a in v))
        if abs(x) < Fraction(2) ** 128:
            return _bits(x)
    with np.errstate(all="ignore"):
        r = np.float32(op(*(np.float64(a) for a in v)))
    return int(np.array([r], dtype=np.float32).view(np.uint32)[0])


def _bits(x: Fraction) -> int:
    """``x`` rounded to the nearest fp32 (ties to even), as bits; normal range only."""
    if x == 0:
        return 0
    a = abs(x)
    e = math.floor(math.log2(a))
    while a >= Fraction(2) ** (e + 1):
        e += 1
    while a < Fraction(2) ** e:
        e -= 1
    q = a / Fraction(2) ** (e - 23)  # in [2**23, 2**24)
    n, rem = divmod(q.numerator, q.denominator)
    rem = Fraction(rem, q.denominator)
    n += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1)
    v = np.float32(n * 2.0 ** (e - 23) * (1 if x > 0 else -1))
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def _trunc_s32(bits: int) -> int:
    v = np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]
    if np.isnan(v):
        return 0
    return int(max(-2 ** 31, min(2 ** 31 - 1, math.trunc(float(v))))) if np.isfinite(v) else (
        2 ** 31 - 1 if v > 0 else -2 ** 31)


def run_codes_ptx(text: str, ops: dict) -> dict:
    """Execute a codes PTX text on one lane's operands ``ops`` ($k -> 32-bit int)."""
    reg = dict(ops)

    def val(name: str) -> int:
        if name.startswith("0f"):
            return int(name[2:], 16)
        if name.startswith("0x"):
            return int(name, 16)
        return reg[name] if not name.isdigit() else int(name)

    for line in text.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.rstrip(";").split(" ", 1)
        if m := re.fullmatch(r"\{(\w+), (\w+)\}, (\$\d+)", args):  # mov.b32 {h0, h1}, $k
            reg[m[1]], reg[m[2]] = reg[m[3]] & 0xFFFF, reg[m[3]] >> 16
            continue
        a = [s.strip() for s in args.split(",")]
        x = [val(s) for s in a[1:]]
        if op == "mul.rn.f32":
            reg[a[0]] = _exact(lambda p, q: p * q, x[0], x[1])
        elif op == "fma.rn.f32":
            reg[a[0]] = _exact(lambda p, q, c: p * q + c, x[0], x[1], x[2])
        elif op == "cvt.rzi.s32.f32":
            reg[a[0]] = _trunc_s32(x[0]) & 0xFFFFFFFF
        elif op == "cvt.pack.sat.u4.s32.b32":
            def sat(v):
                v = v - (1 << 32) if v >> 31 else v
                return min(max(v, 0), 15)
            reg[a[0]] = ((x[2] << 8) | (sat(x[0]) << 4) | sat(x[1])) & 0xFFFFFFFF
        elif op == "shl.b32":
            reg[a[0]] = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            reg[a[0]] = x[0] & x[1]
        elif op == "cvt.f32.f16":
            h = np.array([x[0]], dtype=np.uint16).view(np.float16)[0]
            reg[a[0]] = int(np.array([h], dtype=np.float32).view(np.uint32)[0])
        else:
            raise AssertionError(f"emulator: unknown PTX line {line!r}")
    return reg


@dual_jit
def _row_words_kernel(lo_ptr, hi_ptr, out_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):
    """The kernel's per-row words from a row's (lo, hi): scale, RN(1/scale), zp + 0.5, ch, cl, pw."""
    i = tl.arange(0, N)
    lo = tl.load(lo_ptr + i)
    hi = tl.load(hi_ptr + i)
    scale = tl.maximum((hi - lo) / 15.0, 1e-6)  # the interpreter divides correctly rounded
    rcp = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    zp = tl.floor(tl.minimum(tl.maximum(-lo / scale + 0.5, 0.0), 15.0))
    ch, cl, pw = split_reciprocal(scale, rcp, INTERPRET)
    for k, v in enumerate((scale, rcp, zp + 0.5, ch, cl, pw)):
        tl.store(out_ptr + k * N + i, v)


def _rows(dtype: torch.dtype, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, d, generator=g)
    x[1] = 0.0
    x[2] = 3.0  # constant: one nonzero rotated value
    x[3, 5] = 11.0  # one-hot rows rotate to equal magnitudes: max == -min
    x[3, :5] = 0.0
    x[3, 6:] = 0.0
    x[4] = torch.eye(d)[d - 1] * -0.37
    x[5, 9] = 300.0  # an outlier channel
    x[6] = torch.randn(d, generator=g) * 1e-4
    x[7] = torch.randn(d, generator=g) * 4e3
    for k in range(24):  # more one-hot rows: t of the extremes sits near 7.5, next to a code boundary
        x[8 + k] = torch.eye(d)[k] * (1.0 + k / 7.0) * (-1) ** k
    return x.to(dtype)


@pytest.mark.parametrize("text,dtype", [("CODES_ASM", torch.bfloat16), ("CODES_ASM", torch.float16),
                                        ("PACKED", torch.bfloat16), ("PACKED", torch.float16)])
def test_codes_ptx_gives_the_oracles_codes(text, dtype):
    """Every nibble of 64 rows (random, zeros, constant, one-hot, outlier, tiny, large) from the
    PTX text equals the oracle's code. The one-hot rows put quotients next to code boundaries:
    with ``ch`` and ``cl`` swapped (a division still within one ulp) every case here fails, as
    it does with ``pw`` left out (both checked when the test was written)."""
    d = 64
    x = _rows(dtype, d)
    want_packed, _ = quantize_int4_rows(x)
    want = unpack_int4_nibbles(want_packed)
    r = single_rht(x).float()  # rotated and rounded to the model dtype, as the kernel stores them
    lo, hi = r.amin(-1).clamp(max=0.0).contiguous(), r.amax(-1).clamp(min=0.0).contiguous()
    words = torch.empty(6, len(x))
    with np.errstate(invalid="ignore"):  # the fp16 rows that overflow to Inf give NaN words, as on the GPU
        _row_words_kernel[(1,)](lo, hi, words, N=len(x), INTERPRET=True)
    words = words.numpy().view(np.uint32).astype(np.int64)
    f16 = dtype == torch.float16
    body = CODES_ASM.value if text == "CODES_ASM" else (PACKED_CODES_F16 if f16 else PACKED_CODES_BF16).value
    rbits = r.numpy().view(np.uint32).astype(np.int64)
    half = single_rht(x).contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    got = np.zeros((len(x), d), dtype=np.int64)
    for row in range(len(x)):
        _, _, zph, ch, cl, pw = (int(w[row]) for w in words)
        for first in range(0, d, 8):
            if text == "CODES_ASM":  # $2..$9 values, then 8 copies each of cl, ch, pw, zph
                ops = {f"${2 + i}": int(rbits[row, first + i]) for i in range(8)}
                base = 10
            else:  # $2..$5 packed pairs (element 2j in the low half)
                ops = {f"${2 + j}": int(half[row, first + 2 * j] | half[row, first + 2 * j + 1] << 16) for j in range(4)}
                base = 6
            for k, w in enumerate((cl, ch, pw, zph)):
                ops.update({f"${base + 8 * k + i}": w for i in range(8)})
            out = run_codes_ptx(body, ops)["$0"]
            got[row, first:first + 8] = [(out >> (4 * i)) & 0xF for i in range(8)]
    assert np.array_equal(got, want.numpy().astype(np.int64)), np.argwhere(got != want.numpy())[:5]


def test_division_check_on_a_sample_of_scales():
    """The tool's CPU mode: the sampled scales (edges included) give RN(r / scale) exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        res = cid.check(dtype, "cpu", cid.sample_scales(6, seed=3), log=lambda m: None)
        assert res["quotients"] == 13 * res["r"] and res["mismatches"] == 0 and res["code_disagreements"] == 0


def test_division_check_counts_codes_that_move():
    """A one-ulp difference below a rounding boundary of ``t + zp + 0.5`` is counted; one in the
    middle of a code's range is not."""
    boundary = np.float32(2.5) - np.float32(2.0 ** -21)  # RN(t + 0.5) rounds up to 3 here, not one ulp below
    below = np.nextafter(boundary, np.float32(0))
    assert cid.code_disagreements(np.array([boundary]), np.array([below])) > 0
    mid = np.float32(2.0)
    assert cid.code_disagreements(np.array([mid]), np.array([np.nextafter(mid, np.float32(0))])) == 0
