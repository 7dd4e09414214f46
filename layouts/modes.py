"""KV-cache quantization modes and the parsing of vLLM ``--kv-cache-dtype`` strings.

Strings are parsed once, at the edge, by :func:`get_kv_quant_mode`; everything inside the
library passes :class:`KVQuantMode` values.
"""

from __future__ import annotations

import enum

import torch


class KVQuantMode(enum.IntEnum):
    """How a KV cache stores one (token, head) row. Integer values match vLLM's."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4

    @property
    def per_token_head(self) -> bool:
        """True for the modes that store a float32 scale after every row."""
        return self in _PER_TOKEN_HEAD


_PER_TOKEN_HEAD = frozenset(
    {KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD}
)

PER_TOKEN_HEAD_STRINGS = {
    "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
    "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
    "int4_per_token_head": KVQuantMode.INT4_PER_TOKEN_HEAD,
}
UNQUANTIZED_STRINGS = ("auto", "bfloat16", "float16", "half", "float32")
FP8_PER_TENSOR_STRINGS = ("fp8", "fp8_e4m3", "fp8_e5m2")
ACCEPTED_STRINGS = tuple(PER_TOKEN_HEAD_STRINGS) + FP8_PER_TENSOR_STRINGS + UNQUANTIZED_STRINGS


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """Parse a vLLM ``--kv-cache-dtype`` string.

    Exact per-token-head names first, then any string starting with ``fp8`` is per-tensor
    FP8, then the unquantized dtype names. Anything else is a ``ValueError`` that lists the
    accepted strings.
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    if kv_cache_dtype in PER_TOKEN_HEAD_STRINGS:
        return PER_TOKEN_HEAD_STRINGS[kv_cache_dtype]
    if kv_cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    if kv_cache_dtype in UNQUANTIZED_STRINGS:
        return KVQuantMode.NONE
    raise ValueError(
        f"unknown kv cache dtype {kv_cache_dtype!r}; accepted: {', '.join(ACCEPTED_STRINGS)}"
    )


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """True when the string names any quantized cache (per-tensor FP8 included)."""
    return get_kv_quant_mode(kv_cache_dtype) != KVQuantMode.NONE


def kv_cache_uses_per_token_head_scales(kv_cache_dtype: str) -> bool:
    """True when every (token, head) row carries its own inline float32 scale."""
    return get_kv_quant_mode(kv_cache_dtype).per_token_head


def storage_dtype(mode: KVQuantMode, model_dtype: torch.dtype) -> torch.dtype:
    """torch dtype of the cache tensor for ``mode`` (the model dtype when unquantized)."""
    if mode == KVQuantMode.NONE:
        return model_dtype
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return torch.uint8
    if mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        return torch.int8
    if mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        return torch.float8_e4m3fn
    return torch.float8_e4m3fn  # FP8_PER_TENSOR: parsed, storage only; kernels may refuse it
