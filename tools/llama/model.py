"""Plain-PyTorch Llama forward whose attention goes through a paged KV cache.

Two forwards of the same weights:

- :func:`reference_forward`: dense causal attention over the whole sequence, no cache; the
  test oracle of the runner.
- :class:`LlamaRunner`: per layer, K/V rows are written with the project's write kernel into
  a :class:`kernels.paged_cache.PagedKVCache` (any quant mode) and queries attend with the
  paged attention kernel over that cache. Prefill and decode steps are the same call with
  different token counts.

Linear layers, norms and RoPE run in float32; queries, keys and values are rounded to the
cache's model dtype (bf16) where they enter the kernels, and the attention output comes back
in that dtype (what a bf16 serving engine does).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .gguf_reader import LlamaConfig, LlamaWeights

KVHook = Callable[[int, torch.Tensor, torch.Tensor], Optional[tuple]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def rope_tables(config: LlamaConfig, positions: torch.Tensor):
    """cos/sin ``[num_tokens, head_size // 2]`` float32 for the given positions."""
    d = config.head_size
    inv_freq = config.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv_freq.to(positions.device)[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate ``x [num_tokens, num_heads, head_size]`` by position.

    ``interleaved`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (GGUF's Q/K order);
    ``neox`` rotates ``(x[i], x[i + d/2])`` (Hugging Face / vLLM order).
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    if style == "neox":
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    raise ValueError(f"rope style: expected 'interleaved' or 'neox', got {style!r}")


def _qkv(cfg: LlamaConfig, layer: dict, h: torch.Tensor, cos, sin):
    x = rms_norm(h, layer["attn_norm"], cfg.rms_eps)
    n = x.shape[0]
    q = (x @ layer["wq"].T).view(n, cfg.num_q_heads, cfg.head_size)
    k = (x @ layer["wk"].T).view(n, cfg.num_kv_heads, cfg.head_size)
    v = (x @ layer["wv"].T).view(n, cfg.num_kv_heads, cfg.head_size)
    return apply_rope(q, cos, sin, cfg.rope_style), apply_rope(k, cos, sin, cfg.rope_style), v


def _mlp_residual(cfg: LlamaConfig, layer: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + attn.reshape(h.shape[0], -1).float() @ layer["wo"].T
    x = rms_norm(h, layer["ffn_norm"], cfg.rms_eps)
    return h + (torch.nn.functional.silu(x @ layer["w_gate"].T) * (x @ layer["w_up"].T)) @ layer["w_down"].T


def _logits(weights: LlamaWeights, h: torch.Tensor) -> torch.Tensor:
    return rms_norm(h, weights.final_norm, weights.config.rms_eps) @ weights.embedding.T


@torch.no_grad()
def reference_forward(weights: LlamaWeights, token_ids: torch.Tensor,
                      act_dtype: Optional[torch.dtype] = torch.bfloat16, kv_transform=None) -> torch.Tensor:
    """Dense causal forward of one sequence, no cache (the oracle of :class:`LlamaRunner`).

    Parameters
    ----------
    token_ids : [num_tokens] int64
    act_dtype : dtype q/k/v and the attention output are rounded to (as the paged path does
        at the kernel boundary), or None to stay in float32.
    kv_transform : callable, optional
        Applied to each layer's K and V ``[num_tokens, num_kv_heads, head_size]`` float32 before
        attention (e.g. a quantize -> dequantize round trip: "fake quantization").

    Returns
    -------
    [num_tokens, vocab_size] float32 logits
    """
    cfg = weights.config
    n = token_ids.shape[0]
    pos = torch.arange(n, device=token_ids.device)
    cos, sin = rope_tables(cfg, pos)
    group = cfg.num_q_heads // cfg.num_kv_heads
    rnd = (lambda t: t.to(act_dtype).float()) if act_dtype is not None else (lambda t: t)
    mask = torch.ones(n, n, dtype=torch.bool, device=token_ids.device).tril()
    h = weights.embedding[token_ids]
    for layer in weights.layers:
        q, k, v = (rnd(t) for t in _qkv(cfg, layer, h, cos, sin))
        if kv_transform is not None:
            k, v = kv_transform(k), kv_transform(v)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_size ** -0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        h = _mlp_residual(cfg, layer, h, rnd(torch.einsum("hqk,khd->qhd", p, v)))
    return _logits(weights, h)


class LlamaRunner:
    """Runs one sequence through the model, K/V living in a paged cache.

    Parameters
    ----------
    weights : LlamaWeights (float32, on the compute device)
    """

    def __init__(self, weights: LlamaWeights):
        self.weights = weights
        self.config = weights.config

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start: int, cache, block_ids, *,
                all_logits: bool = False, kv_hook: Optional[KVHook] = None,
                progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start ..``: write their K/V, attend, return logits.

        Parameters
        ----------
        token_ids : [num_tokens] int64, on the cache's device
        start : int
            Position of the first token; positions ``< start`` must already be in the cache.
        cache : kernels.paged_cache.PagedKVCache
        block_ids : list of int
            The sequence's blocks, enough for ``start + num_tokens`` tokens.
        all_logits : bool
            Return logits of every token (teacher forcing) instead of the last one only.
        kv_hook : callable(layer_idx, key, value) -> None or (key, value), optional
            Sees each layer's float32 K/V ``[num_tokens, num_kv_heads, head_size]`` before they
            are written; may return replacements (e.g. a fake-quantized variant).
        progress : callable(layer_idx), optional

        Returns
        -------
        [num_tokens or 1, vocab_size] float32 logits
        """
        cfg = self.config
        n = int(token_ids.shape[0])
        dev = token_ids.device
        cos, sin = rope_tables(cfg, torch.arange(start, start + n, device=dev))
        slots = cache.slot_mapping(block_ids, start, n)
        table = cache.block_table(block_ids)
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        seqused = torch.tensor([start + n], dtype=torch.int32, device=dev)
        h = self.weights.embedding[token_ids]
        for i, layer in enumerate(self.weights.layers):
            q, k, v = _qkv(cfg, layer, h, cos, sin)
            if kv_hook is not None:
                repl = kv_hook(i, k, v)
                if repl is not None:
                    k, v = repl
            cache.write(i, k, v, slots)
            attn = cache.attend(i, q, cu, seqused, table, n, start + n)
            h = _mlp_residual(cfg, layer, h, attn)
            if progress is not None:
                progress(i)
        return _logits(self.weights, h if all_logits else h[-1:])

    def generate(self, prompt_len: int, first_token: int, cache, block_ids, max_new_tokens: int,
                 stop_ids=(), on_token: Optional[Callable[[int], None]] = None) -> list[int]:
        """Greedy decode from a cache that already holds ``prompt_len`` tokens.

        ``first_token`` is the token chosen from the prefill logits (not yet in the cache).
        Returns the generated ids, ``first_token`` first; stops early on ``stop_ids``.
        """
        out = [int(first_token)]
        if on_token is not None:
            on_token(out[-1])
        dev = self.weights.embedding.device
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            pos = prompt_len + len(out) - 1
            logits = self.forward(torch.tensor([out[-1]], device=dev), pos, cache, block_ids)
            out.append(int(logits[-1].argmax()))
            if on_token is not None:
                on_token(out[-1])
        return out
