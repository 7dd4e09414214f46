"""One Triton kernel, two back ends: compiled on CUDA tensors, interpreted on CPU tensors.

``triton.jit`` picks the interpreter only from ``TRITON_INTERPRET`` at decoration time, and
Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``, ...) are then fixed as
compiled functions that refuse to run in Python. The project's kernels must run on CPU tensors
with no variable to set, and on the GPU in the same process, so:

- :func:`dual_jit` keeps a compiled ``JITFunction`` and an interpreted twin of the same Python
  function, and picks one per launch from the device of the tensor arguments;
- during an interpreted launch only, a call to any ``JITFunction`` (a helper of ours or one of
  Triton's library functions) runs its interpreter rewrite instead of raising. The language
  module is patched once for the whole launch in an outer scope and restored after it, so the
  compiler sees an untouched ``triton.language`` before and after.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl
import triton.language.core as core  # noqa: F401  (read by _patch_lang through globals())
from triton.runtime import interpreter as _interp
from triton.runtime.jit import JITFunction

_state = threading.local()
_original_call = JITFunction.__call__
_lock = threading.Lock()


def _call_interpreted(self, *args, **kwargs):
    if not getattr(_state, "active", False):
        return _original_call(self, *args, **kwargs)  # raises Triton's usual error
    return _interp.InterpretedFunction(self.fn).rewrite()(*args, **kwargs)


JITFunction.__call__ = _call_interpreted


def _lang_anchor():  # its globals() name both ``tl`` and ``core`` for _patch_lang
    return tl, core


@contextlib.contextmanager
def _interpreter_scope():
    with _lock:  # the language patch is process-wide: one interpreted launch at a time
        scope = _interp._patch_lang(_lang_anchor)
        _state.active = True
        try:
            yield
        finally:
            _state.active = False
            scope.restore()


class DualKernel:
    """Launch with ``kernel[grid](...)`` exactly like a ``@triton.jit`` kernel."""

    def __init__(self, fn, **jit_kwargs):
        self.fn = fn
        self.compiled = triton.jit(fn, **jit_kwargs)
        self.interpreted = _interp.InterpretedFunction(fn)
        self.__name__ = fn.__name__

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if _device_of(args, kwargs).type != "cpu":
                return self.compiled[grid](*args, **kwargs)
            kwargs.pop("launch_pdl", None)  # a CUDA launch attribute
            kwargs.pop("maxnreg", None)     # a ptxas option
            with _interpreter_scope():
                return self.interpreted[grid](*args, **kwargs)
        return launch


def dual_jit(fn=None, **jit_kwargs):
    """Decorator: like ``triton.jit``, but launches on CPU tensors run in Triton's interpreter.

    Device helpers called from such kernels stay plain ``@triton.jit`` functions.
    """
    if fn is None:
        return lambda f: DualKernel(f, **jit_kwargs)
    return DualKernel(fn, **jit_kwargs)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' grids. ``triton.cdiv`` is a constexpr function in Triton
    3.6+, and calling it from Python goes through its argument unwrapping: 2-7 µs a call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` computes it,
    without its constexpr-function wrapper (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def prev_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (``n >= 1``): the launchers round segment counts down to it."""
    return 1 << (n.bit_length() - 1)


def busy_segments(segs: int, units: int) -> int:
    """The segments that hold work when ``units`` (key tiles, cache blocks) are cut into ``segs``
    segments of ``ceil(units / segs)`` each, as the split kernels cut them: the rest would be
    empty programs and empty rows for the reduction to merge. 512 tiles in 49 segments of 11: 47."""
    return cdiv(units, cdiv(units, segs))


def interpreting(t: torch.Tensor) -> bool:
    """True when a kernel launched on ``t`` runs through the interpreter (CPU tensor).

    Launchers pass this as a constexpr so CPU runs can upcast before ``tl.dot`` (bf16 dots
    are wrong in Triton 3.9's interpreter) while the GPU path stays unchanged.
    """
    return t.device.type == "cpu"


def _device_of(args, kwargs) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    raise TypeError("kernel launch without any tensor argument")
