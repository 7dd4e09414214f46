"""Session 17: INT4 writer trees side by side in one process: the two-operation division
(``div_split``) against Markstein's three, then unmasked tile loads on top.

``--old DIR``: a directory holding earlier trees' ``kernels`` packages copied as ``kernels_<name>``
(relative imports only, so they load side by side); ``--variants old,mid,new`` names them
(``new`` is this tree's ``kernels``; ``new/rows=16+num_warps=1`` adds tuning keywords). Every variant is first
checked against the oracle (poisoned cache, a NaN row, an Inf, a zero row, every 97th slot
negative; a partial last tile; bf16 and fp16), then old, new and a copy of the same bytes are
timed in interleaved rounds of CUDA-graph replays. Run:
``PYTHONPATH=. python3 tools/exp_session17/probe_write_split_div.py --old scratch/oldpkg [--rounds 3] [--out F]``.
An older tree goes there as ``mkdir -p scratch/oldpkg/t && git archive 67e8f0c kernels | tar -x -C
scratch/oldpkg/t && mv scratch/oldpkg/t/kernels scratch/oldpkg/kernels_old`` (``scratch/`` is ignored).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

from tools import bench_write as bw
from tools.timing import tee


def writer(spec):
    """``name`` or ``name/key=int+key=int...``: a tree's writer, with tuning keywords (this tree: ``new``)."""
    name, _, kws = spec.partition("/")
    kw = {k: int(v) for k, v in (item.split("=") for item in kws.split("+") if item)}
    w = importlib.import_module(("kernels" if name == "new" else "kernels_" + name) + ".write")
    w = w.triton_reshape_and_cache_flash_per_token_head_quant

    def call(key, value, slots, views):
        return w(key, value, views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache, slots,
                 bw.MODES["int4"], check_slots=False, **kw)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--shapes", default="65536x128,262144x128,16384x128,65536x64,65536x256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="old,new")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.old)
    log = tee(args.out)
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    variants = {n: writer(n) for n in args.variants.split(",")}
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; INT4 write, 8 kv heads, random slots")
    for d in (128, 64, 256):
        for dtype in (torch.bfloat16, torch.float16):
            for tokens in (65536 if d < 256 else 32768, 4097):
                res = {name: bw.check_case("int4", dtype, d, tokens, dev, write=call) for name, call in variants.items()}
                log(f"check d={d} {str(dtype)[6:]} tokens={tokens}: " + "; ".join(
                    f"{n} rows differing {r}, codes {c}, max Δ {e:.2f}" for n, (r, c, e) in res.items()))
    for tokens, d in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        nbytes, sets = bw.timing_sets("int4", tokens, d, dev)
        calls = {name: lambda k, v, s, c, views, call=call: call(k, v, s, views) for name, call in variants.items()}
        best, copy = bw.interleaved_us(sets, calls, nbytes, dev, args.rounds)
        c = min(copy)
        row = "  ".join(f"{n} {min(t):.1f} ({100 * c / min(t):.1f}%) [{' '.join(f'{x:.1f}' for x in t)}]"
                        for n, t in best.items())
        log(f"{tokens} x 8 x {d}: copy {c:.1f} µs | {row}")
        del sets
        torch.cuda.empty_cache()
    log(f"# done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
