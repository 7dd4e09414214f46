"""The future-like handle a decode-side pull returns, with per-layer completion."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class PullResult:
    """What a completed pull moved."""

    transfer_id: str
    dst_block_ids: tuple
    nbytes: int
    elapsed_s: float


class PullHandle:
    """Progress and outcome of one pull (returned by :meth:`DecodeEndpoint.pull`).

    Thread-safe to read from any thread; updated by the endpoint's I/O thread.
    Blocks land layer by layer: :meth:`wait_layer` / ``on_layer(transfer_id, layer)`` let
    compute on layer ``l`` start while later layers are still in flight.

    An exception raised by ``on_layer`` does not touch the transfer: it is appended to
    :attr:`callback_errors` as ``(layer, exception)``, the layer still counts as landed, and
    the pull completes (ACK, lease release) exactly as it would have.
    """

    def __init__(self, transfer_id: str, dst_block_ids: list, num_layers: int, heads: tuple,
                 deadline_at: float, on_layer: Callable | None) -> None:
        self.transfer_id, self.dst_block_ids = transfer_id, tuple(dst_block_ids)
        self.dst_index = np.asarray(self.dst_block_ids, dtype=np.intp)   # for row scatters
        self.dst_dev = None   # CUDA caches: the destination ids on the device (pull(); CPU: at the first write)
        self.ready = None     # CUDA caches: the event every write of the pull waits for (pull())
        self.preparing: threading.Event | None = None   # CUDA caches: set once pull() has made both
        self.prepare_error: BaseException | None = None  # what making them raised (the pull is aborted)
        self.num_layers, self.heads, self.deadline_at = num_layers, tuple(heads), deadline_at
        self.on_layer = on_layer
        n = len(dst_block_ids)
        self.received = [bytearray(n) for _ in range(num_layers)]   # accepted, maybe in flight
        self.jobs: set = set()        # copy-worker futures writing this pull's blocks
        self.landed = [bytearray(n) for _ in range(num_layers)]     # written into the cache
        self._layer_left = [n] * num_layers
        self._layers_done = bytearray(num_layers)   # 1: the layer has fully landed
        self._cv = threading.Condition()             # notified as a layer lands and as the pull ends
        self._done = threading.Event()
        self.t0 = time.monotonic()
        self.nbytes = 0
        self.error: Exception | None = None
        self.failed_block_ids: list[int] = []
        self.callback_errors: list[tuple] = []   # (layer, exception) raised by on_layer
        self._result: PullResult | None = None

    # ---- I/O thread ---------------------------------------------------------------
    def land(self, layer: int, first: int, count: int) -> bool:
        """Mark positions written; return True when the whole transfer has landed."""
        marks = self.landed[layer]
        new = count - sum(marks[first:first + count])
        marks[first:first + count] = b"\x01" * count
        self._layer_left[layer] -= new
        if self._layer_left[layer] == 0 and not self._layers_done[layer]:
            with self._cv:
                self._layers_done[layer] = 1
                self._cv.notify_all()
            if self.on_layer is not None:
                try:
                    self.on_layer(self.transfer_id, layer)
                except Exception as e:   # the application's callback: recorded, the transfer goes on
                    self.callback_errors.append((layer, e))
        return all(left == 0 for left in self._layer_left)

    def finish(self) -> PullResult:
        self._result = PullResult(self.transfer_id, self.dst_block_ids, self.nbytes, time.monotonic() - self.t0)
        self._end()
        return self._result

    def fail(self, error: Exception) -> None:
        if self._done.is_set():
            return
        self.failed_block_ids = [b for i, b in enumerate(self.dst_block_ids)
                                 if not all(marks[i] for marks in self.landed)]
        error.failed_block_ids = self.failed_block_ids
        self.error = error
        self._end()

    def _end(self) -> None:
        self._done.set()
        with self._cv:   # wake wait_layer callers: the pull is over
            self._cv.notify_all()

    # ---- any thread ---------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> Exception | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"pull {self.transfer_id!r} still running after {timeout} s")
        return self.error

    def result(self, timeout: float | None = None) -> PullResult:
        """Wait for the pull (bounded by its own deadline) and return its :class:`PullResult`.

        Raises the transfer's typed error (``TransferTimeoutError``, ``CorruptFrameError``,
        ``PeerError``, ...), whose ``failed_block_ids`` lists the destination blocks that
        did not fully land; ``TimeoutError`` if ``timeout`` passes first.
        """
        err = self.exception(timeout)
        if err is not None:
            raise err
        return self._result

    def layer_done(self, layer: int) -> bool:
        return bool(self._layers_done[layer])

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` has landed (True) or the pull ended / timeout passed (False)."""
        with self._cv:
            self._cv.wait_for(lambda: self._layers_done[layer] or self._done.is_set(), timeout)
            return bool(self._layers_done[layer])
