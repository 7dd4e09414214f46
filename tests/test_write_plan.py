"""Which write kernel runs: ``kernels.write.write_plan`` / ``plan_for`` and the launches they name.

Over a grid of (mode, head_size, num_tokens, dtype, device) the plan's path follows the documented
order, and the kernel that actually launched (``record_launches``), its grid and its warps are the
plan's. CPU cases run through Triton's interpreter; the GPU grid is checked as a decision on any
machine (``plan_for`` with GPU facts) and as launches on a CUDA device (skipped without one).

Run: ``python -m pytest tests/test_write_plan.py -q``
"""

import dataclasses

import pytest
import torch

from kernels.write import (FusedTuning, LanesTuning, MmaTuning, TileTuning, WriteCall, plan_for, record_launches,
                           reshape_and_cache_flash, reshape_and_cache_int4, write_plan,
                           triton_reshape_and_cache_flash_per_token_head_quant)
from kernels.write.tuning import MMA_TILING, OFFSET_TILING
from layouts import CacheGeometry, KVQuantMode, LayoutError, split_kv_cache

M = KVQuantMode
MODES = {"bf16": M.NONE, "int8": M.INT8_PER_TOKEN_HEAD, "fp8": M.FP8_PER_TOKEN_HEAD, "int4": M.INT4_PER_TOKEN_HEAD}
H, BS = 2, 16
MSE = (1.0, 0.9, 0.8)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN warnings inside the interpreter


def expected_path(mode, head_size, on_gpu, aligned=True, num_shrink=1):
    """The documented order (``kernels/write/plan.py``), written out independently."""
    if mode == M.NONE:
        return "unquantized"
    if mode != M.INT4_PER_TOKEN_HEAD:
        return "symmetric"
    if not on_gpu or num_shrink > 1 or not aligned or head_size > 256:
        return "int4-fused"
    return "int4-mma" if head_size >= 64 else "int4-lanes"


def _write(mode_name, d, num_tokens, dtype, device, tuning=None, shrink=None, key=None, value=None):
    """Write ``num_tokens`` random rows through the public function of ``mode_name``; returns
    (the plan ``write_plan`` makes for the same call, the launches that ran)."""
    mode = MODES[mode_name]
    geo = CacheGeometry(mode, d, H, BS, dtype)
    cache = geo.new_cache(max(1, -(-num_tokens // BS)), device)
    v = split_kv_cache(cache, mode, d)
    if key is None:
        key = torch.randn(num_tokens, H, d, device=device).to(dtype)
        value = torch.randn(num_tokens, H, d, device=device).to(dtype)
    slots = torch.randperm(v.key_cache.shape[0] * BS, device=device)[:num_tokens]
    plan = write_plan(key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, slots, mode,
                      shrink=shrink, tuning=tuning)
    with record_launches() as ran:
        if mode == M.NONE:
            reshape_and_cache_flash(key, value, v.key_cache, v.value_cache, slots, tuning=tuning)
        elif mode == M.INT4_PER_TOKEN_HEAD:
            reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                                   shrink=shrink or (1.0,), tuning=tuning)
        else:
            triton_reshape_and_cache_flash_per_token_head_quant(
                key, value, v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, slots, mode, tuning=tuning)
    return plan, ran


def _assert_ran(plan, ran, num_tokens):
    if num_tokens == 0:
        assert ran == [], "an empty write launches nothing"
        return
    assert [(r.kernel, r.grid, r.num_warps) for r in ran] == [(plan.kernel, plan.grid, plan.tuning.num_warps)]


CPU_GRID = [(m, d, n, dt) for m in MODES for d in (16, 64, 256) for n in (0, 1, 37)
            for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("mode_name,d,num_tokens,dtype", CPU_GRID,
                         ids=[f"{m}-h{d}-t{n}-{str(dt)[6:]}" for m, d, n, dt in CPU_GRID])
def test_cpu_plan_names_the_kernel_that_runs(mode_name, d, num_tokens, dtype):
    plan, ran = _write(mode_name, d, num_tokens, dtype, "cpu")
    assert plan.path == expected_path(MODES[mode_name], d, on_gpu=False)
    assert plan.interpret and plan.shape.num_tokens == num_tokens
    _assert_ran(plan, ran, num_tokens)


REQUESTS = [(LanesTuning(), 64, "int4-lanes"), (LanesTuning(parts=2), 128, "int4-lanes"),
            (MmaTuning(), 64, "int4-mma"), (MmaTuning(), 32, "int4-mma"), (MmaTuning(), 16, "int4-lanes"),
            (FusedTuning(rotation="dot"), 64, "int4-fused"), (None, 512, "int4-fused")]


@pytest.mark.parametrize("tuning,d,path", REQUESTS, ids=[f"{type(t).__name__}-h{d}" for t, d, _ in REQUESTS])
def test_cpu_requested_int4_paths_run(tuning, d, path):
    """A tuning object asks for its path; where that path cannot write the call (the tensor-core
    parts are 32 columns), the next in the order runs, and ``why`` says so."""
    plan, ran = _write("int4", d, 20, torch.bfloat16, "cpu", tuning=tuning)
    assert plan.path == path
    _assert_ran(plan, ran, 20)
    if tuning is not None and type(tuning) is not type(plan.tuning):
        assert "not int4-mma" in plan.why and "32 columns" in plan.why
    elif tuning is not None:  # the fields asked for are the ones used, the rest filled in
        assert all(getattr(plan.tuning, f.name) == getattr(tuning, f.name)
                   for f in dataclasses.fields(tuning) if getattr(tuning, f.name) is not None)
        assert None not in dataclasses.astuple(plan.tuning)


@pytest.mark.parametrize("mode_name", ["bf16", "int8", "fp8"])
def test_cpu_tile_tuning_is_what_runs(mode_name):
    """A ``TileTuning`` sets the rows and warps of the unquantized and symmetric writers: the
    launch takes them (37 tokens x 2 heads in tiles of 8 rows: 10 programs)."""
    plan, ran = _write(mode_name, 64, 37, torch.bfloat16, "cpu", tuning=TileTuning(rows=8, num_warps=2))
    assert plan.path == expected_path(MODES[mode_name], 64, on_gpu=False)
    assert plan.tuning == TileTuning(rows=8, num_warps=2) and plan.grid == (10,)
    _assert_ran(plan, ran, 37)


def test_cpu_mse_encoder_and_strided_rows_take_int4_fused():
    plan, ran = _write("int4", 64, 24, torch.bfloat16, "cpu", tuning=MmaTuning(), shrink=MSE)
    assert plan.path == "int4-fused" and "MSE encoder" in plan.why and plan.shrink == MSE
    _assert_ran(plan, ran, 24)
    kv = torch.randn(24, 2, H, 64).to(torch.bfloat16)  # K and V as slices of one buffer
    plan, ran = _write("int4", 64, 24, torch.bfloat16, "cpu", tuning=LanesTuning(), key=kv[:, 0], value=kv[:, 1])
    assert plan.path == "int4-lanes"  # the interpreter has no 16-byte vector layout to respect
    _assert_ran(plan, ran, 24)


GPU_GRID = [(m, d, aligned, mse) for m in MODES for d in (16, 32, 64, 128, 256, 512) for aligned in (True, False)
            for mse in (False, True) if (m == "int4" or (d % 4 == 0 and not mse))]


@pytest.mark.parametrize("mode_name,d,aligned,mse", GPU_GRID,
                         ids=[f"{m}-h{d}-{'aligned' if a else 'unaligned'}{'-mse' if s else ''}" for m, d, a, s in GPU_GRID])
def test_gpu_decision_grid(mode_name, d, aligned, mse):
    """The GPU's decision, on any machine: ``plan_for`` with the facts of an H200 call."""
    mode = MODES[mode_name]
    for num_rows in (0, 8, 65536 * 8):
        call = WriteCall(mode, d, num_rows, on_gpu=True, num_sms=132, lane_layout=aligned,
                         num_shrink=len(MSE) if mse else 1)
        plan = plan_for(call, shrink=MSE if mse else (1.0,))
        assert plan.path == expected_path(mode, d, True, aligned, call.num_shrink)
        assert not plan.interpret and plan.why
        tiles = -(-num_rows // plan.tuning.rows)
        if plan.path in ("int4-mma", "int4-lanes"):
            assert plan.grid == (tiles, 2)
        elif plan.path == "int4-fused":
            assert plan.grid == (min(tiles, max(1, 132 * plan.tuning.programs_per_sm)),)
        else:
            assert plan.grid == (tiles,)


def test_plans_and_tunings_are_frozen():
    plan = plan_for(WriteCall(M.INT4_PER_TOKEN_HEAD, 128, 64, on_gpu=True))
    with pytest.raises(AttributeError):
        plan.path = "int4-lanes"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tuning.rows = 64


def test_bad_calls_are_refused_before_any_launch():
    """Validation happens once, in the plan: a bad call raises and launches nothing."""
    key = torch.randn(8, H, 64).to(torch.bfloat16)
    geo = CacheGeometry(M.INT4_PER_TOKEN_HEAD, 64, H, BS, torch.bfloat16)
    v = split_kv_cache(geo.new_cache(1, "cpu"), geo.mode, 64)
    with record_launches() as ran:
        with pytest.raises(LayoutError, match="got max slot 16"):
            reshape_and_cache_int4(key, key, v.key_cache, v.value_cache, torch.arange(1, 9) * 2, v.k_scale_cache,
                                   v.v_scale_cache)
        with pytest.raises(ValueError, match="int4-lanes kernel: parts in"):
            reshape_and_cache_int4(key, key, v.key_cache, v.value_cache, torch.arange(8), v.k_scale_cache,
                                   v.v_scale_cache, tuning=LanesTuning(parts=16))
        with pytest.raises(TypeError, match="expected TileTuning for NONE, got MmaTuning"):
            reshape_and_cache_flash(key, key, torch.empty(1, BS, H, 64, dtype=torch.bfloat16),
                                    torch.empty(1, BS, H, 64, dtype=torch.bfloat16), torch.arange(8),
                                    tuning=MmaTuning())
    assert ran == []


def test_bench_plan_table_matches_the_decision_and_the_docs():
    """``bench/write.py --plans`` prints the paths plan_for picks, and docs/KERNELS.md shows that
    table as it is generated today."""
    from pathlib import Path

    from bench import write as bench_write
    table = bench_write.plan_table()
    assert table in (Path(__file__).resolve().parents[1] / "docs" / "KERNELS.md").read_text()
    rows = [r.split("|")[1:-1] for r in table.splitlines()[2:]]
    assert len(rows) == 9 + 12 + 1 + 3
    for mode_name, d, cpu, gpu, tuning, _ in rows:
        mode, num_shrink = bench_write.PLAN_MODES[mode_name.split()[0]]
        head, aligned = int(d.split()[0]), "not 16-byte" not in d
        assert cpu.strip() == expected_path(mode, head, False, aligned, num_shrink)
        assert gpu.strip() == expected_path(mode, head, True, aligned, num_shrink)
        if mode_name.strip().endswith("key offset"):   # the offset write's own tiling (tuning.OFFSET_TILING)
            rows_, warps, cap = OFFSET_TILING.get(head, MMA_TILING[head][:2] + (0,))
            assert f"rows={rows_}, num_warps={warps}," in tuning and tuning.endswith(f"maxnreg={cap} ")


CUDA_GRID = [(m, d, dt) for m in MODES for d in (16, 32, 64, 128, 256, 512) for dt in (torch.bfloat16, torch.float16)
             if m == "int4" or d >= 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode_name,d,dtype", CUDA_GRID, ids=[f"{m}-h{d}-{str(dt)[6:]}" for m, d, dt in CUDA_GRID])
def test_cuda_plan_names_the_kernel_that_runs(mode_name, d, dtype):
    """On the GPU: the default path of each mode and head size, and for INT4 the MSE encoder and
    rows not 16-byte loadable (K/V slices of a token stride H·d + 8), launch what the plan names."""
    mode = MODES[mode_name]
    for n in (1, 4096):
        plan, ran = _write(mode_name, d, n, dtype, "cuda")
        assert plan.path == expected_path(mode, d, True)
        _assert_ran(plan, ran, n)
    if mode == M.INT4_PER_TOKEN_HEAD:
        plan, ran = _write(mode_name, d, 512, dtype, "cuda", shrink=MSE)
        assert plan.path == "int4-fused"
        _assert_ran(plan, ran, 512)
        buf = torch.randn(512, H * d + 8, device="cuda").to(dtype)
        k = buf[:, :H * d].view(512, H, d)
        plan, ran = _write(mode_name, d, 512, dtype, "cuda", key=k, value=k)
        assert plan.path == "int4-fused"
        _assert_ran(plan, ran, 512)
