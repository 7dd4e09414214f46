"""Dump tools: dump -> verify -> inspect -> load round trips, corruption, CLI errors, diff, plots.

Covers ``kvconnector/dumpfile.py`` (format), ``tools/dump.py``, ``tools/verify_dump.py``,
``tools/inspect_dump.py``, ``tools/diff_dump.py``, ``tools/load_dump.py`` and the
statistics in ``tools/cache_stats.py``, for every cache mode (bf16, INT8, FP8, INT4) on
small caches filled by the PyTorch oracle ``reference_reshape_and_cache`` from random K/V
plus edge rows (zeros, a NaN row, a one-hot spike, a huge row).

Run: python -m pytest tests/test_dump_tools.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kernels.reference import reference_reshape_and_cache
from layouts import (CacheGeometry, CorruptFrameError, KVQuantMode, LayoutDescriptor, LayoutError,
                     LayoutMismatchError, ProtocolVersionError, split_kv_cache)
from tools.cache_stats import CacheStats
from tools.cli import main
from tools.diff_dump import diff_dumps
from tools.dump import dump_cache_file, load_cache_file, save_cache_file
from kvconnector.dumpfile import DumpReader, write_dump
from tools.inspect_dump import BlockSource, collect
from tools.load_dump import load_dump, load_into
from tools.verify_dump import verify

MODES = [KVQuantMode.NONE, KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD,
         KVQuantMode.INT4_PER_TOKEN_HEAD]
MODE_IDS = ["bf16", "int8", "fp8", "int4"]
HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS = 32, 2, 4, 6, 3
NUM_TOKENS = 20   # slots 0..19: blocks 0..4 written, block 5 left zeroed


def _kv(seed: int):
    """Random K/V ``[NUM_LAYERS, NUM_TOKENS, H, d]`` bf16 with edge rows in layer 0."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_LAYERS, NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    v = torch.randn(NUM_LAYERS, NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    k[0, 0] = 0.0                    # all-zero row
    k[0, 1, 0, 5] = float("nan")     # non-finite row -> NaN scale marker
    v[0, 2, 1] = 0.0
    v[0, 2, 1, 0] = 3.0              # one-hot spike
    k[0, 3, 1] *= 1e4                # huge row
    return k.bfloat16(), v.bfloat16()


def _caches(mode: KVQuantMode, k, v):
    geo = CacheGeometry(mode, HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE, torch.bfloat16)
    caches = []
    for layer in range(NUM_LAYERS):
        c = torch.zeros(geo.shape(NUM_BLOCKS), dtype=geo.storage_dtype)
        vw = split_kv_cache(c, mode, HEAD_SIZE)
        reference_reshape_and_cache(k[layer], v[layer], vw.key_cache, vw.value_cache, torch.arange(NUM_TOKENS),
                                    mode, vw.k_scale_cache, vw.v_scale_cache)
        caches.append(c)
    return geo, caches, LayoutDescriptor.from_geometry(geo, num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def kv():
    return _kv(0)


@pytest.fixture(scope="module")
def files(tmp_path_factory, kv):
    """Per mode: cache file, and a dump of layers 0 and 2, blocks 4, 0, 5 (out of order on purpose)."""
    root = tmp_path_factory.mktemp("dumps")
    out = {}
    for mode, name in zip(MODES, MODE_IDS):
        geo, caches, desc = _caches(mode, *kv)
        cache_path, dump_path = root / f"{name}.pt", root / f"{name}.kvd"
        save_cache_file(cache_path, caches, desc)
        dump_cache_file(cache_path, dump_path, layers=[0, 2], block_ids=[4, 0, 5], progress=False)
        out[name] = dict(geo=geo, caches=caches, desc=desc, cache=cache_path, dump=dump_path)
    return out


def _cli(*args, timeout=120):
    """The console command in a fresh interpreter (what a user sees, tracebacks included)."""
    return subprocess.run([sys.executable, "-m", "tools.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _main(capsys, *args):
    """The console command in this process (fast): (exit code, stdout, stderr).

    An exception escaping ``main`` fails the test, which is the in-process form of "no traceback".
    """
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", MODE_IDS, ids=MODE_IDS)
def test_round_trip_bit_exact(files, name, tmp_path, capsys):
    f = files[name]
    assert verify(f["dump"], strict=True).startswith("OK")
    desc, caches = load_dump(f["dump"])
    assert desc.fingerprint() == f["desc"].fingerprint()
    assert sorted(caches) == [0, 2]
    for layer in (0, 2):
        for b in range(NUM_BLOCKS):
            want = _bytes(f["caches"][layer][b]) if b in (4, 0, 5) else torch.zeros_like(_bytes(f["caches"][layer][b]))
            assert torch.equal(_bytes(caches[layer][b]), want), (layer, b)
    # the same through the CLI: dump -> verify -> inspect -> load, then compare cache files
    dump2, loaded = tmp_path / "d.kvd", tmp_path / "loaded.pt"
    for args in (("dump", f["cache"], "-o", dump2, "--layers", "0-2", "--blocks", "all"),
                 ("verify", dump2, "--strict"), ("inspect", dump2), ("load", dump2, "-o", loaded)):
        rc, _, err = _main(capsys, *args)
        assert rc == 0, (args, err)
    d2, c2 = load_cache_file(loaded)
    assert d2 == f["desc"]
    assert all(torch.equal(_bytes(c2[i]), _bytes(f["caches"][i])) for i in range(NUM_LAYERS))


@pytest.mark.parametrize("name", MODE_IDS, ids=MODE_IDS)
def test_payload_is_the_connector_block_bytes(files, name):
    """Each message is a protocol BLOCKS header whose one payload frame is the block's raw bytes."""
    f = files[name]
    with DumpReader(f["dump"]) as r:
        recs = list(r)
    assert [(x.layer, x.block_id) for x in recs] == [(l, b) for l in (0, 2) for b in (4, 0, 5)]
    for x in recs:
        assert x.header.nbytes == [f["geo"].block_bytes] and x.header.nblk == 1
        assert bytes(x.payload) == _bytes(f["caches"][x.layer][x.block_id]).numpy().tobytes()


def test_flipped_byte_names_layer_block_frame(files, tmp_path):
    f = files["int4"]
    data = bytearray(f["dump"].read_bytes())
    with DumpReader(f["dump"]) as r:
        rec = [x for x in r][4]                       # layer 2, block 0
    assert (rec.layer, rec.block_id) == (2, 0)
    header_bytes = int.from_bytes(data[rec.offset:rec.offset + 8], "little")
    data[rec.offset + 8 + header_bytes + 8 + 100] ^= 0x01      # byte 100 of the payload
    bad = tmp_path / "flipped.kvd"
    bad.write_bytes(bytes(data))
    r = _cli("verify", bad)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "layer 2 block 0" in r.stderr and "message 4" in r.stderr and "frame 9" in r.stderr
    assert "checksum" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_flipped_bit_anywhere_is_caught(files, tmp_path):
    """A flipped bit at every byte of the file (magic, header, frames, footer, trailer) is a
    typed error, never a silently accepted dump."""
    geo = CacheGeometry(KVQuantMode.INT8_PER_TOKEN_HEAD, 16, 1, 2)    # tiny: every region, few bytes
    cache = torch.randint(-127, 128, geo.shape(3), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    desc = LayoutDescriptor.from_geometry(geo, num_layers=2, num_blocks=3)
    write_dump(tmp_path / "tiny.kvd", [cache, cache.flip(0).contiguous()], desc, block_ids=[2, 0])
    data = (tmp_path / "tiny.kvd").read_bytes()
    assert verify(tmp_path / "tiny.kvd").startswith("OK")
    bad = tmp_path / "x.kvd"
    for pos in range(len(data)):
        d = bytearray(data)
        d[pos] ^= 1 << (pos % 8)
        bad.write_bytes(bytes(d))
        with pytest.raises((CorruptFrameError, ProtocolVersionError, LayoutError)):
            verify(bad)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "huge-length"],
                         ids=["truncated", "garbage", "empty", "huge-length"])
def test_bad_files_give_one_line_errors(files, tmp_path, kind, capsys):
    data = files["fp8"]["dump"].read_bytes()
    bad = tmp_path / f"{kind}.kvd"
    if kind == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "garbage":
        bad.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                      dtype=torch.uint8).numpy().tobytes())
    elif kind == "empty":
        bad.write_bytes(b"")
    else:  # first header frame announces 2**62 bytes: must not allocate, must not hang
        with DumpReader(files["fp8"]["dump"]) as r:
            at = next(iter(r)).offset
        bad.write_bytes(data[:at] + (1 << 62).to_bytes(8, "little") + data[at + 8:])
    r = _cli("verify", bad)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("kvconnector verify: error:")
    for cmd in (("inspect", bad), ("load", bad, "-o", tmp_path / "o.pt"), ("dump", bad, "-o", tmp_path / "o.kvd"),
                ("diff", bad, files["fp8"]["dump"])):
        rc, _, err = _main(capsys, *cmd)
        assert rc != 0 and len(err.strip().splitlines()) == 1, (cmd, err)
        assert err.startswith(f"kvconnector {cmd[0]}: error:"), err


@pytest.mark.parametrize("name", MODE_IDS, ids=MODE_IDS)
def test_inspect_json_counts(files, name, capsys):
    rc, out, err = _main(capsys, "inspect", files[name]["dump"], "--json", "--per-block")
    assert rc == 0, err
    d = json.loads(out)
    assert d["fingerprint"] == files[name]["desc"].fingerprint() and d["layers"] == [0, 2]
    layer0 = d["stats"]["layers"][0]
    assert [b["block"] for b in layer0["blocks"]] == [4, 0, 5]
    k0 = [h for h in layer0["heads"] if h["kv"] == "K" and h["head"] == 0][0]
    assert k0["rows"] == 3 * BLOCK_SIZE
    if name == "bf16":
        assert k0["code_nan"] == 1 and k0["nonfinite"] == 1      # the one NaN element, stored raw
    else:
        # token 1 (block 0) holds the NaN row: NaN scale marker, whole row dequantizes to NaN
        assert k0["scale_nan"] == 1 and k0["nonfinite"] == HEAD_SIZE
        # one code per element (INT4: one nibble per element), over 3 blocks of BLOCK_SIZE rows
        assert sum(k0["code_hist"]) == 3 * BLOCK_SIZE * HEAD_SIZE
        assert len(k0["code_hist"]) == (16 if name == "int4" else 256)
        assert k0["saturated"] >= 1 and k0["scale_max"] > 0
        assert k0["scale_min"] == 0.0          # block 5 was never written: zeroed rows, scale 0
    if name == "int4":
        assert sum(k0["zp_hist"]) == 3 * BLOCK_SIZE


def test_saturation_counts_against_codes(files):
    """INT8 saturation equals a direct count of codes in {-128, -127, 127} in the dumped blocks."""
    f = files["int8"]
    st = collect(BlockSource(f["dump"]))
    for layer in (0, 2):
        codes = torch.stack([f["caches"][layer][b][..., :HEAD_SIZE] for b in (4, 0, 5)])   # [3, 2, N, H, d]
        want = ((codes == 127) | (codes <= -127)).sum((0, 2, 4))
        assert torch.equal(st.layers[layer].saturated, want)


def test_reference_error_per_head_and_plot(files, tmp_path, capsys):
    """INT4 vs its own bf16 source: per-head error within the intrinsic INT4 band, FP8/INT8 far below."""
    png = tmp_path / "int4.png"
    rc, out, err = _main(capsys, "inspect", files["int4"]["dump"], "--reference", files["bf16"]["dump"],
                         "--json", "--plot", png)
    assert rc == 0, err
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heads = json.loads(out)["stats"]["layers"][1]["heads"]     # layer 2: no edge rows
    # Gaussian rows: INT4 per-row relative error is ~0.09 (the 0.12-0.15 quoted for INT4 is after attention)
    assert all(0.03 < h["rel_l2_err"] < 0.2 for h in heads)
    for name in ("bf16", "fp8"):     # no reference: saturation / max |value| heat map, no zero points
        rc, _, err = _main(capsys, "inspect", files[name]["dump"], "--plot", tmp_path / f"{name}.png")
        assert rc == 0 and (tmp_path / f"{name}.png").stat().st_size > 1000, err
    st = collect(BlockSource(files["int8"]["dump"]), BlockSource(files["bf16"]["cache"]))
    assert float(st.error_grid()[1].max()) < 0.02    # INT8: absmax/127 steps, ~0.006 on Gaussians


def test_reference_must_be_unquantized_same_rows(files):
    with pytest.raises(LayoutMismatchError, match="quant_mode"):
        collect(BlockSource(files["int4"]["dump"]), BlockSource(files["int8"]["dump"]))


def test_diff_finds_exactly_the_changed_head(files, tmp_path, capsys):
    f = files["int4"]
    caches = [c.clone() for c in f["caches"]]
    row = f["geo"].row_offset(1, 2, 1)                 # V, slot 2, head 1 of block 0
    caches[2][0].view(torch.uint8).view(-1)[row + 3] ^= 0x11
    other = tmp_path / "changed.kvd"
    write_dump(other, caches, f["desc"], layers=[0, 2], block_ids=[4, 0, 5])
    d = diff_dumps(f["dump"], other)
    assert not d["identical"] and d["compared"] == 6 and not d["layout"]
    assert [(b["layer"], b["block"]) for b in d["blocks"]] == [(2, 0)]
    (h,) = d["blocks"][0]["heads"]
    assert (h["kv"], h["head"], h["bytes"]) == ("V", 1, 1) and h["max_abs"] > 0
    rc, out, _ = _main(capsys, "diff", f["dump"], other, "--json")
    assert rc == 1 and json.loads(out)["blocks"] == json.loads(json.dumps(d["blocks"]))
    assert _main(capsys, "diff", f["dump"], f["dump"])[0] == 0


def test_load_refuses_incompatible_layout(files):
    f = files["int4"]
    other = files["int8"]
    with pytest.raises(LayoutMismatchError, match="quant_mode"):
        load_into(f["dump"], other["caches"], other["desc"])


def test_load_head_slice_under_other_tensor_parallelism(files):
    """A dump of heads [0, 2) lands in a cache holding only global head 1 (TP=2, rank 1)."""
    f = files["fp8"]
    geo = CacheGeometry(KVQuantMode.FP8_PER_TOKEN_HEAD, HEAD_SIZE, 1, BLOCK_SIZE)
    desc = LayoutDescriptor.from_geometry(geo, num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS, head_start=1,
                                          total_num_kv_heads=NUM_KV_HEADS)
    caches = {l: torch.zeros(geo.shape(NUM_BLOCKS), dtype=geo.storage_dtype) for l in (0, 2)}
    written = load_into(f["dump"], caches, desc, block_map={4: 1})
    assert (2, 4, 1) in written and len(written) == 6
    got = _bytes(caches[2][1])                       # [2, N, 1, P]
    want = _bytes(f["caches"][2][4][:, :, 1:2])
    assert torch.equal(got, want)


def test_stats_merge_matches_whole(files):
    """Per-layer totals equal the sum of the per-block statistics (additivity of the engine)."""
    f = files["int4"]
    st = CacheStats(f["geo"])
    for b in (4, 0, 5):
        st.add_block(2, b, f["caches"][2][b])
    total = st.layers[2]
    assert torch.equal(total.code_hist, sum(st.blocks[(2, b)].code_hist for b in (4, 0, 5)))
    # block 5 is zero-filled: all its 2 * H * N rows carry zero point 0
    assert int(st.blocks[(2, 5)].zp_hist[..., 0].sum()) == 2 * NUM_KV_HEADS * BLOCK_SIZE


def test_dump_from_prefill_endpoint(files, tmp_path, capsys):
    """Pull a published transfer over the connector on loopback, dump it, compare bytes; a local
    layout that fails the handshake is a one-line LayoutMismatchError."""
    from kvconnector import PrefillEndpoint

    f = files["int4"]
    out = tmp_path / "pulled.kvd"
    common = ["--transfer-id", "req-1", "--num-transfer-blocks", "3", "--head-size", HEAD_SIZE,
              "--num-kv-heads", NUM_KV_HEADS, "--block-size", BLOCK_SIZE, "--num-layers", NUM_LAYERS,
              "--timeout", "10", "--no-progress", "-o", out]
    with PrefillEndpoint(f["caches"], f["desc"]) as pe:
        pe.publish("req-1", [4, 1, 2])
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--kv-cache-dtype", "int8_per_token_head",
                           *common)
        assert rc == 1 and "LayoutMismatchError" in err and "quant_mode" in err and len(err.splitlines()) == 1
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--kv-cache-dtype", "int4_per_token_head",
                           *common)
        assert rc == 0, err
    assert verify(out).startswith("OK")
    with DumpReader(out) as r:
        assert r.info.tid == "req-1" and r.info.block_ids == [0, 1, 2]
        for rec in r:        # transfer position i holds source block [4, 1, 2][i]
            src = [4, 1, 2][rec.block_id]
            assert bytes(rec.payload) == _bytes(f["caches"][rec.layer][src]).numpy().tobytes()


def test_dump_from_endpoint_needs_no_layout_flags(files, tmp_path, capsys):
    """DESCRIBE: the endpoint announces its layout and transfers; the dump holds the same bytes."""
    from kvconnector import PrefillEndpoint
    from kvconnector.describe import describe_endpoint

    f = files["int8"]
    out = tmp_path / "described.kvd"
    with PrefillEndpoint(f["caches"], f["desc"]) as pe:
        pe.publish("req-2", [5, 0])
        info = describe_endpoint(pe.endpoint, timeout_s=10)
        assert info.descriptor == f["desc"] and info.transfers == {"req-2": 2}
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--num-transfer-blocks", "3", "-o", out)
        assert rc == 1 and "--num-transfer-blocks: expected 2" in err and len(err.splitlines()) == 1
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--no-progress", "-o", out)
        assert rc == 0, err
    with DumpReader(out) as r:
        assert r.info.tid == "req-2" and r.info.desc == f["desc"].with_(num_blocks=2)
        for rec in r:
            assert bytes(rec.payload) == _bytes(f["caches"][rec.layer][[5, 0][rec.block_id]]).numpy().tobytes()


@pytest.mark.parametrize("version, readable", [(3, True), (2, True), (1, False)],
                         ids=["protocol-3", "protocol-2", "protocol-1"])
def test_dumps_of_older_protocols(files, tmp_path, monkeypatch, version, readable):
    """A dump written under protocol 3 or 2 (the same BLOCKS framing as 4, without its headers'
    placement checksum) reads back byte-exact; protocol 1's is refused with ProtocolVersionError
    before any block is read."""
    from kvconnector import dumpfile
    from layouts import ProtocolVersionError

    f, path = files["int4"], tmp_path / f"v{version}.kvd"
    monkeypatch.setattr(dumpfile, "PROTOCOL_VERSION", version)
    write_dump(path, f["caches"], f["desc"], layers=[1], block_ids=[3, 2])
    monkeypatch.undo()
    if not readable:
        with pytest.raises(ProtocolVersionError, match="dump protocol version"):
            load_dump(path)
        return
    desc, caches = load_dump(path)
    assert desc == f["desc"] and sorted(caches) == [1]
    for b in (3, 2):
        assert torch.equal(_bytes(caches[1][b]), _bytes(f["caches"][1][b]))


def test_a_failed_dump_write_leaves_no_file_and_keeps_the_old_one(files, tmp_path, monkeypatch):
    """The dump is written beside its path and renamed into place once complete: a write that
    fails midway (here: disk full after the header) leaves nothing under the path, no part file,
    and a dump already there untouched."""
    import kvconnector.dumpfile as dumpfile

    f = files["int4"]
    out = tmp_path / "d.kvd"
    write_dump(out, f["caches"], f["desc"], layers=[1], block_ids=[3])
    good = out.read_bytes()
    calls = []

    def full_disk(self, layer, block_id, payload):
        calls.append(layer)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(dumpfile.DumpWriter, "write_block", full_disk)
    for path in (out, tmp_path / "new.kvd"):
        with pytest.raises(OSError, match="No space left"):
            write_dump(path, f["caches"], f["desc"], layers=[0, 2], block_ids=[4, 0])
    assert calls and out.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["d.kvd"]
    assert verify(out).startswith("OK")


def test_dump_to_a_missing_directory_does_not_use_the_transfer_up(files, tmp_path, capsys):
    """``-o`` in a directory that does not exist: one line naming the path, before the pull, so
    the transfer is still published and a second dump with a good path gets it."""
    from kvconnector import PrefillEndpoint

    f = files["int8"]
    with PrefillEndpoint(f["caches"], f["desc"]) as pe:
        pe.publish("req-3", [5, 0])
        bad = tmp_path / "no" / "such" / "x.kvd"
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--no-progress", "-o", bad)
        assert rc == 1 and "no writable directory for the dump" in err and str(bad) in err and len(err.splitlines()) == 1
        assert pe.held() == ["req-3"]
        rc, _, err = _main(capsys, "dump", "--endpoint", pe.endpoint, "--no-progress", "-o", tmp_path / "ok.kvd")
        assert rc == 0, err
    assert verify(tmp_path / "ok.kvd").startswith("OK")


def test_a_failed_cache_file_write_keeps_the_old_file(files, tmp_path, monkeypatch):
    """Cache files are written whole or not at all too (``kvconnector.files``)."""
    f = files["int8"]
    path = tmp_path / "c.pt"
    save_cache_file(path, f["caches"], f["desc"])
    good = path.read_bytes()

    def half_then_full(obj, fh):
        fh.write(b"x" * 1000)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        save_cache_file(path, f["caches"][:1], f["desc"], layers=[0])
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    monkeypatch.undo()
    desc, caches = load_cache_file(path)
    assert desc == f["desc"] and all(torch.equal(_bytes(caches[i]), _bytes(c)) for i, c in enumerate(f["caches"]))
