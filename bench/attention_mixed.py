"""The ``--mixed`` table of ``bench.attention``: mixed batches, one call against its halves.

A mix is ``d`` decode rows (one query token each, first in the batch, as vLLM orders them) and
one or two prefill chunks. Per mix and mode, in the same run: (a) one ``unified_attention`` call
with ``num_decode_seqs=d``, (b) its decode half alone plus its chunk half alone (each a call of
its own on views of the same tensors), (c) the batch as one call without ``num_decode_seqs`` (the
2D kernel for every row); warm, and with ``--cold-l2`` also with the L2 flushed before each call.
Every mix's mixed call is first checked against the oracle (first and last decode row, first
chunk; relative L2). Run: ``python -m bench.attention --mixed [--cold-l2] [--quick]``.
"""

from __future__ import annotations

import torch

from bench.attention import MODES, describe, fill_cache, shuffled_block_table, timed_us
from kernels.attention import Plan, attention_plan, unified_attention
from kernels.reference import reference_unified_attention
from layouts import CacheGeometry

# --mixed: (decode rows, their context, [(chunk tokens, chunk context), ...]), at FULL's (or QUICK's) heads
MIXES = [(1, 4096, [(128, 4096)]), (4, 8192, [(512, 8192)]), (16, 8192, [(512, 8192)]),
         (16, 32768, [(2048, 32768)]), (64, 4096, [(256, 4096), (1024, 16384)]),
         (64, 16384, [(512, 8192), (2048, 32768)])]
QUICK_MIXES = [(1, 9, [(8, 40)]), (3, 33, [(5, 40), (9, 20)])]


def make_mixed(mode, d, dec_ctx, chunks, p, device, seed=0):
    """A mixed batch: ``d`` decode rows of ``dec_ctx`` keys first, then ``chunks`` [(tokens,
    context)] (each chunk the last ``tokens`` queries of its context); random cache, shuffled
    block table. Also the two halves as calls of their own: ``dec`` (views of the first ``d``
    rows) and ``chunk`` (rows ``d:`` with ``cu_seqlens_q`` rebased to 0)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    geo = CacheGeometry(mode, p["head_size"], p["num_kv_heads"], p["block_size"], torch.bfloat16)
    q_lens = [1] * d + [n for n, _ in chunks]
    k_lens = [dec_ctx] * d + [k for _, k in chunks]
    bs = p["block_size"]
    blocks = [-(-k // bs) for k in k_lens]
    cache, views = fill_cache(mode, geo, sum(blocks), device, gen)
    table = shuffled_block_table(blocks, device, gen)
    cu_host = [0]
    for n in q_lens:
        cu_host.append(cu_host[-1] + n)
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    q = torch.randn(cu_host[-1], p["num_q_heads"], p["head_size"], device=device, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=device)
    whole = dict(mode=mode, views=views, q=q, out=out, cu=cu, seqused_k=seqused, table=table,
                 max_q=max(q_lens), max_k=max(k_lens), cu_host=cu_host, cache=cache)
    dec = dict(whole, q=q[:d], out=out[:d], cu=cu[:d + 1], seqused_k=seqused[:d], table=table[:d], max_q=1,
               max_k=dec_ctx)
    chunk = dict(whole, q=q[d:], out=out[d:], cu=cu[d:] - d, seqused_k=seqused[d:], table=table[d:],
                 max_q=max(n for n, _ in chunks), max_k=max(k for _, k in chunks))
    return whole, dec, chunk


def mixed_call(pb, **kw):
    v = pb["views"]
    return unified_attention(pb["q"], v.key_cache, v.value_cache, pb["out"], pb["cu"], pb["seqused_k"], pb["max_q"],
                             pb["max_k"], pb["q"].shape[-1] ** -0.5, True, (-1, -1), pb["table"], 0.0, None, None,
                             None, kv_quant_mode=pb["mode"], k_scale_cache=v.k_scale_cache,
                             v_scale_cache=v.v_scale_cache, **kw)


def mixed_plan(pb, **kw) -> Plan:
    v = pb["views"]
    return attention_plan(pb["q"], v.key_cache, v.value_cache, pb["out"], pb["cu"], pb["seqused_k"], pb["max_q"],
                          pb["max_k"], pb["q"].shape[-1] ** -0.5, True, (-1, -1), pb["table"], 0.0,
                          kv_quant_mode=pb["mode"], k_scale_cache=v.k_scale_cache, v_scale_cache=v.v_scale_cache,
                          **kw)


def mixed_check(pb, d) -> float:
    """Relative L2 vs the oracle of the mixed call (``num_decode_seqs``, out poisoned first) on
    the first and last decode row and the first chunk (a gathered sub-cache)."""
    pb["out"].fill_(float("nan"))
    mixed_call(pb, num_decode_seqs=d)
    cu_host = pb["cu_host"]
    seqs = sorted({0, d - 1, d})
    ids = [pb["table"][s, :-(-int(pb["seqused_k"][s]) // pb["views"].key_cache.shape[1])].long() for s in seqs]
    width = max(x.numel() for x in ids)
    flat = torch.cat(ids)
    v = pb["views"]
    sub = [None if t is None else t[flat] for t in v]
    table = torch.zeros(len(seqs), width, dtype=torch.int32, device=flat.device)
    start = 0
    for i, x in enumerate(ids):
        table[i, :x.numel()] = torch.arange(start, start + x.numel(), dtype=torch.int32, device=flat.device)
        start += x.numel()
    rows = torch.cat([torch.arange(cu_host[s], cu_host[s + 1]) for s in seqs]).to(flat.device)
    lens = [cu_host[s + 1] - cu_host[s] for s in seqs]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=flat.device)
    ref = reference_unified_attention(pb["q"][rows], sub[0], sub[1], cu, pb["seqused_k"][seqs], table,
                                      pb["q"].shape[-1] ** -0.5, True, (-1, -1), 0.0, pb["mode"], sub[2], sub[3])
    got = pb["out"][rows].float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def bench_mixed(p, device, modes, mixes, cold, log) -> list:
    """Rows of the mixed table: per mix and mode, (a) one call with ``num_decode_seqs``, (b) the
    decode half + the chunk half as calls of their own, (c) one call without ``num_decode_seqs``;
    warm (and cold with ``cold``), all in this run."""
    rows = []
    for d, dec_ctx, chunks in mixes:
        for name in modes:
            rows.append(_mixed_row(MODES[name], d, dec_ctx, chunks, p, device, cold, log))
            if device != "cpu":
                torch.cuda.empty_cache()  # the mix's cache is freed on return
    return rows


def _mixed_row(mode, d, dec_ctx, chunks, p, device, cold, log) -> dict:
    whole, dec, chunk = make_mixed(mode, d, dec_ctx, chunks, p, device)
    plan = mixed_plan(whole, num_decode_seqs=d)
    err = mixed_check(whole, d)
    name = next(k for k, m in MODES.items() if m == mode)
    r = dict(mode=name, d=d, dec_ctx=dec_ctx, chunks=chunks, err=err, plan=plan)
    for temp in ("warm", "cold") if cold else ("warm",):
        c = temp == "cold"
        t = r[temp] = dict(a=timed_us(lambda: mixed_call(whole, num_decode_seqs=d), device, c),
                           dec=timed_us(lambda: mixed_call(dec), device, c),
                           chunk=timed_us(lambda: mixed_call(chunk), device, c),
                           c=timed_us(lambda: mixed_call(whole), device, c))
        log(f"mixed {name} {temp} d{d}@{dec_ctx} chunks {chunks}: a={t['a']:.1f} dec={t['dec']:.1f} "
            f"chunk={t['chunk']:.1f} c={t['c']:.1f} err={err:.2e} {plan.why}")
    return r


def mixed_table(rows, p, device, argv) -> str:
    name = torch.cuda.get_device_name() if device != "cpu" else "CPU (Triton interpreter; times are not measurements)"
    temps = [t for t in ("warm", "cold") if t in rows[0]] if rows else []
    lines = [f"GPU: {name}; head {p['head_size']}, {p['num_q_heads']} q / {p['num_kv_heads']} KV heads, "
             f"block {p['block_size']}",
             f"command: `python -m bench.attention {' '.join(argv)}`",
             "(a) one call with num_decode_seqs; (b) decode half alone + chunk half alone; "
             "(c) one call without num_decode_seqs (the 2D kernel for the whole batch)", ""]
    head = "| mode | decode rows x context | chunks (tokens@context) |"
    rule = "|---|---|---|"
    for t in temps:
        head += f" {t} (a) µs | {t} (b) µs | {t} (c) µs | {t} (a)/(b) |"
        rule += "---:|---:|---:|---:|"
    lines += [head + " rel. L2 | decode rows' kernel |", rule + "---:|---|"]
    for r in rows:
        chunks = ", ".join(f"{n}@{k}" for n, k in r["chunks"])
        line = f"| {r['mode']} | {r['d']} x {r['dec_ctx']} | {chunks} |"
        for t in temps:
            x = r[t]
            b = x["dec"] + x["chunk"]
            line += f" {x['a']:.1f} | {x['dec']:.1f} + {x['chunk']:.1f} = {b:.1f} | {x['c']:.1f} | {x['a'] / b:.2f} |"
        dec = r["plan"].parts[0] if r["plan"].parts else r["plan"]
        lines.append(line + f" {r['err']:.1e} | {describe(dec)} |")
    return "\n".join(lines)
