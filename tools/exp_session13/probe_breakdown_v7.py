"""Session 13 probe (H200): (A) the per-kernel breakdown of the default decode call (INT4, INT8,
bf16 at b8 / b32 @ 32k; torch profiler over graph replays), (B) v7 against v4 at 131,072 and
65,536 keys, bf16 in the same run, best of 2 rounds.

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session13/probe_breakdown_v7.py OUT.txt``
(session 13: ``raw/session13_probe_breakdown_v7_threshold.txt``)."""
import collections
import sys
import torch
sys.path.insert(0, ".")
from tools import bench_attention as ba
from tools.timing import graph_us
from kernels._attn_launch import AttnConfig, pick_config
from kernels._attn_launch_v6 import v6_segments
from kernels._jit import num_sms
from layouts import KVQuantMode as M
out = open(sys.argv[1], "w")
def log(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
p = dict(ba.FULL)
sms = num_sms(torch.device("cuda"))
# (A)
for mode in (M.INT4_PER_TOKEN_HEAD, M.INT8_PER_TOKEN_HEAD, M.NONE):
    for batch, ctx in ((8, 32768), (32, 32768)):
        pb = ba.make_problem(mode, batch, ctx, 1, p, "cuda")
        cfg = ba.default_cfg(pb)
        err = ba.check(pb, cfg)
        tabs = pb["tables"]
        def fn():
            for t in tabs:
                ba.call(pb, cfg, t)
        wall = graph_us(fn, 40, len(tabs))
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(); torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn()
        torch.cuda.synchronize()
        reps = 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        for e in evs:
            agg[e.name][0] += e.device_time  # us
            agg[e.name][1] += 1
        ncalls = reps * len(tabs)
        # span: first start to last end per replay / calls
        evs.sort(key=lambda e: e.time_range.start)
        span = (evs[-1].time_range.end - evs[0].time_range.start) / ncalls
        parts = "; ".join(f"{n[:40]} {v[0]/ncalls:.1f} us x{v[1]//ncalls}" for n, v in sorted(agg.items(), key=lambda kv: -kv[1][0]))
        ksum = sum(v[0] for v in agg.values()) / ncalls
        log(f"A {mode.name} b{batch}@{ctx} cfg v2={cfg.v2} segs={cfg.num_segments} st={cfg.num_stages} L2 {err:.1e}: "
            f"graph {wall:.1f} us/call, profiled span {span:.1f} us/call, kernels sum {ksum:.1f}: {parts}")
        del pb, g
        torch.cuda.empty_cache()
# (B)
for batch, ctx in ((4, 32768), (8, 16384), (16, 8192), (32, 4096), (64, 2048), (1, 65536), (2, 32768), (8, 8192), (16, 4096)):
    pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, "cuda")
    tb = min(ba.time_us(pbb, ba.default_cfg(pbb)) for _ in range(2))
    del pbb
    for mode in (M.INT8_PER_TOKEN_HEAD, M.FP8_PER_TOKEN_HEAD):
        pb = ba.make_problem(mode, batch, ctx, 1, p, "cuda")
        tiling = pick_config(mode, pb["q"], 4, batch, 1, ctx, None, None, None)
        segs = v6_segments(sms, batch, ctx)
        from kernels._attn_launch_v4 import v4_tiling, v4_segments
        t4 = v4_tiling(mode, 128)
        v4 = AttnConfig(16, t4[0], v4_segments(sms, batch * 8 // (t4[4] or 8), ctx, t4[0], t4[3], 128), t4[1], t4[2], 4, heads_per_program=t4[4])
        cfgs = {"default": tiling, "v4": v4, "v7": AttnConfig(16, 16, segs, 8, 2, 7)}
        res = {n: [ba.check(pb, c)] for n, c in cfgs.items()}
        for _ in range(2):
            for n, c in cfgs.items():
                res[n].append(ba.time_us(pb, c))
        log(f"B {mode.name} b{batch}@{ctx} ({batch*ctx} keys) bf16 {tb:.1f} us; default v2={tiling.v2}; "
            + "; ".join(f"{n} {min(v[1:]):.1f} us ({tb/min(v[1:]):.2f}x bf16, L2 {v[0]:.1e})" for n, v in res.items()))
        del pb
        torch.cuda.empty_cache()
