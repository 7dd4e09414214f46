"""Layout descriptor: fingerprint stability, msgpack round trip, the mismatch matrix, head rules.

Run: python -m pytest tests/test_descriptor.py
"""

import dataclasses

import msgpack
import pytest
import torch

from layouts import (EXACT_FIELDS, CacheGeometry, KVQuantMode, LayoutDescriptor, LayoutError,
                     LayoutMismatchError, check_compatible)


def _desc(mode=KVQuantMode.INT4_PER_TOKEN_HEAD, **kw):
    geo = CacheGeometry(mode, 128, 8, 16, torch.bfloat16)
    return LayoutDescriptor.from_geometry(geo, num_layers=30, num_blocks=100, **kw)


def _changed(value):
    """A different value of the same type."""
    return value + 1 if isinstance(value, int) else value + "_x"


def test_msgpack_round_trip_and_fingerprint():
    d = _desc()
    back = LayoutDescriptor.from_dict(msgpack.unpackb(msgpack.packb(d.to_dict())))
    assert back == d and back.fingerprint() == d.fingerprint()
    assert len(d.fingerprint()) == 16
    # fingerprint ignores the fields allowed to differ
    assert d.with_(num_blocks=7).fingerprint() == d.fingerprint()
    assert _desc(KVQuantMode.INT8_PER_TOKEN_HEAD).fingerprint() != d.fingerprint()


def test_fingerprint_is_stable_across_processes():
    # sha256 over canonical JSON: no dependence on hash randomisation or dict order
    import subprocess
    import sys
    code = ("import torch;from layouts import *;"
            "print(LayoutDescriptor.from_geometry(CacheGeometry(KVQuantMode.INT4_PER_TOKEN_HEAD,128,8,16),"
            "num_layers=30,num_blocks=100).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".")
    assert out.stdout.strip() == _desc().fingerprint()


@pytest.mark.parametrize("field", EXACT_FIELDS)
def test_mismatch_matrix_each_exact_field(field):
    a = _desc()
    b = a.with_(**{field: _changed(getattr(a, field))})
    for x, y in ((a, b), (b, a)):  # both ends refuse
        with pytest.raises(LayoutMismatchError, match=field) as ei:
            check_compatible(x, y)
        assert ei.value.fields == [field]
        assert ei.value.differences[0][1:] == (getattr(x, field), getattr(y, field))


def test_mismatch_lists_every_field():
    a = _desc()
    b = a.with_(head_size=64, block_size=32, quant_mode=2)
    with pytest.raises(LayoutMismatchError) as ei:
        check_compatible(a, b)
    assert ei.value.fields == ["quant_mode", "head_size", "block_size"]
    assert "head_size: local=128 remote=64" in str(ei.value)


def test_num_blocks_may_differ():
    a = _desc()
    assert check_compatible(a, a.with_(num_blocks=3)) == range(0, 8)


@pytest.mark.parametrize("local,remote,shared", [
    ((0, 8), (0, 4), range(0, 4)),       # decode holds all heads, prefill rank 0 of 2
    ((0, 8), (4, 4), range(4, 8)),       # ... rank 1 of 2
    ((2, 2), (0, 4), range(2, 4)),       # head slice of a larger rank
], ids=["tp1-from-tp2r0", "tp1-from-tp2r1", "slice"])
def test_head_ranges_that_overlap_are_legal(local, remote, shared):
    base = _desc()
    a = base.with_(head_start=local[0], num_kv_heads=local[1])
    b = base.with_(head_start=remote[0], num_kv_heads=remote[1])
    assert check_compatible(a, b) == shared


@pytest.mark.parametrize("remote", [(4, 4), (6, 4), (-1, 2)], ids=["disjoint", "past-total", "negative"])
def test_illegal_head_ranges(remote):
    base = _desc()
    a = base.with_(head_start=0, num_kv_heads=4)
    b = base.with_(head_start=remote[0], num_kv_heads=remote[1])
    with pytest.raises(LayoutMismatchError, match="head_start") as ei:
        check_compatible(a, b)
    assert set(ei.value.fields) == {"head_start", "num_kv_heads"}


def test_from_dict_rejects_bad_input():
    d = _desc().to_dict()
    with pytest.raises(LayoutError, match="missing"):
        LayoutDescriptor.from_dict({k: v for k, v in d.items() if k != "head_size"})
    with pytest.raises(LayoutError, match="unexpected"):
        LayoutDescriptor.from_dict({**d, "evil": 1})
    with pytest.raises(LayoutError, match="data_head_size"):
        LayoutDescriptor.from_dict({**d, "data_head_size": 128})
    with pytest.raises(LayoutError, match="expected int or str"):
        LayoutDescriptor.from_dict({**d, "head_size": [1]})
    with pytest.raises(LayoutError, match="format_version"):
        LayoutDescriptor.from_dict({**d, "format_version": 99})
    with pytest.raises(LayoutError, match="outside"):
        LayoutDescriptor.from_dict({**d, "head_start": 6})
    with pytest.raises(LayoutError, match="block_size: expected 0..65536"):
        LayoutDescriptor.from_dict({**d, "block_size": 2 ** 62})
    with pytest.raises(LayoutError, match="a map"):
        LayoutDescriptor.from_dict([1, 2])


def test_descriptor_carries_spec_fields():
    names = {f.name for f in dataclasses.fields(LayoutDescriptor)}
    for n in ("format_version", "quant_mode", "model_dtype", "head_size", "num_kv_heads", "head_start",
              "total_num_kv_heads", "block_size", "num_layers", "data_head_size", "scale_pad",
              "scale_dtype", "scale_position", "zero_point", "rotation", "sign_seed", "nibble_order",
              "byte_order"):
        assert n in names
    d = _desc()
    assert (d.sign_seed, d.nibble_order, d.zero_point) == (0x9E3779B9, "even_low", "scale_low4_bits")
    assert d.block_bytes == 2 * 16 * 8 * (64 + 4)
