"""Session 15: the tensor-core INT4 writer with the row range on rounded pairs (``packed_range``) or not.

Checks every variant against the oracle first (poisoned cache, a NaN row, an Inf, a zero row,
every 97th slot negative; a partial last tile), then times them in interleaved rounds of CUDA-graph
replays next to a copy of the same bytes. Run: ``PYTHONPATH=. python3 tools/exp_session15/probe_write_packed.py
[--out FILE] [--rounds 3] [--shapes 65536x128,...]``.
"""
from __future__ import annotations

import argparse
import time

import torch

from tools import bench_write as bw
from tools.timing import tee

# (name, head_size -> tuning keywords, or None where the variant is the default or does not apply)
VARIANTS = [("default", lambda d: dict(kernel="mma")),
            ("packed", lambda d: dict(kernel="mma", packed_range=True) if d != 64 else None),
            ("packed r96", lambda d: dict(kernel="mma", packed_range=True, maxnreg=96) if d == 128 else None),
            ("packed r88", lambda d: dict(kernel="mma", packed_range=True, maxnreg=88) if d == 128 else None),
            ("fp32 r88", lambda d: dict(kernel="mma", packed_range=False, maxnreg=88) if d == 128 else None),
            ("packed r64", lambda d: dict(kernel="mma", maxnreg=64) if d == 64 else None),
            ("packed r56", lambda d: dict(kernel="mma", maxnreg=56) if d == 64 else None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="65536x128,262144x128,16384x128,65536x256,262144x256,65536x64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated indices into VARIANTS")
    ap.add_argument("--no-check", action="store_true", help="time only (the oracle checks ran before)")
    args = ap.parse_args()
    log = tee(args.out)
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    variants = VARIANTS if not args.variants else [VARIANTS[int(i)] for i in args.variants.split(",")]
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; INT4 write, 8 kv heads, random slots")
    for d in (() if args.no_check else (128, 64, 256)):
        for dtype in (torch.bfloat16, torch.float16):
            for tokens in (65536 if d < 256 else 32768, 4097):
                for name, kw in variants:
                    if kw(d) is None:
                        continue
                    rows, codes, err = bw.check_case("int4", dtype, d, tokens, dev, **kw(d))
                    log(f"check d={d} {str(dtype)[6:]} tokens={tokens} {name}: rows differing {rows}, "
                        f"codes {codes}, max Δ {err:.2f}")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for tokens, d in shapes:
        nbytes, sets = bw.timing_sets("int4", tokens, d, dev)
        calls = {name: lambda k, v, s, c, views, kw=kw(d): bw._write("int4", k, v, s, views, **kw)
                 for name, kw in variants if kw(d) is not None}
        times, copies = bw.interleaved_us(sets, calls, nbytes, dev, args.rounds)
        copy = min(copies)
        row = "  ".join(f"{name} {min(us):.1f} ({100 * copy / min(us):.0f}%)" for name, us in times.items())
        log(f"{tokens} x 8 x {d}: copy {copy:.1f} µs | {row}")
        del sets
        torch.cuda.empty_cache()
    log(f"# done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
