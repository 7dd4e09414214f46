"""Session 14 A/B (H200, branch exp/session14-v6-pair): v6 with two cache blocks per loop step
(``L6.PAIR``: one softmax step, one accumulator rescale and one ring barrier per 32 keys; offline
sm_90 619 SASS per step against 355 per block, 128 registers, no spills) against one block per
step. First the v6 CUDA test cases with PAIR on at 2, 4 and 6 stages (oracle and v4); then per
shape bf16's default, v6's default and PAIR at 4 and 6 stages, ``--rounds`` interleaved rounds of
CUDA-graph timings, best kept.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session14/probe_v6_pair.py [--out FILE]``."""
from __future__ import annotations

import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch_v6 as L6  # noqa: E402
from kernels._attn_launch import AttnConfig  # noqa: E402
from layouts import KVQuantMode as M  # noqa: E402
from tools import bench_attention as ba  # noqa: E402
from tools.exp_session14 import ab  # noqa: E402


def pair(on: bool) -> None:
    L6.PAIR = on


def main(argv=None) -> int:
    args = ab.parser(__doc__, "8x32768,32x32768,4x32768,12x16384").parse_args(argv)
    log, p = ab.start(args, "INT4 v6, head_size 128")
    from tests import test_attention_kernels as T
    pair(True)
    for hq, hk in ((32, 8), (8, 8), (64, 8), (16, 4), (4, 1), (8, 2)):
        c = T.make_case(M.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1] * 5, k_lens=[1500, 1, 17, 333, 640],
                        num_q_heads=hq, num_kv_heads=hk, head_size=128, device="cuda", seed=hq + hk)
        v4 = AttnConfig(16, 32, 8, 1, 2, 4, heads_per_program=1)
        for segs, stages in ((3, 2), (32, 4), (5, 6)):
            T._matches_v4(c, AttnConfig(16, 16, segs, hk, stages, 6), v4)
    assert not L6._DISABLED
    log("PAIR: the v6 test cases passed (6 GQA cases x 3 segment / stage settings, oracle and v4)")
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
        pb = ba.make_problem(M.INT4_PER_TOKEN_HEAD, batch, ctx, 1, p, "cuda")
        d = ba.default_cfg(pb)
        runs = [("bf16", pbb, ba.default_cfg(pbb), False), (f"v6 (s{d.num_segments}, 4 st)", pb, d, False),
                ("pair, 4 st", pb, d, True), ("pair, 6 st", pb, dataclasses.replace(d, num_stages=6), True)]
        try:
            errs = ab.check(runs[1:], shape, pair)
            log(ab.line(f"b{batch}@{ctx}", runs, ab.time_rounds(runs, args.rounds, pair))
                + "; rel. L2 " + " / ".join(f"{e:.2e}" for e in errs))
        finally:
            pair(True)  # the default
        del pb, pbb
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
