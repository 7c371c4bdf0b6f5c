"""Counter-based random numbers for the detector: Philox4x32-10 (Salmon et al., SC'11, the generator of
Random123 and of PyTorch's CUDA streams) written as torch integer operations.

Every number is a pure function of (seed, stream, pixel index, draw): no state is carried from one pixel,
image or call to the next, so one image of a dataset, or one pixel of it, is drawn again alone, and the
integers are the same on every device (the floating-point functions built on them, log and the like, may
round differently from one device to another, so images are identical on the same device and dtype).
Pixel i takes word i mod 4 of the block i div 4; on the CPU the words come from the compiled philox.c
(the same words, faster), elsewhere or without a C compiler from the torch operations here.
"""

from __future__ import annotations

import math

import torch

from . import native

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10


def _mulhilo(multiplier: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of multiplier·value (value < 2³², int64), in 16-bit halves so that no
    intermediate leaves int64."""
    low_part = (value & 0xFFFF) * multiplier
    high_part = (value >> 16) * multiplier
    high = (high_part + (low_part >> 16)) >> 16
    low = (low_part + ((high_part & 0xFFFF) << 16)) & _MASK32
    return high, low


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the four 32-bit counter words (int64 tensors holding values below 2³²) under a
    64-bit key (two 32-bit words): four int64 tensors of 32-bit outputs."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(ROUNDS):
        if round_index:
            k0, k1 = (k0 + _WEYL[0]) & _MASK32, (k1 + _WEYL[1]) & _MASK32
        hi0, lo0 = _mulhilo(_MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _key(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & _MASK32, seed >> 32


def words(seed: int, stream: int, draw: int, index: torch.Tensor) -> torch.Tensor:
    """One 32-bit word (in int64) per flat pixel `index`: word index mod 4 of Philox4x32-10 of the counter
    (index div 4, draw, stream) under the 64-bit key `seed`."""
    if index.device.type == "cpu" and native.compiled_philox_available():
        return native.philox_words(seed, stream, draw, index)
    return torch_words(seed, stream, draw, index)


def torch_words(seed: int, stream: int, draw: int, index: torch.Tensor) -> torch.Tensor:
    """`words` computed with torch operations (any device)."""
    block = index >> 2
    counter = (block & _MASK32, (block >> 32) & _MASK32, torch.full_like(index, draw & _MASK32),
               torch.full_like(index, stream & _MASK32))
    return torch.stack(philox4x32(counter, _key(seed))).gather(0, (index & 3).unsqueeze(0)).squeeze(0)


def uniforms(seed: int, stream: int, draw: int, index: torch.Tensor) -> torch.Tensor:
    """A uniform deviate in (0, 1), float64, per flat pixel `index`."""
    return (words(seed, stream, draw, index).to(torch.float64) + 0.5) * 2.0 ** -32


def normals(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """A standard normal deviate per flat pixel `index` (Box–Muller of draws 0 and 1), float64."""
    u1, u2 = uniforms(seed, stream, 0, index), uniforms(seed, stream, 1, index)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


INVERSION_LIMIT = 10.0
"""Means below this are drawn by inversion (one uniform), the others by Hörmann's PTRS rejection."""


def poisson(rates: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """Poisson deviates of `rates` (float64, flat, ≥ 0), one per element, counter-keyed by element index.

    Small means by sequential inversion of one uniform; large means by transformed rejection with squeeze
    (PTRS, W. Hörmann, Insurance: Mathematics and Economics 12, 39 (1993)), each try using the next
    draw of the pixel's own counter, so the result does not depend on which other pixels needed retries.
    """
    counts = torch.zeros_like(rates)
    index = torch.arange(rates.numel(), device=rates.device, dtype=torch.int64)
    small = rates < INVERSION_LIMIT
    _inversion(rates, counts, index[small], seed, stream)
    _ptrs(rates, counts, index[~small], seed, stream)
    return counts


def _inversion(rates: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, seed: int, stream: int) -> None:
    """Count k up while the cumulative probability stays below the pixel's uniform; the pixels still
    counting are gathered into ever shorter arrays."""
    u = uniforms(seed, stream, 0, index)
    rate = rates[index]
    term = torch.exp(-rate)
    cumulative = term.clone()
    k = torch.zeros_like(rate)
    while index.numel():
        done = (u <= cumulative) | (term == 0)
        counts[index[done]] = k[done]
        going = torch.nonzero(~done).squeeze(1)
        index, u, rate, term, cumulative, k = (values.index_select(0, going)
                                               for values in (index, u, rate, term, cumulative, k))
        k += 1.0
        term *= rate / k
        cumulative += term


def _ptrs(rates: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, seed: int, stream: int) -> None:
    """Hörmann's PTRS: accept or reject a candidate per pixel, retrying the rejected with later draws."""
    attempt = 0
    while index.numel():
        rate = rates[index]
        u, v = uniforms(seed, stream, 2 * attempt, index), uniforms(seed, stream, 2 * attempt + 1, index)
        slam, loglam = torch.sqrt(rate), torch.log(rate)
        b = 0.931 + 2.53 * slam
        a = -0.059 + 0.02483 * b
        inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
        v_r = 0.9277 - 3.6224 / (b - 2.0)
        u = u - 0.5
        us = 0.5 - torch.abs(u)
        k = torch.floor((2.0 * a / us + b) * u + rate + 0.43)
        quick = (us >= 0.07) & (v <= v_r)
        hopeless = (k < 0) | ((us < 0.013) & (v > us))
        log_ratio = (torch.log(v) + torch.log(inv_alpha) - torch.log(a / (us * us) + b))
        exact = log_ratio <= -rate + k * loglam - torch.lgamma(k + 1.0)
        accept = quick | (~hopeless & exact)
        counts[index[accept]] = k[accept]
        index = index[~accept]
        attempt += 1
