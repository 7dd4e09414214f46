"""The INT4 rotation's sign vector: the one piece of the rotation every writer and reader shares.

``s`` is a ±1 vector of length ``head_size`` that depends on ``head_size`` alone (vLLM's seed
and generator): a CPU ``torch.Generator`` seeded with ``RHT_SIGN_SEED``, ``torch.bernoulli`` of
a length-``head_size`` tensor of 0.5, mapped ``b -> 2b - 1``. The same ``s`` serves every layer,
head, K, V and Q in every process. The oracle (``kernels.reference``) and the kernels both take
it from here, so neither imports the other for it.

:func:`sign_seed_override` exists for accuracy evaluation only: inside it every writer and
reader of this process draws ``s`` from another seed, so one result can be averaged over several
sign vectors (a single vector's INT4 error varies by about ±12%). Caches written inside are not
in the documented format (the descriptor's ``sign_seed`` stays the default's).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .descriptor import RHT_SIGN_SEED


_seed = [RHT_SIGN_SEED]  # the seed in use: the format's, except inside sign_seed_override


@functools.lru_cache(maxsize=None)
def _rht_signs_cpu(head_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = torch.bernoulli(torch.full((head_size,), 0.5), generator=g)
    return 2.0 * b - 1.0


@functools.lru_cache(maxsize=None)
def _rht_signs_on(head_size: int, device: str, seed: int) -> torch.Tensor:
    return _rht_signs_cpu(head_size, seed).to(device)


def rht_sign_seed() -> int:
    """The seed :func:`rht_signs` draws from now (``RHT_SIGN_SEED`` outside an override):
    kernels that cache tables derived from ``s`` key them by it."""
    return _seed[0]


@contextlib.contextmanager
def sign_seed_override(seed: int):
    """Evaluation only: inside the block :func:`rht_signs` draws ``s`` from ``seed``, for every
    writer and reader of this process (not thread-aware; nothing else may run meanwhile)."""
    old, _seed[0] = _seed[0], int(seed)
    try:
        yield
    finally:
        _seed[0] = old


def rht_signs(head_size: int, device="cpu") -> torch.Tensor:
    """The ±1 float32 vector ``s``, ``[head_size]``, on ``device``.

    One shared tensor per (head_size, device), made once: callers must not modify it in place.
    (A copy to the GPU per call would be a pageable host-to-device copy, which synchronizes the
    stream: the kernel launchers call this on every write and attention.)
    """
    return _rht_signs_on(head_size, str(torch.device(device)), _seed[0])
