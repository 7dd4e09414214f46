"""The cache as 16-bit code units: the view the code-unit and block-tile decode kernels read.

Host side: :func:`code_units` (the int16 views of K and V and their alignment, or None where the
view does not exist), :func:`decode_args` (the keyword arguments both kernels share) and
``DECODE_MODES`` (the kernels' ``MODE`` and code offset ``OFF`` per cache mode). Device side:
:func:`units_to_dot`.

The kernel reads cache rows as ``int16`` units: 4 INT4 nibbles (dims ``4u .. 4u+3``) or 2 INT8 /
FP8 bytes (dims ``2u, 2u+1``). Triton hands ``inline_asm_elementwise(pack=2)`` one 32-bit
register holding two units (two keys of V^T, or two units of a K row), and each output register
holds one dim of both, as fp16x2 (the dot operand layout wants pairs along its K axis).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from layouts import KVQuantMode

from .common import to_dot

MODE_INT8 = tl.constexpr(1)
MODE_FP8 = tl.constexpr(2)
MODE_INT4 = tl.constexpr(3)


@triton.jit
def _nib4_asm(u):
    """Two int16 units per 32-bit register ``r = [b0 b1 | b2 b3]`` -> 4 fp16x2, nibble ``x`` of
    both units minus 8: ``r & 0x000F000F`` is nibble 0, ``r & 0x00F000F0`` nibble 1 (times 16),
    ``r >> 8`` the same for nibbles 2 and 3; ``| 0x6400`` makes fp16 ``1024 + n`` (``1024 +
    16 n``), then minus 1032, or times 1/16 (0x2C00) minus 72 (0xD480): exact."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 h, c, r, m;
        mov.b32 c, 0x64086408;
        mov.b32 r, 0x2C002C00;
        mov.b32 m, 0xD480D480;
        shr.b32 h, $4, 8;
        lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $2, h, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $3, h, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, $0, c;
        fma.rn.f16x2 $1, $1, r, m;
        sub.f16x2 $2, $2, c;
        fma.rn.f16x2 $3, $3, r, m;
        }""",
        constraints="=r,=r,=r,=r,r", args=[u], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=2)


@triton.jit
def _int8x2_asm(u):
    """Two int16 units ``[b0 b1 | b2 b3]`` of int8 codes -> fp16x2 ``1152 + c`` of bytes (0, 2)
    and (1, 3): ``(c ^ 0x80) | 0x6400`` is fp16 ``1024 + c + 128``."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, h;
        mov.b32 h, 0x64646464;
        xor.b32 x, $2, 0x80808080;
        prmt.b32 $0, x, h, 0x4240;
        prmt.b32 $1, x, h, 0x4341;
        }""",
        constraints="=r,=r,r", args=[u], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _fp8x2_asm(u):
    """Two int16 units ``[b0 b1 | b2 b3]`` of e4m3 codes -> fp16x2 of bytes (0, 2) and (1, 3)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, z;
        .reg .b16 lo, hi;
        mov.b32 z, 0;
        prmt.b32 x, $2, z, 0x3120;
        mov.b32 {lo, hi}, x;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[u], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def units_to_dot(u, MODE: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr):
    """int16 code units -> (c0, c1, c2, c3) dot operands, ``cx`` = dim ``NOUT * unit + x`` plus
    the mode's offset (INT4 -8, INT8 1152, FP8 0); for INT8 / FP8 (2 dims per unit) c2, c3 repeat
    c0, c1 and are not used."""
    if ASM:
        if MODE == MODE_INT4:
            c0, c1, c2, c3 = _nib4_asm(u)
        elif MODE == MODE_INT8:
            c0, c1 = _int8x2_asm(u)
            c2, c3 = c0, c1
        else:
            c0, c1 = _fp8x2_asm(u)
            c2, c3 = c0, c1
    else:  # interpreter: plain integer ops, the same values
        w = u.to(tl.int32)
        if MODE == MODE_INT4:
            c0 = ((w & 0xF) - 8).to(tl.float32)
            c1 = (((w >> 4) & 0xF) - 8).to(tl.float32)
            c2 = (((w >> 8) & 0xF) - 8).to(tl.float32)
            c3 = (((w >> 12) & 0xF) - 8).to(tl.float32)
        elif MODE == MODE_INT8:
            c0 = (((w & 0xFF) ^ 0x80) + 1024).to(tl.float32)
            c1 = ((((w >> 8) & 0xFF) ^ 0x80) + 1024).to(tl.float32)
            c2, c3 = c0, c1
        else:
            c0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c2, c3 = c0, c1
        c0, c1, c2, c3 = to_dot(c0, DOT), to_dot(c1, DOT), to_dot(c2, DOT), to_dot(c3, DOT)
    return c0, c1, c2, c3


# kernel MODE and code offset OFF of the swapped-operand decode kernels (split, code units, block tiles)
DECODE_MODES = {KVQuantMode.INT8_PER_TOKEN_HEAD: (MODE_INT8.value, 1152.0),
                KVQuantMode.FP8_PER_TOKEN_HEAD: (MODE_FP8.value, 0.0),
                KVQuantMode.INT4_PER_TOKEN_HEAD: (MODE_INT4.value, -8.0)}


def code_units(k: torch.Tensor, v: torch.Tensor, mode: KVQuantMode):
    """``(k, v)`` as int16 code units and the unit alignment (2, 4 or 8) of their block and slot
    strides, or None where the code-unit kernels cannot read them (units < 16, rows not 4-byte aligned)."""
    if mode not in DECODE_MODES:
        return None
    if k.shape[3] * k.element_size() // 2 < 16 or k.stride(3) != 1 or v.stride(3) != 1:
        return None
    byte_strides = [s * t.element_size() for t in (k, v) for s in t.stride()[:3]]
    offsets = [t.storage_offset() * t.element_size() for t in (k, v)]
    if any(s % 4 for s in byte_strides + offsets):
        return None
    g = 0
    for s in byte_strides[:2] + byte_strides[3:5]:
        g = math.gcd(g, s // 2)
    return k.view(torch.int16), v.view(torch.int16), min(8, g & -g) if g else 8


def planned_units(call, plan) -> tuple:
    """The :func:`code_units` the plan found (``plan.unit_align``), as views: not checked again."""
    return call.k.view(torch.int16), call.v.view(torch.int16), plan.unit_align


def decode_args(call, query, units, q_scale, col_scale) -> dict:
    """The keyword arguments the code-unit and block-tile decode kernels share: tensors, scalars
    and strides (block / slot code strides divided by the units' alignment, ``ALIGN_BS``);
    ``call`` an ``AttnCall`` with its segment buffers, ``query`` what the kernel reads as q."""
    k16, v16, align = units
    ks, vs = call.ks.view(torch.int32), call.vs.view(torch.int32)
    return dict(
        q_ptr=query, k_ptr=k16, v_ptr=v16, k_scale_ptr=ks, v_scale_ptr=vs,
        segm_out_ptr=call.segm_output, segm_max_ptr=call.segm_max, segm_sum_ptr=call.segm_expsum,
        block_table_ptr=call.block_table, cu_seqlens_q_ptr=call.cu_seqlens_q.contiguous(),
        seqused_k_ptr=call.seqused_k.contiguous(),
        softmax_scale=q_scale, col_scale=col_scale, softcap=call.softcap,
        window_left=int(call.window_size[0]), window_right=int(call.window_size[1]),
        stride_q_t=query.stride(0), stride_q_h=query.stride(1), stride_q_d=query.stride(2),
        stride_k_b=k16.stride(0) // align, stride_k_s=k16.stride(1) // align,
        stride_v_b=v16.stride(0) // align, stride_v_s=v16.stride(1) // align,
        stride_ks_b=ks.stride(0), stride_ks_s=ks.stride(1), stride_ks_h=ks.stride(2),
        stride_vs_b=vs.stride(0), stride_vs_s=vs.stride(1), stride_vs_h=vs.stride(2),
        stride_bt_s=call.block_table.stride(0))
