"""Short soak of the connector (kvconnector/testing/soak.py): ~20 s of concurrent transfers with faults.

Two decode endpoints behind fault-injecting proxies pull from one prefill endpoint with
six worker threads, random aborts, random BLOCKS faults and link cuts. Every (layer, block)
is verified by content hash; the run must end with zero corrupted or lost blocks, only
typed errors, no hung pull, every lease / stream / pending pull / block returned, and RSS,
open fds and threads back near their post-warm-up baseline; on the host path and on the device
path (``--frame-ops``: grouped gathers and verify passes). The long run (minutes) and its
numbers are in docs/RELIABILITY.md.

Run: python -m pytest tests/test_soak.py
"""

import pytest

from kvconnector.testing import soak


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [[], ["--frame-ops"]], ids=["host-path", "device-path"])
def test_short_soak_loses_and_corrupts_nothing_and_returns_resources(path):
    a = soak.parser().parse_args(["--seconds", "18", "--warmup-s", "3", "--kill-every", "4",
                                  "--fault-rate", "0.02", "--abort-rate", "0.1", "--quiet", *path])
    s = soak.Soak(a)
    try:
        r = s.run()
    finally:
        s.close()
    assert soak.problems(r, a.rss_slack_mb) == [], r
    # the run exercised what it claims: faults, aborts and typed failures all happened
    assert r["faults_injected"] >= 10 and r["aborts_issued"] >= 10, r
    assert r["transfers_ok"] >= 100 and r["blocks_verified"] >= 1000, r
    assert any(k.startswith("failed_") for k in r), r
