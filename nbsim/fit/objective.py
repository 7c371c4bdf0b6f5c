"""What a fit minimises: the images and their counts (`FitImage`), how to fit (`FitOptions`), and the
objective (`Objective`): the negative log-likelihood of every image's fitted pixels, their background and the
restraints, as a function of the model's internal coordinates, image by image (`image_terms`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import NbsimError
from ..modes import Compile
from ..resolve import Setup
from .likelihood import LIKELIHOODS, negative_log_likelihood
from .model import DiffractionModel
from .pixels import Shoeboxes

OPTIMIZERS = ("auto", "fisher", "lbfgs", "adam")
"""auto: fisher where it applies (`fisher_applies`), else lbfgs."""
BACKGROUNDS = ("plane", "flat", "none")


@dataclass(frozen=True)
class FitImage:
    """One observed image and its starting model: counts in photons (slow, fast), or (panels, slow, fast) of a
    multi-panel detector, which pixels can be used (unmasked, below the overload, on a panel), and its observed
    spots where another program found them."""

    name: str
    setup: Setup
    counts: np.ndarray
    usable: np.ndarray
    spots: np.ndarray | None = None
    """Centre pixels (row, col) of the observed spots (DIALS's: `nbsim fit --refl`), brightest first; None: the
    fit finds them in the image (nbsim.fit.pixels.observed_spots)."""


@dataclass(frozen=True)
class FitOptions:
    """How to fit: what is refined and shared, the pixels, the likelihood, the optimiser and its stops."""

    refine: tuple[str, ...] = ("orientation", "cell", "N", "scale")
    shared: tuple[str, ...] = ()
    lattice: str | None = None
    shoebox_px: int = 9
    max_spots: int = 200
    observed_spots: bool = True
    background: str = "plane"
    likelihood: str = "poisson"
    readout_photons: float = 0.0
    optimizer: str = "auto"
    max_iterations: int = 100
    gradient_tolerance: float = 1e-4
    """Stop when the largest |∂NLL/∂x| falls below this (x: the dimensionless coordinates)."""
    change_tolerance: float = 1e-12
    """Stop when an iteration changes the NLL by less than this fraction of its size (never below the dtype's
    rounding: `relative_change_stop`)."""
    restraints: dict[str, float] = field(default_factory=dict)
    """Gaussian restraints towards the start: name → σ in the quantity's units (degrees for orientation; mm of
    the shifts and degrees of the rotations for panels)."""
    groups: str | Mapping[str, Sequence[str]] = "modules"
    """The panel groups "panels" moves: "modules", "all" or group name → panel names (nbsim.fit.panels)."""
    search_deg: float = 0.3
    """How far off the starting orientation may be: sets the coarse stage's broadening (0: no coarse stage)."""
    device: str = "cpu"
    dtype: torch.dtype = torch.float64
    compile: Compile | bool | str = Compile.AUTO
    """The fit's compiled kernel (nbsim.fit.model.DiffractionModel): "auto" uses it when cached or when
    building it pays (`compile_plan`), "on" always (built first if needed), "off" never."""

    def check(self) -> None:
        """Raise a one-line NbsimError for an option out of range."""
        if self.likelihood not in LIKELIHOODS:
            raise NbsimError(f"likelihood must be one of {', '.join(LIKELIHOODS)} (got {self.likelihood!r})")
        if self.optimizer not in OPTIMIZERS:
            raise NbsimError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.background not in BACKGROUNDS:
            raise NbsimError(f"background must be one of {', '.join(BACKGROUNDS)} (got {self.background!r})")
        if self.max_iterations < 1:
            raise NbsimError(f"the iteration cap must be at least 1 (got {self.max_iterations})")
        if self.max_spots < 1:
            raise NbsimError(f"max spots must be at least 1 (got {self.max_spots})")
        if self.readout_photons < 0 or not math.isfinite(self.readout_photons):
            raise NbsimError(f"readout noise must be a finite number not below 0 (got {self.readout_photons:g})")
        for name, sigma in self.restraints.items():
            if not sigma > 0:
                raise NbsimError(f"restraint sigma of {name} must be above 0 (got {sigma:g})")
            if name not in self.refine:
                raise NbsimError(f"restraint on {name}, which is not refined")


class Objective:
    """The negative log-likelihood of every image (plus restraints) as a function of the model's internal
    coordinates. Each shoebox's background plane is held fixed while the model is refined: first the plane
    through its border's counts, then, after `refresh_planes`, through its border's residuals (counts less
    the model), so a spot's own tails do not count as background (alternated to a fixed point by `fit`)."""

    def __init__(self, model: DiffractionModel, images: Sequence[FitImage], boxes: Sequence[Shoeboxes],
                 options: FitOptions):
        self.model = model
        self.options = options
        self.counts = [torch.as_tensor(b.take(image.counts), dtype=torch.float64, device=model.device)
                       for image, b in zip(images, boxes, strict=True)]
        self.flat = [torch.as_tensor(b.background, dtype=torch.float64, device=model.device) for b in boxes]
        self.planes_operators = [None if b.plane is None else b.plane.to(model.device) for b in boxes]
        self.planes = [self._planes(image, torch.zeros_like(counts)) for image, counts in enumerate(self.counts)]
        self.restraints = {name: sigma for name, sigma in options.restraints.items() if name in model.refine}
        """The options' restraints on what this model refines (a fit's search stages refine less than it)."""

    def _planes(self, image: int, photons: torch.Tensor) -> torch.Tensor:
        """Each box's plane through its border's counts less `photons` (not below zero)."""
        operator = self.planes_operators[image]
        if operator is None:
            return torch.zeros_like(self.counts[image])
        return torch.clamp(operator(self.counts[image] - photons), min=0.0)

    def refresh_planes(self) -> float:
        """Refit the planes to the residuals of the current model; the largest change, in photons."""
        with torch.no_grad():
            change = 0.0
            for image, photons in enumerate(self.model()):
                planes = self._planes(image, photons.to(torch.float64))
                change = max(change, float((planes - self.planes[image]).abs().max())) if len(planes) else change
                self.planes[image] = planes
        return change

    def expected(self, internal: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Expected photons at each image's pixels: the model plus the background (the fixed planes and the
        refined flat level)."""
        values = self.model.natural(internal)
        return [photons.to(torch.float64) + self.planes[image] + self.flat[image] * image_values["background"][0]
                for image, (photons, image_values) in enumerate(zip(self.model.photons(values), values, strict=True))]

    def __call__(self, internal: torch.Tensor | None = None) -> torch.Tensor:
        return self.of_expected(self.expected(internal), internal)

    def of_expected(self, expected: list[torch.Tensor], internal: torch.Tensor | None = None) -> torch.Tensor:
        """The objective from each image's expected photons (at `internal`, for the restraints)."""
        return self.image_terms(expected, internal).sum()

    def image_terms(self, expected: list[torch.Tensor], internal: torch.Tensor | None = None,
                    images: Sequence[int] | None = None) -> torch.Tensor:
        """Each image's part of the objective (len(images),): its negative log-likelihood and its restraints;
        `expected`: those images' expected photons (default: every image's)."""
        images = range(len(self.counts)) if images is None else images
        likelihoods = torch.stack([negative_log_likelihood(photons, self.counts[image], self.options.readout_photons,
                                                           self.options.likelihood)
                                   for photons, image in zip(expected, images, strict=True)])
        if not self.restraints:
            return likelihoods
        return likelihoods + 0.5 * torch.square(self.restraint_residuals(internal, images)).sum(dim=1)

    def restraint_residuals(self, internal: torch.Tensor | None, images: Sequence[int] | None = None) -> torch.Tensor:
        """(images, R): (value − start)/σ of every restrained quantity's components, per image (default every
        image); a shared quantity's restraint counts once, in the first image's row (zeros in the others)."""
        values = self.model.natural(internal)
        rows = []
        for image in range(len(self.counts)) if images is None else images:
            start = self.model.starts[image]
            changes = []
            for name, sigma in self.restraints.items():
                change = values[image][name] - start[name]
                if name in self.model.shared and image > 0:
                    change = torch.zeros_like(change)
                changes.append((torch.rad2deg(change) if name == "orientation" else change) / sigma)
            rows.append(torch.cat(changes))
        return torch.stack(rows)


def relative_change_stop(options: FitOptions) -> float:
    """The relative change of the likelihood that ends a fit: the one asked, but never below the rounding of
    the dtype the model renders in (in float32 the likelihood's last digits are rounding, and a line search
    asked to resolve them fails at the optimum)."""
    return max(options.change_tolerance, torch.finfo(options.dtype).eps)
