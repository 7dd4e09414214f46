"""Session 14 A/B (H200): v6 with three programs per SM (register cap 80: 24 warps per SM, 6
per scheduler, some values spilled to local memory) against the default two (cap 128, no
spills). Per shape: bf16's default, v6's default, then v6 capped at 80 registers with the
default segments (the spills' cost alone) and with segments for 3 programs per SM (the
launcher's rule with ``PROGRAMS_PER_SM = 3``) at 3 and 4 stages. Every configuration is checked
against the oracle first; ``--rounds`` interleaved rounds of CUDA-graph timings, best kept.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session14/probe_v6_three_per_sm.py
[--shapes 8x32768] [--out FILE]``."""
from __future__ import annotations

import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch_v6 as L6  # noqa: E402
from kernels._jit import num_sms  # noqa: E402
from layouts import KVQuantMode as M  # noqa: E402
from tools import bench_attention as ba  # noqa: E402
from tools.exp_session14 import ab  # noqa: E402


def segments(per_sm: int, sms: int, seqs: int, ctx: int) -> int:
    saved = L6.PROGRAMS_PER_SM
    L6.PROGRAMS_PER_SM = per_sm
    try:
        return L6.v6_segments(sms, seqs, ctx)
    finally:
        L6.PROGRAMS_PER_SM = saved


def main(argv=None) -> int:
    args = ab.parser(__doc__, "8x32768,32x32768,12x16384,4x32768").parse_args(argv)
    log, p = ab.start(args, "INT4 v6, head_size 128")
    sms = num_sms(torch.device("cuda"))
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
        pb = ba.make_problem(M.INT4_PER_TOKEN_HEAD, batch, ctx, 1, p, "cuda")
        d = ba.default_cfg(pb)
        s3 = segments(3, sms, batch, ctx)
        runs = [("bf16", pbb, ba.default_cfg(pbb)), (f"v6 default (s{d.num_segments}, 4 st)", pb, d),
                (f"cap 80, s{d.num_segments}, 4 st", pb, dataclasses.replace(d, max_registers=80)),
                (f"cap 80, s{s3}, 4 st", pb, dataclasses.replace(d, max_registers=80, num_segments=s3)),
                (f"cap 80, s{s3}, 3 st", pb, dataclasses.replace(d, max_registers=80, num_segments=s3, num_stages=3))]
        errs = ab.check(runs[1:], shape)
        assert not L6._DISABLED
        log(ab.line(f"b{batch}@{ctx}", runs, ab.time_rounds(runs, args.rounds))
            + "; rel. L2 " + " / ".join(f"{e:.2e}" for e in errs))
        del pb, pbb
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
