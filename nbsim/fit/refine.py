"""Fitting images: pixels chosen, the likelihood minimised by L-BFGS (Adam as the fallback), and standard
errors from the inverse Hessian of the negative log-likelihood at the optimum, all by autograd.

`fit(images, options)` is the library call; `nbsim fit` parses its arguments into the same call.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import torch

from ..errors import NbsimError
from ..render import Renderer
from ..resolve import Setup
from .likelihood import LIKELIHOODS, negative_log_likelihood
from .model import DiffractionModel, observed_oversample, smooth_oversample, with_oversample
from .pixels import Shoeboxes, shoeboxes

OPTIMIZERS = ("lbfgs", "adam")
PLANE_ROUNDS = 3
"""How many times the background planes are refitted to the residuals and the model refined again."""
PLANE_TOLERANCE_PHOTONS = 0.01
"""A refit that moves no plane by more than this many photons at any pixel ends the rounds."""
BACKGROUNDS = ("plane", "flat", "none")
SAMPLING_ROUNDS = 3
"""How many times the fit starts again when the refined crystal changes the sub-pixels its image needs."""


@dataclass(frozen=True)
class FitImage:
    """One observed image and its starting model: counts in photons (slow, fast), and which pixels can be
    used (unmasked, below the overload)."""

    name: str
    setup: Setup
    counts: np.ndarray
    usable: np.ndarray


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
    optimizer: str = "lbfgs"
    max_iterations: int = 100
    gradient_tolerance: float = 1e-4
    """Stop when the largest |∂NLL/∂x| falls below this (x: the dimensionless coordinates)."""
    change_tolerance: float = 1e-12
    """Stop when an iteration changes the NLL by less than this fraction of its size (never below the dtype's
    rounding: `relative_change_stop`)."""
    restraints: dict[str, float] = field(default_factory=dict)
    """Gaussian restraints towards the start: name → σ in the quantity's units (degrees for orientation)."""
    search_deg: float = 0.3
    """How far off the starting orientation may be: sets the coarse stage's broadening (0: no coarse stage)."""
    device: str = "cpu"
    dtype: torch.dtype = torch.float64
    compile: bool = False
    """Render the fitted pixels through torch.compile (a compile per kernel structure; see docs/fitting.md)."""

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


@dataclass
class FitResult:
    """A finished fit: the model at the optimum, its pixels, the outcome and the standard errors."""

    images: list[FitImage]
    model: DiffractionModel
    boxes: list[Shoeboxes]
    converged: bool
    reason: str
    iterations: int
    seconds: float
    nll: float
    covariance: torch.Tensor | None
    history: list[float]
    expected: list[torch.Tensor]
    """Expected photons (model and background) at each image's fitted pixels, at the optimum."""

    @property
    def pixels(self) -> int:
        """Fitted pixels over every image."""
        return sum(b.count for b in self.boxes)


class Objective:
    """The negative log-likelihood of every image (plus restraints) as a function of the model's internal
    coordinates. Each shoebox's background plane is held fixed while the model is refined: first the plane
    through its border's counts, then, after `refresh_planes`, through its border's residuals (counts less
    the model), so a spot's own tails do not count as background (alternated to a fixed point by `fit`)."""

    def __init__(self, model: DiffractionModel, images: Sequence[FitImage], boxes: Sequence[Shoeboxes],
                 options: FitOptions):
        self.model = model
        self.options = options
        self.counts = [torch.as_tensor(image.counts[b.rows, b.cols], dtype=torch.float64, device=model.device)
                       for image, b in zip(images, boxes, strict=True)]
        self.flat = [torch.as_tensor(b.background, dtype=torch.float64, device=model.device) for b in boxes]
        self.planes_operators = [None if b.plane is None else b.plane.to(model.device) for b in boxes]
        self.planes = [self._planes(image, torch.zeros_like(counts)) for image, counts in enumerate(self.counts)]

    def _planes(self, image: int, photons: torch.Tensor) -> torch.Tensor:
        """Each box's plane through its border's counts less `photons` (not below zero)."""
        operator = self.planes_operators[image]
        if operator is None:
            return torch.zeros_like(self.counts[image])
        residual = (self.counts[image] - photons).unsqueeze(-1)
        return torch.clamp(torch.sparse.mm(operator, residual).squeeze(-1), min=0.0)

    def refresh_planes(self) -> float:
        """Refit the planes to the residuals of the current model; the largest change, in photons."""
        with torch.no_grad():
            values = self.model.natural()
            change = 0.0
            for image in range(len(self.counts)):
                photons = self.model.render(image, values[image]).to(torch.float64)
                planes = self._planes(image, photons)
                change = max(change, float((planes - self.planes[image]).abs().max())) if len(planes) else change
                self.planes[image] = planes
        return change

    def expected(self, internal: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Expected photons at each image's pixels: the model plus the background (the fixed planes and the
        refined flat level)."""
        values = self.model.natural(internal)
        return [self.model.render(image, image_values).to(torch.float64) + self.planes[image]
                + self.flat[image] * image_values["background"][0] for image, image_values in enumerate(values)]

    def __call__(self, internal: torch.Tensor | None = None) -> torch.Tensor:
        return self.of_expected(self.expected(internal), internal)

    def of_expected(self, expected: list[torch.Tensor], internal: torch.Tensor | None = None) -> torch.Tensor:
        """The objective from each image's expected photons (at `internal`, for the restraints)."""
        total = sum(negative_log_likelihood(photons, counts, self.options.readout_photons, self.options.likelihood)
                    for photons, counts in zip(expected, self.counts, strict=True))
        return total + self.restraint(internal)

    def restraint(self, internal: torch.Tensor | None) -> torch.Tensor:
        """½ Σ ((value − start)/σ)² over the restrained quantities of every image."""
        total = torch.zeros((), dtype=torch.float64)
        if not self.options.restraints:
            return total
        values = self.model.natural(internal)
        for image, start in enumerate(self.model.starts):
            for name, sigma in self.options.restraints.items():
                change = values[image][name] - start[name]
                if name == "orientation":
                    change = torch.rad2deg(change)
                total = total + 0.5 * torch.square(change / sigma).sum()
        return total


def predicted_image(setup: Setup) -> np.ndarray:
    """The starting model's whole image (photons), to place the shoeboxes."""
    with torch.no_grad():
        return Renderer(setup, dtype=torch.float32, compile="auto")().double().numpy()


def choose_pixels(images: Sequence[FitImage], setups: Sequence[Setup], options: FitOptions) -> list[Shoeboxes]:
    """Each image's shoeboxes, placed by its model in `setups`; an image whose shape differs from its model's
    detector is an input error."""
    boxes = []
    for image, setup in zip(images, setups, strict=True):
        shape = setup.shape
        if tuple(image.counts.shape) != tuple(shape):
            raise NbsimError(f"{image.name}: the image is {image.counts.shape[-1]}x{image.counts.shape[0]} pixels "
                             f"but the model's detector is {shape[-1]}x{shape[0]}")
        boxes.append(shoeboxes(predicted_image(setup), image.counts, image.usable, options.shoebox_px,
                               options.max_spots, options.observed_spots, options.background))
        if not np.any(image.counts[boxes[-1].rows, boxes[-1].cols] > 0):
            raise NbsimError(f"{image.name}: the shoeboxes hold no counts")
    return boxes


def starting_scales(objective: Objective) -> None:
    """Each image's scale set so the model's photons in its shoeboxes add up to the observed counts less
    the background (a start within the scale's basin, whatever the fluence given)."""
    model = objective.model
    with torch.no_grad():
        for image, expected in enumerate(model()):
            signal = float((objective.counts[image] - objective.planes[image] - objective.flat[image]).sum())
            total = float(expected.sum())
            if signal > 0 and total > 0:
                model.set_start(image, "scale", model.starts[image]["scale"] * signal / total)


def hessian(objective: Objective, internal: torch.Tensor) -> torch.Tensor:
    """The Hessian of the objective in the internal coordinates, by autograd. Quantities of different images
    do not interact, so one Hessian-vector product serves the k-th quantity of every image at once; shared
    quantities take one each."""
    model = objective.model
    size = model.size
    x = internal.detach().clone().requires_grad_(True)
    gradient = torch.autograd.grad(objective(x), x, create_graph=True)[0]
    per_image: list[list[int]] = [[] for _ in model.setups]
    shared: list[int] = []
    for slot in model.slots:
        indices = list(range(slot.start, slot.stop))
        (shared if slot.image is None else per_image[slot.image]).extend(indices)
    result = torch.zeros(size, size, dtype=torch.float64)

    def product(vector: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(gradient @ vector, x, retain_graph=True)[0].detach()

    for column in shared:
        vector = torch.zeros(size, dtype=torch.float64)
        vector[column] = 1.0
        result[:, column] = product(vector)
    for position in range(max((len(p) for p in per_image), default=0)):
        columns = [indices[position] for indices in per_image if position < len(indices)]
        vector = torch.zeros(size, dtype=torch.float64)
        vector[columns] = 1.0
        column_values = product(vector)
        for indices in per_image:
            if position < len(indices):
                result[indices, indices[position]] = column_values[indices]
    for column in shared:
        result[column, :] = result[:, column]
    return 0.5 * (result + result.T)


def covariance_of(matrix: torch.Tensor) -> torch.Tensor | None:
    """The inverse of a positive-definite Hessian, else None (no honest standard errors then)."""
    try:
        factor = torch.linalg.cholesky(matrix)
    except torch.linalg.LinAlgError:
        return None
    return torch.cholesky_inverse(factor)


def stage_objective(images: Sequence[FitImage], setups: Sequence[Setup], boxes: Sequence[Shoeboxes],
                    refine: Sequence[str], options: FitOptions,
                    n_cells: Sequence[Sequence[float]] | None = None) -> Objective:
    """The objective of one stage of a fit: its model of `refine` on the boxes' pixels, with N started at
    `n_cells` where given, and each image's scale started from its counts."""
    model = DiffractionModel(setups, [(b.rows, b.cols) for b in boxes], refine, options.shared, options.lattice,
                             options.device, options.dtype, options.compile)
    for image, cells in enumerate(n_cells or []):
        model.set_start(image, "N", cells)
    objective = Objective(model, images, boxes, options)
    if "scale" in model.refine:
        starting_scales(objective)
    return objective


def coarse_cells(setup: Setup, boxes: Shoeboxes, search_deg: float) -> list[float]:
    """Unit cells per axis for the coarse stage: few enough that a spot at the fitted pixels' highest
    resolution stays on its reflection's rocking curve when the orientation is `search_deg` off (the
    rocking width 1/(N·a) at least the displacement |q|·δθ), never fewer than 3 nor more than the start."""
    geometry = setup.geometry
    rows = torch.as_tensor(boxes.rows, dtype=torch.float64)
    cols = torch.as_tensor(boxes.cols, dtype=torch.float64)
    pixel = geometry.pixel_size_m
    positions = (geometry.pix0_m.detach() + (cols + 0.5).unsqueeze(-1) * pixel * geometry.fdet.detach()
                 + (rows + 0.5).unsqueeze(-1) * pixel * geometry.sdet.detach())
    cos_two_theta = (positions / positions.norm(dim=1, keepdim=True)) @ geometry.beam.detach()
    wavelength = float(setup.sources.wavelength_A.detach().min())
    q_max = float(torch.sqrt(torch.clamp(2.0 - 2.0 * cos_two_theta, min=0.0)).max()) / wavelength
    lengths = setup.lattice.cell_parameters()[:3]
    step = q_max * math.radians(search_deg)
    return [float(min(max(3.0, 1.0 / (step * length)), float(n))) if step > 0 else float(n)
            for length, n in zip(lengths, setup.n_cells, strict=True)]


def fit(images: Sequence[FitImage], options: FitOptions,
        progress: Callable[[str, int, float, float, float], None] | None = None) -> FitResult:
    """Fit the images' models to their counts, in stages. Unless `options.search_deg` is 0, the search is on a
    smooth likelihood, every pixel averaged over its area (`smooth_stage`): a coarse stage refines all but N
    and the mosaic spread (with the orientation refined, with the unit cells per axis cut so that the rocking
    curves span the search range) and places the shoeboxes again by its result, then a smooth stage refines
    everything asked (N too). The fit ends from there with the pixels sampled as the image was
    (`observed_oversample`, followed as the refined crystal changes it). `progress(stage, iteration, nll,
    gradient_max, seconds)` is called after each iteration."""
    options.check()
    started = time.perf_counter()
    if not images:
        raise NbsimError("no images to fit")
    refine = list(options.refine)
    if options.background == "flat" and "background" not in refine:
        refine.append("background")
    setups = [image.setup for image in images]
    boxes = choose_pixels(images, setups, options)

    def report(stage: str) -> Callable[[int, float, float, float], None] | None:
        return None if progress is None else (lambda *values: progress(stage, *values))

    total_iterations = 0
    if options.search_deg > 0:
        coarse = [name for name in refine if name not in ("N", "mosaic")]
        stages = ([("coarse", coarse)] if coarse else []) + ([("smooth", refine)] if refine != coarse else [])
        n_cells = None
        if "orientation" in refine:
            n_cells = [coarse_cells(setup, b, options.search_deg) for setup, b in zip(setups, boxes, strict=True)]
        for stage, names in stages:
            setups, iterations = smooth_stage(images, setups, boxes, names, options, report(stage), started, n_cells)
            total_iterations += iterations
            if stage == "coarse":
                boxes = choose_pixels(images, setups, options)
            n_cells = None
    history: list[float] = []
    for _ in range(SAMPLING_ROUNDS):
        setups = [with_oversample(setup, observed_oversample(setup)) for setup in setups]
        objective = stage_objective(images, setups, boxes, refine, options)
        converged, reason, iterations, more = refine_with_planes(objective, options, report("fit"), started)
        total_iterations += iterations
        history += more
        setups = objective.model.refined_setups()
        if all(observed_oversample(setup) == setup.oversample for setup in setups):
            break
    model = objective.model
    covariance = None
    if model.size:
        covariance = covariance_of(hessian(objective, model.internal))
        if covariance is None and converged:
            converged, reason = False, "the Hessian at the optimum is not positive definite (no standard errors)"
    with torch.no_grad():
        expected = objective.expected()
        nll = float(objective.of_expected(expected))
    return FitResult(images=list(images), model=model, boxes=boxes, converged=converged, reason=reason,
                     iterations=total_iterations, seconds=time.perf_counter() - started, nll=nll,
                     covariance=covariance, history=history, expected=expected)


def smooth_stage(images: Sequence[FitImage], setups: Sequence[Setup], boxes: Sequence[Shoeboxes],
                 refine: Sequence[str], options: FitOptions,
                 progress: Callable[[int, float, float, float], None] | None, started: float,
                 n_cells: Sequence[Sequence[float]] | None = None) -> tuple[list[Setup], int]:
    """Refine `refine` with every pixel averaged over its area (`smooth_oversample`, for N cut to `n_cells`
    where given): a likelihood without the walls of point samples crossing the lattice factor's nodes. The
    refined set-ups, back at their own sampling and, where N was cut, their own N; the iterations taken."""
    cut = [dataclasses.replace(setup, n_cells=cells) for setup, cells in zip(setups, n_cells, strict=True)] \
        if n_cells else list(setups)
    smooth = [with_oversample(setup, smooth_oversample(each)) for setup, each in zip(setups, cut, strict=True)]
    objective = stage_objective(images, smooth, boxes, refine, options, n_cells)
    _, _, iterations, _ = minimise(objective, options, progress, started)
    refined = objective.model.refined_setups()
    if n_cells:
        refined = [dataclasses.replace(each, n_cells=setup.n_cells)
                   for each, setup in zip(refined, setups, strict=True)]
    return [with_oversample(each, setup.oversample) for each, setup in zip(refined, setups, strict=True)], iterations


def refine_with_planes(objective: Objective, options: FitOptions,
                       progress: Callable[[int, float, float, float], None] | None,
                       started: float) -> tuple[bool, str, int, list[float]]:
    """`minimise`, then the background planes refitted to the residuals and the model refined again, until no
    plane moves by PLANE_TOLERANCE_PHOTONS (at most PLANE_ROUNDS times)."""
    converged, reason, iterations, history = minimise(objective, options, progress, started)
    for _ in range(PLANE_ROUNDS):
        if objective.refresh_planes() <= PLANE_TOLERANCE_PHOTONS:
            break
        converged, reason, more_iterations, more = minimise(objective, options, progress, started)
        iterations += more_iterations
        history += more
    return converged, reason, iterations, history


def relative_change_stop(options: FitOptions) -> float:
    """The relative change of the likelihood that ends a fit: the one asked, but never below the rounding of
    the dtype the model renders in (in float32 the likelihood's last digits are rounding, and a line search
    asked to resolve them fails at the optimum)."""
    return max(options.change_tolerance, torch.finfo(options.dtype).eps)


def minimise(objective: Objective, options: FitOptions,
             progress: Callable[[int, float, float, float], None] | None,
             started: float) -> tuple[bool, str, int, list[float]]:
    """Run the optimiser on the model's internal coordinates: (converged, reason, iterations, NLL history).
    L-BFGS is SciPy's L-BFGS-B (the optimiser diffBragg uses) on the value and gradient autograd gives;
    Adam is torch's, stopped by the same tests."""
    model = objective.model
    if not model.size:
        return True, "nothing to refine", 0, [float(objective().detach())]
    if options.optimizer == "adam":
        return _adam(objective, options, progress, started)
    history: list[float] = []
    latest: dict[str, float] = {}

    def value_and_gradient(point: np.ndarray) -> tuple[float, np.ndarray]:
        x = torch.as_tensor(point, dtype=torch.float64).requires_grad_(True)
        value = objective(x)
        gradient = torch.autograd.grad(value, x)[0]
        latest["value"], latest["gradient"] = float(value.detach()), float(gradient.abs().max())
        if not math.isfinite(latest["value"]) or not torch.isfinite(gradient).all():
            raise FloatingPointError
        return latest["value"], gradient.numpy().astype(np.float64)

    def after_iteration(point: np.ndarray) -> None:
        history.append(latest["value"])
        if progress is not None:
            progress(len(history), latest["value"], latest["gradient"], time.perf_counter() - started)

    start = model.internal.detach().numpy().copy()
    try:
        outcome = scipy.optimize.minimize(
            value_and_gradient, start, jac=True, method="L-BFGS-B", callback=after_iteration,
            options={"maxiter": options.max_iterations, "gtol": options.gradient_tolerance,
                     "ftol": relative_change_stop(options), "maxcor": 20})
    except FloatingPointError:
        return False, f"the likelihood became NaN or infinite at iteration {len(history) + 1}", len(history), history
    with torch.no_grad():
        model.internal.copy_(torch.as_tensor(outcome.x, dtype=torch.float64))
    message = outcome.message if isinstance(outcome.message, str) else outcome.message.decode()
    if outcome.status == 1:
        message = f"iteration cap ({options.max_iterations}) reached"
    return bool(outcome.success), message.lower(), int(outcome.nit), history


def _adam(objective: Objective, options: FitOptions, progress: Callable[[int, float, float, float], None] | None,
          started: float) -> tuple[bool, str, int, list[float]]:
    """Adam on the internal coordinates (steps of a tenth of a typical step, decaying), stopped by the
    gradient or relative-change test."""
    parameter = objective.model.internal
    optimizer = torch.optim.Adam([parameter], lr=0.1)
    history: list[float] = []
    for iteration in range(1, options.max_iterations + 1):
        optimizer.zero_grad()
        value = objective()
        value.backward()
        nll, gradient_max = float(value.detach()), float(parameter.grad.abs().max())
        if not math.isfinite(nll) or not torch.isfinite(parameter.grad).all():
            return False, f"the likelihood became NaN or infinite at iteration {iteration}", iteration, history
        history.append(nll)
        if progress is not None:
            progress(iteration, nll, gradient_max, time.perf_counter() - started)
        if gradient_max <= options.gradient_tolerance:
            return True, "projected gradient below gtol", iteration, history
        if len(history) > 1 and abs(history[-2] - nll) <= relative_change_stop(options) * max(abs(nll), 1.0):
            return True, "relative reduction of f below ftol", iteration, history
        optimizer.step()
    return False, f"iteration cap ({options.max_iterations}) reached", options.max_iterations, history
