"""The 2D attention path (prefill chunks, mixed batches): its tilings and variants against the
oracle, and the prefill benchmark's CPU-side logic.

Covers: every cache mode through the 2D kernel under each tiling the prefill benchmark sweeps
(``bench.attention_prefill.sweep_tunings``), on chunks that start mid-block after cached tokens,
chunks with no cached token, and a mixed batch (decode rows + a chunk); the benchmark's byte and
FLOP counts; a ``--smoke`` run of ``bench/attention_prefill.py``.

CPU tensors run through Triton's interpreter (small shapes); the CUDA test runs when a GPU is
present. Run: ``python -m pytest tests/test_prefill_2d.py -q``.

Tolerance: relative L2 <= 1e-2 against ``reference_unified_attention`` on the same cache; the
residual is rounding only (bf16 output, 16-bit dot operands, INT4's rotated query in 16 bits),
measured near 3e-3.
"""

from __future__ import annotations

import pytest
import torch

from bench import attention_prefill as AP
from kernels.attention import Path, Rotate, Tuning, attention_plan
from layouts import KVQuantMode
from test_attention_kernels import make_case, run_and_check

MODES = [
    pytest.param(KVQuantMode.NONE, id="bf16"),
    pytest.param(KVQuantMode.INT8_PER_TOKEN_HEAD, id="int8"),
    pytest.param(KVQuantMode.FP8_PER_TOKEN_HEAD, id="fp8"),
    pytest.param(KVQuantMode.INT4_PER_TOKEN_HEAD, id="int4"),
]
# (q_lens, k_lens): chunks after 0 cached tokens, after cached tokens that end mid-block (block 16),
# and a mixed batch (two decode rows, a chunk starting mid-block, an empty sequence)
CASES = [
    pytest.param([24, 7], [24, 7], id="no-cache"),
    pytest.param([21, 40], [21 + 37, 40 + 9], id="mid-block"),
    pytest.param([1, 1, 19, 0], [70, 33, 19 + 45, 5], id="mixed"),
]


def _tunings(mode=KVQuantMode.INT4_PER_TOKEN_HEAD):
    """Every tuning the benchmark sweeps for ``mode``, planned for a 64-row query tile (GQA group 4)."""
    c = make_case(KVQuantMode.NONE, torch.bfloat16, [24], [24], num_q_heads=8, num_kv_heads=2)
    plan = attention_plan(c["q"], c["views"].key_cache, c["views"].value_cache, torch.empty_like(c["q"]), c["cu"],
                          c["seqused_k"], c["max_q"], c["max_k"], 0.125, True, (-1, -1), c["block_table"], 0.0)
    return AP.sweep_tunings(plan, mode)


def _tuning_id(t: Tuning) -> str:
    if t == Tuning():
        return "default"
    return "m{0.block_m}-t{0.tile}-w{0.num_warps}-s{0.num_stages}".format(t.tiling) + \
        ("-zp" if t.tiling.code_zp else "") + ("-rot1" if t.rotate_q_once else "") + \
        ("-asm" if t.tiling.code_asm else "") + ("-dq" if t.tiling.dequant_first else "")


@pytest.mark.parametrize("q_lens,k_lens", CASES)
@pytest.mark.parametrize("mode,tuning", [pytest.param(m.values[0], t, id=f"{m.id}-{_tuning_id(t)}")
                                         for m in MODES for t in _tunings(m.values[0])])
def test_2d_tunings_match_oracle(mode, q_lens, k_lens, tuning):
    """Every tuning the benchmark sweeps for the mode against the oracle."""
    c = make_case(mode, torch.bfloat16, q_lens, k_lens, num_q_heads=8, num_kv_heads=2, head_size=64)
    run_and_check(c, tuning=tuning)


@pytest.mark.parametrize("head_size", [32, 128])
@pytest.mark.parametrize("tuning", [t for t in _tunings() if t.tiling is not None and t.tiling.tile == 64
                                    and t.tiling.block_m == 64], ids=_tuning_id)
def test_2d_int4_variants_other_head_sizes(head_size, tuning):
    """The INT4 variants at other head sizes, GQA group 1, softcap and a sliding window."""
    c = make_case(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.bfloat16, [1, 19, 6], [33, 19 + 21, 6],
                  num_q_heads=2, num_kv_heads=2, head_size=head_size)
    run_and_check(c, tuning=tuning)
    run_and_check(c, causal=False, window=(9, -1), softcap=20.0, tuning=tuning)


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
        variants = {(t.tiling.code_zp, t.rotate_q_once, t.tiling.code_asm, t.tiling.dequant_first)
                    for t in tunings[1:]}
        assert variants == set(AP.VARIANTS[mode])


def test_bench_counts_bytes_and_flops():
    """Bytes: K and V rows of every context token + queries read + output written; FLOPs: 4 *
    head_size per causal (query head, key) pair: a chunk of 2 new tokens over 3 cached sees 4 + 5 keys."""
    shape = AP.Shape("t", 64, 4, 2, [(2, 5), (1, 7)])
    pb = AP.make_problem(KVQuantMode.INT4_PER_TOKEN_HEAD, shape, 16, "cpu")
    assert pb["flops"] == 4 * 64 * 4 * (4 + 5 + 7)
    row_bytes = 64 // 2 + 4
    assert pb["bytes"] == (5 + 7) * 2 * 2 * row_bytes + 2 * 3 * 4 * 64 * 2


def test_bench_prefill_smoke(capsys):
    assert AP.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    for mode in ("bf16", "int8", "fp8", "int4"):
        assert f"| {mode} |" in text
    assert "prefill 24 over 40" in text and "mixed 3x decode@50" in text
    errs = [float(line.split("|")[12]) for line in text.splitlines() if line.startswith("| 64 |")]
    assert len(errs) == 12 and max(errs) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_size,num_q_heads", [(64, 32), (128, 32), (256, 16)])
def test_cuda_2d_tunings_realistic(mode, head_size, num_q_heads):
    c = make_case(mode, torch.bfloat16, [1, 300, 1, 129], [900, 300 + 700, 33, 129 + 17], num_q_heads=num_q_heads,
                  num_kv_heads=8, head_size=head_size, device="cuda")
    for tuning in _tunings(mode):
        try:
            run_and_check(c, tuning=tuning)
        except ValueError as e:  # a tiling that does not fit this GPU's shared memory says so
            assert "does not fit this GPU" in str(e)
