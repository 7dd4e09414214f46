"""Triton kernels (and their plain-PyTorch twins) for per-token-head quantized paged KV caches.

Every kernel compiles on CUDA tensors and runs through Triton's interpreter on CPU tensors
(``kernels._jit.dual_jit``); ``kernels.reference`` holds the oracle of each.
"""

from layouts import (KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache,  # noqa: F401
                     kv_cache_uses_per_token_head_scales)

from .attention import (Tiling, Tuning, attention_plan, unified_attention,  # noqa: F401
                        unified_attention_int4)
from .reference import pack_int4_nibbles, single_rht, unpack_int4_nibbles  # noqa: F401
from .write import (reshape_and_cache_flash, reshape_and_cache_int4,  # noqa: F401
                    triton_reshape_and_cache_flash_per_token_head_quant, write_plan)
