"""Session 14 A/B (H200): the Gluon decode kernels (v6 INT4, v7 INT8 / FP8) at the launcher's
segment count, now ``PROGRAMS_PER_SM x SMs // sequences`` exactly (``v6_segments``), against the
power of two below it (the rule before). bf16's default in the same run; every configuration is
checked against the oracle first; ``--rounds`` interleaved rounds of CUDA-graph timings, best kept.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session14/probe_exact_segments.py
[--shapes 8x32768,4x32768] [--out FILE]``."""
from __future__ import annotations

import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from kernels._jit import prev_pow2  # noqa: E402
from layouts import KVQuantMode as M  # noqa: E402
from tools import bench_attention as ba  # noqa: E402
from tools.exp_session14 import ab  # noqa: E402


def main(argv=None) -> int:
    ap = ab.parser(__doc__, "8x32768,4x32768,12x16384,24x8192,8x16384")
    ap.add_argument("--modes", default="int4,int8")
    args = ap.parse_args(argv)
    log, p = ab.start(args, "head_size 128, 32 query / 8 KV heads, block 16")
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
        runs = [("bf16", pbb, ba.default_cfg(pbb))]
        pbs = [pbb]
        for m in args.modes.split(","):
            pb = ba.make_problem(ba.MODES[m], batch, ctx, 1, p, "cuda")
            pbs.append(pb)
            cfg = ba.default_cfg(pb)
            runs.append((f"{m} v{cfg.v2} s{cfg.num_segments}", pb, cfg))
            low = prev_pow2(cfg.num_segments)
            if low != cfg.num_segments:
                runs.append((f"{m} v{cfg.v2} s{low}", pb, dataclasses.replace(cfg, num_segments=low)))
        ab.check(runs, f"b{batch}@{ctx}")
        log(ab.line(f"b{batch}@{ctx}", runs, ab.time_rounds(runs, args.rounds)))
        del pbs, pbb, runs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
