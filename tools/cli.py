"""``kvconnector`` console command: one subcommand per tool module.

Each tool module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (exit code), a
one-line module docstring used as its help, and ``EXAMPLES`` (shown at the end of its
``--help``). Modules are imported only when their subcommand runs, so ``kvconnector --help``
stays fast and a missing optional dependency of one tool never breaks another.

Errors: a wrong option is one line ``kvconnector <cmd>: error: ...`` and exit 2 (argparse's
usage block is not repeated; ``--help`` shows it). A usage or environment error raised while
the command runs (missing file, port in use, unknown host, layout mismatch, ...) is the same
one line and exit 2; any other exception is a bug and keeps its traceback (exit 70). See
:mod:`tools.errors`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tools.errors import EXIT_USAGE, run_guarded

COMMANDS = {
    "demo": "tools.demo",
    "eval": "tools.eval_accuracy",
    "calibrate": "tools.calibrate",
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
    "export-hf": "tools.hf_export",
    "convert-demo": "tools.convert_demo",
}

# examples of the subcommands whose modules live outside tools/ (or predate EXAMPLES)
_EXAMPLES = {
    "load": "  kvconnector load blocks.kvd -o cache.pt          # dump -> cache file (all layers it holds)\n",
    "bench-transfer": "  kvconnector bench-transfer --quick                # tiny smoke run\n"
                      "  kvconnector bench-transfer --modes int4_per_token_head --blocks 64,256\n",
}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``<prog>: error: <message> (see --help)``."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _load(name: str):
    try:
        return importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as e:
        if e.name == COMMANDS[name]:
            return None
        raise


def version_string() -> str:
    """``kvconnector X.Y.Z (wire protocol N, layout descriptor format M)``."""
    from kvconnector import PROTOCOL_VERSION, __version__
    from layouts.descriptor import FORMAT_VERSION

    return f"kvconnector {__version__} (wire protocol {PROTOCOL_VERSION}, layout descriptor format {FORMAT_VERSION})"


def _check_bench_transfer(args) -> None:
    """bench/transfer.py takes its lists as strings: check them before anything starts."""
    from tools.argtypes import cache_mode_list, int_list

    for opt, check in (("--modes", cache_mode_list), ("--blocks", int_list)):
        value = getattr(args, opt[2:])
        if value is None:   # left to the benchmark's preset
            continue
        try:
            check(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{opt}: {e}") from None


_PRECHECKS = {"bench-transfer": _check_bench_transfer}


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``wanted``, only that subcommand's module is imported."""
    parser = OneLineParser(prog="kvconnector", description="Quantized paged KV caches (INT4/INT8/FP8 per token "
                           "and head) and their prefill -> decode transfer: one subcommand per tool.",
                           epilog="Run `kvconnector COMMAND --help` for a command's options and examples.")
    parser.add_argument("--version", action="store_true", help="print the package and protocol versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMANDS:
        if wanted and name != wanted:
            sub.add_parser(name)
            continue
        mod = _load(name)
        if mod is None:
            continue
        doc = (mod.__doc__ or name).strip().splitlines()[0]
        examples = getattr(mod, "EXAMPLES", None) or _EXAMPLES.get(name)
        p = sub.add_parser(name, help=doc, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"examples:\n{examples}" if examples else None)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:
        print(version_string())
        return 0
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(wanted)
    args = parser.parse_args(argv)
    if args.version:
        print(version_string())
        return 0
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    check = _PRECHECKS.get(args.command)

    def run(a):
        if check is not None:
            check(a)
        return a._run(a)
    return run_guarded(args.command, run, args)


if __name__ == "__main__":
    sys.exit(main())
