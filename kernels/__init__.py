"""Triton kernels (and their plain-PyTorch twins) for per-token-head quantized paged KV caches."""

from layouts import (KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache,  # noqa: F401
                     kv_cache_uses_per_token_head_scales)

from .reference import pack_int4_nibbles, single_rht, unpack_int4_nibbles  # noqa: F401
from .attention import unified_attention; from .attention_int4 import unified_attention_int4  # noqa: F401,E702
from .write import reshape_and_cache_flash, reshape_and_cache_int4, triton_reshape_and_cache_flash_per_token_head_quant  # noqa: F401,E501
