"""A small GGUF (v2/v3) parser: metadata as Python values, tensors as numpy views of the file.

``gguf.GGUFReader`` builds a numpy memmap view for every part of every metadata field, which
for SmolLM2's 49,152-token vocabulary and 48,900 merges costs about 3 s of one core: most of
the demo's model load. Here the metadata is read with ``struct`` from one ``bytes`` object
(tens of milliseconds) and each tensor is a numpy view of a memory map, in the shapes
``gguf.quants.dequantize`` takes (the quantized row bytes last).

Layout (little-endian): ``"GGUF"``, u32 version, u64 tensor count, u64 metadata count; each
metadata entry is a string key, a u32 value type and the value (arrays: u32 element type,
u64 count, elements); each tensor info is a string name, u32 dims, u64 dims (fastest first),
u32 ggml type, u64 offset from the data section, which starts at the next multiple of
``general.alignment`` (default 32) after the infos. A string is a u64 length and UTF-8 bytes.

:func:`dequantize` expands F32, Q8_0 and Q4_1 (what the SmolLM2 file holds) with a few
whole-tensor numpy operations, in the same float32 arithmetic as ``gguf.quants`` (the model
tests compare them bit for bit), and falls back to ``gguf.quants.dequantize`` for other types.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
F32, Q4_1, Q8_0 = 0, 3, 8      # ggml type ids


@dataclass
class GGUFTensor:
    name: str
    tensor_type: int        # ggml type (gguf.GGMLQuantizationType value)
    shape: tuple            # numpy order (slowest first)
    data: np.ndarray        # float32 [shape] or uint8 [rows..., row bytes] for block-quantized types


class GGUFFile:
    """``fields``: metadata key -> value (str, int, float, bool, or list); ``tensors``: name -> GGUFTensor."""

    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version: expected 2 or 3, got {version}")
        self._pos = 24
        self.fields = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ndim = self._u32()
            dims = struct.unpack_from(f"<{ndim}Q", buf, self._pos)
            self._pos += 8 * ndim
            ttype, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {}
        for name, dims, ttype, offset in infos:
            block, type_bytes = GGML_QUANT_SIZES[ttype]
            shape = tuple(int(d) for d in reversed(dims))
            count = int(np.prod(shape))
            nbytes = count // block * type_bytes
            raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start + offset)
            if block == 1:   # plain element types: F32, F16, ...
                data = raw.view(np.dtype(f"<f{type_bytes}") if type_bytes in (2, 4, 8) else np.uint8).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_bytes)
            self.tensors[name] = GGUFTensor(name, ttype, shape, data)

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._map, self._pos)
        self._pos += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        s = self._map[self._pos + 8:self._pos + 8 + n].decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype = self._u32()
            (count,) = struct.unpack_from("<Q", self._map, self._pos)
            self._pos += 8
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype in _NUMPY:
                arr = np.frombuffer(self._map, dtype=_NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v


def dequantize(t: GGUFTensor) -> np.ndarray:
    """float32 ``[t.shape]`` values of a tensor (a fresh, writable array).

    Q8_0 blocks (34 bytes / 32 values): f16 scale ``d``, 32 int8 ``q``: ``x = q * d``.
    Q4_1 blocks (20 bytes / 32 values): f16 ``d``, f16 ``m``, 16 bytes whose low nibbles are
    values 0..15 and high nibbles 16..31: ``x = d * q + m``.
    """
    if t.tensor_type == F32:
        return np.array(t.data, dtype=np.float32)
    if t.tensor_type == Q8_0:
        blocks = t.data.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)          # [n, 1]
        q = blocks[:, 2:].view(np.int8).astype(np.float32)                     # [n, 32]
        return (q * d).reshape(t.shape)
    if t.tensor_type == Q4_1:
        blocks = t.data.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)         # [n, 1]
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]                                                     # [n, 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)   # [n, 32]
        return (d * q + m).reshape(t.shape)
    from gguf.quants import dequantize as gguf_dequantize
    return np.require(gguf_dequantize(t.data, t.tensor_type), np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
