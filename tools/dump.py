"""Write chosen layers and blocks of a KV cache (saved cache file or prefill endpoint) to a dump file.

From an endpoint no layout flags are needed: the prefill side is asked for its layout
(DESCRIBE, docs/PROTOCOL.md, "DESCRIBE") and the pull's handshake checks it on both ends.

Also home of the **cache file** the dump tools read and write: ``torch.save`` of a plain
dict (no pickled classes; read back with ``torch.load(weights_only=True)``)::

    {"format": "kvconnector-cache", "version": 1,
     "desc": LayoutDescriptor.to_dict(),          # plain ints and strs
     "layers": [layer index, ...],                # which layers the list holds
     "caches": [packed cache tensor, ...]}        # [num_blocks, 2, N, H, P] per layer
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

import torch

from layouts import CorruptFrameError, KVCacheError, LayoutDescriptor, LayoutError

from kvconnector.dumpfile import DumpInfo, write_dump
from kvconnector.files import written_whole

from .argtypes import cache_mode, positive_float, positive_int
from .errors import EXIT_USAGE, UsageError, error_line

CACHE_FILE_FORMAT = "kvconnector-cache"
CACHE_FILE_VERSION = 1


def save_cache_file(path, caches, desc: LayoutDescriptor, layers=None) -> None:
    """Save per-layer packed caches and their descriptor.

    Parameters
    ----------
    caches : sequence of [num_blocks, 2, block_size, num_kv_heads, P] storage-dtype tensors
        One per entry of ``layers`` (moved to the CPU, made contiguous).
    layers : sequence of int, optional
        Layer index of each cache; ``range(len(caches))`` when None.
    """
    layers = list(range(len(caches))) if layers is None else [int(i) for i in layers]
    if len(layers) != len(caches):
        raise LayoutError(f"cache file: expected one layer index per cache, got {len(layers)} for {len(caches)}")
    with written_whole(path) as f:
        torch.save({"format": CACHE_FILE_FORMAT, "version": CACHE_FILE_VERSION, "desc": desc.to_dict(),
                    "layers": layers, "caches": [c.detach().cpu().contiguous() for c in caches]}, f)


def load_cache_file(path) -> tuple[LayoutDescriptor, dict[int, torch.Tensor]]:
    """Read a cache file written by :func:`save_cache_file`.

    Returns
    -------
    desc : LayoutDescriptor
    caches : dict layer index -> [num_blocks, 2, block_size, num_kv_heads, P] CPU tensor

    Raises
    ------
    CorruptFrameError
        Not a cache file (unreadable, or not the expected dict).
    LayoutError
        A cache whose shape or dtype disagrees with the descriptor.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # torch.load raises many unrelated types on a foreign file
        raise CorruptFrameError(f"{path}: not a readable cache file ({type(e).__name__})") from e
    if not isinstance(obj, dict) or obj.get("format") != CACHE_FILE_FORMAT:
        raise CorruptFrameError(f"{path}: expected a dict with format {CACHE_FILE_FORMAT!r}")
    if obj.get("version") != CACHE_FILE_VERSION:
        raise CorruptFrameError(f"{path}: cache file version: expected {CACHE_FILE_VERSION}, got {obj.get('version')!r}")
    desc = LayoutDescriptor.from_dict(obj.get("desc"))
    layers, caches = obj.get("layers"), obj.get("caches")
    if not isinstance(layers, list) or not isinstance(caches, list) or len(layers) != len(caches):
        raise CorruptFrameError(f"{path}: expected equal-length lists 'layers' and 'caches'")
    geo = desc.geometry()
    out = {}
    for i, c in zip(layers, caches):
        want = geo.shape(desc.num_blocks)
        if not isinstance(i, int) or not 0 <= i < desc.num_layers or i in out:
            raise LayoutError(f"{path}: layer index {i!r} outside [0, {desc.num_layers}) or repeated")
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != want or c.dtype != geo.storage_dtype:
            got = (tuple(c.shape), c.dtype) if isinstance(c, torch.Tensor) else type(c).__name__
            raise LayoutError(f"{path}: layer {i}: expected {want} {geo.storage_dtype}, got {got}")
        out[i] = c
    return desc, out


def parse_ids(spec: str | None, n: int, what: str) -> list[int]:
    """``"all"``/None -> ``range(n)``; ``"0,3-5"`` -> ``[0, 3, 4, 5]``, each checked in ``[0, n)``."""
    if spec is None or spec == "all":
        return list(range(n))
    ids = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            ids += range(int(lo), int(hi or lo) + 1)
    except ValueError as e:
        raise LayoutError(f"{what}: expected 'all' or a list like '0,3-5', got {spec!r}") from e
    bad = [i for i in ids if not 0 <= i < n]
    if bad or len(set(ids)) != len(ids):
        raise LayoutError(f"{what}: expected distinct ids in [0, {n}), got {spec!r}")
    return ids


EXAMPLES = """\
  kvconnector dump cache.pt -o blocks.kvd --layers 0-3 --blocks 0-7
  kvconnector dump --endpoint tcp://127.0.0.1:41234 -o t0.kvd            # the only published transfer
  kvconnector dump --endpoint tcp://10.0.0.5:5555 --transfer-id t3 -o t3.kvd
"""


def cli_guard(command: str, fn, args, error_code: int = 1) -> int:
    """Run ``fn(args)``; a library or file error (a bad or corrupt input) becomes one line on
    stderr and ``error_code``; a wrong command line, one line and exit 2."""
    try:
        return int(fn(args) or 0)
    except BrokenPipeError:          # `kvconnector inspect ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except UsageError as e:
        print(error_line(command, e), file=sys.stderr)
        return EXIT_USAGE
    except (KVCacheError, OSError, ValueError, EOFError) as e:
        print(error_line(command, e), file=sys.stderr)
        return error_code


def dump_cache_file(cache_path, out_path, layers="all", block_ids="all", tid: str = "dump",
                    progress: bool | None = None) -> DumpInfo:
    """Dump chosen layers/blocks of a saved cache file.

    ``layers`` / ``block_ids``: lists of ints or :func:`parse_ids` specs (``"all"`` = every layer
    the file holds / every block). ``progress=None`` shows a bar for dumps of 256+ blocks.
    """
    desc, caches = load_cache_file(cache_path)
    if isinstance(layers, str):
        layers = sorted(caches) if layers == "all" else parse_ids(layers, desc.num_layers, "layers")
    if isinstance(block_ids, str):
        block_ids = parse_ids(block_ids, desc.num_blocks, "blocks")
    missing = [i for i in layers if i not in caches]
    if missing:
        raise LayoutError(f"{cache_path}: holds layers {sorted(caches)}, asked for {missing}")
    if progress is None:
        progress = len(layers) * len(block_ids) >= 256
    return write_dump(out_path, caches, desc, layers, block_ids, tid=tid,
                      meta={"source": str(cache_path)}, progress=progress)


def dump_from_endpoint(endpoint: str, transfer_id: str, num_transfer_blocks: int, desc: LayoutDescriptor,
                       out_path, layers=None, timeout_s: float = 30.0, curve=None,
                       progress: bool = False) -> DumpInfo:
    """Pull a published transfer from a running prefill endpoint, then dump it.

    The pull is an ordinary decode-side pull (handshake, checksums, deadline) into fresh
    zeroed CPU caches laid out as ``desc`` (its ``num_blocks`` is replaced by
    ``num_transfer_blocks``; transfer position ``i`` lands in block ``i``). Like any
    completed pull it ACKs, so the prefill side releases the transfer's lease: the output's
    directory is checked first, so a mistyped path does not use the transfer up.

    Parameters
    ----------
    endpoint : "tcp://host:port" of the :class:`kvconnector.PrefillEndpoint`
    transfer_id : the published transfer
    num_transfer_blocks : how many blocks the transfer holds (the prefill side refuses others)
    desc : LayoutDescriptor of the local side; must pass the handshake
        (:func:`layouts.check_compatible`), else :class:`LayoutMismatchError`.
    """
    from kvconnector import DecodeEndpoint

    folder = os.path.dirname(os.path.abspath(os.fspath(out_path)))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):   # before the pull consumes the transfer
        raise FileNotFoundError(errno.ENOENT, "no writable directory for the dump", os.fspath(out_path))
    desc = desc.with_(num_blocks=int(num_transfer_blocks))
    desc.validate()
    geo = desc.geometry()
    caches = [torch.zeros(geo.shape(desc.num_blocks), dtype=geo.storage_dtype) for _ in range(desc.num_layers)]
    with DecodeEndpoint(caches, desc, curve=curve) as ep:
        ep.connect(endpoint, timeout_s=timeout_s)
        ep.pull(transfer_id, range(desc.num_blocks), deadline_s=timeout_s).result(timeout_s + 5.0)
    return write_dump(out_path, caches, desc, layers, None, tid=transfer_id,
                      meta={"source": endpoint, "transfer_id": transfer_id}, progress=progress)


LAYOUT_FLAGS = ("kv_cache_dtype", "model_dtype", "head_size", "num_kv_heads", "head_start", "total_kv_heads",
                "block_size", "num_layers")


def local_descriptor(remote: LayoutDescriptor, num_transfer_blocks: int, **overrides) -> LayoutDescriptor:
    """The decode-side layout for a pull: the prefill side's (from DESCRIBE), ``num_blocks`` set
    to the transfer's block count, with any of :data:`LAYOUT_FLAGS` given (not None) replacing
    the remote value. The handshake of the pull checks the result on both ends."""
    from layouts import CacheGeometry, KVQuantMode, get_kv_quant_mode

    o = {k: v for k, v in overrides.items() if v is not None}
    if not o:
        return remote.with_(num_blocks=int(num_transfer_blocks))
    mode = get_kv_quant_mode(o["kv_cache_dtype"]) if "kv_cache_dtype" in o else KVQuantMode(remote.quant_mode)
    num_kv_heads = o.get("num_kv_heads", remote.num_kv_heads)
    geo = CacheGeometry(mode, o.get("head_size", remote.head_size), num_kv_heads,
                        o.get("block_size", remote.block_size), getattr(torch, o.get("model_dtype", remote.model_dtype)))
    total = o.get("total_kv_heads", remote.total_num_kv_heads if "num_kv_heads" not in o else num_kv_heads)
    return LayoutDescriptor.from_geometry(geo, num_layers=o.get("num_layers", remote.num_layers),
                                          num_blocks=int(num_transfer_blocks),
                                          head_start=o.get("head_start", remote.head_start if "num_kv_heads" not in o else 0),
                                          total_num_kv_heads=total)


def pull_to_dump(endpoint: str, out_path, transfer_id: str | None = None, layers="all", timeout_s: float = 30.0,
                 progress: bool = True, say=None, num_transfer_blocks: int | None = None,
                 **overrides) -> DumpInfo:
    """DESCRIBE the endpoint, pull one published transfer with the layout it announced, dump it.

    ``transfer_id`` None: the only published transfer. ``overrides``: :data:`LAYOUT_FLAGS`
    values that replace the announced layout (a wrong one is refused by the handshake).
    ``say``: callable(str) for progress lines (stderr in the CLI).
    """
    from kvconnector.describe import describe_endpoint

    say = say or (lambda msg: None)
    say(f"asking {endpoint} for its layout (DESCRIBE, {min(timeout_s, 10.0):g} s) ...")
    info = describe_endpoint(endpoint, timeout_s=min(timeout_s, 10.0))
    tid, nblk = info.pick_transfer(transfer_id)
    if num_transfer_blocks is not None and num_transfer_blocks != nblk:
        raise LayoutError(f"--num-transfer-blocks: expected {nblk} (announced by {endpoint} for {tid!r}), "
                          f"got {num_transfer_blocks}")
    desc = local_descriptor(info.descriptor, nblk, **overrides)
    desc.validate()
    layer_ids = None if layers == "all" else parse_ids(layers, desc.num_layers, "--layers")
    say(f"pulling {tid!r}: {nblk} blocks x {desc.num_layers} layers of {desc.geometry().mode.name}, "
        f"fingerprint {desc.fingerprint()} (deadline {timeout_s:g} s) ...")
    return dump_from_endpoint(endpoint, tid, nblk, desc, out_path, layer_ids, timeout_s=timeout_s,
                              progress=progress and desc.num_layers * desc.num_blocks >= 256)


def add_endpoint_arguments(p: argparse.ArgumentParser) -> None:
    """--endpoint and its options (shared by dump and inspect)."""
    g = p.add_argument_group("pull from a running prefill endpoint (its layout is asked for: no layout flags)")
    g.add_argument("--endpoint", help="tcp://host:port of the prefill endpoint (e.g. what `kvconnector serve` printed)")
    g.add_argument("--transfer-id", help="published transfer to pull (default: the only one published)")
    g.add_argument("--num-transfer-blocks", type=positive_int,
                   help="optional: the transfer's block count, checked against what the endpoint announces")
    g.add_argument("--timeout", type=positive_float, default=30.0, help="handshake and pull deadline, seconds")
    o = p.add_argument_group("override the announced layout (optional; the handshake refuses a mismatch)")
    o.add_argument("--kv-cache-dtype", type=cache_mode, help="local cache dtype (vLLM string)")
    o.add_argument("--model-dtype", choices=("bfloat16", "float16"))
    o.add_argument("--head-size", type=positive_int)
    o.add_argument("--num-kv-heads", type=positive_int, help="KV heads held locally")
    o.add_argument("--head-start", type=int, help="first global KV head held locally")
    o.add_argument("--total-kv-heads", type=positive_int, help="global KV heads")
    o.add_argument("--block-size", type=positive_int)
    o.add_argument("--num-layers", type=positive_int)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cache", nargs="?", help="cache file (torch.save'd dict, see `tools/dump.py`); "
                                            "or use --endpoint")
    p.add_argument("-o", "--output", required=True, help="dump file to write")
    p.add_argument("--layers", default="all", help="layers to dump: 'all' or e.g. '0,3-5'")
    p.add_argument("--blocks", default="all", help="block ids to dump (cache file): 'all' or e.g. '0-7,12'")
    p.add_argument("--tid", default="dump", help="transfer id recorded in every BLOCKS header (cache file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_endpoint_arguments(p)


def progress_printer():
    """Lines that show a pull is alive, on stderr when it is a terminal (scripts get clean stderr)."""
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if sys.stderr.isatty() else None


def _run(args) -> int:
    if (args.cache is None) == (args.endpoint is None):
        raise UsageError("give either a cache file or --endpoint (not both)")
    if args.endpoint:
        info = pull_to_dump(args.endpoint, args.output, args.transfer_id, args.layers, args.timeout,
                            progress=not args.no_progress, say=progress_printer(),
                            num_transfer_blocks=args.num_transfer_blocks,
                            **{k: getattr(args, k) for k in LAYOUT_FLAGS})
    else:
        info = dump_cache_file(args.cache, args.output, args.layers, args.blocks, tid=args.tid,
                               progress=False if args.no_progress else None)
    print(f"wrote {args.output}: {len(info.layers)} layers x {len(info.block_ids)} blocks "
          f"({info.num_messages * info.desc.block_bytes} payload bytes), fingerprint {info.fingerprint}")
    return 0


def run(args) -> int:
    return cli_guard("dump", _run, args)
