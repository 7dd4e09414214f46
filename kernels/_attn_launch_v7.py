"""Launch of the INT8 / FP8 decode kernel v7 (``_attn_decode_v7``; EXPERIMENTAL, branch
``exp/session12-v7-int8``: not yet run on a GPU). Opt-in only: ``AttnConfig.v2 = 7``.

v7 reads the packed INT8 / FP8 cache of SPEC §4 at head_size 128 and block size 16, as
``layouts.split_kv_cache`` views it (V half right after the K half; each row's f32 scale right
after its 128 code bytes; blocks 16-byte aligned), with at most 8 KV heads (a power of two), at
most 8 query heads per KV head, and a query whose last dim is contiguous. It shares v6's ring
reservation and its switch-off on compile failure.
"""

from __future__ import annotations

import functools

import torch

from layouts import KVQuantMode

from . import _attn_launch_v6 as L6
from ._attn_launch_v6 import _RING_OFFSETS, MAX_REGISTERS, _bulk_capable, _reserve_ring, _Words, available

HEAD_SIZE = 128
BLOCK_SIZE = 16
ROW_BYTES = HEAD_SIZE + 4           # 132: 128 code bytes, then the f32 scale
MAX_KV_HEADS = 8
MAX_GROUP = 8
STAGES = 3                          # 3 x 33,792 bytes at 8 heads: two programs per SM fit
MODES = (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD)


@functools.lru_cache(maxsize=None)
def _kernel():
    try:
        from ._attn_decode_v7 import _attn_decode_v7_kernel
    except Exception:
        return None
    return _attn_decode_v7_kernel


def reads_layout(mode: KVQuantMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor,
                 vs: torch.Tensor) -> bool:
    """Whether the four views are the packed INT8 / FP8 cache v7 reads (any device)."""
    nkv = k.shape[2]
    if mode not in MODES or q.shape[2] != HEAD_SIZE or q.stride(2) != 1 or k.element_size() != 1:
        return False
    if k.shape[1] != BLOCK_SIZE or k.shape[3] != HEAD_SIZE:
        return False
    if nkv > MAX_KV_HEADS or nkv & (nkv - 1) or q.shape[1] % nkv or q.shape[1] // nkv > MAX_GROUP:
        return False
    half = BLOCK_SIZE * nkv * ROW_BYTES
    rows = (nkv * ROW_BYTES, ROW_BYTES, 1)
    if k.stride()[1:] != rows or v.stride()[1:] != rows or k.stride(0) != v.stride(0):
        return False
    if v.data_ptr() - k.data_ptr() != half or k.stride(0) < 2 * half or k.stride(0) % 16 or k.data_ptr() % 16:
        return False
    words = (k.stride(0) // 4, nkv * ROW_BYTES // 4, ROW_BYTES // 4)
    if ks.element_size() != 4 or ks.stride() != words or vs.stride() != words:
        return False
    return ks.data_ptr() == k.data_ptr() + HEAD_SIZE and vs.data_ptr() == v.data_ptr() + HEAD_SIZE


def v7_fit(mode, q, k, v, ks, vs) -> bool:
    """Whether v7 runs on this call: INT8 / FP8, a GPU v6 runs on (FP8 conversion: sm_89+), the
    packed layout."""
    if q.device.type != "cuda" or not reads_layout(mode, q, k, v, ks, vs) or not available(q.device):
        return False
    return mode != KVQuantMode.FP8_PER_TOKEN_HEAD or torch.cuda.get_device_capability(q.device) >= (8, 9)


def ring_bytes(num_kv_heads: int, stages: int, bulk: bool = False) -> int:
    """The ring's blocks, and with ``bulk`` one 8-byte mbarrier per stage (to 16 bytes)."""
    return stages * 2 * BLOCK_SIZE * num_kv_heads * ROW_BYTES + (-(-8 * stages // 16) * 16 if bulk else 0)


def launch_v7(q, k, mode, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg, group,
              segm_output, segm_max, segm_expsum, qk_scale, use_softcap, probe=False):
    """Launch ``_attn_decode_v7_kernel`` (grid: sequences x segments, one warp per KV head)."""
    nkv, stages = k.shape[2], max(2, cfg.num_stages)
    grid = (cu_seqlens_q.numel() - 1, cfg.num_segments)
    args = [q, _Words(k.data_ptr()), segm_output, segm_max, segm_expsum, block_table,
            cu_seqlens_q.contiguous(), seqused_k.contiguous(), float(qk_scale), float(softcap or 0.0),
            int(window_size[0]), int(window_size[1]), q.stride(0), q.stride(1), k.stride(0) // 4,
            block_table.stride(0), 0]
    bulk = L6.BULK and q.device.type == "cuda" and _bulk_capable(q.device.index or 0)  # v6's switch
    kw = dict(NUM_Q_HEADS=q.shape[1], NKV=nkv, GROUP=group, FP8=mode == KVQuantMode.FP8_PER_TOKEN_HEAD,
              USE_SOFTCAP=use_softcap, NUM_SEGMENTS=cfg.num_segments, STAGES=stages, PROBE=probe, BULK=bulk,
              num_warps=nkv, maxnreg=cfg.max_registers or MAX_REGISTERS)
    kernel = _kernel()
    key = (id(kernel), q.device.index, tuple(sorted(kw.items())))
    off = _RING_OFFSETS.get(key)
    if off is None:
        off = _RING_OFFSETS[key] = _reserve_ring(kernel.warmup(*args, grid=grid, **kw), ring_bytes(nkv, stages, bulk))
    args[-1] = off
    kernel[grid](*args, **kw)
