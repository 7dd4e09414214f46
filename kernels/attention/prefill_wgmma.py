"""Host side of the sm_90 prefill kernel (``prefill_wgmma_gluon``): which calls it takes, its
tilings, its tensor descriptors and its launch.

The planner (``plan._prefill_tiling``) sets ``Tiling.wgmma`` where :func:`eligible` holds on
an sm_90 GPU whose Triton has Gluon; ``prefill_2d.launch_2d`` then launches
:func:`launch` instead of the Triton kernel. The kernel reads K / V through 2D TMA descriptors
over the cache viewed as rows of ``num_kv_heads * head_size`` elements (one per slot; a block's
first row is ``block id x row_pitch``, ``row_pitch`` = block stride / slot stride, so K and V
halves of one block, as docs/LAYOUT.md lays them out, are rows of one view too). The cache must
be that view: head stride = ``head_size``, contiguous head dims, the block stride a multiple of
the slot stride, 16-byte aligned base and rows.
"""

from __future__ import annotations

import dataclasses

import torch

from layouts import CacheGeometry, KVQuantMode, split_kv_cache

from .common import LOG2E

# head_size -> (keys per tile, ring stages, fewest keys of the longest context it is chosen for):
# shared memory = query tile + stages x (K + V tiles) (sm_90 compile: head 64 144 KiB, head 128
# 224 KiB, head 256 192 KiB of the 227 available). Head 64 under 2,048 keys measured slower than
# the Triton kernel (docs/BENCHMARKS.md, "Prefill over a quantized cache").
TILINGS = {64: (128, 4, 2048), 128: (128, 3, 0), 256: (64, 2, 0)}
# head sizes at which INT4 rows kept rotated are read as int8 keys (``Tiling.int8_keys``, with
# ``Tuning(int8_key_prefill=True)``). H200, against fp16 keys: head 256 1.11-1.19x from 4k cached
# keys; head 128 0.99-1.02x from 8k to 32k (no gain past the machine's spread), 0.95-0.99x at 4k;
# head 64 0.84-0.88x (the scores' conversion costs more than the int8 MMAs save). docs/BENCHMARKS.md,
# "Prefill over a quantized cache".
INT8_KEY_HEADS = (256,)
# head sizes at which a dequantized scratch is read as blocks of a tile's keys (``Tiling.tile_blocks``:
# one TMA box a tile instead of one per 16-slot block). H200, two runs, INT8 / INT4 against the
# 16-slot scratch: head 64 1.02-1.07x, head 128 0.97-1.06x (2,048-token chunks 1.01-1.05x); head 256
# (64-key tiles, 4 blocks a tile) 0.95-1.07x, 1.01x on average: left off. docs/BENCHMARKS.md,
# "Prefill over a quantized cache".
TILE_BLOCK_HEADS = (64, 128)
BLOCK_M = 128                   # query rows per program (two consumer warpgroups of 64)
NUM_WARPS = 4                   # the default partition (a consumer); the other consumer and the producer are workers
MAX_REGS = 168                  # per thread at launch: 12 warps x 32 x 168 <= 65,536 (the partitions then
CONSUMER_REGS = 240             # take 240 / 240 / 24 with setmaxnreg)


def _tma_view_ok(x: torch.Tensor) -> bool:
    """``x`` ``[num_blocks, block_size, num_kv_heads, head_size]`` is the 2D view the kernel's
    descriptors take."""
    nb, bs, h, d = x.shape
    return (x.dtype in (torch.float16, torch.bfloat16) and x.stride(3) == 1 and x.stride(2) == d
            and x.stride(1) >= h * d and x.stride(0) % x.stride(1) == 0 and x.stride(0) >= bs * x.stride(1)
            and (x.stride(1) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


def eligible(call, dequant: bool) -> list:
    """Why the kernel cannot run ``call`` (empty list: it can). ``dequant``: the call will run over
    its dequantized fp16 scratch (``prefill_dequant``), whose layout always fits."""
    why = []
    head, bs = call.head_size, call.k.shape[1]
    if head not in TILINGS:
        why.append(f"head_size {head} not in {sorted(TILINGS)}")
        return why
    tile, _, min_keys = TILINGS[head]
    if call.max_seqlen_k < min_keys:
        why.append(f"contexts under {min_keys} keys at head_size {head}")
    if bs < 8 or bs & (bs - 1) or tile % bs:
        why.append(f"block_size {bs}: a power of two from 8 to {tile} is needed")
    if call.softcap > 0 or tuple(call.window_size) != (-1, -1):
        why.append("soft cap / sliding window")
    if call.group > BLOCK_M:
        why.append(f"{call.group} query heads per KV head > {BLOCK_M}")
    if call.q.stride(2) != 1 or call.out.stride(2) != 1:
        why.append("query / output head dims not contiguous")
    if call.out.element_size() != 2:
        why.append(f"{call.out.dtype} output: the kernel writes 16-bit rows")
    if not dequant and not (_tma_view_ok(call.k) and _tma_view_ok(call.v) and _pitch(call.k) == _pitch(call.v)):
        why.append("K / V not a 2D TMA view (16-bit, [blocks x slots, heads x dims], 16-byte aligned)")
    return why


def _pitch(x: torch.Tensor) -> int:
    """Rows (slots) from one cache block's first row to the next one's."""
    return x.stride(0) // x.stride(1)


def _descriptor(x: torch.Tensor, layout):
    """2D TMA descriptor over ``x``'s rows (the last block's last slot is its last row), boxes
    of one block's ``block_size`` rows x ``head_size`` dims."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    nb, bs, h, d = x.shape
    return TensorDescriptor(x, [(nb - 1) * _pitch(x) + bs, h * d], [x.stride(1), 1], [bs, d], layout)


def _scales_descriptor(ks: torch.Tensor, tile: int):
    """1D TMA descriptor over the int8 keys' scales (``ks`` contiguous), boxes of one tile's."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    flat = ks.view(-1)
    return TensorDescriptor(flat, [flat.numel()], [1], [tile], layout)


def probe(dev: torch.device, head: int, dtype: torch.dtype, group: int, block_size: int, causal: bool,
          int8_keys: bool = False) -> bool:
    """Whether the kernel compiles on ``dev`` for this shape class (``gluon_probe.compiles``: once
    per process, on empty tensors: nothing is launched); ``int8_keys``: its int8-key form over
    ``dtype`` values."""
    def compile_once():
        from .call import make_call
        from .plan import Path, Plan, Tiling
        geo = CacheGeometry(KVQuantMode.NONE, head, 1, block_size, dtype)
        views = split_kv_cache(geo.new_cache(2, device=dev), KVQuantMode.NONE, head)
        q = torch.empty(1, group, head, dtype=dtype, device=dev)
        idx = torch.empty(2, dtype=torch.int32, device=dev)
        call = make_call(q, views.key_cache, views.value_cache, torch.empty_like(q), idx, idx[1:], 1, 32, 1.0,
                         causal, (-1, -1), idx.view(1, 2), 0.0, KVQuantMode.NONE, views.k_scale_cache,
                         views.v_scale_cache)
        if int8_keys:
            call = dataclasses.replace(call, k=torch.empty(call.k.shape, dtype=torch.int8, device=dev),
                                       ks=torch.empty(call.k.shape[2], call.k.shape[0] * block_size,
                                                      dtype=torch.float32, device=dev))
        tile, stages, _ = TILINGS[head]
        launch(call, Plan(Path.PREFILL_2D, Tiling(BLOCK_M, tile, num_warps=NUM_WARPS, num_stages=stages, wgmma=True)),
               compile_only=True)
    from . import gluon_probe
    return gluon_probe.compiles("_prefill_wgmma_kernel", dev.index,
                                (head, str(dtype), group, block_size, causal, int8_keys),
                                compile_once, "the Triton 2D kernel runs instead")


def launch(call, plan, compile_only: bool = False) -> None:
    """Launch the kernel on ``call`` (16-bit K / V: a bf16 / fp16 cache or the dequantized
    scratch): grid (q tiles, KV heads), writes ``call.out``; ``compile_only``: compile, launch
    nothing (the probe)."""
    from triton.experimental.gluon import language as gl
    from .gluon_probe import require
    kernel = require("prefill_wgmma_gluon", "_prefill_wgmma_kernel")
    q, k, v, out = call.q, call.k, call.v, call.out
    bs, hkv, head = k.shape[1], k.shape[2], k.shape[3]
    tile, stages = plan.tiling.tile, plan.tiling.num_stages
    k8 = k.dtype == torch.int8
    types = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int8: gl.int8}
    k_layout = gl.NVMMASharedLayout.get_default_for([bs, head], types[k.dtype])
    v_layout = gl.NVMMASharedLayout.get_default_for([bs, head], types[v.dtype])
    block_q = BLOCK_M // call.group
    base = call.first_token // block_q
    grid = (q.shape[0] // block_q - base + call.num_seqs, hkv)
    k_desc, v_desc = _descriptor(k, k_layout), _descriptor(v, v_layout)
    if k8:  # the keys' scales [Hkv, num_seqs x blocks_per_seq x block_size], the scratch's identity table
        ks_desc, ks_head, ks_seq = _scales_descriptor(call.ks, tile), call.ks.stride(0), call.block_table.shape[1] * bs
    else:
        ks_desc, ks_head, ks_seq = k_desc, 0, 0  # unread
    args = (q, k_desc, v_desc, out, ks_desc,
            call.block_table, call.cu_seqlens_q.contiguous(), call.seqused_k.contiguous(),
            call.softmax_scale * LOG2E, call.num_seqs, base, k.shape[0], _pitch(k),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), call.block_table.stride(0), ks_head, ks_seq)
    kw = dict(GROUP=call.group, HEAD=head, BLOCK_SIZE=bs, BLOCK_Q=block_q, TILE=tile, STAGES=stages,
              CAUSAL=call.causal, CONSUMER_REGS=CONSUMER_REGS, K8=k8, num_warps=NUM_WARPS, maxnreg=MAX_REGS)
    if compile_only:
        kernel.warmup(*args, grid=grid, **kw)
    else:
        kernel[grid](*args, **kw)
