"""Tuning of each write path: one frozen dataclass per path, and the defaults it resolves to.

A field left ``None`` takes the path's default for the call's head size and device (the tables
below, measured on an H200 at 65,536 tokens x 8 KV heads; ``bench/write.py`` reproduces them).
Benchmarks and tests pass an instance to the public write functions (``tuning=``); naming a
path's tuning asks :func:`~kernels.write.plan.write_plan` for that path. Nothing here is
mutable: there are no switches to flip.

On CPU the interpreter runs a whole tile per numpy operation, so every path takes few, large
tiles there (64 rows, or 4096 values, and 4 warps: warps mean nothing to the interpreter).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .._jit import next_pow2

MMA_COLS = 32  # columns of one tensor-core part (one H_32 product)

# (parts, rows, warps) of the int4-lanes kernel on the GPU (head_size 16 / 32 run it by default;
# 64..256 only on request, as the exact alternative to int4-mma)
LANES_TILING = {16: (1, 64, 4), 32: (2, 64, 4), 64: (4, 16, 1), 128: (8, 16, 1), 256: (8, 16, 2)}
# (rows, warps, packed_range, fast_rcp) of the int4-mma kernel on the GPU, its default head sizes
MMA_TILING = {64: (32, 2, True, True), 128: (32, 2, True, True), 256: (32, 2, False, True)}
ROTATIONS = ("butterfly", "dot")
# int4-mma with key offsets, where each lane loads its offsets (plan.lane_offsets_fit), on the plain
# kernel's tiling (head 64; a caller's rows or warps; 16 KV heads): programs per SM that loop over tiles,
# loading them once (0: one program per tile, each loading them). A loop keeps the lanes' entries live
# through the code stores.
OFFSET_PROGRAMS_PER_SM = {64: 0, 128: 8, 256: 8}
# int4-mma with lane key offsets at these head sizes: (rows, warps, maxnreg) of one-warp programs, one
# tile each. Each lane loads its entry of the lane table (its columns' signs and -s·m: two 16-byte loads
# per part, where the plain kernel loads the sign bits with one) and one fma per packed pair subtracts
# and flips the signs, where the plain kernel has one xor. H200: +0.7 to +2.4% over the plain write at
# head 128, -0.1 to +0.6% at 256 (two-warp programs: +1.5 to +2.7%, +0.9 to +1.1%), docs/BENCHMARKS.md.
OFFSET_TILING = {128: (16, 1, 0), 256: (16, 1, 0)}


@dataclass(frozen=True)
class TileTuning:
    """Paths ``symmetric`` (INT8 / FP8) and ``unquantized`` (bf16 / fp16): a program writes
    ``rows`` (token, head) rows of K and V with ``num_warps`` warps.

    GPU defaults: ``max(8, 1024 // head_size)`` rows (1 KiB of values); 1 warp for INT8 / FP8,
    4 for the unquantized copy."""

    rows: Optional[int] = None
    num_warps: Optional[int] = None


@dataclass(frozen=True)
class LanesTuning:
    """Path ``int4-lanes``: ``rows`` per program (K or V), ``num_warps``, ``parts`` (1, 2, 4 or
    8 column ranges a lane holds one element of each), ``fast_rcp`` (each row's reciprocal by
    ``device_math.RCP_PTX`` instead of ``div_rn``: the same bits, fewer instructions)."""

    rows: Optional[int] = None
    num_warps: Optional[int] = None
    parts: Optional[int] = None
    fast_rcp: Optional[bool] = None


@dataclass(frozen=True)
class MmaTuning:
    """Path ``int4-mma``: ``rows``, ``num_warps``, ``packed_range`` (the row range taken on
    rounded bf16x2 / f16x2 pairs), ``fast_rcp`` (as :class:`LanesTuning`), ``lane_offsets`` (key
    smoothing: each lane loads its offsets once inside the tensor-core asm where every row it
    holds has one head, ``plan.lane_offsets_fit``; False: each row's offsets are loaded as a
    tile; default True), ``offset_programs_per_sm`` (with lane offsets: programs per SM, each
    looping over tiles so its offsets load serves many; 0: one program per tile), ``maxnreg``
    (ptxas' register cap per thread, 0: none; GPU only). The parts are always
    ``head_size / 32`` columns wide (one tensor-core product each)."""

    rows: Optional[int] = None
    num_warps: Optional[int] = None
    packed_range: Optional[bool] = None
    fast_rcp: Optional[bool] = None
    lane_offsets: Optional[bool] = None
    offset_programs_per_sm: Optional[int] = None
    maxnreg: Optional[int] = None


@dataclass(frozen=True)
class FusedTuning:
    """Path ``int4-fused``: ``rows`` per tile, ``num_warps``, ``rotation`` ("dot": ``tl.dot``
    against ±1 Hadamard tiles, the GPU default; "butterfly": the oracle's stages, the CPU default)
    and ``programs_per_sm`` (GPU: resident programs per SM that loop over the tiles; 0: one
    program per tile)."""

    rows: Optional[int] = None
    num_warps: Optional[int] = None
    rotation: Optional[str] = None
    programs_per_sm: Optional[int] = None


TUNING_OF_PATH = {"unquantized": TileTuning, "symmetric": TileTuning, "int4-lanes": LanesTuning,
                  "int4-mma": MmaTuning, "int4-fused": FusedTuning}


def _filled(tuning, **defaults):
    """``tuning`` with every ``None`` field replaced by its entry in ``defaults``."""
    return dataclasses.replace(tuning, **{k: v for k, v in defaults.items() if getattr(tuning, k) is None})


def resolve_offset_tuning(tuning, head_size: int) -> "MmaTuning":
    """The complete ``int4-mma`` tuning of a GPU write with lane key offsets: ``tuning``'s fields
    where set; where it sets neither ``rows`` nor ``num_warps`` and :data:`OFFSET_TILING` has the
    head size, that tiling, one program per tile and its register cap (unless set); the rest
    :func:`resolve_tuning`'s defaults."""
    t = MmaTuning() if tuning is None else tuning
    if head_size in OFFSET_TILING and t.rows is None and t.num_warps is None:
        rows, warps, cap = OFFSET_TILING[head_size]
        t = _filled(t, rows=rows, num_warps=warps, maxnreg=cap, offset_programs_per_sm=0)
    return resolve_tuning("int4-mma", t, head_size, True)


def resolve_tuning(path: str, tuning, head_size: int, on_gpu: bool):
    """The complete tuning ``path`` runs with: ``tuning``'s fields where set, else the defaults.

    Raises ``ValueError`` for a tiling the path's kernel cannot run."""
    cls = TUNING_OF_PATH[path]
    tuning = cls() if tuning is None else tuning
    d = head_size
    if path in ("unquantized", "symmetric"):
        if not on_gpu:
            return _filled(tuning, rows=max(1, 4096 // next_pow2(d)), num_warps=4)
        return _filled(tuning, rows=max(8, 1024 // next_pow2(d)), num_warps=4 if path == "unquantized" else 1)
    if path == "int4-fused":
        if not on_gpu:
            t = _filled(tuning, rows=64, num_warps=4, rotation="butterfly", programs_per_sm=0)
        else:  # a row is rotated in chunks of min(d, 128) up to 256, of d / 2 above: dot tiles up to 128 fit
            t = _filled(tuning, rows={64: 128, 128: 64}.get(d, 64), num_warps=8 if d > 128 else 4,
                        rotation="dot" if d <= 256 else "butterfly", programs_per_sm=4)
        if t.rotation not in ROTATIONS:
            raise ValueError(f"int4-fused rotation: expected one of {ROTATIONS}, got {t.rotation!r}")
        if t.rotation == "dot" and d > 256:
            raise ValueError(f"int4-fused rotation 'dot': the ±1 tiles of head_size {d} (chunks of {d // 2}) do not "
                             f"fit shared memory; expected 'butterfly' above head_size 256")
        return t
    if path == "int4-mma":
        rows, warps, packed, fast = MMA_TILING.get(d, (32, 2, False, False)) if on_gpu else (64, 4, False, False)
        t = _filled(tuning, rows=rows, num_warps=warps, packed_range=packed, fast_rcp=fast, lane_offsets=True,
                    offset_programs_per_sm=OFFSET_PROGRAMS_PER_SM.get(d, 8), maxnreg=0)
        parts = d // MMA_COLS
    else:
        parts, rows, warps = LANES_TILING.get(d, (8, 16, 2)) if on_gpu else (1, 64, 4)
        t = _filled(tuning, rows=rows, num_warps=warps, parts=parts, fast_rcp=False)
        parts = t.parts
    # the shuffles assume warps tile whole rows: rows a multiple of the rows one CTA covers
    # (mma: of twice that, each lane's rows taken in pairs as one 16-row tile)
    cover = t.num_warps * 32 * 8 * parts // d * (2 if path == "int4-mma" else 1)
    if parts not in (1, 2, 4, 8) or d // parts < 8 or (on_gpu and t.rows % cover):
        raise ValueError(f"{path} kernel: parts in (1, 2, 4, 8) with head_size/parts >= 8 and rows a multiple "
                         f"of {cover} (num_warps x 32 lanes / lanes per row), got parts={parts}, rows={t.rows}, "
                         f"num_warps={t.num_warps}")
    return t
