"""The `kvconnector` console command: help, --version, examples, quickstart, and the error table.

The error table runs every wrong usage found so far in a fresh interpreter (what a user
sees): each must exit non-zero with exactly one line on stderr, starting with
``kvconnector``, and no Python traceback. A real bug keeps its traceback, labelled as one.

Run: python -m pytest tests/test_cli.py
"""

import os
import socket
import subprocess
import sys

import pytest

from tools.cli import COMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tools.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0
    assert "quickstart" in r.stdout


def test_version():
    from kvconnector import PROTOCOL_VERSION, __version__
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"kvconnector {__version__} (wire protocol {PROTOCOL_VERSION}")


@pytest.mark.parametrize("command", list(COMMANDS), ids=list(COMMANDS))
def test_every_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    examples = out[out.index("examples:"):]
    assert f"kvconnector {command}" in examples


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
    if "CPU" in r.stdout:   # interpreted kernels: no fake timings
        assert " nan " not in r.stdout and "| n/a |" in r.stdout
    r = _cli("bench-kernels", "--", "--quick")
    assert r.returncode != 0 and "need one --part" in r.stderr


@pytest.fixture(scope="module")
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


# (id, argv, text the one stderr line must contain); "{busy}" is a port some socket holds
WRONG_USAGES = [
    ("eval-missing-text", ["eval", "--text", "/nonexistent/text.txt", "--model", "synthetic"], "/nonexistent/text.txt"),
    ("eval-bad-variant", ["eval", "--variants", "int3"], "--variants"),
    ("quickstart-head-size-100", ["quickstart", "--head-size", "100", "--tokens", "16"], "power of two"),
    ("quickstart-zero-tokens", ["quickstart", "--tokens", "0"], "--tokens"),
    ("bench-transfer-int3", ["bench-transfer", "--modes", "int3"], "int3"),
    ("bench-transfer-quick-int3", ["bench-transfer", "--quick", "--modes", "int4_per_token_head,int3"], "int3"),
    ("bench-transfer-bad-blocks", ["bench-transfer", "--blocks", "16,x"], "--blocks"),
    ("bench-transfer-bad-chunk", ["bench-transfer", "--chunk-mb", "1,0"], "--chunk-mb"),
    ("serve-port-in-use", ["serve", "--port", "{busy}", "--layers", "1", "--num-blocks", "4",
                           "--blocks-per-transfer", "2", "--fill", "random"], "{busy}"),
    ("serve-bad-host", ["serve", "--host", "no-such-host.invalid", "--layers", "1", "--num-blocks", "4",
                        "--blocks-per-transfer", "2", "--fill", "random"], "no-such-host.invalid"),
    ("serve-port-99999", ["serve", "--port", "99999"], "99999"),
    ("serve-port-negative", ["serve", "--port", "-5"], "-5"),
    ("serve-metrics-port-70000", ["serve", "--metrics-port", "70000"], "70000"),
    ("serve-bad-mode", ["serve", "--mode", "int3_per_token_head"], "int3_per_token_head"),
    ("serve-plan-too-big", ["serve", "--num-blocks", "4", "--blocks-per-transfer", "9", "--layers", "1"],
     "--blocks-per-transfer"),
    ("serve-missing-dump", ["serve", "--from-dump", "/nonexistent.kvd"], "/nonexistent.kvd"),
    ("dump-dead-endpoint", ["dump", "--endpoint", "tcp://127.0.0.1:{busy}", "-o", "/tmp/never.kvd", "--timeout", "1"],
     "no answer"),
    ("dump-bad-endpoint", ["dump", "--endpoint", "not-an-endpoint", "-o", "/tmp/never.kvd"], "not-an-endpoint"),
    ("dump-nothing", ["dump", "-o", "/tmp/never.kvd"], "--endpoint"),
    ("inspect-missing-file", ["inspect", "/nonexistent.kvd"], "/nonexistent.kvd"),
    ("verify-missing-file", ["verify", "/nonexistent.kvd"], "/nonexistent.kvd"),
    ("diff-missing-arg", ["diff", "a.kvd"], "required"),
    ("demo-bad-mode", ["demo", "--mode", "int3_per_token_head"], "int3_per_token_head"),
    ("demo-zero-tokens", ["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("unknown-command", ["frobnicate"], "frobnicate"),
    ("unknown-option", ["quickstart", "--frob"], "--frob"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("argv,needle", [(a, n) for _, a, n in WRONG_USAGES], ids=[i for i, _, _ in WRONG_USAGES])
def test_wrong_usage_is_one_line(argv, needle, busy_port):
    argv = [a.replace("{busy}", str(busy_port)) for a in argv]
    r = _cli(*argv, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0, (argv, r.stdout[-500:])
    assert "Traceback" not in r.stderr and len(err) == 1, r.stderr
    assert err[0].startswith("kvconnector"), err[0]
    assert needle.replace("{busy}", str(busy_port)) in err[0], err[0]


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """An exception that is not a usage error is labelled as a bug, traceback included (exit 70)."""
    import tools.quickstart as qs

    monkeypatch.setattr(qs, "run", lambda args: {}["no such key"])
    rc = main(["quickstart"])
    err = capsys.readouterr().err
    assert rc == 70 and "Traceback" in err and "KeyError" in err and "a bug in kvconnector" in err


def test_missing_optional_package_is_usage_but_own_module_is_a_bug(monkeypatch, capsys):
    import tools.quickstart as qs

    def missing(name):
        def run(args):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return run
    monkeypatch.setattr(qs, "run", missing("prometheus_client"))
    assert main(["quickstart"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "prometheus_client" in err
    monkeypatch.setattr(qs, "run", missing("kvconnector.nope"))
    assert main(["quickstart"]) == 70
    assert "Traceback" in capsys.readouterr().err
