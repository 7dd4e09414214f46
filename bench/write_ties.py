"""Count the INT4 writer's tie rows: rows whose bytes differ from the PyTorch oracle.

The GPU default (path ``int4-mma``) rotates on tensor cores, which add in another order than the
oracle's butterfly, so a rotated value can rarely round to the neighbouring bf16/fp16;
``int4-lanes`` (``LanesTuning``) adds in the oracle's order and must give none. For each case
this prints the rows and codes that differ and the largest difference of a dequantized value, in
scales (a tie moves a value by at most one code step: <= 1.0)::

    python -m bench.write_ties                                 # random and outlier-channel K/V
    python -m bench.write_ties --dump-kv kv.pt                 # real K/V of SmolLM2-135M (CPU)
    python -m bench.write_ties --kv-file kv.pt                 # ... counted on the GPU

``--dump-kv`` runs the model over a text (``--text``, default the Apache-2.0 licence file) with
the dense reference forward and saves every layer's K and V (bf16), so the GPU machine, which
lacks the model package, can count them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from kernels.write import LanesTuning, MmaTuning, reshape_and_cache_int4  # noqa: E402
from layouts import CacheGeometry, KVQuantMode, split_kv_cache  # noqa: E402
from bench.write import _compare, oracle_write  # noqa: E402

KERNELS = {"mma": MmaTuning(), "lanes": LanesTuning()}  # --kernels: the path each name asks for
BS = 16


def count(key: torch.Tensor, value: torch.Tensor, tuning=None) -> tuple[int, int, float]:
    """(rows differing, codes differing, max |Δ dequantized| in scales) of one write of
    ``key``/``value`` [tokens, heads, d] at random slots against the oracle's bytes."""
    n, h, d = key.shape
    geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, d, h, BS, key.dtype)
    nb = -(-n // BS)
    ref, got = geo.new_cache(nb, key.device), geo.new_cache(nb, key.device)
    for c in (ref, got):
        c.view(torch.uint8).fill_(0xA5)
    slots = torch.randperm(nb * BS, device=key.device)[:n]
    gv = split_kv_cache(got, geo.mode, d)
    oracle_write("int4", key, value, slots, split_kv_cache(ref, geo.mode, d))
    reshape_and_cache_int4(key, value, gv.key_cache, gv.value_cache, slots, gv.k_scale_cache, gv.v_scale_cache,
                           tuning=tuning)
    return _compare("int4", geo, ref, got)


def synthetic(kind: str, tokens: int, heads: int, d: int, dtype, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """"random": unit normal K/V; "outliers": d/16 key channels x30 and one value channel x10."""
    k = torch.randn(tokens, heads, d, device=device, generator=gen)
    v = torch.randn(tokens, heads, d, device=device, generator=gen)
    if kind == "outliers":
        ch = torch.randperm(d, device=device, generator=gen)[: max(1, d // 16)]
        k[..., ch] *= 30.0
        v[..., ch[:1]] *= 10.0
    return k.to(dtype), v.to(dtype)


def model_kv(model: str, text_path: str | None = None, layers: int | None = None,
             tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K, V) ``[layers, tokens, kv_heads, head_size]`` bf16 of ``model`` over a text (``text_path``,
    default the Apache-2.0 licence file; its first ``tokens`` tokens if given), the rows its cache
    would hold (the dense reference forward), and the token count."""
    from tools.eval_accuracy import find_text
    from tools.llama import load_model
    from tools.llama.model import reference_forward
    weights, tok = load_model(model, synthetic_layers=layers)
    with open(find_text(text_path)) as f:
        ids = torch.tensor(tok.encode(f.read()), dtype=torch.long)[:tokens]
    ks, vs = [], []

    def capture(x):  # called for K, then V, of each layer
        (ks if len(ks) == len(vs) else vs).append(x.to(torch.bfloat16))
        return x
    with torch.no_grad():
        reference_forward(weights, ids, kv_transform=capture)
    return torch.stack(ks), torch.stack(vs), len(ids)


def dump_kv(path: str, text_path: str | None, model: str, layers: int | None) -> int:
    k, v, n = model_kv(model, text_path, layers)
    torch.save({"k": k, "v": v, "tokens": n, "model": model}, path)
    print(f"saved {k.shape[0]} layers x {n} tokens of K/V {tuple(k.shape[2:])} to {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=131072, help="tokens per synthetic case (x 8 heads x K and V)")
    p.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--kv-file", default=None, help="also count a --dump-kv file's layers")
    p.add_argument("--dump-kv", default=None, metavar="PATH", help="save a model's K/V to PATH and exit")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "synthetic"))
    p.add_argument("--layers", type=int, default=None, help="synthetic model's layer count")
    p.add_argument("--text", default=None)
    a = p.parse_args(argv)
    if a.dump_kv:
        return dump_kv(a.dump_kv, a.text, a.model, a.layers)
    dev = torch.device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    print(f"## INT4 writer vs oracle on {name}, {time.strftime('%Y-%m-%d')}\n")
    print("| K/V | dtype | head_size | rows | kernel | rows differing | codes differing | max Δ (scales) |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for kind in ("random", "outliers"):
        for dtype in (torch.bfloat16, torch.float16):
            for d in a.head_sizes:
                k, v = synthetic(kind, a.tokens, 8, d, dtype, dev, gen)
                for kernel in a.kernels:
                    rd, cd, err = count(k, v, KERNELS[kernel])
                    print(f"| {kind} | {str(dtype)[6:]} | {d} | {2 * k.shape[0] * 8} | {kernel} | {rd} | {cd} | "
                          f"{err:.3f} |", flush=True)
    if a.kv_file:
        kv = torch.load(a.kv_file)
        for kernel in a.kernels:
            per_layer = [count(k.to(dev), v.to(dev), KERNELS[kernel]) for k, v in zip(kv["k"], kv["v"])]
            rows = 2 * kv["k"].shape[0] * kv["k"].shape[1] * kv["k"].shape[2]
            rd, cd, err = (sum(r[0] for r in per_layer), sum(r[1] for r in per_layer), max(r[2] for r in per_layer))
            print(f"| {kv.get('model', '?')}: {kv['k'].shape[0]} layers x {kv['tokens']} tokens | bf16 | "
                  f"{kv['k'].shape[-1]} | {rows} | {kernel} | {rd} | {cd} | {err:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
