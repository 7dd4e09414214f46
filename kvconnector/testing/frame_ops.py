"""A plain-PyTorch ``FrameOps`` (``kvconnector.device_frames``): the same contract as
``kernels.transfer.FRAME_OPS`` (gather + ``mix64``, verify then scatter only if every frame
matched), with ``torch`` indexing for the bytes and the NumPy reference ``layouts.checksum`` for
the sums. It drives the connector's device path on CPU caches at realistic message counts and
sizes in seconds, where the interpreted kernels would take minutes: the connector tests and
``kvconnector.testing.live_fuzz --frame-ops`` use it; tests check it against the kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from layouts import checksum as ref


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _rows(caches, block_ids: torch.Tensor, heads) -> list:
    """Per layer, the ``[k, 2, N, h, P]`` uint8 rows of ``block_ids`` (heads ``heads``), views where possible."""
    lo, hi = (0, caches[0].shape[3]) if heads is None else heads
    return [c.view(torch.uint8)[block_ids][:, :, :, lo:hi] for c in caches]


def _sums(buf: torch.Tensor, frame_nbytes) -> list:
    lens = [buf.numel()] if frame_nbytes is None else [int(n) for n in frame_nbytes]
    out, off, arr = [], 0, buf.numpy()
    for n in lens:
        out.append(_signed(ref.mix64(arr[off:off + n])))
        off += n
    return out


def gather(caches, block_ids, *, out, checksums, heads=None, frame_nbytes=None) -> None:
    torch.cat([r.reshape(-1) for r in _rows(caches, block_ids, heads)], out=out)
    checksums.copy_(torch.tensor(_sums(out, frame_nbytes), dtype=torch.int64))


def verify_scatter(staging, expected, caches, block_ids, *, ok, checksums=None, heads=None,
                   frame_nbytes=None) -> None:
    sums = torch.tensor(_sums(staging, frame_nbytes), dtype=torch.int64)
    good = (sums == expected).to(torch.int32)
    ok[:-1].copy_(good)
    ok[-1] = int((good == 0).sum())
    if checksums is not None:
        checksums.copy_(sums)
    if int(ok[-1]):
        return
    lo, hi = (0, caches[0].shape[3]) if heads is None else heads
    k = block_ids.numel()
    per_layer = staging.numel() // len(caches)
    for i, c in enumerate(caches):
        rows = staging[i * per_layer:(i + 1) * per_layer].view(k, 2, c.shape[2], hi - lo, -1)
        c.view(torch.uint8)[block_ids, :, :, lo:hi] = rows


TORCH_FRAME_OPS = SimpleNamespace(gather=gather, verify_scatter=verify_scatter)
