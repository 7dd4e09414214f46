"""Host side of the whole-block-staged decode kernels (Gluon): which caches they read, their
segments, their shared-memory ring, their compile probe and their launch.

``decode_staged_int4_gluon`` (INT4) and ``decode_staged_int8_gluon`` (INT8 / FP8) copy whole
cache blocks (every KV head, K and V halves) into a ring in shared memory, one program per
(sequence, segment) and one warp per KV head. They read one layout only: the packed cache as
``layouts.split_kv_cache`` views it at head_size 128 and block size 16 (V half right after the
K half, each row's 4-byte scale right after its code bytes, blocks 16-byte aligned), with at
most 8 KV heads (a power of two) and at most 8 query heads per KV head; INT8 / FP8 also need a
query whose last dim is contiguous, FP8 an sm_89+ device (its conversion instruction).

They are the default from ``MIN_KEYS`` keys in the batch (sequences x context) on, one sequence
included: INT4 from 256, INT8 / FP8 from 4,096. Against the kernel the plan takes below that,
on the H200 (cold L2, read flush, call times, each pair timed in one job): 1.24-1.50x
``decode_block_tiles`` from 262,144 keys, 1.04-1.14x (INT4) at 131,072; at 65,536 keys b1@64k INT4
35.7-36.0 against 40.8-41.4 µs, INT8 46.2-46.8 against 51.7-51.8; INT8 at 32,768 keys b1@32k
24.4-24.5 against 28.5-28.6, b2@16k 24.3 against 29.3, b4@8k 24.2 against 29.2 (FP8 b1@32k
23.5-23.6 against 29.3-29.4). INT8 below that: b1@16k 17.7 against 20.0 (an earlier job: 21.7
against 18.8), b8@2k 16.7 against 19.3, b32@512 16.9 against 19.7, b8@1k 13.2 against 13.9, b1@8k
14.7 against 14.3, b2@2k 11.6 against 12.1, b8@512 10.5 against 10.8 (FP8 the same or better), and
block tiles ahead below 4,096 keys (b1@512 8.0 against 8.8). INT4 against ``decode_code_units``:
b1@4k 10.3 (64 segments) against 11.8, b2@2k 9.8 against 12.1, b4@1k 9.5 against 11.7, b1@2k 9.9
against 12.1, b1@1k 8.6 against 10.5, b1@512 7.7 against 8.9, b8@512 8.5 against 12.4, b1@256 7.5
against 8.9, b8@256 8.4 against 10.2. Up to 65,536 keys the programs run one per SM
(:func:`segments`), launched so (:func:`_spread_shared`).
Rings: INT4 4 blocks (3 and 4 within 1%, 2 up to 2% slower; 6-10 slower at one program per SM),
INT8 / FP8 2 (3 was 1-4% slower), 4 at one program per SM (:func:`stages`); a 128-register cap
(two programs of 8 warps per SM). On sm_90+ each block is one bulk copy (an mbarrier per ring
slot, 0-2.5% faster than 16-byte ``cp.async``), and both kernels are launched with
programmatic dependent launch, waiting (``griddepcontrol.wait``) before their first load: the
query and the cache may be the previous kernel's (INT8 / FP8: 0.1-0.5 µs a call against a plain
launch). The INT4 kernel rotates its query in its prologue (``Plan.rotate`` PROLOGUE), 0.5-1.6 µs
faster than a rotation kernel first from b1 to b32 (b2@4k 12.6 against 14.2, b1@32k 21.1 against
21.9); with the rotation kernel first (``Tuning(rotate_q_in_decode=False)``) its first block
copies start before its wait. Where the grid runs one program per SM, both kernels let the
reduction be scheduled at their start (``Plan.reduce_early``): INT4 b1@4k 9.5 against 10.3 µs,
b1@32k 18.5 against 18.8-18.9, INT8 b1@64k 39.2-39.3 against 40.0-40.2.

The ring lives in dynamic shared memory after Triton's own: each variant is compiled once
(``warmup``), and :func:`reserve_ring` raises the compiled kernel's shared-memory size by the
ring before its first launch and passes the ring's offset to the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from layouts import CacheGeometry, KVQuantMode, split_kv_cache

from .._jit import busy_segments
from . import gluon_probe
from .gluon_probe import RingUnsupported

HEAD_SIZE = 128
BLOCK_SIZE = 16
MAX_KV_HEADS = 8                    # one warp per KV head
MAX_GROUP = 8                       # query heads per KV head: the dots' N axis
MIN_KEYS = {"decode_staged_int4": 256,  # sequences x context from which the kernel is the default
            "decode_staged_int8": 4096}
STAGES = {"decode_staged_int4": 4,  # ring depth: 4 x 17,408 bytes at 8 heads
          "decode_staged_int8": 2}  # 2 x 33,792 bytes at 8 heads
SPREAD_STAGES = {"decode_staged_int4": 4,  # ring depth where the grid runs one program per SM (:func:`stages`)
                 "decode_staged_int8": 4}
ROW_BYTES = {"decode_staged_int4": HEAD_SIZE // 2 + 4,  # 68: 64 code bytes, then the scale word
             "decode_staged_int8": HEAD_SIZE + 4}       # 132: 128 code bytes, then the f32 scale
MAX_REGISTERS = 128                 # two programs of 8 warps per SM (the INT4 kernel needs 127)
PROGRAMS_PER_SM = 2                 # at most (registers)
MIN_BLOCKS_PER_PROGRAM = 32         # fewer programs, down to one per SM, before shorter ones
MIN_BLOCKS_PER_SEGMENT = 4          # fewer programs than SMs before shorter ones (two loop steps)
SPREAD = True                       # a grid that fits the SMs one program each is launched so (_spread_shared)
_KERNELS = {"decode_staged_int4": ("decode_staged_int4_gluon", "_decode_staged_int4_kernel"),
            "decode_staged_int8": ("decode_staged_int8_gluon", "_decode_staged_int8_kernel")}
_RING_OFFSETS: dict = {}            # (kernel, device, constexprs) -> the ring's offset in shared memory


def kernel(path: str):
    """The Gluon kernel of ``path`` (``gluon_probe.gluon_kernel``), or None without Gluon."""
    return gluon_probe.gluon_kernel(*_KERNELS[path])


def wants(path: str, head_size: int, group: int, num_kv_heads: int, num_seqs: int, max_seqlen_k: int) -> bool:
    """The shape the staged kernel ``path`` takes by default: head_size 128, at most 8 query heads
    per KV head and 8 KV heads, and at least ``MIN_KEYS[path]`` keys in the batch."""
    return (head_size == HEAD_SIZE and group <= MAX_GROUP and num_kv_heads <= MAX_KV_HEADS
            and num_seqs * max_seqlen_k >= MIN_KEYS[path])


def segments(num_sms: int, num_seqs: int, max_seqlen_k: int) -> int:
    """Segments per sequence: programs of at least ``MIN_BLOCKS_PER_PROGRAM`` blocks as long as
    that leaves one program per SM or more, and never more than ``PROGRAMS_PER_SM`` per SM
    (rounded down); segments of at least ``MIN_BLOCKS_PER_SEGMENT`` blocks even where that leaves
    SMs idle; at least 2, then the fewest segments that keep the same blocks per segment (the
    kernels give each segment ``ceil(blocks / segments)`` blocks).

    On 132 SMs, one program per SM: b1@64k 128 segments, b2@32k 64, b4@16k 32, b8@8k 16 and b16@4k
    8 (32 blocks each), b2@16k 64 and b8@4k 16 (16 blocks each), b1@16k 128 and b4@4k 32 (8 blocks
    each); two per SM: b1@128k 256, b4@32k 64, b8@32k 33 (63 blocks each), b12@16k 22, b24@8k 11
    and b32@32k 8. On the H200 (cold L2, read flush, call times), one program per SM against two of
    half the blocks: INT4 b2@32k 32.9-34.2 against 37.0-37.3 µs, b16@4k 32.8-33.0 against
    35.4-35.7, INT8 b2@32k 45.0-45.2 against 49.4-49.8; two per SM of 32 blocks against one of 64:
    INT4 b4@32k 52.8-53.5 against 54.7-54.8. Not a power of two where the SMs divide otherwise:
    against the power of two below, INT4 b12@16k 80.0 vs 97.7 µs, b24@8k 83.7 vs 102.3; b8@32k
    within 1.6% either way. Short contexts, INT4 (call times, H200, cold L2), segments of 4 blocks
    against 2 and 8: b1@4k 64 segments 10.30 µs against 128 10.67 and 32 11.95; b2@2k 32: 9.82
    against 64 10.10 and 16 11.55; b4@1k 16: 9.52 against 32 9.52 and 8 11.31; b1@2k 32: 9.52
    against 64 9.17."""
    blocks = max(1, -(-max_seqlen_k // BLOCK_SIZE))
    seqs = max(1, num_seqs)
    most = max(1, PROGRAMS_PER_SM * num_sms // seqs)
    want = min(most, max(num_sms // seqs, blocks // MIN_BLOCKS_PER_PROGRAM), max(1, blocks // MIN_BLOCKS_PER_SEGMENT))
    return max(2, busy_segments(max(1, want), blocks))


def stages(path: str, num_sms: int, num_seqs: int, num_segments: int) -> int:
    """Ring depth of ``path``: ``STAGES``, or ``SPREAD_STAGES`` where the grid runs one program per
    SM and the ring has the SM's shared memory to itself. On the H200 (cold L2, call times) INT8
    b1@64k with 2 / 4 / 6 blocks: 42.9-43.0 / 41.4-41.5 / 43.2-43.4 µs; INT4 b1@32k with 4 / 6 / 8:
    19.6 / 21.7-21.8 / 22.4. INT8 with 2 / 4 blocks on another start: b1@64k 41.1-41.3 / 39.3-39.7,
    b2@32k 41.9-42.0 / 39.8-39.9 (FP8 41.6 / 39.2), b4@16k 41.8-42.2 / 39.9-40.0, b8@8k 41.2-41.3 /
    39.7-39.8."""
    return SPREAD_STAGES[path] if max(1, num_seqs) * num_segments <= num_sms else STAGES[path]


def packed_views(q, k, v, ks, vs, code_bytes: int) -> bool:
    """The layout checks both kernels share: block size 16, 1-8 KV heads (a power of two), at most
    8 query heads per KV head, rows of ``code_bytes`` codes then the 4-byte scale, V half right
    after the K half, blocks 16-byte aligned (copied whole), the scale views' word strides and
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


def reads_layout(mode: KVQuantMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor,
                 vs: torch.Tensor) -> bool:
    """Whether the four views are the packed cache a staged kernel reads (any device); ``ks`` /
    ``vs``: the scale caches as 4-byte words."""
    if q.shape[2] != HEAD_SIZE or k.element_size() != 1:
        return False
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return k.dtype == torch.uint8 and k.shape[3] == HEAD_SIZE // 2 and packed_views(q, k, v, ks, vs, HEAD_SIZE // 2)
    if mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        return q.stride(2) == 1 and k.shape[3] == HEAD_SIZE and packed_views(q, k, v, ks, vs, HEAD_SIZE)
    return False


def ring_bytes(num_kv_heads: int, stages: int, bulk: bool = False,
               row_bytes: int = ROW_BYTES["decode_staged_int4"]) -> int:
    """Bytes of a ring: ``stages`` whole cache blocks (K and V halves) of ``num_kv_heads`` heads
    with rows of ``row_bytes``, and with ``bulk`` copies one 8-byte mbarrier per stage after them
    (to 16 bytes)."""
    return stages * 2 * BLOCK_SIZE * num_kv_heads * row_bytes + (-(-8 * stages // 16) * 16 if bulk else 0)


def reserve_ring(compiled, nbytes: int, min_shared: int = 0) -> int:
    """Make ``compiled`` (a Triton ``CompiledKernel`` not yet loaded) launch with ``nbytes`` more
    dynamic shared memory, after Triton's own (at least ``min_shared`` bytes in all), and return
    the ring's offset there (128-byte aligned). Done once per compiled kernel: Triton's cache
    keeps the object, so every later launch of it, CUDA graph captures included, gets the ring."""
    off = getattr(compiled, "_kv_ring_off", None)
    if off is not None:
        return off
    if compiled.module is not None:  # loaded without the ring: its shared memory size is fixed
        raise RuntimeError("kernels: a staged decode kernel was loaded before its shared-memory ring was reserved")
    meta, packed = getattr(compiled, "metadata", None), getattr(compiled, "packed_metadata", None)
    # Triton 3.6: a namedtuple, and the launch's (num_warps, num_ctas, shared)
    if not (hasattr(meta, "_replace") and isinstance(getattr(meta, "shared", None), int) and isinstance(packed, tuple)
            and packed == (meta.num_warps, meta.num_ctas, meta.shared)):
        raise RingUnsupported(f"kernels: cannot reserve the staged decode's shared-memory ring in this Triton's "
                              f"compiled kernel ({type(meta).__name__}, launch metadata {packed!r})")
    off = -(-meta.shared // 128) * 128
    shared = max(off + nbytes, min_shared)
    compiled.metadata = meta._replace(shared=shared)
    compiled.packed_metadata = (meta.num_warps, meta.num_ctas, shared)
    compiled._kv_ring_off = off
    return off


class _Words:
    """The packed cache's base as an int32 pointer argument (Triton reads ``data_ptr`` and ``dtype``)."""

    dtype = torch.int32

    def __init__(self, ptr: int):
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def _constexprs(path: str, call, plan, use_softcap: bool, stages: int) -> dict:
    """The kernel's constexprs and launch options for ``call`` under ``plan``."""
    nkv = call.k.shape[2]
    kw = dict(NUM_Q_HEADS=call.q.shape[1], NKV=nkv, GROUP=call.group, USE_SOFTCAP=use_softcap,
              NUM_SEGMENTS=plan.tiling.num_segments, STAGES=stages, BULK=plan.bulk_copies, PDL=plan.pdl,
              launch_pdl=plan.pdl)
    if path == "decode_staged_int4":  # with bulk copies and an even ring: two blocks per loop step
        kw.update(PAIR=plan.bulk_copies and stages % 2 == 0, UNROTATE=plan.unrotated,
                  ROTATE_Q=plan.rotate.value == "prologue")
    else:
        kw.update(FP8=call.mode == KVQuantMode.FP8_PER_TOKEN_HEAD)
    return kw


def _spread_shared(device: torch.device, programs: int) -> int:
    """Shared memory per program that keeps a second one off its SM (more than half an SM's), for
    a grid of ``programs`` that fits the SMs one each (:func:`segments`); 0 otherwise (two fit
    an SM by registers). Without it the scheduler may put two on one SM while others stay empty,
    and that SM sets the kernel's time: the INT4 kernel, launched while the query's rotation still
    runs (PDL), took b2@32k in 35.1-47.5 µs and b4@16k in 47.6-47.9 without it, 32.9-34.2 and
    34.1-34.2 with it (H200, cold L2); the INT8 kernel, launched after its predecessor ends, was
    the same either way."""
    if not SPREAD or device.type != "cuda":
        return 0
    sms, per_sm = _sm_limits(torch.cuda.current_device() if device.index is None else device.index)
    return per_sm // 2 if per_sm and programs <= sms else 0


@functools.lru_cache(maxsize=None)
def _sm_limits(index: int) -> tuple:
    """(SMs, shared memory bytes per SM) of CUDA device ``index``, asked once per device, not per
    launch; 0 bytes where this torch does not report it."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 0)


def launch(call, plan, query: torch.Tensor, scale: float, use_softcap: bool, *, q_scale: float = 1.0,
           compile_only: bool = False) -> None:
    """Launch the staged kernel of ``plan.path`` (grid: sequences x segments, one warp per KV
    head) on ``call`` (its segment buffers allocated). ``query``: INT4 the rotated query
    (``rotate_query``, 4 parts, fp32), or ``call.q`` where the kernel rotates it (``plan.rotate``
    PROLOGUE, ``q_scale`` the softmax scale), INT8 / FP8 ``call.q``; ``scale``: INT4 the key
    scales' factor ``col_scale``, INT8 / FP8 ``softmax_scale`` (times ``log2 e`` without softcap).
    Each variant is compiled once and its ring reserved before its first launch;
    ``compile_only``: that, and no launch (the compile probe)."""
    path = plan.path.value
    k, tiling = call.k, plan.tiling
    stages = max(2, tiling.num_stages)
    ring = ring_bytes(k.shape[2], stages, plan.bulk_copies, ROW_BYTES[path])
    fn = gluon_probe.require(*_KERNELS[path])
    grid = (call.num_seqs, tiling.num_segments)
    args = [query, _Words(k.data_ptr()), call.segm_output, call.segm_max, call.segm_expsum, call.block_table,
            call.cu_seqlens_q.contiguous(), call.seqused_k.contiguous()]
    if path == "decode_staged_int4":  # with plan.unrotated it writes the split output unrotated
        args.append(call.signs)
    args += [float(scale), call.softcap, int(call.window_size[0]), int(call.window_size[1])]
    if path == "decode_staged_int4":
        args += [float(q_scale), query.stride(0), query.stride(1), query.stride(2)]
    else:
        args += [query.stride(0), query.stride(1)]
    args += [k.stride(0) // 4, call.block_table.stride(0)]
    kw = _constexprs(path, call, plan, use_softcap, stages)
    sm_shared = _spread_shared(query.device, call.num_seqs * tiling.num_segments)
    kw.update(num_warps=k.shape[2], maxnreg=tiling.max_registers or MAX_REGISTERS, SPREAD=sm_shared > 0,
              RELEASE=plan.reduce_early)
    key = (id(fn), query.device.index, tuple(sorted(kw.items())))
    off = _RING_OFFSETS.get(key)
    if off is None:
        off = _RING_OFFSETS[key] = reserve_ring(fn.warmup(*args, 0, grid=grid, **kw), ring, sm_shared)
    if not compile_only:
        fn[grid](*args, off, **kw)


def probe(path: str, mode: KVQuantMode, dev: torch.device, num_kv_heads: int, group: int, stages: int, bulk: bool,
          pdl: bool, rotate_q: bool = False) -> bool:
    """Whether the staged kernel of ``path`` compiles on device ``dev`` for this shape class
    (``gluon_probe.compiles``: once per process, on a 2-block cache); ``rotate_q``: the INT4
    kernel that rotates its query itself."""
    def compile_once():
        from .call import make_call
        from .plan import Path, Plan, Rotate, Tiling
        geo = CacheGeometry(mode, HEAD_SIZE, num_kv_heads, BLOCK_SIZE, torch.bfloat16)
        views = split_kv_cache(geo.new_cache(2, device=dev), mode, HEAD_SIZE)
        # only shapes, dtypes and addresses matter: every tensor is empty (nothing is launched, so
        # this is safe inside a CUDA graph capture)
        q = torch.empty(1, num_kv_heads * group, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
        idx = torch.empty(2, dtype=torch.int32, device=dev)
        call = make_call(q, views.key_cache, views.value_cache, torch.empty_like(q), idx, idx[1:], 1, 32, 1.0,
                         True, (-1, -1), idx.view(1, 2), 0.0, mode, views.k_scale_cache, views.v_scale_cache)
        plan = Plan(Path(path), Tiling(16, 16, 2, num_kv_heads, stages), Rotate.PROLOGUE if rotate_q else Rotate.NONE,
                    pdl=pdl, bulk_copies=bulk)
        segm = torch.empty(1, q.shape[1], 2, HEAD_SIZE, dtype=torch.float32, device=dev)
        stats = torch.empty(1, q.shape[1], 2, dtype=torch.float32, device=dev)
        call = dataclasses.replace(call, segm_output=segm, segm_max=stats, segm_expsum=stats)
        int4 = path == "decode_staged_int4" and not rotate_q
        query = torch.empty(q.shape, dtype=torch.float32, device=dev) if int4 else q
        launch(call, plan, query, 1.0, False, compile_only=True)
    key = (mode.name, num_kv_heads, group, stages, bulk, pdl, rotate_q)
    return gluon_probe.compiles(_KERNELS[path][1], dev.index, key, compile_once,
                                "the query rotation kernel runs first" if rotate_q else
                                f"{path} falls back to decode_block_tiles")
