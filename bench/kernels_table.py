"""Print the "## Attention" section of docs/KERNELS.md: which kernel runs when, and why each exists.

The tables are ``kernels.attention_plan`` over a grid of decode and prefill shapes, planned for
the CPU (Triton's interpreter) and for an H200 (``kernels.attention.H200``: 132 SMs, sm_90,
Gluon; fake device facts, so this runs anywhere). Only shapes, strides and addresses are read,
so a 4-block cache stands for every context length.

Run: ``python -m bench.kernels_table > /tmp/attention.md`` (then paste it over the section).
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernels.attention import CPU, H200, Path, Plan, attention_plan
from kernels.attention.decode_staged import MIN_KEYS
from kernels.attention.plan import OVERLAP_MAX_DECODE_KEYS, OVERLAP_MIN_QUANTIZED_DECODE_KEYS
from layouts import CacheGeometry, KVQuantMode, split_kv_cache

MODES = {"bf16": KVQuantMode.NONE, "int8": KVQuantMode.INT8_PER_TOKEN_HEAD, "fp8": KVQuantMode.FP8_PER_TOKEN_HEAD,
         "int4": KVQuantMode.INT4_PER_TOKEN_HEAD}
DECODE = [(1, 4096), (1, 32768), (2, 32768), (8, 32768), (32, 32768), (12, 16384), (64, 4096)]
MIXED = [(1, 4096, 128, 4096), (16, 8192, 512, 8192), (64, 32768, 2048, 32768)]  # decode rows @ ctx, chunk @ ctx
FILES = {
    Path.MIXED: "`plan.py`, `run.py` (then its parts' files)",
    Path.PREFILL_2D: "`prefill_2d.py` (INT4: `prefill_2d_int4.py`)",
    Path.DECODE_SPLIT: "`decode_split.py`",
    Path.DECODE_CODE_UNITS: "`decode_code_units.py`",
    Path.DECODE_BLOCK_TILES: "`decode_block_tiles.py`",
    Path.DECODE_STAGED_INT4: "`decode_staged.py` + `decode_staged_int4_gluon.py`",
    Path.DECODE_STAGED_INT8: "`decode_staged.py` + `decode_staged_int8_gluon.py`",
}
WHY = {
    Path.MIXED: "A mixed batch whose decode rows the caller counts (`num_decode_seqs`; vLLM puts them first): "
                "the decode rows run as a decode batch of their own (their plan is `parts[0]`), the chunk "
                "rows through the 2D kernel (`parts[1]`), on views of q and out: no copy, no device sync. On "
                "CUDA a small decode part (`Plan.overlap`) runs on a second stream alongside the chunk, joined "
                "before the call returns; larger ones run first. Without the count the whole batch takes the "
                "2D kernel.",
    Path.PREFILL_2D: "Several queries per sequence (prefill, a mixed batch's chunks): a program owns a tile of "
                     "query rows x the GQA group, so each K/V byte feeds every head of the group. Also the bf16/fp16 decode "
                     "(keys split into segments when the grid would leave SMs idle; on sm_90, as many as fill whole "
                     "waves of its resident programs; short contexts down to one 64-key tile a segment while the "
                     "grid holds at most 2 programs per SM, 4 at head_size 64), quantized decode at head "
                     "sizes that are not a power of two, and any decode that ends up with one segment.",
    Path.DECODE_SPLIT: "Portable split-KV decode for any quantized cache: reads through byte strides, so it "
                       "serves the caches the faster decode kernels cannot read (INT4 at head_size 32, rows that "
                       "are not 4-byte aligned). Swapped-operand dots: codes are the MMA's A operand, the few "
                       "query heads its N axis.",
    Path.DECODE_CODE_UNITS: "Split-KV decode reading rows as 16-bit code units, one loop per row-alignment class, "
                            "1-4 warps a program; an INT4 query is rotated in its prologue (no extra launch). "
                            "The INT4 default below the thresholds of the block-tile and staged kernels (at "
                            f"head_size 128: under {MIN_KEYS[Path.DECODE_STAGED_INT4.value]:,} keys in the batch).",
    Path.DECODE_BLOCK_TILES: "Split-KV decode on tiles of whole cache blocks (one block id per tile, "
                             "loop-invariant offsets), one warp per KV head: INT8 / FP8 decode at head_size 64 / "
                             "128 / 256, INT4 from 8,192 (head 64) or 32,768 (128, 256) keys in the batch.",
    Path.DECODE_STAGED_INT4: "Gluon: each program copies whole cache blocks (every KV head, K and V) into a ring "
                             "in shared memory with bulk copies, one warp per KV head, MMA on raw nibble codes; "
                             "each program rotates its query in its prologue. "
                             f"The INT4 default on CUDA sm_80+ from {MIN_KEYS[Path.DECODE_STAGED_INT4.value]:,} keys in "
                             "the batch, one sequence included (1.24-1.39x decode_block_tiles from 262,144 keys on the "
                             "H200); only the packed cache layout at "
                             "head_size 128, block 16, <= 8 KV heads, <= 8 query heads per KV head.",
    Path.DECODE_STAGED_INT8: "The same design for INT8 / FP8 (132-byte rows): their default on CUDA sm_80+ (FP8: "
                             f"sm_89+) from {MIN_KEYS[Path.DECODE_STAGED_INT8.value]:,} keys in the batch, one sequence "
                             "included (1.31-1.50x decode_block_tiles from 262,144 keys on the H200).",
}


def plan(mode, batch, ctx, facts, head_size=128, num_q_heads=32, num_kv_heads=8, q_len=1, packed=True, **kw) -> Plan:
    """``attention_plan`` of ``batch`` sequences of ``ctx`` keys (``q_len`` queries each) for ``facts``
    (``kw``: more ``attention_plan`` keywords). Only shapes, strides and addresses are read, so a
    4-block cache stands for a large one."""
    geo = CacheGeometry(mode, head_size, num_kv_heads, 16, torch.bfloat16)
    views = split_kv_cache(geo.new_cache(4), mode, head_size)
    if not packed:
        views = type(views)(*(None if t is None else t.clone() for t in views))
    q = torch.zeros(batch * q_len, num_q_heads, head_size, dtype=torch.bfloat16)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    table = torch.zeros(batch, -(-ctx // 16), dtype=torch.int32)
    return attention_plan(q, views.key_cache, views.value_cache, q, cu, torch.full((batch,), ctx, dtype=torch.int32),
                          q_len, ctx, head_size ** -0.5, True, (-1, -1), table, 0.0, kv_quant_mode=mode,
                          k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache, device=facts, **kw)


def mixed_plan(mode, d, ctx, chunk, chunk_ctx, facts) -> Plan:
    """``attention_plan`` with ``num_decode_seqs=d``: ``d`` decode rows of ``ctx`` keys, then one
    chunk of ``chunk`` queries over ``chunk_ctx`` keys (head 128, 32 query / 8 KV heads)."""
    geo = CacheGeometry(mode, 128, 8, 16, torch.bfloat16)
    views = split_kv_cache(geo.new_cache(4), mode, 128)
    q = torch.zeros(d + chunk, 32, 128, dtype=torch.bfloat16)
    cu = torch.tensor(list(range(d + 1)) + [d + chunk], dtype=torch.int32)
    table = torch.zeros(d + 1, -(-max(ctx, chunk_ctx) // 16), dtype=torch.int32)
    seqused = torch.tensor([ctx] * d + [chunk_ctx], dtype=torch.int32)
    return attention_plan(q, views.key_cache, views.value_cache, q, cu, seqused, chunk, max(ctx, chunk_ctx),
                          128 ** -0.5, True, (-1, -1), table, 0.0, kv_quant_mode=mode,
                          k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache, device=facts,
                          num_decode_seqs=d)


def cell(p: Plan) -> str:
    """One plan as a table cell: the path, its segments, the INT4 rotation and the reduction (a
    mixed plan: its two parts, "side by side" where they run on two CUDA streams)."""
    if p.parts:
        return " + ".join(cell(part) for part in p.parts) + (" (side by side)" if p.overlap else "")
    extra = [f"{p.tiling.num_segments} seg"] if p.tiling.num_segments > 1 else []
    if p.rotate.value not in ("none", "in_kernel"):
        extra.append(f"rot {p.rotate.value}")
    if p.unrotated:
        extra.append("unrotated")
    if p.reduce.value != "none":
        extra.append(f"red {p.reduce.value}" + (f" x{p.reduce_split}" if p.reduce_split > 1 else "")
                     + (" early" if p.reduce_early else ""))
    if p.tiling.dequant_first:
        groups = p.tiling.dequant_groups
        extra.append("dequant first" + (f" in {groups} head groups" if groups > 1 else "")
                     + (", rows unrotated" if p.tiling.unrotate else ""))
    return f"`{p.path.value}`" + (f" ({', '.join(extra)})" if extra else "")


def table(head_size: int, num_q_heads: int, num_kv_heads: int, shapes) -> list:
    lines = ["| mode | batch x context | H200 (132 SMs, sm_90, Gluon) | CPU (interpreter) |", "|---|---|---|---|"]
    for name, mode in MODES.items():
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD and head_size & (head_size - 1):
            continue  # INT4 needs a power-of-two head size (its Hadamard rotation)
        for batch, ctx, q_len in shapes:
            shape = f"{batch} x {ctx}" + (f" (prefill {q_len})" if q_len > 1 else "")
            cells = [cell(plan(mode, batch, ctx, f, head_size, num_q_heads, num_kv_heads, q_len)) for f in (H200, CPU)]
            lines.append(f"| {name} | {shape} | {cells[0]} | {cells[1]} |")
    return lines


def section() -> str:
    out = ["## Attention", "",
           "Generated by `python -m bench.kernels_table` from `kernels.attention_plan` (fake device facts for the "
           "H200); edit the script, not this section.", "",
           "Every call of `kernels.unified_attention` is validated once, planned once (`attention_plan` returns "
           "the `Plan` without launching) and run as planned: the plan's `path` is the kernel, and `why` says "
           "why in words (`attention_plan(...).why`). Files are under `kernels/attention/`. In the cells: the "
           "path, its split-KV segments, how an INT4 query is rotated (`rot`: `prologue` inside "
           "`decode_code_units` or `decode_staged_int4`, `triton` / `gluon` a rotation kernel first; the 2D "
           "kernel rotates its own tile) and which kernel merges the segments (`red`; `x4`: four programs per "
           "query row, each merging a quarter of the dims, where the rows alone leave SMs idle; `early`: the "
           "split kernel, whose grid is resident at once, lets the reduction's programs be scheduled at its "
           "start, where they wait for its end; `unrotated`: the staged INT4 kernel "
           "applies the inverse rotation to each segment's rows, so its reduction does not rotate); "
           "`dequant first`: the 2D plan dequantizes a "
           "quantized context into a 16-bit scratch first (`Tiling.dequant_first`, see \"Prefill over a "
           "quantized cache\" below; `rows unrotated`: INT4 rows written in the original domain, "
           "`Tiling.unrotate`).", "",
           "### Decode and prefill, head_size 128, 32 query / 8 KV heads, packed cache", ""]
    out += table(128, 32, 8, [(b, c, 1) for b, c in DECODE] + [(1, 4096, 4096)])
    out += ["", "### Other head sizes (32 query / 8 KV heads)", ""]
    for head in (64, 256, 96, 32):
        out += [f"head_size {head}:", ""] + table(head, 32, 8, [(1, 4096, 1), (8, 32768, 1)]) + [""]
    out += ["### Mixed batches (`num_decode_seqs`), head_size 128, 32 query / 8 KV heads", "",
            "Decode rows first, then one prefill chunk; the cell is the decode rows' plan + the chunk's, \"side by side\" "
            f"where the decode part runs on a second CUDA stream alongside the chunk (up to {OVERLAP_MAX_DECODE_KEYS:,} decode "
            f"keys; over a quantized cache from {OVERLAP_MIN_QUANTIZED_DECODE_KEYS:,}).", "",
            "| mode | decode rows x context + chunk @ context | H200 (132 SMs, sm_90, Gluon) | CPU (interpreter) |",
            "|---|---|---|---|"]
    for name, mode in MODES.items():
        for d, ctx, chunk, chunk_ctx in MIXED:
            cells = [cell(mixed_plan(mode, d, ctx, chunk, chunk_ctx, f)) for f in (H200, CPU)]
            out.append(f"| {name} | {d} x {ctx} + {chunk} @ {chunk_ctx} | {cells[0]} | {cells[1]} |")
    out += ["", "### Caches the staged kernels cannot read", "",
            "Four separate tensors (not the packed layout) at INT4 b8 x 32768: H200 "
            f"{cell(plan(KVQuantMode.INT4_PER_TOKEN_HEAD, 8, 32768, H200, packed=False))}; 16 query heads per KV "
            f"head: {cell(plan(KVQuantMode.INT4_PER_TOKEN_HEAD, 8, 32768, H200, num_q_heads=128))}. A Triton whose "
            "Gluon does not compile the staged kernels: the plan's one-time probe (`gluon_probe`) says so and "
            "the plan names `decode_block_tiles`.", "",
            "### Why each path exists", "", "| path | files | why |", "|---|---|---|"]
    for path, why in WHY.items():
        out.append(f"| `{path.value}` | {FILES[path]} | {why} |")
    out += ["", "Around the decode kernels: `rotate_query.py` (Triton) / `rotate_query_gluon.py` (Gluon, head_size "
            "128) rotate an INT4 query; `reduce.py` (Triton) / `reduce_gluon.py` (Gluon, head_size 128, <= 512 "
            "segments) merge the segments; `plan.py` holds the rules and `Tuning`, `run.py` the launch by path.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m bench.kernels_table", description=__doc__.splitlines()[0]).parse_args(argv)
    print(section())
    return 0


if __name__ == "__main__":
    sys.exit(main())
