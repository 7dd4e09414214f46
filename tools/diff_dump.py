"""Compare two dumps by layer/block/head, in bytes and dequantized values (exit 1 if they differ)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields

import torch

from kernels.reference import dequantize_rows
from layouts import LayoutDescriptor

from .cache_stats import KV_NAMES, split_block
from .argtypes import non_negative_int
from .dump import cli_guard
from .inspect_dump import BlockSource

ROW_FIELDS = ("head_size", "block_size", "head_start", "num_kv_heads")  # must match to compare values


def descriptor_diffs(a: LayoutDescriptor, b: LayoutDescriptor) -> list[tuple[str, object, object]]:
    return [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in fields(a)
            if getattr(a, f.name) != getattr(b, f.name)]


def diff_block(a: torch.Tensor, b: torch.Tensor, da: LayoutDescriptor, db: LayoutDescriptor) -> list[dict]:
    """Per (K/V, head) differences of two blocks holding the same rows.

    Parameters
    ----------
    a, b : [2, block_size, num_kv_heads, P] storage dtype of ``da`` / ``db``, CPU

    Returns
    -------
    list of dict, one per (K/V, head) that differs: ``bytes`` (differing bytes, None when
    the layouts differ so bytes are not comparable), ``max_abs`` and ``rel_l2`` of the
    dequantized values (over entries finite in both), ``nonfinite_mismatch`` (entries
    finite in one and not the other).
    """
    ga, gb = da.geometry(), db.geometry()
    same_layout = da.fingerprint() == db.fingerprint()
    if same_layout:
        nbytes = (a.view(torch.uint8) != b.view(torch.uint8)).sum((1, 3))           # [2, H]
    xa = dequantize_rows(*split_block(a, ga), ga.mode).double()
    xb = dequantize_rows(*split_block(b, gb), gb.mode).double()
    fa, fb = torch.isfinite(xa), torch.isfinite(xb)
    both = fa & fb
    e = torch.where(both, xa - xb, 0.0)
    err_sq = (e * e).sum((1, 3))
    ref_sq = torch.where(both, xb * xb, 0.0).sum((1, 3))
    max_abs = e.abs().amax((1, 3))
    mismatch = (fa != fb).sum((1, 3))
    out = []
    for kv in (0, 1):
        for h in range(ga.num_kv_heads):
            nb = int(nbytes[kv, h]) if same_layout else None
            if nb == 0 or (nb is None and float(max_abs[kv, h]) == 0 and int(mismatch[kv, h]) == 0):
                continue
            rs = float(ref_sq[kv, h])
            out.append({"kv": KV_NAMES[kv], "head": da.head_start + h, "bytes": nb,
                        "max_abs": float(max_abs[kv, h]),
                        "rel_l2": math.sqrt(float(err_sq[kv, h]) / rs) if rs > 0 else None,
                        "nonfinite_mismatch": int(mismatch[kv, h])})
    return out


def diff_dumps(path_a, path_b) -> dict:
    """Compare two dumps (or cache files).

    Returns
    -------
    dict with ``layout`` (differing descriptor fields), ``only_a`` / ``only_b`` ((layer, block)
    pairs present in one only), ``blocks`` (one entry per differing (layer, block) with its
    per-head list from :func:`diff_block`), ``compared`` (blocks compared) and ``identical``.
    """
    a, b = BlockSource(path_a), BlockSource(path_b)
    try:
        layout = descriptor_diffs(a.desc, b.desc)
        comparable = all(getattr(a.desc, n) == getattr(b.desc, n) for n in ROW_FIELDS)
        keys_b = {(l, k) for l in b.layers for k in b.block_ids}
        keys_a = {(l, k) for l in a.layers for k in a.block_ids}
        blocks, compared = [], 0
        if comparable:
            for layer, blk_id, blk in a.blocks():
                if (layer, blk_id) not in keys_b:
                    continue
                heads = diff_block(blk, b.block(layer, blk_id), a.desc, b.desc)
                compared += 1
                if heads:
                    blocks.append({"layer": layer, "block": blk_id, "heads": heads})
    finally:
        a.close()
        b.close()
    only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
    return {"a": str(path_a), "b": str(path_b), "layout": [list(x) for x in layout], "comparable": comparable,
            "only_a": only_a, "only_b": only_b, "compared": compared, "blocks": blocks,
            "identical": comparable and not (layout or only_a or only_b or blocks)}


def format_diff(d: dict, limit: int | None = 20) -> str:
    """The summary first, then layout and missing-block lines, then at most ``limit`` detail
    rows (K/V heads that differ, largest relative error first; None: all of them)."""
    rows = [(blk, h) for blk in d["blocks"] for h in blk["heads"]]
    lines = [f"--- {d['a']}", f"+++ {d['b']}"]
    if d["identical"]:
        lines.append(f"identical ({d['compared']} blocks compared)")
    else:
        summary = f"differ: {len(d['blocks'])} of {d['compared']} compared blocks ({len(rows)} K/V heads)"
        missing = len(d["only_a"]) + len(d["only_b"])
        summary += f", {missing} blocks in one file only" if missing else ""
        summary += f", {len(d['layout'])} layout fields" if d["layout"] else ""
        lines.append(summary)
    lines += [f"layout {n}: {x!r} != {y!r}" for n, x, y in d["layout"]]
    if not d["comparable"]:
        lines.append(f"rows not comparable: {', '.join(ROW_FIELDS)} must match")
    for name in ("only_a", "only_b"):
        if d[name]:
            shown = ", ".join(f"L{l}/B{b}" for l, b in d[name][:20])
            lines.append(f"{name.replace('_', ' in ')}: {len(d[name])} blocks: {shown}{' ...' if len(d[name]) > 20 else ''}")
    rows.sort(key=lambda r: -(r[1]["rel_l2"] if r[1]["rel_l2"] is not None else math.inf))
    shown = rows if limit is None else rows[:limit]
    if shown:
        lines.append("layer block kv head  bytes     max|a-b|     rel L2  nonfinite")
    for blk, h in shown:
        nb = "-" if h["bytes"] is None else str(h["bytes"])
        rel = "-" if h["rel_l2"] is None else f"{h['rel_l2']:.3g}"
        lines.append(f"{blk['layer']:>5} {blk['block']:>5} {h['kv']:>2} {h['head']:>4} {nb:>6} "
                     f"{h['max_abs']:>12.4g} {rel:>10} {h['nonfinite_mismatch']:>10}")
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more K/V heads differ (--limit N or --all to show them)")
    return "\n".join(lines)


EXAMPLES = """\
  kvconnector diff a.kvd b.kvd                  # summary, then the 20 worst K/V heads
  kvconnector diff a.kvd b.kvd --limit 100
  kvconnector diff a.kvd b.kvd --json | jq .identical
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first dump (or cache file)")
    p.add_argument("b", help="second dump (or cache file)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--limit", type=non_negative_int, default=20,
                   help="detail lines (K/V heads that differ, worst first) after the summary; default 20")
    p.add_argument("--all", action="store_true", help="every detail line")


def _run(args) -> int:
    d = diff_dumps(args.a, args.b)
    print(json.dumps(d) if args.json else format_diff(d, None if args.all else args.limit))
    return 0 if d["identical"] else 1


def run(args) -> int:
    return cli_guard("diff", _run, args, error_code=2)
