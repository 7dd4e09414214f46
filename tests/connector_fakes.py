"""Helpers for connector tests: seeded caches and a fault-injecting prefill peer (not a test module)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from kvconnector import DecodeEndpoint
from kvconnector.blocks import gather_blocks
from kvconnector.protocol import Header, MsgType, decode_header, encode_header, encode_message
from layouts import CacheGeometry, CorruptFrameError, KVQuantMode, LayoutDescriptor


def until(cond, timeout_s: float = 20.0) -> bool:
    """Poll ``cond()`` every 10 ms until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


class GatedEvent:
    """Stands in for a CUDA event on CPU (the landing thread's ``_record`` seam): the device has
    ended the message once ``gate`` is set."""

    def __init__(self):
        self.gate = threading.Event()

    def query(self):
        return self.gate.is_set()

    def synchronize(self):
        assert self.gate.wait(20), "fake event never released"


def make_desc(mode=KVQuantMode.INT4_PER_TOKEN_HEAD, head_size=32, num_kv_heads=2, block_size=4,
              num_layers=2, num_blocks=8, **kw):
    geo = CacheGeometry(mode, head_size, num_kv_heads, block_size)
    return LayoutDescriptor.from_geometry(geo, num_layers=num_layers, num_blocks=num_blocks, **kw)


def filled_caches(desc, seed):
    """One cache per layer filled with seeded random bytes (every code and scale bit pattern)."""
    geo, g = desc.geometry(), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(desc.num_layers):
        c = geo.new_cache(desc.num_blocks)
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        out.append(c)
    return out


def refused_pull(desc, script, match):
    """Pull blocks 2 and 3 from a :class:`FakePrefill` playing ``script`` into seeded caches; the
    pull must fail with a CorruptFrameError matching ``match``. Returns (that error, the
    destination caches, a copy of them taken before the pull)."""
    fake = FakePrefill(desc, filled_caches(desc, 0), script)
    dst = filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    try:
        with DecodeEndpoint(dst, desc) as dec:
            dec.connect(fake.endpoint, timeout_s=5)
            with pytest.raises(CorruptFrameError, match=match) as exc:
                dec.pull("t", [2, 3], deadline_s=5).result(timeout=5)
    finally:
        fake.close()
    return exc.value, dst, before


class FakePrefill:
    """A ROUTER peer that answers HELLO honestly and then misbehaves on PULL.

    ``script(peer, pull_header)`` is called on the fake's thread with a ``send(frames)``
    helper and decides what BLOCKS messages to send. ``version`` overrides the header version.
    """

    def __init__(self, desc, caches, script, version=None):
        self.desc, self.caches, self.script, self.version = desc, caches, script, version
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.received = []
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def blocks(self, tid, layer, first, count, heads=None, **kw):
        geo = self.desc.geometry()
        ids = list(range(first, first + count))
        payload = gather_blocks(self.caches[layer], geo, ids).numpy().tobytes()
        heads = heads or (self.desc.head_start, self.desc.head_start + self.desc.num_kv_heads)
        h = Header(MsgType.BLOCKS, tid=tid, layer=layer, first=first, nblk=count, heads=heads, **kw)
        return encode_message(h, [payload])

    def multi_blocks(self, tid, layer, nlay, first, count, cut=None, **kw):
        """A protocol-v2 BLOCKS message carrying layers ``layer .. layer+nlay-1`` (layer-major);
        ``cut`` = block index (over all layers) where a second payload frame starts."""
        geo = self.desc.geometry()
        ids = list(range(first, first + count))
        payload = b"".join(gather_blocks(self.caches[la], geo, ids).numpy().tobytes()
                           for la in range(layer, layer + nlay))
        frames = [payload] if cut is None else [payload[:cut * geo.block_bytes], payload[cut * geo.block_bytes:]]
        heads = (self.desc.head_start, self.desc.head_start + self.desc.num_kv_heads)
        h = Header(MsgType.BLOCKS, tid=tid, layer=layer, nlay=nlay, first=first, nblk=count, heads=heads, **kw)
        return encode_message(h, frames)

    def _run(self):
        while not self._stop:
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            h = decode_header(frames[0])
            self.received.append(h.type)
            if h.type == MsgType.HELLO:
                ack = Header(MsgType.HELLO_ACK, desc=self.desc.to_dict(), ok=True)
                raw = encode_header(ack)
                if self.version is not None:
                    import msgpack
                    d = msgpack.unpackb(raw)
                    d["v"] = self.version
                    raw = msgpack.packb(d)
                self.sock.send_multipart([ident, raw])
            elif h.type == MsgType.PULL:
                self.script(lambda fr: self.sock.send_multipart([ident, *fr]), h, self)

    def close(self):
        self._stop = True
        self._t.join(2)
        self.sock.close(0)
        self.ctx.term()
