"""Layout-aware KV-cache block transfer between prefill and decode workers over ZeroMQ."""

__version__ = "0.1.0"

from .blocks import gather_blocks, scatter_blocks, slice_bytes  # noqa: E402
from .decode import DecodeEndpoint  # noqa: E402
from .handle import PullHandle, PullResult  # noqa: E402
from .prefill import PrefillEndpoint  # noqa: E402
from .protocol import PROTOCOL_VERSION, Header, MsgType  # noqa: E402
from .transport import CurveKeys  # noqa: E402

__all__ = [
    "CurveKeys", "DecodeEndpoint", "Header", "MsgType", "PROTOCOL_VERSION", "PrefillEndpoint",
    "PullHandle", "PullResult", "gather_blocks", "scatter_blocks", "slice_bytes",
]
