"""The plain-PyTorch oracle: rotation, signs, packing, INT4/INT8/FP8 round trips, edge rows.

These check the oracle directly against the formulas of docs/LAYOUT.md, "Quantization" (hand
formulas, exact identities), since every kernel test trusts it. Run: python -m pytest tests/test_reference.py
"""

import pytest
import torch

from kernels.reference import (NAN_SCALE_BITS, dequantize_int4_rows, dequantize_rows, fwht,
                               pack_int4_nibbles, quantize_int4_rows, quantize_rows, rht_signs,
                               single_rht, unpack_int4_nibbles)
from kernels.reference import reference_unified_attention
from layouts import KVQuantMode, LayoutError

M = KVQuantMode
DTYPES = [torch.bfloat16, torch.float16]


def _sylvester(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_signs_match_vllm_seed():
    assert rht_signs(8).tolist() == [1, -1, 1, 1, -1, -1, -1, -1]
    g = torch.Generator().manual_seed(0x9E3779B9)
    assert torch.equal(rht_signs(128), 2 * torch.bernoulli(torch.full((128,), 0.5), generator=g) - 1)


@pytest.mark.parametrize("d", [16, 64, 128, 256], ids=lambda d: f"h{d}")
def test_fwht_is_sylvester_matrix(d):
    x = torch.randn(5, d)
    torch.testing.assert_close(fwht(x), x @ _sylvester(d).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [16, 64, 128], ids=lambda d: f"h{d}")
def test_rht_inverse_is_d_times_identity(d):
    x = torch.randn(4, 3, d)
    y = single_rht(single_rht(x), inverse=True)
    torch.testing.assert_close(y, d * x, rtol=1e-5, atol=1e-4)
    s = rht_signs(d)
    torch.testing.assert_close(single_rht(x), (x * s) @ _sylvester(d).T, rtol=1e-5, atol=1e-4)


def test_rht_rounds_once_to_input_dtype():
    x = torch.randn(7, 64).bfloat16()
    r = single_rht(x)
    assert r.dtype == torch.bfloat16
    assert torch.equal(r, fwht(x.float() * rht_signs(64)).bfloat16())


def test_rht_rejects_bad_head_size():
    with pytest.raises(LayoutError, match="power of two"):
        single_rht(torch.randn(2, 96))


def test_pack_unpack_nibble_order():
    q = torch.tensor([[1, 2, 15, 0, 7, 8]])
    p = pack_int4_nibbles(q)
    assert p.tolist() == [[0x21, 0x0F, 0x87]]  # even element in the low nibble
    assert torch.equal(unpack_int4_nibbles(p), q.to(torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_int4_nibbles(torch.zeros(1, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("idx", [0, 5], ids=["onehot0", "onehot5"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
def test_int4_one_sided_rows_round_trip_exactly(dtype, idx, sign):
    # One-hot at 0 rotates to a constant row (one side of zero): the zero-inclusive range
    # puts it exactly on code 0 or 15, so it decodes to the input value once rounded back.
    x = torch.zeros(1, 64, dtype=dtype)
    x[0, idx] = sign * 2.75
    p, s = quantize_int4_rows(x)
    y = dequantize_int4_rows(p, s).to(dtype)
    if idx == 0:
        assert torch.equal(y, x)
    assert ((y.float() - x.float()).norm() / x.float().norm()) < 0.2


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_int4_rows_on_one_side_of_zero_decode_exactly(dtype):
    x = torch.zeros(3, 32, dtype=dtype)
    x[:, 0] = torch.tensor([0.5, -3.0, 100.0])
    p, s = quantize_int4_rows(x)
    assert torch.equal(dequantize_int4_rows(p, s).to(dtype), x)


def test_int4_zero_row_and_constant_row():
    z = torch.zeros(1, 64).bfloat16()
    p, s = quantize_int4_rows(z)
    assert torch.equal(dequantize_int4_rows(p, s), torch.zeros(1, 64))
    assert s.item() > 0  # scale clamps at 1e-6, no division by zero


@pytest.mark.parametrize("kind", ["constant", "gaussian", "outlier"])
def test_int4_error_within_half_step(kind):
    # Rounding error is <= scale/2 per rotated element; the rotation is H/sqrt(d) up to a
    # factor, so the row error in the original domain obeys ||x_hat - x||_2 <= scale / 2
    # (plus the bf16 rounding of the rotated row, well under 1%).
    x = {"constant": torch.full((4, 64), -0.25), "gaussian": torch.randn(4, 64),
         "outlier": torch.randn(4, 64) * torch.tensor([30.0] + [1.0] * 63)}[kind].bfloat16()
    p, s = quantize_int4_rows(x)
    err = (dequantize_int4_rows(p, s) - single_rht(single_rht(x), inverse=True).float() / 64).norm(dim=-1)
    step = s.view(torch.int32) & ~0xF
    assert (err <= 0.5 * step.view(torch.float32) * 1.001).all()


def test_int4_scale_bits_carry_zero_point():
    x = torch.randn(64, 128).bfloat16()
    p, s = quantize_int4_rows(x)
    r = single_rht(x).float()
    lo = r.amin(-1).clamp(max=0)
    hi = r.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    zp = s.view(torch.int32) & 0xF
    expect = torch.sign(-lo / scale) * torch.floor((-lo / scale).abs() + 0.5)
    assert torch.equal(zp, expect.clamp(0, 15).to(torch.int32))
    assert torch.equal(s.view(torch.int32) & ~0xF, scale.view(torch.int32) & ~0xF)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", [M.INT4_PER_TOKEN_HEAD, M.INT8_PER_TOKEN_HEAD, M.FP8_PER_TOKEN_HEAD],
                         ids=["int4", "int8", "fp8"])
def test_non_finite_rows_decode_to_nan_never_plausible(mode, bad):
    x = torch.randn(3, 64).bfloat16()
    x[1, 7] = bad
    data, scale = quantize_rows(x, mode)
    assert scale[1].view(torch.int32).item() == NAN_SCALE_BITS
    assert (data[1].view(torch.uint8) == 0).all()
    y = dequantize_rows(data, scale, mode)
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2]]).all()


def test_int8_round_half_to_even_and_clamp():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -127.0, 0.0, 3.0]]).bfloat16()
    q, s = quantize_rows(x, M.INT8_PER_TOKEN_HEAD)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -2, -127, 0, 3]]


def test_fp8_uses_full_range():
    x = torch.randn(8, 64).bfloat16()
    q, s = quantize_rows(x, M.FP8_PER_TOKEN_HEAD)
    assert q.dtype == torch.float8_e4m3fn
    assert (q.float().abs().amax(-1) == 448).all()
    torch.testing.assert_close(dequantize_rows(q, s, M.FP8_PER_TOKEN_HEAD), x.float(), rtol=0.07, atol=1e-2)


def test_rotation_reduces_int4_error_on_outlier_channels():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 3] *= 20  # one outlier channel, as real keys have
    x = x.bfloat16()
    p, s = quantize_int4_rows(x)
    rot = (dequantize_int4_rows(p, s) - x.float()).norm() / x.float().norm()
    # the same asymmetric 4-bit grid without rotation, for comparison
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True).clamp(max=0), xf.amax(-1, keepdim=True).clamp(min=0)
    sc = (hi - lo) / 15
    zp = torch.round(-lo / sc)
    q = torch.round(xf / sc + zp).clamp(0, 15)
    plain = ((q - zp) * sc - xf).norm() / xf.norm()
    assert rot < 0.6 * plain


def test_mse_optimal_encoder_never_worse():
    x = torch.randn(512, 64).bfloat16()
    base = quantize_int4_rows(x)
    best = quantize_int4_rows(x, shrink=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75))
    e = lambda ps: (dequantize_int4_rows(*ps, rotated=True) - single_rht(x).float()).square().sum(-1)  # noqa: E731
    assert (e(best) <= e(base) + 1e-6).all() and e(best).sum() < 0.95 * e(base).sum()


def test_reference_write_with_shrink():
    """The write oracle's ``shrink`` stores :func:`quantize_int4_rows`' MSE rows at their slots
    (negative slots skipped) and is refused for modes without range factors."""
    from kernels.reference import reference_reshape_and_cache
    shrink = (1.0, 0.9, 0.8)
    k, v = torch.randn(6, 2, 64).bfloat16(), torch.randn(6, 2, 64).bfloat16()
    slots = torch.tensor([5, -1, 0, 7, 2, 3])
    kc, vc = torch.zeros(2, 4, 2, 32, dtype=torch.uint8), torch.zeros(2, 4, 2, 32, dtype=torch.uint8)
    ks, vs = torch.zeros(2, 4, 2), torch.zeros(2, 4, 2)
    reference_reshape_and_cache(k, v, kc, vc, slots, KVQuantMode.INT4_PER_TOKEN_HEAD, ks, vs, shrink=shrink)
    for x, c, s in ((k, kc, ks), (v, vc, vs)):
        want_c, want_s = quantize_int4_rows(x[slots >= 0], shrink=shrink)
        keep = slots[slots >= 0]
        assert torch.equal(c.view(8, 2, 32)[keep], want_c)
        assert torch.equal(s.view(8, 2)[keep].view(torch.int32), want_s.view(torch.int32))
        assert (c.view(8, 2, 32)[[1, 4, 6]] == 0).all()  # slots no token maps to
    with pytest.raises(ValueError, match="only the INT4 encoder"):
        reference_reshape_and_cache(k, v, kc, vc, slots, KVQuantMode.INT8_PER_TOKEN_HEAD, ks, vs, shrink=shrink)


def test_reference_attention_matches_dense_softmax():
    # one sequence, whole cache in order: paged oracle == plain dense causal attention
    torch.manual_seed(1)
    nb, bs, hk, d, hq, n = 3, 4, 2, 16, 4, 10
    k = torch.randn(nb, bs, hk, d)
    v = torch.randn(nb, bs, hk, d)
    q = torch.randn(n, hq, d)
    out = reference_unified_attention(q, k, v, torch.tensor([0, n]), torch.tensor([n]),
                                      torch.tensor([[2, 0, 1]]), 0.25)
    kk = k[[2, 0, 1]].reshape(-1, hk, d)[:n].repeat_interleave(2, 1)
    vv = v[[2, 0, 1]].reshape(-1, hk, d)[:n].repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.25
    s = s.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))


def _imports(path):
    """Every module a source file imports: absolute names, and relative ones as ``.name``."""
    import ast
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_oracle_imports_no_kernel_and_no_kernel_imports_the_oracle():
    """The oracle (``kernels/reference/``) imports only torch, layouts and its own modules, so a
    kernel bug cannot hide in its twin; no production kernel module imports the oracle."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "kernels"
    for f in (root / "reference").glob("*.py"):
        for name in _imports(f):
            ok = name.split(".")[0] in ("__future__", "torch", "layouts") or name in (".attention", ".quant")
            assert ok, f"{f.name} imports {name}"
    for f in root.rglob("*.py"):
        if "reference" in f.parts or f in (root / "__init__.py", root / "paged_cache.py"):
            continue  # the package's re-exports and the object API's reference back end use it on purpose
        for name in _imports(f):
            assert "reference" not in name, f"{f.relative_to(root)} imports the oracle ({name})"
