"""Seeded synthetic caches for ``kvconnector serve`` and the transfer benchmark.

Two kinds, both reproducible from ``(descriptor, seed)`` in any process:

- :func:`written_caches`: Gaussian K/V (``N(0, 1)``, the descriptor's model dtype) quantized
  into the cache by the project's write kernel (or its PyTorch oracle), so every code,
  scale and zero point is one a real writer produces: ``inspect`` shows sane statistics and
  ``verify --strict`` passes. What ``serve`` publishes by default.
- :func:`random_byte_caches`: uniform random bytes (every code and scale bit pattern,
  NaN and huge scales included): for transfer benchmarks, where only the bytes matter.
"""

from __future__ import annotations

import torch

from layouts import KVQuantMode, LayoutDescriptor, LayoutError, split_kv_cache

WRITERS = ("auto", "triton", "reference")
# Triton's interpreter writes about 2,000 (token, head) rows per second on one CPU core:
# up to this many rows per cache, "auto" uses the kernel on CPU too (a few seconds at most)
CPU_TRITON_MAX_ROWS = 16384


def random_byte_caches(desc: LayoutDescriptor, seed: int, device="cpu") -> list:
    """One packed cache per layer of ``desc`` filled with seeded uniform random bytes.

    Returns
    -------
    list of [num_blocks, 2, block_size, num_kv_heads, P] storage-dtype tensors on ``device``
    """
    geo, gen = desc.geometry(), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(desc.num_layers):
        c = geo.new_cache(desc.num_blocks)
        raw = c.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        out.append(c.to(device))
    return out


def resolve_writer(writer: str, desc: LayoutDescriptor, device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA or for small CPU caches, else ``"reference"``."""
    if writer not in WRITERS:
        raise ValueError(f"writer: expected one of {WRITERS}, got {writer!r}")
    if writer != "auto":
        return writer
    rows = desc.num_layers * desc.num_blocks * desc.block_size * desc.num_kv_heads
    return "triton" if torch.device(device).type == "cuda" or rows <= CPU_TRITON_MAX_ROWS else "reference"


def describe_writer(writer: str) -> str:
    return {"triton": "the Triton write kernel",
            "reference": "the write kernel's PyTorch oracle (kernels.reference)"}[writer]


def written_caches(desc: LayoutDescriptor, seed: int, device="cpu", writer: str = "triton") -> list:
    """One packed cache per layer, every slot written from seeded Gaussian K/V.

    Parameters
    ----------
    desc : LayoutDescriptor (any mode but FP8 per-tensor, which the kernels do not write)
    writer : "triton" (``kernels.triton_reshape_and_cache_flash_per_token_head_quant`` /
        ``kernels.reshape_and_cache_flash``) or "reference" (``kernels.reference``)

    Returns
    -------
    list of [num_blocks, 2, block_size, num_kv_heads, P] storage-dtype tensors on ``device``
        Layer ``l``'s K and V are ``torch.randn`` of ``[num_blocks * block_size,
        num_kv_heads, head_size]`` from a CPU generator seeded ``seed * 1000 + l``, cast to
        the model dtype; slot ``i`` holds token ``i``.
    """
    import kernels
    from kernels.reference import reference_reshape_and_cache

    geo = desc.geometry()
    mode = geo.mode
    if mode == KVQuantMode.FP8_PER_TENSOR:
        raise LayoutError("synthetic cache: fp8 per-tensor caches are not written by the kernels; "
                          "use --fill random")
    num_tokens = desc.num_blocks * desc.block_size
    slots = torch.arange(num_tokens, device=device)
    out = []
    for layer in range(desc.num_layers):
        gen = torch.Generator().manual_seed(seed * 1000 + layer)
        shape = (num_tokens, desc.num_kv_heads, desc.head_size)
        k = torch.randn(shape, generator=gen).to(device=device, dtype=geo.model_dtype)
        v = torch.randn(shape, generator=gen).to(device=device, dtype=geo.model_dtype)
        cache = geo.new_cache(desc.num_blocks, torch.device(device)).zero_()
        views = split_kv_cache(cache, mode, desc.head_size)
        if writer == "reference":
            reference_reshape_and_cache(k, v, views.key_cache, views.value_cache, slots, mode,
                                        views.k_scale_cache, views.v_scale_cache)
        elif mode == KVQuantMode.NONE:
            kernels.reshape_and_cache_flash(k, v, views.key_cache, views.value_cache, slots)
        else:
            kernels.triton_reshape_and_cache_flash_per_token_head_quant(
                k, v, views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache, slots,
                kv_quant_mode=mode)
        out.append(cache)
    return out
