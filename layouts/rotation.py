"""The INT4 rotation's sign vector: the one piece of the rotation every writer and reader shares.

``s`` is a ±1 vector of length ``head_size`` that depends on ``head_size`` alone (vLLM's seed
and generator): a CPU ``torch.Generator`` seeded with ``RHT_SIGN_SEED``, ``torch.bernoulli`` of
a length-``head_size`` tensor of 0.5, mapped ``b -> 2b - 1``. The same ``s`` serves every layer,
head, K, V and Q in every process. The oracle (``kernels.reference``) and the kernels both take
it from here, so neither imports the other for it.
"""

from __future__ import annotations

import functools

import torch

from .descriptor import RHT_SIGN_SEED


@functools.lru_cache(maxsize=None)
def _rht_signs_cpu(head_size: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(RHT_SIGN_SEED)
    b = torch.bernoulli(torch.full((head_size,), 0.5), generator=g)
    return 2.0 * b - 1.0


@functools.lru_cache(maxsize=None)
def _rht_signs_on(head_size: int, device: str) -> torch.Tensor:
    return _rht_signs_cpu(head_size).to(device)


def rht_signs(head_size: int, device="cpu") -> torch.Tensor:
    """The ±1 float32 vector ``s``, ``[head_size]``, on ``device``.

    One shared tensor per (head_size, device), made once: callers must not modify it in place.
    (A copy to the GPU per call would be a pageable host-to-device copy, which synchronizes the
    stream: the kernel launchers call this on every write and attention.)
    """
    return _rht_signs_on(head_size, str(torch.device(device)))
