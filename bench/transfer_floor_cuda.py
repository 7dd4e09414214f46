"""The floor under ``bench.transfer --cuda``: a pull's bytes from a socket into GPU memory, no protocol.

``python -m bench.transfer --cuda`` compares a pull of CUDA-cache blocks with a plain pyzmq burst
of the same bytes, which ends in host memory. A pull must also put every byte on the decode GPU,
so part of its time is the copy of the last message(s) to the device, after they have arrived.
This probe times only that, in the same process pair and interleaved rounds as the burst, with
nothing else a connector does (no gather, checksums, verify, scatter, handshake, leases or Python
hand-offs between threads): the sender sends pre-filled host memory, as the connector sends a
message it staged at publish, so the prefill GPU's copy to the host is left out too. Kinds:

* ``plain``: ``bench.transfer``'s burst, the ceiling of its ratios: messages of the connector's
  chunk size (``--chunk-mb``, whole blocks), consecutive slices of one buffer, ``copy=False`` on both
  sides; done when the last byte is in host memory.
* ``pinned``: the same messages; the receiver takes each with ``Socket.recv_into`` into a pinned
  buffer of its own (one memcpy inside libzmq, as the connector receives CUDA-cache payloads) and
  queues its copy to the GPU on a side stream at once; done when the last copy has finished.
* ``pageable``: each message received zero copy and copied to the GPU from ZeroMQ's buffer
  (the driver stages a pageable source itself).
* ``pinned-P``: as ``pinned`` with the same bytes cut into messages of about ``P`` MiB, so less
  of the last copy waits behind the wire.
* ``landed-P`` (``--landed``): as ``pinned-P``, then the connector's own integrity and write on the
  GPU for the whole transfer at once: one ``verify_scatter`` (``kernels.transfer``: each layer's
  ``mix64`` checked against the sent bytes' and, only if all match, the blocks scattered into
  random destination blocks of 32 layer caches), done when its verdict is on the host. What a
  pull would cost with one thread, one device copy a message and one verify + scatter a transfer.

``plain / pinned`` and ``plain / pageable`` bound a CUDA-cache pull's ratio on this host from
above; ``landed`` shows how close a pull with its integrity passes can get. Every round checks the
GPU buffer of every device kind (and the destination blocks of ``landed``) byte for byte against
the sent bytes.

Run: ``python -m bench.transfer_floor_cuda [--blocks 16,64,256] [--pieces 1,2] [--landed 1,2]``; rows as
``bench.transfer --cuda`` (32 layers of INT8 / INT4 blocks of 8 KV heads x head_size 128 x 16
tokens: 33 / 17 KiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import numpy as np
import zmq

from bench.transfer_floor import spawn_pair

ROWS = (("int8_per_token_head", 2 * 16 * 8 * 132), ("int4_per_token_head", 2 * 16 * 8 * 68))


def burst_sizes(total: int, block_bytes: int, chunk_bytes: int) -> list:
    """``bench.transfer``'s burst: messages of whole blocks up to ``chunk_bytes``, the rest last."""
    msg = min(total, max(block_bytes, chunk_bytes // block_bytes * block_bytes))
    return [msg] * (total // msg) + ([total % msg] if total % msg else [])


def piece_sizes(total: int, piece_bytes: int) -> list:
    """``total`` bytes in messages of about ``piece_bytes`` (equal but for the last)."""
    n = max(1, round(total / piece_bytes))
    size = -(-total // n)
    return [size] * (total // size) + ([total % size] if total % size else [])


def payload(total: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)


def sender(conn, total: int, endpoint: str) -> None:
    """Spawned: numpy and zmq only. Sends ``sizes`` consecutive slices of one pre-filled buffer."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.connect(endpoint)
    data = payload(total)
    conn.send("ready")
    while True:
        sizes = conn.recv()
        if sizes is None:
            break
        off = 0
        for n in sizes:
            push.send(data[off:off + n], copy=False)
            off += n
    push.close(0)
    ctx.term()


class Landing:
    """``landed`` kinds: ``layers`` destination caches of ``2 x blocks`` blocks (rows of 8 KV heads x
    16 slots, K and V), the sent bytes' per-layer ``mix64`` and the verdict buffer, all on the
    device of ``sent`` ([total] uint8, the bytes the sender sends)."""

    def __init__(self, sent, block_bytes: int, layers: int) -> None:
        import torch
        from kernels.transfer import frame_checksums
        device, total = sent.device, sent.numel()
        self.sent = sent
        self.k = total // layers // block_bytes
        self.frames = [total // layers] * layers
        row_bytes = block_bytes // (2 * 16 * 8)
        self.caches = [torch.zeros(2 * self.k, 2, 16, 8, row_bytes, dtype=torch.uint8, device=device)
                       for _ in range(layers)]
        self.ids = torch.randperm(2 * self.k, generator=torch.Generator().manual_seed(3))[:self.k].to(device)
        self.expected = torch.empty(layers, dtype=torch.int64, device=device)
        frame_checksums(sent, self.expected, frame_nbytes=self.frames)
        self.ok = torch.empty(layers + 1, dtype=torch.int32, device=device)

    def land(self, staging) -> None:
        """Verify every layer of ``staging`` and scatter it (queued on the current stream), then wait
        for the verdict."""
        from kernels.transfer import verify_scatter
        verify_scatter(staging, self.expected, self.caches, self.ids, ok=self.ok, frame_nbytes=self.frames)
        if int(self.ok[-1]) != 0:
            raise RuntimeError(f"landed: {int(self.ok[-1])} of {len(self.caches)} layers failed their checksum")

    def check(self) -> None:
        """Each layer's destination blocks hold that layer's bytes as sent."""
        import torch
        want = self.sent.view(len(self.caches), self.k, -1)
        for la, cache in enumerate(self.caches):
            if not torch.equal(cache[self.ids].reshape(self.k, -1), want[la]):
                raise RuntimeError(f"landed: layer {la}'s destination blocks differ from the bytes sent")


def receive(kind: str, pull, sizes: list, dst, host, stream, landing=None) -> None:
    """Receive one transfer of ``sizes`` messages as ``kind`` does; returns when its last byte is in
    host memory (``plain``), on the GPU, or (``landed``) verified and scattered into the caches."""
    import torch
    on_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
    off = 0
    for i, n in enumerate(sizes):
        if not pull.poll(60000):
            raise TimeoutError(f"{kind}: no message within 60 s")
        if kind == "plain":
            got = len(pull.recv(copy=False))
        elif kind == "pageable":
            frame = pull.recv(copy=False)
            got = len(frame)
            with on_stream:   # a pageable source: the copy returns when the host bytes are read
                dst[off:off + got].copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8), non_blocking=True)
        else:
            got = pull.recv_into(host[off:off + n].numpy())
            with on_stream:
                dst[off:off + got].copy_(host[off:off + got], non_blocking=True)
        if got != n:
            raise RuntimeError(f"{kind}: message {i} has {got} bytes, expected {n}")
        off += n
    if kind.startswith("landed"):
        with on_stream:
            landing.land(dst)
    elif kind != "plain" and stream is not None:
        stream.synchronize()


def run_row(total: int, block_bytes: int, args) -> dict:
    """Spawn a sender; ``args.rounds`` rounds, each every kind once (order alternating); medians (s)."""
    import torch
    native = burst_sizes(total, block_bytes, int(args.chunk_mb * (1 << 20)))
    kinds = {"plain": native, "pinned": native, "pageable": native}
    for p in args.pieces:
        kinds[f"pinned-{p:g}"] = piece_sizes(total, int(p * (1 << 20)))
    for p in args.landed:
        kinds[f"landed-{p:g}"] = piece_sizes(total, int(p * (1 << 20)))
    ctx, pull, conn, proc = spawn_pair(sender, total)
    cuda = args.device == "cuda"
    dst = torch.empty(total, dtype=torch.uint8, device=args.device)
    host = torch.empty(total, dtype=torch.uint8)   # each message received into its own slice
    host = host.pin_memory() if cuda else host
    stream = torch.cuda.Stream() if cuda else None
    want = torch.from_numpy(payload(total)).to(args.device)
    landing = Landing(want, block_bytes, args.layers) if args.landed else None
    t = {k: [] for k in kinds}
    names = list(kinds)
    try:
        for rnd in range(args.rounds):
            for kind in (names if rnd % 2 else names[::-1]):
                dst.zero_()
                if landing is not None and kind.startswith("landed"):
                    for c in landing.caches:
                        c.zero_()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                conn.send(kinds[kind])
                receive(kind, pull, kinds[kind], dst, host, stream, landing)
                dt = time.perf_counter() - t0
                if rnd:
                    t[kind].append(dt)
                if kind != "plain" and not torch.equal(dst, want):
                    raise RuntimeError(f"round {rnd} {kind}: the GPU buffer differs from the bytes sent")
                if kind.startswith("landed"):
                    landing.check()
    finally:
        conn.send(None)
        proc.join(30)
        pull.close(0)
        ctx.term()
    return {k: statistics.median(v) for k, v in t.items()} | {"msgs": {k: len(s) for k, s in kinds.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", default="16,64,256", help="comma-separated blocks per layer moved per transfer")
    ap.add_argument("--modes", default="int8_per_token_head,int4_per_token_head")
    ap.add_argument("--chunk-mb", type=float, default=8.0, help="the burst's message size, as bench.transfer")
    ap.add_argument("--pieces", default="1,2", help="comma-separated MiB: pinned kinds cut into messages this size")
    ap.add_argument("--landed", default="", help="comma-separated MiB: landed kinds (verify + scatter) in messages "
                    "this size")
    ap.add_argument("--rounds", type=int, default=10, help="rounds (the first is a warm-up)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a CPU tensor as the destination (unpinned buffers; a smoke test of the probe)")
    args = ap.parse_args()
    args.pieces = [float(p) for p in args.pieces.split(",") if p]
    args.landed = [float(p) for p in args.landed.split(",") if p]
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.transfer_floor_cuda: no CUDA device (--device cpu runs the probe's steps on the CPU)")
    rows = dict(ROWS)
    modes = args.modes.split(",")
    for m in modes:
        if m not in rows:
            raise SystemExit(f"bench.transfer_floor_cuda: unknown mode {m!r} (known: {', '.join(rows)})")
    kinds = ["pinned", "pageable"] + [f"pinned-{p:g}" for p in args.pieces] + [f"landed-{p:g}" for p in args.landed]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU destination"
    print(f"# bench.transfer_floor_cuda: {os.cpu_count()} cores, {where}, "
          f"pyzmq {zmq.__version__}, {args.layers} layers, median of {args.rounds - 1} rounds (+1 warm-up), "
          f"kinds interleaved; ms (plain / kind)", flush=True)
    print("| mode | blocks | MiB | plain ms (msgs) | " + " | ".join(kinds) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(kinds))
    for m in modes:
        for nb in map(int, args.blocks.split(",")):
            total = args.layers * nb * rows[m]
            r = run_row(total, rows[m], args)
            cells = [f"{r[k] * 1e3:.2f} ({r['plain'] / r[k]:.2f}, {r['msgs'][k]} msgs)" for k in kinds]
            print(f"| {m} | {nb} | {total / (1 << 20):.1f} | {r['plain'] * 1e3:.2f} ({r['msgs']['plain']}) | "
                  + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
