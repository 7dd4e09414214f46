"""The two-process demo, reduced: synthetic 2-layer model, a few tokens, hard timeout.

Starts ``kvconnector demo`` as a subprocess (which itself starts a prefill and a decode process
talking over ZeroMQ on loopback), then checks its JSON summary: the pulled bytes are exactly the
prompt's blocks x layers x block bytes, the block hashes matched, and greedy decode ran. Also
checks that a bad ``--mode`` is refused before any process starts, and that mismatched cache
modes on the two sides make both handshakes refuse with no KV byte moved.

Run: ``python -m pytest tests/test_demo.py``
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from layouts import CacheGeometry, get_kv_quant_mode

PROMPT = "kv cache over zmq"  # 17 bytes -> 17 tokens of the synthetic byte tokenizer


def _demo(tmp_path, *extra, timeout=240):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "tools.cli", "demo", "--model", "synthetic", "--synthetic-layers", "2",
           "--max-new-tokens", "3", "--prompt", PROMPT, "--timeout", "200", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["int4_per_token_head"], ids=["int4"])
def test_demo_two_processes(tmp_path, mode):
    proc, summary = _demo(tmp_path, "--mode", mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[prefill]" in proc.stdout and "[decode]" in proc.stdout and "handshake ok" in proc.stdout
    geo = CacheGeometry(get_kv_quant_mode(mode), 64, 3, 16)
    num_blocks = math.ceil(len(PROMPT.encode()) / 16)
    assert summary["prompt_tokens"] == len(PROMPT.encode())
    assert summary["bytes"] == num_blocks * 2 * geo.block_bytes  # blocks x layers x 2·N·H·P
    assert summary["hashes_ok"] is True
    assert len(summary["tokens"]) == 3 and len(summary["reference_tokens"]) == 3
    assert 0.0 <= summary["agreement"] <= 1.0


def test_demo_refuses_bad_mode(tmp_path):
    proc, summary = _demo(tmp_path, "--mode", "int3_per_token_head", timeout=60)
    assert proc.returncode == 2 and summary is None
    assert "int3_per_token_head" in proc.stderr


@pytest.mark.timeout(300)
def test_demo_layout_mismatch_is_refused(tmp_path):
    proc, summary = _demo(tmp_path, "--mode", "int4_per_token_head", "--decode-mode", "int8_per_token_head")
    assert proc.returncode == 1 and summary is None
    # both handshakes refuse, naming the differing field with both values
    assert "layout mismatch (decode side)" in proc.stderr, proc.stderr[-2000:]
    assert "layout mismatch (prefill side)" in proc.stderr, proc.stderr[-2000:]
    assert "quant_mode: local=" in proc.stderr
    assert "pulled" not in proc.stdout  # no KV byte moved
