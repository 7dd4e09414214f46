"""Time variants of the v4 decode kernel (``AttnConfig.v2 = 4``) against the launcher's default and bf16.

Every configuration is checked against the oracle first (``bench.attention.check``), then
timed with CUDA graphs (``time_us``), all in one process on the same caches. ``--rounds R`` times
the variants R times, interleaved; ``--placements P`` repeats everything on P fresh caches at
other addresses and prints, per variant, its speed-up over the first one in each placement:
differences of a few percent can depend on where the cache lands (docs/bench/attention.md,
session 10). Run: ``PYTHONPATH=. python3 bench/bench_decode_v4.py [--out FILE]`` (H200).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from kernels._attn_launch import AttnConfig  # noqa: E402
from kernels._attn_launch_v4 import v4_segments  # noqa: E402
from kernels._jit import num_sms  # noqa: E402
from layouts import KVQuantMode  # noqa: E402
from bench import attention as ba  # noqa: E402
from bench.timing import tee  # noqa: E402

QUANT = {"int4": KVQuantMode.INT4_PER_TOKEN_HEAD, "int8": KVQuantMode.INT8_PER_TOKEN_HEAD,
         "fp8": KVQuantMode.FP8_PER_TOKEN_HEAD}
# tile, warps, stages, resident programs per SM aimed at, KV heads per program (0 = all)
# [, token-major loads [, register cap]]
VARIANTS = {"int4": ((16, 4, 2, 2, 0), (16, 1, 2, 8, 1), (16, 1, 2, 16, 1), (32, 1, 2, 8, 1), (32, 2, 2, 8, 1),
                     (64, 2, 2, 8, 1), (16, 1, 3, 8, 1)),
            "int8": ((16, 1, 2, 4, 1), (16, 1, 2, 8, 1), (16, 1, 2, 16, 1), (32, 1, 2, 8, 1), (32, 2, 2, 8, 1),
                     (16, 1, 3, 8, 1), (16, 2, 2, 8, 1))}
VARIANTS["fp8"] = VARIANTS["int8"]


def v4_cfg(base: AttnConfig, batch: int, ctx: int, heads: int, head_size: int, tile: int, warps: int, stages: int,
           per_sm: int, hg: int, rows: int = 1, regs: int = 0) -> AttnConfig:
    """A v4 configuration with the launcher's segment rule (:func:`v4_segments`) for ``per_sm``."""
    segs = v4_segments(num_sms(torch.device("cuda", torch.cuda.current_device())), batch * (heads // (hg or heads)),
                       ctx, tile, per_sm, head_size)
    return AttnConfig(base.block_m, tile, segs, warps, stages, 4, heads_per_program=hg, row_loads=bool(rows),
                      max_registers=regs)


def label(cfg: AttnConfig) -> str:
    kind = {3: "v3", 4: "v4"}.get(cfg.v2, f"v{cfg.v2}")
    return (f"{kind} tile {cfg.tile} warps {cfg.num_warps} stages {cfg.num_stages} segs {cfg.num_segments} "
            f"heads/program {cfg.heads_per_program} rows {int(cfg.row_loads)} regs {cfg.max_registers}")


def time_variants(name, batch, ctx, p, spec, place, rounds, bf, log) -> dict:
    """Check, then time (best of ``rounds``, interleaved) the launcher's default and the variants of
    ``name`` on a fresh problem; ``place`` > 0 allocates ``place`` x 37.3 MB first, so the cache
    lands elsewhere. Returns {config: µs}."""
    pad = torch.empty(int(place * 37.3e6) + 1, dtype=torch.uint8, device="cuda")
    pb = ba.make_problem(QUANT[name], batch, ctx, 1, p, "cuda", seed=place)
    base = ba.default_cfg(pb)
    cfgs = list(dict.fromkeys([base] + [v4_cfg(base, batch, ctx, p["num_kv_heads"], p["head_size"], *v)
                                        for v in spec or VARIANTS[name]]))
    errs = {}
    for cfg in cfgs:
        errs[cfg] = err = ba.check(pb, cfg)
        if not err <= 1e-2:
            raise AssertionError(f"{name} {cfg}: relative L2 {err:.2e}")
    times = {cfg: [] for cfg in cfgs}
    for _ in range(rounds):
        for cfg in cfgs:
            times[cfg].append(ba.time_us(pb, cfg))
    at = f" placement {place}" if place else ""
    best = {cfg: min(ts) for cfg, ts in times.items()}
    for cfg, ts in times.items():
        spread = f" ({best[cfg]:.1f}-{max(ts):.1f} over {rounds} rounds)" if rounds > 1 else ""
        log(f"  {name} b{batch}@{ctx}{at} {label(cfg)}: {best[cfg]:.1f} us{spread} (rel. L2 {errs[cfg]:.1e}), "
            f"{bf / best[cfg]:.2f}x bf16")
    del pb, pad
    torch.cuda.empty_cache()
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x32768,32x32768,1x32768,8x4096,1x4096,2x4096,1x2048",
                    help="batch x context, comma separated")
    ap.add_argument("--modes", default="int4,int8,fp8", help="comma separated, of " + ",".join(QUANT))
    ap.add_argument("--variants", default=None,
                    help="space separated tile:warps:stages:per_sm:heads[:rows[:max registers]] (default: VARIANTS)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timings of every variant")
    ap.add_argument("--placements", type=int, default=1, help="fresh caches at other addresses")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.placements < 1:
        ap.error("--rounds and --placements must be at least 1")
    try:
        shapes = [tuple(map(int, x.split("x"))) for x in args.shapes.split(",")]
        spec = [tuple(map(int, v.split(":"))) for v in args.variants.split()] if args.variants else None
    except ValueError as e:
        ap.error(f"--shapes / --variants must be integers: {e}")
    if any(len(sh) != 2 for sh in shapes) or any(not 5 <= len(v) <= 7 for v in spec or ()):
        ap.error("--shapes takes BATCHxCONTEXT, --variants tile:warps:stages:per_sm:heads[:rows[:registers]]")
    if unknown := set(args.modes.split(",")) - set(QUANT):
        ap.error(f"unknown modes {sorted(unknown)}; choose from {sorted(QUANT)}")
    if not torch.cuda.is_available():
        print("bench_decode_v4 needs a CUDA GPU")
        return 1

    log = tee(args.out)
    ba.REP_MS = 30
    p = dict(ba.FULL, head_size=args.head_size)
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, head_size {args.head_size}")
    for batch, ctx in shapes:
        pb = ba.make_problem(KVQuantMode.NONE, batch, ctx, 1, p, "cuda")
        bf = ba.time_us(pb, ba.default_cfg(pb))
        del pb
        log(f"b{batch}@{ctx} bf16 {bf:.1f} us")
        for name in args.modes.split(","):
            speedups = {}
            for place in range(args.placements):
                times = time_variants(name, batch, ctx, p, spec, place, args.rounds, bf, log)
                first = next(iter(times.values()))
                for cfg, us in times.items():
                    speedups.setdefault(cfg, []).append(first / us)
            if args.placements > 1:
                for cfg, r in speedups.items():
                    log(f"  {name} b{batch}@{ctx} {label(cfg)}: {min(r):.3f}-{max(r):.3f}x the first variant's speed "
                        f"over {args.placements} placements")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
