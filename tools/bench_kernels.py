"""Benchmark the Triton kernels: the write part (bench/write.py) and the attention part (bench/attention.py).

``kvconnector bench-kernels --part write|attention|all [-- <part options>]``. With ``--quick`` both
parts run their small CPU smoke shapes. Each part prints its own markdown table with the GPU
name and command; options after ``--`` go to the chosen part unchanged.
"""

from __future__ import annotations

import argparse

from bench import attention as bench_attention, write as bench_write

PARTS = {"write": bench_write, "attention": bench_attention}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["all", *PARTS], default="all")
    p.add_argument("--quick", action="store_true", help="small shapes of every part (CI smoke test, CPU)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the part (after --)")


def run(args) -> int:
    rest = [a for a in args.rest if a != "--"]
    names = list(PARTS) if args.part == "all" else [args.part]
    if rest and len(names) > 1:
        raise SystemExit("bench-kernels: options after -- need one --part (write or attention)")
    status = 0
    for name in names:
        sub = argparse.ArgumentParser(prog=f"bench-kernels --part {name}")
        PARTS[name].add_arguments(sub)
        part_args = sub.parse_args((["--quick"] if args.quick else []) + rest)
        print(f"\n# bench-kernels: {name}\n", flush=True)
        status |= int(PARTS[name].run(part_args) or 0)
    return status
