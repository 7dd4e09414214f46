"""The vLLM adapter's worker side (``kvconnector.integrations.vllm.worker``) without vLLM: two
workers in one process over loopback, engine caches laid out like vLLM's CPU backend (per head,
K as ``[head_size, block_size]`` then V as ``[block_size, head_size]``), on CPU and, when
present, CUDA (the adapter's CUDA path is the same code on CUDA tensors).

Run::

    python -m pytest tests/test_vllm_worker.py -q -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from kvconnector.integrations.vllm.cache_layout import probe_block_map
from kvconnector.integrations.vllm.scheduler import ConnectorMeta, LoadSpec, SaveSpec
from kvconnector.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.timeout(120)

H, D, LAYERS, NBLK = 2, 64, 3, 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def cpu_like_writer(n, h=H):
    """A writer with vLLM's CPU-backend block interior, for engine tensors ``[num_blocks, h, n, 2D]``."""
    def write(key, value, cache, slots):
        v = cache.view(cache.shape[0], h, 2, n * D)
        kreg, vreg = v[:, :, 0].view(-1, h, D, n), v[:, :, 1].view(-1, h, n, D)
        b, t = slots // n, slots % n
        kreg[b, :, :, t] = key
        vreg[b, :, t, :] = value
    return write


def make_worker(device, n, producer: bool, heads=H, tp_rank=0, tp_size=1, **config):
    w = WorkerSide({"handshake_s": 2, "peer_timeout_s": 1, "pull_deadline_s": 5, "lease_s": 10, **config},
                   is_producer=producer, is_consumer=not producer, tp_rank=tp_rank, tp_size=tp_size)
    shape = (NBLK, heads, n, 2 * D)
    caches = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
    bmap = probe_block_map(cpu_like_writer(n, heads), shape, torch.bfloat16, n, heads, D, device=device)
    w.register(caches, [f"layer.{i}" for i in range(LAYERS)], bmap, torch.bfloat16)
    return w


def wait_results(w, finished=(), want="recving", timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        sending, recving, failed = w.transfer_results(set(finished))
        got = {"sending": sending, "recving": recving}[want]
        if got:
            return got, failed
        time.sleep(0.02)
    raise TimeoutError(f"no {want} within {timeout_s} s")


def prefill_request(w, n, req_id, block_ids, num_tokens, seed, heads=H):
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.tensor(block_ids)[:, None] * n + torch.arange(n)).reshape(-1)[:num_tokens]
    for cache in w.caches:      # what vLLM's forward writes, layer by layer
        k = torch.randn(num_tokens, heads, D, generator=gen).bfloat16().to(cache.device)
        v = torch.randn(num_tokens, heads, D, generator=gen).bfloat16().to(cache.device)
        cpu_like_writer(n, heads)(k, v, cache, slots.to(cache.device))
    meta = ConnectorMeta(saves=[SaveSpec(req_id, list(block_ids), 0, num_tokens, num_tokens)])
    for i, cache in enumerate(w.caches):
        w.save_layer(f"layer.{i}", cache, meta)
    w.wait_for_save(meta)
    return {"do_remote_prefill": True, "remote_endpoint": w.prefill.endpoint, "remote_request_id": req_id,
            "remote_block_ids": list(block_ids), "remote_num_tokens": num_tokens, "remote_block_size": n,
            "layout_fingerprint": w.descriptor.fingerprint()}


HAVE_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ops", [None, "kernels.transfer.FRAME_OPS"], ids=["host-checksums", "device-kernels"])
@pytest.mark.parametrize("plane", ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(
    not HAVE_NIXL, reason="needs the nixl package"))])
def test_pull_lands_in_engine_order_and_releases_prefill_blocks(device, ops, plane):
    """A prompt's blocks pulled by a decode worker land in the engine's block order (config
    ``frame_ops`` and ``data_plane`` on both workers), and the prefill's blocks free once acked."""
    n = 32
    pre = make_worker(device, n, True, frame_ops=ops, data_plane=plane)
    dec = make_worker(device, n, False, frame_ops=ops, data_plane=plane, nixl_region_mb=4)
    try:
        params = prefill_request(pre, n, "r1", [3, 9, 4], 70, seed=1)
        dec.start_load(ConnectorMeta(loads=[LoadSpec("d1", params, [5, 6, 7, 8], 0)]))
        recving, failed = wait_results(dec)
        assert recving == {"d1"} and not failed
        assert dec._decoders[pre.prefill.endpoint].checksum == ("mix64" if ops else "xxh3_64")
        assert dec._decoders[pre.prefill.endpoint].plane == plane
        for src, dst in zip(pre.caches, dec.caches):        # whole blocks, in the engine's own order
            assert torch.equal(dst[[5, 6, 7]], src[[3, 9, 4]])
            assert not dst[8].any() and not dst[[0, 1, 2, 3, 4]].any()
        # the scheduler marks r1 delayed when it finishes; its blocks free once the lease ended (ACK)
        pre.wait_for_save(ConnectorMeta(delayed=["r1"]))
        sending, _ = wait_results(pre, finished={"r1"}, want="sending")
        assert sending == {"r1"}
        assert pre.stats.counts.get("lease_end") == 1
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize("device", DEVICES)
def test_local_prefix_blocks_are_not_overwritten(device):
    n = 32
    pre, dec = make_worker(device, n, True), make_worker(device, n, False)
    try:
        params = prefill_request(pre, n, "r2", [1, 2], 50, seed=2)
        for c in dec.caches:
            c[10].fill_(7.0)                                  # a block the decode side already holds
        dec.start_load(ConnectorMeta(loads=[LoadSpec("d2", params, [10, 11], 1)]))
        recving, failed = wait_results(dec)
        assert recving == {"d2"} and not failed
        for src, dst in zip(pre.caches, dec.caches):
            assert (dst[10] == 7.0).all() and torch.equal(dst[11], src[2])
    finally:
        pre.close()
        dec.close()


def test_failures_are_reported_per_request_within_deadlines():
    n = 32
    pre, dec = make_worker("cpu", n, True), make_worker("cpu", n, False)
    other = make_worker("cpu", 2 * n, False)       # another block size: refused on both ends
    try:
        params = prefill_request(pre, n, "r3", [0], 20, seed=3)
        other.start_load(ConnectorMeta(loads=[LoadSpec("m1", params, [1], 0)]))
        recving, failed = wait_results(other)
        assert recving == failed == {"m1"}
        assert other.stats.counts.get("load_failed") == 1
        assert not other.caches[0].any()                  # not one byte landed
        pre.transfer_results(set())                       # the prefill side's record of the refusal
        assert pre.stats.counts.get("endpoint_error", 0) >= 1

        missing = dict(params, remote_request_id="never-published")
        dec.start_load(ConnectorMeta(loads=[LoadSpec("u1", missing, [2], 0)]))
        recving, failed = wait_results(dec)
        assert recving == failed == {"u1"}

        pre.close()                                       # prefill gone before the pull
        t0 = time.monotonic()
        dec.start_load(ConnectorMeta(loads=[LoadSpec("k1", params, [3], 0)]))
        recving, failed = wait_results(dec, timeout_s=30)
        assert recving == failed == {"k1"} and time.monotonic() - t0 < 15
        assert not dec.caches[0][3].any()
    finally:
        pre.close()
        dec.close()
        other.close()


def test_frame_ops_config_names_what_cannot_load():
    from kernels.transfer import FRAME_OPS
    from kvconnector.integrations.vllm.worker import frame_ops_from_config
    assert frame_ops_from_config(None) is None and frame_ops_from_config("") is None
    assert frame_ops_from_config("kernels.transfer.FRAME_OPS") is FRAME_OPS
    for bad in ("kernels.transfer.NO_SUCH_OPS", "no_such_module.FRAME_OPS", "FRAME_OPS"):
        with pytest.raises(ValueError, match="kv_connector_extra_config 'frame_ops': cannot load"):
            frame_ops_from_config(bad)


def test_unknown_data_plane_is_a_one_line_error():
    with pytest.raises(ValueError, match="data_plane: expected one of"):
        WorkerSide({"data_plane": "rdma"}, is_producer=True, is_consumer=False)


@pytest.mark.parametrize("extra, says", [
    ({"lease_seconds": 5}, "unknown key 'lease_seconds' (known: host, "),
    ({"lease_s": "soon"}, "lease_s: expected a positive number of seconds, got 'soon'"),
    ({"pull_deadline_s": 0}, "pull_deadline_s: expected a positive number"),
    ({"handshake_s": True}, "handshake_s: expected a positive number"),
    ({"peer_timeout_s": float("inf")}, "peer_timeout_s: expected a positive number"),
    ({"port": "15500"}, "port: expected an integer in [0, 65535]"), ({"port": 65536}, "port: expected an integer"),
    ({"nixl_region_mb": 0.5}, "nixl_region_mb: expected an integer"),
    ({"lanes": 0}, "lanes: expected an integer in [1, 64], got 0"),
    ({"host": ""}, "host: expected a non-empty string"), ({"curve": "on"}, "curve: expected a map"),
    ({"data_plane": "rdma"}, "data_plane: expected one of ['zmq', 'nixl'], got 'rdma'"),
])
def test_bad_extra_config_is_a_one_line_error_naming_the_key(extra, says):
    """What vLLM raises when it builds the connector (the engine does not start) for a typo'd key
    or a bad value, instead of a default silently used or every load failing later."""
    for role in ({"is_producer": True, "is_consumer": False}, {"is_producer": False, "is_consumer": True}):
        with pytest.raises(ValueError) as e:
            WorkerSide(dict(extra), **role)
        msg = str(e.value)
        assert msg.startswith("kv_connector_extra_config: ") and says in msg and "\n" not in msg, msg


def test_extra_config_defaults_and_values():
    from kvconnector.integrations.vllm.config import connector_config
    c = connector_config({"port": 15500, "lease_s": 60, "frame_ops": "", "curve": None})
    assert (c["port"], c["lease_s"], c["pull_deadline_s"], c["handshake_s"], c["peer_timeout_s"]) == (15500, 60.0, 10.0, 3.0, 3.0)
    assert (c["host"], c["advertise_host"], c["frame_ops"], c["curve"], c["data_plane"], c["nixl_region_mb"],
            c["lanes"]) == ("127.0.0.1", None, None, None, "zmq", 256, None)
    assert connector_config(c) == c           # checking twice changes nothing (connector, then worker)


def test_decoders_of_prefills_gone_silent_are_closed_at_the_next_load():
    """A decode worker keeps one DecodeEndpoint per prefill address; one whose prefill has been
    silent for ``peer_timeout_s`` (gone, or moved) is closed at the next load, so the worker
    does not keep a socket and threads for every address it ever pulled from. A live one stays."""
    n = 32
    pres = [make_worker("cpu", n, True) for _ in range(3)]
    dec = make_worker("cpu", n, False)
    try:
        for i, pre in enumerate(pres[:2]):
            params = prefill_request(pre, n, f"r{i}", [3, 9], 40, seed=i)
            dec.start_load(ConnectorMeta(loads=[LoadSpec(f"d{i}", params, [5, 6], 0)]))
            recving, failed = wait_results(dec)
            assert recving == {f"d{i}"} and not failed
        assert set(dec._decoders) == {pres[0].prefill.endpoint, pres[1].prefill.endpoint}
        gone = dec._decoders[pres[0].prefill.endpoint]
        pres[0].close()                                   # prefill 0 goes away; prefill 1 lives on
        time.sleep(1.5)                                   # > peer_timeout_s (1 s in make_worker)
        params = prefill_request(pres[2], n, "r2", [3, 9], 40, seed=2)
        dec.start_load(ConnectorMeta(loads=[LoadSpec("d2", params, [5, 6], 0)]))
        recving, failed = wait_results(dec)
        assert recving == {"d2"} and not failed
        assert set(dec._decoders) == {pres[1].prefill.endpoint, pres[2].prefill.endpoint}
        assert gone._loop.sock.closed                     # the gone prefill's endpoint is closed
        assert dec.stats.counts.get("decoders_closed") == 1
    finally:
        for w in pres[1:] + [dec]:
            w.close()


def test_a_prompt_aborted_before_it_completes_leaves_no_state():
    """A prefill request aborted after some of its steps were staged (vLLM's scheduler lists it
    in ``released``): nothing is published and the worker keeps nothing of it (a server sees many
    such requests: client disconnects)."""
    n = 32
    pre = make_worker("cpu", n, True)
    try:
        meta = ConnectorMeta(saves=[SaveSpec("r1", [3, 9, 4], 0, 64, 70)])    # 64 of 70 prompt tokens
        for i, cache in enumerate(pre.caches):
            pre.save_layer(f"layer.{i}", cache, meta)
        pre.wait_for_save(meta)
        assert "r1" in pre._stage_s and "r1" in pre._first_layer_t
        pre.wait_for_save(ConnectorMeta(released=["r1"]))
        assert not (pre._stage_s or pre._first_layer_t or pre._last_layer_t or pre._published)
        assert pre.prefill.held() == [] and "published" not in pre.stats.counts
    finally:
        pre.close()


def test_a_published_prompt_released_by_vllm_leaves_no_state():
    """vLLM lists a published request in ``released`` (aborted after its prompt completed, so not
    delayed): its lease ends ``released``, it is never reported in ``finished_sending`` (vLLM
    freed its blocks itself), and the worker keeps nothing of it."""
    n = 32
    pre = make_worker("cpu", n, True)
    try:
        prefill_request(pre, n, "r1", [3, 9, 4], 70, seed=1)
        assert pre.prefill.held() == ["r1"]
        pre.wait_for_save(ConnectorMeta(released=["r1"]))
        end = time.monotonic() + 5
        while "lease_end" not in pre.stats.counts and time.monotonic() < end:
            time.sleep(0.01)
        sending, _, _ = pre.transfer_results({"r1"})
        assert not sending and pre.prefill.held() == []
        assert not (pre._published or pre._ended or pre._finished_seen or pre._delayed or pre._stage_s)
    finally:
        pre.close()


def test_a_prefill_rank_holding_part_of_the_heads_is_refused_not_half_loaded(tmp_path):
    """Decode at tensor parallelism 1 (all 4 KV heads) against prefill rank 0 of 2 (heads 0-1):
    the handshake passes (the ranges overlap) but only half of each block could land, so the
    load fails naming both head ranges, and nothing is written into the engine's blocks."""
    n = 32
    pre = make_worker("cpu", n, True, heads=2, tp_rank=0, tp_size=2)
    stats = tmp_path / "stats.jsonl"
    dec = make_worker("cpu", n, False, heads=4, stats_path=str(stats))
    try:
        params = prefill_request(pre, n, "r1", [3, 9], 40, seed=1, heads=2)
        dec.start_load(ConnectorMeta(loads=[LoadSpec("d1", params, [5, 6], 0)]))
        recving, failed = wait_results(dec)
        assert recving == {"d1"} and failed == {"d1"}
        assert not any(c.any() for c in dec.caches)
        errors = [e["error"] for e in map(json.loads, stats.read_text().splitlines()) if e["event"] == "load_failed"]
        assert len(errors) == 1 and "holds KV heads [0, 2) of 4, this worker needs [0, 4) of 4" in errors[0], errors
    finally:
        pre.close()
        dec.close()


def test_lanes_from_the_extra_config_reach_both_endpoints():
    """``"lanes"`` in kv_connector_extra_config: the decode worker's endpoint offers its count, the
    prefill grants at most its own, and the pull lands as before."""
    n = 32
    pre = make_worker("cpu", n, True, lanes=2)
    dec = make_worker("cpu", n, False, lanes=3)
    try:
        params = prefill_request(pre, n, "r1", [3, 9], 40, seed=2)
        dec.start_load(ConnectorMeta(loads=[LoadSpec("d1", params, [5, 6], 0)]))
        recving, failed = wait_results(dec)
        assert recving == {"d1"} and not failed
        ep = dec._decoders[pre.prefill.endpoint]
        assert (ep.lanes, pre.prefill.lanes, ep.stats()["lanes_opened"]) == (3, 2, 1)
        for src, dst in zip(pre.caches, dec.caches):
            assert torch.equal(dst[[5, 6]], src[[3, 9]])
    finally:
        pre.close()
        dec.close()
