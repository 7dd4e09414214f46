"""The attention side of the oracle: varlen paged attention in plain PyTorch over any cache mode,
by dequantizing the whole cache first (``quant.dequantize_rows``)."""

from __future__ import annotations

import torch

from layouts import KVQuantMode

from .quant import dequantize_rows


def dequantize_cache(key_cache, value_cache, k_scale_cache, v_scale_cache, kv_quant_mode, head_size):
    """Dequantize a whole cache to float32 ``[num_blocks, block_size, num_kv_heads, head_size]`` (K, V).

    INT4 rows are returned in the original (un-rotated) domain.
    """
    mode = KVQuantMode(kv_quant_mode)
    k = dequantize_rows(key_cache, k_scale_cache, mode)
    v = dequantize_rows(value_cache, v_scale_cache, mode)
    assert k.shape[-1] == head_size, (k.shape, head_size)
    return k, v


def reference_unified_attention(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table,
                                softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0,
                                kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None):
    """Varlen paged attention in float32, the oracle of ``kernels.unified_attention``.

    Parameters
    ----------
    q : [num_tokens, num_q_heads, head_size]
        Queries of all sequences, concatenated; sequence ``i`` owns rows
        ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are its *last* tokens.
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, data_head_size]
    cu_seqlens_q : [num_seqs + 1] int
    seqused_k : [num_seqs] int, context length of each sequence (queries included)
    block_table : [num_seqs, max_blocks_per_seq] int
    window_size : (left, right); ``left >= 0`` keeps keys with ``q_pos - k_pos <= left``
    softcap : > 0 applies ``softcap * tanh(s / softcap)`` to the scaled scores

    Returns
    -------
    [num_tokens, num_q_heads, head_size] float32
    """
    head_size = q.shape[-1]
    k_all, v_all = dequantize_cache(key_cache, value_cache, k_scale_cache, v_scale_cache,
                                    kv_quant_mode, head_size)
    block_size, num_kv_heads = k_all.shape[1], k_all.shape[2]
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, kl in enumerate(seqused_k.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        nblk = -(-kl // block_size)
        ids = block_table[i, :nblk].long()
        k = k_all[ids].reshape(-1, num_kv_heads, head_size)[:kl].repeat_interleave(group, dim=1)
        v = v_all[ids].reshape(-1, num_kv_heads, head_size)[:kl].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * softmax_scale
        if softcap and softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(kl - ql, kl, device=q.device)[:, None]
        k_pos = torch.arange(kl, device=q.device)[None, :]
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device)
        if causal:
            mask &= k_pos <= q_pos
        if window_size[0] >= 0:
            mask &= q_pos - k_pos <= window_size[0]
        if window_size[1] >= 0:
            mask &= k_pos - q_pos <= window_size[1]
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key outputs 0
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
    return out
