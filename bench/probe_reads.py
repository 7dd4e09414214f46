"""Read-only probes of a paged KV cache: how fast can a decode kernel's *access pattern* go?

Two Triton kernels read the codes and scale words of every visible key (K and V) of a batch
through a shuffled block table and only XOR / add them, so they measure the memory side of a
decode kernel without its maths:

- ``head``: one program per (sequence, KV head, segment), reading that head's ``U`` code words
  and scale word of each token, as ``decode_code_units`` does (branching once on the row's 16-,
  8- or 4-byte alignment);
- ``row3d``: one program per (sequence, segment), reading ``[TILE, heads, U]`` code words and
  ``[TILE, heads]`` scale words, i.e. whole token rows;
- ``block``: one program per (sequence, KV head, segment) addressed as ``decode_block_tiles`` does: tiles of whole cache blocks, one block id per tile when the tile
  is one block, loop-invariant slot / head offsets, 4-byte words, no alignment branch.

Rows are ``R`` 4-byte words apart (INT4 head_size 128: 17 words = 68 bytes, 16 of them codes;
INT8: 33 and 32; bf16: 64 and 64 with no scale word). Each probe's result is checked against a
torch sum on the first run. ``--padded`` also times the real INT4 / INT8 decode on caches whose
rows are padded (same useful bytes, other alignment).

Run: ``python -m bench.probe_reads`` (H200; ``--block`` times only the ``block``
probe's sweep), ``--quick`` (tiny, CPU interpreter: checks the addressing, times nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from kernels._jit import dual_jit, prev_pow2  # noqa: E402
from bench.timing import graph_us  # noqa: E402


@triton.jit
def _head_loop(w_ptr, bt_row, t0, t1, head, v_off, stride_b, stride_s, acc,
               TILE: tl.constexpr, U: tl.constexpr, BS: tl.constexpr, AB: tl.constexpr,
               SC: tl.constexpr, ALIGN: tl.constexpr):
    head = (head // ALIGN) * ALIGN  # exact in this branch; tells Triton's alignment analysis
    offs_u = tl.arange(0, U)
    for t in range(t0, t1):
        kp = t * TILE + tl.arange(0, TILE)
        blk = tl.load(bt_row + kp // BS).to(tl.int64)
        row = blk * (stride_b * AB) + (kp % BS) * (stride_s * AB) + head
        x = tl.load(w_ptr + row[:, None] + offs_u[None, :]) ^ tl.load(w_ptr + v_off * AB + row[:, None] + offs_u[None, :])
        if SC:
            x += (tl.load(w_ptr + row + U) ^ tl.load(w_ptr + v_off * AB + row + U))[:, None]
        acc += x
    return acc


@dual_jit
def _probe_head(w_ptr, bt_ptr, out_ptr, stride_b, stride_s, stride_h, v_off, stride_bt, per_seg,
                TILE: tl.constexpr, U: tl.constexpr, BS: tl.constexpr, AB: tl.constexpr, SC: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    head = h * stride_h
    bt_row = bt_ptr + seq * stride_bt
    t0 = seg * per_seg
    acc = tl.zeros([TILE, U], tl.int32)
    if head % 4 == 0:
        acc = _head_loop(w_ptr, bt_row, t0, t0 + per_seg, head, v_off, stride_b, stride_s, acc, TILE, U, BS, AB, SC, 4)
    elif head % 2 == 0:
        acc = _head_loop(w_ptr, bt_row, t0, t0 + per_seg, head, v_off, stride_b, stride_s, acc, TILE, U, BS, AB, SC, 2)
    else:
        acc = _head_loop(w_ptr, bt_row, t0, t0 + per_seg, head, v_off, stride_b, stride_s, acc, TILE, U, BS, AB, SC, 1)
    tl.store(out_ptr + (seq * tl.num_programs(1) + h) * tl.num_programs(2) + seg, tl.sum(tl.sum(acc, 1), 0))


@dual_jit
def _probe_row3d(w_ptr, bt_ptr, out_ptr, stride_b, stride_s, v_off, stride_bt, per_seg, R: tl.constexpr,
                 H: tl.constexpr, U: tl.constexpr, TILE: tl.constexpr, BS: tl.constexpr, AB: tl.constexpr,
                 SC: tl.constexpr):
    seq = tl.program_id(0)
    seg = tl.program_id(1)
    offs_h = tl.arange(0, H)
    hu = offs_h[:, None] * R + tl.arange(0, U)[None, :]
    acc = tl.zeros([TILE, H, U], tl.int32)
    t0 = seg * per_seg
    for t in range(t0, t0 + per_seg):
        kp = t * TILE + tl.arange(0, TILE)
        blk = tl.load(bt_ptr + seq * stride_bt + kp // BS).to(tl.int64)
        row = blk * (stride_b * AB) + (kp % BS) * (stride_s * AB)
        x = tl.load(w_ptr + row[:, None, None] + hu[None, :, :]) ^ \
            tl.load(w_ptr + v_off * AB + row[:, None, None] + hu[None, :, :])
        if SC:
            sw = row[:, None] + offs_h[None, :] * R + U
            x += (tl.load(w_ptr + sw) ^ tl.load(w_ptr + v_off * AB + sw))[:, :, None]
        acc += x
    tl.store(out_ptr + seq * tl.num_programs(1) + seg, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0))


@dual_jit
def _probe_block(w_ptr, bt_ptr, out_ptr, stride_b, stride_s, v_off, stride_bt, per_seg, R: tl.constexpr,
                 U: tl.constexpr, TILE: tl.constexpr, BS: tl.constexpr, SC: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    slot = tl.arange(0, TILE) % BS
    off = slot[:, None] * stride_s + h * R + tl.arange(0, U)[None, :]      # loop invariant
    s_off = slot * stride_s + h * R + U
    bt_row = bt_ptr + seq * stride_bt
    acc = tl.zeros([TILE, U], tl.int32)
    t0 = seg * per_seg
    for t in range(t0, t0 + per_seg):
        if TILE == BS:  # one block id per tile
            base = tl.load(bt_row + t).to(tl.int64) * stride_b
            x = tl.load(w_ptr + base + off) ^ tl.load(w_ptr + v_off + base + off)
            if SC:
                x += (tl.load(w_ptr + base + s_off) ^ tl.load(w_ptr + v_off + base + s_off))[:, None]
        else:  # whole blocks, one id per key
            base = tl.load(bt_row + (t * TILE + tl.arange(0, TILE)) // BS).to(tl.int64) * stride_b
            x = tl.load(w_ptr + base[:, None] + off) ^ tl.load(w_ptr + v_off + base[:, None] + off)
            if SC:
                x += (tl.load(w_ptr + base + s_off) ^ tl.load(w_ptr + v_off + base + s_off))[:, None]
        acc += x
    tl.store(out_ptr + (seq * tl.num_programs(1) + h) * tl.num_programs(2) + seg, tl.sum(tl.sum(acc, 1), 0))


def _time_us(fn, device) -> float:
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return graph_us(fn, 40)


def _expected(back, table, R, U, segs, per_head):
    """Torch sums of what each program reads (int32 wrap-around), ``[programs]``."""
    nb, _, bs, heads, _ = back.shape
    kk = back[:, 0].reshape(nb * bs, heads, R).long()
    vv = back[:, 1].reshape(nb * bs, heads, R).long()
    tok = (table.long()[:, :, None] * bs + torch.arange(bs, device=back.device)).view(table.shape[0], -1)
    x = kk[tok][..., :U] ^ vv[tok][..., :U]
    if R > U:
        x = x + (kk[tok][..., U] ^ vv[tok][..., U])[..., None]
    x = x.view(table.shape[0], segs, -1, heads, U)
    s = x.permute(0, 3, 1, 2, 4).sum((-1, -2)) if per_head else x.sum((2, 3, 4))
    return ((s + 2**31) % 2**32 - 2**31).reshape(-1).to(torch.int32)


def probe(batch, ctx, R, U, device, heads=8, bs=16, head_cfg=(64, 16, 2), row_cfgs=((16, 64, 4),), block_cfgs=(),
          log=print):
    """Time the probes; ``R``, ``U`` in 4-byte words; ``head_cfg`` (tile, segments, warps; None:
    skipped), ``row_cfgs`` [(tile, segments, warps)], ``block_cfgs`` [(tile, segments, warps,
    stages)]. Returns {name: µs}."""
    nb = batch * ctx // bs
    g = torch.Generator(device=device).manual_seed(0)
    back = torch.empty(nb, 2, bs, heads, R, dtype=torch.int32, device=device).random_(generator=g)
    table = torch.randperm(nb, device=device, generator=g).to(torch.int32).view(batch, -1)
    w = back.view(-1)
    sb, ss, sv = back.stride(0), back.stride(2), back.stride(1)
    ab = 4 if sb % 4 == 0 and ss % 4 == 0 and sv % 4 == 0 else 1
    useful = batch * ctx * heads * 2 * (U + (R > U)) * 4
    res = {}

    def run(name, fn, out, segs, per_head, line):
        fn()
        if not torch.equal(out, _expected(back, table, R, U, segs, per_head)):
            raise AssertionError(f"probe {name} R={R} U={U}: sum differs from torch ({line})")
        res[name] = us = _time_us(fn, device)
        log(f"R={4 * R}B U={4 * U}B b{batch}@{ctx} {line}: {us:.1f} us, {useful / us / 1e3:.0f} GB/s useful")

    for tile, segs, warps, stages in block_cfgs:
        out = torch.empty(batch * heads * segs, dtype=torch.int32, device=device)
        fn = lambda: _probe_block[(batch, heads, segs)](  # noqa: E731
            w, table, out, sb, ss, sv, table.stride(0), ctx // tile // segs, R=R, U=U, TILE=tile, BS=bs,
            SC=R > U, num_warps=warps, num_stages=stages)
        run(f"block {tile}/{segs}/{warps}/{stages}", fn, out, segs, True,
            f"block tile {tile} segs {segs} warps {warps} stages {stages}")
    if head_cfg is not None:
        tile, segs, warps = head_cfg
        out = torch.empty(batch * heads * segs, dtype=torch.int32, device=device)
        fn = lambda: _probe_head[(batch, heads, segs)](  # noqa: E731
            w, table, out, sb // ab, ss // ab, R, sv // ab, table.stride(0), ctx // tile // segs,
            TILE=tile, U=U, BS=bs, AB=ab, SC=R > U, num_warps=warps)
        run("head", fn, out, segs, True, f"head  tile {tile} segs {segs} warps {warps}")
    for tile, segs, warps in row_cfgs:
        out = torch.empty(batch * segs, dtype=torch.int32, device=device)
        fn = lambda: _probe_row3d[(batch, segs)](  # noqa: E731
            w, table, out, sb // ab, ss // ab, sv // ab, table.stride(0), ctx // tile // segs,
            R=R, H=heads, U=U, TILE=tile, BS=bs, AB=ab, SC=R > U, num_warps=warps)
        run(f"row3d {tile}/{segs}/{warps}", fn, out, segs, False, f"row3d tile {tile} segs {segs} warps {warps}")
    return res


def padded_decode(mode, batch, ctx, R, device, log=print):
    """Default decode (``unified_attention``) on a cache whose (token, head) rows are ``R`` bytes
    apart instead of ``data + 4``; checked against the oracle, then timed."""
    from layouts import KVCacheViews, KVQuantMode
    from bench import attention as ba
    p = dict(ba.FULL)
    hs, heads, bs = p["head_size"], p["num_kv_heads"], p["block_size"]
    data = hs // 2 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else hs
    g = torch.Generator(device=device).manual_seed(1)
    nb = batch * ctx // bs
    back = torch.empty(nb, 2, bs, heads, R, dtype=torch.uint8, device=device).random_(0, 256, generator=g)
    cdt = torch.uint8 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else torch.int8
    k, v = back[:, 0, ..., :data].view(cdt), back[:, 1, ..., :data].view(cdt)
    ks = back[:, 0, ..., data:data + 4].view(torch.float32)[..., 0]
    vs = back[:, 1, ..., data:data + 4].view(torch.float32)[..., 0]
    views = KVCacheViews(k, v, ks, vs)
    ba.fill_values(views, mode, device, g)
    perm = torch.randperm(nb, device=device, generator=g).to(torch.int32).view(batch, -1)
    q = torch.randn(batch, p["num_q_heads"], hs, device=device, generator=g).to(torch.bfloat16)
    pb = dict(mode=mode, views=views, tables=[perm], q=q, q_len=1, ctx=ctx, batch=batch,
              cu=torch.arange(batch + 1, dtype=torch.int32, device=device), out=torch.empty_like(q),
              seqused_k=torch.full((batch,), ctx, dtype=torch.int32, device=device))
    tuning = ba.Tuning()
    err = ba.check(pb, tuning)
    if not err <= 1e-2:
        raise AssertionError(f"padded {mode.name} R={R}: relative L2 {err:.2e}")
    us = ba.time_us(pb, tuning)
    log(f"decode {mode.name} b{batch}@{ctx} row pitch {R} B: {us:.1f} us (rel. L2 {err:.1e}, "
        f"{ba.describe(ba.plan_of(pb, tuning))})")
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU interpreter (addressing check)")
    ap.add_argument("--padded", action="store_true", help="also time the decode on padded-row caches")
    ap.add_argument("--block", action="store_true", help="only the 'block' probe (decode_block_tiles' addressing), b8 and b32 @ 32k")
    ap.add_argument("--out", default=None, help="also append the lines to this file")
    args = ap.parse_args(argv)
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"

    def log(msg):
        print(msg, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(msg + "\n")

    if device == "cpu":
        for R, U in ((17, 16), (64, 64)):
            probe(2, 128, R, U, device, heads=4, head_cfg=(16, 2, 1), row_cfgs=((16, 2, 1),),
                  block_cfgs=((16, 2, 1, 2), (32, 2, 1, 2)), log=log)
        return 0
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.block:
        cfgs = ((16, 1, 2, 8), (32, 1, 2, 8), (16, 1, 3, 8), (16, 1, 2, 16), (32, 1, 2, 16), (64, 1, 2, 8),
                (16, 2, 2, 8), (32, 2, 2, 8))  # tile, warps, stages, programs per SM
        for batch in (8, 32):
            for R, U in ((17, 16), (33, 32), (64, 64)):
                segs = [max(2, min(per_sm * 132 // (batch * 8), 32768 // t)) for t, _, _, per_sm in cfgs]
                block = [(t, prev_pow2(n), w, st) for (t, w, st, _), n in zip(cfgs, segs)]
                probe(batch, 32768, R, U, device, head_cfg=None, row_cfgs=(), block_cfgs=block, log=log)
        return 0
    rows = ((16, 16, 8), (16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 64, 8), (16, 128, 2), (32, 128, 4))
    for R, U in ((17, 16), (20, 16), (33, 32), (36, 32), (64, 64)):
        probe(8, 32768, R, U, device, row_cfgs=rows, log=log)
    if args.padded:
        from layouts import KVQuantMode
        for mode, pitches in ((KVQuantMode.INT4_PER_TOKEN_HEAD, (68, 80, 128)),
                              (KVQuantMode.INT8_PER_TOKEN_HEAD, (132, 144, 256))):
            for R in pitches:
                padded_decode(mode, 8, 32768, R, device, log=log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(os.sys.argv[1:]))
