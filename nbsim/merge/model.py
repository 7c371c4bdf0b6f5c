"""The structure factors as refined quantities: log|F| of each unique reflection (|F| positive by construction),
expanded into the kernel's padded P1 table, and the restraints a user can weigh on them.

Restraints are Gaussian in log|F|, so their σ is relative (0.1: about 10 %): towards the start, towards the
mean log|F| of the reflection's resolution shell, and an F(+) towards its F(−)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NbsimError
from .reflections import Reflections, shells

FLOOR_FRACTION = 1e-3
"""No |F| goes below this fraction of the starting mean |F| (a start of zero begins there): log 0 has no gradient,
and the maximum-likelihood |F| of a reflection whose pixels hold no counts is 0."""


@dataclass(frozen=True)
class Restraints:
    """σ of each restraint on log|F| (None: off); `shells`: how many resolution shells the shell mean takes."""

    start: float | None = None
    shell: float | None = None
    friedel: float | None = None
    shells: int = 10

    def check(self) -> None:
        """A σ not above zero, or fewer than one shell, is an input error."""
        for name in ("start", "shell", "friedel"):
            sigma = getattr(self, name)
            if sigma is not None and not (sigma > 0 and math.isfinite(sigma)):
                raise NbsimError(f"the {name} restraint's sigma must be a finite number above 0 (got {sigma:g})")
        if self.shells < 1:
            raise NbsimError(f"the shell restraint needs at least one shell (got {self.shells})")


class StructureFactorModel:
    """log|F| of the reflections' parameters, their restraints, and the kernel table they make."""

    def __init__(self, reflections: Reflections, start_F: np.ndarray, restraints: Restraints):
        restraints.check()
        self.reflections = reflections
        self.restraints = restraints
        start = np.asarray(start_F, np.float64)
        floor = FLOOR_FRACTION * max(float(np.mean(np.clip(start, 0.0, None))), 1e-12)
        self.log_floor = math.log(floor)
        self.log_start = torch.log(torch.as_tensor(np.maximum(start, floor)))
        shell = shells(reflections.parameter_d_A(), restraints.shells)
        self.shell = torch.as_tensor(shell)
        self.shell_count = torch.bincount(self.shell, minlength=restraints.shells).to(torch.float64)
        plus, minus = reflections.friedel_pairs()
        self.pairs = torch.as_tensor(plus), torch.as_tensor(minus)
        start_intensity = torch.exp(2.0 * self.log_start)
        shell_mean = torch.zeros_like(self.shell_count).index_add(0, self.shell, start_intensity) / \
            self.shell_count.clamp(min=1)
        self.log_reference = 0.5 * torch.log(shell_mean[self.shell])
        """log|F| of each parameter's reference: √ of the start's mean |F|² in its shell. The information a
        parameter's pixels would have about it at that |F| says whether they measure it (nbsim.merge.refine),
        whatever its estimate."""

    @property
    def size(self) -> int:
        """How many |F| are refined."""
        return self.reflections.size

    def table(self, log_F: torch.Tensor, base: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """The kernel's flat padded table with each mapped node (`nodes` ≥ 0) holding its parameter's |F| and
        the rest `base`'s values (differentiable in log_F)."""
        amplitudes = torch.exp(log_F).to(base.dtype)
        return torch.where(nodes >= 0, amplitudes[nodes.clamp(min=0)], base)

    def penalty(self, log_F: torch.Tensor) -> torch.Tensor:
        """½ Σ (deviation/σ)² over the restraints that are on."""
        total = torch.zeros((), dtype=torch.float64)
        r = self.restraints
        if r.start is not None:
            total = total + 0.5 * torch.square((log_F - self.log_start) / r.start).sum()
        if r.shell is not None:
            means = torch.zeros_like(self.shell_count).index_add(0, self.shell, log_F) / self.shell_count.clamp(min=1)
            total = total + 0.5 * torch.square((log_F - means[self.shell]) / r.shell).sum()
        if r.friedel is not None and len(self.pairs[0]):
            total = total + 0.5 * torch.square((log_F[self.pairs[0]] - log_F[self.pairs[1]]) / r.friedel).sum()
        return total

    def curvature(self) -> torch.Tensor:
        """The diagonal of the restraints' Hessian in log|F| (constant: they are quadratic)."""
        diagonal = torch.zeros(self.size, dtype=torch.float64)
        r = self.restraints
        if r.start is not None:
            diagonal += 1.0 / r.start ** 2
        if r.shell is not None:
            diagonal += (1.0 - 1.0 / self.shell_count[self.shell].clamp(min=1)) / r.shell ** 2
        if r.friedel is not None and len(self.pairs[0]):
            diagonal[self.pairs[0]] += 1.0 / r.friedel ** 2
            diagonal[self.pairs[1]] += 1.0 / r.friedel ** 2
        return diagonal
