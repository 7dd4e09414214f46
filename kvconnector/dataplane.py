"""Data planes: how a BLOCKS message's payload reaches the decode side.

The control plane (handshake, layout checks, PULL, leases, checksums, ACK / ABORT / ERROR) is
always ZeroMQ. The payload bytes of a BLOCKS message travel on one of two data planes:

- ``zmq`` (default, every peer): as the message's own payload frames, zero copy out of the
  prefill's buffers (docs/PROTOCOL.md, "BLOCKS").
- ``nixl``: written by the prefill with NIXL (UCX: TCP here; RDMA where the fabric has it)
  straight into a receive region the decode side registered; the BLOCKS header then carries
  ``at`` (where the frames start in the region, back to back) and no payload frames, and is sent
  once its write is in the region (up to ``prefill.NIXL_INFLIGHT`` writes of a transfer in flight). The
  header still lists ``nbytes`` and checksums, and the decode side verifies them in the region
  before a byte reaches a cache, exactly as for frames (docs/PROTOCOL.md, "Data planes").

Negotiation (optional keys of protocol 3): a decode side created with ``data_plane="nixl"``
sends HELLO ``nixl`` = its agent metadata and region; a prefill created with
``data_plane="nixl"`` answers HELLO_ACK ``plane: "nixl"`` and writes to that peer with NIXL;
anyone else keeps ``zmq``. Each PULL on the ``nixl`` plane names its area of the region (``at``).

:class:`NixlReceiver` (decode) owns the region and hands out one area per pull;
:class:`NixlWriter` (prefill) writes a message's payload frames into a peer's area. NIXL is
imported only when a ``nixl`` plane is asked for (``pip install nixl``).
"""

from __future__ import annotations

import itertools
import os
import time

import torch

from layouts import TransferError, TransferTimeoutError

ZMQ, NIXL = "zmq", "nixl"
PLANES = (ZMQ, NIXL)
_ids = itertools.count()


def _agent(role: str):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransferError(f"data_plane='nixl' needs the nixl package (pip install nixl): {e}") from e
    name = f"kvc-{role}-{os.getpid()}-{next(_ids)}"
    # no UCX progress thread: each side's I/O thread progresses its agent (the prefill polling its
    # writes, NixlWrite.poll; the decode side calling NixlReceiver.progress while a pull is pending),
    # where a progress thread spins for the life of the process (on 2 cores, pulls 2-4x slower)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])), name


def check_plane(name: str) -> str:
    if name not in PLANES:
        raise ValueError(f"data_plane: expected one of {list(PLANES)}, got {name!r}")
    return name


class NixlReceiver:
    """Decode side: a registered host region (pinned when CUDA is available), one area per pull.

    Parameters
    ----------
    nbytes : int
        Region size; a pull needs ``num_layers · blocks · 2·N·h·P`` bytes of it while pending.
    """

    def __init__(self, nbytes: int) -> None:
        self.agent, self.name = _agent("decode")
        self.region = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._reg = self.agent.register_memory(self.region)
        self._free = [(0, nbytes)]       # (offset, length), sorted
        self._quarantine: list = []      # (reusable at, offset, length): areas of failed pulls

    def offer(self) -> dict:
        """HELLO ``nixl`` value: agent metadata and the region's address and size."""
        return {"agent": self.agent.get_agent_metadata(), "addr": self.region.data_ptr(),
                "len": self.region.numel()}

    def reserve(self, nbytes: int) -> int:
        """Offset of a free area of ``nbytes`` (first fit). Raises TransferError when full."""
        now = time.monotonic()
        for item in [q for q in self._quarantine if q[0] <= now]:
            self._quarantine.remove(item)
            self.release(item[1], item[2])
        for i, (off, n) in enumerate(self._free):
            if n >= nbytes:
                self._free[i:i + 1] = [(off + nbytes, n - nbytes)] if n > nbytes else []
                return off
        raise TransferError(f"nixl receive region: expected {nbytes} free bytes for the pull, got at most "
                            f"{max((n for _, n in self._free), default=0)} of {self.region.numel()}")

    def release(self, off: int, nbytes: int, after_s: float = 0.0) -> None:
        """Give an area back; ``after_s`` > 0 keeps it out of use that long (a failed pull's
        prefill may still be writing into it)."""
        if after_s > 0:
            self._quarantine.append((time.monotonic() + after_s, off, nbytes))
            return
        self._free.append((off, nbytes))
        self._free.sort()
        merged = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def progress(self) -> None:
        """Let the agent move what is arriving (it has no progress thread of its own: the decode I/O
        thread calls this at least every millisecond while a pull is pending on the plane)."""
        self.agent.get_new_notifs()

    def view(self, at: int, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 view of the region at ``at``."""
        return self.region[at:at + nbytes]

    def area(self, pull_at: int, layer: int, first: int, nblk: int, per_block: int) -> int:
        """Where the payload of (``layer``, position ``first``) sits in the area of a pull at
        ``pull_at`` of ``nblk`` blocks per layer: the transfer layout, layer-major."""
        return pull_at + (layer * nblk + first) * per_block

    def close(self) -> None:
        self.agent.deregister_memory(self._reg)


class NixlWriter:
    """Prefill side: writes payload frames into a decode peer's region, several in flight
    (:meth:`start`, then :meth:`NixlWrite.poll` from the I/O thread)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.agent, self.name = _agent("prefill")
        self.timeout_s = timeout_s
        self._orphans: list = []         # abandoned writes NIXL may still be performing

    def add_peer(self, offer: dict) -> tuple:
        """Register a peer from its HELLO ``nixl`` value; returns the peer handle ``(agent name,
        region address, region size)``. Raises TransferError on a malformed offer."""
        try:
            meta, addr, size = offer["agent"], int(offer["addr"]), int(offer["len"])
            return self.agent.add_remote_agent(bytes(meta)), addr, size
        except Exception as e:
            raise TransferError(f"HELLO field 'nixl': expected {{agent: bytes, addr: int, len: int}} NIXL "
                                f"metadata, got {type(e).__name__}: {e}") from e

    def start(self, peer: tuple, frames: list, at: int) -> "NixlWrite":
        """Post a write of ``frames`` (host buffers) back to back at ``at`` of the peer's region and
        return at once: the returned :class:`NixlWrite` says when it is in the region (``poll``)
        and when the frames may be reused (``done``). Raises TransferError for a range outside the
        region or a transfer NIXL refuses to post."""
        name, addr, size = peer
        total = sum(memoryview(f).nbytes for f in frames)
        if not 0 <= at <= size - total:
            raise TransferError(f"nixl write: expected [{at}, {at + total}) inside the peer's region of {size} bytes")
        tensors = [torch.from_numpy(f) if not isinstance(f, torch.Tensor) else f for f in frames]
        reg = self.agent.register_memory(tensors)
        src, dst, off = [], [], addr + at
        for t in tensors:
            src.append((t.data_ptr(), t.numel(), 0))
            dst.append((off, t.numel(), 0))
            off += t.numel()
        try:
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(src, "DRAM"),
                                                self.agent.get_xfer_descs(dst, "DRAM"), name)
        except Exception:
            self.agent.deregister_memory(reg)
            raise
        return NixlWrite(self.agent, handle, reg, tensors, at, total, name, time.monotonic() + self.timeout_s,
                         self.agent.transfer(handle))

    def abandon(self, w: "NixlWrite") -> None:
        """A write whose transfer was given up: its handle is released once NIXL is done with it
        (:meth:`reap`)."""
        if not w.done:
            self._orphans.append(w)

    def reap(self) -> None:
        """Release the handles of abandoned writes NIXL has finished."""
        self._orphans = [w for w in self._orphans if not w.finish_quietly()]

    def close(self) -> None:
        """Release what is left (abandoned writes still in flight included)."""
        for w in self._orphans:
            try:
                w.release()
            except Exception:  # NIXL refuses to release a transfer still running; the agent goes with the endpoint
                pass
        self._orphans = []


class NixlWrite:
    """One posted NIXL write (:meth:`NixlWriter.start`): its transfer handle, the registration of
    its source buffers and the buffers themselves, held until NIXL reports the transfer finished."""

    def __init__(self, agent, handle, reg, tensors: list, at: int, total: int, peer: str, deadline: float,
                 state: str) -> None:
        self._agent, self._handle, self._reg, self._tensors = agent, handle, reg, tensors
        self.at, self.total, self.peer, self.deadline = at, total, peer, deadline
        self.state = state              # NIXL's: "PROC" while running, then "DONE" or "ERR"

    @property
    def done(self) -> bool:
        """The source buffers are free again (NIXL no longer reads them): the tracker a pooled
        buffer is released with (``sender.BufferPool``)."""
        return self._handle is None

    def poll(self) -> bool:
        """True once the payload is in the peer's region. Raises TransferError if NIXL reports the
        transfer failed (on every call after that too), TransferTimeoutError past the writer's
        ``timeout_s`` (the handle is then left for :meth:`NixlWriter.abandon`)."""
        if self._handle is not None and not self._settle():
            if time.monotonic() > self.deadline:
                raise TransferTimeoutError(f"nixl write of {self.total} bytes: not done after the writer's timeout")
            return False
        if self.state == "ERR":
            raise TransferError(f"nixl write of {self.total} bytes at {self.at} of {self.peer}'s region: "
                                "transfer failed")
        return True

    def finish_quietly(self) -> bool:
        """Poll without raising; True once released (done or failed)."""
        return self._handle is None or self._settle()

    def _settle(self) -> bool:
        """Ask NIXL for the transfer's state; once it is finished (done or failed), release the
        handle and the registration and return True."""
        if self.state not in ("DONE", "ERR"):
            self.state = self._agent.check_xfer_state(self._handle)
        if self.state in ("DONE", "ERR"):
            self.release()
            return True
        return False

    def release(self) -> None:
        if self._handle is not None:
            self._agent.release_xfer_handle(self._handle)
            self._agent.deregister_memory(self._reg)
            self._handle, self._reg, self._tensors = None, None, []
