"""The `kvconnector` console command: help lists the tools; quickstart runs end to end.

Run: python -m pytest tests/test_cli.py
"""

import subprocess
import sys


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0
    assert "quickstart" in r.stdout


def test_quickstart_reports_every_mode():
    r = _cli("quickstart", "--tokens", "64", "--head-size", "64")
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.split()}
    assert {"auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"} <= set(lines)
    # block bytes: bf16 2*N*H*2d, int4 2*N*H*(d/2+4) with N=16, H=4, d=64
    assert int(lines["auto"][1]) == 2 * 16 * 4 * 128 and int(lines["int4_per_token_head"][1]) == 2 * 16 * 4 * 36
    attn_err = {m: float(v[5]) for m, v in lines.items() if m.endswith("head")}
    assert attn_err["int8_per_token_head"] < 0.02 < attn_err["int4_per_token_head"] < 0.25


def test_bench_kernels_dispatches_to_a_part():
    r = _cli("bench-kernels", "--part", "write", "--quick")
    assert r.returncode == 0, r.stderr
    assert "# bench-kernels: write" in r.stdout and "| int4 |" in r.stdout
    assert "# bench-kernels: attention" not in r.stdout
    r = _cli("bench-kernels", "--", "--quick")
    assert r.returncode != 0 and "need one --part" in r.stderr
