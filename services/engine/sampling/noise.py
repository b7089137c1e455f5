"""Counter-based random numbers: each draw is a pure function of (seed, position, lane).

A sampled request's draws are keyed by its seed and the absolute position of the token
they decide, so no generator state is carried between steps and none has to be read or
advanced on the host: the same tensors run eagerly, inside a CUDA graph and on either side
of a disaggregated transfer, and give the same numbers. A seeded request reproduces its
tokens whatever shares its batch, whichever path (device-resident or general) runs its
step, and whether its first token came from a prefill worker.

Lanes keep the draws of one position apart: the drafter's draw of the token at position t
(DRAFT), the accept test of the draft at t (ACCEPT) and the target's draw at t (TARGET: a
prefill's first token, a plain decode step, a recovered or bonus token). Speculative
sampling stays exact with this keying: the tokens a step emits, up to position t, depend
only on draws keyed at positions <= t, so the draws at later positions are still fresh
when the next step uses them.
"""

from __future__ import annotations

import torch

DRAFT, ACCEPT, TARGET = 1, 2, 3
SEED_BITS = 64  # seeds are taken modulo 2**64, held as int64 (two's complement)
_MASK32 = 0xFFFFFFFF
_SALT = 0x3C6EF372  # mixes the lane into the first word
_UNIT = 2.0**-24  # float32 keeps 24 bits: u = k * 2**-24, k in [0, 2**24)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (xorshift-multiply rounds) on int64 values in [0, 2**32); the
    multipliers are below 2**31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, lane: int) -> torch.Tensor:
    """seeds [rows] int64 (any 64-bit pattern); positions [rows] or [rows, n] int64 >= 0 -> U[0, 1)
    float32 of the same shape as ``positions``, on its device: 24 random bits each."""
    s = seeds if positions.dim() == 1 else seeds[:, None]
    h = _mix((s & _MASK32) ^ (_SALT * lane & _MASK32))
    h = _mix(h ^ ((s >> 32) & _MASK32))
    h = _mix(h ^ (positions & _MASK32))
    h = _mix(h ^ ((positions >> 32) & _MASK32) ^ lane)
    return (h >> 8).float() * _UNIT


def request_seed(seed: int) -> int:
    """A request's seed as an int64 value: any Python int modulo 2**64, so every seed in
    [0, 2**64) keys its own draws."""
    wrapped = seed % (1 << SEED_BITS)
    return wrapped - (1 << SEED_BITS) if wrapped >= 1 << (SEED_BITS - 1) else wrapped
