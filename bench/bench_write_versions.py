"""Time the GPU INT4 writer (``kernels/_write_int4_lanes.py``) of several git commits side by side.

Each commit's file is read with ``git show`` and loaded as its own module; the launcher
(``kernels._write_int4``) is pointed at each in turn, so every version runs through the same
public API in one process. Each version is first checked byte for byte against the oracle
(``bench.write.check_case``: NaN / Inf / zero rows, negative slots, poisoned cache), then
timed next to a device copy of the same bytes, interleaved, ``--reps`` times::

    PYTHONPATH=. python3 bench/bench_write_versions.py HEAD 430b719 65324f4 71e181d

``--kernel`` picks the path through the file ("lanes", default, or "mma", the tensor-core
rotation). Since session 8 the launcher passes the kernel a table argument and the MMA flags, so
only files from that change on load into today's launcher; older ones need their own tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, ".")
import kernels._write_int4 as W  # noqa: E402
from bench import write as BW  # noqa: E402

PATH = "kernels/_write_int4_lanes.py"


def load(commit: str, tmp: str):
    src = subprocess.run(["git", "show", f"{commit}:{PATH}"], capture_output=True, text=True, check=True).stdout
    name = f"kernels._lanes_{commit.replace('~', '_').replace('^', '_')}"
    path = f"{tmp}/{name.split('.')[-1]}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)  # package "kernels": relative imports work
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def use(mod) -> None:
    W._reshape_and_cache_int4_lanes_kernel = mod._reshape_and_cache_int4_lanes_kernel
    W.fwht_asm = mod.fwht_asm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commits", nargs="+")
    p.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kernel", choices=("lanes", "mma"), default="lanes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_write_versions needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        mods = {c: load(c, tmp) for c in a.commits}
        for d in a.head_sizes:
            for c, m in mods.items():
                use(m)
                check = BW.check_case("int4", torch.bfloat16, d, 4096, dev, kernel=a.kernel)
                print(d, c, "check (rows, codes, max err)", check, flush=True)
            for rep in range(a.reps):
                _, nbytes = BW.time_write("int4", a.tokens, d, dev, kernel=a.kernel)
                copy_us = BW.time_copy(nbytes, dev)
                for c, m in mods.items():
                    use(m)
                    us, _ = BW.time_write("int4", a.tokens, d, dev, kernel=a.kernel)
                    print(f"d={d} rep={rep} {c} us={us:.1f} copy_us={copy_us:.1f} "
                          f"pct={100 * copy_us / us:.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
