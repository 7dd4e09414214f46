"""Benchmark the cache-write kernels against a device-to-device copy of the same bytes.

For each shape (num_tokens x 8 kv heads x head_size) and mode (bf16, int8, fp8, int4, int4 with
the MSE encoder) prints µs per call and GB/s counting bytes read (K, V, slot_mapping) plus bytes
written (codes and scales), next to ``torch`` copying the same number of bytes (read + write)
in the same run. ``--check`` first compares every mode with the PyTorch oracle on realistic
shapes; ``--sweep`` times INT4 tile/rotation/division variants; ``--compare`` checks and times the
default INT4 kernel (tensor-core rotation) against the shuffle and fused tl.dot ones and the
INT8/FP8 tiles against the previous ones, next to bf16. ``--slots blocks`` writes whole blocks in
order instead of a random slot per token. Run:
``PYTHONPATH=. python bench/write.py [--quick] [--check] [--sweep] [--compare] [--slots blocks]``.
On CUDA every time is the median of CUDA-graph replays (since session 9; before, plain launches,
whose host time, 90-150 µs per call on the H200 machine, hid shorter kernels); the table ends
with the launcher's host time per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from kernels.reference import dequantize_rows, reference_reshape_and_cache
from kernels.write import reshape_and_cache_flash, triton_reshape_and_cache_flash_per_token_head_quant
from layouts import CacheGeometry, KVQuantMode, split_kv_cache
from bench.timing import graph_us

M = KVQuantMode
MODES = {"bf16": M.NONE, "int8": M.INT8_PER_TOKEN_HEAD, "fp8": M.FP8_PER_TOKEN_HEAD,
         "int4": M.INT4_PER_TOKEN_HEAD, "int4-mse": M.INT4_PER_TOKEN_HEAD}
MSE_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
NUM_KV_HEADS, BLOCK_SIZE = 8, 16
L2_FLUSH_BYTES = 256 << 20  # rotate input sets until one pass touches several L2s (60 MB)


SLOTS = {"order": "tokens"}  # --slots: "tokens" (random per token) or "blocks" (random blocks, in order within)


def _setup(num_tokens, head_size, mode_name, device, dtype=torch.bfloat16, num_sets=1, offset_blocks=1):
    """Input sets and a packed cache per set (views at a nonzero storage offset)."""
    mode = MODES[mode_name]
    geo = CacheGeometry(mode, head_size, NUM_KV_HEADS, BLOCK_SIZE, dtype)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    sets = []
    for _ in range(num_sets):
        key = torch.randn(num_tokens, NUM_KV_HEADS, head_size, dtype=dtype, device=device)
        value = torch.randn_like(key)
        if SLOTS["order"] == "blocks":  # as a prefill writes: whole blocks at random places, tokens in order
            blocks = torch.randperm(num_blocks, device=device)
            slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()[:num_tokens]
        else:  # every token at a random slot (the worst case for the stores)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
        whole = geo.new_cache(num_blocks + offset_blocks, device)
        cache = whole[offset_blocks:]
        sets.append((key, value, slots, cache, split_kv_cache(cache, mode, head_size)))
    return geo, sets


def _write(mode_name, key, value, slots, views, **kw):
    mode = MODES[mode_name]
    if mode == M.NONE:
        return reshape_and_cache_flash(key, value, views.key_cache, views.value_cache, slots, check_slots=False, **kw)
    if mode_name == "int4-mse":
        kw["shrink"] = MSE_SHRINK
    return triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache, slots,
        mode, check_slots=False, **kw)


def _bytes(geo, num_tokens, dtype=torch.bfloat16) -> int:
    """Bytes one write moves: K and V read, slot_mapping read, codes and scales written."""
    rows = num_tokens * geo.num_kv_heads
    return 2 * rows * geo.head_size * dtype.itemsize + 8 * num_tokens + 2 * rows * geo.row_bytes


def _time_us(fn, device, calls: int = 1) -> float:
    """µs per call of ``fn``, which makes ``calls`` calls. CUDA: the median of CUDA-graph replays, so
    the time is the GPU's alone: without a graph, calls shorter than the launcher's host time
    (tens of µs of Python per call, see :func:`host_us`) measure the host, not the kernel."""
    if device.type == "cuda":  # BW_NOSYNC=1 skips graph_us's sync: session 9's stops, bench/write.md
        return graph_us(fn, 100, calls, sync=not os.environ.get("BW_NOSYNC"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / calls


def _each(sets, call):
    """One call per input set, in order (one graph replay rotates through all of them)."""
    def fn():
        for s in sets:
            call(*s)
    return fn


def _num_sets(nbytes, device) -> int:
    return 1 if device.type != "cuda" else max(1, min(16, -(-L2_FLUSH_BYTES // nbytes)))


def timing_sets(mode_name, num_tokens, head_size, device):
    """(bytes one write moves, input sets that one pass rotates through so it leaves the L2 cold)."""
    geo, probe = _setup(num_tokens, head_size, mode_name, device)
    nbytes = _bytes(geo, num_tokens)
    del probe
    return nbytes, _setup(num_tokens, head_size, mode_name, device, num_sets=_num_sets(nbytes, device))[1]


def interleaved_us(sets, calls: dict, nbytes, device, rounds):
    """``rounds`` rounds of every ``calls[name](key, value, slots, cache, views)`` over ``sets`` in
    turn, then a copy of ``nbytes``: ({name: µs per call, a value per round}, [copy µs per round])."""
    times, copy = {name: [] for name in calls}, []
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(_time_us(_each(sets, call), device, len(sets)))
        copy.append(time_copy(nbytes, device))
    return times, copy


def time_write(mode_name, num_tokens, head_size, device, **kw):
    nbytes, sets = timing_sets(mode_name, num_tokens, head_size, device)
    us = _time_us(_each(sets, lambda k, v, s, c, views: _write(mode_name, k, v, s, views, **kw)), device, len(sets))
    return us, nbytes


def host_us(mode_name, head_size, device, calls: int = 200, **kw) -> float:
    """Host time per call of one write of 1 token (argument checks, launch), calls queued back to
    back without waiting for the GPU: what a caller pays per layer and step outside a CUDA graph."""
    _, sets = _setup(1, head_size, mode_name, device)
    k, v, s, _, views = sets[0]
    for _ in range(10):
        _write(mode_name, k, v, s, views, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(calls):
        _write(mode_name, k, v, s, views, **kw)
    us = (time.perf_counter() - t) / calls * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return us


def time_copy(nbytes, device):
    """A device-to-device copy that reads nbytes/2 and writes nbytes/2."""
    half = nbytes // 2
    n = _num_sets(nbytes, device)
    bufs = [(torch.empty(half, dtype=torch.uint8, device=device).random_(),
             torch.empty(half, dtype=torch.uint8, device=device)) for _ in range(n)]
    fn = _each(bufs, lambda src, dst: dst.copy_(src))
    us = _time_us(fn, device, len(bufs))
    if device.type == "cuda":  # a graph runs a large copy_ as a memcpy node, measured at ~2.8 TB/s
        import triton.testing       # where the launched copy reaches ~4.2: the faster of the two
        us = min(us, 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / len(bufs))
    return us


def run_table(args, device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"\n## write kernels on {name}\n\ncommand: `{' '.join(sys.argv)}`; {NUM_KV_HEADS} kv heads, "
          f"block_size {BLOCK_SIZE}, bf16 inputs, packed-cache views, slots: {SLOTS['order']}; "
          f"GB/s = (bytes read + written) / time\n")
    print("| tokens | head_size | mode | µs | GB/s | copy µs | copy GB/s | % of copy |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for num_tokens in args.tokens:
        for head_size in args.head_sizes:
            for mode_name in args.modes:
                us, nbytes = time_write(mode_name, num_tokens, head_size, device)
                cus = time_copy(nbytes, device)
                gbs, cgbs = nbytes / us / 1e3, nbytes / cus / 1e3
                results.append((num_tokens, head_size, mode_name, us, gbs, cus, cgbs))
                print(f"| {num_tokens} | {head_size} | {mode_name} | {us:.1f} | {gbs:.0f} | {cus:.1f} | "
                      f"{cgbs:.0f} | {100 * gbs / cgbs:.0f}% |", flush=True)
    if device.type == "cuda":
        print("\nhost time per call outside a CUDA graph (1 token, head_size "
              f"{args.head_sizes[0]}; checks + launch, not waiting for the GPU): "
              + ", ".join(f"{m} {host_us(m, args.head_sizes[0], device):.1f} µs" for m in args.modes), flush=True)
    return results


def run_sweep(args, device):
    variants = {
        64: [dict(rotation="dot", rows=r, num_warps=w) for r in (128, 256) for w in (4, 8)]
        + [dict(rotation="butterfly", rows=32, num_warps=4)],
        128: [dict(rotation="dot", rows=r, num_warps=w) for r in (32, 64, 128) for w in (4, 8)]
        + [dict(rotation="dot", rows=64, num_warps=4, programs_per_sm=p) for p in (0, 8)]
        + [dict(rotation="dot", rows=64, num_warps=4, div=d) for d in ("rn", "fast")]
        + [dict(rotation="butterfly", rows=16, num_warps=4), dict(rotation="butterfly", rows=32, num_warps=8)],
        256: [dict(rotation="dot", rows=r, num_warps=w) for r in (32, 64) for w in (4, 8)]
        + [dict(rotation="butterfly", rows=16, num_warps=4)],
    }
    print("\n| head_size | variant | µs | GB/s | % of copy |\n|---:|---|---:|---:|---:|")
    for head_size in args.head_sizes:
        copy_us = None
        for kw in variants.get(head_size, []):
            us, nbytes = time_write("int4", args.sweep_tokens, head_size, device, **kw)
            copy_us = copy_us or time_copy(nbytes, device)
            print(f"| {head_size} | {kw} | {us:.1f} | {nbytes / us / 1e3:.0f} | {100 * copy_us / us:.0f}% |",
                  flush=True)


def _compare(mode_name, geo, ref, out):
    """Row-level comparison of two packed caches: (rows differing, codes differing, max |Δdeq|/scale
    over the K and the V rows)."""
    a, b = ref.view(torch.uint8).flatten(0, 3), out.view(torch.uint8).flatten(0, 3)
    rows_diff = int((a != b).any(-1).sum())
    if MODES[mode_name] == M.NONE or rows_diff == 0:
        return rows_diff, int((a != b).sum()), 0.0
    va, vb = split_kv_cache(ref, geo.mode, geo.head_size), split_kv_cache(out, geo.mode, geo.head_size)
    err = 0.0
    for (ca, sa), (cb, sb) in zip(((va.key_cache, va.k_scale_cache), (va.value_cache, va.v_scale_cache)),
                                  ((vb.key_cache, vb.k_scale_cache), (vb.value_cache, vb.v_scale_cache))):
        da, db = (dequantize_rows(c, sc, geo.mode, rotated=True) for c, sc in ((ca, sa), (cb, sb)))
        err = max(err, ((da - db).abs() / sa.abs().clamp(min=1e-30)[..., None]).nan_to_num(0.0).max().item())
    if geo.mode == M.INT4_PER_TOKEN_HEAD:
        from kernels.reference import unpack_int4_nibbles
        codes = int((unpack_int4_nibbles(a[:, :geo.data_bytes]) != unpack_int4_nibbles(b[:, :geo.data_bytes])).sum())
    else:
        codes = int((a[:, :geo.data_bytes] != b[:, :geo.data_bytes]).sum())
    return rows_diff, codes, err


def oracle_write(mode_name, key, value, slots, views):
    """The PyTorch oracle's write of ``key``/``value`` at ``slots`` into ``views`` (negative slots
    skipped; "int4-mse": the MSE encoder)."""
    reference_reshape_and_cache(key, value, views.key_cache, views.value_cache, slots, MODES[mode_name],
                                views.k_scale_cache, views.v_scale_cache,
                                shrink=MSE_SHRINK if mode_name == "int4-mse" else (1.0,))


def check_case(mode_name, dtype, head_size, num_tokens, device, write=None, **kw):
    """One write against the oracle on a poisoned cache with a NaN row, an Inf, a zero row and
    negative slots: (rows differing, codes differing, max |Δ dequantized| in scales). ``write``:
    ``write(key, value, slots, views)`` instead of this tree's writer with ``kw``."""
    geo, [(key, value, slots, cache, views)] = _setup(num_tokens, head_size, mode_name, device, dtype)
    key[7, 3] = float("nan")
    value[11, 0, 5] = float("inf")
    key[13] = 0.0
    slots[::97] = -1
    cache.view(torch.uint8).fill_(0xA5)  # poison: unwritten rows must stay 0xA5
    ref = cache.clone()
    oracle_write(mode_name, key, value, slots, split_kv_cache(ref, geo.mode, head_size))
    if write is None:
        _write(mode_name, key, value, slots, views, **kw)
    else:
        write(key, value, slots, views)
    return _compare(mode_name, geo, ref, cache)


COMPARE_VARIANTS = [("bf16", {}), ("int8", {}), ("fp8", {}), ("int4", {}), ("int4", dict(kernel="lanes")),
                    ("int4", dict(kernel="fused")),
                    ("int8", dict(rows=32, num_warps=4)), ("fp8", dict(rows=32, num_warps=4))]


def run_compare(args, device):
    """Defaults against the other kernels/tiles (INT4 shuffle and fused tl.dot, INT8/FP8 32 rows x 4
    warps): each variant checked against the oracle at the first token count, then timed with a
    copy of the same bytes; table printed last."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    checks, rows = [], []
    for head_size in args.head_sizes:
        for mode_name, kw in COMPARE_VARIANTS:
            n = args.tokens[0]
            rd, cd, err = check_case(mode_name, torch.bfloat16, head_size, n, device, **kw)
            checks.append(f"| {mode_name} | {kw or ''} | {head_size} | {n} | {rd} | {cd} | {err:.2f} |")
            print(checks[-1], flush=True)
            for num_tokens in args.tokens:
                us, nbytes = time_write(mode_name, num_tokens, head_size, device, **kw)
                cus = time_copy(nbytes, device)
                gbs, cgbs = nbytes / us / 1e3, nbytes / cus / 1e3
                rows.append(f"| {num_tokens} | {head_size} | {mode_name} | {kw or ''} | {us:.1f} | {gbs:.0f} | "
                            f"{cus:.1f} | {cgbs:.0f} | {100 * gbs / cgbs:.0f}% |")
                print(rows[-1], flush=True)
    print(f"\n## write kernels, defaults vs previous, on {name}\n\ncommand: `{' '.join(sys.argv)}`; {NUM_KV_HEADS} kv heads, "
          f"block_size {BLOCK_SIZE}, bf16 inputs, packed-cache views, slots: {SLOTS['order']}, "
          f"poisoned cache with NaN/Inf/zero rows "
          f"and negative slots for the check\n")
    print("| mode | options | head_size | tokens | rows differing | codes differing | max Δ (scales) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(checks))
    print("\n| tokens | head_size | mode | options | µs | GB/s | copy µs | copy GB/s | % of copy |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


def run_check(args, device):
    print("\n| mode | dtype | head_size | tokens | options | rows differing | codes differing | max Δ (scales) |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    cases = [(m, torch.bfloat16, d, {}) for d in args.head_sizes for m in args.modes]
    cases += [("int4", torch.float16, 128, {}), ("int4", torch.bfloat16, 128, dict(kernel="lanes")),
              ("int4", torch.float16, 128, dict(kernel="lanes")),
              ("int4", torch.bfloat16, 128, dict(rotation="butterfly")),
              ("int8", torch.float16, 128, {}), ("fp8", torch.float16, 128, {})]
    worst = 0
    for mode_name, dtype, head_size, kw in cases:
        num_tokens = args.check_tokens if head_size <= 128 else args.check_tokens // 2
        rows_diff, codes_diff, err = check_case(mode_name, dtype, head_size, num_tokens, device, **kw)
        worst = max(worst, rows_diff / (2 * num_tokens * NUM_KV_HEADS))
        print(f"| {mode_name} | {str(dtype)[6:]} | {head_size} | {num_tokens} | {kw or ''} | {rows_diff} | "
              f"{codes_diff} | {err:.2f} |", flush=True)
    return worst


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small shapes only (CI smoke test; runs on CPU)")
    p.add_argument("--check", action="store_true", help="compare with the PyTorch oracle first")
    p.add_argument("--sweep", action="store_true", help="time INT4 tile/rotation/division variants")
    p.add_argument("--compare", action="store_true",
                   help="defaults vs other kernels (INT4 shuffle and fused, INT8/FP8 big tiles), each checked, "
                        "instead of the main table")
    p.add_argument("--no-table", action="store_true", help="skip the main table")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--slots", choices=("tokens", "blocks"), default="tokens",
                   help="slot_mapping: each token at a random slot (default, the worst case) or whole blocks "
                        "at random places with their tokens in order (as a prefill writes)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    p.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--check-tokens", type=int, default=65536)
    p.add_argument("--sweep-tokens", type=int, default=65536)


def run(args) -> int:
    device = torch.device(args.device)
    SLOTS["order"] = getattr(args, "slots", "tokens")
    if args.quick:
        args.tokens, args.head_sizes, args.check_tokens = [64], [64], 48
    if args.check:
        worst = run_check(args, device)
        print(f"\nworst fraction of rows differing from the oracle: {worst:.2e}")
    if args.sweep:
        run_sweep(args, device)
    if args.compare:
        run_compare(args, device)
    elif not args.no_table:
        run_table(args, device)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
