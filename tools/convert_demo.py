"""Conversion on the wire with the project's runner: bf16 prefill -> INT4 (or INT8 / FP8) decode.

One process, two endpoints over loopback ZeroMQ. The prefill side runs the prompt through
:class:`tools.llama.LlamaRunner` with an unquantized (bf16) paged cache and serves it through
:class:`kvconnector.convert.ConvertingPrefill`, which runs the decode format's write kernel on
the prefill side. The decode side owns a cache of the quantized format, handshakes against the
wire descriptor, pulls into other block ids, and then:

1. checks the pulled bytes against what its *own* writer produces from the same K/V (the
   prefill's K/V are captured as the forward writes them): they must be equal, byte for byte;
2. continues greedy generation from the pulled cache and prints it next to the all-bf16 run.

Usage::

    kvconnector convert-demo [--model auto|smollm2|synthetic] [--decode-mode int4_per_token_head]
"""

from __future__ import annotations

import argparse
import time

import torch


def convert_and_generate(model: str = "auto", decode_mode: str = "int4_per_token_head", prompt: str = "What is the capital of France?",
        max_new_tokens: int = 12, block_size: int = 16, backend: str = "triton-write", synthetic_layers=None,
        seed: int = 0) -> dict:
    from kernels.paged_cache import PagedKVCache
    from kvconnector import DecodeEndpoint
    from kvconnector.convert import ConvertingPrefill
    from tools.llama import LlamaRunner, load_model
    from tools.wire_writer import kernel_writer

    torch.manual_seed(seed)
    weights, tok = load_model(model, synthetic_layers=synthetic_layers, seed=seed)
    cfg, runner = weights.config, LlamaRunner(weights)
    text = tok.format_chat(prompt) if hasattr(tok, "format_chat") else prompt
    ids = tok.encode(text)[:128]
    n_blocks = -(-(len(ids) + max_new_tokens) // block_size) + 4

    def cache(mode):
        return PagedKVCache(mode, cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_blocks=n_blocks,
                            block_size=block_size, backend=backend)

    src, dst, own = cache("auto"), cache(decode_mode), cache(decode_mode)
    captured = {}
    src_blocks = src.allocate(len(ids) + max_new_tokens)
    t0 = time.perf_counter()
    logits = runner.forward(torch.tensor(ids), 0, src, src_blocks,
                            kv_hook=lambda i, k, v: captured.__setitem__(i, (k, v)))
    prefill_s = time.perf_counter() - t0
    first = int(logits[-1].argmax())
    prompt_blocks = src_blocks[:-(-len(ids) // block_size)]

    dst.allocate(3 * block_size)                       # other block ids on the decode side
    dst_blocks = dst.allocate(len(ids) + max_new_tokens)
    pulled = dst_blocks[:len(prompt_blocks)]
    t0 = time.perf_counter()
    with ConvertingPrefill(src.caches, src.descriptor, decode_mode, kernel_writer(decode_mode)) as pre, \
            DecodeEndpoint(dst.caches, dst.descriptor) as dec:
        pre.publish("convert-demo", prompt_blocks, num_tokens=len(ids))
        convert_s = time.perf_counter() - t0
        dec.connect(pre.endpoint.endpoint, timeout_s=10)
        res = dec.pull("convert-demo", pulled, deadline_s=60).result()
    wire_s = time.perf_counter() - t0

    # the decode side's own writer on the same K/V, at the same block ids
    own.allocate(3 * block_size)
    own_blocks = own.allocate(len(ids) + max_new_tokens)
    slots = own.slot_mapping(own_blocks, 0, len(ids))
    for layer, (k, v) in captured.items():
        own.write(layer, k, v, slots)
    equal = all(torch.equal(dst.caches[la][pulled].view(torch.uint8), own.caches[la][pulled].view(torch.uint8))
                for la in range(cfg.num_layers))

    out = runner.generate(len(ids), first, dst, dst_blocks, max_new_tokens, tok.stop_ids)
    ref = runner.generate(len(ids), first, src, src_blocks, max_new_tokens, tok.stop_ids)
    agree = sum(a == b for a, b in zip(out, ref))
    return {"model": weights.source.rsplit("/", 1)[-1], "prompt_tokens": len(ids), "decode_mode": decode_mode,
            "bytes": res.nbytes, "blocks": len(pulled), "bytes_equal_own_writer": equal, "prefill_s": prefill_s,
            "convert_s": convert_s, "wire_s": wire_s, "tokens": out, "text": tok.decode(out),
            "reference_text": tok.decode(ref), "agree": agree, "compared": min(len(out), len(ref))}


EXAMPLES = """\
  kvconnector convert-demo                                   # SmolLM2 (or synthetic) bf16 -> INT4
  kvconnector convert-demo --decode-mode int8_per_token_head --model synthetic
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "synthetic"))
    p.add_argument("--decode-mode", default="int4_per_token_head",
                   choices=("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"))
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--synthetic-layers", type=int, default=None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    r = convert_and_generate(args.model, args.decode_mode, args.prompt, args.max_new_tokens, synthetic_layers=args.synthetic_layers)
    print(f"model {r['model']}: bf16 prefill of {r['prompt_tokens']} tokens ({r['prefill_s']:.1f} s), converted "
          f"to {r['decode_mode']} on the prefill side ({r['convert_s']:.1f} s), {r['blocks']} blocks x layers = "
          f"{r['bytes']} bytes pulled")
    print(f"pulled bytes equal the decode side's own writer on the same K/V: {r['bytes_equal_own_writer']}")
    print(f"decode ({r['decode_mode']} cache): {r['text']!r}")
    print(f"all-bf16 reference:            {r['reference_text']!r}  ({r['agree']}/{r['compared']} tokens agree)")
    return 0 if r["bytes_equal_own_writer"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
