"""Worker side of the vLLM connector: stage layers as they finish, publish, pull, report.

Each worker keeps a *staging* cache in the project's packed layout (one tensor per layer, as
many blocks as the engine, block ``b`` of staging standing for engine block ``b``), described
by a truthful :class:`layouts.LayoutDescriptor`. The endpoints only ever see staging caches, so
the handshake compares real layouts on both ends, whatever order the engine keeps its blocks in
(:mod:`.cache_layout` finds that order with the engine's own writer).

Prefill (``kv_producer``): ``save_kv_layer`` copies the blocks the step wrote, for that layer
only, from the engine tensor into staging while the later layers still compute; when the
prompt is complete the blocks are published under the request id (a lease). The lease ends
when the decode side ACKs, ABORTs or it expires; only then is the request reported in
``finished_sending`` so vLLM frees its blocks (block ``b`` of staging is reused only after
engine block ``b`` is).

Decode (``kv_consumer``): each load is pulled into staging on a background thread (handshake,
pull with a deadline), then copied into the engine's blocks in the engine's order; the request
is reported in ``finished_recving`` when that is done, and also in ``failed_recving`` when the
pull failed (layout mismatch, dead or silent peer, deadline, corrupt frame): vLLM's
``kv_load_failure_policy`` then recomputes the prompt or fails the request. Nothing waits
without a deadline, and a failed load never leaves partial bytes that vLLM would trust.

With ``frame_ops`` in the config (``"kernels.transfer.FRAME_OPS"``) both endpoints get the
device kernels: blocks are gathered and checksummed (``mix64``) and verified + scattered on the
caches' device instead of hashed and copied on the host (docs/PROTOCOL.md, "Checksums").
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvconnector.decode import DecodeEndpoint
from kvconnector.prefill import PrefillEndpoint
from kvconnector.security import keys_from_config
from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor, LayoutError, TransferTimeoutError
from .cache_layout import BlockMap, gather_packed, scatter_packed
from .config import connector_config
from .scheduler import ConnectorMeta

log = logging.getLogger("vllm.kvconnector")  # a child of vLLM's logger: printed with its handlers


def engine_descriptor(*, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, num_layers: int,
                      num_blocks: int, tp_rank: int = 0, tp_size: int = 1) -> LayoutDescriptor:
    """Descriptor of the staging cache that mirrors an unquantized engine cache (one TP rank)."""
    geo = CacheGeometry(KVQuantMode.NONE, head_size, num_kv_heads, block_size, dtype)
    return LayoutDescriptor.from_geometry(geo, num_layers=num_layers, num_blocks=num_blocks,
                                          head_start=tp_rank * num_kv_heads, total_num_kv_heads=tp_size * num_kv_heads)


def _span(d: LayoutDescriptor) -> str:
    return f"[{d.head_start}, {d.head_start + d.num_kv_heads}) of {d.total_num_kv_heads}"


def rank_endpoint(endpoint: str, tp_rank: int) -> str:
    """The prefill endpoint of tensor-parallel rank ``tp_rank``: rank r binds ``port + r``, and decode
    rank r pulls from prefill rank r (both engines must use the same tensor parallelism; the
    handshake refuses other head ranges)."""
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + tp_rank}"


def frame_ops_from_config(name) -> object | None:
    """The device frame kernels named by ``kv_connector_extra_config["frame_ops"]``: a dotted
    ``module.attribute`` (``"kernels.transfer.FRAME_OPS"``), or None when not set. The
    connector never imports kernels by itself; this is how a vLLM deployment passes them.
    Raises ValueError naming the key when the name cannot be loaded."""
    if not name:
        return None
    module, _, attr = str(name).rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"kv_connector_extra_config 'frame_ops': cannot load {name!r} "
                         f"({type(e).__name__}: {e})") from e


class Stats:
    """Counters and per-request timings; also appended as JSON lines to ``path`` when given
    (tests and operators read them: ``{"event": ..., "req": ..., "t": wall time, ...}``)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.counts, self._lock = path, {}, threading.Lock()

    def event(self, name: str, **fields) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"event": name, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


class WorkerSide:
    """Worker-side state; see the module docstring.

    Parameters
    ----------
    config : dict
        ``kv_connector_extra_config``: ``host`` (bind, default 127.0.0.1), ``port`` (prefill
        rank 0; rank r binds ``port + r``), ``lease_s`` (30), ``pull_deadline_s`` (10),
        ``handshake_s`` (3), ``peer_timeout_s`` (3), ``stats_path`` (optional JSON lines file),
        ``curve`` (optional ZeroMQ CURVE keys, see :func:`kvconnector.security.keys_from_config`:
        prefill ``{"secret_file", "authorized"}``, decode ``{"secret_file", "server_key"}``),
        ``frame_ops`` (optional: the dotted name of the device frame kernels, see
        :func:`frame_ops_from_config`), ``data_plane`` (``"zmq"``, the default, or ``"nixl"``
        where the nixl package is installed on both sides: :mod:`kvconnector.dataplane`) and
        ``nixl_region_mb`` (decode side, 256: its NIXL receive region), ``lanes`` (optional:
        connections BLOCKS travel over, both sides; default: the endpoints', docs/PROTOCOL.md "Lanes").
    is_producer, is_consumer : bool
    """

    def __init__(self, config: dict, *, is_producer: bool, is_consumer: bool, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.config = connector_config(config)
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.stats = Stats(self.config["stats_path"])
        self.frame_ops = frame_ops_from_config(self.config["frame_ops"])
        self.data_plane = self.config["data_plane"]
        self.prefill: PrefillEndpoint | None = None
        self._decoders: dict = {}                 # remote endpoint -> DecodeEndpoint
        self._decoders_lock = threading.Lock()
        self._in_use: dict = {}                   # remote endpoint -> loads using its DecodeEndpoint now
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvc-vllm-load") if is_consumer else None
        self._loads: dict = {}                    # req_id -> Future
        self._lock = threading.Lock()
        self._ended: dict = {}                    # req_id -> lease end reason (I/O thread)
        self._published: set = set()
        self._delayed: set = set()
        self._finished_seen: set = set()
        self._first_layer_t: dict = {}    # req_id -> wall time its first layer was staged
        self._last_layer_t: dict = {}     # req_id -> wall time its last layer was staged
        self._errors_seen = 0
        self._stage_s: dict = {}          # req_id -> seconds spent staging its layers (inside the forward)

    # ---- registration ------------------------------------------------------------------
    def register(self, caches: list, layer_names: list, bmap: BlockMap, dtype: torch.dtype) -> None:
        """``caches``: the engine's per-layer tensors in layer order; ``bmap``: their block order."""
        self.caches, self.bmap = caches, bmap
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        num_blocks = int(caches[0].shape[0])
        self.descriptor = engine_descriptor(block_size=bmap.block_size, num_kv_heads=bmap.num_kv_heads,
                                            head_size=bmap.head_size, dtype=dtype, num_layers=len(caches),
                                            num_blocks=num_blocks, tp_rank=self.tp_rank, tp_size=self.tp_size)
        geo = self.descriptor.geometry()
        # untouched until a block is staged or pulled (no zero fill: only published / pulled blocks are read)
        flat = torch.empty((len(caches), *geo.shape(num_blocks)), dtype=geo.storage_dtype, device=caches[0].device)
        self.staging = list(flat.unbind(0))
        self.stats.event("registered", layout=bmap.name, fingerprint=self.descriptor.fingerprint(),
                         num_blocks=num_blocks, num_layers=len(caches))
        if self.is_producer:
            self.prefill = PrefillEndpoint(self.staging, self.descriptor, host=self.config["host"],
                                           port=self.config["port"] + (self.tp_rank if self.config["port"] else 0),
                                           on_release=self._on_release, lease_s=self.config["lease_s"],
                                           peer_timeout_s=self.config["peer_timeout_s"],
                                           curve=keys_from_config(self.config["curve"], "server"),
                                           frame_ops=self.frame_ops, data_plane=self.data_plane,
                                           **self._lanes())
            log.info("kvconnector prefill endpoint %s, layout %s, fingerprint %s",
                     self.prefill.endpoint, bmap.name, self.descriptor.fingerprint())

    def _lanes(self) -> dict:
        """The endpoints' ``lanes`` keyword when the config sets one (else their defaults)."""
        return {} if self.config["lanes"] is None else {"lanes": self.config["lanes"]}

    # ---- prefill side ------------------------------------------------------------------
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: ConnectorMeta) -> None:
        if not meta.saves or self.prefill is None:
            return
        idx = self.layer_index.get(layer_name)
        if idx is None:
            return
        n = self.bmap.block_size
        t0 = time.perf_counter()
        for s in meta.saves:
            first_pos, last_pos = s.stage_from_token // n, (s.first_token + s.num_tokens - 1) // n
            ids = s.block_ids[first_pos:last_pos + 1]
            gather_packed(kv_layer, self.bmap, ids, self.staging[idx], ids)
            if idx == 0:
                self._first_layer_t.setdefault(s.req_id, time.time())
            if idx == len(self.caches) - 1:
                self._last_layer_t[s.req_id] = time.time()
        if meta.saves:    # staging time of this layer, shared by the step's requests
            dt = (time.perf_counter() - t0) / len(meta.saves)
            for s in meta.saves:
                self._stage_s[s.req_id] = self._stage_s.get(s.req_id, 0.0) + dt

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        if self.prefill is not None:
            if self.staging[0].is_cuda and any(s.completes_prompt for s in meta.saves):
                # the staging copies were queued on the engine's stream: they must be done before a
                # peer can read the blocks (the endpoint's copy stream does not know that stream)
                torch.cuda.current_stream(self.staging[0].device).synchronize()
            for s in meta.saves:
                if s.completes_prompt:
                    ids = s.block_ids[:-(-s.num_prompt_tokens // self.bmap.block_size)]
                    try:
                        self.prefill.publish(s.req_id, ids)
                    except ValueError as e:   # e.g. published already: never fail vLLM's step for it
                        self._forget_staging(s.req_id)
                        self.stats.event("publish_failed", req=s.req_id, error=f"{type(e).__name__}: {e}")
                        log.warning("kvconnector: cannot publish %s: %s", s.req_id, e)
                        continue
                    self._published.add(s.req_id)
                    self.stats.event("published", req=s.req_id, blocks=len(ids), tokens=s.num_prompt_tokens,
                                     **self._forget_staging(s.req_id))
            for rid in meta.released:
                self._forget_staging(rid)    # e.g. aborted before its prompt was complete
                if rid in self._published:
                    # start the release and go on: vLLM frees the blocks once ``on_release`` has
                    # run (get_finished), so the step never waits for a transfer still reading them
                    try:
                        self.prefill.release(rid, timeout_s=0.05)
                    except TransferTimeoutError:
                        self.stats.event("release_pending", req=rid)
                    with self._lock:         # never reported in finished_sending: vLLM did not delay it
                        self._published.discard(rid)
            self._delayed.update(meta.delayed)
        for params in meta.remote_releases:      # loads skipped: tell the prefill side now
            ep = self._decoders.get(rank_endpoint(params["remote_endpoint"], self.tp_rank))
            if ep is not None:
                ep.abort(params["remote_request_id"])

    def _forget_staging(self, req_id: str) -> dict:
        """Drop (and return) what :meth:`save_layer` recorded for ``req_id``'s staging."""
        return {"t_first_layer": self._first_layer_t.pop(req_id, None),
                "t_last_layer": self._last_layer_t.pop(req_id, None), "stage_s": self._stage_s.pop(req_id, 0.0)}

    def _on_release(self, tid: str, block_ids, reason: str) -> None:
        with self._lock:
            self._ended[tid] = reason
        self.stats.event("lease_end", req=tid, reason=reason)

    # ---- decode side -------------------------------------------------------------------
    def start_load(self, meta: ConnectorMeta) -> None:
        for rid, (before, now) in meta.first_steps.items():
            self.stats.event("first_step", req=rid, computed_before=before, computed_now=now)
        for spec in meta.loads:
            self._loads[spec.req_id] = self._pool.submit(self._load, spec)

    def _decoder(self, endpoint: str) -> DecodeEndpoint:
        """The decode endpoint connected to ``endpoint`` (connected now if there is none), in use
        until :meth:`_done_with`. Endpoints not in use whose prefill has been silent for
        ``peer_timeout_s`` (gone, or moved to another address) are closed first, so a decode worker
        does not keep a socket, threads and reconnect attempts for every prefill address it ever
        pulled from."""
        with self._decoders_lock:
            gone = [a for a, ep in self._decoders.items()
                    if not self._in_use.get(a) and ep.peer_silent_s() > self.config["peer_timeout_s"]]
            closing = [self._decoders.pop(a) for a in gone]
        for old in closing:
            old.close()
        if closing:
            self.stats.event("decoders_closed", endpoints=gone)
        with self._decoders_lock:
            ep = self._decoders.get(endpoint)
            if ep is not None:
                self._in_use[endpoint] = self._in_use.get(endpoint, 0) + 1
                return ep
            ep = DecodeEndpoint(self.staging, self.descriptor,
                                peer_timeout_s=self.config["peer_timeout_s"],
                                curve=keys_from_config(self.config["curve"], "client"), frame_ops=self.frame_ops,
                                data_plane=self.data_plane,
                                nixl_region_bytes=self.config["nixl_region_mb"] << 20, **self._lanes())
            try:
                ep.connect(endpoint, timeout_s=self.config["handshake_s"])
            except BaseException:
                ep.close()
                raise
            self._decoders[endpoint] = ep
            self._in_use[endpoint] = self._in_use.get(endpoint, 0) + 1
            return ep

    def _done_with(self, endpoint: str) -> None:
        with self._decoders_lock:
            n = self._in_use.pop(endpoint, 0) - 1
            if n > 0:
                self._in_use[endpoint] = n

    def _drop_decoder(self, endpoint: str) -> None:
        with self._decoders_lock:
            ep = self._decoders.pop(endpoint, None)
        if ep is not None:
            ep.close()

    def _load(self, spec) -> dict:
        if spec.error:                # malformed kv_transfer_params: failed before any connection
            raise ValueError(spec.error)
        p = spec.params
        remote_ids = list(p["remote_block_ids"])
        dst = spec.block_ids[:len(remote_ids)]
        t0 = time.time()
        deadline = self.config["pull_deadline_s"]
        endpoint = rank_endpoint(p["remote_endpoint"], self.tp_rank)
        ep = self._decoder(endpoint)
        try:
            d = self.descriptor
            if ep.shared_heads != range(d.head_start, d.head_start + d.num_kv_heads):
                raise LayoutError(f"prefill {endpoint} holds KV heads {_span(ep.remote)}, this worker needs "
                                  f"{_span(d)}: both engines need the same tensor parallelism")
            handle = ep.pull(p["remote_request_id"], dst, deadline_s=deadline)
            result = handle.result(timeout=deadline + 5.0)
        except TimeoutError:          # TransferTimeoutError too: a dead or silent peer, reconnect next time
            self._drop_decoder(endpoint)
            raise
        finally:
            self._done_with(endpoint)
        keep = [i for i in range(len(dst)) if i >= spec.num_local_blocks]
        if keep:
            ids = [dst[i] for i in keep]
            for layer, engine in enumerate(self.caches):
                scatter_packed(self.staging[layer], self.bmap, ids, engine, ids)
            if self.caches[0].is_cuda:    # done before vLLM is told the blocks are there
                torch.cuda.current_stream(self.caches[0].device).synchronize()
        return {"bytes": result.nbytes, "blocks": len(keep), "t_start": t0, "t_ready": time.time(),
                "checksum": ep.checksum, "plane": ep.plane,
                "tokens": min(int(p["remote_num_tokens"]), len(dst) * self.bmap.block_size)
                - spec.num_local_blocks * self.bmap.block_size}

    # ---- both --------------------------------------------------------------------------
    def transfer_results(self, finished_req_ids) -> tuple[set, set, set]:
        """``(finished_sending, finished_recving, failed_recving)`` for this step."""
        self._finished_seen.update(finished_req_ids or ())
        sending = set()
        with self._lock:
            for rid in list(self._delayed):
                if rid in self._finished_seen and (rid in self._ended or rid not in self._published):
                    sending.add(rid)
                    self._delayed.discard(rid)
                    self._finished_seen.discard(rid)
                    self._published.discard(rid)
                    self._ended.pop(rid, None)
            for rid in [r for r in self._ended if r not in self._delayed and r not in self._published]:
                del self._ended[rid]         # a released request's lease end: nobody waits for it
        if self.prefill is not None:      # refusals and bad frames the endpoint recorded
            errors, total = self.prefill.errors.since(self._errors_seen)
            if total - self._errors_seen > len(errors):
                log.warning("kvconnector prefill endpoint: %d more errors, not kept",
                            total - self._errors_seen - len(errors))
            for e in errors:
                self.stats.event("endpoint_error", error=f"{type(e).__name__}: {e}")
                log.warning("kvconnector prefill endpoint: %s: %s", type(e).__name__, e)
            self._errors_seen = total
        recving, failed = set(), set()
        for rid, fut in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[rid]
            recving.add(rid)
            err = fut.exception()
            if err is None:
                r = fut.result()
                self.stats.event("loaded", req=rid, **r)
            else:
                failed.add(rid)
                self.stats.event("load_failed", req=rid, error=f"{type(err).__name__}: {err}")
                log.warning("kvconnector: load of %s failed (%s: %s); vLLM's kv_load_failure_policy decides",
                            rid, type(err).__name__, err)
        self._finished_seen -= {r for r in self._finished_seen if r not in self._delayed and r not in self._published}
        return sending, recving, failed

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
        for ep in list(self._decoders.values()):
            ep.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
