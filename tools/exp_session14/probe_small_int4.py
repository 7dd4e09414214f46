"""Session 14 probe (H200): the small INT4 decode rows (batch 1-8, 2k-4k context, head_size 128),
where INT4 must not be slower than bf16. Per shape, the defaults of bf16, INT8 and INT4, then INT4
through v3 (tile 64, 2 warps), v4 (tile 32, 1 warp) and v6 (whole blocks, every KV head) at
several segment counts. Every configuration is checked against the oracle first; then all are
timed with CUDA graphs in ``--rounds`` interleaved rounds, best of the rounds.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session14/probe_small_int4.py
[--shapes 2x4096,1x4096] [--out FILE]``."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch_v6 as L6  # noqa: E402
from kernels._attn_launch import AttnConfig  # noqa: E402
from layouts import KVQuantMode as M  # noqa: E402
from tools import bench_attention as ba  # noqa: E402
from tools.exp_session14 import ab  # noqa: E402


def variants(kv_heads: int, segs3, segs4, segs6):
    out = {}
    for s in segs3:
        out[f"v3 s{s}"] = AttnConfig(16, 64, s, 2, 2, 3)
    for s in segs4:
        out[f"v4 s{s}"] = AttnConfig(16, 32, s, 1, 2, 4, heads_per_program=1)
    for s in segs6:
        out[f"v6 s{s}"] = AttnConfig(16, 16, s, kv_heads, L6.STAGES, 6)
    return out


def main(argv=None) -> int:
    ap = ab.parser(__doc__, "1x2048,2x2048,1x4096,2x4096,4x4096,8x2048")
    ap.add_argument("--segs3", default="16,32,64")
    ap.add_argument("--segs4", default="16,32,64")
    ap.add_argument("--segs6", default="8,16,32,64")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with tiny heads (interpreter)")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    dev = args.device
    log, p = ab.start(args, "head_size {head_size}, {num_q_heads} query / {num_kv_heads} KV heads, block 16".format(
        **(ba.FULL if dev == "cuda" else ba.QUICK)), dev)
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pbs = {m: ba.make_problem(m, batch, ctx, 1, p, dev) for m in (M.NONE, M.INT8_PER_TOKEN_HEAD,
                                                                          M.INT4_PER_TOKEN_HEAD)}
        runs = [("bf16 default", pbs[M.NONE], ba.default_cfg(pbs[M.NONE])),
                ("int8 default", pbs[M.INT8_PER_TOKEN_HEAD], ba.default_cfg(pbs[M.INT8_PER_TOKEN_HEAD]))]
        pb4 = pbs[M.INT4_PER_TOKEN_HEAD]
        d4 = ba.default_cfg(pb4)
        runs.append((f"int4 default (v{d4.v2} s{d4.num_segments})", pb4, d4))
        runs += [(n, pb4, c) for n, c in variants(p["num_kv_heads"], ints(args.segs3), ints(args.segs4),
                                                   ints(args.segs6)).items() if ctx // c.num_segments >= 32]
        errs = ab.check(runs, f"b{batch}@{ctx}")
        times = ab.time_rounds(runs, args.rounds)
        log(ab.line(f"b{batch}@{ctx}", runs, times))
        log(f"  max rel. L2 {max(errs):.1e}; spread (max-min over rounds) "
            + " ".join(f"{max(t) - min(t):.1f}" for t in times))
        del pbs, pb4
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
