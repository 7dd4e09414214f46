"""One paged-attention call, validated: :func:`make_call` checks every input once (typed
``LayoutError`` saying expected vs got, before anything touches the GPU) and returns an
:class:`AttnCall`, the one object the planner and every launcher read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from layouts import KVQuantMode, LayoutError, rht_signs

_CODE_DTYPES = {
    KVQuantMode.INT8_PER_TOKEN_HEAD: torch.int8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: torch.float8_e4m3fn,
    KVQuantMode.INT4_PER_TOKEN_HEAD: torch.uint8,
}
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttnCall:
    """The validated arguments of one call (shapes and dtypes as ``kernels.unified_attention``).

    ``ks`` / ``vs`` are the scale caches as the kernels read them: int32 bit views for INT4
    (scale | zero point), float32 for INT8 / FP8, a 1-element dummy for NONE. ``block_table``
    has a unit last stride (copied where it had not). ``signs`` is INT4's sign vector
    ([head_size] float32, ``layouts.rht_signs``), else None. The ``segm_*`` buffers are the
    caller's, or None until :func:`with_segment_buffers` allocates them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    signs: Optional[torch.Tensor]
    segm_output: Optional[torch.Tensor]
    segm_max: Optional[torch.Tensor]
    segm_expsum: Optional[torch.Tensor]
    mode: KVQuantMode
    softmax_scale: float
    causal: bool
    window_size: tuple
    softcap: float
    max_seqlen_q: int
    max_seqlen_k: int
    head_size: int
    group: int                      # query heads per KV head
    first_token: int = 0            # cu_seqlens_q[0], known on the host: > 0 for the chunk half of a mixed call

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_pad(self) -> int:
        """Last dim of ``segm_output``: ``max(16, next_pow2(head_size))``."""
        return max(16, 1 << (self.head_size - 1).bit_length())


def _fail(msg: str):
    raise LayoutError(f"unified_attention: {msg}")


def make_call(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_size, block_table, softcap, mode, k_scale_cache, v_scale_cache, segm_output=None,
              segm_max=None, segm_expsum=None) -> AttnCall:
    """Validate ``kernels.unified_attention``'s arguments (:func:`validate`) into an :class:`AttnCall`."""
    mode = KVQuantMode(mode)
    head_size, _, group = validate(q, k, v, out, cu_seqlens_q, seqused_k, block_table, mode, k_scale_cache,
                                   v_scale_cache, window_size, softcap, max_seqlen_q)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # the kernels read the scale words as int32 bits
        ks, vs = k_scale_cache.view(torch.int32), v_scale_cache.view(torch.int32)
    elif mode.per_token_head:
        ks, vs = k_scale_cache, v_scale_cache
    else:
        ks = vs = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    return AttnCall(
        q=q, k=k, v=v, out=out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        block_table=block_table if block_table.stride(1) == 1 else block_table.contiguous(), ks=ks, vs=vs,
        signs=rht_signs(head_size, q.device) if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else None,
        segm_output=segm_output, segm_max=segm_max, segm_expsum=segm_expsum, mode=mode,
        softmax_scale=float(softmax_scale), causal=bool(causal), window_size=tuple(window_size),
        softcap=float(softcap or 0.0), max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        head_size=head_size, group=group)


def validate(q, k, v, out, cu_seqlens_q, seqused_k, block_table, mode, k_scale_cache, v_scale_cache,
             window_size, softcap, max_seqlen_q):
    """Check every input; return ``(head_size, num_kv_heads, group)``. Raises LayoutError."""
    if mode == KVQuantMode.FP8_PER_TENSOR:
        raise LayoutError("unified_attention: fp8 per-tensor caches (FP8_PER_TENSOR) are not implemented; "
                          "use fp8_per_token_head")
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16):
        _fail(f"q must be [num_tokens, num_q_heads, head_size] bf16/fp16, got {tuple(q.shape)} {q.dtype}")
    num_tokens, num_q_heads, head_size = q.shape
    for name, t in (("k", k), ("v", v), ("out", out), ("cu_seqlens_q", cu_seqlens_q),
                    ("seqused_k", seqused_k), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != q.device:
            _fail(f"{name} is on {t.device}, expected q's device {q.device}")
    if k.dim() != 4 or k.shape != v.shape:
        _fail(f"k, v must both be [num_blocks, block_size, num_kv_heads, data_head_size], "
              f"got {tuple(k.shape)} and {tuple(v.shape)}")
    expected = q.dtype if mode == KVQuantMode.NONE else _CODE_DTYPES[mode]
    if k.dtype != expected or v.dtype != expected:
        _fail(f"{mode.name} cache dtype: expected {expected}, got k {k.dtype}, v {v.dtype}")
    num_kv_heads = k.shape[2]
    data_head = head_size // 2 if mode == KVQuantMode.INT4_PER_TOKEN_HEAD else head_size
    if k.shape[3] != data_head:
        _fail(f"cache last dim: expected {data_head} for {mode.name} head_size {head_size}, got {k.shape[3]}")
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD and (head_size < 32 or head_size & (head_size - 1)):
        _fail(f"INT4 attention needs head_size a power of two >= 32, got {head_size}")
    if num_q_heads % num_kv_heads:
        _fail(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out.shape != q.shape or out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail(f"out must be {tuple(q.shape)} bf16/fp16/fp32, got {tuple(out.shape)} {out.dtype}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in _INDEX_DTYPES or cu_seqlens_q.numel() < 2:
        _fail(f"cu_seqlens_q must be [num_seqs + 1] int32/int64, got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    num_seqs = cu_seqlens_q.numel() - 1
    if seqused_k.shape != (num_seqs,) or seqused_k.dtype not in _INDEX_DTYPES:
        _fail(f"seqused_k must be [{num_seqs}] int32/int64, got {tuple(seqused_k.shape)} {seqused_k.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] < num_seqs or block_table.dtype not in _INDEX_DTYPES:
        _fail(f"block_table must be [num_seqs={num_seqs}, max_blocks] int32/int64, "
              f"got {tuple(block_table.shape)} {block_table.dtype}")
    if mode.per_token_head:
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if t is None:
                _fail(f"{mode.name} needs {name} [num_blocks, block_size, num_kv_heads] float32, got None")
            if t.shape != k.shape[:3] or t.dtype != torch.float32 or t.device != q.device:
                _fail(f"{name} must be {tuple(k.shape[:3])} float32 on {q.device}, "
                      f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if len(tuple(window_size)) != 2 or not all(isinstance(w, int) for w in window_size):
        _fail(f"window_size must be (left, right) ints (-1 = unbounded), got {window_size!r}")
    if softcap is not None and softcap < 0:
        _fail(f"softcap must be >= 0 (0 = off), got {softcap}")
    if max_seqlen_q < 0:
        _fail(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    return head_size, num_kv_heads, num_q_heads // num_kv_heads


def check_num_decode_seqs(call: AttnCall, num_decode_seqs) -> int:
    """``num_decode_seqs`` as an int in ``[0, num_seqs]`` with at least that many query rows; LayoutError otherwise."""
    d = num_decode_seqs
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= min(call.num_seqs, call.q.shape[0]):
        _fail(f"num_decode_seqs must be an int in [0, min(num_seqs={call.num_seqs}, num_tokens={call.q.shape[0]})], "
              f"got {d!r}")
    return d


def split_mixed(call: AttnCall, d: int) -> tuple:
    """The two halves of a mixed call whose first ``d`` sequences have one query token each:
    ``(decode, chunk)``. Both are views, nothing is copied: the decode half is rows ``[0, d)`` of
    q / out, ``cu_seqlens_q[:d + 1]``, ``seqused_k[:d]``, ``block_table[:d]`` (a decode batch of
    its own, ``max_seqlen_q`` 1, the caller's segment buffers if any); the chunk half is
    sequences ``[d, num_seqs)`` over the whole q / out (``cu_seqlens_q[d:]`` holds absolute row
    offsets, ``first_token`` = d), no segment buffers."""
    decode = dataclasses.replace(call, q=call.q[:d], out=call.out[:d], cu_seqlens_q=call.cu_seqlens_q[:d + 1],
                                 seqused_k=call.seqused_k[:d], block_table=call.block_table[:d], max_seqlen_q=1)
    chunk = dataclasses.replace(call, cu_seqlens_q=call.cu_seqlens_q[d:], seqused_k=call.seqused_k[d:],
                                block_table=call.block_table[d:], segm_output=None, segm_max=None,
                                segm_expsum=None, first_token=call.first_token + d)
    return decode, chunk


def head_group(call: AttnCall, h0: int, h1: int) -> AttnCall:
    """KV heads ``[h0, h1)`` of ``call`` and their query heads: views of q / out / the caches
    (nothing copied; the kernels take the strides), as a call of its own. For calls without
    segment buffers (one segment)."""
    g = call.group
    return dataclasses.replace(call, q=call.q[:, h0 * g:h1 * g], out=call.out[:, h0 * g:h1 * g],
                               k=call.k[:, :, h0:h1], v=call.v[:, :, h0:h1],
                               ks=call.ks[:, :, h0:h1], vs=call.vs[:, :, h0:h1])


def with_segment_buffers(call: AttnCall, segs: int) -> AttnCall:
    """``call`` with the split path's scratch for ``segs`` segments: the caller's buffers,
    checked (contiguous float32 ``[>= num_tokens, num_q_heads, segs(, head_pad)]`` on q's
    device; LayoutError otherwise), or new ones."""
    q, head_pad = call.q, call.head_pad
    segm_output, segm_max, segm_expsum = call.segm_output, call.segm_max, call.segm_expsum
    num_tokens, num_q_heads = q.shape[:2]
    if segm_output is None:
        segm_output = torch.empty(num_tokens, num_q_heads, segs, head_pad, dtype=torch.float32, device=q.device)
        segm_max = torch.empty(num_tokens, num_q_heads, segs, dtype=torch.float32, device=q.device)
        segm_expsum = torch.empty_like(segm_max)
        return dataclasses.replace(call, segm_output=segm_output, segm_max=segm_max, segm_expsum=segm_expsum)
    for name, t, tail in (("softmax_segm_output", segm_output, (num_q_heads, segs, head_pad)),
                          ("softmax_segm_max", segm_max, (num_q_heads, segs)),
                          ("softmax_segm_expsum", segm_expsum, (num_q_heads, segs))):
        if (t is None or t.dtype != torch.float32 or t.device != q.device or not t.is_contiguous()
                or tuple(t.shape[1:]) != tail or t.shape[0] < num_tokens):
            got = None if t is None else (tuple(t.shape), t.dtype, str(t.device))
            _fail(f"{name} must be a contiguous float32 [>= {num_tokens}, {', '.join(map(str, tail))}] "
                  f"tensor on {q.device}, got {got}")
    return call


def kv_align(k, v) -> int:
    """Largest element count (<= 16 bytes) dividing every K/V block/slot/head stride.

    Packed rows are ``data + 4`` bytes (68 for INT4 d=128, 132 for INT8), a multiple of 4 but
    not of 16, which Triton's argument specialisation cannot see: it would fall back to 1-byte
    loads. Passing ``stride // align`` and multiplying by a constexpr restores word loads.
    """
    elem = k.element_size()
    g = 0
    for t in (k, v):
        for s in t.stride()[:3]:
            g = math.gcd(g, s)
    align = 16 // elem
    while align > 1 and g % align:
        align //= 2
    return align
