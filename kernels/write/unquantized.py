"""The unquantized writer (path ``unquantized``): K/V rows copied into a bf16/fp16 paged cache.

Rows are cast to the cache dtype when it differs from the input's (round to nearest even, the
same on the GPU and in the interpreter). Oracle: ``kernels.reference.reference_reshape_and_cache``
with ``KVQuantMode.NONE``.
"""

from __future__ import annotations

import triton.language as tl

from .._jit import dual_jit, next_pow2
from .checks import stride_args
from .device_math import tile_rows, to_model_dtype
from .plan import WriteArgs, WritePlan, launch


@dual_jit
def _reshape_and_cache_flash_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_kv_heads, HEAD_SIZE] bf16/fp16
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_SIZE] bf16/fp16
    slot_mapping_ptr,                # [num_tokens] int32/int64, negative = skip
    num_rows, num_slots,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_kv_heads, ROWS),)``: one program copies ROWS (token, head)
    rows of K and V into their slots, casting to the cache dtype (round to nearest even)."""
    mask, token, head, blk, off = tile_rows(tl.program_id(0), num_rows, slot_mapping_ptr, num_slots,
                                            ROWS, NUM_KV_HEADS, BLOCK_SIZE)
    xk = token * stride_key_token + head * stride_key_head
    xv = token * stride_value_token + head * stride_value_head
    kc = blk * stride_kc_block + off * stride_kc_slot + head * stride_kc_head
    vc = blk * stride_vc_block + off * stride_vc_slot + head * stride_vc_head
    cols = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (cols[None, :] < HEAD_SIZE)
    # k, v: [ROWS, BLOCK_D]
    k = tl.load(key_ptr + xk[:, None] + cols[None, :], mask=m2)
    v = tl.load(value_ptr + xv[:, None] + cols[None, :], mask=m2)
    dtype = key_cache_ptr.dtype.element_ty
    if k.dtype != dtype:
        k = to_model_dtype(k.to(tl.float32), dtype, INTERPRET)
        v = to_model_dtype(v.to(tl.float32), dtype, INTERPRET)
    tl.store(key_cache_ptr + kc[:, None] + cols[None, :], k, mask=m2)
    tl.store(value_cache_ptr + vc[:, None] + cols[None, :], v, mask=m2)


def launch_unquantized(plan: WritePlan, t: WriteArgs) -> None:
    """Run an ``unquantized`` plan on ``t`` (validated by :func:`~kernels.write.plan.write_plan`)."""
    shape, tuning = plan.shape, plan.tuning
    launch(_reshape_and_cache_flash_kernel, plan.grid, dict(
        key_ptr=t.key, value_ptr=t.value, key_cache_ptr=t.key_cache, value_cache_ptr=t.value_cache,
        slot_mapping_ptr=t.slot_mapping,
        num_rows=shape.num_tokens * shape.num_kv_heads, num_slots=shape.num_blocks * shape.block_size,
        **stride_args(t),
        ROWS=tuning.rows, HEAD_SIZE=shape.head_size, BLOCK_D=next_pow2(shape.head_size),
        INTERPRET=plan.interpret, NUM_KV_HEADS=shape.num_kv_heads, BLOCK_SIZE=shape.block_size,
        num_warps=tuning.num_warps))
