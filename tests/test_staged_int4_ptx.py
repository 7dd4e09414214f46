"""The PTX that the staged INT4 decode kernel generates for its copies and shared-memory loads
(``kernels/attention/decode_staged_int4_gluon.py``): checked on the CPU against the packed
cache's byte layout (docs/LAYOUT.md). The kernel itself runs only on a GPU (tests/test_attention_kernels.py)."""

from __future__ import annotations

import re

import pytest

int4 = pytest.importorskip("kernels.attention.decode_staged_int4_gluon",
                         reason="needs Triton's Gluon dialect", exc_type=ImportError)

ROW = 68  # bytes per (token, head) row: 64 code bytes, then the scale word


def _offsets(asm: str, op: str) -> list[int]:
    """The immediate offsets of ``op``'s shared-memory operand, in order."""
    return [int(m) for m in re.findall(op + r"[^\[]*\[\$\d+\+(\d+)\]", asm)]


@pytest.mark.parametrize("nkv", [1, 2, 4, 8])
def test_block_copy_covers_the_block_once(nkv):
    """Every thread's 4 + 1 sixteen-byte copies, the fifth only for the first ``8 x nkv``
    threads, cover a whole block (K and V halves: ``2 x 16 x nkv x 68`` bytes) exactly once."""
    asm = int4._copy_asm.fn(nkv, 4)
    offs = _offsets(asm, "cp.async.cg.shared.global")
    assert len(offs) == 5 and asm.count("16;") == 5
    stage = 2 * 16 * nkv * ROW
    covered = []
    for tid in range(32 * nkv):
        for i, off in enumerate(offs):
            if i < 4 or tid < 8 * nkv:
                covered.extend(range(16 * tid + off, 16 * tid + off + 16))
    assert sorted(covered) == list(range(stage))


@pytest.mark.parametrize("nkv", [1, 2, 4, 8])
def test_loads_reach_each_threads_words(nkv):
    """The word loads' offsets from a thread's first address are the dot operand A elements the
    kernel expects, in register order: key codes (keys r, r + 8; words c, c + 4, each in both
    registers of its K pair; "k8": words c + 8, c + 12), value codes (words r, r + 8; keys 2c,
    2c + 1, 2c + 8, 2c + 9) and the scale words of keys r, r + 8, for rows
    ``(token x nkv + head) x 68`` bytes apart."""
    def row(key):
        return key * nkv * ROW

    want_v = [row(key) + 4 * w for w, key in ((0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9))]
    assert _offsets(int4._lds_asm.fn(nkv, "v"), "ld.shared.b32") == want_v
    for kind, first in (("k", 0), ("k8", 8)):
        asm = int4._lds_asm.fn(nkv, kind)
        # registers 2i, 2i + 1 (one K pair) both hold key r / r + 8's word c / c + 4 (+ 8 for "k8")
        want_k = [row(kr) + 4 * (first + w) for kr, w in ((0, 0), (8, 0), (0, 4), (8, 4))]
        assert _offsets(asm, "ld.shared.b32") == want_k
        assert re.findall(r"ld\.shared\.b32 \$(\d+)", asm) == ["0", "2", "4", "6"]
        assert re.findall(r"mov\.b32 \$(\d+), \$(\d+)", asm) == [("1", "0"), ("3", "2"), ("5", "4"), ("7", "6")]
    assert _offsets(int4._scales_asm.fn(nkv, 68), "ld.shared.b32") == [0, row(8)]  # the scale words
    # the zero points: scale words of keys 2c, 2c + 1, then 2c + 8, 2c + 9
    assert _offsets(int4._zp_asm.fn(nkv), "ld.shared.b32") == [0, row(1), row(8), row(9)]


def test_zero_point_operand_bits():
    """The zero-point block turns two scale words into fp16x2 ``-(1024 + zp)`` and
    ``-(1024 + 16 zp)``: run its ``prmt`` / ``lop3`` / ``shl`` on sample words in Python."""
    import numpy as np

    asm = int4._zp_asm.fn(8)
    assert "prmt.b32 x, a, b, 0x5410" in asm
    assert "lop3.b32 $0, x, 0x000F000F, 0xE400E400, 0xEA" in asm and "shl.b32 x, x, 4" in asm
    assert "lop3.b32 $4, x, 0x00F000F0, 0xE400E400, 0xEA" in asm
    for zp_a, zp_b in ((0, 15), (7, 3), (15, 15)):
        a = 0x3F80_0000 | zp_a  # a float scale with the zero point in its low bits
        b = 0x4120_0000 | zp_b
        x = (a & 0xFFFF) | ((b & 0xFFFF) << 16)                     # prmt 0x5410
        even = (x & 0x000F000F) | 0xE400E400                       # lop3 0xEA: (x & mask) | c
        odd = (((x << 4) & 0xFFFFFFFF) & 0x00F000F0) | 0xE400E400
        halves = np.array([even & 0xFFFF, even >> 16, odd & 0xFFFF, odd >> 16], dtype=np.uint16).view(np.float16)
        assert halves.tolist() == [-(1024 + zp_a), -(1024 + zp_b), -(1024 + 16 * zp_a), -(1024 + 16 * zp_b)]


def _run_bits(asm: str, regs: dict) -> dict:
    """Run the ``lop3`` (lut 0xEA: ``(a & b) | c``) / ``shr`` / ``shl`` lines of ``asm`` on ``regs``
    (names as written: ``$4``, ``x``), 32-bit."""
    for op, d, a, b, c in re.findall(r"(lop3|shr|shl)\.b32 (\$?\w+), (\$?\w+), (\w+)(?:, (\w+), 0xEA)?;", asm):
        x = regs[a]
        if op == "lop3":
            regs[d] = (x & int(b, 16)) | int(c, 16)
        elif op == "shr":
            regs[d] = x >> int(b)
        else:
            regs[d] = (x << int(b)) & 0xFFFFFFFF
    return regs


def test_key_code_operand_bits():
    """A key-code word -> 4 fp16x2 registers: register v holds nibbles v and v + 4 (the K pair's
    two elements) as fp16 ``1024 + c`` for even v and ``1024 + 16 c`` for odd v (the query's odd
    parts are pre-divided by 16): run ``NIB4_ASM`` on sample words in Python."""
    import numpy as np

    asm = int4.NIB4_ASM.value
    assert asm.count("lop3.b32") == 4 and asm.count("shr.b32") == 1  # 5 instructions a word
    rng = np.random.default_rng(0)
    for word in [0, 0xFFFFFFFF, 0x76543210, *rng.integers(0, 2 ** 32, 20).tolist()]:
        out = _run_bits(asm, {"$4": int(word)})
        nib = [(int(word) >> (4 * i)) & 0xF for i in range(8)]
        for v in range(4):
            halves = np.array([out[f"${v}"] & 0xFFFF, out[f"${v}"] >> 16], dtype=np.uint16).view(np.float16)
            m = 16 if v % 2 else 1
            assert halves.tolist() == [1024 + m * nib[v], 1024 + m * nib[v + 4]], (hex(word), v)
