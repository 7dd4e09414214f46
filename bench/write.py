"""Benchmark the cache-write kernels against a device-to-device copy of the same bytes.

For each shape (num_tokens x 8 kv heads x head_size) and mode (bf16, int8, fp8, int4, int4 with
the MSE encoder) prints µs per call and GB/s counting bytes read (K, V, slot_mapping) plus bytes
written (codes and scales), next to ``torch`` copying the same number of bytes (read + write)
in the same run. ``--check`` first compares every mode with the PyTorch oracle on realistic
shapes; ``--sweep`` times int4-fused tilings and rotations; ``--compare`` checks and times the
default INT4 path (int4-mma) against int4-lanes and int4-fused and the INT8/FP8 tiles against
32 rows x 4 warps, next to bf16; ``--plans`` prints which path :func:`kernels.write.write_plan`
picks over a grid of calls, on CPU and on an H200 (the table of ``docs/KERNELS.md``);
``--key-offset`` times the INT4 write with and without a key offset, interleaved
(``bench/write_key_offset.py``).
``--slots blocks`` writes whole blocks in order instead of a random slot per token. Run:
``python -m bench.write [--quick] [--check] [--sweep] [--compare] [--plans] [--key-offset] [--slots blocks]``.
On CUDA every time is the median of CUDA-graph replays (plain launches would time the
launcher's host work, not shorter kernels); the table ends with the launcher's host time per call.
Tuning other than the defaults is passed explicitly as ``kernels.write`` tuning objects.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kernels.reference import dequantize_rows, reference_reshape_and_cache, unpack_int4_nibbles
from kernels.write import (FusedTuning, LanesTuning, TileTuning, WriteCall, plan_for, reshape_and_cache_flash,
                           triton_reshape_and_cache_flash_per_token_head_quant)
from kernels.write.checks import WriteShape
from layouts import CacheGeometry, KVQuantMode, split_kv_cache
from bench.timing import graph_us

M = KVQuantMode
MODES = {"bf16": M.NONE, "int8": M.INT8_PER_TOKEN_HEAD, "fp8": M.FP8_PER_TOKEN_HEAD,
         "int4": M.INT4_PER_TOKEN_HEAD, "int4-mse": M.INT4_PER_TOKEN_HEAD}
MSE_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
NUM_KV_HEADS, BLOCK_SIZE = 8, 16
L2_FLUSH_BYTES = 256 << 20  # rotate input sets until one pass touches several L2s (60 MB)

SLOT_ORDERS = ("tokens", "blocks")  # --slots: random slot per token, or random blocks with tokens in order


def _setup(num_tokens, head_size, mode_name, device, dtype=torch.bfloat16, num_sets=1, offset_blocks=1,
           slot_order="tokens"):
    """Input sets and a packed cache per set (views at a nonzero storage offset)."""
    mode = MODES[mode_name]
    geo = CacheGeometry(mode, head_size, NUM_KV_HEADS, BLOCK_SIZE, dtype)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    sets = []
    for _ in range(num_sets):
        key = torch.randn(num_tokens, NUM_KV_HEADS, head_size, dtype=dtype, device=device)
        value = torch.randn_like(key)
        if slot_order == "blocks":  # as a prefill writes: whole blocks at random places, tokens in order
            blocks = torch.randperm(num_blocks, device=device)
            slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()[:num_tokens]
        else:  # every token at a random slot (the worst case for the stores)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
        whole = geo.new_cache(num_blocks + offset_blocks, device)
        cache = whole[offset_blocks:]
        sets.append((key, value, slots, cache, split_kv_cache(cache, mode, head_size)))
    return geo, sets


def _write(mode_name, key, value, slots, views, tuning=None):
    mode = MODES[mode_name]
    if mode == M.NONE:
        return reshape_and_cache_flash(key, value, views.key_cache, views.value_cache, slots, check_slots=False,
                                       tuning=tuning)
    return triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache, slots,
        mode, check_slots=False, shrink=MSE_SHRINK if mode_name == "int4-mse" else None, tuning=tuning)


def _bytes(geo, num_tokens, dtype=torch.bfloat16) -> int:
    """Bytes one write moves: K and V read, slot_mapping read, codes and scales written."""
    rows = num_tokens * geo.num_kv_heads
    return 2 * rows * geo.head_size * dtype.itemsize + 8 * num_tokens + 2 * rows * geo.row_bytes


def _time_us(fn, device, calls: int = 1) -> float:
    """µs per call of ``fn``, which makes ``calls`` calls. CUDA: the median of CUDA-graph replays, so
    the time is the GPU's alone: without a graph, calls shorter than the launcher's host time
    (tens of µs of Python per call, see :func:`host_us`) measure the host, not the kernel."""
    if device.type == "cuda":
        return graph_us(fn, 100, calls)
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


def timing_sets(mode_name, num_tokens, head_size, device, slot_order="tokens"):
    """(bytes one write moves, input sets that one pass rotates through so it leaves the L2 cold)."""
    geo, probe = _setup(num_tokens, head_size, mode_name, device)
    nbytes = _bytes(geo, num_tokens)
    del probe
    return nbytes, _setup(num_tokens, head_size, mode_name, device, num_sets=_num_sets(nbytes, device),
                          slot_order=slot_order)[1]


def time_write(mode_name, num_tokens, head_size, device, tuning=None, slot_order="tokens"):
    nbytes, sets = timing_sets(mode_name, num_tokens, head_size, device, slot_order)
    us = _time_us(_each(sets, lambda k, v, s, c, views: _write(mode_name, k, v, s, views, tuning)), device,
                  len(sets))
    return us, nbytes


def host_us(mode_name, head_size, device, calls: int = 200, tuning=None) -> float:
    """Host time per call of one write of 1 token (argument checks, launch), calls queued back to
    back without waiting for the GPU: what a caller pays per layer and step outside a CUDA graph."""
    _, sets = _setup(1, head_size, mode_name, device)
    k, v, s, _, views = sets[0]
    for _ in range(10):
        _write(mode_name, k, v, s, views, tuning)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(calls):
        _write(mode_name, k, v, s, views, tuning)
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
          f"block_size {BLOCK_SIZE}, bf16 inputs, packed-cache views, slots: {args.slots}; "
          f"GB/s = (bytes read + written) / time\n")
    print("| tokens | head_size | mode | µs | GB/s | copy µs | copy GB/s | % of copy |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for num_tokens in args.tokens:
        for head_size in args.head_sizes:
            for mode_name in args.modes:
                us, nbytes = time_write(mode_name, num_tokens, head_size, device, slot_order=args.slots)
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
    """int4-fused tilings and rotations (the path of the MSE encoder and of unaligned rows)."""
    F = FusedTuning
    variants = {
        64: [F(rotation="dot", rows=r, num_warps=w) for r in (128, 256) for w in (4, 8)]
        + [F(rotation="butterfly", rows=32, num_warps=4)],
        128: [F(rotation="dot", rows=r, num_warps=w) for r in (32, 64, 128) for w in (4, 8)]
        + [F(rotation="dot", rows=64, num_warps=4, programs_per_sm=p) for p in (0, 8)]
        + [F(rotation="butterfly", rows=16, num_warps=4), F(rotation="butterfly", rows=32, num_warps=8)],
        256: [F(rotation="dot", rows=r, num_warps=w) for r in (32, 64) for w in (4, 8)]
        + [F(rotation="butterfly", rows=16, num_warps=4)],
    }
    print("\n| head_size | variant | µs | GB/s | % of copy |\n|---:|---|---:|---:|---:|")
    for head_size in args.head_sizes:
        copy_us = None
        for tuning in variants.get(head_size, []):
            us, nbytes = time_write("int4", args.sweep_tokens, head_size, device, tuning, args.slots)
            copy_us = copy_us or time_copy(nbytes, device)
            print(f"| {head_size} | {_label(tuning)} | {us:.1f} | {nbytes / us / 1e3:.0f} | "
                  f"{100 * copy_us / us:.0f}% |", flush=True)


def _label(tuning) -> str:
    """``LanesTuning(rows=16)`` for a tuning object (its set fields only), '' for None."""
    if tuning is None:
        return ""
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(tuning).items() if v is not None)
    return f"{type(tuning).__name__}({fields})"


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


def check_case(mode_name, dtype, head_size, num_tokens, device, write=None, tuning=None, slot_order="tokens"):
    """One write against the oracle on a poisoned cache with a NaN row, an Inf, a zero row and
    negative slots: (rows differing, codes differing, max |Δ dequantized| in scales). ``write``:
    ``write(key, value, slots, views)`` instead of this tree's writer with ``tuning``."""
    geo, [(key, value, slots, cache, views)] = _setup(num_tokens, head_size, mode_name, device, dtype,
                                                      slot_order=slot_order)
    key[7, 3] = float("nan")
    value[11, 0, 5] = float("inf")
    key[13] = 0.0
    slots[::97] = -1
    cache.view(torch.uint8).fill_(0xA5)  # poison: unwritten rows must stay 0xA5
    ref = cache.clone()
    oracle_write(mode_name, key, value, slots, split_kv_cache(ref, geo.mode, head_size))
    if write is None:
        _write(mode_name, key, value, slots, views, tuning)
    else:
        write(key, value, slots, views)
    return _compare(mode_name, geo, ref, cache)


COMPARE_VARIANTS = [("bf16", None), ("int8", None), ("fp8", None), ("int4", None), ("int4", LanesTuning()),
                    ("int4", FusedTuning()),
                    ("int8", TileTuning(rows=32, num_warps=4)), ("fp8", TileTuning(rows=32, num_warps=4))]


def run_compare(args, device):
    """Defaults against the other paths / tiles (INT4: int4-lanes and int4-fused; INT8/FP8: 32 rows x
    4 warps): each variant checked against the oracle at the first token count, then timed with a
    copy of the same bytes; table printed last."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    checks, rows = [], []
    for head_size in args.head_sizes:
        for mode_name, tuning in COMPARE_VARIANTS:
            n = args.tokens[0]
            rd, cd, err = check_case(mode_name, torch.bfloat16, head_size, n, device, tuning=tuning,
                                     slot_order=args.slots)
            checks.append(f"| {mode_name} | {_label(tuning)} | {head_size} | {n} | {rd} | {cd} | {err:.2f} |")
            print(checks[-1], flush=True)
            for num_tokens in args.tokens:
                us, nbytes = time_write(mode_name, num_tokens, head_size, device, tuning, args.slots)
                cus = time_copy(nbytes, device)
                gbs, cgbs = nbytes / us / 1e3, nbytes / cus / 1e3
                rows.append(f"| {num_tokens} | {head_size} | {mode_name} | {_label(tuning)} | {us:.1f} | {gbs:.0f} | "
                            f"{cus:.1f} | {cgbs:.0f} | {100 * gbs / cgbs:.0f}% |")
                print(rows[-1], flush=True)
    print(f"\n## write kernels, defaults vs the other paths and tiles, on {name}\n\ncommand: `{' '.join(sys.argv)}`; {NUM_KV_HEADS} kv heads, "
          f"block_size {BLOCK_SIZE}, bf16 inputs, packed-cache views, slots: {args.slots}, "
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
    cases = [(m, torch.bfloat16, d, None) for d in args.head_sizes for m in args.modes]
    cases += [("int4", torch.float16, 128, None), ("int4", torch.bfloat16, 128, LanesTuning()),
              ("int4", torch.float16, 128, LanesTuning()),
              ("int4", torch.bfloat16, 128, FusedTuning(rotation="butterfly")),
              ("int8", torch.float16, 128, None), ("fp8", torch.float16, 128, None)]
    worst = 0
    for mode_name, dtype, head_size, tuning in cases:
        num_tokens = args.check_tokens if head_size <= 128 else args.check_tokens // 2
        rows_diff, codes_diff, err = check_case(mode_name, dtype, head_size, num_tokens, device, tuning=tuning,
                                                slot_order=args.slots)
        worst = max(worst, rows_diff / (2 * num_tokens * NUM_KV_HEADS))
        print(f"| {mode_name} | {str(dtype)[6:]} | {head_size} | {num_tokens} | {_label(tuning)} | {rows_diff} | "
              f"{codes_diff} | {err:.2f} |", flush=True)
    return worst


PLAN_MODES = {"bf16": (M.NONE, 1), "int8": (M.INT8_PER_TOKEN_HEAD, 1), "fp8": (M.FP8_PER_TOKEN_HEAD, 1),
              "int4": (M.INT4_PER_TOKEN_HEAD, 1), "int4-mse": (M.INT4_PER_TOKEN_HEAD, len(MSE_SHRINK))}


def _plan(mode_name, head_size, on_gpu, aligned=True, num_tokens=65536, smooth=False):
    mode, num_shrink = PLAN_MODES[mode_name]
    call = WriteCall(mode, head_size, num_tokens * NUM_KV_HEADS, on_gpu, num_sms=132 if on_gpu else 0,
                     lane_layout=aligned, num_shrink=num_shrink, smooth=smooth)
    shape = WriteShape(num_tokens, NUM_KV_HEADS, head_size, num_tokens // BLOCK_SIZE, BLOCK_SIZE) if smooth else None
    return plan_for(call, shrink=MSE_SHRINK[:num_shrink], shape=shape)


def plan_table() -> str:
    """Markdown table of the path :func:`kernels.write.plan_for` picks per mode and head size on
    CPU and on an H200 (132 SMs; 65,536 tokens x 8 KV heads, K/V rows 16-byte loadable, plus one
    line for rows that are not), with the H200 tuning and reason: ``docs/KERNELS.md``'s table."""
    lines = ["| mode | head_size | CPU path | H200 path | H200 tuning | why (H200) |", "|---|---|---|---|---|---|"]
    cases = [(m, d, True) for m in ("bf16", "int8", "fp8") for d in (64, 128, 256)]
    cases += [(m, d, True) for m in ("int4", "int4-mse") for d in (16, 32, 64, 128, 256, 512)]
    cases += [("int4", 128, False)] + [("int4 + key offset", d, True) for d in (64, 128, 256)]
    for m, d, aligned in cases:
        smooth = m.endswith("key offset")
        mode = m.split()[0]
        cpu, gpu = _plan(mode, d, False, aligned, smooth=smooth), _plan(mode, d, True, aligned, smooth=smooth)
        tuning = ", ".join(f"{k}={v}" for k, v in vars(gpu.tuning).items())
        note = "" if aligned else " (K/V rows not 16-byte loadable)"
        lines.append(f"| {m} | {d}{note} | {cpu.path} | {gpu.path} | {tuning} | {gpu.why} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small shapes only (CI smoke test; runs on CPU)")
    p.add_argument("--check", action="store_true", help="compare with the PyTorch oracle first")
    p.add_argument("--sweep", action="store_true", help="time int4-fused tilings and rotations")
    p.add_argument("--compare", action="store_true",
                   help="defaults vs other paths (INT4 int4-lanes and int4-fused, INT8/FP8 big tiles), each checked, "
                        "instead of the main table")
    p.add_argument("--plans", action="store_true",
                   help="print which write path runs over a grid of calls on CPU and on an H200 (no timing)")
    p.add_argument("--key-offset", action="store_true",
                   help="INT4 only: the write with and without a key offset, checked, then timed interleaved "
                        "(instead of the main table)")
    p.add_argument("--rounds", type=int, default=8, help="--key-offset: interleaved rounds per row (median)")
    p.add_argument("--no-table", action="store_true", help="skip the main table")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--slots", choices=SLOT_ORDERS, default="tokens",
                   help="slot_mapping: each token at a random slot (default, the worst case) or whole blocks "
                        "at random places with their tokens in order (as a prefill writes)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    p.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--check-tokens", type=int, default=65536)
    p.add_argument("--sweep-tokens", type=int, default=65536)


def run(args) -> int:
    device = torch.device(args.device)
    if args.plans:
        print(plan_table())
        return 0
    if args.quick:
        args.tokens, args.head_sizes, args.check_tokens, args.sweep_tokens = [64], [64], 48, 64
    if args.check:
        worst = run_check(args, device)
        print(f"\nworst fraction of rows differing from the oracle: {worst:.2e}")
    if args.sweep:
        run_sweep(args, device)
    if args.key_offset:
        from bench.write_key_offset import run_key_offset
        run_key_offset(args, device)
    elif args.compare:
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
