"""Launch of the INT8 / FP8 decode kernel v7 (``_attn_decode_v7``): where it applies, its grid,
and when it is the default.

v7 reads the packed INT8 / FP8 cache of SPEC §4 at head_size 128 and block size 16, as
``layouts.split_kv_cache`` views it (V half right after the K half; each row's f32 scale right
after its 128 code bytes; blocks 16-byte aligned), with at most 8 KV heads (a power of two), at
most 8 query heads per KV head, and a query whose last dim is contiguous; FP8 needs sm_89+ (its
conversion instruction). It shares v6's ring reservation and bulk copies, and has its own
switch-off on compile failure (:func:`available`; one warning, then v4).

Defaults measured on the H200 (docs/bench/attention.md, "Session 13"; 32 query / 8 KV heads):
a ring of 2 blocks (3 was 1-4% slower), bulk copies (0-2% faster than ``cp.async``), segments
for two programs per SM as v6. v7 is the INT8 / FP8 default from ``V7_MIN_KEYS`` keys in the
batch: 1.31-1.50x faster than v4 from 262,144 keys (b8@32k, b16@16k, b64@4k, b32@32k); at
65,536 keys (b2@32k) equal to v4 (0.99-1.01x).
"""

from __future__ import annotations

import torch

from layouts import KVQuantMode

from . import _attn_launch_v6 as L6
from ._attn_launch_v6 import (_capable, bulk_copies, capability, large_batch, launch_gluon_decode, packed_views,
                              ring_bytes)

HEAD_SIZE = 128
ROW_BYTES = HEAD_SIZE + 4           # 132: 128 code bytes, then the f32 scale
STAGES = 2                          # ring depth: 2 x 33,792 bytes at 8 heads
V7_MIN_KEYS = 131072                # sequences x context from which v7 is the INT8 / FP8 default
PROBE = False                       # benchmarks only: copies without the maths (a read probe)
MODES = (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD)
_DISABLED: list = []                # why v7 was switched off in this process, if it was


def _kernel():
    """The v7 kernel (``_attn_launch_v6.gluon_kernel``)."""
    return L6.gluon_kernel("._attn_decode_v7", "_attn_decode_v7_kernel")


def available(device: torch.device) -> bool:
    """Whether v7 can run on ``device`` at all (CUDA, sm_80+, Gluon, not switched off by :func:`disable`)."""
    return not _DISABLED and device.type == "cuda" and _capable(device.index or 0) and _kernel() is not None


def disable(error: Exception) -> None:
    """Switch v7 off for this process after ``error`` (it did not compile here), with one warning."""
    L6.disable(error, _DISABLED, "INT8 / FP8 decode kernel (v7)", "INT8 / FP8 decode uses the v4 kernel instead")


def v7_default(mode: KVQuantMode, q: torch.Tensor, group: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """Whether a decode batch takes v7 by default (the cache layout is checked at launch:
    :func:`v7_fit`, else v4)."""
    return mode in MODES and large_batch(q, group, num_seqs, max_seqlen_k, V7_MIN_KEYS) and available(q.device)


def reads_layout(mode: KVQuantMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor,
                 vs: torch.Tensor) -> bool:
    """Whether the four views are the packed INT8 / FP8 cache v7 reads (any device)."""
    if mode not in MODES or q.shape[2] != HEAD_SIZE or q.stride(2) != 1 or k.element_size() != 1:
        return False
    return k.shape[3] == HEAD_SIZE and packed_views(q, k, v, ks, vs, HEAD_SIZE)


def v7_fit(mode, q, k, v, ks, vs) -> bool:
    """Whether v7 runs on this call: INT8 / FP8, a GPU v6 runs on (FP8 conversion: sm_89+), the
    packed layout."""
    if q.device.type != "cuda" or not reads_layout(mode, q, k, v, ks, vs) or not available(q.device):
        return False
    return mode != KVQuantMode.FP8_PER_TOKEN_HEAD or capability(q.device.index or 0) >= (8, 9)


def launch_v7(q, k, mode, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg, group,
              segm_output, segm_max, segm_expsum, qk_scale, use_softcap):
    """Launch ``_attn_decode_v7_kernel`` (grid: sequences x segments, one warp per KV head) on a
    cache :func:`v7_fit` accepts; ``qk_scale`` is the softmax scale (times ``log2 e`` without
    softcap). The ring has ``cfg.num_stages`` stages (at least 2)."""
    nkv, stages, bulk = k.shape[2], max(2, cfg.num_stages), bulk_copies(q.device)
    launch_gluon_decode(_kernel(), q, k, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg,
                        segm_output, segm_max, segm_expsum, qk_scale, ring_bytes(nkv, stages, bulk, ROW_BYTES),
                        NUM_Q_HEADS=q.shape[1], NKV=nkv, GROUP=group, FP8=mode == KVQuantMode.FP8_PER_TOKEN_HEAD,
                        USE_SOFTCAP=use_softcap, NUM_SEGMENTS=cfg.num_segments, STAGES=stages, PROBE=PROBE,
                        BULK=bulk)
