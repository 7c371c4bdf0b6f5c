"""Fisher scoring with Levenberg–Marquardt damping for fits whose images share a quantity that moves their pixels
(a multi-panel detector's panel groups): every coordinate of every image in one damped Gauss–Newton system.

The expected photons' derivatives come from forward-mode autograd, one Jacobian–vector product per coordinate
an image has (serving that coordinate of every image at once: images do not interact) and per coordinate of a
panel group's move (serving every group at once: a pixel sees only its own panel's group), so a fit of many
shots and panels costs about as many products as one shot has coordinates plus six. The information
Σ_p w_p ∂λ_p ∂λ_pᵀ (w_p = 1/(λ_p + σ²), Poisson counts; the expected Hessian of the negative log-likelihood) is
assembled from blocks of pixels that share their image and group, the restraints add their Gauss–Newton
terms, and the step (B + μ·b·I) δ = −g (g the objective's gradient, by reverse-mode autograd) is kept when
the whole objective falls (`scaled_step`); μ follows Nielsen's rule. The products cost some thirty
evaluations of the model, so one matrix serves up to REUSED_STEPS steps while its quadratic model foretells their
falls (the gradient is always the point's own).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import DiffractionModel
from .newton import ACCEPTED_RATIO, INITIAL_DAMPING, fisher_weights, newton_decrement
from .objective import FitOptions, Objective, relative_change_stop
from .panels import MOVE_SIZE

LARGEST_STEP = 100.0
"""The most a step moves any coordinate, in typical steps (0.1 mm of a panel group's shift, 0.1° of its rotation,
1° of a crystal's): a still's likelihood is far from quadratic over more, and a poorly determined direction
(a panel's tilt, its place along the beam) would otherwise take steps of millimetres the data reject."""
STALL_STEPS, STALL_FALL = 5, 0.05
"""The fit also stops when STALL_STEPS accepted steps together lower −log L by less than STALL_FALL: it is then creeping
through the roughness of the likelihood (the nearest-node lookup of F: a step that moves the crystal moves some of
its pixels' steps between reflections' cells, a jump the Fisher model does not see), √(2·0.05) = 0.32 standard
errors at most, as a search stage's tolerance (nbsim.fit.refine.SEARCH_TOLERANCE)."""
REUSED_STEPS = 3
"""Accepted steps one information matrix serves (each step's gradient is its own) while the falls they bring are
at least GOOD_RATIO of the falls its quadratic model predicts; a stop judged on an older matrix is judged again on
a fresh one."""
GOOD_RATIO = 0.5
DECREMENT_FLOOR = 1e-3
"""A fall of −log L the fit stops short of: the Newton decrement ½gᵀB⁻¹g below it puts every coordinate within
√(2·1e-3) = 0.045 standard errors of the optimum of the quadratic model. The likelihood is rough below about that
(the nearest-node lookup of F: a spot's steps crossing between reflections' cells), and a still's likelihood
creeps along its poorly determined directions for many more steps."""


def joint_applies(model: DiffractionModel) -> bool:
    """Does this model's fit go through the joint system: its images share the panels (rendered through autograd,
    every pixel with its panel's moved frame)?"""
    return "panels" in model.shared


@dataclass
class Columns:
    """Where each Jacobian–vector product's column lands: `tangents` (T, size) the directions; per image and run of
    pixels with one column set, the pixels (start, stop in the image's list) and the global coordinate of each
    product (−1: the product does not touch these pixels)."""

    tangents: torch.Tensor
    blocks: list[list[tuple[int, int, torch.Tensor]]]


def product_columns(model: DiffractionModel) -> Columns:
    """The directions of the products and where their columns go (see Columns)."""
    images = len(model.setups)
    own: list[list[int]] = [[] for _ in range(images)]
    shared: list[int] = []
    panels = None
    for slot in model.slots:
        if slot.image is not None:
            own[slot.image].extend(range(slot.start, slot.stop))
        elif slot.quantity.name == "panels":
            panels = slot
        else:
            shared.extend(range(slot.start, slot.stop))
    locals_count = max(len(positions) for positions in own)
    tangents = torch.zeros(locals_count + (MOVE_SIZE if panels else 0) + len(shared), model.size, dtype=torch.float64)
    for positions in own:
        for index, position in enumerate(positions):
            tangents[index, position] = 1.0
    if panels is not None:
        for k in range(MOVE_SIZE):
            tangents[locals_count + k, panels.start + k:panels.stop:MOVE_SIZE] = 1.0
    for index, position in enumerate(shared):
        tangents[locals_count + (MOVE_SIZE if panels else 0) + index, position] = 1.0
    group_of = {}
    for number, members in enumerate(model.groups.members if model.groups is not None else ()):
        group_of.update({panel: number for panel in members})
    blocks = []
    for image in range(images):
        runs = model.runs[image] or [(0, 0, len(model.rows[image]))]
        image_blocks = []
        for panel, start, stop in runs:
            target = [*own[image], *([-1] * (locals_count - len(own[image])))]
            group = group_of.get(panel, -1) if model.runs[image] is not None else -1
            target += [panels.start + MOVE_SIZE * group + k if group >= 0 else -1 for k in range(MOVE_SIZE)] \
                if panels is not None else []
            target += shared
            image_blocks.append((start, stop, torch.tensor(target, dtype=torch.int64)))
        blocks.append(image_blocks)
    return Columns(tangents, blocks)


@dataclass
class State:
    """The objective, its gradient and the information matrix at one point."""

    value: float
    gradient: torch.Tensor
    information: torch.Tensor


def evaluate(objective: Objective, internal: torch.Tensor, layout: Columns,
             reused: torch.Tensor | None = None) -> State:
    """The objective's value and gradient (reverse mode) and the information matrix (forward-mode products, or
    `reused`) at `internal`."""
    x = internal.detach().clone().requires_grad_(True)
    value = objective(x)
    gradient = torch.autograd.grad(value, x)[0].detach()
    return State(float(value.detach()), gradient,
                 information(objective, internal, layout) if reused is None else reused)


def information(objective: Objective, internal: torch.Tensor, layout: Columns) -> torch.Tensor:
    """The Fisher information of every image's pixels in the internal coordinates, plus the restraints'
    Gauss–Newton terms (size, size). Image by image, the products go through torch.func.vmap, all directions in
    one pass."""
    model, options = objective.model, objective.options
    x = internal.detach().clone()
    result = torch.zeros(model.size, model.size, dtype=torch.float64)
    for image, image_blocks in enumerate(layout.blocks):
        def expected(point: torch.Tensor, image: int = image) -> torch.Tensor:
            values = model.image_natural(image, point)
            return (model.render(image, values).to(torch.float64) + objective.planes[image]
                    + objective.flat[image] * values["background"][0])

        def product(tangent: torch.Tensor, expected=expected) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.func.jvp(expected, (x,), (tangent,))

        photons, derivatives = torch.func.vmap(product)(layout.tangents)
        weights = fisher_weights(photons[0].detach(), options.readout_photons, options.likelihood)
        for start, stop, target in image_blocks:
            keep = target >= 0
            block = derivatives[keep][:, start:stop].detach()
            at = target[keep]
            result[at.unsqueeze(-1), at] += (block * weights[start:stop]) @ block.T
    if objective.restraints:
        rows = torch.autograd.functional.jacobian(lambda point: objective.restraint_residuals(point).reshape(-1), x)
        result += rows.T @ rows
    return result


def minimise_joint(objective: Objective, options: FitOptions,
                   progress: Callable[[int, float, float, float], None] | None,
                   started: float, change_floor: float = 0.0) -> tuple[bool, str, int, list[float]]:
    """Damped Fisher scoring of every coordinate at once: (converged, reason, iterations, objective history)."""
    model = objective.model
    layout = product_columns(model)
    x = model.internal.detach().clone()
    state = evaluate(objective, x, layout)
    ftol = relative_change_stop(options)

    def small(value: float) -> float:
        return max(ftol * max(abs(value), 1.0), change_floor, DECREMENT_FLOOR)

    damping, growth, age = INITIAL_DAMPING, 2.0, 0
    history: list[float] = []
    accepted = [state.value]
    reason = _stop_reason(state, options.gradient_tolerance, small(state.value))
    iteration = 0
    while not reason and iteration < options.max_iterations:
        iteration += 1
        step = scaled_step(state.information, state.gradient, damping)
        step = step * min(1.0, LARGEST_STEP / max(float(step.abs().max()), 1e-300))
        predicted = -float(state.gradient @ step + 0.5 * step @ state.information @ step)
        with torch.no_grad():
            after = float(objective(x + step))
        fall = state.value - after
        if math.isfinite(after) and fall >= ACCEPTED_RATIO * predicted:
            ratio = fall / predicted if predicted > 0 else 1.0
            damping *= max(1.0 / 3.0, 1.0 - (2.0 * ratio - 1.0) ** 3)
            growth = 2.0
            x = x + step
            age = age + 1 if ratio >= GOOD_RATIO and age + 1 < REUSED_STEPS else 0
            state = evaluate(objective, x, layout, state.information if age else None)
            reason = ("relative reduction of f below ftol" if fall <= small(state.value)
                      else _stop_reason(state, options.gradient_tolerance, small(state.value)))
            if reason and age:
                age, state = 0, evaluate(objective, x, layout)
                reason = _stop_reason(state, options.gradient_tolerance, small(state.value))
        elif age:
            age, state = 0, evaluate(objective, x, layout)
        else:
            damping *= growth
            growth *= 2.0
            if predicted <= small(state.value):
                reason = ("no step lowers the likelihood by more than ftol (at its optimum to the likelihood's "
                          "resolution)")
            elif not math.isfinite(after) and damping > 1e12:
                with torch.no_grad():
                    model.internal.copy_(x)
                return False, f"the likelihood became NaN or infinite at iteration {iteration}", iteration, history
        history.append(state.value)
        if accepted[-1] != state.value:
            accepted.append(state.value)
        if not reason and len(accepted) > STALL_STEPS and accepted[-1 - STALL_STEPS] - accepted[-1] < STALL_FALL:
            reason = f"-log L fell by less than {STALL_FALL:g} in {STALL_STEPS} steps (the likelihood's roughness)"
        if progress is not None:
            progress(iteration, state.value, float(state.gradient.abs().max()), time.perf_counter() - started)
    with torch.no_grad():
        model.internal.copy_(x)
    if not reason:
        return False, f"iteration cap ({options.max_iterations}) reached", iteration, history
    return True, reason, iteration, history


def scaled_step(information: torch.Tensor, gradient: torch.Tensor, damping: float) -> torch.Tensor:
    """The Levenberg–Marquardt step (B + μ·b·I) δ = −g, b the largest diagonal element of B: Marquardt's damping in
    the fit's coordinates, each a typical step of its quantity. Damping each coordinate by its own diagonal (as
    nbsim.fit.newton does for one shot) holds back the combinations of well-measured coordinates that the images
    measure poorly together, such as every crystal and module turning at once, and there a joint fit crept."""
    largest = float(torch.diagonal(information).max().clamp(min=1e-300))
    return torch.linalg.solve(information + damping * largest * torch.eye(len(gradient), dtype=information.dtype),
                              -gradient)


def _stop_reason(state: State, gradient_tolerance: float, small: float) -> str:
    """Why the fit stops at this state (empty: it goes on)."""
    if float(state.gradient.abs().max()) <= gradient_tolerance:
        return "projected gradient below gtol"
    if newton_decrement(state.information, state.gradient) <= small:
        return "the Newton decrement is below ftol of f"
    return ""
