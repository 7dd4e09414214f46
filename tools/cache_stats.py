"""Statistics of packed cache blocks per (layer, block, K/V, head): codes, scales, values, error.

The engine behind ``kvconnector inspect``. One :class:`HeadStats` holds additive counters
for every (K/V, head) of one block, so blocks merge into per-layer totals and layers into
a whole-dump total without keeping the bytes around.

What is counted, per (K/V, head):

- ``code_hist``: INT4 nibble values 0..15 (16 bins); INT8 values -128..127 (bin = q + 128);
  FP8 e4m3fn bit patterns 0x00..0xFF (256 bins); none for unquantized caches.
- ``zp_hist`` (INT4): the zero point hidden in the scale's low 4 bits, 16 bins.
- ``saturated``: codes at the ends of the range: INT4 0 or 15, INT8 -128, -127 or 127 (the
  symmetric writer maps a row's absmax to ±127, so -127 is as saturated as 127), FP8 ±448.
  For INT4 every row that spans zero hits both ends by construction (the range's min and max
  map onto them), so expect about two saturated codes per row there.
- ``code_nan``: FP8 NaN bit patterns (e4m3fn has no Inf); for unquantized caches the
  non-finite stored values.
- scales (per-token-head modes): finite min / max (INT4: low 4 bits cleared), NaN and Inf counts.
  A row with a NaN scale is the writer's marker for a non-finite input row.
- dequantized values (``kernels.reference.dequantize_rows``, INT4 back in the un-rotated
  domain): finite count, sum, sum of squares, min, max, and the non-finite count.
- with a reference block (same shape, float): squared error and squared reference norm over
  entries where both are finite, and the max absolute error; the relative L2 error is
  ``sqrt(err_sq / ref_sq)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from kernels.reference import decode_int4_scale, dequantize_rows, unpack_int4_nibbles
from layouts import CacheGeometry, KVQuantMode, LayoutError

FP8_SAT_PATTERNS = (0x7E, 0xFE)   # e4m3fn ±448, the largest finite magnitude
FP8_NAN_PATTERNS = (0x7F, 0xFF)   # e4m3fn's only NaN encodings; it has no Inf
KV_NAMES = ("K", "V")


def num_code_bins(mode: KVQuantMode) -> int:
    """Histogram bins of the stored codes: 16 (INT4), 256 (INT8/FP8), 0 (unquantized)."""
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return 16
    return 256 if mode.per_token_head else 0


def split_block(block: torch.Tensor, geo: CacheGeometry):
    """Split one block into codes and scales.

    Parameters
    ----------
    block : [2, block_size, num_kv_heads, P] in the storage dtype of ``geo.mode``, any device

    Returns
    -------
    data : [2, block_size, num_kv_heads, data_head_size], storage dtype (a view)
    scale : [2, block_size, num_kv_heads] float32 (a copy), or None when the mode has no scale
    """
    want = (2, geo.block_size, geo.num_kv_heads, geo.row_elems)
    if tuple(block.shape) != want or block.dtype != geo.storage_dtype:
        raise LayoutError(f"block: expected {want} {geo.storage_dtype}, got {tuple(block.shape)} {block.dtype}")
    data = block[..., :geo.data_head_size]
    if not geo.mode.per_token_head:
        return data, None
    tail = block.view(torch.uint8)[..., geo.data_bytes:geo.data_bytes + 4].contiguous()
    return data, tail.view(torch.float32).squeeze(-1)


@dataclass
class HeadStats:
    """Additive statistics of a set of blocks, one entry per (K/V, head).

    Every field is a tensor whose first two dims are ``[2, num_kv_heads]`` (K then V).
    """

    code_hist: torch.Tensor   # [2, H, num_code_bins] int64
    zp_hist: torch.Tensor     # [2, H, 16 or 0] int64
    saturated: torch.Tensor   # [2, H] int64
    code_nan: torch.Tensor    # [2, H] int64
    num_rows: torch.Tensor    # [2, H] int64
    scale_min: torch.Tensor   # [2, H] float64, +inf when no finite scale was seen
    scale_max: torch.Tensor   # [2, H] float64, -inf when no finite scale was seen
    scale_nan: torch.Tensor   # [2, H] int64
    scale_inf: torch.Tensor   # [2, H] int64
    count: torch.Tensor       # [2, H] int64, finite dequantized values
    nonfinite: torch.Tensor   # [2, H] int64, non-finite dequantized values
    total: torch.Tensor       # [2, H] float64
    total_sq: torch.Tensor    # [2, H] float64
    value_min: torch.Tensor   # [2, H] float64
    value_max: torch.Tensor   # [2, H] float64
    err_sq: torch.Tensor      # [2, H] float64 (zeros without a reference)
    ref_sq: torch.Tensor      # [2, H] float64
    err_max: torch.Tensor     # [2, H] float64
    has_reference: bool = False

    def merge(self, other: "HeadStats") -> "HeadStats":
        """Combine two sets of blocks with the same heads (returns a new object)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "has_reference":
                out[f.name] = a and b
            elif f.name in ("scale_min", "value_min"):
                out[f.name] = torch.minimum(a, b)
            elif f.name in ("scale_max", "value_max", "err_max"):
                out[f.name] = torch.maximum(a, b)
            else:
                out[f.name] = a + b
        return HeadStats(**out)

    def summary(self, kv: int, head: int) -> dict:
        """Plain-Python numbers of one (K/V, head): what ``--json`` and the table print."""
        def f(t):
            x = float(t[kv, head])
            return x if math.isfinite(x) else None

        n = int(self.count[kv, head])
        mean = float(self.total[kv, head]) / n if n else None
        var = float(self.total_sq[kv, head]) / n - mean * mean if n else None
        ref = float(self.ref_sq[kv, head])
        rel = math.sqrt(float(self.err_sq[kv, head]) / ref) if self.has_reference and ref > 0 else None
        return {
            "kv": KV_NAMES[kv], "head": head, "rows": int(self.num_rows[kv, head]),
            "code_hist": self.code_hist[kv, head].tolist(), "zp_hist": self.zp_hist[kv, head].tolist(),
            "saturated": int(self.saturated[kv, head]), "code_nan": int(self.code_nan[kv, head]),
            "scale_min": f(self.scale_min), "scale_max": f(self.scale_max),
            "scale_nan": int(self.scale_nan[kv, head]), "scale_inf": int(self.scale_inf[kv, head]),
            "values": n, "nonfinite": int(self.nonfinite[kv, head]),
            "mean": mean, "std": math.sqrt(max(var, 0.0)) if n else None,
            "min": f(self.value_min), "max": f(self.value_max),
            "rel_l2_err": rel, "max_abs_err": f(self.err_max) if self.has_reference else None,
        }


def _per_head(x: torch.Tensor, op) -> torch.Tensor:
    """Reduce ``x [2, N, H, ...]`` over every dim but (K/V, head) -> ``[2, H]``."""
    x = x.movedim(2, 1).reshape(2, x.shape[2], -1)
    return op(x)


def _hist(codes: torch.Tensor, nbins: int) -> torch.Tensor:
    """``codes [2, N, H, k]`` int64 in [0, nbins) -> ``[2, H, nbins]`` counts."""
    two, _, h = codes.shape[:3]
    idx = torch.arange(2 * h, device=codes.device).view(2, 1, h, *([1] * (codes.dim() - 3))) * nbins
    flat = (codes + idx).flatten()
    return torch.bincount(flat, minlength=2 * h * nbins).view(2, h, nbins).cpu()


def block_stats(block: torch.Tensor, geo: CacheGeometry, reference: torch.Tensor | None = None,
                key_offset: torch.Tensor | None = None) -> HeadStats:
    """Statistics of one block.

    Parameters
    ----------
    block : [2, block_size, num_kv_heads, P] storage dtype, any device (read only)
    geo : CacheGeometry of the block
    reference : [2, block_size, num_kv_heads, head_size] float (bf16/fp16/fp32), optional
        The values the block was written from (e.g. the same block of a bf16 dump).
    key_offset : [num_kv_heads, head_size] float32, optional
        The key offsets a smoothed INT4 writer subtracted: added back (rounded to the model dtype,
        as the writer rounded them) to the dequantized keys, so statistics describe the keys.

    Returns
    -------
    HeadStats
        Counters on the CPU.
    """
    mode = geo.mode
    data, scale = split_block(block, geo)
    h = geo.num_kv_heads
    zeros_i = torch.zeros(2, h, dtype=torch.int64)
    nbins = num_code_bins(mode)
    code_hist = torch.zeros(2, h, nbins, dtype=torch.int64)
    zp_hist = torch.zeros(2, h, 0, dtype=torch.int64)
    saturated, code_nan = zeros_i.clone(), zeros_i.clone()
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        codes = unpack_int4_nibbles(data).long()
        code_hist = _hist(codes, 16)
        saturated = code_hist[..., 0] + code_hist[..., 15]
        zp_hist = _hist(decode_int4_scale(scale)[1].long().unsqueeze(-1), 16)
    elif mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        code_hist = _hist(data.long() + 128, 256)
        saturated = code_hist[..., 0] + code_hist[..., 1] + code_hist[..., 255]
    elif mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        code_hist = _hist(data.view(torch.uint8).long(), 256)
        saturated = sum(code_hist[..., p] for p in FP8_SAT_PATTERNS)
        code_nan = sum(code_hist[..., p] for p in FP8_NAN_PATTERNS)
    elif mode == KVQuantMode.NONE:
        code_nan = _per_head(~torch.isfinite(data.float()), lambda x: x.sum(-1)).cpu()
    else:
        raise LayoutError(f"statistics: {mode.name} caches are not supported")

    inf64 = torch.full((2, h), math.inf, dtype=torch.float64)
    scale_min, scale_max, scale_nan, scale_inf = inf64.clone(), -inf64, zeros_i.clone(), zeros_i.clone()
    if scale is not None:
        s = decode_int4_scale(scale)[0] if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else scale
        s = s.double()
        fin = torch.isfinite(s)
        scale_min = _per_head(torch.where(fin, s, math.inf), lambda x: x.amin(-1)).cpu()
        scale_max = _per_head(torch.where(fin, s, -math.inf), lambda x: x.amax(-1)).cpu()
        scale_nan = _per_head(torch.isnan(s), lambda x: x.sum(-1)).cpu()
        scale_inf = _per_head(torch.isinf(s), lambda x: x.sum(-1)).cpu()

    x = dequantize_rows(data, scale, mode).double()      # [2, N, H, head_size]
    if key_offset is not None:
        x[0] += key_offset.to(geo.model_dtype).to(x.device).double()
    fin = torch.isfinite(x)
    xz = torch.where(fin, x, 0.0)
    err_sq, ref_sq, err_max = (torch.zeros(2, h, dtype=torch.float64) for _ in range(3))
    if reference is not None:
        want = (2, geo.block_size, h, geo.head_size)
        if tuple(reference.shape) != want:
            raise LayoutError(f"reference block: expected {want}, got {tuple(reference.shape)}")
        r = reference.to(x.device).double()
        both = fin & torch.isfinite(r)
        e = torch.where(both, x - r, 0.0)
        err_sq = _per_head(e * e, lambda t: t.sum(-1)).cpu()
        ref_sq = _per_head(torch.where(both, r * r, 0.0), lambda t: t.sum(-1)).cpu()
        err_max = _per_head(e.abs(), lambda t: t.amax(-1)).cpu()
    return HeadStats(
        code_hist=code_hist, zp_hist=zp_hist, saturated=saturated, code_nan=code_nan,
        num_rows=torch.full((2, h), geo.block_size, dtype=torch.int64),
        scale_min=scale_min, scale_max=scale_max, scale_nan=scale_nan, scale_inf=scale_inf,
        count=_per_head(fin, lambda t: t.sum(-1)).cpu(),
        nonfinite=_per_head(~fin, lambda t: t.sum(-1)).cpu(),
        total=_per_head(xz, lambda t: t.sum(-1)).cpu(),
        total_sq=_per_head(xz * xz, lambda t: t.sum(-1)).cpu(),
        value_min=_per_head(torch.where(fin, x, math.inf), lambda t: t.amin(-1)).cpu(),
        value_max=_per_head(torch.where(fin, x, -math.inf), lambda t: t.amax(-1)).cpu(),
        err_sq=err_sq, ref_sq=ref_sq, err_max=err_max, has_reference=reference is not None,
    )


class CacheStats:
    """Statistics of a dump: per (layer, block) and per layer, merged as blocks are added."""

    def __init__(self, geo: CacheGeometry, head_start: int = 0, keep_blocks: bool = True):
        self.geo = geo
        self.head_start = head_start
        self.keep_blocks = keep_blocks    # per-block stats cost ~2·H·(bins + 20)·8 bytes per block
        self.blocks: dict[tuple[int, int], HeadStats] = {}
        self.layers: dict[int, HeadStats] = {}

    def add_block(self, layer_idx: int, block_id: int, block: torch.Tensor,
                  reference: torch.Tensor | None = None, key_offset: torch.Tensor | None = None) -> HeadStats:
        st = block_stats(block, self.geo, reference, key_offset)
        if self.keep_blocks:
            self.blocks[(layer_idx, block_id)] = st
        self.layers[layer_idx] = st if layer_idx not in self.layers else self.layers[layer_idx].merge(st)
        return st

    @property
    def has_reference(self) -> bool:
        return bool(self.layers) and all(s.has_reference for s in self.layers.values())

    def _heads(self, st: HeadStats) -> list[dict]:
        out = []
        for kv in (0, 1):
            for h in range(self.geo.num_kv_heads):
                d = st.summary(kv, h)
                d["head"] = self.head_start + h   # global head index under tensor parallelism
                out.append(d)
        return out

    def to_dict(self) -> dict:
        """Nested plain dict: ``layers[i].heads`` totals and ``layers[i].blocks[j].heads``
        (``blocks`` empty unless ``keep_blocks``)."""
        layers = []
        for layer_idx in sorted(self.layers):
            blocks = [{"block": b, "heads": self._heads(self.blocks[(l, b)])}
                      for (l, b) in self.blocks if l == layer_idx]   # in the order added
            layers.append({"layer": layer_idx, "heads": self._heads(self.layers[layer_idx]), "blocks": blocks})
        return {"layers": layers}

    def error_grid(self) -> torch.Tensor:
        """``[num_layers_seen, 2, num_kv_heads]`` relative L2 error (NaN without a reference)."""
        rows = []
        for layer_idx in sorted(self.layers):
            st = self.layers[layer_idx]
            rel = (st.err_sq / st.ref_sq).sqrt() if st.has_reference else torch.full_like(st.err_sq, math.nan)
            rows.append(torch.where(st.ref_sq > 0, rel, math.nan))
        return torch.stack(rows) if rows else torch.empty(0, 2, self.geo.num_kv_heads)
