"""Session 13 diagnostic (H200 and CPU): the split-KV reduction with the INT4 inverse rotation against
the same reduction without it, rotated afterwards by float32 butterflies (``reference.fwht``),
at head_size 256 and 128. It showed the first Kronecker version computing in TF32 at 256 (Triton
turned its broadcast product and sum of [16, 16] tiles into a dot). Run from the repository root:
``PYTHONPATH=. python3 tools/exp_session13/diag_reduce_rotation.py`` (needs a CUDA GPU for its
cuda rows; output: ``docs/bench/raw/session13_reduce_rotation_diag.txt``)."""
import sys, torch
sys.path.insert(0, ".")
from kernels._attn_launch import launch_reduce
from kernels.reference import fwht, rht_signs
for d, segs in ((256, 5), (128, 8), (256, 1 << 1)):
    g = torch.Generator().manual_seed(d + segs)
    t, hq = 3, 4
    part = torch.randn(t, hq, segs, d, generator=g)
    mx = torch.randn(t, hq, segs, generator=g) * 4
    sm = torch.rand(t, hq, segs, generator=g) + 0.5
    for dev in ("cpu", "cuda"):
        plain = torch.empty(t, hq, d, device=dev)
        rot = torch.empty(t, hq, d, device=dev)
        launch_reduce(plain, part.to(dev), mx.to(dev), sm.to(dev), d, segs, None)
        launch_reduce(rot, part.to(dev), mx.to(dev), sm.to(dev), d, segs, rht_signs(d, dev))
        ref = fwht(plain.double().cpu()) * rht_signs(d).double() / d
        diff = (rot.double().cpu() - ref).abs()
        print(d, segs, dev, "rot vs fwht(plain):", f"{diff.max().item():.2e}", "max |ref|", f"{ref.abs().max().item():.2e}",
              "bad count", int((diff > 1e-6).sum()), "first bad", (diff > 1e-6).nonzero()[:4].tolist())
