"""``kvconnector`` console command: one subcommand per tool module.

Each tool module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (exit code) and
a one-line module docstring used as its help. Modules are imported only when their
subcommand runs, so ``kvconnector --help`` stays fast and a missing optional dependency of
one tool never breaks another.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "tools.demo",
    "eval": "tools.eval_accuracy",
    "quickstart": "tools.quickstart",
    "serve": "tools.serve",
    "dump": "tools.dump",
    "inspect": "tools.inspect_dump",
    "verify": "tools.verify_dump",
    "diff": "tools.diff_dump",
    "load": "tools.load_dump",
    "bench-kernels": "tools.bench_kernels",
    "bench-transfer": "bench.transfer",
    "proxy": "tools.proxy",
}


def _load(name: str):
    try:
        return importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as e:
        if e.name == COMMANDS[name]:
            return None
        raise


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvconnector", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name in COMMANDS:
        if wanted and name != wanted:
            sub.add_parser(name)
            continue
        mod = _load(name)
        if mod is None:
            continue
        doc = (mod.__doc__ or name).strip().splitlines()[0]
        p = sub.add_parser(name, help=doc, description=doc)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
