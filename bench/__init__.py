"""Benchmarks and measurement tools (run as ``python -m bench.<name> --help``; never collected
by pytest)."""
