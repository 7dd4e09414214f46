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
    """What the int4-mma kernel's lanes load (``int4_mma.lane_text``), from the model-dtype key offsets
    ``m: [num_kv_heads, head_size]`` (:func:`model_dtype_offset`): ``[2, head_size // 32,
    num_kv_heads, 4, 16]`` in the model dtype, contiguous and 16-byte aligned. Entry ``[kv, p, h,
    t]`` serves the lanes holding columns ``32·p + 8t .. + 8`` of head ``h``: its first 8 halves are
    those columns' rotation signs ``s`` (``±1``), its last 8 ``-s ⊙ m[h]`` (exact: a sign flip) for
    K (``kv = 0``) and -0 for V (``kv = 1``: the rows come out as without offsets). ``seed``: the
    sign seed (``layouts.rotation.rht_sign_seed()``), part of the key only."""
    return _derived(key_offset, ("lane", seed), _lane_entries)


def _lane_entries(m: torch.Tensor) -> torch.Tensor:
    heads, d = m.shape
    s = rht_signs(d).to(m.device, m.dtype).expand(heads, d)
    groups = (heads, d // 32, 4, 8)   # [h, p, t, 8 columns]
    sg = s.reshape(groups)
    k = torch.stack([sg, (m * -s).reshape(groups)], 3)   # [h, p, t, (s | -s·m), 8]
    v = torch.stack([sg, torch.full(groups, -0.0, dtype=m.dtype, device=m.device)], 3)
    return torch.stack([k, v]).transpose(1, 2).reshape(2, d // 32, heads, 4, 16).contiguous()
