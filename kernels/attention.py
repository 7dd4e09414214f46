"""Varlen paged attention over every cache mode, vLLM's ``unified_attention`` argument list.

Paths (picked by :func:`kernels._attn_launch.pick_config`):

- **2D** (prefill and mixed batches): one program per (q tile of one sequence, KV head); the
  q tile packs ``BLOCK_Q`` tokens x the ``GROUP`` query heads of that KV head.
- **split-KV** (decode, ``max_seqlen_q == 1``): the visible keys of each sequence are cut into
  ``num_segments`` segments, one program each, and a reduction kernel merges them. Used when
  the caller passes the segment buffers (vLLM's ``softmax_segm_*``), or when the heuristic
  finds that the 2D grid would leave SMs idle; buffers are then allocated here. Quantized
  caches use the v4 decode kernel there at head_size 64, 128 and 256 (``_attn_decode_v4``:
  one cache block per tile, one warp per KV head; INT4 only from 8k / 32k keys in the batch on)
  and the v3 kernel otherwise (``_attn_decode_v3``: 16-bit code units, one loop per
  row-alignment class, 1-4 warps per program); docs/bench/attention.md.

Modes: NONE (bf16/fp16 cache, dots in the model dtype), INT8 / FP8 per-token-head (codes
converted exactly to fp16 for the dots, per-token scales applied to score columns and folded
into the probability tile), INT4 per-token-head (routed to ``unified_attention_int4``).
FP8_PER_TENSOR is not implemented (LayoutError). ``q_descale``/``k_descale``/``v_descale``
are vLLM's per-tensor fp8 descales: accepted for drop-in compatibility and ignored, since
no supported mode uses per-tensor scales (per-token-head scales live in the cache).
For INT8/FP8 the query is cast to fp16 for the dot: |q| must stay below 65504.
"""

from __future__ import annotations

from typing import Optional

from layouts import KVQuantMode

from ._attn_launch import AttnConfig, attend
from .attention_int4 import unified_attention_int4


def unified_attention(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_size, block_table, softcap, q_descale,
                      k_descale, v_descale, seq_threshold_3D=None, num_par_softmax_segments=None,
                      softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
                      kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None,
                      config: Optional[AttnConfig] = None):
    """Varlen paged attention; writes ``out`` in place and returns it.

    Parameters
    ----------
    q : [num_tokens, num_q_heads, head_size] bf16/fp16 (any strides), CUDA or CPU.
        Sequence ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, its last tokens.
    k, v : [num_blocks, block_size, num_kv_heads, data_head_size]; dtype q's (NONE), int8,
        float8_e4m3fn or uint8 (INT4, ``data_head_size = head_size // 2``). May be strided
        views into one packed cache (``layouts.split_kv_cache``): every stride is honoured.
    out : [num_tokens, num_q_heads, head_size] bf16/fp16/fp32, written in place.
    cu_seqlens_q : [num_seqs + 1] int32/int64.
    seqused_k : [num_seqs] int32/int64, context length of each sequence (its queries included).
    max_seqlen_q, max_seqlen_k : int, host-side bounds; ``max_seqlen_q == 1`` means decode.
    softmax_scale : float.
    causal : bool.
    window_size : (left, right); ``left >= 0`` keeps keys with ``q_pos - k_pos <= left``,
        ``right >= 0`` keeps ``k_pos - q_pos <= right``; -1 = unbounded.
    block_table : [num_seqs, max_blocks_per_seq] int32/int64 physical block ids.
    softcap : float; > 0 applies ``softcap * tanh(s / softcap)`` to the scaled scores.
    q_descale, k_descale, v_descale : ignored (see the module docstring); may be None.
    seq_threshold_3D : int, optional; decode batches with more sequences take the 2D path.
    num_par_softmax_segments : int, optional; segments of the split path.
    softmax_segm_output : [>= num_tokens, num_q_heads, num_segments, head_size_padded] float32
    softmax_segm_max, softmax_segm_expsum : [>= num_tokens, num_q_heads, num_segments] float32
        Contiguous scratch of the split path; ``head_size_padded = max(16, next_pow2(head_size))``.
    kv_quant_mode : KVQuantMode
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32, required for
        the per-token-head modes (strided views of the row tails are fine).
    config : AttnConfig, optional; tiling override (benchmarks, tests).

    Raises
    ------
    LayoutError
        On any shape, dtype, device or mode problem, before anything is launched.
    """
    mode = KVQuantMode(kv_quant_mode)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return unified_attention_int4(
            q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size, block_table, softcap, k_scale_cache, v_scale_cache,
            seq_threshold_3D=seq_threshold_3D, num_par_softmax_segments=num_par_softmax_segments,
            softmax_segm_output=softmax_segm_output, softmax_segm_max=softmax_segm_max,
            softmax_segm_expsum=softmax_segm_expsum, config=config)
    return attend(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_size, block_table, softcap, mode, k_scale_cache, v_scale_cache,
                  seq_threshold_3D=seq_threshold_3D, num_par_softmax_segments=num_par_softmax_segments,
                  segm_output=softmax_segm_output, segm_max=softmax_segm_max,
                  segm_expsum=softmax_segm_expsum, config=config)
