"""The floor under ``bench.transfer``: the mandatory passes over the payload, with no protocol.

``python -m bench.transfer`` compares a connector pull with a plain pyzmq burst of the same
bytes. This probe answers how close any connector could get on this host: it runs only the work
the connector's integrity rules require of every transfer of scattered CPU-cache blocks
(gather, a checksum on each side, verify before write, then write; see docs/PROTOCOL.md), with
no protocol, leases, handshake or endpoint objects, timed in the same process pair and the same
rounds as the plain burst. Three kinds, interleaved:

* ``plain``:  the sender pushes ``messages`` x ``chunk`` bytes, consecutive slices of one
  pre-filled buffer of them all (distinct bytes, ``copy=False``); the receiver takes them
  (``copy=False``). The benchmark's baseline.
* ``copies``: the sender gathers each message's blocks from a source cache (random block ids,
  ``np.take`` into a pre-faulted buffer) and sends it; the receiver scatters each message into a
  destination cache (random ids, one fancy-index row assignment). No checksums: what the gather
  and the write cost alone.
* ``floor``:  as ``copies``, plus xxh3_64 on both sides as the connector does it: the sender hashes
  each 512 KiB piece right after gathering it (while it is in cache), the receiver hashes the
  whole message and only then writes it (verify before write).

Both sides run those passes on as many threads as the connector's stage threads and copy
workers (:func:`threads`: one per four cores, at most four, none on hosts with at most 4 cores,
where they run inline; numpy and xxhash release the GIL), so they overlap the socket. Every
round checks the last ``floor`` transfer's destination rows byte for byte against the source.

``floor / plain`` is a measured upper bound for the connector's ratio on this host (the
connector adds its protocol on top). The sending side is a spawned process that imports only
numpy, xxhash and zmq.

Run: ``python -m bench.transfer_floor [--contiguous]``; block sizes default to bf16 / INT8 /
INT4 blocks of 8 KV heads x head_size 128 x 16 tokens (64 / 33 / 17 KiB).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
import zmq

PIECE = 512 << 10
KINDS = ("plain", "copies", "floor")


def threads() -> int:
    """Worker threads per side: ``kvconnector.sender.stage_threads`` and
    ``kvconnector.decode.default_copy_threads``'s rule, written out so the probe's processes do not
    import torch."""
    cores = os.cpu_count() or 1
    return 0 if cores <= 4 else min(4, cores // 4)


def messages(args) -> list:
    """The transfer's messages: ``(layer, first block, blocks)``, one layer each, at most
    ``chunk_mib`` MiB (both processes make the same list)."""
    per_msg = args.chunk_mib * 1024 // args.block_kib
    return [(la, p, min(per_msg, args.blocks - p)) for la in range(args.layers) for p in range(0, args.blocks, per_msg)]


def pool(n: int) -> ThreadPoolExecutor | None:
    return ThreadPoolExecutor(n) if n else None


def caches(seed: int, layers: int, num_blocks: int, block_bytes: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(layers)]


def plan(args, rnd: int):
    """Per round: source and destination block ids (random permutations of half the cache)."""
    rng = np.random.default_rng(1000 + rnd)
    nb = args.blocks
    src = np.arange(nb) if args.contiguous else rng.permutation(2 * nb)[:nb]
    return src, rng.permutation(2 * nb)[:nb]


def gather(src_rows, ids, buf, hashed: bool) -> int:
    """Gather rows ``ids`` into ``buf`` (piece by piece); xxh3_64 of the pieces while hot.
    ``buf`` None: the rows are consecutive and sent from the cache itself (hash them there)."""
    k = len(ids)
    if buf is None:
        return xxhash.xxh3_64_intdigest(src_rows[ids[0]:ids[0] + k]) if hashed else 0
    out = buf.reshape(k, -1)
    step = max(1, PIECE // out.shape[1])
    h = xxhash.xxh3_64() if hashed else None
    for i in range(0, k, step):
        np.take(src_rows, ids[i:i + step], axis=0, out=out[i:i + step], mode="clip")
        if h is not None:
            h.update(out[i:i + step])
    return h.intdigest() if h is not None else 0


def sender(conn, args, endpoint: str) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.connect(endpoint)
    src = caches(1, args.layers, 2 * args.blocks, args.block_kib << 10)
    msgs = messages(args)
    bufs = [None if args.contiguous else np.ones(k * (args.block_kib << 10), np.uint8) for *_, k in msgs]
    plain = np.ones(sum(k for *_, k in msgs) * (args.block_kib << 10), np.uint8)
    ex = pool(threads())
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        kind, rnd = cmd
        if kind == "plain":
            off = 0
            for *_, k in msgs:
                n = k * (args.block_kib << 10)
                push.send(plain[off:off + n], copy=False)
                off += n
            continue
        src_ids, _ = plan(args, rnd)
        hashed = kind == "floor"
        jobs: deque = deque()
        todo = deque(enumerate(msgs))
        ahead = 1 + threads()
        while todo or jobs:
            while todo and len(jobs) < ahead:
                i, (la, p, k) = todo.popleft()
                a = (src[la], src_ids[p:p + k], bufs[i], hashed)
                jobs.append((i, ex.submit(gather, *a) if ex and jobs else a))
            i, job = jobs.popleft()
            digest = gather(*job) if isinstance(job, tuple) else job.result()
            la, p, k = msgs[i]
            data = bufs[i] if bufs[i] is not None else src[la][src_ids[p]:src_ids[p] + k]   # zero copy
            push.send_multipart([np.array([digest, i], np.uint64), data], copy=False)
    push.close(0)
    ctx.term()


def write(dst_rows, ids, frame, digest: int, hashed: bool) -> None:
    data = np.frombuffer(frame, np.uint8)
    if hashed and xxhash.xxh3_64_intdigest(data) != digest:
        raise RuntimeError("checksum mismatch")
    dst_rows[ids] = data.reshape(len(ids), -1)


ROWS = ((64, "auto (bf16)"), (33, "int8_per_token_head"), (17, "int4_per_token_head"))


def spawn_pair(target, arg):
    """A PULL socket bound on loopback and a spawned sender process running ``target(conn, arg,
    endpoint)`` that has answered "ready": ``(ctx, pull, conn, proc)``."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, 1000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    mpc = mp.get_context("spawn")
    conn, child = mpc.Pipe()
    proc = mpc.Process(target=target, args=(child, arg, f"tcp://127.0.0.1:{port}"), daemon=True)
    proc.start()
    conn.recv()
    return ctx, pull, conn, proc


def run_row(args) -> dict:
    """One row: spawn a sender, time ``rounds`` interleaved rounds; medians in seconds."""
    ctx, pull, conn, proc = spawn_pair(sender, args)
    dst = caches(2, args.layers, 2 * args.blocks, args.block_kib << 10)
    src = caches(1, args.layers, 2 * args.blocks, args.block_kib << 10)
    msgs = messages(args)
    ex = pool(threads())
    t = {k: [] for k in KINDS}
    try:
        for rnd in range(args.rounds):
            for kind in (KINDS if rnd % 2 else KINDS[::-1]):
                _, dst_ids = plan(args, rnd)
                t0 = time.perf_counter()
                conn.send((kind, rnd))
                futs = []
                for _ in msgs:
                    if not pull.poll(60000):
                        raise TimeoutError(f"{kind}: no message within 60 s")
                    if kind == "plain":
                        pull.recv(copy=False)
                        continue
                    head, frame = pull.recv_multipart(copy=False)
                    digest, i = np.frombuffer(head.buffer, np.uint64)
                    la, p, k = msgs[int(i)]
                    a = (dst[la], dst_ids[p:p + k], frame.buffer, int(digest), kind == "floor")
                    if ex is not None:
                        futs.append(ex.submit(write, *a))
                    else:
                        write(*a)
                for f in futs:
                    f.result()
                dt = time.perf_counter() - t0
                if rnd:
                    t[kind].append(dt)
                if kind == "floor":   # the destination holds exactly the source's rows
                    src_ids, _ = plan(args, rnd)
                    for la in range(args.layers):
                        if not np.array_equal(dst[la][dst_ids], src[la][src_ids]):
                            raise RuntimeError(f"round {rnd} layer {la}: destination differs from source")
    finally:
        conn.send(("exit",))
        proc.join(30)
        pull.close(0)
        ctx.term()
        if ex is not None:
            ex.shutdown()
    return {k: statistics.median(v) for k, v in t.items()} | {"msgs": len(msgs), "rounds": t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", default="16,64,256", help="comma-separated blocks per layer moved per transfer")
    ap.add_argument("--block-kib", default="64,33,17", help="comma-separated block sizes: 64, 33, 17 KiB are "
                    "bf16 / INT8 / INT4 blocks of 8 KV heads, head_size 128, 16 tokens")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--contiguous", action="store_true", help="consecutive source blocks, sent from the "
                    "cache without a gather (the connector's zero-copy case)")
    args = ap.parse_args()
    names = dict(ROWS)
    print(f"# bench.transfer_floor: {os.cpu_count()} cores, worker threads per side {threads()}, "
          f"{'contiguous' if args.contiguous else 'scattered'} source blocks, {args.layers} layers, one layer "
          f"per message of <= {args.chunk_mib} MiB, median of {args.rounds - 1} rounds (+1 warm-up), "
          f"kinds interleaved", flush=True)
    print("| block | blocks | MiB | msgs | plain ms | copies ms | floor ms | copies / plain | floor / plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for kib in map(int, args.block_kib.split(",")):
        for nb in map(int, args.blocks.split(",")):
            row = run_row(argparse.Namespace(**{**vars(args), "block_kib": kib, "blocks": nb}))
            ratios.append(row["plain"] / row["floor"])
            mib = args.layers * nb * kib / 1024
            print(f"| {kib} KiB ({names.get(kib, '?')}) | {nb} | {mib:.1f} | {row['msgs']} | "
                  f"{row['plain'] * 1e3:.2f} | {row['copies'] * 1e3:.2f} | {row['floor'] * 1e3:.2f} | "
                  f"{row['plain'] / row['copies']:.2f} | {ratios[-1]:.2f} |", flush=True)
    print(f"# floor / plain: median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
