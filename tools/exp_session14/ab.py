"""What the session 14 probes share: check every configuration against the oracle, time them in
interleaved rounds of CUDA-graph replays, and write one line per shape.

A run is ``(name, problem, config)`` or ``(name, problem, config, setting)``; ``apply(setting)``
is called before each check and timing of a run that has one (e.g. a module flag of the launcher)."""
from __future__ import annotations

import argparse

import torch

from tools import bench_attention as ba
from tools.timing import tee


def parser(doc: str, shapes: str) -> argparse.ArgumentParser:
    """The probes' common options: ``--shapes`` (BATCHxCONTEXT, comma separated), ``--rounds``, ``--out``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    return ap


def start(args, what: str, device: str = "cuda"):
    """30 ms of timing per configuration; the header line (device, torch, ``what``) written to
    stdout and ``args.out``; returns the ``log`` function and the problem parameters (``ba.FULL``
    on CUDA, ``ba.QUICK`` on the CPU)."""
    log = tee(args.out)
    ba.REP_MS = 30
    p = dict(ba.FULL if device == "cuda" else ba.QUICK)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    log(f"# {name}, torch {torch.__version__}; {what}; µs per call, best of {args.rounds} interleaved rounds; "
        "ratio = the first run's best / this one's")
    return log, p


def check(runs, label: str, apply=None) -> list:
    """Relative L2 of each run against the oracle; AssertionError past 1e-2."""
    errs = []
    for name, pb, cfg, *setting in runs:
        if apply and setting:
            apply(setting[0])
        e = ba.check(pb, cfg)
        if not e <= 1e-2:
            raise AssertionError(f"{label} {name}: relative L2 {e:.2e}")
        errs.append(e)
    return errs


def time_rounds(runs, rounds: int, apply=None) -> list:
    """µs per call of each run in each of ``rounds`` interleaved rounds."""
    times = [[] for _ in runs]
    for _ in range(rounds):
        for i, (_, pb, cfg, *setting) in enumerate(runs):
            if apply and setting:
                apply(setting[0])
            times[i].append(ba.time_us(pb, cfg))
    return times


def line(label: str, runs, times) -> str:
    """``label: name best (ratio to the first run's best, rounds ...); ...``."""
    best = [min(t) for t in times]
    return f"{label}: " + "; ".join(
        f"{r[0]} {b:.1f} ({best[0] / b:.2f}x, rounds {' '.join(f'{x:.1f}' for x in t)})"
        for r, b, t in zip(runs, best, times))
