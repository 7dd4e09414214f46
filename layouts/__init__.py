"""Cache geometry, quant modes, layout descriptors and errors: the single source of truth.

Imports only torch and the standard library; ``kernels``, ``kvconnector`` and ``tools`` build on it.
"""

from .descriptor import (EXACT_FIELDS, FORMAT_VERSION, RHT_SIGN_SEED, LayoutDescriptor,
                         check_compatible)
from .errors import (CorruptFrameError, KVCacheError, LayoutError, LayoutMismatchError, PeerError,
                     ProtocolVersionError, TransferError, TransferTimeoutError)
from .key_offsets import KeyOffsets, shipped_key_offsets
from .geometry import SCALE_BYTES, CacheGeometry, check_head_size, get_kv_cache_shape
from .rotation import rht_signs
from .modes import (ACCEPTED_STRINGS, KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache,
                    kv_cache_uses_per_token_head_scales, storage_dtype)
from .views import KVCacheViews, check_packed_strides, geometry_of, split_kv_cache

__all__ = [
    "ACCEPTED_STRINGS", "CacheGeometry", "CorruptFrameError", "EXACT_FIELDS", "FORMAT_VERSION",
    "KVCacheError", "KVCacheViews", "KVQuantMode", "KeyOffsets", "LayoutDescriptor", "LayoutError",
    "LayoutMismatchError", "PeerError", "ProtocolVersionError", "RHT_SIGN_SEED", "SCALE_BYTES",
    "TransferError", "TransferTimeoutError", "check_compatible", "check_head_size",
    "check_packed_strides", "geometry_of", "get_kv_cache_shape", "get_kv_quant_mode",
    "is_quantized_kv_cache", "kv_cache_uses_per_token_head_scales", "rht_signs", "shipped_key_offsets",
    "split_kv_cache", "storage_dtype",
]
