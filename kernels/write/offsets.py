"""Key offsets (key smoothing) as the write kernels read them, made once per offsets tensor.

A model writes every layer every step with the same offsets, and a conversion per call would add
a launch to every write, so each form below is made once per (tensor, in-place version, form) and
kept. An entry holds the tensor it was made from, so that tensor's address cannot be reused by
another tensor while the entry lives.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from layouts import rht_signs

_DERIVED: dict = {}  # (id, version, form) -> (the tensor it was made from, the derived tensor)
_MAX_DERIVED = 128


def _derived(t: torch.Tensor, form: tuple, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(t)``, made once per (``t``, its in-place version, ``form``) and kept (oldest dropped first)."""
    k = (id(t), t._version, form)
    hit = _DERIVED.get(k)
    if hit is None or hit[0] is not t:
        if len(_DERIVED) >= _MAX_DERIVED:
            _DERIVED.pop(next(iter(_DERIVED)))
        hit = _DERIVED[k] = (t, make(t))
    return hit[1]


def model_dtype_offset(key_offset: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``key_offset`` rounded to the model ``dtype`` (RNE), contiguous and 16-byte aligned, as the
    kernels read it (the register paths load it like the K rows, in 16-byte vectors); the tensor
    itself when it already is."""
    if key_offset is None or (key_offset.dtype == dtype and key_offset.is_contiguous()
                              and key_offset.data_ptr() % 16 == 0):
        return key_offset
    return _derived(key_offset, ("model dtype", dtype),
                    lambda t: t.to(dtype, copy=True, memory_format=torch.contiguous_format))


def lane_offset_table(key_offset: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``-s ⊙ m``: the model-dtype key offsets ``[num_kv_heads, head_size]`` (:func:`model_dtype_offset`)
    with each column's rotation sign applied and negated (exact), contiguous and 16-byte aligned,
    as the int4-mma kernel's lanes load them (``int4_mma.lane_offsets_text``). ``seed``: the sign
    seed (``layouts.rotation.rht_sign_seed()``), part of the key only."""
    return _derived(key_offset, ("lane", seed), lambda t: (t * -rht_signs(t.shape[-1]).to(t.device, t.dtype))
                    .contiguous())
