"""Split-KV INT4 decode, whole cache blocks staged in shared memory, every KV head, one warp each.

Written in Gluon (``triton.experimental.gluon``, Triton 3.6, NVIDIA sm_80+) with inline PTX for
the shared-memory ring; the Triton kernels serve everything else (and the CPU). Host side
(layout checks, segments, ring, launch): ``decode_staged.py``. The helpers of the ring (copies,
barriers, block-id queue, tile range, output rows) are shared with ``decode_staged_int8_gluon``.

This module is over 400 lines because the kernel and its ring helpers are one piece of inline
PTX addressing: split apart they would be read apart.

**Why.** ``decode_block_tiles`` reads each KV head's 68-byte rows on their own, 544 bytes
apart, and runs at that access pattern's rate. Here one program per (sequence, segment) holds
every KV head, and each cache block is copied as it lies in the packed cache
(docs/LAYOUT.md: ``2 x 16 x num_kv_heads x 68`` contiguous bytes: K half, then V half) by
16-byte ``cp.async`` into a ring of ``STAGES`` blocks; each thread copies 4.25 chunks with
immediate offsets from one address. Each warp then reads its head's rows, codes and scale words,
with ``ld.shared.b32`` at immediate offsets from one address per thread. Gluon's shared layouts
cannot state the 17-word row pitch in Triton 3.6 (the padded layout is not lowered on NVIDIA,
and TMA boxes cannot start at 68-byte offsets), so the ring is addressed by the kernel's own
inline PTX, in dynamic shared memory after Triton's own: the launcher reserves it
(``decode_staged.reserve_ring``) and passes its offset (``ring_off``); a small Triton
allocation (``anchor``) makes the kernel declare ``global_smem``, the base it is addressed from.

**Maths** (as ``decode_block_tiles``; docs/LAYOUT.md). The query is rotated and scaled in 4
parts, by each program in its prologue (``ROTATE_Q``, :func:`_query_operands`: lane butterflies,
about 350 SASS instructions once per program) or by ``_rotate_query_kernel`` first. Nibble
``n`` of 32-bit code word ``w`` is dim ``8 w + n``. Scores take 8
``mma.m16n8k16`` k-steps of 16 dims: k-step ``i`` holds nibbles ``v = i % 4`` and ``v + 4`` of
words ``8 (i // 4)`` to ``8 (i // 4) + 7``, each K pair of the A operand being one word's two
nibbles, so a word goes from shared memory into one fp16x2 register per ``v`` in 5 instructions
(``_nib4``): ``1024 + c`` for even ``v``, ``1024 + 16 c`` for odd ``v`` (the query's odd parts
are pre-divided by 16; its k-step ``i`` is 16 contiguous values of the rotated query's part
``v``). Each dot starts from minus its offset and zero-point share: per key
for the scores, per tile for the values. The tensor cores add that share to the products, so no
large offset is left to cancel in the fp32 sums (cancelling it once per segment instead gave a
relative L2 of 2.9e-3 at b32@32k against ``decode_block_tiles``' 1.6e-3). The values' share is itself a dot:
the probabilities times a row of ``-(1024 + zp)`` per key (``-(1024 + 16 zp)`` for odd ``n``), so
its result has the accumulator's layout with no reduction across lanes. The per-token key scale
is applied to the score tile. The online softmax keeps its running max over
``s + log2(v_scale)``: then ``P' = p * v_scale <= 1`` goes to fp16 with no per-tile
normaliser, and the accumulators and the sum share the max's units (the reduction kernel sees
that max). The value product is ``N_n^T . P'`` per nibble position ``n``, with the keys as the K
axis: a K pair is two keys' nibble ``n`` of the same word, which one PTX block (``_nib8``) builds
from two words in 6 instructions a word.
The query heads of a KV head are the N axis (8, ``GROUP`` used).

**Two blocks a step** (``PAIR``: bulk copies and an even ring): each loop step waits for two
adjacent ring slots and takes both blocks' scores through one online-softmax step (one running
max, one ``alpha``), so the accumulators' rescale, the cross-lane max and the ring's barrier and
refill are paid once per 32 keys: 619-627 SASS instructions per step against 355 per block
(sm_90, 6 / 4 stages, 128 registers, no spills), 4-5% faster on the H200. Both
blocks' offset and zero-point shares go into the first block's value dots (one ``c`` per nibble
parity), so the second block's offset cancels one fp32 rounding later: relative L2 against the
oracle 1.84e-3 instead of 1.76e-3 at b8@32k.

**Masks only at the edges** (``PAIR``): a step whose 32 keys are all visible (inside the window,
before the sequence's end, both tiles in the segment) runs ``_pair_step`` without the masks'
compares and selects; only the steps at a segment's edges mask. Offline sm_90: 595 SASS
instructions per unmasked step (warps 1..: 492), 644 per masked step, against 647 (544) for
every step when each masked. With the 5-instruction key conversion, on the H200 (cold L2, call
times): b8@32k 84.2 against 86.7-86.9 µs, b32@32k 280.9-281.6 against 291.7-292.4, b4@32k
51.1-51.3 against 52.5-52.7; batch 1-2 within the runs' spread.

**Output stores**: each thread holds dims ``8 w`` to ``8 w + 7`` of its output rows, one per
accumulator, and writes them as two 16-byte stores (``_store4``); eight 4-byte stores 32 bytes
apart made every program's last act 4,096 partial-sector writes, which the H200 paid for at
every batch: b1@32k 23.8 -> 19.7 µs, b4@32k 51.3 -> 44.4, b8@32k 84.7 -> 79.6, b32@32k 277.7
-> 274.3 (cold L2, call times).

**Warp 0 refills** (with ``PAIR``): one thread issues each bulk copy, so the copies' address
and mbarrier arithmetic and the block-id queue's loads run in warp 0 alone, behind a branch on
``%tid.x < 32``: warps 1.. run 543 SASS instructions per step and warp 0 647 (offline sm_90),
against 624 for every warp, 4-7% faster on the H200. Every warp still meets at the block
barrier before the refills.

**Prologue order**: a program's first copies wait on a chain of loads (the sequence's lengths,
then its block ids, then the blocks). The three lengths are loaded together (the early-return
branch reads all three, or the compiler sinks the last below it), and with ``ROTATE_Q`` the
query rows are loaded as soon as the token is known (:func:`_query_load`) but rotated only after
the first copies are queued, so the rotation runs while they land: in a test build reading the
clock, b1@4k's first loop step started 3.4 µs after the program did, against 3.9 with the query
loaded and rotated after the copies were queued (its rotation was then the longer chain).

**Unrotated split output** (``_unrotate``): each segment's accumulators get the inverse rotation
``s * H acc / 128`` before they are stored (it is linear, so it commutes with the merge), in
registers and lane shuffles, about 360 SASS instructions once per program. The reduction is
then a plain weighted sum of each dim, which it spreads over more programs than the 32 query
heads of a batch-1 call (``reduce.dim_split``).

Writes the split buffers of ``reduce._attn_reduce_kernel`` (natural dims). Masked keys
(past the sequence, outside the window) get a ``-inf`` score and a zero value scale, so
poisoned bytes in a block's unused rows never reach the output.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_pdl import gdc_release, gdc_wait
from .rotate_query_gluon import _bfly

HEAD = gl.constexpr(128)        # head_size this kernel reads
WORDS = gl.constexpr(16)        # 32-bit code words per row (HEAD / 8)
ROW = gl.constexpr(17)          # words per row: the codes and the scale word
BLOCK = gl.constexpr(16)        # tokens per cache block (the tile)


@gluon.jit
def _ring_base(ring_off):
    """Shared-window address of the ring: ``ring_off`` bytes past ``global_smem``, Triton's base of
    the dynamic shared memory (declared because the kernel stores into ``anchor``; a function-scope
    ``.extern .shared`` array of its own does not assemble)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .u32 b; mov.u32 b, global_smem; add.u32 $0, b, $1; }",
        constraints="=r,r", args=[ring_off], dtype=gl.int32, is_pure=False, pack=1)


@gluon.constexpr_function
def _copy_asm(nkv, rounds):
    """PTX of one thread's share of a block copy (``2 x 16 x nkv`` rows of ``4 rounds + 1`` words:
    ``8 x nkv x (4 rounds + 1)`` chunks of 16 bytes over ``32 x nkv`` threads, thread-major):
    ``cp.async.cg`` at ``$1`` / ``$2`` and ``rounds - 1`` more a step of ``32 x nkv x 16`` bytes
    apart where ``$3`` (the block is copied), one more where ``$4`` (the tail: the first
    ``8 x nkv`` threads). INT4's 68-byte rows: 4 rounds; INT8 / FP8's 132-byte rows: 8."""
    step = 512 * nkv
    lines = [f"@p cp.async.cg.shared.global [$1+{i * step}], [$2+{i * step}], 16;" for i in range(rounds)]
    return ("{ .reg .pred p; setp.ne.b32 p, $3, 0; " + " ".join(lines) + " setp.ne.b32 p, $4, 0; "
            f"@p cp.async.cg.shared.global [$1+{rounds * step}], [$2+{rounds * step}], 16; mov.b32 $0, 0; }}")


@gluon.constexpr_function
def _lds_asm(nkv, kind):
    """PTX of ``ld.shared.b32`` of a thread's 8 registers at constant offsets from its first
    address, for a key pitch of ``ks = 68 x nkv`` bytes (:func:`_ld8`). ``kind``: "k" (key-code
    words of dot operand A, in register order: keys r, r + 8 x words c, c + 4, each word in both
    registers of its K pair, since one word holds the pair's two nibbles), "k8" (the same for words
    c + 8, c + 12) or "v" (value-code words: words r, r + 8 x keys 2c, 2c + 1, 2c + 8, 2c + 9)."""
    ks = 68 * nkv
    if kind in ("k", "k8"):  # 4 loads, each word copied to the pair's second register
        base = 0 if kind == "k" else 32
        return " ".join(f"ld.shared.b32 ${2 * i}, [$8+{base + off}]; mov.b32 ${2 * i + 1}, ${2 * i};"
                        for i, off in enumerate([0, 8 * ks, 16, 8 * ks + 16]))
    return _lds_lines([0, ks, 32, 32 + ks, 8 * ks, 9 * ks, 32 + 8 * ks, 32 + 9 * ks])


@gluon.constexpr_function
def _scales_asm(nkv, row_bytes):
    """PTX: the scale words of keys r and r + 8 (``8 x row_bytes x nkv`` bytes apart)."""
    return _lds_lines([0, 8 * row_bytes * nkv])


@gluon.constexpr_function
def _lds_lines(offsets):
    """PTX: ``ld.shared.b32`` of output ``i`` at byte ``offsets[i]`` from the address operand after the outputs."""
    n = len(offsets)
    return " ".join(f"ld.shared.b32 ${i}, [${n}+{offsets[i]}];" for i in range(n))


@gluon.constexpr_function
def _zp_asm(nkv):
    """PTX: the value scale words of keys 2c, 2c + 1, 2c + 8, 2c + 9 (``68 x nkv`` bytes apart) ->
    dot operand A registers of ``-(1024 + zp)`` (even nibbles) and ``-(1024 + 16 zp)`` (odd),
    fp16x2, the same in rows r and r + 8."""
    ks = 68 * nkv
    half = []
    for reg in range(2):  # keys 2c, 2c + 1, then 2c + 8, 2c + 9 (no tuple targets: Triton parses this body)
        lo = 8 * ks * reg
        hi = lo + ks
        e = 2 * reg
        o = 4 + 2 * reg
        half.append(f"ld.shared.b32 a, [$8+{lo}]; ld.shared.b32 b, [$8+{hi}]; prmt.b32 x, a, b, 0x5410; "
                    f"lop3.b32 ${e}, x, 0x000F000F, 0xE400E400, 0xEA; mov.b32 ${e + 1}, ${e}; shl.b32 x, x, 4; "
                    f"lop3.b32 ${o}, x, 0x00F000F0, 0xE400E400, 0xEA; mov.b32 ${o + 1}, ${o};")
    return "{ .reg .b32 a, b, x; " + " ".join(half) + " }"


LD8 = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r")


@gluon.jit
def _copy_block(saddr, gaddr, ok, tail, NKV: gl.constexpr, ROUNDS: gl.constexpr):
    """Queue one thread's 16-byte copies of a block (:func:`_copy_asm`)."""
    return gl.inline_asm_elementwise(asm=_copy_asm(NKV, ROUNDS), constraints="=r,r,l,r,r",
                                     args=[saddr, gaddr, ok.to(gl.int32), (tail & ok).to(gl.int32)],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ld8(addr, ASM: gl.constexpr):
    """8 words per thread from the ring, at the constant offsets of ``ASM`` (a module's
    ``_lds_asm``: a block of 68-byte rows here, of 132 in ``decode_staged_int8_gluon``) from each
    thread's first address, which ``addr`` holds in all its elements; in dot operand A register order. Not pure: ordered after
    the ring's barrier."""
    return gl.inline_asm_elementwise(asm=ASM, constraints=LD8, args=[addr], dtype=gl.int32, is_pure=False, pack=8)


@gluon.jit
def _ld_codes(addr, NKV: gl.constexpr, KIND: gl.constexpr):
    """A warp's code words of one block, dot operand A (``KIND`` "k": ``[NKV, TILE, WORDS]``, "v":
    ``[NKV, WORDS, TILE]``)."""
    return _ld8(addr, _lds_asm(NKV, KIND))


@gluon.jit
def _ld_scales(addr, NKV: gl.constexpr, ROW_BYTES: gl.constexpr = 68):
    """The scale words of keys r and r + 8 (``[NKV, TILE]``, per key) from each thread's first
    address, for rows of ``ROW_BYTES`` (INT4: 68, INT8 / FP8: 132)."""
    return gl.inline_asm_elementwise(asm=_scales_asm(NKV, ROW_BYTES), constraints="=r,=r,r,r", args=[addr],
                                     dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _ld_zero_points(addr, NKV: gl.constexpr):
    """The value zero points of a block as dot operand A ``[NKV, 16, TILE]`` fp16 (each row: the
    keys' ``-(1024 + zp)``, and ``-(1024 + 16 zp)`` for odd nibbles), from each thread's first scale
    word address: a dot with the probabilities gives each tile's offset and zero-point share."""
    return gl.inline_asm_elementwise(asm=_zp_asm(NKV), constraints=LD8, args=[addr], dtype=(gl.float16, gl.float16),
                                     is_pure=False, pack=8)


@gluon.jit
def _store4(ptr, a, b, c, d, ok):
    """``st.global.v4.f32`` of ``(a, b, c, d)`` at each element's ``ptr`` (16-byte aligned) where ``ok``."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $6, 0; @p st.global.v4.f32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0; }",
        constraints="=r,l,r,r,r,r,r", args=[ptr, a.to(gl.int32, bitcast=True), b.to(gl.int32, bitcast=True),
                                            c.to(gl.int32, bitcast=True), d.to(gl.int32, bitcast=True),
                                            ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _lg2(x):
    """``lg2.approx`` (MUFU; ``gl.log2`` is libdevice's polynomial): only the running max uses it."""
    return gl.inline_asm_elementwise(asm="lg2.approx.ftz.f32 $0, $1;", constraints="=r,r", args=[x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _nib8(w):
    """Two 32-bit code words per instance (adjacent along the dot's K axis) -> 8 fp16x2, nibble
    ``n`` of both words as fp16 ``1024 + c`` (even ``n``) or ``1024 + 16 c`` (odd ``n``)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x;
        prmt.b32 x, $8, $9, 0x5410;
        lop3.b32 $0, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, x, 0x00F000F0, 0x64006400, 0xEA;
        shr.b32 x, x, 8;
        lop3.b32 $2, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $3, x, 0x00F000F0, 0x64006400, 0xEA;
        prmt.b32 x, $8, $9, 0x7632;
        lop3.b32 $4, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $5, x, 0x00F000F0, 0x64006400, 0xEA;
        shr.b32 x, x, 8;
        lop3.b32 $6, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $7, x, 0x00F000F0, 0x64006400, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=2)


# Key codes: one 32-bit code word per K pair -> 4 fp16x2 (:func:`_nib4`)
NIB4_ASM = gl.constexpr("""{
        .reg .b32 x;
        lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
        shr.b32 x, $4, 8;
        lop3.b32 $2, x, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $3, x, 0x00F000F0, 0x64006400, 0xEA;
        }""")


@gluon.jit
def _nib4(w):
    """Key codes: one 32-bit code word per K pair (both elements of the pair hold it) -> 4 fp16x2,
    register ``v`` holding nibbles ``v`` and ``v + 4`` of the word as fp16 ``1024 + c`` (``v`` even)
    or ``1024 + 16 c`` (``v`` odd): 5 instructions a word, where :func:`_nib8` pairs two words'
    nibbles in 6."""
    return gl.inline_asm_elementwise(asm=NIB4_ASM, constraints="=r,=r,=r,=r,r,r", args=[w],
                                     dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _issue(ring, kv_ptr, blk, ok, slot, tid, tail, stride_blk, STAGE_BYTES: gl.constexpr, NKV: gl.constexpr,
           ROUNDS: gl.constexpr):
    """Queue the copies of cache block ``blk`` into ring slot ``slot`` (nothing unless ``ok``)."""
    _copy_block(ring + slot * STAGE_BYTES + tid * 16, kv_ptr + blk.to(gl.int64) * stride_blk + tid * 4, ok, tail, NKV,
                ROUNDS)
    async_copy.commit_group()


@gluon.jit
def _bar_init(bar, first):
    """``mbarrier.init`` (one arrival a phase) of the barrier at shared address ``bar``, by the
    threads where ``first``."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p mbarrier.init.shared::cta.b64 [$1], 1; mov.b32 $0, 0; }",
        constraints="=r,r,r", args=[bar, first.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _in_warp0(x):
    """1 in the threads of warp 0, else 0 (``%tid.x < 32``): a scalar per thread, for branches only
    warp 0 takes (the refills: the other warps skip their address arithmetic)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.lt.u32 p, t, 32; selp.u32 $0, 1, 0, p; }",
        constraints="=r,r", args=[x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _bar_init_fence(x):
    """Make the barriers' initialisation visible (before the block-wide barrier that follows)."""
    return gl.inline_asm_elementwise(asm="fence.mbarrier_init.release.cluster; mov.b32 $0, 0;", constraints="=r,r",
                                     args=[x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bulk_copy(saddr, gaddr, bar, go, nbytes):
    """Where ``go`` (one thread): one bulk copy (TMA, no tensor map) of ``nbytes`` contiguous bytes
    from ``gaddr`` to shared ``saddr``, completing on the barrier at ``bar`` (which expects them).
    The proxy fence orders the ring slot's earlier ``ld.shared`` reads before the copy's writes."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $4, 0; @p fence.proxy.async.shared::cta; "
            "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$3], $5; "
            "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $5, [$3]; mov.b32 $0, 0; }",
        constraints="=r,r,l,r,r,r", args=[saddr, gaddr, bar, go.to(gl.int32), nbytes], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _bar_wait(bar, phase):
    """Every thread waits until the barrier at ``bar`` has completed the phase of parity ``phase``."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; KV6_WAIT_${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
            "@!p bra KV6_WAIT_${:uid}; mov.b32 $0, 0; }",
        constraints="=r,r,r", args=[bar, phase], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue_bulk(ring, bars, kv_ptr, blk, ok, slot, first, stride_blk, STAGE_BYTES: gl.constexpr):
    """Queue cache block ``blk`` into ring slot ``slot`` as one bulk copy (nothing unless ``ok``)."""
    _bulk_copy(ring + slot * STAGE_BYTES, kv_ptr + blk.to(gl.int64) * stride_blk, bars + 8 * slot, first & ok,
               STAGE_BYTES)


@gluon.jit
def _value_dots(addr, p, c_even, c_odd, a3, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, NKV: gl.constexpr):
    """One block's 8 value dots ``N_n^T . P'`` (codes ``[NKV, WORDS, TILE]`` from each thread's first
    address ``addr``, ``p`` the fp16 ``P'``) added into the accumulators rescaled by ``a3``; each
    dot starts from its nibble parity's offset and zero-point share ``c_even`` / ``c_odd``."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _nib8(_ld_codes(addr, NKV, "v"))
    return (acc0 * a3 + mma_v2(v0, p, c_even), acc1 * a3 + mma_v2(v1, p, c_odd),
            acc2 * a3 + mma_v2(v2, p, c_even), acc3 * a3 + mma_v2(v3, p, c_odd),
            acc4 * a3 + mma_v2(v4, p, c_even), acc5 * a3 + mma_v2(v5, p, c_odd),
            acc6 * a3 + mma_v2(v6, p, c_even), acc7 * a3 + mma_v2(v7, p, c_odd))


@gluon.jit
def _pair_step(sa, t, t1, k_lo, k_hi, tok_i, s_off, k_off, v_off, z_off, q0, q1, q2, q3, q4, q5, q6, q7, nq_off, nq_sum,
               col_scale, softcap, m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zero_o,
               b_l: gl.constexpr, NKV: gl.constexpr, USE_SOFTCAP: gl.constexpr, MASKED: gl.constexpr):
    """PAIR: one loop step over the two ring slots from ``sa`` (tiles ``t``, ``t + 1``): scores, one
    online-softmax step, the value dots into the accumulators. ``MASKED`` False where every key of
    both tiles is visible (no compares, no selects). Returns ``m_i, l_acc, acc0 .. acc7``."""
    TILE: gl.constexpr = BLOCK
    HALF_B: gl.constexpr = BLOCK * NKV * ROW * 4
    STAGE_BYTES: gl.constexpr = 2 * HALF_B
    sbb = sa + STAGE_BYTES
    ka_w = _ld_scales(sa + s_off, NKV)
    va_w = _ld_scales(sa + HALF_B + s_off, NKV)
    kb_w = _ld_scales(sbb + s_off, NKV)
    vb_w = _ld_scales(sbb + HALF_B + s_off, NKV)
    pos_a = t * TILE + tok_i
    pos_b = pos_a + TILE
    ok_a = ((pos_a < k_hi) & (pos_a >= k_lo))[None, :] & (ka_w == ka_w)
    ok_b = ((pos_b < k_hi) & (pos_b >= k_lo) & (t + 1 < t1))[None, :] & (kb_w == kb_w)
    if MASKED:  # masked keys: scale words 0 (no zero point, no value scale)
        ka_w = gl.where(ok_a, ka_w, 0)
        va_w = gl.where(ok_a, va_w, 0)
        kb_w = gl.where(ok_b, kb_w, 0)
        vb_w = gl.where(ok_b, vb_w, 0)
    s_a = _scores(sa + k_off, q0, q1, q2, q3, q4, q5, q6, q7, (ka_w & 0xF).to(gl.float32), nq_off, nq_sum,
                  NKV)
    s_b = _scores(sbb + k_off, q0, q1, q2, q3, q4, q5, q6, q7, (kb_w & 0xF).to(gl.float32), nq_off, nq_sum,
                  NKV)
    pv_a, pv_b, alpha, m_i, l_acc = _softmax_pair(
        s_a, s_b, (ka_w & -16).to(gl.float32, bitcast=True) * col_scale,
        (kb_w & -16).to(gl.float32, bitcast=True) * col_scale, (va_w & -16).to(gl.float32, bitcast=True),
        (vb_w & -16).to(gl.float32, bitcast=True), ok_a, ok_b, m_i, l_acc, softcap, USE_SOFTCAP, MASKED)
    p_a = gl.convert_layout(pv_a, b_l)
    p_b = gl.convert_layout(pv_b, b_l)
    za_even, za_odd = _ld_zero_points(sa + z_off, NKV)
    zb_even, zb_odd = _ld_zero_points(sbb + z_off, NKV)
    c_even = mma_v2(zb_even, p_b, mma_v2(za_even, p_a, zero_o))
    c_odd = mma_v2(zb_odd, p_b, mma_v2(za_odd, p_a, zero_o))
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _value_dots(
        sa + v_off, p_a, c_even, c_odd, alpha[:, None, :], acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, NKV)
    v0, v1, v2, v3, v4, v5, v6, v7 = _nib8(_ld_codes(sbb + v_off, NKV, "v"))
    acc0 = mma_v2(v0, p_b, acc0)
    acc1 = mma_v2(v1, p_b, acc1)
    acc2 = mma_v2(v2, p_b, acc2)
    acc3 = mma_v2(v3, p_b, acc3)
    acc4 = mma_v2(v4, p_b, acc4)
    acc5 = mma_v2(v5, p_b, acc5)
    acc6 = mma_v2(v6, p_b, acc6)
    acc7 = mma_v2(v7, p_b, acc7)
    return m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.constexpr_function
def _query_rows(group):
    """Rows a warp rotates for ``group`` query heads: the power of two >= ``group``, at least 2."""
    return max(2, 1 << (group - 1).bit_length())


@gluon.jit
def _query_load(q_ptr, signs_ptr, tok, ok, stride_q_t, stride_q_h, stride_q_d, NKV: gl.constexpr,
                GROUP: gl.constexpr):
    """ROTATE_Q: issue the loads of token ``tok``'s raw query rows (none where not ``ok``) and of the
    rotation signs for :func:`_query_operands`, which uses them later: their latency overlaps the
    block table's and the ring's first copies instead of following them.

    Warp ``h`` holds its ``GP`` rows (query heads ``h * GROUP + g``; ``GP`` the power of two >=
    ``GROUP``, zero rows past it) as ``[GP, 16, 2, 4]``: dim ``64 j + 4 w + v`` at (``w``, ``j``,
    ``v``), ``w`` across 16 lanes. Returns the rows ``[NKV, GP, 16, 2, 4]`` in the query's dtype and
    the signs ``[1, 1, 16, 2, 4]``."""
    GP: gl.constexpr = _query_rows(GROUP)
    X_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, GP // 2, 1, 2, 4], threads_per_warp=[1, 2, 16, 1, 1],
                                         warps_per_cta=[NKV, 1, 1, 1, 1], order=[4, 3, 2, 1, 0])
    h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, X_L)))))
    g = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, X_L)))))
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, X_L)))))
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, X_L)))))
    v = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, X_L)))))
    d = (64 * j[None, None, None, :, None] + 4 * w[None, None, :, None, None]
         + v[None, None, None, None, :])                                                # [1, 1, 16, 2, 4]
    g5 = g[None, :, None, None, None]
    head = h[:, None, None, None, None] * GROUP + g5
    x = gl.load(q_ptr + tok.to(gl.int64) * stride_q_t + head * stride_q_h + d * stride_q_d,
                mask=(g5 < GROUP) & (d >= 0) & ok, other=0.0)
    return x, gl.load(signs_ptr + d)


@gluon.jit
def _query_operands(x, signs, q_scale, b_l: gl.constexpr):
    """ROTATE_Q: the score dots' B operands ``q0 .. q7`` (:func:`_scores`) from the raw query rows
    and signs of :func:`_query_load`: ``q_scale * H (s * q)`` of each KV head's ``GROUP`` query
    heads, odd parts over 16, as fp16 in ``b_l``; the values the rotation kernel writes, rotated
    here. The Hadamard stages on bits 0, 1 and 6 (``v``, ``j``) are adds and subtractions in the
    thread; they leave 8 tensors ``[NKV, GP, 16]`` of rotated dims ``64 j + 4 w + v``, operand
    ``v + 4 j`` each; bits 2-5 are 4 lane butterflies on each (``rotate_query_gluon._bfly``)."""
    NKV: gl.constexpr = x.shape[0]
    GP: gl.constexpr = x.shape[1]
    x = gl.reshape(x.to(gl.float32) * signs, [NKV, GP, 16, 2, 2, 2])                 # (j, v // 2, v % 2)
    a, b = gl.split(x)                        # v % 2 = 0, 1: [NKV, GP, 16, 2, 2]
    e, o = _sum_diff(a, b)                    # bit 0
    e0, e1 = gl.split(e)                      # v // 2 = 0, 1: [NKV, GP, 16, 2]
    o0, o1 = gl.split(o)
    y0, y2 = _sum_diff(e0, e1)                # bit 1: v = 0, 2
    y1, y3 = _sum_diff(o0, o1)                # v = 1, 3
    q0, q4 = _half_stage(y0)                  # bit 6: operands v + 4 j
    q1, q5 = _half_stage(y1)
    q2, q6 = _half_stage(y2)
    q3, q7 = _half_stage(y3)
    lane = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, q0.type.layout)))[None, None, :]
    for i in gl.static_range(4):              # bits 2-5: across the 16 lanes of w
        q0 = _bfly(q0, lane, 1 << i)
        q1 = _bfly(q1, lane, 1 << i)
        q2 = _bfly(q2, lane, 1 << i)
        q3 = _bfly(q3, lane, 1 << i)
        q4 = _bfly(q4, lane, 1 << i)
        q5 = _bfly(q5, lane, 1 << i)
        q6 = _bfly(q6, lane, 1 << i)
        q7 = _bfly(q7, lane, 1 << i)
    odd = q_scale * 0.0625
    return (_operand(q0 * q_scale, b_l, GP), _operand(q1 * odd, b_l, GP), _operand(q2 * q_scale, b_l, GP),
            _operand(q3 * odd, b_l, GP), _operand(q4 * q_scale, b_l, GP), _operand(q5 * odd, b_l, GP),
            _operand(q6 * q_scale, b_l, GP), _operand(q7 * odd, b_l, GP))


@gluon.jit
def _half_stage(y):
    """The Hadamard stage on dim bit 6 of ``y`` [NKV, GP, 16, 2 (j)]: ``(y0 + y1, y0 - y1)``."""
    y0, y1 = gl.split(y)
    return _sum_diff(y0, y1)


@gluon.jit
def _operand(q, b_l: gl.constexpr, GP: gl.constexpr):
    """``[NKV, GP (g), 16 (w)]`` fp32 -> the dots' B operand ``[NKV, 16, 8]`` fp16 in ``b_l``, zero
    past ``GP`` query heads."""
    q = q.to(gl.float16)
    if GP == 2:
        q = _pad_rows(q)
    if GP <= 4:
        q = _pad_rows(q)
    return gl.convert_layout(gl.permute(q, (0, 2, 1)), b_l)


@gluon.jit
def _pad_rows(q):
    """``[NKV, R, 16]`` -> ``[NKV, 2 R, 16]``, rows ``R ..`` zero."""
    NKV: gl.constexpr = q.shape[0]
    R: gl.constexpr = q.shape[1]
    z = gl.permute(gl.join(q, gl.zeros_like(q)), (0, 3, 1, 2))                      # [NKV, 2, R, 16]
    return gl.reshape(z, [NKV, 2 * R, 16])


# Grid: (num_seqs, NUM_SEGMENTS); num_warps = NKV. A tile is one cache block (16 keys).
@gluon.jit
def _scaled_scores(s, k_sc, v_sc, n_ok, softcap, USE_SOFTCAP: gl.constexpr, MASKED: gl.constexpr = True):
    """A tile's raw scores ``s`` [NKV, TILE, 8] with the key scale (with the softmax scale and
    ``log2 e``) and softcap applied, masked keys at ``-inf``; and ``s + log2(v_scale)``, what the
    running max is taken over (see :func:`_softmax_tile`)."""
    s = s * k_sc[:, :, None]
    if USE_SOFTCAP:
        s = softcap * (2.0 / (1.0 + gl.exp(-2.0 * s / softcap)) - 1.0) * 1.4426950408889634
    if MASKED:
        s = gl.where(n_ok[:, :, None], s, float("-inf"))
    return s, s + _lg2(gl.maximum(v_sc, 8.673617379884035e-19))[:, :, None]   # scales >= 2^-60


@gluon.jit
def _softmax_tile(s, k_sc, v_sc, n_ok, m_i, l_acc, softcap, USE_SOFTCAP: gl.constexpr):
    """One tile of the online softmax both staged kernels share. ``s`` [NKV, TILE, 8]: the raw scores
    (:func:`_scaled_scores`). The running max ``m_i`` is taken over ``s + log2(v_scale)``: then
    ``p * v_scale <= 1`` fits fp16 with no per-tile normaliser, and the sum ``l_acc`` (per key
    row) and the accumulators share its units. Returns the fp16 ``p * v_scale``, the accumulators'
    factor ``alpha`` and the new ``m_i``, ``l_acc``."""
    s, t_sc = _scaled_scores(s, k_sc, v_sc, n_ok, softcap, USE_SOFTCAP)
    m_new = gl.maximum(m_i, gl.max(t_sc, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[:, None, :])
    alpha = gl.exp2(m_i - m_use)
    l_acc = l_acc * alpha[:, None, :] + p
    return (p * v_sc[:, :, None]).to(gl.float16), alpha, m_new, l_acc


@gluon.jit
def _scores(addr, q0, q1, q2, q3, q4, q5, q6, q7, k_zp, nq_off, nq_sum, NKV: gl.constexpr):
    """One block's raw scores ``[NKV, TILE, 8]``: its key codes from each thread's first address
    ``addr``, one ``mma`` k-step per nibble position. The dots start from minus the code offset's
    and the zero point's share (``k_zp``: the keys' zero points): the tensor cores sum it with the
    products, so no large offset is left to cancel later."""
    k0, k1, k2, k3 = _nib4(_ld_codes(addr, NKV, "k"))     # words 0-7: nibbles (0, 4), (1, 5), (2, 6), (3, 7)
    k4, k5, k6, k7 = _nib4(_ld_codes(addr, NKV, "k8"))    # words 8-15
    s = mma_v2(k0, q0, nq_off[:, None, :] + k_zp[:, :, None] * nq_sum[:, None, :])
    s = mma_v2(k1, q1, s)
    s = mma_v2(k2, q2, s)
    s = mma_v2(k3, q3, s)
    s = mma_v2(k4, q4, s)
    s = mma_v2(k5, q5, s)
    s = mma_v2(k6, q6, s)
    return mma_v2(k7, q7, s)


@gluon.jit
def _softmax_pair(s_a, s_b, k_sc_a, k_sc_b, v_sc_a, v_sc_b, ok_a, ok_b, m_i, l_acc, softcap,
                  USE_SOFTCAP: gl.constexpr, MASKED: gl.constexpr):
    """PAIR: :func:`_softmax_tile` over two blocks at once: one running-max step, one ``alpha``
    (``MASKED`` False: every key of both blocks is visible, ``ok_a`` / ``ok_b`` unread)."""
    s_a, t_a = _scaled_scores(s_a, k_sc_a, v_sc_a, ok_a, softcap, USE_SOFTCAP, MASKED)
    s_b, t_b = _scaled_scores(s_b, k_sc_b, v_sc_b, ok_b, softcap, USE_SOFTCAP, MASKED)
    m_new = gl.maximum(m_i, gl.max(gl.maximum(t_a, t_b), 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p_a = gl.exp2(s_a - m_use[:, None, :])
    p_b = gl.exp2(s_b - m_use[:, None, :])
    alpha = gl.exp2(m_i - m_use)
    l_acc = l_acc * alpha[:, None, :] + p_a + p_b
    return (p_a * v_sc_a[:, :, None]).to(gl.float16), (p_b * v_sc_b[:, :, None]).to(gl.float16), alpha, m_new, l_acc


@gluon.jit
def _store_stats(segm_max_ptr, segm_sum_ptr, tok, seg_idx, m_i, l_acc, NUM_Q_HEADS: gl.constexpr, NKV: gl.constexpr,
                 GROUP: gl.constexpr, NUM_SEGMENTS: gl.constexpr, ROW_L: gl.constexpr):
    """Store the segment's running max ``m_i`` [NKV, 8] and sum (``l_acc`` [NKV, TILE, 8] summed
    over its key rows) of each query head (both staged kernels): the reduction's split buffers."""
    r_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, ROW_L))
    r_g = gl.arange(0, 8, layout=gl.SliceLayout(0, ROW_L))
    rows = (tok.to(gl.int64) * NUM_Q_HEADS + r_h[:, None] * GROUP + r_g[None, :]) * NUM_SEGMENTS + seg_idx
    r_ok = (r_g < GROUP)[None, :] & (r_h >= 0)[:, None]
    gl.store(segm_max_ptr + rows, m_i, mask=r_ok)
    gl.store(segm_sum_ptr + rows, gl.sum(l_acc, 1), mask=r_ok)


@gluon.jit
def _bfly_row8(x, NKV: gl.constexpr):
    """``(x[w] + x[w + 8], x[w] - x[w + 8])`` at rows ``w`` / ``w + 8`` of ``x`` [NKV, 16, 8]: the two
    rows are one thread's registers in the MMA layout."""
    a, b = gl.split(gl.permute(gl.reshape(x, [NKV, 2, 8, 8]), (0, 2, 3, 1)))
    y = gl.reshape(gl.permute(gl.join(a + b, a - b), (0, 3, 1, 2)), [NKV, 16, 8])
    return gl.convert_layout(y, x.type.layout)


@gluon.jit
def _sum_diff(x, y):
    return x + y, x - y


@gluon.jit
def _unrotate(a0, a1, a2, a3, a4, a5, a6, a7, o_w, signs_ptr, NKV: gl.constexpr):
    """``s * H a / 128`` of the accumulators (element ``[h, w, g]`` of ``a_n`` is rotated dim
    ``8 w + n``): the inverse rotation the reduction would apply after the merge, applied to each
    segment's rows (it is linear), so the split output is in the cache's natural dims. ``H`` over
    the dim's bits 0-2 adds the accumulators, over bits 3-5 (the row's bits 0-2: lanes 4, 8, 16
    apart) shuffles, over bit 6 (rows ``w``, ``w + 8``, one thread's) adds in registers."""
    b0, b1 = _sum_diff(a0, a1)          # bit 0
    b2, b3 = _sum_diff(a2, a3)
    b4, b5 = _sum_diff(a4, a5)
    b6, b7 = _sum_diff(a6, a7)
    c0, c2 = _sum_diff(b0, b2)          # bit 1
    c1, c3 = _sum_diff(b1, b3)
    c4, c6 = _sum_diff(b4, b6)
    c5, c7 = _sum_diff(b5, b7)
    lane = (4 * o_w)[None, :, None]
    return (_unrotate_rows(c0 + c4, lane, o_w, signs_ptr, 0, NKV),
            _unrotate_rows(c1 + c5, lane, o_w, signs_ptr, 1, NKV),
            _unrotate_rows(c2 + c6, lane, o_w, signs_ptr, 2, NKV),
            _unrotate_rows(c3 + c7, lane, o_w, signs_ptr, 3, NKV),
            _unrotate_rows(c0 - c4, lane, o_w, signs_ptr, 4, NKV),
            _unrotate_rows(c1 - c5, lane, o_w, signs_ptr, 5, NKV),
            _unrotate_rows(c2 - c6, lane, o_w, signs_ptr, 6, NKV),
            _unrotate_rows(c3 - c7, lane, o_w, signs_ptr, 7, NKV))


@gluon.jit
def _unrotate_rows(x, lane, o_w, signs_ptr, N: gl.constexpr, NKV: gl.constexpr):
    """``H`` over the row bits of accumulator ``N`` (already summed over bits 0-2), then its dims'
    signs over 128."""
    x = _bfly(x, lane, 4)
    x = _bfly(x, lane, 8)
    x = _bfly(x, lane, 16)
    x = _bfly_row8(x, NKV)
    return x * (gl.load(signs_ptr + 8 * o_w + N) * (1.0 / 128))[None, :, None]


@gluon.jit
def _out_rows(tok, seg_idx, MMA: gl.constexpr, NKV: gl.constexpr, INNER: gl.constexpr, GROUP: gl.constexpr,
              NUM_Q_HEADS: gl.constexpr, NUM_SEGMENTS: gl.constexpr):
    """Where the value accumulators ``[NKV, INNER, 8]`` (layout ``MMA``: KV head, M index, query
    head of the group) go in the split output (both staged kernels): each element's output row, its mask (query
    heads past ``GROUP`` are padding) and the M index ``[INNER]``, which each kernel maps to dims."""
    o_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    o_m = gl.arange(0, INNER, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    row3 = (tok.to(gl.int64) * NUM_Q_HEADS + o_h[:, None, None] * GROUP + o_g[None, None, :]) * NUM_SEGMENTS + seg_idx
    ok3 = (o_g < GROUP)[None, None, :] & (o_h >= 0)[:, None, None] & (o_m >= 0)[None, :, None]
    return row3, ok3, o_m


@gluon.jit
def _ring_start(ring_off, NKV: gl.constexpr):
    """The ring's shared-window address (:func:`_ring_base`), after a word per thread is stored
    once into Triton's own shared memory, so that the kernel declares ``global_smem``."""
    anchor = gl.allocate_shared_memory(gl.int32, [32 * NKV], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    anchor.store(gl.zeros([32 * NKV], gl.int32, layout=gl.BlockedLayout([1], [32], [NKV], [0])))
    return _ring_base(ring_off)


@gluon.jit
def _sequence(cu_seqlens_q_ptr, seqused_k_ptr, seq_idx):
    """Sequence ``seq_idx``'s first query token, whether it has one, its key count, and whether
    the program has work (both staged kernels return early where not). ``live`` reads
    ``seq_len`` too (never negative), so all three loads leave together: a load the early return
    does not use is sunk below its branch by the compiler, one latency later in the chain."""
    tok = gl.load(cu_seqlens_q_ptr + seq_idx)
    has_query = gl.load(cu_seqlens_q_ptr + seq_idx + 1) != tok
    seq_len = gl.load(seqused_k_ptr + seq_idx)
    return tok, has_query, seq_len, has_query & (seq_len >= 0)


@gluon.jit
def _tile_range(seq_len, seg_idx, window_left, window_right, TILE: gl.constexpr, NUM_SEGMENTS: gl.constexpr):
    """The visible keys ``[k_lo, k_hi)`` of a sequence of ``seq_len`` keys (sliding window) and this
    segment's tiles ``[t0, t1)`` (an equal share of the visible tiles; empty past the end)."""
    k_hi = seq_len
    if window_right >= 0:
        k_hi = gl.minimum(k_hi, seq_len + window_right)
    k_lo = 0
    if window_left >= 0:
        k_lo = gl.maximum(seq_len - 1 - window_left, 0)
    tile_lo = k_lo // TILE
    tile_hi = (k_hi + TILE - 1) // TILE
    per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    t0 = tile_lo + seg_idx * per_seg
    t1 = gl.minimum(t0 + per_seg, tile_hi)
    return k_lo, k_hi, t0, t1


@gluon.jit
def _bars_init(bars, tid, first, STAGES: gl.constexpr):
    """BULK: initialise the ring's ``STAGES`` mbarriers (by the first thread), visible to all."""
    for i in gl.static_range(STAGES):
        _bar_init(bars + 8 * i, first)
    _bar_init_fence(tid)
    gl.thread_barrier()


@gluon.jit
def _ids_ahead(bt_row, n, t1):
    """Block ids of tiles ``n .. n + 3`` (0 past ``t1``): the queue in registers that keeps the
    block-table loads four tiles ahead of their copies."""
    b0 = gl.load(bt_row + n, mask=n < t1, other=0)
    b1 = gl.load(bt_row + n + 1, mask=n + 1 < t1, other=0)
    b2 = gl.load(bt_row + n + 2, mask=n + 2 < t1, other=0)
    b3 = gl.load(bt_row + n + 3, mask=n + 3 < t1, other=0)
    return b0, b1, b2, b3


@gluon.jit
def _ring_fill(ring, bars, kv_ptr, bt_row, t0, t1, tid, tail, first, stride_blk, STAGE_BYTES: gl.constexpr,
               NKV: gl.constexpr, ROUNDS: gl.constexpr, STAGES: gl.constexpr, BULK: gl.constexpr,
               FILL: gl.constexpr):
    """Before the loop: the barriers (BULK), then the copies of the first ``FILL`` tiles
    (``STAGES - 1`` for a loop that refills one slot a step, ``STAGES - 2`` for two)."""
    if BULK:
        _bars_init(bars, tid, first, STAGES)
    for i in gl.static_range(FILL):
        ok = t0 + i < t1
        blk = gl.load(bt_row + t0 + i, mask=ok, other=0)
        if BULK:
            _issue_bulk(ring, bars, kv_ptr, blk, ok, i, first, stride_blk, STAGE_BYTES)
        else:
            _issue(ring, kv_ptr, blk, ok, i, tid, tail, stride_blk, STAGE_BYTES, NKV, ROUNDS)


@gluon.jit
def _ring_advance(ring, bars, kv_ptr, blk, t, t1, j, slot, first, tid, tail, stride_blk, STAGE_BYTES: gl.constexpr,
                  NKV: gl.constexpr, ROUNDS: gl.constexpr, STAGES: gl.constexpr, BULK: gl.constexpr):
    """At tile ``t`` (the ``j``-th of the segment, in ``slot``): once every warp is done with the
    slot of tile ``j - 1``, refill it with block ``blk`` (tile ``t + STAGES - 1``), and have tile
    ``j`` landed (BULK: its mbarrier's phase; else all but the newest ``STAGES - 2`` groups)."""
    if BULK:
        gl.thread_barrier()
        _issue_bulk(ring, bars, kv_ptr, blk, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, first, stride_blk,
                    STAGE_BYTES)
        _bar_wait(bars + 8 * slot, (j // STAGES) & 1)
    else:
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        _issue(ring, kv_ptr, blk, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, tid, tail, stride_blk,
               STAGE_BYTES, NKV, ROUNDS)


@gluon.jit(do_not_specialize=["ring_off"])
def _decode_staged_int4_kernel(
    q_ptr,                          # [T, Hq, 128] fp32: rotated, scaled, 4 parts (``_rotate_query_kernel``);
                                    # ROTATE_Q: the raw query (bf16 / fp16, any strides)
    kv_ptr,                         # the packed cache as int32 words
    segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
    signs_ptr,                      # [128] fp32 rotation signs (UNROTATE)
    col_scale, softcap, window_left, window_right,
    q_scale,                        # ROTATE_Q: the softmax scale, applied to the rotated query
    stride_q_t, stride_q_h, stride_q_d,
    stride_blk,                     # words from one block to the next
    stride_bt_s,
    ring_off,                       # bytes from the dynamic shared memory's base to the ring
    NUM_Q_HEADS: gl.constexpr, NKV: gl.constexpr, GROUP: gl.constexpr,
    USE_SOFTCAP: gl.constexpr, NUM_SEGMENTS: gl.constexpr, STAGES: gl.constexpr,
    BULK: gl.constexpr = False,     # sm_90: one bulk copy (TMA) per block and mbarriers, not cp.async
    PDL: gl.constexpr = False,      # launched with launch_pdl: the query is read after griddepcontrol.wait
    PAIR: gl.constexpr = False,     # BULK only: two blocks per loop step (one softmax step, one rescale per 32 keys)
    SPREAD: gl.constexpr = False,   # launched one program per SM (decode_staged.launch); the code is the same
    UNROTATE: gl.constexpr = False,  # store the split output unrotated (Plan.unrotated)
    ROTATE_Q: gl.constexpr = False,  # rotate the raw query here (Rotate.PROLOGUE), not read it rotated
    RELEASE: gl.constexpr = False,  # let the reduction be scheduled at the start (Plan.reduce_early)
):
    HALF_B: gl.constexpr = BLOCK * NKV * ROW * 4     # bytes of one half (K or V) of a block
    STAGE_BYTES: gl.constexpr = 2 * HALF_B
    TILE: gl.constexpr = BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NKV, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    tok_l: gl.constexpr = gl.SliceLayout(2, mma)     # [NKV, TILE]: per key
    row_l: gl.constexpr = gl.SliceLayout(1, mma)     # [NKV, 8]: per query head
    ch_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NKV],
                                          order=[0])

    seq_idx = gl.program_id(0)
    seg_idx = gl.program_id(1)
    if RELEASE:  # the grid is resident at once: the reduction's programs wait in their own gdc_wait
        gdc_release(ring_off)
    if PDL:
        if ROTATE_Q:  # the call's first kernel: its inputs (the cache, the query) may be the previous kernel's
            gdc_wait(ring_off)
    ring = _ring_start(ring_off, NKV)
    tok, has_query, seq_len, live = _sequence(cu_seqlens_q_ptr, seqused_k_ptr, seq_idx)
    if ROTATE_Q:  # in flight while the block table is read and the ring's first copies land
        q_raw, q_signs = _query_load(q_ptr, signs_ptr, tok, has_query, stride_q_t, stride_q_h, stride_q_d, NKV,
                                     GROUP)
    if not live:
        return
    k_lo, k_hi, t0, t1 = _tile_range(seq_len, seg_idx, window_left, window_right, TILE, NUM_SEGMENTS)

    tid = gl.arange(0, 32 * NKV, layout=ch_l)
    tail = tid < 8 * NKV
    # byte offsets (from a stage's start) of the rows each thread reads
    kh = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    kt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    kwi = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    # each thread's first word address (the same in all its elements: its others are that plus
    # the constants of _lds_asm); keys: K index 2 c (+ 1, + 8, + 9) -> word c (+ 4)
    k_off = (((kt & 7)[None, :, None] * NKV + kh[:, None, None]) * ROW + ((kwi & 6) // 2)[None, None, :]) * 4
    vw_ = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    vt = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    # [NKV, WORDS, TILE]
    v_off = (((vt & 6)[None, None, :] * NKV + kh[:, None, None]) * ROW + (vw_ & 7)[None, :, None]) * 4 + HALF_B
    z_off = (((vt & 6)[None, None, :] * NKV + kh[:, None, None]) * ROW + WORDS) * 4 + HALF_B + (vw_ * 0)[None, :, None]
    sh = gl.arange(0, NKV, layout=gl.SliceLayout(1, tok_l))
    st = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))
    s_off = (((st & 7)[None, :] * NKV + sh[:, None]) * ROW + WORDS) * 4                          # [NKV, TILE]

    bt_row = block_table_ptr + seq_idx.to(gl.int64) * stride_bt_s
    bars = ring + STAGES * STAGE_BYTES          # BULK: one 8-byte mbarrier per slot, after the ring
    first = tid == 0
    # PAIR: two blocks (tiles) a loop step, so each step refills the two slots of the step before
    _ring_fill(ring, bars, kv_ptr, bt_row, t0, t1, tid, tail, first, stride_blk, STAGE_BYTES, NKV, 4, STAGES, BULK,
               STAGES - 2 if PAIR else STAGES - 1)
    # block ids four tiles ahead of their copy (a queue in registers): a load from the table takes
    # longer than a tile when every SM streams the cache
    b0, b1, b2, b3 = _ids_ahead(bt_row, t0 + STAGES - (2 if PAIR else 1), t1)

    if PDL:  # the ring's first copies are in flight; the query is the previous kernel's (_rotate_query_kernel) output
        if not ROTATE_Q:
            gdc_wait(ring_off)
    # the query, B operand of the score dots (_scores): Q_i [NKV, 16, 8] fp16, for k-step i (nibbles
    # v = i % 4 and v + 4 of words 8 (i // 4) .. + 7), Q_i[h, k, g] = rotated dim
    # 8 (8 (i // 4) + k // 2) + v + 4 (k % 2) of head h * GROUP + g, which the rotation stores at
    # part v, unit 16 (i // 4) + k (16 contiguous values); odd v over 16 (their codes come as 16 c)
    if ROTATE_Q:
        q0, q1, q2, q3, q4, q5, q6, q7 = _query_operands(q_raw, q_signs, q_scale, b_l)
    else:
        q_h = gl.arange(0, NKV, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
        q_w = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
        q_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
        head = q_h[:, None, None] * GROUP + q_g[None, None, :]
        q_ok = (q_g < GROUP)[None, None, :] & (q_h >= 0)[:, None, None] & (q_w >= 0)[None, :, None]
        q_row = q_ptr + tok.to(gl.int64) * stride_q_t + head * stride_q_h + q_w[None, :, None]
        q0 = gl.load(q_row + 0, mask=q_ok, other=0.0).to(gl.float16)
        q1 = (gl.load(q_row + 32, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
        q2 = gl.load(q_row + 64, mask=q_ok, other=0.0).to(gl.float16)
        q3 = (gl.load(q_row + 96, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
        q4 = gl.load(q_row + 16, mask=q_ok, other=0.0).to(gl.float16)
        q5 = (gl.load(q_row + 48, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
        q6 = gl.load(q_row + 80, mask=q_ok, other=0.0).to(gl.float16)
        q7 = (gl.load(q_row + 112, mask=q_ok, other=0.0) * 0.0625).to(gl.float16)
    q_even = (gl.sum(q0.to(gl.float32), 1) + gl.sum(q2.to(gl.float32), 1) + gl.sum(q4.to(gl.float32), 1)
              + gl.sum(q6.to(gl.float32), 1))
    q_odd = (gl.sum(q1.to(gl.float32), 1) + gl.sum(q3.to(gl.float32), 1) + gl.sum(q5.to(gl.float32), 1)
             + gl.sum(q7.to(gl.float32), 1))
    # s_raw = sum_n Q_n . (1024 + m_n c) = q . c + 1024 (q_even + q_odd): the dot of the operands as rounded
    nq_sum = gl.convert_layout(-(q_even + 16.0 * q_odd), row_l)                # [NKV, 8]
    nq_off = gl.convert_layout(-1024.0 * (q_even + q_odd), row_l)

    m_i = gl.full([NKV, 8], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([NKV, TILE, 8], gl.float32, layout=mma)   # the sum of p, per key row until the end
    acc0 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc1 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc2 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc3 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc4 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc5 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc6 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    acc7 = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    zero_o = gl.zeros([NKV, WORDS, 8], gl.float32, layout=mma)
    tok_i = gl.arange(0, TILE, layout=gl.SliceLayout(0, tok_l))

    if PAIR:
        for t in range(t0, t1, 2):
            j = t - t0
            slot = j % STAGES
            n = t + STAGES + 2
            gl.thread_barrier()  # every warp is done with the previous step's two slots: refill them
            # only warp 0 runs the refills' code (the copies are one thread's anyway)
            if _in_warp0(ring_off) != 0:
                _issue_bulk(ring, bars, kv_ptr, b0, t + STAGES - 2 < t1, (j + STAGES - 2) % STAGES, first, stride_blk,
                            STAGE_BYTES)
                _issue_bulk(ring, bars, kv_ptr, b1, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, first, stride_blk,
                            STAGE_BYTES)
                b0, b1 = b2, b3
                b2 = gl.load(bt_row + n, mask=n < t1, other=0)
                b3 = gl.load(bt_row + n + 1, mask=n + 1 < t1, other=0)
            _bar_wait(bars + 8 * slot, (j // STAGES) & 1)
            if t + 1 < t1:
                _bar_wait(bars + 8 * (slot + 1), ((j + 1) // STAGES) & 1)
            sa = ring + slot * STAGE_BYTES
            # only the steps whose 32 keys cross the visible range's edges (or the segment's end)
            # mask: the others skip the masks' compares and selects (8% of the step's instructions)
            if (t * TILE >= k_lo) & ((t + 2) * TILE <= k_hi) & (t + 1 < t1):
                m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _pair_step(
                    sa, t, t1, k_lo, k_hi, tok_i, s_off, k_off, v_off, z_off, q0, q1, q2, q3, q4, q5, q6, q7, nq_off,
                    nq_sum, col_scale, softcap, m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zero_o,
                    b_l, NKV, USE_SOFTCAP, False)
            else:
                m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _pair_step(
                    sa, t, t1, k_lo, k_hi, tok_i, s_off, k_off, v_off, z_off, q0, q1, q2, q3, q4, q5, q6, q7, nq_off,
                    nq_sum, col_scale, softcap, m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zero_o,
                    b_l, NKV, USE_SOFTCAP, True)
    else:
        for t in range(t0, t1):
            j = t - t0
            slot = j % STAGES
            # _ring_advance written out (the INT8 / FP8 kernel calls it): as a call the bulk builds get the
            # same instructions in another order and register assignment (offline sm_90), about 1% slower
            # on the H200 at b8@32k with 5 stages
            if BULK:  # every warp is done with the slot of tile j - 1: refill it, then wait for tile j
                gl.thread_barrier()
                _issue_bulk(ring, bars, kv_ptr, b0, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, first, stride_blk,
                            STAGE_BYTES)
                _bar_wait(bars + 8 * slot, (j // STAGES) & 1)
            else:
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()
                _issue(ring, kv_ptr, b0, t + STAGES - 1 < t1, (j + STAGES - 1) % STAGES, tid, tail, stride_blk,
                       STAGE_BYTES, NKV, 4)
            n = t + STAGES + 3
            b0, b1, b2, b3 = b1, b2, b3, gl.load(bt_row + n, mask=n < t1, other=0)
            sb = ring + slot * STAGE_BYTES
            ksw = _ld_scales(sb + s_off, NKV)                                   # [NKV, TILE]
            vsw = _ld_scales(sb + HALF_B + s_off, NKV)
            k_pos = t * TILE + tok_i
            n_ok = ((k_pos < k_hi) & (k_pos >= k_lo))[None, :] & (ksw == ksw)
            ksw = gl.where(n_ok, ksw, 0)
            vsw = gl.where(n_ok, vsw, 0)
            k_zp = (ksw & 0xF).to(gl.float32)
            k_sc = (ksw & -16).to(gl.float32, bitcast=True) * col_scale
            v_sc = (vsw & -16).to(gl.float32, bitcast=True)
            s = _scores(sb + k_off, q0, q1, q2, q3, q4, q5, q6, q7, k_zp, nq_off, nq_sum, NKV)  # [NKV, TILE, 8]
            pv, alpha, m_i, l_acc = _softmax_tile(s, k_sc, v_sc, n_ok, m_i, l_acc, softcap, USE_SOFTCAP)
            p_b = gl.convert_layout(pv, b_l)
            # the tile's offset and zero-point share, -sum_k (1024 + zp_k) p'_k (odd n: 16 zp_k), on
            # the tensor cores: its rows are the same, as the accumulator's layout wants them
            zd_even, zd_odd = _ld_zero_points(sb + z_off, NKV)
            c_even = mma_v2(zd_even, p_b, zero_o)
            c_odd = mma_v2(zd_odd, p_b, zero_o)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _value_dots(
                sb + v_off, p_b, c_even, c_odd, alpha[:, None, :], acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                NKV)
    if not BULK:
        async_copy.wait_group(0)

    # out[row(h, g), 8 w + n] = acc_n[h, w, g]
    row3, ok3, o_w = _out_rows(tok, seg_idx, mma, NKV, WORDS, GROUP, NUM_Q_HEADS, NUM_SEGMENTS)
    # each thread holds dims 8 w .. 8 w + 7 of its rows (one per accumulator): two 16-byte stores
    # each, not eight 4-byte ones 32 bytes apart (8 partial sectors)
    base = segm_out_ptr + row3 * HEAD + 8 * o_w[None, :, None]
    if UNROTATE:
        o0, o1, o2, o3, o4, o5, o6, o7 = _unrotate(acc0, acc1 * 0.0625, acc2, acc3 * 0.0625, acc4, acc5 * 0.0625,
                                                   acc6, acc7 * 0.0625, o_w, signs_ptr, NKV)
        _store4(base, o0, o1, o2, o3, ok3)
        _store4(base + 4, o4, o5, o6, o7, ok3)
    else:
        _store4(base, acc0, acc1 * 0.0625, acc2, acc3 * 0.0625, ok3)
        _store4(base + 4, acc4, acc5 * 0.0625, acc6, acc7 * 0.0625, ok3)
    _store_stats(segm_max_ptr, segm_sum_ptr, tok, seg_idx, m_i, l_acc, NUM_Q_HEADS, NKV, GROUP, NUM_SEGMENTS, row_l)
