"""Paged attention kernels (``kernels.unified_attention``, ``kernels.unified_attention_int4``).

Covers: every cache mode (NONE bf16/fp16, INT8, FP8, INT4) against the plain-PyTorch oracle
``reference_unified_attention`` reading the same cache; GQA ratios 1/4/8; partial last blocks;
mixed prefill + decode batches (including an empty sequence); causal and non-causal; sliding
window; softcap; the 2D and the split-KV paths (segments forced, buffers passed by the caller,
and the launcher's own choice); strided views of one packed cache and separate tensors;
launcher errors; every decode kernel forced through ``Tuning.path`` (the 2D kernel, decode_split,
decode_code_units, decode_block_tiles; on the GPU also with their PTX code conversion, and the
Gluon staged kernels); the plan's defaults and fallbacks (``attention_plan``, for the CPU and for
an H200 through fake device facts) and that the planned kernel is the one launched; the Gluon
compile probe; the reduction in chunks; programmatic dependent launch (GPU); a smoke run of
``bench/attention.py --quick``.

CPU tensors run through Triton's interpreter (small shapes); a CUDA test runs when a GPU is
present. Caches are filled with the oracle writer ``reference_reshape_and_cache`` so these
tests do not depend on the write kernels. Run: ``python -m pytest tests/test_attention_kernels.py``.

Tolerance: relative L2 <= 1e-2. The kernel and the oracle read the same codes, so
the difference is only rounding: bf16 output (~2e-3), 16-bit dot operands and the rotated
query in bf16 for INT4; measured errors sit near 3e-3.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from kernels.attention import (CPU, H200, DeviceFacts, Path, Reduce, Rotate, Tiling, Tuning, attention_plan,
                               unified_attention, unified_attention_int4)
from kernels.reference import reference_reshape_and_cache
from kernels.reference import reference_unified_attention
from layouts import CacheGeometry, KVQuantMode, LayoutError, split_kv_cache

TOL = 1e-2  # see the module docstring for where the residual comes from
P2D, SPLIT, UNITS, BLOCKS = Path.PREFILL_2D, Path.DECODE_SPLIT, Path.DECODE_CODE_UNITS, Path.DECODE_BLOCK_TILES
STAGED4, STAGED8 = Path.DECODE_STAGED_INT4, Path.DECODE_STAGED_INT8


def forced(path, block_m, tile, num_segments, num_warps=4, num_stages=2, **kw) -> Tuning:
    """A Tuning that asks for ``path`` with this tiling (the plan still falls back where the
    path cannot read the cache)."""
    return Tuning(path=path, tiling=Tiling(block_m, tile, num_segments, num_warps, num_stages, **kw))

MODES = [
    pytest.param(KVQuantMode.NONE, torch.bfloat16, id="none-bf16"),
    pytest.param(KVQuantMode.NONE, torch.float16, id="none-fp16"),
    pytest.param(KVQuantMode.INT8_PER_TOKEN_HEAD, torch.bfloat16, id="int8"),
    pytest.param(KVQuantMode.FP8_PER_TOKEN_HEAD, torch.bfloat16, id="fp8"),
    pytest.param(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, id="int4"),
]


def make_case(mode, dtype, q_lens, k_lens, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
              device="cpu", packed=True, seed=0):
    """Random K/V written by the oracle writer into a paged cache with a shuffled block table.

    Unused cache bytes are poisoned (NaN values / 0xFF codes) so a read outside the table shows.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(blocks_per_seq) + 3
    geo = CacheGeometry(mode, head_size, num_kv_heads, block_size, dtype)
    cache = geo.new_cache(num_blocks, device=device)
    if mode == KVQuantMode.NONE:
        cache.fill_(float("nan"))
    else:
        cache.view(torch.uint8).fill_(0xFF)
    views = split_kv_cache(cache, mode, head_size)
    if not packed:  # four separate contiguous tensors
        views = type(views)(*(None if t is None else t.clone() for t in views))
    perm = torch.randperm(num_blocks, generator=g).to(device)
    block_table = torch.zeros(len(q_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start:start + n]
        start += n
    for i, kl in enumerate(k_lens):
        key = torch.randn(kl, num_kv_heads, head_size, generator=g).to(dtype).to(device)
        value = torch.randn(kl, num_kv_heads, head_size, generator=g).to(dtype).to(device)
        pos = torch.arange(kl, device=device)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        reference_reshape_and_cache(key, value, views.key_cache, views.value_cache, slots, mode,
                                    views.k_scale_cache, views.v_scale_cache)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(int(cu[-1]), num_q_heads, head_size, generator=g).to(dtype).to(device)
    return dict(q=q, views=views, cu=cu, seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                block_table=block_table, max_q=max(q_lens), max_k=max(k_lens), mode=mode)


def plan_for(mode, batch, ctx, facts=H200, *shape, **kw):
    """``attention_plan`` of a batch of ``batch`` sequences of ``ctx`` keys for ``facts``: the
    same helper that generates docs/KERNELS.md (``bench.kernels_table.plan``)."""
    from bench.kernels_table import plan
    return plan(mode, batch, ctx, facts, *shape, **kw)


def run_and_check(c, causal=True, window=(-1, -1), softcap=0.0, out_dtype=None, **kw):
    q, views = c["q"], c["views"]
    out = torch.full(q.shape, float("nan"), dtype=out_dtype or q.dtype, device=q.device)  # poison
    scale = q.shape[-1] ** -0.5
    ret = unified_attention(q, views.key_cache, views.value_cache, out, c["cu"], c["seqused_k"], c["max_q"],
                            c["max_k"], scale, causal, window, c["block_table"], softcap, None, None, None,
                            kv_quant_mode=c["mode"], k_scale_cache=views.k_scale_cache,
                            v_scale_cache=views.v_scale_cache, **kw)
    assert ret is out
    ref = reference_unified_attention(q, views.key_cache, views.value_cache, c["cu"], c["seqused_k"],
                                      c["block_table"], scale, causal, window, softcap, c["mode"],
                                      views.k_scale_cache, views.v_scale_cache)
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output rows"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= TOL, f"relative L2 {err:.2e} > {TOL}"
    return out


# Every kernel a plan can launch, as (module of kernels.attention, name): where its launcher
# looks it up (the Gluon ones through gluon_probe.require).
PATH_KERNELS = {
    Path.PREFILL_2D: ("prefill_2d", "_attn_kernel"),
    Path.DECODE_SPLIT: ("decode_split", "_decode_split_kernel"),
    Path.DECODE_CODE_UNITS: ("decode_code_units", "_decode_code_units_kernel"),
    Path.DECODE_BLOCK_TILES: ("decode_block_tiles", "_decode_block_tiles_kernel"),
    Path.DECODE_STAGED_INT4: ("decode_staged_int4_gluon", "_decode_staged_int4_kernel"),
    Path.DECODE_STAGED_INT8: ("decode_staged_int8_gluon", "_decode_staged_int8_kernel"),
}
INT4_2D = ("prefill_2d", "_attn_int4_kernel")
WGMMA_2D = ("prefill_wgmma_gluon", "_prefill_wgmma_kernel")  # Tiling.wgmma: the sm_90 2D kernel over 16-bit rows
DEQUANT = ("prefill_dequant", "_dequant_blocks_kernel")  # Tiling.dequant_first's pass before the 2D kernel
ROTATE_ROWS = ("prefill_dequant", "_rotate_rows_kernel")  # INT4 dequant_first: query and output rotations
ROTATE_KERNELS = {Rotate.TRITON: ("rotate_query", "_rotate_query_kernel"),
                  Rotate.GLUON: ("rotate_query_gluon", "_rotate_query_gluon_kernel")}
REDUCE_KERNELS = {Reduce.TRITON: ("reduce", "_attn_reduce_kernel"),
                  Reduce.GLUON: ("reduce_gluon", "_attn_reduce_gluon_kernel")}


class _Recorder:
    """A kernel that logs its name at each launch (``kernel[grid](...)``) and is otherwise the kernel."""

    def __init__(self, name, kernel, log):
        self._name, self._kernel, self._log = name, kernel, log

    def __getitem__(self, grid):
        self._log.append(self._name)
        return self._kernel[grid]

    def __getattr__(self, attr):
        return getattr(self._kernel, attr)


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels launched while the test runs, in order."""
    import importlib

    from kernels.attention import gluon_probe
    log = []
    for module, name in [*PATH_KERNELS.values(), INT4_2D, DEQUANT, ROTATE_ROWS, *ROTATE_KERNELS.values(),
                         *REDUCE_KERNELS.values()]:
        if not module.endswith("_gluon"):
            mod = importlib.import_module(f"kernels.attention.{module}")
            monkeypatch.setattr(mod, name, _Recorder(name, getattr(mod, name), log))
    real = gluon_probe.require
    monkeypatch.setattr(gluon_probe, "require", lambda module, name: _Recorder(name, real(module, name), log))
    return log


def dequant_launches(mode, tiling=None) -> list:
    """The kernels of one ``dequant_first`` group, in launch order (``tiling.wgmma``: the sm_90
    Gluon kernel attends over the scratch; INT4 rotates its query and output around them unless
    ``tiling.unrotate``)."""
    attend = (WGMMA_2D if tiling is not None and tiling.wgmma else PATH_KERNELS[P2D])[1]
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not (tiling is not None and tiling.unrotate):
        return [ROTATE_ROWS[1], DEQUANT[1], attend, ROTATE_ROWS[1]]
    return [DEQUANT[1], attend]


def expected_launches(plan, mode) -> list:
    """The kernels ``plan`` names, in launch order: the query rotation, the path's kernel, the
    reduction; a mixed plan's parts one after the other; a dequantized 2D plan (``dequant_first``
    over a quantized cache): the dequantizing pass, then the unquantized 2D kernel (INT4: the
    query's rotation first and the output's after), once per group of KV heads
    (``Tiling.dequant_groups``)."""
    if plan.path == Path.EMPTY:
        return []
    if plan.path == Path.MIXED:
        return expected_launches(plan.parts[0], mode) + expected_launches(plan.parts[1], mode)
    if plan.path == P2D and plan.tiling.dequant_first and mode != KVQuantMode.NONE:
        return dequant_launches(mode, plan.tiling) * plan.tiling.dequant_groups
    names = [ROTATE_KERNELS[plan.rotate][1]] if plan.rotate in ROTATE_KERNELS else []
    main = INT4_2D if plan.path == P2D and mode == KVQuantMode.INT4_PER_TOKEN_HEAD else PATH_KERNELS[plan.path]
    if plan.path == P2D and plan.tiling.wgmma:
        main = WGMMA_2D
    names.append(main[1])
    if plan.reduce in REDUCE_KERNELS:
        names.append(REDUCE_KERNELS[plan.reduce][1])
    return names


SCENARIOS = [
    # mixed batch: prefill chunks, a decode row, an empty sequence; partial last blocks; GQA 4
    pytest.param(dict(q_lens=[5, 1, 0, 17], k_lens=[40, 23, 9, 17]), {}, id="mixed-causal-gqa4"),
    # non-causal, MQA (GQA 8), sliding window, softcap, fp32 output
    pytest.param(dict(q_lens=[3, 9], k_lens=[50, 33], num_q_heads=8, num_kv_heads=1),
                 dict(causal=False, window=(10, 4), softcap=5.0, out_dtype=torch.float32),
                 id="noncausal-window-softcap-gqa8"),
    # decode through the split-KV path, forced to 4 segments; GQA 1
    pytest.param(dict(q_lens=[1, 1, 1], k_lens=[70, 23, 130], num_q_heads=2, num_kv_heads=2),
                 dict(num_par_softmax_segments=4), id="decode-split-gqa1"),
    # decode, split path, sliding window (segments cover only the window)
    pytest.param(dict(q_lens=[1, 1], k_lens=[100, 37]), dict(window=(24, -1), num_par_softmax_segments=2),
                 id="decode-split-window"),
]


@pytest.mark.parametrize("mode,dtype", MODES)
@pytest.mark.parametrize("shape,opts", SCENARIOS)
def test_matches_oracle(mode, dtype, shape, opts):
    run_and_check(make_case(mode, dtype, **shape), **opts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("mode,dtype", MODES)
@pytest.mark.parametrize("shape,opts", SCENARIOS)
def test_cuda_matches_oracle(mode, dtype, shape, opts, head_size):
    """The scenarios above on the GPU at every head size the kernels serve (the compiled code,
    not the interpreter's: dot dtypes, layouts and shared memory differ)."""
    run_and_check(make_case(mode, dtype, head_size=head_size, device="cuda", **shape), **opts)


@pytest.mark.parametrize("mode,dtype", [MODES[0], MODES[2], MODES[4]])
def test_separate_tensors_and_caller_buffers(mode, dtype):
    """Four separate contiguous tensors; vLLM-style segment buffers larger than needed."""
    c = make_case(mode, dtype, q_lens=[1, 1], k_lens=[45, 90], packed=False, seed=3)
    segs, head = 8, 64
    buf = torch.full((5, 8, segs, head), float("nan"))
    mx = torch.full((5, 8, segs), float("nan"))
    run_and_check(c, softmax_segm_output=buf, softmax_segm_max=mx, softmax_segm_expsum=mx.clone())
    assert torch.isfinite(mx[:2]).any()  # the split path really ran through the caller's buffers


def test_two_paths_agree_and_heuristic():
    """Decode through 2D and through split-KV gives the same output; the launcher picks split."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.float16, q_lens=[1, 1], k_lens=[1100, 1030], seed=5)
    hq, hkv, head = c["q"].shape[1], c["views"].key_cache.shape[2], c["q"].shape[2]
    plan = plan_for(c["mode"], 2, 1100, CPU, head, hq, hkv)
    assert plan.tiling.num_segments > 1, plan
    plan = plan_for(c["mode"], 2, 1100, CPU, head, hq, hkv, q_len=7)
    assert (plan.path, plan.tiling.num_segments) == (P2D, 1)
    plan = plan_for(c["mode"], 2, 1100, CPU, head, hq, hkv, seq_threshold_3D=1)  # threshold
    assert (plan.path, plan.tiling.num_segments) == (P2D, 1)
    auto = run_and_check(c)
    two_d = run_and_check(c, seq_threshold_3D=0)
    assert ((auto.float() - two_d.float()).norm() / two_d.float().norm()) < 5e-3  # fp16 rounding only


def _call(c, **over):
    views = c["views"]
    args = dict(q=c["q"], k=views.key_cache, v=views.value_cache, out=torch.empty_like(c["q"]),
                cu_seqlens_q=c["cu"], seqused_k=c["seqused_k"], max_seqlen_q=c["max_q"],
                max_seqlen_k=c["max_k"], softmax_scale=0.1, causal=True, window_size=(-1, -1),
                block_table=c["block_table"], softcap=0.0, q_descale=None, k_descale=None, v_descale=None,
                kv_quant_mode=c["mode"], k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache)
    args.update(over)
    return unified_attention(**args)


@pytest.fixture(scope="module")
def int8_case():
    return make_case(KVQuantMode.INT8_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[2], k_lens=[20])


@pytest.mark.parametrize("over,match", [
    (lambda c: dict(q=c["q"].float()), "q must be"),
    (lambda c: dict(k=c["views"].key_cache.view(torch.uint8)), "cache dtype: expected torch.int8"),
    (lambda c: dict(k=c["views"].key_cache[..., :32], v=c["views"].value_cache[..., :32]), "cache last dim"),
    (lambda c: dict(q=c["q"][:, :7]), "multiple of num_kv_heads"),
    (lambda c: dict(out=torch.empty(1, 8, 64)), "out must be"),
    (lambda c: dict(k_scale_cache=None), "needs k_scale_cache"),
    (lambda c: dict(seqused_k=c["seqused_k"].float()), "seqused_k must be"),
    (lambda c: dict(block_table=c["block_table"][0]), "block_table must be"),
    (lambda c: dict(window_size=(4,)), "window_size"),
    (lambda c: dict(softcap=-1.0), "softcap must be"),
    (lambda c: dict(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR), "not implemented"),
    (lambda c: dict(max_seqlen_q=1, softmax_segm_output=torch.empty(2, 8, 4, 32),
                    softmax_segm_max=torch.empty(2, 8, 4), softmax_segm_expsum=torch.empty(2, 8, 4)),
     "softmax_segm_output must be"),
], ids=["q-dtype", "cache-dtype", "head-size", "gqa", "out-shape", "missing-scale", "seqused-dtype",
        "block-table", "window", "softcap", "fp8-per-tensor", "segm-buffer"])
def test_launcher_errors(int8_case, over, match):
    with pytest.raises(LayoutError, match=match):
        _call(int8_case, **over(int8_case))


def test_int4_head_size_error():
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1], k_lens=[8], head_size=16)
    v = c["views"]
    with pytest.raises(LayoutError, match="power of two >= 32"):
        unified_attention_int4(c["q"], v.key_cache, v.value_cache, torch.empty_like(c["q"]), c["cu"],
                               c["seqused_k"], 1, 8, 0.25, True, (-1, -1), c["block_table"], 0.0,
                               v.k_scale_cache, v.v_scale_cache)


QUANT = [MODES[2], MODES[3], MODES[4]]
DECODE_KERNELS = [pytest.param(P2D, 3, id="prefill_2d"), pytest.param(SPLIT, 3, id="decode_split"),
                  pytest.param(UNITS, 3, id="decode_code_units"), pytest.param(BLOCKS, 2, id="decode_block_tiles")]


@pytest.mark.parametrize("mode,dtype", QUANT)
@pytest.mark.parametrize("kernel,stages", DECODE_KERNELS)
def test_quantized_decode_kernels(mode, dtype, kernel, stages):
    """Every quantized decode kernel (2D, decode_split, decode_code_units, decode_block_tiles) on the
    split path: an empty sequence, a segment boundary inside a tile, window, non-causal softcap."""
    c = make_case(mode, dtype, q_lens=[1, 0, 1], k_lens=[70, 5, 130], seed=7)
    cfg = forced(kernel, 16, 32, 3, 4, stages)
    run_and_check(c, tuning=cfg)
    run_and_check(c, tuning=cfg, window=(40, -1))
    run_and_check(c, tuning=cfg, causal=False, softcap=3.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("mode,dtype", QUANT)
@pytest.mark.parametrize("head_size,num_q_heads,num_kv_heads", [(64, 8, 8), (128, 8, 1), (256, 4, 4)])
def test_block_tiles_decode_kernel(mode, dtype, head_size, num_q_heads, num_kv_heads, device):
    """decode_block_tiles vs the oracle: GQA 1 / 4 / 8, sequences of different lengths, partial
    last blocks; tiles of one block (one id per tile), of two (ids per key) and of half a block
    (block 32); one, two or all KV heads per program, token-major loads or not; window and
    non-causal softcap."""
    c = make_case(mode, dtype, q_lens=[1, 1, 1], k_lens=[75, 9, 140], head_size=head_size,
                  num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=head_size + num_kv_heads, device=device)
    cfg = forced(BLOCKS, 16, 16, 4, 4, 2)
    run_and_check(c, tuning=cfg)
    run_and_check(c, tuning=cfg, window=(40, -1))
    run_and_check(c, tuning=cfg, causal=False, softcap=3.0)
    run_and_check(c, tuning=forced(BLOCKS, 16, 32, 4, 1, 2, heads_per_program=1), window=(40, -1))
    run_and_check(c, tuning=forced(BLOCKS, 16, 16, 3, 2, 2, heads_per_program=min(2, num_kv_heads)))
    run_and_check(c, tuning=forced(BLOCKS, 16, 16, 3, 2, 2, heads_per_program=min(2, num_kv_heads), row_loads=False))
    run_and_check(c, tuning=forced(BLOCKS, 16, 32, 3, 2, 2, heads_per_program=min(2, num_kv_heads)))  # ids per key
    c = make_case(mode, dtype, q_lens=[1, 1], k_lens=[75, 140], head_size=head_size, block_size=32,
                  num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=head_size, device=device)
    run_and_check(c, tuning=forced(BLOCKS, 16, 16, 4, 1, 2, heads_per_program=1), window=(40, -1))
    run_and_check(c, tuning=forced(BLOCKS, 16, 16, 4, 2, 2, heads_per_program=min(2, num_kv_heads)))  # token-major


def _gluon_available():
    """A CUDA sm_80+ device whose Triton has Gluon (the staged kernels' probe decides the rest)."""
    from kernels.attention.plan import device_facts
    return torch.cuda.is_available() and device_facts(torch.device("cuda")).cuda_sm80 and \
        device_facts(torch.device("cuda")).gluon


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_staged_int4_falls_back_where_it_cannot_read(device):
    """decode_staged_int4 asked for on a cache it cannot read takes decode_block_tiles with its
    tiling and still matches the oracle: the CPU (interpreter), four separate tensors, head_size
    64; and the planner never picks a staged kernel on the CPU."""
    from kernels.attention import decode_staged
    cfg = forced(STAGED4, 16, 16, 4, 8, 2)
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1, 1], k_lens=[75, 140],
                  num_q_heads=32, num_kv_heads=8, head_size=128, seed=21, device=device, packed=False)
    v = c["views"]
    assert not decode_staged.reads_layout(c["mode"], c["q"], v.key_cache, v.value_cache,
                                          v.k_scale_cache.view(torch.int32), v.v_scale_cache.view(torch.int32))
    assert _plan_of(c, tuning=cfg).path == BLOCKS
    run_and_check(c, tuning=cfg)
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1, 1], k_lens=[75, 140],
                  seed=22, device=device)  # head_size 64
    run_and_check(c, tuning=cfg, window=(40, -1))
    for mode, dtype, head_size in ((KVQuantMode.NONE, torch.bfloat16, 64), (KVQuantMode.INT8_PER_TOKEN_HEAD,
                                                                           torch.bfloat16, 96)):
        c = make_case(mode, dtype, q_lens=[1, 1], k_lens=[75, 40], head_size=head_size, seed=23, device=device)
        run_and_check(c, tuning=cfg)  # no block-tile tiling (bf16, head_size 96): the generic kernels
        assert _plan_of(c, tuning=cfg).path in (P2D, SPLIT)
    assert plan_for(KVQuantMode.INT4_PER_TOKEN_HEAD, 8, 32768, CPU).path == BLOCKS


def _plan_of(c, **kw):
    """``attention_plan`` of case ``c`` on its own device (as ``run_and_check`` calls it)."""
    q, views = c["q"], c["views"]
    return attention_plan(q, views.key_cache, views.value_cache, q, c["cu"], c["seqused_k"], c["max_q"], c["max_k"],
                          0.1, True, (-1, -1), c["block_table"], 0.0, kv_quant_mode=c["mode"],
                          k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache, **kw)


def _matches_block_tiles(c, cfg, block_tiles):
    """A staged decode tuning on case ``c`` plans the staged kernel and matches the oracle and
    decode_block_tiles (relative L2 <= 2e-3): causal, a 100-key window, and non-causal with softcap."""
    assert _plan_of(c, tuning=cfg).path == cfg.path
    for opts in ({}, dict(window=(100, -1)), dict(causal=False, softcap=30.0)):
        got = run_and_check(c, tuning=cfg, **opts).float()
        ref = run_and_check(c, tuning=block_tiles, **opts).float()
        assert ((got - ref).norm() / ref.norm()).item() <= 2e-3


@pytest.mark.skipif(not _gluon_available(), reason="needs a CUDA GPU (sm_80+) and Triton's Gluon")
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (8, 8), (64, 8), (16, 4), (4, 1), (8, 2)])
def test_cuda_staged_int4_decode_kernel(num_q_heads, num_kv_heads):
    """The staged INT4 decode kernel reads the packed cache itself and matches the oracle and
    decode_block_tiles: GQA 1 / 2 / 4 / 8 (4 on 8 query rows), a one-key sequence, partial last blocks, a
    100-key window, softcap, 3 to 32 segments (empty ones included), rings of 2 to 6 stages (two
    blocks a loop step where even, with bulk copies); the unused rows of each
    last block hold 0xFF poison (scale words NaN), which must not reach the output. The query
    rotated in the kernel's prologue (``Rotate.PROLOGUE``, from a strided query too) and by the
    rotation kernel first."""
    from kernels.attention import decode_staged, gluon_probe
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1] * 5, k_lens=[1500, 1, 17, 333, 640],
                  num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=128, device="cuda",
                  seed=num_q_heads + num_kv_heads)
    v = c["views"]
    assert decode_staged.reads_layout(c["mode"], c["q"], v.key_cache, v.value_cache,
                                      v.k_scale_cache.view(torch.int32), v.v_scale_cache.view(torch.int32))
    block_tiles = forced(BLOCKS, 16, 32, 8, 1, 2, heads_per_program=1)
    # even rings: two blocks a loop step (sm_90); 3 stages: one (odd tile counts in both)
    for segs, stages in ((3, 2), (32, 2), (3, decode_staged.STAGES[STAGED4.value]), (5, 6), (5, 3)):
        for in_kernel in (True, False):
            cfg = dataclasses.replace(forced(STAGED4, 16, 16, segs, num_kv_heads, stages), rotate_q_in_decode=in_kernel)
            assert (_plan_of(c, tuning=cfg).rotate == Rotate.PROLOGUE) == in_kernel
            _matches_block_tiles(c, cfg, block_tiles)
    wide = torch.randn(5, num_q_heads, 3, 128, device="cuda", dtype=torch.bfloat16)
    wide[:, :, 1] = c["q"]
    c["q"] = wide[:, :, 1]  # strides (3 x 128 x heads, 3 x 128, 1): as a slice of a fused QKV projection
    _matches_block_tiles(c, forced(STAGED4, 16, 16, 32, num_kv_heads, 4), block_tiles)
    assert not any(gluon_probe.verdicts().values())  # every probe compiled


def test_staged_ring_is_reserved_once_before_the_first_launch(monkeypatch):
    """``decode_staged.launch`` compiles each variant once (``warmup``), reserves its ring in
    dynamic shared memory after Triton's own (128-byte aligned offset, ``stages`` whole blocks),
    passes that offset as ``ring_off``, and reuses it; each kernel object keeps its own; a kernel
    that was loaded before its ring was reserved is refused, and another Triton's compiled-kernel
    object is a compile-type error (so the probe's verdict is: the staged kernel does not run)."""
    import collections
    import types

    from kernels.attention import decode_staged as staged
    from kernels.attention import gluon_probe
    from kernels.attention.plan import Plan
    meta = collections.namedtuple("KernelMetadata", "num_ctas num_warps shared")

    class Compiled:
        def __init__(self, shared):
            self.metadata, self.module = meta(1, 8, shared), None
            self.packed_metadata = (8, 1, shared)

    class Kernel:
        def __init__(self, shared):
            self.compiled, self.warmups, self.launches = Compiled(shared), 0, []

        def warmup(self, *args, grid, **kw):
            self.warmups += 1
            return self.compiled

        def __getitem__(self, grid):
            return lambda *args, **kw: self.launches.append((grid, args[-1], kw["STAGES"]))

    monkeypatch.setattr(staged, "_RING_OFFSETS", {})
    q = torch.zeros(2, 32, 128)
    call = types.SimpleNamespace(
        q=q, k=torch.zeros(5, 16, 8, 64, dtype=torch.uint8), group=4, mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
        segm_output=torch.zeros(1), segm_max=torch.zeros(1), segm_expsum=torch.zeros(1),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), seqused_k=torch.tensor([20, 30], dtype=torch.int32),
        block_table=torch.zeros(2, 3, dtype=torch.int32), window_size=(-1, -1), softcap=0.0, num_seqs=2,
        signs=torch.ones(128))
    kernels = []  # alive: the offsets are keyed by kernel object
    for shared, stages, off in ((1024, 4, 1024), (1000, 4, 1024), (0, 2, 0)):
        kernel = Kernel(shared)
        kernels.append(kernel)
        monkeypatch.setattr(gluon_probe, "require", lambda *a, kernel=kernel: kernel)
        plan = Plan(STAGED4, Tiling(16, 16, 4, 8, stages))
        for _ in range(2):
            staged.launch(call, plan, q, 0.1, False)
        ring = staged.ring_bytes(8, stages)
        assert ring == stages * 2 * 16 * 8 * 68 and kernel.warmups == 1
        assert kernel.compiled.metadata.shared == off + ring and kernel.compiled.packed_metadata == (8, 1, off + ring)
        assert kernel.launches == [((2, 4), off, stages)] * 2
    loaded = Compiled(1024)
    loaded.module = object()
    with pytest.raises(RuntimeError, match="loaded before"):
        staged.reserve_ring(loaded, 4096)
    # another Triton's compiled kernel (metadata not a namedtuple, or other launch metadata): a
    # compile-type error, so the probe says the staged kernel does not compile
    for meta_, packed in ((dict(num_warps=8, num_ctas=1, shared=1024), (8, 1, 1024)),
                          (meta(1, 8, 1024), (8, 1, 1024, 0))):
        other = Compiled(1024)
        other.metadata, other.packed_metadata = meta_, packed
        with pytest.raises(staged.RingUnsupported):
            staged.reserve_ring(other, 4096)
        assert other.packed_metadata == packed and not hasattr(other, "_kv_ring_off")
    assert staged.RingUnsupported in gluon_probe.COMPILE_ERRORS


def test_staged_grid_of_one_program_per_sm_keeps_a_second_off_each_sm(monkeypatch):
    """A staged grid that fits the SMs one program each asks for more than half an SM's shared
    memory (``reserve_ring``'s ``min_shared``), so the scheduler cannot put two programs on one
    SM; a larger grid, and a CPU tensor, ask for nothing more than the ring."""
    import collections
    import types

    from kernels.attention import decode_staged as staged
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or props)
    cuda = torch.device("cuda", 0)
    staged._sm_limits.cache_clear()
    try:
        assert staged._spread_shared(cuda, 128) == staged._spread_shared(cuda, 132) == 116736
        assert staged._spread_shared(cuda, 133) == 0 and staged._spread_shared(torch.device("cpu"), 8) == 0
        assert asked == [0]  # the device is asked once, not per launch
    finally:
        staged._sm_limits.cache_clear()  # drop the fake device's facts
    meta = collections.namedtuple("KernelMetadata", "num_ctas num_warps shared")
    for min_shared, shared in ((116736, 116736), (0, 1024 + 69632), (50000, 1024 + 69632)):
        compiled = types.SimpleNamespace(metadata=meta(1, 8, 1000), packed_metadata=(8, 1, 1000), module=None)
        assert staged.reserve_ring(compiled, 69632, min_shared) == 1024
        assert compiled.metadata.shared == shared and compiled.packed_metadata == (8, 1, shared)


@pytest.mark.skipif(not _gluon_available(), reason="needs a CUDA GPU (sm_80+) and Triton's Gluon")
@pytest.mark.parametrize("mode", [KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (8, 8), (16, 4), (4, 1), (8, 2)])
def test_cuda_staged_int8_decode_kernel(mode, num_q_heads, num_kv_heads):
    """The staged INT8 / FP8 decode reads the packed cache itself and matches the oracle and
    decode_block_tiles: GQA 1 / 2 / 4 / 8, a one-key sequence, partial last blocks with 0xFF poison in
    the unused rows (NaN codes for FP8), a 100-key window, softcap, 3 and 32 segments, 2 and 3
    stages, bulk and ``cp.async`` copies (sm_90+)."""
    from kernels.attention import decode_staged, gluon_probe
    c = make_case(mode, torch.bfloat16, q_lens=[1] * 5, k_lens=[1500, 1, 17, 333, 640], num_q_heads=num_q_heads,
                  num_kv_heads=num_kv_heads, head_size=128, device="cuda", seed=num_q_heads + 7 * num_kv_heads)
    v = c["views"]
    assert decode_staged.reads_layout(c["mode"], c["q"], v.key_cache, v.value_cache, v.k_scale_cache,
                                      v.v_scale_cache)
    block_tiles = forced(BLOCKS, 16, 16, 8, 1, 2, heads_per_program=1)
    for segs, stages, bulk in ((3, 2, True), (32, 3, True), (32, 2, False)):
        tuning = dataclasses.replace(forced(STAGED8, 16, 16, segs, num_kv_heads, stages), bulk_copies=bulk)
        assert _plan_of(c, tuning=tuning).bulk_copies == (bulk and torch.cuda.get_device_capability() >= (9, 0))
        _matches_block_tiles(c, tuning, block_tiles)
    assert not any(gluon_probe.verdicts().values())  # every probe compiled


def test_staged_int8_reads_only_the_packed_int8_fp8_layout():
    """``decode_staged.reads_layout``: the packed INT8 / FP8 views at head_size 128 / block 16 /
    1-8 KV heads; not INT4, separate tensors or head_size 64. On the CPU, decode_staged_int8
    asked for takes decode_block_tiles."""
    from kernels.attention.decode_staged import reads_layout
    for mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        for nkv in (1, 2, 8):
            c = make_case(mode, torch.bfloat16, q_lens=[1], k_lens=[20], num_q_heads=2 * nkv, num_kv_heads=nkv,
                          head_size=128, seed=nkv)
            v = c["views"]
            assert reads_layout(mode, c["q"], v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache)
        assert not reads_layout(KVQuantMode.INT4_PER_TOKEN_HEAD, c["q"], v.key_cache, v.value_cache,
                                v.k_scale_cache, v.v_scale_cache)
        c = make_case(mode, torch.bfloat16, q_lens=[1], k_lens=[20], num_q_heads=4, num_kv_heads=2, head_size=128,
                      seed=3, packed=False)
        v = c["views"]
        assert not reads_layout(mode, c["q"], v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache)
    c = make_case(KVQuantMode.INT8_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1, 1], k_lens=[75, 40], head_size=64,
                  seed=5)
    v = c["views"]
    assert not reads_layout(c["mode"], c["q"], v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache)
    assert _plan_of(c, tuning=forced(STAGED8, 16, 16, 4, 2, 2)).path == BLOCKS
    run_and_check(c, tuning=forced(STAGED8, 16, 16, 4, 2, 2))  # CPU: falls back, matches the oracle


INT4, INT8, FP8, NONE = (KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD,
                         KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.NONE)
# (mode, head_size, q_lens, k_lens, max_seqlen_k or None, the path on the CPU): max_seqlen_k is an
# upper bound, so a larger one plans a larger batch on a small cache (the kernels read seqused_k)
PLAN_GRID = [
    pytest.param(NONE, 64, [1, 1], [600, 300], None, P2D, id="bf16-decode-split-2d"),
    pytest.param(NONE, 64, [5, 1], [40, 30], None, P2D, id="bf16-prefill"),
    pytest.param(INT8, 64, [1, 1], [100, 37], None, BLOCKS, id="int8-h64-decode"),
    pytest.param(FP8, 128, [1, 1], [100, 37], None, BLOCKS, id="fp8-h128-decode"),
    pytest.param(FP8, 96, [1, 1], [600, 37], None, P2D, id="fp8-h96-decode"),
    pytest.param(INT8, 128, [3, 1], [40, 30], None, P2D, id="int8-prefill"),
    pytest.param(INT4, 64, [1, 1], [100, 37], None, UNITS, id="int4-h64-b2-small"),
    pytest.param(INT4, 64, [1, 1], [100, 37], 4096, BLOCKS, id="int4-h64-b2-8k-keys"),
    pytest.param(INT4, 256, [1], [100], None, UNITS, id="int4-h256-b1"),
    pytest.param(INT4, 32, [1, 1], [100, 37], None, SPLIT, id="int4-h32-units-too-narrow"),
    pytest.param(INT4, 128, [4, 1], [40, 30], None, P2D, id="int4-prefill"),
]


@pytest.mark.parametrize("mode,head_size,q_lens,k_lens,max_k,cpu_path", PLAN_GRID)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_plan_names_the_kernel_that_runs(mode, head_size, q_lens, k_lens, max_k, cpu_path, device, launched):
    """For each (mode, head_size, batch, context, device) the plan's path, rotation and reduction
    are the kernels that the call launches (recorded at launch), in order, and the output
    matches the oracle; on the CPU the path is the one the rules give."""
    c = make_case(mode, torch.bfloat16, q_lens=q_lens, k_lens=k_lens, head_size=head_size, seed=len(k_lens),
                  device=device)
    c["max_k"] = max_k or c["max_k"]
    plan = _plan_of(c)
    if device == "cpu":
        assert plan.path == cpu_path, plan
    run_and_check(c)
    assert launched == expected_launches(plan, mode), plan


@pytest.mark.skipif(not _gluon_available(), reason="needs a CUDA GPU (sm_80+) and Triton's Gluon")
@pytest.mark.parametrize("mode", [INT4, INT8, FP8])
@pytest.mark.parametrize("batch,ctx", [(4, 32768), (12, 11000), (2, 4096), (2, 32768), (1, 65536), (8, 2048)])
def test_cuda_plan_names_the_kernel_that_runs(mode, batch, ctx, launched):
    """On the GPU at head_size 128 (32 query / 8 KV heads), from small to staged batches: the
    launched kernels are the plan's (the staged kernels, their rotation and the Gluon reduction
    included), and the output matches the oracle."""
    from kernels.attention import decode_staged
    c = make_case(mode, torch.bfloat16, q_lens=[1] * batch, k_lens=[ctx - 7 * i for i in range(batch)],
                  num_q_heads=32, num_kv_heads=8, head_size=128, device="cuda", seed=batch)
    plan = _plan_of(c)
    staged = decode_staged.wants((STAGED4 if mode == INT4 else STAGED8).value, 128, 4, 8, batch, ctx)
    assert (plan.path in (STAGED4, STAGED8)) == staged, plan
    run_and_check(c)
    assert launched == expected_launches(plan, mode), plan


def test_empty_batch_launches_nothing(launched):
    """No query tokens: the plan is ``empty`` and nothing is launched; ``out`` is returned as is."""
    c = make_case(INT4, torch.bfloat16, q_lens=[0, 0], k_lens=[20, 9])
    assert _plan_of(c).path == Path.EMPTY
    v = c["views"]
    out = torch.empty_like(c["q"])
    assert unified_attention(c["q"], v.key_cache, v.value_cache, out, c["cu"], c["seqused_k"], 0, 20, 0.1, True,
                             (-1, -1), c["block_table"], 0.0, None, None, None, kv_quant_mode=INT4,
                             k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache) is out
    assert launched == []


@pytest.mark.parametrize("mode", [KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD,
                                  KVQuantMode.FP8_PER_TOKEN_HEAD], ids=["int4", "int8", "fp8"])
def test_staged_is_the_default_for_large_batches_on_an_h200(mode):
    """On an H200 (fake device facts) the plan takes the staged kernel of the mode (its ring
    depth, deeper where the grid runs one program per SM; its segments) for decode at head_size 128 from ``MIN_KEYS`` keys in the batch, one
    sequence included, and the portable kernel below it (INT4: decode_code_units, which takes
    INT4 below 32,768 keys), decode_block_tiles for GQA 16, head_size 64, separate tensors (the
    staged kernels read only the packed layout: block tiles keep the staged segment count),
    without Gluon, and (FP8) on an sm_80 device."""
    from kernels.attention import decode_staged
    staged = STAGED4 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else STAGED8
    big = 4096                                          # both staged kernels take 8 x big
    assert 8 * big >= max(decode_staged.MIN_KEYS.values())
    plan = plan_for(mode, 8, big)
    # one program per SM (8 x 16 segments): the spread ring depth; two per SM (b8@32k): the default
    assert plan.path == staged and plan.tiling.num_stages == decode_staged.SPREAD_STAGES[staged.value]
    assert plan.tiling.num_segments == decode_staged.segments(132, 8, big) == 16 and plan.bulk_copies and plan.pdl
    two = plan_for(mode, 8, 32768)
    assert two.tiling.num_segments == 33 and two.tiling.num_stages == decode_staged.STAGES[staged.value]
    # INT4: the kernel rotates its query (the rotation kernel with rotate_q_in_decode off)
    int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    assert plan.rotate == (Rotate.PROLOGUE if int4 else Rotate.NONE)
    off = plan_for(mode, 8, big, tuning=Tuning(rotate_q_in_decode=False))
    assert off.rotate == (Rotate.GLUON if int4 else Rotate.NONE) and off.path == staged
    assert plan.reduce == Reduce.GLUON
    # the reduction scheduled at the kernel's start where the grid is one program per SM (8 x 16), not at
    # two per SM (b8@32k), nor without programmatic dependent launch
    assert plan.reduce_early and not two.reduce_early
    assert not plan_for(mode, 8, big, tuning=Tuning(pdl=False)).reduce_early
    below = UNITS if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else BLOCKS   # INT4 block tiles from 32,768 keys
    one = decode_staged.MIN_KEYS[staged.value]      # 8 sequences, 2, or a single one
    assert (plan_for(mode, 8, one // 8).path, plan_for(mode, 8, one // 16).path) == (staged, below)
    assert (plan_for(mode, 1, one).path, plan_for(mode, 1, one // 2).path) == (staged, below)
    assert plan_for(mode, 2, one // 2).path == staged and plan_for(mode, 2, one // 2 - 16).path == below
    assert plan_for(mode, 8, big, num_q_heads=128).path == BLOCKS                        # GQA 16
    assert plan_for(mode, 8, big, head_size=64).path == BLOCKS
    separate = plan_for(mode, 8, big, packed=False)
    assert (separate.path, separate.tiling.num_segments) == (BLOCKS, plan.tiling.num_segments)
    assert "not the packed layout" in separate.why
    no_gluon = plan_for(mode, 8, big, facts=dataclasses.replace(H200, gluon=False))
    assert no_gluon.path == BLOCKS and no_gluon.reduce == Reduce.TRITON
    a100 = plan_for(mode, 8, big, facts=DeviceFacts("cuda", 108, (8, 0), gluon=True))
    assert a100.path == (BLOCKS if mode == KVQuantMode.FP8_PER_TOKEN_HEAD else staged) and not a100.pdl
    assert not a100.bulk_copies
    assert plan_for(mode, 8, big, facts=CPU).path == BLOCKS  # never a Gluon kernel on the CPU


def test_reduction_is_scheduled_early_only_after_one_wave_grids():
    """``Plan.reduce_early`` (the split kernel lets the reduction's programs be scheduled at its
    start) on an H200 where the split kernel's grid is resident at once: the bf16 split decode
    within 3 programs per SM (b1@32k: 8 KV heads x 47 segments), the staged kernels at one program
    per SM; not for two waves (bf16 b32@32k), two staged programs per SM (INT4 b32@32k), without
    programmatic dependent launch, nor on the CPU."""
    bf16 = plan_for(NONE, 1, 32768)
    assert bf16.path == P2D and bf16.tiling.num_segments * 8 <= 3 * 132 and bf16.reduce_early
    assert not plan_for(NONE, 32, 32768).reduce_early
    assert plan_for(INT4, 1, 32768).reduce_early and not plan_for(INT4, 32, 32768).reduce_early
    assert plan_for(INT8, 1, 65536).reduce_early
    assert not plan_for(NONE, 1, 32768, tuning=Tuning(pdl=False)).reduce_early
    assert not any(plan_for(m, 1, 32768, CPU).reduce_early for m in (NONE, INT4, INT8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_int4_query_rotation_in_decode_or_kernel(device, head_size, monkeypatch, launched):
    """INT4 decode_code_units: the query rotated in the decode kernel's prologue (the default; at
    head_size 256 for small grids like this one) and by the separate rotation kernel
    (``Tuning(rotate_q_in_decode=False)``) agree (only the fp32 order of the rotation's sums
    differs) and both match the oracle; GQA 4, sequences of different lengths, a partial last block."""
    from kernels.attention import plan as plan_mod
    real = plan_mod.device_facts
    # an H200's resident slots: this grid is small
    monkeypatch.setattr(plan_mod, "device_facts", lambda dev: dataclasses.replace(real(dev), num_sms=132))
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1, 1, 1], k_lens=[75, 9, 140],
                  head_size=head_size, seed=11, device=device)
    outs = []
    for fused in (True, False):
        tuning = dataclasses.replace(forced(UNITS, 16, 32, 3, 2, 2), rotate_q_in_decode=fused)
        plan = _plan_of(c, tuning=tuning)
        assert plan.rotate == (Rotate.PROLOGUE if fused else _rotation_kernel(c))
        launched.clear()
        outs.append(run_and_check(c, tuning=tuning).float())
        assert launched == expected_launches(plan, c["mode"])
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-2 * outs[1].abs().max().item()


def _rotation_kernel(c) -> Rotate:
    """The rotation kernel a plan picks for case ``c``'s device: Gluon on CUDA at head_size 128."""
    return Rotate.GLUON if c["q"].is_cuda and c["q"].shape[2] == 128 and _gluon_available() else Rotate.TRITON


def test_bench_quick_smoke(capsys):
    from bench import attention as bench_attention

    assert bench_attention.main(["--quick"]) == 0
    text = capsys.readouterr().out
    assert "| int4 |" in text and "prefill" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,dtype", MODES)
def test_cuda_realistic(mode, dtype):
    c = make_case(mode, dtype, q_lens=[1, 1, 37, 1], k_lens=[1500, 700, 900, 33], num_q_heads=32,
                  num_kv_heads=8, head_size=128, device="cuda")
    run_and_check(c)
    run_and_check(c, causal=False, window=(200, -1), softcap=30.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,dtype", QUANT)
@pytest.mark.parametrize("kernel,stages", DECODE_KERNELS)
def test_cuda_quantized_decode_kernels(mode, dtype, kernel, stages):
    """The GPU-only PTX code conversion of every decode kernel (default tile 128) vs the oracle."""
    c = make_case(mode, dtype, q_lens=[1, 1, 0, 1], k_lens=[1500, 700, 9, 33], num_q_heads=32,
                  num_kv_heads=8, head_size=128, device="cuda", seed=11)
    # block tiles: one KV head per program (its default); all 8 heads x 128 keys of INT8 rows would need
    # more shared memory than an SM has (Triton's OutOfResources)
    cfg = forced(kernel, 16, 128, 4, 4, stages, heads_per_program=1 if kernel == BLOCKS else 0)
    run_and_check(c, tuning=cfg)
    run_and_check(c, tuning=cfg, causal=False, window=(200, -1), softcap=30.0)
    if kernel == BLOCKS:  # a register cap, and two heads per program with token-major loads
        run_and_check(c, tuning=forced(BLOCKS, 16, 32, 4, 1, stages, heads_per_program=1, max_registers=168))
        run_and_check(c, tuning=forced(BLOCKS, 16, 16, 4, 2, stages, heads_per_program=2))
        if mode != KVQuantMode.INT4_PER_TOKEN_HEAD:  # 8 heads x 128 keys of INT8 rows: 287 KB of shared memory
            with pytest.raises(ValueError, match="does not fit this GPU"):  # was Triton's OutOfResources
                run_and_check(c, tuning=forced(BLOCKS, 16, 128, 4, 4, 4, heads_per_program=8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("mode,dtype", QUANT)
@pytest.mark.parametrize("kernel", [UNITS, BLOCKS], ids=["decode_code_units", "decode_block_tiles"])
def test_alignment_classes_and_poisoned_block0(mode, dtype, device, kernel):
    """decode_code_units' 16-, 8- and 4-byte row classes (4 KV heads: rows of 36 / 68 bytes
    put heads 0, 1, 2 in different classes) and its unmasked code loads: block 0, which keys past
    a sequence read, is left out of every table and poisoned (0xFF: NaN for FP8). Triton's
    interpreter does not turn the e4m3 byte 0xFF into NaN, so only the GPU run tests FP8's mask."""
    c = make_case(mode, dtype, q_lens=[1, 1, 1], k_lens=[70, 5, 130], num_q_heads=16, num_kv_heads=4, seed=3,
                  device=device)
    views, table = c["views"], c["block_table"]
    used = set(table.flatten().tolist())
    spare = next(b for b in range(views.key_cache.shape[0]) if b not in used)
    for t in views:  # move block 0's data to a spare block, then poison block 0 (scales: NaN)
        t[spare] = t[0]
        if t.dtype == torch.float32:
            t[0] = float("nan")
        else:
            t.view(torch.uint8)[0] = 0xFF
    table[table == 0] = spare
    cfg = forced(kernel, 16, 32 if kernel == UNITS else 16, 4, 1, 2)
    run_and_check(c, tuning=cfg)
    run_and_check(c, tuning=cfg, causal=False, softcap=3.0)
    run_and_check(c)  # the launcher's default


@pytest.mark.parametrize("mode,dtype", QUANT)
def test_decode_falls_back_where_code_units_cannot_read_the_cache(mode, dtype):
    """decode_code_units reads rows as 16-bit units, at least 16 of them: INT4 at head_size 32 (8
    units) goes to decode_split with the generic tiling, also when the tuning asks for code
    units; INT8 / FP8 at head_size 32 (16 units) stay on decode_code_units."""
    c = make_case(mode, dtype, q_lens=[1, 1], k_lens=[70, 33], head_size=32, seed=5)
    want = SPLIT if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else UNITS
    assert _plan_of(c).path == want
    run_and_check(c)
    plan = _plan_of(c, tuning=forced(UNITS, 16, 32, 4, 1, 2))
    assert plan.path == want and plan.tiling.tile == (128 if want == SPLIT else 32)
    run_and_check(c, tuning=forced(UNITS, 16, 32, 4, 1, 2))


def test_decode_config_keeps_its_tiling_with_a_given_segment_count():
    """A caller-fixed segment count (num_par_softmax_segments or segment buffers) changes only the
    split, not the measured tiling: decode_block_tiles for INT8 / FP8 at head_size 64 / 128 / 256
    and INT4 at 64, decode_code_units elsewhere (INT4 with 2 x 4,096 keys stays below the block
    tiles' threshold at 128 and 256)."""
    from kernels.attention import decode_block_tiles, decode_code_units
    for head_size in (64, 128, 256):
        for mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD):
            blocks = decode_block_tiles.tiling(mode, head_size) \
                if head_size == 64 or mode != KVQuantMode.INT4_PER_TOKEN_HEAD else None
            for given in (None, 8):
                plan = plan_for(mode, 2, 4096, CPU, head_size, 8, 2, num_par_softmax_segments=given)
                t = plan.tiling
                got = (t.tile, t.num_warps, t.num_stages, plan.path, t.heads_per_program)
                want = (*blocks[:3], BLOCKS, blocks[4]) if blocks else \
                    (*decode_code_units.tiling(mode, head_size)[:3], UNITS, 0)
                assert got == want, (mode, head_size, given)
            assert plan_for(mode, 2, 4096, CPU, head_size, 8, 2, num_par_softmax_segments=8).tiling.num_segments == 8


def test_block_tiles_default_and_segments():
    """decode_block_tiles is the default at the measured head sizes (64, 128, 256); INT4 from 8,192 keys in the
    batch on at 64 and 32,768 at 128 / 256. Its segments aim at the programs per SM, are a power
    of two, at least 2, at most one per tile, and past 16,384 / head_size of 8 tiles at least."""
    from kernels.attention.decode_block_tiles import segments as bt_segments
    from kernels.attention.decode_block_tiles import tiling as bt_tiling
    from kernels.attention.decode_block_tiles import wants as bt_wants
    int4, int8, fp8 = KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD
    for hs in (64, 128, 256):
        assert bt_wants(int8, hs, 1, 16) and bt_wants(fp8, hs, 1, 16)
    assert not bt_wants(int8, 32, 8, 32768) and not bt_wants(fp8, 512, 8, 32768)
    assert bt_tiling(int8, 96) is None and bt_tiling(KVQuantMode.NONE, 128) is None
    assert not bt_wants(int4, 128, 1, 4096) and not bt_wants(int4, 128, 2, 8192)
    assert not bt_wants(int4, 256, 2, 8192) and bt_wants(int4, 256, 8, 4096)
    assert bt_wants(int4, 64, 2, 4096) and not bt_wants(int4, 64, 1, 4096)
    assert bt_wants(int4, 128, 1, 32768) and bt_wants(int4, 128, 8, 4096)
    assert not bt_wants(KVQuantMode.NONE, 128, 8, 32768)
    assert bt_segments(132, 64, 32768, 16, 8) == 16     # b8 x 8 heads: 8 x 132 / 64 = 16.5
    assert bt_segments(132, 256, 32768, 16, 8) == 4     # b32: 4.1 -> 4 (no keys-per-segment cap)
    assert bt_segments(132, 8, 2048, 16, 8) == 128      # at most one per tile
    assert bt_segments(132, 4096, 100, 16, 8) == 2      # at least 2
    # past the reduction's one load (segments x head_size <= 16K), segments of 8 tiles at least
    assert bt_segments(132, 8, 4096, 16, 8, 128) == 128 and bt_segments(132, 8, 4096, 16, 8, 256) == 64
    assert bt_segments(132, 8, 32768, 16, 8, 256) == 128 and bt_segments(132, 8, 2048, 16, 8, 512) == 32


def test_bf16_decode_segments_fill_whole_waves():
    """The 2D kernel's split decode over a 16-bit cache on sm_90 (H200 facts: 3 resident programs
    per SM at head_size 128, 396 slots): segments fill the fewest whole waves to at least 90%,
    capped at 4 key tiles per segment, less the trailing ones left empty by ``ceil(tiles /
    segments)`` tiles each (b1@32k: 49 asked, 47 hold tiles); other head sizes, other GPUs and
    the CPU keep 16 programs per SM (a power of two). Short contexts take segments down to one
    tile while the grid holds at most 2 programs per SM (4 at head_size 64): b1@512 8 segments
    where 4 tiles each would make 2."""
    from kernels._jit import busy_segments
    from kernels.attention.plan import MIN_WAVE_FILL, whole_wave_segments
    bf16 = KVQuantMode.NONE
    for batch, ctx, segs in ((1, 32768, 47), (2, 32768, 24), (4, 32768, 12), (8, 32768, 6), (16, 32768, 3),
                             (32, 32768, 3), (12, 16384, 4), (1, 4096, 32), (4, 4096, 11), (8, 4096, 6),
                             (8, 1024, 4), (1, 8192, 32), (2, 8192, 22), (1, 512, 8), (1, 2048, 32), (2, 2048, 16),
                             (4, 1024, 8), (8, 512, 4), (32, 1024, 3)):
        plan = plan_for(bf16, batch, ctx, H200)
        assert (plan.path, plan.tiling.num_segments) == (P2D, segs), (batch, ctx, plan)
        tiles = -(-ctx // plan.tiling.tile)
        assert (segs - 1) * -(-tiles // segs) < tiles, (batch, ctx)   # the last segment holds a tile
    assert (busy_segments(49, 512), busy_segments(12, 64), busy_segments(6, 512), busy_segments(5, 3)) == (47, 11, 6, 3)
    for pairs in range(1, 5000):  # (sequences x KV heads): 90% of the slots up to b32 x 8 heads, 80% beyond
        segs = whole_wave_segments(pairs, 396)
        waves = -(-pairs * segs // 396)
        assert segs >= 1 and pairs * segs / (waves * 396) >= (MIN_WAVE_FILL if pairs <= 256 else 0.8), pairs
    assert plan_for(bf16, 8, 32768, H200, head_size=64).tiling.num_segments == 32   # 16 * 132 // 64 = 33 -> 32
    for batch, ctx, segs in ((1, 512, 8), (2, 4096, 32), (4, 2048, 16), (8, 1024, 8), (1, 8192, 64)):
        assert plan_for(bf16, batch, ctx, H200, head_size=64).tiling.num_segments == segs   # <= 4 x 132 programs
    for batch, ctx, segs in ((1, 2048, 32), (2, 2048, 16), (8, 512, 4), (1, 32768, 128)):
        assert plan_for(bf16, batch, ctx, H200, head_size=256).tiling.num_segments == segs  # <= 2 x 132 programs
    assert plan_for(bf16, 1, 32768, CPU).tiling.num_segments == 8                  # 16 * 4 // 8
    ampere = dataclasses.replace(H200, capability=(8, 0))                         # slots not counted there
    assert plan_for(bf16, 8, 32768, ampere).tiling.num_segments == 32


def test_bf16_decode_segment_counts_that_are_not_powers_of_two():
    """The 2D kernel's 16-bit split decode with segment counts like whole_wave_segments' (3, 7):
    ``ceil(tiles / segments)`` tiles each, so the last segments of a short sequence are empty."""
    c = make_case(KVQuantMode.NONE, torch.bfloat16, q_lens=[1, 1], k_lens=[700, 300], seed=11)  # 11 and 5 tiles
    for segs in (3, 7):
        run_and_check(c, tuning=forced(P2D, 16, 64, segs, 4, 3))
        run_and_check(c, tuning=forced(P2D, 16, 64, segs, 4, 3), window=(200, -1))


def test_gluon_decode_segments():
    """Staged decode segments: programs of 32 blocks or more down to one per SM, at most 2 per SM,
    then the fewest segments with the same blocks per segment (the kernels give each
    ``ceil(blocks / segments)``); at least 2, and fewer programs than SMs before segments of fewer
    than 4 blocks (b1@4k: 64). Not a power of two where the SMs divide otherwise."""
    from kernels.attention.decode_staged import segments as v6_segments
    for seqs, ctx, segs in ((8, 32768, 33), (8, 16384, 32), (12, 16384, 22), (24, 8192, 11), (4, 32768, 64),
                            (32, 32768, 8), (16, 16384, 16), (1, 100, 2), (1, 16, 2), (500, 32768, 2),
                            (1, 4096, 64), (1, 2048, 32), (2, 2048, 32), (4, 1024, 16), (1, 8192, 128),
                            (1, 65536, 128), (2, 32768, 64), (4, 16384, 32), (8, 8192, 16), (16, 4096, 8),
                            (1, 131072, 256), (1, 1 << 20, 264)):
        assert v6_segments(132, seqs, ctx) == segs, (seqs, ctx)
        blocks = -(-ctx // 16)
        per = -(-blocks // segs)
        assert segs == 2 or (segs - 1) * per < blocks  # no empty segment
    plan = plan_for(KVQuantMode.INT4_PER_TOKEN_HEAD, 12, 16384, H200)
    assert (plan.path, plan.tiling.num_segments) == (STAGED4, 22)


def test_reduction_dim_split_and_unrotated_segments_in_the_plan():
    """On the H200 the Gluon reduction spreads each row's dims over up to 4 programs where tokens x
    query heads leave SMs idle and it does not rotate; the staged INT4 kernel unrotates its split
    output (so the reduction need not rotate) from 128 segments: batch 1 from 8k keys, not b1@4k or
    b2@32k (64 segments) nor b8@32k (256 rows fill the SMs); other INT4 kernels leave the rotation to a
    one-program-per-row reduction. The interpreter's Triton reduction never splits."""
    int4 = KVQuantMode.INT4_PER_TOKEN_HEAD
    for b, ctx, want in ((1, 32768, (STAGED4, True, 4)), (1, 8192, (STAGED4, True, 4)),
                         (2, 32768, (STAGED4, False, 1)), (8, 32768, (STAGED4, False, 1)),
                         (1, 4096, (STAGED4, False, 1)), (1, 2048, (STAGED4, False, 1)), (1, 128, (UNITS, False, 1))):
        p = plan_for(int4, b, ctx, H200)
        assert (p.path, p.unrotated, p.reduce_split) == want, (b, ctx, p)
        assert p.unrotated == ("unrotated in the kernel" in p.why)
    for mode, b, ctx, split in ((KVQuantMode.NONE, 1, 4096, 4), (KVQuantMode.NONE, 2, 32768, 4),
                                (KVQuantMode.NONE, 4, 32768, 2), (KVQuantMode.NONE, 8, 32768, 1),
                                (KVQuantMode.INT8_PER_TOKEN_HEAD, 1, 65536, 4)):
        p = plan_for(mode, b, ctx, H200)
        assert (p.reduce, p.reduce_split, p.unrotated) == (Reduce.GLUON, split, False), (mode, b, ctx, p)
    p = plan_for(int4, 1, 32768, CPU)
    assert (p.reduce, p.reduce_split, p.unrotated) == (Reduce.TRITON, 1, False)


def test_code_units_tiling_per_head_size_and_segments():
    """Measured head sizes get their own tiling; others take the nearest measured one (in log2,
    the smaller on a tie). Segments aim at the tiling's programs per SM, are a power of two, at
    least 2, at most one per tile, and hold at most 2,048 keys."""
    from kernels.attention.decode_code_units import TILING as V3_TILING
    from kernels.attention.decode_code_units import segments as v3_segments
    from kernels.attention.decode_code_units import tiling as v3_tiling
    int4, int8 = KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD
    assert v3_tiling(int4, 64) == (32, 1, 2, 16) and v3_tiling(int4, 256) == (64, 4, 2, 4)
    assert v3_tiling(int4, 512) == V3_TILING[int4][256] and v3_tiling(int4, 32) == V3_TILING[int4][64]
    assert v3_tiling(int8, 64) == V3_TILING[int8][128] and v3_tiling(int8, 256) == (32, 2, 2, 16)
    assert v3_tiling(int8, 181) == V3_TILING[int8][128]  # log2 181 is nearer 128 than 256
    assert v3_segments(132, 64, 32768, 32, 16) == 32     # 16 x 132 / 64 = 33 -> 32
    assert v3_segments(132, 64, 32768, 64, 4) == 16      # 8 programs' worth, but 2,048 keys at most
    assert v3_segments(132, 8, 2048, 64, 8) == 32        # one tile per segment at most
    assert v3_segments(132, 4096, 100, 64, 8) == 2       # at least 2
    # half: INT4 above ROTATE_Q_MAX_HEAD aims at half the slots (the prologue rotation's condition)
    assert v3_segments(132, 8, 4096, 64, 4) == 64 and v3_segments(132, 8, 4096, 64, 4, half=True) == 32
    assert v3_segments(132, 16, 2048, 64, 4, half=True) == 16   # 264 / 16 = 16.5 -> 16
    # head_size 128 (asked for: the staged INT4 kernel takes these batches from 256 keys): about 512
    # programs (4 per SM), at most one tile per segment
    for b, ctx, segs in ((1, 2048, 32), (2, 1024, 16), (4, 512, 8), (8, 256, 4)):
        assert plan_for(int4, b, ctx, H200).path == STAGED4
        plan = plan_for(int4, b, ctx, H200, tuning=Tuning(path=UNITS))
        assert (plan.path, plan.tiling.num_segments, plan.rotate) == (UNITS, segs, Rotate.PROLOGUE), (b, ctx, plan)
    assert plan_for(int4, 1, 128, H200).path == UNITS  # below 256 keys
    for b, ctx, segs in ((1, 4096, 32), (2, 4096, 16), (2, 2048, 16), (8, 2048, 4)):  # H200's 132 SMs
        plan = plan_for(int4, b, ctx, H200, head_size=256)
        assert (plan.path, plan.tiling.num_segments) == (UNITS, segs) and 2 * b * 8 * segs <= 4 * 132
        assert plan.rotate == Rotate.PROLOGUE  # the grid fills at most half the resident slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,dtype", MODES)
@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_pdl_back_to_back(mode, dtype, batch):
    """Programmatic dependent launch: a kernel may start before the previous one has finished, so
    a missing wait would read a stale rotated query or stale segment buffers. Six decode calls
    with fresh queries are queued with no sync in between, each writing its own output; every
    output must equal the same call made with PDL off, bit for bit (batch 1 also lets the INT4
    query kernel release the decode kernel early)."""
    from kernels.attention.plan import device_facts
    c = make_case(mode, dtype, q_lens=[1] * batch, k_lens=[700 + 300 * i for i in range(batch)],
                  num_q_heads=32, num_kv_heads=8, head_size=128, device="cuda", seed=5)
    assert _plan_of(c).pdl == (device_facts(c["q"].device).capability >= (9, 0))
    _queued_calls_match_without_pdl(c, seed=9)


def _queued_calls_match_without_pdl(c, seed, tuning=None):
    """Six decode calls on ``c``'s cache with fresh queries, queued with no sync in between, each
    writing its own output, with PDL on and then off: equal bit for bit, and the outputs differ
    from each other. Returns the queries and the outputs (PDL on)."""
    views = c["views"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qs = [torch.randn(c["q"].shape, device="cuda", generator=gen).to(c["q"].dtype) for _ in range(6)]

    def calls():
        outs = [torch.empty_like(q) for q in qs]
        for q, out in zip(qs, outs):
            unified_attention(q, views.key_cache, views.value_cache, out, c["cu"], c["seqused_k"], 1, c["max_k"],
                              128 ** -0.5, True, (-1, -1), c["block_table"], 0.0, None, None, None,
                              kv_quant_mode=c["mode"], k_scale_cache=views.k_scale_cache,
                              v_scale_cache=views.v_scale_cache, tuning=tuning)
        torch.cuda.synchronize()
        return outs
    tuning = tuning or Tuning()
    with_pdl = calls()
    tuning = dataclasses.replace(tuning, pdl=False)
    without = calls()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
    assert not torch.equal(with_pdl[0], with_pdl[1])  # the queries differ, so must the outputs
    return qs, with_pdl


@pytest.mark.skipif(not _gluon_available(), reason="needs a CUDA GPU (sm_80+) and Triton's Gluon")
@pytest.mark.parametrize("mode", [KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD])
def test_cuda_gluon_decode_pdl_back_to_back(mode):
    """As ``test_cuda_pdl_back_to_back`` for the staged decode kernels (INT4: its first block
    copies start before ``griddepcontrol.wait`` and the query rotation releases it early; INT8),
    forced at 32 segments: six calls queued with no sync equal the same calls with PDL
    off, bit for bit."""
    c = make_case(mode, torch.bfloat16, q_lens=[1] * 4, k_lens=[700 + 300 * i for i in range(4)], num_q_heads=32,
                  num_kv_heads=8, head_size=128, device="cuda", seed=6)
    cfg = forced(STAGED4 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else STAGED8, 16, 16, 32, 8,
                 4 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else 2)
    qs, with_pdl = _queued_calls_match_without_pdl(c, seed=10, tuning=cfg)
    c["q"] = qs[0]
    assert torch.equal(run_and_check(c, tuning=cfg), with_pdl[0])  # and the first matches the oracle


@pytest.mark.parametrize("mode,dtype", [MODES[0], MODES[4]])
def test_reduction_in_chunks(mode, dtype):
    """Past 16K values the split-KV reduction merges segments 4096 // head_size at a time: head_size
    256 with 80 segments takes five chunks of 16 segments, the last partly masked (80 of 128 padded
    rows), then (INT4) the inverse rotation as a 16 x 16 Kronecker split (5,120 keys: exactly one
    64-key tile per segment); 3 segments take the single-load path."""
    c = make_case(mode, dtype, q_lens=[1, 1], k_lens=[5120, 250], num_q_heads=4, num_kv_heads=2, head_size=256,
                  seed=13)
    run_and_check(c, num_par_softmax_segments=80)
    run_and_check(c, num_par_softmax_segments=3)


def test_decode_kernel_choice_is_checked():
    """``Tuning.path`` names a path (a ``Path`` or its string): anything else is refused when the
    Tuning is made, before a launch."""
    assert Tuning(path="decode_block_tiles").path == BLOCKS
    for bad in ("v4", "decode", 4):
        with pytest.raises(ValueError, match="Tuning.path: expected one of"):
            Tuning(path=bad)


def test_pdl_switch_and_cpu_launch(launched):
    """Programmatic dependent launch is a CUDA launch attribute and PTX: never planned for CPU
    tensors (the interpreter cannot run ``griddepcontrol``) or before sm_90, and
    ``Tuning(pdl=False)`` turns it off. A CPU decode launched through the same code path still
    matches the oracle."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, q_lens=[1, 1], k_lens=[90, 40], seed=2)
    assert not _plan_of(c).pdl
    assert plan_for(KVQuantMode.INT8_PER_TOKEN_HEAD, 8, 4096, H200).pdl
    assert not plan_for(KVQuantMode.INT8_PER_TOKEN_HEAD, 8, 4096, H200, tuning=Tuning(pdl=False)).pdl
    assert not plan_for(KVQuantMode.INT8_PER_TOKEN_HEAD, 8, 4096, DeviceFacts("cuda", 108, (8, 0), True)).pdl
    plan = _plan_of(c, num_par_softmax_segments=3)
    run_and_check(c, num_par_softmax_segments=3)  # rotation, decode and reduction kernels, all given launch_pdl
    assert launched == expected_launches(plan, c["mode"]) and len(launched) == 2  # prologue rotation, reduction


def test_gluon_probe_verdict_is_cached_and_warns_once(monkeypatch):
    """``gluon_probe.compiles``: a compile failure (another Gluon API) is one RuntimeWarning naming
    the kernel and a cached False for that shape class (no second attempt, no second warning);
    a kernel that compiles is a cached True; a CUDA error is not mistaken for a compile failure."""
    from triton.compiler.errors import CompilationError

    from kernels.attention import gluon_probe
    monkeypatch.setattr(gluon_probe, "_VERDICTS", {})
    calls = []

    def broken():
        calls.append(1)
        raise CompilationError(None, None, "gluon.foo is not defined")
    with pytest.warns(RuntimeWarning, match=r"_k did not compile.*Triton kernel runs instead"):
        assert not gluon_probe.compiles("_k", 0, (8, 4), broken, "the Triton kernel runs instead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gluon_probe.compiles("_k", 0, (8, 4), broken, "the Triton kernel runs instead")
        assert not gluon_probe.compiles("_k", 0, (4, 4), broken, "...")  # another class: probed, no warning
    assert calls == [1, 1] and gluon_probe.verdicts()[("_k", 0, (8, 4))].startswith("CompilationError")
    assert gluon_probe.compiles("_ok", 0, (), lambda: calls.append(2), "")
    assert gluon_probe.compiles("_ok", 0, (), lambda: calls.append(2), "") and calls == [1, 1, 2]

    def cuda_error():
        raise RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered")
    with pytest.raises(RuntimeError, match="illegal instruction"):
        gluon_probe.compiles("_cuda", 0, (), cuda_error, "")
    assert ("_cuda", 0, ()) not in gluon_probe.verdicts()
    with pytest.raises(gluon_probe.GluonUnavailable):
        gluon_probe.require("no_such_module", "_kernel")


@pytest.mark.parametrize("mode", [KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD])
def test_plan_takes_the_triton_kernels_where_gluon_does_not_compile(mode, monkeypatch):
    """On a real device (facts with an index) the plan asks each Gluon kernel's probe once per
    shape class before it picks it: where the staged kernel, the rotation or the reduction does
    not compile, the plan names the Triton kernel instead (decode_block_tiles with its own
    segments, the Triton rotation and reduction), and says why; nothing is decided at launch."""
    from kernels.attention import decode_staged, reduce, rotate_query
    asked = []
    monkeypatch.setattr(decode_staged, "probe", lambda path, *a, **kw: asked.append(path) or False)
    monkeypatch.setattr(rotate_query, "probe", lambda *a: asked.append("rotate") or False)
    monkeypatch.setattr(reduce, "probe", lambda *a: asked.append("reduce") or False)
    real = DeviceFacts("cuda", 132, (9, 0), gluon=True, index=0)
    big = 4096                                          # staged for either mode; block tiles below them
    plan = plan_for(mode, 8, big, real)
    assert plan.path == BLOCKS and plan.reduce == Reduce.TRITON
    no_gluon = dataclasses.replace(H200, gluon=False)
    assert plan.tiling.num_segments == plan_for(mode, 8, big, no_gluon).tiling.num_segments
    staged = "decode_staged_int4" if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else "decode_staged_int8"
    assert asked[0] == staged and "reduce" in asked
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        assert plan.rotate == Rotate.TRITON and "rotate" in asked
    forced_plan = plan_for(mode, 8, big, real, tuning=forced(staged, 16, 16, 8, 8, 2))
    assert forced_plan.path == BLOCKS and "does not compile" in forced_plan.why
    monkeypatch.setattr(decode_staged, "probe", lambda *a, **kw: True)
    monkeypatch.setattr(reduce, "probe", lambda *a: True)
    assert plan_for(mode, 8, big, real).path == staged
    assert plan_for(mode, 8, big, real).reduce == Reduce.GLUON
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # the kernel rotates its query where that variant compiles
        assert plan_for(mode, 8, big, real).rotate == Rotate.PROLOGUE
        monkeypatch.setattr(decode_staged, "probe", lambda *a, rotate_q=False: not rotate_q)
        plan = plan_for(mode, 8, big, real)
        assert (plan.path, plan.rotate) == (staged, Rotate.TRITON)  # the Gluon rotation's probe says no


def test_staged_int4_reads_only_the_packed_int4_layout():
    """``decode_staged.reads_layout`` (device independent) accepts the views ``split_kv_cache``
    makes of a packed INT4 cache at head_size 128, block 16, 1-8 KV heads, GQA up to 8, and
    refuses separate tensors, a misaligned cache, block size 32, 16 KV heads and GQA 16."""
    from kernels.attention import decode_staged

    def reads_layout(q, k, v, ks, vs):
        return decode_staged.reads_layout(KVQuantMode.INT4_PER_TOKEN_HEAD, q, k, v, ks.view(torch.int32),
                                          vs.view(torch.int32))

    def views(num_kv_heads, block_size=16, offset=0):
        geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 128, num_kv_heads, block_size, torch.bfloat16)
        shape = geo.new_cache(3).shape
        flat = torch.zeros(math.prod(shape) + 64, dtype=torch.uint8)
        assert flat.data_ptr() % 16 == 0  # PyTorch's CPU allocator aligns to 64 bytes
        cache = flat[offset:offset + math.prod(shape)].view(shape)
        return split_kv_cache(cache, KVQuantMode.INT4_PER_TOKEN_HEAD, 128)

    def q(heads):
        return torch.zeros(1, heads, 128)

    for nkv, hq in ((1, 4), (2, 8), (4, 16), (8, 32), (8, 64), (8, 8)):
        assert reads_layout(q(hq), *views(nkv)), (nkv, hq)
    v = views(8)
    assert not reads_layout(q(32), *(t.clone() for t in v))  # four separate tensors
    assert not reads_layout(q(128), *v)                     # GQA 16
    assert not reads_layout(q(32), *views(8, offset=4))    # blocks not 16-byte aligned
    assert not reads_layout(q(32), *views(8, block_size=32))
    assert not reads_layout(q(64), *views(16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_query_rotation_in_parts(device, parts, dtype):
    """``rotate_query.rotated_query`` (INT4) against ``softmax_scale * H (s * q)`` by butterflies
    in float64, rotated dim ``parts * i + x`` at ``x * 128 / parts + i``; on CUDA the Gluon kernel
    (lane butterflies) rotates, on the CPU the Triton one (a dot with the Hadamard matrix)."""
    import types

    from kernels.attention.plan import Plan
    from kernels.attention.rotate_query import rotated_query
    from layouts import rht_signs
    g = torch.Generator().manual_seed(parts)
    q = (torch.randn(5, 6, 128, generator=g) * 3).to(dtype)
    q[1, 2, 7] = 300.0                                     # an outlier channel
    signs = rht_signs(128, device)
    call = types.SimpleNamespace(q=q.to(device), signs=signs, softmax_scale=0.125, head_size=128)
    kind = Rotate.GLUON if device == "cuda" and _gluon_available() else Rotate.TRITON
    qp, q_scale = rotated_query(call, Plan(BLOCKS, Tiling(16, 16, 2), rotate=kind, rotate_parts=parts))
    assert q_scale == 1.0
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:                                 # Sylvester's construction, exact
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    ref = (q.double() * rht_signs(128).double()) @ h * 0.125          # [T, H, 128], natural order
    want = ref.view(5, 6, 128 // parts, parts).transpose(-1, -2).reshape(5, 6, 128)
    assert torch.allclose(qp.double().cpu(), want, rtol=1e-5, atol=1e-4), (qp.double().cpu() - want).abs().max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("head_size,segments", [(16, 3), (32, 8), (64, 2), (128, 8), (128, 33), (128, 64), (128, 65),
                                               (128, 160), (128, 512), (256, 5)])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "int4-rotation"])
def test_reduction_merges_segments_and_inverse_rotates(device, head_size, segments, rotate):
    """``reduce.reduce_segments`` against a float64 merge of the segments (weights ``exp2(max_s - max)``,
    an empty segment with max ``-inf``, a row with no visible key -> 0) and, for INT4, the inverse
    rotation ``s * H acc / d`` by butterflies (``reference.fwht``): the Triton kernel's Kronecker
    split of the Hadamard matrix (``HI x LO``) at head sizes 16-256, one load and chunked segments
    (160, 512); on CUDA at head_size 128, the Gluon kernel's lane butterflies, with each thread holding
    every segment's statistics (up to 64) or the warp's lanes sharing them (65-512)."""
    import types

    from kernels.attention.plan import Plan
    from kernels.attention.reduce import GLUON_MAX_SEGMENTS, reduce_segments
    from kernels.reference import fwht
    from layouts import rht_signs
    g = torch.Generator().manual_seed(head_size + segments)
    t, hq, pad = 3, 4, max(16, head_size)
    part = torch.randn(t, hq, segments, pad, generator=g)
    mx = torch.randn(t, hq, segments, generator=g) * 4
    sm = torch.rand(t, hq, segments, generator=g) + 0.5
    mx[0, 1, segments // 2] = float("-inf")  # an empty segment
    sm[0, 1, segments // 2] = 0.0
    mx[2, 3] = float("-inf")                 # no visible key in any segment
    sm[2, 3] = 0.0
    signs = rht_signs(head_size, device) if rotate else None
    out = torch.full((t, hq, head_size), float("nan"), device=device)
    call = types.SimpleNamespace(out=out, segm_output=part.to(device), segm_max=mx.to(device),
                                 segm_expsum=sm.to(device), signs=signs, head_size=head_size)
    gluon = device == "cuda" and _gluon_available() and head_size == 128 and segments <= GLUON_MAX_SEGMENTS
    m = mx.double().amax(-1, keepdim=True)
    w = torch.exp2(mx.double() - torch.where(m == float("-inf"), 0.0, m))
    total = (sm.double() * w).sum(-1, keepdim=True)
    merged = torch.where(total > 0, (part.double()[..., :head_size] * w[..., None]).sum(-2) / total, 0.0)
    ref = fwht(merged.float()).double() * rht_signs(head_size).double() / head_size if rotate else merged
    # the Gluon kernel without the rotation also splits each row's dims over 2 or 4 programs; with
    # INT4 signs and plan.unrotated (the staged kernel unrotated the segments) it must not rotate
    runs = [(1, False, ref)]
    if gluon:
        runs += [(2, False, ref), (4, False, ref)] if not rotate else [(4, True, merged)]
    for split, unrotated, want in runs:
        out.fill_(float("nan"))
        reduce_segments(call, Plan(BLOCKS, Tiling(16, 16, segments), reduce=Reduce.GLUON if gluon else Reduce.TRITON,
                                   reduce_split=split, unrotated=unrotated))
        assert torch.isfinite(out).all(), split
        diff = (out.double().cpu() - want).abs()
        assert torch.allclose(out.double().cpu(), want, atol=1e-5, rtol=1e-4), (split, diff.max().item())
        assert (out[2, 3] == 0).all()


def test_kernels_doc_attention_section_is_generated():
    """docs/KERNELS.md's "## Attention" section is exactly what ``python -m bench.kernels_table``
    prints from ``attention_plan`` (regenerate it after changing a rule); it names the staged
    INT4 kernel for b8 x 32768 on an H200 and decode_block_tiles for it on the CPU."""
    import pathlib

    from bench import kernels_table
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "KERNELS.md").read_text()
    start = doc.index("## Attention\n")
    end = doc.find("\n## ", start + 1)
    got = doc[start:] if end < 0 else doc[start:end + 1]
    want = kernels_table.section()
    assert got.rstrip("\n") == want.rstrip("\n")
    row = next(line for line in want.splitlines() if line.startswith("| int4 | 8 x 32768 |"))
    assert "`decode_staged_int4`" in row.split("|")[3] and "`decode_block_tiles`" in row.split("|")[4]


def test_gluon_probes_compile_a_tiny_input_without_launching(monkeypatch):
    """The staged kernels', rotation's and reduction's probes build a tiny input of the shape
    class and only compile (``warmup``; the staged ones also reserve their ring), with the
    constexprs a real launch of that class passes; a compile error is a cached False, a launch
    never happens. Run here with a stand-in Gluon kernel on the CPU."""
    import collections

    from triton.compiler.errors import CompilationError

    from kernels.attention import decode_staged, gluon_probe, reduce, rotate_query
    meta = collections.namedtuple("KernelMetadata", "num_ctas num_warps shared")
    warmups = []

    class Compiled:
        def __init__(self):
            self.metadata, self.module, self.packed_metadata = meta(1, 8, 1000), None, (8, 1, 1000)

    class Kernel:
        def __init__(self, name, broken=False):
            self.name, self.broken = name, broken

        def warmup(self, *args, grid, **kw):
            warmups.append((self.name, grid, kw))
            if self.broken:
                raise CompilationError(None, None, "gluon.foo is not defined")
            return Compiled()

        def __getitem__(self, grid):
            raise AssertionError("a probe launched a kernel")

    monkeypatch.setattr(gluon_probe, "_VERDICTS", {})
    monkeypatch.setattr(decode_staged, "_RING_OFFSETS", {})
    monkeypatch.setattr(gluon_probe, "require", lambda module, name: Kernel(name))
    cpu = torch.device("cpu")
    assert decode_staged.probe("decode_staged_int4", INT4, cpu, 8, 4, 4, True, True)
    name, grid, kw = warmups[-1]
    assert name == "_decode_staged_int4_kernel" and grid == (1, 2)
    assert (kw["NKV"], kw["GROUP"], kw["STAGES"], kw["BULK"], kw["PAIR"], kw["PDL"], kw["num_warps"]) == \
        (8, 4, 4, True, True, True, 8)
    assert decode_staged.probe("decode_staged_int8", FP8, cpu, 2, 8, 2, False, True)
    assert warmups[-1][2]["FP8"] and warmups[-1][2]["PDL"] and warmups[-1][2]["launch_pdl"]
    assert rotate_query.probe(cpu, 32, 4, True, True)
    assert warmups[-1][0] == "_rotate_query_gluon_kernel" and warmups[-1][2]["RELEASE"]
    assert reduce.probe(cpu, 32, 33, True, True)
    assert warmups[-1][0] == "_attn_reduce_gluon_kernel" and warmups[-1][2]["SEG_PAD"] == 64
    count = len(warmups)
    assert reduce.probe(cpu, 32, 5, True, True) and len(warmups) == count  # same class: the cached verdict
    monkeypatch.setattr(gluon_probe, "require", lambda module, name: Kernel(name, broken=True))
    with pytest.warns(RuntimeWarning, match="_attn_reduce_gluon_kernel did not compile"):
        assert not reduce.probe(cpu, 32, 5, False, True)
