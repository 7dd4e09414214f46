"""INT4 decode: the v6 kernel (``AttnConfig.v2 = 6``) against v4 on the same caches, by batch size.

For each batch x context: v4 with its launcher tiling (``v4_segments``) and v6 at the
launcher's segment count (``v6_segments``, marked ``*``), half of it and twice it
(``--launcher-segments``: the launcher's only), at each ring depth of ``--stages``. Every
configuration is first checked against the oracle (``bench.attention.check``). Then all
are timed with CUDA graphs, ``--rounds`` times interleaved, best of the rounds. ``--probe``
also times v6's copies alone (``_attn_launch_v6.PROBE``: the ring without the maths). This is
how ``V6_MIN_KEYS`` and the ring depth were set (docs/bench/attention.md, "Session 11", "Session 12").

Run: ``PYTHONPATH=. python3 bench/bench_decode_v6.py [--shapes 8x32768,32x4096] [--out FILE]`` (H200).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch_v6 as L6  # noqa: E402
from kernels._attn_launch import AttnConfig  # noqa: E402
from kernels._attn_launch_v4 import v4_segments, v4_tiling  # noqa: E402
from kernels._jit import num_sms  # noqa: E402
from layouts import KVQuantMode  # noqa: E402
from bench import attention as ba  # noqa: E402
from bench.timing import tee  # noqa: E402

INT4 = KVQuantMode.INT4_PER_TOKEN_HEAD
SHAPES = "1x32768,2x32768,4x32768,8x8192,8x16384,16x8192,4x16384,16x16384,32x4096,64x4096,8x32768,32x32768"


def configs(sms: int, batch: int, ctx: int, kv_heads: int, stages=(L6.STAGES,), spread: bool = True,
            segments=()):
    """v4 (launcher tiling) and v6 at half / the launcher's / twice its segments (only the
    launcher's unless ``spread``; ``segments``: these counts instead, any positive number, e.g.
    33 for b8 on 132 SMs: 264 programs, two per SM), for each ring depth in ``stages``."""
    tile, warps, v4_stages, per_sm, hg = v4_tiling(INT4, L6.HEAD_SIZE)
    v4 = AttnConfig(16, tile, v4_segments(sms, batch * kv_heads // hg, ctx, tile, per_sm, L6.HEAD_SIZE), warps,
                    v4_stages, 4, heads_per_program=hg)
    s6 = L6.v6_segments(sms, batch, ctx)
    counts = sorted(set(segments)) or (sorted({max(2, s6 // 2), s6, 2 * s6}) if spread else [s6])
    return v4, s6, [AttnConfig(16, 16, s, kv_heads, st, 6) for st in stages for s in counts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="batch x context, comma separated")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timings of every configuration")
    ap.add_argument("--probe", action="store_true", help="also time v6's copies alone")
    ap.add_argument("--copies", choices=("bulk", "cp.async", "both"), default="both",
                    help="v6's block copies: one bulk copy (TMA) per block (sm_90), cp.async, or both")
    ap.add_argument("--launcher-segments", action="store_true", help="v6 at the launcher's segment count only")
    ap.add_argument("--stages", default=str(L6.STAGES), help="ring depths to time, comma separated (>= 2)")
    ap.add_argument("--segments", default="", help="v6 segment counts to time, comma separated (default: the "
                    "launcher's, half and twice it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
    except ValueError as e:
        ap.error(f"--shapes takes BATCHxCONTEXT: {e}")
    if any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        ap.error("--shapes takes BATCHxCONTEXT, both positive")
    try:
        stages = tuple(int(v) for v in args.stages.split(","))
    except ValueError as e:
        ap.error(f"--stages takes ring depths: {e}")
    if min(stages) < 2:
        ap.error("--stages: a ring has at least 2 stages")
    try:
        segments = tuple(int(v) for v in args.segments.split(",") if v.strip())
    except ValueError as e:
        ap.error(f"--segments takes segment counts: {e}")
    if segments and min(segments) < 2:
        ap.error("--segments: the split path has at least 2 segments")
    if not torch.cuda.is_available():
        print("bench_decode_v6 needs a CUDA GPU")
        return 1
    if not L6.available(torch.device("cuda")):
        print("bench_decode_v6 needs compute capability 8.0+ and Triton's Gluon")
        return 1

    log = tee(args.out)
    ba.REP_MS = 30
    p = dict(ba.FULL)
    sms = num_sms(torch.device("cuda"))
    log(f"# {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}; INT4, head_size 128, "
        f"{p['num_q_heads']} query / {p['num_kv_heads']} KV heads; µs, best of {args.rounds} interleaved rounds")
    for batch, ctx in shapes:
        pb = ba.make_problem(INT4, batch, ctx, 1, p, "cuda")
        v4, s6, v6s = configs(sms, batch, ctx, p["num_kv_heads"], stages, not args.launcher_segments, segments)
        bulks = (True, False) if args.copies == "both" else (args.copies == "bulk",)
        v6runs = [(c, b) for c in v6s for b in bulks]
        runs = [(v4, False, True)] + [(c, False, b) for c, b in v6runs] + (
            [(c, True, b) for c, b in v6runs] if args.probe else [])
        times = [[] for _ in runs]
        try:
            for c, probe, bulk in runs[:1 + len(v6runs)]:
                L6.BULK = bulk
                err = ba.check(pb, c)
                if not err <= 1e-2:
                    raise AssertionError(f"b{batch}@{ctx} {c} bulk {bulk}: relative L2 {err:.2e}")
            for _ in range(args.rounds):
                for i, (c, probe, bulk) in enumerate(runs):
                    L6.PROBE, L6.BULK = probe, bulk
                    times[i].append(ba.time_us(pb, c))
        finally:
            L6.PROBE, L6.BULK = False, True
        best = [min(t) for t in times]
        parts = []
        for (c, probe, bulk), us in zip(runs[1:], best[1:]):
            mark = "*" if c.num_segments == s6 else ""
            kind = ("v6 copies only" if probe else "v6") + (" bulk" if bulk else " cp.async")
            parts.append(f"{kind} stages {c.num_stages} segs {c.num_segments}{mark} {us:.1f} ({best[0] / us:.2f}x v4)")
        log(f"b{batch}@{ctx} keys {batch * ctx}: v4 {best[0]:.1f} us (segs {v4.num_segments}); " + "; ".join(parts))
        del pb
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
