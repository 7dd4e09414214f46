"""Show a dump's layout and per layer/block/head statistics (table, --json, --plot PNG)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch

from layouts import KVQuantMode, LayoutDescriptor, LayoutMismatchError

from .cache_stats import KV_NAMES, CacheStats
from .dump import LAYOUT_FLAGS, add_endpoint_arguments, cli_guard, load_cache_file, progress_printer, pull_to_dump
from .errors import UsageError
from kvconnector.dumpfile import MAGIC, DumpReader


EXAMPLES = """\
  kvconnector inspect blocks.kvd                      # layout + per layer/head statistics
  kvconnector inspect blocks.kvd --per-block --json
  kvconnector inspect int4.kvd --reference bf16.kvd --plot int4.png
  kvconnector inspect --endpoint tcp://127.0.0.1:41234  # pull the published transfer, inspect it
"""


class BlockSource:
    """Blocks of a dump file or of a cache file, addressed by (layer, block id).

    ``blocks()`` yields ``(layer, block_id, block [2, N, H, P] storage dtype, CPU)`` in
    order; ``block(layer, block_id)`` reads one (a dump seeks through its footer index).
    """

    def __init__(self, path, key_offsets_path: str | None = None):
        self.path = str(path)
        with open(self.path, "rb") as f:
            is_dump = f.read(len(MAGIC)) == MAGIC
        self.reader = DumpReader(self.path) if is_dump else None
        if is_dump:
            self.desc, self.layers, self.block_ids = (self.reader.info.desc, self.reader.info.layers,
                                                      self.reader.info.block_ids)
            self.kind = f"dump (tid {self.reader.info.tid!r})"
        else:
            self.desc, self.caches = load_cache_file(self.path)
            self.layers, self.block_ids = sorted(self.caches), list(range(self.desc.num_blocks))
            self.kind = "cache file"
        self.key_offsets = self.reader.info.key_offsets if self.reader is not None else None
        if key_offsets_path:
            from layouts import KeyOffsets
            ko = KeyOffsets.load(key_offsets_path)
            if ko.fingerprint != self.desc.key_offset:
                raise LayoutMismatchError([("key_offset", self.desc.key_offset, ko.fingerprint)],
                                          f"{self.path} vs --key-offsets {key_offsets_path}")
            self.key_offsets = ko

    def key_offset(self, layer: int) -> torch.Tensor | None:
        """``[num_kv_heads, head_size]`` offsets of this source's heads in ``layer`` (None: not smoothed
        or the offsets are not at hand)."""
        if self.key_offsets is None:
            return None
        return self.key_offsets.layer(layer, self.desc.head_start, self.desc.num_kv_heads)

    def key_offset_note(self) -> str:
        if self.desc.key_offset == "none":
            return ""
        if self.key_offsets is None:
            return (f"key offsets: {self.desc.key_offset} (smoothed keys; values not in this file: keys are shown "
                    f"WITHOUT m, pass --key-offsets FILE)")
        return f"key offsets: {self.desc.key_offset} (smoothed keys; m added back to the keys shown)"

    def blocks(self):
        if self.reader is not None:
            for rec in self.reader:
                yield rec.layer, rec.block_id, rec.block(self.desc)
        else:
            for layer in self.layers:
                for b in self.block_ids:
                    yield layer, b, self.caches[layer][b]

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        if self.reader is not None:
            return self.reader.read_block(layer, block_id).block(self.desc)
        if layer not in self.caches or not 0 <= block_id < self.desc.num_blocks:
            raise LayoutMismatchError([("block", (layer, block_id), "absent")], f"{self.path}")
        return self.caches[layer][block_id]

    def close(self):
        if self.reader is not None:
            self.reader.close()


def check_reference(desc: LayoutDescriptor, ref: LayoutDescriptor) -> None:
    """A reference must be an unquantized cache of the same rows (mode may differ, nothing else)."""
    names = ("head_size", "block_size", "head_start", "num_kv_heads", "total_num_kv_heads")
    diffs = [(n, getattr(desc, n), getattr(ref, n)) for n in names if getattr(desc, n) != getattr(ref, n)]
    if ref.quant_mode != KVQuantMode.NONE:
        diffs.append(("quant_mode (reference must be unquantized)", desc.quant_mode, ref.quant_mode))
    if diffs:
        raise LayoutMismatchError(diffs, "dump vs reference")


def collect(src: BlockSource, ref: BlockSource | None = None, progress: bool = False,
            per_block: bool = True) -> CacheStats:
    """Statistics of every block of ``src`` (with the matching ``ref`` block when given);
    per-block statistics are kept only with ``per_block`` (layer totals always)."""
    st = CacheStats(src.desc.geometry(), src.desc.head_start, keep_blocks=per_block)
    if ref is not None:
        check_reference(src.desc, ref.desc)
    it = src.blocks()
    if progress:
        from tqdm import tqdm
        it = tqdm(it, total=len(src.layers) * len(src.block_ids), desc="inspect", unit="block", file=sys.stderr)
    for layer, b, blk in it:
        r = ref.block(layer, b).float() if ref is not None else None
        st.add_block(layer, b, blk, r, src.key_offset(layer))
    return st


def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def _row(layer, block, h: dict, mode: KVQuantMode) -> str:
    ncodes = sum(h["code_hist"])
    zps = [i for i, c in enumerate(h["zp_hist"]) if c]
    absmax = None if h["min"] is None else max(abs(h["min"]), abs(h["max"]))
    cells = [
        f"{layer:>5}", f"{block:>5}", f"{h['kv']:>2}", f"{h['head']:>4}",
        f"{_fmt(h['scale_min'], '.3e')}..{_fmt(h['scale_max'], '.3e')}".rjust(21),
        (f"{zps[0]}..{zps[-1]}" if zps else "-").rjust(6),
        (f"{100 * h['saturated'] / ncodes:.2f}%" if ncodes else "-").rjust(7),
        f"{h['scale_nan'] + h['code_nan']:>5}", f"{h['scale_inf']:>4}",
        f"{_fmt(h['mean']):>9}", f"{_fmt(h['std']):>9}", f"{_fmt(absmax):>9}", f"{_fmt(h['rel_l2_err']):>9}",
    ]
    return " ".join(cells)


def format_table(src: BlockSource, st: CacheStats, per_block: bool = False) -> str:
    d = src.desc
    geo = d.geometry()
    mode = KVQuantMode(d.quant_mode)
    lines = [
        f"file: {src.path}  ({src.kind})",
        f"layout: {mode.name}  model {d.model_dtype}  storage {d.storage_dtype}  head_size {d.head_size}  "
        f"heads [{d.head_start}, {d.head_start + d.num_kv_heads}) of {d.total_num_kv_heads}  "
        f"block_size {d.block_size}  row {geo.row_bytes} B  block {geo.block_bytes} B",
        f"fingerprint: {d.fingerprint()}  layers {d.num_layers}  blocks {d.num_blocks}",
        f"holds: layers {src.layers}  blocks {src.block_ids[:32]}{'...' if len(src.block_ids) > 32 else ''}",
    ] + ([src.key_offset_note()] if src.key_offset_note() else []) + [
        "",
        "layer block kv head        scale min..max     zp    sat%   nan  inf      mean       std    absmax    rel L2",
    ]
    data = st.to_dict()
    for layer in data["layers"]:
        for h in layer["heads"]:
            lines.append(_row(layer["layer"], "all", h, mode))
        if per_block:
            for blk in layer["blocks"]:
                for h in blk["heads"]:
                    lines.append(_row(layer["layer"], blk["block"], h, mode))
    lines.append("(nan = NaN scales + NaN codes/values; sat = codes at the range ends; "
                 "rel L2 = error vs --reference)")
    return "\n".join(lines)


def to_json(src: BlockSource, st: CacheStats) -> dict:
    return {"file": src.path, "kind": src.kind, "layout": src.desc.to_dict(),
            "key_offsets_added": src.key_offsets is not None,
            "mode": KVQuantMode(src.desc.quant_mode).name, "fingerprint": src.desc.fingerprint(),
            "layers": src.layers, "block_ids": src.block_ids, "stats": st.to_dict()}


def plot(st: CacheStats, path, title: str = "") -> None:
    """PNG: code and zero-point histograms (all layers), scale ranges by layer, and a
    layer x head heat map of the reconstruction error (or, without a reference, of the
    saturated-code fraction)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(st.layers)
    total = st.layers[layers[0]]
    for layer in layers[1:]:
        total = total.merge(st.layers[layer])
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    hist = total.code_hist.sum(1)                       # [2, bins]
    for kv in (0, 1):
        if hist.shape[-1]:
            ax[0, 0].bar((torch.arange(hist.shape[-1]) + 0.4 * kv).numpy(), hist[kv].numpy(), width=0.4,
                         label=KV_NAMES[kv])
        zp = total.zp_hist.sum(1)
        if zp.shape[-1]:
            ax[0, 1].bar((torch.arange(16) + 0.4 * kv).numpy(), zp[kv].numpy(), width=0.4, label=KV_NAMES[kv])
    mode = st.geo.mode
    ax[0, 0].set_title("code histogram")
    if not hist.shape[-1]:
        ax[0, 0].axis("off")
        ax[0, 0].text(0.5, 0.5, "no codes (unquantized cache)", ha="center", va="center")
    ax[0, 0].set_xlabel({KVQuantMode.INT4_PER_TOKEN_HEAD: "INT4 nibble", KVQuantMode.INT8_PER_TOKEN_HEAD: "INT8 code + 128",
                         KVQuantMode.FP8_PER_TOKEN_HEAD: "FP8 e4m3fn bit pattern (sign bit 0x80)"}.get(mode, ""))
    if total.zp_hist.shape[-1]:
        ax[0, 1].set_title("INT4 zero-point histogram")
    else:
        ax[0, 1].axis("off")
        ax[0, 1].text(0.5, 0.5, f"no zero points ({mode.name}: INT4 only)", ha="center", va="center")
    for kv in (0, 1):
        lo = [st.layers[l].scale_min[kv].min().item() for l in layers]
        hi = [st.layers[l].scale_max[kv].max().item() for l in layers]
        if all(math.isfinite(x) for x in lo + hi):
            ax[1, 0].fill_between(layers, lo, hi, alpha=0.4, label=f"{KV_NAMES[kv]} scale min..max")
    ax[1, 0].set_title("scale range by layer" if mode.per_token_head else "no scales (unquantized)")
    ax[1, 0].set_xticks(layers)
    ax[1, 0].set_xlabel("layer")
    if st.has_reference:
        grid, what = st.error_grid(), "relative L2 error vs reference"
    elif mode.per_token_head:
        grid = torch.stack([st.layers[l].saturated / st.layers[l].code_hist.sum(-1).clamp(min=1) for l in layers])
        what = "saturated-code fraction"
    else:   # unquantized: no codes to saturate, show the largest magnitude instead
        grid = torch.stack([torch.maximum(st.layers[l].value_max, -st.layers[l].value_min) for l in layers])
        what = "max |value|"
    grid = grid.permute(0, 2, 1).reshape(len(layers), -1).float()   # [layer, head * (K, V)]
    im = ax[1, 1].imshow(grid.numpy(), aspect="auto", cmap="viridis")
    h = st.geo.num_kv_heads
    ax[1, 1].set_xticks(range(2 * h), [f"{st.head_start + i // 2}{KV_NAMES[i % 2]}" for i in range(2 * h)],
                        fontsize=7)
    ax[1, 1].set_yticks(range(len(layers)), layers)
    ax[1, 1].set_xlabel("head (K/V)")
    ax[1, 1].set_ylabel("layer")
    ax[1, 1].set_title(what)
    fig.colorbar(im, ax=ax[1, 1])
    for a in ax.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", nargs="?", help="dump file (or cache file) to inspect; or use --endpoint")
    p.add_argument("--reference", help="unquantized dump or cache file of the same blocks: error per head")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="OUT.png", help="write histograms and a layer x head heat map")
    p.add_argument("--per-block", action="store_true", help="statistics per block too (table rows, JSON entries)")
    p.add_argument("--key-offsets", metavar="FILE", help="offsets file of a smoothed INT4 dump that does not carry "
                   "them (its fingerprint must be the layout's key_offset): m is added back to the keys shown")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_endpoint_arguments(p)


def _run(args) -> int:
    if (args.dump is None) == (args.endpoint is None):
        raise UsageError("give either a dump (or cache) file or --endpoint (not both)")
    if args.endpoint:   # pull one published transfer into a temporary dump, inspect that
        with tempfile.TemporaryDirectory(prefix="kvc-inspect-") as tmp:
            args.dump = os.path.join(tmp, "pulled.kvd")
            pull_to_dump(args.endpoint, args.dump, args.transfer_id, "all", args.timeout,
                         progress=not args.no_progress, say=progress_printer(),
                         num_transfer_blocks=args.num_transfer_blocks,
                         **{k: getattr(args, k) for k in LAYOUT_FLAGS})
            return _inspect(args)
    return _inspect(args)


def _inspect(args) -> int:
    src = BlockSource(args.dump, args.key_offsets)
    if args.endpoint:   # name what was pulled, not the temporary file
        src.path, src.kind = args.endpoint, f"pulled from a prefill endpoint (tid {src.reader.info.tid!r})"
    ref = BlockSource(args.reference) if args.reference else None
    try:
        n = len(src.layers) * len(src.block_ids)
        st = collect(src, ref, progress=not args.no_progress and n >= 256, per_block=args.per_block)
        if args.plot and st.layers:
            plot(st, args.plot, f"{src.path}: {KVQuantMode(src.desc.quant_mode).name}")
        print(json.dumps(to_json(src, st), allow_nan=False) if args.json else format_table(src, st, args.per_block))
    finally:
        src.close()
        if ref is not None:
            ref.close()
    return 0


def run(args) -> int:
    return cli_guard("inspect", _run, args)
