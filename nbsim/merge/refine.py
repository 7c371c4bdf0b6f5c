"""Ensemble refinement of structure factors over many stills, by modelling every shoebox pixel.

Macro-cycles: each shot's model is refined with F fixed (`nbsim.fit.fit`, shot by shot, which also places
the shoeboxes and fits their background planes), then log|F| with every shot fixed, by L-BFGS on the Poisson
negative log-likelihood summed over every shot's pixels (the gradient by autograd, through the kernel's table
lookup) plus the restraints. Each worker holds its shots; the F step's value and gradient are summed over
the workers by all-reduce, and every worker runs the same L-BFGS on the same sums, in step.

Standard errors of |F|: the diagonal of the Fisher information (the expected Gauss–Newton Hessian) of
log|F| at the optimum, the restraints' curvature added, with each pixel attributed to the one reflection its
sub-steps see (found by rendering with coded tables; a pixel seeing several is left out of the sum, which
only widens the errors). σ(|F|) = |F| / √I.
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
from ..fit.images import read_fit_image
from ..fit.likelihood import negative_log_likelihood
from ..fit.model import DiffractionModel
from ..fit.output import fit_json
from ..fit.refine import FitImage, FitOptions, fit
from ..io.structure_files import read_reflection_file
from ..model.structure_factors import HKLGrid, build_grid
from ..nanobragg.arguments import parse
from ..resolve import Setup, resolve
from .distributed import all_sum, gather, rank_and_size, worker_device
from .model import Restraints, StructureFactorModel
from .reflections import (
    Reflections,
    anomalous_differences,
    asymmetric_unit,
    correlation,
    node_parameters,
    shells,
    space_group,
    values_of_table,
)

STEP_FACTOR_LIMIT = 1e3
"""The F step moves no |F| by more than this factor (a bound of L-BFGS-B: a line search's trial step would
otherwise overflow exp(log|F|)); the next cycle starts from where it ended."""
SINGLE_OWNER_TOLERANCE = 1e-6
"""A pixel sees one reflection when its coded renders' spread (variance over mean², see `fisher_diagonal`) is
below this."""


@dataclass(frozen=True)
class MergeOptions:
    """How to merge: the per-shot refinement (`shots`: nbsim fit's options), the macro-cycles, the F step's
    optimiser and the restraints."""

    shots: FitOptions = field(default_factory=FitOptions)
    cycles: int = 3
    restraints: Restraints = field(default_factory=Restraints)
    max_iterations: int = 200
    gradient_tolerance: float = 1e-5
    """Stop the F step when the largest |∂NLL/∂v| falls below this (v: log|F| scaled by √ of its curvature)."""
    change_tolerance: float = 1e-13
    shells: int = 6
    """Resolution shells of the reported correlations."""

    def check(self) -> None:
        """Raise a one-line NbsimError for an option out of range."""
        self.shots.check()
        self.restraints.check()
        if self.cycles < 1:
            raise NbsimError(f"at least one cycle is needed (got {self.cycles})")
        if self.max_iterations < 1:
            raise NbsimError(f"the F step's iteration cap must be at least 1 (got {self.max_iterations})")
        if self.shells < 1:
            raise NbsimError(f"at least one resolution shell is needed (got {self.shells})")


@dataclass(frozen=True)
class MergeJob:
    """What every worker needs, in plain data: the shots (name, the nanoBragg flags of its starting model,
    the start's -hkl among them), the starting |F|'s file and column, the space group, the truth's file."""

    shots: tuple[tuple[str, tuple[str, ...]], ...]
    hkl: str
    column: str | None
    space_group: str
    cell_A_deg: tuple[float, ...]
    default_F: float
    anomalous: bool
    options: MergeOptions
    adc_offset_adu: float | None = None
    truth: str | None = None
    truth_column: str | None = None


@dataclass
class Shot:
    """One shot held by this worker: its frame, its current model, and what the last shot step left (the
    refined scale, the fitted pixels and their fixed background)."""

    image: FitImage
    argv: tuple[str, ...]
    setup: Setup
    scale: float = 1.0
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    background: torch.Tensor | None = None
    document: dict | None = None


@dataclass
class MergeResult:
    """A finished merge: the reflections, their |F| and σ (NaN where no pixel measures a parameter), every
    shot's refined model (the JSON `nbsim fit` writes; on rank 0, every worker's), and the cycles' records."""

    reflections: Reflections
    amplitudes: np.ndarray
    sigmas: np.ndarray
    measured: np.ndarray
    shots: list[dict]
    cycles: list[dict]
    nll: float
    seconds: float


def start_reflections(job: MergeJob) -> tuple[Reflections, np.ndarray, HKLGrid]:
    """The unique reflections, their starting |F| and the P1 table's grid the kernel looks up."""
    table = read_reflection_file(job.hkl, job.column)
    group = space_group(job.space_group)
    reflections, start = asymmetric_unit(table.reflections, group, job.cell_A_deg, job.anomalous, job.hkl)
    return reflections, start, build_grid(table.reflections, job.default_F)


def load_shot(name: str, argv: Sequence[str], grid: HKLGrid, adc_offset_adu: float | None) -> Shot:
    """A shot's starting model, resolved, with its frame; a model the merge cannot refine F of is an error."""
    setup = resolve(parse(list(argv))[0])
    if setup.grid is None:
        raise NbsimError(f"{name}: the model has no structure-factor table")
    if setup.channel_grids is not None:
        raise NbsimError(f"{name}: merge refines one |F| table; per-energy anomalous channels (-anomalous with a "
                         "-model) are not supported")
    if setup.lookup != "nearest":
        raise NbsimError(f"{name}: merge needs the nearest-node lookup of F (give -nointerpolate)")
    if setup.grid.index_min != grid.index_min or setup.grid.shape != grid.shape:
        raise NbsimError(f"{name}: its -hkl table is not the merge's start")
    return Shot(image=read_fit_image(name, setup, adc_offset_adu), argv=tuple(argv), setup=setup)


class Merge:
    """The state of a merge on one worker: the shared log|F| and this worker's shots."""

    def __init__(self, job: MergeJob):
        job.options.check()
        self.job, self.options = job, job.options
        self.device = worker_device(job.options.shots.device)
        self.rank, self.size = rank_and_size()
        self.reflections, start, self.grid = start_reflections(job)
        self.model = StructureFactorModel(self.reflections, start, job.options.restraints)
        self.log_F = self.model.log_start.clone()
        self.base = torch.as_tensor(self.grid.padded(job.default_F).reshape(-1), dtype=torch.float64,
                                    device=self.device)
        self.nodes = torch.as_tensor(node_parameters(self.reflections, self.grid), device=self.device)
        self.shots = [load_shot(name, argv, self.grid, job.adc_offset_adu)
                      for name, argv in job.shots[self.rank::self.size]]
        self.truth = None
        if job.truth is not None:
            truth = read_reflection_file(job.truth, job.truth_column)
            self.truth = values_of_table(self.reflections, truth.reflections)
        self.readout = job.options.shots.readout_photons
        self.pixel_model: DiffractionModel | None = None
        self.measured = np.ones(self.model.size, dtype=bool)
        """Parameters some single-reflection pixel measures (every one until the first F step says)."""

    def table(self, log_F: torch.Tensor) -> torch.Tensor:
        """The kernel's flat padded table at these log|F|."""
        return self.model.table(log_F.to(self.device), self.base, self.nodes)

    def current_grid(self) -> HKLGrid:
        """The current |F| as an HKLGrid (what a shot's set-up carries into `nbsim.fit`)."""
        with torch.no_grad():
            padded = self.table(self.log_F).cpu().numpy().reshape(np.asarray(self.grid.shape) + 2)
        return HKLGrid(values=padded[1:-1, 1:-1, 1:-1].copy(), index_min=self.grid.index_min,
                       entries=self.grid.entries)

    def refine_shots(self, cycle: int) -> None:
        """The shot step: each shot refined with F fixed; its scale, pixels and background kept for the F step."""
        grid = self.current_grid()
        options = self.options.shots
        if cycle > 0:
            options = dataclasses.replace(options, search_deg=0.0)
        for shot in self.shots:
            setup = dataclasses.replace(shot.setup, grid=grid)
            result = fit([dataclasses.replace(shot.image, setup=setup)], options)
            model = result.model
            with torch.no_grad():
                values = model.natural()[0]
                photons = model.render(0, values).to(torch.float64)
            shot.setup = model.refined_setups()[0]
            shot.scale = float(values["scale"][0])
            shot.rows, shot.cols = result.boxes[0].rows, result.boxes[0].cols
            shot.background = (result.expected[0].detach() - photons).to(self.device)
            document = fit_json(result, [list(shot.argv)])["shots"][0]
            shot.document = {**document, "converged": result.converged, "reason": result.reason,
                             "negative_log_likelihood": result.nll}
        self.pixel_model = None

    def _pixels(self) -> DiffractionModel:
        """This worker's shots at their refined models, with nothing refined: the F step's renderer (float64)."""
        if self.pixel_model is None and self.shots:
            model = DiffractionModel([shot.setup for shot in self.shots], [(s.rows, s.cols) for s in self.shots],
                                     (), device=self.device, dtype=torch.float64)
            for index, shot in enumerate(self.shots):
                model.set_start(index, "scale", [shot.scale])
            self.pixel_model = model
        return self.pixel_model

    def _render(self, index: int, table: torch.Tensor) -> torch.Tensor:
        """Shot `index`'s photons at its pixels with the kernel looking F up in `table`."""
        model = self._pixels()
        model.tables[index] = model.tables[index]._replace(grid=table)
        return model.render(index, model.natural()[index])

    def local_nll(self, log_F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's negative log-likelihood and its gradient in log|F| (one backward through the table)."""
        gradient = torch.zeros(self.model.size, dtype=torch.float64)
        if not self.shots:
            return torch.zeros((), dtype=torch.float64), gradient
        x = log_F.detach().to(self.device).requires_grad_(True)
        table = self.table(x)
        leaf = table.detach().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        table_gradient = torch.zeros_like(leaf)
        kind = self.options.shots.likelihood
        for index, shot in enumerate(self.shots):
            counts = torch.as_tensor(shot.image.counts[shot.rows, shot.cols], dtype=torch.float64, device=self.device)
            nll = negative_log_likelihood(self._render(index, leaf) + shot.background, counts, self.readout, kind)
            table_gradient += torch.autograd.grad(nll, leaf)[0]
            total = total + nll.detach()
        gradient = torch.autograd.grad(table, x, grad_outputs=table_gradient)[0]
        return total.cpu(), gradient.cpu()

    def nll(self, log_F: torch.Tensor) -> tuple[float, torch.Tensor]:
        """The negative log-likelihood over every worker's shots and its gradient (all-reduced)."""
        value, gradient = self.local_nll(log_F)
        summed = all_sum(torch.cat([value.reshape(1), gradient]), self.device)
        return float(summed[0]), summed[1:]

    def curvature_estimate(self) -> torch.Tensor:
        """Σ_p (∂λ_p/∂log|F_j|)·2·signal_p/λ_p over every worker's pixels, one backward pass: the Fisher diagonal
        where a pixel sees one reflection, an overestimate where it sees several (the F step's preconditioner,
        defined for every parameter a pixel sees)."""
        gradient = torch.zeros(self.model.size, dtype=torch.float64)
        if self.shots:
            x = self.log_F.detach().to(self.device).requires_grad_(True)
            table = self.table(x)
            leaf = table.detach().requires_grad_(True)
            table_gradient = torch.zeros_like(leaf)
            for index, shot in enumerate(self.shots):
                photons = self._render(index, leaf)
                weights = (2.0 * photons / (photons + shot.background + self.readout ** 2).clamp(min=1e-300)).detach()
                table_gradient += torch.autograd.grad((photons * weights).sum(), leaf)[0]
            gradient = torch.autograd.grad(table, x, grad_outputs=table_gradient)[0].cpu()
        return all_sum(gradient, self.device)

    def fisher_diagonal(self) -> torch.Tensor:
        """The diagonal of the Fisher information of log|F| over every worker's pixels. λ is linear in |F|² of
        each node under the nearest lookup, so ∂λ_p/∂log|F_j| = 2·(signal of p from j); three renders with the
        nodes' |F| multiplied by 1, √r and r (r: 1 + the node's parameter) give Σw, Σw·r and Σw·r² over what
        the pixel sees, and a pixel whose r does not vary is reflection r − 1's alone."""
        information = torch.zeros(self.model.size, dtype=torch.float64)
        if self.shots:
            with torch.no_grad():
                table = self.table(self.log_F)
                code = torch.where(self.nodes >= 0, (self.nodes + 1).to(torch.float64), torch.zeros_like(table))
                for index, shot in enumerate(self.shots):
                    signal, first, second = (self._render(index, table * factor).to(torch.float64)
                                             for factor in (torch.ones_like(code), torch.sqrt(code), code))
                    mean = first / signal.clamp(min=1e-300)
                    spread = second / signal.clamp(min=1e-300) - mean * mean
                    single = (signal > 0) & (mean >= 0.5) & (spread.abs() <= SINGLE_OWNER_TOLERANCE * mean * mean)
                    owner = (torch.round(mean[single]) - 1).long().cpu()
                    expected = signal[single] + shot.background[single] + self.readout ** 2
                    contribution = (4.0 * signal[single] ** 2 / expected).cpu()
                    information.index_add_(0, owner, contribution)
        return all_sum(information, self.device)

    def refine_F(self) -> tuple[float, int]:
        """The F step: L-BFGS on log|F| (scaled by √ of each parameter's estimated curvature, so that the Hessian
        is near the identity; a parameter no pixel sees takes the median), every worker in step. Returns the final
        negative log-likelihood and the iterations."""
        self.measured = (self.fisher_diagonal() > 0).numpy()
        curvature = self.curvature_estimate().clamp(min=0.0) + self.model.curvature()
        known = curvature > 0
        typical = float(curvature[known].median()) if known.any() else 1.0
        scale = torch.sqrt(torch.where(known, curvature, torch.full_like(curvature, typical)))
        origin = self.log_F.clone()

        def value_and_gradient(point: np.ndarray) -> tuple[float, np.ndarray]:
            log_F = origin + torch.as_tensor(point) / scale
            nll, gradient = self.nll(log_F)
            x = log_F.clone().requires_grad_(True)
            penalty = self.model.penalty(x)
            gradient = gradient + (torch.autograd.grad(penalty, x)[0] if penalty.requires_grad else 0.0)
            return nll + float(penalty.detach()), (gradient / scale).numpy()

        reach = (math.log(STEP_FACTOR_LIMIT) * scale).numpy()
        outcome = scipy.optimize.minimize(
            value_and_gradient, np.zeros(self.model.size), jac=True, method="L-BFGS-B",
            bounds=scipy.optimize.Bounds(-reach, reach),
            options={"maxiter": self.options.max_iterations, "gtol": self.options.gradient_tolerance,
                     "ftol": self.options.change_tolerance, "maxcor": 30})
        if not (math.isfinite(outcome.fun) and np.all(np.isfinite(outcome.x))):
            raise NbsimError("the F step's likelihood became NaN or infinite")
        self.log_F = origin + torch.as_tensor(outcome.x) / scale
        return self.nll(self.log_F)[0], int(outcome.nit)

    def scores(self) -> dict:
        """CC(|F|, truth) overall and by resolution shell, and CCano (of |F(+)| − |F(−)|) with `anomalous`, over
        the measured parameters."""
        if self.truth is None:
            return {}
        values = np.where(self.measured, torch.exp(self.log_F).numpy(), np.nan)
        d_A = self.reflections.parameter_d_A()
        shell = shells(d_A, self.options.shells, d_A[self.measured])
        record = {"cc": correlation(values, self.truth),
                  "cc_by_shell": [correlation(values[shell == s], self.truth[shell == s])
                                  for s in range(self.options.shells)]}
        if self.reflections.anomalous:
            record["cc_anomalous"] = correlation(anomalous_differences(self.reflections, values),
                                                 anomalous_differences(self.reflections, self.truth))
        return record

    def run(self, progress: Callable[[dict], None] | None = None) -> MergeResult:
        """Every macro-cycle, then the standard errors; `progress(record)` after each cycle (on every worker)."""
        started = time.perf_counter()
        cycles = []
        if progress is not None and self.truth is not None:
            progress({"cycle": 0, **self.scores()})
        nll = math.nan
        for cycle in range(self.options.cycles):
            self.refine_shots(cycle)
            nll, iterations = self.refine_F()
            record = {"cycle": cycle + 1, "negative_log_likelihood": nll, "f_iterations": iterations,
                      "seconds": round(time.perf_counter() - started, 3), **self.scores()}
            cycles.append(record)
            if progress is not None:
                progress(record)
        information = self.fisher_diagonal()
        measured = (information > 0).numpy()
        curvature = (information + self.model.curvature()).numpy()
        amplitudes = torch.exp(self.log_F).numpy()
        with np.errstate(divide="ignore"):
            sigmas = np.where(measured, amplitudes / np.sqrt(curvature), np.nan)
        documents = [document for worker in gather([s.document for s in self.shots]) for document in worker]
        order = {name: index for index, (name, _) in enumerate(self.job.shots)}
        documents.sort(key=lambda document: order[document["image"]])
        return MergeResult(reflections=self.reflections, amplitudes=amplitudes, sigmas=sigmas, measured=measured,
                           shots=documents, cycles=cycles, nll=nll, seconds=time.perf_counter() - started)
