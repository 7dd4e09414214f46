"""The public entry points: :func:`unified_attention` (vLLM's argument list, every cache mode),
:func:`unified_attention_int4` (INT4 caches) and :func:`attention_plan` (the same arguments: what
would run, launched nothing).

Every call is validated once (``call.make_call``), planned once (``plan.plan_call``) and run as
planned (``run.run_plan``). Modes: NONE (bf16/fp16 cache, dots in the model dtype), INT8 / FP8
per-token-head (codes converted exactly to fp16 for the dots, per-token scales applied to score
columns and folded into the probability tile), INT4 per-token-head (rotated nibble codes: the
query is rotated with the cache's signed Hadamard, ``1/head_size`` folded into the softmax
scale, scores and values computed on raw codes with the per-token scale and zero point applied
to the score and probability tiles, the output inverse-rotated once per query row).
FP8_PER_TENSOR is not implemented (LayoutError). ``q_descale``/``k_descale``/``v_descale`` are
vLLM's per-tensor fp8 descales: accepted for drop-in compatibility and ignored, since no
supported mode uses per-tensor scales (per-token-head scales live in the cache). For INT8/FP8
the query is cast to fp16 for the dot: |q| must stay below 65504.
"""

from __future__ import annotations

from typing import Optional

from layouts import KVQuantMode

from .call import make_call
from .plan import DeviceFacts, Plan, Tuning, plan_call
from .run import run_plan


def _planned(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
             block_table, softcap, seq_threshold_3D, num_par_softmax_segments, softmax_segm_output, softmax_segm_max,
             softmax_segm_expsum, kv_quant_mode, k_scale_cache, v_scale_cache, tuning, device, num_decode_seqs):
    call = make_call(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_size, block_table, softcap, kv_quant_mode, k_scale_cache, v_scale_cache,
                     softmax_segm_output, softmax_segm_max, softmax_segm_expsum)
    return call, plan_call(call, seq_threshold_3D=seq_threshold_3D, num_segments=num_par_softmax_segments,
                           tuning=tuning, facts=device, num_decode_seqs=num_decode_seqs)


def unified_attention(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_size, block_table, softcap, q_descale,
                      k_descale, v_descale, seq_threshold_3D=None, num_par_softmax_segments=None,
                      softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
                      kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None, *,
                      tuning: Optional[Tuning] = None, num_decode_seqs: Optional[int] = None):
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
    tuning : Tuning, optional; the planner's settings (benchmarks, tests; default ``Tuning()``).
    num_decode_seqs : int, optional; sequences ``[0, num_decode_seqs)`` have one query token
        each and come first (as vLLM orders a batch; known on the host). A mixed batch then runs
        its decode rows through the decode kernels and the rest through the 2D kernel, back to
        back, on views of q / out (no copy, no device sync). None: one plan for the whole batch.
        Must be in ``[0, num_seqs]`` (LayoutError).

    Raises
    ------
    LayoutError
        On any shape, dtype, device or mode problem, before anything is launched.
    """
    call, plan = _planned(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          window_size, block_table, softcap, seq_threshold_3D, num_par_softmax_segments,
                          softmax_segm_output, softmax_segm_max, softmax_segm_expsum, kv_quant_mode, k_scale_cache,
                          v_scale_cache, tuning, None, num_decode_seqs)
    return run_plan(call, plan)


def attention_plan(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, block_table, softcap, q_descale=None,
                   k_descale=None, v_descale=None, seq_threshold_3D=None, num_par_softmax_segments=None,
                   softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
                   kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None, *,
                   tuning: Optional[Tuning] = None, device: Optional[DeviceFacts] = None,
                   num_decode_seqs: Optional[int] = None) -> Plan:
    """The :class:`Plan` that :func:`unified_attention` runs for these arguments (validated the
    same way, LayoutError alike); launches nothing. ``device``: the facts to plan for (e.g.
    ``kernels.attention.H200`` with CPU tensors) instead of the tensors' device; only
    ``q``/``k``/``v``/scale views' shapes, strides and addresses are read, never their values.
    On a real CUDA device the first plan of a Gluon kernel compiles it once (``gluon_probe``).

    Returns
    -------
    Plan
        ``path`` (the kernel: ``Path`` names its file), ``tiling``, the INT4 query rotation, the
        reduction, PDL, bulk copies and ``why`` in words; a mixed batch (``num_decode_seqs``):
        path ``mixed`` and ``parts`` = (the decode rows' plan, the chunk rows' plan).
    """
    return _planned(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_size, block_table, softcap, seq_threshold_3D, num_par_softmax_segments, softmax_segm_output,
                    softmax_segm_max, softmax_segm_expsum, kv_quant_mode, k_scale_cache, v_scale_cache, tuning,
                    device, num_decode_seqs)[1]


def unified_attention_int4(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table, softcap,
                           k_scale_cache, v_scale_cache, seq_threshold_3D=None,
                           num_par_softmax_segments=None, softmax_segm_output=None,
                           softmax_segm_max=None, softmax_segm_expsum=None, *,
                           tuning: Optional[Tuning] = None, num_decode_seqs: Optional[int] = None):
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
    tuning, num_decode_seqs : optional; as :func:`unified_attention`.

    Returns
    -------
    out
    """
    return unified_attention(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                             causal, window_size, block_table, softcap, None, None, None, seq_threshold_3D,
                             num_par_softmax_segments, softmax_segm_output, softmax_segm_max, softmax_segm_expsum,
                             KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache, v_scale_cache, tuning=tuning,
                             num_decode_seqs=num_decode_seqs)
