"""Soak test of the connector: many concurrent transfers for minutes, with faults and aborts.

One prefill endpoint serves ``--decoders`` decode endpoints, each behind a
:class:`kvconnector.testing.faultproxy.FaultProxy` that drops / duplicates / delays / reorders /
truncates / corrupts a fraction ``--fault-rate`` of BLOCKS messages, and a chaos thread
cuts one link now and then (``--kill-every`` seconds). ``--workers`` threads loop: take
free source and destination blocks, fill the source with fresh random bytes, publish,
pull, abort at random (``--abort-rate``), and check **every (layer, block) by its xxh3
content hash**: a successful pull must have landed all of them; a failed one (typed errors
only) must leave each destination either complete or untouched, and report every
incomplete block in ``failed_block_ids``. Source blocks return to the free pool only from
``on_release`` (the lease ended), destination blocks when the pull ends.

At the end: leases, streams and pending pulls must be zero, every block back in its free
pool, and RSS / open fds / threads back near their post-warm-up baseline.

``--frame-ops``: both endpoints on the device path (``mix64``; gathers covering several messages,
verify + scatter passes over groups of consecutive messages, on these CPU caches).

Run: ``python -m kvconnector.testing.soak --seconds 240`` (prints a markdown table; exit 1 on any lost or
corrupted block, untyped error, or resource not returned).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import threading
import time
from collections import Counter

import torch
import xxhash

from kvconnector import DecodeEndpoint, PrefillEndpoint
from layouts import CacheGeometry, KVCacheError, KVQuantMode, LayoutDescriptor
from kvconnector.testing.faultproxy import FaultProxy, random_policy
from kvconnector.testing.frame_ops import TORCH_FRAME_OPS


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Pool:
    """Free block ids, taken and returned under a lock."""

    def __init__(self, n: int) -> None:
        self.free, self.n, self.cv = set(range(n)), n, threading.Condition()

    def take(self, k: int, rng: random.Random, timeout: float = 5.0) -> list | None:
        with self.cv:
            if not self.cv.wait_for(lambda: len(self.free) >= k, timeout):
                return None
            ids = rng.sample(sorted(self.free), k)
            self.free.difference_update(ids)
            return ids

    def give(self, ids) -> None:
        with self.cv:
            self.free.update(ids)
            self.cv.notify_all()


def _hashes(caches, ids) -> list[list[int]]:
    return [[xxhash.xxh3_64_intdigest(c.view(torch.uint8)[b].numpy()) for b in ids] for c in caches]


class Soak:
    def __init__(self, a) -> None:
        self.a, self.rng = a, random.Random(a.seed)
        geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 64, 2, 16)
        self.desc = LayoutDescriptor.from_geometry(geo, num_layers=a.layers, num_blocks=a.blocks)
        self.src = [geo.new_cache(a.blocks) for _ in range(a.layers)]
        self.src_pool = Pool(a.blocks)
        self.leased: dict[str, list] = {}
        self.faults, self.stats = Counter(), Counter()
        self.lock = threading.Lock()
        ops = TORCH_FRAME_OPS if a.frame_ops else None
        self.pre = PrefillEndpoint(self.src, self.desc, chunk_bytes=a.chunk_bytes, lease_s=a.lease_s,
                                   heartbeat_s=0.1, peer_timeout_s=1.0, on_release=self._released, frame_ops=ops)
        self.decs, self.proxies, self.dst_pools, self.dsts = [], [], [], []
        for i in range(a.decoders):
            dst = [geo.new_cache(a.blocks) for _ in range(a.layers)]
            proxy = FaultProxy(self.pre.endpoint, random_policy(a.fault_rate, a.seed + i, self.faults))
            dec = DecodeEndpoint(dst, self.desc, heartbeat_s=0.1, peer_timeout_s=0.5, frame_ops=ops)
            dec.connect(proxy.endpoint, timeout_s=5)
            self.decs.append(dec), self.proxies.append(proxy), self.dsts.append(dst)
            self.dst_pools.append(Pool(a.blocks))
        self.stop = threading.Event()

    def _released(self, tid, block_ids, reason) -> None:
        self.stats[f"release_{reason}"] += 1
        self.src_pool.give(block_ids)

    def _one(self, w: int, n: int, rng: random.Random) -> None:
        d = w % len(self.decs)
        dec, dst, pool = self.decs[d], self.dsts[d], self.dst_pools[d]
        k = rng.randint(1, self.a.max_blocks)
        src_ids = self.src_pool.take(k, rng)
        if src_ids is None:
            self.stats["starved"] += 1
            return
        dst_ids = pool.take(k, rng)
        if dst_ids is None:
            self.src_pool.give(src_ids)
            self.stats["starved"] += 1
            return
        for c in self.src:  # fresh content every time: a stale or misplaced block shows
            c.view(torch.uint8)[src_ids] = torch.randint(0, 256, c.view(torch.uint8)[src_ids].shape,
                                                         dtype=torch.uint8)
        want, before = _hashes(self.src, src_ids), _hashes(dst, dst_ids)
        tid = f"w{w}-{n}"
        self.pre.publish(tid, src_ids)
        h = dec.pull(tid, dst_ids, deadline_s=self.a.deadline_s)
        if rng.random() < self.a.abort_rate:
            time.sleep(rng.uniform(0, 0.02))
            dec.abort(tid)
            self.stats["aborts_issued"] += 1
        try:
            err = h.exception(timeout=self.a.deadline_s + 5)
        except TimeoutError:  # the handle itself must end by its deadline
            self.stats["hung_pulls"] += 1
            err = None
        got = _hashes(dst, dst_ids)
        failed = set(h.failed_block_ids) if err is not None else set()
        for layer in range(self.a.layers):
            for i, b in enumerate(dst_ids):
                landed = got[layer][i] == want[layer][i]
                if not landed and got[layer][i] != before[layer][i]:
                    self.stats["corrupted_blocks"] += 1
                elif not landed and b not in failed:
                    self.stats["lost_blocks"] += 1
                self.stats["blocks_verified"] += 1
        if err is None:
            self.stats["transfers_ok"] += 1
            self.stats["bytes_ok"] += h.nbytes
        elif isinstance(err, KVCacheError):
            self.stats[f"failed_{type(err).__name__}"] += 1
        else:
            self.stats[f"UNTYPED_{type(err).__name__}"] += 1
        pool.give(dst_ids)

    def _worker(self, w: int) -> None:
        rng = random.Random(self.a.seed * 1000 + w)
        n = 0
        while not self.stop.is_set():
            try:
                self._one(w, n, rng)
            except Exception as e:  # an untyped error escaping the API is a finding
                self.stats[f"UNTYPED_{type(e).__name__}"] += 1
            n += 1

    def _chaos(self) -> None:
        rng = random.Random(self.a.seed + 99)
        while not self.stop.wait(rng.uniform(0.5, 1.5) * self.a.kill_every):
            p = rng.choice(self.proxies)
            p.kill()
            self.faults["kill"] += 1
            self.stop.wait(rng.uniform(0.1, 0.8))
            p.revive(new_connection=rng.random() < 0.5)

    def run(self) -> dict:
        a = self.a
        threads = [threading.Thread(target=self._worker, args=(w,), daemon=True) for w in range(a.workers)]
        if a.kill_every > 0:
            threads.append(threading.Thread(target=self._chaos, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(min(a.warmup_s, a.seconds))
        gc.collect()
        base = {"rss_mb": rss_mb(), "fds": open_fds(), "threads": threading.active_count()}
        peak = base["rss_mb"]
        bar = _progress_bar(a.seconds, a.quiet)   # seconds elapsed of --seconds, with ETA
        while time.monotonic() - t0 < a.seconds:
            time.sleep(0.5)
            peak = max(peak, rss_mb())
            if bar is not None:
                bar.update(min(a.seconds, time.monotonic() - t0) - bar.n)
                bar.set_postfix(ok=self.stats["transfers_ok"], faults=sum(self.faults.values()))
        if bar is not None:
            bar.close()
        self.stop.set()
        for t in threads:
            t.join(a.deadline_s + 10)
        end = time.monotonic() + a.lease_s + 3  # leases whose ABORT was lost expire
        while time.monotonic() < end and (self.pre.held() or self.pre.stats()["streams"]
                                           or any(d.stats()["pending"] for d in self.decs)):
            time.sleep(0.05)
        gc.collect()
        out = dict(self.stats)
        out.update(seconds=round(time.monotonic() - t0, 1), faults=dict(self.faults),
                   faults_injected=sum(self.faults.values()),
                   leases_left=len(self.pre.held()), streams_left=self.pre.stats()["streams"],
                   pending_left=sum(d.stats()["pending"] for d in self.decs),
                   src_blocks_not_free=a.blocks - len(self.src_pool.free),
                   dst_blocks_not_free=sum(a.blocks - len(p.free) for p in self.dst_pools),
                   rss_base_mb=round(base["rss_mb"], 1), rss_peak_mb=round(peak, 1),
                   rss_end_mb=round(rss_mb(), 1), fds_base=base["fds"], fds_end=open_fds(),
                   threads_base=base["threads"], threads_end=threading.active_count(),
                   bytes_received=sum(d.stats()["bytes_received"] for d in self.decs),
                   bytes_sent=self.pre.stats()["bytes_sent"])
        return out

    def close(self) -> None:
        for dec, proxy in zip(self.decs, self.proxies):
            dec.close()
            proxy.close()
        self.pre.close()


def _progress_bar(seconds: float, quiet: bool):
    """A tqdm bar over the soak's seconds (stderr), or None when quiet or tqdm is absent."""
    if quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=seconds, unit="s", desc="soak", file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s "
                "[{elapsed}<{remaining}{postfix}]")


def problems(r: dict, rss_slack_mb: float) -> list[str]:
    """What makes a soak run fail."""
    bad = [k for k in r if k.startswith("UNTYPED")]
    for k in ("corrupted_blocks", "lost_blocks", "hung_pulls", "leases_left", "streams_left",
              "pending_left", "src_blocks_not_free", "dst_blocks_not_free"):
        if r.get(k, 0):
            bad.append(f"{k}={r[k]}")
    if r["rss_end_mb"] - r["rss_base_mb"] > rss_slack_mb:
        bad.append(f"rss grew {r['rss_end_mb'] - r['rss_base_mb']:.1f} MB")
    if r["fds_end"] > r["fds_base"] or r["threads_end"] > r["threads_base"]:
        bad.append(f"fds {r['fds_base']}->{r['fds_end']}, threads {r['threads_base']}->{r['threads_end']}")
    if not r.get("transfers_ok"):
        bad.append("no transfer succeeded")
    return bad


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=5.0, help="baseline taken after this")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256, help="blocks per cache (prefill and each decode)")
    p.add_argument("--max-blocks", type=int, default=16, help="blocks per transfer: uniform 1..this")
    p.add_argument("--chunk-bytes", type=int, default=16 << 10)
    p.add_argument("--fault-rate", type=float, default=0.01, help="per BLOCKS message")
    p.add_argument("--abort-rate", type=float, default=0.05, help="per transfer")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between link cuts (0: never)")
    p.add_argument("--deadline-s", type=float, default=3.0)
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument("--rss-slack-mb", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--frame-ops", action="store_true", help="both endpoints on the device path (mix64, the "
                   "plain-PyTorch frame ops of kvconnector.testing.frame_ops on these CPU caches)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    s = Soak(a)
    try:
        r = s.run()
    finally:
        s.close()
    print("\n| metric | value |\n|---|---|")
    for k in sorted(r):
        print(f"| {k} | {r[k]} |")
    bad = problems(r, a.rss_slack_mb)
    print("RESULT:", "PASS" if not bad else "FAIL " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
