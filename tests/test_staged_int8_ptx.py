"""The PTX of the staged INT8 / FP8 decode kernel (``kernels/attention/decode_staged_int8_gluon.py``),
emulated on the CPU against the packed cache's byte layout (docs/LAYOUT.md): which words each thread
loads, and what the conversions make of them, must give every score and value dot the dims the
query loads and the store expect."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

int8 = pytest.importorskip("kernels.attention.decode_staged_int8_gluon", reason="needs Triton's Gluon dialect",
                         exc_type=ImportError)
int4 = pytest.importorskip("kernels.attention.decode_staged_int4_gluon", reason="needs Triton's Gluon dialect",
                         exc_type=ImportError)

ROW = 132


def _offsets(asm):
    return [int(m) for m in re.findall(r"ld\.shared\.b32[^\[]*\[\$\d+\+(\d+)\]", asm)]


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * k)) & 7] << (8 * k) for k in range(4))


def _run(asm: str, ins: list[int]) -> list[int]:
    """Emulate the conversion asm's xor / prmt / lop3 (lut 0x6A) / mov / cvt (e4m3x2) lines."""
    regs = {f"${4 + i}": v for i, v in enumerate(ins)}
    out = {}

    def val(x):
        x = x.strip()
        return regs[x] if x in regs else int(x, 16) if x.startswith("0x") else int(x)

    for stmt in asm.strip("{} ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [a.strip() for a in rest.split(",")] if not rest.startswith("{") else None
        if op == "xor.b32":
            regs[args[0]] = val(args[1]) ^ val(args[2])
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "lop3.b32":
            assert args[4] == "0x6A"
            x, m, c = val(args[1]), val(args[2]), val(args[3])
            regs[args[0]] = (m & (x ^ c)) | (~m & c) & 0xFFFFFFFF
        elif op == "mov.b32":  # mov.b32 {lo, hi}, x
            lo, hi = re.match(r"\{(\w+), (\w+)\}, (\S+)", rest).groups()[:2]
            x = val(rest.split(",")[-1])
            regs[lo], regs[hi] = x & 0xFFFF, x >> 16
        elif op == "cvt.rn.f16x2.e4m3x2":
            h = val(args[1])
            f = torch.tensor([h & 0xFF, h >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
            regs[args[0]] = int(f.view(torch.int16)[0]) & 0xFFFF | (int(f.view(torch.int16)[1]) & 0xFFFF) << 16
        else:
            raise AssertionError(f"unknown op {op}")
        if args and args[0].startswith("$"):
            out[args[0]] = regs[args[0]]
    return [out[f"${i}"] for i in range(4)]


def _halves(reg: int) -> list[float]:
    return np.array([reg & 0xFFFF, reg >> 16], dtype=np.uint16).view(np.float16).astype(np.float64).tolist()


def _word(row_bytes: np.ndarray, w: int) -> int:
    return int(row_bytes[4 * w:4 * w + 4].view(np.uint32)[0])


def _stage(seed, nkv, fp8):
    """A ring stage's K half (16 keys of ``nkv`` heads) whose head-0 rows are random bytes (no
    NaN codes for FP8), and ``code(key, dim)``: the fp16 value the INT8 / FP8 kernel's conversion must give for that
    byte (INT8: ``1152 + c``; FP8: the e4m3 value)."""
    rows = np.random.default_rng(seed).integers(0, 256, size=(16, ROW), dtype=np.uint8)
    if fp8:
        rows[rows & 0x7F == 0x7F] = 0  # no NaN codes in live rows
    ks = ROW * nkv
    stage = np.zeros(16 * ks, dtype=np.uint8)
    for key in range(16):
        stage[key * ks: key * ks + ROW] = rows[key]  # head 0

    def code(key, dim):
        b = int(rows[key, dim])
        if fp8:
            return float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        return 1152.0 + (b - 256 if b > 127 else b)
    return stage, code


@pytest.mark.parametrize("fp8", [False, True])
def test_score_operands_hold_the_dims_the_query_loads(fp8):
    """For every thread (r, c) and score dot i: the A register pairs the kernel builds from its
    loaded words hold code bytes of dims ``4 (8 (i // 2) + p) + 2 (i % 2) + e`` (the query's
    order, ``_q_dot``), as fp16 ``1152 + c`` (INT8) or the e4m3 value (FP8)."""
    nkv = 2
    ks = ROW * nkv
    stage, code = _stage(1, nkv, fp8)
    k_off, k2_off = _offsets(int8._lds_asm.fn(nkv, "k")), _offsets(int8._lds_asm.fn(nkv, "k2"))

    for r in range(8):
        for c in range(4):
            base = r * ks + 4 * c  # key r, word c
            for offs, dots in ((k_off, range(4)), (k2_off, range(4, 8))):
                words = [int(stage[base + o: base + o + 4].view(np.uint32)[0]) for o in offs]
                # element pairs in register order: (r, c-pair), (r + 8, c-pair), (r, c+4 pair), (r + 8, c+4 pair)
                for pair, (key, p) in enumerate(((r, c), (r + 8, c), (r, c + 4), (r + 8, c + 4))):
                    regs = _run(int8._kconv_asm.fn(fp8), words[2 * pair: 2 * pair + 2])
                    for n, i in enumerate(dots):
                        for e, got in enumerate(_halves(regs[n])):
                            dim = 4 * (8 * (i // 2) + p) + 2 * (i % 2) + e
                            assert got == code(key, dim), (r, c, i, p, e)


@pytest.mark.parametrize("fp8", [False, True])
def test_value_operands_hold_the_dims_the_store_expects(fp8):
    """For every thread (r, c) and value dot m: A row ``M`` (r or r + 8) at keys 2c, 2c + 1, 2c + 8,
    2c + 9 holds the code byte of dim ``16 (M % 8) + 4 (M // 8 + 2 (m // 4)) + m % 4``
    (``_store_dot``) of those keys."""
    nkv = 4
    ks = ROW * nkv
    stage, code = _stage(2, nkv, fp8)
    v_off, v2_off = _offsets(int8._lds_asm.fn(nkv, "v")), _offsets(int8._lds_asm.fn(nkv, "v2"))

    for r in range(8):
        for c in range(4):
            base = 2 * c * ks + 16 * r  # key 2c, word 4r
            for offs, dots in ((v_off, range(4)), (v2_off, range(4, 8))):
                words = [int(stage[base + o: base + o + 4].view(np.uint32)[0]) for o in offs]
                for pair, (M, key0) in enumerate(((r, 2 * c), (r + 8, 2 * c), (r, 2 * c + 8), (r + 8, 2 * c + 8))):
                    regs = _run(int8._vconv_asm.fn(fp8), words[2 * pair: 2 * pair + 2])
                    for j, m in enumerate(dots):
                        dim = 16 * (M % 8) + 4 * (M // 8 + 2 * (m // 4)) + m % 4
                        assert _halves(regs[j]) == [code(key0, dim), code(key0 + 1, dim)], (r, c, m, M)


@pytest.mark.parametrize("nkv", [1, 2, 4, 8])
def test_block_copy_and_scale_words(nkv):
    """8 + 1 sixteen-byte copies per thread cover a 132-byte-row block exactly once; the scale
    loads reach keys r and r + 8."""
    asm = int4._copy_asm.fn(nkv, 8)  # the INT4 kernel's copy with 8 rounds (132-byte rows)
    offs = [int(m) for m in re.findall(r"cp\.async\.cg\.shared\.global \[\$1\+(\d+)\]", asm)]
    covered = []
    for tid in range(32 * nkv):
        for i, off in enumerate(offs):
            if i < 8 or tid < 8 * nkv:
                covered.extend(range(16 * tid + off, 16 * tid + off + 16))
    assert sorted(covered) == list(range(2 * 16 * nkv * ROW))
    assert _offsets(int4._scales_asm.fn(nkv, ROW)) == [0, 8 * ROW * nkv]  # the INT8 kernel loads its scale words with the INT4 kernel's _ld_scales
