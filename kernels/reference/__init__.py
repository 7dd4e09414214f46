"""The oracle: plain-PyTorch twins of every kernel, the definition the kernels are tested against.

- ``quant.py``: the signed Hadamard rotation (``fwht``, ``single_rht``), INT4 nibble packing,
  INT4 / INT8 / FP8 row quantization and dequantization, and the cache write
  (``reference_reshape_and_cache``), key smoothing (``smooth_keys`` / ``unsmooth_keys``);
- ``attention.py``: varlen paged attention over any cache mode (``reference_unified_attention``),
  reading the cache through ``quant.dequantize_rows``.

Imports only ``layouts`` and torch, never the Triton kernels, so a kernel bug cannot hide in
its own oracle. The rotation's sign vector is ``layouts.rht_signs`` (re-exported here), shared
with the kernels.
"""

from layouts import KVQuantMode, check_head_size, rht_signs  # noqa: F401  (re-exported)
from layouts.geometry import NAN_SCALE_BITS, ZP_MASK  # noqa: F401  (re-exported)

from .attention import dequantize_cache, reference_unified_attention  # noqa: F401
from .quant import (FP8_QMAX, INT4_LEVELS, INT8_QMAX, MIN_SCALE, decode_int4_scale,  # noqa: F401
                    dequantize_int4_rows, dequantize_rows, dequantize_symmetric_rows, fwht, nan_scale_like,
                    pack_int4_nibbles, quantize_int4_rows, quantize_rows, quantize_symmetric_rows,
                    reference_reshape_and_cache, round_half_away, single_rht, smooth_keys,
                    unpack_int4_nibbles, unsmooth_keys)

__all__ = ["FP8_QMAX", "INT4_LEVELS", "INT8_QMAX", "KVQuantMode", "MIN_SCALE", "NAN_SCALE_BITS", "ZP_MASK",
           "check_head_size", "decode_int4_scale", "dequantize_cache", "dequantize_int4_rows", "dequantize_rows",
           "dequantize_symmetric_rows", "fwht", "nan_scale_like", "pack_int4_nibbles", "quantize_int4_rows",
           "quantize_rows", "quantize_symmetric_rows", "reference_reshape_and_cache", "reference_unified_attention",
           "rht_signs", "round_half_away", "single_rht", "smooth_keys", "unpack_int4_nibbles", "unsmooth_keys"]
