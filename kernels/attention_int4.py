"""Paged attention straight on INT4 per-token-head caches (rotated nibble codes, SPEC §3, §5).

The query is rotated with the cache's signed Hadamard (``single_rht`` semantics, in the kernel;
on the split-KV decode path in the v3 decode kernel's prologue up to head_size 128 and, above
that, when the grid fills at most half the GPU's resident slots; else, and for the v4 decode
kernel, by a small pre-kernel once per query), ``1/head_size`` is folded into
the softmax scale, scores and values are computed on raw nibble codes with the per-token scale
and zero point applied to the score and probability tiles, and the output is inverse-rotated
once per query row. Causal and non-causal.
"""

from __future__ import annotations

from typing import Optional

from layouts import KVQuantMode

from ._attn_launch import AttnConfig, attend


def unified_attention_int4(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table, softcap,
                           k_scale_cache, v_scale_cache, seq_threshold_3D=None,
                           num_par_softmax_segments=None, softmax_segm_output=None,
                           softmax_segm_max=None, softmax_segm_expsum=None,
                           config: Optional[AttnConfig] = None):
    """Varlen paged attention over an INT4 per-token-head cache; writes ``out`` in place.

    Parameters
    ----------
    q : [num_tokens, num_q_heads, head_size] bf16/fp16, un-rotated queries (any strides).
    k, v : [num_blocks, block_size, num_kv_heads, head_size // 2] uint8 nibble codes of the
        rotated rows, even element in the low nibble; may be strided views of one packed cache
        (``layouts.split_kv_cache``).
    out : [num_tokens, num_q_heads, head_size] bf16/fp16/fp32, written in place (un-rotated).
    cu_seqlens_q : [num_seqs + 1] int32/int64; seqused_k : [num_seqs] int32/int64 context lengths.
    max_seqlen_q, max_seqlen_k : int, host-side bounds (``max_seqlen_q == 1`` is decode).
    softmax_scale : float, applied to ``q . k`` of the *un-rotated* vectors.
    causal : bool; window_size : (left, right), -1 = unbounded; softcap : float, 0 = off.
    block_table : [num_seqs, max_blocks_per_seq] int32/int64.
    k_scale_cache, v_scale_cache : [num_blocks, block_size, num_kv_heads] float32 words whose
        low 4 bits are the zero point.
    seq_threshold_3D, num_par_softmax_segments, softmax_segm_* : split-KV controls and buffers,
        as :func:`kernels.unified_attention`.
    config : AttnConfig, optional; tiling override (benchmarks).

    Returns
    -------
    out
    """
    return attend(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_size, block_table, softcap, KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache,
                  v_scale_cache, seq_threshold_3D=seq_threshold_3D,
                  num_par_softmax_segments=num_par_softmax_segments, segm_output=softmax_segm_output,
                  segm_max=softmax_segm_max, segm_expsum=softmax_segm_expsum, config=config)
