"""The decode side's landing threads (``kvconnector.landing.Lander``) driven directly, on CPU:
the launcher starts message k+1 (pinned buffer taken, host copies submitted to the copy workers)
before it queues message k's verify + scatter; the pinned buffers held stay within
``max_inflight`` and none is reused while a (fake) event says the device still reads it, without
deadlock when the bound is reached; a started message whose pull died is dropped before its
device work and its buffer goes back only once its copies ended; a corrupted frame in a
pipelined message fails it with CorruptFrameError and writes nothing of it, while the messages
around it land byte-exact; ``close`` lands what is queued. ``HostFill.run`` queues one device
copy for the pieces the workers copied ahead, one per piece for those it copies itself. Messages
of one pull waiting together are verified + scattered in one pass where their payloads continue
one another (a mismatch leaves the whole pass unwritten), also when the landing thread keeps up
with messages handed over one at a time (the open group waits ``linger_s`` for the next one; the
stream's ``last`` message closes it at once); a pass whose pull died before it was queued is
dropped unverified, its buffers handed back only after its device copies.

The copy workers are a thread pool wrapped to log (and, where a test needs it, hold back) each
piece's copy; the device kernels are their plain-PyTorch twin (``kvconnector.testing.frame_ops``,
checked against the kernels in test_transfer_device_path.py); device events are faked through
the ``_record`` seam.

Run: python -m pytest tests/test_landing.py -q
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvconnector.landing as landing_mod
from connector_fakes import GatedEvent, filled_caches, make_desc, until
from kvconnector.device_frames import HostFill
from kvconnector.landing import Lander, LandJob
from kvconnector.protocol import MIX64, Header, MsgType
from kvconnector.staging import PinnedPool
from kvconnector.testing.frame_ops import TORCH_FRAME_OPS
from layouts import CorruptFrameError, KVQuantMode

pytestmark = pytest.mark.timeout(60)
DESC = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_kv_heads=2, block_size=4, num_layers=2, num_blocks=16)


def _b(c):
    return c.view(torch.uint8)


class _Msg:
    """One BLOCKS message of blocks ``src_ids`` of layer ``layer`` for destination blocks ``dst_ids``,
    its payload in two frames (mix64 sums in the header); ``corrupt``: one payload byte flipped after
    the sums were taken."""

    def __init__(self, src, layer, src_ids, dst_ids, corrupt=False):
        total = len(src_ids) * DESC.block_bytes
        nbytes = [total // 3, total - total // 3]
        payload, sums = torch.empty(total, dtype=torch.uint8), torch.empty(2, dtype=torch.int64)
        TORCH_FRAME_OPS.gather([src[layer]], torch.tensor(src_ids), out=payload, checksums=sums,
                               frame_nbytes=nbytes)
        if corrupt:
            payload[nbytes[0] + 7] ^= 0x20
        raw = payload.numpy().tobytes()
        self.frames = [raw[:nbytes[0]], raw[nbytes[0]:]]
        self.h = Header(MsgType.BLOCKS, tid="t", layer=layer, nblk=len(src_ids), heads=(0, 2), sum=MIX64)
        self.h.nbytes, self.h.checksums = nbytes, [int(v) & ((1 << 64) - 1) for v in sums]
        self.layer, self.src_ids, self.dst_ids = layer, src_ids, dst_ids

    def owns(self, piece) -> bool:
        return any(np.shares_memory(piece, np.frombuffer(f, dtype=np.uint8)) for f in self.frames)

    def job(self, dst, pull) -> LandJob:
        return LandJob(pull, self.h, list(self.frames), None, False, [dst[self.layer]],
                       torch.tensor(self.dst_ids), range(2))


def _messages(src, n, corrupt_idx=None):
    """``n`` messages, message i: source blocks (i, i + 8) of layer i % 2 to destination (2i, 2i + 1)."""
    return [_Msg(src, i % 2, [i, i + 8], [2 * i, 2 * i + 1], corrupt=i == corrupt_idx) for i in range(n)]


class _Workers:
    """Copy workers that log each submitted piece as ("copy", message index) and run it on a real
    thread pool once the message's gate (``gates[i]``, open unless a test closes it) is set."""

    def __init__(self, msgs, log):
        self.msgs, self.log = msgs, log
        self.gates = [threading.Event() for _ in msgs]
        for g in self.gates:
            g.set()
        self.copied = [0] * len(msgs)          # pieces of each message copied so far
        self._pool = ThreadPoolExecutor(2)

    def submit(self, fn, dst, piece):
        i = next(i for i, m in enumerate(self.msgs) if m.owns(piece))
        self.log.append(("copy", i))

        def copy():
            assert self.gates[i].wait(20), "gate never opened"
            fn(dst, piece)
            self.copied[i] += 1
        return self._pool.submit(copy)

    def shutdown(self):
        for g in self.gates:
            g.set()
        self._pool.shutdown(wait=True)


class _Landing:
    """A Lander on CPU caches with logging workers and ops: ``log`` gets ("copy", i) per piece
    submitted and ("verify", i) per verify + scatter call; ``results[i]`` the reported error (or None)."""

    def __init__(self, msgs, dst, *, pool=None, max_inflight=4, lookahead=1, alive=None, **lander_kw):
        self.msgs, self.log, self.results = msgs, [], {}
        self.all_reported = threading.Event()
        self.workers = _Workers(msgs, self.log)
        self.pool = pool or PinnedPool()
        self.hold = threading.Event()       # the launcher waits in its first alive() call until set
        ops = SimpleNamespace(verify_scatter=self._verify)
        self.lander = Lander(ops, None, self.pool, self._report, self._alive, max_inflight=max_inflight,
                             piece_bytes=300, executor=self.workers, workers=2, lookahead=lookahead, **lander_kw)
        self._alive_fn = alive or (lambda job: True)
        self.jobs = [m.job(dst, SimpleNamespace(idx=i)) for i, m in enumerate(msgs)]

    def _alive(self, job):
        assert self.hold.wait(20)
        return self._alive_fn(job)

    def _verify(self, staging, expected, caches, block_ids, **kw):
        i = next(i for i, m in enumerate(self.msgs) if block_ids.tolist() == m.dst_ids)
        self.log.append(("verify", i))
        TORCH_FRAME_OPS.verify_scatter(staging, expected, caches, block_ids, **kw)

    def _report(self, done):
        for job, err in done:
            self.results[job.p.idx] = err
        if len(self.results) == len(self.msgs):
            self.all_reported.set()

    def submit_all(self):
        for job in self.jobs:
            self.lander.submit(job)
        self.hold.set()      # every message is queued before the launcher takes the first

    def close(self):
        self.lander.close()
        self.workers.shutdown()


def _assert_landed(msgs, src, dst, before, bad=()):
    for i, m in enumerate(msgs):
        want = before[m.layer] if i in bad else src[m.layer]
        ids = m.dst_ids if i in bad else m.src_ids
        assert torch.equal(_b(dst[m.layer])[m.dst_ids], _b(want)[ids]), f"message {i}"


@pytest.mark.parametrize("lookahead", [1, 2], ids=["lookahead1", "lookahead2"])
def test_next_message_is_copied_while_this_one_launches(lookahead):
    """With messages queued, the launcher submits message k+1's (and with lookahead 2, k+2's)
    host copies before it calls message k's verify + scatter; ``close`` lands every queued
    message, byte-exact, in arrival order."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    msgs = _messages(src, 6)
    t = _Landing(msgs, dst, lookahead=lookahead, max_inflight=8)   # buffers to spare: only lookahead decides
    t.submit_all()
    t.close()
    log = t.log
    assert [i for kind, i in log if kind == "verify"] == list(range(6))
    for k in range(6):
        ahead = min(k + lookahead, 5)
        assert log.index(("copy", ahead)) < log.index(("verify", k)), (k, log)
    assert t.results == {i: None for i in range(6)}
    _assert_landed(msgs, src, dst, None)


class _BoundedPool(PinnedPool):
    """A pinned pool that checks, per buffer, that the messages hold at most ``bound`` buffers and
    that none comes back before the event of the message that used it (messages take buffers and
    record events in the same order, nothing failing here) has passed."""

    def __init__(self, events, bound):
        super().__init__()
        self.events, self.bound = events, bound
        self.held, self.acquired, self.early, self.over = {}, [], [], []

    def acquire(self, nbytes):
        buf = super().acquire(nbytes)
        base = buf._base if buf._base is not None else buf
        self.held[base.data_ptr()] = len(self.acquired)
        self.acquired.append(base.data_ptr())
        if len(self.held) > self.bound:
            self.over.append(len(self.held))
        return buf

    def release(self, buf):
        base = buf._base if buf._base is not None else buf
        idx = self.held.pop(base.data_ptr())
        if idx >= len(self.events) or not self.events[idx].query():
            self.early.append(idx)
        super().release(buf)


@pytest.mark.parametrize("bound", ["messages", "bytes"])
def test_pool_bound_holds_without_deadlock(monkeypatch, bound):
    """With room for two messages in flight (``max_inflight`` 2, or ``max_inflight_bytes`` of two
    and a half messages), lookahead 1 and every device event held: the launcher lands two
    messages and then waits (the third is neither started nor launched: two buffers are the
    device's); releasing the first event lets the third start, in the first one's buffer. At no
    point do messages hold more than two buffers, and no buffer goes back before its event passed."""
    events = []

    def record(stream):
        events.append(GatedEvent())
        return events[-1]
    monkeypatch.setattr(landing_mod, "_record", record)
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    msgs = _messages(src, 6)
    pool = _BoundedPool(events, bound=2)
    room = dict(max_inflight=2) if bound == "messages" else \
        dict(max_inflight=64, max_inflight_bytes=sum(msgs[0].h.nbytes) * 5 // 2)
    t = _Landing(msgs, dst, pool=pool, **room)
    try:
        t.submit_all()
        assert until(lambda: len(events) == 2), "two messages landed"
        time.sleep(0.2)
        assert len(events) == 2 and len(pool.acquired) == 2 and ("copy", 2) not in t.log
        events[0].gate.set()
        assert until(lambda: len(pool.acquired) == 3), "the third started once the first ended"
        assert pool.acquired[2] == pool.acquired[0]
        while not t.all_reported.is_set():
            for ev in list(events):
                ev.gate.set()
            time.sleep(0.01)
    finally:
        for ev in events:
            ev.gate.set()
        t.close()
    assert t.results == {i: None for i in range(6)}
    assert not pool.early and not pool.over and not pool.held
    _assert_landed(msgs, src, dst, None)


def test_started_message_of_a_dead_pull_waits_for_its_copies():
    """Message 1's pull dies after the launcher started it (its copies submitted, held back):
    it is dropped before its verify + scatter, its buffer goes back only once its copies have
    ended, its future is set then, nothing is reported for it and its destination is untouched;
    message 0 lands."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    msgs = _messages(src, 2)
    calls = {0: 0, 1: 0}

    def alive(job):    # message 1's pull is pending when it starts, gone when it would land
        calls[job.p.idx] += 1
        return job.p.idx == 0 or calls[1] == 1

    released = []

    class Pool(PinnedPool):
        def release(self, buf):
            released.append(list(t.workers.copied))
            super().release(buf)
    t = _Landing(msgs, dst, pool=Pool(), alive=alive)
    t.workers.gates[1].clear()
    try:
        t.submit_all()
        assert until(lambda: 0 in t.results and calls[1] == 2), "message 0 landed, message 1 found dead"
        time.sleep(0.2)
        assert ("copy", 1) in t.log and not t.jobs[1].future.done()
        assert len(released) == 1            # message 0's buffer only
        t.workers.gates[1].set()
        t.jobs[1].future.result(timeout=20)
    finally:
        t.close()
    n1 = sum(1 for e in t.log if e == ("copy", 1))
    assert released[1][1] == n1 > 1          # handed back after all of message 1's pieces were copied
    assert ("verify", 1) not in t.log and t.results == {0: None}
    _assert_landed(msgs[:1], src, dst, None)
    assert torch.equal(_b(dst[1])[msgs[1].dst_ids], _b(before[1])[msgs[1].dst_ids])


@pytest.mark.parametrize("lookahead", [1, 2], ids=["lookahead1", "lookahead2"])
def test_corrupt_pipelined_message_fails_alone(lookahead):
    """Message 2 of 5 has a flipped byte in its second frame: it is reported with a
    CorruptFrameError naming that frame, its destination blocks are untouched, and messages 0, 1,
    3, 4, started and copied around it, land byte-exact."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    msgs = _messages(src, 5, corrupt_idx=2)
    t = _Landing(msgs, dst, lookahead=lookahead, max_inflight=8)
    t.submit_all()
    t.close()
    assert t.log.index(("copy", 3)) < t.log.index(("verify", 2))     # pipelined
    assert isinstance(t.results[2], CorruptFrameError)
    assert "payload frame 1 checksum (mix64" in str(t.results[2])
    assert {i: e for i, e in t.results.items() if i != 2} == {i: None for i in (0, 1, 3, 4)}
    _assert_landed(msgs, src, dst, before, bad={2})


@pytest.mark.parametrize("ahead", [True, False], ids=["copied-ahead", "copied-in-run"])
def test_host_fill_device_copies(monkeypatch, ahead):
    """``HostFill.run`` puts the payload, byte-exact, into the staging buffer (a CPU stand-in for
    the device one): the pieces the workers copied before it ran go in one copy; pieces the run
    copies itself go one copy each, right behind each piece (their DMA overlaps the next copy)."""
    msg = _Msg(filled_caches(DESC, 0), 0, [1, 5, 9], [0, 1, 2])
    total = sum(msg.h.nbytes)
    host, staging = torch.zeros(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
    pool = ThreadPoolExecutor(2)
    fill = HostFill(host, msg.frames, msg.h.nbytes, 256, pool if ahead else None)
    fill.wait()
    copies, copy_ = [], torch.Tensor.copy_

    def logged(dst, src, *a, **k):
        if dst.untyped_storage().data_ptr() == staging.untyped_storage().data_ptr():
            copies.append(dst.numel())
        return copy_(dst, src, *a, **k)
    monkeypatch.setattr(torch.Tensor, "copy_", logged)
    fill.run(staging)
    pool.shutdown()
    assert len(fill.pieces) > 2
    assert copies == ([total] if ahead else [b - a for a, b, _ in fill.pieces])
    assert staging.numpy().tobytes() == b"".join(msg.frames) == host.numpy().tobytes()


def _pull_msg(src, layer, nlay, first, nblk, src_ids, corrupt=False):
    """A one-frame BLOCKS message of layers ``layer .. layer + nlay - 1`` x positions ``first ..
    first + nblk - 1`` of a pull whose source blocks are ``src_ids`` (layer-major payload)."""
    ids = torch.tensor(src_ids[first:first + nblk])
    payload = torch.empty(nlay * nblk * DESC.block_bytes, dtype=torch.uint8)
    sums = torch.empty(1, dtype=torch.int64)
    TORCH_FRAME_OPS.gather(src[layer:layer + nlay], ids, out=payload, checksums=sums)
    if corrupt:
        payload[3] ^= 0x01
    h = Header(MsgType.BLOCKS, tid="t", layer=layer, nlay=nlay, first=first, nblk=nblk, heads=(0, 2), sum=MIX64)
    h.nbytes, h.checksums = [payload.numel()], [int(sums[0]) & ((1 << 64) - 1)]
    return h, payload


@pytest.mark.parametrize("corrupt", [None, 1], ids=["all-match", "middle-corrupt"])
def test_messages_waiting_together_are_verified_in_one_pass(corrupt):
    """Messages of one pull queued together are staged back to back and verified + scattered in
    one call when their payloads follow each other in the pull's layer-major payload: three runs of
    positions of layer 0, then the first run of layer 1 (across the layer boundary), in one pass
    over every layer and the pull's blocks from cell 0; a message of another pull, and the next
    run of the first pull after it, each in their own. Every block lands byte-exact; with one
    flipped byte in the second message, its whole pass is reported with that CorruptFrameError
    (naming it) and writes nothing, while the passes around it land."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    src_ids, dst_ids = [3, 9, 1, 12, 7, 0, 5, 14], [2, 4, 6, 8, 10, 11, 13, 15]
    pull_a, pull_b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    dst_a = torch.tensor(dst_ids)
    plan = [(pull_a, 0, 1, 0, 2), (pull_a, 0, 1, 2, 2), (pull_a, 0, 1, 4, 4), (pull_a, 1, 1, 0, 3),
            (pull_b, 0, 1, 0, 1), (pull_a, 1, 1, 3, 1)]     # the last: pull a again, does not continue b
    calls, reports, hold = [], [], threading.Event()

    def verify(staging, expected, caches, block_ids, **kw):
        calls.append((len(caches), block_ids.tolist(), expected.numel(), kw.get("start")))
        TORCH_FRAME_OPS.verify_scatter(staging, expected, caches, block_ids, **kw)
    lander = Lander(SimpleNamespace(verify_scatter=verify), None, PinnedPool(), reports.extend,
                    lambda job: hold.wait(20), whole_bytes=0)    # these pulls are never whole: no whole-pull groups
    jobs = []
    for i, (p, layer, nlay, first, nblk) in enumerate(plan):
        s_ids = [11, 2, 4, 6, 8, 10, 13, 15] if p is pull_b else src_ids
        h, payload = _pull_msg(src, layer, nlay, first, nblk, s_ids, corrupt=i == corrupt)
        d_ids = torch.tensor([1]) if p is pull_b else dst_a
        jobs.append(LandJob(p, h, [payload.numpy().tobytes()], None, False, dst[layer:layer + nlay],
                            d_ids[first:first + nblk], range(2), layers=dst, pull_ids=d_ids))
    for job in jobs:
        lander.submit(job)
    hold.set()
    lander.close()
    assert calls == [(2, dst_ids, 4, 0), (2, [1], 1, 0), (2, dst_ids, 1, 11)]   # 3 passes, the first of 4 messages
    got = {id(job): err for job, err in reports}
    assert len(got) == len(jobs) and all(job.future.done() for job in jobs)
    if corrupt is None:
        assert all(e is None for e in got.values())
        assert torch.equal(_b(dst[0])[dst_ids], _b(src[0])[src_ids])
        assert torch.equal(_b(dst[1])[dst_ids[:4]], _b(src[1])[src_ids[:4]])
        assert torch.equal(_b(dst[1])[dst_ids[4:]], _b(before[1])[dst_ids[4:]])      # not sent
    else:
        errs = [got[id(j)] for j in jobs[:4]]
        assert all(isinstance(e, CorruptFrameError) for e in errs)
        assert "layer 0 payload frame 0 checksum (mix64" in str(errs[0]) and "3 other message(s)" in str(errs[0])
        assert torch.equal(_b(dst[0])[dst_ids], _b(before[0])[dst_ids])       # nothing of the pass written
        assert torch.equal(_b(dst[1])[dst_ids[:3]], _b(before[1])[dst_ids[:3]])
        assert got[id(jobs[4])] is None and got[id(jobs[5])] is None           # the passes around it land
        assert torch.equal(_b(dst[1])[[dst_ids[3]]], _b(src[1])[[src_ids[3]]])
    assert torch.equal(_b(dst[0])[[1]], _b(src[0])[[11]])


def test_group_of_a_pull_that_died_before_its_verify_is_dropped_unwritten(monkeypatch):
    """Two staged messages of one pull whose pull dies before their verify + scatter is queued:
    nothing is verified or written, nothing reported, both futures are set and both pinned buffers
    are back in the pool once the group's (fake) event has passed, not before."""
    monkeypatch.setattr(landing_mod, "WHOLE_BYTES", 0)   # pulls too large to stage whole: runs of messages
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    src_ids, ids = [3, 9, 1, 12], torch.tensor([2, 4, 6, 8])
    reports, verified, events = [], [], []
    dead, hold = threading.Event(), threading.Event()
    monkeypatch.setattr(landing_mod, "_record", lambda stream: events.append(GatedEvent()) or events[-1])
    pool = PinnedPool()
    lander = Lander(SimpleNamespace(verify_scatter=lambda *a, **k: verified.append(1)), None, pool,
                    reports.extend, lambda job: hold.wait(20) and not dead.is_set())
    close = lander._close_group

    def close_after_death():       # the pull dies between the last stage and the verify
        if lander._group is not None:
            dead.set()
        close()
    lander._close_group = close_after_death
    jobs = []
    for first in (0, 2):
        h, payload = _pull_msg(src, 0, 1, first, 2, src_ids)
        jobs.append(LandJob(SimpleNamespace(), h, [payload.numpy().tobytes()], None, False, dst[:1],
                            ids[first:first + 2], range(2), layers=dst, pull_ids=ids))
    jobs[1].p = jobs[0].p          # one pull
    try:
        for job in jobs:
            lander.submit(job)
        hold.set()                 # both queued before the launcher takes the first: one group
        assert until(lambda: len(events) == 1)
        time.sleep(0.1)
        assert pool.outstanding == 2 and not any(j.future.done() for j in jobs)   # the device may still read them
        events[0].gate.set()
        assert until(lambda: all(j.future.done() for j in jobs) and pool.outstanding == 0)
    finally:
        for ev in events:
            ev.gate.set()
        lander.close()
    assert len(events) == 1 and not verified and not reports
    assert all(torch.equal(_b(d), _b(b)) for d, b in zip(dst, before))


@pytest.mark.parametrize("linger", [0.0, 30.0], ids=["no-linger", "linger"])
@pytest.mark.parametrize("ends", ["last-flag", "close"])
def test_a_landing_thread_that_keeps_up_still_verifies_in_groups(linger, ends, monkeypatch):
    """Four messages of one pull (two runs of two layers) handed over one at a time, each once the
    one before is staged (a landing thread that keeps up with the socket): with no linger each is
    verified alone; with one the group waits for the next message and the four are verified in one
    pass, queued as soon as the message marked ``last`` is staged (not after the 30 s linger), or,
    without the mark, when the lander closes. Every block lands byte-exact either way."""
    monkeypatch.setattr(landing_mod, "WHOLE_BYTES", 0)   # pulls too large to stage whole: runs of messages
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    src_ids, dst_ids = [3, 9, 1, 12], [2, 4, 6, 8]
    ids, pull = torch.tensor(dst_ids), SimpleNamespace()
    calls, reports = [], []

    def verify(staging, expected, caches, block_ids, **kw):
        calls.append(expected.numel())
        TORCH_FRAME_OPS.verify_scatter(staging, expected, caches, block_ids, **kw)
    lander = Lander(SimpleNamespace(verify_scatter=verify), None, PinnedPool(), reports.extend, lambda job: True,
                    linger_s=linger)
    plan = [(0, 0), (0, 2), (1, 0), (1, 2)]          # (layer, first position), two blocks each
    try:
        for i, (layer, first) in enumerate(plan):
            h, payload = _pull_msg(src, layer, 1, first, 2, src_ids)
            h.last = ends == "last-flag" and i == len(plan) - 1
            lander.submit(LandJob(pull, h, [payload.numpy().tobytes()], None, False, dst[layer:layer + 1],
                                  ids[first:first + 2], range(2), layers=dst, pull_ids=ids))
            assert until(lambda: lander.stage_s["messages"] == i + 1)
            if linger == 0:
                assert until(lambda: lander.stage_s["groups"] == i + 1)     # verified before the next comes
        if linger and ends == "last-flag":
            assert until(lambda: len(reports) == 4, timeout_s=10)
        elif linger:
            time.sleep(0.1)
            assert lander.stage_s["groups"] == 0 and not reports            # still open, waiting for more
    finally:
        lander.close()
    assert calls == ([1, 1, 1, 1] if linger == 0 else [4])
    assert len(reports) == 4 and all(err is None for _, err in reports)
    for layer in range(2):
        assert torch.equal(_b(dst[layer])[dst_ids], _b(src[layer])[src_ids])


def _whole_pull(plan, corrupt=None, alive=lambda job: True, **kw):
    """Land the messages ``plan`` [(layer, nlay, first, nblk)] of one pull of 8 blocks x 2 layers,
    in that order; returns (verify calls (frames, start), reports, src, dst before, dst)."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    src_ids, dst_ids = [3, 9, 1, 12, 7, 0, 5, 14], torch.tensor([2, 4, 6, 8, 10, 11, 13, 15])
    calls, reports, pull = [], [], SimpleNamespace(name="p")

    def verify(staging, expected, caches, block_ids, **k):
        calls.append((expected.numel(), k.get("start")))
        TORCH_FRAME_OPS.verify_scatter(staging, expected, caches, block_ids, **k)
    lander = Lander(SimpleNamespace(verify_scatter=verify), None, PinnedPool(), reports.extend, alive, **kw)
    jobs = []
    for i, (layer, nlay, first, nblk) in enumerate(plan):
        h, payload = _pull_msg(src, layer, nlay, first, nblk, src_ids, corrupt=i == corrupt)
        jobs.append(LandJob(pull, h, [payload.numpy().tobytes()], None, False, dst[layer:layer + nlay],
                            dst_ids[first:first + nblk], range(2), layers=dst, pull_ids=dst_ids))
    for job in jobs:
        lander.submit(job)
    assert until(lambda: len(reports) == len(jobs), 10)
    lander.close()
    assert all(job.future.done() for job in jobs)
    return calls, reports, src, before, dst, src_ids, dst_ids.tolist()


@pytest.mark.parametrize("corrupt", [None, 2], ids=["all-match", "one-corrupt"])
def test_a_small_pull_in_any_order_is_staged_whole_and_verified_in_one_pass(corrupt):
    """The four messages of a pull under ``whole_bytes``, arriving out of order (as lanes deliver
    them), are each copied to their place in the pull's staging buffer and verified + scattered in
    one pass once the last is in: every block byte exact; one flipped byte fails all four with
    that CorruptFrameError and writes nothing."""
    plan = [(1, 1, 4, 4), (0, 1, 0, 4), (1, 1, 0, 4), (0, 1, 4, 4)]   # cells 12-16, 0-4, 8-12, 4-8
    calls, reports, src, before, dst, src_ids, dst_ids = _whole_pull(plan, corrupt, linger_s=5.0)
    assert calls == [(4, 0)]                      # one pass, the four frames in payload order, from cell 0
    errs = [e for _, e in reports]
    if corrupt is None:
        assert errs == [None] * 4
        for layer in range(2):
            assert torch.equal(_b(dst[layer])[dst_ids], _b(src[layer])[src_ids])
    else:
        assert all(isinstance(e, CorruptFrameError) for e in errs)
        assert all(torch.equal(_b(d), _b(b)) for d, b in zip(dst, before))


def test_a_whole_pull_whose_last_message_does_not_come_is_verified_by_runs():
    """Three of four messages of a small pull (cells 0-4, 4-8 and 12-16), then nothing for
    ``linger_s``: the two runs that follow each other in the payload are verified in two passes
    (0-8, 12-16) and land; the missing message's blocks stay untouched."""
    plan = [(1, 1, 4, 4), (0, 1, 4, 4), (0, 1, 0, 4)]
    calls, reports, src, before, dst, src_ids, dst_ids = _whole_pull(plan, linger_s=0.01)
    assert sorted(calls, key=lambda c: c[1]) == [(2, 0), (1, 12)]
    assert [e for _, e in reports] == [None] * 3
    assert torch.equal(_b(dst[0])[dst_ids], _b(src[0])[src_ids])
    assert torch.equal(_b(dst[1])[dst_ids[4:]], _b(src[1])[src_ids[4:]])
    assert torch.equal(_b(dst[1])[dst_ids[:4]], _b(before[1])[dst_ids[:4]])


def test_a_whole_pull_that_died_is_dropped_unwritten():
    """Messages of a small pull whose pull dies before the rest come: nothing verified or written,
    every future set (nothing reported: the pull failed already)."""
    src, dst = filled_caches(DESC, 0), filled_caches(DESC, 1)
    before = [c.clone() for c in dst]
    dead, calls, reports = threading.Event(), [], []
    lander = Lander(SimpleNamespace(verify_scatter=lambda *a, **k: calls.append(1)), None, PinnedPool(),
                    reports.extend, lambda job: not dead.is_set(), linger_s=5.0)
    ids = torch.arange(8)
    jobs = []
    for layer in range(2):
        h, payload = _pull_msg(src, layer, 1, 0, 4, list(range(8)))
        jobs.append(LandJob(SimpleNamespace(), h, [payload.numpy().tobytes()], None, False, dst[layer:layer + 1],
                            ids[:4], range(2), layers=dst, pull_ids=ids))
    jobs[1].p = jobs[0].p
    for job in jobs:
        lander.submit(job)
    assert until(lambda: lander.stage_s["messages"] == 2, 10)
    dead.set()
    assert until(lambda: all(job.future.done() for job in jobs), 10)    # swept well before the 5 s linger ends
    lander.close()
    assert calls == [] and reports == []
    assert all(torch.equal(_b(d), _b(b)) for d, b in zip(dst, before))
