"""Key smoothing's identity in the layout: the offsets file, the descriptor field and the handshake.

Covers ``layouts.KeyOffsets`` (bf16 rounding, the file round trip, fingerprint checks on load,
the shipped SmolLM2 file), the descriptor's ``key_offset`` field (validated, exact, in the
fingerprint only when set, absent from the wire map when "none" so unsmoothed fingerprints stay
as they were), the handshake between a smoothed and an unsmoothed or differently calibrated
worker refused on both ends naming ``key_offset`` (real ZeroMQ sockets on loopback, no KV byte
sent), and a transfer between two workers with the same offsets.

Run: ``python -m pytest tests/test_key_smoothing_layout.py -q``
"""

import json
import time

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from layouts import KeyOffsets, KVQuantMode, LayoutDescriptor, LayoutError, LayoutMismatchError, PeerError
from layouts import check_compatible, shipped_key_offsets

pytestmark = pytest.mark.timeout(60)


def offsets(seed=0, shape=(2, 2, 32)):
    g = torch.Generator().manual_seed(seed)
    return KeyOffsets.from_tensor(torch.randn(*shape, generator=g) * 3, "test-model",
                                  {"text": "t", "positions": [0, 8]})


def test_offsets_rounded_to_bf16_and_file_round_trip(tmp_path):
    ko = offsets()
    assert torch.equal(ko.offsets, ko.offsets.to(torch.bfloat16).float())
    path = tmp_path / "m.key_offsets.json"
    ko.save(str(path))
    back = KeyOffsets.load(str(path))
    assert torch.equal(back.offsets, ko.offsets) and back.fingerprint == ko.fingerprint
    assert back.calibration == ko.calibration and back.model == "test-model"
    assert offsets(1).fingerprint != ko.fingerprint
    assert KeyOffsets.from_tensor(ko.offsets, "another name", {}).fingerprint == ko.fingerprint  # values only
    assert ko.layer(1, head_start=1, num_kv_heads=1).shape == (1, 32)


def test_offsets_file_errors(tmp_path):
    d = offsets().to_json()
    path = tmp_path / "bad.json"
    for bad, match in (({**d, "fingerprint": "0" * 16}, "fingerprint field says"),
                       ({**d, "head_size": 16}, "expected bfloat16 values for shape"),
                       ({**d, "format": "other"}, "expected format")):
        path.write_text(json.dumps(bad))
        with pytest.raises(LayoutError, match=match):
            KeyOffsets.load(str(path))
    with pytest.raises(LayoutError, match="expected finite"):
        KeyOffsets.from_tensor(torch.full((1, 1, 16), float("nan")), "x")
    with pytest.raises(LayoutError, match=r"expected \[num_layers, num_kv_heads, head_size\] = \[30, 3, 64\]"):
        offsets().check_model(30, 3, 64)


def test_shipped_smollm2_offsets():
    """The shipped file loads, fits SmolLM2-135M (30 layers, 3 KV heads, head_size 64), says how
    it was calibrated, and is small."""
    import os
    path = shipped_key_offsets("smollm2-135m-instruct")
    assert path is not None and os.path.getsize(path) < 32 << 10
    ko = KeyOffsets.load(path)
    ko.check_model(30, 3, 64)
    assert ko.calibration["positions"] == [0, 1024] and ko.calibration["text"] == "MPL-2.0"
    assert "kvconnector calibrate" in ko.calibration["command"]
    assert shipped_key_offsets("no-such-model") is None


def test_descriptor_field():
    plain = make_desc()
    smooth = make_desc(key_offset=offsets().fingerprint)
    assert "key_offset" not in plain.to_dict() and smooth.to_dict()["key_offset"] == offsets().fingerprint
    assert LayoutDescriptor.from_dict(smooth.to_dict()) == smooth
    assert LayoutDescriptor.from_dict(plain.to_dict()) == plain
    assert smooth.fingerprint() != plain.fingerprint()
    # the unsmoothed fingerprint hashes the fields it hashed before the field existed
    assert plain.fingerprint() == _fingerprint_without_key_offset(plain)
    with pytest.raises(LayoutMismatchError, match="key_offset") as e:
        check_compatible(plain, smooth)
    assert list(e.value.fields) == ["key_offset"]  # the only difference, named
    with pytest.raises(LayoutError, match="key_offset: expected 'none' or 16 hex digits"):
        LayoutDescriptor.from_dict({**plain.to_dict(), "key_offset": "xyz"})
    with pytest.raises(LayoutError, match="key_offset: expected 'none' for a layout that is not INT4"):
        make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, key_offset=offsets().fingerprint)


def _fingerprint_without_key_offset(desc):
    import hashlib
    from layouts.descriptor import EXACT_FIELDS
    exact = {n: getattr(desc, n) for n in EXACT_FIELDS if n != "key_offset"}
    blob = json.dumps(exact, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


PAIRS = {"smoothed-prefill-plain-decode": (offsets(0).fingerprint, "none"),
         "plain-prefill-smoothed-decode": ("none", offsets(0).fingerprint),
         "differently-calibrated": (offsets(0).fingerprint, offsets(1).fingerprint)}


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_handshake_refused_on_both_ends(pair):
    """A decode worker never appends keys with another ``m`` than the prefill used: the
    handshake fails on both ends with ``LayoutMismatchError`` naming ``key_offset``; no byte moves."""
    pre_ko, dec_ko = PAIRS[pair]
    local, remote = make_desc(key_offset=pre_ko), make_desc(key_offset=dec_ko)
    with PrefillEndpoint(filled_caches(local, 0), local) as pre, \
            DecodeEndpoint(filled_caches(remote, 1), remote) as dec:
        with pytest.raises(LayoutMismatchError, match="key_offset") as exc:
            dec.connect(pre.endpoint, timeout_s=5)
        assert "key_offset" in exc.value.fields
        deadline = time.monotonic() + 5
        while not pre.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(isinstance(e, LayoutMismatchError) and "key_offset" in e.fields for e in pre.errors)
        with pytest.raises(PeerError, match="connect"):
            dec.pull("t", [0])
        pre.publish("t", [0])
        time.sleep(0.1)
        assert pre.stats()["bytes_sent"] == 0


def test_same_offsets_transfer_byte_exact():
    desc = make_desc(key_offset=offsets(0).fingerprint)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    with PrefillEndpoint(src, desc) as pre, DecodeEndpoint(dst, desc) as dec:
        dec.connect(pre.endpoint, timeout_s=5)
        pre.publish("r", [1, 2])
        dec.pull("r", [3, 4], deadline_s=10).result()
        for s, d in zip(src, dst):
            assert torch.equal(d.view(torch.uint8)[3], s.view(torch.uint8)[1])
            assert torch.equal(d.view(torch.uint8)[4], s.view(torch.uint8)[2])


def test_dump_carries_offsets_and_inspect_adds_m_back(tmp_path):
    """A smoothed INT4 cache dumped with its offsets: the header carries them (checked against the
    descriptor on read) and ``inspect``'s statistics are those of the keys, m added back; without
    the offsets at hand the keys are shown as stored (about m lower) and the table says so."""
    from kernels.paged_cache import PagedKVCache
    from kvconnector.dumpfile import DumpReader, write_dump
    from tools.inspect_dump import BlockSource, collect, format_table

    ko = KeyOffsets.from_tensor(torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(3)) * 4 + 2, "t")
    cache = PagedKVCache("int4_per_token_head", 2, 2, 32, num_blocks=2, block_size=16, key_offsets=ko)
    assert cache.descriptor.key_offset == ko.fingerprint
    g = torch.Generator().manual_seed(4)
    keys = [torch.randn(32, 2, 32, generator=g) + ko.offsets[i] for i in range(2)]
    for i in range(2):
        cache.write(i, keys[i], torch.randn(32, 2, 32, generator=g), cache.slot_mapping([0, 1], 0, 32))
    path, bare = tmp_path / "s.kvd", tmp_path / "bare.kvd"
    write_dump(path, cache.caches, cache.descriptor, key_offsets=ko)
    write_dump(bare, cache.caches, cache.descriptor)
    with DumpReader(path) as r:
        assert r.info.key_offsets.fingerprint == ko.fingerprint
    with pytest.raises(LayoutError, match="key_offsets: fingerprint"):
        write_dump(tmp_path / "x.kvd", cache.caches, cache.descriptor, key_offsets=offsets())

    def key_means(src):
        st = collect(src).to_dict()
        return torch.tensor([[h["mean"] for h in layer["heads"] if h["kv"] == "K"] for layer in st["layers"]])

    want = torch.stack([k.mean((0, 2)) for k in keys])  # [layer, head]
    shown = key_means(BlockSource(str(path)))
    assert (shown - want).abs().max() < 0.05  # INT4 error averages out over 32 x 32 values per head
    stored = key_means(BlockSource(str(bare)))
    assert (stored - (want - ko.offsets.mean(-1))).abs().max() < 0.05
    note = format_table(BlockSource(str(bare)), collect(BlockSource(str(bare))))
    assert "keys are shown WITHOUT m" in note
    ko_path = tmp_path / "ko.json"
    ko.save(str(ko_path))
    assert torch.allclose(key_means(BlockSource(str(bare), str(ko_path))), shown)
    offsets().save(str(ko_path))
    with pytest.raises(LayoutMismatchError, match="key_offset"):
        BlockSource(str(bare), str(ko_path))
