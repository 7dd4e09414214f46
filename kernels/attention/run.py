"""Run a :class:`~kernels.attention.plan.Plan`: the path's launcher, then the reduction.

Nothing here chooses: the launcher is looked up by ``plan.path`` in :data:`LAUNCHERS`, the
rotation and reduction kernels are the plan's (``plan.rotate``, ``plan.reduce``); a mixed plan
runs its two parts on the two halves of the call (``call.split_mixed``), with ``plan.overlap``
the decode part on a second CUDA stream alongside the chunk part; a 2D plan with
``Tiling.dequant_first`` over a quantized cache dequantizes the context first
(``prefill_dequant.dequantized_call``), runs the 2D kernel on the scratch cache and, for INT4,
rotates its output back (``prefill_dequant.restore_output``), for ``Tiling.dequant_groups``
groups of KV heads in turn (``call.head_group``).
"""

from __future__ import annotations

import functools

import torch
from triton.runtime.errors import OutOfResources

from layouts import KVQuantMode

from . import decode_staged
from .call import AttnCall, head_group, split_mixed, with_segment_buffers
from .decode_block_tiles import launch_block_tiles
from .decode_code_units import launch_code_units
from .decode_split import launch_split
from .plan import Path, Plan
from .prefill_2d import launch_2d
from .prefill_dequant import dequantized_call, restore_output
from .reduce import reduce_segments
from .rotate_query import query_scales, rotated_query


def launch_staged(call: AttnCall, plan: Plan) -> None:
    """The staged decode: INT4 rotates its query first (``rotate_query``) or in the kernel
    (``plan.rotate`` PROLOGUE), INT8 / FP8 read ``call.q`` with the softmax scale folded into the
    key scales' factor."""
    query, q_scale = rotated_query(call, plan)
    use_softcap, col_scale = query_scales(call)
    if plan.path == Path.DECODE_STAGED_INT4:
        decode_staged.launch(call, plan, query, col_scale, use_softcap, q_scale=q_scale)
    else:
        decode_staged.launch(call, plan, query, q_scale * col_scale, use_softcap)


LAUNCHERS = {
    Path.PREFILL_2D: launch_2d,
    Path.DECODE_SPLIT: launch_split,
    Path.DECODE_CODE_UNITS: launch_code_units,
    Path.DECODE_BLOCK_TILES: launch_block_tiles,
    Path.DECODE_STAGED_INT4: launch_staged,
    Path.DECODE_STAGED_INT8: launch_staged,
}


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of :func:`_side_by_side` (one per device, made once)."""
    return torch.cuda.Stream(device=device)


def _side_by_side(first, second, device: torch.device):
    """Launch ``first`` on a side stream and ``second`` on the current one, both after the work
    queued so far on the current stream, which then waits for both (a fork and a join: two
    branches of a CUDA graph when captured). ``first`` launches first, so a short decode grid
    takes its SMs before the chunk's grid fills the rest. Whatever ``first`` allocates belongs to
    the side stream's pool, so the caching allocator reuses it only in that stream's order."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        first()
    second()
    main.wait_stream(side)


def run_plan(call: AttnCall, plan: Plan):
    """Launch ``plan`` on ``call``; returns ``call.out`` (written in place)."""
    if plan.path == Path.EMPTY:
        return call.out
    if plan.path == Path.MIXED:  # the decode rows' plan and the chunk rows' (views of call, nothing copied)
        decode, chunk = split_mixed(call, plan.num_decode_seqs)
        if plan.overlap:
            _side_by_side(lambda: run_plan(decode, plan.parts[0]), lambda: run_plan(chunk, plan.parts[1]),
                          call.out.device)
        else:
            run_plan(decode, plan.parts[0])
            run_plan(chunk, plan.parts[1])
        return call.out
    if plan.tiling.num_segments > 1:
        call = with_segment_buffers(call, plan.tiling.num_segments)
    elif plan.tiling.dequant_first and plan.path == Path.PREFILL_2D and call.mode != KVQuantMode.NONE:
        heads = call.num_kv_heads
        per = -(-heads // max(1, plan.tiling.dequant_groups))
        for h in range(0, heads, per):  # each group over its 16-bit scratch (mode NONE), freed before the next
            part = head_group(call, h, min(h + per, heads))
            dequantized = dequantized_call(part, unrotate=plan.tiling.unrotate, int8_keys=plan.tiling.int8_keys,
                                           block_rows=plan.tiling.tile if plan.tiling.tile_blocks else 0)
            _launch(dequantized, plan)
            restore_output(part, dequantized)
        return call.out
    _launch(call, plan)
    if plan.tiling.num_segments > 1:
        reduce_segments(call, plan)
    return call.out


def _launch(call: AttnCall, plan: Plan) -> None:
    try:
        LAUNCHERS[plan.path](call, plan)
    except OutOfResources as e:  # a caller's tiling too large for this GPU: say which, before any output
        raise ValueError(f"{plan.path.value} with {plan.tiling} does not fit this GPU ({e}); use fewer keys per "
                         "tile, KV heads per program or stages") from e
