"""Device passes of the connector's payload: gather + checksum, verify + scatter (``frames.py``).

``kvconnector`` does not import ``kernels``; an endpoint gets these as :data:`FRAME_OPS`
(``kvconnector.device_frames.FrameOps``), injected by the caller (``tools`` and ``bench`` do):

- :func:`gather_frames`: requested blocks of a message's layers -> one contiguous payload
  buffer, each frame's ``mix64`` computed from the same registers.
- :func:`verify_scatter`: a received payload's ``mix64`` checked on the device, then the rows
  written into the destination blocks only if every frame matched.
- :func:`frame_checksums`: ``mix64`` of the frames of a device buffer.
- :func:`warmup`: compile every variant for a CUDA device before the first transfer.

Every kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors;
the oracle is the NumPy reference ``layouts.checksum`` plus ``kvconnector.blocks``' gather.
"""

from types import SimpleNamespace

from .frames import frame_checksums, gather_frames, verify_scatter, warmup  # noqa: F401

FRAME_OPS = SimpleNamespace(gather=gather_frames, verify_scatter=verify_scatter, checksums=frame_checksums,
                            warmup=warmup)

__all__ = ["FRAME_OPS", "frame_checksums", "gather_frames", "verify_scatter", "warmup"]
