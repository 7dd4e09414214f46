"""Quantize a synthetic K/V cache in every mode and report bytes and errors (no model needed)."""

from __future__ import annotations

import argparse
import time

import torch

from kernels.reference import (dequantize_rows, reference_reshape_and_cache,
                               reference_unified_attention)
from layouts import CacheGeometry, LayoutDescriptor, get_kv_quant_mode, split_kv_cache

from .argtypes import positive_int
from .errors import UsageError

MODES = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


EXAMPLES = """\
  kvconnector quickstart                               # 512 tokens x 4 KV heads x head_size 128
  kvconnector quickstart --head-size 64 --kv-heads 8 --tokens 2048
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int, default=512)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--q-heads", type=positive_int, default=16, help="a multiple of --kv-heads")
    p.add_argument("--head-size", type=positive_int, default=128,
                   help="INT4 needs a power of two >= 16 (the Hadamard rotation)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(args) -> int:
    if args.q_heads % args.kv_heads:
        raise UsageError(f"--q-heads: expected a multiple of --kv-heads ({args.kv_heads}), got {args.q_heads}")
    g = torch.Generator().manual_seed(args.seed)
    n, h, d, bs = args.tokens, args.kv_heads, args.head_size, args.block_size
    k = torch.randn(n, h, d, generator=g).bfloat16()
    v = torch.randn(n, h, d, generator=g).bfloat16()
    q = torch.randn(1, args.q_heads, d, generator=g).bfloat16()
    num_blocks = -(-n // bs)
    slots = torch.arange(n)
    block_table = torch.arange(num_blocks)[None]
    cu = torch.tensor([0, 1])
    seqused = torch.tensor([n])
    print(f"synthetic K/V: {n} tokens x {h} kv heads x head_size {d}, block_size {bs}")
    print(f"{'mode':<22}{'block bytes':>12}{'vs bf16':>9}{'K rel L2':>10}{'V rel L2':>10}{'attn rel L2':>12}{'ms':>8}")
    ref_out = None
    for s in MODES:
        mode = get_kv_quant_mode(s)
        geo = CacheGeometry(mode, d, h, bs, torch.bfloat16)
        cache = geo.new_cache(num_blocks)
        views = split_kv_cache(cache, mode, d)
        t0 = time.perf_counter()
        reference_reshape_and_cache(k, v, views.key_cache, views.value_cache, slots, mode,
                                    views.k_scale_cache, views.v_scale_cache)
        out = reference_unified_attention(q, views.key_cache, views.value_cache, cu, seqused, block_table,
                                          d ** -0.5, True, (-1, -1), 0.0, mode,
                                          views.k_scale_cache, views.v_scale_cache)
        ms = (time.perf_counter() - t0) * 1e3
        flat_k = views.key_cache.reshape(-1, h, geo.data_head_size)[:n]
        flat_v = views.value_cache.reshape(-1, h, geo.data_head_size)[:n]
        ks = views.k_scale_cache.reshape(-1, h)[:n] if mode.per_token_head else None
        vs = views.v_scale_cache.reshape(-1, h)[:n] if mode.per_token_head else None
        if ref_out is None:
            ref_out, bf16_bytes = out, geo.block_bytes
        desc = LayoutDescriptor.from_geometry(geo, num_layers=1, num_blocks=num_blocks)
        print(f"{s:<22}{geo.block_bytes:>12}{geo.block_bytes / bf16_bytes:>9.3f}"
              f"{_rel(dequantize_rows(flat_k, ks, mode), k):>10.4f}{_rel(dequantize_rows(flat_v, vs, mode), v):>10.4f}"
              f"{_rel(out, ref_out):>12.4f}{ms:>8.1f}   fingerprint {desc.fingerprint()}")
    return 0
