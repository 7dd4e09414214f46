"""CUDA-graph timing shared by the kernel benchmarks (``bench.write``, ``bench.attention``,
``bench.probe_reads``)."""

from __future__ import annotations


def graph_us(fn, rep_ms: float, calls: int = 1, sync: bool = True) -> float:
    """µs per call of ``fn``, which makes ``calls`` calls: the median of CUDA-graph replays
    (``triton.testing.do_bench_cudagraph``), so the time is the GPU's alone.

    ``fn`` runs once first, then the device is synchronized: ``do_bench_cudagraph`` runs on a new
    side stream that does not wait for the inputs' set-up on the current one. Without the sync,
    the write benchmark's tables stopped on illegal addresses; ``sync=False`` exists only to
    reproduce that."""
    import torch
    import triton.testing

    fn()
    if sync:
        torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3 / calls


def tee(path):
    """A ``log(msg)`` that prints ``msg`` (flushed) and, when ``path`` is set, appends it to that
    file as a line: the benchmarks' ``--out``."""
    def log(msg: str) -> None:
        print(msg, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(msg + "\n")
    return log


FLUSH_BYTES = 256 * 2**20  # well over the H200's 60 MiB L2: one write of it evicts every cached line


def cold_graph_us(fn, rep_ms: float, flush) -> float:
    """µs of one ``fn()`` with a cold L2: the median of CUDA-graph replays of ``flush.zero_()``
    then ``fn()``, minus the median of replays of ``flush.zero_()`` alone (measured here, in the
    same run). ``flush``: a CUDA uint8 buffer of :data:`FLUSH_BYTES`."""
    def flushed():
        flush.zero_()
        fn()
    return graph_us(flushed, rep_ms) - graph_us(flush.zero_, rep_ms)
