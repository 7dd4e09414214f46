"""Live fuzzing: mutated messages between a real decode and a real prefill endpoint.

A :class:`~kvconnector.testing.faultproxy.FaultProxy` between the two forwards every message
and, with probability ``--rate`` (0.3), sends a mutated copy of a BLOCKS (down), PULL or ACK (up)
message first (:func:`kvconnector.testing.fuzz.mutate_case`, 1-3 edits: bytes, lengths, header
fields, frames). Each pull takes 2 layers x 4 published blocks into 4 random distinct
destination blocks of 16, one BLOCKS message per layer and block (so a mutated header can name
another real position), and must end byte exact or with a typed error (``KVCacheError``);
after it, every destination block holds the source bytes or its previous bytes, every block
the pull reports landed holds the source bytes, no other block changed, and both endpoints
recorded only typed errors. The decoder-level fuzzer (``kvconnector.testing.fuzz``) checks
what one message decodes to; this checks what a sequence of them does to a cache.

``--frame-ops``: both endpoints take the device path (``mix64``; the plain-PyTorch frame ops of
:mod:`kvconnector.testing.frame_ops` on these CPU caches): gathers covering several messages,
the landing thread's verify + scatter passes over groups of consecutive messages, mutated copies
among them.

Run: ``python -m kvconnector.testing.live_fuzz --seconds 600`` (``--seed``, ``--rate``,
``--frame-ops``); prints pulls, outcomes and failures; exit code 1 on any failure.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

import torch

from layouts import CacheGeometry, KVCacheError, KVQuantMode, LayoutDescriptor
from ..decode import DecodeEndpoint
from ..prefill import PrefillEndpoint
from ..protocol import MsgType
from .faultproxy import FaultProxy
from .frame_ops import TORCH_FRAME_OPS
from .fuzz import mutate_case

GEO = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 16, 2, 2, torch.bfloat16)   # 96-byte blocks
LAYERS, BLOCKS, PULLED = 2, 16, 4
DEADLINE_S = 0.5


def mutating_policy(rng: random.Random, rate: float, counts: Counter, mutate=mutate_case):
    """FaultProxy policy: forward every message; before a BLOCKS / PULL / ACK, with probability
    ``rate``, a copy of it edited by ``mutate(rng, target, frames, rounds)`` (counted by type in
    ``counts``)."""
    def policy(direction, header, frames):
        out = [(0.0, frames)]
        if header is None or header.type not in (MsgType.BLOCKS, MsgType.PULL, MsgType.ACK) or rng.random() >= rate:
            return out
        counts[header.type.name] += 1
        target = "blocks" if len(frames) > 1 else "header"
        return [(0.0, mutate(rng, target, [bytes(f) for f in frames], rng.choice([1, 2, 3])))] + out
    return policy


def _caches(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, GEO.shape(BLOCKS), dtype=torch.uint8, generator=g) for _ in range(LAYERS)]


def _untyped(endpoints, seen: list) -> list:
    """What the endpoints recorded since the counts in ``seen`` (updated) that is not a typed
    error, or could not be checked (dropped from the endpoint's bounded log first)."""
    out = []
    for i, ep in enumerate(endpoints):
        errors, total = ep.errors.since(seen[i])
        if total - seen[i] > len(errors):
            out.append(f"{total - seen[i] - len(errors)} errors dropped before they were checked")
        out += [repr(e) for e in errors if not isinstance(e, KVCacheError)]
        seen[i] = total
    return out


def check_pull(src, dst, before, src_ids, dst_ids, err, failed) -> list:
    """What is wrong with the caches after one pull (empty: nothing)."""
    problems = []
    others = [b for b in range(BLOCKS) if b not in dst_ids]
    for layer in range(LAYERS):
        if not torch.equal(dst[layer][others], before[layer][others]):
            problems.append(f"layer {layer}: a block outside the pull changed")
        for s, d in zip(src_ids, dst_ids):
            exact = torch.equal(dst[layer][d], src[layer][s])
            if not exact and (err is None or d not in failed):
                problems.append(f"layer {layer} block {d}: not the source bytes, yet "
                                + ("the pull succeeded" if err is None else "not reported failed"))
            if not exact and not torch.equal(dst[layer][d], before[layer][d]):
                problems.append(f"layer {layer} block {d}: neither the source bytes nor its previous bytes")
    return problems


def run(seconds: float, seed: int, rate: float, log=print, max_pulls: int | None = None, mutate=mutate_case,
        frame_ops: bool = False) -> int:
    """Pull for ``seconds`` (or ``max_pulls`` pulls, whichever ends first); returns the number of
    failures (each logged). ``mutate``: the edit applied to the copies (:func:`mutating_policy`);
    ``frame_ops``: both endpoints on the device path (module doc)."""
    rng = random.Random(seed)
    desc = LayoutDescriptor.from_geometry(GEO, num_layers=LAYERS, num_blocks=BLOCKS)
    src, dst = _caches(seed), _caches(seed + 1)
    mutated, outcomes, failures = Counter(), Counter(), 0
    ops = TORCH_FRAME_OPS if frame_ops else None
    with PrefillEndpoint(src, desc, lease_s=2.0, chunk_bytes=1, frame_ops=ops) as pre:   # a message per layer and block
        proxy = FaultProxy(pre.endpoint, mutating_policy(rng, rate, mutated, mutate))
        try:
            with DecodeEndpoint(dst, desc, peer_timeout_s=2.0, frame_ops=ops) as dec:
                dec.connect(proxy.endpoint, timeout_s=5)
                end, k, seen = time.monotonic() + seconds, 0, [0, 0]
                while time.monotonic() < end and (max_pulls is None or k < max_pulls):
                    src_ids, dst_ids = rng.sample(range(BLOCKS), PULLED), rng.sample(range(BLOCKS), PULLED)
                    pre.publish(f"t{k}", src_ids)
                    before = [c.clone() for c in dst]
                    h = dec.pull(f"t{k}", dst_ids, deadline_s=DEADLINE_S)
                    err = h.exception(timeout=DEADLINE_S + 5)
                    outcomes[type(err).__name__ if err is not None else "ok"] += 1
                    failed = set(getattr(err, "failed_block_ids", None) or [])
                    problems = check_pull(src, dst, before, src_ids, dst_ids, err, failed)
                    if err is not None and not isinstance(err, KVCacheError):
                        problems.append(f"untyped error: {err!r}")
                    problems += [f"inside an endpoint: {e}" for e in _untyped((dec, pre), seen)]
                    for p in problems:
                        failures += 1
                        log(f"FAILURE pull {k} (seed {seed}): {p}")
                    k += 1
                for e in _untyped((dec, pre), seen):
                    failures += 1
                    log(f"FAILURE inside an endpoint: {e}")
                landed = dec.stage_times() if frame_ops else None
        finally:
            proxy.close()
    if landed is not None:
        log(f"device path: {landed['landed']} messages staged, {landed['passes']} verify + scatter passes; "
            f"{pre.stage_times().get('gathers', 0)} gather launches for {pre.stage_times()['sent']} messages sent")
    log(f"pulls {sum(outcomes.values())}: {dict(outcomes)}; mutated copies sent {dict(mutated)}; failures {failures}")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.3, help="chance of a mutated copy before each BLOCKS / PULL / ACK")
    ap.add_argument("--frame-ops", action="store_true", help="both endpoints on the device path (mix64, "
                    "plain-PyTorch frame ops)")
    a = ap.parse_args(argv)
    return 1 if run(a.seconds, a.seed, a.rate, log=lambda m: print(m, flush=True), frame_ops=a.frame_ops) else 0


if __name__ == "__main__":
    sys.exit(main())
