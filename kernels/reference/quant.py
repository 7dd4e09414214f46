"""The write side of the oracle: rotation, packing, quantization and cache writes in plain PyTorch.

Nothing here is fast; everything here is the definition the Triton write kernels are tested
against; each function's docstring states its math. Math runs in float32 on whatever device
the inputs are on.

Key smoothing (INT4 only): an optional per-(KV head) offset ``m`` is subtracted from every key
row before the rotation (:func:`smooth_keys`). Attention is unchanged by it (``q·(k − m) =
q·k − q·m``, one shift per query for every key it sees) as long as ``m`` is one constant per
head for the whole sequence; the row's range shrinks when keys carry large per-channel offsets.

Non-finite rows (any NaN/Inf in a row of K or V; for INT4 the rotation spreads one bad
element over the whole row): every quantized mode stores codes 0 and the scale
``NAN_SCALE_BITS`` (a quiet NaN, zero point 0), so the row dequantizes to all-NaN and
never to plausible finite numbers.
"""

from __future__ import annotations


import torch

from layouts import KVQuantMode, check_head_size, rht_signs
from layouts.geometry import NAN_SCALE_BITS, ZP_MASK

INT8_QMAX = 127.0
FP8_QMAX = 448.0
INT4_LEVELS = 15.0
MIN_SCALE = 1e-6


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform ``H·x`` over the last dim (float32 butterflies)."""
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape)


def single_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Signed Hadamard rotation of the last dim, computed in float32, returned in ``x.dtype``.

    forward: ``H·(s ⊙ x)``; inverse: ``s ⊙ (H·y)``; ``inverse(forward(x)) == d·x``.

    Parameters
    ----------
    x : [..., head_size] float tensor, head_size a power of two >= 16.
    """
    d = x.shape[-1]
    check_head_size(KVQuantMode.INT4_PER_TOKEN_HEAD, d)
    s = rht_signs(d, x.device)
    y = fwht(x.float() * s) if not inverse else fwht(x.float()) * s
    return y.to(x.dtype)


def pack_int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2k] codes in 0..15 -> [..., k] uint8, byte i = q[2i] | q[2i+1] << 4."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4_nibbles needs an even last dim, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4_nibbles(p: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2k] uint8 codes (inverse of :func:`pack_int4_nibbles`)."""
    p = p.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def nan_scale_like(scale: torch.Tensor) -> torch.Tensor:
    """float32 tensor like ``scale`` filled with the quiet NaN ``NAN_SCALE_BITS`` (zero point 0)."""
    return torch.full(scale.shape, NAN_SCALE_BITS, dtype=torch.int32, device=scale.device).view(torch.float32)


def _exact_divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor on ``like``'s device: CUDA PyTorch divides by a Python scalar
    as ``a * (1/b)`` (not correctly rounded), by a device tensor with true division, as on CPU."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def smooth_keys(key: torch.Tensor, key_offset: torch.Tensor) -> torch.Tensor:
    """Key rows with the offset subtracted: ``RN(key - RN(m))`` in ``key.dtype``.

    ``m`` is first rounded to the model dtype (round to nearest even), then subtracted in
    float32 and the difference rounded to the model dtype again, so the writers feed their
    unchanged rotation the same model-dtype rows. Any constant ``m`` keeps attention exact; the
    rounding of ``m`` only has to be the same for the writer and for whoever adds it back
    (:func:`unsmooth_keys`).

    Parameters
    ----------
    key : [..., num_kv_heads, head_size] bf16/fp16
    key_offset : [num_kv_heads, head_size] float32 (or the model dtype), same device
    """
    m = key_offset.to(key.dtype).float()
    return (key.float() - m).to(key.dtype)


def unsmooth_keys(key: torch.Tensor, key_offset: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """Dequantized keys with the offset added back: ``key + RN(m)`` as float32, ``m`` rounded to
    ``model_dtype`` as :func:`smooth_keys` rounded it.

    Parameters
    ----------
    key : [..., num_kv_heads, head_size] float (dequantized, unrotated)
    key_offset : [num_kv_heads, head_size] float32, same device
    model_dtype : the dtype the writer's keys had (bf16/fp16)
    """
    return key.float() + key_offset.to(model_dtype).float()


def quantize_int4_rows(x: torch.Tensor, shrink: tuple[float, ...] = (1.0,)):
    """INT4 per-row quantization of ``x``, rotation included.

    ``r = single_rht(x)`` rounded to ``x.dtype``; the range ``[min(r), max(r)]`` widened to
    include 0; ``scale = max((hi - lo) / 15, 1e-6)``, ``zp = clamp(rha(-lo / scale), 0, 15)``,
    ``q = clamp(rha(r / scale + zp), 0, 15)`` (``rha``: round half away from zero); codes packed
    two per byte (even element in the low nibble) and ``zp`` stored in the scale's low 4 bits.

    Parameters
    ----------
    x : [..., head_size] bf16/fp16
    shrink : factors applied to the zero-inclusive range; the one with the least squared
        error in the rotated domain wins per row. ``(1.0,)`` is the vLLM-compatible encoder.

    Returns
    -------
    packed : [..., head_size // 2] uint8
    scale : [...] float32 whose bits carry the zero point in the low 4 bits
    """
    r = single_rht(x).float()
    lo0 = r.amin(-1).clamp(max=0.0)
    hi0 = r.amax(-1).clamp(min=0.0)
    best = None
    for f in shrink:
        lo, hi = lo0 * f, hi0 * f
        scale = ((hi - lo) / _exact_divisor(INT4_LEVELS, r)).clamp(min=MIN_SCALE)
        zp = round_half_away(-lo / scale).clamp(0, INT4_LEVELS)
        q = round_half_away(r / scale[..., None] + zp[..., None]).clamp(0, INT4_LEVELS)
        err = ((q - zp[..., None]) * scale[..., None] - r).square().sum(-1)
        if best is None:
            best = [err, q, scale, zp]
        else:
            take = err < best[0]
            best[0] = torch.where(take, err, best[0])
            best[1] = torch.where(take[..., None], q, best[1])
            best[2] = torch.where(take, scale, best[2])
            best[3] = torch.where(take, zp, best[3])
    _, q, scale, zp = best
    bits = (_bits(scale) & ~ZP_MASK) | zp.to(torch.int32)
    bad = ~torch.isfinite(r).all(-1)
    bits = torch.where(bad, _bits(nan_scale_like(scale)), bits)
    q = torch.where(bad[..., None], torch.zeros_like(q), q)
    return pack_int4_nibbles(q), bits.view(torch.float32)


def decode_int4_scale(scale: torch.Tensor):
    """Stored float32 -> (scale with the low 4 bits cleared, zero point 0..15 as float32)."""
    bits = _bits(scale)
    return (bits & ~ZP_MASK).view(torch.float32), (bits & ZP_MASK).float()


def dequantize_int4_rows(packed: torch.Tensor, scale: torch.Tensor, rotated: bool = False,
                         out_dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_int4_rows`: ``[..., d/2]`` codes + ``[...]`` scales -> ``[..., d]``.

    With ``rotated=True`` the result stays in the rotated domain (what attention reads).
    """
    s, zp = decode_int4_scale(scale)
    r = (unpack_int4_nibbles(packed).float() - zp[..., None]) * s[..., None]
    if rotated:
        return r.to(out_dtype)
    return (single_rht(r, inverse=True) / r.shape[-1]).to(out_dtype)


def quantize_symmetric_rows(x: torch.Tensor, mode: KVQuantMode):
    """INT8 (round half to even) or FP8 e4m3fn (clamp ±448, cast) per-row quantization.

    Returns ``(codes [..., head_size] int8 | float8_e4m3fn, scale [...] float32)``.
    """
    xf = x.float()
    qmax = INT8_QMAX if mode == KVQuantMode.INT8_PER_TOKEN_HEAD else FP8_QMAX
    scale = (xf.abs().amax(-1) / _exact_divisor(qmax, xf)).clamp(min=MIN_SCALE)
    v = xf / scale[..., None]
    bad = ~torch.isfinite(xf).all(-1)
    v = torch.where(bad[..., None], torch.zeros_like(v), v)
    scale = torch.where(bad, nan_scale_like(scale), scale)
    if mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        q = torch.round(v).clamp(-128, 127).to(torch.int8)  # torch.round: half to even
    elif mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        q = v.clamp(-FP8_QMAX, FP8_QMAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantize_symmetric_rows: not a symmetric per-token-head mode: {mode!r}")
    return q, scale


def dequantize_symmetric_rows(q: torch.Tensor, scale: torch.Tensor, out_dtype=torch.float32):
    return (q.float() * scale[..., None]).to(out_dtype)


def quantize_rows(x: torch.Tensor, mode: KVQuantMode):
    """Dispatch: ``x [..., d]`` -> ``(data [..., data_head_size], scale [...] float32 | None)``."""
    mode = KVQuantMode(mode)
    if mode == KVQuantMode.NONE:
        return x, None
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return quantize_int4_rows(x)
    return quantize_symmetric_rows(x, mode)


def dequantize_rows(data: torch.Tensor, scale, mode: KVQuantMode, rotated: bool = False,
                    out_dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (INT4 optionally left in the rotated domain)."""
    mode = KVQuantMode(mode)
    if mode == KVQuantMode.NONE:
        return data.to(out_dtype)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return dequantize_int4_rows(data, scale, rotated=rotated, out_dtype=out_dtype)
    return dequantize_symmetric_rows(data, scale, out_dtype)


def reference_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None,
                                shrink: tuple[float, ...] = (1.0,), key_offset=None):
    """Oracle of the write kernels: quantize ``key``/``value`` rows into the cache by slot.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size], written in place
    slot_mapping : [num_tokens] int; slot = block_idx * block_size + offset; negative = skip
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, written in place
    shrink : INT4 only: the MSE encoder's range factors (:func:`quantize_int4_rows`)
    key_offset : INT4 only: [num_kv_heads, head_size] float32 per-head key offset, subtracted from
        every key row first (:func:`smooth_keys`); None: keys quantized as they are
    """
    mode = KVQuantMode(kv_quant_mode)
    if tuple(shrink) != (1.0,) and mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        raise ValueError(f"shrink: only the INT4 encoder has range factors, got {shrink} for {mode.name}")
    if key_offset is not None:
        if mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
            raise ValueError(f"key_offset: key smoothing applies to INT4_PER_TOKEN_HEAD only, got {mode.name}")
        key = smooth_keys(key, key_offset)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for x, cache, scales in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
            data, scale = quantize_int4_rows(x[keep], shrink=shrink)
        else:
            data, scale = quantize_rows(x[keep], mode)
        cache[blk, off] = data.to(cache.dtype)
        if scale is not None:
            scales[blk, off] = scale
