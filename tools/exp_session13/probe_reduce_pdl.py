"""Session 13 probe (H200): (1) the split-KV reduction alone, the old kernel (session 12's full
``[HEAD] x [HEAD, HEAD]`` inverse rotation, 8 warps; loaded from git at ``39eb0ed``) against the
Kronecker split with 8 and 4 warps, on the same inputs; (2) the INT4 default decode with v6's
programmatic dependent launch on / off, interleaved, bf16 in the same run; (3) the per-kernel
breakdown of the default call (torch profiler over graph replays).

Run from the repository root: ``PYTHONPATH=. python3 tools/exp_session13/probe_reduce_pdl.py OUT.txt [ROUNDS]``
(session 13: 3 rounds, ``raw/session13_reduce_pdl.txt``, then the final reduction with 1 round,
``raw/session13_reduce_kron_pdl.txt``)."""
import collections
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch
sys.path.insert(0, ".")
from tools import bench_attention as ba
from tools.timing import graph_us
from kernels import _attn_launch_v6 as L6
from kernels._attn_launch import launch_reduce
from kernels._attn_reduce import _attn_reduce_kernel
from kernels.reference import rht_signs
from kernels._jit import next_pow2

def _old_reduce():
    src = subprocess.run(["git", "show", "39eb0ed:kernels/_attn_reduce.py"], capture_output=True, text=True,
                         check=True).stdout
    src = src.replace("from ._attn_common", "from kernels._attn_common").replace("from ._jit", "from kernels._jit")
    path = os.path.join(tempfile.mkdtemp(), "_attn_reduce_old.py")  # Triton reads a kernel's source from its file
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("_attn_reduce_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._attn_reduce_kernel


old_kernel = _old_reduce()
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
from layouts import KVQuantMode as M
out = open(sys.argv[1], "w")
def log(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
dev = "cuda"
# (1)
for T, segs in ((8, 32), (32, 8), (1, 128), (64, 4), (128, 2)):
    hq, d = 32, 128
    part = torch.randn(T, hq, segs, d, device=dev)
    mx = torch.randn(T, hq, segs, device=dev)
    sm = torch.rand(T, hq, segs, device=dev) + 0.5
    signs = rht_signs(d, dev)
    outs = {n: torch.empty(T, hq, d, device=dev, dtype=torch.bfloat16) for n in ("old", "new8", "new4")}
    seg_pad = next_pow2(segs)
    common = dict(segm_out_ptr=part, segm_max_ptr=mx, segm_sum_ptr=sm, signs_ptr=signs, stride_o_t=hq * d,
                  stride_o_h=d, stride_o_d=1, NUM_Q_HEADS=hq, HEAD=d, HEAD_PAD=d, NUM_SEGMENTS=segs, SEG_PAD=seg_pad,
                  SEG_CHUNK=seg_pad, ROTATE=True, PDL=False, launch_pdl=False)
    fns = {
        "old": lambda: old_kernel[(T, hq)](out_ptr=outs["old"], ROT_CHUNK=d, num_warps=8, **common),
        "new8": lambda: _attn_reduce_kernel[(T, hq)](out_ptr=outs["new8"], HI=8, LO=16, num_warps=8, **common),
        "new4": lambda: _attn_reduce_kernel[(T, hq)](out_ptr=outs["new4"], HI=8, LO=16, num_warps=4, **common),
    }
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    err = {n: ((outs[n].float() - outs["old"].float()).norm() / outs["old"].float().norm()).item() for n in outs}
    res = collections.defaultdict(list)
    for _ in range(ROUNDS):
        for n, f in fns.items():
            res[n].append(graph_us(f, 30))
    log(f"R T{T} segs{segs}: " + "; ".join(f"{n} {min(v):.2f} us (rel diff vs old {err[n]:.1e})" for n, v in res.items()))
# (2)
p = dict(ba.FULL)
for batch, ctx in ((8, 32768), (32, 32768), (16, 16384), (4, 32768)):
    pbb = ba.make_problem(M.NONE, batch, ctx, 1, p, dev)
    tb = min(ba.time_us(pbb, ba.default_cfg(pbb)) for _ in range(2))
    del pbb
    pb = ba.make_problem(M.INT4_PER_TOKEN_HEAD, batch, ctx, 1, p, dev)
    cfg = ba.default_cfg(pb)
    res = collections.defaultdict(list)
    errs = {}
    for flag in (True, False):
        L6.PDL = flag
        errs[flag] = ba.check(pb, cfg)
    for _ in range(ROUNDS):
        for flag in (True, False):
            L6.PDL = flag
            res[flag].append(ba.time_us(pb, cfg))
    L6.PDL = True
    log(f"P INT4 b{batch}@{ctx} v2={cfg.v2} segs={cfg.num_segments}: bf16 {tb:.1f} us; v6 PDL on {min(res[True]):.1f} us "
        f"({tb / min(res[True]):.2f}x, L2 {errs[True]:.1e}); PDL off {min(res[False]):.1f} us ({tb / min(res[False]):.2f}x, "
        f"L2 {errs[False]:.1e}); rounds on {[round(x, 1) for x in res[True]]} off {[round(x, 1) for x in res[False]]}")
    # (3) breakdown, PDL on
    tabs = pb["tables"]
    def fn():
        for t in tabs:
            ba.call(pb, cfg, t)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in evs:
        agg[e.name] += e.device_time
    n = 10 * len(tabs)
    log(f"  breakdown: " + "; ".join(f"{k[:30]} {v / n:.1f} us" for k, v in sorted(agg.items(), key=lambda kv: -kv[1])))
    del pb, g
    torch.cuda.empty_cache()
