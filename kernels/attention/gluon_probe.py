"""Whether a Gluon kernel compiles here: one probe per process and shape class, its verdict cached.

The Gluon kernels (``*_gluon.py``) are written against Triton 3.6's Gluon dialect; another
Triton may not have the dialect, or may lower it differently. :func:`attention_plan` asks
:func:`compiles` before it picks a Gluon kernel: the first time for a (kernel, device, shape
class), the kernel is compiled (``warmup``: nothing is launched, so a CUDA graph capture is
safe) on a tiny input of that shape class; a failure is a warning, once, and the plan takes
the Triton kernel instead, for the rest of the process. A failure of the real launch after a
good probe is an error, not a fallback.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import PTXASError


class RingUnsupported(RuntimeError):
    """This Triton's compiled-kernel object is not the one ``decode_staged.reserve_ring`` knows (3.6's)."""


class GluonUnavailable(RuntimeError):
    """The Gluon kernel's module does not import with this Triton (no Gluon dialect, another API)."""


# what a Triton whose Gluon (or compiled-kernel object) differs from 3.6's raises at compile time
COMPILE_ERRORS = (CompilationError, PTXASError, RingUnsupported, GluonUnavailable)
# (kernel name, device index, shape class) -> None where it compiles, else why it does not
_VERDICTS: dict = {}


@functools.lru_cache(maxsize=None)
def gluon_kernel(module: str, name: str):
    """Gluon kernel ``name`` of ``kernels.attention.<module>``, or None where this Triton has no
    Gluon dialect (or a different one): imported at the first call, so that importing the
    launchers never needs Gluon."""
    try:
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)
    except Exception:  # no triton.experimental.gluon, or an API this code does not know
        return None


def require(module: str, name: str):
    """:func:`gluon_kernel`, or :class:`GluonUnavailable` where it does not import (for the probes)."""
    kernel = gluon_kernel(module, name)
    if kernel is None:
        raise GluonUnavailable(f"kernels.attention.{module}.{name} does not import with this Triton")
    return kernel


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple:
    """Compute capability of CUDA device ``index``, asked once."""
    return torch.cuda.get_device_capability(index)


def compiles(name: str, device_index: int, shape_class: tuple, compile_fn, instead: str) -> bool:
    """Whether Gluon kernel ``name`` compiles on this device for ``shape_class``; ``compile_fn()``
    compiles it on a tiny input (once per key; later calls read the cached verdict). A compile
    failure warns once (``instead``: what runs instead); other errors (a CUDA error) raise."""
    key = (name, device_index, shape_class)
    if key not in _VERDICTS:
        try:
            compile_fn()
            _VERDICTS[key] = None
        except COMPILE_ERRORS as e:
            _fail(key, e, instead)
        except RuntimeError as e:  # an MLIR pass that does not lower a layout: a compile failure too
            if "PassManager::run failed" not in str(e):
                raise
            _fail(key, e, instead)
    return _VERDICTS[key] is None


def _fail(key: tuple, error: Exception, instead: str) -> None:
    last = (str(error).strip().splitlines() or [""])[-1]
    _VERDICTS[key] = f"{type(error).__name__}: {last}"
    if sum(1 for k, v in _VERDICTS.items() if k[0] == key[0] and v is not None) == 1:
        warnings.warn(f"kernels: the Gluon kernel {key[0]} did not compile with this Triton ({_VERDICTS[key]}); "
                      f"{instead}", RuntimeWarning, stacklevel=4)


def verdicts() -> dict:
    """A copy of the cached verdicts: ``(kernel, device index, shape class) -> None or why not``."""
    return dict(_VERDICTS)
