"""Run a prefill endpoint over a synthetic quantized cache (or saved blocks), publish transfers, print its endpoint.

For cross-process and cross-node use: start ``kvconnector serve`` on the prefill host, then
pull from any decode host (``kvconnector dump --endpoint ...``, ``kvconnector inspect
--endpoint ...``, or a :class:`kvconnector.DecodeEndpoint`). The first line printed is a JSON
object with the endpoint (the port actually bound), the descriptor, the published transfer
ids and where the cache came from, so a script can read it::

    $ kvconnector serve --host 0.0.0.0 --transfers 4 --blocks-per-transfer 64
    {"endpoint": "tcp://0.0.0.0:41234", "desc": {...}, "transfers": {"t0": [...], ...}, "seed": 0, ...}

The synthetic cache is **synthetic data in a real format**: seeded Gaussian K/V written by the
project's write kernel (:func:`tools.synthetic_cache.written_caches`; on CPU, caches larger
than a few thousand rows use the kernel's PyTorch oracle, said in the output), so the decode
side can rebuild the exact source from the seed and every statistic is a real writer's.
``--fill random`` serves random bytes instead (transfer benchmarks). ``--cache`` serves a
saved cache file, ``--from-dump`` the blocks of a dump file. ``--metrics-port`` serves
Prometheus metrics (docs/DEPLOY.md, "Operations"). The endpoint runs until ``--duration-s`` passes,
stdin closes (``--until-stdin-eof``), or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import torch

from layouts import CacheGeometry, LayoutDescriptor, LayoutError, get_kv_quant_mode

from .argtypes import cache_mode, non_negative_float, port_number, positive_float, positive_int
from .synthetic_cache import WRITERS, describe_writer, random_byte_caches, resolve_writer, written_caches

EXAMPLES = """\
  kvconnector serve                                   # synthetic INT4 cache on a free loopback port
  kvconnector serve --port 5555 --metrics-port 9100   # fixed port; Prometheus at :9100/metrics
  kvconnector serve --from-dump blocks.kvd            # serve the blocks a dump holds
  kvconnector serve --host 0.0.0.0 --mode int8_per_token_head --transfers 4 --duration-s 600
then, on the decode host:
  kvconnector dump --endpoint tcp://HOST:PORT --transfer-id t0 -o t0.kvd
"""

# bench/transfer.py builds its source caches with this name (random bytes: only the bytes matter there)
synthetic_caches = random_byte_caches


def plan_transfers(num_blocks: int, num_transfers: int, blocks_per_transfer: int, seed: int,
                   contiguous: bool = False) -> dict[str, list[int]]:
    """Transfer id -> source block ids: random distinct ids (or consecutive ones), seeded."""
    if not 0 < blocks_per_transfer <= num_blocks:
        raise ValueError(f"--blocks-per-transfer: expected 1..{num_blocks} (num_blocks), got {blocks_per_transfer}")
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for i in range(num_transfers):
        if contiguous:
            start = (i * blocks_per_transfer) % (num_blocks - blocks_per_transfer + 1)
            out[f"t{i}"] = list(range(start, start + blocks_per_transfer))
        else:
            out[f"t{i}"] = torch.randperm(num_blocks, generator=gen)[:blocks_per_transfer].tolist()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--cache", help="saved cache file (kvconnector-cache, all layers) instead of a synthetic one")
    src.add_argument("--from-dump", metavar="FILE",
                     help="serve the blocks of a dump file (it must hold every layer); one transfer, "
                          "named by the dump's transfer id, of the dump's block ids")
    g = p.add_argument_group("synthetic cache (seeded Gaussian K/V written by the write kernel)")
    g.add_argument("--mode", default="int4_per_token_head", type=cache_mode,
                   help="cache mode (--kv-cache-dtype string)")
    g.add_argument("--layers", type=positive_int, default=8)
    g.add_argument("--kv-heads", type=positive_int, default=8)
    g.add_argument("--head-size", type=positive_int, default=128)
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--num-blocks", type=positive_int, default=256)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fill", choices=("kernel", "random"), default="kernel",
                   help="kernel: K/V ~ N(0,1) quantized by the write kernel (default); random: random bytes, "
                        "every bit pattern (for transfer benchmarks; inspect/verify --strict will flag them)")
    g.add_argument("--writer", choices=WRITERS, default="auto",
                   help="auto: the Triton write kernel on CUDA, and on CPU up to 16,384 (token, head) rows "
                        "(Triton's interpreter is slow); larger CPU caches use the kernel's PyTorch oracle")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=port_number, default=0, help="1..65535, or 0 (default): a free port, printed")
    p.add_argument("--transfers", type=positive_int, default=1, help="transfer ids t0..t{N-1} to publish")
    p.add_argument("--blocks-per-transfer", type=positive_int, default=16)
    p.add_argument("--contiguous", action="store_true", help="consecutive source blocks per transfer")
    p.add_argument("--lease-s", type=positive_float, default=3600.0)
    p.add_argument("--chunk-mb", type=positive_float, default=8.0, help="target payload MiB per BLOCKS message")
    p.add_argument("--duration-s", type=non_negative_float, default=0.0,
                   help="stop after this long (0: run until stopped)")
    p.add_argument("--until-stdin-eof", action="store_true", help="stop when stdin closes (for a parent process)")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed); "
                        "needs prometheus-client")


def _load(args) -> tuple[LayoutDescriptor, list, dict | None, str]:
    """(descriptor, per-layer caches, transfers or None to plan them, what the cache is)."""
    if args.cache:
        from .dump import load_cache_file
        desc, by_layer = load_cache_file(args.cache)
        if sorted(by_layer) != list(range(desc.num_layers)):
            raise LayoutError(f"{args.cache}: expected all {desc.num_layers} layers, got {sorted(by_layer)}")
        return desc, [by_layer[i].to(args.device) for i in range(desc.num_layers)], None, f"cache file {args.cache}"
    if args.from_dump:
        from kvconnector.dumpfile import DumpReader
        from .load_dump import load_dump
        with DumpReader(args.from_dump) as r:
            info = r.info
        if info.layers != list(range(info.desc.num_layers)):
            raise LayoutError(f"{args.from_dump}: holds layers {info.layers} of {info.desc.num_layers}; "
                              f"serving needs every layer (dump with --layers all)")
        desc, by_layer = load_dump(args.from_dump, device=args.device)
        return (desc, [by_layer[i] for i in range(desc.num_layers)], {info.tid: list(info.block_ids)},
                f"blocks of dump {args.from_dump}")
    geo = CacheGeometry(get_kv_quant_mode(args.mode), args.head_size, args.kv_heads, args.block_size)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=args.layers, num_blocks=args.num_blocks)
    if args.fill == "random":
        args.writer_used = None
        return desc, random_byte_caches(desc, args.seed, args.device), None, "synthetic: random bytes"
    args.writer_used = resolve_writer(args.writer, desc, args.device)
    caches = written_caches(desc, args.seed, args.device, args.writer_used)
    return desc, caches, None, (f"synthetic: Gaussian K/V (seed {args.seed}) quantized by "
                                f"{describe_writer(args.writer_used)}")


def run(args) -> int:
    from kvconnector import PrefillEndpoint
    from kvconnector.metrics import start_metrics_server

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device")
    args.writer_used = None
    desc, caches, transfers, what = _load(args)
    if transfers is None:
        transfers = plan_transfers(desc.num_blocks, args.transfers, args.blocks_per_transfer, args.seed,
                                   args.contiguous)
    metrics_url = None
    if args.metrics_port is not None:
        port = start_metrics_server(args.metrics_port, args.host)
        metrics_url = f"http://{args.host}:{port}/metrics"
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.until_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    released = []
    with PrefillEndpoint(caches, desc, host=args.host, port=args.port, lease_s=args.lease_s,
                         chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))),
                         on_release=lambda tid, ids, why: released.append((tid, why))) as pre:
        for tid, ids in transfers.items():
            pre.publish(tid, ids)
        synthetic = not (args.cache or args.from_dump)
        print(json.dumps({"endpoint": pre.endpoint, "desc": desc.to_dict(), "transfers": transfers,
                          "seed": args.seed if synthetic else None, "cache": what, "writer": args.writer_used,
                          "metrics": metrics_url}), flush=True)
        print(f"serving {desc.geometry().mode.name} ({what}), {desc.num_layers} layers x {desc.num_blocks} "
              f"blocks, {len(transfers)} transfer(s) on {pre.endpoint}"
              + (f"; metrics at {metrics_url}" if metrics_url else "")
              + "; pull with: kvconnector dump --endpoint " + pre.endpoint
              + f" --transfer-id {next(iter(transfers))} -o out.kvd", flush=True)
        end = time.monotonic() + args.duration_s if args.duration_s > 0 else float("inf")
        while not stop.wait(0.2) and time.monotonic() < end:
            pass
        drain_until = time.monotonic() + 2.0   # pulls still streaming or awaiting their ACK
        while time.monotonic() < drain_until:
            stats = pre.stats()
            if stats["transfers_started"] <= stats["transfers_completed"] + stats["transfers_failed"]:
                break
            time.sleep(0.02)
        stats = pre.stats()
    print(json.dumps({"released": released, "bytes_sent": stats["bytes_sent"],
                      "transfers_completed": stats["transfers_completed"],
                      "failures": stats["failures"], "pulls_total": stats["pulls_total"]}), flush=True)
    return 0
