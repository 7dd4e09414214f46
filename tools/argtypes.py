"""argparse types shared by the ``kvconnector`` subcommands: each refuses a bad value with one line."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port: 1..65535, or 0 for "any free port" (the command prints the port it bound)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (0 = any free port, or 1..65535), got {text!r}")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected 0 (any free port) or 1..65535, got {port}")
    return port


def _bounded(parse, low: float, what: str):
    """An argparse type: ``parse(text)``, refused with one line unless ``>= low`` (nan too)."""
    def check(text: str):
        try:
            x = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if not x >= low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return x
    return check


positive_int = _bounded(int, 1, "an integer >= 1")
non_negative_int = _bounded(int, 0, "an integer >= 0")
non_negative_float = _bounded(float, 0.0, "a number >= 0")     # durations, timeouts


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (leases, deadlines, sizes), else one line."""
    x = non_negative_float(text)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return x


def cache_mode(text: str) -> str:
    """A vLLM ``--kv-cache-dtype`` string the layouts accept (checked here, kept as the string)."""
    from layouts import get_kv_quant_mode

    try:
        get_kv_quant_mode(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0])
    return text


def cache_mode_list(text: str) -> str:
    """Comma-separated cache modes, each checked by :func:`cache_mode` (kept as the string)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated cache modes, got {text!r}")
    for p in parts:
        cache_mode(p)
    return ",".join(parts)


def int_list(text: str) -> str:
    """Comma-separated ints >= 1 (kept as the string)."""
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return text


def positive_float_list(text: str) -> list[float]:
    """Comma-separated numbers, each a :func:`positive_float` (message sizes in MiB, say)."""
    return [positive_float(p) for p in text.split(",")]
