"""Triton kernels (and their plain-PyTorch twins) for per-token-head quantized paged KV caches.

Four wings, each with a package docstring that maps its files:

- ``kernels/write/``: the cache writers (bf16 copy, symmetric INT8 / FP8, INT4 with the
  rotation in registers or on tensor cores, the tiled INT4 path with the MSE range search);
  ``write_plan(...)`` decides which one serves a call.
- ``kernels/attention/``: paged attention (the 2D prefill / mixed kernel, the portable Triton
  decode family, the Gluon decode that stages whole cache blocks for large batches on CUDA
  GPUs, the split-KV reduction, the INT4 query rotation); ``attention_plan(...)`` decides.
- ``kernels/reference/``: the plain-PyTorch oracle of every kernel; it imports nothing from the
  kernels, and the kernels import nothing from it.
- ``kernels/transfer/``: the connector's device passes over payload frames (gather + ``mix64``
  checksum, verify + scatter), handed to ``kvconnector`` endpoints as ``FRAME_OPS``; their oracle
  is ``layouts.checksum`` and ``kvconnector.blocks``.

docs/KERNELS.md lists which kernel runs for which call on CPU and on an H200, and why each
exists. Every kernel compiles on CUDA tensors and runs through Triton's interpreter on CPU
tensors (``kernels._jit.dual_jit``). The package re-exports the oracle's ``single_rht`` and
nibble packing, names vLLM users expect here.
"""

from layouts import (KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache,  # noqa: F401
                     kv_cache_uses_per_token_head_scales)

from .attention import (Tiling, Tuning, attention_plan, unified_attention,  # noqa: F401
                        unified_attention_int4)
from .reference import pack_int4_nibbles, single_rht, unpack_int4_nibbles  # noqa: F401
from .write import (reshape_and_cache_flash, reshape_and_cache_int4,  # noqa: F401
                    triton_reshape_and_cache_flash_per_token_head_quant, write_plan)
