"""kvconnector as a vLLM KV connector (``KVConnectorBase_V1``), loaded by vLLM with
``kv_connector_module_path="kvconnector.integrations.vllm"`` and ``kv_connector="KVConnector"``.

Pieces: :mod:`.cache_layout` (what the engine's cache tensors hold, probed with the engine's own
writer, and copies to/from the packed layout), :mod:`.scheduler` (scheduler-side state and the
``kv_transfer_params`` the decode side receives), :mod:`.worker` (staging, publish, pull,
completion and failure reporting), :mod:`.connector` (the vLLM subclass). Importing this
package does not import vLLM; the class is resolved on first access.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KVConnector":
        from .connector import KVConnector
        return KVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVConnector"]
