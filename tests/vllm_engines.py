"""Real vLLM engines in child processes, driven over a pipe (used by tests/test_vllm_*.py).

Each :class:`EngineProc` runs one offline ``vllm.LLM`` (engine core in the same process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with kvconnector as its KV connector, and answers
``generate`` commands with, per prompt, the generated token ids, vLLM's ``num_cached_tokens``
and the ``kv_transfer_params`` the request returned. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import time

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A TCP port free now for the prefill engine to bind about 30 s later, chosen below the
    kernel's ephemeral range: ports of outgoing connections and port-0 binds (vLLM's own sockets
    in the engines starting meanwhile) come from that range, so none of them can take it first.
    A port from the range itself (a port-0 bind) was once taken so ("Address already in use")."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low > 4096:
        for port in random.sample(range(max(2048, low - 10000), low), 100):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no such range known: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(conn, model_dir: str, role: str, block_size: int, extra: dict, policy: str, prefix_caching: bool,
           env: dict, max_num_batched_tokens: int = 1024) -> None:
    os.environ.update(env)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    tc = KVTransferConfig(kv_connector="KVConnector", kv_connector_module_path="kvconnector.integrations.vllm",
                          kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy)
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=1024, enforce_eager=True, block_size=block_size,
              max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching, kv_transfer_config=tc,
              seed=0)
    conn.send(("ready", None))
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "churn":
            conn.send(("ok", _churn(llm, *args)))
            continue
        prompts, params, max_tokens = args
        sps = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              extra_args={"kv_transfer_params": p} if p is not None else None) for p in params]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        conn.send(("ok", [(list(o.outputs[0].token_ids), o.num_cached_tokens, o.kv_transfer_params,
                           o.outputs[0].finish_reason) for o in outs]))
    conn.send(("bye", None))


def _churn(llm, prompts: list, params: list, seed: int, settle_s: float) -> dict:
    """Every prompt with its ``kv_transfer_params`` (half with ``max_tokens`` 1, half 50), the
    engine stepped by hand; after each step an unfinished request is aborted with probability 0.3
    while its prompt is partly computed or waits for its load, and after its prompt is computed. Then the engine idles ``settle_s`` (leases nobody pulls expire, loads end). Returns
    vLLM's free blocks before and after, its requests left, the aborts, the worker connector's
    per-request state sizes, its event counts, the ``kv_transfer_params`` finished requests
    returned (by prompt index) and (prefill) the leases it holds."""
    import random

    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    worker = get_kv_transfer_group().worker
    free_start = pool.get_num_free_blocks()
    for i, (p, kv) in enumerate(zip(prompts, params)):
        sp = SamplingParams(temperature=0.0, max_tokens=1 if i % 2 else 50, extra_args={"kv_transfer_params": kv})
        eng.add_request(f"c{i}", {"prompt_token_ids": p}, sp)
    aborted, returned = {"before": 0, "after": 0}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.kv_transfer_params:
                returned[int(out.request_id[1:])] = out.kv_transfer_params
        ids = []
        for r in list(core.scheduler.requests.values()):
            if r.is_finished():
                continue
            kind = ("before" if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    or 0 < r.num_computed_tokens < r.num_prompt_tokens
                    else "after" if r.num_computed_tokens >= r.num_prompt_tokens else None)
            if kind and rng.random() < 0.3:
                ids.append(r.request_id)
                aborted[kind] += 1
        if ids:
            eng.abort_request(ids, internal=True)
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        core.step()                  # the connector reports ended leases and loads; vLLM frees their blocks
        time.sleep(0.1)
    state = {k: len(getattr(worker, k, ())) for k in ("_published", "_ended", "_finished_seen", "_delayed", "_stage_s",
                                                  "_first_layer_t", "_last_layer_t", "_loads", "_in_use")}
    return {"free_start": free_start, "free_end": pool.get_num_free_blocks(), "requests": len(core.scheduler.requests),
            "aborted": aborted, "state": state, "counts": dict(worker.stats.counts), "params": returned,
            "held": worker.prefill.held() if worker.prefill is not None else []}


class EngineProc:
    """One vLLM engine in a spawned process.

    Parameters
    ----------
    role : "kv_producer" or "kv_consumer"
    extra : the connector's ``kv_connector_extra_config``
    policy : vLLM's ``kv_load_failure_policy`` ("recompute" or "fail")
    prefix_caching : vLLM's ``enable_prefix_caching``
    max_num_batched_tokens : vLLM's token budget per step (a longer prompt is computed in chunks)
    """

    def __init__(self, model_dir: str, role: str, *, block_size: int = 32, extra: dict | None = None,
                 policy: str = "recompute", prefix_caching: bool = False, start_timeout_s: float = 420.0,
                 max_num_batched_tokens: int = 1024) -> None:
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        ctx = mp.get_context("spawn")
        self.model_dir = model_dir
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, model_dir, role, block_size, extra or {}, policy, prefix_caching, env,
                                      max_num_batched_tokens),
                                daemon=True)
        self.proc.start()
        self.start_timeout_s = start_timeout_s

    def wait_ready(self) -> None:
        self._recv(self.start_timeout_s, "ready")

    def _recv(self, timeout_s: float, want: str):
        end = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self.proc.exitcode}")
            if time.monotonic() > end:
                raise TimeoutError(f"engine: no {want!r} within {timeout_s} s")
        try:
            kind, payload = self.conn.recv()
        except EOFError:             # the process ended (its error went to stderr)
            self.proc.join(10)
            raise RuntimeError(f"engine process exited with code {self.proc.exitcode}") from None
        if kind != want:
            raise RuntimeError(f"engine: expected {want!r}, got {kind!r}")
        return payload

    def generate(self, prompts: list, params: list | None = None, max_tokens: int = 8, timeout_s: float = 300.0):
        """``[(token_ids, num_cached_tokens, kv_transfer_params, finish_reason)]`` per prompt."""
        self.conn.send(("generate", (prompts, params or [None] * len(prompts), max_tokens)))
        return self._recv(timeout_s, "ok")

    def churn(self, prompts: list, params: list, seed: int = 0, settle_s: float = 6.0,
              timeout_s: float = 300.0) -> dict:
        """See :func:`_churn`."""
        self.conn.send(("churn", (prompts, params, seed, settle_s)))
        return self._recv(timeout_s, "ok")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", None))
                self._recv(30, "bye")
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
        self.kill()
