"""Run one decode problem a few times, for a profiler (Nsight Compute) to capture one launch.

Same problems as ``bench/attention.py`` (32 query / 8 KV heads, head_size 128, block 16).
The first call compiles and is checked against the oracle; then ``--calls`` more launches run,
each on its own block-table copy. Profile the last one, e.g.::

    ncu --clock-control none -k regex:decode --launch-skip 2 --launch-count 1 --set full \\
        -o /tmp/int4 python -m bench.profile_decode --mode int4 --batch 8 --ctx 32768 --calls 2

``--path`` asks for a path (``kernels.attention.Path``); ``--tiling
tile:warps:stages[:segments[:heads]]`` a tiling for it (segments: default the plan's keys per
segment kept; ``heads``: KV heads per program of decode_block_tiles, default the plan's, else 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench import attention as B
from kernels.attention import Path, Plan, Tiling, Tuning


def parse_tiling(text: str, plan: Plan, path: Path) -> Tiling:
    """``tile:warps:stages[:segments[:heads]]`` around ``plan``'s tiling."""
    parts = [int(x) for x in text.split(":")]
    tile, warps, stages = parts[:3]
    base = plan.tiling
    segs = parts[3] if len(parts) > 3 else max(2, base.num_segments * base.tile // tile)
    heads = parts[4] if len(parts) > 4 else (base.heads_per_program if plan.path == Path.DECODE_BLOCK_TILES else 1)
    return dataclasses.replace(base, tile=tile, num_warps=warps, num_stages=stages, num_segments=segs,
                               heads_per_program=heads if path == Path.DECODE_BLOCK_TILES else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_decode", description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="int4", choices=sorted(B.MODES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--path", default=None, choices=[x.value for x in Path], help="default: the plan's")
    p.add_argument("--tiling", default="", help="tile:warps:stages[:segments[:heads]] (default: the path's)")
    p.add_argument("--calls", type=int, default=2, help="launches after the checked first one")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU")
        return 1
    pb = B.make_problem(B.MODES[a.mode], a.batch, a.ctx, 1, B.FULL, "cuda")
    tuning = Tuning(path=a.path)
    plan = B.plan_of(pb, tuning)
    if a.tiling:
        tuning = dataclasses.replace(tuning, path=Path(a.path) if a.path else plan.path,
                                     tiling=parse_tiling(a.tiling, plan, Path(a.path) if a.path else plan.path))
    err = B.check(pb, tuning)
    print(f"{a.mode} b{a.batch} ctx{a.ctx} {B.describe(B.plan_of(pb, tuning))} rel. L2 {err:.1e}", flush=True)
    if not err <= 1e-2:
        return 2
    for i in range(a.calls):
        B.call(pb, tuning, pb["tables"][(i + 1) % len(pb["tables"])])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
