"""The 2D attention path (prefill chunks, mixed batches): its tilings and variants against the
oracle, and the prefill benchmark's CPU-side logic.

Covers: the planner's 2D defaults (``mask_edges_only`` always; ``dequant_first`` over a
quantized cache from ``plan.DEQUANT_MIN_Q_TILES`` query tiles per sequence, within
``Tuning.dequant_max_bytes``, for chunks and the chunk half of a mixed batch) and the kernels
they launch; every cache mode through the 2D kernel under the tilings and variants the prefill
benchmark sweeps (``bench.attention_prefill.sweep_tunings``: ``Tiling.code_zp``, ``code_asm``,
``dequant_first``, ``mask_edges_only``, ``Tuning.rotate_q_once``) on chunks that start mid-block
after cached tokens, chunks with no cached token, decode rows and tiles every row sees; the
INT4 variants at other head sizes with softcap and windows; the edge-tile bounds
(``common.full_tiles``); the benchmark's byte and FLOP counts; a ``--smoke`` run of
``bench/attention_prefill.py``. ``code_asm`` is PTX: on the CPU the plain conversion runs, so
only the CUDA test checks it.

CPU tensors run through Triton's interpreter (small shapes); the CUDA test runs when a GPU is
present. Run: ``python -m pytest tests/test_prefill_2d.py -q``.

Tolerance: relative L2 <= 1e-2 against ``reference_unified_attention`` on the same cache; the
residual is rounding only (bf16 output, 16-bit dot operands, INT4's rotated query in 16 bits),
measured near 3e-3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.language as tl

from bench import attention_prefill as AP
from bench import kernels_table
from kernels._jit import dual_jit
from kernels.attention import CPU, H200, Path, Plan, Rotate, Tiling, Tuning, attention_plan
from kernels.attention.common import full_tiles
from kernels.attention.plan import BIG_PREFILL, BIG_PREFILL_SM90, DEQUANT_MIN_Q_TILES, big_prefill_tiling
from layouts import KVQuantMode
from test_attention_kernels import (dequant_launches, expected_launches, launched, make_case,  # noqa: F401 (fixture)
                                    run_and_check)

MODES = [
    pytest.param(KVQuantMode.NONE, id="bf16"),
    pytest.param(KVQuantMode.INT8_PER_TOKEN_HEAD, id="int8"),
    pytest.param(KVQuantMode.FP8_PER_TOKEN_HEAD, id="fp8"),
    pytest.param(KVQuantMode.INT4_PER_TOKEN_HEAD, id="int4"),
]
# One batch of every shape the 2D path meets: a chunk after 0 cached tokens, chunks after cached
# tokens that end mid-block (block 16), decode rows, an empty sequence, and a chunk over key tiles
# that every row sees before the causal edge.
Q_LENS = [24, 21, 1, 1, 19, 0, 21]
K_LENS = [24, 21 + 37, 70, 33, 19 + 45, 5, 21 + 150]


def _tunings(mode=KVQuantMode.INT4_PER_TOKEN_HEAD):
    """Every tuning the benchmark sweeps for ``mode``, planned for a 64-row query tile (GQA group 4)."""
    c = make_case(KVQuantMode.NONE, torch.bfloat16, [24], [24], num_q_heads=8, num_kv_heads=2)
    plan = attention_plan(c["q"], c["views"].key_cache, c["views"].value_cache, torch.empty_like(c["q"]), c["cu"],
                          c["seqused_k"], c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0)
    return AP.sweep_tunings(plan, mode)


def _tested(mode) -> list:
    """The swept tunings the oracle tests run: every variant under the first and the last
    :data:`~bench.attention_prefill.SWEEP_TILINGS` entry, the other tilings plain (a variant's
    code does not depend on the tiling beyond block_m and tile, which those two cover)."""
    first, last = AP.SWEEP_TILINGS[0], AP.SWEEP_TILINGS[-1]
    return [t for t in _tunings(mode) if t == Tuning() or t == Tuning(path=Path.PREFILL_2D, tiling=t.tiling)
            or (t.tiling.block_m, t.tiling.tile, t.tiling.num_warps, t.tiling.num_stages) in (first, last)]


def _tuning_id(t: Tuning) -> str:
    if t == Tuning():
        return "default"
    on = [name for name, field in AP.VARIANT_FIELDS.items()
          if getattr(t if field == "rotate_q_once" else t.tiling, field)]
    return "m{0.block_m}-t{0.tile}-w{0.num_warps}-s{0.num_stages}".format(t.tiling) + "".join(f"-{v}" for v in on)


@pytest.mark.parametrize("mode,tuning", [pytest.param(m.values[0], t, id=f"{m.id}-{_tuning_id(t)}")
                                         for m in MODES for t in _tested(m.values[0])])
def test_2d_tunings_match_oracle(mode, tuning):
    """The benchmark's tunings for the mode (:func:`_tested`) against the oracle on one batch of
    every shape (:data:`Q_LENS`, :data:`K_LENS`)."""
    c = make_case(mode, torch.bfloat16, Q_LENS, K_LENS, num_q_heads=8, num_kv_heads=2, head_size=64)
    run_and_check(c, tuning=tuning)


@pytest.mark.parametrize("head_size", [32, 128])
@pytest.mark.parametrize("tuning", [t for t in _tunings() if t.tiling is not None and (
    t.tiling.block_m, t.tiling.tile, t.tiling.num_warps, t.tiling.num_stages) == AP.SWEEP_TILINGS[0]], ids=_tuning_id)
def test_2d_int4_variants_other_head_sizes(head_size, tuning):
    """The INT4 variants at other head sizes, GQA group 1, softcap and a sliding window."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, [1, 19, 6], [33, 19 + 21, 6],
                  num_q_heads=2, num_kv_heads=2, head_size=head_size)
    run_and_check(c, tuning=tuning)
    run_and_check(c, causal=False, window=(9, -1), softcap=20.0, tuning=tuning)


@pytest.mark.parametrize("mode", [MODES[0], MODES[3]])
@pytest.mark.parametrize("causal,window", [(True, (70, -1)), (False, (100, 5)), (False, (-1, -1))],
                         ids=["causal-left", "both-sides", "full"])
def test_mask_edges_only_windows(mode, causal, window):
    """``Tiling.mask_edges_only`` under sliding windows and without causality: only tiles inside
    every row's window go unmasked (a chunk of 19 over 200 cached keys, tiles of 32)."""
    c = make_case(mode, torch.bfloat16, [19, 1], [19 + 200, 90], num_q_heads=4, num_kv_heads=2, head_size=64)
    for tile in (32, 64):
        run_and_check(c, causal=causal, window=window,
                      tuning=Tuning(path=Path.PREFILL_2D, tiling=Tiling(64, tile, mask_edges_only=True)))


@pytest.mark.parametrize("mode", [MODES[0], MODES[1]])
@pytest.mark.parametrize("offs_i64", [False, True], ids=["offs-i32", "offs-i64"])
def test_2d_block_sizes_strides_and_offset_widths(mode, offs_i64, monkeypatch):
    """The 2D kernel's K/V addressing: blocks of 32 keys under tiles of 16 (a tile inside a block),
    32 and 64 (whole blocks: the slot offsets are computed once), a value cache whose strides
    differ from the key cache's (a view of every other 64-dim half, the other half NaN / 0x7F
    codes), and the int32 and int64 offset arithmetic (``OFFS_I64``, forced here)."""
    from kernels.attention import prefill_2d
    monkeypatch.setattr(prefill_2d, "OFFS_I32_MAX", -1 if offs_i64 else 2 ** 31 - 1)
    c = make_case(mode, torch.bfloat16, [19, 1, 40], [19 + 45, 70, 40], num_q_heads=4, num_kv_heads=2,
                  head_size=64, block_size=32, seed=7)
    views = c["views"]
    v = views.value_cache
    poison = torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, 127)
    wide = torch.stack([poison, v], dim=3).view(*v.shape[:3], 2 * v.shape[3])[..., v.shape[3]:]
    assert wide.stride() != views.key_cache.stride() and torch.equal(wide.float().nan_to_num(), v.float().nan_to_num())
    c["views"] = type(views)(views.key_cache, wide, views.k_scale_cache, views.v_scale_cache)
    for tile in (16, 32, 64):
        for edges in (False, True):
            run_and_check(c, tuning=Tuning(path=Path.PREFILL_2D, tiling=Tiling(64, tile, mask_edges_only=edges)))
    run_and_check(c, causal=False, window=(20, 3), softcap=10.0,
                  tuning=Tuning(path=Path.PREFILL_2D, tiling=Tiling(64, 32, mask_edges_only=True)))


def test_register_caps_only_where_they_fit():
    """``prefill_2d.reg_cap``: the 128 x 32, 8-warp tiling compiles under 128 registers (two
    programs per SM) only over 16-bit caches of head size <= 128; scaled caches and wider heads
    (more live registers: they would spill) and other tilings compile uncapped."""
    from kernels.attention.prefill_2d import REG_CAPS, reg_cap
    tiling = Tiling(128, 32, num_warps=8)
    assert reg_cap(tiling, KVQuantMode.NONE, 128) == REG_CAPS[(128, 32, 8)] == 128
    assert reg_cap(tiling, KVQuantMode.NONE, 64) == 128
    assert reg_cap(tiling, KVQuantMode.NONE, 256) is None
    assert reg_cap(tiling, KVQuantMode.INT8_PER_TOKEN_HEAD, 128) is None
    assert reg_cap(Tiling(128, 64, num_warps=8), KVQuantMode.NONE, 128) is None
    assert reg_cap(Tiling(128, 32, num_warps=4), KVQuantMode.NONE, 128) is None


@dual_jit
def _full_tiles_probe(out_ptr, k_lo, k_hi, t0, t1, wl, wr, CAUSAL: tl.constexpr):
    """Writes ``full_tiles`` for 16 rows at positions 137..152 and tiles of 64 keys."""
    offs = tl.arange(0, 16)
    f0, f1 = full_tiles(137 + offs, offs < 16, k_lo, k_hi, t0, t1, wl, wr, CAUSAL, 64)
    tl.store(out_ptr, f0)
    tl.store(out_ptr + 1, f1)


def test_full_tiles_bounds():
    """``common.full_tiles``: rows at positions 137..152 all see keys 0..137 (causal), so of the
    64-key tiles [0, 3) tiles 0 and 1 need no mask; a start tile, a left window and a short
    context shrink the range."""
    out = torch.zeros(2, dtype=torch.int32)
    for args, want in [((0, 153, 0, 3, -1, -1, True), [0, 2]), ((0, 153, 0, 3, -1, -1, False), [0, 2]),
                       ((0, 153, 1, 3, -1, -1, True), [1, 2]), ((80, 153, 1, 3, 60, -1, True), [2, 2]),
                       ((0, 153, 0, 3, 100, -1, True), [1, 2]), ((0, 20, 0, 1, -1, -1, True), [0, 0])]:
        _full_tiles_probe[(1,)](out, *args[:6], CAUSAL=args[6])
        assert out.tolist() == want, (args, out.tolist())


@pytest.mark.parametrize("tuning", [Tuning(), Tuning(path=Path.PREFILL_2D, tiling=Tiling(64, 32, code_zp=True))],
                         ids=["default", "code-zp"])
def test_2d_int4_head_256_rotates_in_chunks(tuning):
    """Above head_size 128 the in-kernel INT4 rotations run in chunks of 64 dims (whole-head fp32
    Hadamard operands would need more shared memory than an H200 has); same results."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, [9, 1], [9 + 30, 20], num_q_heads=2,
                  num_kv_heads=1, head_size=256)
    run_and_check(c, tuning=tuning)


def _scratch_case(mode, head_size, k_lens, **kw):
    """A case of 8 query / 8 KV heads over contexts ``k_lens`` (chunks of 3 and 1 tokens), its
    call and the oracle's dequantized K and V caches."""
    from kernels.attention.call import make_call
    from kernels.reference.attention import dequantize_cache

    c = make_case(mode, torch.bfloat16, [3, 1], k_lens, num_q_heads=8, num_kv_heads=8, head_size=head_size, **kw)
    v = c["views"]
    call = make_call(c["q"], v.key_cache, v.value_cache, torch.empty_like(c["q"]), c["cu"], c["seqused_k"],
                     c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0, mode, v.k_scale_cache,
                     v.v_scale_cache)
    refs = dequantize_cache(v.key_cache, v.value_cache, v.k_scale_cache, v.v_scale_cache, mode, head_size)
    return c, call, refs


def _assert_context_rows(d, c, k_lens, refs, undo=lambda r: r, rtol=1e-5, atol=1e-5, atol_of_max=0.0):
    """Every context row of every sequence of the dequantized call ``d``, K and V (through
    ``undo``, as fp32), equals the oracle's row in ``refs`` within ``rtol`` and ``atol`` (or
    ``atol_of_max`` times the largest magnitude of the sequence's rows compared)."""
    head_size = d.k.shape[-1]
    for i, n in enumerate(k_lens):
        for got, ref in zip((d.k, d.v), refs):
            rows = undo(got[d.block_table[i].long()].reshape(-1, 8, head_size)[:n].float())
            want = ref[c["block_table"][i].long()].reshape(-1, 8, head_size)[:n].float()
            tol = atol_of_max * want.abs().max().item() if atol_of_max else atol
            torch.testing.assert_close(rows, want, rtol=rtol, atol=tol)


def _used_rows(d, k_lens) -> torch.Tensor:
    """Mask ``[blocks, block_size]`` of the scratch slots holding context rows (sequence ``i``'s
    first ``k_lens[i]`` positions, ``d.block_table`` the identity)."""
    per_seq, bs = d.block_table.shape[1], d.k.shape[1]
    pos = torch.arange(per_seq * bs).view(per_seq, bs)
    return torch.cat([pos < n for n in k_lens])


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("head_size,packed", [(32, True), (64, True), (64, False), (256, True)],
                         ids=["h32", "h64", "h64-separate", "h256"])
def test_dequantized_call_holds_the_oracle_rows(mode, head_size, packed):
    """``prefill_dequant.dequantized_call``: every context row of every sequence, K and V, equals
    the oracle's dequantized row to fp32 rounding (INT4: its rows stay rotated, ``r / d_b``, and
    are rotated back here), through the identity table; contexts longer than one program's
    BLOCKS table entries and ending mid-block; 8 KV heads of 16 slots = 128 rows a block: several
    row tiles at head_size 256, one below; the packed cache and four separate tensors. INT4 also
    with ``unrotate``: rows written in the original domain, the caller's query and output kept."""
    from kernels.attention.prefill_dequant import _MODES, BLOCKS, UNROTATE, dequantized_call, rotation_split, tile_rows

    k_lens = [16 * max(BLOCKS, *(u.blocks for u in UNROTATE.values())) + 37, 5]
    c, call, refs = _scratch_case(mode, head_size, k_lens, packed=packed)
    assert (tile_rows(head_size, 16, 8, _MODES[mode]) < 128) == (head_size == 256)
    d = dequantized_call(call)
    assert d.mode == KVQuantMode.NONE and d.k.dtype == torch.float32  # fp32 under the interpreter
    int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    undo = lambda r: r  # noqa: E731
    if int4:  # rows r / d_b of the rotated domain: x = s * H(r / d_b) / d_a
        from kernels.reference.quant import single_rht
        d_a, _ = rotation_split(head_size)
        undo = lambda r: single_rht(r, inverse=True) / d_a  # noqa: E731
    _assert_context_rows(d, c, k_lens, refs, undo)  # default tolerances: fp32 sums in another order
    if int4:  # int8 keys: codes c - zp times their scales are the same rotated key rows, V unchanged
        e = dequantized_call(call, int8_keys=True)
        assert e.k.dtype == torch.int8 and e.ks.shape == (8, e.k.shape[0] * 16) and e.ks.dtype == torch.float32
        used = _used_rows(e, k_lens)
        codes = e.k[used]
        assert -15 <= codes.min().item() < 0 < codes.max().item() <= 15
        keys = codes.float() * e.ks.t().reshape(e.k.shape[:3])[used][..., None]
        torch.testing.assert_close(keys, d.k[used], rtol=0, atol=0)
        torch.testing.assert_close(e.v[used], d.v[used], rtol=0, atol=0)
        torch.testing.assert_close(e.q, d.q, rtol=0, atol=0)
        with pytest.raises(ValueError, match="int8 keys: INT4 rows kept rotated only"):
            dequantized_call(call, unrotate=True, int8_keys=True)
    else:
        with pytest.raises(ValueError, match=f"int8 keys: INT4 rows kept rotated only, not {mode.name}"):
            dequantized_call(call, int8_keys=True)
    if int4:  # unrotate: the pass writes x = s * H(r) / d itself
        assert (tile_rows(head_size, 16, 8, _MODES[mode], unrotate=True) < 128) == (head_size >= 128)
        u = dequantized_call(call, unrotate=True)
        assert u.q is call.q and u.out is call.out and u.k.dtype == torch.float32
        _assert_context_rows(u, c, k_lens, refs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
def test_cuda_unrotated_int4_rows_are_the_oracle_rows_in_fp16(head_size):
    """On the GPU, INT4 rows written unrotated (the pass's fp16 MMAs on exact code sums): every
    context row equals the oracle's dequantized row to fp16 rounding."""
    from kernels.attention.prefill_dequant import dequantized_call

    k_lens = [16 * 5 + 7, 33]
    c, call, refs = _scratch_case(KVQuantMode.INT4_PER_TOKEN_HEAD, head_size, k_lens, device="cuda")
    d = dequantized_call(call, unrotate=True)
    assert d.k.dtype == torch.float16 and d.q is call.q and d.out is call.out
    _assert_context_rows(d, c, k_lens, refs, rtol=1e-3, atol_of_max=1e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("facts", [H200, CPU], ids=["h200", "cpu"])
def test_default_2d_plan_masks_edges_and_dequantizes_long_chunks(mode, facts):
    """The planner's 2D tilings: edge tiles only masked in every mode, decode segments included;
    over a quantized cache the context is dequantized first from DEQUANT_MIN_Q_TILES query tiles
    per sequence (64-row tiles, GQA group 4: 16 tokens a tile), not below, not at a head size the
    pass does not serve, not above ``Tuning.dequant_max_bytes``; ``why`` says which."""
    quantized = mode != KVQuantMode.NONE
    tokens = DEQUANT_MIN_Q_TILES * 16
    long = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens)
    assert long.path == Path.PREFILL_2D and long.tiling.mask_edges_only and long.tiling.num_segments == 1
    assert long.tiling.dequant_first == quantized, long
    assert ("dequantized first" in long.why) == quantized, long.why
    int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    # 2 x 256 blocks x 16 slots x 8 KV heads, K and V, against 2 x 64 tokens x 32 query heads, q and out: 16
    kept = "INT4 rows kept rotated, the query and output rotated (16.00 context rows per query row > 2.0)"
    assert not long.tiling.unrotate and (kept in long.why) == int4, long.why
    fresh = kernels_table.plan(mode, 2, tokens, facts, q_len=tokens)  # nothing cached: 4 blocks a sequence
    assert fresh.tiling.dequant_first == quantized and fresh.tiling.unrotate == int4, fresh
    unrot = "INT4 rows unrotated by the pass (0.25 context rows per query row <= 2.0)"
    assert (unrot in fresh.why) == int4, fresh.why
    short = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens - 1)
    assert short.tiling.mask_edges_only and not short.tiling.dequant_first
    if quantized:
        assert "query tiles per sequence <" in short.why, short.why
        # 2 sequences x 256 blocks x 16 slots x 8 KV heads x 128 dims, K and V, fp16 (fp32 interpreted);
        # INT4 (kept rotated: 4096 keys each): the rotated query and output in the scratch's type
        size = 2 if facts is H200 else 4
        q_elems = 2 * tokens * 32 * 128
        extra = 2 * q_elems * size if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else 0
        need = 2 * 256 * 16 * 8 * 128 * 2 * size + extra
        fits = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(dequant_max_bytes=need))
        halves = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(dequant_max_bytes=need - 1))
        eighths = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(dequant_max_bytes=need // 8))
        capped = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(dequant_max_bytes=need // 8 - 1))
        assert fits.tiling.dequant_first and fits.tiling.dequant_groups == 1
        assert halves.tiling.dequant_first and halves.tiling.dequant_groups == 2, halves  # 8 KV heads: 2 x 4
        assert "2 groups of 4 KV heads" in halves.why, halves.why
        assert eighths.tiling.dequant_first and eighths.tiling.dequant_groups == 8, eighths
        assert not capped.tiling.dequant_first and capped.tiling.dequant_groups == 1
        assert "Tuning.dequant_max_bytes" in capped.why and capped.tiling.mask_edges_only, capped.why
        off = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(dequant_max_bytes=0))
        assert not off.tiling.dequant_first
    if mode in (KVQuantMode.NONE, KVQuantMode.INT8_PER_TOKEN_HEAD):
        odd = kernels_table.plan(mode, 2, 4096, facts, head_size=96, q_len=tokens)  # no pow2 row tiles
        assert odd.tiling.mask_edges_only and not odd.tiling.dequant_first
    decode = kernels_table.plan(mode, 2, 32768, facts)
    if decode.path == Path.PREFILL_2D:  # bf16 decode: the 2D kernel's segments mask edges only too
        assert decode.tiling.mask_edges_only and decode.tiling.num_segments > 1, decode
    mixed = kernels_table.mixed_plan(mode, 16, 8192, 512, 8192, facts)
    assert mixed.parts[1].tiling.mask_edges_only and mixed.parts[1].tiling.dequant_first == quantized
    # the chunk's rows only (not the 16 decode rows): 512 blocks x 16 x 8 x 2 / (512 x 32 x 2)
    assert ("(4.00 context rows per query row > 2.0)" in mixed.parts[1].why) == int4, mixed.parts[1].why
    assert mixed.tiling == mixed.parts[1].tiling
    given = Tiling(64, 64)
    asked = kernels_table.plan(mode, 2, 4096, facts, q_len=tokens, tuning=Tuning(tiling=given))
    assert asked.tiling == given  # a tiling the caller gives is used as given


SM80 = dataclasses.replace(H200, capability=(8, 0))


@pytest.mark.parametrize("mode", MODES)
def test_long_16_bit_chunks_take_the_big_tiling_on_a_gpu(mode):
    """Where the 2D kernel reads 16-bit rows on a GPU (a bf16 cache, or a context dequantized
    first) with at least block_m query rows per sequence: on sm_90 ``BIG_PREFILL_SM90`` by padded
    head size (64, 128, 256; head 32 and 96 keep ``BIG_PREFILL``), elsewhere ``BIG_PREFILL`` up
    to head_size 128; 64 x 64 below that row count, at head_size 256 off sm_90, for the fused
    quantized kernel, on the CPU. (The sm_90 Gluon kernel turned off, ``Tuning.wgmma_prefill``:
    where it applies it takes these chunks, see ``test_sm90_prefill_takes_the_wgmma_kernel_where_it_applies``.)"""
    triton_2d = Tuning(wgmma_prefill=False)
    tokens = DEQUANT_MIN_Q_TILES * 32  # dequantized first (see above): 512 query rows per sequence at group 4

    def tiling_of(p):
        return (p.tiling.block_m, p.tiling.tile, p.tiling.num_warps, p.tiling.num_stages)

    cases = [(H200, 64, (128, 64, 4, 5)), (H200, 128, BIG_PREFILL), (H200, 256, (128, 64, 8, 3)),
             (H200, 32, BIG_PREFILL), (SM80, 64, BIG_PREFILL), (SM80, 128, BIG_PREFILL)]
    if mode == KVQuantMode.NONE:  # quantized caches have no dequantizing pass at head_size 96
        cases.append((H200, 96, BIG_PREFILL))
    for facts, head, want in cases:
        assert big_prefill_tiling(head, facts) == want, (facts, head)
        long = kernels_table.plan(mode, 2, 4096, facts, head_size=head, q_len=tokens, tuning=triton_2d)
        assert tiling_of(long) == want and long.tiling.mask_edges_only, (facts, head, long)
        assert f"{want[0]} x {want[1]} tiles, {want[2]} warps, {want[3]} stages" in long.why, long.why
        few = kernels_table.plan(mode, 2, 4096, facts, head_size=head, q_len=want[0] // 4 - 1,  # group 4: < block_m rows
                                 tuning=triton_2d)
        assert (few.tiling.block_m, few.tiling.tile) == (64, 64), few
    assert big_prefill_tiling(256, SM80) is None and big_prefill_tiling(128, CPU) is None
    wide = kernels_table.plan(mode, 2, 4096, SM80, head_size=256, q_len=tokens)
    assert (wide.tiling.block_m, wide.tiling.tile) == (64, 64), wide
    cpu = kernels_table.plan(mode, 2, 4096, CPU, q_len=tokens)
    assert (cpu.tiling.block_m, cpu.tiling.tile) == (64, 64), cpu
    if mode != KVQuantMode.NONE:
        fused = kernels_table.plan(mode, 2, 4096, H200, q_len=tokens, tuning=Tuning(dequant_max_bytes=0))
        assert (fused.tiling.block_m, fused.tiling.tile) == (64, 64) and not fused.tiling.dequant_first, fused


@pytest.mark.parametrize("mode", [KVQuantMode.NONE, KVQuantMode.INT4_PER_TOKEN_HEAD])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_big_tiling_matches_oracle(mode, head_size):
    """The big tiling of each padded head size on sm_90 (edges-only masking; INT4 dequantized
    first) against the oracle on a causal chunk whose length is not a tile multiple, with a
    window and softcap too."""
    bm, tile, warps, stages = BIG_PREFILL_SM90[head_size]
    tiling = Tiling(bm, tile, num_warps=warps, num_stages=stages, mask_edges_only=True,
                    dequant_first=mode != KVQuantMode.NONE)
    c = make_case(mode, torch.bfloat16, [70, 45], [70 + 150, 45 + 9], num_q_heads=8, num_kv_heads=2,
                  head_size=head_size)
    run_and_check(c, tuning=Tuning(tiling=tiling))
    run_and_check(c, causal=False, window=(60, 5), softcap=8.0, tuning=Tuning(tiling=tiling))


@pytest.mark.parametrize("head_size", [32, 64, 256])
def test_rotate_rows_rotates_the_rows_in_range_only(head_size):
    """``prefill_dequant.rotate_rows``, INT4's query and output rotations around a dequantized 2D
    call: ``scale * H(s * x)`` and ``scale * s * H(x)`` against the reference's signed Hadamard
    (``single_rht``) on strided views, tokens ``first <= t < end`` only (a mixed call's decode rows
    and the rows past the last sequence keep what they held), and back again: the identity times
    ``d``."""
    from kernels.attention.prefill_dequant import rotate_rows, rotation_split
    from kernels.reference.quant import single_rht
    from layouts import rht_signs

    gen = torch.Generator().manual_seed(head_size)
    x = torch.randn(37, 3, 2 * head_size, generator=gen)[:, :, ::2]  # strided last dim
    signs = rht_signs(head_size)
    first, end = 4, torch.tensor([30], dtype=torch.int32)
    y = torch.full((37, 3, head_size), float("nan"))
    rotate_rows(x, signs, y, 0.5, True, first, end)
    torch.testing.assert_close(y[first:30], single_rht(x[first:30]) * 0.5, rtol=1e-6, atol=1e-5)
    assert y[:first].isnan().all() and y[30:].isnan().all()
    z = torch.full_like(y, float("nan"))
    rotate_rows(y, signs, z, 2.0 / head_size, False, first, end)
    torch.testing.assert_close(z[first:30], single_rht(y[first:30], inverse=True) * 2.0 / head_size)
    torch.testing.assert_close(z[first:30], x[first:30], rtol=1e-5, atol=1e-5)
    assert z[:first].isnan().all() and z[30:].isnan().all()
    d_a, d_b = rotation_split(head_size)
    assert d_a * d_b == head_size and d_a <= d_b <= 2 * d_a


@pytest.mark.parametrize("mode", MODES[1:])
def test_default_dequant_first_matches_oracle(mode, launched):
    """The default plan of a 64-token chunk over 37 cached keys (4 query tiles at GQA group 4)
    dequantizes first: the pass then the unquantized 2D kernel launch, and the output matches
    the oracle; with a window and softcap; and as the chunk half of a mixed batch."""
    c = make_case(mode, torch.bfloat16, [64], [64 + 37], num_q_heads=8, num_kv_heads=2, head_size=64)
    v = c["views"]
    args = (c["q"], v.key_cache, v.value_cache, c["q"], c["cu"], c["seqused_k"], c["max_q"], c["max_k"], 0.125,
            True, (-1, -1), c["block_table"], 0.0)
    kw = dict(kv_quant_mode=mode, k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache)
    plan = attention_plan(*args, **kw)
    assert plan.tiling.dequant_first and plan.tiling.mask_edges_only, plan
    int4 = mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    assert plan.tiling.unrotate == int4, plan  # 7 blocks x 16 x 2 KV heads, K and V: 448 <= 2 x 64 x 8 rows
    out = run_and_check(c)
    assert launched == expected_launches(plan, mode) == dequant_launches(mode, plan.tiling)
    if int4:  # the rows kept rotated: the query and output rotated around the same pass, same result
        launched.clear()
        rotated = Tuning(tiling=dataclasses.replace(plan.tiling, unrotate=False))
        torch.testing.assert_close(run_and_check(c, tuning=rotated), out, rtol=2e-3, atol=2e-3)
        assert launched == dequant_launches(mode) and len(launched) == 4
    run_and_check(c, causal=False, window=(40, 3), softcap=10.0)
    m = make_case(mode, torch.bfloat16, [1, 1, 64], [30, 90, 64 + 21], num_q_heads=8, num_kv_heads=2, head_size=64,
                  seed=1)
    launched.clear()
    run_and_check(m, num_decode_seqs=2)
    chunk = dequant_launches(mode, plan.tiling)
    assert launched[-len(chunk):] == chunk, launched


@pytest.mark.parametrize("mode", MODES[1:])
def test_dequant_first_in_head_groups_writes_what_one_group_writes(mode, launched):
    """A scratch above ``Tuning.dequant_max_bytes`` is made for groups of KV heads in turn: with
    the cap at half the scratch of a 2-KV-head call the plan takes 2 groups, launches the pass
    and the 2D kernel once per group, and writes exactly what the one-group run writes (each KV
    head's programs compute the same), which matches the oracle, as the chunk half of a mixed
    batch too; a tiling asking for more groups than KV heads runs one head each; with the cap
    below one head's scratch: the fused kernel."""
    from kernels.attention.call import make_call
    from kernels.attention.prefill_dequant import scratch_bytes, unrotates

    c = make_case(mode, torch.bfloat16, [64], [64 + 37], num_q_heads=8, num_kv_heads=2, head_size=64)
    v = c["views"]
    args = (c["q"], v.key_cache, v.value_cache, torch.empty_like(c["q"]), c["cu"], c["seqused_k"], c["max_q"],
            c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0)
    kw = dict(kv_quant_mode=mode, k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache)
    call = make_call(*args, mode, v.k_scale_cache, v.v_scale_cache)
    need = scratch_bytes(call, interpreted=True, unrotate=unrotates(call))
    whole, halves = Tuning(dequant_max_bytes=need), Tuning(dequant_max_bytes=need // 2)
    plan = attention_plan(*args, **kw, tuning=halves)
    assert plan.tiling.dequant_first and plan.tiling.dequant_groups == 2 and "2 groups of 1 KV heads" in plan.why
    one = run_and_check(c, tuning=whole)
    assert launched == expected_launches(attention_plan(*args, **kw, tuning=whole), mode) == \
        dequant_launches(mode, plan.tiling)
    launched.clear()
    two = run_and_check(c, tuning=halves)
    assert launched == expected_launches(plan, mode) == dequant_launches(mode, plan.tiling) * 2
    assert torch.equal(one, two)
    given = run_and_check(c, tuning=Tuning(tiling=dataclasses.replace(plan.tiling, dequant_groups=3)))
    assert torch.equal(one, given)  # more groups than KV heads: one head each
    fused = attention_plan(*args, **kw, tuning=Tuning(dequant_max_bytes=need // 2 - 1))
    assert not fused.tiling.dequant_first and "one KV head at a time" in fused.why, fused.why
    m = make_case(mode, torch.bfloat16, [1, 1, 64], [30, 90, 64 + 21], num_q_heads=8, num_kv_heads=2, head_size=64,
                  seed=1)
    launched.clear()
    run_and_check(m, num_decode_seqs=2, tuning=Tuning(dequant_max_bytes=need // 2))
    chunk = dequant_launches(mode, plan.tiling)
    assert launched[-2 * len(chunk):] == chunk * 2, launched


@pytest.mark.parametrize("mode", MODES[1:])
def test_scratch_bytes_is_what_dequantized_call_allocates(mode):
    """``prefill_dequant.scratch_bytes``, which the planner caps, counts the K and V scratch that
    ``dequantized_call`` allocates (fp32 under the interpreter; INT4: the rotated query and
    output, none with ``unrotate``)."""
    from kernels.attention.call import make_call
    from kernels.attention.prefill_dequant import dequantized_call, scratch_bytes

    c = make_case(mode, torch.bfloat16, [3, 1, 5], [70, 33, 5], num_q_heads=4, num_kv_heads=2, head_size=64)
    v = c["views"]
    call = make_call(c["q"], v.key_cache, v.value_cache, torch.empty_like(c["q"]), c["cu"], c["seqused_k"],
                     c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0, mode, v.k_scale_cache,
                     v.v_scale_cache)
    d = dequantized_call(call)
    kv = 2 * d.k.numel()
    assert d.k.shape == (3 * 5, 16, 2, 64)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # rotated query and output scratch, in the rows' type
        assert d.q is not call.q and d.out is not call.out and d.q.dtype == d.out.dtype == d.k.dtype
        assert scratch_bytes(call, interpreted=True) == (kv + d.q.numel() + d.out.numel()) * d.k.element_size()
        assert scratch_bytes(call) == (kv + 2 * c["q"].numel()) * 2
        e = dequantized_call(call, int8_keys=True)  # int8 keys: a byte a dim and an fp32 scale a row
        assert scratch_bytes(call, int8_keys=True) == e.k.numel() + 4 * e.ks.numel() + (kv // 2 + 2 * c["q"].numel()) * 2
        u = dequantized_call(call, unrotate=True)  # rows unrotated: the caller's query and output, as INT8
        assert u.q is call.q and u.out is call.out and u.k.shape == d.k.shape
        assert scratch_bytes(call, interpreted=True, unrotate=True) == kv * d.k.element_size()
        assert scratch_bytes(call, unrotate=True) == kv * 2
    else:  # the caller's bf16 query: the 2D kernels convert it as they load it
        assert d.q is call.q and d.out is call.out
        assert scratch_bytes(call, interpreted=True) == kv * d.k.element_size()
        assert scratch_bytes(call) == kv * 2  # fp16 rows on a GPU


def test_rotate_q_once_plans_the_rotation_kernel():
    """``Tuning.rotate_q_once``: the 2D INT4 plan rotates the query with the rotation kernel in 2
    parts (even, odd dims); the default rotates in the kernel; other modes have no rotation."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, [24], [40], num_q_heads=8, num_kv_heads=2)
    args = (c["q"], c["views"].key_cache, c["views"].value_cache, torch.empty_like(c["q"]), c["cu"], c["seqused_k"],
            c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0)
    kw = dict(kv_quant_mode=c["mode"], k_scale_cache=c["views"].k_scale_cache, v_scale_cache=c["views"].v_scale_cache)
    once = attention_plan(*args, **kw, tuning=Tuning(rotate_q_once=True))
    assert (once.path, once.rotate, once.rotate_parts) == (Path.PREFILL_2D, Rotate.TRITON, 2)
    assert attention_plan(*args, **kw).rotate == Rotate.IN_KERNEL
    c8 = make_case(KVQuantMode.INT8_PER_TOKEN_HEAD, torch.bfloat16, [24], [40], num_q_heads=8, num_kv_heads=2)
    args8 = (c8["q"], c8["views"].key_cache, c8["views"].value_cache, torch.empty_like(c8["q"])) + args[4:]
    kw8 = dict(kv_quant_mode=c8["mode"], k_scale_cache=c8["views"].k_scale_cache,
               v_scale_cache=c8["views"].v_scale_cache)
    assert attention_plan(*args8, **kw8, tuning=Tuning(rotate_q_once=True)).rotate == Rotate.NONE


def test_sweep_pins_the_2d_path_and_starts_with_the_default():
    """The default first, no repeats, every other one the 2D path without a split, under the
    variants of the cache's mode."""
    for mode in (KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD):
        tunings = _tunings(mode)
        assert tunings[0] == Tuning() and len(tunings) == len(set(tunings)) > 1
        assert all(t.path == Path.PREFILL_2D and t.tiling.num_segments == 1 for t in tunings[1:])
        variants = {tuple(name for name, field in AP.VARIANT_FIELDS.items()
                          if getattr(t if field == "rotate_q_once" else t.tiling, field)) for t in tunings[1:]}
        assert variants == {tuple(sorted(v, key=list(AP.VARIANT_FIELDS).index)) for v in AP.VARIANTS[mode]}


def test_bench_counts_bytes_and_flops():
    """Bytes: K and V rows of every context token + queries read + output written; FLOPs: 4 *
    head_size per causal (query head, key) pair: a chunk of 2 new tokens over 3 cached sees 4 + 5 keys."""
    shape = AP.Shape("t", 64, 4, 2, [(2, 5), (1, 7)])
    pb = AP.make_problem(KVQuantMode.INT4_PER_TOKEN_HEAD, shape, 16, "cpu")
    assert pb["flops"] == 4 * 64 * 4 * (4 + 5 + 7)
    row_bytes = 64 // 2 + 4
    assert pb["bytes"] == (5 + 7) * 2 * 2 * row_bytes + 2 * 3 * 4 * 64 * 2
    # the dequantizing pass: every slot of the 2 blocks (16 slots, 2 KV heads), K and V, read and
    # written as fp16 rows
    pass_bytes = 2 * 16 * 2 * 2 * (row_bytes + 64 * 2)
    assert pb["dequant_bytes"] == pass_bytes
    q = 3 * 4 * 64 * 4  # a pass over the query (or the output): 16-bit rows read and written
    rotated, unrot = Tiling(64, 64, dequant_first=True), Tiling(64, 64, dequant_first=True, unrotate=True)
    # INT4 kept rotated: the query's rotation and the output's; unrotated rows and INT8: the pass alone
    assert AP._dequant_bytes(pb, Plan(Path.PREFILL_2D, rotated)) == pass_bytes + 2 * q
    assert AP._dequant_bytes(pb, Plan(Path.PREFILL_2D, unrot)) == pass_bytes
    pb8 = AP.make_problem(KVQuantMode.INT8_PER_TOKEN_HEAD, shape, 16, "cpu")
    assert pb8["dequant_bytes"] == AP._dequant_bytes(pb8, Plan(Path.PREFILL_2D, rotated)) == \
        2 * 16 * 2 * 2 * (64 + 4 + 64 * 2)


def test_bench_prefill_smoke(capsys):
    assert AP.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    for mode in ("bf16", "int8", "fp8", "int4"):
        assert f"| {mode} |" in text
    assert "prefill 24 over 40" in text and "mixed 3x decode@50" in text
    errs = [float(line.split("|")[12]) for line in text.splitlines() if line.startswith("| 64 |")]
    assert len(errs) == 12 and max(errs) <= 1e-2
    assert all(line.split("|")[13].strip() == "-" for line in text.splitlines() if line.startswith("| 64 |"))


def test_bench_prefill_smoke_times_the_dequant_pass(capsys):
    """A chunk of 128 tokens at GQA group 2 (4 query tiles): the INT8 default dequantizes first,
    and its row reports the pass's own time; bf16 has none."""
    assert AP.main(["--smoke", "--q-lens", "128", "--cached", "40", "--no-mixed", "--modes", "int8"]) == 0
    rows = {line.split("|")[3].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 64 |")}
    assert set(rows) == {"bf16", "int8"} and rows["bf16"][13].strip() == "-"
    assert "dequant-first" in rows["int8"][14] and float(rows["int8"][13].split("(")[0]) > 0
    assert float(rows["int8"][12]) <= 1e-2


def test_bench_prefill_smoke_sdpa_reference(capsys):
    """``--sdpa``: a second table with torch SDPA (the math backend on the CPU) over contiguous
    K / V of each prefill row, next to bf16's rate from the same run; the mixed row has none."""
    assert AP.main(["--smoke", "--sdpa", "--modes", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "torch SDPA over contiguous K / V" in text
    ref = [line.split("|") for line in text.split("torch SDPA over contiguous")[1].splitlines()
           if line.startswith("| 64 |")]
    assert [r[2].strip() for r in ref] == ["prefill 24 over 0", "prefill 24 over 40"]
    assert all(r[4].strip() == "math" and float(r[5]) > 0 for r in ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_int4_2d_head_64_long_mixed_batch_within_bound():
    """The INT4 2D kernel at head_size 64 (fp32 dot operands on the GPU) on the prefill
    benchmark's mixed row, one call: 16 decode rows over 8,192 keys and a 512-token chunk over
    4,096. Within 1e-2 of the oracle: with one tf32 product per dot it measured 1.9e-2 on the
    H200 (rotated query and probabilities truncated to 10 mantissa bits), with tf32x3 1.6e-3."""
    shape = AP.Shape("mixed", 64, 32, 8, [(1, 8192)] * 16 + [(512, 4096 + 512)])
    pb = AP.make_problem(KVQuantMode.INT4_PER_TOKEN_HEAD, shape, 16, "cuda")
    plan = AP.plan_of(pb, Tuning())
    assert plan.path == Path.PREFILL_2D and not plan.tiling.dequant_first, plan
    assert AP.check(pb, Tuning()) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_size,num_q_heads", [(64, 32), (128, 32), (256, 16)])
def test_cuda_2d_variants_realistic(mode, head_size, num_q_heads):
    """On the GPU (where ``code_asm`` is PTX): the default and every variant of the mode under the
    first swept tiling, on decode rows and chunks over cached tokens, against the oracle."""
    c = make_case(mode, torch.bfloat16, [1, 300, 1, 129], [900, 300 + 700, 33, 129 + 17], num_q_heads=num_q_heads,
                  num_kv_heads=8, head_size=head_size, device="cuda")
    first = AP.SWEEP_TILINGS[0]
    for tuning in _tunings(mode):
        t = tuning.tiling
        if t is not None and (t.block_m, t.tile, t.num_warps, t.num_stages) != first:
            continue
        run_and_check(c, tuning=tuning)  # at 64 x 64 every head size fits an sm_90 (compiled: <= 160 KiB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [KVQuantMode.NONE, KVQuantMode.INT4_PER_TOKEN_HEAD])
@pytest.mark.parametrize("head_size,num_q_heads", [(64, 32), (128, 32), (256, 16)])
def test_cuda_default_long_chunks_match_oracle(mode, head_size, num_q_heads):
    """On the GPU: the default plan of two long chunks (300 and 129 tokens over 700 and 17 cached)
    takes the device's big prefill tiling, or on sm_90 at heads 128 / 256 the Gluon kernel's (INT4
    dequantized first), and matches the oracle."""
    from kernels.attention.plan import device_facts
    from kernels.attention.prefill_wgmma import BLOCK_M, TILINGS
    c = make_case(mode, torch.bfloat16, [300, 129], [300 + 700, 129 + 17], num_q_heads=num_q_heads,
                  num_kv_heads=8, head_size=head_size, device="cuda")
    v = c["views"]
    plan = attention_plan(c["q"], v.key_cache, v.value_cache, c["q"], c["cu"], c["seqused_k"], c["max_q"], c["max_k"],
                          head_size ** -0.5, True, (-1, -1), c["block_table"], 0.0, kv_quant_mode=mode,
                          k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache)
    t = plan.tiling
    want = big_prefill_tiling(head_size, device_facts(c["q"].device))
    if t.wgmma:
        assert (t.block_m, t.tile, t.num_stages) == (BLOCK_M, *TILINGS[head_size][:2]), plan
    else:
        assert want is None or (t.block_m, t.tile, t.num_warps, t.num_stages) == want, plan
    assert t.dequant_first == (mode != KVQuantMode.NONE), plan
    run_and_check(c)


def test_bench_sweeps_the_tilings_given(capsys):
    """``--sweep --tilings``: the default plan, then each tiling given (with the mode's variants),
    checked against the oracle like every row; a malformed list is a one-line usage error."""
    assert AP.main(["--smoke", "--sweep", "--tilings", "64,32,4,2", "--modes", "bf16", "--no-mixed",
                    "--q-lens", "24", "--cached", "40"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |")]
    kernels = [r[14].strip() for r in rows]
    assert any("(64, 32, 4w, 2s)" in k for k in kernels) and any("(64, 64, 4w, 2s)" in k for k in kernels), kernels
    assert all(float(r[12]) <= 1e-2 for r in rows)
    with pytest.raises(SystemExit):
        AP.main(["--smoke", "--sweep", "--tilings", "64,32,4"])
    assert "--tilings: expected" in capsys.readouterr().err


def _plan(c, device=H200, **kw):
    v, out = c["views"], kw.pop("out", None)
    out = torch.empty_like(c["q"]) if out is None else out
    args = (c["q"], v.key_cache, v.value_cache, out, c["cu"], c["seqused_k"], c["max_q"],
            c["max_k"], c["q"].shape[-1] ** -0.5, kw.pop("causal", True), kw.pop("window", (-1, -1)),
            c["block_table"], kw.pop("softcap", 0.0))
    return attention_plan(*args, kv_quant_mode=c["mode"], k_scale_cache=v.k_scale_cache,
                          v_scale_cache=v.v_scale_cache, device=device, **kw)


def test_sm90_prefill_takes_the_wgmma_kernel_where_it_applies():
    """On an H200 (fake device facts) prefill chunks over 16-bit rows take the Gluon TMA /
    warpgroup-MMA kernel (``Tiling.wgmma``) at heads 128 and 256 and at head 64 from 2,048 keys:
    over a bf16 cache in this project's layout (K and V halves of each block: rows of one TMA
    view) and over the dequantized scratch of a quantized one. A soft cap, a sliding window, a
    shorter head-64 context, an fp32 output, ``Tuning(wgmma_prefill=False)``, a Triton without
    Gluon, another GPU, and a value cache whose heads are not contiguous rows take the Triton
    kernel, and the plan says why."""
    from kernels.attention import DeviceFacts

    def case(mode=KVQuantMode.NONE, head=128, k_len=3000):
        return make_case(mode, torch.bfloat16, [600, 600], [k_len, 600], num_q_heads=8, num_kv_heads=2,
                         head_size=head, block_size=16)

    k8 = Tuning(int8_key_prefill=True)
    assert _plan(case(KVQuantMode.INT4_PER_TOKEN_HEAD, head=256, k_len=8000)).tiling.int8_keys is False  # opt-in
    for c in (case(), case(head=64), case(head=256), case(KVQuantMode.INT4_PER_TOKEN_HEAD, head=256, k_len=8000),
              case(KVQuantMode.INT8_PER_TOKEN_HEAD)):
        plan = _plan(c, tuning=k8)
        assert plan.path == Path.PREFILL_2D and plan.tiling.wgmma and "prefill_wgmma_gluon" in plan.why, plan.why
        assert plan.tiling.dequant_first == (c["mode"] != KVQuantMode.NONE)
        assert (plan.tiling.block_m, plan.tiling.num_warps) == (128, 4)
        int8_keys = c["mode"] == KVQuantMode.INT4_PER_TOKEN_HEAD  # head 256, rows kept rotated (1.8 a query row)
        assert plan.tiling.int8_keys == int8_keys and ("int8 score MMAs" in plan.why) == int8_keys, plan.why
    for c, tuning in ((case(KVQuantMode.FP8_PER_TOKEN_HEAD), k8),
                      (case(KVQuantMode.INT4_PER_TOKEN_HEAD), k8),  # rows unrotated: not integers
                      (case(KVQuantMode.INT4_PER_TOKEN_HEAD, k_len=20000), Tuning()),
                      (case(KVQuantMode.INT4_PER_TOKEN_HEAD, k_len=8000), k8),  # head 128: no gain measured
                      (case(KVQuantMode.INT4_PER_TOKEN_HEAD, head=64, k_len=20000), k8)):  # slower at head 64
        plan = _plan(c, tuning=tuning)
        assert plan.tiling.wgmma and plan.tiling.dequant_first and not plan.tiling.int8_keys, plan.why
        assert plan.tiling.unrotate == (c["mode"] == KVQuantMode.INT4_PER_TOKEN_HEAD and c["max_k"] < 8000)
    assert _plan(case(KVQuantMode.INT4_PER_TOKEN_HEAD)).tiling.unrotate
    for bad in (dict(), dict(wgmma=True), dict(dequant_first=True), dict(wgmma=True, dequant_first=True, unrotate=True)):
        with pytest.raises(ValueError, match="Tiling.int8_keys: only with wgmma and dequant_first"):
            Tiling(128, 128, int8_keys=True, **bad)
    c = case()
    not_wgmma = {
        "soft cap / sliding window": [_plan(c, softcap=10.0), _plan(c, causal=False, window=(64, 0))],
        "float32 output": [_plan(c, out=torch.empty_like(c["q"], dtype=torch.float32))],
        "contexts under 2048 keys at head_size 64": [_plan(case(head=64, k_len=1000))],
        "": [_plan(c, tuning=Tuning(wgmma_prefill=False)), _plan(c, device=dataclasses.replace(H200, gluon=False)),
             _plan(c, device=DeviceFacts("cuda", 108, (8, 0), gluon=True)), _plan(c, device=CPU)],
    }
    for why, plans in not_wgmma.items():
        for plan in plans:
            assert not plan.tiling.wgmma and why in plan.why, plan.why
    v = c["views"].value_cache
    wide = torch.stack([v, v], dim=3).view(*v.shape[:3], 2 * v.shape[3])[..., v.shape[3]:]  # head stride 2 x head_size
    c["views"] = type(c["views"])(c["views"].key_cache, wide, None, None)
    plan = _plan(c)
    assert not plan.tiling.wgmma and "not a 2D TMA view" in plan.why, plan.why


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head", [128, 64, 256])
@pytest.mark.parametrize("mode,dtype", [(KVQuantMode.NONE, torch.bfloat16), (KVQuantMode.NONE, torch.float16),
                                        (KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16),
                                        (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.bfloat16)], ids=["bf16", "fp16", "int4", "int8"])
@pytest.mark.parametrize("hq,hkv,bs", [(8, 2, 16), (4, 4, 32), (16, 2, 16)], ids=["gqa4-b16", "mha-b32", "gqa8-b16"])
@pytest.mark.parametrize("int8_keys", [True, False], ids=["int8-keys", "fp16-keys"])
def test_cuda_wgmma_prefill_matches_oracle(head, mode, dtype, hq, hkv, bs, int8_keys, launched):
    """The sm_90 Gluon prefill kernel, chosen by the default plan, against the oracle: chunks of
    329 / 600 / 5 tokens over 2,300 / 2,648 / 2,100 keys (partial last tiles and blocks, a
    chunk shorter than a query tile; enough query tiles per sequence that a quantized context
    is dequantized first at every GQA group here), causal and not, in a cache whose unused
    slots hold NaN; then as the chunk half of a mixed batch. Over INT4 rows kept rotated with the
    keys as int8 codes (``Tuning(int8_key_prefill=True)``) and as fp16 rows (the default)."""
    if not int8_keys and mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        pytest.skip("int8 keys are for INT4 contexts")
    tuning = mixed = Tuning(int8_key_prefill=int8_keys)
    c = make_case(mode, dtype, [329, 600, 5], [2300, 600 + 2048, 2100], num_q_heads=hq, num_kv_heads=hkv,
                  head_size=head, block_size=bs, device="cuda", seed=head + hq)
    plan = _plan(c, device=None, tuning=tuning)
    want = (int8_keys and mode == KVQuantMode.INT4_PER_TOKEN_HEAD and not plan.tiling.unrotate  # gqa8: unrotated
            and head == 256)  # head 256 only
    if int8_keys and head != 256 and mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # the kernel's int8-key form there
        tuning = Tuning(tiling=dataclasses.replace(plan.tiling, int8_keys=not plan.tiling.unrotate))
        plan = _plan(c, device=None, tuning=tuning)
        want = not plan.tiling.unrotate
    assert plan.tiling.wgmma and plan.tiling.int8_keys == want, plan.why
    run_and_check(c, tuning=tuning)
    assert launched == expected_launches(plan, mode), launched
    run_and_check(c, causal=False, tuning=tuning)
    m = make_case(mode, dtype, [1, 1, 600], [30, 90, 2400], num_q_heads=hq, num_kv_heads=hkv, head_size=head,
                  block_size=bs, device="cuda", seed=1)
    launched.clear()
    run_and_check(m, num_decode_seqs=2, tuning=mixed)
    assert "_prefill_wgmma_kernel" in launched, launched


@pytest.mark.parametrize("mode,unrotate", [(KVQuantMode.INT8_PER_TOKEN_HEAD, False), (KVQuantMode.FP8_PER_TOKEN_HEAD, False),
                                           (KVQuantMode.INT4_PER_TOKEN_HEAD, False), (KVQuantMode.INT4_PER_TOKEN_HEAD, True)])
def test_scratch_read_as_tile_blocks_writes_what_block_size_blocks_write(mode, unrotate):
    """``Tiling.tile_blocks``: ``dequantized_call(..., block_rows=tile)`` pads each sequence's scratch
    blocks to a multiple of ``tile / block_size`` and views them as blocks of ``tile`` slots (no
    copy: the 16-slot blocks' rows in the same memory, read through a table of the bigger blocks);
    the 2D kernel over that view writes exactly what it writes over 16-slot blocks, which matches
    the oracle, on sequences whose lengths are no tile multiple; a block_rows that is no multiple
    of the block size is refused."""
    from kernels.attention.call import make_call
    from kernels.attention.prefill_dequant import dequantized_call

    c = make_case(mode, torch.bfloat16, [70, 45], [70 + 150, 45 + 9], num_q_heads=8, num_kv_heads=2, head_size=64)
    v = c["views"]
    call = make_call(c["q"], v.key_cache, v.value_cache, torch.empty_like(c["q"]), c["cu"], c["seqused_k"],
                     c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0, mode,
                     v.k_scale_cache, v.v_scale_cache)
    plain = dequantized_call(call, unrotate=unrotate)
    per_seq = plain.block_table.shape[1]
    assert per_seq == 14  # 220 keys in 16-slot blocks
    for rows, f in ((64, 4), (128, 8), (16, 1), (0, 1)):
        tiled = dequantized_call(call, unrotate=unrotate, block_rows=rows)
        pitch = -(-per_seq // f) * f
        assert tiled.k.shape == (2 * pitch // f, 16 * f, 2, 64) == tiled.v.shape, (rows, tiled.k.shape)
        assert torch.equal(tiled.block_table.flatten(), torch.arange(2 * pitch // f, dtype=torch.int32))
        flat, ref = tiled.k.reshape(2, pitch * 16, 2, 64), plain.k.reshape(2, per_seq * 16, 2, 64)
        for s, n in enumerate((220, 54)):   # every slot a sequence reads holds the same row
            assert torch.equal(flat[s, :n], ref[s, :n]), (rows, s)
    with pytest.raises(ValueError, match="block_rows 24: expected a multiple of the block size 16"):
        dequantized_call(call, block_rows=24)
    base = Tiling(64, 64, num_warps=4, num_stages=2, mask_edges_only=True, dequant_first=True, unrotate=unrotate)
    out = run_and_check(c, tuning=Tuning(path=Path.PREFILL_2D, tiling=base))
    tiles = run_and_check(c, tuning=Tuning(path=Path.PREFILL_2D, tiling=dataclasses.replace(base, tile_blocks=True)))
    assert torch.equal(tiles, out)
    with pytest.raises(ValueError, match="tile_blocks: only with dequant_first"):
        Tiling(64, 64, tile_blocks=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD])
@pytest.mark.parametrize("head_size,num_q_heads", [(64, 32), (128, 32), (256, 16)])
def test_cuda_scratch_as_tile_blocks_writes_what_16_slot_blocks_write(mode, head_size, num_q_heads):
    """On the GPU, the Gluon kernel (sm_90) or the Triton 2D kernel over a dequantized scratch read as
    tile-sized blocks (``Tiling.tile_blocks``) writes exactly what it writes over the scratch's
    16-slot blocks, within the oracle's bound; INT4 at head 256 with int8 keys too."""
    c = make_case(mode, torch.bfloat16, [300, 129], [300 + 2100, 129 + 17], num_q_heads=num_q_heads,
                  num_kv_heads=8, head_size=head_size, device="cuda")
    tunings = [Tuning()] + ([Tuning(int8_key_prefill=True)] if head_size == 256 and mode != KVQuantMode.INT8_PER_TOKEN_HEAD
                            else [])
    for tuning in tunings:
        plan = _plan(c, device=None, tuning=tuning)
        assert plan.tiling.dequant_first, plan
        outs = [run_and_check(c, tuning=Tuning(path=plan.path, tiling=dataclasses.replace(plan.tiling, tile_blocks=tb)))
                for tb in (False, True)]
        assert torch.equal(outs[0], outs[1]), (plan, (outs[0].float() - outs[1].float()).abs().max())


def test_sm90_plan_reads_the_scratch_as_tile_blocks():
    """``Tuning.tile_blocks_prefill`` (default on): on an H200 (fake facts) a chunk over a quantized
    cache that takes the Gluon kernel at head 64 or 128 reads its scratch as blocks of the
    kernel's tile (``Tiling.tile_blocks``, said in ``why``); head 256 (measured no faster), a bf16
    cache (no scratch) and ``tile_blocks_prefill=False`` keep 16-slot blocks."""
    from kernels.attention.prefill_wgmma import TILE_BLOCK_HEADS, TILINGS
    assert TILE_BLOCK_HEADS == (64, 128)
    for head, k_len in ((64, 3000), (128, 3000), (256, 8000)):
        for mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.NONE):
            c = make_case(mode, torch.bfloat16, [600, 600], [k_len, 600], num_q_heads=8, num_kv_heads=2,
                          head_size=head)
            on, off = _plan(c), _plan(c, tuning=Tuning(tile_blocks_prefill=False))
            assert on.tiling.wgmma and not off.tiling.tile_blocks, (off, on)
            assert on.tiling.tile_blocks == (mode != KVQuantMode.NONE and head != 256), on
            said = f"the scratch read as {TILINGS[head][0]}-slot blocks" in on.why
            assert said == on.tiling.tile_blocks, on.why
            assert on.tiling == dataclasses.replace(off.tiling, tile_blocks=on.tiling.tile_blocks)


def test_bench_tile_blocks_flag_flips_the_default_plans_scratch_blocks():
    """``bench.attention_prefill --tile-blocks``: for a plan that dequantizes first, the same plan
    with ``Tiling.tile_blocks`` flipped either way (the A/B of the two scratch layouts); none for a
    plan without a scratch."""
    on = Tiling(128, 128, wgmma=True, dequant_first=True, tile_blocks=True)
    for t in (on, dataclasses.replace(on, tile_blocks=False)):
        flipped = AP.tile_blocks_tuning(Plan(Path.PREFILL_2D, t))
        assert flipped.path == Path.PREFILL_2D and flipped.tiling == dataclasses.replace(t, tile_blocks=not t.tile_blocks)
    assert AP.tile_blocks_tuning(Plan(Path.PREFILL_2D, Tiling(128, 128, wgmma=True))) is None
