"""The project's one exception hierarchy.

Every failure the library raises on purpose is a :class:`KVCacheError`; each class also
inherits the builtin a caller would naturally catch (``ValueError`` for bad input,
``TimeoutError`` for deadlines), so generic handlers keep working.

::

    KVCacheError
    ├── LayoutError(ValueError)            bad geometry, dtype, strides, descriptor
    │   └── LayoutMismatchError            two descriptors that may not exchange blocks
    └── TransferError                      anything that goes wrong moving blocks
        ├── CorruptFrameError(ValueError)  checksum, byte count, framing, decode failure
        ├── ProtocolVersionError           peer speaks another protocol version
        ├── TransferTimeoutError(TimeoutError)  a deadline passed / peer presumed dead
        └── PeerError                      the peer reported a failure (unknown id, aborted, ...)
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error this project raises on purpose."""


class LayoutError(KVCacheError, ValueError):
    """A cache tensor, shape, dtype, stride or descriptor does not fit the layout."""


class LayoutMismatchError(LayoutError):
    """Two layout descriptors cannot exchange blocks.

    Parameters
    ----------
    differences : list of (field, local_value, remote_value)
        Every field that differs, with both values, in descriptor field order.
    """

    def __init__(self, differences, context: str = ""):
        self.differences = list(differences)
        lines = [f"  {name}: local={a!r} remote={b!r}" for name, a, b in self.differences]
        head = "layout mismatch" + (f" ({context})" if context else "")
        super().__init__(head + ":\n" + "\n".join(lines))

    @property
    def fields(self) -> list[str]:
        return [name for name, _, _ in self.differences]


class TransferError(KVCacheError):
    """Base class of failures while moving blocks between endpoints or files."""


class CorruptFrameError(TransferError, ValueError):
    """A frame failed its checksum, byte count or decoding."""


class ProtocolVersionError(TransferError):
    """The peer speaks a protocol version this endpoint does not accept."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A deadline passed: handshake, pull, lease, or a silent peer."""


class PeerError(TransferError):
    """The peer answered with an error (unknown transfer, aborted, refused)."""
