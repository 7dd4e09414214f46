"""Teacher-forced accuracy of a quantized KV cache against the unquantized one.

One variant = one cache configuration. The whole text runs as one prefill: every layer writes
its K/V into the variant's cache and every query attends over the cache, so each position's
next-token distribution sees quantized keys and values of all earlier tokens (and its own).
Compared with the unquantized (bf16) cache: top-1 agreement and mean KL(base || variant) of
the next-token distributions, and per layer the relative L2 error of the stored K and V.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kernels.paged_cache import PagedKVCache
from kernels.reference import INT4_LEVELS, MIN_SCALE, dequantize_rows, round_half_away, unsmooth_keys
from .model import LlamaRunner

MSE_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # six range factors the MSE-optimal encoder tries


@dataclass(frozen=True)
class Variant:
    """A cache configuration to evaluate.

    ``fake`` variants (reference only) quantize-dequantize K/V in PyTorch and store the result
    in an unquantized cache; the others go through the write and attention kernels.
    """

    name: str
    cache_dtype: str
    int4_shrink: Optional[tuple] = None
    fake: Optional[str] = None  # "int4_norot"
    smooth: Optional[str] = None  # key smoothing: "model" (an offsets file) or "prompt" (the prompt's own mean)

    @property
    def rotated(self) -> bool:
        """Whether the variant's cache holds rotated rows (its numbers depend on the sign vector)."""
        return self.cache_dtype == "int4_per_token_head"


VARIANTS = {
    "bf16": Variant("bf16", "auto"),
    "int8": Variant("int8", "int8_per_token_head"),
    "fp8": Variant("fp8", "fp8_per_token_head"),
    "int4": Variant("int4", "int4_per_token_head"),
    "int4-norot": Variant("int4-norot", "auto", fake="int4_norot"),
    "int4-mse": Variant("int4-mse", "int4_per_token_head", int4_shrink=MSE_SHRINK),
    "int4-smooth": Variant("int4-smooth", "int4_per_token_head", smooth="model"),
    "int4-smooth-mse": Variant("int4-smooth-mse", "int4_per_token_head", int4_shrink=MSE_SHRINK, smooth="model"),
    "int4-smooth-prompt": Variant("int4-smooth-prompt", "int4_per_token_head", smooth="prompt"),
}


def int4_norot_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The INT4 asymmetric per-row quantization of docs/LAYOUT.md *without* the Hadamard rotation, dequantized.

    ``x [..., d]`` (rounded to bf16 first, as the kernels see it) -> float32 ``[..., d]``.
    """
    x = x.to(torch.bfloat16).float()
    lo = x.amin(-1, keepdim=True).clamp(max=0.0)
    hi = x.amax(-1, keepdim=True).clamp(min=0.0)
    scale = ((hi - lo) / INT4_LEVELS).clamp(min=MIN_SCALE)
    zp = round_half_away(-lo / scale).clamp(0, INT4_LEVELS)
    q = round_half_away(x / scale + zp).clamp(0, INT4_LEVELS)
    return (q - zp) * scale


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over all elements, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@dataclass
class VariantResult:
    name: str
    logprobs: torch.Tensor                  # [num_tokens, vocab] float32
    kv: list = field(default_factory=list)  # per layer (K, V) bf16-rounded float32 inputs
    seconds: float = 0.0


def run_variant(runner: LlamaRunner, token_ids: torch.Tensor, variant: Variant, backend: str,
                block_size: int = 16, keep_kv: bool = False,
                progress: Optional[Callable[[int], None]] = None, key_offsets=None) -> VariantResult:
    """Teacher-forced prefill of ``token_ids`` through ``variant``'s cache.

    Returns the next-token log-probabilities of every position and, with ``keep_kv``, each
    layer's K/V ``[num_tokens, num_kv_heads, head_size]`` as written (before quantization).
    ``key_offsets`` (``layouts.KeyOffsets``): the offsets of a smoothing variant.
    """
    cfg = runner.config
    n = int(token_ids.shape[0])
    cache = _cache_for(variant, cfg.num_layers, cfg.num_kv_heads, cfg.head_size, n, block_size,
                       token_ids.device, backend, key_offsets)
    block_ids = cache.allocate(n)
    kv = []

    def hook(i, k, v):
        if keep_kv:
            kv.append((k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()))
        if variant.fake == "int4_norot":
            return int4_norot_roundtrip(k), int4_norot_roundtrip(v)
        return None

    t0 = time.perf_counter()
    logits = runner.forward(token_ids, 0, cache, block_ids, all_logits=True, kv_hook=hook, progress=progress)
    seconds = time.perf_counter() - t0
    return VariantResult(variant.name, torch.log_softmax(logits.float(), dim=-1), kv, seconds)


def _cache_for(variant: Variant, num_layers, num_kv_heads, head_size, num_tokens, block_size, device, backend,
               key_offsets=None):
    if variant.smooth and key_offsets is None:
        raise ValueError(f"variant {variant.name}: key smoothing needs key offsets")
    return PagedKVCache(variant.cache_dtype, num_layers, num_kv_heads, head_size,
                        num_blocks=-(-num_tokens // block_size), block_size=block_size,
                        device=device, backend=backend, int4_shrink=variant.int4_shrink,
                        key_offsets=key_offsets if variant.smooth else None)


def prompt_key_offsets(kv: list):
    """The prompt's own mean key per (layer, KV head) (``kv`` as in :attr:`VariantResult.kv`):
    the offsets of the ``smooth="prompt"`` variant. Per request, so a cache written with it
    cannot be reused by another request's prefix (its keys carry another ``m``)."""
    from layouts import KeyOffsets

    return KeyOffsets.from_tensor(torch.stack([k.double().mean(0).float().cpu() for k, _ in kv]), "prompt")


def roundtrip_errors(kv: list, variant: Variant, backend: str, block_size: int = 16,
                     key_offsets=None) -> tuple[list, list]:
    """Per-layer relative L2 error of K and of V after a write into ``variant``'s cache and a
    dequantizing read back (fake variants: their PyTorch round trip; smoothing variants: the
    layer's offsets added back to the keys). ``kv`` as in :attr:`VariantResult.kv`."""
    from layouts import KeyOffsets

    ke, ve = [], []
    for i, (kb, vb) in enumerate(kv):
        if variant.fake == "int4_norot":
            k_hat, v_hat = int4_norot_roundtrip(kb), int4_norot_roundtrip(vb)
        else:
            n, h, d = kb.shape
            layer_offsets = None
            if variant.smooth:
                layer_offsets = KeyOffsets(key_offsets.model, key_offsets.offsets[i:i + 1])
            cache = _cache_for(variant, 1, h, d, n, block_size, kb.device, backend, layer_offsets)
            block_ids = cache.allocate(n)
            cache.write(0, kb, vb, cache.slot_mapping(block_ids, 0, n))
            k_hat, v_hat = read_back(cache, 0, block_ids, n)
            if variant.smooth:
                k_hat = unsmooth_keys(k_hat, cache.key_offset(0), cache.geometry.model_dtype)
        ke.append(rel_l2(k_hat, kb))
        ve.append(rel_l2(v_hat, vb))
    return ke, ve


def read_back(cache: PagedKVCache, layer_idx: int, block_ids, num_tokens: int):
    """Dequantized K and V of the first ``num_tokens`` slots of ``block_ids`` (float32)."""
    v = cache.views[layer_idx]
    ids = torch.as_tensor(list(block_ids), device=v.key_cache.device)
    d = cache.geometry.data_head_size
    h = cache.geometry.num_kv_heads
    out = []
    for data, scale in ((v.key_cache, v.k_scale_cache), (v.value_cache, v.v_scale_cache)):
        rows = data[ids].reshape(-1, h, d)[:num_tokens]
        sc = scale[ids].reshape(-1, h)[:num_tokens] if scale is not None else None
        out.append(dequantize_rows(rows, sc, cache.mode))
    return out


def compare(base: VariantResult, other: VariantResult) -> dict:
    """Top-1 agreement (%) and mean KL(base || other) in nats over all positions."""
    top1 = (base.logprobs.argmax(-1) == other.logprobs.argmax(-1)).double().mean().item() * 100
    kl = (base.logprobs.exp() * (base.logprobs - other.logprobs)).sum(-1).clamp(min=0).mean().item()
    return {"top1": top1, "kl": kl}


__all__ = ["MSE_SHRINK", "VARIANTS", "Variant", "VariantResult", "compare", "int4_norot_roundtrip",
           "prompt_key_offsets", "read_back", "rel_l2", "roundtrip_errors", "run_variant"]
