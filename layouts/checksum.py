"""``mix64``: a payload checksum that a GPU computes in parallel, and its NumPy reference.

The wire protocol's first checksum, XXH3-64, is a sequential hash: a GPU cannot split one
frame across thousands of threads. ``mix64`` hashes every 64-bit word independently and adds
the results, so any partition of a frame (tiles, layers, chunks) can be hashed separately and
the partial sums added in any order. docs/PROTOCOL.md ("Checksums") is the normative text and
lists test vectors; this module is the reference the Triton kernels are tested against.

Definition, for a byte string ``B`` of ``L`` bytes (all arithmetic modulo ``2**64``)::

    W      = ceil(L / 8);  B is zero-padded to 8·W bytes
    w_i    = bytes 8i .. 8i+7 of the padded B as a little-endian uint64   (i = 0 .. W-1)
    fmix(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
    m_i    = fmix(w_i + (i + 1) · K_WORD)                    K_WORD   = 0x9E3779B97F4A7C15
    S      = m_0 + m_1 + ... + m_{W-1}                       (S = 0 when L = 0)
    mix64  = fmix(S ^ (L · K_LENGTH))                        K_LENGTH = 0xC2B2AE3D27D4EB4F

Properties the receiver relies on: ``fmix`` is a bijection of 64-bit words, so a change
confined to one word (any single-bit flip) always changes ``m_i`` and hence the checksum;
the word's position enters ``m_i``, so swapped words or blocks change it (with probability
1 - 2**-64 for unrelated contents); ``L`` enters the final mix, so appended zero bytes and
truncations change it. It is an integrity check against faults, not a MAC (CURVE is the
protection against tampering).

This module imports only NumPy (``layouts`` depends on nothing but torch and NumPy), so the
kernels (``kernels/transfer``) read its constants and ``kvconnector`` its reference.
"""

from __future__ import annotations

import numpy as np

NAME = "mix64"
K_WORD = 0x9E3779B97F4A7C15
K_LENGTH = 0xC2B2AE3D27D4EB4F
FMIX_M1 = 0xBF58476D1CE4E5B9
FMIX_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_SLAB_WORDS = 1 << 20          # reference works on 8 MiB slabs, so temporaries stay bounded


def fmix64(z: int) -> int:
    """The 64-bit finalizer on one Python int (the SplitMix64 output function)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * FMIX_M1) & _MASK
    z = ((z ^ (z >> 27)) * FMIX_M2) & _MASK
    return z ^ (z >> 31)


def _fmix_array(z: np.ndarray) -> np.ndarray:
    """``fmix`` on a uint64 array in place (NumPy wraps uint64 products modulo 2**64)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(FMIX_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(FMIX_M2)
    z ^= z >> np.uint64(31)
    return z


def _as_bytes(buf) -> np.ndarray:
    """The bytes of ``buf`` as a flat uint8 array (a view when ``buf`` is contiguous)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def word_sum(buf, first_word: int = 0) -> int:
    """``sum(m_i)`` over the words of ``buf`` (zero-padded to whole words), numbered from
    ``first_word``: the partial sum of a piece of a frame that starts at byte ``8·first_word``.

    Parameters
    ----------
    buf : bytes-like or contiguous numpy array (any dtype, read as raw bytes), host memory
    first_word : int
        Index ``i`` of the piece's first word inside its frame.
    """
    a = _as_bytes(buf)
    total = 0
    for start in range(0, a.size, 8 * _SLAB_WORDS):
        piece = a[start:start + 8 * _SLAB_WORDS]
        if piece.size % 8:   # the frame's last word, zero-padded
            piece = np.concatenate([piece, np.zeros(8 - piece.size % 8, dtype=np.uint8)])
        w = piece.view("<u8").astype(np.uint64, copy=True)                      # w_i
        i0 = first_word + start // 8 + 1
        idx = np.arange(i0, i0 + w.size, dtype=np.uint64)                       # i + 1
        idx *= np.uint64(K_WORD)
        w += idx
        total += int(_fmix_array(w).sum(dtype=np.uint64))                       # sums of m_i, mod 2**64
    return total & _MASK


def finish(word_sum_: int, length: int) -> int:
    """The checksum from a frame's word sum and its byte length."""
    return fmix64((word_sum_ & _MASK) ^ ((length * K_LENGTH) & _MASK))


def mix64(buf) -> int:
    """``mix64`` of one frame (bytes-like or contiguous numpy array, host memory)."""
    n = _as_bytes(buf).size
    return finish(word_sum(buf), n)


def mix64_scalar(data: bytes) -> int:
    """Word-by-word twin of :func:`mix64` in plain Python (tests check one against the other)."""
    padded = data + b"\0" * (-len(data) % 8)
    s = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        s = (s + fmix64(w + (i + 1) * K_WORD)) & _MASK
    return finish(s, len(data))
