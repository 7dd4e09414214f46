"""``kvconnector load --block-map``: a map that would not do what it says is refused.

An entry naming a block the dump does not hold, two dump blocks sent to one destination, or a
destination outside the cache gives a one-line error and a non-zero exit, and writes nothing;
a valid map moves exactly the named blocks.

Run: python -m pytest tests/test_load_block_map.py
"""

from __future__ import annotations

import re

import pytest
import torch

from connector_fakes import filled_caches, make_desc
from layouts import KVQuantMode, LayoutError
from tools.cli import main
from tools.dump import dump_cache_file, load_cache_file, save_cache_file
from tools.load_dump import load_into

DUMP_BLOCKS = [4, 0, 5]   # the dump holds these blocks of layers 0 and 2


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("blockmap")
    desc = make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 32, num_layers=3, num_blocks=8)
    caches = filled_caches(desc, 0)
    save_cache_file(root / "src.pt", caches, desc)
    dump_cache_file(root / "src.pt", root / "d.kvd", layers=[0, 2], block_ids=DUMP_BLOCKS, progress=False)
    return dict(desc=desc, caches=caches, path=root / "d.kvd")


def _main(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


BAD_MAPS = {
    "absent-source": ("4:1,1:2", r"holds blocks \[4, 0, 5\], the map names \[1\]"),
    "only-absent": ("3:1", r"the map names \[3\]"),
    "two-onto-one": ("4:1,0:1", "distinct sources and destinations"),     # refused while parsing
    "onto-unmapped": ("4:5", "two dump blocks to one destination"),      # block 5 keeps id 5
    "outside-cache": ("4:8", r"expected ids in \[0, 8\), got \[8\]"),
    "duplicate-source": ("4:1,4:2", "distinct sources and destinations"),
}


@pytest.mark.parametrize("case", list(BAD_MAPS), ids=list(BAD_MAPS))
def test_cli_refuses_a_map_that_would_do_nothing(dump, tmp_path, capsys, case):
    spec, why = BAD_MAPS[case]
    out = tmp_path / "out.pt"
    rc, err = _main(capsys, "load", dump["path"], "-o", out, "--block-map", spec)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvconnector load: error: LayoutError")
    assert re.search(why, lines[0]), lines[0]
    assert not out.exists()


def test_load_into_refuses_before_writing(dump):
    desc = dump["desc"]
    caches = {layer: torch.zeros_like(c) for layer, c in enumerate(dump["caches"])}
    with pytest.raises(LayoutError, match=r"the map names \[1\]"):
        load_into(dump["path"], caches, desc, block_map={4: 1, 1: 3})
    assert all(not c.view(torch.uint8).any() for c in caches.values())


def test_valid_map_moves_exactly_the_named_blocks(dump, tmp_path, capsys):
    out = tmp_path / "out.pt"
    rc, err = _main(capsys, "load", dump["path"], "-o", out, "--block-map", "4:1,0:7")
    assert rc == 0, err
    _, got = load_cache_file(out)
    src = dump["caches"]
    for layer in (0, 2):
        g, s = got[layer].view(torch.uint8), src[layer].view(torch.uint8)
        assert torch.equal(g[1], s[4]) and torch.equal(g[7], s[0]) and torch.equal(g[5], s[5])
        for b in (0, 2, 3, 4, 6):
            assert not g[b].any(), f"layer {layer} block {b} written"
