"""CUDA-graph timing shared by the kernel benchmarks (``bench.write``, ``bench.attention``,
``bench.probe_reads``)."""

from __future__ import annotations

import torch
import triton.language as tl

from kernels._jit import dual_jit


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


FLUSH_BYTES = 256 * 2**20  # well over the H200's 60 MiB L2: one pass over it evicts every cached line
# each flush kind -> its kernel's name in the profiler's kernel list (the write flush is ``zero_``)
FLUSH_KERNELS = {"read": "_read_flush_kernel", "write": "FillFunctor<unsigned char>"}
FLUSHES = tuple(FLUSH_KERNELS)


def flush_l2(buf, kind: str = "read") -> None:
    """Evict every line of the L2 by one pass over ``buf`` (a CUDA uint8 buffer of
    :data:`FLUSH_BYTES`).

    ``read`` leaves the L2 holding clean lines of ``buf``, as a serving step leaves it before an
    attention call (the layers between two calls of one layer read weights and other layers' KV
    and write little). ``write`` (``buf.zero_()``) leaves it full of dirty lines, so the call
    timed next also pays for writing up to an L2 of someone else's bytes back to memory, in
    proportion to the lines it brings in."""
    if kind == "write":
        buf.zero_()
    elif kind == "read":
        read_pass(buf)
    else:
        raise ValueError(f"flush {kind!r}: expected one of {FLUSHES}")


def read_pass(buf, programs: int = 1056, block: int = 2048):
    """Read every 32-bit word of ``buf`` (its size a multiple of ``4 * block`` bytes) once:
    program ``p`` XORs the blocks ``p, p + programs, ...`` of ``block`` words and stores one word.
    Returns those ``programs`` words (int32), so the pass writes 4 bytes per program. Defaults:
    8 programs per H200 SM, 8 KiB per load step."""
    words = buf.view(torch.int32)
    out = torch.empty(programs, dtype=torch.int32, device=buf.device)
    _read_flush_kernel[(programs,)](words, out, words.numel(), BLOCK=block)
    return out


@dual_jit
def _read_flush_kernel(src, out, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, step):
        acc ^= tl.load(src + start + tl.arange(0, BLOCK))
    tl.store(out + pid, tl.xor_sum(acc, 0))


def cold_graph_us(fn, rep_ms: float, flush, kind: str = "read") -> float:
    """µs of one ``fn()`` with a cold L2: the median of CUDA-graph replays of
    :func:`flush_l2` then ``fn()``, minus the median of replays of the flush alone (measured
    here, in the same run). ``flush``: a CUDA uint8 buffer of :data:`FLUSH_BYTES`; ``kind``: one of :data:`FLUSHES`."""
    def flushed():
        flush_l2(flush, kind)
        fn()
    return graph_us(flushed, rep_ms) - graph_us(lambda: flush_l2(flush, kind), rep_ms)
