"""Fitting images: pixels chosen, the likelihood minimised by L-BFGS (Adam as the fallback), and standard
errors from the inverse Hessian of the negative log-likelihood at the optimum, all by autograd.

`fit(images, options)` is the library call; `nbsim fit` parses its arguments into the same call.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch

from ..devices import dtype_name
from ..errors import NbsimError
from ..modes import Compile
from ..render import Renderer
from ..resolve import Setup
from .compiled import Variant, kernels_ready
from .joint import information, joint_applies, minimise_joint, product_columns
from .model import (
    DiffractionModel,
    observed_oversample,
    smooth_oversample,
    with_binned_spectrum,
    with_oversample,
    with_spectrum,
)
from .newton import evaluate, image_coordinates, minimise_fisher
from .objective import FitImage, FitOptions, Objective, relative_change_stop
from .panels import panel_groups, pixel_centres_m
from .pixels import Shoeboxes, shoeboxes
from .scattering import CRYSTAL_QUANTITIES, fixed_frame_fittable

PLANE_ROUNDS = 3
"""How many times the background planes are refitted to the residuals and the model refined again."""
PLANE_TOLERANCE_PHOTONS = 0.01
"""A refit that moves no plane by more than this many photons at any pixel ends the rounds."""
SEARCH_TOLERANCE = 0.05
"""A search stage stops once −log L is within this of its minimum as far as the optimiser can tell (an
iteration's gain, or Fisher scoring's predicted gain, below it): the search only has to end in the final
stage's basin, 0.05 in −log L is at most 0.32 standard errors of any parameter (√(2·0.05)), and the nearest-
node lookup of F makes the likelihood of broad search-stage spots rough at about that level."""
SAMPLING_ROUNDS = 3
"""How many times the fit starts again when the refined crystal changes the sub-pixels its image needs."""
PANEL_RESTRAINT = 0.1
"""σ (mm of a group's shift, degrees of its rotation) of the restraint towards the start that refined panels get
when none is given: a detector's metrology is known to about that before a fit, stills tell a module's tilt and
its place along the beam poorly, and a rotation of the whole detector about the beam is the same image as a
rotation of every crystal, which only a restraint places (docs/fitting.md, "Multi-panel detectors")."""


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
    restraints: dict[str, float] = dataclasses.field(default_factory=dict)
    """The restraints the fit applied (the options', and refined panels' PANEL_RESTRAINT where not given)."""

    @property
    def pixels(self) -> int:
        """Fitted pixels over every image."""
        return sum(b.count for b in self.boxes)


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
            raise NbsimError(f"{image.name}: the image is {_described(image.counts.shape)} but the model's detector "
                             f"is {_described(shape)}")
        boxes.append(shoeboxes(predicted_image(setup), image.counts, image.usable, options.shoebox_px,
                               options.max_spots, options.observed_spots, options.background, image.spots))
        if not np.any(boxes[-1].take(image.counts) > 0):
            raise NbsimError(f"{image.name}: the shoeboxes hold no counts")
    return boxes


def _described(shape: tuple[int, ...]) -> str:
    """An image's shape as a reader says it: fast x slow pixels, and its panels."""
    pixels = f"{shape[-1]}x{shape[-2]} pixels"
    return pixels if len(shape) == 2 else f"{shape[0]} panels of up to {pixels}"


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


HESSIAN_STEP = 1e-2
"""The step (in the dimensionless coordinates: a hundredth of a typical step) of the central differences of
gradients that give the Hessian where the model has no second derivatives (its compiled kernel)."""


def hessian(objective: Objective, internal: torch.Tensor) -> torch.Tensor:
    """The Hessian of the objective in the internal coordinates: by autograd (Hessian-vector products); where
    the model renders on fixed scattering vectors (first derivatives only), the Fisher information of each
    image's block (the expected Hessian: `fisher_applies`, nbsim.fit.newton.evaluate), or, with quantities
    shared there, central differences of gradients; where the images share panels, the Fisher information of
    every coordinate (nbsim.fit.joint). Quantities of different images do not interact, so one
    product (one pair of gradients) serves the k-th quantity of every image at once; shared quantities take
    one each."""
    model = objective.model
    size = model.size
    if joint_applies(model):
        return information(objective, internal, product_columns(model))
    if fisher_applies(model):
        coordinates = image_coordinates(objective)
        blocks = evaluate(objective, internal, coordinates, list(range(len(coordinates)))).blocks
        result = torch.zeros(size, size, dtype=torch.float64)
        for positions, block in zip(coordinates, blocks, strict=True):
            result[positions.unsqueeze(-1), positions] = block
        return result
    x = internal.detach().clone().requires_grad_(True)
    if model.scattering is not None:
        def gradient_at(point: torch.Tensor) -> torch.Tensor:
            point = point.detach().requires_grad_(True)
            return torch.autograd.grad(objective(point), point)[0].detach()

        def product(vector: torch.Tensor) -> torch.Tensor:
            step = HESSIAN_STEP * vector
            return (gradient_at(x + step) - gradient_at(x - step)) / (2.0 * HESSIAN_STEP)
    else:
        gradient = torch.autograd.grad(objective(x), x, create_graph=True)[0]

        def product(vector: torch.Tensor) -> torch.Tensor:
            return torch.autograd.grad(gradient @ vector, x, retain_graph=True)[0].detach()
    per_image: list[list[int]] = [[] for _ in model.setups]
    shared: list[int] = []
    for slot in model.slots:
        indices = list(range(slot.start, slot.stop))
        (shared if slot.image is None else per_image[slot.image]).extend(indices)
    result = torch.zeros(size, size, dtype=torch.float64)
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
    `n_cells` where given, and each image's scale started from its counts; the cell keeps its scale in every
    stage of a fit that refines the spectrum (whose shift the search stages leave to the last)."""
    groups = panel_groups(setups[0], options.groups) if "panels" in refine else None
    shared = [name for name in options.shared if name in refine]
    model = DiffractionModel(setups, [b.pixels for b in boxes], refine, shared, options.lattice, options.device,
                             options.dtype, options.compile, groups, cell_scale_held="spectrum" in options.refine)
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
    positions = pixel_centres_m(setup, boxes.pixels)
    cos_two_theta = (positions / positions.norm(dim=1, keepdim=True)) @ setup.geometry.beam.detach()
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
    everything asked (N too) but the spectrum: on area-averaged pixels its stretch and N both widen the spots,
    and the stretch ran to 0 (a monochromatic beam) with N low, a minimum the last stage did not leave; a few
    eV of shift move the spots far less than a search has to. The shoeboxes are placed, and the search stages
    render, with a spectrum binned into `SEARCH_CHANNELS` channels (`with_binned_spectrum`). The fit ends from
    there with the pixels sampled as the image was (`observed_oversample`, followed as the refined crystal
    changes it). Panels are refined last: the search and a first pass of the last stage (to SEARCH_TOLERANCE)
    refine the crystals on the starting detector, each shot on its own, then everything is refined together.
    `progress(stage, iteration, nll, gradient_max, seconds)` is called after each iteration."""
    options.check()
    started = time.perf_counter()
    if not images:
        raise NbsimError("no images to fit")
    refine = list(options.refine)
    if options.background == "flat" and "background" not in refine:
        refine.append("background")
    if "panels" in refine and "panels" not in options.restraints:
        options = dataclasses.replace(options, restraints={**options.restraints, "panels": PANEL_RESTRAINT})
    searched = [name for name in refine if name != "panels"]
    setups = [image.setup for image in images]
    binned = [with_binned_spectrum(setup) for setup in setups]
    boxes = choose_pixels(images, binned, options)
    if Compile.of(options.compile) is Compile.AUTO:
        kernels_ready(fit_kernel_variants(setups, searched, options),
                      sum(b.count * setup.steps for b, setup in zip(boxes, setups, strict=True)))

    def report(stage: str) -> Callable[[int, float, float, float], None] | None:
        return None if progress is None else (lambda *values: progress(stage, *values))

    total_iterations = 0
    starting_n = [[float(n) for n in setup.n_cells] for setup in setups]
    if options.search_deg > 0:
        search = [name for name in searched if name != "spectrum"]
        coarse = [name for name in search if name not in ("N", "mosaic")]
        stages = ([("coarse", coarse)] if coarse else []) + ([("smooth", search)] if search != coarse else [])
        n_cells = None
        if "orientation" in refine:
            n_cells = [coarse_cells(setup, b, options.search_deg) for setup, b in zip(setups, boxes, strict=True)]
        searching = binned
        for stage, names in stages:
            searching, iterations = smooth_stage(images, searching, boxes, names, options, report(stage), started,
                                                 n_cells)
            total_iterations += iterations
            if stage == "coarse":
                boxes = choose_pixels(images, searching, options)
            n_cells = None
        setups = [each if setup.config.beam.spectrum is None else with_spectrum(each, setup.config.beam.spectrum)
                  for each, setup in zip(searching, setups, strict=True)]
    history: list[float] = []
    for sampling_round in range(SAMPLING_ROUNDS):
        setups = [with_oversample(setup, observed_oversample(setup)) for setup in setups]
        if sampling_round == 0 and options.search_deg > 0 and "N" in refine:
            objective = objective_from_searched_or_starting_n(images, setups, boxes, searched, options, starting_n)
        else:
            objective = stage_objective(images, setups, boxes, searched, options)
        if searched != refine:
            _, _, iterations, more = minimise(objective, options, report("fit"), started, SEARCH_TOLERANCE)
            total_iterations += iterations
            history += more
            objective = stage_objective(images, objective.model.refined_setups(), boxes, refine, options)
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
                     covariance=covariance, history=history, expected=expected, restraints=dict(options.restraints))


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
    _, _, iterations, _ = minimise(objective, options, progress, started, SEARCH_TOLERANCE)
    refined = objective.model.refined_setups()
    if n_cells:
        refined = [dataclasses.replace(each, n_cells=setup.n_cells)
                   for each, setup in zip(refined, setups, strict=True)]
    return [with_oversample(each, setup.oversample) for each, setup in zip(refined, setups, strict=True)], iterations


def objective_from_searched_or_starting_n(images: Sequence[FitImage], setups: Sequence[Setup],
                                          boxes: Sequence[Shoeboxes], refine: Sequence[str], options: FitOptions,
                                          starting_n: Sequence[Sequence[float]]) -> Objective:
    """The final stage's objective with each image's N started at the search's (in `setups`) or at the one the
    fit started with, whichever explains the image better at its own sampling. Averaging every pixel over its
    area broadens the spots, so the search's N can be far off (N 16-19 for a true 10), in a basin of its own.
    Where every image prefers one, that side's objective serves as it is."""
    searched = stage_objective(images, setups, boxes, refine, options)
    started = stage_objective(images, setups, boxes, refine, options, starting_n)
    with torch.no_grad():
        searched_terms = searched.image_terms(searched.expected()).tolist()
        started_terms = started.image_terms(started.expected()).tolist()
    prefer_start = [later < sooner for sooner, later in zip(searched_terms, started_terms, strict=True)]
    if all(prefer_start):
        return started
    if not any(prefer_start):
        return searched
    n_cells = [list(first) if start else [float(n) for n in setup.n_cells]
               for first, setup, start in zip(starting_n, setups, prefer_start, strict=True)]
    return stage_objective(images, setups, boxes, refine, options, n_cells)


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


def fit_kernel_variants(setups: Sequence[Setup], refine: Sequence[str], options: FitOptions) -> list[Variant]:
    """The compiled kernels (nbsim.fit.compiled) a fit of these set-ups renders with, where it can (none where
    it refines more than the crystal, or its crystals are not the kernel's)."""
    if not fixed_frame_fittable(setups, refine):
        return []
    device = torch.device(options.device).type
    return [Variant(setups[0].lookup, gradients, dtype_name(options.dtype), device) for gradients in (False, True)]


def fisher_applies(model: DiffractionModel) -> bool:
    """Can Fisher scoring (nbsim.fit.newton) refine this model: its pixels on fixed scattering vectors (the
    crystal refined only) and nothing shared between its images (a Hessian of one block per image)?"""
    return model.scattering is not None and not model.shared


def minimise(objective: Objective, options: FitOptions,
             progress: Callable[[int, float, float, float], None] | None,
             started: float, change_floor: float = 0.0) -> tuple[bool, str, int, list[float]]:
    """Run the optimiser on the model's internal coordinates: (converged, reason, iterations, NLL history).
    Fisher scoring (nbsim.fit.newton) where it applies and `options.optimizer` allows; L-BFGS is SciPy's
    L-BFGS-B (the optimiser diffBragg uses) on the value and gradient autograd gives; Adam is torch's, stopped
    by the same tests. `change_floor`: a change of the objective small enough to stop at, whatever its size
    (a search stage's SEARCH_TOLERANCE)."""
    model = objective.model
    if not model.size:
        return True, "nothing to refine", 0, [float(objective().detach())]
    if options.optimizer == "adam":
        return _adam(objective, options, progress, started)
    if options.optimizer in ("auto", "fisher") and joint_applies(model):
        return minimise_joint(objective, options, progress, started, change_floor)
    if options.optimizer == "fisher" and not fisher_applies(model):
        raise NbsimError("the fisher optimizer needs images that share nothing and a refinement of the crystal "
                         f"only ({', '.join(CRYSTAL_QUANTITIES)}): use lbfgs")
    if options.optimizer in ("auto", "fisher") and fisher_applies(model):
        return minimise_fisher(objective, options, progress, started, change_floor)
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
    ftol = relative_change_stop(options)
    if change_floor > 0:
        with torch.no_grad():
            ftol = max(ftol, change_floor / max(abs(float(objective())), 1.0))
    try:
        outcome = scipy.optimize.minimize(
            value_and_gradient, start, jac=True, method="L-BFGS-B", callback=after_iteration,
            options={"maxiter": options.max_iterations, "gtol": options.gradient_tolerance, "ftol": ftol,
                     "maxcor": 20})
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
