"""Run one decode problem a few times, for a profiler (Nsight Compute) to capture one launch.

Same problems as ``bench/attention.py`` (32 query / 8 KV heads, head_size 128, block 16).
The first call compiles and is checked against the oracle; then ``--calls`` more launches run,
each on its own block-table copy. Profile the last one, e.g.::

    ncu --clock-control none -k regex:decode_v3 --launch-skip 2 --launch-count 1 --set full \\
        -o /tmp/int4 python3 bench/profile_decode.py --mode int4 --batch 8 --ctx 32768 --calls 2

``--cfg tile:warps:stages:kernel[:segments[:heads]]`` overrides the launcher's default tiling
(``heads``: KV heads per program of the v4 kernel, ``kernel`` 4; default the launcher's, else 1).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from kernels._attn_launch import AttnConfig  # noqa: E402
from bench import attention as B  # noqa: E402


def parse_cfg(text: str, base: AttnConfig) -> AttnConfig:
    parts = [int(x) for x in text.split(":")]
    tile, warps, stages, kernel = parts[:4]
    segs = parts[4] if len(parts) > 4 else max(2, base.num_segments * base.tile // tile)
    heads = parts[5] if len(parts) > 5 else (base.heads_per_program if base.v2 == 4 else 1)
    return AttnConfig(base.block_m, tile, segs, warps, stages, kernel, heads_per_program=heads if kernel == 4 else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="int4", choices=sorted(B.MODES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--cfg", default="", help="tile:warps:stages:kernel[:segments[:heads]] (default: the launcher's)")
    p.add_argument("--calls", type=int, default=2, help="launches after the checked first one")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU")
        return 1
    pb = B.make_problem(B.MODES[a.mode], a.batch, a.ctx, 1, B.FULL, "cuda")
    base = B.default_cfg(pb)
    cfg = parse_cfg(a.cfg, base) if a.cfg else base
    err = B.check(pb, cfg)
    print(f"{a.mode} b{a.batch} ctx{a.ctx} {cfg} rel. L2 {err:.1e}", flush=True)
    if not err <= 1e-2:
        return 2
    for i in range(a.calls):
        B.call(pb, cfg, pb["tables"][(i + 1) % len(pb["tables"])])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
