"""The public cache-write functions (names as in vLLM): each asks ``plan.write_plan`` once, then
runs exactly the plan it returns."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from layouts import KVQuantMode, LayoutError

from .int4_fused import launch_int4_fused
from .int4_lanes import launch_int4_lanes
from .offsets import model_dtype_offset
from .plan import WriteArgs, WritePlan, write_plan
from .symmetric import launch_symmetric
from .unquantized import launch_unquantized

LAUNCHERS = {"unquantized": launch_unquantized, "symmetric": launch_symmetric, "int4-mma": launch_int4_lanes,
             "int4-lanes": launch_int4_lanes, "int4-fused": launch_int4_fused}


def run_plan(plan: WritePlan, args: WriteArgs) -> None:
    """Launch ``plan`` (from :func:`~kernels.write.plan.write_plan` on these same tensors)."""
    if plan.shape.num_tokens * plan.shape.num_kv_heads:
        LAUNCHERS[plan.path](plan, args)


def triton_reshape_and_cache_flash_per_token_head_quant(
        key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_quant_mode: KVQuantMode = KVQuantMode.INT8_PER_TOKEN_HEAD, *, check_slots: bool = True,
        shrink: Optional[Sequence[float]] = None, tuning=None, key_offset: Optional[torch.Tensor] = None) -> None:
    """Quantize K/V rows per (token, head) and write codes and inline scales into a paged cache.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU; last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size], written in place
        int8 (INT8), float8_e4m3fn (FP8) or uint8 with ``head_size // 2`` packed codes (INT4);
        separate tensors or the views of one packed cache from ``layouts.split_kv_cache``.
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, written in place
        INT8/FP8: ``scale = max(absmax / QMAX, 1e-6)`` (QMAX 127 / 448); a row holding NaN/Inf
        stores codes 0 and ``NAN_SCALE_BITS`` (a quiet NaN). INT4: see :func:`reshape_and_cache_int4`.
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped (cache left as it was).
    kv_quant_mode : INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD or INT4_PER_TOKEN_HEAD.
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
    shrink : INT4 only, as in :func:`reshape_and_cache_int4`.
    tuning : a ``kernels.write.tuning`` instance (benchmarks and tests; None: the defaults).
    key_offset : INT4 only, as in :func:`reshape_and_cache_int4`.

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride, head-size or slot-range mismatch; nothing is written.
    """
    mode = KVQuantMode(kv_quant_mode)
    if not mode.per_token_head:
        raise LayoutError(f"kv_quant_mode: expected INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD or "
                          f"INT4_PER_TOKEN_HEAD, got {mode.name}")
    plan = write_plan(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, mode,
                      check_slots=check_slots, shrink=shrink, tuning=tuning, key_offset=key_offset)
    run_plan(plan, WriteArgs(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache,
                             model_dtype_offset(key_offset, key.dtype)))


def reshape_and_cache_int4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, *,
                           shrink: Sequence[float] = (1.0,), check_slots: bool = True, tuning=None,
                           key_offset: Optional[torch.Tensor] = None) -> None:
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
    shrink : factors of the zero-inclusive range tried per row, least squared error wins (the MSE
        encoder; same stored format, every reader unchanged); ``(1.0,)`` (default) is the
        vLLM-compatible encoder. The first factor must be 1.0.
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
        The kernel never writes outside the cache either way: unchecked bad slots are skipped.
    tuning : ``LanesTuning``, ``MmaTuning`` or ``FusedTuning`` (benchmarks and tests): that path
        first, with these fields; None: the default path (``plan.write_plan`` says which and why).
    key_offset : [num_kv_heads, head_size] float32 (or bf16/fp16), same device, or None: key
        smoothing. Each key row first loses its head's offset ``m`` (rounded to the model dtype),
        ``RN(k - RN(m))`` (``kernels.reference.smooth_keys``), in the same pass; values are never
        changed. Attention over the cache is unchanged when ``m`` is the same for every key of a
        sequence (``q·(k - m) = q·k - q·m``); readers that want the keys themselves add ``m`` back.

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride, head-size or slot-range mismatch; nothing is written.
    """
    plan = write_plan(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
                      KVQuantMode.INT4_PER_TOKEN_HEAD, check_slots=check_slots, shrink=shrink, tuning=tuning,
                      key_offset=key_offset)
    run_plan(plan, WriteArgs(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache,
                             model_dtype_offset(key_offset, key.dtype)))


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                            check_slots: bool = True, tuning=None) -> None:
    """Write K/V rows unquantized into a bf16/fp16 paged cache.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_size] bf16/fp16, CUDA or CPU; last dim contiguous
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_size] bf16/fp16, written in place
        Cast from the input dtype (round to nearest even) when they differ.
    slot_mapping : [num_tokens] int32/int64; negative slots are skipped (cache left as it was).
    check_slots : check ``max(slot_mapping) < num_blocks * block_size`` first (one device sync).
    tuning : a ``TileTuning`` (benchmarks and tests; None: the defaults).

    Raises
    ------
    LayoutError
        On any shape, dtype, device, stride or slot-range mismatch; nothing is written.
    """
    plan = write_plan(key, value, key_cache, value_cache, None, None, slot_mapping, KVQuantMode.NONE,
                      check_slots=check_slots, tuning=tuning)
    run_plan(plan, WriteArgs(key, value, key_cache, value_cache, slot_mapping, None, None))
