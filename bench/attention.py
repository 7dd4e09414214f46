"""Benchmark the paged attention kernels: decode and prefill, every cache mode, against copy bandwidth.

Decode rows: context x batch for 32 query / 8 KV heads, head_size 128, block 16 (presets
below). Each row: median µs over CUDA-graph replays (``triton.testing.do_bench_cudagraph``;
the launcher does no host sync, so a graph captures it), GB/s of KV bytes read (codes and
scales of every visible token, K and V), the ratio of bf16's time to the mode's time, and the
share of the device-to-device copy bandwidth measured in the same run. Caches hold random
codes; every timed configuration is first checked against the oracle
``reference_unified_attention`` on two of its sequences (relative L2 <= 1e-2). Caches smaller
than 4x the L2 are replicated and the timed call rotates through the copies.

Every timed call passes its ``kernels.attention.Tuning`` explicitly: ``Tuning()`` (the plan's
choice) for the default table; ``--pdl``, ``--q-rotation``, ``--paths``, ``--sweep`` and
``--compare`` time other settings side by side in the same process.

``--cold-l2``: every timed call is preceded by one pass over a 256 MiB buffer (the L2 flushed),
and the time of that pass alone, measured in the same run, is subtracted; the decode table then
times one cache copy instead of rotating through several. ``--flush read`` (default) reads the
buffer, leaving clean lines in the L2 as the layers between two attention calls do; ``--flush
write`` writes it, so each call also pays the write-back of an L2 of dirty lines
(:func:`bench.timing.flush_l2`).

``--mixed`` (``bench/attention_mixed.py``): mixed batches (decode rows first, then one or two
prefill chunks), every mode, timing in the same run (a) one call with ``num_decode_seqs``, (b) its decode half alone plus
its chunk half alone (each a call of its own), (c) the same batch as one call without
``num_decode_seqs`` (the whole batch through the 2D kernel); warm, and with ``--cold-l2`` also
cold. The ratio (a)/(b) is the cost of sharing the call.

Run: ``python -m bench.attention`` (H200), ``--quick`` (tiny, any device, CPU timing by wall
clock: a smoke test, not a measurement), ``--sweep`` (tile/warps/segments variants of the
decode rows, for tuning), ``--paths decode_staged_int4,decode_block_tiles`` (each path with its
own default tiling, every one a row). Which kernel each shape takes: ``python -m bench.kernels_table``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from kernels.attention import Path, Plan, Tuning, attention_plan, unified_attention
from kernels.attention.plan import DECODE_STAGES, DECODE_TILE, DECODE_WARPS
from kernels.reference import reference_unified_attention
from layouts import CacheGeometry, KVQuantMode, split_kv_cache
from bench.timing import FLUSH_BYTES, FLUSHES, cold_graph_us, graph_us, tee

MODES = {"bf16": KVQuantMode.NONE, "int8": KVQuantMode.INT8_PER_TOKEN_HEAD,
         "fp8": KVQuantMode.FP8_PER_TOKEN_HEAD, "int4": KVQuantMode.INT4_PER_TOKEN_HEAD}
FULL = dict(contexts=[1024, 4096, 32768], batches=[1, 8, 32], num_q_heads=32, num_kv_heads=8,
            head_size=128, block_size=16, prefill=(1, 4096))
QUICK = dict(contexts=[40, 96], batches=[1, 2], num_q_heads=4, num_kv_heads=2, head_size=64,
             block_size=16, prefill=(1, 48))
L2_BYTES = 60 * 2**20
REP_MS = 100  # per timed configuration (do_bench_cudagraph)
COLD_L2 = False  # --cold-l2: flush the L2 before every timed call
FLUSH = "read"  # --flush: how (bench.timing.flush_l2)
# --compare: tilings of the split decode kernels (path; tile, warps, stages)
COMPARE = ((Path.DECODE_SPLIT, 128, 4, 3), (Path.DECODE_CODE_UNITS, 64, 2, 2), (Path.DECODE_CODE_UNITS, 32, 1, 2))


def fill_cache(mode, geo, num_blocks, device, gen):
    """Packed cache of random codes with plausible per-row scales (timing needs no real K/V)."""
    cache = geo.new_cache(num_blocks, device=device)
    if mode == KVQuantMode.NONE:
        cache.normal_(generator=gen)
        return cache, split_kv_cache(cache, mode, geo.head_size)
    raw = cache.view(torch.uint8)
    raw.random_(0, 256, generator=gen)
    views = split_kv_cache(cache, mode, geo.head_size)
    fill_values(views, mode, device, gen)
    return cache, views


def fill_values(views, mode, device, gen) -> None:
    """Over random code bytes: finite e4m3 codes (FP8) and plausible per-row scales, INT4's with a
    zero point in the low 4 bits; ``views`` as :func:`layouts.split_kv_cache` returns them."""
    if mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        for t in (views.key_cache, views.value_cache):
            t.copy_(torch.randn(t.shape, device=device, generator=gen).mul(100).clamp(-448, 448).to(t.dtype))
    for t in (views.k_scale_cache, views.v_scale_cache):
        s = torch.rand(t.shape, device=device, generator=gen) * 0.05 + 0.01
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # zero point in the low 4 bits
            zp = torch.randint(0, 16, t.shape, device=device, generator=gen, dtype=torch.int32)
            s = ((s.view(torch.int32) & ~0xF) | zp).view(torch.float32)
        t.copy_(s)


def make_problem(mode, batch, ctx, q_len, p, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    geo = CacheGeometry(mode, p["head_size"], p["num_kv_heads"], p["block_size"], torch.bfloat16)
    blocks_per_seq = -(-ctx // p["block_size"])
    set_blocks = batch * blocks_per_seq
    copies = 1 if device == "cpu" else max(1, -(-4 * L2_BYTES // (set_blocks * geo.block_bytes)))
    cache, views = fill_cache(mode, geo, copies * set_blocks, device, gen)
    perm = torch.randperm(copies * set_blocks, device=device, generator=gen).to(torch.int32)
    tables = [perm[i * set_blocks:(i + 1) * set_blocks].view(batch, blocks_per_seq) for i in range(copies)]
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, p["num_q_heads"], p["head_size"], device=device, generator=gen).to(torch.bfloat16)
    kv_bytes = batch * ctx * p["num_kv_heads"] * 2 * geo.row_bytes
    return dict(mode=mode, views=views, tables=tables, cu=cu, q=q, q_len=q_len, ctx=ctx, batch=batch,
                seqused_k=torch.full((batch,), ctx, dtype=torch.int32, device=device), kv_bytes=kv_bytes,
                out=torch.empty_like(q), cache=cache)


def _args(pb, table):
    v = pb["views"]
    return ((pb["q"], v.key_cache, v.value_cache, pb["out"], pb["cu"], pb["seqused_k"], pb["q_len"], pb["ctx"],
             pb["q"].shape[-1] ** -0.5, True, (-1, -1), table, 0.0, None, None, None),
            dict(kv_quant_mode=pb["mode"], k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache))


def call(pb, tuning: Tuning, table):
    args, kw = _args(pb, table)
    return unified_attention(*args, **kw, tuning=tuning)


def plan_of(pb, tuning: Tuning) -> Plan:
    """What ``call(pb, tuning, ...)`` runs (``kernels.attention_plan``)."""
    args, kw = _args(pb, pb["tables"][0])
    return attention_plan(*args, **kw, tuning=tuning)


def check(pb, tuning) -> float:
    """Relative L2 of the kernel vs the oracle on the first and last sequence (a gathered sub-cache)."""
    pb["out"].fill_(float("nan"))
    call(pb, tuning, pb["tables"][0])
    seqs = sorted({0, pb["batch"] - 1})
    ids = pb["tables"][0][seqs].long()  # [n, blocks]
    v = pb["views"]
    sub = [None if t is None else t[ids.flatten()] for t in v]
    table = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device).view(ids.shape)
    ql = pb["q_len"]
    rows = torch.cat([torch.arange(s * ql, (s + 1) * ql) for s in seqs]).to(ids.device)
    cu = torch.arange(0, (len(seqs) + 1) * ql, ql, dtype=torch.int32, device=ids.device)
    ref = reference_unified_attention(pb["q"][rows], sub[0], sub[1], cu, pb["seqused_k"][:len(seqs)], table,
                                      pb["q"].shape[-1] ** -0.5, True, (-1, -1), 0.0, pb["mode"], sub[2], sub[3])
    got = pb["out"][rows].float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


_FLUSH = {}  # the 256 MiB buffer of --cold-l2


def timed_us(fn, device, cold: bool = False) -> float:
    """µs of one ``fn()``: the median of CUDA-graph replays; ``cold``: each replay flushes the
    L2 first (a pass of :data:`FLUSH` kind over a 256 MiB buffer) and the flush's own time is
    subtracted (:func:`bench.timing.cold_graph_us`). On the CPU: wall clock of one run (a smoke test, not a
    measurement)."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    if not cold:
        return graph_us(fn, REP_MS)
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    return cold_graph_us(fn, REP_MS, _FLUSH["buf"], FLUSH)


def shuffled_block_table(blocks: list, device, gen) -> torch.Tensor:
    """``[len(blocks), max(blocks)]`` int32 block table: sequence ``i`` owns ``blocks[i]`` blocks of
    a random permutation of ``range(sum(blocks))`` (the rest of its row 0), so no sequence reads
    consecutive blocks."""
    perm = torch.randperm(sum(blocks), device=device, generator=gen).to(torch.int32)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start:start + n]
        start += n
    return table


def time_us(pb, tuning) -> float:
    tables = pb["tables"]
    if pb["q"].device.type == "cpu":
        t0 = time.perf_counter()
        call(pb, tuning, tables[0])
        return (time.perf_counter() - t0) * 1e6
    if COLD_L2:
        return timed_us(lambda: call(pb, tuning, tables[0]), pb["q"].device.type, cold=True)

    def fn():  # one replay runs every copy once: rotation through more than the L2
        for t in tables:
            call(pb, tuning, t)
    return graph_us(fn, REP_MS, len(tables))


def copy_gbps(device) -> float:
    if device == "cpu":
        return float("nan")
    import triton.testing
    src = torch.empty(2**30, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def sweep_tunings(base: Tuning, plan: Plan):
    """Tile / warps / segment-count variants around the plan's tiling (same path), for the split path."""
    if plan.tiling.num_segments == 1:
        return [base]
    out = [base]
    pinned = dataclasses.replace(base, path=plan.path)
    for tile, warps in ((128, 4), (64, 4), (64, 8)):
        out.append(dataclasses.replace(pinned, tiling=dataclasses.replace(plan.tiling, tile=tile, num_warps=warps)))
    for mul in (0.5, 2, 4):
        segs = max(2, int(plan.tiling.num_segments * mul))
        out.append(dataclasses.replace(pinned, tiling=dataclasses.replace(plan.tiling, num_segments=segs)))
    return list(dict.fromkeys(out))


def compare_tunings(base: Tuning, plan: Plan, mode):
    """The 2D kernel's split decode (its own tiling) and tilings of the split decode kernels
    (``COMPARE``), all at the plan's segment count."""
    if plan.tiling.num_segments == 1 or mode == KVQuantMode.NONE:
        return [base]
    t = plan.tiling
    two_d = dataclasses.replace(base, path=Path.PREFILL_2D, tiling=dataclasses.replace(
        t, tile=DECODE_TILE[mode], num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, heads_per_program=0))
    return [two_d] + [dataclasses.replace(base, path=path, tiling=dataclasses.replace(
        t, tile=tile, num_warps=warps, num_stages=stages, heads_per_program=0))
        for path, tile, warps, stages in COMPARE]


def path_tunings(base: Tuning, paths) -> list:
    """``base`` asking for each of ``paths`` with that path's default tiling."""
    return [dataclasses.replace(base, path=Path(p)) for p in paths]


def describe(plan: Plan) -> str:
    t = plan.tiling
    return f"{plan.path.value} ({t.block_m}, {t.tile}, {t.num_segments}, {t.num_warps}, {t.num_stages})"


def bench(p, device, modes, sweep, log, sweep_min_ctx=0, compare=False, pdl_modes=(None,), rot_modes=(None,),
          paths=()):
    """Rows of the results table. ``pdl_modes``: None (the default) or True / False to force
    programmatic dependent launch on or off; ``rot_modes``: None (the default) or True / False to rotate
    the INT4 query in the decode kernel or in the separate rotation kernel. With several, every
    tuning is timed under each combination in turn (same process, same cache); rows of the
    forced-off runs are marked ``no-PDL`` / ``q-rot-kernel``. ``paths`` (and ``compare``): time each
    of these paths, every one a row, instead of the best tuning."""
    variants = [(pdl, rot) for pdl in pdl_modes for rot in rot_modes]
    rows = []
    shapes = [(b, c, 1) for c in sorted(p["contexts"], reverse=True) for b in p["batches"]]
    if p["prefill"]:
        shapes.append((p["prefill"][0], p["prefill"][1], p["prefill"][1]))
    every = compare or bool(paths)
    for batch, ctx, q_len in shapes:
        base_us = {}
        for name in modes:
            pb = make_problem(MODES[name], batch, ctx, q_len, p, device)
            best = {}
            for var in variants:
                use_pdl, rot = var
                base = Tuning(pdl=Tuning.pdl if use_pdl is None else use_pdl,
                              rotate_q_in_decode=Tuning.rotate_q_in_decode if rot is None else rot)
                plan = plan_of(pb, base)
                tunings = sweep_tunings(base, plan) if sweep and ctx >= sweep_min_ctx else [base]
                if compare:
                    tunings = compare_tunings(base, plan, MODES[name])
                elif paths and q_len == 1:
                    tunings = path_tunings(base, paths)
                tag = (" no-PDL" if use_pdl is False and len(pdl_modes) > 1 else "") + \
                    (" q-rot-kernel" if rot is False and len(rot_modes) > 1 else "")
                for tuning in tunings:
                    ran = plan_of(pb, tuning)
                    err = check(pb, tuning)
                    us = time_us(pb, tuning) if err <= 1e-2 else float("nan")
                    log(f"{name}{tag} b{batch} ctx{ctx} q{q_len} {describe(ran)} err={err:.2e} us={us:.1f}")
                    if every:
                        if name == "bf16":
                            base_us[var] = us
                        label = "" if MODES[name] == KVQuantMode.NONE else f" {ran.path.value}"
                        rows.append(dict(mode=name + label + tag, batch=batch, ctx=ctx, q_len=q_len, us=us, err=err,
                                         plan=ran, gbps=pb["kv_bytes"] / us / 1e3,
                                         vs_bf16=(base_us[var] / us) if var in base_us else float("nan")))
                    if err <= 1e-2 and (var not in best or us < best[var][0]):
                        best[var] = (us, ran, err, tag)
            if len(best) < len(variants):
                raise RuntimeError(f"{name} b{batch} ctx{ctx}: no tuning passed the oracle check")
            if every:
                del pb
                continue
            for var in variants:
                us, ran, err, tag = best[var]
                gbps = pb["kv_bytes"] / us / 1e3
                log(f"BEST {name}{tag} b{batch} ctx{ctx} q{q_len} {describe(ran)} us={us:.1f} GB/s={gbps:.0f}")
                if name == "bf16":
                    base_us[var] = us
                rows.append(dict(mode=name + tag, batch=batch, ctx=ctx, q_len=q_len, us=us, err=err, plan=ran,
                                 gbps=gbps, vs_bf16=(base_us[var] / us) if var in base_us else float("nan")))
            del pb
            if device != "cpu":
                torch.cuda.empty_cache()
    return rows


def table(rows, copy, device, argv) -> str:
    name = torch.cuda.get_device_name() if device != "cpu" else "CPU (Triton interpreter; times are not measurements)"
    lines = [f"GPU: {name}; device copy bandwidth {copy:.0f} GB/s (read + write)"
             + (f"; L2 flushed before every timed call (cold, {FLUSH} flush)" if COLD_L2 else ""),
             f"command: `python -m bench.attention {' '.join(argv)}`", "",
             "| mode | kind | batch | context | µs | KV GB/s | % of copy | speed-up vs bf16 | rel. L2 vs oracle "
             "| kernel (block_m, tile, segs, warps, stages) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        kind = "decode" if r["q_len"] == 1 else f"prefill {r['q_len']}"
        lines.append(f"| {r['mode']} | {kind} | {r['batch']} | {r['ctx']} | {r['us']:.1f} | {r['gbps']:.0f} | "
                     f"{100 * r['gbps'] / copy:.0f} | {r['vs_bf16']:.2f} | {r['err']:.1e} | {describe(r['plan'])} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter unless --device)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--modes", default="bf16,int8,fp8,int4", help="comma-separated subset of bf16,int8,fp8,int4")
    parser.add_argument("--contexts", default=None, help="override the decode contexts, e.g. 4096,32768")
    parser.add_argument("--batches", default=None, help="override the decode batches, e.g. 8,32")
    parser.add_argument("--head-size", type=int, default=None, help="override the head size (default 128)")
    parser.add_argument("--sweep", action="store_true", help="time tile/warps/segment variants, keep the best")
    parser.add_argument("--sweep-min-ctx", type=int, default=0, help="sweep only rows with at least this context")
    parser.add_argument("--compare", action="store_true",
                        help="decode rows: time the 2D kernel's split decode and tilings of decode_split / "
                             "decode_code_units side by side, every one a row")
    parser.add_argument("--paths", default="", help="decode rows: time each of these paths (comma separated, "
                        "e.g. decode_staged_int4,decode_block_tiles) with its default tiling, every one a row")
    parser.add_argument("--rep-ms", type=int, default=REP_MS, help="timing budget per configuration (ms)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill length (0 = no prefill row)")
    parser.add_argument("--log", default=None, help="write every timed variant to this file")
    parser.add_argument("--pdl", default="auto", choices=("auto", "on", "off", "both"),
                        help="programmatic dependent launch: the launcher's choice, forced, or both side by side")
    parser.add_argument("--mixed", action="store_true",
                        help="mixed batches (decode rows + prefill chunks): one call with num_decode_seqs vs its "
                             "halves alone vs one call without it")
    parser.add_argument("--mixes", default="", help="--mixed: only these entries of MIXES (comma-separated "
                        "indices, e.g. 0,2)")
    parser.add_argument("--cold-l2", action="store_true",
                        help="flush the L2 (one pass over 256 MiB, its time subtracted) before every timed "
                             "call; --mixed: warm and cold side by side")
    parser.add_argument("--flush", default="read", choices=FLUSHES,
                        help="--cold-l2: read the buffer (clean L2, default) or write it (dirty L2: each call "
                             "also pays the write-back)")
    parser.add_argument("--q-rotation", default="auto", choices=("auto", "decode", "kernel", "both"),
                        help="INT4 query rotation in the decode kernel's prologue or in its own kernel "
                             "(auto: the launcher's default), or both side by side")


def run(args, argv=()) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    p = dict(QUICK if args.quick else FULL)
    if args.contexts:
        p["contexts"] = [int(x) for x in args.contexts.split(",")]
    if args.batches:
        p["batches"] = [int(x) for x in args.batches.split(",")]
    if args.head_size:
        p["head_size"] = args.head_size
    global REP_MS, COLD_L2, FLUSH
    REP_MS = args.rep_ms
    FLUSH = args.flush
    COLD_L2 = args.cold_l2 and device != "cpu"
    if args.prefill is not None:
        p["prefill"] = (1, args.prefill) if args.prefill else None
    modes = args.modes.split(",")
    if args.mixed:
        from bench.attention_mixed import MIXES, QUICK_MIXES, bench_mixed, mixed_table
        log = tee(args.log)
        mixes = QUICK_MIXES if args.quick else MIXES
        if args.mixes:
            mixes = [mixes[int(i)] for i in args.mixes.split(",")]
        rows = bench_mixed(p, device, modes, mixes, COLD_L2, log)
        print(mixed_table(rows, p, device, list(argv)))
        return 0
    if modes[0] != "bf16":
        modes = ["bf16"] + [m for m in modes if m != "bf16"]  # ratios need bf16 first
    logf = open(args.log, "w") if args.log else None

    def log(msg):
        if logf:
            logf.write(msg + "\n")
            logf.flush()
    copy = copy_gbps(device)
    log(f"copy {copy:.0f} GB/s")
    pdl_modes = {"auto": (None,), "on": (True,), "off": (False,), "both": (True, False)}[args.pdl]
    rot_modes = {"auto": (None,), "decode": (True,), "kernel": (False,), "both": (True, False)}[args.q_rotation]
    paths = [Path(x) for x in args.paths.split(",") if x]
    rows = bench(p, device, modes, args.sweep, log, args.sweep_min_ctx, args.compare, pdl_modes, rot_modes, paths)
    print(table(rows, copy, device, list(argv)))
    if logf:
        logf.close()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
