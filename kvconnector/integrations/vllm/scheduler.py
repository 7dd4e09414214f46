"""Scheduler side of the vLLM connector: which requests save, which load, and what the decode side gets.

Flow of one disaggregated request (``kv_transfer_params`` travel through the router):

1. The router sends the prompt to the prefill engine with ``{"do_remote_decode": True}`` and
   ``max_tokens=1``. :meth:`SchedulerSide.update_state_after_alloc` marks it for saving; every
   step that computes its prompt tokens puts a :class:`SaveSpec` in the step's metadata, and
   the workers stage each layer's blocks as the layer finishes and publish them under the
   request id once the prompt is complete.
2. :meth:`SchedulerSide.request_finished` keeps the blocks (returns True: the workers report
   the request in ``finished_sending`` when the decode side acknowledged, aborted, or the lease
   ran out) and returns the parameters the decode side needs: endpoint, request id, block
   ids, token count, block size, layout fingerprint, model (:func:`decode_params`).
3. The router sends the prompt to the decode engine with those parameters. The scheduler
   asks :meth:`SchedulerSide.get_num_new_matched_tokens`: the prompt tokens not cached
   locally, loaded asynchronously. After allocation a :class:`LoadSpec` goes to the workers,
   which pull in the background; vLLM keeps the request waiting until the workers report it
   in ``finished_recving`` (with ``failed_recving`` on failure, which vLLM's
   ``kv_load_failure_policy`` turns into a recompute or an error).

Pure Python: requests, block lists and scheduler outputs are duck-typed, so the logic is
testable without vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PARAM_KEYS = ("remote_endpoint", "remote_request_id", "remote_block_ids", "remote_num_tokens",
              "remote_block_size", "layout_fingerprint")


@dataclass
class SaveSpec:
    """One request's prompt tokens computed this step (prefill side)."""

    req_id: str
    block_ids: list          # the request's engine blocks (group 0), in token order
    first_token: int         # tokens already computed before this step
    num_tokens: int          # prompt tokens computed this step
    num_prompt_tokens: int
    stage_from_token: int = 0  # first token whose block is staged: 0 on the request's first step, so
                               # blocks found in the local prefix cache are shipped too

    @property
    def completes_prompt(self) -> bool:
        return self.first_token + self.num_tokens >= self.num_prompt_tokens


@dataclass
class LoadSpec:
    """One request whose prompt blocks are pulled from a prefill worker (decode side)."""

    req_id: str
    params: dict             # the prefill side's kv_transfer_params
    block_ids: list          # local engine blocks, in token order (at least len(remote) of them)
    num_local_blocks: int    # leading blocks already computed locally (prefix cache): not overwritten
    error: str = ""          # what is wrong with ``params`` (:func:`params_error`): the load fails without a pull


@dataclass
class ConnectorMeta:
    """What the scheduler tells the workers for one step (picklable)."""

    saves: list = field(default_factory=list)      # SaveSpec
    loads: list = field(default_factory=list)      # LoadSpec
    delayed: list = field(default_factory=list)    # req ids whose blocks wait for finished_sending
    released: list = field(default_factory=list)   # own req ids whose published blocks are no longer needed
    remote_releases: list = field(default_factory=list)   # prefill params of loads skipped (all cached locally)
    first_steps: dict = field(default_factory=dict)  # loaded req id -> (tokens computed before, tokens computed now)
                                                     # in its first step after the load (what vLLM asked for)


def decode_params(params: dict | None) -> dict | None:
    """The prefill side's parameters when ``params`` ask for a remote prefill, else None."""
    if not params or not params.get("do_remote_prefill"):
        return None
    return params


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def params_error(params: dict, model: str = "", tp_size: int = 0) -> str:
    """What is wrong with remote-prefill ``params`` (from a client or a router), in one line; ''
    when they are well formed and, where both name them, the prefill ran this engine's ``model``
    at its tensor-parallel size ``tp_size`` (decode rank r pulls from prefill rank r).
    Such parameters fail the request's load (vLLM's ``kv_load_failure_policy`` decides) instead
    of raising in vLLM's scheduler, which would end the engine, or of loading another model's KV
    into a cache of the same shape."""
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        return f"kv_transfer_params: missing {', '.join(missing)}"
    endpoint, rid, ids = params["remote_endpoint"], params["remote_request_id"], params["remote_block_ids"]
    tokens, size = params["remote_num_tokens"], params["remote_block_size"]
    if not (isinstance(endpoint, str) and re.fullmatch(r"[a-z]+://\S+:\d{1,5}", endpoint)):
        return f"kv_transfer_params: remote_endpoint: expected 'tcp://host:port', got {endpoint!r:.80}"
    if not (isinstance(rid, str) and rid):
        return f"kv_transfer_params: remote_request_id: expected a non-empty string, got {rid!r:.80}"
    if not (isinstance(ids, list) and ids and all(_is_int(b) and b >= 0 for b in ids)):
        return f"kv_transfer_params: remote_block_ids: expected a non-empty list of block ids, got {ids!r:.80}"
    if not (_is_int(tokens) and tokens > 0):
        return f"kv_transfer_params: remote_num_tokens: expected a positive integer, got {tokens!r:.80}"
    if not (_is_int(size) and size > 0):
        return f"kv_transfer_params: remote_block_size: expected a positive integer, got {size!r:.80}"
    if len(ids) != -(-tokens // size):
        return (f"kv_transfer_params: {len(ids)} remote_block_ids do not hold {tokens} tokens in blocks of "
                f"{size} (expected {-(-tokens // size)})")
    if not isinstance(params["layout_fingerprint"], str):
        return f"kv_transfer_params: layout_fingerprint: expected a string, got {params['layout_fingerprint']!r:.80}"
    remote_model = params.get("remote_model")
    if remote_model is not None and not isinstance(remote_model, str):
        return f"kv_transfer_params: remote_model: expected a string, got {remote_model!r:.80}"
    if model and remote_model and remote_model != model:
        return f"kv_transfer_params: the prefill ran model {remote_model!r:.120}, this engine runs {model!r:.120}"
    remote_tp = params.get("remote_tp_size")
    if remote_tp is not None and not (_is_int(remote_tp) and remote_tp > 0):
        return f"kv_transfer_params: remote_tp_size: expected a positive integer, got {remote_tp!r:.80}"
    if tp_size and remote_tp and remote_tp != tp_size:
        return (f"kv_transfer_params: the prefill runs tensor parallel size {remote_tp}, this engine {tp_size}; "
                f"the connector pulls rank r from rank r, so both engines need the same size")
    return ""


class SchedulerSide:
    """State of the scheduler-side connector.

    Parameters
    ----------
    block_size : int
        Tokens per engine block.
    endpoint : str
        ``tcp://host:port`` that decode workers pull from (this engine's rank-0 worker).
    fingerprint : str
        Layout fingerprint of this engine's wire format, carried in ``kv_transfer_params`` for
        operators and logs (the layouts themselves are checked on both ends by the pull's handshake).
    model : str
        The model this engine runs (vLLM's model name or path, or the ``model_id`` setting):
        sent as ``remote_model`` by a prefill engine; a decode engine refuses KV of another model.
    tp_size : int
        This engine's tensor-parallel size: sent as ``remote_tp_size``; a decode engine of
        another size fails the load at once (no rank would find its peer's heads).
    is_producer, is_consumer : bool
        The engine's ``kv_role``.
    """

    def __init__(self, *, block_size: int, endpoint: str, fingerprint: str = "", model: str = "", tp_size: int = 0,
                 is_producer: bool = True, is_consumer: bool = True) -> None:
        self.block_size, self.endpoint, self.fingerprint, self.model = block_size, endpoint, fingerprint, model
        self.tp_size = tp_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self._saving: dict = {}       # req_id -> request, until its prompt is fully computed
        self._started: set = set()    # req ids with at least one SaveSpec sent
        self._loading: dict = {}      # req_id -> request, until its first step after the load
        self._meta = ConnectorMeta()

    # ---- decode side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = decode_params(request.kv_transfer_params) if self.is_consumer else None
        if params is None:
            return 0, False
        if params_error(params, self.model, self.tp_size):   # claimed: the load fails in the worker, the policy decides
            remote = request.num_prompt_tokens
        else:
            remote = min(params["remote_num_tokens"], request.num_prompt_tokens)
        count = remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids: list, num_hashed_blocks: int,
                                 num_external_tokens: int) -> None:
        """``block_ids``: the request's blocks of group 0 after allocation; ``num_hashed_blocks``:
        how many leading ones are local prefix-cache hits."""
        params = request.kv_transfer_params or {}
        if self.is_producer and params.get("do_remote_decode"):
            self._saving[request.request_id] = request
        remote = decode_params(params) if self.is_consumer else None
        if remote is None:
            return
        params["do_remote_prefill"] = False          # one transfer per request, even if rescheduled
        error = params_error(remote, self.model, self.tp_size)
        if num_external_tokens > 0:
            self._meta.loads.append(LoadSpec(request.request_id, dict(remote), list(block_ids), num_hashed_blocks,
                                             error))
            self._loading[request.request_id] = request
        elif not error:                              # all cached locally: let the prefill side release now
            self._meta.remote_releases.append(dict(remote))

    # ---- prefill side ----------------------------------------------------------------
    def build_meta(self, scheduled: dict, block_ids_of) -> ConnectorMeta:
        """Metadata of one step.

        Parameters
        ----------
        scheduled : dict req_id -> tokens scheduled this step
        block_ids_of : callable(req_id) -> list of the request's block ids (group 0)
        """
        for req_id, request in list(self._saving.items()):
            n = scheduled.get(req_id, 0)
            first = request.num_computed_tokens
            if n <= 0 or first >= request.num_prompt_tokens:
                continue
            n = min(n, request.num_prompt_tokens - first)
            first_step = req_id not in self._started
            self._started.add(req_id)
            spec = SaveSpec(req_id, list(block_ids_of(req_id)), first, n, request.num_prompt_tokens,
                            0 if first_step else first)
            self._meta.saves.append(spec)
            if spec.completes_prompt:
                del self._saving[req_id]
                self._started.discard(req_id)
        for req_id in [r for r in self._loading if scheduled.get(r, 0) > 0]:
            request = self._loading.pop(req_id)
            self._meta.first_steps[req_id] = (request.num_computed_tokens, scheduled[req_id])
        meta, self._meta = self._meta, ConnectorMeta()
        return meta

    def request_finished(self, request, block_ids: list, finished_ok: bool) -> tuple[bool, dict | None]:
        """``finished_ok``: the request stopped or hit its length cap (not aborted)."""
        self._saving.pop(request.request_id, None)
        self._started.discard(request.request_id)
        self._loading.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if not finished_ok or len(block_ids) < num_blocks or request.num_computed_tokens < request.num_prompt_tokens:
            self._meta.released.append(request.request_id)
            return False, None
        self._meta.delayed.append(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_endpoint": self.endpoint, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids[:num_blocks]), "remote_num_tokens": request.num_prompt_tokens,
            "remote_block_size": self.block_size, "layout_fingerprint": self.fingerprint,
            **({"remote_model": self.model} if self.model else {}),
            **({"remote_tp_size": self.tp_size} if self.tp_size else {}),
        }
