"""Put a dump's blocks back into a cache (offload -> reload); refuses an incompatible layout."""

from __future__ import annotations

import argparse

import torch

from kvconnector.blocks import scatter_blocks
from layouts import LayoutDescriptor, LayoutError, check_compatible

from .dump import cli_guard, load_cache_file, parse_ids, save_cache_file
from kvconnector.dumpfile import DumpReader


def load_into(path, caches, desc: LayoutDescriptor, block_map: dict[int, int] | None = None,
              layers=None) -> list[tuple[int, int, int]]:
    """Write a dump's blocks into caches held in this process.

    Each block is verified (checksum, byte count, header fields) before a byte of it is
    written. Under a different tensor-parallel split only the heads both layouts hold are
    written; the cache's other heads keep their bytes.

    Parameters
    ----------
    path : dump file
    caches : indexable by layer (list or dict) of [num_blocks, 2, block_size, num_kv_heads, P]
        Packed caches in ``desc``'s layout, CPU or CUDA, written in place.
    desc : LayoutDescriptor of ``caches`` (the local layout)
    block_map : dict dump block id -> destination block id, optional (identity when None)
    layers : sequence of int, optional
        Which of the dump's layers to load (all when None).

    Returns
    -------
    list of (layer, dump block id, destination block id) written.

    Raises
    ------
    LayoutMismatchError
        The dump's layout cannot be loaded into ``desc`` (:func:`layouts.check_compatible`).
    CorruptFrameError
        A frame failed verification; blocks before it have been written.
    """
    written = []
    with DumpReader(path) as r:
        src = r.info.desc
        shared = check_compatible(desc, src, context=f"loading dump {path}")
        want = set(r.info.layers if layers is None else layers)
        absent = want - set(r.info.layers)
        if absent:
            raise LayoutError(f"{path}: holds layers {r.info.layers}, asked for {sorted(absent)}")
        geo = desc.geometry()
        src_heads = slice(shared.start - src.head_start, shared.stop - src.head_start)
        dst_heads = range(shared.start - desc.head_start, shared.stop - desc.head_start)
        block_map = {} if block_map is None else block_map
        check_block_map(block_map, r.info.block_ids, desc.num_blocks, path)
        for rec in r:
            if rec.layer not in want:
                continue
            payload = torch.frombuffer(rec.payload, dtype=torch.uint8)
            if len(shared) != src.num_kv_heads:
                payload = payload.view(2, src.block_size, src.num_kv_heads, -1)[:, :, src_heads].flatten()
            dst = block_map.get(rec.block_id, rec.block_id)
            cache = caches[rec.layer]
            scatter_blocks(cache, geo, [dst], payload.to(cache.device), heads=dst_heads)
            written.append((rec.layer, rec.block_id, dst))
    return written


def check_block_map(block_map: dict[int, int], dump_block_ids, num_blocks: int, path="dump") -> None:
    """Refuse a block map that would not do what it says, before a byte is written.

    Raises
    ------
    LayoutError
        An entry names a block the dump does not hold (it would be ignored), two dump blocks
        land in one destination (one would be lost), or a destination is outside the cache's
        ``[0, num_blocks)``.
    """
    held = list(dump_block_ids)
    absent = sorted(set(block_map) - set(held))
    if absent:
        raise LayoutError(f"block map: {path} holds blocks {_short(held)}, the map names {absent} too")
    dst_ids = [block_map.get(b, b) for b in held]
    if len(set(dst_ids)) != len(dst_ids):
        raise LayoutError(f"block map sends two dump blocks to one destination: {_short(held)} -> {_short(dst_ids)}")
    outside = sorted(d for d in dst_ids if not 0 <= d < num_blocks)
    if outside:
        raise LayoutError(f"block map destinations: expected ids in [0, {num_blocks}), got {outside[:8]}")


def _short(ids: list, n: int = 16) -> str:
    return str(ids) if len(ids) <= n else f"{ids[:n]}... ({len(ids)} ids)"


def load_dump(path, num_blocks: int | None = None, device="cpu",
              block_map: dict[int, int] | None = None) -> tuple[LayoutDescriptor, dict[int, torch.Tensor]]:
    """Load a dump into fresh zero-filled caches with the dump's own layout.

    Returns
    -------
    desc : LayoutDescriptor of the new caches (``num_blocks`` replaced when given)
    caches : dict layer -> [num_blocks, 2, block_size, num_kv_heads, P] on ``device``
    """
    with DumpReader(path) as r:
        desc, layers = r.info.desc, r.info.layers
    if num_blocks is not None:
        desc = desc.with_(num_blocks=int(num_blocks))
        desc.validate()
    geo = desc.geometry()
    caches = {l: torch.zeros(geo.shape(desc.num_blocks), dtype=geo.storage_dtype, device=device) for l in layers}
    load_into(path, caches, desc, block_map)
    return desc, caches


def parse_block_map(spec: str | None) -> dict[int, int] | None:
    """``"0:5,1:6"`` -> ``{0: 5, 1: 6}`` (dump block id -> destination block id)."""
    if not spec:
        return None
    try:
        pairs = [p.split(":") for p in spec.split(",")]
        out = {int(a): int(b) for a, b in pairs}
    except ValueError as e:
        raise LayoutError(f"--block-map: expected 'src:dst,...' with ints, got {spec!r}") from e
    if len(out) != len(pairs) or len(set(out.values())) != len(out):
        raise LayoutError(f"--block-map: expected distinct sources and destinations, got {spec!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", help="dump file to load")
    p.add_argument("-o", "--output", required=True, help="cache file to write")
    p.add_argument("--into", help="existing cache file to load into (its layout must be compatible); "
                                  "default: fresh zeroed caches with the dump's layout")
    p.add_argument("--layers", default="all", help="dump layers to load: 'all' or e.g. '0,3-5'")
    p.add_argument("--block-map", help="destination block ids, e.g. '0:5,1:6' (default: same ids)")
    p.add_argument("--num-blocks", type=int, help="blocks per layer of a fresh cache (default: the dump's)")


def _run(args) -> int:
    block_map = parse_block_map(args.block_map)
    with DumpReader(args.dump) as r:
        info = r.info
    layers = (info.layers if args.layers == "all"
              else parse_ids(args.layers, info.desc.num_layers, "--layers"))
    if args.into:
        desc, caches = load_cache_file(args.into)
        missing = [l for l in layers if l not in caches]
        if missing:
            raise LayoutError(f"{args.into}: holds layers {sorted(caches)}, the dump has {missing} too")
    else:
        desc = info.desc if args.num_blocks is None else info.desc.with_(num_blocks=args.num_blocks)
        desc.validate()
        geo = desc.geometry()
        caches = {l: torch.zeros(geo.shape(desc.num_blocks), dtype=geo.storage_dtype) for l in layers}
    written = load_into(args.dump, caches, desc, block_map, layers)
    save_cache_file(args.output, [caches[l] for l in sorted(caches)], desc, sorted(caches))
    print(f"loaded {len(written)} blocks of {args.dump} into {args.output} "
          f"({len(caches)} layers x {desc.num_blocks} blocks, fingerprint {desc.fingerprint()})")
    return 0


def run(args) -> int:
    return cli_guard("load", _run, args)
