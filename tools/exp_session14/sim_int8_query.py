"""Session 14, CPU: what an int8 query would cost INT4 decode in accuracy (the "int8 key codes on
the score side" idea for v6). float64 attention of one token (32 query / 8 KV heads, head_size
128, 4,096 keys, random normal data, optionally 4 outlier channels ×8) on INT4-quantized
rotated keys (asymmetric, per token and head, as SPEC §3), with the rotated query exact, rounded
to fp16 (what v6 does), or rounded to int8 with a per-head absmax scale. Prints the relative L2
of each against the exact query. Run: ``python3 tools/exp_session14/sim_int8_query.py``."""
import math

import torch


def main() -> None:
    torch.manual_seed(0)
    d, hq, hk, n = 128, 32, 8, 4096
    g = hq // hk
    for dist in ("normal", "outlier channels"):
        q = torch.randn(hq, d, dtype=torch.float64)
        k = torch.randn(hk, n, d, dtype=torch.float64)
        v = torch.randn(hk, n, d, dtype=torch.float64)
        if dist != "normal":
            q[:, :4] *= 8
            k[:, :, :4] *= 8
        rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]  # an orthogonal rotation
        qr, kr = q @ rot, k @ rot
        lo, hi = kr.amin(-1, keepdim=True).clamp(max=0), kr.amax(-1, keepdim=True).clamp(min=0)
        sc = (hi - lo) / 15
        zp = torch.round(-lo / sc)
        kq = (torch.clamp(torch.round(kr / sc) + zp, 0, 15) - zp) * sc

        def attn(qx):
            s = torch.einsum("hgd,hnd->hgn", qx.view(hk, g, d), kq) / math.sqrt(d)
            return torch.einsum("hgn,hnd->hgd", torch.softmax(s, -1), v)

        ref = attn(qr)
        amax = qr.abs().amax(-1, keepdim=True)
        for name, qx in (("fp16 query", qr.to(torch.float16).to(torch.float64)),
                         ("int8 query", torch.round(qr / amax * 127) * amax / 127)):
            out = attn(qx)
            print(f"{dist}: {name}: relative L2 {((out - ref).norm() / ref.norm()).item():.2e}")


if __name__ == "__main__":
    main()
