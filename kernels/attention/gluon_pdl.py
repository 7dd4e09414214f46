"""Programmatic dependent launch inside Gluon kernels (sm_90+; the launcher passes ``launch_pdl``):
the two ``griddepcontrol`` instructions as inline PTX, for the staged INT4 decode and the Gluon query rotation and
reduction. (The Triton kernels use ``triton.language.extra.cuda``'s, in ``common.py``.)"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def gdc_wait(x):
    """``griddepcontrol.wait``: the previous kernel of the stream has finished and its writes are
    visible (a no-op in a kernel launched without ``launch_pdl``). ``x``: any scalar, to order it."""
    return gl.inline_asm_elementwise(asm="griddepcontrol.wait; mov.b32 $0, 0;", constraints="=r,r", args=[x],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gdc_release(x):
    """``griddepcontrol.launch_dependents``: the next kernel may be scheduled now (it still waits
    for this one in its own :func:`gdc_wait`)."""
    return gl.inline_asm_elementwise(asm="griddepcontrol.launch_dependents; mov.b32 $0, 0;", constraints="=r,r",
                                     args=[x], dtype=gl.int32, is_pure=False, pack=1)
