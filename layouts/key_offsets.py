"""Per-model key offsets for INT4 key smoothing, and the small file that carries them.

Attention does not change when one constant vector ``m`` is subtracted from every key of a
(layer, KV head): ``q·(k - m) = q·k - q·m`` shifts every logit of a query by the same amount.
LLM keys carry large per-channel offsets, so an INT4 writer that quantizes ``k - m`` stores a
smaller range per row in the same bytes (``kernels.write``'s ``key_offset``). ``m`` must be the
same for every key a query can see, so it is one constant per (layer, KV head) for the whole
model: calibrated once (``kvconnector calibrate``) over a stated range of positions, written to
an offsets file, and named in the layout descriptor by its fingerprint (field ``key_offset``)
so a decode worker never appends keys with another ``m`` than the prefill used.

The file (JSON, one object; values little-endian bf16 bits, base64)::

    {"format": "kvconnector-key-offsets", "version": 1,
     "model": str, "num_layers": L, "num_kv_heads": H, "head_size": D,
     "dtype": "bfloat16", "offsets": base64 of L*H*D uint16 (layer-major, then head, then channel),
     "calibration": {...}  (free-form: text, positions, command; not part of the identity),
     "fingerprint": 16 hex digits}

The values are bf16 numbers (the writers round ``m`` to the model dtype anyway; a bf16 model then
subtracts exactly the stored ``m``). The fingerprint is the first 16 hex digits of the sha256 of
``"key_offsets/1:L,H,D:"`` followed by the raw value bytes: the identity is the numbers alone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import LayoutError

FORMAT = "kvconnector-key-offsets"
VERSION = 1
NONE = "none"  # the descriptor's key_offset when keys are stored as they are
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16}$")
DATA_DIR = os.path.join(os.path.dirname(__file__), "data")  # offsets files shipped with the package


def _fingerprint(values: torch.Tensor) -> str:
    num_layers, num_kv_heads, head_size = values.shape
    raw = values.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    prefix = f"key_offsets/{VERSION}:{num_layers},{num_kv_heads},{head_size}:".encode()
    return hashlib.sha256(prefix + raw).hexdigest()[:16]


@dataclass(frozen=True)
class KeyOffsets:
    """Per-(layer, KV head) key offsets of one model.

    ``offsets``: [num_layers, num_kv_heads, head_size] float32 on CPU, every value a bf16 number
    (:meth:`from_tensor` rounds). ``calibration``: how they were made (text, positions, command).
    """

    model: str
    offsets: torch.Tensor
    calibration: dict = field(default_factory=dict)

    @classmethod
    def from_tensor(cls, offsets: torch.Tensor, model: str, calibration: dict | None = None) -> "KeyOffsets":
        """Round ``offsets [num_layers, num_kv_heads, head_size]`` to bf16 numbers (float32, CPU)."""
        if offsets.dim() != 3 or not offsets.is_floating_point():
            raise LayoutError(f"key offsets: expected a float [num_layers, num_kv_heads, head_size] tensor, "
                              f"got {offsets.dtype} {list(offsets.shape)}")
        if not torch.isfinite(offsets).all():
            raise LayoutError("key offsets: expected finite values, got NaN/Inf")
        return cls(model, offsets.detach().to("cpu", torch.bfloat16).float().contiguous(), dict(calibration or {}))

    @property
    def num_layers(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.offsets.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.offsets.shape[2])

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the values (what the layout descriptor's ``key_offset`` holds)."""
        return _fingerprint(self.offsets)

    def layer(self, layer_idx: int, head_start: int = 0, num_kv_heads: int | None = None,
              device="cpu") -> torch.Tensor:
        """``[num_kv_heads, head_size]`` float32 offsets of one layer's heads ``head_start ..``
        (a tensor-parallel rank's slice), on ``device``: the writers' ``key_offset``."""
        n = self.num_kv_heads - head_start if num_kv_heads is None else num_kv_heads
        if not 0 <= head_start and head_start + n <= self.num_kv_heads:
            raise LayoutError(f"key offsets heads [{head_start}, {head_start + n}): expected inside "
                              f"[0, {self.num_kv_heads})")
        return self.offsets[layer_idx, head_start:head_start + n].to(device)

    def check_model(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        """Raise :class:`LayoutError` unless the offsets fit a model of this shape."""
        want, got = (num_layers, num_kv_heads, head_size), tuple(self.offsets.shape)
        if got != want:
            raise LayoutError(f"key offsets of {self.model!r}: expected [num_layers, num_kv_heads, head_size] = "
                              f"{list(want)}, got {list(got)}")

    def to_json(self) -> dict:
        raw = self.offsets.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
        return {"format": FORMAT, "version": VERSION, "model": self.model, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_size": self.head_size, "dtype": "bfloat16",
                "offsets": base64.b64encode(raw).decode("ascii"), "calibration": self.calibration,
                "fingerprint": self.fingerprint}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_json(cls, d: dict, source: str = "key offsets") -> "KeyOffsets":
        """Inverse of :meth:`to_json`; checks the format, the sizes and the fingerprint."""
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
            raise LayoutError(f"{source}: expected format {FORMAT!r} version {VERSION}, got "
                              f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r} "
                              f"version {d.get('version') if isinstance(d, dict) else None}")
        try:
            shape = tuple(int(d[k]) for k in ("num_layers", "num_kv_heads", "head_size"))
            raw = base64.b64decode(d["offsets"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"{source}: bad field: {e}") from e
        if d.get("dtype") != "bfloat16" or not all(0 < s <= 1 << 12 for s in shape) \
                or len(raw) != 2 * shape[0] * shape[1] * shape[2]:
            raise LayoutError(f"{source}: expected bfloat16 values for shape {list(shape)} "
                              f"({2 * int(np.prod(shape))} bytes), got {d.get('dtype')!r} and {len(raw)} bytes")
        bits = torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape).copy())
        out = cls(str(d.get("model", "")), bits.view(torch.bfloat16).float(), dict(d.get("calibration") or {}))
        if d.get("fingerprint") != out.fingerprint:
            raise LayoutError(f"{source}: fingerprint field says {d.get('fingerprint')!r}, the values hash to "
                              f"{out.fingerprint!r}")
        return out

    @classmethod
    def load(cls, path: str) -> "KeyOffsets":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise LayoutError(f"key offsets file {path}: {e}") from e
        return cls.from_json(d, f"key offsets file {path}")


def shipped_key_offsets(model: str) -> str | None:
    """Path of the offsets file shipped for ``model`` (``layouts/data/<model>.key_offsets.json``), or None."""
    path = os.path.join(DATA_DIR, f"{model}.key_offsets.json")
    return path if os.path.isfile(path) else None


def check_key_offset_field(value, quantized_int4: bool) -> None:
    """The descriptor's ``key_offset``: ``"none"``, or an offsets fingerprint on an INT4 layout."""
    if value == NONE:
        return
    if not isinstance(value, str) or not FINGERPRINT_RE.match(value):
        raise LayoutError(f"descriptor key_offset: expected 'none' or 16 hex digits (an offsets fingerprint), "
                          f"got {value!r}")
    if not quantized_int4:
        raise LayoutError(f"descriptor key_offset: expected 'none' for a layout that is not INT4 (key smoothing "
                          f"is INT4 only), got {value!r}")
