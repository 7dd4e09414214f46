"""Exhaustive check of the INT4 writer's two-operation division (``kernels.write.device_math.div_split``).

The writer needs ``RN(r / scale)`` exactly for every rotated, rounded value ``r`` of a row
(the codes must be the oracle's). ``div_split`` computes it as ``fma(r, ch, RN(r·cl))``
from a 48-bit reciprocal ``pw·(ch + cl)`` (``split_reciprocal``), one operation fewer per value
than Markstein's correction of ``r·RN(1/scale)``. No error bound proves the two equal, so this
tool compares them everywhere it matters:

- every value of ``RN(r / scale)`` depends on ``r`` and ``scale`` only through their significands
  (scaling either by a power of two scales the quotient, and ``split_reciprocal`` keeps every
  intermediate a normal number), so ``scale`` runs over all 2**23 significands in [1, 2) and
  ``r`` over all 128 bf16 and all 1,024 fp16 significands in [1, 2): 9.7e9 quotients;
- each quotient is computed both ways on the device (``tl.div_rn`` is the correctly rounded
  reference) and the mismatches are listed;
- a mismatch is one unit in the last place. For each, every INT4 code the kernel could derive
  from it is compared: ``clamp(floor(RN(±t·2**j + zp + 0.5)), 0, 15)`` for ``zp`` 0..15 and ``j``
  -4..5 (``|t|`` from 1/32 to 64; codes move only for ``|t|`` in [0.25, 16]).

On a GPU it also compares the writer's per-row reciprocal (``RCP_PTX``: ``rcp.approx`` and two FMA
steps, no slow path) with ``div_rn(1, scale)`` for every significand at seven exponents from the
scale's floor (1e-6) to its ceiling.

``python3 -m bench.check_int4_division`` on a GPU checks everything (a few seconds);
``--quick`` checks a sample of scales through Triton's interpreter on the CPU (the reciprocal's
PTX does not run there).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

from kernels._jit import dual_jit
from kernels.write.device_math import div_split, rcp_fast, split_reciprocal

SIGNIFICANDS = 1 << 23


def significands(dtype: torch.dtype) -> torch.Tensor:
    """Every value of ``dtype`` in [1, 2) as fp32 (bf16: 128, fp16: 1,024)."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    return 1.0 + torch.arange(1 << mant, dtype=torch.float32) / (1 << mant)


@triton.jit
def _quotients(scale, r, INTERPRET: tl.constexpr):
    rcp = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    ch, cl, pw = split_reciprocal(scale, rcp, INTERPRET)
    exact = tl.div_rn(r[None, :], scale[:, None])
    split = div_split(r[None, :], ch[:, None], cl[:, None]) * pw[:, None]
    return exact, split


@dual_jit
def _count_kernel(counts_ptr, r_ptr, n_r, first, n_scales, BS: tl.constexpr, RB: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """``counts[i]``: how many ``r`` give a different quotient for scale significand ``first + i``."""
    i = tl.program_id(0) * BS + tl.arange(0, BS)
    ok = i < n_scales
    scale = ((first + i) | 0x3F800000).to(tl.float32, bitcast=True)
    bad = tl.zeros([BS], tl.int32)
    for k in range(0, n_r, RB):
        j = k + tl.arange(0, RB)
        r = tl.load(r_ptr + j, mask=j < n_r, other=1.0)
        exact, split = _quotients(scale, r, INTERPRET)
        bad += tl.sum(((exact != split) & (j < n_r)[None, :]).to(tl.int32), 1)
    tl.store(counts_ptr + i, bad, mask=ok)


@dual_jit
def _pair_kernel(exact_ptr, split_ptr, scale_ptr, r_ptr, n_r, RB: tl.constexpr, INTERPRET: tl.constexpr):
    """Both quotients of one scale (program) and every ``r``, for the mismatches' code check."""
    scale = tl.load(scale_ptr + tl.program_id(0) + tl.arange(0, 1))
    for k in range(0, n_r, RB):
        j = k + tl.arange(0, RB)
        r = tl.load(r_ptr + j, mask=j < n_r, other=1.0)
        exact, split = _quotients(scale, r, INTERPRET)
        off = tl.program_id(0) * n_r + j[None, :]
        tl.store(exact_ptr + off, exact, mask=(j < n_r)[None, :])
        tl.store(split_ptr + off, split, mask=(j < n_r)[None, :])


def count_mismatches(scale_bits: torch.Tensor | None, r: torch.Tensor, device: str, chunk: int = 1 << 20,
                     progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(scale significands with a mismatch, their counts); ``scale_bits`` None: all 2**23 (in order)."""
    r = r.to(device)
    bs, rb = (64, 128) if device != "cpu" else (64, min(128, r.numel()))
    found, counts = [], []
    if scale_bits is None:
        for first in range(0, SIGNIFICANDS, chunk):
            n = min(chunk, SIGNIFICANDS - first)
            c = torch.empty(n, dtype=torch.int32, device=device)
            _count_kernel[(triton.cdiv(n, bs),)](c, r, r.numel(), first, n, BS=bs, RB=rb, INTERPRET=device == "cpu")
            idx = torch.nonzero(c).flatten()
            found.append(idx.cpu().numpy() + first)
            counts.append(c[idx].cpu().numpy())
            if progress:
                progress(first + n)
    else:
        for m in scale_bits.tolist():
            c = torch.empty(1, dtype=torch.int32, device=device)
            _count_kernel[(1,)](c, r, r.numel(), m, 1, BS=bs, RB=rb, INTERPRET=device == "cpu")
            if int(c[0]):
                found.append(np.array([m]))
                counts.append(c.cpu().numpy())
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    return np.concatenate(found).astype(np.int64), np.concatenate(counts)


def quotient_pairs(mants: np.ndarray, r: torch.Tensor, device: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exact, split, r) fp32 arrays of every mismatching (scale, r) pair of the scales ``mants``."""
    scales = torch.from_numpy((mants.astype(np.uint32) | 0x3F800000).view(np.float32).copy()).to(device)
    r = r.to(device)
    exact = torch.empty(len(mants), r.numel(), dtype=torch.float32, device=device)
    split = torch.empty_like(exact)
    rb = 128 if device != "cpu" else min(128, r.numel())
    if len(mants):
        _pair_kernel[(len(mants),)](exact, split, scales, r, r.numel(), RB=rb, INTERPRET=device == "cpu")
    exact, split = exact.cpu().numpy(), split.cpu().numpy()
    bad = exact != split
    rr = np.broadcast_to(r.cpu().numpy()[None, :], bad.shape)
    return exact[bad], split[bad], rr[bad]


def code_disagreements(exact: np.ndarray, split: np.ndarray) -> int:
    """Cases (quotient pair, sign, 2**j, zp) where the two quotients give different INT4 codes."""
    n = 0
    for sign in (1.0, -1.0):
        for j in range(-4, 6):
            f = np.float32(sign * 2.0 ** j)
            a, b = exact * f, split * f  # exact scalings
            for zp in range(16):
                zph = np.float32(zp + 0.5)
                ca = np.clip(np.floor(a + zph), 0, 15)  # float32 + float32 rounds once, as the kernel does
                cb = np.clip(np.floor(b + zph), 0, 15)
                n += int(np.count_nonzero(ca != cb))
    return n


def check(dtype: torch.dtype, device: str, scale_bits: torch.Tensor | None, log=print) -> dict:
    r = significands(dtype)
    t0 = time.perf_counter()
    step = [0]

    def progress(done):
        if done >= step[0]:
            log(f"  {dtype}: {done:,} / {SIGNIFICANDS:,} scale significands")
            step[0] += SIGNIFICANDS // 4

    mants, counts = count_mismatches(scale_bits, r, device, progress=progress if scale_bits is None else None)
    exact, split, rr = quotient_pairs(mants, r, device)
    if len(exact) != int(counts.sum()):
        raise RuntimeError(f"the pair pass found {len(exact)} mismatches, the count pass {int(counts.sum())}")
    ulps = np.abs(exact.view(np.int32).astype(np.int64) - split.view(np.int32).astype(np.int64))
    n_scales = SIGNIFICANDS if scale_bits is None else scale_bits.numel()
    return {"dtype": str(dtype).replace("torch.", ""), "scales": n_scales, "r": r.numel(),
            "quotients": n_scales * r.numel(), "mismatches": len(exact), "max_ulps": int(ulps.max()) if len(ulps) else 0,
            "code_disagreements": code_disagreements(exact, split), "seconds": round(time.perf_counter() - t0, 2),
            "examples": [(float(a), float(b), float(c)) for a, b, c in zip(exact[:3], split[:3], rr[:3])]}


@triton.jit
def _rcp_kernel(bad_ptr, first, EXP: tl.constexpr, BS: tl.constexpr):
    """How many scale significands ``first + i`` (exponent EXP) get a reciprocal from ``rcp_fast``
    other than ``div_rn(1, scale)`` (GPU only: inline PTX)."""
    i = first + tl.program_id(0) * BS + tl.arange(0, BS)
    scale = (i | ((EXP + 127) << 23)).to(tl.float32, bitcast=True)
    want = tl.div_rn(tl.full([BS], 1.0, tl.float32), scale)
    got = rcp_fast(scale)
    diff = want.to(tl.int32, bitcast=True) != got.to(tl.int32, bitcast=True)
    tl.atomic_add(bad_ptr + tl.arange(0, 1), tl.sum(diff.to(tl.int32), 0)[None])


RCP_EXPONENTS = (-20, -2, 0, 1, 30, 100, 124)  # scale from 1e-6 (the floor) to 3.4e38 / 15


def check_reciprocal() -> dict:
    """``rcp_fast`` (the writer's per-row ``RN(1/scale)``) against ``div_rn`` for every significand at
    each of :data:`RCP_EXPONENTS` (the reciprocal's significand depends on the scale's alone)."""
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    for e in RCP_EXPONENTS:
        _rcp_kernel[(SIGNIFICANDS // 1024,)](bad, 0, EXP=e, BS=1024)
    return {"scales": SIGNIFICANDS * len(RCP_EXPONENTS), "mismatches": int(bad.item())}


def sample_scales(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` random scale significands plus the edges (1.0, the largest, and all-ones patterns)."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor([0, 1, SIGNIFICANDS - 1, SIGNIFICANDS - 2, SIGNIFICANDS // 2, 0x2AAAAA, 0x555555])
    return torch.cat([edges, torch.randint(0, SIGNIFICANDS, (n,), generator=g)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a sample of scales on the CPU (interpreter)")
    p.add_argument("--samples", type=int, default=48, help="random scales with --quick")
    p.add_argument("--dtypes", default="bf16,fp16")
    a = p.parse_args(argv)
    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    scale_bits = sample_scales(a.samples) if device == "cpu" else None
    failed = False
    if device == "cuda":
        res = check_reciprocal()
        print(f"reciprocal: {res['scales']:,} scales (exponents {RCP_EXPONENTS}), {res['mismatches']} differ from "
              f"div_rn(1, scale)")
        failed |= res["mismatches"] > 0
    else:
        print("reciprocal (RCP_PTX, inline PTX): not checked without a GPU")
    for name in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        res = check(dtype, device, scale_bits)
        print(f"{res['dtype']} on {device}: {res['scales']:,} scales x {res['r']:,} significands = "
              f"{res['quotients']:,} quotients; {res['mismatches']} differ from RN(r / scale) "
              f"(at most {res['max_ulps']} ulp); INT4 codes that differ: {res['code_disagreements']} "
              f"[{res['seconds']} s]")
        if res["examples"]:
            print("  e.g. (exact, split, r):", res["examples"])
        failed |= res["code_disagreements"] > 0 or res["max_ulps"] > 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
