"""Key smoothing in the INT4 writers: every path against the oracle, and what it keeps exact.

Covers ``kernels.reference.smooth_keys`` (the definition: ``RN(k - RN(m))`` before the rotation),
the ``key_offset`` argument of every INT4 write path (int4-fused with both rotations and the MSE
encoder, int4-lanes, int4-mma's part split) through Triton's interpreter on CPU: codes and scale
bits identical to the oracle's on random keys with a large per-channel offset, on real keys
(``tests/test_key_smoothing_model.py``), values untouched, the attention invariance (softmax of
``q·(k - m)`` equals that of ``q·k``), and the argument's errors; compiled for sm_90 without a GPU,
where the offsets are loaded (per row, or per lane inside the tensor-core asm) and the plan's rule
for the latter. CUDA-only: the same comparison at a realistic size, with the tensor-core path's
tie rows bounded, and the per-lane offsets (looping programs or not) against the per-row ones
byte for byte on keys built to break a wrong subtraction.

Run: ``python -m pytest tests/test_key_smoothing.py -q``
"""

import dataclasses

import pytest
import torch

from kernels.reference import quantize_int4_rows, reference_reshape_and_cache, smooth_keys, unsmooth_keys
from kernels.reference import dequantize_int4_rows
from kernels.write import (FusedTuning, LanesTuning, MmaTuning, reshape_and_cache_int4,
                           triton_reshape_and_cache_flash_per_token_head_quant)
from kernels.write.tuning import MMA_TILING, OFFSET_TILING
from layouts import CacheGeometry, KVQuantMode, LayoutError, split_kv_cache

M = KVQuantMode
H, BS, POISON = 2, 16, 0xA5

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN warnings inside the interpreter


def offset_keys(num_tokens, d, dtype, seed=0, device="cpu"):
    """(key, value, m): keys with a large per-channel offset per head, as LLM keys carry, and
    the offset ``m`` [H, d] float32 (not rounded: the writers round it)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(H, d, generator=g) * 4 * (torch.rand(H, d, generator=g) < 0.1)  # a few big channels
    m += torch.randn(H, d, generator=g) * 0.3
    key = (torch.randn(num_tokens, H, d, generator=g) + m).to(dtype)
    value = torch.randn(num_tokens, H, d, generator=g).to(dtype)
    return key.to(device), value.to(device), m.to(device)


def new_cache(d, num_blocks, dtype, device="cpu"):
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, d, H, BS, dtype)
    c = geo.new_cache(num_blocks, device)
    c.view(torch.uint8).fill_(POISON)
    return c, split_kv_cache(c, M.INT4_PER_TOKEN_HEAD, d)


def oracle_and_kernel(key, value, m, slots, num_blocks, **kw):
    d, dtype, dev = key.shape[-1], key.dtype, key.device
    (ref, rv), (got, gv) = new_cache(d, num_blocks, dtype, dev), new_cache(d, num_blocks, dtype, dev)
    reference_reshape_and_cache(key, value, rv.key_cache, rv.value_cache, slots, M.INT4_PER_TOKEN_HEAD,
                                rv.k_scale_cache, rv.v_scale_cache, key_offset=m, shrink=kw.get("shrink", (1.0,)))
    reshape_and_cache_int4(key, value, gv.key_cache, gv.value_cache, slots, gv.k_scale_cache, gv.v_scale_cache,
                           key_offset=m, **kw)
    return ref, got, rv, gv


TUNINGS = {"fused-butterfly": FusedTuning(), "lanes": LanesTuning(), "mma": None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["h64", "h128", "h256"])
@pytest.mark.parametrize("path", list(TUNINGS), ids=list(TUNINGS))
def test_kernel_matches_oracle_with_offsets(path, d, dtype):
    """Every INT4 path with a key offset: the oracle's bytes (interpreter: the oracle's butterfly)."""
    tuning = TUNINGS[path] if path != "mma" else MmaTuning(packed_range=MMA_TILING.get(d, (0, 0, False))[2])
    key, value, m = offset_keys(40, d, dtype, seed=d)
    slots = torch.randperm(64)[:40]
    slots[::9] = -1
    ref, got, _, _ = oracle_and_kernel(key, value, m, slots, 4, tuning=tuning)
    assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8))


def test_offset_changes_only_keys_and_shrinks_their_error():
    """Values are written exactly as without an offset; keys differ (the offset is applied), and
    the smoothed keys' reconstruction error (``m`` added back) is smaller than plain INT4's."""
    key, value, m = offset_keys(64, 128, torch.bfloat16, seed=1)
    slots = torch.arange(64)
    _, plain = new_cache(128, 4, torch.bfloat16)
    _, smooth = new_cache(128, 4, torch.bfloat16)
    reshape_and_cache_int4(key, value, plain.key_cache, plain.value_cache, slots, plain.k_scale_cache,
                           plain.v_scale_cache)
    reshape_and_cache_int4(key, value, smooth.key_cache, smooth.value_cache, slots, smooth.k_scale_cache,
                           smooth.v_scale_cache, key_offset=m)
    assert torch.equal(plain.value_cache, smooth.value_cache) and torch.equal(plain.v_scale_cache,
                                                                             smooth.v_scale_cache)
    assert not torch.equal(plain.key_cache, smooth.key_cache)
    blk, off = slots // BS, slots % BS
    k_plain = dequantize_int4_rows(plain.key_cache[blk, off], plain.k_scale_cache[blk, off])
    k_smooth = unsmooth_keys(dequantize_int4_rows(smooth.key_cache[blk, off], smooth.k_scale_cache[blk, off]),
                             m, torch.bfloat16)
    err = lambda k: (k - key.float()).square().mean().item()  # noqa: E731
    assert err(k_smooth) < 0.5 * err(k_plain), (err(k_smooth), err(k_plain))


def test_mse_encoder_and_dot_rotation_with_offsets():
    """The MSE encoder (int4-fused only) takes the offset in the same pass; the tl.dot rotation
    too (on CPU its fp32 "ieee" dot is exact here, so no tie rows)."""
    key, value, m = offset_keys(40, 128, torch.bfloat16, seed=7)
    slots = torch.randperm(64)[:40]
    for kw in (dict(shrink=(1.0, 0.9, 0.8)), dict(tuning=FusedTuning(rotation="dot"))):
        ref, got, _, _ = oracle_and_kernel(key, value, m, slots, 4, **kw)
        assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8)), kw


def test_smooth_keys_definition_and_invariance():
    """``smooth_keys`` rounds ``m`` and the difference to the model dtype; attention weights
    over the smoothed keys equal those over the keys up to that one bf16 rounding per element
    (the shift ``q·m`` is the same for every key a query sees)."""
    key, _, m = offset_keys(32, 64, torch.bfloat16, seed=2)
    ks = smooth_keys(key, m)
    assert ks.dtype == torch.bfloat16
    assert torch.equal(ks, (key.float() - m.to(torch.bfloat16).float()).to(torch.bfloat16))
    q = torch.randn(5, H, 64)
    attn = lambda k: torch.softmax(torch.einsum("qhd,thd->hqt", q, k.float()) / 8, -1)  # noqa: E731
    p, ps = attn(key), attn(ks)
    # |k - m| < ~4 here: one bf16 rounding (2**-9 relative) moves a logit by < 0.05 (measured 0.0x)
    assert (ps - p).abs().max() < 2e-2
    # without the per-head constant the weights move far more: the test can fail
    assert (attn(ks * 0.9) - p).abs().max() > 5 * (ps - p).abs().max()


def test_smoothed_row_is_quantize_of_smoothed_keys():
    key, _, m = offset_keys(8, 64, torch.float16, seed=3)
    p, s = quantize_int4_rows(smooth_keys(key, m))
    (_, rv), slots = new_cache(64, 1, torch.float16), torch.arange(8)
    reference_reshape_and_cache(key, key, rv.key_cache, rv.value_cache, slots, M.INT4_PER_TOKEN_HEAD,
                                rv.k_scale_cache, rv.v_scale_cache, key_offset=m)
    assert torch.equal(rv.key_cache[0, :8], p) and torch.equal(rv.k_scale_cache[0, :8].view(torch.int32),
                                                               s.view(torch.int32))


def test_offset_in_model_dtype_and_conversion_cache():
    """A bf16 offset gives the same bytes as the float32 one it rounds from; an in-place change
    of the float32 offset is seen by the next write (the conversion is keyed by version)."""
    key, value, m = offset_keys(16, 64, torch.bfloat16, seed=4)
    slots = torch.arange(16)
    outs = []
    for off in (m, m.to(torch.bfloat16), None):
        c, v = new_cache(64, 1, torch.bfloat16)
        if off is None:
            m.mul_(0.5)  # same tensor object, new contents
            off = m
        reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                               key_offset=off)
        outs.append(c.clone())
    assert torch.equal(outs[0], outs[1])
    from kernels.write.api import model_dtype_offset
    odd = torch.empty(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64)  # 2 bytes off: not 16-byte aligned
    odd.copy_(m)
    aligned = model_dtype_offset(odd, torch.bfloat16)
    assert aligned.data_ptr() % 16 == 0 and torch.equal(aligned, odd)  # the register paths load 16-byte vectors
    (ref, rv) = new_cache(64, 1, torch.bfloat16)
    reference_reshape_and_cache(key, value, rv.key_cache, rv.value_cache, slots, M.INT4_PER_TOKEN_HEAD,
                                rv.k_scale_cache, rv.v_scale_cache, key_offset=m)
    assert torch.equal(outs[2], ref) and not torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("bad,match", [
    (lambda m: m[:1], r"key_offset: expected float32 \[2, 64\].*got torch.float32 \[1, 64\]"),
    (lambda m: m.double(), r"key_offset: expected float32 \[2, 64\].*got torch.float64"),
    ("int8", r"key_offset: expected None for INT8_PER_TOKEN_HEAD"),
], ids=["shape", "dtype", "int8"])
def test_key_offset_errors_write_nothing(bad, match):
    key, value, m = offset_keys(4, 64, torch.bfloat16)
    slots = torch.arange(4)
    if bad == "int8":
        geo = CacheGeometry(M.INT8_PER_TOKEN_HEAD, 64, H, BS, torch.bfloat16)
        c = geo.new_cache(1, "cpu")
        c.view(torch.uint8).fill_(POISON)
        v = split_kv_cache(c, M.INT8_PER_TOKEN_HEAD, 64)
        with pytest.raises(LayoutError, match=match):
            triton_reshape_and_cache_flash_per_token_head_quant(
                key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, slots,
                M.INT8_PER_TOKEN_HEAD, key_offset=m)
    else:
        c, v = new_cache(64, 1, torch.bfloat16)
        with pytest.raises(LayoutError, match=match):
            reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache,
                                   v.v_scale_cache, key_offset=bad(m))
    assert (c.view(torch.uint8) == POISON).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["h64", "h128", "h256"])
@pytest.mark.parametrize("path", ["default", "lanes", "fused"])
def test_cuda_offsets_match_oracle(path, d, dtype):
    """On the GPU: the shuffle kernel (the oracle's additions) byte for byte; the default
    (tensor-core rotation) and the fused tl.dot kernel up to tie rows within one code step."""
    from tests.test_write_kernels import _assert_ties
    tuning = {"default": None, "lanes": LanesTuning(), "fused": FusedTuning()}[path]
    key, value, m = offset_keys(4096, d, dtype, seed=d, device="cuda")
    slots = torch.randperm(4096 + BS, device="cuda")[:4096]
    ref, got, _, _ = oracle_and_kernel(key, value, m, slots, 4096 // BS + 1, tuning=tuning)
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, d, H, BS, dtype)
    _assert_ties(geo, ref, got, bound=0 if path == "lanes" else 2 * 4096 * H * 1e-3)


def _wide_keys(num_tokens, heads, d, dtype, seed):
    """(key, m) on the GPU that stress the subtraction ``RN(k - m)``: magnitudes spread over 2**-40 ..
    2**40 (exponent gaps that make the fp32 difference inexact), equal pairs (``k == m``: +0),
    signed zeros, and one row each with +Inf, a NaN and an fp16-overflowing difference."""
    g = torch.Generator().manual_seed(seed)
    lim = 14 if dtype == torch.float16 else 40

    def wide(*shape):
        mag = torch.exp2(torch.randint(-lim, lim + 1, shape, generator=g).float()) * (1 + torch.rand(shape, generator=g))
        return torch.where(torch.rand(shape, generator=g) < 0.5, -mag, mag)
    m = wide(heads, d).to(dtype)
    key = wide(num_tokens, heads, d).to(dtype)
    same = torch.rand(num_tokens, heads, d, generator=g) < 0.05
    key = torch.where(same, m.expand_as(key), key)
    key[0, 0, :8] = -0.0
    m[0, 8:16] = -0.0
    key[1, 0, 3] = float("inf")
    key[2, 0, 5] = float("nan")
    big = torch.finfo(dtype).max
    key[3, 0, :] = big
    m[0, 0] = -big if dtype == torch.float16 else m[0, 0]
    return key.cuda(), m.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["h64", "h128", "h256"])
@pytest.mark.parametrize("heads", [1, 2, 8, 16], ids=["H1", "H2", "H8", "H16"])
def test_cuda_lane_offsets_equal_row_tiles(heads, d, dtype):
    """On the GPU: the int4-mma kernel with lane offsets (one 32-byte lane-table entry of signs and
    ``-s ⊙ m`` per lane and part, ``fma.rn(k, s, -s·m)`` on packed pairs inside the tensor-core
    asm: subtraction and sign flip in one rounding), with the default tiling
    (``tuning.OFFSET_TILING``: one-warp programs, one tile each) and with two-warp programs looping over
    tiles or not, writes the same bytes as the same kernel loading each row's offsets and
    subtracting in fp32 (the oracle's ``smooth_keys``), on keys and offsets built to break a wrong
    subtraction; all feed identical rows to the same rotation, so any difference is the
    subtraction's (or a lane reading another head's offsets)."""
    from kernels.write.plan import write_plan
    n = 8192
    key, m = _wide_keys(n, heads, d, dtype, seed=heads * d)
    value = torch.randn(n, heads, d, device="cuda").to(dtype)
    slots = torch.randperm(n + BS, device="cuda")[:n]
    slots[::97] = -1
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, d, heads, BS, dtype)
    base = MmaTuning(*MMA_TILING[d])
    variants = {"default": None, "loop": dataclasses.replace(base, offset_programs_per_sm=1),
                "one tile each": dataclasses.replace(base, offset_programs_per_sm=0),
                "row tiles": dataclasses.replace(base, lane_offsets=False)}
    out = {}
    for name, tuning in variants.items():
        c = geo.new_cache(n // BS + 1, "cuda")
        c.view(torch.uint8).fill_(POISON)
        v = split_kv_cache(c, M.INT4_PER_TOKEN_HEAD, d)
        plan = write_plan(key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, slots,
                          M.INT4_PER_TOKEN_HEAD, tuning=tuning, key_offset=m)
        assert plan.lane_offsets is (name != "row tiles")
        if name == "default" and d in OFFSET_TILING and 8 % heads == 0:   # heads 16 keep the two-warp loop
            assert (plan.tuning.rows, plan.tuning.num_warps, plan.tuning.maxnreg) == OFFSET_TILING[d]
        elif name != "default":
            assert (plan.grid[0] < n * heads // base.rows) is (name == "loop")
        reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                               key_offset=m, tuning=tuning)
        out[name] = c.view(torch.uint8)
    assert not torch.equal(out["row tiles"], torch.full_like(out["row tiles"], POISON))
    for name in ("default", "loop", "one tile each"):
        assert torch.equal(out[name], out["row tiles"]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, d", [(8, 128), (1, 64), (2, 256)])
def test_lane_offset_table_holds_each_lanes_signs_and_offsets(dtype, heads, d):
    """What the lanes load (``offsets.lane_offset_table``): entry ``[kv, p, h, t]`` is the ``±1``
    signs of columns ``32p + 8t .. + 8`` (the fma's multiplier), then ``-s ⊙ m[h]`` of them for K,
    exact (a sign flip: the bits differ from ``m``'s in bit 15 exactly where ``s = +1``), -0 for V
    (``fma(x, s, -0) = s·x``, signed zeros included); made once per tensor and in-place version."""
    from kernels.write.offsets import lane_offset_table
    from layouts import rht_signs
    m = (torch.randn(heads, d) * 3).to(dtype)
    t = lane_offset_table(m)
    s = rht_signs(d)
    assert t.shape == (2, d // 32, heads, 4, 16) and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
    cols = (32 * torch.arange(d // 32)[:, None, None, None] + 8 * torch.arange(4)[None, None, :, None]
            + torch.arange(8)).expand(d // 32, heads, 4, 8)   # [p, h, t, 8]
    h = torch.arange(heads)[None, :, None, None].expand_as(cols)
    for kv in (0, 1):
        assert torch.equal(t[kv, ..., :8].float(), s[cols])
    assert torch.equal(t[0, ..., 8:].float(), -(s[cols] * m[h, cols].float()))
    assert torch.equal(t[0, ..., 8:].view(torch.int16) ^ m[h, cols].view(torch.int16),
                       torch.where(s[cols] > 0, -32768, 0).to(torch.int16))
    assert torch.equal(t[1, ..., 8:].view(torch.int16), torch.full_like(cols, -32768, dtype=torch.int16))
    assert lane_offset_table(m) is t
    m.add_(1)   # a new in-place version: made again
    assert torch.equal(lane_offset_table(m)[0, ..., 8:].float(), -(s[cols] * m[h, cols].float()))


def test_bench_key_offset_smoke(capsys):
    """``python -m bench.write --key-offset --quick`` runs on CPU: the offset write equals the
    oracle's (0 rows differing) and both variants are timed."""
    from bench import write as bench_write
    assert bench_write.main(["--quick", "--key-offset", "--device", "cpu"]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 64 | 64 |")]
    assert len(row) == 1 and row[0].split("|")[4].strip() == "0", row


def _sm90_ttgir(kernel, mma, offset, d=128, lane=False, loop=False):
    """TTGIR of a lanes / mma write kernel compiled for sm_90 on this machine (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
    fn = kernel.compiled
    names = fn.arg_names
    consts = dict(ROWS=64, D=d, PARTS=d // 32 if mma else 4, INTERPRET=False, CACHE_ALIGN=4, NUM_KV_HEADS=8,
                  BLOCK_SIZE=16, CONTIG=True, FAST_RCP=True, OFFSET=offset, PACKED=True, LANE_M=lane,
                  LOOP=loop)
    consts["LOG2_N"] = (d // consts["PARTS"]).bit_length() - 1
    ptrs = {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_offset_ptr": "*bf16", "key_cache_ptr": "*u8",
            "value_cache_ptr": "*u8", "k_scale_ptr": "*i32", "v_scale_ptr": "*i32", "slot_mapping_ptr": "*i64",
            "sign_ptr": "*fp32", "tab_ptr": "*bf16" if mma else "*fp32"}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items() if k in names})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4, enable_fp_fusion=False))
    except CompilationError:  # the kernel's own source: a failure, not a missing toolchain
        raise
    except Exception as e:  # no CUDA toolchain (ptxas) in this environment
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    return compiled.asm["ttgir"]


@pytest.mark.parametrize("mma", [False, True], ids=["lanes", "mma"])
def test_offset_loads_share_the_rows_layout(mma):
    """The GPU kernels hand each part's rows to inline asm that assumes the 16-byte-vector load
    layout; the offsets are loaded with the same shape, element size and contiguity, so compiled
    for sm_90 every ``[64, 32]`` bf16 load (rows and offsets, the offsets' predicated on the
    program writing K) has one layout, the offset adds no layout conversion and no branch."""
    import re
    from kernels.write.int4_lanes import _reshape_and_cache_int4_lanes_kernel, _reshape_and_cache_int4_mma_kernel
    kernel = _reshape_and_cache_int4_mma_kernel if mma else _reshape_and_cache_int4_lanes_kernel
    plain, smooth = (_sm90_ttgir(kernel, mma, off) for off in (False, True))
    loads = [re.findall(r"tt\.load %[^:]* : tensor<64x32x!tt\.ptr<bf16>, (#\w+)>", t) for t in (plain, smooth)]
    assert len(loads[1]) == len(loads[0]) + 4 and len(set(loads[1])) == 1, loads  # 4 parts of 32: 4 offset loads
    assert smooth.count("ttg.convert_layout") == plain.count("ttg.convert_layout")
    assert smooth.count("scf.if") == plain.count("scf.if")  # predicated loads, no branch per part


@pytest.mark.parametrize("loop", [False, True], ids=["tile", "loop"])
def test_lane_offsets_load_once_per_lane_in_the_mma_asm(loop):
    """With lane offsets (8 KV heads divide the layout's row period) the int4-mma kernel loads no
    offset tile and no sign tile: one asm per part loads its lane's entry of the lane table (its
    8 columns' ``±1`` signs and ``-s ⊙ m``: two 16-byte ``ld.global.nc``, addressed by ``tid mod
    4·heads``), the tensor-core asm subtracts and flips the signs in one ``fma.rn(k, s, -s·m)``
    per packed pair, where the kernel without offsets has one ``xor`` and loads the sign bits as
    a tile; the rows' loads and layouts are those of the kernel without offsets, no layout
    conversion is added, and with ``LOOP`` the lane loads stay outside the loop over tiles."""
    import re
    from kernels.write.int4_lanes import _reshape_and_cache_int4_mma_kernel as kernel
    plain, lane = _sm90_ttgir(kernel, True, False), _sm90_ttgir(kernel, True, True, lane=True, loop=loop)
    pattern = r"tt\.load %[^:]* : tensor<64x32x!tt\.ptr<bf16>, (#\w+)>"
    assert set(re.findall(pattern, lane)) == set(re.findall(pattern, plain))
    extra = len(re.findall(pattern, lane)) - len(re.findall(pattern, plain))
    assert extra == 1 - 4  # no sign-bit tile per part: part 0's once, the lane loads' layout carrier
    assert lane.count("ld.global.nc.v4.b32") == 8 and plain.count("ld.global.nc") == 0  # 4 parts of 32
    assert lane.count("fma.rn.bf16x2") == 4 * 8 and lane.count("and.b32 e, e, 31;") == 4
    assert plain.count("xor.b32 a") == 4 * 8 and lane.count("xor.b32 a") == 0   # the sign flips
    assert lane.count("ttg.convert_layout") == plain.count("ttg.convert_layout")
    if loop:
        body = lane[lane.index("scf.for"):]
        assert "ld.global.nc" not in body and "fma.rn.bf16x2" in body


@pytest.mark.parametrize("heads, rows, warps, want", [
    (8, 32, 2, True), (16, 32, 2, True), (4, 32, 2, True), (1, 32, 2, True), (2, 64, 4, True),
    (3, 32, 2, False), (32, 32, 2, False), (16, 32, 1, False), (16, 8, 2, False)])
def test_lane_offsets_rule(heads, rows, warps, want):
    """The per-lane offset load applies exactly when every row of a lane has one head
    (``num_kv_heads`` divides 8·warps and the tile's rows); otherwise the kernel loads each row's
    offsets (3 KV heads, as SmolLM2-135M, is one such model). The plan says which, and loops its
    programs over tiles only then."""
    from kernels.write.checks import WriteShape
    from kernels.write.plan import _plan, lane_offsets_fit
    assert lane_offsets_fit(heads, rows, warps) is want
    shape = WriteShape(65536, heads, 128, 65536 * heads // BS, BS)
    tuning = MmaTuning(rows=rows, num_warps=warps) if rows % (16 * warps) == 0 else None
    if tuning is None:
        return
    plans = {smooth: _plan(M.INT4_PER_TOKEN_HEAD, 128, 65536 * heads, True, 132, True, (1.0,), tuning, shape, smooth)
             for smooth in (False, True)}
    assert plans[True].lane_offsets is want and plans[False].lane_offsets is False
    tiles = 65536 * heads // rows
    assert plans[False].grid == (tiles, 2)
    assert plans[True].grid == ((min(tiles, 132 * plans[True].tuning.offset_programs_per_sm) if want else tiles), 2)
