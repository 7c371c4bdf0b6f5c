"""The negative log-likelihood of observed counts given the model's expected photons.

Counts are in photons: (ADU − ADC offset) / gain, as the detector response nbsim models writes them. The
readout noise σ (photons) enters as in diffBragg and CCD practice: "poisson" treats c + σ² as a Poisson
draw of λ + σ² (exact for σ = 0, the usual shifted-Poisson approximation otherwise); "gaussian" is
diffBragg's Gaussian approximation, variance λ + σ². Constants that do not depend on the model are left
out, so the value compares fits of the same pixels only.
"""

from __future__ import annotations

import torch

from ..errors import NbsimError

LIKELIHOODS = ("poisson", "gaussian")
FLOOR_PHOTONS = 1e-6
"""The smallest expected count a pixel may have (a model of exactly zero at a count would be −log 0)."""


def negative_log_likelihood(expected: torch.Tensor, counts: torch.Tensor, readout_photons: float,
                            kind: str = "poisson") -> torch.Tensor:
    """Σ over pixels of −log p(counts | expected), up to a model-free constant (float64)."""
    variance_floor = readout_photons * readout_photons
    expected = torch.clamp(expected.to(torch.float64), min=FLOOR_PHOTONS)
    counts = counts.to(torch.float64)
    if kind == "poisson":
        shifted = expected + variance_floor
        observed = torch.clamp(counts + variance_floor, min=0.0)
        return (shifted - observed * torch.log(shifted)).sum()
    if kind == "gaussian":
        variance = expected + variance_floor
        return 0.5 * (torch.square(counts - expected) / variance + torch.log(variance)).sum()
    raise NbsimError(f"likelihood must be one of {', '.join(LIKELIHOODS)} (got {kind!r})")
