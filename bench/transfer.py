"""Benchmark connector block transfer against plain pyzmq zero-copy PUSH/PULL on loopback.

Both columns move the same bytes in the same run, and by default the sending side of both
runs in a separate (spawned) process, as in a deployment: the prefill endpoint for the
connector, the PUSH socket for pyzmq; this process is the decode endpoint / the PULL socket.
``--in-process`` runs the sender on a thread of this process instead (one GIL for both).

Connector: one whole pull (PULL -> BLOCKS with xxh3_64 per frame -> verify -> scatter into the
decode cache -> ACK -> result), source blocks a random permutation (``--contiguous``:
consecutive), destination blocks a random permutation; the last pull of every row is checked
byte for byte against the source (rebuilt here from the same seed). pyzmq: the same total bytes
in messages of the connector's chunk size, sent ``copy=False`` as consecutive slices of one
pre-filled buffer of the whole payload (distinct bytes, as the connector sends), received
``copy=False``; timed from the "go" signal to the last byte received. A second burst re-sends
the first message's bytes every time (one buffer that stays in the CPU caches): the socket's
best case, reported beside it; the two bursts alternate which goes first.

``--kernels``: both endpoints get the device kernels (``kernels.transfer.FRAME_OPS``) and
negotiate ``mix64``: the prefill gathers and checksums on the device, the decode side receives
each payload into pinned memory (``recv_into``, the default for CUDA caches; ``--no-recv-into``:
zero copy, then copied into pinned memory by the landing thread or the copy workers), and the
device verifies + scatters (on CPU caches the kernels run in
Triton's interpreter: only a functional check). ``--cuda`` is the CUDA-cache preset: INT8 and
INT4, 16 / 64 / 256 blocks x a Llama-8B-shaped layer set (32 layers, 8 KV heads, head size 128,
block size 16), caches on the GPU, ``--kernels``. CPU columns are the host CPU time of both
processes per MiB moved.

``--threads``: also where the host CPU time of the connector's pulls goes, per thread of both
processes (the endpoints' I/O threads, copy and staging workers, the decode side's landing
thread, ZeroMQ's I/O threads, CUDA's and PyTorch's own threads), from
``/proc/self/task/*/schedstat`` (Linux), in CPU ms per MiB; and where the wall time of one pull
goes, per stage (``PrefillEndpoint.stage_times`` / ``DecodeEndpoint.stage_times``, ms per pull):
prefill I/O thread staging (gather + device-to-host copies queued), waiting for a message's
bytes in host memory, handing it to ZeroMQ; decode I/O thread receiving and checking messages,
and on its landing thread the host copy into pinned memory, queuing the device copies and
kernels, the CPU time that thread used in both (the rest of their wall time it was blocked: on
the copies, the GIL, the driver), and waiting for the device.

``--layerwise-tokens N``: the exposed time of a layer-wise pull of an N-token request (INT4,
the same layer set): the decode side pulls while the prefill announces one layer every
``--layer-ms`` (``publish(..., layers_ready=0)`` then ``publish_layers``, standing in for the
forward writing each layer); exposed = from the last layer announced to the last block landed.
For comparison the same pull with every layer announced at once (no layer-wise overlap).
``--cuda`` measures it for 32k tokens.

``--chunk-mb 1,2,8``: the connector's message size, one row per size (each shape's sizes one
after another, each with its own bursts: of its own size, or ``--burst-mb``), so message sizes
are compared in one run; the layer-wise measurement runs at each size too.

``--prestage-mb``: a row publishes all of its transfers before its first pull, as a serving
engine publishes a prompt's blocks before the decode worker's pull arrives; with ``--kernels``
the prefill endpoint then stages each transfer's first message at publish (up to this many MiB
of them; 0: staged at the pull).

``--trace DIR``: the last timed pull of each row as a Chrome trace (``chrome://tracing``,
Perfetto) of both processes' per-message spans on one clock (:mod:`kvconnector.trace`):
where each message waited, on which thread.

Run: ``python -m bench.transfer [--device cuda] [--contiguous] [--kernels] [--cuda] [--threads]``
(also ``kvconnector bench-transfer``); ``--quick`` is the smoke test CI runs (also with
``--kernels --threads``). The floor any connector could reach on the same host (the mandatory
gather, checksum and write passes with no protocol) is ``python -m bench.transfer_floor``. Results: docs/BENCHMARKS.md, "Transfer".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import torch
import zmq

from bench.transfer_floor_cuda import burst_sizes
from kvconnector.trace import write_chrome
from layouts import CacheGeometry, LayoutDescriptor, get_kv_quant_mode
from tools.argtypes import positive_float_list, positive_int

MODES = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None, help="comma-separated cache modes (default: every mode; --cuda: "
                   "int8_per_token_head,int4_per_token_head)")
    p.add_argument("--blocks", default="16,64,256", help="comma-separated blocks per transfer")
    p.add_argument("--layers", type=int, default=None, help="default 8 (--cuda: 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="default 8")
    p.add_argument("--head-size", type=int, default=None, help="default 128")
    p.add_argument("--block-size", type=int, default=None, help="default 16")
    p.add_argument("--repeats", type=int, default=7, help="transfers timed per row (median reported)")
    p.add_argument("--chunk-mb", type=positive_float_list, default=[8.0], help="target payload MiB per message of the "
                   "connector; comma-separated: one row per size, each shape's sizes one after another")
    p.add_argument("--burst-mb", type=float, default=None, help="MiB per message of the pyzmq bursts (default: "
                   "--chunk-mb), so a connector at small messages is compared with the burst at any size")
    p.add_argument("--lanes", type=positive_int, default=None, help="connections the connector's BLOCKS travel "
                   "over (default: the endpoints', kvconnector.decode.default_lanes)")
    p.add_argument("--burst-lanes", type=positive_int, default=1, help="also time a pyzmq burst dealt over this many "
                   "connections (each on a ZeroMQ I/O thread of its own), in the same rounds: the ceiling of lanes")
    p.add_argument("--contiguous", action="store_true", help="publish consecutive source blocks "
                   "(zero-copy send) instead of a random permutation (gather copy)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (caches on the GPU, pinned host staging)")
    p.add_argument("--in-process", action="store_true", help="sender on a thread of this process "
                   "(one GIL) instead of a spawned process")
    p.add_argument("--data-plane", default="zmq", choices=("zmq", "nixl"), help="payload path of the connector: "
                   "ZeroMQ frames, or NIXL writes into the decode side's registered region (pip install nixl)")
    p.add_argument("--kernels", action="store_true", help="device kernels on both ends (mix64, gather / "
                   "verify + scatter on the device, the decode side's landing thread)")
    p.add_argument("--cuda", action="store_true", help="CUDA-cache preset: int8_per_token_head + "
                   "int4_per_token_head, 16/64/256 blocks x 32 layers, 8 KV heads, head size 128, block size 16, "
                   "caches on the GPU, --kernels (shape options given on the command line are kept)")
    p.add_argument("--layerwise-tokens", type=int, default=None, help="also measure the exposed time of a layer-wise "
                   "INT4 pull of this many tokens (0: off, the default; --cuda: 32768 unless given)")
    p.add_argument("--layer-ms", type=float, default=40.0, help="time between layer announcements in the "
                   "layer-wise measurement (about one layer of a 32k-token Llama-8B prefill on one H200)")
    p.add_argument("--recv-into", action=argparse.BooleanOptionalAction, default=None,
                   help="--kernels: the decode side's I/O thread receives payload frames straight into pinned memory "
                   "with Socket.recv_into (--no-recv-into: zero copy, copied into pinned memory by the copy workers; "
                   "default: the endpoint's, recv_into for CUDA caches)")
    p.add_argument("--prestage-mb", type=float, default=None, help="--kernels: MiB of first messages the prefill "
                   "endpoint stages at publish, before their pulls (0: off; default: the endpoint's, "
                   "PRESTAGE_BYTES for CUDA caches, 0 for CPU caches); the row's transfers are all published "
                   "before its first pull")
    p.add_argument("--threads", action="store_true", help="also print the connector pulls' host CPU time per "
                   "thread of both processes (Linux /proc)")
    p.add_argument("--trace", metavar="DIR", help="write the last timed pull of each row as a Chrome trace of both "
                   "processes' per-message spans (kvconnector.trace) to DIR/<mode>-<blocks>[-<chunk>mib].json")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (CI)")


def thread_cpu() -> dict:
    """CPU seconds used so far by each thread group of this process: Python threads by name,
    others (ZeroMQ, CUDA, OpenMP) by their OS name, trailing numbers dropped so pools add up.
    Read from ``/proc/self/task/<tid>/schedstat`` (ns on CPU); empty where that is missing."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue   # the thread ended meanwhile, or no schedstat on this kernel
        name = names.get(int(tid), comm).rstrip("0123456789").rstrip("_/-") or comm
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


# ---- the sending side (a spawned process, or a thread with --in-process) ------------------
def _sender(conn) -> None:
    """Serve rows from ``conn`` until ("exit",): a prefill endpoint and a PUSH socket per row."""
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        if cmd[0] == "layerwise":
            _serve_layerwise(conn, *cmd[1:])
        else:
            _serve_row(conn, *cmd[1:])


def _serve_layerwise(conn, desc_dict, seed, device, chunk_bytes, ids, kernels, lanes=None) -> None:
    """Layer-wise rows: ("publish", tid) publishes with no layer written; ("layers", tid, step_s,
    at_once) announces the layers (one every ``step_s``, or all at once after ``num_layers·step_s``)
    and answers the monotonic time of the last announcement; "done" ends."""
    from kvconnector import PrefillEndpoint
    from tools.serve import synthetic_caches
    desc = LayoutDescriptor.from_dict(desc_dict)
    with PrefillEndpoint(synthetic_caches(desc, seed, device), desc, chunk_bytes=chunk_bytes, lease_s=600,
                         frame_ops=_frame_ops(kernels),
                         **_lanes_kw(lanes, prefill=True)) as pre:
        conn.send(pre.endpoint)
        while True:
            cmd = conn.recv()
            if cmd == "done":
                break
            if cmd[0] == "publish":
                pre.publish(cmd[1], ids, layers_ready=0)
                conn.send("ok")
                continue
            _, tid, step_s, at_once = cmd
            t_next = time.monotonic()
            for layer in range(1, desc.num_layers + 1):
                t_next += step_s
                while time.monotonic() < t_next:        # the forward computing this layer
                    time.sleep(max(0.0, min(0.002, t_next - time.monotonic())))
                if not at_once or layer == desc.num_layers:
                    pre.publish_layers(tid, layer)
            conn.send(time.monotonic())
    conn.send("closed")


def _lanes_kw(lanes: int | None, prefill: bool = False) -> dict:
    """An endpoint's ``lanes`` keyword for ``--lanes`` (none given: the endpoint's default); a prefill
    grants at least its default, so the decode side's count decides."""
    if lanes is None:
        return {}
    from kvconnector.prefill import LANES
    return {"lanes": max(lanes, LANES) if prefill else lanes}


def _frame_ops(kernels: bool):
    if not kernels:
        return None
    from kernels.transfer import FRAME_OPS
    return FRAME_OPS


def _serve_row(conn, desc_dict, seed, device, chunk_bytes, transfers, push_endpoints, sizes, kernels=False,
               plane="zmq", prestage_bytes=None, lanes=None) -> None:
    """One row: a prefill endpoint that publishes ``transfers`` when asked ("publish": once the decode
    side has connected), a PUSH socket connected to each of ``push_endpoints``; it answers "cpu"
    with this process's CPU seconds, "go" with one burst of
    ``sizes`` messages (consecutive slices of one buffer of their total) on the first socket,
    "go_hot" with the same burst re-sending the first slice, and "go_lanes" with the "go" burst
    dealt over every socket in turn (one TCP connection each, on ZeroMQ I/O threads of their own)."""
    from kvconnector import PrefillEndpoint
    from tools.serve import synthetic_caches
    desc = LayoutDescriptor.from_dict(desc_dict)
    ctx = zmq.Context(io_threads=len(push_endpoints))
    pushes = []
    for endpoint in push_endpoints:
        pushes.append(ctx.socket(zmq.PUSH))
        pushes[-1].setsockopt(zmq.LINGER, 0)
        pushes[-1].connect(endpoint)
    push = pushes[0]
    buf = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8).numpy()
    with PrefillEndpoint(synthetic_caches(desc, seed, device), desc, chunk_bytes=chunk_bytes, lease_s=600,
                         frame_ops=_frame_ops(kernels), data_plane=plane, prestage_bytes=prestage_bytes,
                         **_lanes_kw(lanes, prefill=True)) as pre:
        conn.send(pre.endpoint)
        while True:
            cmd = conn.recv()
            if cmd == "publish":     # once the decode side is connected, as a serving engine's workers are
                for tid, ids in transfers:
                    pre.publish(tid, ids)
                conn.send(True)
            elif cmd == "go":
                off = 0
                for n in sizes:
                    push.send(buf[off:off + n], copy=False)
                    off += n
            elif cmd == "go_hot":
                for n in sizes:
                    push.send(buf[:n], copy=False)
            elif cmd == "go_lanes":
                off = 0
                for i, n in enumerate(sizes):
                    pushes[i % len(pushes)].send(buf[off:off + n], copy=False)
                    off += n
            elif cmd == "cpu":
                conn.send(time.process_time())
            elif cmd == "threads":
                conn.send(thread_cpu())
            elif cmd == "stages":
                conn.send(pre.stage_times())
            elif cmd == "trace_on":
                pre.trace.enabled = True
                conn.send(True)
            elif cmd == "trace_take":
                pre.trace.enabled = False
                conn.send(pre.trace.take())
            else:                                    # "done"
                break
    for s in pushes:
        s.close(0)
    ctx.term()
    conn.send("closed")


class Sender:
    """The sending side: a spawned process, or a thread when ``in_process``."""

    def __init__(self, in_process: bool) -> None:
        self.in_process = in_process
        if in_process:
            self.conn, child = mp.Pipe()
            self._worker = threading.Thread(target=_sender, args=(child,), daemon=True)
        else:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self._worker = ctx.Process(target=_sender, args=(child,), daemon=True)
        self._worker.start()

    def ask(self, *cmd, timeout_s: float = 300.0):
        self.conn.send(cmd[0] if len(cmd) == 1 else cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"sender did not answer {cmd[0]!r} within {timeout_s} s")
        return self.conn.recv()

    def cpu_s(self) -> float:
        """CPU seconds used so far by both sides (one number when they share a process)."""
        mine = time.process_time()
        return mine if self.in_process else mine + self.ask("cpu")

    def threads(self) -> tuple[dict, dict]:
        """(this process's, the sender's) CPU seconds per thread group (:func:`thread_cpu`)."""
        return thread_cpu(), ({} if self.in_process else self.ask("threads"))

    def stages(self) -> dict:
        """The prefill endpoint's :meth:`~kvconnector.PrefillEndpoint.stage_times` so far."""
        return self.ask("stages")

    def close(self) -> None:
        self.conn.send(("exit",))
        self._worker.join(30)


# ---- the receiving side (this process) ----------------------------------------------------
def _burst(sender, pulls, sizes, total: int, cmd: str) -> float:
    """Ask the sender for one pyzmq burst (``cmd``: "go" or "go_hot" on the first of ``pulls``,
    "go_lanes" over all of them) and receive it; seconds from the request to its last byte in."""
    poller = zmq.Poller()
    for p in pulls if cmd == "go_lanes" else pulls[:1]:
        poller.register(p, zmq.POLLIN)
    t0 = time.perf_counter()
    sender.conn.send(cmd)
    got = n = 0
    while n < len(sizes):
        ready = poller.poll(60000)
        if not ready:
            raise TimeoutError("pyzmq baseline: no message within 60 s")
        for sock, _ in ready:
            got += len(sock.recv(copy=False))
            n += 1
    t = time.perf_counter() - t0
    if got != total:
        raise RuntimeError(f"pyzmq baseline: expected {total} bytes, got {got}")
    return t


def bench_row(sender: Sender, geo, layers, nblocks, repeats, chunk_bytes, contiguous, device, gen,
              kernels: bool = False, plane: str = "zmq", threads: bool = False, recv_into: bool | None = None,
              trace: str | None = None, prestage_bytes: int | None = None, burst_bytes: int | None = None,
              lanes: int | None = None, burst_lanes: int = 1) -> dict:
    """Alternate connector pulls and pyzmq bursts of the same bytes (so both see the same
    machine load); medians of wall and CPU time; the last pull is checked byte for byte.
    ``threads``: also sum each thread group's CPU time over the timed connector pulls
    (``out["threads"]``: (decode side, prefill side) dicts of seconds). ``trace``: write the
    last pull's spans of both processes to this Chrome trace file (``out["spans"]``: how many).
    ``burst_bytes``: the bursts' message size (default ``chunk_bytes``). ``lanes``: the connector's
    connections (default: the endpoints'); ``burst_lanes`` > 1: also a burst dealt over that many
    connections (``out["lanes"]``), timed in the same rounds."""
    from kvconnector import DecodeEndpoint
    from tools.serve import synthetic_caches
    desc = LayoutDescriptor.from_geometry(geo, num_layers=layers, num_blocks=2 * nblocks)
    total = layers * nblocks * geo.block_bytes
    sizes = burst_sizes(total, geo.block_bytes, chunk_bytes if burst_bytes is None else burst_bytes)
    src_ids = [list(range(nblocks)) if contiguous else torch.randperm(2 * nblocks, generator=gen)[:nblocks].tolist()
               for _ in range(repeats + 1)]
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    zctx = zmq.Context(io_threads=burst_lanes)
    pulls, push_endpoints = [], []
    for _ in range(burst_lanes):
        pulls.append(zctx.socket(zmq.PULL))
        pulls[-1].setsockopt(zmq.LINGER, 0)
        push_endpoints.append(f"tcp://127.0.0.1:{pulls[-1].bind_to_random_port('tcp://127.0.0.1')}")
    endpoint = sender.ask(("row", desc.to_dict(), seed, device, chunk_bytes,
                           [(f"t{r}", ids) for r, ids in enumerate(src_ids)], push_endpoints, sizes,
                           kernels, plane, prestage_bytes, lanes))
    dst = synthetic_caches(desc, seed + 1, device)
    t = {"conn": [], "conn_cpu": [], "zmq": [], "zmq_cpu": [], "hot": [], "lanes": []}
    per_thread, stages = ({}, {}), ({}, {})   # (decode, prefill): summed over the timed pulls
    try:
        with DecodeEndpoint(dst, desc, frame_ops=_frame_ops(kernels), data_plane=plane,
                            nixl_region_bytes=max(1 << 20, total), recv_into=recv_into,
                            **_lanes_kw(lanes)) as dec:
            dec.connect(endpoint, timeout_s=30)
            sender.ask("publish")
            algorithm = dec.checksum
            for r in range(repeats + 1):               # first round is warm-up
                dst_ids = torch.randperm(2 * nblocks, generator=gen)[:nblocks].tolist()
                th0 = sender.threads() if threads and r else None      # read outside the timed window
                st0 = (dec.stage_times(), sender.stages()) if th0 is not None else None
                traced = trace is not None and r == repeats
                if traced:
                    sender.ask("trace_on")
                    dec.trace.enabled = True
                c0 = sender.cpu_s()
                t0 = time.perf_counter()
                res = dec.pull(f"t{r}", dst_ids, deadline_s=120).result()
                if device != "cpu":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                c1 = sender.cpu_s()
                if th0 is not None:
                    for acc, after, before in zip(per_thread, sender.threads(), th0):
                        for k, v in _delta(after, before).items():
                            acc[k] = acc.get(k, 0.0) + v
                    for acc, after, before in zip(stages, (dec.stage_times(), sender.stages()), st0):
                        for k, v in after.items():   # seconds (float) or counts (int)
                            acc[k] = acc.get(k, 0 * v) + v - before.get(k, 0 * v)
                if traced:
                    dec.trace.enabled = False
                    spans = write_chrome(trace, [("prefill", sender.ask("trace_take")), ("decode", dec.trace.take())])
                if res.nbytes != total:
                    raise RuntimeError(f"connector: expected {total} bytes, got {res.nbytes}")
                cmds = ("go", "go_hot") + (("go_lanes",) if burst_lanes > 1 else ())
                for cmd in cmds if r % 2 else cmds[::-1]:   # each timed from its own request
                    if cmd == "go":
                        cz = sender.cpu_s()
                        zmq_s = _burst(sender, pulls, sizes, total, cmd)
                        c2 = sender.cpu_s()
                    elif cmd == "go_hot":
                        hot_s = _burst(sender, pulls, sizes, total, cmd)
                    else:
                        lanes_s = _burst(sender, pulls, sizes, total, cmd)
                if r:
                    t["conn"].append(t1 - t0)
                    t["conn_cpu"].append(c1 - c0)
                    t["zmq"].append(zmq_s)
                    t["zmq_cpu"].append(c2 - cz)
                    t["hot"].append(hot_s)
                    if burst_lanes > 1:
                        t["lanes"].append(lanes_s)
            num_messages = dec.metrics.c["blocks_messages"]     # BLOCKS messages accepted
    finally:
        sender.ask("done")
        for p in pulls:
            p.close(0)
        zctx.term()
    src = synthetic_caches(desc, seed, "cpu")
    for s, d in zip(src, dst):
        if not torch.equal(s[src_ids[-1]].view(torch.uint8), d[dst_ids].view(torch.uint8).cpu()):
            raise RuntimeError("transferred blocks differ from the source")
    out = {k: statistics.median(v) for k, v in t.items() if v}
    out.update(nbytes=total, messages=num_messages / (repeats + 1), burst_messages=len(sizes), checksum=algorithm,
               threads=per_thread, stages=stages, spans=spans if trace is not None else 0)
    return out


def _thread_line(label: str, secs: dict, mib: float) -> str:
    """``label: name ms/MiB, ...`` for thread groups above 0.005 ms/MiB, largest first."""
    if not secs:
        return f"{label}: (none apart: --in-process, or no /proc schedstat)"
    parts = sorted(((v * 1e3 / mib, k) for k, v in secs.items()), reverse=True)
    return f"{label}: " + ", ".join(f"{k} {v:.2f}" for v, k in parts if v >= 0.005)


def _stage_line(label: str, stages: tuple, repeats: int) -> str:
    """``label``: per stage, ms per pull (counts per pull), decode side then prefill side."""
    parts = []
    for side, st in zip(("decode", "prefill"), stages):
        items = [f"{k} {v * 1e3 / repeats:.2f}" if isinstance(v, float) else f"{k} {v / repeats:.0f}"
                 for k, v in st.items()]
        parts.append(f"{side}: " + (", ".join(items) or "(none)"))
    return f"{label}; " + "; ".join(parts)


def bench_layerwise(sender: Sender, geo, layers, tokens, layer_ms, repeats, chunk_bytes, device, gen,
                    kernels: bool, lanes: int | None = None) -> dict:
    """Exposed time (last layer announced -> last block landed) of layer-wise pulls, and of the same
    pulls with every layer announced at once; medians over ``repeats`` (after one warm-up each).
    ``lanes``: the connector's connections (default: the endpoints')."""
    from kvconnector import DecodeEndpoint
    from tools.serve import synthetic_caches
    nblocks = -(-tokens // geo.block_size)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=layers, num_blocks=nblocks)
    ids = torch.randperm(nblocks, generator=gen).tolist()
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    endpoint = sender.ask(("layerwise", desc.to_dict(), seed, device, chunk_bytes, ids, kernels, lanes))
    dst = synthetic_caches(desc, seed + 1, device)
    out = {"layerwise": [], "at_once": []}
    try:
        with DecodeEndpoint(dst, desc, frame_ops=_frame_ops(kernels),
                            **_lanes_kw(lanes)) as dec:
            dec.connect(endpoint, timeout_s=60)
            for r in range(2 * (repeats + 1)):
                at_once = r % 2 == 1
                tid = f"lw{r}"
                sender.ask(("publish", tid))
                handle = dec.pull(tid, list(range(nblocks)), deadline_s=600)
                t_last = sender.ask(("layers", tid, layer_ms / 1e3, at_once), timeout_s=600)
                handle.result(timeout=600)
                if device != "cpu":
                    torch.cuda.synchronize()
                t_done = time.monotonic()
                if r >= 2:
                    out["at_once" if at_once else "layerwise"].append(t_done - t_last)
            algorithm = dec.checksum
    finally:
        sender.ask("done")
    src = synthetic_caches(desc, seed, "cpu")
    for s, d in zip(src, dst):
        if not torch.equal(s[ids].view(torch.uint8), d.view(torch.uint8).cpu()):
            raise RuntimeError("layer-wise pull: transferred blocks differ from the source")
    return {"layerwise": statistics.median(out["layerwise"]), "at_once": statistics.median(out["at_once"]),
            "nbytes": layers * nblocks * geo.block_bytes, "checksum": algorithm}


def _prestage_note(mb: float | None, device: str) -> str:
    """Whether the prefill endpoint stages first messages at publish (``prestage_bytes``), for the header line."""
    from kvconnector.prefill import default_prestage_bytes
    mb = default_prestage_bytes(device) / 2**20 if mb is None else mb
    return f", first messages staged at publish (up to {mb:g} MiB)" if mb > 0 else ", staged at the pull only"


def _receive_note(recv_into: bool | None, device: str) -> str:
    """How the decode side receives payloads (DecodeEndpoint's ``recv_into``), for the header line."""
    from kvconnector.decode import default_recv_into
    if recv_into is None:
        recv_into = default_recv_into(device)
    return (", frames received into pinned memory on the I/O thread (recv_into)" if recv_into else
            ", frames received zero copy, copied into pinned memory by the copy workers")


def run(args) -> int:
    shape = dict(modes=",".join(MODES), layers=8, kv_heads=8, head_size=128, block_size=16)
    if args.cuda:
        args.device, args.kernels = "cuda", True
        shape.update(modes="int8_per_token_head,int4_per_token_head", layers=32)
        args.layerwise_tokens = 32768 if args.layerwise_tokens is None else args.layerwise_tokens
    if args.quick:
        args.blocks, args.repeats = "4,16", 2
        shape.update(modes="auto,int4_per_token_head", layers=2, kv_heads=2, head_size=64)
        if args.kernels and args.device == "cpu":   # interpreted kernels: keep the smoke run small
            args.blocks = "2"
    for k, v in shape.items():   # a preset fills only what the command line left out
        if getattr(args, k) is None:
            setattr(args, k, v)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device")
        return 2
    gen = torch.Generator().manual_seed(0)
    if args.trace is not None:
        os.makedirs(args.trace, exist_ok=True)
    chunks = [(c, int(c * (1 << 20))) for c in args.chunk_mb]
    sizes_txt = ",".join(f"{c:g}" for c, _ in chunks)
    order = "contiguous" if args.contiguous else "scattered"
    from kvconnector.decode import default_copy_threads
    from kvconnector.sender import stage_threads
    where = "sender on a thread (one process)" if args.in_process else "sender in a spawned process"
    print(f"# bench-transfer: device={device} layers={args.layers} kv_heads={args.kv_heads} "
          f"head_size={args.head_size} block_size={args.block_size} src blocks {order} "
          f"chunk={sizes_txt} MiB, bursts in {sizes_txt if args.burst_mb is None else f'{args.burst_mb:g}'} MiB "
          f"messages, {where}, median of {args.repeats}; {os.cpu_count()} cores, "
          f"stage threads {stage_threads()}, copy threads {default_copy_threads()}"
          f"{', device kernels' if args.kernels else ''}"
          f"{', NIXL data plane' if args.data_plane == 'nixl' else ''}"
          f"{_receive_note(args.recv_into, device) if args.kernels else ''}"
          f"{_prestage_note(args.prestage_mb, device) if args.kernels else ''}"
          f"{', GPU ' + torch.cuda.get_device_name() if device == 'cuda' else ''}")
    print(f"# command: python -m bench.transfer {' '.join(sys.argv[1:])}")
    k = args.burst_lanes
    print("| mode | blocks | MiB | chunk MiB | msgs | burst msgs | checksum | connector ms | GB/s | CPU ms/MiB "
          "| pyzmq ms | GB/s | CPU ms/MiB | ratio | pyzmq one buffer ms | ratio to it |"
          + (f" pyzmq {k} connections ms | ratio to it |" if k > 1 else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if k > 1 else ""))
    ratios, hot_ratios, lane_ratios, threads_out = [], [], [], []
    sender = Sender(args.in_process)
    try:
        for mode_str in args.modes.split(","):
            geo = CacheGeometry(get_kv_quant_mode(mode_str), args.head_size, args.kv_heads, args.block_size)
            for nblocks, (c_mb, chunk) in ((int(b), c) for b in args.blocks.split(",") for c in chunks):
                row = f"{mode_str} {nblocks} blocks" + (f" {c_mb:g} MiB messages" if len(chunks) > 1 else "")
                name = f"{mode_str}-{nblocks}" + (f"-{c_mb:g}mib" if len(chunks) > 1 else "")
                trace = None if args.trace is None else os.path.join(args.trace, f"{name}.json")
                r = bench_row(sender, geo, args.layers, nblocks, args.repeats, chunk, args.contiguous, device, gen,
                              args.kernels, args.data_plane, args.threads, args.recv_into, trace,
                              None if args.prestage_mb is None else int(args.prestage_mb * 2**20),
                              None if args.burst_mb is None else int(args.burst_mb * (1 << 20)), args.lanes, k)
                ratios.append(r["zmq"] / r["conn"])
                hot_ratios.append(r["hot"] / r["conn"])
                n = r["nbytes"]
                mib = n / 2**20
                print(f"| {mode_str} | {nblocks} | {mib:.1f} | {c_mb:g} | {r['messages']:.0f} | {r['burst_messages']} "
                      f"| {r['checksum']} | {r['conn'] * 1e3:.2f} | {n / r['conn'] / 1e9:.2f} "
                      f"| {r['conn_cpu'] * 1e3 / mib:.2f} | {r['zmq'] * 1e3:.2f} | {n / r['zmq'] / 1e9:.2f} "
                      f"| {r['zmq_cpu'] * 1e3 / mib:.2f} | {ratios[-1]:.2f} | {r['hot'] * 1e3:.2f} "
                      f"| {hot_ratios[-1]:.2f} |"
                      + (f" {r['lanes'] * 1e3:.2f} | {r['lanes'] / r['conn']:.2f} |" if k > 1 else ""), flush=True)
                if k > 1:
                    lane_ratios.append(r["lanes"] / r["conn"])
                if trace is not None:
                    threads_out.append(f"# {row}, last pull traced: {trace} ({r['spans']} spans)")
                if args.threads:   # summed over the timed pulls, per MiB moved
                    moved = mib * args.repeats
                    threads_out.append(f"# {row}, connector CPU ms/MiB by thread; "
                                       + _thread_line("decode process", r["threads"][0], moved) + "; "
                                       + _thread_line("prefill process", r["threads"][1], moved))
                    threads_out.append(_stage_line(f"# {row}, connector I/O and landing "
                                                   f"threads, ms per pull by stage", r["stages"], args.repeats))
        for line in threads_out:
            print(line)
        print(f"# ratio connector/pyzmq: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}; "
              f"to pyzmq re-sending one buffer: median {statistics.median(hot_ratios):.2f}, min {min(hot_ratios):.2f}"
              + (f"; to pyzmq over {k} connections: median {statistics.median(lane_ratios):.2f}, "
                 f"min {min(lane_ratios):.2f}" if k > 1 else ""))
        if args.layerwise_tokens:
            geo = CacheGeometry(get_kv_quant_mode("int4_per_token_head"), args.head_size, args.kv_heads,
                                args.block_size)
            lw = [(c_mb, bench_layerwise(sender, geo, args.layers, args.layerwise_tokens, args.layer_ms,
                                         args.repeats, chunk, device, gen, args.kernels, args.lanes))
                  for c_mb, chunk in chunks]
            r = lw[0][1]
            print(f"\n# layer-wise pull: int4, {args.layerwise_tokens} tokens, {args.layers} layers, "
                  f"{r['nbytes'] / 2**20:.0f} MiB, {r['checksum']}, one layer announced every {args.layer_ms} ms")
            print("| chunk MiB | exposed ms, layer by layer (last layer announced -> last block landed) "
                  "| exposed ms, all layers announced at once |")
            print("|---|---|---|")
            for c_mb, r in lw:
                print(f"| {c_mb:g} | {r['layerwise'] * 1e3:.1f} | {r['at_once'] * 1e3:.1f} |")
    finally:
        sender.close()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
