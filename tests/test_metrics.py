"""Endpoint metrics: the Python ``stats()`` keys and the Prometheus collectors move together.

Unit level (no sockets): each event of :class:`kvconnector.metrics.Metrics` lands in the
snapshot key of the same name as its Prometheus metric and, when ``prometheus-client`` is
installed, in that metric (read back from the default registry). The HTTP scrape after a
real pull is in tests/test_serve.py.

Run: python -m pytest tests/test_metrics.py
"""

import pytest

from kvconnector.metrics import PROMETHEUS_KEYS, Metrics, prometheus_available

needs_prometheus = pytest.mark.skipif(not prometheus_available(), reason="prometheus-client not installed")


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_snapshot_has_every_prometheus_key():
    s = Metrics("prefill").snapshot()
    assert set(PROMETHEUS_KEYS) <= set(s)


def test_events_land_in_the_same_named_keys():
    m = Metrics("decode")
    m.add("bytes_received", 1000)
    m.completed(1000, 0.002, num_blocks=10)
    m.fail("checksum")
    m.fail("deadline")
    m.fail("lease_expired")          # not the outcome of a pull
    m.fail("layout_mismatch")        # neither
    m.handshake_refused(["block_size", "quant_mode"])
    s = m.snapshot()
    assert s["bytes_total"] == {"sent": 0, "received": 1000}
    assert s["blocks_total"] == 10
    assert s["pulls_total"] == {"ok": 1, "checksum": 1, "deadline": 1}
    assert s["checksum_failures_total"] == 1 and s["lease_expiries_total"] == 1
    assert s["handshake_refusals_total"] == {"block_size": 1, "quant_mode": 1}
    assert s["transfer_seconds"] == {"count": 1, "sum": 0.002}
    assert s["transfers_failed"] == 4 and s["failures"]["layout_mismatch"] == 1


@needs_prometheus
def test_prometheus_collectors_follow_the_events():
    role = "test-role"            # a label of its own: other tests' endpoints share the registry
    before = _sample("kvconnector_pulls_total", role=role, outcome="ok")
    m = Metrics(role)
    m.add("bytes_sent", 4096)
    m.completed(4096, 0.01, num_blocks=4)
    m.fail("checksum")
    m.fail("lease_expired")
    m.handshake_refused(["head_size"])
    assert _sample("kvconnector_pulls_total", role=role, outcome="ok") == before + 1
    assert _sample("kvconnector_bytes_total", role=role, direction="sent") >= 4096
    assert _sample("kvconnector_blocks_total", role=role) >= 4
    assert _sample("kvconnector_checksum_failures_total", role=role) >= 1
    assert _sample("kvconnector_lease_expiries_total", role=role) >= 1
    assert _sample("kvconnector_pulls_total", role=role, outcome="lease_expired") == 0
    assert _sample("kvconnector_handshake_refusals_total", role=role, field="head_size") >= 1
    assert _sample("kvconnector_transfer_seconds_count", role=role) >= 1
    assert _sample("kvconnector_transfer_seconds_bucket", role=role, le="0.01") >= 1


@needs_prometheus
def test_peer_controlled_labels_are_bounded():
    """Failure reasons and field names partly come from the peer: odd ones become "other"."""
    role = "test-labels"
    m = Metrics(role)
    m.fail("Weird Code! {}")
    m.handshake_refused(["x" * 200])
    assert _sample("kvconnector_pulls_total", role=role, outcome="other") == 1
    assert _sample("kvconnector_handshake_refusals_total", role=role, field="other") == 1
    assert m.snapshot()["pulls_total"] == {"Weird Code! {}": 1}   # stats() keeps the raw reason
