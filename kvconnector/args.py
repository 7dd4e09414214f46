"""Checks of the endpoints' numeric arguments: a one-line ValueError naming the argument.

A NaN lease never expires (every comparison with it is false), a zero peer timeout drops every
peer at the next tick, a port above 65535 binds another port than the endpoint string says: such
values are refused where they are given, not discovered as a hung lease or a refused connection.
"""

from __future__ import annotations

import math


def seconds(name: str, x, *, infinite: bool = False) -> float:
    """``x`` as a positive number of seconds (``inf`` too when ``infinite``)."""
    ok = (not isinstance(x, bool) and isinstance(x, (int, float)) and x > 0
          and (math.isfinite(x) or (infinite and x == math.inf)))
    if not ok:
        raise ValueError(f"{name}: expected a positive number of seconds{' (or inf)' if infinite else ''}, got {x!r}")
    return float(x)


def count(name: str, x, low: int, high: int | None = None) -> int:
    """``x`` as an integer in ``[low, high]`` (no upper bound when ``high`` is None)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < low or (high is not None and x > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected an integer {bound}, got {x!r}")
    return x
