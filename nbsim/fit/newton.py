"""Fisher scoring with Levenberg–Marquardt damping, one block per image: the optimiser of fits whose images
share nothing and whose model renders on fixed scattering vectors (nbsim.fit.scattering).

The images of such a fit do not interact: its Hessian is block-diagonal, a block of a few parameters per
image. Each block is approximated by the Fisher information of the image's pixels, Σ_p w_p ∂λ_p ∂λ_pᵀ
(w_p = 1/(λ_p + σ²) for Poisson counts; the expected Hessian of the negative log-likelihood), built from
the fit kernel's derivatives of every pixel in the crystal's real cell vectors, N and scale (`photon
derivatives`), carried to the refined coordinates through their Jacobian (`kernel_parameters`, by
autograd). Every image takes its own damped Newton step (B + μ·diag B) δ = −g, keeps it when its own part of
the objective falls, and adapts its own μ (Nielsen's rule); all images' trial points are evaluated in one
pass of the kernel, so a fit of many stills costs about as many passes as a fit of one.

An image stops when its largest gradient component falls below the gradient tolerance, when a step changes
its objective by less than the relative tolerance, or when the decrease its Newton step promises, ½ gᵀB⁻¹g,
is below that tolerance of its objective (what L-BFGS's relative-change test measures, without the steps
that find it out).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .objective import FitOptions, Objective, relative_change_stop

INITIAL_DAMPING = 1e-3
"""μ of an image's first step, relative to its block's diagonal."""
ACCEPTED_RATIO = 1e-3
"""A step is kept when its image's objective falls by at least this fraction of the fall its quadratic model
predicts (a smaller fall, on a likelihood made rough by the nearest-node lookup of F, is noise)."""


@dataclass
class Evaluation:
    """The objective at one point, per image of `images`: its part of the objective, its gradient (in its
    own coordinates) and its Fisher block."""

    images: list[int]
    terms: list[float]
    gradients: list[torch.Tensor]
    blocks: list[torch.Tensor]


def image_coordinates(objective: Objective) -> list[torch.Tensor]:
    """The positions of each image's coordinates in the flat internal vector."""
    model = objective.model
    positions: list[list[int]] = [[] for _ in model.setups]
    for slot in model.slots:
        positions[slot.image].extend(range(slot.start, slot.stop))
    return [torch.tensor(p, dtype=torch.int64) for p in positions]


def evaluate(objective: Objective, internal: torch.Tensor, coordinates: list[torch.Tensor],
             images: list[int]) -> Evaluation:
    """The objective, gradient and Fisher block of each of `images` at `internal`, from one pass of the kernel
    with derivatives over their pixels: the model's photons enter as their first-order expansion about this
    point, which has the model's value and gradient here."""
    model, options = objective.model, objective.options
    x = internal.detach().clone().requires_grad_(True)
    values = model.natural(x)
    parameters = model.kernel_parameters(values, images)
    found = model.photon_derivatives(values, images)
    expected, columns = [], []
    for row, (image, (photons, derivatives)) in enumerate(zip(images, found, strict=True)):
        change = (parameters[row] - parameters[row].detach()).to(derivatives.dtype)
        linear = (photons + change @ derivatives).to(torch.float64)
        background = objective.flat[image] * values[image]["background"][0]
        expected.append(linear + objective.planes[image] + background)
        columns.append(torch.cat([derivatives.to(torch.float64), objective.flat[image].unsqueeze(0)]))
    terms = objective.image_terms(expected, x, images)
    gradient = torch.autograd.grad(terms.sum(), x, retain_graph=True)[0]
    backgrounds = torch.stack([values[image]["background"][0] for image in images]).unsqueeze(-1)
    jacobian = _rows(torch.cat([parameters, backgrounds], dim=1), x)
    restrained = _rows(objective.restraint_residuals(x, images), x) if objective.restraints else None
    blocks = []
    for row, image in enumerate(images):
        positions = coordinates[image]
        weights = fisher_weights(expected[row].detach(), options.readout_photons, options.likelihood)
        information = (columns[row] * weights) @ columns[row].T
        chain = jacobian[:, positions]
        block = chain.T @ information @ chain
        if restrained is not None:
            block = block + restrained[:, positions].T @ restrained[:, positions]
        blocks.append(block)
    return Evaluation(list(images), terms.detach().tolist(), [gradient[coordinates[image]] for image in images],
                      blocks)


def _rows(outputs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(C, size): row c holds ∂outputs[i, c]/∂x of every image i in that image's coordinates (images do not
    interact, so the gradient of a column's sum over images is every image's row at once); one backward
    pass for all columns (batched)."""
    columns = outputs.shape[1]
    selectors = torch.eye(columns, dtype=outputs.dtype).unsqueeze(1).expand(columns, outputs.shape[0], columns)
    return torch.autograd.grad(outputs, x, grad_outputs=selectors.contiguous(), is_grads_batched=True,
                               retain_graph=True)[0]


def fisher_weights(expected: torch.Tensor, readout_photons: float, likelihood: str) -> torch.Tensor:
    """Each pixel's Fisher information per unit of expected photons squared: 1/v for Poisson counts, 1/v +
    1/(2v²) for diffBragg's Gaussian, v = λ + σ²."""
    variance = torch.clamp(expected, min=1e-6) + readout_photons * readout_photons
    weights = 1.0 / variance
    return weights + 0.5 * weights * weights if likelihood == "gaussian" else weights


@dataclass
class ImageState:
    """Where one image's refinement stands: its objective, gradient and Fisher block at its current point, its
    damping μ and μ's growth on the next rejected step, and why it stopped (empty while it runs)."""

    term: float
    gradient: torch.Tensor
    block: torch.Tensor
    damping: float = INITIAL_DAMPING
    growth: float = 2.0
    reason: str = ""


def minimise_fisher(objective: Objective, options: FitOptions,
                    progress: Callable[[int, float, float, float], None] | None,
                    started: float, change_floor: float = 0.0) -> tuple[bool, str, int, list[float]]:
    """Damped Fisher scoring of every image at once: (converged, reason, iterations, objective history).
    converged when every image stopped by a tolerance; the reason is the last image's. `change_floor`: an
    image's change of its objective small enough to stop at, whatever its size."""
    model = objective.model
    coordinates = image_coordinates(objective)
    x = model.internal.detach().clone()
    first = evaluate(objective, x, coordinates, list(range(len(coordinates))))
    states = [ImageState(term, gradient, block)
              for term, gradient, block in zip(first.terms, first.gradients, first.blocks, strict=True)]
    ftol = relative_change_stop(options)

    def small(value: float) -> float:
        """A change of an image's objective too small to go on for."""
        return max(ftol * max(abs(value), 1.0), change_floor)

    for state in states:
        state.reason = _stop_reason(state, options.gradient_tolerance, small(state.term))
    history: list[float] = []
    iteration = 0
    while iteration < options.max_iterations:
        running = [image for image, state in enumerate(states) if not state.reason]
        if not running:
            break
        iteration += 1
        steps, trial = {}, x.clone()
        for image in running:
            state = states[image]
            steps[image] = damped_step(state.block, state.gradient, state.damping)
            trial[coordinates[image]] = x[coordinates[image]] + steps[image]
        attempt = evaluate_trial(objective, trial, coordinates, running)
        for row, image in enumerate(running):
            state, step = states[image], steps[image]
            after, gradient = attempt.terms[row], attempt.gradients[row]
            predicted = -float(state.gradient @ step + 0.5 * step @ state.block @ step)
            fall = state.term - after
            if math.isfinite(after) and torch.isfinite(gradient).all() and fall >= ACCEPTED_RATIO * predicted:
                ratio = fall / predicted if predicted > 0 else 1.0
                state.damping *= max(1.0 / 3.0, 1.0 - (2.0 * ratio - 1.0) ** 3)
                state.growth = 2.0
                x[coordinates[image]] = trial[coordinates[image]]
                state.term, state.gradient, state.block = after, gradient, attempt.blocks[row]
                state.reason = ("relative reduction of f below ftol" if fall <= small(after)
                                else _stop_reason(state, options.gradient_tolerance, small(after)))
            else:
                state.damping *= state.growth
                state.growth *= 2.0
                if predicted <= small(state.term):
                    state.reason = ("no step lowers the likelihood by more than ftol (at its optimum to the "
                                    "likelihood's resolution)")
                elif not math.isfinite(after) and state.damping > 1e12:
                    with torch.no_grad():
                        model.internal.copy_(x)
                    return False, f"the likelihood became NaN or infinite at iteration {iteration}", iteration, history
        total = sum(state.term for state in states)
        history.append(total)
        if progress is not None:
            largest = max(float(state.gradient.abs().max()) for state in states if len(state.gradient))
            progress(iteration, total, largest, time.perf_counter() - started)
    with torch.no_grad():
        model.internal.copy_(x)
    if any(not state.reason for state in states):
        return False, f"iteration cap ({options.max_iterations}) reached", iteration, history
    return True, states[-1].reason, iteration, history


def evaluate_trial(objective: Objective, trial: torch.Tensor, coordinates: list[torch.Tensor],
                   images: list[int]) -> Evaluation:
    """`evaluate` at a trial point; where a step took an image's crystal somewhere its model has no value (a
    singular cell), that image's objective is infinite (a rejected step) and the others are evaluated
    without it."""
    try:
        return evaluate(objective, trial, coordinates, images)
    except torch.linalg.LinAlgError:
        if len(images) == 1:
            return Evaluation(list(images), [math.inf], [torch.full_like(trial[coordinates[images[0]]], math.nan)],
                              [torch.empty(0)])
    parts = [evaluate_trial(objective, trial, coordinates, [image]) for image in images]
    return Evaluation(list(images), [part.terms[0] for part in parts], [part.gradients[0] for part in parts],
                      [part.blocks[0] for part in parts])


def damped_step(block: torch.Tensor, gradient: torch.Tensor, damping: float) -> torch.Tensor:
    """The Levenberg–Marquardt step (B + μ·diag B) δ = −g (a coordinate B does not see gets a unit diagonal)."""
    diagonal = torch.diagonal(block).clamp(min=0.0)
    scale = torch.where(diagonal > 0, diagonal, torch.ones_like(diagonal))
    return torch.linalg.solve(block + damping * torch.diag(scale), -gradient)


def newton_decrement(block: torch.Tensor, gradient: torch.Tensor) -> float:
    """½ gᵀB⁻¹g: how much the objective would fall at the minimum of its quadratic model (inf for a singular B)."""
    try:
        return 0.5 * float(gradient @ torch.linalg.solve(block, gradient))
    except torch.linalg.LinAlgError:
        return math.inf


def _stop_reason(state: ImageState, gradient_tolerance: float, small: float) -> str:
    """Why an image at this state stops (empty: it goes on)."""
    if not len(state.gradient) or float(state.gradient.abs().max()) <= gradient_tolerance:
        return "projected gradient below gtol"
    if newton_decrement(state.block, state.gradient) <= small:
        return "the Newton decrement is below ftol of f"
    return ""
