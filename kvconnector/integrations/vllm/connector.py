"""The vLLM ``KVConnectorBase_V1`` subclass (imports vLLM; loaded by vLLM itself).

Use it with::

    --kv-transfer-config '{"kv_connector": "KVConnector",
                           "kv_connector_module_path": "kvconnector.integrations.vllm",
                           "kv_role": "kv_producer",            # or "kv_consumer"
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"port": 15500}}'

The class delegates to :class:`.scheduler.SchedulerSide` (scheduler process) and
:class:`.worker.WorkerSide` (each worker); see those modules for the flow.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorTransferResults)
from vllm.v1.request import RequestStatus

from .cache_layout import probe_block_map
from .config import connector_config
from .scheduler import ConnectorMeta, SchedulerSide
from .worker import WorkerSide, engine_descriptor

log = logging.getLogger("vllm.kvconnector")  # a child of vLLM's logger: printed with its handlers


class _Meta(ConnectorMeta, KVConnectorMetadata):
    """:class:`ConnectorMeta` as the metadata type vLLM passes from scheduler to workers."""


def _spec(kv_cache_config):
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvconnector: expected one KV cache group (full attention), got {len(groups)}")
    return groups[0].kv_cache_spec, list(groups[0].layer_names)


def _engine_writer(vllm_config, layer_name: str):
    """The engine's own cache writer for one attention layer: ``write(key, value, cache, slots)``."""
    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    impl = layer.impl
    if not hasattr(layer, "isa") and type(impl).__name__ == "CPUAttentionBackendImpl":
        # the CPU metadata builder sets the ISA on each layer; it may not exist yet
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        spec = vllm_config.cache_config
        layer.isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, layer.head_size,
                                  spec.cache_dtype)

    def write(key, value, cache, slots):
        impl.do_kv_cache_update(layer, key, value, cache, slots)
    return write


class KVConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode through kvconnector's ZeroMQ endpoints."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.extra = connector_config({"port": tc.kv_port, **(tc.kv_connector_extra_config or {})})
        spec, self.layer_names = _spec(kv_cache_config)
        self.block_size = spec.block_size
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            host = self.extra["advertise_host"] or self.extra["host"]
            desc = engine_descriptor(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                     head_size=spec.head_size, dtype=spec.dtype, num_layers=len(self.layer_names),
                                     num_blocks=kv_cache_config.num_blocks, tp_size=self.tp_size)
            self.scheduler = SchedulerSide(block_size=spec.block_size,
                                           endpoint=f"tcp://{host}:{self.extra['port']}",
                                           fingerprint=desc.fingerprint(),
                                           model=self.extra["model_id"] or str(vllm_config.model_config.model),
                                           tp_size=self.tp_size,
                                           is_producer=tc.is_kv_producer,
                                           is_consumer=tc.is_kv_consumer)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.worker = WorkerSide(self.extra, is_producer=tc.is_kv_producer, is_consumer=tc.is_kv_consumer,
                                     tp_rank=get_tensor_model_parallel_rank(), tp_size=self.tp_size)
            self._spec = spec

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True      # save_kv_layer runs between layers: it must not be skipped by a graph replay

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = [n for n in self.layer_names if n in kv_caches]
        caches = [kv_caches[n] for n in names]
        first = caches[0]
        for n, c in zip(names, caches):
            if c.shape != first.shape or c.dtype != first.dtype or c.stride() != first.stride():
                raise ValueError(f"kvconnector: layer {n}: expected {tuple(first.shape)} {first.dtype} strides "
                                 f"{first.stride()} like {names[0]}, got {tuple(c.shape)} {c.dtype} {c.stride()}")
        s = self._spec
        bmap = probe_block_map(_engine_writer(self._vllm_config, names[0]), tuple(first.shape), first.dtype,
                               s.block_size, s.num_kv_heads, s.head_size, device=first.device,
                               strides=tuple(first.stride()))
        log.info("kvconnector: engine cache %s %s, block interior %s", tuple(first.shape), first.dtype, bmap.name)
        self.worker.register(caches, names, bmap, first.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if meta.loads or meta.first_steps:
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None      # loads are asynchronous: a request runs only after its blocks landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_layer(layer_name, kv_layer, self._get_connector_metadata())

    def wait_for_save(self):
        if self.has_connector_metadata():
            self.worker.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()     # failures are reported per request (failed_recving), never as partial blocks

    def shutdown(self):
        if self.worker is not None:
            self.worker.close()

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return (0,)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        group = blocks.blocks[0] if blocks.blocks else []
        ids = [b.block_id for b in group]
        hashed = 0
        for b in group:        # leading local prefix-cache hits
            if b.block_hash is None:
                break
            hashed += 1
        self.scheduler.update_state_after_alloc(request, ids, hashed, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        meta = self.scheduler.build_meta(dict(scheduler_output.num_scheduled_tokens),
                                         lambda rid: manager.get_block_ids(rid)[0])
        out = _Meta()
        out.__dict__.update(meta.__dict__)
        return out

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self.scheduler.request_finished(request, list(block_ids), ok)
