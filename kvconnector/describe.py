"""DESCRIBE: ask a prefill endpoint what it serves, before any handshake.

A decode-side tool that only knows an endpoint address sends one DESCRIBE header (no keys)
on a short-lived DEALER socket; the prefill endpoint answers with a DESCRIBE header carrying
its layout descriptor (``desc``) and its published transfers (``xfers``: ``[transfer id,
block count]`` pairs, at most :data:`MAX_LISTED`). The tool builds its local descriptor from
the answer and then pulls as usual: the handshake still checks both layouts on both ends,
so DESCRIBE is a convenience, never a substitute for the check. Wire details:
docs/PROTOCOL.md, "DESCRIBE".

- :func:`describe_reply`: the prefill side's answer (called on its I/O thread).
- :func:`describe_endpoint`: the client; returns an :class:`EndpointDescription`.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from layouts import CorruptFrameError, LayoutDescriptor, PeerError, TransferError, TransferTimeoutError
from .protocol import MAX_HEADER_BYTES, Header, MsgType, decode_header, encode_header
from .transport import CurveKeys, make_socket

MAX_LISTED = 1024    # transfers listed in one reply (keeps the header far below MAX_HEADER_BYTES)


def describe_reply(descriptor: LayoutDescriptor, xfers: list) -> Header:
    """DESCRIBE reply of a prefill endpoint: its descriptor and its published transfers
    (``[transfer id, block count]`` pairs, at most :data:`MAX_LISTED`)."""
    return Header(MsgType.DESCRIBE, desc=descriptor.to_dict(), xfers=list(xfers)[:MAX_LISTED])


@dataclass(frozen=True)
class EndpointDescription:
    """What a prefill endpoint said about itself."""

    endpoint: str
    descriptor: LayoutDescriptor
    transfers: dict          # transfer id -> number of blocks (published, lease held)

    def pick_transfer(self, transfer_id: str | None) -> tuple[str, int]:
        """``(transfer id, block count)``; with ``None``, the only published transfer.

        Raises
        ------
        PeerError
            The transfer is not published there, or ``None`` while zero or several are.
        """
        listed = ", ".join(f"{t} ({n} blocks)" for t, n in list(self.transfers.items())[:10]) or "none"
        if not self.transfers:
            raise PeerError(f"{self.endpoint} publishes no transfer (none published, or their leases ended)")
        if transfer_id is None:
            if len(self.transfers) != 1:
                raise PeerError(f"{self.endpoint} publishes {len(self.transfers)} transfers ({listed}); "
                                f"choose one with --transfer-id")
            return next(iter(self.transfers.items()))
        if transfer_id not in self.transfers:
            raise PeerError(f"{self.endpoint}: transfer {transfer_id!r} is not published (published: {listed})")
        return transfer_id, self.transfers[transfer_id]


def describe_endpoint(endpoint: str, timeout_s: float = 5.0, curve: CurveKeys | None = None) -> EndpointDescription:
    """Ask the prefill endpoint at ``endpoint`` for its layout and published transfers.

    Raises
    ------
    TransferTimeoutError
        No answer within ``timeout_s`` (nothing listening, or not a kvconnector endpoint).
    ProtocolVersionError
        The endpoint speaks another protocol version (one without DESCRIBE, for instance).
    PeerError
        It answered with an ERROR message.
    CorruptFrameError, LayoutError
        An answer that is not a valid DESCRIBE reply or descriptor.
    """
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, max_frame_bytes=MAX_HEADER_BYTES, curve=curve)
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise TransferError(f"cannot connect to {endpoint!r}: {e}") from e
        sock.send(encode_header(Header(MsgType.DESCRIBE)))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TransferTimeoutError(f"describe {endpoint}: no answer within {timeout_s} s "
                                       f"(is a kvconnector prefill endpoint listening there?)")
        frames = sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()
    h = decode_header(frames[0])
    if h.type == MsgType.ERROR:
        raise PeerError(f"describe {endpoint}: peer says {h.code}: {h.msg}")
    if h.type != MsgType.DESCRIBE or h.desc is None:
        raise CorruptFrameError(f"describe {endpoint}: expected a DESCRIBE reply with 'desc', got {h.type.name}")
    transfers = {}
    for item in h.xfers:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or isinstance(item[1], bool) or item[1] < 1):
            raise CorruptFrameError(f"DESCRIBE header field 'xfers': expected [str, int >= 1] pairs, got {item!r}")
        transfers[item[0]] = item[1]
    return EndpointDescription(endpoint, LayoutDescriptor.from_dict(h.desc), transfers)
