"""Launch of the INT4 decode kernel v6 (``_attn_decode_v6``): where it applies, its grid, and when
it is the default.

v6 needs a CUDA GPU of compute capability 8.0 or newer, Triton with the Gluon dialect, and one
cache layout: the packed INT4 cache of SPEC §4 at head_size 128 and block size 16, as
``layouts.split_kv_cache`` views it (V half right after the K half; each row's scale word right
after its 64 code bytes; blocks 16-byte aligned), with at most 8 KV heads (a power of two) and at most 8
query heads per KV head. Anything else goes to v4 / v3 (and on CPU to the interpreter). A kernel
that does not compile with the installed Triton switches v6 off for the process, with one
warning (:func:`disable`).

On sm_90+ each block is one bulk copy (``cp.async.bulk``, an mbarrier per ring slot; ``BULK``),
and v6 is launched with programmatic dependent launch where the launcher uses it (``PDL``): its
first block copies start before ``griddepcontrol.wait``, the rotated query is read after it.

The ring lives in dynamic shared memory after Triton's own: :func:`launch_v6` compiles each
variant once (``warmup``), and :func:`_reserve_ring` raises the compiled kernel's shared-memory
size by the ring before its first launch and passes the ring's offset to the kernel.

Defaults measured on the H200 (docs/bench/attention.md, "Session 12"; 32 query / 8 KV heads):
a ring of 4 blocks (3 and 4 within 1% of each other, 2 up to 2% slower; copies alone 5% slower
with 2), a 128-register cap (two programs of 8 warps per SM; the kernel needs 127), and segments
for about two programs per SM. v6 is the INT4 default from ``V6_MIN_KEYS`` keys in the batch
(sequences x context): 1.24-1.39x faster than v4 from 262,144 keys (b8@32k, b16@16k, b64@4k,
b32@32k), 1.04-1.14x at 131,072 (b4@32k, b8@16k, b16@8k, b32@4k, b64@2k). At 65,536 keys it
was 0.97-1.00x, and at b1@32k (256 programs of 8 blocks each) 0.66x. Session 13: bulk copies
0-2.5% faster than 16-byte ``cp.async``, PDL 0.8-2.2% faster (docs/bench/attention.md, "Session 13").
Session 18: only warp 0 runs the refills' code (``WARP0``), 4-7% faster; INT4 b8@32k 3.04x bf16.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import PTXASError

from layouts import KVQuantMode


HEAD_SIZE = 128
BLOCK_SIZE = 16
ROW_BYTES = HEAD_SIZE // 2 + 4      # 68: 64 code bytes, then the scale word
MAX_KV_HEADS = 8                    # one warp per KV head
MAX_GROUP = 8                       # query heads per KV head: the dots' N axis
STAGES = 4                          # ring depth (dynamic shared memory: 4 x 17,408 bytes at 8 heads)
MAX_REGISTERS = 128                 # two programs of 8 warps per SM (the kernel needs 127)
PROGRAMS_PER_SM = 2
V6_MIN_KEYS = 131072                # sequences x context from which v6 is the INT4 default
PROBE = False                       # benchmarks only: copies without the maths (a read probe)
PAIR = True                         # bulk copies and an even ring: two blocks per loop step (H200, session 14:
                                    # 4-5% faster, b8@32k 96.9 vs 101.4 µs; off: one block a step)
BULK = True                         # sm_90+: one bulk copy (TMA) per block, mbarriers (else cp.async)
PDL = True                          # programmatic dependent launch where the launcher uses it (sm_90+)
PDL_EARLY = True                    # with PDL: the query rotation releases v6 at its start
WARP0 = True                        # PAIR: only warp 0 runs the refills' code and the block-id queue (H200,
                                    # session 18: b8@32k 90.4 vs 95.5 µs, b32@32k 310.2 vs 323.2)


class RingUnsupported(RuntimeError):
    """This Triton's compiled-kernel object is not the one :func:`_reserve_ring` knows (3.6's)."""


# what a Triton whose Gluon (or compiled-kernel object) differs from the one v6 was written for
# (3.6) raises at the first launch
V6_COMPILE_ERRORS = (CompilationError, PTXASError, RingUnsupported)
_DISABLED: list = []                # why v6 was switched off in this process, if it was
_RING_OFFSETS: dict = {}            # (kernel, device, constexprs) -> the ring's offset in shared memory


@functools.lru_cache(maxsize=None)
def gluon_kernel(module: str, name: str):
    """Gluon kernel ``name`` of this package's ``module``, or None where this Triton has no Gluon
    dialect (or a different one): imported at the first call, so that importing the launchers
    never needs Gluon."""
    try:
        return getattr(importlib.import_module(module, __package__), name)
    except Exception:  # no triton.experimental.gluon, or an API this code does not know
        return None


def _kernel():
    """The v6 kernel (:func:`gluon_kernel`)."""
    return gluon_kernel("._attn_decode_v6", "_attn_decode_v6_kernel")


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple:
    """Compute capability of CUDA device ``index``, asked once (the launchers check it on every call)."""
    return torch.cuda.get_device_capability(index)


def _capable(index: int) -> bool:
    return capability(index) >= (8, 0)


def available(device: torch.device) -> bool:
    """Whether v6 can run on ``device`` at all (CUDA, sm_80+, Gluon, not switched off by :func:`disable`)."""
    return not _DISABLED and device.type == "cuda" and _capable(device.index or 0) and _kernel() is not None


def disable(error: Exception, disabled: "list | None" = None, what: str = "INT4 decode kernel (v6)",
            instead: str = "INT4 decode uses the v4 kernel instead") -> None:
    """Switch a Gluon kernel off for this process after ``error`` (it did not compile here), with
    one warning: v6 by default; v7 and the reduction pass their own ``disabled`` list and words
    (``instead``: what runs instead)."""
    disabled = _DISABLED if disabled is None else disabled
    if not disabled:
        last = (str(error).strip().splitlines() or [""])[-1]
        disabled.append(f"{type(error).__name__}: {last}")
        warnings.warn(f"kernels: the Gluon {what} did not compile with this Triton ({disabled[0]}); "
                      f"{instead}", RuntimeWarning, stacklevel=3)


def gluon_ran(disable, launch) -> bool:
    """Run ``launch`` (a Gluon kernel: v6, v7, the decode's rotation and reduction). If the kernel
    does not compile with this Triton (its Gluon API may differ from 3.6's), ``disable`` switches
    it off for the process with one warning, and False sends the call to the Triton kernel that
    stands in for it. Other errors (a CUDA error) raise."""
    try:
        launch()
    except V6_COMPILE_ERRORS as e:
        disable(e)
        return False
    except RuntimeError as e:  # an MLIR pass that does not lower a layout: a compile failure too
        if "PassManager::run failed" not in str(e):
            raise  # e.g. a CUDA error: not a reason to switch the kernel off
        disable(e)
        return False
    return True


class _Words:
    """The packed cache's base as an int32 pointer argument (Triton reads ``data_ptr`` and ``dtype``)."""

    dtype = torch.int32

    def __init__(self, ptr: int):
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def reads_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> bool:
    """Whether the four views are the packed INT4 cache v6 reads (any device): head_size 128,
    block size 16, 1-8 KV heads (a power of two), at most 8 query heads per KV head, V half right
    after the K half, each row's scale word right after its 64 code bytes, blocks at 16-byte
    aligned addresses. ``ks`` / ``vs``: the scale caches as 4-byte words."""
    if q.shape[2] != HEAD_SIZE or k.dtype != torch.uint8 or k.shape[3] != HEAD_SIZE // 2:
        return False
    return packed_views(q, k, v, ks, vs, HEAD_SIZE // 2)


def packed_views(q, k, v, ks, vs, code_bytes: int) -> bool:
    """The layout checks v6 and v7 share: block size 16, 1-8 KV heads (a power of two), at most 8
    query heads per KV head, rows of ``code_bytes`` codes then the 4-byte scale, V half right after
    the K half, blocks 16-byte aligned (copied whole), the scale views' word strides and
    addresses right after each row's codes."""
    nkv, row = k.shape[2], code_bytes + 4
    if k.shape[1] != BLOCK_SIZE or nkv > MAX_KV_HEADS or nkv & (nkv - 1) or q.shape[1] % nkv:
        return False
    if q.shape[1] // nkv > MAX_GROUP:
        return False
    half = BLOCK_SIZE * nkv * row
    rows = (nkv * row, row, 1)
    if k.stride()[1:] != rows or v.stride()[1:] != rows or k.stride(0) != v.stride(0):
        return False
    if v.data_ptr() - k.data_ptr() != half or k.stride(0) < 2 * half or k.stride(0) % 16 or k.data_ptr() % 16:
        return False  # blocks copied whole, 16 bytes at a time
    words = (k.stride(0) // 4, nkv * row // 4, row // 4)
    if ks.element_size() != 4 or ks.stride() != words or vs.stride() != words:
        return False
    return ks.data_ptr() == k.data_ptr() + code_bytes and vs.data_ptr() == v.data_ptr() + code_bytes


def v6_fit(mode: KVQuantMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor,
           vs: torch.Tensor) -> bool:
    """Whether v6 runs on this call: INT4, a CUDA tensor on a GPU v6 supports (:func:`available`),
    and a cache it reads (:func:`reads_layout`)."""
    return (mode == KVQuantMode.INT4_PER_TOKEN_HEAD and q.device.type == "cuda"
            and reads_layout(q, k, v, ks, vs) and available(q.device))


def v6_default(mode: KVQuantMode, q: torch.Tensor, group: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """Whether a decode batch takes v6 by default (the cache layout is checked at launch:
    :func:`v6_fit`, else v4)."""
    return (mode == KVQuantMode.INT4_PER_TOKEN_HEAD and large_batch(q, group, num_seqs, max_seqlen_k, V6_MIN_KEYS)
            and available(q.device))


def large_batch(q: torch.Tensor, group: int, num_seqs: int, max_seqlen_k: int, min_keys: int) -> bool:
    """The shape a Gluon decode kernel (v6, v7) takes by default: head_size 128, at most 8 query
    heads per KV head and 8 KV heads, and at least ``min_keys`` keys in the batch (sequences x context)."""
    return (q.shape[2] == HEAD_SIZE and group <= MAX_GROUP and q.shape[1] // group <= MAX_KV_HEADS
            and num_seqs * max_seqlen_k >= min_keys)


def v6_segments(num_sms: int, num_seqs: int, max_seqlen_k: int) -> int:
    """Segments per sequence for the Gluon decode kernels (v6, v7): about ``PROGRAMS_PER_SM``
    programs per SM (rounded down), at least 2, at most one per block, then the fewest segments
    that keep the same blocks per segment (the kernels give each segment ``ceil(blocks /
    segments)`` blocks). Not a power of two where the SMs divide otherwise: H200 (132 SMs),
    b12@16k 22 segments, b24@8k 11, b8@32k 33 (63 blocks each); b8@16k 32 (33 would leave one
    empty), b4@32k 64, b32@32k 8.

    Session 14 (``tools/exp_session14/probe_exact_segments.py``), against the power of two
    below, the rule before: INT4 b12@16k 80.0 vs 97.7 µs, b24@8k 83.7 vs 102.3; INT8 112.0 vs
    115.4 and 111.8 vs 116.4; b8@32k within 1.6% either way (INT4 101.1 / 100.8 and 100.8 /
    102.3 in two runs, INT8 144.5 / 142.2)."""
    blocks = max(1, -(-max_seqlen_k // BLOCK_SIZE))
    want = max(1, min(PROGRAMS_PER_SM * num_sms // max(1, num_seqs), blocks))
    per_segment = -(-blocks // want)
    return max(2, -(-blocks // per_segment))


def ring_bytes(num_kv_heads: int, stages: int, bulk: bool = False, row_bytes: int = ROW_BYTES) -> int:
    """Bytes of a Gluon decode kernel's ring: ``stages`` whole cache blocks (K and V halves) of
    ``num_kv_heads`` heads with rows of ``row_bytes`` (v6: 68, v7: 132), and with ``bulk`` copies
    one 8-byte mbarrier per stage after them (to 16 bytes)."""
    return stages * 2 * BLOCK_SIZE * num_kv_heads * row_bytes + (-(-8 * stages // 16) * 16 if bulk else 0)


def bulk_copies(device: torch.device) -> bool:
    """Whether the Gluon decode kernels copy each block with one bulk copy (``BULK``, sm_90+)."""
    return BULK and device.type == "cuda" and _bulk_capable(device.index or 0)


def _bulk_capable(index: int) -> bool:
    return capability(index) >= (9, 0)


def _reserve_ring(compiled, nbytes: int) -> int:
    """Make ``compiled`` (a Triton ``CompiledKernel`` not yet loaded) launch with ``nbytes`` more
    dynamic shared memory, after Triton's own, and return the ring's offset there (128-byte
    aligned). Done once per compiled kernel: Triton's cache keeps the object, so every later
    launch of it, CUDA graph captures included, gets the ring."""
    off = getattr(compiled, "_kv6_ring_off", None)
    if off is not None:
        return off
    if compiled.module is not None:  # loaded without the ring: its shared memory size is fixed
        raise RuntimeError("kernels: the v6 kernel was loaded before its shared-memory ring was reserved")
    meta, packed = getattr(compiled, "metadata", None), getattr(compiled, "packed_metadata", None)
    # Triton 3.6: a namedtuple, and the launch's (num_warps, num_ctas, shared)
    if not (hasattr(meta, "_replace") and isinstance(getattr(meta, "shared", None), int) and isinstance(packed, tuple)
            and packed == (meta.num_warps, meta.num_ctas, meta.shared)):
        raise RingUnsupported(f"kernels: cannot reserve v6's shared-memory ring in this Triton's compiled kernel "
                              f"({type(meta).__name__}, launch metadata {packed!r})")
    off = -(-meta.shared // 128) * 128
    compiled.metadata = meta._replace(shared=off + nbytes)
    compiled.packed_metadata = (meta.num_warps, meta.num_ctas, off + nbytes)
    compiled._kv6_ring_off = off
    return off


def launch_v6(q, k, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg, group,
              segm_output, segm_max, segm_expsum, qp, col_scale, use_softcap, use_pdl=False):
    """Launch ``_attn_decode_v6_kernel`` (grid: sequences x segments, one warp per KV head) on a
    cache :func:`v6_fit` accepts; ``qp`` is ``_prep_q_kernel``'s rotated query (4 parts). The
    ring has ``cfg.num_stages`` stages (at least 2); with bulk copies and an even ring the kernel
    takes two blocks a loop step (``PAIR``). ``use_pdl``: launched with programmatic dependent
    launch (the kernel waits for ``qp``'s writer before reading it)."""
    nkv, stages, bulk = k.shape[2], max(2, cfg.num_stages), bulk_copies(q.device)
    launch_gluon_decode(_kernel(), qp, k, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg,
                        segm_output, segm_max, segm_expsum, col_scale, ring_bytes(nkv, stages, bulk),
                        NUM_Q_HEADS=q.shape[1], NKV=nkv, GROUP=group, USE_SOFTCAP=use_softcap,
                        NUM_SEGMENTS=cfg.num_segments, STAGES=stages, PROBE=PROBE, BULK=bulk, PDL=use_pdl,
                        PAIR=PAIR and bulk and not PROBE and stages % 2 == 0, WARP0=WARP0,
                        launch_pdl=use_pdl)


def launch_gluon_decode(kernel, query, k, cu_seqlens_q, seqused_k, block_table, window_size, softcap, cfg,
                        segm_output, segm_max, segm_expsum, scale, ring: int, **kw):
    """The launch v6 and v7 share (grid: sequences x segments, one warp per KV head): their
    argument list (``scale``: v6's ``col_scale``, v7's ``qk_scale``; ``ring_off`` last), each
    variant compiled once (``warmup``; ``ring_off`` is not specialized on) and its ring of ``ring``
    bytes reserved before the first launch (:func:`_reserve_ring`), then launched; ``kw``: the
    kernel's constexprs and launch options."""
    grid = (cu_seqlens_q.numel() - 1, cfg.num_segments)
    args = [query, _Words(k.data_ptr()), segm_output, segm_max, segm_expsum, block_table,
            cu_seqlens_q.contiguous(), seqused_k.contiguous(), float(scale), float(softcap or 0.0),
            int(window_size[0]), int(window_size[1]), query.stride(0), query.stride(1), k.stride(0) // 4,
            block_table.stride(0)]
    kw.update(num_warps=k.shape[2], maxnreg=cfg.max_registers or MAX_REGISTERS)
    key = (id(kernel), query.device.index, tuple(sorted(kw.items())))
    off = _RING_OFFSETS.get(key)
    if off is None:
        off = _RING_OFFSETS[key] = _reserve_ring(kernel.warmup(*args, 0, grid=grid, **kw), ring)
    kernel[grid](*args, off, **kw)
