"""Benchmark the Triton kernels: the write part (bench/write.py) and the attention part (bench/attention.py).

``kvconnector bench-kernels --part write|attention|all [-- <part options>]``. With ``--quick`` both
parts run their small CPU smoke shapes. Each part prints its own markdown table with the GPU
name and command; options after ``--`` go to the chosen part unchanged. Without a GPU the
kernels run in Triton's interpreter: times, bandwidths and speed-ups are then not
measurements, and their table cells print ``n/a`` (the correctness columns stay).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys

import torch

from bench import attention as bench_attention, write as bench_write

from .errors import UsageError

PARTS = {"write": bench_write, "attention": bench_attention}
EXAMPLES = """\
  kvconnector bench-kernels --quick                     # both parts, small shapes (CPU smoke run)
  kvconnector bench-kernels --part attention            # on a GPU: the decode/prefill table
  kvconnector bench-kernels --part write -- --quick     # options after -- go to the part
"""
# table columns that are timings on a GPU and meaningless under the interpreter
_TIMING_COLUMN = re.compile(r"µs|us\b|GB/s|%|speed-up|ms\b", re.IGNORECASE)


class _NoTimings(io.TextIOBase):
    """Line filter for CPU runs: timing cells of markdown tables and the copy-bandwidth line -> n/a."""

    def __init__(self, out) -> None:
        self.out, self.buf, self.timing_cols = out, "", None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.out.write(self._filter(line) + "\n")
        self.out.flush()
        return len(s)

    def flush(self) -> None:
        if self.buf:
            self.out.write(self._filter(self.buf))
            self.buf = ""
        self.out.flush()

    def _filter(self, line: str) -> str:
        if not line.startswith("|"):
            self.timing_cols = None if not line.strip() else self.timing_cols
            return re.sub(r"bandwidth nan GB/s", "bandwidth n/a", line)
        cells = line.strip().strip("|").split("|")
        if self.timing_cols is None:                      # a header row
            self.timing_cols = {i for i, c in enumerate(cells) if _TIMING_COLUMN.search(c)}
            return line
        if all(set(c.strip()) <= set("-:") for c in cells):   # the separator row
            return line
        return "|" + "|".join(" n/a " if i in self.timing_cols else c for i, c in enumerate(cells)) + "|"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["all", *PARTS], default="all")
    p.add_argument("--quick", action="store_true", help="small shapes of every part (CI smoke test, CPU)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the part (after --)")


def run(args) -> int:
    from tools.cli import OneLineParser

    rest = [a for a in args.rest if a != "--"]
    names = list(PARTS) if args.part == "all" else [args.part]
    if rest and len(names) > 1:
        raise UsageError("options after -- need one --part (write or attention)")
    interpreted = not torch.cuda.is_available()
    status = 0
    for name in names:
        sub = OneLineParser(prog=f"kvconnector bench-kernels --part {name}")
        PARTS[name].add_arguments(sub)
        part_args = sub.parse_args((["--quick"] if args.quick else []) + rest)
        print(f"\n# bench-kernels: {name}\n", flush=True)
        if interpreted:
            print("(no GPU: Triton's interpreter runs the kernels; timing columns print n/a)\n", flush=True)
        out = _NoTimings(sys.stdout) if interpreted else sys.stdout
        with contextlib.redirect_stdout(out):
            status |= int(PARTS[name].run(part_args) or 0)
        out.flush()
    return status
