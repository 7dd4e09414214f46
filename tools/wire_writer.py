"""The project's cache writers as the ``write`` callables that :mod:`kvconnector.convert` takes.

``kvconnector`` does not import ``kernels``; a process that converts on the wire builds the
writer here and injects it (the vLLM adapter takes ``"wire_writer": "tools.wire_writer:kernel_writer"``).
The decode side writes its own caches with the same kernels, so the converted bytes are the
bytes it would have written itself.
"""

from __future__ import annotations

import torch

from layouts import KVQuantMode, get_kv_quant_mode, split_kv_cache


def kernel_writer(kv_cache_dtype: str):
    """``write(key, value, kv_cache, slot_mapping)`` for one packed layer of ``kv_cache_dtype``.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]`` bf16/fp16; ``kv_cache``: one
    layer ``[num_blocks, 2, block_size, num_kv_heads, P]`` (written in place at ``slot_mapping``,
    ``[num_tokens]`` int64). Runs the Triton kernels (their interpreter on CPU tensors).
    """
    from kernels import reshape_and_cache_flash, triton_reshape_and_cache_flash_per_token_head_quant

    mode = get_kv_quant_mode(kv_cache_dtype)

    def write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        head_size = key.shape[-1]
        kc, vc, ks, vs = split_kv_cache(kv_cache, mode, head_size)
        if mode == KVQuantMode.NONE:
            reshape_and_cache_flash(key, value, kc, vc, slot_mapping)
        else:
            triton_reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slot_mapping,
                                                                kv_quant_mode=mode)
    return write
