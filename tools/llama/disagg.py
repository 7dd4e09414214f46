"""The two roles of the disaggregated demo, each run in its own process.

- :func:`prefill_worker`: tokenizes the prompt, runs it once (K/V written into a paged cache of
  the chosen mode), picks the first new token, serves the prompt's blocks through a
  :class:`kvconnector.PrefillEndpoint` and waits until the decode side acknowledges; then,
  while the decode side generates, runs the unquantized comparison
  (:func:`reference_generate`) with the model it already holds, so the comparison costs
  neither a third model load nor extra wall time.
- :func:`decode_worker`: waits for the transfer notice, connects (handshake: both sides check
  the layout descriptors), pulls the blocks into *different* block ids of its own cache,
  checks a content hash of every block against the prefill side's, then continues greedy
  generation from the transferred cache.

The parent (``tools/demo.py``) plays the router: it passes the transfer notice (endpoint,
transfer id, prompt length, first token, block hashes) from one queue to the other as JSON
strings. K/V bytes only ever travel over the connector.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import torch
import xxhash

DECODE_BLOCK_OFFSET = 3  # decode leaves its first blocks unused so pulled ids visibly differ


def _say(role: str, msg: str) -> None:
    print(f"[{role}] {msg}", flush=True)


def _setup(spec: dict, role: str):
    from kernels.paged_cache import PagedKVCache
    from tools.llama import LlamaRunner, load_model

    torch.manual_seed(spec["seed"])
    torch.set_num_threads(max(1, spec.get("threads", 1)))
    device = torch.device(spec["device"])
    t0 = time.perf_counter()
    weights, tok = load_model(spec["model"], synthetic_layers=spec.get("synthetic_layers"),
                              seed=spec["seed"], device=device)
    cfg = weights.config
    mode = spec["decode_mode"] if role == "decode" else spec["mode"]
    offsets_path = spec.get("decode_key_offsets" if role == "decode" else "key_offsets")
    key_offsets = None
    if offsets_path:  # INT4 key smoothing: the same m on both sides, or the handshake refuses
        from layouts import KeyOffsets
        key_offsets = KeyOffsets.load(offsets_path)
    cache = PagedKVCache(mode, cfg.num_layers, cfg.num_kv_heads, cfg.head_size,
                         num_blocks=spec["num_blocks"] + (DECODE_BLOCK_OFFSET if role == "decode" else 0),
                         block_size=spec["block_size"], device=device, backend=spec["backend"],
                         key_offsets=key_offsets)
    smooth = f", key offsets {key_offsets.fingerprint}" if key_offsets is not None else ""
    _say(role, f"model {weights.source.rsplit('/', 1)[-1]} loaded in {time.perf_counter() - t0:.1f} s; "
               f"cache {cache.mode.name}{smooth}, {cache.block_bytes} B/block/layer, fingerprint "
               f"{cache.descriptor.fingerprint()}")
    return LlamaRunner(weights), tok, cache, device


def block_hashes(cache, block_ids) -> list[str]:
    """xxh3-64 of each block's bytes over all layers (K and V halves, scales included)."""
    out = []
    for b in block_ids:
        h = xxhash.xxh3_64()
        for layer in range(cache.num_layers):
            h.update(cache.block_payload(layer, b).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def prompt_ids(tok, spec: dict) -> list[int]:
    """Token ids of the (chat-wrapped) prompt, cut to ``spec["max_prompt_tokens"]``."""
    text = tok.format_chat(spec["prompt"]) if spec.get("chat", True) else spec["prompt"]
    return tok.encode(text)[: spec["max_prompt_tokens"]]


def prefill_worker(spec_json: str, out_q) -> None:
    """Process entry: prefill role. Puts one JSON notice on ``out_q``; exits after the ACK."""
    from kvconnector import PrefillEndpoint

    spec = json.loads(spec_json)
    try:
        runner, tok, cache, device = _setup(spec, "prefill")
        ids = prompt_ids(tok, spec)
        block_ids = cache.allocate(len(ids))
        _say("prefill", f"prompt: {len(ids)} tokens -> blocks {block_ids[0]}..{block_ids[-1]}")
        t0 = time.perf_counter()
        logits = runner.forward(torch.tensor(ids, device=device), 0, cache, block_ids,
                                progress=_layer_progress("prefill", runner.config.num_layers))
        prefill_s = time.perf_counter() - t0
        first = int(logits[-1].argmax())
        released = threading.Event()
        endpoint = PrefillEndpoint(cache.caches, cache.descriptor, host=spec["host"], port=0,
                                   on_release=lambda tid, ids_, reason: (released.set(),
                                                                        _say("prefill", f"lease {tid}: {reason}")),
                                   lease_s=spec["timeout_s"])
        tid = f"demo-{int(time.time() * 1e3)}"
        endpoint.publish(tid, block_ids)
        _say("prefill", f"ran in {prefill_s:.1f} s; published {tid!r} ({len(block_ids)} blocks x "
                        f"{cache.num_layers} layers) on {endpoint.endpoint}")
        out_q.put(json.dumps({
            "role": "prefill", "endpoint": endpoint.endpoint, "transfer_id": tid, "prompt_ids": ids,
            "first_token": first, "num_blocks": len(block_ids), "hashes": block_hashes(cache, block_ids),
            "fingerprint": cache.descriptor.fingerprint(), "prefill_s": prefill_s,
            "backend": cache.backend, "model": runner.weights.source}))
        end = time.monotonic() + spec["timeout_s"]
        while not released.wait(0.2):
            if endpoint.errors:  # e.g. the peer's layout did not match: no byte was sent
                endpoint.close()
                raise endpoint.errors[0]
            if time.monotonic() > end:
                endpoint.close()
                raise TimeoutError(f"no ACK from the decode side within {spec['timeout_s']} s")
        stats = endpoint.stats()
        endpoint.close()
        if spec.get("reference", True):
            _say("prefill", "unquantized comparison (bf16 cache) running while decode generates")
            ref_tokens, ref_s = reference_generate(spec, runner, tok, device)
            out_q.put(json.dumps({"role": "reference", "tokens": ref_tokens, "text": tok.decode(ref_tokens),
                                  "pieces": [tok.decode([t]) for t in ref_tokens],
                                  "seconds": ref_s, "backend": reference_backend(spec["backend"])}))
        out_q.put(json.dumps({"role": "prefill-done", "stats": _jsonable(stats)}))
    except Exception as e:  # reported to the parent, which fails the demo
        _report(out_q, "prefill", e)


def decode_worker(spec_json: str, in_q, out_q) -> None:
    """Process entry: decode role. Reads the transfer notice from ``in_q``; puts its result on ``out_q``."""
    from kvconnector import DecodeEndpoint

    spec = json.loads(spec_json)
    try:
        runner, tok, cache, device = _setup(spec, "decode")
        cache.allocate(DECODE_BLOCK_OFFSET * cache.block_size)  # keep ids 0..2 busy: remapped pull
        try:
            notice = json.loads(in_q.get(timeout=spec["timeout_s"]))
        except queue.Empty:
            raise TimeoutError(f"no transfer notice from the router within {spec['timeout_s']} s") from None
        n = len(notice["prompt_ids"])
        max_new = spec["max_new_tokens"]
        dst = cache.allocate(n + max_new)
        pulled = dst[: notice["num_blocks"]]
        if notice["fingerprint"] != cache.descriptor.fingerprint():
            _say("decode", f"descriptor fingerprints differ: prefill {notice['fingerprint']}, "
                           f"decode {cache.descriptor.fingerprint()} (the handshake will refuse)")
        with DecodeEndpoint(cache.caches, cache.descriptor, peer_timeout_s=spec["timeout_s"]) as ep:
            heads = ep.connect(notice["endpoint"], timeout_s=30.0)
            _say("decode", f"handshake ok (layout fingerprint {cache.descriptor.fingerprint()}, "
                           f"heads {heads.start}..{heads.stop - 1}); pulling into blocks "
                           f"{pulled[0]}..{pulled[-1]}")
            res = ep.pull(notice["transfer_id"], pulled, deadline_s=spec["timeout_s"]).result()
        hashes_ok = block_hashes(cache, pulled) == notice["hashes"]
        _say("decode", f"pulled {res.nbytes / 1e6:.2f} MB in {res.elapsed_s * 1e3:.1f} ms "
                       f"({res.nbytes / max(res.elapsed_s, 1e-9) / 1e9:.2f} GB/s); block hashes "
                       f"{'match' if hashes_ok else 'DIFFER'}")
        if not hashes_ok:
            raise ValueError("transferred blocks differ from the prefill side's (content hash mismatch)")
        printer = _TextStream(tok, "decode")
        t0 = time.perf_counter()
        out = runner.generate(n, notice["first_token"], cache, dst, max_new, tok.stop_ids, on_token=printer)
        decode_s = time.perf_counter() - t0
        printer.end()
        out_q.put(json.dumps({
            "role": "decode", "tokens": out, "text": tok.decode(out), "pieces": [tok.decode([t]) for t in out],
            "bytes": res.nbytes,
            "pull_s": res.elapsed_s, "decode_s": decode_s, "hashes_ok": hashes_ok,
            "block_bytes": cache.block_bytes, "pulled_blocks": pulled}))
    except Exception as e:
        _report(out_q, "decode", e)


def reference_backend(backend: str) -> str:
    """Back end of the unquantized comparison: the same attention path as the quantized run.

    ``triton`` keeps the Triton attention kernel. ``triton-write`` and ``reference`` both
    attend with the PyTorch oracle; for a bf16 cache the Triton write is a plain copy, so
    the oracle back end gives the same bytes and the same logits without the interpreter.
    """
    return "triton" if backend == "triton" else "reference"


def reference_generate(spec: dict, runner, tok, device) -> tuple[list, float]:
    """Unquantized (bf16 cache) prefill + greedy decode of the same prompt, same attention path."""
    from kernels.paged_cache import PagedKVCache

    cfg = runner.config
    ids = prompt_ids(tok, spec)
    cache = PagedKVCache("auto", cfg.num_layers, cfg.num_kv_heads, cfg.head_size,
                         num_blocks=spec["num_blocks"], block_size=spec["block_size"], device=device,
                         backend=reference_backend(spec["backend"]))
    blocks = cache.allocate(len(ids) + spec["max_new_tokens"])
    t0 = time.perf_counter()
    logits = runner.forward(torch.tensor(ids, device=device), 0, cache, blocks)
    out = runner.generate(len(ids), int(logits[-1].argmax()), cache, blocks, spec["max_new_tokens"], tok.stop_ids)
    return out, time.perf_counter() - t0


class _TextStream:
    """Prints generated text as it grows (decoding the whole id list each time: BPE-safe)."""

    def __init__(self, tok, role: str):
        self.tok, self.role, self.ids, self.shown = tok, role, [], ""
        print(f"[{role}] generating: ", end="", flush=True)

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):].replace("\n", " "))
            sys.stdout.flush()
            self.shown = text

    def end(self) -> None:
        print(flush=True)


def _report(out_q, role: str, e: Exception) -> None:
    """Tell the parent; typed project errors exit quietly, anything else keeps its traceback."""
    from layouts import KVCacheError

    out_q.put(json.dumps({"role": "error", "where": role, "error": f"{type(e).__name__}: {e}"}))
    if isinstance(e, (KVCacheError, TimeoutError)):
        sys.exit(1)
    raise e


def _layer_progress(role: str, num_layers: int):
    step = max(1, num_layers // 5)

    def cb(i):
        if (i + 1) % step == 0 or i + 1 == num_layers:
            _say(role, f"layer {i + 1}/{num_layers}")
    return cb


def _jsonable(d):
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}
