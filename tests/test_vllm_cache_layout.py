"""The engine-cache probe (``kvconnector.integrations.vllm.cache_layout``) and the scheduler-side
bookkeeping, without engines; the CPU-backend case runs vLLM's real cache writer when vLLM is
installed.

Run::

    python -m pytest tests/test_vllm_cache_layout.py -q -p no:cacheprovider
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvconnector.integrations.vllm.cache_layout import gather_packed, probe_block_map, scatter_packed
from kvconnector.integrations.vllm.scheduler import SchedulerSide
from layouts import LayoutError

N, H, D = 32, 3, 64


def packed_writer(key, value, cache, slots):
    """The project's packed layout ``[num_blocks, 2, N, H, D]`` (identity map)."""
    c = cache.view(cache.shape[0], 2, N, H, D)
    c[slots // N, 0, slots % N] = key
    c[slots // N, 1, slots % N] = value


def vllm_cpu_writer(isa):
    from vllm import _custom_ops as ops

    def write(key, value, cache, slots):
        kc, vc = cache.view(cache.shape[0], H, 2 * N, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    return write


def _roundtrip(write, shape, bmap):
    """Engine blocks -> packed (must hold the K/V written) -> engine again (must equal)."""
    gen = torch.Generator().manual_seed(0)
    eng = torch.zeros(4, *shape[1:], dtype=torch.bfloat16)
    k = torch.randn(2 * N, H, D, generator=gen).bfloat16()
    v = torch.randn(2 * N, H, D, generator=gen).bfloat16()
    write(k, v, eng, torch.arange(N, 3 * N))              # blocks 1 and 2
    packed = torch.full((3, 2, N, H, D), float("nan"), dtype=torch.bfloat16)
    gather_packed(eng, bmap, [2, 1], packed, [0, 2])
    assert torch.equal(packed[2, 0], k[:N]) and torch.equal(packed[2, 1], v[:N])
    assert torch.equal(packed[0, 0], k[N:]) and torch.equal(packed[0, 1], v[N:])
    back = torch.zeros_like(eng)
    scatter_packed(packed, bmap, [2, 0], back, [1, 2])
    assert torch.equal(back, eng)


def test_packed_writer_is_identity():
    shape = (10, 2, N, H, D)
    bmap = probe_block_map(packed_writer, shape, torch.bfloat16, N, H, D)
    assert bmap.is_identity() and bmap.name == "K@0:N,H,D | V@6144:N,H,D"
    _roundtrip(packed_writer, shape, bmap)


def test_vllm_cpu_backend_block_interior():
    """vLLM's CPU cache ``[num_blocks, H, N, 2D]`` really is, per head, K as [D, N] then V as [N, D]."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    shape = (10, H, N, 2 * D)
    for isa in ("vec", "vec16"):
        write = vllm_cpu_writer(isa)
        bmap = probe_block_map(write, shape, torch.bfloat16, N, H, D)
        assert bmap.name == f"K@0:H,D,N | V@{N * D}:H,N,D", (isa, bmap.name)
        _roundtrip(write, shape, bmap)


def test_probe_refuses_padding_and_duplicates():
    shape = (4, 2, N, H, D)

    def drops_last_slot(key, value, cache, slots):
        packed_writer(key[:-1], value[:-1], cache, slots[:-1])

    def k_twice(key, value, cache, slots):
        packed_writer(key, key, cache, slots)

    with pytest.raises(LayoutError, match="not written once"):
        probe_block_map(drops_last_slot, shape, torch.bfloat16, N, H, D)
    with pytest.raises(LayoutError, match="hold the same"):
        probe_block_map(k_twice, shape, torch.bfloat16, N, H, D)
    with pytest.raises(LayoutError, match="expected bf16/fp16"):
        probe_block_map(packed_writer, shape, torch.float8_e4m3fn, N, H, D)


def _request(rid, prompt_len, params, computed=0):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_len, kv_transfer_params=params,
                           num_computed_tokens=computed)


def test_scheduler_prefill_then_decode_bookkeeping():
    pre = SchedulerSide(block_size=N, endpoint="tcp://10.0.0.1:15500", fingerprint="f", is_producer=True,
                        is_consumer=False)
    req = _request("r1", 70, {"do_remote_decode": True})
    pre.update_state_after_alloc(req, [4, 9, 2], 0, 0)
    meta = pre.build_meta({"r1": 64}, lambda rid: [4, 9, 2])              # chunked: 64 of 70 tokens
    assert [(s.first_token, s.num_tokens, s.stage_from_token, s.completes_prompt) for s in meta.saves] == \
        [(0, 64, 0, False)]
    req.num_computed_tokens = 64
    meta = pre.build_meta({"r1": 6}, lambda rid: [4, 9, 2])
    assert [(s.first_token, s.num_tokens, s.stage_from_token, s.completes_prompt) for s in meta.saves] == \
        [(64, 6, 64, True)]
    assert not pre.build_meta({"r1": 1}, lambda rid: [4, 9, 2]).saves        # decode steps are not saved
    req.num_computed_tokens = 70
    delay, params = pre.request_finished(req, [4, 9, 2], finished_ok=True)
    assert delay and params["remote_block_ids"] == [4, 9, 2] and params["remote_num_tokens"] == 70
    assert pre.build_meta({}, None).delayed == ["r1"]
    aborted = _request("r2", 40, {"do_remote_decode": True}, computed=40)
    assert pre.request_finished(aborted, [1, 3], finished_ok=False) == (False, None)
    assert pre.build_meta({}, None).released == ["r2"]

    dec = SchedulerSide(block_size=N, endpoint="tcp://x:1", is_producer=False, is_consumer=True)
    d = _request("d1", 70, dict(params))
    assert dec.get_num_new_matched_tokens(d, 0) == (70, True)
    assert dec.get_num_new_matched_tokens(d, 64) == (6, True)
    dec.update_state_after_alloc(d, [7, 8, 11], 0, 70)
    assert dec.get_num_new_matched_tokens(d, 0) == (0, False)               # one transfer per request
    load = dec.build_meta({}, None).loads[0]
    assert (load.req_id, load.block_ids, load.num_local_blocks) == ("d1", [7, 8, 11], 0)
    plain = _request("d2", 10, None)
    assert dec.get_num_new_matched_tokens(plain, 0) == (0, False)


GOOD = {"do_remote_prefill": True, "remote_endpoint": "tcp://10.0.0.1:15500", "remote_request_id": "r1",
        "remote_block_ids": [4, 9, 2], "remote_num_tokens": 70, "remote_block_size": 32, "layout_fingerprint": "f"}


@pytest.mark.parametrize("change, named", [
    ({"remote_num_tokens": "abc"}, "remote_num_tokens"), ({"remote_num_tokens": None}, "remote_num_tokens"),
    ({"remote_num_tokens": True}, "remote_num_tokens"), ({"remote_num_tokens": 0}, "remote_num_tokens"),
    ({"remote_block_ids": 7}, "remote_block_ids"), ({"remote_block_ids": []}, "remote_block_ids"),
    ({"remote_block_ids": [4, "9", 2]}, "remote_block_ids"), ({"remote_block_ids": [4, -9, 2]}, "remote_block_ids"),
    ({"remote_block_ids": [4, 9]}, "2 remote_block_ids do not hold 70 tokens"),
    ({"remote_block_size": 0}, "remote_block_size"), ({"remote_block_size": 16.0}, "remote_block_size"),
    ({"remote_endpoint": 5}, "remote_endpoint"), ({"remote_endpoint": "10.0.0.1"}, "remote_endpoint"),
    ({"remote_request_id": ""}, "remote_request_id"), ({"layout_fingerprint": None}, "layout_fingerprint"),
    ({"remote_request_id": KeyError}, "missing remote_request_id"),
])
def test_malformed_remote_params_fail_the_load_not_the_scheduler(change, named):
    """Malformed ``kv_transfer_params`` on a decode engine: the scheduler claims the prompt and
    hands the workers a load that carries a one-line error (they fail it without connecting, vLLM's
    ``kv_load_failure_policy`` decides), never an exception in vLLM's scheduler; nothing is
    released on the named prefill endpoint."""
    params = {k: v for k, v in {**GOOD, **change}.items() if v is not KeyError}
    dec = SchedulerSide(block_size=N, endpoint="tcp://x:1", is_producer=False, is_consumer=True)
    req = _request("d1", 70, params)
    assert dec.get_num_new_matched_tokens(req, 0) == (70, True)
    assert dec.get_num_new_matched_tokens(_request("d2", 70, params), 64) == (6, True)
    dec.update_state_after_alloc(req, [7, 8, 11], 0, 70)
    meta = dec.build_meta({}, None)
    assert [(x.req_id, x.block_ids) for x in meta.loads] == [("d1", [7, 8, 11])]
    assert named in meta.loads[0].error and meta.loads[0].error.startswith("kv_transfer_params: ")
    assert "\n" not in meta.loads[0].error
    dec2 = SchedulerSide(block_size=N, endpoint="tcp://x:1", is_producer=False, is_consumer=True)
    dec2.update_state_after_alloc(_request("d3", 70, dict(params)), [7, 8, 11], 3, 0)   # all cached locally
    assert not dec2.build_meta({}, None).remote_releases


def test_well_formed_remote_params_carry_no_error():
    dec = SchedulerSide(block_size=N, endpoint="tcp://x:1", is_producer=False, is_consumer=True)
    for change in ({}, {"remote_endpoint": "tcp://[::1]:15500"}, {"remote_num_tokens": 33, "remote_block_ids": [4, 9, 2],
                                                                   "remote_block_size": 16}):
        req = _request("d1", 70, {**GOOD, **change, "extra_key_from_vllm": 1})
        dec.update_state_after_alloc(req, [7, 8, 11], 0, 70)
        assert dec.build_meta({}, None).loads[0].error == ""


def test_package_import_does_not_import_vllm():
    """``import kvconnector.integrations.vllm`` stays free of vLLM; the class resolves lazily."""
    import subprocess
    import sys
    code = ("import sys, kvconnector, kvconnector.integrations.vllm as m; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(m.__all__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "KVConnector" in r.stdout, r.stderr


def test_permuted_engine_tensor_maps_memory_order():
    """A logical ``[num_blocks, H, N, 2D]`` tensor stored as ``[num_blocks, N, H, 2D]`` (a stride
    permutation, as vLLM's CUDA layouts do): the map follows memory, and copies round-trip."""
    def physical(num_blocks):
        return torch.zeros(num_blocks, N, H, 2 * D, dtype=torch.bfloat16).transpose(1, 2)   # logical B,H,N,2D

    def write(key, value, cache, slots):        # through the logical view: (B, H, N, 2D) -> K | V halves
        kc, vc = cache.split(D, dim=-1)
        kc[slots // N, :, slots % N] = key
        vc[slots // N, :, slots % N] = value

    eng = physical(4)
    bmap = probe_block_map(write, tuple(eng.shape), torch.bfloat16, N, H, D, strides=eng.stride())
    assert bmap.name == f"K@0:N,H,D | V@{D}:N,H,D", bmap.name
    _roundtrip_on(write, eng, bmap)
    with pytest.raises(LayoutError, match="dense range"):
        gather_packed(eng[:, :, :, :D], bmap, [0], torch.zeros(1, 2, N, H, D, dtype=torch.bfloat16), [0])


def _roundtrip_on(write, eng, bmap):
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(N, H, D, generator=gen).bfloat16()
    v = torch.randn(N, H, D, generator=gen).bfloat16()
    write(k, v, eng, torch.arange(2 * N, 3 * N))        # block 2
    packed = torch.zeros(1, 2, N, H, D, dtype=torch.bfloat16)
    gather_packed(eng, bmap, [2], packed, [0])
    assert torch.equal(packed[0, 0], k) and torch.equal(packed[0, 1], v)
    back = torch.zeros_like(eng)
    scatter_packed(packed, bmap, [0], back, [2])
    assert torch.equal(back, eng)


def test_blocks_interleaved_across_layers():
    """Blocks of one layer ``2·N·H·D`` elements apart from each other by the other layers' blocks
    (a block-outermost allocation): each block is still one dense range, copies round-trip."""
    shape = (4, 2, N, H, D)
    both = torch.zeros(4, 2, *shape[1:], dtype=torch.bfloat16)     # [num_blocks, layers, ...]
    layer1 = both[:, 1]
    bmap = probe_block_map(packed_writer, shape, torch.bfloat16, N, H, D, strides=layer1.stride())
    assert bmap.is_identity()
    _roundtrip_on(packed_writer, layer1, bmap)
    assert not both[:, 0].any()                                       # the other layer untouched


def _published(**side) -> dict:
    """The ``kv_transfer_params`` a prefill scheduler (``side``: its model, TP size) returns."""
    pre = SchedulerSide(block_size=N, endpoint="tcp://10.0.0.1:15500", is_producer=True, is_consumer=False, **side)
    req = _request("r1", 70, {"do_remote_decode": True}, computed=70)
    pre.update_state_after_alloc(req, [4, 9, 2], 0, 0)
    return pre.request_finished(req, [4, 9, 2], finished_ok=True)[1]


def _load_error(params: dict, **side) -> str:
    """The error a decode scheduler (``side``) gives the load of ``params`` ('' for none)."""
    dec = SchedulerSide(block_size=N, endpoint="tcp://x:1", is_producer=False, is_consumer=True, **side)
    d = _request("d1", 70, params)
    assert dec.get_num_new_matched_tokens(d, 0) == (70, True)
    dec.update_state_after_alloc(d, [7, 8, 11], 0, 70)
    return dec.build_meta({}, None).loads[0].error


def test_kv_of_another_model_is_refused_by_the_decode_side():
    """The prefill names its model (``remote_model``); a decode engine running another model fails
    the load (policy decides) rather than attending over another model's KV of the same shape."""
    params = _published(model="org/llama-ft-a")
    assert params["remote_model"] == "org/llama-ft-a"
    for model, changed, error in [("org/llama-ft-a", {}, ""), ("org/llama-ft-b", {}, "the prefill ran model "
                                  "'org/llama-ft-a', this engine runs 'org/llama-ft-b'"),
                                  ("org/llama-ft-b", {"remote_model": None}, ""),     # a prefill that does not say
                                  ("", {}, ""), ("m", {"remote_model": 3}, "remote_model: expected a string")]:
        got = _load_error({**params, **changed}, model=model)
        assert (error in got and got.startswith("kv_transfer_params: ")) if error else got == "", (model, changed, got)


def test_a_prefill_of_another_tensor_parallel_size_fails_the_load_at_once():
    """The prefill sends its TP size; a decode engine of another size fails the load at once with
    one line (its rank r would pull from a prefill rank r that holds other heads, or none),
    instead of timing out a handshake per request."""
    params = _published(tp_size=1)
    assert params["remote_tp_size"] == 1
    for tp, changed, error in [(1, {}, ""), (2, {}, "the prefill runs tensor parallel size 1, this engine 2"),
                               (2, {"remote_tp_size": None}, ""), (0, {}, ""),
                               (1, {"remote_tp_size": "1"}, "remote_tp_size: expected a positive integer")]:
        got = _load_error({**params, **changed}, tp_size=tp)
        assert (error in got and got.startswith("kv_transfer_params: ")) if error else got == "", (tp, changed, got)
