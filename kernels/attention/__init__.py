"""Paged attention over every cache mode: one decision (:func:`attention_plan`), then its kernel.

Which file runs a call is what :func:`attention_plan` returns (``Plan.path``; the table over a
grid of shapes for the CPU and an H200 is in docs/KERNELS.md). The pieces:

Entry points and the decision
    ``api.py``          ``unified_attention``, ``unified_attention_int4``, ``attention_plan``
    ``call.py``         validation of the arguments into one ``AttnCall``
    ``plan.py``         ``Path``, ``Tiling``, ``Tuning``, ``DeviceFacts``, ``Plan``: the one decision
    ``run.py``          runs a plan: the path's launcher, then the reduction; a mixed batch
                        (``num_decode_seqs``): its decode rows' plan, then its chunk rows' 2D plan

Kernels (each beside its launcher), by how they read the cache
    ``prefill_2d.py``       2D tiles of query rows x keys: prefill, mixed batches, bf16 decode
                            (split into segments), any head size; ``prefill_2d_int4.py`` its INT4 twin;
                            ``prefill_dequant.py`` converts a call's blocks to an fp16 cache first
                            (``Tiling.dequant_first``)
    ``decode_split.py``     split-KV decode through byte strides: any quantized cache
    ``decode_code_units.py`` split-KV decode on 16-bit code units, a loop per row-alignment class:
                            small INT4 batches, head sizes other than 64 / 128 / 256
    ``decode_block_tiles.py`` split-KV decode on tiles of whole cache blocks, one warp per KV head:
                            INT8 / FP8 decode, INT4 from 8k-32k keys in the batch
    ``decode_staged.py``    host side of the Gluon whole-block-staged decode (large batches on
                            CUDA, head_size 128): ``decode_staged_int4_gluon.py`` (INT4) and
                            ``decode_staged_int8_gluon.py`` (INT8 / FP8)

Around the decode kernels
    ``rotate_query.py``     the INT4 query rotation (Triton; ``rotate_query_gluon.py``: Gluon, head 128)
    ``reduce.py``           the split-KV reduction (Triton; ``reduce_gluon.py``: Gluon, head 128)
    ``units.py``            the cache as 16-bit code units (views and conversions)
    ``common.py``           device helpers shared by the Triton kernels
    ``gluon_pdl.py``        programmatic dependent launch inside Gluon kernels
    ``gluon_probe.py``      whether a Gluon kernel compiles here (one probe per shape class)

``*_gluon.py`` modules import only where Triton has the Gluon dialect; nothing imports them
until a plan picks them.
"""

from .api import attention_plan, unified_attention, unified_attention_int4  # noqa: F401
from .plan import CPU, H200, DeviceFacts, Path, Plan, Reduce, Rotate, Tiling, Tuning  # noqa: F401
