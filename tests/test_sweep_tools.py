"""The GPU benchmark helpers' CPU-side logic: the attention benchmark's tunings (sweep, compare,
paths), the profiling driver's ``--tiling``, the timeline's specs and trace reading, and the read
probes' addressing (the timing itself needs a GPU).

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


def test_attention_timeline_specs_and_trace_split(tmp_path, monkeypatch, capsys):
    """bench/attention_timeline.py: a spec names the plan's default or a path with its tiling (the
    2D kernel's with edges-only masking); a bad spec is a one-line error; a profiler trace splits
    into calls at each flush kernel, the kernels before the first flush dropped; without a GPU it
    says so."""
    import json

    from bench import attention_timeline as T
    assert T.parse_spec("int4:1:32768") == ("int4", 1, 32768, Tuning())
    mode, batch, ctx, t = T.parse_spec("int4:2:4096:decode_staged_int4:132:16:8:4")
    assert (mode, batch, ctx, t.path) == ("int4", 2, 4096, Path.DECODE_STAGED_INT4)
    assert (t.tiling.num_segments, t.tiling.tile, t.tiling.num_warps, t.tiling.num_stages) == (132, 16, 8, 4)
    assert not t.tiling.mask_edges_only
    assert T.parse_spec("bf16:1:4096:prefill_2d:33:64:4:3")[3].tiling.mask_edges_only
    assert T.parse_spec("int4:1:64:decode_block_tiles:8:32:1:2:2")[3].tiling.heads_per_program == 2
    capped = T.parse_spec("int4:1:64:decode_block_tiles:8:32:1:2:1:128")[3].tiling
    assert (capped.heads_per_program, capped.max_registers) == (1, 128)
    for bad in ("int5:1:64", "int4:1", "int4:1:64:decode_block_tiles:8"):
        with pytest.raises(ValueError, match="mode:batch:context"):
            T.parse_spec(bad)
    assert T.main(["int4:1"]) == 2 and "error: spec" in capsys.readouterr().err
    flush = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>"
    events = [dict(cat="kernel", name="early", ts=0, dur=1), dict(cat="cpu_op", name="x", ts=1, dur=1),
              dict(cat="kernel", name=flush, ts=10, dur=80), dict(cat="kernel", name="decode", ts=95, dur=20),
              dict(cat="kernel", name="reduce", ts=116, dur=3), dict(cat="kernel", name=flush, ts=200, dur=80),
              dict(cat="kernel", name="decode", ts=281, dur=21)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events[::-1]}))
    calls = T.split_calls(T.kernel_events(str(path)), T.FLUSH_KERNELS["write"])
    assert [(end, [k["name"] for k in ks]) for end, ks in calls] == [(90, ["decode", "reduce"]), (280, ["decode"])]
    read = [dict(e, name="_read_flush_kernel") if e["name"] == flush else e for e in events]
    path.write_text(json.dumps({"traceEvents": read}))
    assert T.split_calls(T.kernel_events(str(path)), T.FLUSH_KERNELS["read"]) == calls
    assert T.split_calls(T.kernel_events(str(path)), T.FLUSH_KERNELS["write"]) == []
    args = {"grid": [1, 8, 128], "block": [128, 1, 1], "registers per thread": 156, "shared memory": 98304,
            "est. achieved occupancy %": 19}
    line = T.kernel_line(dict(name="_attn_kernel", args=args), 46.43, 0.26)
    assert line.split() == ["_attn_kernel", "grid", "[1,", "8,", "128]", "block", "[128,", "1,", "1]", "regs", "156",
                            "smem", "98304", "occ", "19%", "46.43", "us,", "gap", "0.26", "us"]
    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: False)
    assert T.main(["int4:1:32768"]) == 1 and "needs a CUDA GPU" in capsys.readouterr().err


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


def test_read_pass_reads_every_word_once():
    """bench.timing.read_pass (the read flush's kernel, here through the interpreter): program
    ``p``'s word is the XOR of blocks ``p, p + programs, ...`` of the buffer, for a buffer of
    random words whose blocks do not divide evenly among the programs; ``flush_l2`` refuses an
    unknown kind."""
    import numpy as np
    import torch

    from bench.timing import flush_l2, read_pass
    programs, block = 3, 8
    words = torch.randint(-2**31, 2**31 - 1, (7 * block,), dtype=torch.int32)
    got = read_pass(words.view(torch.uint8), programs, block)
    rows = words.numpy().reshape(7, block)
    want = [np.bitwise_xor.reduce(rows[p::programs].ravel()) for p in range(programs)]
    assert got.tolist() == [int(w) for w in want]
    with pytest.raises(ValueError, match="expected one of"):
        flush_l2(words.view(torch.uint8), "evict")
