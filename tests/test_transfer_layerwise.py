"""Layer-wise publish: a pull streams each layer as soon as the prefill announces it.

``PrefillEndpoint.publish(..., layers_ready=0)`` then ``publish_layers(tid, n)``: nothing of a
layer not yet announced is sent (its destination blocks keep their old bytes and ``on_layer``
is not called for it), announced layers land while later ones are still being written, and the
pull completes byte-exact once the last layer is announced; on CPU with xxh3_64 and with the
device kernels (interpreter on CPU, compiled on CUDA when present), on each data plane.

Run: python -m pytest tests/test_transfer_layerwise.py -q
"""

import importlib.util
import time

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kernels.transfer import FRAME_OPS
from kvconnector import DecodeEndpoint, PrefillEndpoint
from layouts import TransferError

pytestmark = pytest.mark.timeout(120)
PLANES = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                               reason="needs the nixl package"))]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]


def _wait(cond, timeout_s=20.0):
    t_end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < t_end:
        time.sleep(0.005)
    return cond()


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("kernels", [False, True], ids=["xxh3-host", "mix64-kernels"])
@pytest.mark.parametrize("device", DEVICES)
def test_layers_stream_as_published(plane, kernels, device):
    desc = make_desc(num_layers=3, num_blocks=6)
    src = [c.to(device) for c in filled_caches(desc, 0)]
    dst = [c.to(device) for c in filled_caches(desc, 1)]
    before = [c.clone() for c in dst]
    ops = FRAME_OPS if kernels else None
    landed = []
    with PrefillEndpoint(src, desc, frame_ops=ops, data_plane=plane) as pre, \
            DecodeEndpoint(dst, desc, frame_ops=ops, data_plane=plane, nixl_region_bytes=1 << 20) as dec:
        dec.connect(pre.endpoint, timeout_s=10)
        pre.publish("t", [5, 2, 0], layers_ready=0)
        handle = dec.pull("t", [1, 3, 4], deadline_s=60, on_layer=lambda tid, layer: landed.append(layer))
        time.sleep(0.2)
        assert landed == [] and not handle.done()
        pre.publish_layers("t", 1)
        assert _wait(lambda: landed == [0])
        time.sleep(0.2)
        assert landed == [0]                       # layers 1 and 2 were not sent
        if device == "cuda":
            torch.cuda.synchronize()
        for layer in (1, 2):
            assert torch.equal(dst[layer].view(torch.uint8), before[layer].view(torch.uint8))
        pre.publish_layers("t", 3)
        handle.result(timeout=30)
        if device == "cuda":
            torch.cuda.synchronize()
        assert sorted(landed) == [0, 1, 2]
        for s, d in zip(src, dst):
            assert torch.equal(d.view(torch.uint8)[[1, 3, 4]], s.view(torch.uint8)[[5, 2, 0]])


def test_publish_layers_of_an_unknown_transfer():
    desc = make_desc(num_layers=2, num_blocks=2)
    with PrefillEndpoint(filled_caches(desc, 0), desc) as pre:
        with pytest.raises(TransferError, match="not published"):
            pre.publish_layers("nope", 1)
