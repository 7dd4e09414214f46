"""Benchmark connector block transfer against plain pyzmq zero-copy PUSH/PULL on loopback."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import zmq

from kvconnector import DecodeEndpoint, PrefillEndpoint
from layouts import CacheGeometry, LayoutDescriptor, get_kv_quant_mode

MODES = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated cache modes")
    p.add_argument("--blocks", default="16,64,256", help="comma-separated blocks per transfer")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="transfers timed per row (median reported)")
    p.add_argument("--chunk-mb", type=float, default=8.0, help="target payload MiB per message")
    p.add_argument("--contiguous", action="store_true", help="publish consecutive source blocks "
                   "(zero-copy send) instead of a random permutation (gather copy)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (caches on the GPU, pinned host staging)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (CI)")


def _caches(geo, desc, device, gen):
    out = []
    for _ in range(desc.num_layers):
        c = geo.new_cache(desc.num_blocks)
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        out.append(c.to(device))
    return out


def bench_connector(geo, layers, nblocks, repeats, chunk_bytes, contiguous, device, gen):
    """Median seconds of one whole pull (publish -> result) and bytes moved; checks bytes once."""
    desc = LayoutDescriptor.from_geometry(geo, num_layers=layers, num_blocks=2 * nblocks)
    src, dst = _caches(geo, desc, device, gen), _caches(geo, desc, device, gen)
    times, nbytes = [], 0
    with PrefillEndpoint(src, desc, chunk_bytes=chunk_bytes) as pre, DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint)
        for r in range(repeats + 1):                   # first round is warm-up
            ids = list(range(nblocks)) if contiguous else torch.randperm(2 * nblocks, generator=gen)[:nblocks].tolist()
            dst_ids = torch.randperm(2 * nblocks, generator=gen)[:nblocks].tolist()
            t0 = time.perf_counter()
            pre.publish(f"t{r}", ids)
            res = dec.pull(f"t{r}", dst_ids, deadline_s=60).result()
            if device != "cpu":
                torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
            nbytes = res.nbytes
            if r == repeats:
                for s, d in zip(src, dst):
                    if not torch.equal(s[ids].view(torch.uint8).cpu(), d[dst_ids].view(torch.uint8).cpu()):
                        raise RuntimeError("transferred blocks differ from the source")
        stats = dec.stats()
    return statistics.median(times), nbytes, stats


def bench_pyzmq(total_bytes, msg_bytes, repeats):
    """Median seconds to move ``total_bytes`` in ``msg_bytes`` zero-copy messages, PUSH -> PULL."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    buf = torch.randint(0, 256, (msg_bytes,), dtype=torch.uint8).numpy()
    sizes = [msg_bytes] * (total_bytes // msg_bytes) + ([total_bytes % msg_bytes] if total_bytes % msg_bytes else [])
    times = []
    try:
        for r in range(repeats + 1):
            def send():
                for n in sizes:
                    push.send(buf[:n], copy=False)
            th = threading.Thread(target=send)
            t0 = time.perf_counter()
            th.start()
            got = 0
            for _ in sizes:
                got += len(pull.recv(copy=False))
            th.join()
            if r:
                times.append(time.perf_counter() - t0)
            assert got == total_bytes
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
    return statistics.median(times)


def run(args) -> int:
    if args.quick:
        args.modes, args.blocks, args.layers, args.repeats = "auto,int4_per_token_head", "4,16", 2, 2
        args.kv_heads, args.head_size = 2, 64
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device")
        return 2
    gen = torch.Generator().manual_seed(0)
    chunk = int(args.chunk_mb * (1 << 20))
    order = "contiguous" if args.contiguous else "scattered"
    print(f"# bench-transfer: device={device} layers={args.layers} kv_heads={args.kv_heads} "
          f"head_size={args.head_size} block_size={args.block_size} src blocks {order} "
          f"chunk={args.chunk_mb} MiB, median of {args.repeats}")
    print("| mode | blocks | MiB | connector ms | connector GB/s | pyzmq ms | pyzmq GB/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for mode_str in args.modes.split(","):
        geo = CacheGeometry(get_kv_quant_mode(mode_str), args.head_size, args.kv_heads, args.block_size)
        for nblocks in (int(b) for b in args.blocks.split(",")):
            t_c, nbytes, _ = bench_connector(geo, args.layers, nblocks, args.repeats, chunk,
                                             args.contiguous, device, gen)
            per_layer = nbytes // args.layers
            msg = min(per_layer, max(geo.block_bytes, chunk // geo.block_bytes * geo.block_bytes))
            t_z = bench_pyzmq(nbytes, msg, args.repeats)
            ratios.append(t_z / t_c)
            print(f"| {mode_str} | {nblocks} | {nbytes / 2**20:.1f} | {t_c * 1e3:.2f} | {nbytes / t_c / 1e9:.2f} "
                  f"| {t_z * 1e3:.2f} | {nbytes / t_z / 1e9:.2f} | {t_z / t_c:.2f} |", flush=True)
    print(f"# ratio connector/pyzmq: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}")
    return 0
