"""Session 18 probe (H200): where an INT4 v6 decode call's time goes, by leaving pieces out of it.

Per shape, in interleaved rounds of CUDA-graph replays (best kept), the default INT4 call and:

- ``no reduce``: the rotation and v6 only (the reduction not launched);
- ``no rotation``: v6 and the reduction, the rotated query computed once before (not launched);
- ``v6 alone``: neither;
- ``rows=N``: the Gluon reduction with N segments per thread (``GLUON_ROWS``);
- ``warp0 off``: every warp of v6 runs the refills' code (``L6.WARP0`` off; calls 1-4 ran with
  it off, and call 5 timed it on as ``warp0``);
- ``arrive`` (call 8 only; the branch was removed): v6's warps 1.. arrive on a named barrier
  (``bar.arrive``, two ids alternating) and go on, warp 0 alone waits there before the refills;
- ``triton edges``: the Triton query rotation and reduction (``_attn_launch_edges.GLUON`` off;
  ``triton reduce`` in calls 2-4, before the rotation had a Gluon kernel), the rest the default.

(Call 1 of the session also timed ``tail``: v6 releasing the reduction after its loop with
``griddepcontrol.launch_dependents``; 4-8% slower at every shape, the branch was removed.)

Then the kernels' own times under the torch profiler (graph replays of the default call).
Every variant that computes the whole output is checked against the oracle first.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session18/probe_v6_parts.py [--out FILE]``."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch as LA  # noqa: E402
from kernels import _attn_launch_edges as LR  # noqa: E402
from kernels import _attn_launch_v6 as L6  # noqa: E402
from layouts import KVQuantMode as M  # noqa: E402
from tools import bench_attention as ba  # noqa: E402
from tools.exp_session14 import ab  # noqa: E402

REAL_REDUCE, REAL_QUERY = LA.launch_reduce, LA.decode_query
_CACHED: dict = {}


def _cached_query(q, signs, *a, **kw):
    """decode_query without a launch after the first: the rotated query of the first call."""
    key = (q.data_ptr(), q.shape)
    if key not in _CACHED:
        _CACHED[key] = REAL_QUERY(q, signs, *a, **kw)
    return _CACHED[key]


ROWS = LR.GLUON_ROWS


def setting(name: str) -> None:
    LA.launch_reduce = (lambda *a, **kw: None) if name in ("no reduce", "v6 alone") else REAL_REDUCE
    LA.decode_query = _cached_query if name in ("no rotation", "v6 alone") else REAL_QUERY
    LR.GLUON = name != "triton edges"
    LR.GLUON_ROWS = int(name[5:]) if name.startswith("rows=") else ROWS
    L6.WARP0 = name != "warp0 off"


def kernel_times(pb, cfg, log, label: str) -> None:
    """Each kernel's mean time over graph replays of the call, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile
    table = pb["tables"][0]
    ba.call(pb, cfg, table)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for _ in range(10):
                ba.call(pb, cfg, table)
    torch.cuda.synchronize()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None)
        total = getattr(e, "cuda_time_total", 0.0) if total is None else total
        if total > 0 and e.count >= 100:
            rows.append((e.key, total / e.count, e.count))
    log(f"{label} kernels: " + "; ".join(f"{k[:40]} {t:.2f} us x{c}" for k, t, c in sorted(rows, key=lambda r: -r[1])))


def main(argv=None) -> int:
    ap = ab.parser(__doc__, "8x32768,12x32768,32x32768,4x32768")
    ap.add_argument("--variants", default="default,triton edges,no reduce,no rotation,v6 alone")
    args = ap.parse_args(argv)
    log, p = ab.start(args, "INT4 v6 call, pieces left out")
    names = args.variants.split(",")
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
        pb = ba.make_problem(M.INT4_PER_TOKEN_HEAD, batch, ctx, 1, p, "cuda")
        d = ba.default_cfg(pb)
        runs = [("bf16", pbb, ba.default_cfg(pbb), "default")] + [(n, pb, d, n) for n in names]
        try:
            errs = ab.check([r for r in runs if r[3] not in ("no reduce", "v6 alone")], shape, setting)
            log(ab.line(f"b{batch}@{ctx} s{d.num_segments}", runs, ab.time_rounds(runs, args.rounds, setting))
                + "; rel. L2 of each full call " + " / ".join(f"{e:.2e}" for e in errs))
            setting("default")
            kernel_times(pb, d, log, f"b{batch}@{ctx} default")
            setting("triton edges")
            kernel_times(pb, d, log, f"b{batch}@{ctx} triton edges")
        finally:
            setting("default")
        del pb, pbb
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
