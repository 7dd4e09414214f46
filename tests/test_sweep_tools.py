"""The GPU benchmark helpers' CPU-side logic: the attention benchmark's tunings (sweep, compare,
paths), the profiling driver's ``--tiling``, and the read probes' addressing (the timing itself needs a GPU).

Run: python -m pytest tests/test_sweep_tools.py -q
"""

import pytest

from bench import attention as B
from bench import profile_decode as P
from kernels.attention import Path, Tuning


def test_attention_bench_tunings_pin_the_path_and_vary_the_tiling():
    """bench.attention: ``--sweep`` varies the plan's tiling on the plan's path (the default first,
    no repeats); ``--compare`` times the 2D kernel and the split decode tilings at the plan's
    segment count; ``--paths`` asks for each path with its own tiling. Every variant is a Tuning."""
    pb = B.make_problem(B.MODES["int8"], 2, 4096, 1, dict(B.QUICK, head_size=128), "cpu")
    base = Tuning()
    plan = B.plan_of(pb, base)
    assert plan.path == Path.DECODE_BLOCK_TILES and plan.tiling.num_segments > 1
    swept = B.sweep_tunings(base, plan)
    assert swept[0] == base and len(swept) == len(set(swept))
    assert all(t.path == plan.path for t in swept[1:])
    assert sorted({t.tiling.num_segments for t in swept[1:]}) == sorted(
        {plan.tiling.num_segments, *(max(2, int(plan.tiling.num_segments * m)) for m in (0.5, 2, 4))})
    compared = B.compare_tunings(base, plan, B.MODES["int8"])
    assert [t.path for t in compared] == [Path.PREFILL_2D, Path.DECODE_SPLIT, Path.DECODE_CODE_UNITS,
                                          Path.DECODE_CODE_UNITS]
    assert {t.tiling.num_segments for t in compared} == {plan.tiling.num_segments}
    assert [B.plan_of(pb, t).path for t in compared] == [t.path for t in compared]  # the CPU reads them all
    paths = B.path_tunings(base, [Path.DECODE_STAGED_INT8, Path.DECODE_CODE_UNITS])
    assert [B.plan_of(pb, t).path for t in paths] == [Path.DECODE_BLOCK_TILES, Path.DECODE_CODE_UNITS]


def test_profile_decode_tiling_and_no_gpu_exit(monkeypatch, capsys):
    """bench/profile_decode.py: ``--tiling`` around the plan's tiling (segments keep the keys per
    segment unless given; heads per program only for decode_block_tiles); without a GPU it says so."""
    pb = B.make_problem(B.MODES["int8"], 2, 4096, 1, dict(B.QUICK, head_size=128), "cpu")
    plan = B.plan_of(pb, Tuning())
    t = P.parse_tiling("32:1:2:8", plan, Path.DECODE_CODE_UNITS)
    assert (t.tile, t.num_warps, t.num_stages, t.num_segments, t.heads_per_program) == (32, 1, 2, 8, 0)
    t = P.parse_tiling("32:1:2", plan, Path.DECODE_CODE_UNITS)
    assert t.num_segments == max(2, plan.tiling.num_segments * plan.tiling.tile // 32)
    assert P.parse_tiling("16:4:2:8:2", plan, Path.DECODE_BLOCK_TILES).heads_per_program == 2
    assert P.parse_tiling("16:4:2", plan, Path.DECODE_BLOCK_TILES).heads_per_program == plan.tiling.heads_per_program
    monkeypatch.setattr(P.torch.cuda, "is_available", lambda: False)
    assert P.main(["--mode", "int4"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        P.main(["--path", "v4"])


def test_probe_reads_quick():
    """bench/probe_reads.py --quick: both read probes on tiny caches through the interpreter; each
    probe's sum is compared with a torch sum of the same rows (the tool raises on a mismatch)."""
    from bench import probe_reads

    assert probe_reads.main(["--quick"]) == 0


def test_tee_prints_and_appends(tmp_path, capsys):
    """bench.timing.tee: each message is printed, and appended as a line to the file when one is given."""
    from bench.timing import tee
    out = tmp_path / "log.txt"
    log = tee(str(out))
    log("first")
    log("second")
    tee(None)("only printed")
    assert out.read_text() == "first\nsecond\n"
    assert capsys.readouterr().out == "first\nsecond\nonly printed\n"
