"""Key smoothing end to end through the commands, on the synthetic 2-layer model (seconds each).

Covers ``kvconnector calibrate`` (the mean key of the stated positions, the offsets file, the
per-band report), ``kvconnector eval`` with the smoothing variants pooled over two rotation
sign vectors (smoothed keys read back with m added: a lower key error than plain INT4), the
sign-seed override (another seed, other bytes; the default restored), and ``kvconnector demo``
with offsets on both sides (handshake ok, the fingerprint printed) and with different ones
(refused on both sides naming ``key_offset``). The SmolLM2 numbers are in docs/ACCURACY.md.

Run: ``python -m pytest tests/test_key_smoothing_tools.py -q``
"""

import json
import re
import subprocess
import sys

import pytest
import torch

from layouts import KeyOffsets, rht_signs
from layouts.rotation import RHT_SIGN_SEED, rht_sign_seed, sign_seed_override

TEXT = "/usr/share/common-licenses/Apache-2.0"
SYN = ["--model", "synthetic", "--synthetic-layers", "2"]


def _cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "tools.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def offsets_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ko") / "syn.key_offsets.json"
    r = _cli("calibrate", *SYN, "--text", TEXT, "--positions", "8:40", "-o", path, "--check-text", TEXT,
             "--check-tokens", "64", "--band", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^\| 0\.\.31 \| 0\.\d+ \| 0\.\d+ \| -?\d+\.\d% \|$", r.stdout, re.M), r.stdout
    return path


def test_calibrate_writes_the_mean_key(offsets_file):
    """The file holds the bf16-rounded mean of the model's keys at positions 8..39, and says so."""
    from tools.calibrate import key_means, model_keys
    from tools.llama import LlamaRunner, load_model
    ko = KeyOffsets.load(str(offsets_file))
    assert ko.calibration["positions"] == [8, 40] and ko.calibration["text"] == "Apache-2.0"
    weights, tok = load_model("synthetic", synthetic_layers=2)
    ids = tok.encode(open(TEXT, encoding="utf-8").read())[:40]
    keys = model_keys(LlamaRunner(weights), torch.tensor(ids))
    assert torch.equal(ko.offsets, key_means(keys, 8, 40).to(torch.bfloat16).float())


def test_calibrate_refuses_a_range_past_the_text(tmp_path):
    r = _cli("calibrate", *SYN, "--text", "/usr/share/common-licenses/BSD", "--positions", "0:100000")
    assert r.returncode == 2 and "needs 100000 tokens" in r.stderr


def test_eval_smoothing_variants(offsets_file, tmp_path):
    out = tmp_path / "e.json"
    r = _cli("eval", *SYN, "--key-offsets", offsets_file, "--variants", "int8,int4,int4-smooth,int4-smooth-prompt",
             "--sign-seeds", "2", "--tokens", "48", "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mean over 2 rotation sign vectors" in r.stdout and "int4 -> int8 KL gap closed" in r.stdout
    rows = {x["variant"]: x for x in json.loads(out.read_text())["rows"]}
    assert len(rows["int4"]["kl_runs"]) == 2 and len(rows["int8"]["kl_runs"]) == 1  # int8 has no rotation
    k = {n: sum(rows[n]["key_err"]) / len(rows[n]["key_err"]) for n in rows}
    assert k["int4-smooth"] < k["int4"] and k["int4-smooth-prompt"] < k["int4"], k
    assert rows["int4-smooth"]["value_err"] == rows["int4"]["value_err"]  # values are never smoothed


def test_eval_needs_offsets_for_smoothing():
    r = _cli("eval", *SYN, "--key-offsets", "none", "--variants", "int4-smooth", "--tokens", "8")
    assert r.returncode == 2 and "need --key-offsets" in r.stderr


def test_sign_seed_override_changes_the_signs_then_restores():
    from kernels.reference import quantize_int4_rows
    x = torch.randn(4, 64).to(torch.bfloat16)
    s0, q0 = rht_signs(64).clone(), quantize_int4_rows(x)[0]
    with sign_seed_override(RHT_SIGN_SEED + 1):
        assert rht_sign_seed() == RHT_SIGN_SEED + 1
        assert not torch.equal(rht_signs(64), s0) and not torch.equal(quantize_int4_rows(x)[0], q0)
    assert rht_sign_seed() == RHT_SIGN_SEED and torch.equal(rht_signs(64), s0)


@pytest.mark.timeout(600)
def test_demo_with_offsets_and_refused_with_different_ones(offsets_file, tmp_path):
    base = ["demo", *SYN, "--max-new-tokens", "2", "--prompt", "kv cache", "--no-reference", "--timeout", "200"]
    r = _cli(*base, "--key-offsets", offsets_file)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fp = KeyOffsets.load(str(offsets_file)).fingerprint
    assert r.stdout.count(f"key offsets {fp}") == 2 and "handshake ok" in r.stdout  # both sides smoothed
    r = _cli(*base, "--key-offsets", offsets_file, "--decode-key-offsets", "none")
    assert r.returncode == 1
    assert "layout mismatch (decode side)" in r.stderr and "layout mismatch (prefill side)" in r.stderr
    assert f"key_offset: local='none' remote='{fp}'" in r.stderr


def test_calibrate_over_windows(tmp_path):
    """``--windows 2``: the mean over positions 0..15 of two consecutive 16-token windows, each
    run from position 0 (the positions short prompts occupy)."""
    from tools.calibrate import key_means, model_keys
    from tools.llama import LlamaRunner, load_model
    path = tmp_path / "w.json"
    r = _cli("calibrate", *SYN, "--text", TEXT, "--positions", "0:16", "--windows", "2", "-o", path)
    assert r.returncode == 0, r.stderr[-2000:]
    weights, tok = load_model("synthetic", synthetic_layers=2)
    ids = tok.encode(open(TEXT, encoding="utf-8").read())[:32]
    runner = LlamaRunner(weights)
    means = [key_means(model_keys(runner, torch.tensor(ids[w * 16:(w + 1) * 16])), 0, 16) for w in range(2)]
    ko = KeyOffsets.load(str(path))
    assert ko.calibration["windows"] == 2
    assert torch.equal(ko.offsets, ((means[0] + means[1]) / 2).to(torch.bfloat16).float())
