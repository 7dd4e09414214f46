"""Benchmark the 2D attention path (prefill chunks, mixed batches) over every cache mode, against
the device's own limits.

Rows: for each head size (64: 32 query / 8 KV heads, as Llama 3.2 1B; 128: 32 / 8, as Llama 3
8B; 256: 16 / 8, as Gemma 2 9B; block 16, bf16 queries), chunks of ``max_seqlen_q`` 512 and
2,048 new tokens over 0 / 4,096 / 32,768 cached tokens, and one mixed batch (decode rows plus
one chunk). The new tokens' keys are in the cache too, as a prefill worker has them after
writing them: a sequence's context is ``cached + q_len``. Each prefill row holds
:data:`TOKENS_PER_CALL` new tokens (``4096 // q_len`` sequences) so the grid fills the GPU.

Each row, every mode: the median µs of CUDA-graph replays, warm and with a cold L2 (one pass
over a 256 MiB buffer before every replay, its own time measured in the same run and
subtracted; ``--flush read``, the default, or ``write``: :func:`bench.timing.flush_l2`); the
*ceiling*: ``max(bytes / copy bandwidth, FLOPs / bf16 matmul rate)``, both rates measured in
this run (copy: a device-to-device copy of 1 GiB, counted read + write; matmul: ``torch.matmul``
of two bf16 8192 x 8192 matrices). Bytes: every visible key's K and V row once (codes and
scales), the queries read and the output written. FLOPs: ``4 * head_size`` per visible
(query head, key) pair (the two dots). Printed: the ratio of bf16's cold time to the mode's,
and the fraction of the binding limit reached (cold). Every configuration is first checked
against the oracle ``reference_unified_attention`` on the last rows of one chunk (and one
decode row of a mixed batch): relative L2 <= 1e-2.

The mixed batch is one ``unified_attention`` call, so every row goes through the 2D kernel.

Quantized rows whose plan dequantizes the context first (``Tiling.dequant_first``) also time
that pass alone (``prefill_dequant.dequantized_call``: codes and scales of every context block
read, fp16 K/V rows written; INT4 rows kept rotated: the query rotated into fp16 and the
output's rotation back, ``restore_output``, too), cold, with its GB/s (read + write) and the
fraction of the copy bandwidth.

``--sdpa``: a second table, the same prefill rows run by torch's own attention
(``torch.nn.functional.scaled_dot_product_attention``: on CUDA its cuDNN and flash backends, on
the CPU its math backend) over *contiguous* K / V of the same shapes (no paging, no block table,
no mask: every query sees every key, since torch's causal mask aligns the queries with the start
of the keys where these rows' queries are the last ``q_len`` tokens), each rate on its own FLOPs,
next to bf16's rate in the same run: what a tuned non-paged kernel reaches on this GPU.

``--sweep``: the rows with the most cached tokens (32k) under each tuning of :func:`sweep_tunings`
(2D tilings, each with the mode's variants: ``Tiling.mask_edges_only`` for every mode,
``Tiling.dequant_first`` for the quantized ones, ``Tiling.code_zp`` / ``code_asm`` and
``Tuning.rotate_q_once`` for INT4), side by side in the same process; a tuning that does not fit
or compile is logged (``SKIPPED``) and has no row.

Run: ``python -m bench.attention_prefill`` (H200; a subset: ``--heads 128 --modes bf16,int4
--cached 32768 --no-mixed``), ``--smoke`` (tiny shapes through Triton's interpreter on the CPU:
a test that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from bench.attention import MODES, copy_gbps, fill_cache, shuffled_block_table
from bench.timing import FLUSH_BYTES, FLUSHES, cold_graph_us, graph_us, tee
from kernels.attention import Path, Plan, Rotate, Tiling, Tuning, attention_plan, unified_attention
from kernels.attention.call import make_call
from kernels.attention.prefill_dequant import dequantized_call, restore_output
from kernels.reference import reference_unified_attention
from layouts import CacheGeometry, KVQuantMode

HEADS = {64: (32, 8), 128: (32, 8), 256: (16, 8)}  # head_size -> (num_q_heads, num_kv_heads)
Q_LENS = (512, 2048)
CACHED = (0, 4096, 32768)
TOKENS_PER_CALL = 4096
# mixed batch: (decode rows, their context, chunk length, tokens cached before the chunk)
MIXED = (16, 8192, 512, 4096)
SMOKE = dict(heads={64: (4, 2)}, q_lens=(24,), cached=(0, 40), tokens=48, mixed=(3, 50, 20, 17), block_size=16)
FULL = dict(heads=HEADS, q_lens=Q_LENS, cached=CACHED, tokens=TOKENS_PER_CALL, mixed=MIXED, block_size=16)
CHECK_ROWS = 64  # query rows of one chunk compared with the oracle (a suffix: same keys, same positions)
REP_MS = 100
MATMUL_N = 8192


@dataclasses.dataclass
class Shape:
    """One row: sequences given as (query tokens, context incl. those tokens)."""

    name: str
    head_size: int
    num_q_heads: int
    num_kv_heads: int
    seqs: list          # [(q_len, seq_len)]

    @property
    def max_q(self) -> int:
        return max(q for q, _ in self.seqs)

    @property
    def max_k(self) -> int:
        return max(k for _, k in self.seqs)


def shapes(p, heads) -> list:
    out = []
    for head in heads:
        hq, hkv = p["heads"][head]
        for q_len in p["q_lens"]:
            batch = max(1, p["tokens"] // q_len)
            for cached in p["cached"]:
                out.append(Shape(f"prefill {q_len} over {cached}", head, hq, hkv, [(q_len, cached + q_len)] * batch))
        if not p["mixed"]:
            continue
        d, d_ctx, chunk, cached = p["mixed"]
        out.append(Shape(f"mixed {d}x decode@{d_ctx} + {chunk} over {cached}", head, hq, hkv,
                         [(1, d_ctx)] * d + [(chunk, cached + chunk)]))
    return out


def make_problem(mode, shape: Shape, block_size, device, seed=0) -> dict:
    """A packed cache of random codes holding every sequence's context, a shuffled block table,
    bf16 queries and the byte / FLOP counts of the call."""
    gen = torch.Generator(device=device).manual_seed(seed)
    geo = CacheGeometry(mode, shape.head_size, shape.num_kv_heads, block_size, torch.bfloat16)
    blocks = [-(-k // block_size) for _, k in shape.seqs]
    cache, views = fill_cache(mode, geo, sum(blocks), device, gen)
    table = shuffled_block_table(blocks, device, gen)
    q_lens = [q for q, _ in shape.seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), shape.num_q_heads, shape.head_size, device=device, generator=gen).to(torch.bfloat16)
    seq_lens = [k for _, k in shape.seqs]
    pairs = sum(sum(range(k - ql + 1, k + 1)) for ql, k in shape.seqs)  # causal: query at position p sees p + 1 keys
    kv_bytes = sum(seq_lens) * shape.num_kv_heads * 2 * geo.row_bytes
    rows = sum(blocks) * block_size * shape.num_kv_heads  # every slot of every block the pass converts
    return dict(mode=mode, views=views, table=table, cu=cu, q=q, out=torch.empty_like(q), shape=shape, cache=cache,
                seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                bytes=kv_bytes + 2 * q.numel() * q.element_size(),
                flops=4 * shape.head_size * shape.num_q_heads * pairs,
                dequant_bytes=rows * 2 * (geo.row_bytes + 2 * shape.head_size),  # the pass alone: K and V rows
                dequant_rows=rows)


def _args(pb):
    v, s = pb["views"], pb["shape"]
    return ((pb["q"], v.key_cache, v.value_cache, pb["out"], pb["cu"], pb["seqused_k"], s.max_q, s.max_k,
             s.head_size ** -0.5, True, (-1, -1), pb["table"], 0.0, None, None, None),
            dict(kv_quant_mode=pb["mode"], k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache))


def call(pb, tuning: Tuning):
    args, kw = _args(pb)
    return unified_attention(*args, **kw, tuning=tuning)


def dequant(pb, plan: Plan) -> None:
    """What ``plan`` (``dequant_first``) runs besides the 2D kernel, alone: the dequantizing pass
    (``prefill_dequant.dequantized_call``) and, for INT4 rows kept rotated, the query's and
    output's rotations (the output's over the scratch as it lies: timed, not checked)."""
    args, _ = _args(pb)
    v = pb["views"]
    call = make_call(*args[:13], pb["mode"], v.k_scale_cache, v.v_scale_cache)
    restore_output(call, dequantized_call(call, unrotate=plan.tiling.unrotate, int8_keys=plan.tiling.int8_keys))


def _dequant_bytes(pb, plan: Plan) -> int:
    """Bytes :func:`dequant` moves: the pass, plus for INT4 rows kept rotated the query's and the
    output's rotations (16-bit rows read and written)."""
    rotated = pb["mode"] == KVQuantMode.INT4_PER_TOKEN_HEAD and not plan.tiling.unrotate
    moved = pb["dequant_bytes"]
    if plan.tiling.int8_keys:  # key rows written as a byte a dim and an fp32 scale, not two bytes a dim
        s = pb["shape"]
        moved -= pb["dequant_rows"] * (s.head_size - 4)
    return moved + (2 * pb["q"].numel() * 4 if rotated else 0)


def plan_of(pb, tuning: Tuning) -> Plan:
    args, kw = _args(pb)
    return attention_plan(*args, **kw, tuning=tuning)


def check(pb, tuning: Tuning) -> float:
    """Relative L2 of the kernel vs the oracle on the last :data:`CHECK_ROWS` query rows of the
    last sequence (a chunk) and on the first sequence's rows (a decode row in a mixed batch),
    over a gathered sub-cache of just those sequences."""
    pb["out"].fill_(float("nan"))
    call(pb, tuning)
    seqs = sorted({0, len(pb["shape"].seqs) - 1})
    cu = pb["cu"].tolist()
    rows, q_lens = [], []
    for s in seqs:
        n = min(CHECK_ROWS, cu[s + 1] - cu[s])
        rows.append(torch.arange(cu[s + 1] - n, cu[s + 1]))
        q_lens.append(n)
    rows = torch.cat(rows).to(pb["q"].device)
    ids = pb["table"][seqs].long()
    sub = [None if t is None else t[ids.flatten()] for t in pb["views"]]
    table = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device).view(ids.shape)
    sub_cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=ids.device)
    ref = reference_unified_attention(pb["q"][rows], sub[0], sub[1], sub_cu, pb["seqused_k"][seqs], table,
                                      pb["shape"].head_size ** -0.5, True, (-1, -1), 0.0, pb["mode"], sub[2], sub[3])
    got = pb["out"][rows].float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


class Timer:
    """Warm and cold-L2 µs of one call (CUDA-graph replays); wall clock of one call on the CPU."""

    def __init__(self, device, rep_ms, flush="read"):
        self.device, self.rep_ms, self.kind = device, rep_ms, flush
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device != "cpu" else None

    def __call__(self, fn) -> tuple:
        if self.device == "cpu":
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
            return us, us
        return graph_us(fn, self.rep_ms), cold_graph_us(fn, self.rep_ms, self.flush, self.kind)


SDPA_BACKENDS = {"cuda": ("CUDNN_ATTENTION", "FLASH_ATTENTION"), "cpu": ("MATH",)}


def sdpa_reference(shape: Shape, device, timer) -> list:
    """``[(backend, µs cold, FLOPs)]``: torch SDPA over contiguous K / V of ``shape``, a prefill
    row (every sequence ``(q_len, seq_len)`` alike): q ``[seqs, q_heads, q_len, head]``, k / v
    ``[seqs, kv_heads, seq_len, head]`` bf16, no mask, GQA by ``enable_gqa``; FLOPs ``4 * head``
    per (query head, key) pair. A backend that does not run this shape here has no entry."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    (q_len, seq_len), n = shape.seqs[0], len(shape.seqs)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    q = torch.randn(n, shape.num_q_heads, q_len, shape.head_size, device=device, dtype=dtype)
    k = torch.randn(n, shape.num_kv_heads, seq_len, shape.head_size, device=device, dtype=dtype)
    v = torch.randn_like(k)
    flops = 4 * shape.head_size * shape.num_q_heads * n * q_len * seq_len
    out = []
    for name in SDPA_BACKENDS["cpu" if device == "cpu" else "cuda"]:
        def run(backend=getattr(SDPBackend, name)):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run()
        except RuntimeError:  # no kernel of this backend for this shape / device
            continue
        out.append((name.split("_")[0].lower(), timer(run)[1], flops))
    return out


def matmul_tflops(device) -> float:
    """bf16 ``torch.matmul`` of two MATMUL_N-square matrices, TFLOP/s (the dense tensor-core rate here)."""
    if device == "cpu":
        return float("nan")
    import triton.testing
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.matmul(a, b), rep=200, return_mode="median")
    return 2 * MATMUL_N ** 3 / ms / 1e9


# --sweep: 2D-kernel tilings (block_m, tile, warps, stages), each under the variants of the cache's
# mode; a variant names the fields it turns on (VARIANT_FIELDS)
SWEEP_TILINGS = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2))
VARIANT_FIELDS = {"zp": "code_zp", "asm": "code_asm", "dq": "dequant_first", "mask": "mask_edges_only",
                  "unrot": "unrotate", "rot1": "rotate_q_once"}  # rot1 is a Tuning field, the others Tiling fields
VARIANTS = {
    KVQuantMode.NONE: ((), ("mask",)),
    KVQuantMode.INT8_PER_TOKEN_HEAD: ((), ("mask",), ("dq",), ("dq", "mask")),
    KVQuantMode.FP8_PER_TOKEN_HEAD: ((), ("mask",), ("dq",), ("dq", "mask")),
    KVQuantMode.INT4_PER_TOKEN_HEAD: ((), ("zp",), ("zp", "rot1"), ("asm",), ("zp", "rot1", "asm"), ("mask",),
                                      ("zp", "rot1", "asm", "mask"), ("dq",), ("dq", "mask"),
                                      ("dq", "mask", "unrot")),
}


def variant_tuning(tiling: Tiling, variant) -> Tuning:
    """The 2D path with ``tiling`` and the fields ``variant`` names turned on."""
    fields = {VARIANT_FIELDS[v]: True for v in variant}
    once = fields.pop("rotate_q_once", False)
    return Tuning(path=Path.PREFILL_2D, tiling=dataclasses.replace(tiling, **fields), rotate_q_once=once)


def sweep_tunings(plan: Plan, mode: KVQuantMode, tilings=SWEEP_TILINGS) -> list:
    """The default first (the planner's choice, variants included), then the 2D kernel under each
    of ``tilings`` (``(block_m, tile, warps, stages)``, default :data:`SWEEP_TILINGS`) with each of
    the mode's :data:`VARIANTS` (the others off); no repeats. Tilings that do not fit the GPU's
    shared memory are skipped at run time."""
    out = [Tuning()]
    plain = {field: False for field in VARIANT_FIELDS.values() if field != "rotate_q_once"}  # the default's variants off
    for block_m, tile, warps, stages in tilings:
        if block_m < plan.tiling.block_m:
            continue
        base = dataclasses.replace(plan.tiling, block_m=block_m, tile=tile, num_warps=warps, num_stages=stages, **plain)
        out += [variant_tuning(base, v) for v in VARIANTS[mode]]
    return list(dict.fromkeys(out))


def describe(plan: Plan) -> str:
    t = plan.tiling
    groups = f"x{t.dequant_groups}" if t.dequant_groups > 1 else ""   # dequantized for KV-head groups in turn
    extra = (" code-zp" if t.code_zp else "") + (" code-asm" if t.code_asm else "") + \
        (f" dequant-first{groups}" if t.dequant_first else "") + (" unrotated" if t.unrotate else "") + \
        (" mask-edges" if t.mask_edges_only else "") + \
        (" wgmma" if t.wgmma else "") + (" int8-keys" if t.int8_keys else "") + \
        (" tile-blocks" if t.tile_blocks else "") + \
        (f" q-rot-{plan.rotate.value}" if plan.rotate in (Rotate.TRITON, Rotate.GLUON) else "")
    return f"{plan.path.value} ({t.block_m}, {t.tile}, {t.num_warps}w, {t.num_stages}s){extra}"


def tile_blocks_tuning(plan: Plan):
    """``--tile-blocks``: where the plan dequantizes first, the plan with ``Tiling.tile_blocks``
    flipped (its scratch read as tile-sized blocks where it reads 16-slot ones, and the other way
    round); else None."""
    t = plan.tiling
    if not t.dequant_first:
        return None
    return Tuning(path=plan.path, tiling=dataclasses.replace(t, tile_blocks=not t.tile_blocks))


def bench(p, device, modes, heads, sweep, log, rep_ms=REP_MS, tilings=SWEEP_TILINGS, flush="read",
          refs=None, tile_blocks=False) -> tuple:
    """Time every row; ``refs`` (a list): append ``(shape, bf16 TFLOP/s cold, sdpa_reference(...))``
    for each prefill row (``--sdpa``); ``tile_blocks``: also the default plan with
    ``Tiling.tile_blocks`` flipped, where it dequantizes first."""
    copy = copy_gbps(device)
    tflops = matmul_tflops(device)
    log(f"copy {copy:.0f} GB/s (read + write), bf16 matmul {tflops:.0f} TFLOP/s")
    timer = Timer(device, rep_ms, flush)
    rows = []
    for shape in shapes(p, heads):
        bf16_cold = None
        for name in modes:
            pb = make_problem(MODES[name], shape, p["block_size"], device)
            bytes_us = pb["bytes"] / copy / 1e3
            flops_us = pb["flops"] / tflops / 1e6
            ceiling, bound = (bytes_us, "bytes") if bytes_us >= flops_us else (flops_us, "FLOPs")
            big = shape.seqs[-1][1] - shape.seqs[-1][0] >= max(p["cached"])
            tunings = sweep_tunings(plan_of(pb, Tuning()), pb["mode"], tilings) if sweep and big else [Tuning()]
            if tile_blocks and (extra := tile_blocks_tuning(plan_of(pb, Tuning()))) is not None:
                tunings.append(extra)
            for tuning in tunings:
                ran = plan_of(pb, tuning)
                try:
                    err = check(pb, tuning)
                except Exception as e:  # a tuning too large for this GPU (or not compiling): logged, no row
                    log(f"SKIPPED {name} h{shape.head_size} {shape.name} {describe(ran)}: "
                        f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                warm, cold = timer(lambda: call(pb, tuning)) if err <= 1e-2 else (float("nan"), float("nan"))
                if name == "bf16" and tuning == Tuning():
                    bf16_cold = cold
                    if refs is not None and len(set(shape.seqs)) == 1:
                        refs.append((shape, pb["flops"] / cold / 1e6, sdpa_reference(shape, device, timer)))
                dq_us = float("nan")
                if ran.tiling.dequant_first and tuning == Tuning() and pb["mode"] != KVQuantMode.NONE:
                    dq_us = timer(lambda: dequant(pb, ran))[1]
                row = dict(head=shape.head_size, shape=shape.name, mode=name, batch=len(shape.seqs), warm=warm,
                           cold=cold, ceiling=ceiling, bound=bound, err=err, plan=ran, swept=tuning != Tuning(),
                           vs_bf16=bf16_cold / cold if bf16_cold else float("nan"),
                           tflops=pb["flops"] / cold / 1e6, gbps=pb["bytes"] / cold / 1e3,
                           dq_us=dq_us, dq_gbps=_dequant_bytes(pb, ran) / dq_us / 1e3)
                log(f"{name} h{shape.head_size} {shape.name} {describe(ran)} err={err:.1e} warm={warm:.1f} "
                    f"cold={cold:.1f} ceiling={ceiling:.1f} ({bound})"
                    + (f" dequant={dq_us:.1f} ({row['dq_gbps']:.0f} GB/s, {100 * row['dq_gbps'] / copy:.0f}% of copy)"
                       if dq_us == dq_us else ""))
                rows.append(row)
            pb = None   # this mode's caches freed before the next mode's are made
            if device != "cpu":
                torch.cuda.empty_cache()
    return rows, copy, tflops


def table(rows, copy, tflops, device, argv, flush="read") -> str:
    name = torch.cuda.get_device_name() if device != "cpu" else "CPU (Triton interpreter; times are not measurements)"
    lines = [f"GPU: {name}; copy {copy:.0f} GB/s (read + write); bf16 matmul {tflops:.0f} TFLOP/s; "
             f"cold: L2 flushed ({flush} flush) before every replay",
             f"command: `python -m bench.attention_prefill {' '.join(argv)}`", "",
             "| head | shape | mode | seqs | µs warm | µs cold | TFLOP/s | GB/s | ceiling µs (bound) | "
             "% of limit | vs bf16 | rel. L2 | dequant µs cold (GB/s, % of copy) | "
             "kernel (block_m, tile, warps, stages) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mode = r["mode"] + (" (swept)" if r["swept"] else "")
        dq = (f"{r['dq_us']:.1f} ({r['dq_gbps']:.0f}, {100 * r['dq_gbps'] / copy:.0f}%)"
              if r["dq_us"] == r["dq_us"] else "-")
        lines.append(f"| {r['head']} | {r['shape']} | {mode} | {r['batch']} | {r['warm']:.1f} | {r['cold']:.1f} | "
                     f"{r['tflops']:.0f} | {r['gbps']:.0f} | {r['ceiling']:.1f} ({r['bound']}) | "
                     f"{100 * r['ceiling'] / r['cold']:.0f} | {r['vs_bf16']:.2f} | {r['err']:.1e} | {dq} | "
                     f"{describe(r['plan'])} |")
    return "\n".join(lines)


def sdpa_table(refs, tflops) -> str:
    """The ``--sdpa`` table: per prefill row, bf16's rate (paged, causal) and each SDPA backend's
    (contiguous, unmasked), TFLOP/s and % of the bf16 matmul rate."""
    lines = ["", "torch SDPA over contiguous K / V of the same shapes (no mask; each rate on its own FLOPs):", "",
             "| head | shape | bf16 (this project, paged) TFLOP/s (% of matmul) | SDPA backend | µs cold | "
             "TFLOP/s (% of matmul) |", "|---:|---|---:|---|---:|---:|"]
    for shape, ours, ref in refs:
        for backend, us, flops in ref:
            rate = flops / us / 1e6
            lines.append(f"| {shape.head_size} | {shape.name} | {ours:.0f} ({100 * ours / tflops:.0f}%) | {backend} | "
                         f"{us:.1f} | {rate:.0f} ({100 * rate / tflops:.0f}%) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.attention_prefill", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--modes", default="bf16,int8,fp8,int4", help="comma-separated subset of bf16,int8,fp8,int4")
    parser.add_argument("--heads", default=None, help="head sizes, comma-separated (default 64,128,256)")
    parser.add_argument("--sweep", action="store_true",
                        help="32k-cached rows: time every tuning of sweep_tunings side by side")
    parser.add_argument("--tilings", default=None,
                        help="with --sweep: the 2D tilings to time, 'block_m,tile,warps,stages' separated by ';' "
                             "(default SWEEP_TILINGS)")
    parser.add_argument("--q-lens", default=None, help="chunk lengths, comma-separated (default 512,2048)")
    parser.add_argument("--cached", default=None, help="cached tokens before each chunk (default 0,4096,32768)")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                        help="include the mixed-batch row (--no-mixed: leave it out)")
    parser.add_argument("--rep-ms", type=int, default=REP_MS, help="timing budget per configuration (ms)")
    parser.add_argument("--flush", default="read", choices=FLUSHES,
                        help="cold L2: read the 256 MiB buffer (clean L2, default) or write it (dirty L2)")
    parser.add_argument("--log", default=None, help="append every timed configuration to this file")
    parser.add_argument("--sdpa", action="store_true",
                        help="also time torch SDPA (cuDNN / flash; CPU: math) on contiguous K / V of the prefill rows")
    parser.add_argument("--tile-blocks", action="store_true",
                        help="also time each quantized row's default plan with Tiling.tile_blocks flipped (scratch "
                        "read as tile-sized blocks or as 16-slot ones)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    p = dict(SMOKE if args.smoke else FULL)
    if args.q_lens:
        p["q_lens"] = tuple(int(x) for x in args.q_lens.split(","))
    if args.cached:
        p["cached"] = tuple(int(x) for x in args.cached.split(","))
    if not args.mixed:
        p["mixed"] = None
    heads = [int(h) for h in args.heads.split(",")] if args.heads else list(p["heads"])
    unknown = [h for h in heads if h not in p["heads"]]
    if unknown:
        parser.error(f"--heads: expected some of {list(p['heads'])}, got {unknown}")
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: expected a subset of {list(MODES)}, got {args.modes!r}")
    modes = ["bf16"] + [m for m in modes if m != "bf16"]  # the ratios need bf16 first
    tilings = SWEEP_TILINGS
    if args.tilings:
        try:
            tilings = tuple(tuple(int(x) for x in t.split(",")) for t in args.tilings.split(";") if t)
        except ValueError:
            tilings = ()
        if not tilings or any(len(t) != 4 or min(t) < 1 for t in tilings):
            parser.error(f"--tilings: expected 'block_m,tile,warps,stages' separated by ';', got {args.tilings!r}")
    refs = [] if args.sdpa else None
    rows, copy, tflops = bench(p, device, modes, heads, args.sweep, tee(args.log), args.rep_ms, tilings, args.flush,
                               refs, args.tile_blocks)
    print(table(rows, copy, tflops, device, list(argv), args.flush))
    if refs is not None:
        print(sdpa_table(refs, tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
