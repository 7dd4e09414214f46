"""Heterogeneous tensor parallelism: assembling KV heads across differently split workers.

Every (token, head) row carries its own scale, so heads move independently. Covers: a
decode worker holding all KV heads pulling each head slice from N prefill ranks (N = 2, 4)
into the same destination blocks, for every cache mode; the reverse (decode ranks holding
a slice, each pulling its heads out of one prefill worker holding all heads); partially
overlapping splits (decode [1, 3) from prefill ranks [0, 2) and [2, 4)); heads outside the
shared range refused locally and by the prefill side; and the layout rule of
``check_compatible`` against a brute-force statement of it, over every pair of head ranges,
on both sides of a real handshake for the refused ones. Assembled caches are compared byte
for byte with one full reference cache; heads that were not pulled stay untouched.

Run: python -m pytest tests/test_hetero_tp.py
"""

import itertools
import time

import pytest
import torch
import zmq

from connector_fakes import make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.protocol import ErrorCode, Header, MsgType, decode_header, encode_header
from layouts import KVQuantMode, LayoutError, LayoutMismatchError, PeerError, check_compatible

pytestmark = pytest.mark.timeout(60)
TOTAL = 4
MODES = [(KVQuantMode.NONE, "bf16"), (KVQuantMode.INT8_PER_TOKEN_HEAD, "int8"),
         (KVQuantMode.FP8_PER_TOKEN_HEAD, "fp8"), (KVQuantMode.INT4_PER_TOKEN_HEAD, "int4")]
SRC_IDS, DST_IDS = [5, 0, 3], [1, 6, 2]


def _desc(mode, lo, hi, num_blocks=8):
    return make_desc(mode, 32, num_kv_heads=hi - lo, block_size=4, num_layers=2, num_blocks=num_blocks,
                     head_start=lo, total_num_kv_heads=TOTAL)


def _full_reference(mode, seed=0):
    """One cache per layer holding all TOTAL heads, random bytes in every code and scale."""
    desc, g = _desc(mode, 0, TOTAL), torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(desc.num_layers):
        c = desc.geometry().new_cache(desc.num_blocks)
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        caches.append(c)
    return caches


def _slice(caches, lo, hi):
    """The head slice [lo, hi) of full caches, as a rank holding only those heads stores it."""
    return [c[:, :, :, lo:hi].contiguous() for c in caches]


def _heads_equal(a, b, dst_ids, src_ids):
    """Byte comparison (random bytes include NaN bit patterns, which never compare equal)."""
    u8 = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    return all(torch.equal(u8(x[d]), u8(y[s])) for x, y in zip(a, b) for d, s in zip(dst_ids, src_ids))


def _ranks(n):
    w = TOTAL // n
    return [(r * w, (r + 1) * w) for r in range(n)]


@pytest.mark.parametrize("n_ranks", [2, 4], ids=["tp2", "tp4"])
@pytest.mark.parametrize("mode,name", MODES, ids=[m[1] for m in MODES])
def test_full_decode_assembles_heads_from_n_prefill_ranks(mode, name, n_ranks):
    ref = _full_reference(mode, 0)
    dst = _full_reference(mode, 1)
    before = [c.clone() for c in dst]
    full = _desc(mode, 0, TOTAL)
    pres, decs = [], []
    try:
        for r, (lo, hi) in enumerate(_ranks(n_ranks)):
            pres.append(PrefillEndpoint(_slice(ref, lo, hi), _desc(mode, lo, hi)))
            dec = DecodeEndpoint(dst, full)           # one endpoint per peer, one shared cache
            assert dec.connect(pres[-1].endpoint) == range(lo, hi)
            decs.append(dec)
            pres[-1].publish("req", SRC_IDS)
        handles = [d.pull("req", DST_IDS, deadline_s=10) for d in decs]  # all ranks concurrently
        for h in handles:
            h.result(timeout=10)
        assert _heads_equal(dst, ref, DST_IDS, SRC_IDS)  # every head row, scales included
        others = [b for b in range(full.num_blocks) if b not in DST_IDS]
        assert _heads_equal(dst, before, others, others)
        end = time.monotonic() + 5  # each rank's lease ends when that rank's ACK arrives
        while any(p.held() for p in pres) and time.monotonic() < end:
            time.sleep(0.01)
        assert all(p.held() == [] for p in pres)
    finally:
        for e in decs + pres:
            e.close()


@pytest.mark.parametrize("mode,name", MODES, ids=[m[1] for m in MODES])
def test_decode_ranks_each_pull_their_slice_from_a_full_prefill(mode, name):
    ref = _full_reference(mode, 0)
    with PrefillEndpoint(ref, _desc(mode, 0, TOTAL)) as pre:
        for r, (lo, hi) in enumerate(_ranks(2)):
            dst = _slice(_full_reference(mode, 1), lo, hi)
            with DecodeEndpoint(dst, _desc(mode, lo, hi)) as dec:
                assert dec.connect(pre.endpoint) == range(lo, hi)
                pre.publish(f"req{r}", SRC_IDS)
                dec.pull(f"req{r}", DST_IDS, deadline_s=10).result(timeout=10)
            assert _heads_equal(dst, _slice(ref, lo, hi), DST_IDS, SRC_IDS)


def _until(cond, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


class _Ranks:
    """One prefill with all heads, its transfer published layer by layer with no layer written
    yet (so every pull waits inside it until :meth:`write_all`), and decode endpoints for the
    given head ranges, each over its own slice of a destination cache."""

    def __init__(self, ranges, pulls=None):
        self.mode = KVQuantMode.INT4_PER_TOKEN_HEAD
        self.ref = _full_reference(self.mode, 0)
        self.released = []
        self.pre = PrefillEndpoint(self.ref, _desc(self.mode, 0, TOTAL),
                                   on_release=lambda tid, ids, reason: self.released.append(reason))
        self.dsts, self.decs = [], []
        for lo, hi in ranges:
            dst = _slice(_full_reference(self.mode, 1), lo, hi)
            self.dsts.append((dst, [c.clone() for c in dst], lo, hi))
            self.decs.append(DecodeEndpoint(dst, _desc(self.mode, lo, hi)))
            self.decs[-1].connect(self.pre.endpoint)
        kw = {} if pulls is None else {"pulls": pulls}
        self.pre.publish("req", SRC_IDS, layers_ready=0, **kw)

    def pull(self, i):
        """Rank ``i`` pulls; returns once the prefill serves its pull or it has failed."""
        n = self.pre.stats()["transfers_started"]
        h = self.decs[i].pull("req", DST_IDS, deadline_s=10)
        assert _until(lambda: self.pre.stats()["transfers_started"] > n or h.done())
        return h

    def write_all(self):
        self.pre.publish_layers("req", 2)

    def exact(self, i):
        dst, _, lo, hi = self.dsts[i]
        return _heads_equal(dst, _slice(self.ref, lo, hi), DST_IDS, SRC_IDS)

    def untouched(self, i):
        dst, before, _, _ = self.dsts[i]
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst, before))

    def close(self):
        for e in self.decs + [self.pre]:
            e.close()


def test_decode_ranks_pull_one_transfer_published_for_two_pulls():
    """Two decode ranks pull their halves of one transfer id concurrently (``pulls=2``): both
    land byte exact, and the lease ends (once, ``acked``) only when both acknowledged."""
    r = _Ranks(_ranks(2), pulls=2)
    try:
        h0 = r.pull(0)
        h1 = r.pull(1)
        r.write_all()
        h0.result(timeout=10)
        assert r.exact(0)
        h1.result(timeout=10)
        assert r.exact(1)
        assert _until(lambda: r.released == ["acked"]) and r.pre.held() == []
    finally:
        r.close()


def test_a_third_head_range_beyond_pulls_fails_at_once():
    """A pull beyond what the transfer was published for fails at once with ``already_pulled``
    (not at its deadline), its destination untouched; the pulls it was published for complete."""
    r = _Ranks([(0, 2), (2, 4), (1, 3)], pulls=2)
    try:
        h0, h1 = r.pull(0), r.pull(1)
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="already_pulled: transfer 'req': published for 2 pull"):
            r.pull(2).result(timeout=10)
        assert time.monotonic() - t0 < 2 and r.untouched(2)
        r.write_all()
        h0.result(timeout=10), h1.result(timeout=10)
        assert r.exact(0) and r.exact(1)
    finally:
        r.close()


@pytest.mark.parametrize("ranges, loser, says", [
    (_ranks(2), 1, "published for 1 pull"),                                   # another rank: refused
    ([(0, 4), (0, 4)], 0, "a newer pull of the same heads took over")],        # the same heads: taken over
    ids=["second-rank", "same-heads"])
def test_a_second_pull_under_the_default_one_pull_fails_at_once(ranges, loser, says):
    """Published for one pull (the default), two peers pull: a second head range is refused, a
    second pull of the same heads takes over from the first; the pull left out fails at once
    (``already_pulled``), its blocks untouched, and the other completes."""
    r = _Ranks(ranges)
    try:
        hs = [r.pull(0), r.pull(1)]
        with pytest.raises(PeerError, match=f"already_pulled: transfer 'req': {says}"):
            hs[loser].result(timeout=2)
        r.write_all()
        hs[1 - loser].result(timeout=10)
        assert r.exact(1 - loser) and r.untouched(loser) and _until(lambda: r.released == ["acked"])
    finally:
        r.close()


def test_an_abort_from_one_rank_fails_the_others_at_once():
    r = _Ranks(_ranks(2), pulls=2)
    try:
        h0, h1 = r.pull(0), r.pull(1)
        r.decs[0].abort("req")
        with pytest.raises(PeerError, match="aborted: transfer 'req': aborted by another peer"):
            h1.result(timeout=2)
        with pytest.raises(PeerError):
            h0.result(timeout=2)
        assert r.untouched(0) and r.untouched(1) and _until(lambda: r.released == ["aborted"])
    finally:
        r.close()


def test_partially_overlapping_splits_and_a_subset_of_heads():
    """decode [1, 3) takes head 1 from prefill [0, 2) and head 2 from prefill [2, 4); a full
    decode pulling only head 3 leaves heads 0-2 of its blocks untouched."""
    mode = KVQuantMode.INT4_PER_TOKEN_HEAD
    ref = _full_reference(mode, 0)
    dst = _slice(_full_reference(mode, 1), 1, 3)
    pres = [PrefillEndpoint(_slice(ref, lo, hi), _desc(mode, lo, hi)) for lo, hi in _ranks(2)]
    decs = [DecodeEndpoint(dst, _desc(mode, 1, 3)) for _ in pres]
    try:
        assert [d.connect(p.endpoint) for d, p in zip(decs, pres)] == [range(1, 2), range(2, 3)]
        for p in pres:
            p.publish("req", SRC_IDS)
        for h in [d.pull("req", DST_IDS, deadline_s=10) for d in decs]:
            h.result(timeout=10)
        assert _heads_equal(dst, _slice(ref, 1, 3), DST_IDS, SRC_IDS)
    finally:
        for e in decs + pres:
            e.close()
    full_dst = _full_reference(mode, 2)
    before = [c.clone() for c in full_dst]
    with PrefillEndpoint(ref, _desc(mode, 0, TOTAL)) as pre, DecodeEndpoint(full_dst, _desc(mode, 0, TOTAL)) as dec:
        dec.connect(pre.endpoint)
        pre.publish("h3", SRC_IDS)
        dec.pull("h3", DST_IDS, heads=range(3, 4), deadline_s=10).result(timeout=10)
    assert _heads_equal(_slice(full_dst, 3, 4), _slice(ref, 3, 4), DST_IDS, SRC_IDS)
    assert _heads_equal(_slice(full_dst, 0, 3), _slice(before, 0, 3), DST_IDS, DST_IDS)


def test_heads_outside_the_shared_range_are_refused_on_both_sides():
    mode = KVQuantMode.INT8_PER_TOKEN_HEAD
    pdesc, ddesc = _desc(mode, 2, 4), _desc(mode, 0, TOTAL)
    with PrefillEndpoint(_slice(_full_reference(mode), 2, 4), pdesc) as pre:
        with DecodeEndpoint(_full_reference(mode, 1), ddesc) as dec:
            assert dec.connect(pre.endpoint) == range(2, 4)
            with pytest.raises(LayoutError, match="heads"):
                dec.pull("x", DST_IDS, heads=range(0, 4))
        pre.publish("x", SRC_IDS)
        ctx = zmq.Context()  # a peer that skips the local check: the prefill side refuses too
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(pre.endpoint)
            s.send(encode_header(Header(MsgType.HELLO, desc=ddesc.to_dict())))
            assert s.poll(5000) and decode_header(s.recv_multipart()[0]).ok
            s.send(encode_header(Header(MsgType.PULL, tid="x", nblk=len(SRC_IDS), heads=(1, 3))))
            replies, end = [], time.monotonic() + 5
            while time.monotonic() < end and not any(h.type == MsgType.ERROR for h in replies):
                if s.poll(200):
                    replies.append(decode_header(s.recv_multipart()[0]))
            errs = [h for h in replies if h.type == MsgType.ERROR]
            assert errs and errs[0].code == ErrorCode.BAD_HEADS
            assert not any(h.type == MsgType.BLOCKS for h in replies)
        finally:
            s.close(0)
            ctx.term()


def _legal(a, b):
    """The rule, stated independently: both ranges valid and non-empty, and they overlap."""
    (sa, na), (sb, nb) = a, b
    valid = all(s >= 0 and n > 0 and s + n <= TOTAL for s, n in (a, b))
    lo, hi = max(sa, sb), min(sa + na, sb + nb)
    return range(lo, hi) if valid and lo < hi else None


RANGES = [(s, n) for s in range(TOTAL) for n in range(1, TOTAL - s + 1)]


def test_layout_rule_accepts_exactly_the_overlapping_head_ranges():
    base = _desc(KVQuantMode.INT4_PER_TOKEN_HEAD, 0, TOTAL)
    for a, b in itertools.product(RANGES, RANGES):
        da, db = base.with_(head_start=a[0], num_kv_heads=a[1]), base.with_(head_start=b[0], num_kv_heads=b[1])
        want = _legal(a, b)
        if want is None:
            with pytest.raises(LayoutMismatchError) as ei:
                check_compatible(da, db)
            assert {"head_start", "num_kv_heads"} <= set(ei.value.fields)
        else:
            assert check_compatible(da, db) == check_compatible(db, da) == want
    with pytest.raises(LayoutMismatchError, match="total_num_kv_heads"):
        check_compatible(base, base.with_(total_num_kv_heads=8))


@pytest.mark.parametrize("pre_r,dec_r", [((0, 2), (2, 4)), ((3, 4), (0, 3))], ids=["halves", "3+1"])
def test_disjoint_head_ranges_refused_on_both_sides(pre_r, dec_r):
    mode = KVQuantMode.FP8_PER_TOKEN_HEAD
    ref = _full_reference(mode)
    with PrefillEndpoint(_slice(ref, *pre_r), _desc(mode, *pre_r)) as pre, \
            DecodeEndpoint(_slice(ref, *dec_r), _desc(mode, *dec_r)) as dec:
        with pytest.raises(LayoutMismatchError, match="head_start"):
            dec.connect(pre.endpoint)
        end = time.monotonic() + 5
        while not pre.errors and time.monotonic() < end:
            time.sleep(0.01)
        assert any(isinstance(e, LayoutMismatchError) and "head_start" in e.fields for e in pre.errors)
        assert pre.stats()["bytes_sent"] == 0
