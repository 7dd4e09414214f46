"""Every frame of one real pull, as hex and decoded msgpack: the worked example of docs/PROTOCOL.md.

A live :class:`~kvconnector.PrefillEndpoint` serves a tiny INT4 cache (2 layers, block_size 4,
1 KV head, head_size 16: rows of 8 code bytes + a 4-byte scale word, 96-byte blocks) filled
with seeded bytes; a raw ZeroMQ DEALER plays the decode side and records each frame it sends
and receives: HELLO, HELLO_ACK, PULL, BLOCKS, ACK, then PING/PONG and a PULL of an unknown
transfer answered by ERROR. The output is deterministic (seeded bytes, fixed message plan), so
``tests/test_protocol_doc.py`` checks that the document shows exactly what this prints.

Run: python -m kvconnector.testing.wire_example
"""

from __future__ import annotations

import msgpack
import torch
import zmq

from layouts import CacheGeometry, KVQuantMode, LayoutDescriptor
from ..prefill import PrefillEndpoint
from ..protocol import Header, MsgType, encode_header

SRC_IDS = [3, 1]          # source blocks, in transfer order
HEX_BYTES_PER_LINE = 32


def example_caches() -> tuple[LayoutDescriptor, list[torch.Tensor]]:
    """The example's descriptor and its 2 caches ``[4, 2, 4, 1, 12]`` uint8 (seeded bytes)."""
    geo = CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD, 16, 1, 4)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=2, num_blocks=4)
    g = torch.Generator().manual_seed(0)
    return desc, [torch.randint(0, 256, geo.shape(4), dtype=torch.uint8, generator=g) for _ in range(2)]


def _hex(buf: bytes) -> list[str]:
    return [buf[i:i + HEX_BYTES_PER_LINE].hex(" ") for i in range(0, len(buf), HEX_BYTES_PER_LINE)]


def _show(direction: str, frames: list[bytes]) -> list[str]:
    head = msgpack.unpackb(frames[0], raw=False)
    name = MsgType(head["t"]).name
    out = [f"{direction} {name}: header frame, {len(frames[0])} bytes"]
    out += ["    " + line for line in _hex(frames[0])]
    out.append("    = " + repr(head))
    for i, f in enumerate(frames[1:]):
        out.append(f"  payload frame {i}, {len(f)} bytes, xxh3_64 {head['xxh'][i]:#018x}")
        out += ["    " + line for line in _hex(f)]
    return out


def run_example(timeout_ms: int = 5000) -> str:
    """Run the exchange against a live endpoint; return the annotated frames as text."""
    desc, caches = example_caches()
    lines = []
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with PrefillEndpoint(caches, desc) as pre:
            sock.connect(pre.endpoint)

            def send(h: Header) -> None:
                frame = encode_header(h)
                lines.extend(_show("D->P", [frame]))
                sock.send(frame)

            def recv() -> None:
                if not sock.poll(timeout_ms):
                    raise TimeoutError("no reply from the prefill endpoint")
                lines.extend(_show("P->D", sock.recv_multipart()))

            send(Header(MsgType.HELLO, desc=desc.to_dict()))
            recv()
            pre.publish("req-1", SRC_IDS)
            send(Header(MsgType.PULL, tid="req-1", nblk=len(SRC_IDS), heads=(0, 1)))
            recv()
            send(Header(MsgType.ACK, tid="req-1", ok=True))
            send(Header(MsgType.PING))
            recv()
            send(Header(MsgType.PULL, tid="req-9", nblk=1, heads=(0, 1)))
            recv()
    finally:
        sock.close(0)
        ctx.term()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run_example(), end="")
