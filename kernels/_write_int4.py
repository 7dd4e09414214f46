"""INT4 cache write: the launcher, its tuning defaults and its device-side constants.

Two kernels share the SPEC §3 math (the oracle is ``kernels.reference.quantize_int4_rows``,
``shrink`` included); each reads a row once (2·d bytes of bf16/fp16) and writes it once (d/2
bytes of codes + 4 bytes of scale), the fewest bytes the format allows (vLLM rotates in a
separate pass first):

- ``kernel="mma"`` (``_write_int4_mma`` inside the lanes kernel, the GPU default for head_size
  64..256): each 32-column part rotated by ``mma.sync`` on tensor cores, the parts joined by
  in-lane adds; the tensor cores add in their own order, so a rare row differs from the oracle
  by one rounding of a rotated value (a tie row, within one code step; docs/bench/write.md);
- ``kernel="lanes"`` (``_write_int4_lanes``, the GPU default for head_size 16 and 32): the
  oracle's butterfly in registers and warp shuffles, bit-identical to the oracle;
- ``kernel="fused"`` (``_write_int4_fused``, the CPU default; on the GPU for the MSE encoder and
  wider rows) with two rotations: ``"butterfly"`` (the oracle's stages, exact) or ``"dot"``
  (``tl.dot`` against the ±1 matrix ``diag(s)·H``: exact products, fp32 sums in another order, so
  a rotated value can rarely round to a neighbouring bf16/fp16).

Division ``r / scale`` is correctly rounded like the oracle's (``div="markstein"``: one
multiply and two FMAs per element from a per-row reciprocal; ``"rn"``: ``div_rn`` per
element); ``"fast"`` (Triton's approximate ``/``) exists only to measure what exactness costs.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from layouts import KVQuantMode

from ._jit import cdiv, interpreting
from ._write_checks import cache_alignment, check_write_args, lane_layout_ok, packed_rows, scale_bits_view
from ._write_int4_fused import _reshape_and_cache_int4_kernel
from ._write_int4_mma import MMA_COLS, mma_table
from ._write_int4_lanes import LANE_BITS, _reshape_and_cache_int4_lanes_kernel, fwht_asm
from layouts import rht_signs

ROTATIONS = ("butterfly", "dot")
DIVISIONS = {"rn": 0, "markstein": 1, "fast": 2}


def chunk_size(head_size: int) -> int:
    """Rotation chunk: the whole row up to 128, else half of it (joined by one last butterfly stage)."""
    return head_size if head_size <= 128 else head_size // 2


@functools.lru_cache(maxsize=None)
def signed_hadamard_chunks(head_size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[head_size // CH, CH, CH] ±1 tiles ``diag(s_c)·H_CH`` so ``x_c @ M_c`` rotates chunk ``c``."""
    ch = chunk_size(head_size)
    h = torch.ones(1, 1)
    while h.shape[0] < ch:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    s = rht_signs(head_size).view(-1, ch, 1)
    return (s * h).to(dtype=dtype, device=device).contiguous()


@functools.lru_cache(maxsize=64)
def device_shrink(shrink: tuple, device: str) -> torch.Tensor:
    """The MSE range factors as a float32 tensor on ``device``, made once per tuple (a pageable
    host-to-device copy per call would synchronize the stream and idle the GPU between writes)."""
    return torch.tensor(shrink, dtype=torch.float32, device=device)


# (parts, rows, warps) of the shuffle kernel, fastest on the H200 at 65,536 tokens x 8 heads
# (head_size 16 / 32 / 64 / 128 / 256: 111.0 / 50.2 / 77.8 / 143.8 / 295.2 us; docs/bench/write.md, session 2)
LANES_TILING = {16: (1, 64, 4), 32: (2, 64, 4), 64: (4, 16, 1), 128: (8, 16, 1), 256: (8, 16, 2)}
# (rows, warps, packed_range, fast_rcp) of the tensor-core kernel, the GPU default from head_size 64: at
# 65,536 tokens x 8 heads 64.1-64.4 / 115.5-116.5 / 241-242 us against the shuffle kernel's 73.4-73.8 /
# 145.6-147.0 / 278-280 at head_size 64 / 128 / 256 (docs/bench/write.md, session 8). The range on
# rounded pairs at 128 since session 15 (6% fewer instructions; 1-2% faster in 5 of 6 comparisons over
# three machine starts, CUDA-graph time); at 256 it was within +-1%. The reciprocal without a slow path
# since session 17: with it 59.5 / 105.0 / 220.4 us, without 61.8 / 107.0 / 237.3 (same process)
MMA_TILING = {64: (32, 2, True, True), 128: (32, 2, True, True), 256: (32, 2, False, True)}


def default_int4_kernel(head_size: int, on_cpu: bool) -> str:
    """The kernel used when the caller names none: "mma" on the GPU from head_size 64, "lanes"
    below, "fused" on CPU and for rows wider than 256."""
    return "fused" if on_cpu or head_size not in LANE_BITS else "mma" if head_size in MMA_TILING else "lanes"


def default_int4_config(head_size: int, on_cpu: bool, kernel: str | None = None) -> dict:
    """Tile rows, warps, rotation, division, programs per SM... of ``kernel`` (None: the kernel
    used when the caller names none: "mma" on the GPU from head_size 64, "lanes" below, "fused"
    on CPU and for rows wider than 256)."""
    if kernel is None:
        kernel = default_int4_kernel(head_size, on_cpu)
    cfg = dict(rotation="butterfly", div="markstein", programs_per_sm=0, kernel=kernel, num_stages=None,
               parts=1, packed_range=False, maxnreg=None, fast_rcp=False)
    mma_parts = max(1, head_size // MMA_COLS)
    if on_cpu:  # the interpreter runs a whole tile per numpy op: few, large tiles are fastest
        return dict(cfg, rows=64, num_warps=4, parts=mma_parts if kernel == "mma" else 1)
    if kernel == "mma":
        rows, warps, packed, fast_rcp = MMA_TILING.get(head_size, (32, 2, False, False))
        return dict(cfg, rows=rows, num_warps=warps, parts=mma_parts, packed_range=packed, fast_rcp=fast_rcp)
    if kernel == "lanes":
        parts, rows, warps = LANES_TILING.get(head_size, (8, 16, 2))
        return dict(cfg, rows=rows, num_warps=warps, parts=parts)
    return fused_int4_config(head_size)


def fused_int4_config(head_size: int) -> dict:
    """The fused K+V kernel's GPU tuning (head sizes above 256, the MSE encoder, or on request)."""
    return dict(rows={64: 128, 128: 64}.get(head_size, 64), num_warps=8 if head_size > 128 else 4,
                rotation="dot", div="markstein", programs_per_sm=4, kernel="fused", num_stages=None, parts=1,
                packed_range=False, maxnreg=None, fast_rcp=False)


# the tuning keywords of every kernel's config (the same keys for all of them)
TUNING_KEYS = frozenset(default_int4_config(128, False))


def reshape_and_cache_int4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, *,
                           shrink: Sequence[float] = (1.0,), check_slots: bool = True,
                           **tuning) -> None:
    """Rotate, quantize to INT4 and write K/V rows into a paged cache, one fused pass.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU
        head_size a power of two >= 16; last dim contiguous, other strides free.
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_size // 2] uint8, written in place
        Separate tensors or the views of one packed cache from ``layouts.split_kv_cache``.
    slot_mapping : [num_tokens] int32/int64, same device; ``slot = block_idx * block_size + offset``;
        negative slots are skipped and leave the cache as it was.
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, written in place
        Bits ``(bits(scale) & ~0xF) | zero_point``; a row with NaN/Inf after rotation stores codes 0
        and ``NAN_SCALE_BITS`` (a quiet NaN), so it decodes to NaN, never to plausible numbers.
    shrink : factors of the zero-inclusive range tried per row, least squared error wins (SPEC §8);
        ``(1.0,)`` (default) is the SPEC/vLLM encoder. The first factor must be 1.0.
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
        The kernel never writes outside the cache either way: unchecked bad slots are skipped.
    **tuning : ``kernel`` ("mma": tensor-core rotation, the GPU default for head_size 64..256,
        rare tie rows; "lanes": the shuffle kernel of ``_write_int4_lanes``, bit-identical to the
        oracle, the GPU default below 64; "fused": ``tl.dot`` or butterfly rotation, the CPU default
        and the GPU kernel for the MSE encoder, wider rows and K/V rows not 16-byte aligned
        (``_write_checks.lane_layout_ok``); naming a ``rotation`` or a ``div`` selects it),
        ``rows``, ``num_warps``, ``num_stages``, ``parts`` (lanes), ``packed_range`` (mma: the
        row range on rounded bf16x2/f16x2 pairs), ``fast_rcp`` (lanes / mma: each row's reciprocal
        by ``_write_math.RCP_PTX`` instead of ``div_rn``; the same bits), ``rotation``
        ("butterfly"/"dot"), ``div`` ("markstein"/"rn"/"fast"), ``programs_per_sm`` (fused:
        programs resident per SM; 0: one tile per program), ``maxnreg`` (a register cap for the
        GPU build; ignored on CPU); benchmarks only. Naming
        ``kernel="fused"`` alone gives the fused kernel's own GPU tuning.

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride, head-size or slot-range mismatch; nothing is written.
    """
    shape = check_write_args(key, value, key_cache, value_cache, slot_mapping,
                             KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache, v_scale_cache, check_slots)
    shrink = tuple(float(f) for f in shrink)
    if not shrink or shrink[0] != 1.0 or not all(0.0 < f <= 1.0 for f in shrink):
        raise ValueError(f"shrink: expected factors in (0, 1] starting with 1.0, got {shrink}")
    cpu = interpreting(key)
    unknown = set(tuning) - TUNING_KEYS
    if unknown:
        raise TypeError(f"reshape_and_cache_int4: unknown tuning keywords {sorted(unknown)}")
    kernel = tuning.get("kernel")
    if kernel is None:  # naming a rotation or a division selects the fused kernel, which has them
        fused_only = "rotation" in tuning or tuning.get("div", "markstein") != "markstein"
        kernel = "fused" if fused_only else default_int4_kernel(shape.head_size, cpu)
    if kernel not in ("fused", "lanes", "mma"):
        raise ValueError(f"kernel: expected 'fused', 'lanes' or 'mma', got {kernel!r}")
    if kernel == "mma" and shape.head_size < MMA_COLS:
        kernel = "lanes"  # tensor-core parts are 32 columns wide
    if kernel != "fused" and (len(shrink) > 1 or shape.head_size not in LANE_BITS
                              or not (cpu or lane_layout_ok(key, value))):
        kernel = "fused"  # the MSE encoder, rows wider than one warp's 32 lanes x 8 and unaligned rows
    if kernel == "mma" and tuning.get("parts") not in (None, shape.head_size // MMA_COLS):
        raise ValueError(f"mma kernel: parts is head_size / {MMA_COLS} = {shape.head_size // MMA_COLS}, "
                         f"got {tuning['parts']}")
    cfg = default_int4_config(shape.head_size, cpu, kernel)
    cfg.update({k: v for k, v in tuning.items() if v is not None}, kernel=kernel)
    if cfg["rotation"] not in ROTATIONS or cfg["div"] not in DIVISIONS:
        raise ValueError(f"rotation/div: expected one of {ROTATIONS} / {tuple(DIVISIONS)}, got "
                         f"{cfg['rotation']!r} / {cfg['div']!r}")
    num_rows = shape.num_tokens * shape.num_kv_heads
    if num_rows == 0:
        return
    d, rows = shape.head_size, cfg["rows"]
    dev = str(key.device)
    ks, vs = scale_bits_view(k_scale_cache), scale_bits_view(v_scale_cache)
    num_tiles = cdiv(num_rows, rows)
    align = cache_alignment(key_cache, value_cache)
    # compile options the launches take only when set: Triton's pipelining depth, ptxas's register cap (GPU)
    compile_opts = {} if cfg["num_stages"] is None else dict(num_stages=cfg["num_stages"])
    if cfg["maxnreg"] and not cpu:
        compile_opts["maxnreg"] = cfg["maxnreg"]
    if cfg["kernel"] in ("lanes", "mma"):
        mma = cfg["kernel"] == "mma"
        # the shuffles assume warps tile whole rows: ROWS a multiple of the rows one CTA covers
        # (mma: of twice that, each lane's rows taken in pairs as one 16-row tile)
        cover = cfg["num_warps"] * 32 * 8 * cfg["parts"] // d * (2 if mma else 1)
        if cfg["parts"] not in (1, 2, 4, 8) or d // cfg["parts"] < 8 or (rows % cover and not cpu):
            raise ValueError(f"{cfg['kernel']} kernel: parts in (1, 2, 4, 8) with head_size/parts >= 8 and rows a "
                             f"multiple of {cover} (num_warps x 32 lanes / lanes per row), got "
                             f"parts={cfg['parts']}, rows={rows}, num_warps={cfg['num_warps']}")
        contig = packed_rows(key) and packed_rows(value)
        _reshape_and_cache_int4_lanes_kernel[(num_tiles, 2)](
            key, value, key_cache, value_cache, ks, vs, slot_mapping, rht_signs(d, dev),
            mma_table(d, key.dtype, dev) if mma else rht_signs(d, dev), num_rows, shape.num_blocks * shape.block_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *(st // align for st in key_cache.stride()[:3]), *(st // align for st in value_cache.stride()[:3]),
            ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
            ROWS=rows, D=d, PARTS=cfg["parts"], LOG2_N=(d // cfg["parts"]).bit_length() - 1,
            FWHT_ASM=fwht_asm(LANE_BITS[d] - cfg["parts"].bit_length() + 1), INTERPRET=cpu,
            CACHE_ALIGN=align, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size, CONTIG=contig,
            MMA=mma, WARPS=cfg["num_warps"], PACKED=bool(cfg["packed_range"]), FAST_RCP=bool(cfg["fast_rcp"]),
            num_warps=cfg["num_warps"], enable_fp_fusion=False, **compile_opts)
        return
    ch = chunk_size(d)
    dot = cfg["rotation"] == "dot" and ch <= 128  # wider dot tiles would not fit shared memory
    rot = signed_hadamard_chunks(d, key.dtype, dev) if dot else rht_signs(d, dev)
    shrink_t = device_shrink(shrink, dev)
    programs = num_tiles
    if not cpu and cfg["programs_per_sm"]:
        sms = torch.cuda.get_device_properties(key.device).multi_processor_count
        programs = min(num_tiles, max(1, sms * cfg["programs_per_sm"]))
    _reshape_and_cache_int4_kernel[(programs,)](
        key, value, key_cache, value_cache, ks, vs, slot_mapping, rot, shrink_t,
        num_rows, num_tiles, shape.num_blocks * shape.block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *(st // align for st in key_cache.stride()[:3]), *(st // align for st in value_cache.stride()[:3]),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        ROWS=rows, CH=ch, LOG2_CH=ch.bit_length() - 1, SPLIT=ch != d, DOT=dot,
        DIV=DIVISIONS[cfg["div"]], INTERPRET=cpu, NUM_SHRINK=len(shrink), CACHE_ALIGN=align,
        NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        num_warps=cfg["num_warps"], enable_fp_fusion=False, **compile_opts,  # keep the oracle's separate roundings
    )
