"""The endpoints' error logs (``kvconnector.error_log``): bounded, counted, without tracebacks, so
a peer sending junk cannot grow a prefill process.

Run::

    python -m pytest tests/test_error_log.py -q -p no:cacheprovider
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import zmq

from connector_fakes import filled_caches, make_desc
from kvconnector import PrefillEndpoint
from kvconnector.error_log import KEEP, ErrorLog
from layouts import CorruptFrameError

pytestmark = pytest.mark.timeout(120)


def _raised(msg: str, cause: Exception | None = None) -> Exception:
    try:
        try:
            raise cause or KeyError("inner")
        except Exception as inner:
            raise CorruptFrameError(msg) from inner
    except CorruptFrameError as e:
        return e


def test_keeps_the_last_errors_counts_all_and_reports_what_is_new():
    log = ErrorLog(keep=3)
    assert not log and len(log) == 0 and log.since(0) == ([], 0)
    errs = [_raised(f"e{i}") for i in range(5)]
    for e in errs[:2]:
        log.append(e)
    assert list(log) == errs[:2] and log.since(0) == (errs[:2], 2) and log.since(1) == (errs[1:2], 2)
    for e in errs[2:]:
        log.append(e)
    assert len(log) == 3 and log.total == 5 and list(log) == errs[2:] and log[-1] is errs[4]
    assert log.since(1) == (errs[2:], 5)          # e1 was dropped: 5 - 1 - 3 = 1 not kept
    assert log.since(3) == (errs[3:], 5) and log.since(5) == ([], 5)


def test_errors_are_kept_without_tracebacks_of_their_chain():
    e = _raised("outer")
    assert e.__traceback__ is not None and e.__cause__.__traceback__ is not None
    ErrorLog().append(e)
    assert e.__traceback__ is None and e.__cause__.__traceback__ is None and e.__context__.__traceback__ is None
    assert str(e) == "outer" and isinstance(e.__cause__, KeyError)      # the error itself is intact


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_junk_from_a_peer_does_not_grow_the_prefill_process():
    """An unauthenticated peer sends 600 junk messages of 512 KiB (each refused as a corrupt
    header): every one is counted, the last ``KEEP`` kept, typed; the process does not keep their
    bytes (kept with their tracebacks, it grew by the junk's size, ~300 MiB), and the endpoint
    still answers."""
    desc = make_desc(num_layers=1, num_blocks=4)
    junk = os.urandom(512 << 10)
    n = 600
    with PrefillEndpoint(filled_caches(desc, 0), desc) as pre:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(pre.endpoint)
            gc.collect()
            before = _rss_mib()
            for i in range(n):
                s.send_multipart([junk[i % 64:i % 64 + 64], junk])
                while s.poll(0):
                    s.recv_multipart()
            end = time.monotonic() + 60
            while pre.errors.total < n and time.monotonic() < end:
                if s.poll(50):
                    s.recv_multipart()
            gc.collect()
            grown = _rss_mib() - before
        finally:
            s.close(0)
            ctx.term()
        assert grown < 64, f"the prefill process grew by {grown:.0f} MiB over {n} junk messages"
        assert pre.errors.total == n and len(pre.errors) == KEEP
        assert all(isinstance(e, CorruptFrameError) and e.__traceback__ is None for e in pre.errors)
        assert pre.stats()["messages_received"] >= n
