"""The one decision of a cache write: which path runs, with which tiling, and why.

:func:`write_plan` takes the arguments of the public write functions, validates them once
(``checks.check_write_args``: nothing is launched, nothing written on error), and asks the
paths of the call's mode, in a fixed order, whether they fit (:func:`plan_for`). The public
functions then run exactly the plan it returns; no launcher falls back to another path.

Paths, by mode:

- ``unquantized`` (bf16 / fp16 caches): ``unquantized.py``;
- ``symmetric`` (INT8 / FP8 per token head): ``symmetric.py``;
- INT4, first that fits: the path the caller's tuning names, then ``int4-mma`` (GPU, head_size
  64 / 128 / 256: the tensor-core rotation, ``int4_lanes.py`` + ``int4_mma.py``), then
  ``int4-lanes`` (GPU, head_size 16..256: butterflies in registers and warp shuffles,
  ``int4_lanes.py``), then ``int4-fused`` (everything else: CPU, the MSE encoder, rows wider
  than 256, K/V rows not loadable in 16-byte vectors; ``int4_fused.py``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional, Sequence

import torch

from layouts import KVQuantMode

from .._jit import cdiv
from .checks import WriteShape, check_key_offset, check_write_args, lane_layout_ok
from .tuning import (LANES_TILING, MMA_COLS, MMA_TILING, TUNING_OF_PATH, MmaTuning, TileTuning,
                     resolve_offset_tuning, resolve_tuning)

# the Triton kernel each path launches (the names ``record_launches`` sees)
KERNELS = {"unquantized": "_reshape_and_cache_flash_kernel", "symmetric": "_reshape_and_cache_symmetric_kernel",
           "int4-mma": "_reshape_and_cache_int4_mma_kernel", "int4-lanes": "_reshape_and_cache_int4_lanes_kernel",
           "int4-fused": "_reshape_and_cache_int4_fused_kernel"}
INT4_ORDER = ("int4-mma", "int4-lanes", "int4-fused")
_ONE_RANGE = (1.0,)  # the vLLM-compatible INT4 encoder: the zero-inclusive range itself


class WriteArgs(NamedTuple):
    """The tensors of one write, as the launchers take them (shapes: ``write_plan``)."""

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale_cache: Optional[torch.Tensor]
    v_scale_cache: Optional[torch.Tensor]
    key_offset: Optional[torch.Tensor] = None  # INT4: [num_kv_heads, head_size] in the model dtype, contiguous


class WriteCall(NamedTuple):
    """What the choice of a path depends on (no tensors): built by :func:`write_plan` from the
    arguments, or by hand to ask what would run elsewhere (``bench/write.py --plans``)."""

    mode: KVQuantMode
    head_size: int
    num_rows: int            # num_tokens * num_kv_heads
    on_gpu: bool             # False: Triton's interpreter (CPU tensors)
    num_sms: int = 132       # GPU multiprocessors (int4-fused's persistent grid)
    lane_layout: bool = True  # K/V rows loadable in 16-byte vectors (checks.lane_layout_ok)
    num_shrink: int = 1      # INT4 range factors tried per row (> 1: the MSE encoder)
    smooth: bool = False     # INT4: a key offset is subtracted (key smoothing)


class WritePlan(NamedTuple):
    """One write's decision (immutable): the path, the kernel it launches, its complete tuning,
    the grid and why this path. ``shape`` is None for a plan made from a :class:`WriteCall` alone."""

    path: str
    kernel: str
    tuning: object
    grid: tuple
    why: str
    mode: KVQuantMode
    interpret: bool
    shrink: tuple = (1.0,)
    shape: Optional[WriteShape] = None
    lane_offsets: bool = False  # int4-mma with a key offset: each lane's offsets loaded once per program


def _int4_misfit(path: str, call: WriteCall) -> Optional[str]:
    """Why ``path`` cannot write ``call`` (None: it can)."""
    d = call.head_size
    if path == "int4-fused":
        return None
    if call.num_shrink > 1:
        return "the MSE encoder (several range factors) runs in int4-fused only"
    if d not in LANES_TILING:
        return f"head_size {d} is wider than one warp's 32 lanes x 8 values"
    if path == "int4-mma" and d < MMA_COLS:
        return f"head_size {d} < the tensor-core part's {MMA_COLS} columns"
    if call.on_gpu and not call.lane_layout:
        return "K/V rows are not loadable in 16-byte vectors (base or strides)"
    return None


def _choose(call: WriteCall, requested: Optional[str]) -> tuple[str, str]:
    """(path, why) for ``call``; ``requested``: the path the caller's tuning names, tried first."""
    mode = call.mode
    if mode == KVQuantMode.NONE:
        return "unquantized", "bf16/fp16 cache: rows copied, cast to the cache dtype"
    if mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        return "symmetric", f"{mode.name}: one absmax scale per row, no rotation"
    if requested is not None:
        order = (requested,) + INT4_ORDER[INT4_ORDER.index(requested) + 1:]
    elif not call.on_gpu:
        return "int4-fused", "CPU: the interpreter runs int4-fused's whole tiles per numpy operation"
    else:
        order = INT4_ORDER if call.head_size in MMA_TILING else INT4_ORDER[1:]
    skipped: dict[str, list[str]] = {}  # misfit -> paths it rules out, in order
    for path in order:
        misfit = _int4_misfit(path, call)
        if misfit is None:
            if skipped:
                return path, "; ".join(f"not {' / '.join(ps)}: {m}" for m, ps in skipped.items())
            if requested == path:
                return path, "requested (tuning)"
            if path == "int4-mma":
                return path, f"GPU, head_size {call.head_size}: rotation on tensor cores, the fastest measured"
            return path, f"GPU, head_size {call.head_size}: butterflies in registers and shuffles, exact"
        skipped.setdefault(misfit, []).append(path)
    raise AssertionError("int4-fused fits every call")  # pragma: no cover


@functools.lru_cache(maxsize=4096)
def _decide(mode: KVQuantMode, head_size: int, on_gpu: bool, lane_layout: bool, num_shrink: int, tuning):
    """(path, why, complete tuning): the part of a plan that does not depend on the row count,
    made once per distinct call (tunings are frozen, hence hashable)."""
    call = WriteCall(mode, head_size, 0, on_gpu, 0, lane_layout, num_shrink)
    requested = None
    if tuning is not None:
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
            requested = next((p for p in INT4_ORDER if type(tuning) is TUNING_OF_PATH[p]), None)
            if requested is None:
                raise TypeError(f"tuning: expected LanesTuning, MmaTuning or FusedTuning for INT4_PER_TOKEN_HEAD, "
                                f"got {type(tuning).__name__}")
        elif type(tuning) is not TileTuning:
            raise TypeError(f"tuning: expected TileTuning for {mode.name}, got {type(tuning).__name__}")
    path, why = _choose(call, requested)
    if requested is not None and path != requested:
        tuning = None  # the requested path cannot write the call: the one that runs takes its own defaults
    return path, why, resolve_tuning(path, tuning, head_size, on_gpu)


def plan_for(call: WriteCall, tuning=None, shrink: Sequence[float] = (1.0,),
             shape: Optional[WriteShape] = None) -> WritePlan:
    """The plan of ``call``: the path chosen in the fixed order, its tuning resolved (``tuning``
    where set, else the path's defaults), and the grid. Pure: no tensor, no device is touched.

    ``tuning`` (a ``tuning.*Tuning`` instance or None) names the path tried first; when that path
    cannot write the call (e.g. ``MmaTuning`` at head_size 16), the next one in the order runs
    with its own defaults, and ``why`` says so."""
    return _plan(call.mode, call.head_size, call.num_rows, call.on_gpu, call.num_sms, call.lane_layout,
                 tuple(shrink), tuning, shape, call.smooth)


def lane_offsets_fit(num_kv_heads: int, rows: int, warps: int) -> bool:
    """Whether every row a lane of the ``int4-mma`` kernel holds has one head, so the lane can load
    its key offsets once for all of them (``int4_mma.lane_offsets_text``): the lane's rows are
    ``8·warp + g + 8·warps·k`` of a tile, so ``num_kv_heads`` must divide ``8 * warps`` (the
    layout's row period) and ``rows`` (tiles start on a head-0 row)."""
    return (8 * warps) % num_kv_heads == 0 and rows % num_kv_heads == 0


@functools.lru_cache(maxsize=4096)
def _plan(mode, head_size, num_rows, on_gpu, num_sms, lane_layout, shrink, tuning, shape, smooth=False) -> WritePlan:
    """The plan of these facts (all hashable), made once: a model writes every layer, and a decode
    loop every step, with the same shapes."""
    path, why, t = _decide(mode, head_size, on_gpu, lane_layout, len(shrink), tuning)
    tiles = cdiv(num_rows, t.rows)
    lane = (path == "int4-mma" and smooth and on_gpu and shape is not None and bool(t.lane_offsets)
            and lane_offsets_fit(shape.num_kv_heads, t.rows, t.num_warps))
    if lane:  # the offset write's own tiling where its lanes' offsets fit it (tuning.OFFSET_TILING)
        t_off = resolve_offset_tuning(tuning if type(tuning) is MmaTuning else None, head_size)
        if lane_offsets_fit(shape.num_kv_heads, t_off.rows, t_off.num_warps):
            t, tiles = t_off, cdiv(num_rows, t_off.rows)
        per_sm = t.offset_programs_per_sm   # programs that loop over tiles load their lanes' offsets once
        grid = (min(tiles, max(1, num_sms * per_sm)) if per_sm else tiles, 2)
        return WritePlan(path, KERNELS[path], t, grid, why + "; key offsets loaded once per lane and program",
                         mode, False, shrink, shape, True)
    if path in ("int4-lanes", "int4-mma"):
        grid = (tiles, 2)  # axis 1: K or V
    elif path == "int4-fused" and on_gpu and t.programs_per_sm:
        grid = (min(tiles, max(1, num_sms * t.programs_per_sm)),)
    else:
        grid = (tiles,)
    return WritePlan(path, KERNELS[path], t, grid, why, mode, not on_gpu, shrink, shape)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def write_plan(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               k_scale_cache: Optional[torch.Tensor], v_scale_cache: Optional[torch.Tensor],
               slot_mapping: torch.Tensor, kv_quant_mode: KVQuantMode = KVQuantMode.INT8_PER_TOKEN_HEAD, *,
               check_slots: bool = True, shrink: Optional[Sequence[float]] = None, tuning=None,
               key_offset: Optional[torch.Tensor] = None) -> WritePlan:
    """Validate one cache write and decide how it runs; launches nothing.

    Arguments as :func:`~kernels.write.triton_reshape_and_cache_flash_per_token_head_quant`
    (``KVQuantMode.NONE`` with ``None`` scales for an unquantized cache).

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU; last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size], the mode's dtype
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, or None for NONE
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped
    kv_quant_mode : NONE, INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD or INT4_PER_TOKEN_HEAD
    check_slots : also check ``max(slot_mapping) < num_blocks * block_size`` (one device sync)
    shrink : INT4 only: range factors tried per row, least squared error wins; None or ``(1.0,)``
        is the vLLM-compatible encoder; the first factor must be 1.0
    tuning : a ``kernels.write.tuning`` instance (benchmarks, tests): names the path tried first
    key_offset : INT4 only: [num_kv_heads, head_size] float32 (or the model dtype) key offsets,
        or None; every INT4 path subtracts them in its one pass, so the path does not depend on
        it; int4-mma's grid does (``WritePlan.lane_offsets``: programs loop over tiles)

    Returns
    -------
    WritePlan

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride, head-size or slot-range mismatch.
    ValueError, TypeError
        On bad ``shrink`` factors, a tuning of another mode or a tiling its kernel cannot run.
    """
    mode = kv_quant_mode if type(kv_quant_mode) is KVQuantMode else KVQuantMode(kv_quant_mode)
    if shrink is not None and mode != KVQuantMode.INT4_PER_TOKEN_HEAD:
        raise TypeError(f"shrink: range factors apply to INT4_PER_TOKEN_HEAD only, got them for {mode.name}")
    if shrink is None or shrink == _ONE_RANGE:
        shrink = _ONE_RANGE
    else:
        shrink = tuple(float(f) for f in shrink)
        if not shrink or shrink[0] != 1.0 or not all(0.0 < f <= 1.0 for f in shrink):
            raise ValueError(f"shrink: expected factors in (0, 1] starting with 1.0, got {shrink}")
    shape = check_write_args(key, value, key_cache, value_cache, slot_mapping, mode,
                             k_scale_cache, v_scale_cache, check_slots)
    check_key_offset(key_offset, mode, shape, key.device)
    on_gpu = key.device.type != "cpu"
    int4_gpu = on_gpu and mode == KVQuantMode.INT4_PER_TOKEN_HEAD
    return _plan(mode, shape.head_size, shape.num_tokens * shape.num_kv_heads, on_gpu,
                 _sm_count(key.device) if int4_gpu else 0, int4_gpu and lane_layout_ok(key, value), shrink,
                 tuning, shape, key_offset is not None)


class Launch(NamedTuple):
    """One kernel launch as :func:`record_launches` sees it."""

    kernel: str   # the Triton kernel's name
    grid: tuple
    num_warps: int


_recording: list[list[Launch]] = []  # the lists of the open record_launches blocks, innermost last


@contextlib.contextmanager
def record_launches():
    """Collect the write kernels launched inside the block, as :class:`Launch` tuples (tests
    assert that what a plan names is what ran). Not thread-aware: one recording test at a time."""
    launches: list[Launch] = []
    _recording.append(launches)
    try:
        yield launches
    finally:
        _recording.remove(launches)


def launch(kernel, grid: tuple, kwargs: dict) -> None:
    """``kernel[grid](**kwargs)``, noted by :func:`record_launches` when one is open."""
    if _recording:
        _recording[-1].append(Launch(kernel.__name__, tuple(grid), kwargs["num_warps"]))
    kernel[grid](**kwargs)
