"""Fault matrix: real prefill and decode endpoints with a fault-injecting proxy between them.

For each fault (drop, duplicate, delay, reorder, truncate, corrupt, misplace, kill, restart, slow
consumer; see docs/RELIABILITY.md for the table) the test checks what the decode side sees
(success, or the expected typed error within its deadline), that no cache is corrupted
(every (layer, destination block) holds either the source bytes or its old bytes, and every
block not reported in ``failed_block_ids`` holds the source bytes in every layer), and that
leases, streams, pending pulls and pooled send buffers are all released afterwards.

Run: python -m pytest tests/test_faults.py
"""

import threading
import time
from collections import Counter

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import MsgType, decode_header
from layouts import CorruptFrameError, TransferTimeoutError
from kvconnector.testing.faultproxy import FaultProxy, corrupt, reheader, truncate

pytestmark = pytest.mark.timeout(60)
SRC_IDS, DST_IDS = [7, 2, 3, 4, 9, 0], [1, 5, 6, 8, 10, 11]
DEADLINE_S = 1.5


def nth(msg_type, direction, n, action):
    """Policy: apply ``action(frames) -> [(delay, frames)]`` to the n-th (0-based) message of a type."""
    seen = Counter()

    def policy(d, h, frames):
        if h is None or h.type != msg_type or d != direction:
            return [(0.0, frames)]
        seen[0] += 1
        return action(frames) if seen[0] - 1 == n or n == "all" else [(0.0, frames)]
    return policy


def swap_first_two_blocks():
    held = []

    def policy(d, h, frames):
        if h is None or h.type != MsgType.BLOCKS:
            return [(0.0, frames)]
        if not held and h.seq == 0:
            held.append(frames)
            return []
        return [(0.0, frames)] + ([(0.0, held.pop())] if held else [])
    return policy


DROP = lambda fr: []                                   # noqa: E731
TWICE = lambda fr: [(0.0, fr), (0.0, fr)]             # noqa: E731
GARBLE_HEADER = lambda fr: [(0.0, [b"\xc1" * 8, *fr[1:]])]  # noqa: E731


def misplace(frames):
    """The same BLOCKS message one position on (``first + 1``, modulo the pull's blocks), every
    checksum as sent (``reheader``): a header corrupted in a way that still parses."""
    return [(0.0, reheader(frames, first=(decode_header(frames[0]).first + 1) % len(SRC_IDS)))]


class Rig:
    """prefill <- proxy <- decode, with caches and release bookkeeping."""

    def __init__(self, policy=None, *, lease_s=10.0, peer_timeout_s=3.0, port=0):
        self.desc = make_desc(num_layers=3, num_blocks=12)
        self.src, self.dst = filled_caches(self.desc, 0), filled_caches(self.desc, 1)
        self.before = [c.clone() for c in self.dst]
        self.released = []
        self.lease_s = lease_s
        self.pre = self._prefill(port)
        self.proxy = FaultProxy(self.pre.endpoint, policy)
        self.dec = DecodeEndpoint(self.dst, self.desc, heartbeat_s=0.1, peer_timeout_s=peer_timeout_s)
        self.dec.connect(self.proxy.endpoint, timeout_s=5)

    def _prefill(self, port=0):
        return PrefillEndpoint(self.src, self.desc, port=port, chunk_bytes=1, lease_s=self.lease_s,
                               heartbeat_s=0.1, peer_timeout_s=1.0,
                               on_release=lambda t, ids, why: self.released.append((t, why)))

    def pull(self, tid="t", deadline_s=DEADLINE_S):
        self.pre.publish(tid, SRC_IDS)
        return self.dec.pull(tid, DST_IDS, deadline_s=deadline_s)

    def check_caches(self, handle):
        """Every (layer, dst block) is the source or untouched; unreported blocks are complete."""
        failed = set(handle.failed_block_ids if handle.error else [])
        for layer, (s, d, b) in enumerate(zip(self.src, self.dst, self.before)):
            s8, d8, b8 = (x.view(torch.uint8) for x in (s, d, b))
            for si, di in zip(SRC_IDS, DST_IDS):
                landed = torch.equal(d8[di], s8[si])
                assert landed or torch.equal(d8[di], b8[di]), f"layer {layer} block {di} corrupted"
                assert landed or di in failed, f"layer {layer} block {di} missing but not reported"
            for other in set(range(self.desc.num_blocks)) - set(DST_IDS):
                assert torch.equal(d8[other], b8[other]), f"layer {layer} block {other} written"

    def wait_released(self, timeout_s=5.0, n_released=1):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:  # the lease leaves held() once on_release has run
            ps, ds = self.pre.stats(), self.dec.stats()
            if ps["leases"] == 0 and ps["streams"] == 0 and ds["pending"] == 0 \
                    and len(self.released) >= n_released:
                break
            time.sleep(0.02)
        ps, ds = self.pre.stats(), self.dec.stats()
        assert (ps["leases"], ps["streams"], ds["pending"]) == (0, 0, 0), (ps, ds)
        end = time.monotonic() + timeout_s  # zero-copy buffers: ZeroMQ lets go of every one
        while any(t is not None and not t.done for _, t in self.pre._pool._free) and time.monotonic() < end:
            time.sleep(0.02)
        assert all(t is None or t.done for _, t in self.pre._pool._free)
        pool = self.pre._pool
        assert pool.free_bytes == sum(b.numel() for b, _ in pool._free) <= pool.max_free_bytes

    def close(self):
        self.dec.close()
        self.proxy.close()
        self.pre.close()


# id -> (policy factory, rig kwargs, expected error or None, expected release reason, extra check)
MATRIX = {
    "drop-blocks": (lambda: nth(MsgType.BLOCKS, "down", 2, DROP), {}, TransferTimeoutError, "aborted"),
    "drop-pull": (lambda: nth(MsgType.PULL, "up", 0, DROP), {}, TransferTimeoutError, "aborted"),
    "drop-ack": (lambda: nth(MsgType.ACK, "up", 0, DROP), {"lease_s": 2.5}, None, "expired"),
    "duplicate-blocks": (lambda: nth(MsgType.BLOCKS, "down", "all", TWICE), {}, None, "acked"),
    "duplicate-ack": (lambda: nth(MsgType.ACK, "up", 0, TWICE), {}, None, "acked"),
    "delay-within-deadline": (lambda: nth(MsgType.BLOCKS, "down", 3, lambda fr: [(0.4, fr)]), {}, None, "acked"),
    "delay-past-deadline": (lambda: nth(MsgType.BLOCKS, "down", 0, lambda fr: [(DEADLINE_S + 0.5, fr)]), {},
                            TransferTimeoutError, "aborted"),
    "reorder": (swap_first_two_blocks, {}, None, "acked"),
    "truncate": (lambda: nth(MsgType.BLOCKS, "down", 4, lambda fr: [(0.0, truncate(fr))]), {},
                 CorruptFrameError, "aborted"),
    "corrupt-payload": (lambda: nth(MsgType.BLOCKS, "down", 5, lambda fr: [(0.0, corrupt(fr))]), {},
                        CorruptFrameError, "aborted"),
    "corrupt-header": (lambda: nth(MsgType.BLOCKS, "down", 1, GARBLE_HEADER), {}, TransferTimeoutError, "aborted"),
    "misplaced-header": (lambda: nth(MsgType.BLOCKS, "down", 1, misplace), {}, CorruptFrameError, "aborted"),
}


@pytest.mark.parametrize("case", list(MATRIX), ids=list(MATRIX))
def test_message_fault(case):
    make_policy, kw, err, reason = MATRIX[case]
    rig = Rig(make_policy(), **kw)
    try:
        t0 = time.monotonic()
        h = rig.pull()
        e = h.exception(timeout=DEADLINE_S + 3)
        elapsed = time.monotonic() - t0
        if err is None:
            assert e is None, f"{case}: expected success, got {e!r}"
        else:
            assert isinstance(e, err), f"{case}: expected {err.__name__}, got {e!r}"
            assert elapsed < DEADLINE_S + 1.0, f"{case}: error after {elapsed:.2f} s"
        rig.check_caches(h)
        rig.wait_released(timeout_s=kw.get("lease_s", 0) + 3)
        assert rig.released == [("t", reason)]
        ds = rig.dec.stats()
        if case == "duplicate-blocks":
            assert ds["ignored"].get("duplicate", 0) >= 1
        if case == "duplicate-ack":  # the copy may be handled just after the lease ended
            end = time.monotonic() + 2
            while not rig.pre.stats()["ignored"].get("duplicate_acked") and time.monotonic() < end:
                time.sleep(0.02)
            assert rig.pre.stats()["ignored"].get("duplicate_acked") == 1
        if case == "delay-past-deadline":  # the late frames arrive after the failure: ignored
            end = time.monotonic() + 2
            while not ds["ignored"].get("late") and time.monotonic() < end:
                time.sleep(0.05)
                ds = rig.dec.stats()
            assert ds["ignored"].get("late", 0) >= 1
        # the endpoint survives the fault: a clean transfer still works afterwards
        rig.proxy.policy = lambda d, hd, fr: [(0.0, fr)]
        rig.before = [c.clone() for c in rig.dst]
        h2 = rig.pull("t2", deadline_s=5)
        h2.result(timeout=6)
        rig.check_caches(h2)
    finally:
        rig.close()


def _slow_blocks(gap_s):
    """Policy: BLOCKS messages leave the proxy one per ``gap_s`` (a slow link)."""
    next_at = [0.0]

    def policy(d, h, fr):
        if h is None or h.type != MsgType.BLOCKS:
            return [(0.0, fr)]
        now = time.monotonic()
        delay = max(0.0, next_at[0] - now)
        next_at[0] = now + delay + gap_s
        return [(delay, fr)]
    return policy


def test_kill_link_mid_transfer():
    """Link cut after the first layer: decode times out on silence, prefill's lease expires."""
    rig = Rig(_slow_blocks(0.05), lease_s=2.0, peer_timeout_s=0.6)
    try:
        h = rig.pull(deadline_s=10)
        assert h.wait_layer(0, timeout=5)
        rig.proxy.kill()
        t0 = time.monotonic()
        e = h.exception(timeout=5)
        assert isinstance(e, TransferTimeoutError) and "silent" in str(e)
        assert time.monotonic() - t0 < 0.6 + 0.5  # peer_timeout_s + tick slack
        assert e.failed_block_ids  # the later layers did not land
        rig.check_caches(h)
        rig.wait_released(timeout_s=4)
        assert rig.released == [("t", "expired")]  # the ABORT could not pass; the lease ran out
    finally:
        rig.close()


def test_kill_prefill_mid_transfer():
    rig = Rig(_slow_blocks(0.05), peer_timeout_s=0.6)
    try:
        h = rig.pull(deadline_s=10)
        assert h.wait_layer(0, timeout=5)
        rig.proxy.kill()                         # the process dies with its unsent messages
        rig.pre.close()
        rig.proxy.revive(new_connection=True)
        e = h.exception(timeout=5)
        assert isinstance(e, TransferTimeoutError)
        rig.check_caches(h)
        assert rig.dec.stats()["pending"] == 0
    finally:
        rig.dec.close()
        rig.proxy.close()


def test_restart_prefill_mid_transfer():
    """The prefill process restarts on the same port with the transfer re-published (its
    unsent messages lost): the pull resumes and completes byte exact."""
    rig = Rig(_slow_blocks(0.05), peer_timeout_s=3.0)
    try:
        h = rig.pull(deadline_s=4)
        assert h.wait_layer(0, timeout=5)
        port = rig.pre.port
        rig.proxy.kill()                         # the process dies with its unsent messages
        rig.pre.close()
        rig.pre = rig._prefill(port)
        rig.pre.publish("t", SRC_IDS)
        rig.proxy.revive(new_connection=True)
        e = h.exception(timeout=6)
        # the new process answers the decode side's PING with HANDSHAKE_REQUIRED; decode
        # re-handshakes and re-sends its PULL; positions already landed come again as duplicates
        assert e is None, repr(e)
        rig.check_caches(h)
        assert rig.dec.stats()["ignored"].get("duplicate", 0) >= 1
        rig.wait_released()
        assert rig.released[-1] == ("t", "acked")
    finally:
        rig.close()


def test_slow_consumer_does_not_stall_other_peers():
    """One decode peer stops reading for 1 s; another peer of the same prefill is unaffected."""
    rig = Rig(peer_timeout_s=3.0)
    fast_dst = filled_caches(rig.desc, 2)
    try:
        with DecodeEndpoint(fast_dst, rig.desc) as fast:
            fast.connect(rig.pre.endpoint, timeout_s=5)
            rig.proxy.stall_down = True
            slow = rig.pull("slow", deadline_s=10)
            time.sleep(0.1)
            rig.pre.publish("fast", SRC_IDS)
            t0 = time.monotonic()
            fast.pull("fast", DST_IDS, deadline_s=5).result(timeout=6)
            fast_s = time.monotonic() - t0
            assert not slow.done()
            time.sleep(max(0.0, 1.0 - fast_s))
            rig.proxy.stall_down = False
            slow.result(timeout=10)
            assert fast_s < 0.9, f"fast peer took {fast_s:.2f} s while the slow one stalled"
            for s, d in zip(rig.src, fast_dst):
                for si, di in zip(SRC_IDS, DST_IDS):
                    assert torch.equal(s.view(torch.uint8)[si], d.view(torch.uint8)[di])
        rig.check_caches(slow)
        rig.wait_released(n_released=2)
        assert sorted(rig.released) == [("fast", "acked"), ("slow", "acked")]
    finally:
        rig.close()
