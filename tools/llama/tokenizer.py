"""Tokenizers: SmolLM2's byte-level BPE rebuilt from GGUF metadata, and a byte fallback.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``eos_token_id`` and
``format_chat(user_text) -> str`` (the ChatML form of SmolLM2's template; the synthetic model
has no template and returns the text unchanged).
"""

from __future__ import annotations

from .gguf_reader import TokenizerData

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) with SmolLM2's pre-tokenizer: single digits, then bytes.

    Parameters
    ----------
    data : TokenizerData
        Vocabulary (index = token id), ``"a b"`` merge strings, special-token ids.
    """

    def __init__(self, data: TokenizerData):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {tok: i for i, tok in enumerate(data.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in data.merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(data.tokens[i], special=True, normalized=False)
                                for i in data.special_ids])
        self._tok = tok
        self.vocab_size = len(data.tokens)
        self.eos_token_id = data.eos_token_id
        self.bos_token_id = data.bos_token_id
        # ChatML end-of-turn also ends a reply of the instruct model
        self.stop_ids = {data.eos_token_id} | {vocab[t] for t in ("<|im_end|>",) if t in vocab}
        self.has_chat_template = "<|im_start|>" in vocab

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def format_chat(self, user_text: str, system: str = DEFAULT_SYSTEM) -> str:
        """SmolLM2's chat template with one user turn and the assistant prompt opened."""
        if not self.has_chat_template:
            return user_text
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n")


class ByteTokenizer:
    """One token per UTF-8 byte (ids ``OFFSET .. OFFSET+255``), for the synthetic model."""

    OFFSET = 3  # ids 0..2 stay free for unk / bos / eos, as in SmolLM2's vocabulary

    def __init__(self, vocab_size: int = 49152, bos_token_id: int = 1, eos_token_id: int = 2):
        if vocab_size < self.OFFSET + 256:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_ids = {eos_token_id}
        self.has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # ids outside the byte range (the synthetic model may emit any id) decode to nothing
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def format_chat(self, user_text: str, system: str = DEFAULT_SYSTEM) -> str:
        return user_text
