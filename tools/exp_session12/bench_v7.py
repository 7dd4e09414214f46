"""Session 12's prepared A/B for the experimental INT8 / FP8 decode v7 (H200): the launcher's
default (v4) against v7 at 2 programs per SM (``v6_segments``) with 2 and 3 stages, bulk copies
(sm_90) and cp.async, and v7's copies alone, bf16 in the same run for the ratio. Each configuration is checked against the
oracle first. Run: ``PYTHONPATH=. python3 tools/exp_session12/bench_v7.py OUT.txt``."""
import sys

import torch

sys.path.insert(0, ".")
from kernels import _attn_launch_v7 as L7  # noqa: E402
from kernels import _attn_launch_v6 as L6  # noqa: E402
from kernels._attn_launch import AttnConfig, pick_config  # noqa: E402
from kernels._attn_launch_v6 import v6_segments  # noqa: E402
from kernels._jit import num_sms  # noqa: E402
from layouts import KVQuantMode  # noqa: E402
from tools import bench_attention as ba  # noqa: E402

ba.REP_MS = 30
sms = num_sms(torch.device("cuda"))
out = open(sys.argv[1], "w")
p = dict(ba.FULL)
for batch, ctx in ((8, 32768), (32, 32768), (16, 16384), (64, 4096), (2, 32768)):
    pbb = ba.make_problem(KVQuantMode.NONE, batch, ctx, 1, p, "cuda")
    qb = pbb["q"]
    cfg_b = pick_config(KVQuantMode.NONE, qb, 4, batch, 1, ctx, None, None, None)
    t_bf16 = min(ba.time_us(pbb, cfg_b) for _ in range(2))
    del pbb
    for mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        pb = ba.make_problem(mode, batch, ctx, 1, p, "cuda")
        segs = v6_segments(sms, batch, ctx)
        cfgs = [("v4", pick_config(mode, pb["q"], 4, batch, 1, ctx, None, None, None), False, True)]
        cfgs += [(f"v7 {'bulk' if b else 'cp.async'} st{st}", AttnConfig(16, 16, segs, 8, st, 7), False, b)
                 for b in (True, False) for st in (2, 3)]
        cfgs += [(f"v7 {'bulk' if b else 'cp.async'} st3 copies only", AttnConfig(16, 16, segs, 8, 3, 7), True, b)
                 for b in (True, False)]
        res = {}
        for name, c, probe, bulk in cfgs:
            L6.BULK = bulk
            if not probe:
                err = ba.check(pb, c)
                assert err < 1e-2, (mode, name, err)
                res[name] = [err]
            else:
                res[name] = [float("nan")]
        for _ in range(2):
            for name, c, probe, bulk in cfgs:
                L7.PROBE, L6.BULK = probe, bulk
                res[name].append(ba.time_us(pb, c))
        L7.PROBE, L6.BULK = False, True
        line = (f"{mode.name} b{batch}@{ctx}: bf16 {t_bf16:.1f} us; "
                + "; ".join(f"{n} {min(v[1:]):.1f} us ({t_bf16 / min(v[1:]):.2f}x bf16, L2 {v[0]:.1e})"
                            for n, v in res.items()))
        print(line)
        out.write(line + "\n")
        out.flush()
        del pb
        torch.cuda.empty_cache()
