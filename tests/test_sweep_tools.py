"""The GPU sweep helpers' CPU-side logic: decode sweep configurations, the profiling driver's
``--cfg`` and the read probes' addressing (the timing itself needs a GPU).

Run: python -m pytest tests/test_sweep_tools.py -q
"""

import pytest

from kernels._attn_launch import AttnConfig
from bench import attention as B
from bench import profile_decode as P
from bench import sweep_decode as S


def test_sweep_configs_default_first_old_default_and_segment_scaling():
    pb = B.make_problem(B.MODES["int8"], 2, 64, 1, B.QUICK, "cpu")
    base = AttnConfig(16, 32, 4, 1, 2, 3)
    got = S.configs(base, B.MODES["int8"], [(64, 2, 2, 3), (32, 1, 2, 3)], [0.5, 1, 2], [], True, pb)
    assert got[0] == base
    assert got[1].v2 == 0  # the previous (v1) INT8 default, from the launcher with v3 switched off
    assert S.L.DECODE_V2[B.MODES["int8"]] == 3  # and switched back on
    assert [c.num_segments for c in got[2:] if c.tile == 64] == [2, 4, 8]  # 4 x (0.5, 1, 2) x 64 / 64
    # 4 x (0.5, 1, 2) x 64 / 32; the first equals the default and is not repeated
    assert [c.num_segments for c in got if c.tile == 32 and c.v2 == 3] == [4, 8, 16]
    assert len(got) == len(set(got))
    explicit = S.configs(base, B.MODES["int4"], [(64, 2, 2, 3)], [1], [3, 5], True, pb)
    assert [c.num_segments for c in explicit[1:]] == [3, 5]  # no old default for INT4
    v4 = S.configs(base, B.MODES["int8"], [(16, 1, 2, 4, 1), (16, 4, 2, 4)], [1], [8], False, pb)
    assert [(c.v2, c.heads_per_program) for c in v4[1:]] == [(4, 1), (4, 0)]  # optional 5th field


def test_profile_decode_cfg_and_no_gpu_exit(monkeypatch, capsys):
    base = AttnConfig(16, 64, 16, 2, 2, 3)
    assert P.parse_cfg("32:1:2:3:8", base) == AttnConfig(16, 32, 8, 1, 2, 3)
    assert P.parse_cfg("32:1:2:3", base).num_segments == 32  # the default's keys per segment kept
    assert P.parse_cfg("128:4:3:0", base).num_segments == 8
    # v4: one KV head per program unless asked (0 = all heads), or the launcher's own v4 choice
    assert P.parse_cfg("16:1:2:4", base).heads_per_program == 1
    assert P.parse_cfg("16:4:2:4:8:0", base).heads_per_program == 0
    v4 = AttnConfig(16, 32, 16, 1, 2, 4, heads_per_program=2)
    assert P.parse_cfg("16:1:2:4", v4).heads_per_program == 2 and P.parse_cfg("16:1:2:3", v4).heads_per_program == 0
    monkeypatch.setattr(P.torch.cuda, "is_available", lambda: False)
    assert P.main(["--mode", "int4"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bench_decode_v4_arguments_and_no_gpu_exit(monkeypatch, capsys):
    """bench/bench_decode_v4.py: malformed shapes, variants or modes are argparse errors (exit 2)
    before any GPU work; without a GPU it says so and returns 1."""
    from bench import bench_decode_v4 as V4
    for bad in (["--variants", "16:1:2"], ["--variants", "16:1:x:8:1"], ["--shapes", "8"], ["--modes", "int5"],
                ["--rounds", "0"], ["--placements", "0"], ["--placements", "x"]):
        with pytest.raises(SystemExit) as e:
            V4.main(bad)
        assert e.value.code == 2, bad
    monkeypatch.setattr(V4.torch.cuda, "is_available", lambda: False)
    assert V4.main(["--variants", "16:1:2:8:1 32:1:2:8:1:0:168", "--rounds", "2", "--placements", "3"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bench_decode_v6_arguments_and_no_gpu_exit(monkeypatch, capsys):
    """bench/bench_decode_v6.py: malformed shapes, rounds, ring depths or segment counts are argparse
    errors (exit 2) before any GPU work; without a GPU it says so and returns 1; its v6 segment
    counts bracket the launcher's, at each ring depth asked for (only the launcher's with
    ``spread=False``; given counts, once each, with ``segments``)."""
    from bench import bench_decode_v6 as V6
    for bad in (["--shapes", "8"], ["--shapes", "8xk"], ["--shapes", "0x4096"], ["--rounds", "0"],
                ["--stages", "1,3"], ["--stages", "x"], ["--segments", "1,32"], ["--segments", "a"]):
        with pytest.raises(SystemExit) as e:
            V6.main(bad)
        assert e.value.code == 2, bad
    monkeypatch.setattr(V6.torch.cuda, "is_available", lambda: False)
    assert V6.main(["--shapes", "8x32768", "--probe"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    v4, s6, v6s = V6.configs(132, 8, 32768, 8)
    assert (v4.v2, s6, [c.num_segments for c in v6s]) == (4, 33, [16, 33, 66])  # 264 programs on 132 SMs
    assert all(c.v2 == 6 and c.tile == 16 and c.num_stages == V6.L6.STAGES for c in v6s)
    _, _, v6s = V6.configs(132, 8, 32768, 8, (2, 4), spread=False)
    assert [(c.num_segments, c.num_stages) for c in v6s] == [(33, 2), (33, 4)]
    _, _, v6s = V6.configs(132, 8, 32768, 8, (4,), segments=(33, 32, 33))  # 33: 264 programs on 132 SMs
    assert [c.num_segments for c in v6s] == [32, 33]


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
