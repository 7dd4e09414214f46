"""Mixed batches (``num_decode_seqs``): decode rows through the decode kernels, chunk rows through the 2D kernel.

Covers: every cache mode (bf16, INT8, FP8, INT4) against the oracle ``reference_unified_attention``
(relative L2 <= 1e-2) with 1, 3 and 17 decode rows (17 puts the chunk's first row in the 2D
kernel's second q block, so its grid starts past program 0), one and two chunks, decode rows
whose context is shorter than one cache block, chunks that start mid-block; the kernels launched
are the decode plan's then the 2D kernel (recorded at launch); every output row is written
(``out`` poisoned with NaN first); the plan's split and its validation; without
``num_decode_seqs`` the plan is unchanged; on CUDA the decode part on a second stream alongside the
chunk part (the default for small decode parts) gives the serial call's output bit for bit, also
replayed from a CUDA graph. CPU through Triton's interpreter (tiny shapes); the same cases on CUDA
when a GPU is present.

Run: ``python -m pytest tests/test_mixed_batches.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import H200, Path, attention_plan
from layouts import KVQuantMode, LayoutError
from tests.test_attention_kernels import (P2D, expected_launches, launched, make_case,  # noqa: F401 (fixture)
                                          run_and_check)

MODES = [
    pytest.param(KVQuantMode.NONE, id="bf16"),
    pytest.param(KVQuantMode.INT8_PER_TOKEN_HEAD, id="int8"),
    pytest.param(KVQuantMode.FP8_PER_TOKEN_HEAD, id="fp8"),
    pytest.param(KVQuantMode.INT4_PER_TOKEN_HEAD, id="int4"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]

# (decode contexts, chunks as (query tokens, context)); block size 16.
MIXES = [
    # one decode row shorter than a block; one chunk starting mid-block (keys 35..39 of 40)
    pytest.param([9], [(5, 40)], id="1dec-short-1chunk-midblock"),
    # three decode rows (short, long, longer); two chunks: one mid-block, one whole prefill
    pytest.param([9, 70, 130], [(6, 38), (17, 17)], id="3dec-2chunks"),
    # 17 decode rows: the chunk's rows start in the 2D kernel's second q block (BLOCK_Q 16)
    pytest.param([5 + 3 * i for i in range(17)], [(9, 25)], id="17dec-1chunk-base1"),
]


def _mixed_case(mode, dec_ctx, chunks, device, seed=0):
    q_lens = [1] * len(dec_ctx) + [n for n, _ in chunks]
    k_lens = list(dec_ctx) + [k for _, k in chunks]
    return make_case(mode, torch.bfloat16, q_lens=q_lens, k_lens=k_lens, device=device, seed=seed)


def _plan(c, facts=None, **kw):
    v = c["views"]
    return attention_plan(c["q"], v.key_cache, v.value_cache, c["q"], c["cu"], c["seqused_k"], c["max_q"],
                          c["max_k"], c["q"].shape[-1] ** -0.5, True, (-1, -1), c["block_table"], 0.0,
                          kv_quant_mode=c["mode"], k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache,
                          device=facts, **kw)


def _record_2d_grids(monkeypatch) -> list:
    """The grids of the 2D kernels' launches while the test runs, in order."""
    from kernels.attention import prefill_2d
    grids = []

    class Grid:
        def __init__(self, kernel):
            self._kernel = kernel

        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return self._kernel[grid]

    for name in ("_attn_kernel", "_attn_int4_kernel"):
        monkeypatch.setattr(prefill_2d, name, Grid(getattr(prefill_2d, name)))
    return grids


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dec_ctx,chunks", MIXES)
@pytest.mark.parametrize("segments", [None, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_matches_oracle_and_launches_both_paths(mode, dec_ctx, chunks, segments, device, launched,
                                                           monkeypatch):
    """The output (poisoned first) matches the oracle on every row, and the launched kernels are
    the decode rows' plan (as a decode batch of their own) followed by the 2D kernel."""
    c = _mixed_case(mode, dec_ctx, chunks, device, seed=len(dec_ctx))
    d = len(dec_ctx)
    kw = dict(num_decode_seqs=d, num_par_softmax_segments=segments)
    plan = _plan(c, **kw)
    assert plan.path == Path.MIXED and plan.num_decode_seqs == d, plan
    dec, pre = plan.parts
    alone = make_case(mode, torch.bfloat16, q_lens=[1] * d, k_lens=dec_ctx, device=device)
    alone["max_k"] = c["max_k"]
    assert dec == _plan(alone, num_par_softmax_segments=segments), "decode rows planned as a decode batch of their own"
    assert pre.path == P2D and pre.tiling.num_segments == 1
    if segments:
        assert dec.tiling.num_segments == segments and dec.path != P2D or mode == KVQuantMode.NONE, dec
    grids = _record_2d_grids(monkeypatch)
    run_and_check(c, **kw)
    assert launched == expected_launches(dec, mode) + expected_launches(pre, mode), plan
    # the chunk's 2D grid covers its q blocks only: from the block of its first row (d // BLOCK_Q) on
    block_q = pre.tiling.block_m // (c["q"].shape[1] // c["views"].key_cache.shape[2])
    assert grids[-1][0] == c["q"].shape[0] // block_q - d // block_q + len(chunks), (grids, block_q)
    if mode == KVQuantMode.NONE:
        return
    launched.clear()  # the same batch without num_decode_seqs: one 2D launch, as before
    assert _plan(c).path == P2D
    run_and_check(c)
    assert launched == expected_launches(_plan(c), mode)


def test_plan_of_a_mixed_batch_on_an_h200():
    """Planned for an H200 (16 decode rows at 512 keys + one 64-token chunk, head 128, 32 q / 8
    KV heads): INT8 decode rows take a split decode kernel, the chunk the 2D kernel; ``why``
    names both; D == num_seqs plans a decode batch, D == 0 the single 2D plan."""
    mode = KVQuantMode.INT8_PER_TOKEN_HEAD
    c = make_case(mode, torch.bfloat16, q_lens=[1] * 16 + [64], k_lens=[512] * 16 + [512], num_q_heads=32,
                  num_kv_heads=8, head_size=128)
    plan = _plan(c, H200, num_decode_seqs=16)
    assert plan.path == Path.MIXED
    assert plan.parts[0].path not in (P2D, Path.EMPTY) and plan.parts[0].tiling.num_segments > 1, plan
    assert plan.parts[1].path == P2D and "16 decode rows" in plan.why and "prefill_2d" in plan.why
    assert plan.overlap and "alongside (two streams)" in plan.why, plan.why  # on a CUDA device: two streams
    from kernels.attention import CPU, Tuning
    serial = _plan(c, H200, num_decode_seqs=16, tuning=Tuning(overlap_mixed=False))
    assert not serial.overlap and "alongside" not in serial.why and serial.parts == plan.parts
    assert not _plan(c, CPU, num_decode_seqs=16).overlap  # the interpreter has one stream
    few = make_case(mode, torch.bfloat16, q_lens=[1, 64], k_lens=[1024, 1024], num_q_heads=32, num_kv_heads=8,
                    head_size=128)
    assert not _plan(few, H200, num_decode_seqs=1).overlap  # a quantized cache: from 4,096 decode keys
    few_bf16 = make_case(KVQuantMode.NONE, torch.bfloat16, q_lens=[1, 64], k_lens=[1024, 1024], num_q_heads=32,
                         num_kv_heads=8, head_size=128)
    assert _plan(few_bf16, H200, num_decode_seqs=1).overlap
    many = make_case(KVQuantMode.NONE, torch.bfloat16, q_lens=[1] * 64 + [64], k_lens=[4096] * 65, num_q_heads=32,
                     num_kv_heads=8, head_size=128)
    assert not _plan(many, H200, num_decode_seqs=64).overlap  # 262,144 decode keys fill the GPU
    assert _plan(c, H200, num_decode_seqs=0) == _plan(c, H200)
    dec = make_case(mode, torch.bfloat16, q_lens=[1] * 4, k_lens=[512] * 4, num_q_heads=32, num_kv_heads=8,
                    head_size=128)
    want = _plan(dec, H200)
    assert want.path == Path.DECODE_BLOCK_TILES, want
    dec["max_q"] = 3  # a loose host bound: the caller's count says these are decode rows
    assert _plan(dec, H200).path == P2D
    assert _plan(dec, H200, num_decode_seqs=4) == want


@pytest.mark.parametrize("bad", [-1, 4, 2.0, "1", True])
def test_num_decode_seqs_is_checked(bad):
    c = _mixed_case(KVQuantMode.INT8_PER_TOKEN_HEAD, [9], [(5, 40), (3, 3)], "cpu")
    with pytest.raises(LayoutError, match=r"num_decode_seqs must be an int in \[0, min\(num_seqs=3"):
        _plan(c, num_decode_seqs=bad)


def test_bench_quick_mixed_smoke(capsys):
    """``python -m bench.attention --quick --mixed`` prints one row per mix and mode with the
    ratio (a)/(b), every mixed call checked against the oracle."""
    from bench import attention as bench_attention
    from bench import attention_mixed

    assert bench_attention.main(["--quick", "--mixed", "--modes", "int8,int4"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith(("| int8 |", "| int4 |"))]
    assert len(rows) == 2 * len(attention_mixed.QUICK_MIXES), text
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        assert float(cells[-3]) <= 1e-2, row  # rel. L2 of the mixed call vs the oracle
        assert float(cells[7]) > 0 and cells[-2].startswith(("decode_", "prefill_2d")), row


def test_mixed_int4_chunk_with_the_query_rotated_once():
    """INT4 chunk rows whose query the rotation kernel rotates once (``Tuning.rotate_q_once``):
    the chunk part of the mixed plan carries the rotation's parts, and the output matches the
    oracle on every row."""
    from kernels.attention import Tuning
    mode = KVQuantMode.INT4_PER_TOKEN_HEAD
    c = _mixed_case(mode, [9, 70, 130], [(6, 38), (17, 17)], "cpu", seed=3)
    tuning = Tuning(rotate_q_once=True)
    plan = _plan(c, num_decode_seqs=3, tuning=tuning)
    assert plan.parts[1].rotate_parts == 2, plan.parts[1]
    run_and_check(c, num_decode_seqs=3, tuning=tuning)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_mixed_parts_on_two_streams_equal_the_serial_call(mode):
    """On CUDA the decode part runs on a second stream alongside the chunk part (``Plan.overlap``):
    the output equals, bit for bit, the same plan run one part after the other (disjoint rows,
    the same kernels), read on the caller's stream straight after the call (the join); captured
    in a CUDA graph (two branches) and replayed on new inputs, the same again."""
    from kernels.attention import Tuning, unified_attention
    c = _mixed_case(mode, [700, 1300, 3000, 1000], [(40, 700)], "cuda", seed=7)  # 4 x 3,000 decode keys
    v, q = c["views"], c["q"]
    d = 4

    def run(out, tuning):
        return unified_attention(q, v.key_cache, v.value_cache, out, c["cu"], c["seqused_k"], c["max_q"], c["max_k"],
                                 q.shape[-1] ** -0.5, True, (-1, -1), c["block_table"], 0.0, None, None, None,
                                 kv_quant_mode=mode, k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache,
                                 num_decode_seqs=d, tuning=tuning)

    assert _plan(c, num_decode_seqs=d).overlap
    serial = run(torch.full_like(q, float("nan")), Tuning(overlap_mixed=False)).clone()
    assert torch.isfinite(serial).all()
    out = torch.full_like(q, float("nan"))
    assert torch.equal(run(out, Tuning()), serial)
    run(out, Tuning())  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        run(out, Tuning())
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert torch.equal(out, run(torch.full_like(q, float("nan")), Tuning(overlap_mixed=False)))
