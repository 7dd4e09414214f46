"""Cache-write kernels (``kernels.write``) against the PyTorch oracle.

Covers INT4 (both rotations of int4-fused, int4-lanes with 1, 2, 4 and 8 parts, int4-mma's part
split, the MSE encoder), INT8, FP8 and bf16/fp16 writes through Triton's interpreter on CPU with
small shapes: codes and scale bits identical to the oracle, dequantized
values within the format's rounding bound, both calling conventions (separate tensors and views
of one packed cache at a nonzero storage offset), negative slots and poisoned caches, edge rows
(zeros, constants, one-hot, outliers, NaN/Inf), strided inputs, launcher errors, and a smoke run
of ``bench/write.py --quick``. CUDA-only tests repeat the comparison at a realistic size.
``tests/test_write_plan.py`` covers which path runs.

Run: ``python -m pytest tests/test_write_kernels.py -q``
"""

import math
import time

import pytest
import torch

from kernels.reference import (NAN_SCALE_BITS, dequantize_rows, quantize_int4_rows,
                               reference_reshape_and_cache)
from kernels.write import (FusedTuning, LanesTuning, MmaTuning, TileTuning, reshape_and_cache_flash,
                           reshape_and_cache_int4, triton_reshape_and_cache_flash_per_token_head_quant)
from kernels.write import record_launches
from kernels.write.tuning import MMA_TILING
from layouts import CacheGeometry, KVQuantMode, LayoutError, split_kv_cache

M = KVQuantMode
MODES = {"bf16": M.NONE, "int8": M.INT8_PER_TOKEN_HEAD, "fp8": M.FP8_PER_TOKEN_HEAD, "int4": M.INT4_PER_TOKEN_HEAD}
POISON = 0xA5
H, BS = 2, 16

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN warnings inside the interpreter


def _cache(mode, d, num_blocks, dtype, packed, device="cpu"):
    """Poisoned cache: (tensor holding every byte, KVCacheViews)."""
    geo = CacheGeometry(mode, d, H, BS, dtype)
    if packed:  # one packed layer two blocks into a larger allocation: nonzero storage offset
        whole = geo.new_cache(num_blocks + 2, device)
        whole.view(torch.uint8).fill_(POISON)
        cache = whole[2:]
        return cache, split_kv_cache(cache, mode, d)
    sd, dd = geo.storage_dtype, geo.data_head_size
    kc, vc = (torch.full((num_blocks, BS, H, dd * sd.itemsize), POISON, dtype=torch.uint8, device=device).view(sd)
              for _ in range(2))
    scales = [None, None]
    if mode.per_token_head:
        scales = [torch.full((num_blocks, BS, H, 4), POISON, dtype=torch.uint8, device=device).view(torch.float32)[..., 0]
                  for _ in range(2)]
    from layouts import KVCacheViews
    views = KVCacheViews(kc, vc, *scales)
    return views, views


def _bytes(holder):
    if isinstance(holder, torch.Tensor):
        return holder.view(torch.uint8).clone()
    return torch.cat([t.contiguous().view(torch.uint8).flatten() for t in holder if t is not None])


def _write(mode, key, value, slots, v, **kw):
    if mode == M.NONE:
        return reshape_and_cache_flash(key, value, v.key_cache, v.value_cache, slots, **kw)
    return triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, slots, mode, **kw)


def _inputs(num_tokens, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(num_tokens, H, d, generator=g) * 2).to(dtype)
    value = torch.randn(num_tokens, H, d, generator=g).to(dtype)
    return key, value


def _run_both(mode, key, value, slots, num_blocks, packed, **kw):
    """(oracle bytes, kernel bytes, kernel views) for the same poisoned cache."""
    out = []
    for impl in ("oracle", "kernel"):
        holder, v = _cache(mode, key.shape[-1], num_blocks, key.dtype, packed)
        if impl == "oracle":
            reference_reshape_and_cache(key, value, v.key_cache, v.value_cache, slots, mode,
                                        v.k_scale_cache, v.v_scale_cache)
        else:
            _write(mode, key, value, slots, v, **kw)
        out.append((_bytes(holder), v))
    return out[0][0], out[1][0], out[1][1]


CASES = [(m, dt, d, packed) for m in MODES for dt in (torch.bfloat16, torch.float16) for d in (64, 128)
         for packed in (False, True)] + [("int4", torch.bfloat16, 256, True), ("int8", torch.float16, 96, True)]


@pytest.mark.parametrize("mode_name,dtype,d,packed", CASES,
                         ids=[f"{m}-{str(dt)[6:]}-h{d}-{'packed' if p else 'separate'}" for m, dt, d, p in CASES])
def test_matches_oracle_bit_for_bit(mode_name, dtype, d, packed):
    mode = MODES[mode_name]
    num_tokens, num_blocks = 37, 4  # 37 tokens: the last block is partial
    key, value = _inputs(num_tokens, d, dtype, seed=d)
    slots = torch.randperm(num_blocks * BS)[:num_tokens]
    slots[[3, 20]] = -1  # skipped: those slots keep the poison
    ref, got, views = _run_both(mode, key, value, slots, num_blocks, packed)
    assert torch.equal(ref, got), f"{int((ref != got).sum())} bytes differ from the oracle"
    unwritten = sorted(set(range(num_blocks * BS)) - set(slots.tolist()))
    untouched = views.key_cache.reshape(num_blocks * BS, H, -1)[unwritten].view(torch.uint8)
    assert (untouched == POISON).all(), "a slot that no token maps to was written"


@pytest.mark.parametrize("mode_name", ["int8", "fp8", "int4"])
def test_interpreter_with_two_rounding_fma(mode_name, monkeypatch):
    """Triton 3.6's interpreter computes ``tl.fma`` as a multiply then an add (two roundings; 3.9
    fuses them). The writers' exact division must not depend on it: with that interpreter
    behaviour patched in, every byte still equals the oracle's (Markstein's correction, which
    needs a true FMA, gave wrong quotients in a few rows of every mode there)."""
    from triton.runtime import interpreter
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_fma"):
        pytest.skip("this Triton's interpreter has no create_fma to patch")
    monkeypatch.setattr(builder, "create_fma", lambda self, x, y, z: interpreter.TensorHandle(
        x.data * y.data + z.data, z.dtype.scalar))
    mode = MODES[mode_name]
    for dtype in (torch.bfloat16, torch.float16):
        key, value = _inputs(64, 128, dtype, seed=3)
        slots = torch.randperm(5 * BS)[:64]
        ref, got, _ = _run_both(mode, key, value, slots, 5, packed=True)
        assert torch.equal(ref, got), f"{dtype}: {int((ref != got).sum())} bytes differ from the oracle"


@pytest.mark.parametrize("mode_name", list(MODES), ids=list(MODES))
def test_dequantized_within_rounding_bound(mode_name):
    mode = MODES[mode_name]
    key, value = _inputs(32, 64, torch.bfloat16, seed=7)
    slots = torch.arange(32)
    _, v = _cache(mode, 64, 2, torch.bfloat16, packed=True)
    _write(mode, key, value, slots, v)
    got = dequantize_rows(v.key_cache.reshape(32, H, -1), None if mode == M.NONE else v.k_scale_cache.reshape(32, H),
                          mode, rotated=mode == M.INT4_PER_TOKEN_HEAD)
    x = key.float()
    if mode == M.NONE:
        assert torch.equal(got, x)
    elif mode == M.INT8_PER_TOKEN_HEAD:  # round to nearest: half a step, plus fp32 slack
        assert ((got - x).abs() <= v.k_scale_cache.reshape(32, H, 1) * 0.5001).all()
    elif mode == M.FP8_PER_TOKEN_HEAD:  # e4m3 keeps 3 mantissa bits: relative 2**-4, subnormal step 2**-9
        step = v.k_scale_cache.reshape(32, H, 1) * 2.0 ** -9
        assert ((got - x).abs() <= x.abs() * 2.0 ** -4 + step).all()
    else:  # rotated domain: half a code step (ties land exactly on it; 1e-5 covers fp32 rounding)
        from kernels.reference import decode_int4_scale, single_rht
        scale, _ = decode_int4_scale(v.k_scale_cache.reshape(32, H))
        r = single_rht(key).float()
        assert ((got - r).abs() <= scale[..., None] * 0.5 * (1 + 1e-5)).all()


EDGE_ROWS = ["zeros", "constant", "negative-constant", "one-hot", "one-hot-last", "outlier", "tiny", "nan", "inf"]


def _edge_row(kind, d):
    x = torch.randn(d)
    return {"zeros": torch.zeros(d), "constant": torch.full((d,), 3.0), "negative-constant": torch.full((d,), -0.5),
            "one-hot": torch.eye(d)[0] * 7, "one-hot-last": -torch.eye(d)[-1], "outlier": x.index_fill(0, torch.tensor([5]), 300.0),
            "tiny": x * 1e-30, "nan": x.index_fill(0, torch.tensor([2]), math.nan),
            "inf": x.index_fill(0, torch.tensor([9]), -math.inf)}[kind]


@pytest.mark.parametrize("mode_name", ["int4", "int8", "fp8"], ids=["int4", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_edge_rows(mode_name, dtype):
    mode, d = MODES[mode_name], 64
    rows = torch.stack([_edge_row(k, d) for k in EDGE_ROWS])  # [n, d]
    key = rows[:, None, :].expand(-1, H, -1).to(dtype).contiguous()
    value = rows.flip(0)[:, None, :].expand(-1, H, -1).to(dtype).contiguous()
    slots = torch.arange(len(EDGE_ROWS)) * 3
    ref, got, views = _run_both(mode, key, value, slots, 2, packed=True)
    assert torch.equal(ref, got)
    bits = views.k_scale_cache.reshape(-1, H)[slots].view(torch.int32)
    bad = torch.tensor([k in ("nan", "inf") for k in EDGE_ROWS])
    assert (bits[bad] == NAN_SCALE_BITS).all(), "non-finite rows must store the NaN scale"
    assert (views.key_cache.reshape(-1, H, views.key_cache.shape[-1])[slots][bad].view(torch.uint8) == 0).all()
    assert not torch.isnan(views.k_scale_cache.reshape(-1, H)[slots][~bad]).any()


@pytest.mark.parametrize("rotation", ["butterfly", "dot"], ids=["butterfly", "dot"])
@pytest.mark.parametrize("d", [16, 128, 256], ids=["h16", "h128", "h256"])
def test_int4_rotations(rotation, d):
    key, value = _inputs(40, d, torch.bfloat16, seed=3)
    slots = torch.randperm(64)[:40]
    _, v = _cache(M.INT4_PER_TOKEN_HEAD, d, 4, torch.bfloat16, packed=True)
    reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                           tuning=FusedTuning(rotation=rotation))
    p, s = quantize_int4_rows(value)
    blk, off = slots // BS, slots % BS
    # butterfly: the oracle's additions in its order, so exact. dot: fp32 sums in another order
    # may round a rotated value to the neighbouring bf16 (a tie); allow 1 row in 40 to differ.
    diff_rows = int((v.value_cache[blk, off] != p).any(-1).sum() + (v.v_scale_cache[blk, off] != s).sum())
    assert diff_rows == 0 if rotation == "butterfly" else diff_rows <= H


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,parts", [(16, 1), (16, 2), (128, 1), (128, 4), (128, 8), (256, 2), (256, 8)],
                         ids=["h16-p1", "h16-p2", "h128-p1", "h128-p4", "h128-p8", "h256-p2", "h256-p8"])
def test_int4_lanes_kernel(d, parts, strided, dtype):
    """The shuffle kernel on edge rows, both input layouts and both model dtypes: byte for byte
    the oracle's (on CPU it runs the oracle's butterfly; the CUDA tests check the shuffles)."""
    _check_int4_kernel(d, strided, dtype, tuning=LanesTuning(parts=parts))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256], ids=["h16", "h32", "h64", "h128", "h256"])
def test_int4_mma_kernel(d, strided, dtype):
    """``MmaTuning`` (the GPU default from head_size 64) on CPU: its split into head_size/32
    parts of 32 columns and the cross-part stages, through the interpreter's butterfly, give the
    oracle's bytes; head_size 16 falls back to the shuffle kernel. The tensor-core rotation itself
    runs only on a GPU (the CUDA tests; ``tests/test_write_int4_mma.py`` emulates its PTX)."""
    _check_int4_kernel(d, strided, dtype, tuning=MmaTuning(packed_range=MMA_TILING.get(d, (0, 0, False))[2]))


def _check_int4_kernel(d, strided, dtype, **kw):
    key, value = _inputs(40, d, dtype, seed=5)
    key[3, 1], value[5, 0, 7], key[6], value[8, 1] = float("nan"), float("inf"), 0.0, 0.0
    value[8, 1, 0] = -3.0  # one-sided row
    if strided:  # K and V as slices of one [T, 2, H, d] buffer: per-row offsets instead of one stretch
        kv = torch.stack((key, value), 1)
        key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(64)[:40]
    slots[::7] = -1
    ref, got = (_cache(M.INT4_PER_TOKEN_HEAD, d, 4, dtype, packed=True) for _ in range(2))
    keep = slots >= 0
    blk, off = slots[keep] // BS, slots[keep] % BS
    for x, kc, sc in ((key, ref[1].key_cache, ref[1].k_scale_cache), (value, ref[1].value_cache, ref[1].v_scale_cache)):
        kc[blk, off], sc[blk, off] = quantize_int4_rows(x[keep])
    v = got[1]
    reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache, **kw)
    assert torch.equal(_bytes(ref[0]), _bytes(got[0]))


@pytest.mark.parametrize("parts", [3, 4], ids=["parts3", "parts4-h16"])
def test_int4_lanes_kernel_refuses_bad_parts(parts):
    """A part count the kernel cannot split a row into is a clear error, and nothing is written."""
    key, value = _inputs(8, 16, torch.bfloat16)
    whole, v = _cache(M.INT4_PER_TOKEN_HEAD, 16, 4, torch.bfloat16, packed=True)
    before = _bytes(whole).clone()
    with pytest.raises(ValueError, match="lanes kernel: parts"):
        reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, torch.arange(8), v.k_scale_cache,
                               v.v_scale_cache, tuning=LanesTuning(parts=parts))
    assert torch.equal(_bytes(whole), before)


def test_lane_layout_check():
    """The int4-lanes / int4-mma writers need rows Triton loads in 16-byte vectors; the check that
    sends other inputs to int4-fused accepts packed and 16-element-strided rows only."""
    from kernels.write.checks import lane_layout_ok
    buf = torch.zeros(4 * 2 * H * 64 + 64, dtype=torch.bfloat16)
    packed = buf[:4 * H * 64].view(4, H, 64)
    stacked = buf[:4 * 2 * H * 64].view(4, 2, H, 64)[:, 0]            # [T, 2, H, d]: strides 2Hd, d
    shifted = buf[1:1 + 4 * H * 64].view(4, H, 64)                     # 2-byte aligned base
    padded = buf[:4 * (H * 64 + 8)].view(4, H * 64 + 8)[:, :H * 64].view(4, H, 64)  # token stride Hd + 8
    assert lane_layout_ok(packed, stacked) and buf.data_ptr() % 16 == 0
    assert not lane_layout_ok(packed, shifted) and not lane_layout_ok(padded)


def test_tuning_of_another_mode_is_refused():
    """A tuning names a path of the call's mode: another mode's tuning is a TypeError saying which
    classes fit, and nothing is written."""
    key, value = _inputs(8, 128, torch.bfloat16)
    whole, v = _cache(M.INT4_PER_TOKEN_HEAD, 128, 4, torch.bfloat16, packed=True)
    before = _bytes(whole).clone()
    with pytest.raises(TypeError, match="expected LanesTuning, MmaTuning or FusedTuning for INT4_PER_TOKEN_HEAD, "
                                        "got TileTuning"):
        reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, torch.arange(8), v.k_scale_cache,
                               v.v_scale_cache, tuning=TileTuning(rows=16))
    assert torch.equal(_bytes(whole), before)
    _, v8 = _cache(M.INT8_PER_TOKEN_HEAD, 128, 4, torch.bfloat16, packed=True)
    with pytest.raises(TypeError, match="expected TileTuning for INT8_PER_TOKEN_HEAD, got FusedTuning"):
        triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, v8.key_cache, v8.value_cache, v8.k_scale_cache, v8.v_scale_cache, torch.arange(8),
            M.INT8_PER_TOKEN_HEAD, tuning=FusedTuning())


@pytest.mark.parametrize("d", [64, 256], ids=["h64", "h256"])
def test_int4_mse_encoder(d):
    shrink = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
    key, value = _inputs(24, d, torch.bfloat16, seed=11)
    key[5, 1, 3] = 40.0  # an outlier makes shrinking worthwhile
    slots = torch.arange(24)
    _, v = _cache(M.INT4_PER_TOKEN_HEAD, d, 2, torch.bfloat16, packed=True)
    reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                           shrink=shrink)
    p, s = quantize_int4_rows(key, shrink=shrink)
    assert torch.equal(v.key_cache.reshape(32, H, -1)[:24], p)
    assert torch.equal(v.k_scale_cache.reshape(32, H)[:24].view(torch.int32), s.view(torch.int32))
    p1, s1 = quantize_int4_rows(key)
    r = dequantize_rows(p, s, M.INT4_PER_TOKEN_HEAD, rotated=True)
    r1 = dequantize_rows(p1, s1, M.INT4_PER_TOKEN_HEAD, rotated=True)
    from kernels.reference import single_rht
    x = single_rht(key).float()
    assert ((r - x).square().sum(-1) <= (r1 - x).square().sum(-1) * (1 + 1e-6)).all()


@pytest.mark.parametrize("mode_name", list(MODES), ids=list(MODES))
def test_strided_inputs_and_int32_slots(mode_name):
    """K and V as slices of one fused [T, 3, H, d] projection; slot_mapping int32."""
    mode = MODES[mode_name]
    qkv = torch.randn(20, 3, H, 64).to(torch.bfloat16)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(32)[:20].to(torch.int32)
    ref, got, _ = _run_both(mode, key.contiguous(), value.contiguous(), slots.long(), 2, packed=True)
    holder, v = _cache(mode, 64, 2, torch.bfloat16, packed=True)
    _write(mode, key, value, slots, v)
    assert torch.equal(ref, _bytes(holder))


def _error_case(kind):
    key, value = _inputs(8, 64, torch.bfloat16)
    holder, v = _cache(M.INT4_PER_TOKEN_HEAD, 64, 1, torch.bfloat16, packed=True)
    args = dict(key=key, value=value, key_cache=v.key_cache, value_cache=v.value_cache,
                slot_mapping=torch.arange(8), k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache)
    if kind == "slot-range":
        args["slot_mapping"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 16])
    elif kind == "key-dtype":
        args["key"] = key.float()
    elif kind == "value-shape":
        args["value"] = value[:, :1]
    elif kind == "cache-dtype":
        args["key_cache"] = v.key_cache.view(torch.int8)
    elif kind == "head-size":
        args["key"], args["value"] = key[..., :48], value[..., :48]
    elif kind == "scale-missing":
        args["v_scale_cache"] = None
    elif kind == "slots-dtype":
        args["slot_mapping"] = torch.arange(8.0)
    elif kind == "slots-too-many":
        args["slot_mapping"] = torch.arange(9)
    elif kind == "device":
        args["slot_mapping"] = torch.arange(8, device="meta")
    elif kind == "noncontiguous":
        args["key"] = torch.randn(8, H, 128).to(torch.bfloat16)[..., ::2]
    elif kind == "scale-shape":
        args["k_scale_cache"] = v.k_scale_cache[:, :8]
    return holder, args


ERRORS = {"slot-range": "slots < num_blocks \\* block_size = 16, got max slot 16",
          "key-dtype": "key: expected dtype bfloat16 or float16, got torch.float32",
          "value-shape": "value: expected shape \\(8, 2, 64\\)", "cache-dtype": "key_cache: expected dtype torch.uint8",
          "head-size": "power of two >= 16", "scale-missing": "v_scale_cache: expected a float32",
          "slots-dtype": "slot_mapping: expected a 1-D int32/int64", "slots-too-many": "at most 8 entries",
          "device": "slot_mapping: expected device cpu", "noncontiguous": "key: expected a contiguous last dim",
          "scale-shape": "k_scale_cache: expected float32 \\(1, 16, 2\\)"}


@pytest.mark.parametrize("kind", list(ERRORS), ids=list(ERRORS))
def test_launcher_errors_write_nothing(kind):
    holder, args = _error_case(kind)
    before = _bytes(holder)
    with pytest.raises(LayoutError, match=ERRORS[kind]):
        reshape_and_cache_int4(**args)
    assert torch.equal(before, _bytes(holder)), "a refused call must not write"


def test_bench_slot_orders():
    """bench_write's slot mappings: distinct slots either way; ``blocks`` keeps each block's tokens
    in order (as a prefill writes), ``tokens`` scatters them."""
    from bench import write as bench_write
    got = {}
    for order in ("tokens", "blocks"):
        torch.manual_seed(0)
        got[order] = bench_write._setup(160, 64, "int4", torch.device("cpu"), slot_order=order)[1][0][2]
    for slots in got.values():
        assert slots.unique().numel() == 160 and int(slots.max()) < 160
    b = got["blocks"].view(10, 16)
    assert torch.equal(b - b[:, :1], torch.arange(16).expand(10, 16)) and (b[:, 0] % 16 == 0).all()
    assert not torch.equal(got["tokens"].view(10, 16) - got["tokens"].view(10, 16)[:, :1], torch.arange(16).expand(10, 16))


def test_mode_and_option_errors():
    key, value = _inputs(4, 64, torch.bfloat16)
    _, v = _cache(M.INT8_PER_TOKEN_HEAD, 64, 1, torch.bfloat16, packed=True)
    with pytest.raises(LayoutError, match="got FP8_PER_TENSOR"):
        triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, torch.arange(4),
            M.FP8_PER_TENSOR)
    with pytest.raises(LayoutError, match="key_cache: expected dtype torch.float8_e4m3fn"):
        triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, torch.arange(4),
            M.FP8_PER_TOKEN_HEAD)
    _, v4 = _cache(M.INT4_PER_TOKEN_HEAD, 64, 1, torch.bfloat16, packed=True)
    with pytest.raises(ValueError, match="shrink: expected factors in \\(0, 1\\] starting with 1.0"):
        reshape_and_cache_int4(key, value, v4.key_cache, v4.value_cache, torch.arange(4), v4.k_scale_cache,
                               v4.v_scale_cache, shrink=(0.9, 1.0))
    before = v4.key_cache.clone()
    with pytest.raises(TypeError, match="shrink: range factors apply to INT4_PER_TOKEN_HEAD only, got them for "
                                        "INT8_PER_TOKEN_HEAD"):
        triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, torch.arange(4),
            M.INT8_PER_TOKEN_HEAD, shrink=(1.0, 0.9))
    with pytest.raises(ValueError, match="int4-fused rotation: expected one of"):
        reshape_and_cache_int4(key, value, v4.key_cache, v4.value_cache, torch.arange(4), v4.k_scale_cache,
                               v4.v_scale_cache, tuning=FusedTuning(rotation="givens"))
    assert torch.equal(v4.key_cache, before)  # nothing written


def test_bench_timing_helpers():
    """bench_write's timed function calls every input set once, and the time is per call."""
    from bench import write as bench_write
    calls = []
    fn = bench_write._each([(1,), (2,), (3,)], lambda i: (calls.append(i), time.sleep(0.002)))
    us = bench_write._time_us(fn, torch.device("cpu"), calls=3)
    assert calls == [1, 2, 3] * 3  # three timed rounds of the three sets
    assert 1500 < us < 20000  # ~2 ms of sleep per call, not ~6 per round
    assert bench_write.host_us("int4", 64, torch.device("cpu"), calls=2) > 0


def test_bench_quick_smoke(capsys):
    from bench import write as bench_write
    assert bench_write.main(["--quick", "--check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "worst fraction of rows differing from the oracle: 0.00e+00" in out
    assert out.count("| 64 | 64 |") == len(bench_write.MODES)  # one table row per mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["h64", "h128", "h256"])
@pytest.mark.parametrize("mode_name", list(MODES), ids=list(MODES))
def test_cuda_matches_oracle(mode_name, d, dtype):
    """Every GPU default byte for byte the oracle's, except INT4's tie rows: its default (the
    tensor-core rotation) and the fused tl.dot kernel add in another order than the oracle, so a
    rotated value can round to the neighbouring bf16/fp16; such rows are counted, bounded and
    checked to dequantize within one code step. The shuffle kernel (the oracle's order) is exact."""
    mode = MODES[mode_name]
    g = torch.Generator(device="cuda").manual_seed(d)
    key = torch.randn(4096, H, d, device="cuda", generator=g).to(dtype)
    value = torch.randn(4096, H, d, device="cuda", generator=g).to(dtype)
    key[7, 1], value[9, 0, 3], key[11] = float("nan"), float("inf"), 0.0
    slots = torch.randperm(4096 + BS, device="cuda")[:4096]
    slots[::97] = -1
    geo = CacheGeometry(mode, d, H, BS, dtype)
    caches = [geo.new_cache(4096 // BS + 1, "cuda") for _ in range(3)]
    for c in caches:
        c.view(torch.uint8).fill_(POISON)
    vs = [split_kv_cache(c, mode, d) for c in caches]
    reference_reshape_and_cache(key, value, vs[0].key_cache, vs[0].value_cache, slots, mode,
                                vs[0].k_scale_cache, vs[0].v_scale_cache)
    _write(mode, key, value, slots, vs[1])
    rows = lambda c: (caches[0].view(torch.uint8) != c.view(torch.uint8)).any(-1).sum().item()  # noqa: E731
    if mode != M.INT4_PER_TOKEN_HEAD:
        assert rows(caches[1]) == 0
        return
    _assert_ties(geo, caches[0], caches[1], bound=2 * 4096 * H * 2e-4)  # measured: 0-5 per 1,048,576 rows
    for tuning, bound in ((LanesTuning(), 0), (FusedTuning(), 2 * 4096 * H * 1e-3)):  # fused: 26 per 1,048,576
        c = caches[2]
        c.view(torch.uint8).fill_(POISON)
        reshape_and_cache_int4(key, value, vs[2].key_cache, vs[2].value_cache, slots, vs[2].k_scale_cache,
                               vs[2].v_scale_cache, tuning=tuning)
        _assert_ties(geo, caches[0], c, bound)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tuning", [None, LanesTuning(), MmaTuning()], ids=["default", "lanes", "mma"])
@pytest.mark.parametrize("layout", ["shifted", "padded"])
def test_cuda_int4_unaligned_rows(tuning, layout):
    """K/V rows Triton cannot load in 16-byte vectors (a base 2 bytes off, a token stride of
    H·d + 8) go to int4-fused whatever path is named: the oracle's bytes up to its ties."""
    d, n = 128, 2048
    g = torch.Generator(device="cuda").manual_seed(7)
    if layout == "shifted":
        key, value = (torch.randn(n * H * d + 1, device="cuda", generator=g).to(torch.bfloat16)[1:].view(n, H, d)
                      for _ in range(2))
    else:
        key, value = (torch.randn(n, H * d + 8, device="cuda", generator=g).to(torch.bfloat16)[:, :H * d].view(n, H, d)
                      for _ in range(2))
    slots = torch.randperm(n + BS, device="cuda")[:n]
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, d, H, BS, torch.bfloat16)
    caches = [geo.new_cache(n // BS + 1, "cuda") for _ in range(2)]
    vs = [split_kv_cache(c, geo.mode, d) for c in caches]
    for c in caches:
        c.view(torch.uint8).fill_(POISON)
    reference_reshape_and_cache(key, value, vs[0].key_cache, vs[0].value_cache, slots, geo.mode,
                                vs[0].k_scale_cache, vs[0].v_scale_cache)
    with record_launches() as ran:
        reshape_and_cache_int4(key, value, vs[1].key_cache, vs[1].value_cache, slots, vs[1].k_scale_cache,
                               vs[1].v_scale_cache, tuning=tuning)
    assert [r.kernel for r in ran] == ["_reshape_and_cache_int4_fused_kernel"]
    _assert_ties(geo, caches[0], caches[1], bound=2 * n * H * 1e-3)


def _assert_ties(geo, ref, out, bound):
    """At most ``bound`` rows of ``out`` differ from ``ref`` (INT4 packed caches), and in those rows
    every dequantized value (rotated domain, K and V) is within one code step of the oracle's."""
    from bench.write import _compare
    rows, _, err = _compare("int4", geo, ref, out)
    assert rows <= bound, f"{rows} rows differ, bound {bound}"
    assert err <= 1.01, f"a differing row is not a tie ({err:.3f} scales)"


def test_write_ties_tool_dumps_and_counts(tmp_path, capsys):
    """bench/write_ties.py end to end on CPU: a synthetic model's K/V dumped, then counted with the
    random and outlier cases (the interpreter runs the oracle's butterfly: no tie rows)."""
    from bench import write_ties
    path, text = str(tmp_path / "kv.pt"), tmp_path / "text.txt"
    text.write_text("Keys and values of a short text, written into a paged cache and read back. " * 3)
    assert write_ties.main(["--dump-kv", path, "--model", "synthetic", "--layers", "2", "--text", str(text)]) == 0
    kv = torch.load(path)
    assert kv["k"].shape[0] == 2 and kv["k"].shape[1] == kv["tokens"] and kv["k"].dtype == torch.bfloat16
    capsys.readouterr()
    assert write_ties.main(["--device", "cpu", "--tokens", "8", "--head-sizes", "64", "--kv-file", path]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(rows) == 2 * 2 * 2 + 2  # (random, outliers) x (bf16, fp16) x (mma, lanes) + the file per kernel
    assert all(r.split("|")[6].strip() == "0" for r in rows), rows
