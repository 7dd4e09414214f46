"""Cross-check of the accuracy anchors (docs/ACCURACY.md) with no cache and no kernels.

A dense float32 forward of SmolLM2-135M (``tools.llama.model.reference_forward``, no bf16
rounding) where each layer's K and V go through the plain-PyTorch oracle's quantize ->
dequantize round trip. Scores teacher-forced top-1 agreement and mean KL against the same
forward without quantization, on consecutive windows of a real text. It checks the formulas
independently of the paged runner and the Triton kernels that ``kvconnector eval`` uses.

    python -m bench.check_anchor --text /usr/share/common-licenses/Apache-2.0 --tokens 112 --windows 3
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernels.reference import dequantize_rows, quantize_rows
from layouts import KVQuantMode

from tools.llama import load_model
from tools.llama.model import reference_forward


def _fake_quant(mode: KVQuantMode):
    return lambda x: dequantize_rows(*quantize_rows(x, mode), mode)


def _no_rotation_int4(x: torch.Tensor) -> torch.Tensor:
    """The same asymmetric 4-bit grid (zero-inclusive range, round half away) without rotation."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    rha = lambda v: torch.sign(v) * torch.floor(v.abs() + 0.5)  # noqa: E731
    zp = rha(-lo / scale).clamp(0, 15)
    return (rha(x / scale + zp).clamp(0, 15) - zp) * scale


VARIANTS = {
    "int8": _fake_quant(KVQuantMode.INT8_PER_TOKEN_HEAD),
    "fp8": _fake_quant(KVQuantMode.FP8_PER_TOKEN_HEAD),
    "int4": _fake_quant(KVQuantMode.INT4_PER_TOKEN_HEAD),
    "int4-no-rotation": _no_rotation_int4,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default="/usr/share/common-licenses/Apache-2.0")
    p.add_argument("--tokens", type=int, default=112)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args(argv)
    loaded = load_model("smollm2")
    weights, tok = loaded[0], loaded[1]
    ids = torch.tensor(tok.encode(open(args.text).read()))
    print(f"| window | {' | '.join(f'{n} top-1 / KL' for n in VARIANTS)} |")
    print("|---|" + "---|" * len(VARIANTS))
    for w in range(args.windows):
        window = ids[w * args.tokens:(w + 1) * args.tokens]
        base = reference_forward(weights, window, act_dtype=None).log_softmax(-1)
        cells = []
        for fn in VARIANTS.values():
            lp = reference_forward(weights, window, act_dtype=None, kv_transform=fn).log_softmax(-1)
            agree = (lp.argmax(-1) == base.argmax(-1)).float().mean().item()
            kl = (base.exp() * (base - lp)).sum(-1).mean().item()
            cells.append(f"{100 * agree:.1f}% / {kl:.4f}")
        print(f"| {w * args.tokens}..{(w + 1) * args.tokens} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
