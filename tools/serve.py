"""Run a prefill endpoint over a synthetic (seeded) or saved cache, publish transfers, print its endpoint.

For cross-process and cross-node use: start ``kvconnector serve`` on the prefill host, then
pull from any decode host (``kvconnector dump --endpoint ...``, or a
:class:`kvconnector.DecodeEndpoint`). The first line printed is a JSON object with the
endpoint, the descriptor and the published transfer ids, so a script can read it::

    $ kvconnector serve --host 0.0.0.0 --transfers 4 --blocks-per-transfer 64
    {"endpoint": "tcp://0.0.0.0:41234", "desc": {...}, "transfers": {"t0": [...], ...}, "seed": 0}

A synthetic cache holds seeded random bytes (every code and scale bit pattern), so the
decode side can rebuild the exact source with :func:`synthetic_caches` and check every byte.
The endpoint runs until ``--duration-s`` passes, stdin closes (``--until-stdin-eof``), or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import torch

from layouts import CacheGeometry, LayoutDescriptor, get_kv_quant_mode


def synthetic_caches(desc: LayoutDescriptor, seed: int, device="cpu") -> list:
    """One packed cache per layer of ``desc`` filled with seeded random bytes.

    Returns
    -------
    list of [num_blocks, 2, block_size, num_kv_heads, P] storage-dtype tensors on ``device``
        The same ``(desc, seed)`` gives the same bytes in every process.
    """
    geo, gen = desc.geometry(), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(desc.num_layers):
        c = geo.new_cache(desc.num_blocks)
        raw = c.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        out.append(c.to(device))
    return out


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
    p.add_argument("--cache", help="saved cache file (kvconnector-cache, all layers) instead of a synthetic one")
    g = p.add_argument_group("synthetic cache")
    g.add_argument("--mode", default="int4_per_token_head", help="cache mode (--kv-cache-dtype string)")
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-size", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="0: a random free port")
    p.add_argument("--transfers", type=int, default=1, help="transfer ids t0..t{N-1} to publish")
    p.add_argument("--blocks-per-transfer", type=int, default=16)
    p.add_argument("--contiguous", action="store_true", help="consecutive source blocks per transfer")
    p.add_argument("--lease-s", type=float, default=3600.0)
    p.add_argument("--chunk-mb", type=float, default=8.0, help="target payload MiB per BLOCKS message")
    p.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: run until stopped)")
    p.add_argument("--until-stdin-eof", action="store_true", help="stop when stdin closes (for a parent process)")


def _load(args) -> tuple[LayoutDescriptor, list]:
    if args.cache:
        from .dump import load_cache_file
        desc, by_layer = load_cache_file(args.cache)
        if sorted(by_layer) != list(range(desc.num_layers)):
            raise ValueError(f"{args.cache}: expected all {desc.num_layers} layers, got {sorted(by_layer)}")
        return desc, [by_layer[i].to(args.device) for i in range(desc.num_layers)]
    geo = CacheGeometry(get_kv_quant_mode(args.mode), args.head_size, args.kv_heads, args.block_size)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=args.layers, num_blocks=args.num_blocks)
    return desc, synthetic_caches(desc, args.seed, args.device)


def run(args) -> int:
    from kvconnector import PrefillEndpoint
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serve: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    try:
        desc, caches = _load(args)
        transfers = plan_transfers(desc.num_blocks, args.transfers, args.blocks_per_transfer, args.seed,
                                   args.contiguous)
    except (ValueError, OSError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.until_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    released = []
    with PrefillEndpoint(caches, desc, host=args.host, port=args.port, lease_s=args.lease_s,
                         chunk_bytes=int(args.chunk_mb * (1 << 20)),
                         on_release=lambda tid, ids, why: released.append((tid, why))) as pre:
        for tid, ids in transfers.items():
            pre.publish(tid, ids)
        print(json.dumps({"endpoint": pre.endpoint, "desc": desc.to_dict(), "transfers": transfers,
                          "seed": None if args.cache else args.seed}), flush=True)
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
                      "failures": stats["failures"]}), flush=True)
    return 0
