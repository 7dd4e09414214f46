"""The tensor-core rotation of the INT4 writer (``kernels.write.int4_mma``) without a GPU.

The GPU tests compare the kernel's bytes with the oracle; here the pieces that decide whether a
tensor-core tile computes ``H_32 · (s ⊙ x)`` (or ``H_32 · (s ⊙ RN(x - m))`` with a key offset) at
all are checked on CPU: the PTX text, the B words it computes from each lane's id, the sign
table and the lane table of key offsets, run through a small emulator of the PTX instructions
the text uses, with ``mma.sync.m16n8k16`` taking its fragments from the 32 lanes exactly as the
PTX ISA lays them out.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kernels.write.int4_mma import MMA_COLS, b_negated, b_text, b_word, mma_text, sign_table
from kernels.write.offsets import lane_offset_table
from kernels.reference import fwht, rht_signs

_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.\1\.f32 "
                  r"\{([^}]*)\}, \{([^}]*)\}, \{([^}]*)\}, \{([^}]*)\};")


def _half_to_f64(bits: int, f16: bool) -> float:
    if f16:
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _f32_bits(v: float) -> int:
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def _bits_f32(b: int) -> float:
    return float(np.array([b], dtype=np.uint32).view(np.float32)[0])


def _operand(r: dict, name: str) -> int:
    if name.startswith(("0x", "0X")):
        return int(name, 16)
    return int(name) if name.isdigit() else r[name]


_INT_OPS = {"shr.u32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF,
            "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "xor.b32": lambda a, b: a ^ b}


def _fma_pairs(x: int, s: int, m: int, f16: bool) -> int:
    """``fma.rn.{bf16,f16}x2`` per half (the test's values are small integers: every result exact)."""
    out = 0
    for e in (0, 1):
        v = _half_to_f64(x >> 16 * e & 0xFFFF, f16) * _half_to_f64(s >> 16 * e & 0xFFFF, f16) \
            + _half_to_f64(m >> 16 * e & 0xFFFF, f16)
        t = torch.tensor([v], dtype=torch.float16 if f16 else torch.bfloat16)
        assert float(t) == v, "the test's values must be exact in the model dtype"
        out |= (int(t.view(torch.int16)) & 0xFFFF) << 16 * e
    return out


def run_ptx(text: str, regs: list[dict]) -> None:
    """Execute ``text`` on 32 lanes' register files (name -> 32-bit int) in place."""
    for line in text.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        if m := re.fullmatch(r"mov\.b32 (\w+), 0f([0-9A-F]{8});", line):
            for r in regs:
                r[m[1]] = int(m[2], 16)
        elif m := re.fullmatch(r"mov\.u32 (\w+), %laneid;", line):
            for lane, r in enumerate(regs):
                r[m[1]] = lane
        elif m := re.fullmatch(r"popc\.b32 (\w+), (\w+);", line):
            for r in regs:
                r[m[1]] = bin(r[m[2]]).count("1")
        elif m := re.fullmatch(r"(shr\.u32|shl\.b32|and\.b32|or\.b32|xor\.b32) (\w+), (\$?\w+), (\$?\w+);", line):
            for r in regs:
                r[m[2]] = _INT_OPS[m[1]](_operand(r, m[3]), _operand(r, m[4]))
        elif m := re.fullmatch(r"fma\.rn\.(bf16|f16)x2 (\w+), (\$\d+), (\$\d+), (\$\d+);", line):
            for r in regs:
                r[m[2]] = _fma_pairs(r[m[3]], r[m[4]], r[m[5]], m[1] == "f16")
        elif m := _MMA.fullmatch(line):
            f16 = m[1] == "f16"
            d, a, b, c = ([s.strip() for s in m[i].split(",")] for i in range(2, 6))
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for lane, r in enumerate(regs):
                g, t = lane >> 2, lane & 3
                for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                    A[row, col] = _half_to_f64(r[a[i]] & 0xFFFF, f16)
                    A[row, col + 1] = _half_to_f64(r[a[i]] >> 16, f16)
                for i, k in enumerate((2 * t, 2 * t + 8)):
                    B[k, g] = _half_to_f64(r[b[i]] & 0xFFFF, f16)
                    B[k + 1, g] = _half_to_f64(r[b[i]] >> 16, f16)
                for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    C[row, col] = _bits_f32(r[c[i]])
            D = (A @ B + C).astype(np.float32)
            for lane, r in enumerate(regs):
                g, t = lane >> 2, lane & 3
                for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    r[d[i]] = _f32_bits(float(D[row, col]))
        else:
            raise AssertionError(f"emulator: unknown PTX line {line!r}")


def _place(rows: int, warps: int):
    """Triton's coalesced layout of a [rows, 32] 16-bit tile: element (row, col) -> (warp, lane, register)."""
    where = {}
    for row in range(rows):
        for col in range(32):
            where[row, col] = ((row // 8) % warps, 4 * (row % 8) + col // 8, (row // (8 * warps)) * 8 + col % 8)
    return where


@pytest.mark.parametrize("offset", [False, True], ids=["plain", "key offset"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,warps", [(16, 1), (32, 1), (32, 2)], ids=["r16w1", "r32w1", "r32w2"])
def test_mma_text_and_tables_rotate_each_part(dtype, rows, warps, offset):
    """Every 32-column part of every row comes out as the exact ``H_32 · (s ⊙ x)``, or with a key
    offset ``H_32 · (s ⊙ (x - m))``, each lane reading its entry ``tid mod 4·heads`` of the lane
    table (integer inputs, so every sum is exact in fp32 and any misplaced operand shows)."""
    d, heads = 128, 2 * warps   # heads divide 8·warps: every row of a lane has one head
    f16 = dtype == torch.float16
    g = torch.Generator().manual_seed(rows + warps)
    x = torch.randint(-8, 9, (rows, d), generator=g).to(dtype)
    m = torch.randint(-4, 5, (heads, d), generator=g).to(dtype)
    x16 = x.view(torch.int16).numpy().astype(np.uint16)
    signs = sign_table(d, dtype, "cpu").view(torch.int16).numpy().astype(np.uint16)
    lanes = lane_offset_table(m).view(torch.int16).numpy().astype(np.uint16).reshape(2, d // 32, 4 * heads, 16)
    where = _place(rows, warps)
    s = rht_signs(d)
    head = torch.arange(rows) % heads
    for part in range(d // MMA_COLS):
        cols = slice(part * 32, part * 32 + 32)
        want = fwht((x[:, cols].float() - (m[head, cols].float() if offset else 0)) * s[cols])  # exact
        got = np.zeros((rows, 32), dtype=np.float32)
        for inv in range(rows // (16 * warps)):
            for w in range(warps):
                # registers of invocation `inv` on warp w: 16 elements per lane, packed 2 per word
                elems = {(ww, lane, reg): (row, col) for (row, col), (ww, lane, reg) in where.items()
                         if ww == w and reg // 16 == inv}
                regs = [{} for _ in range(32)]
                for lane in range(32):
                    e = [elems[w, lane, 16 * inv + i] for i in range(16)]
                    entry = lanes[0, part, (32 * w + lane) % (4 * heads)]
                    for k in range(8):
                        (r0, c0), (r1, c1) = e[2 * k], e[2 * k + 1]
                        regs[lane][f"${16 + k}"] = int(x16[r0, part * 32 + c0]) | int(x16[r1, part * 32 + c1]) << 16
                        if offset:
                            regs[lane][f"${24 + k}"] = int(entry[2 * k]) | int(entry[2 * k + 1]) << 16
                        else:
                            regs[lane][f"${24 + k}"] = int(signs[part * 32 + c0]) | int(signs[part * 32 + c1]) << 16
                run_ptx(mma_text(f16, offset), regs)
                for lane in range(32):
                    for i in range(16):
                        row, col = elems[w, lane, 16 * inv + i]
                        got[row, col] = _bits_f32(regs[lane][f"${i}"])
        assert np.array_equal(got, want.numpy()), f"part {part}"


@pytest.mark.parametrize("one", [0x3F80, 0x3C00], ids=["bf16", "fp16"])
def test_b_words_computed_from_the_lane_id(one):
    """The B words the asm computes (``b_text``: ``B0`` and ``-B0`` from ``%laneid``, each word
    ``q`` taking ``-B0`` where ``b_negated(q)``) are the table of :func:`b_word` for all 32 lanes
    and 16 words."""
    regs = [{} for _ in range(32)]
    run_ptx("\n".join(b_text(one)), regs)
    for lane in range(32):
        for q in range(16):
            assert regs[lane]["bn" if b_negated(q) else "bp"] == b_word(lane, q, one), (lane, q)


def test_b_words_are_a_permuted_hadamard():
    """The 32 lanes' words hold each entry of ``H_32`` (permuted rows and columns) exactly once
    per (k-step, n-tile) block: a wrong σ or k map would repeat or miss entries."""
    m = np.zeros((32, 32), dtype=int)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for q in range(16):
            ks, nn, r = q >> 3, (q >> 1) & 3, q & 1
            w = b_word(lane, q, 0x3F80)
            for e in (0, 1):
                a = 8 * t + 4 * ks + 2 * r + e
                c = 8 * (g >> 1) + 2 * nn + (g & 1)
                m[a, c] += 1 if (w >> (16 * e)) & 0x8000 == 0 else -1
    h = fwht(torch.eye(32)).numpy().astype(int)
    assert np.array_equal(m, h)
