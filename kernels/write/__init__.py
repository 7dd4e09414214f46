"""Cache-write kernels: K/V rows of one step into a paged cache, quantized per (token, head).

Which kernel runs is decided once, by :func:`write_plan` (``plan.py``), from the mode, the head
size, the device and the input layout; the public functions run exactly that plan. Paths:

==============  =========================================  ===========================================
path            file                                       runs for
==============  =========================================  ===========================================
unquantized     ``unquantized.py``                         bf16 / fp16 caches (a copy, cast if needed)
symmetric       ``symmetric.py``                           INT8 and FP8 per token head
int4-mma        ``int4_lanes.py`` + ``int4_mma.py``        INT4 on the GPU, head_size 64 / 128 / 256
int4-lanes      ``int4_lanes.py``                          INT4 on the GPU, head_size 16 / 32
int4-fused      ``int4_fused.py``                          INT4 on CPU, with the MSE encoder, head_size
                                                           above 256, K/V rows not 16-byte loadable
==============  =========================================  ===========================================

Every INT4 path takes an optional ``key_offset`` (per-head key smoothing,
``kernels.reference.smooth_keys``): each K row loses its head's offset right after its load, in
the same pass. ``bench/write.py --key-offset`` times the write with and without it.

Around them: ``checks.py`` validates the arguments (``LayoutError`` saying expected vs got;
nothing written on error), ``tuning.py`` holds each path's frozen tuning and its measured
defaults, ``device_math.py`` the device helpers the kernels share (exact division, rounding,
butterflies, INT4 codes), ``api.py`` the public functions. Every kernel runs on CUDA tensors
compiled and on CPU tensors through Triton's interpreter; the oracle of each is
``kernels.reference.reference_reshape_and_cache``.
"""

from .api import (reshape_and_cache_flash, reshape_and_cache_int4, run_plan,  # noqa: F401
                  triton_reshape_and_cache_flash_per_token_head_quant)
from .plan import Launch, WriteArgs, WriteCall, WritePlan, plan_for, record_launches, write_plan  # noqa: F401
from .tuning import FusedTuning, LanesTuning, MmaTuning, TileTuning  # noqa: F401

__all__ = ["FusedTuning", "LanesTuning", "Launch", "MmaTuning", "TileTuning", "WriteArgs", "WriteCall", "WritePlan",
           "plan_for", "record_launches", "reshape_and_cache_flash", "reshape_and_cache_int4", "run_plan",
           "triton_reshape_and_cache_flash_per_token_head_quant", "write_plan"]
