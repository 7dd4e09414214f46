"""Time quantized decode tilings (tile, warps, stages, kernel) x segment counts on one GPU.

Each configuration is checked against the oracle (relative L2 <= 1e-2) before it is timed, on
the same problems as ``bench/attention.py`` (32 query / 8 KV heads, head_size 128 or
``--head-size``, block 16, a random block table rotated through more than the L2). Lines are printed as they finish::

    PYTHONPATH=. python3 bench/sweep_decode.py --modes int4,int8,fp8 \\
        --shapes 8x32768,32x32768,1x32768,8x4096,1x4096,1x2048 \\
        --variants 64:2:2:3,32:1:2:3,64:2:3:3,128:4:2:3 --seg-mults 0.5,1,2 --old-default

``--variants`` items are ``tile:warps:stages:kernel[:heads]`` (kernel: 0 = v1, 1 = v2, 3 = v3, 4 = v4;
``heads``: v4's KV heads per program, 0 = all, the default); for each,
the segment count is the launcher default's times each ``--seg-mults`` value, scaled by
``64 / tile`` (at least 2), or the explicit ``--segs`` list.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch as L  # noqa: E402
from kernels._attn_launch import AttnConfig  # noqa: E402
from bench import attention as B  # noqa: E402


def configs(base: AttnConfig, mode, variants, mults, segs, old_default, pb):
    out = [base]
    if old_default and mode != B.MODES["int4"]:  # the v1 default the launcher used before v3
        keep = L.DECODE_V2[mode]
        L.DECODE_V2[mode] = 0
        out.append(B.default_cfg(pb))
        L.DECODE_V2[mode] = keep
    for tile, warps, stages, kernel, *heads in variants:
        counts = segs or [max(2, int(base.num_segments * m * 64 // tile)) for m in mults]
        out += [AttnConfig(16, tile, s, warps, stages, kernel, heads_per_program=heads[0] if heads else 0)
                for s in counts]
    return list(dict.fromkeys(out))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="int4,int8,fp8")
    p.add_argument("--shapes", default="8x32768,32x32768,1x32768,8x4096,1x4096,1x2048", help="batch x context")
    p.add_argument("--variants", default="64:2:2:3,32:1:2:3", help="tile:warps:stages:kernel[:heads], comma-separated")
    p.add_argument("--seg-mults", default="0.5,1,2")
    p.add_argument("--segs", default="", help="explicit segment counts (instead of --seg-mults)")
    p.add_argument("--old-default", action="store_true", help="also time INT8/FP8's previous (v1) default")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--head-size", type=int, default=B.FULL["head_size"])
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_decode needs a CUDA GPU")
        return 1
    B.REP_MS = a.rep_ms
    preset = dict(B.FULL, head_size=a.head_size)
    variants = [tuple(int(x) for x in v.split(":")) for v in a.variants.split(",") if v]
    mults = [float(m) for m in a.seg_mults.split(",") if m]
    segs = [int(s) for s in a.segs.split(",") if s]
    for shape in a.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pb = B.make_problem(B.MODES["bf16"], batch, ctx, 1, preset, "cuda")
        print(f"bf16 d{a.head_size} b{batch} ctx{ctx} default us={B.time_us(pb, B.default_cfg(pb)):.1f}", flush=True)
        del pb
        for name in a.modes.split(","):
            mode = B.MODES[name]
            pb = B.make_problem(mode, batch, ctx, 1, preset, "cuda")
            base = B.default_cfg(pb)
            for cfg in configs(base, mode, variants, mults, segs, a.old_default, pb):
                err = B.check(pb, cfg)
                us = B.time_us(pb, cfg) if err <= 1e-2 else float("nan")
                tag = "DEFAULT " if cfg == base else ""
                print(f"{tag}{name} d{a.head_size} b{batch} ctx{ctx} v{cfg.v2} t{cfg.tile} w{cfg.num_warps} "
                      f"st{cfg.num_stages} "
                      f"segs{cfg.num_segments} err={err:.1e} us={us:.1f}", flush=True)
            del pb
    return 0


if __name__ == "__main__":
    sys.exit(main())
