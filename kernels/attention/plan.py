"""The one decision of a paged-attention call: which kernel runs, with which tiling, and why.

:func:`plan_call` (behind ``kernels.attention_plan`` and ``kernels.unified_attention``) reads a
validated :class:`~kernels.attention.call.AttnCall`, the :class:`Tuning` and the device's
:class:`DeviceFacts`, and returns a frozen :class:`Plan`; ``run.run_plan`` launches exactly
that plan, with no check or fallback of its own.

Order of the questions (each asked once):

1. No query tokens: nothing runs (``empty``). A mixed batch whose decode rows the caller
   counted (``num_decode_seqs`` D, 0 < D < num_seqs: sequences ``[0, D)`` have one query token
   each and come first): two plans (``mixed``), the first D sequences as a decode batch of their
   own (these questions again), the others through the 2D kernel; on a CUDA device the decode part
   runs on a second stream alongside the chunk part where it is small (``Plan.overlap``).
   D == num_seqs: a decode batch; D == 0: as without it.
2. Not a decode batch (``max_seqlen_q > 1``, or more sequences than ``seq_threshold_3D``): the
   2D kernel (``prefill_2d``). Over a quantized cache, with many query tiles per sequence and a
   scratch within ``Tuning.dequant_max_bytes``, the context is dequantized first and the
   unquantized 2D kernel reads it (``Tiling.dequant_first``, :func:`_prefill_tiling`; INT4 rows
   unrotated by the pass where the context has few rows per query row, ``Tiling.unrotate``). On sm_90,
   16-bit rows (the cache's or the scratch's) at head sizes 64 / 128 / 256 take the Gluon kernel
   with TMA copies and warpgroup MMAs (``Tiling.wgmma``: ``prefill_wgmma``) where it applies.
3. Decode on a bf16/fp16 cache, or a head size that is not a power of two: the 2D kernel, its
   keys split into segments when the 2D grid would leave SMs idle (over a 16-bit cache on sm_90:
   as many as fill whole waves of its resident programs, :func:`whole_wave_segments`).
4. Quantized decode, the first path that *wants* the batch (a shape rule measured on the H200):
   ``decode_staged_int4`` / ``decode_staged_int8`` (Gluon; from ``decode_staged.MIN_KEYS`` keys in
   the batch, head_size 128, at most 8 KV heads and 8 query heads per KV head; a CUDA sm_80+ device
   whose Triton compiles it),
   else ``decode_block_tiles`` (head_size 64 / 128 / 256; INT4 only from a number of keys on),
   else ``decode_code_units``. Its tiling sets the segment count; one segment: the 2D kernel.
5. Whether that path *fits* the cache as laid out (strides, alignment, the packed layout of
   the staged kernels): if not, the next one down the list that does (``decode_split`` reads
   any quantized cache), keeping the segment count.
6. Around the kernel: how an INT4 query is rotated (in the 2D kernel, in the code-unit or
   staged kernel's prologue, or by a Triton / Gluon rotation kernel first), which kernel merges
   the segments (Triton / Gluon) and whether it is scheduled at the split kernel's start
   (``Plan.reduce_early``, where that grid is resident at once), programmatic dependent launch,
   bulk copies.

The 2D kernel masks scores only in the key tiles that cross a causal / window / length edge
(``Tiling.mask_edges_only``), in every mode and for decode segments too.

``Tuning.path`` / ``Tuning.tiling`` replace the choice of steps 2-4 (benchmarks and tests); step
5 still applies; a tiling given in ``Tuning.tiling`` is used as given. ``docs/KERNELS.md`` lists
the plans over a grid of shapes (``python -m bench.attention --plans``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from layouts import KVQuantMode

from .._jit import busy_segments, cdiv, next_pow2, prev_pow2
from . import decode_block_tiles as B
from . import decode_code_units as C
from . import decode_staged as S
from . import prefill_dequant as D
from . import prefill_wgmma as W
from . import reduce as R
from . import rotate_query as Q
from .call import AttnCall, check_num_decode_seqs, split_mixed
from .units import DECODE_MODES, code_units


class Path(str, enum.Enum):
    """The kernel that reads the cache; each value names its file (see the package docstring)."""

    EMPTY = "empty"                            # no query tokens: nothing is launched
    MIXED = "mixed"                            # decode rows then chunk rows: Plan.parts, launched back to back
    PREFILL_2D = "prefill_2d"                  # prefill_2d.py / prefill_2d_int4.py
    DECODE_SPLIT = "decode_split"              # decode_split.py
    DECODE_CODE_UNITS = "decode_code_units"    # decode_code_units.py
    DECODE_BLOCK_TILES = "decode_block_tiles"  # decode_block_tiles.py
    DECODE_STAGED_INT4 = "decode_staged_int4"  # decode_staged.py + decode_staged_int4_gluon.py
    DECODE_STAGED_INT8 = "decode_staged_int8"  # decode_staged.py + decode_staged_int8_gluon.py (INT8 / FP8)


class Rotate(str, enum.Enum):
    """Where an INT4 query gets the cache's rotation (``none`` for the other modes)."""

    NONE = "none"
    IN_KERNEL = "in_kernel"     # the 2D INT4 kernel rotates its query tile
    PROLOGUE = "prologue"       # the code-unit or staged INT4 decode kernel rotates in its prologue
    TRITON = "triton"           # rotate_query._rotate_query_kernel first
    GLUON = "gluon"             # rotate_query_gluon._rotate_query_gluon_kernel first (head_size 128, CUDA)


class Reduce(str, enum.Enum):
    """Which kernel merges the split-KV segments (``none``: one segment, nothing to merge)."""

    NONE = "none"
    TRITON = "triton"           # reduce._attn_reduce_kernel
    GLUON = "gluon"             # reduce_gluon._attn_reduce_gluon_kernel (head_size 128, <= 512 segments, CUDA)


@dataclass(frozen=True)
class Tiling:
    """Tiling of one launch (``num_segments`` 1: no split; > 1: split-KV and a reduction)."""

    block_m: int                # 2D kernel: query rows per program (tokens x heads of one KV group), pow2 >= 16
    tile: int                   # keys per inner iteration, power of two >= 16
    num_segments: int = 1
    num_warps: int = 4
    num_stages: int = 2         # pipeline stages; the staged kernels: ring depth in cache blocks
    heads_per_program: int = 0  # decode_block_tiles: KV heads per program (0 = all)
    row_loads: bool = True      # decode_block_tiles with several heads per program: token-major loads
    max_registers: int = 0      # decode_block_tiles / staged on a GPU: ptxas register cap per thread (0 = default)
    code_zp: bool = False       # 2D INT4 kernel: zero points subtracted from the codes as they convert
    code_asm: bool = False      # 2D INT4 kernel on a GPU: codes converted by PTX, 4 bytes per register
    dequant_first: bool = False  # 2D path, one segment, quantized cache: dequantize once, then the unquantized kernel
    dequant_groups: int = 1     # dequant_first: KV-head groups dequantized and attended in turn (one scratch at a time)
    unrotate: bool = False      # dequant_first over INT4: rows written unrotated (no query / output rotation)
    mask_edges_only: bool = False  # 2D kernels: mask only the key tiles that cross a causal / window / length edge
    wgmma: bool = False         # 2D path over 16-bit rows on sm_90: prefill_wgmma_gluon (TMA copies, warpgroup MMAs)
    int8_keys: bool = False     # wgmma over INT4 rows kept rotated: keys as int8 codes, int8 score MMAs
    tile_blocks: bool = False   # dequant_first: the scratch read as blocks of up to `tile` keys (one TMA box a tile)

    def __post_init__(self):
        if self.tile_blocks and not self.dequant_first:
            raise ValueError("Tiling.tile_blocks: only with dequant_first (it views the dequantized scratch)")
        if self.int8_keys and not (self.wgmma and self.dequant_first and not self.unrotate):
            raise ValueError("Tiling.int8_keys: only with wgmma and dequant_first over rows kept rotated "
                             f"(unrotate False), got wgmma={self.wgmma}, dequant_first={self.dequant_first}, "
                             f"unrotate={self.unrotate}")


@dataclass(frozen=True)
class Tuning:
    """Settings of the planner, passed explicitly (benchmarks, tests); ``Tuning()`` is the default.

    ``path`` / ``tiling``: use this kernel / tiling instead of the planner's choice (a path that
    cannot read the cache still falls back, see the module docstring); ``path`` may be a
    :class:`Path` or its string. ``pdl``: programmatic dependent launch where the device has it
    (sm_90+). ``rotate_q_in_decode``: the code-unit decode kernel may rotate an INT4 query in
    its prologue, and the staged INT4 kernel does (off: always the rotation kernel).
    ``bulk_copies``: the staged kernels copy each block with one bulk copy on sm_90+ (off:
    16-byte ``cp.async``). ``gluon_edges``: the
    Gluon query rotation and reduction where they apply (off: the Triton ones). ``wgmma_prefill``:
    prefill chunks over 16-bit rows on sm_90 take the Gluon TMA / warpgroup-MMA kernel
    (``prefill_wgmma``) where it applies (off: the Triton 2D kernel); ``int8_key_prefill`` (opt-in:
    the query's int8 rounding measured up to 1.02e-2 relative L2 on SmolLM2's activations): over INT4
    rows kept rotated it reads the keys as int8 codes with an int8-quantized query
    (``Tiling.int8_keys``; off: fp16 keys). ``tile_blocks_prefill``: at the head sizes of
    ``prefill_wgmma.TILE_BLOCK_HEADS`` that kernel reads a dequantized scratch as blocks of a
    tile's keys (``Tiling.tile_blocks``; off: 16-slot blocks).
    ``rotate_q_once``:
    the 2D INT4 kernel reads the query rotated once per call by the rotation kernel (off: each
    program rotates its own query tile). ``dequant_max_bytes``: the largest scratch the 2D path
    may allocate to dequantize a quantized context before attending (``Tiling.dequant_first``,
    ``prefill_dequant.scratch_bytes``); a call that would need more runs the fused kernel; 0:
    never dequantize first. ``overlap_mixed``: a mixed call on a CUDA device runs its decode part on
    a second stream, alongside its chunk part (off: one after the other)."""

    path: Optional[Path] = None
    tiling: Optional[Tiling] = None
    pdl: bool = True
    rotate_q_in_decode: bool = True
    bulk_copies: bool = True
    gluon_edges: bool = True
    wgmma_prefill: bool = True
    int8_key_prefill: bool = False
    tile_blocks_prefill: bool = True
    rotate_q_once: bool = False
    dequant_max_bytes: int = 1 << 30
    overlap_mixed: bool = True

    def __post_init__(self):
        if self.path is not None and not isinstance(self.path, Path):
            try:
                object.__setattr__(self, "path", Path(self.path))
            except ValueError:
                raise ValueError(f"Tuning.path: expected one of {[p.value for p in Path]}, got {self.path!r}") from None


@dataclass(frozen=True)
class DeviceFacts:
    """What the planner asks of the device. ``index`` set (facts of a real CUDA device, from
    :func:`device_facts`): the Gluon kernels are compiled once per shape class before the plan
    picks them (``gluon_probe``); None (facts given, e.g. :data:`H200` on a CPU): ``gluon``
    is trusted as it is."""

    type: str                   # "cpu" (Triton's interpreter) or "cuda"
    num_sms: int                # the heuristics' unit; 4 for the interpreter (keeps splits small)
    capability: tuple = (0, 0)  # CUDA compute capability
    gluon: bool = False         # Triton's Gluon dialect imports
    index: Optional[int] = None

    @property
    def cuda_sm80(self) -> bool:
        return self.type == "cuda" and tuple(self.capability) >= (8, 0)

    @property
    def cuda_sm90(self) -> bool:
        """Hopper (compute capability 9.x): where the H200-measured tables apply."""
        return self.type == "cuda" and tuple(self.capability)[:1] == (9,)


CPU = DeviceFacts("cpu", 4)
H200 = DeviceFacts("cuda", 132, (9, 0), gluon=True)


@functools.lru_cache(maxsize=None)
def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of a real device (asked once per device)."""
    if device.type != "cuda":
        return CPU
    index = torch.cuda.current_device() if device.index is None else device.index
    try:
        import triton.experimental.gluon  # noqa: F401
        gluon = True
    except Exception:
        gluon = False
    return DeviceFacts("cuda", torch.cuda.get_device_properties(index).multi_processor_count,
                       tuple(torch.cuda.get_device_capability(index)), gluon, index)


@dataclass(frozen=True)
class Plan:
    """What :func:`run.run_plan` launches for one call: the kernel (``path``), its tiling, the
    INT4 query rotation (``rotate``, in ``rotate_parts`` parts; ``rotate_release``: the
    rotation kernel lets the next kernel start early), the reduction, programmatic dependent
    launch, bulk copies (staged kernels), the alignment (in 16-bit units) of the cache's block and
    slot strides that the code-unit and block-tile kernels read (``units.code_units``), and
    ``why`` in words. A mixed call (``path`` MIXED) is two plans, ``parts`` =
    (the plan of its first ``num_decode_seqs`` sequences as a decode batch of their own, the 2D
    plan of the others); its own tiling is the chunk part's; ``overlap``: the decode part runs on
    a second CUDA stream while the chunk part runs on the caller's."""

    path: Path
    tiling: Tiling
    rotate: Rotate = Rotate.NONE
    rotate_parts: int = 0
    rotate_release: bool = False
    reduce: Reduce = Reduce.NONE
    pdl: bool = False
    bulk_copies: bool = False
    unit_align: int = 0
    why: str = ""
    parts: tuple = ()
    num_decode_seqs: int = 0
    reduce_split: int = 1           # Gluon reduction programs per (token, query head), each over 128 / it dims
    unrotated: bool = False         # the staged INT4 kernel unrotates its split output (the reduction does not)
    reduce_early: bool = False      # the split kernel lets the reduction be scheduled at its start (one wave)
    overlap: bool = False           # MIXED: the two parts on two CUDA streams, side by side


DEFAULT_TUNING = Tuning()
# The generic decode tiling (the 2D kernel's split decode, decode_split, and the fallbacks to
# them): quantized tiles of 128 keys beat 64 by 15-25% at 32k context on the H200; bf16: 64.
DECODE_TILE = {KVQuantMode.NONE: 64, KVQuantMode.INT8_PER_TOKEN_HEAD: 128,
               KVQuantMode.FP8_PER_TOKEN_HEAD: 128, KVQuantMode.INT4_PER_TOKEN_HEAD: 128}
DECODE_WARPS = 4
DECODE_STAGES = 3
PREFILL_BLOCK_M = 64
PREFILL_TILE = 64
# The 2D kernel's tiling on a GPU where it reads 16-bit rows (a bf16 / fp16 cache, or a context
# dequantized first) and every sequence brings at least block_m query rows on average:
# (block_m, tile, num_warps, num_stages), chosen by :func:`big_prefill_tiling`. BIG_PREFILL
# serves head_size <= 128: H200, 2,048-token chunk over 32k cached keys, head 128, bf16,
# edges-only masking, cold L2: 5,803 µs against 6,432 at 64 x 64 with 4 warps (its shared
# memory: 160 KB of 227 KB; two warpgroups share each wgmma tile). On sm_90, by padded head
# size, BIG_PREFILL_SM90 (same benchmark, chunks of 512 / 2,048 over 0 / 4k / 32k cached keys):
# head 64 takes 64-key tiles, 4 warps and 5 stages, 1.3-1.5x faster than BIG_PREFILL (2,048
# over 32k: 3,064 against 4,491 µs); head 256, where BIG_PREFILL does not fit the shared
# memory, 128 x 64 with 8 warps and 3 stages (about 192 KB), 1.3-1.7x faster than 64 x 64
# (4,709 against 8,097 µs).
BIG_PREFILL = (128, 128, 8, 2)
BIG_PREFILL_SM90 = {64: (128, 64, 4, 5), 128: BIG_PREFILL, 256: (128, 64, 8, 3)}
# Tiling.dequant_first from this many query tiles per sequence (mean over the call's sequences).
# The fused 2D kernels convert every code once per query tile that reads it; dequantizing first
# converts it once, then writes and re-reads 16-bit rows: about what one or two query tiles'
# conversions cost (H200, head_size 128, a 2,048-token chunk = 128 tiles over 32k cached keys:
# 2.3x faster dequantized first). The margin keeps batches whose mean hides many one-token
# sequences (decode rows read their context once) on the fused kernel.
DEQUANT_MIN_Q_TILES = 4
TARGET_PROGRAMS_PER_SM = 16  # 2D split decode: segments until the grid holds about this many programs per SM
MIN_TILES_PER_SEGMENT = 4    # 2D split decode: a shorter segment costs more in reduction than it saves ...
# ... except in a small grid over a 16-bit cache: segments down to one tile while the grid holds
# at most this many programs per SM, by padded head size (default 2). A short context is a few
# tiles per program, so its time is the chain of each program's tile latencies, not the merge
# (bf16, H200, cold L2, docs/BENCHMARKS.md): b1@512 at head 128 6.3 µs in 8 one-tile segments
# against 10.5 in 2, b1@2k 8.9 in 32 against 11.3 in 8, b8@512 12.0 in 4 against 14.0 in 2; head
# 64 runs its lighter programs best at 4 per SM (b2@4k 12.5 µs in 32 segments against 13.0-14.2
# in 16), heads 128 / 256 at 2 (head 128 b1@4k 11.7 in 32 against 13.7 in 64).
SHORT_SEGMENT_PROGRAMS_PER_SM = {64: 4}
# The 2D kernel's split decode over a 16-bit cache on sm_90: resident programs per SM of its decode
# tiling (16 x 64, 4 warps, 3 stages) by padded head size; other GPUs and head sizes keep the rule
# above. H200 profiler at head_size 128: 156 registers x 128 threads and 38 KiB of shared memory
# per program, so registers bind at 3. There the grid is sized in whole waves of these slots
# (:func:`whole_wave_segments`): fewer, longer programs in one or two full waves beat
# TARGET_PROGRAMS_PER_SM's many waves by 3-11% from b1 to b32 (cold L2, docs/BENCHMARKS.md:
# bf16 b2@32k 77.7 against 84.7 µs, b8@32k 252.3 against 276.4, b8@4k 46.8 against 50.6), and
# the segments left empty by whole tiles per segment are dropped (:func:`busy_segments`: b1@32k
# 38.5-40.0 µs in 47 segments against 40.3-40.7 in 49).
DECODE_2D_RESIDENT = {128: 3}
MIN_WAVE_FILL = 0.9          # whole_wave_segments: the share of the waves' slots the grid must fill
SPLIT_PROGRAMS_PER_SM = 2    # decode_split asked for without a tiling: segments for about this many per SM
# A mixed call's decode part runs on a second CUDA stream alongside its chunk part up to this many
# decode keys (rows x their longest context): a small decode grid leaves SMs to the chunk's, so the
# two overlap (H200, cold L2, bf16: 1 row over 1k + a 128-token chunk 24.9 against 27.2 µs one
# after the other, 8 rows over 4k + 256 tokens 90.2 against 95.9, 1 row over 32k + 512 tokens
# 93.4 against 99.2, 1 row over 128k 178.5 against 187.5; INT4 1.00-1.03x); decode parts that
# fill the GPU gained nothing and lost about 1% (bf16 16 rows x 32k + 2,048 tokens 2,337.6
# against 2,306.8; 64 rows x 4k + two chunks 803.5 against 796.7).
OVERLAP_MAX_DECODE_KEYS = 131072
# ... and over a quantized cache from this many: INT4 with one decode row over 1k keys and a
# 128-token chunk measured 0.93-0.95x side by side (43.0 against 40.8 µs), 1.00-1.03x from 4k keys.
OVERLAP_MIN_QUANTIZED_DECODE_KEYS = 4096
_STAGED = {KVQuantMode.INT4_PER_TOKEN_HEAD: Path.DECODE_STAGED_INT4,
           KVQuantMode.INT8_PER_TOKEN_HEAD: Path.DECODE_STAGED_INT8,
           KVQuantMode.FP8_PER_TOKEN_HEAD: Path.DECODE_STAGED_INT8}


def plan_call(call: AttnCall, *, seq_threshold_3D: Optional[int] = None, num_segments: Optional[int] = None,
              tuning: Optional[Tuning] = None, facts: Optional[DeviceFacts] = None,
              num_decode_seqs: Optional[int] = None) -> Plan:
    """The :class:`Plan` of ``call`` (see the module docstring); launches nothing (a real CUDA
    device's first plan of a Gluon kernel compiles it once, see ``gluon_probe``).
    ``num_decode_seqs``: sequences ``[0, num_decode_seqs)`` have one query token each and come
    first (the caller knows it on the host): see :func:`_plan_mixed`."""
    tuning = tuning or DEFAULT_TUNING
    facts = facts or device_facts(call.q.device)
    if call.q.shape[0] == 0:
        return Plan(Path.EMPTY, Tiling(16, 16), why="no query tokens: nothing is launched")
    if num_decode_seqs is not None:
        d = check_num_decode_seqs(call, num_decode_seqs)
        if 0 < d < call.num_seqs:
            return _plan_mixed(call, d, seq_threshold_3D, num_segments, tuning, facts)
        if d == call.num_seqs:  # every sequence is a decode row: a decode batch
            call = dataclasses.replace(call, max_seqlen_q=1)
    pdl = tuning.pdl and facts.type == "cuda" and tuple(facts.capability) >= (9, 0)
    why: list = []
    given = call.segm_output.shape[2] if call.segm_output is not None else num_segments
    path, tiling = _choose(call, facts, tuning, pdl, seq_threshold_3D, given, why)
    path, tiling, units = _settle(path, tiling, call, facts, tuning, pdl, why)
    if path == Path.PREFILL_2D and tuning.tiling is None:  # decode through the 2D kernel too (its segments)
        tiling = dataclasses.replace(tiling, mask_edges_only=True)
    rotate, parts, release = _rotation(path, tiling, call, facts, tuning, pdl, why)
    reduce = _reduction(tiling, call, facts, tuning, pdl)
    bulk = path in _STAGED.values() and _bulk_copies(tuning, facts)
    align = units[2] if units is not None and path in (Path.DECODE_CODE_UNITS, Path.DECODE_BLOCK_TILES) else 0
    split, unrotated = _reduce_split(path, tiling, call, facts, reduce, why)
    early = pdl and reduce != Reduce.NONE and _one_wave(path, tiling, call, facts)
    return Plan(path, tiling, rotate, parts, release, reduce, pdl, bulk, align, "; ".join(why), reduce_split=split,
                unrotated=unrotated, reduce_early=early)


def _one_wave(path, tiling, call, facts) -> bool:
    """Whether the split kernel's grid is resident at once, where letting the reduction start
    early (``Plan.reduce_early``) was measured faster (over a grid of more than one wave an early
    release was slower, ``common.pdl_release``): the staged kernels at one program per SM, the 2D
    kernel's bf16 / fp16 split decode within ``DECODE_2D_RESIDENT`` per SM."""
    programs = call.num_seqs * tiling.num_segments
    if path in _STAGED.values():
        return programs <= facts.num_sms
    if path == Path.PREFILL_2D and call.mode == KVQuantMode.NONE and call.max_seqlen_q == 1 and facts.cuda_sm90:
        resident = DECODE_2D_RESIDENT.get(call.head_size)  # measured at head_size 128
        return bool(resident) and programs * call.num_kv_heads <= resident * facts.num_sms
    return False


def _plan_mixed(call, d, seq_threshold_3D, num_segments, tuning, facts) -> Plan:
    """A mixed call split at sequence ``d`` (``call.split_mixed``): the decode rows get the plan of
    a decode batch of their own (``tuning`` as given), the chunk rows the 2D kernel's prefill
    tiling (``tuning.path`` / ``tiling`` are for the decode rows); no copy, no device sync."""
    decode, chunk = split_mixed(call, d)
    dec = plan_call(decode, seq_threshold_3D=seq_threshold_3D, num_segments=num_segments, tuning=tuning, facts=facts)
    pdl = tuning.pdl and facts.type == "cuda" and tuple(facts.capability) >= (9, 0)
    whys: list = []
    tiling = _prefill_tiling(chunk, facts, tuning, whys)
    rotate, rotate_parts, release = _rotation(Path.PREFILL_2D, tiling, chunk, facts, tuning, pdl, [])
    rows = chunk.num_seqs
    why = "; ".join([f"prefill rows of {rows} sequence{'s' * (rows > 1)} after {d} decode row{'s' * (d > 1)}"]
                    + whys)
    pre = Plan(Path.PREFILL_2D, tiling, rotate, rotate_parts, release, pdl=pdl, why=why)
    keys = d * decode.max_seqlen_k
    overlap = (tuning.overlap_mixed and facts.type == "cuda" and keys <= OVERLAP_MAX_DECODE_KEYS
               and (call.mode == KVQuantMode.NONE or keys >= OVERLAP_MIN_QUANTIZED_DECODE_KEYS))
    order = "alongside (two streams)" if overlap else "then"
    return Plan(Path.MIXED, tiling, pdl=pdl, parts=(dec, pre), num_decode_seqs=d, overlap=overlap,
                why=f"mixed batch: {d} decode rows -> {dec.path.value} ({dec.why}), {order} {why} -> prefill_2d")


def _generic(call: AttnCall, block_m: int, segs: int) -> Tiling:
    return Tiling(block_m, DECODE_TILE[call.mode], segs, DECODE_WARPS, DECODE_STAGES)


def _choose(call, facts, tuning, pdl, seq_threshold_3D, given, why) -> tuple:
    """Steps 2-4: the wanted path and its tiling (or the one ``tuning`` asks for)."""
    decode = call.max_seqlen_q == 1 and not (seq_threshold_3D is not None and call.num_seqs > seq_threshold_3D)
    if tuning.path is not None:
        why.append(f"{tuning.path.value} asked for (Tuning.path)")
        if tuning.path == Path.PREFILL_2D and not decode and tuning.tiling is None:
            return tuning.path, _prefill_tiling(call, facts, tuning, why)
        return tuning.path, tuning.tiling or _tiling(tuning.path, call, facts, decode, given)
    if not decode:
        why.append(f"prefill / mixed batch (max_seqlen_q {call.max_seqlen_q})" if call.max_seqlen_q != 1 else
                   f"decode batch of {call.num_seqs} sequences > seq_threshold_3D {seq_threshold_3D}")
        return Path.PREFILL_2D, tuning.tiling or _prefill_tiling(call, facts, tuning, why)
    head, mode = call.head_size, call.mode
    keys = call.num_seqs * call.max_seqlen_k
    if mode not in DECODE_MODES or head & (head - 1):
        why.append("decode on a bf16/fp16 cache" if mode not in DECODE_MODES else
                   f"decode at head_size {head}, not a power of two")
        path = Path.PREFILL_2D
    elif _staged_wanted(call, facts, tuning, pdl):
        path = _STAGED[mode]
        why.append(f"decode, {keys} keys in the batch >= {S.MIN_KEYS[path.value]}, head_size 128, "
                   f"group {call.group}, {call.num_kv_heads} KV heads")
    elif B.wants(mode, head, call.num_seqs, call.max_seqlen_k):
        path = Path.DECODE_BLOCK_TILES
        why.append(f"decode at head_size {head}" + (f", {keys} keys >= {B.INT4_MIN_KEYS[head]}"
                                                      if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else ""))
    else:
        path = Path.DECODE_CODE_UNITS
        why.append(f"decode at head_size {head}" + (f", {keys} keys < {B.INT4_MIN_KEYS[head]}"
                                                     if head in B.INT4_MIN_KEYS else ""))
    tiling = tuning.tiling or _tiling(path, call, facts, True, given)
    if tiling.num_segments <= 1 and path != Path.PREFILL_2D:
        why.append("one segment: the 2D kernel")
        return Path.PREFILL_2D, _generic(call, tiling.block_m, tiling.num_segments)
    return path, tiling


def _prefill_tiling(call: AttnCall, facts: DeviceFacts, tuning: Tuning, why: list) -> Tiling:
    """The 2D kernel's tiling of a prefill / mixed call (no split): edge tiles only masked, and
    over a quantized cache the context dequantized first where it pays (:data:`DEQUANT_MIN_Q_TILES`
    query tiles per sequence) and its scratch fits ``tuning.dequant_max_bytes``; ``why`` says which."""
    block_m = max(PREFILL_BLOCK_M, next_pow2(call.group))
    rows = (call.q.shape[0] - call.first_token) * call.group / call.num_seqs  # query rows per sequence
    dequant, groups, unrotate = False, 1, D.unrotates(call)
    if call.mode != KVQuantMode.NONE:
        tiles = rows / block_m
        need = D.scratch_bytes(call, interpreted=facts.type == "cpu", unrotate=unrotate)
        cap = tuning.dequant_max_bytes
        if tiles < DEQUANT_MIN_Q_TILES:
            why.append(f"fused kernel: {tiles:.1f} query tiles per sequence < {DEQUANT_MIN_Q_TILES}")
        elif not D.reads(call):
            why.append(f"fused kernel: no dequantizing pass for {call.mode.name} at head_size {call.head_size}")
        else:
            found = dequant_groups(need, cap, call.num_kv_heads)
            if found is None:
                why.append(f"fused kernel: dequantizing first would need {need / 2**20:.1f} MiB of scratch "
                           f"(one KV head at a time: {need / call.num_kv_heads / 2**20:.1f} MiB) > "
                           f"Tuning.dequant_max_bytes {cap / 2**20:.1f} MiB")
            else:
                dequant, groups = True, found
                turns = f", {groups} groups of {call.num_kv_heads // groups} KV heads in turn" if groups > 1 else ""
                why.append(f"context dequantized first ({tiles:.0f} query tiles per sequence >= "
                           f"{DEQUANT_MIN_Q_TILES}; {need / groups / 2**20:.1f} MiB of scratch{turns})")
                if call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
                    ratio, bound = D.rows_per_query_row(call), D.unrotate_bound(call.head_size)
                    why.append(f"INT4 rows unrotated by the pass ({ratio:.2f} context rows per query row <= {bound})"
                               if unrotate else f"INT4 rows kept rotated, the query and output rotated ({ratio:.2f} "
                               f"context rows per query row > {bound})")
    unrotate = unrotate and dequant
    if facts.cuda_sm90 and facts.gluon and tuning.wgmma_prefill and (call.mode == KVQuantMode.NONE or dequant) \
            and rows >= W.BLOCK_M:
        not_ok = W.eligible(call, dequant)
        dtype = D.scratch_dtype(interpreted=False) if dequant else call.k.dtype  # the probe runs on the GPU
        int8_keys = dequant and tuning.int8_key_prefill and D.int8_keys_apply(call, unrotate) \
            and call.head_size in W.INT8_KEY_HEADS
        tile_blocks = dequant and tuning.tile_blocks_prefill and call.head_size in W.TILE_BLOCK_HEADS
        block_rows = W.TILINGS[call.head_size][0] if tile_blocks and not not_ok else call.k.shape[1]
        if not not_ok and facts.index is not None and not W.probe(
                _device(facts), call.head_size, dtype, call.group, block_rows, call.causal, int8_keys):
            not_ok = ["its Gluon kernel does not compile with this Triton"]
        if not not_ok:
            tile, stages, _ = W.TILINGS[call.head_size]
            why.append(f"prefill_wgmma_gluon: TMA copies, warpgroup MMAs, {tile}-key tiles, {stages} stages "
                       f"({rows:.0f} query rows per sequence)")
            if tile_blocks:
                why.append(f"the scratch read as {tile}-slot blocks: one TMA box a tile")
            if int8_keys:
                why.append(f"keys as int8 codes, the query quantized per row: int8 score MMAs (head_size "
                           f"{call.head_size} in {W.INT8_KEY_HEADS})")
            return Tiling(W.BLOCK_M, tile, num_warps=W.NUM_WARPS, num_stages=stages, mask_edges_only=True,
                          dequant_first=dequant, dequant_groups=groups, unrotate=unrotate, wgmma=True,
                          int8_keys=int8_keys, tile_blocks=tile_blocks)
        why.append("not prefill_wgmma_gluon: " + "; ".join(not_ok))
    big = big_prefill_tiling(call.head_size, facts)
    if big and (call.mode == KVQuantMode.NONE or dequant) and rows >= big[0] and block_m <= big[0]:
        bm, tile, warps, stages = big
        why.append(f"{bm} x {tile} tiles, {warps} warps, {stages} stages over 16-bit rows "
                   f"({rows:.0f} query rows per sequence)")
        return Tiling(bm, tile, num_warps=warps, num_stages=stages, mask_edges_only=True, dequant_first=dequant,
                      dequant_groups=groups, unrotate=unrotate)
    return Tiling(block_m, PREFILL_TILE, mask_edges_only=True, dequant_first=dequant, dequant_groups=groups,
                  unrotate=unrotate)


def big_prefill_tiling(head_size: int, facts: DeviceFacts) -> Optional[tuple]:
    """The 2D kernel's prefill tiling over 16-bit rows on a GPU, ``(block_m, tile, num_warps,
    num_stages)``: on sm_90 :data:`BIG_PREFILL_SM90` by padded head size, else :data:`BIG_PREFILL`
    up to head_size 128; None on the CPU and where neither applies."""
    if facts.type != "cuda":
        return None
    head_pad = next_pow2(head_size)
    if facts.cuda_sm90 and head_pad in BIG_PREFILL_SM90:
        return BIG_PREFILL_SM90[head_pad]
    return BIG_PREFILL if head_size <= 128 else None


def dequant_groups(need: int, cap: int, num_kv_heads: int) -> Optional[int]:
    """The fewest KV-head groups (a divisor of ``num_kv_heads``) whose dequantized scratch, ``need``
    bytes for all heads (it grows with the heads), fits ``cap``; None where one head does not fit."""
    for groups in range(1, num_kv_heads + 1):
        if num_kv_heads % groups == 0 and need <= cap * groups:
            return groups
    return None


def _tiling(path: Path, call: AttnCall, facts: DeviceFacts, decode: bool, given: Optional[int]) -> Tiling:
    """The default tiling of ``path`` for ``call`` (``given``: the caller's segment count)."""
    mode, head, ctx, sms = call.mode, call.head_size, call.max_seqlen_k, facts.num_sms
    block_m = max(16, next_pow2(call.group))
    pairs = max(1, call.num_seqs * call.num_kv_heads)
    if path == Path.PREFILL_2D and not decode:
        return Tiling(max(PREFILL_BLOCK_M, block_m), PREFILL_TILE)  # no split: the caller's count is for decode
    if path in (Path.DECODE_STAGED_INT4, Path.DECODE_STAGED_INT8):
        segs = given or S.segments(sms, call.num_seqs, ctx)
        return Tiling(block_m, 16, int(segs), call.num_kv_heads, S.stages(path.value, sms, call.num_seqs, int(segs)))
    t = B.tiling(mode, head) if path == Path.DECODE_BLOCK_TILES else None
    if t:
        groups = max(1, pairs // max(1, t[4] or call.num_kv_heads))
        want = B.segments(sms, groups, ctx, t[0], t[3], head)
        segs = given or prev_pow2(max(1, min(want, ctx)))
        return Tiling(block_m, t[0], int(segs), t[1], t[2], heads_per_program=t[4])
    if path == Path.DECODE_CODE_UNITS and mode in DECODE_MODES:
        t = C.tiling(mode, head)
        want = C.segments(sms, pairs, ctx, t[0], t[3], C.rotate_needs_small_grid(mode, head))
        segs = given or prev_pow2(max(1, min(want, ctx)))
        return Tiling(block_m, t[0], int(segs), t[1], t[2])
    tile = DECODE_TILE[mode]
    if path == Path.DECODE_SPLIT:  # about SPLIT_PROGRAMS_PER_SM programs per SM, one tile per segment at least
        want, cap = max(2, SPLIT_PROGRAMS_PER_SM * sms // pairs), max(1, ctx // tile)
    else:
        tiles = cdiv(ctx, tile)
        short = SHORT_SEGMENT_PROGRAMS_PER_SM.get(call.head_pad, 2) * sms // pairs if mode == KVQuantMode.NONE else 0
        cap = max(1, ctx // (tile * MIN_TILES_PER_SEGMENT), min(tiles, short))
        # on sm_90, where the slots were counted
        resident = DECODE_2D_RESIDENT.get(call.head_pad) if mode == KVQuantMode.NONE and facts.cuda_sm90 else None
        if resident and not given:
            segs = min(whole_wave_segments(pairs, resident * sms), cap)
            return _generic(call, block_m, busy_segments(segs, tiles))
        want = TARGET_PROGRAMS_PER_SM * sms // pairs
    return _generic(call, block_m, int(given or prev_pow2(max(1, min(want, cap)))))


def whole_wave_segments(pairs: int, slots: int, max_waves: int = 8) -> int:
    """Segments per (sequence, KV head) that make a grid of ``pairs x segments`` programs fill
    ``k`` whole waves of ``slots`` resident programs to at least :data:`MIN_WAVE_FILL`, for the
    fewest waves ``k`` that can (the fullest fill within ``max_waves`` otherwise): on 396 slots
    (H200, 3 per SM) b1 takes 49 segments, b8 6, b16 3 (one wave each), b32 3 (two waves)."""
    best = (0.0, 1)
    for k in range(1, max_waves + 1):
        segs = k * slots // pairs
        if segs < 1:
            continue
        fill = pairs * segs / (k * slots)
        if fill >= MIN_WAVE_FILL:
            return segs
        best = max(best, (fill, segs))
    return best[1]


def _staged_wanted(call, facts, tuning, pdl) -> bool:
    """Whether a staged kernel takes this decode batch by default: its shape rule, and a device
    where it runs (:func:`_staged_runs`)."""
    path = _STAGED[call.mode]
    return (S.wants(path.value, call.head_size, call.group, call.num_kv_heads, call.num_seqs, call.max_seqlen_k)
            and _staged_runs(path, call, facts, tuning, pdl, None) is None)


def _staged_runs(path, call, facts, tuning, pdl, tiling, rotate_q: bool = False) -> Optional[str]:
    """None where the staged kernel ``path`` runs on this device, else why not; ``rotate_q``: its
    variant that rotates an INT4 query itself."""
    if not facts.cuda_sm80:
        return "no CUDA sm_80+ device"
    if not facts.gluon:
        return "no Gluon in this Triton"
    if facts.index is None:
        return None
    stages = max(2, tiling.num_stages) if tiling else S.STAGES[path.value]
    if not S.probe(path.value, call.mode, _device(facts), call.num_kv_heads, call.group, stages,
                   _bulk_copies(tuning, facts), pdl, rotate_q=rotate_q):
        return "its Gluon kernel does not compile with this Triton"
    return None


def _bulk_copies(tuning, facts) -> bool:
    """Whether the staged kernels copy each block with one bulk copy (sm_90+, asked for)."""
    return tuning.bulk_copies and tuple(facts.capability) >= (9, 0)


def _settle(path, tiling, call, facts, tuning, pdl, why) -> tuple:
    """Step 5: the first path, from ``path`` down, that reads this cache; and the cache's
    ``units.code_units`` where the path reads them."""
    mode = call.mode
    if path == Path.PREFILL_2D:
        return path, tiling, None
    if tiling.num_segments <= 1 or mode not in DECODE_MODES:
        why.append("one segment or a bf16/fp16 cache: the 2D kernel")
        if tiling.num_segments > 1 and path in (Path.DECODE_STAGED_INT4, Path.DECODE_STAGED_INT8):
            tiling = _generic(call, tiling.block_m, tiling.num_segments)  # the staged tiling means nothing here
        return Path.PREFILL_2D, tiling, None
    if path in (Path.DECODE_STAGED_INT4, Path.DECODE_STAGED_INT8):
        reason = None
        if _STAGED[mode] != path:
            reason = f"{path.value} does not read {mode.name} caches"
        elif not S.reads_layout(mode, call.q, call.k, call.v, call.ks, call.vs):
            reason = "the cache is not the packed layout (or its shape is not one it reads)"
        elif mode == KVQuantMode.FP8_PER_TOKEN_HEAD and tuple(facts.capability) < (8, 9):
            reason = "its FP8 conversion needs sm_89+"
        reason = reason or _staged_runs(path, call, facts, tuning, pdl, tiling)
        if reason is None:
            return path, tiling, None
        t = B.tiling(mode, call.head_size)
        why.append(f"{path.value} cannot run ({reason})")
        if t:
            path = Path.DECODE_BLOCK_TILES
            tiling = dataclasses.replace(tiling, tile=t[0], num_warps=t[1], num_stages=t[2], heads_per_program=t[4])
        elif call.head_size & (call.head_size - 1) == 0:
            path, tiling = Path.DECODE_SPLIT, _generic(call, tiling.block_m, tiling.num_segments)
        else:
            return Path.PREFILL_2D, _generic(call, tiling.block_m, tiling.num_segments), None
    units = code_units(call.k, call.v, mode) if path in (Path.DECODE_BLOCK_TILES, Path.DECODE_CODE_UNITS) else None
    if path == Path.DECODE_BLOCK_TILES:
        if units is not None and B.reads(units, call.num_kv_heads, tiling.heads_per_program):
            return path, tiling, units
        if units is not None:
            why.append("K and V head strides differ or heads per program do not divide the KV heads: "
                       "decode_code_units")
            return Path.DECODE_CODE_UNITS, tiling, units
    if path in (Path.DECODE_BLOCK_TILES, Path.DECODE_CODE_UNITS) and units is None:
        why.append("the cache rows are not 4-byte aligned 16-bit units: decode_split")
        return Path.DECODE_SPLIT, _generic(call, tiling.block_m, tiling.num_segments), None
    return path, tiling, units


def _device(facts: DeviceFacts) -> torch.device:
    """The device the Gluon probes compile for (facts of a real device)."""
    return torch.device(facts.type, facts.index)


def _gluon_edge(call, facts, tuning) -> bool:
    """Whether a Gluon rotation / reduction may run: head_size 128, CUDA sm_80+ with Gluon, asked for."""
    return call.head_size == 128 and tuning.gluon_edges and facts.cuda_sm80 and facts.gluon


def _rotation(path, tiling, call, facts, tuning, pdl, why) -> tuple:
    """Step 6: ``(Rotate, parts, release)`` of an INT4 query."""
    if call.mode != KVQuantMode.INT4_PER_TOKEN_HEAD or path == Path.DECODE_STAGED_INT8:
        return Rotate.NONE, 0, False
    parts, release = 4, False
    if path == Path.PREFILL_2D:
        if tiling.dequant_first and tiling.num_segments == 1:  # prefill_dequant unrotates, or rotates q / out itself
            return Rotate.NONE, 0, False
        if not tuning.rotate_q_once:
            return Rotate.IN_KERNEL, 0, False
        parts = 2  # the 2D kernel's dots take the even, then the odd rotated dims
    if path == Path.DECODE_CODE_UNITS:
        grid = call.num_seqs * call.num_kv_heads * tiling.num_segments
        small = 2 * grid <= C.tiling(call.mode, call.head_size)[3] * facts.num_sms  # half the resident slots
        if tuning.rotate_q_in_decode and (small or call.head_size <= C.ROTATE_Q_MAX_HEAD):
            return Rotate.PROLOGUE, 0, False
        release = small
    elif path == Path.DECODE_STAGED_INT4:
        if tuning.rotate_q_in_decode and _staged_runs(path, call, facts, tuning, pdl, tiling, rotate_q=True) is None:
            why.append("the staged kernel rotates its query")
            return Rotate.PROLOGUE, 0, False
        release = pdl
    elif path == Path.DECODE_SPLIT:
        parts = 2
    num_q_heads = call.q.shape[1]
    if _gluon_edge(call, facts, tuning) and (
            facts.index is None or Q.probe(_device(facts), num_q_heads, parts, pdl, pdl and release)):
        return Rotate.GLUON, parts, release
    return Rotate.TRITON, parts, release


def _reduce_split(path, tiling, call, facts, reduce, why) -> tuple:
    """Step 6: ``(reduce_split, unrotated)``: the Gluon reduction spreads each row's dims over
    ``R.dim_split`` programs where the rows alone leave SMs idle, if it does not rotate; the staged
    INT4 kernel unrotates its split output for it from ``R.UNROTATE_MIN_SEGMENTS`` segments."""
    if reduce != Reduce.GLUON:
        return 1, False
    split = R.dim_split(call.q.shape[0] * call.q.shape[1], facts.num_sms)
    if call.mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        return split, False
    if path != Path.DECODE_STAGED_INT4 or split == 1 or tiling.num_segments < R.UNROTATE_MIN_SEGMENTS:
        return 1, False
    why.append(f"{tiling.num_segments} segments: unrotated in the kernel, the reduction over {split} dim groups")
    return split, True


def _reduction(tiling, call, facts, tuning, pdl) -> Reduce:
    """Step 6: the kernel that merges the segments."""
    segs = tiling.num_segments
    if segs <= 1:
        return Reduce.NONE
    rotate = call.mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    if _gluon_edge(call, facts, tuning) and segs <= R.GLUON_MAX_SEGMENTS and (
            facts.index is None or R.probe(_device(facts), call.q.shape[1], segs, rotate, pdl)):
        return Reduce.GLUON
    return Reduce.TRITON

