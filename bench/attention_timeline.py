"""Where the time of one decode call goes, kernel by kernel, with a cold L2 (CUDA).

Each spec ``mode:batch:context[:path:segments:tile:warps:stages[:heads[:max_registers]]]``
builds the decode problem of ``bench.attention`` (32 query / 8 KV heads, head_size 128, block 16, random codes,
shuffled block table), checks it against the oracle, captures ``calls`` of it in one CUDA
graph, each after a pass over 256 MiB that flushes the L2 (``--flush read``, the default, or
``write``: :func:`bench.timing.flush_l2`), and replays the graph under the PyTorch
profiler. Printed per kernel of the call (rotation, decode, reduction): its grid, block,
registers per thread, shared memory per block, the profiler's estimate of achieved occupancy
(what says whether a grid fills the SMs in whole waves), the median duration over the calls
and the median gap after the previous kernel (negative: it started before that one ended,
programmatic dependent launch); then the median time from
the end of the flush to the end of the call's last kernel. A spec with a path times that path
with the tiling given (``Tiling(16, tile, segments, warps, stages)``, edges-only masking for
the 2D kernel; ``heads``: KV heads per program of ``decode_block_tiles``, 0 = all; ``max_registers``:
the register cap per thread, 0 = the kernel's own) instead of the plan's.

Run: ``python -m bench.attention_timeline int4:1:32768 bf16:1:32768 int4:1:32768:decode_staged_int4:132:16:8:4``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from bench import attention as B
from bench.timing import FLUSH_BYTES, FLUSH_KERNELS, FLUSHES, flush_l2
from kernels.attention import Path, Tiling, Tuning



def parse_spec(spec: str) -> tuple:
    """``(mode, batch, context, Tuning)`` of ``mode:batch:context[:path:segments:tile:warps:stages[:heads[:max_registers]]]``."""
    f = spec.split(":")
    if len(f) not in (3, 8, 9, 10) or f[0] not in B.MODES:
        raise ValueError(f"spec {spec!r}: expected mode:batch:context[:path:segments:tile:warps:stages[:heads[:max_registers]]] "
                         f"with mode one of {sorted(B.MODES)}")
    if len(f) == 3:
        return f[0], int(f[1]), int(f[2]), Tuning()
    path = Path(f[3])
    segs, tile, warps, stages = (int(x) for x in f[4:8])
    heads = int(f[8]) if len(f) > 8 else 0
    max_registers = int(f[9]) if len(f) > 9 else 0
    tiling = Tiling(16, tile, segs, warps, stages, heads_per_program=heads, max_registers=max_registers,
                    mask_edges_only=path == Path.PREFILL_2D)
    return f[0], int(f[1]), int(f[2]), Tuning(path=path, tiling=tiling)


def kernel_events(trace_path: str) -> list:
    """The profiler trace's kernel events, in start order."""
    with open(trace_path) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def split_calls(events: list, flush_kernel: str = FLUSH_KERNELS["read"]) -> list:
    """``[(flush end µs, [kernel events of the call])]``: a call is what follows a flush."""
    calls = []
    for e in events:
        if flush_kernel in e["name"]:
            calls.append((e["ts"] + e["dur"], []))
        elif calls:
            calls[-1][1].append(e)
    return calls


def timeline(mode: str, batch: int, ctx: int, tuning: Tuning, calls: int = 20, flush_kind: str = "read") -> list:
    """Lines describing one spec (see the module docstring)."""
    pb = B.make_problem(B.MODES[mode], batch, ctx, 1, B.FULL, "cuda")
    plan = B.plan_of(pb, tuning)
    err = B.check(pb, tuning)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    tables = pb["tables"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        B.call(pb, tuning, tables[0])
        flush_l2(flush, flush_kind)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            flush_l2(flush, flush_kind)
            B.call(pb, tuning, tables[i % len(tables)])
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        found = split_calls(kernel_events(path), FLUSH_KERNELS[flush_kind])[2:]   # the first calls of a replay start after the host's launch
    finally:
        os.unlink(path)
    count = statistics.mode(len(k) for _, k in found)
    found = [c for c in found if len(c[1]) == count]
    given = " (given)" if tuning.path else ""
    lines = [f"{mode} b{batch} ctx{ctx} {B.describe(plan)}{given} rotate={plan.rotate.value} "
             f"reduce={plan.reduce.value} pdl={plan.pdl} rel. L2 {err:.1e}, {len(found)} calls"]
    for i in range(count):
        first = found[0][1][i]
        durs = [k[i]["dur"] for _, k in found]
        gaps = [k[i]["ts"] - (k[i - 1]["ts"] + k[i - 1]["dur"] if i else end) for end, k in found]
        lines.append(kernel_line(first, statistics.median(durs), statistics.median(gaps)))
    total = [k[-1]["ts"] + k[-1]["dur"] - end for end, k in found]
    lines.append(f"  flush end -> last kernel end: {statistics.median(total):.2f} us")
    return lines


def kernel_line(event: dict, dur_us: float, gap_us: float) -> str:
    """One kernel of a call: name, grid, block, registers per thread, shared memory per block and
    the profiler's estimate of achieved occupancy (from the trace event's args), time and gap."""
    a = event.get("args", {})
    return (f"  {event['name'][:48]:48s} grid {a.get('grid')} block {a.get('block')} "
            f"regs {a.get('registers per thread')} smem {a.get('shared memory')} "
            f"occ {a.get('est. achieved occupancy %')}% {dur_us:8.2f} us, gap {gap_us:6.2f} us")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention_timeline", description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="+", help="mode:batch:context[:path:segments:tile:warps:stages[:heads[:max_registers]]]")
    p.add_argument("--calls", type=int, default=20, help="calls per graph (each after its flush)")
    p.add_argument("--flush", default="read", choices=FLUSHES, help="read the 256 MiB buffer (default) or write it")
    a = p.parse_args(argv)
    try:
        specs = [parse_spec(s) for s in a.specs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.attention_timeline needs a CUDA GPU (the profiler's kernel timeline)", file=sys.stderr)
        return 1
    for mode, batch, ctx, tuning in specs:
        print("\n".join(timeline(mode, batch, ctx, tuning, a.calls, a.flush)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
