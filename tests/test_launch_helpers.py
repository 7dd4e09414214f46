"""The launchers' grid arithmetic: plain Python stand-ins for Triton's constexpr functions."""

import triton

from kernels._jit import cdiv, next_pow2, prev_pow2


def test_cdiv_and_next_pow2_match_triton():
    """Same values as ``triton.cdiv`` / ``triton.next_power_of_2`` (which cost 2-7 µs a call from
    Python in Triton 3.6+), including 0, 1, exact powers of two and values past 2**31."""
    values = list(range(0, 2100)) + [2**31 - 1, 2**31, 2**31 + 1, 3 * 2**33 + 5]
    for n in values:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in values[:700] + values[-4:]:
        for b in (1, 2, 3, 16, 17, 64, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_prev_pow2():
    """The largest power of two <= n, for the segment counts: exact powers stay, others round down."""
    for n in list(range(1, 2100)) + [2**31 - 1, 2**31, 2**31 + 1]:
        p = prev_pow2(n)
        assert p & (p - 1) == 0 and p <= n < 2 * p, n
