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


def _cell_bytes(cache, heads) -> int:
    lo, hi = (0, cache.shape[3]) if heads is None else heads
    return 2 * cache.shape[2] * (hi - lo) * cache.shape[4] * cache.element_size()


def _pieces(caches, k: int, nbytes: int, heads, start) -> list:
    """``(layer index, first position, end position)`` of the payload of ``caches`` x ``k`` blocks
    that ``nbytes`` bytes from cell ``start`` (``layer·k + position``; None: the whole payload)
    cover, in layer-major order."""
    if start is None:
        return [(i, 0, k) for i in range(len(caches))]
    cells, out = nbytes // _cell_bytes(caches[0], heads), []
    while cells > 0:
        layer, pos = divmod(start, k)
        n = min(cells, k - pos)
        out.append((layer, pos, pos + n))
        start, cells = start + n, cells - n
    return out


def _rows(cache, ids: torch.Tensor, heads) -> torch.Tensor:
    """The ``[k, 2, N, h, P]`` uint8 rows of ``ids`` (heads ``heads``) of one layer."""
    lo, hi = (0, cache.shape[3]) if heads is None else heads
    return cache.view(torch.uint8)[ids][:, :, :, lo:hi]


def _sums(buf: torch.Tensor, frame_nbytes) -> list:
    lens = [buf.numel()] if frame_nbytes is None else [int(n) for n in frame_nbytes]
    out, off, arr = [], 0, buf.numpy()
    for n in lens:
        out.append(_signed(ref.mix64(arr[off:off + n])))
        off += n
    return out


def gather(caches, block_ids, *, out, checksums, heads=None, frame_nbytes=None, start=None) -> None:
    pieces = _pieces(caches, block_ids.numel(), out.numel(), heads, start)
    torch.cat([_rows(caches[i], block_ids[a:b], heads).reshape(-1) for i, a, b in pieces], out=out)
    checksums.copy_(torch.tensor(_sums(out, frame_nbytes), dtype=torch.int64))


def verify_scatter(staging, expected, caches, block_ids, *, ok, checksums=None, heads=None,
                   frame_nbytes=None, start=None) -> None:
    sums = torch.tensor(_sums(staging, frame_nbytes), dtype=torch.int64)
    good = (sums == expected).to(torch.int32)
    ok[:-1].copy_(good)
    ok[-1] = int((good == 0).sum())
    if checksums is not None:
        checksums.copy_(sums)
    if int(ok[-1]):
        return
    lo, hi = (0, caches[0].shape[3]) if heads is None else heads
    per_cell, off = _cell_bytes(caches[0], heads), 0
    for i, a, b in _pieces(caches, block_ids.numel(), staging.numel(), heads, start):
        c, n = caches[i], (b - a) * per_cell
        c.view(torch.uint8)[block_ids[a:b], :, :, lo:hi] = staging[off:off + n].view(b - a, 2, c.shape[2], hi - lo, -1)
        off += n


TORCH_FRAME_OPS = SimpleNamespace(gather=gather, verify_scatter=verify_scatter)
