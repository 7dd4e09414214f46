"""A fault-injecting ZeroMQ man in the middle between a decode and a prefill endpoint.

The decode endpoint connects to :attr:`FaultProxy.endpoint` instead of the prefill's; the
proxy forwards every message both ways (a ROUTER facing decode peers, one DEALER per peer
facing the prefill endpoint) and lets a *policy* drop, duplicate, delay, reorder,
truncate or corrupt any of them, or cut the link (:meth:`kill` / :meth:`revive`), or
stall one direction (a slow consumer). Used by ``tests/test_faults.py`` and ``kvconnector/testing/soak.py``.

A policy is ``policy(direction, header, frames) -> [(delay_s, frames), ...]``: what to
forward and when (an empty list drops the message). ``direction`` is ``"up"`` (decode ->
prefill) or ``"down"``; ``header`` is the decoded :class:`~kvconnector.protocol.Header`
(None when it does not decode). :func:`random_policy` builds a seeded random mix.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections import Counter, deque

import msgpack
import zmq

from kvconnector.protocol import MsgType, decode_header

FAULTS = ("drop", "duplicate", "delay", "reorder", "truncate", "corrupt")


def passthrough(direction, header, frames):
    return [(0.0, frames)]


def truncate(frames):
    """Cut the last payload frame in half (header untouched: it still claims the full count)."""
    out = list(frames)
    out[-1] = bytes(out[-1])[: len(out[-1]) // 2]
    return out


def corrupt(frames, rng=random):
    """Flip one bit of one payload byte."""
    out = list(frames)
    i = rng.randrange(1, len(out)) if len(out) > 1 else 0
    b = bytearray(out[i])
    if b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    out[i] = bytes(b)
    return out


def reheader(frames, **fields):
    """The same message with header ``fields`` set and nothing else changed: its payload, payload
    checksums and BLOCKS placement checksum as sent (a header corrupted so that it still parses)."""
    raw = msgpack.unpackb(bytes(frames[0]), raw=False)
    raw.update(fields)
    return [msgpack.packb(raw, use_bin_type=True), *frames[1:]]


def random_policy(rate: float, seed: int, counts: Counter, faults=FAULTS, max_delay_s: float = 0.05):
    """A policy that applies one random fault from ``faults`` to a BLOCKS message with
    probability ``rate`` (counted in ``counts``); everything else passes."""
    rng = random.Random(seed)
    held = []

    def policy(direction, header, frames):
        out = [(0.0, frames)]
        if held:  # a reordered message goes out right after the next one
            out.append(held.pop())
        if header is None or header.type != MsgType.BLOCKS or rng.random() >= rate:
            return out
        kind = rng.choice(faults)
        counts[kind] += 1
        if kind == "drop":
            return out[1:]
        if kind == "duplicate":
            return out + [(rng.uniform(0, max_delay_s), frames)]
        if kind == "delay":
            return [(rng.uniform(0, max_delay_s), frames)] + out[1:]
        if kind == "reorder":
            held.append((0.0, frames))
            return out[1:]
        if kind == "truncate":
            return [(0.0, truncate(frames))] + out[1:]
        return [(0.0, corrupt(frames, rng))] + out[1:]
    return policy


class FaultProxy:
    """Forward messages between decode peers and one prefill endpoint, injecting faults.

    Parameters
    ----------
    target : str
        The prefill endpoint, ``tcp://host:port``.
    policy : callable, optional
        See the module docstring; :func:`passthrough` when None.
    host : str
        Where the proxy binds (loopback by default).
    """

    def __init__(self, target: str, policy=None, host: str = "127.0.0.1") -> None:
        self.target, self.policy = target, policy or passthrough
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self.front.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{self.port}"
        self.forwarded = Counter()         # direction -> messages forwarded
        self.dead = False                  # kill(): drop everything both ways
        self.stall_down = False            # slow consumer: stop reading from the prefill side
        self._backs: dict[bytes, zmq.Socket] = {}
        self._queue: list = []             # heap of (due, seq, direction, ident, frames)
        self._seq = itertools.count()
        self._revive: deque = deque()      # (new_connection, done event), applied by the proxy thread
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"faultproxy-{self.port}", daemon=True)
        self._thread.start()

    def kill(self) -> None:
        """Cut the link: nothing passes either way (like a dead peer or a pulled cable)."""
        self.dead = True

    def revive(self, new_connection: bool = False) -> None:
        """Restore the link; ``new_connection`` also replaces the prefill-facing sockets,
        so the prefill endpoint sees a new, un-handshaken peer. Returns once the proxy thread
        has applied it (within one poll, ~10 ms): only that thread touches the sockets, and
        no lock is held across its polls, so a caller cannot be starved by the loop (with a
        lock, a loop that re-takes it at once kept ``revive`` waiting for seconds on a
        16-core host)."""
        done = threading.Event()
        self._revive.append((new_connection, done))
        if not done.wait(5.0):
            raise TimeoutError("fault proxy: revive was not applied within 5 s (proxy closed?)")

    def _apply_revive(self) -> None:
        while self._revive:
            new_connection, done = self._revive.popleft()
            if new_connection:  # what the old connection still carried is lost with it
                for s in self._backs.values():
                    s.close(0)
                self._backs.clear()
                self._queue.clear()
            self.dead = False
            done.set()

    def _back(self, ident: bytes) -> zmq.Socket:
        s = self._backs.get(ident)
        if s is None:
            s = self._backs[ident] = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.target)
        return s

    def _schedule(self, direction: str, ident: bytes, frames: list) -> None:
        if self.dead:
            self.forwarded["killed"] += 1
            return
        try:
            h = decode_header(frames[0])
        except Exception:  # a message the policy may still want to pass on untouched
            h = None
        now = time.monotonic()
        for delay, out in self.policy(direction, h, frames):
            heapq.heappush(self._queue, (now + delay, next(self._seq), direction, ident, out))

    def _flush(self) -> float:
        now = time.monotonic()
        while self._queue and self._queue[0][0] <= now:
            _, _, direction, ident, frames = heapq.heappop(self._queue)
            if self.dead:
                continue
            try:
                if direction == "up":
                    self._back(ident).send_multipart(frames, zmq.NOBLOCK)
                else:
                    self.front.send_multipart([ident, *frames], zmq.NOBLOCK)
                self.forwarded[direction] += 1
            except zmq.ZMQError:
                self.forwarded[f"{direction}_unroutable"] += 1
        return 0.01 if not self._queue else max(0.0, min(0.01, self._queue[0][0] - now))

    def _run(self) -> None:
        while not self._stop:
            self._apply_revive()
            poller = zmq.Poller()
            poller.register(self.front, zmq.POLLIN)
            if not self.stall_down:
                for s in self._backs.values():
                    poller.register(s, zmq.POLLIN)
            wait = self._flush()
            ready = dict(poller.poll(int(wait * 1000) + 1))
            if self.front in ready:
                ident, *frames = self.front.recv_multipart()
                self._schedule("up", ident, frames)
            for ident, s in list(self._backs.items()):
                if s in ready:
                    self._schedule("down", ident, s.recv_multipart())

    def close(self) -> None:
        self._stop = True
        self._thread.join(2.0)
        for s in [self.front, *self._backs.values()]:
            s.close(0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
