"""Command-line programs: dump / inspect / verify / diff, benchmarks and the P/D demo."""
