"""Conversion on the wire (``kvconnector.convert``): a bf16 prefill cache served to an INT8 / FP8 /
INT4 per-token-head decode cache, byte for byte what the decode side's own writer produces.

No vLLM needed (vLLM's CPU backend has no per-token-head cache; the vLLM adapter only moves its
own format). Run::

    python -m pytest tests/test_vllm_wire_convert.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from kernels import reshape_and_cache_flash
from kvconnector import DecodeEndpoint
from kvconnector.convert import ConvertingPrefill, wire_descriptor
from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor, LayoutMismatchError, split_kv_cache
from tools.wire_writer import kernel_writer

pytestmark = pytest.mark.timeout(300)

HEAD, HEADS, BLOCK, LAYERS, NBLK = 64, 2, 16, 2, 8


def _bf16_caches(num_tokens: int, block_ids, seed: int):
    geo = CacheGeometry(KVQuantMode.NONE, HEAD, HEADS, BLOCK, torch.bfloat16)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=LAYERS, num_blocks=NBLK)
    gen = torch.Generator().manual_seed(seed)
    caches, kv = [], []
    slots = (torch.tensor(block_ids)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:num_tokens]
    for _ in range(LAYERS):
        c = geo.new_cache(NBLK).zero_()
        k = (torch.randn(num_tokens, HEADS, HEAD, generator=gen) * 3).bfloat16()
        v = torch.randn(num_tokens, HEADS, HEAD, generator=gen).bfloat16()
        kc, vc, _, _ = split_kv_cache(c, KVQuantMode.NONE, HEAD)
        reshape_and_cache_flash(k, v, kc, vc, slots)
        caches.append(c)
        kv.append((k, v))
    return caches, desc, kv


def _decode_cache(mode: str, block_size: int = BLOCK):
    geo = CacheGeometry(KVQuantMode[{"int4_per_token_head": "INT4_PER_TOKEN_HEAD",
                                     "int8_per_token_head": "INT8_PER_TOKEN_HEAD",
                                     "fp8_per_token_head": "FP8_PER_TOKEN_HEAD"}[mode]],
                        HEAD, HEADS, block_size, torch.bfloat16)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=LAYERS, num_blocks=NBLK)
    return [geo.new_cache(NBLK).zero_() for _ in range(LAYERS)], desc


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"],
                         ids=["int8", "fp8", "int4"])
def test_converted_bytes_equal_decode_side_writer(mode):
    num_tokens, src_ids, dst_ids = 37, [5, 1, 6], [2, 7, 0]          # 2 full blocks + 5 tokens, remapped
    caches, desc, kv = _bf16_caches(num_tokens, src_ids, seed=3)
    dst, dst_desc = _decode_cache(mode)
    own, _ = _decode_cache(mode)
    write = kernel_writer(mode)
    own_slots = (torch.tensor(dst_ids)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:num_tokens]
    for layer, (k, v) in enumerate(kv):
        write(k, v, own[layer], own_slots)            # what the decode side writes from the same K/V
    with ConvertingPrefill(caches, desc, mode, write) as pre, DecodeEndpoint(dst, dst_desc) as dec:
        pre.publish("t", src_ids, num_tokens=num_tokens)
        dec.connect(pre.endpoint.endpoint, timeout_s=10)
        res = dec.pull("t", dst_ids, deadline_s=60).result(timeout=90)
    assert res.nbytes == LAYERS * len(src_ids) * dst_desc.block_bytes
    for layer in range(LAYERS):
        got, want = dst[layer].view(torch.uint8), own[layer].view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer}: {(got != want).sum().item()} bytes differ"
        assert got[dst_ids].any()                     # really written, not two zero caches


def test_other_mismatch_stays_refused_both_ends():
    caches, desc, _ = _bf16_caches(16, [0], seed=4)
    dst, dst_desc = _decode_cache("int4_per_token_head", block_size=2 * BLOCK)
    with ConvertingPrefill(caches, desc, "int4_per_token_head", kernel_writer("int4_per_token_head")) as pre, \
            DecodeEndpoint(dst, dst_desc) as dec:
        with pytest.raises(LayoutMismatchError, match="block_size"):
            dec.connect(pre.endpoint.endpoint, timeout_s=10)
        assert any(isinstance(e, LayoutMismatchError) and "block_size" in str(e) for e in pre.errors)


def test_only_unquantized_to_per_token_head_converts():
    _, desc, _ = _bf16_caches(1, [0], seed=5)
    with pytest.raises(LayoutMismatchError, match="quant_mode"):
        wire_descriptor(desc, "fp8")                                   # per-tensor FP8: not exact
    _, q_desc = _decode_cache("int8_per_token_head")
    with pytest.raises(LayoutMismatchError, match="quant_mode"):
        wire_descriptor(q_desc, "int4_per_token_head")                 # already quantized source
    assert KVQuantMode(wire_descriptor(desc, "int4_per_token_head").quant_mode) == KVQuantMode.INT4_PER_TOKEN_HEAD


def test_convert_demo_on_the_project_runner():
    """``kvconnector convert-demo``: the project's runner prefills in bf16, the prefill side
    converts to INT4 on the wire, and the decode side's pulled bytes equal its own writer's on the
    same K/V; then it generates from them. SmolLM2 when its package is installed (as in CI), else
    the synthetic model of the same shapes."""
    import subprocess
    import sys

    from tools.llama import find_gguf_path
    model = "smollm2" if find_gguf_path() else "synthetic"
    args = ["--model", model] + (["--synthetic-layers", "2"] if model == "synthetic" else [])
    r = subprocess.run([sys.executable, "-m", "tools.cli", "convert-demo", *args], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "converted to int4_per_token_head on the prefill side" in r.stdout
    assert "pulled bytes equal the decode side's own writer on the same K/V: True" in r.stdout
    if model == "smollm2":   # on this prompt the INT4 continuation is the bf16 run's, token for token
        decoded = r.stdout.split("decode (int4_per_token_head cache):")[1].split("\n")[0].strip()
        reference = r.stdout.split("all-bf16 reference:")[1].split("(")[0].strip()
        assert decoded == reference, (decoded, reference)
