"""How the ``kvconnector`` command reports a failure: one line on stderr, a non-zero exit.

A *usage or environment* error (a bad option value, a missing file, a port in use, a peer
that does not answer, a layout mismatch) is one line ``kvconnector <cmd>: error: <Type>: <msg>``
and exit code 2 (:data:`USAGE_ERRORS`; a missing optional package such as ``gguf`` counts,
a missing module of this project does not). Anything else is a bug in this project: its
traceback is kept and labelled as one, exit code 70 (``EX_SOFTWARE``).
"""

from __future__ import annotations

import os
import sys
import traceback

from layouts import KVCacheError

EXIT_USAGE = 2
EXIT_BUG = 70


class UsageError(Exception):
    """A wrong command line found after parsing (e.g. two options that exclude each other)."""


def _usage_errors() -> tuple:
    errs = [KVCacheError, UsageError, ValueError, OSError, TimeoutError, EOFError, ModuleNotFoundError]
    try:
        import zmq
        errs.append(zmq.ZMQError)
    except ImportError:
        pass
    return tuple(errs)


USAGE_ERRORS = _usage_errors()


def one_line(e: BaseException) -> str:
    """An exception as one line (multi-line messages such as layout mismatches joined by '; ')."""
    parts = [s.strip() for s in str(e).splitlines() if s.strip()]
    return "; ".join(parts).replace(":; ", ": ") or type(e).__name__


def error_line(command: str, e: BaseException) -> str:
    """``kvconnector <command>: error: <Type>: <message>``."""
    kind = "" if isinstance(e, UsageError) else f"{type(e).__name__}: "
    return f"kvconnector {command}: error: {kind}{one_line(e)}"


OWN_PACKAGES = ("kvconnector", "kernels", "layouts", "tools", "bench")


def _own_module_missing(e: BaseException) -> bool:
    """A missing optional package (gguf, prometheus_client, ...) is the user's environment; a
    missing module of this project is a bug."""
    return isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OWN_PACKAGES


def run_guarded(command: str, fn, args) -> int:
    """Run ``fn(args)``; usage errors become one stderr line and exit 2, bugs keep their traceback."""
    try:
        return int(fn(args) or 0)
    except KeyboardInterrupt:
        print(f"kvconnector {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # `kvconnector inspect ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USAGE_ERRORS as e:
        if _own_module_missing(e):
            return _bug(command)
        print(error_line(command, e), file=sys.stderr)
        return EXIT_USAGE
    except Exception:
        return _bug(command)


def _bug(command: str) -> int:
    traceback.print_exc()
    print(f"kvconnector {command}: internal error (a bug in kvconnector; please report it with the "
          f"traceback above)", file=sys.stderr)
    return EXIT_BUG
