"""Session 13 probe (H200): the INT4 default decode with v6's programmatic dependent launch off, on,
and on with the query rotation releasing v6 at its start (``L6.PDL`` / ``L6.PDL_EARLY``), three
interleaved rounds, bf16 in the same run. Run from the repository root:
``PYTHONPATH=. python3 tools/exp_session13/probe_pdl_early.py OUT.txt`` (session 13:
``docs/bench/raw/session13_pdl_early.txt``)."""
import collections
import sys

import torch
sys.path.insert(0, ".")
from tools import bench_attention as ba
from kernels import _attn_launch_v6 as L6
from layouts import KVQuantMode as M
out = open(sys.argv[1], "w")
p = dict(ba.FULL)
for batch, ctx in ((8, 32768), (32, 32768), (4, 32768), (16, 16384)):
    pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
    tb = min(ba.time_us(pbb, ba.default_cfg(pbb)) for _ in range(2))
    del pbb
    pb = ba.make_problem(M.INT4_PER_TOKEN_HEAD, batch, ctx, 1, p, "cuda")
    cfg = ba.default_cfg(pb)
    variants = {"off": (False, False), "pdl": (True, False), "pdl+early": (True, True)}
    res = collections.defaultdict(list); errs = {}
    for n, (a, b) in variants.items():
        L6.PDL, L6.PDL_EARLY = a, b
        errs[n] = ba.check(pb, cfg)
    for _ in range(3):
        for n, (a, b) in variants.items():
            L6.PDL, L6.PDL_EARLY = a, b
            res[n].append(ba.time_us(pb, cfg))
    L6.PDL, L6.PDL_EARLY = True, True
    line = (f"INT4 b{batch}@{ctx} segs {cfg.num_segments}: bf16 {tb:.1f} us; "
            + "; ".join(f"{n} {min(v):.1f} us ({tb / min(v):.2f}x, L2 {errs[n]:.1e}, rounds {[round(x, 1) for x in v]})"
                        for n, v in res.items()))
    print(line, flush=True); out.write(line + "\n"); out.flush()
    del pb; torch.cuda.empty_cache()
