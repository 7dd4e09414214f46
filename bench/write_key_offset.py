"""The INT4 write with and without a key offset (key smoothing), timed interleaved in one run.

For each head size and token count: the default INT4 path checked against the oracle with an
offset (rows differing, max |Δ dequantized| in scales: the tensor-core path's tie rows only),
then ``rounds`` rounds that time the plain write, the offset write (default: on the GPU the
int4-mma kernel's lanes load their offsets once inside its tensor-core asm, with the offset
write's own tiling where ``tuning.OFFSET_TILING`` has one), on the GPU the offset write with the
plain kernel's tiling (one program per tile; where the default differs) and the offset write
loading each row's offsets as a tile (``MmaTuning(lane_offsets=False)``), in a rotating order
(drift of clocks or temperature falls on all), each the median of CUDA-graph replays over input
sets that leave the L2 cold. Prints the median of the rounds for each and the differences.
Run: ``python -m bench.write --key-offset [--tokens ...] [--head-sizes ...] [--rounds N]``.
"""

from __future__ import annotations

import statistics
import sys

import torch

from kernels.reference import reference_reshape_and_cache
from kernels.write import MmaTuning, reshape_and_cache_int4
from kernels.write.tuning import MMA_TILING, OFFSET_TILING
from bench import write as bw


def _offset(head_size, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bw.NUM_KV_HEADS, head_size, generator=g) * 2).to(device)  # [H, d] float32


def _int4(key, value, slots, views, key_offset=None, tuning=None):
    reshape_and_cache_int4(key, value, views.key_cache, views.value_cache, slots, views.k_scale_cache,
                           views.v_scale_cache, check_slots=False, key_offset=key_offset, tuning=tuning)


def check_offset(head_size, num_tokens, device):
    """(rows differing, max |Δ dequantized| in scales) of the offset write against the oracle."""
    geo, [(key, value, slots, cache, views)] = bw._setup(num_tokens, head_size, "int4", device)
    m = _offset(head_size, device)
    key += m.to(key.dtype)  # keys that carry the offset, as a model's do
    slots[::97] = -1
    cache.view(torch.uint8).fill_(0xA5)
    ref = cache.clone()
    rv = bw.split_kv_cache(ref, geo.mode, head_size)
    reference_reshape_and_cache(key, value, rv.key_cache, rv.value_cache, slots, geo.mode, rv.k_scale_cache,
                                rv.v_scale_cache, key_offset=m)
    _int4(key, value, slots, views, m)
    rows, _, err = bw._compare("int4", geo, ref, cache)
    return rows, err


def run_key_offset(args, device) -> list:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    rounds = 2 if args.quick else args.rounds
    print(f"\n## INT4 write, key offset vs none, on {name}\n\ncommand: `{' '.join(sys.argv)}`; "
          f"{bw.NUM_KV_HEADS} kv heads, block_size {bw.BLOCK_SIZE}, bf16 inputs, slots: {args.slots}; "
          f"{rounds} interleaved rounds, median of each\n")
    tiles = device.type == "cuda"  # the tiling variants differ from the default on the GPU only
    print("| tokens | head_size | path | rows ≠ oracle (offset) | max Δ (scales) | µs none | µs offset | Δ | "
          + ("µs offset, plain tiling | Δ | µs offset, row tiles | Δ | " if tiles else "") + "GB/s none | GB/s offset |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if tiles else "") + "---:|---:|")
    results = []
    for head_size in args.head_sizes:
        path = bw._plan("int4", head_size, device.type == "cuda").path
        rows, err = check_offset(head_size, args.tokens[0], device)
        m = _offset(head_size, device)
        row_tiles = MmaTuning(lane_offsets=False) if path == "int4-mma" else None
        plain_tiling = (MmaTuning(rows=MMA_TILING[head_size][0], num_warps=MMA_TILING[head_size][1],
                                  offset_programs_per_sm=0)
                        if path == "int4-mma" and head_size in OFFSET_TILING else None)
        for num_tokens in args.tokens:
            nbytes, sets = bw.timing_sets("int4", num_tokens, head_size, device, args.slots)
            fns = {None: bw._each(sets, lambda k, v, s, c, views: _int4(k, v, s, views)),
                   "offset": bw._each(sets, lambda k, v, s, c, views: _int4(k, v, s, views, m))}
            if tiles and plain_tiling is not None:
                fns["plain tiling"] = bw._each(sets, lambda k, v, s, c, views: _int4(k, v, s, views, m, plain_tiling))
            if tiles:
                fns["tiles"] = bw._each(sets, lambda k, v, s, c, views: _int4(k, v, s, views, m, row_tiles))
            names = list(fns)
            times = {name: [] for name in names}
            for r in range(rounds):
                for which in names[r % len(names):] + names[:r % len(names)]:
                    times[which].append(bw._time_us(fns[which], device, len(sets)))
            med = {name: statistics.median(t) for name, t in times.items()}
            plain, smooth = med[None], med["offset"]
            results.append((num_tokens, head_size, plain, smooth, med.get("tiles")))
            extra = "".join(f"{med[v]:.2f} | {100 * (med[v] / plain - 1):+.1f}% | " if v in med else "– | | "
                            for v in ("plain tiling", "tiles")) if tiles else ""
            print(f"| {num_tokens} | {head_size} | {path} | {rows} | {err:.2f} | {plain:.2f} | {smooth:.2f} | "
                  f"{100 * (smooth / plain - 1):+.1f}% | {extra}{nbytes / plain / 1e3:.0f} | {nbytes / smooth / 1e3:.0f} |",
                  flush=True)
    return results
