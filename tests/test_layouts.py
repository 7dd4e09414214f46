"""Layouts: mode parsing, cache shapes, golden byte positions of one row per mode, views.

Run: python -m pytest tests/test_layouts.py
"""

import struct

import pytest
import torch

from kernels.reference import reference_reshape_and_cache
from layouts import (CacheGeometry, KVQuantMode, LayoutError, get_kv_cache_shape, get_kv_quant_mode,
                     is_quantized_kv_cache, kv_cache_uses_per_token_head_scales, split_kv_cache)

M = KVQuantMode


@pytest.mark.parametrize("s,mode", [
    ("auto", M.NONE), ("bfloat16", M.NONE), ("float16", M.NONE),
    ("fp8", M.FP8_PER_TENSOR), ("fp8_e4m3", M.FP8_PER_TENSOR), ("fp8_e5m2", M.FP8_PER_TENSOR),
    ("int8_per_token_head", M.INT8_PER_TOKEN_HEAD), ("fp8_per_token_head", M.FP8_PER_TOKEN_HEAD),
    ("int4_per_token_head", M.INT4_PER_TOKEN_HEAD),
], ids=lambda v: str(v))
def test_mode_strings(s, mode):
    assert get_kv_quant_mode(s) is mode
    assert is_quantized_kv_cache(s) == (mode != M.NONE)
    assert kv_cache_uses_per_token_head_scales(s) == (mode in (2, 3, 4))


def test_mode_values_match_vllm():
    assert [int(m) for m in M] == [0, 1, 2, 3, 4]


def test_unknown_mode_lists_accepted():
    with pytest.raises(ValueError, match="int4_per_token_head.*fp8.*auto"):
        get_kv_quant_mode("int3")
    with pytest.raises(TypeError):
        get_kv_quant_mode(4)


@pytest.mark.parametrize("s,last", [("auto", 128), ("int8_per_token_head", 132),
                                    ("fp8_per_token_head", 132), ("int4_per_token_head", 68)],
                         ids=["none", "int8", "fp8", "int4"])
def test_cache_shape(s, last):
    assert get_kv_cache_shape(10, 16, 8, 128, s) == (10, 2, 16, 8, last)


@pytest.mark.parametrize("d", [8, 80, 96, 100], ids=lambda d: f"h{d}")
def test_int4_rejects_non_power_of_two(d):
    with pytest.raises(LayoutError, match="power of two"):
        get_kv_cache_shape(1, 16, 1, d, "int4_per_token_head")


def _golden_cache(mode, d, x_row, slot, head, kv, num_kv_heads=3, block_size=4, num_blocks=3):
    """Write one row through the oracle into a packed cache; return cache bytes and geometry."""
    geo = CacheGeometry(mode, d, num_kv_heads, block_size, torch.bfloat16)
    cache = geo.new_cache(num_blocks)
    cache.view(torch.uint8).fill_(0xAB)
    views = split_kv_cache(cache, mode, d)
    key = torch.zeros(1, num_kv_heads, d, dtype=torch.bfloat16)
    val = torch.zeros_like(key)
    (key if kv == 0 else val)[0, head] = x_row
    reference_reshape_and_cache(key, val, views.key_cache, views.value_cache, torch.tensor([slot]),
                                mode, views.k_scale_cache, views.v_scale_cache)
    return cache.view(torch.uint8).flatten(), geo


def test_golden_int4_row():
    d, slot, head, kv = 16, 6, 2, 1  # block 1, offset 2, V half
    x = torch.randn(d).bfloat16()
    raw, geo = _golden_cache(M.INT4_PER_TOKEN_HEAD, d, x, slot, head, kv)
    base = 1 * geo.block_bytes + geo.half_bytes + (2 * 3 + 2) * (d // 2 + 4)
    assert base == 1 * geo.block_bytes + geo.row_offset(kv, 2, head)
    # hand computation of docs/LAYOUT.md's INT4 formulas on the same row
    from kernels.reference import single_rht
    r = single_rht(x[None])[0].float()
    lo, hi = min(r.min().item(), 0.0), max(r.max().item(), 0.0)
    scale = torch.tensor(max((hi - lo) / 15, 1e-6), dtype=torch.float32)
    rha = lambda v: torch.sign(v) * torch.floor(v.abs() + 0.5)  # noqa: E731
    zp = int(rha(-torch.tensor(lo, dtype=torch.float32) / scale).clamp(0, 15))
    q = rha(r / scale + zp).clamp(0, 15).to(torch.int64).tolist()
    expect_bytes = [q[2 * i] | (q[2 * i + 1] << 4) for i in range(d // 2)]
    assert raw[base:base + d // 2].tolist() == expect_bytes
    bits = struct.unpack("<I", bytes(raw[base + d // 2:base + d // 2 + 4].tolist()))[0]
    assert bits & 0xF == zp
    assert bits & ~0xF == struct.unpack("<I", struct.pack("<f", scale.item()))[0] & ~0xF
    # every other byte of the cache is untouched except the K row written with zeros and
    # the V/K rows of other heads in the same slot (zeros inputs)
    touched = set()
    for h in range(3):
        for k in range(2):
            off = geo.block_bytes + geo.row_offset(k, 2, h)
            touched.update(range(off, off + geo.row_bytes))
    untouched = [i for i in range(raw.numel()) if i not in touched]
    assert (raw[untouched] == 0xAB).all()


def test_golden_int8_row():
    d = 16
    x = torch.linspace(-2.0, 1.0, d).bfloat16()
    raw, geo = _golden_cache(M.INT8_PER_TOKEN_HEAD, d, x, 3, 1, 0)
    base = geo.row_offset(0, 3, 1)
    scale = x.float().abs().max() / 127
    q = torch.round(x.float() / scale).to(torch.int8)
    assert raw[base:base + d].view(torch.int8).tolist() == q.tolist()
    assert raw[base + d:base + d + 4].tolist() == list(struct.pack("<f", scale.item()))


def test_golden_fp8_row():
    d = 16
    x = torch.linspace(-3.0, 5.0, d).bfloat16()
    raw, geo = _golden_cache(M.FP8_PER_TOKEN_HEAD, d, x, 0, 0, 1)
    base = geo.row_offset(1, 0, 0)
    scale = x.float().abs().max() / 448
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert raw[base:base + d].tolist() == q.view(torch.uint8).tolist()
    assert raw[base + d:base + d + 4].tolist() == list(struct.pack("<f", scale.item()))


def test_golden_bf16_row():
    d = 16
    x = torch.randn(d).bfloat16()
    raw, geo = _golden_cache(M.NONE, d, x, 5, 2, 0)
    base = geo.block_bytes + geo.row_offset(0, 1, 2)
    assert raw[base:base + 2 * d].tolist() == x.view(torch.uint8).tolist()  # little-endian halves


def test_views_at_storage_offset_alias_cache():
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, 32, 2, 4)
    backing = torch.zeros(64 + geo.block_bytes * 3, dtype=torch.uint8)
    cache = backing[64:].view(geo.shape(3))
    v = split_kv_cache(cache, M.INT4_PER_TOKEN_HEAD, 32)
    assert v.key_cache.shape == (3, 4, 2, 16) and v.k_scale_cache.shape == (3, 4, 2)
    v.v_scale_cache[2, 3, 1] = -1.5
    v.key_cache[1, 0, 1, 5] = 0x3C
    off = 64 + 2 * geo.block_bytes + geo.scale_offset(1, 3, 1)
    assert backing[off:off + 4].tolist() == list(struct.pack("<f", -1.5))
    assert backing[64 + geo.block_bytes + geo.row_offset(0, 0, 1) + 5] == 0x3C


def test_views_refuse_bad_tensors():
    geo = CacheGeometry(M.INT8_PER_TOKEN_HEAD, 32, 2, 4)
    cache = geo.new_cache(3)
    with pytest.raises(LayoutError, match="strides"):
        split_kv_cache(cache.transpose(2, 3).contiguous().transpose(2, 3), M.INT8_PER_TOKEN_HEAD, 32)
    with pytest.raises(LayoutError, match="dtype"):
        split_kv_cache(cache.view(torch.uint8), M.INT8_PER_TOKEN_HEAD, 32)
    with pytest.raises(LayoutError, match="last dim"):
        split_kv_cache(cache, M.INT8_PER_TOKEN_HEAD, 64)
    with pytest.raises(LayoutError, match="aligned"):
        split_kv_cache(torch.zeros(geo.block_bytes * 3 + 2, dtype=torch.int8)[2:].view(geo.shape(3)),
                       M.INT8_PER_TOKEN_HEAD, 32)
    with pytest.raises(LayoutError, match=r"\[num_blocks, 2"):
        split_kv_cache(cache[:, 0], M.INT8_PER_TOKEN_HEAD, 32)


def test_unquantized_views_have_no_scales():
    cache = CacheGeometry(M.NONE, 64, 2, 8, torch.float16).new_cache(2)
    v = split_kv_cache(cache, M.NONE)
    assert v.k_scale_cache is None and v.key_cache.shape == (2, 8, 2, 64)
