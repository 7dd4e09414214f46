"""The transfer kernels (``kernels.transfer``) against their oracles, on CPU through Triton's
interpreter and on CUDA when a GPU is present.

Oracles: ``layouts.checksum.mix64`` (NumPy reference of the checksum) and
``kvconnector.blocks.gather_blocks`` / ``scatter_blocks`` (the byte layout of a payload).
Covers: checksums of several frames of one buffer; gather of several layers x blocks (every
cache mode, all heads and a head slice) equal to the oracle's payload, with each frame's
checksum; verify + scatter writing exactly the oracle's bytes; a corrupted byte (and a wrong
expected checksum) leaving every destination byte as it was, with the mismatching frame
flagged; argument validation.

Run: python -m pytest tests/test_transfer_kernels.py -q
"""

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kernels.transfer import frame_checksums, gather_frames, verify_scatter
from kvconnector.blocks import gather_blocks, scatter_blocks
from layouts import KVQuantMode, LayoutError
from layouts.checksum import mix64

pytestmark = pytest.mark.timeout(300)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]
MODES = [(KVQuantMode.NONE, 32), (KVQuantMode.INT8_PER_TOKEN_HEAD, 32), (KVQuantMode.FP8_PER_TOKEN_HEAD, 16),
         (KVQuantMode.INT4_PER_TOKEN_HEAD, 32)]
M64 = (1 << 64) - 1


def _u64(t: torch.Tensor) -> list[int]:
    return [int(v) & M64 for v in t.cpu().tolist()]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frames", [[1], [7], [8], [4096 + 9], [100, 5000, 4900], [40000, 8, 3]],
                         ids=lambda f: "-".join(map(str, f)))
def test_frame_checksums_match_reference(device, frames):
    buf = torch.randint(0, 256, (sum(frames),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    out = torch.full((len(frames),), -1, dtype=torch.int64, device=device)
    frame_checksums(buf.to(device), out, frames)
    edges = [0]
    for n in frames:
        edges.append(edges[-1] + n)
    assert _u64(out) == [mix64(buf[a:b].numpy()) for a, b in zip(edges, edges[1:])]


def _setup(mode, head_size, device, heads, num_heads=3, block_size=4, num_layers=3, num_blocks=9):
    desc = make_desc(mode, head_size, num_kv_heads=num_heads, block_size=block_size, num_layers=num_layers,
                     num_blocks=num_blocks)
    geo = desc.geometry()
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    hr = range(num_heads) if heads is None else range(*heads)
    return desc, geo, src, dst, hr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [None, (1, 3)], ids=["all-heads", "heads-1-3"])
@pytest.mark.parametrize("mode,head_size", MODES, ids=["bf16", "int8", "fp8", "int4"])
def test_gather_equals_oracle_payload_and_checksum(mode, head_size, heads, device):
    desc, geo, src, _, hr = _setup(mode, head_size, device, heads)
    ids = [7, 2, 3, 0]
    layers = src[1:3]
    want = torch.cat([gather_blocks(c.cpu(), geo, ids, hr) for c in layers])
    out = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
    sums = torch.empty(1, dtype=torch.int64, device=device)
    gather_frames(layers, torch.tensor(ids, device=device), out=out, checksums=sums, heads=heads)
    assert torch.equal(out.cpu(), want)
    assert _u64(sums) == [mix64(want.numpy())]
    # the same payload split in frames of whole blocks (one crossing the layer boundary)
    blk = want.numel() // (2 * len(ids))
    frames = [blk, 4 * blk, 3 * blk]
    sums3 = torch.empty(3, dtype=torch.int64, device=device)
    gather_frames(layers, torch.tensor(ids, device=device), out=out, checksums=sums3, heads=heads,
                  frame_nbytes=frames)
    assert _u64(sums3) == [mix64(want[:blk].numpy()), mix64(want[blk:5 * blk].numpy()),
                           mix64(want[5 * blk:].numpy())]


def _payload(geo, src, ids, hr):
    return torch.cat([gather_blocks(c.cpu(), geo, ids, hr) for c in src])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [None, (0, 2)], ids=["all-heads", "heads-0-2"])
@pytest.mark.parametrize("mode,head_size", MODES, ids=["bf16", "int8", "fp8", "int4"])
def test_verify_scatter_writes_oracle_bytes(mode, head_size, heads, device):
    desc, geo, src, dst, hr = _setup(mode, head_size, device, heads)
    src_ids, dst_ids = [1, 8, 4], [5, 0, 6]
    payload = _payload(geo, src[:2], src_ids, hr)
    want = [c.cpu().clone() for c in dst[:2]]
    for c, part in zip(want, payload.chunk(2)):
        scatter_blocks(c, geo, dst_ids, part, hr)
    blk = payload.numel() // 6
    frames = [2 * blk, 4 * blk]
    expected = torch.tensor([_signed(mix64(payload[:2 * blk].numpy())), _signed(mix64(payload[2 * blk:].numpy()))],
                            dtype=torch.int64, device=device)
    ok = torch.full((3,), -1, dtype=torch.int32, device=device)
    verify_scatter(payload.to(device), expected, dst[:2], torch.tensor(dst_ids, device=device), ok=ok,
                   heads=heads, frame_nbytes=frames)
    assert ok.cpu().tolist() == [1, 1, 0]
    for got, w in zip(dst[:2], want):
        assert torch.equal(got.cpu().view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["flipped-byte", "wrong-checksum"])
def test_mismatch_leaves_destination_untouched(device, fault):
    desc, geo, src, dst, hr = _setup(KVQuantMode.INT4_PER_TOKEN_HEAD, 32, device, None)
    payload = _payload(geo, src[:2], [1, 2], hr)
    half = payload.numel() // 2
    expected = [mix64(payload[:half].numpy()), mix64(payload[half:].numpy())]
    if fault == "flipped-byte":
        payload[half + 17] ^= 0x40          # frame 1 corrupted after its checksum was taken
    else:
        expected[0] ^= 1
    before = [c.clone() for c in dst]
    ok = torch.full((3,), -1, dtype=torch.int32, device=device)
    sums = torch.empty(2, dtype=torch.int64, device=device)
    verify_scatter(payload.to(device), torch.tensor([_signed(v) for v in expected], device=device), dst[:2],
                   torch.tensor([3, 4], device=device), ok=ok, checksums=sums, frame_nbytes=[half, half])
    bad = 1 if fault == "flipped-byte" else 0
    assert ok.cpu().tolist() == [int(bad != 0), int(bad != 1), 1]
    assert _u64(sums)[bad] == mix64(payload[bad * half:(bad + 1) * half].numpy())
    for got, b in zip(dst, before):
        assert torch.equal(got.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [None, (1, 3)], ids=["all-heads", "heads-1-3"])
@pytest.mark.parametrize("mode,head_size", [MODES[1], MODES[3]], ids=["int8", "int4"])
def test_a_stretch_from_any_cell_gathers_and_scatters_across_layers(mode, head_size, heads, device):
    """``start``: the buffer holds whole cells of the payload of every layer x every block from a
    cell inside a layer, across the next layer boundaries (consecutive messages of a pull in one
    pass); the kernels and the plain-PyTorch ops agree with the oracle's bytes and checksums."""
    from kvconnector.testing.frame_ops import TORCH_FRAME_OPS
    desc, geo, src, dst, hr = _setup(mode, head_size, device, heads)
    ids, dst_ids = [7, 2, 3, 0], [5, 0, 6, 1]
    whole = _payload(geo, src, ids, hr)                   # 3 layers x 4 blocks, layer-major
    blk = whole.numel() // 12
    start, cells = 3, 7                                   # layer 0 position 3 .. layer 2 position 1
    want = whole[start * blk:(start + cells) * blk]
    frames = [blk, 5 * blk, blk]
    ref = [mix64(want[:blk].numpy()), mix64(want[blk:6 * blk].numpy()), mix64(want[6 * blk:].numpy())]
    for gather, scatter in [(gather_frames, verify_scatter),
                            (TORCH_FRAME_OPS.gather, TORCH_FRAME_OPS.verify_scatter)]:
        if device == "cuda" and gather is TORCH_FRAME_OPS.gather:
            continue
        out = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
        sums = torch.empty(3, dtype=torch.int64, device=device)
        gather(src, torch.tensor(ids, device=device), out=out, checksums=sums, heads=heads, frame_nbytes=frames,
               start=start)
        assert torch.equal(out.cpu(), want)
        assert _u64(sums) == ref
        got = [c.clone() for c in dst]
        expect = [c.cpu().clone() for c in dst]        # the oracle: cells 3 .. 9 written, nothing else
        for cell in range(start, start + cells):
            layer, pos = divmod(cell, 4)
            scatter_blocks(expect[layer], geo, [dst_ids[pos]], whole[cell * blk:(cell + 1) * blk], hr)
        ok = torch.full((4,), -1, dtype=torch.int32, device=device)
        scatter(out, sums, got, torch.tensor(dst_ids, device=device), ok=ok, heads=heads, frame_nbytes=frames,
                start=start)
        assert ok.cpu().tolist() == [1, 1, 1, 0]
        for g, w in zip(got, expect):
            assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


def test_arguments_are_checked():
    desc, geo, src, dst, hr = _setup(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, "cpu", None)
    ids = torch.tensor([0, 1])
    n = 2 * 2 * geo.block_bytes
    with pytest.raises(LayoutError, match="out: expected"):
        gather_frames(src[:2], ids, out=torch.empty(n - 1, dtype=torch.uint8), checksums=torch.empty(1, dtype=torch.int64))
    with pytest.raises(LayoutError, match="heads: expected"):
        gather_frames(src[:2], ids, out=torch.empty(n, dtype=torch.uint8), checksums=torch.empty(1, dtype=torch.int64),
                      heads=(2, 5))
    with pytest.raises(LayoutError, match="frame_nbytes: expected"):
        gather_frames(src[:2], ids, out=torch.empty(n, dtype=torch.uint8), checksums=torch.empty(2, dtype=torch.int64),
                      frame_nbytes=[n, 1])
    for start, nbytes in [(3, 2 * geo.block_bytes), (1, 2 * geo.block_bytes - 1), (-1, geo.block_bytes), (4, 0)]:
        with pytest.raises(LayoutError, match="out: expected whole cells"):   # past the end, part of a cell
            gather_frames(src[:2], ids, out=torch.empty(nbytes, dtype=torch.uint8),
                          checksums=torch.empty(1, dtype=torch.int64), start=start)
    with pytest.raises(LayoutError, match="staging: expected whole cells"):
        verify_scatter(torch.empty(3 * geo.block_bytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
                       dst[:2], ids, ok=torch.empty(2, dtype=torch.int32), start=2)
    with pytest.raises(LayoutError, match="block_ids: expected"):
        gather_frames(src[:2], ids.int(), out=torch.empty(n, dtype=torch.uint8), checksums=torch.empty(1, dtype=torch.int64))
    with pytest.raises(LayoutError, match=r"caches\[1\]"):
        gather_frames([src[0], src[1][:4]], ids, out=torch.empty(n, dtype=torch.uint8),
                      checksums=torch.empty(1, dtype=torch.int64))
    # the caches' checks are kept per list of tensor objects: other objects at the same addresses are checked again
    out, sums = torch.empty(n, dtype=torch.uint8), torch.empty(1, dtype=torch.int64)
    gather_frames(src[:2], ids, out=out, checksums=sums)
    gather_frames(list(src[:2]), ids, out=out, checksums=sums)
    t = src[1].transpose(2, 3)
    assert t.data_ptr() == src[1].data_ptr()
    with pytest.raises(LayoutError, match=r"caches\[1\]"):
        gather_frames([src[0], t], ids, out=out, checksums=sums)
    with pytest.raises(LayoutError, match="caches: expected packed"):
        gather_frames([src[0].transpose(2, 3), t], ids, out=out, checksums=sums)
