"""Check a dump's checksums and layout; exit 0 when clean, 1 with the first problem named."""

from __future__ import annotations

import argparse

import torch

from kernels.reference import NAN_SCALE_BITS
from layouts import CacheGeometry, CorruptFrameError, KVQuantMode

from .cache_stats import split_block
from .dump import cli_guard
from kvconnector.dumpfile import DumpReader


def check_rows(block: torch.Tensor, geo: CacheGeometry) -> str | None:
    """Value-level sanity of one block's rows (``--strict``); None when every row is sane.

    Every written row of a per-token-head mode has a finite positive scale, or the writer's
    NaN marker (``NAN_SCALE_BITS``) with all codes 0; a never-written zeroed row (scale
    and codes all 0) is accepted. FP8 codes are never NaN. Unquantized caches have no rule.

    Parameters
    ----------
    block : [2, block_size, num_kv_heads, P] storage dtype, CPU
    """
    if not geo.mode.per_token_head:
        return None
    data, scale = split_block(block, geo)
    bits = scale.contiguous().view(torch.int32)
    zero_codes = (data.view(torch.uint8) == 0).all(-1)
    marker = (bits == NAN_SCALE_BITS) & zero_codes
    unwritten = (bits == 0) & zero_codes
    plain = scale
    if geo.mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        plain = (bits & ~0xF).view(torch.float32)
    ok = (torch.isfinite(plain) & (plain > 0)) | marker | unwritten
    if geo.mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        ok &= ~((data.view(torch.uint8) & 0x7F) == 0x7F).any(-1)
    if bool(ok.all()):
        return None
    kv, slot, head = (int(x) for x in (~ok).nonzero()[0])
    return (f"{'KV'[kv]} row (slot {slot}, head {head}): scale bits {int(bits[kv, slot, head]) & 0xFFFFFFFF:#010x} "
            f"= {float(scale[kv, slot, head])!r} is neither a finite positive scale nor the NaN marker "
            f"with zero codes" + (" (or an FP8 NaN code)" if geo.mode == KVQuantMode.FP8_PER_TOKEN_HEAD else ""))


def verify(path, strict: bool = False) -> str:
    """Read every frame of a dump, verifying it; return a one-line summary.

    Raises
    ------
    CorruptFrameError, ProtocolVersionError, LayoutError
        On the first problem, naming layer, block, message, frame and byte offset.
    """
    with DumpReader(path) as r:
        info = r.info
        geo = info.desc.geometry()
        n = 0
        for rec in r:
            if strict:
                why = check_rows(rec.block(info.desc), geo)
                if why:
                    raise CorruptFrameError(f"layer {rec.layer} block {rec.block_id} (message {rec.message_idx}, "
                                            f"frame {2 * rec.message_idx + 1}, byte {rec.offset}): {why}")
            n += 1
    mode = KVQuantMode(info.desc.quant_mode).name
    return (f"OK {path}: {n} blocks ({len(info.layers)} layers x {len(info.block_ids)} blocks, "
            f"{n * geo.block_bytes} payload bytes), {mode}, fingerprint {info.fingerprint}")


EXAMPLES = """\
  kvconnector verify blocks.kvd            # checksums, byte counts, header fields, footer
  kvconnector verify blocks.kvd --strict   # and the values: NaN/Inf, impossible scales
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", help="dump file to verify")
    p.add_argument("--strict", action="store_true",
                   help="also check every row's scale (finite and positive, or the NaN marker)")


def _run(args) -> int:
    print(verify(args.dump, args.strict))
    return 0


def run(args) -> int:
    return cli_guard("verify", _run, args)
