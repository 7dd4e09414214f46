"""The versioned layout descriptor, its fingerprint and the compatibility rules.

A descriptor says everything a peer needs to interpret a block's bytes. Two endpoints
exchange descriptors in the handshake; :func:`check_compatible` decides, on both ends,
whether blocks may flow between them.

Field classes
-------------
- **exact** fields (:data:`EXACT_FIELDS`) must be equal; they are hashed into the
  fingerprint.
- ``num_blocks`` may differ freely (each side owns its pool).
- ``head_start`` / ``num_kv_heads`` may differ under different tensor parallelism: each
  range must lie inside ``[0, total_num_kv_heads)`` and the two ranges must overlap, since
  every (token, head) row carries its own scale and heads can be assembled row by row.

``key_offset`` (exact) names the per-model key offsets an INT4 writer subtracted from every key
(``layouts.key_offsets``): ``"none"`` or the offsets file's fingerprint. A layout without
smoothing leaves it out of :meth:`LayoutDescriptor.to_dict` and out of the fingerprint, so its
descriptor, its fingerprint and its dumps are those of a peer that predates the field; a map
without the field reads as ``"none"``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace

import torch

from .errors import LayoutError, LayoutMismatchError
from .geometry import CacheGeometry
from .key_offsets import NONE as NO_KEY_OFFSET
from .key_offsets import check_key_offset_field
from .modes import KVQuantMode

FORMAT_VERSION = 1
RHT_SIGN_SEED = 0x9E3779B9  # CPU torch.Generator seed of the ±1 rotation signs (vLLM's)

# Sanity bounds on what a peer or a file may claim (far above any real model), so a hostile
# descriptor cannot make a reader size buffers from absurd numbers.
_UPPER_BOUNDS = {"head_size": 1 << 12, "block_size": 1 << 16, "num_layers": 1 << 12,
                 "total_num_kv_heads": 1 << 12, "num_kv_heads": 1 << 12, "num_blocks": 1 << 32}

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class LayoutDescriptor:
    """Everything needed to read one model's cache blocks, msgpack-serialisable.

    Build one with :meth:`from_geometry`; every field is a plain int or str.
    """

    format_version: int
    quant_mode: int
    model_dtype: str
    storage_dtype: str
    head_size: int
    data_head_size: int
    scale_pad: int
    scale_dtype: str          # "float32" or "none"
    scale_position: str       # "row_tail" or "none"
    zero_point: str           # "scale_low4_bits" (INT4) or "none"
    rotation: str             # "hadamard_signed" (INT4) or "none"
    sign_seed: int
    nibble_order: str         # "even_low" (INT4) or "none"
    byte_order: str           # "little"
    block_size: int
    num_layers: int
    total_num_kv_heads: int
    head_start: int
    num_kv_heads: int
    num_blocks: int
    key_offset: str = NO_KEY_OFFSET  # "none" or the key offsets' fingerprint (INT4 key smoothing)

    @classmethod
    def from_geometry(cls, geo: CacheGeometry, *, num_layers: int, num_blocks: int,
                      head_start: int = 0, total_num_kv_heads: int | None = None,
                      key_offset: str = NO_KEY_OFFSET) -> "LayoutDescriptor":
        mode = geo.mode
        int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
        d = cls(
            format_version=FORMAT_VERSION,
            quant_mode=int(mode),
            model_dtype=_DTYPE_NAMES[geo.model_dtype],
            storage_dtype=str(geo.storage_dtype).removeprefix("torch."),
            head_size=geo.head_size,
            data_head_size=geo.data_head_size,
            scale_pad=geo.scale_pad,
            scale_dtype="float32" if mode.per_token_head else "none",
            scale_position="row_tail" if mode.per_token_head else "none",
            zero_point="scale_low4_bits" if int4 else "none",
            rotation="hadamard_signed" if int4 else "none",
            sign_seed=RHT_SIGN_SEED if int4 else 0,
            nibble_order="even_low" if int4 else "none",
            byte_order="little",
            block_size=geo.block_size,
            num_layers=num_layers,
            total_num_kv_heads=geo.num_kv_heads if total_num_kv_heads is None else total_num_kv_heads,
            head_start=head_start,
            num_kv_heads=geo.num_kv_heads,
            num_blocks=num_blocks,
            key_offset=key_offset,
        )
        d.validate()
        return d

    def validate(self) -> None:
        """Raise :class:`LayoutError` when the descriptor is internally inconsistent."""
        for f in fields(self):
            v = getattr(self, f.name)
            want = str if f.type in ("str", str) else int  # annotations are strings here
            if not isinstance(v, want) or isinstance(v, bool):
                raise LayoutError(f"descriptor field {f.name}: expected int or str "
                                  f"({want.__name__} here), got {type(v).__name__}")
        for name, bound in _UPPER_BOUNDS.items():
            if not 0 <= getattr(self, name) <= bound:
                raise LayoutError(f"descriptor {name}: expected 0..{bound}, got {getattr(self, name)}")
        if self.format_version != FORMAT_VERSION:
            raise LayoutError(f"descriptor format_version: expected {FORMAT_VERSION}, got {self.format_version}")
        try:
            geo = self.geometry()
        except ValueError as e:
            raise LayoutError(f"descriptor geometry invalid: {e}") from e
        if (geo.data_head_size, geo.scale_pad) != (self.data_head_size, self.scale_pad):
            raise LayoutError(
                f"descriptor data_head_size/scale_pad: expected {geo.data_head_size}/{geo.scale_pad}, "
                f"got {self.data_head_size}/{self.scale_pad}")
        if not (0 <= self.head_start and self.head_start + self.num_kv_heads <= self.total_num_kv_heads):
            raise LayoutError(
                f"descriptor heads [{self.head_start}, {self.head_start + self.num_kv_heads}) "
                f"outside [0, {self.total_num_kv_heads})")
        if self.num_layers <= 0 or self.num_blocks < 0:
            raise LayoutError(f"descriptor num_layers={self.num_layers}, num_blocks={self.num_blocks}")
        check_key_offset_field(self.key_offset, self.quant_mode == int(KVQuantMode.INT4_PER_TOKEN_HEAD))

    def geometry(self) -> CacheGeometry:
        try:
            dtype = getattr(torch, self.model_dtype)
            mode = KVQuantMode(self.quant_mode)
        except (AttributeError, ValueError) as e:
            raise LayoutError(f"descriptor names unknown mode/dtype: {e}") from e
        return CacheGeometry(mode, self.head_size, self.num_kv_heads, self.block_size, dtype)

    @property
    def block_bytes(self) -> int:
        return self.geometry().block_bytes

    @property
    def head_range(self) -> range:
        return range(self.head_start, self.head_start + self.num_kv_heads)

    def to_dict(self) -> dict:
        """Plain dict of ints and strs (what goes into msgpack); ``key_offset`` only when set."""
        d = asdict(self)
        if d["key_offset"] == NO_KEY_OFFSET:
            del d["key_offset"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LayoutDescriptor":
        """Inverse of :meth:`to_dict`; validates, raising :class:`LayoutError` on bad input."""
        if not isinstance(d, dict):
            raise LayoutError(f"descriptor: expected a map, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        d = {"key_offset": NO_KEY_OFFSET, **d}  # written without it: keys stored as they are
        missing = [n for n in names if n not in d]
        extra = [k for k in d if k not in names]
        if missing or extra:
            raise LayoutError(f"descriptor fields: missing {missing}, unexpected {extra}")
        out = cls(**{n: d[n] for n in names})
        out.validate()
        return out

    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of the exact-match fields (sha256 of canonical JSON);
        ``key_offset`` takes part only when set, so unsmoothed layouts keep their fingerprints."""
        exact = {n: getattr(self, n) for n in EXACT_FIELDS}
        if exact["key_offset"] == NO_KEY_OFFSET:
            del exact["key_offset"]
        blob = json.dumps(exact, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_(self, **changes) -> "LayoutDescriptor":
        """Copy with some fields changed (not validated: tests build bad descriptors)."""
        return replace(self, **changes)


FREE_FIELDS = ("num_blocks",)
HEAD_FIELDS = ("head_start", "num_kv_heads")
EXACT_FIELDS = tuple(f.name for f in fields(LayoutDescriptor) if f.name not in FREE_FIELDS + HEAD_FIELDS)


def check_compatible(local: LayoutDescriptor, remote: LayoutDescriptor, context: str = "") -> range:
    """Check that blocks may flow between ``local`` and ``remote``.

    Returns
    -------
    range
        The global KV heads both sides hold (the heads that can be exchanged).

    Raises
    ------
    LayoutMismatchError
        Listing every differing exact field with both values, and the head fields when
        the head ranges are illegal or disjoint.
    """
    diffs = [(n, getattr(local, n), getattr(remote, n)) for n in EXACT_FIELDS
             if getattr(local, n) != getattr(remote, n)]
    lo = max(local.head_start, remote.head_start)
    hi = min(local.head_start + local.num_kv_heads, remote.head_start + remote.num_kv_heads)
    heads_ok = (  # total_num_kv_heads itself is an exact field, reported above
        all(0 <= d.head_start and d.num_kv_heads > 0
                and d.head_start + d.num_kv_heads <= d.total_num_kv_heads for d in (local, remote))
        and lo < hi
    )
    if not heads_ok:
        diffs += [(n, getattr(local, n), getattr(remote, n)) for n in HEAD_FIELDS]
    if diffs:
        raise LayoutMismatchError(diffs, context)
    return range(lo, hi)
