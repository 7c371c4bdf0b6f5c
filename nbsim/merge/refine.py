"""Ensemble refinement of structure factors over many stills, by modelling every shoebox pixel.

Macro-cycles (docs/merging.md, "The refinement"): each shot's model is refined with F fixed (`nbsim.fit.fit`,
many shots a call, which also places the shoeboxes and fits their background planes; the first `scale_cycles`
cycles refine only the scale, and the cell may be one for every shot), then log|F|: EM steps on |F|², then
L-BFGS on log|F| with every shot's log scale, on the Poisson negative log-likelihood summed over every shot's
pixels plus the restraints. With the shots fixed every pixel's expected count is linear in the |F|² its steps
see (the nearest-node lookup), so the F step works on a sparse design matrix built once per F step
(`design.py`), never calling the kernel. Only the |F| the pixels can measure are refined. Each worker holds
its shots; the F step's value and gradients are summed over the workers by all-reduce, and every worker runs
the same steps on the same sums, in step. After each cycle the state can be checkpointed (`state.py`) and a
run resumed from it.

Standard errors of |F|: the diagonal of the Fisher information (the expected Gauss–Newton Hessian) of
log|F| at the optimum, the restraints' curvature added. σ(|F|) = |F| / √I.
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
from ..fit.compiled import kernels_ready
from ..fit.images import read_fit_image
from ..fit.likelihood import negative_log_likelihood
from ..fit.model import DiffractionModel
from ..fit.output import fit_json
from ..fit.parameters import lattice_system
from ..fit.refine import FitImage, FitOptions, fit, fit_kernel_variants
from ..fit.scattering import fixed_frame_fittable
from ..io.structure_files import read_reflection_file
from ..model.structure_factors import HKLGrid, build_grid
from ..modes import Compile
from ..nanobragg.arguments import parse
from ..resolve import Setup, resolve
from .design import Design, shot_design
from .distributed import all_sum, gather, rank_and_size, worker_device
from .joint import JointShots
from .model import Restraints, StructureFactorModel
from .reflections import (
    Reflections,
    anomalous_differences,
    asymmetric_unit,
    correlation,
    lattice_system_of,
    node_parameters,
    other_indexings,
    shells,
    space_group,
    values_of_table,
)
from .state import (
    Checkpoint,
    ShotState,
    fingerprint,
    read_checkpoint,
    rebuilt_setup,
    reindexed_start,
    shot_values,
    write_checkpoint,
)

CHANGE_ITERATIONS = 10
"""The F step's change test (`MergeOptions.change_tolerance`) averages over this many iterations: single
iterations of L-BFGS gain unevenly."""
STEP_FACTOR_LIMIT = 1e3
"""The F step moves no |F| by more than this factor (a bound of L-BFGS-B: a line search's trial step would
otherwise overflow exp(log|F|)); the next cycle starts from where it ended."""
REFINED_INFORMATION = 1.0
"""A parameter is refined when its pixels' Fisher information in log|F|, had it its shell's mean intensity
(`StructureFactorModel.log_reference`), is at least this (σ(log|F|) ≤ 1: about half a photon of expected
signal without background). Below it a reflection is seen only by pixels its signal barely reaches (the
lattice factor's far tails: weights of 10⁻¹⁸ of a spot's peak), where one count would set its |F| to 10⁹; at
such a runaway estimate the information is that of the few counts it explains, so a test at the estimate
alone would refine it."""
MEASURED_INFORMATION = 16.0
"""A refined parameter counts as measured (written, scored) when that information, at its shell's mean
intensity, is at least this (σ(log|F|) ≤ 0.25 there) and its information at its estimate is at least
REFINED_INFORMATION (a reflection whose pixels hold nothing has its estimate at the floor, where the
information of log|F| vanishes: written, its σ would be 10⁵ times its |F|). Between 1 and 16 a reflection is
seen only by the edges of spots: on 100 SAD stills those were 4 % of the refined parameters and held the two
outer shells' CC(|F|, truth) at 0.95 and 0.88 (0.98 and 0.99 without them), and, their pixels changing with
each cycle's shoeboxes, their estimates moved by 0.1–0.3 in log|F| a cycle (docs/merging.md)."""
RESOLUTION_F_OVER_SIGMA = 4.0
"""The data's resolution (`Merge.signal`): the high-resolution edge of the last resolution shell, counted from the
lowest, whose measured amplitudes have a mean |F|/σ(|F|) of at least this: the usual ⟨I/σ(I)⟩ ≥ 2, since
σ(I) ≈ 2|F|·σ(|F|)."""
AS_GIVEN = "x,y,z"
"""A shot's indexing as its start gives it (`Shot.indexing`)."""
REINDEX_MARGIN = 10.0
"""A shot takes another indexing of its lattice (`Merge.choose_indexings`) only where that lowers the −log L of
its pixels by at least this (a likelihood ratio of e¹⁰, were the starting |F| right): a shot whose pixels cannot
tell keeps its start's."""
SOLVES = ("cycles", "joint")
"""How the merge refines |F| and the shots after the scale-only cycles (`MergeOptions.solve`)."""
JOINT_REACH_SIGMAS = 1e3
"""The joint solve moves no shot coordinate by more than this many of its standard errors (1/√ of its Fisher
information) from the shot step's model: a bound against a line search's trial step far out of the crystal's
range (a singular cell)."""
SHOTS_PER_FIT = 16
"""Shots one call of `nbsim.fit.fit` refines together (`fit_batches`): enough that the per-iteration work of
Fisher scoring (autograd through each shot's parametrisation; off the CPU, the kernel call) is shared, few
enough that the fit's memory stays small (about 45 MB a SAD still of 16,000 pixels and 20 channels: 50 SAD
shots a call took a worker to 2.0 GB, 16 to 1.4 GB, one to 0.7 GB, in about the same time on the CPU)."""


@dataclass(frozen=True)
class MergeOptions:
    """How to merge: the per-shot refinement (`shots`: nbsim fit's options), the macro-cycles, the F step's
    optimiser and the restraints."""

    shots: FitOptions = field(default_factory=FitOptions)
    cycles: int = 5
    restraints: Restraints = field(default_factory=Restraints)
    max_iterations: int = 200
    gradient_tolerance: float = 1e-5
    """Stop the F step when the largest |∂NLL/∂v| falls below this (v: log|F| scaled by √ of its curvature)."""
    change_tolerance: float = 0.01
    """Stop the F step once its last CHANGE_ITERATIONS iterations lowered −log L by less than this each, on
    average (a hundredth of what one standard error of one parameter is worth, ½)."""
    shared: tuple[str, ...] = ()
    """Quantities of every shot's model that are one for all shots ("cell": crystals of one form)."""
    convergence: float = 0.1
    """Stop once a cycle (past the scale-only ones) changes the log|F| measured before and after it by less than
    this many of their standard errors, the median over them (0: run every cycle). Not the root mean square
    change: a few percent of the measured |F|, weakly determined, jump with each cycle's choice of shoeboxes and
    keep it at 0.05–0.1 while the median falls fourfold a cycle (docs/merging.md)."""
    scale_cycles: int = 1
    """The first this many cycles refine only each shot's scale (then everything `shots.refine` names)."""
    em_iterations: int = 30
    """At most this many EM steps open each F step (0: L-BFGS alone)."""
    em_tolerance: float = 1e-4
    """The EM steps end when none moves a log|F| by more than this."""
    shells: int = 6
    """Resolution shells of the reported correlations."""
    reindex: bool = False
    """Where the lattice admits other indexings than the space group's (`reflections.other_indexings`: P 61, not
    P 43 21 2), the first shot step gives each shot the one its pixels prefer against the starting |F|
    (`Merge.choose_indexings`): stills indexed one by one (DIALS's) come out in any of them. Off by default: from a
    start of CC 0.5 the choice is not reliable shot by shot (docs/merging.md, "Other crystals": it reindexed 4 of
    50 P 61 shots given in the right indexing)."""
    shot_change_tolerance: float = 1e-7
    """The shot step stops a shot's fit once an iteration changes its −log L by less than this fraction (nbsim
    fit's change tolerance, where `shots` asks for less): about 0.02–0.05 in −log L for a shot of 16,000
    pixels, a tenth of a standard error of any of its parameters, where fit's default (10⁻¹²) spends a hundred
    iterations on changes of 0.01 that the nearest-node lookup's roughness makes (the shots are refined again
    next cycle)."""

    solve: str = "cycles"
    """After the scale-only cycles: "cycles", macro-cycles of a shot step and an F step until converged; "joint", one
    shot step (which places the shoeboxes and fits their background planes), then one optimisation of log|F|
    together with every shot's scale and refined quantities (`Merge.solve_jointly`), and the merge ends."""

    def check(self) -> None:
        """Raise a one-line NbsimError for an option out of range."""
        self.shots.check()
        self.restraints.check()
        if self.cycles < 1:
            raise NbsimError(f"at least one cycle is needed (got {self.cycles})")
        if self.max_iterations < 1:
            raise NbsimError(f"the F step's iteration cap must be at least 1 (got {self.max_iterations})")
        unknown = [name for name in self.shared if name != "cell"]
        if unknown:
            raise NbsimError(f"merge shares only the cell between shots (got {unknown[0]!r})")
        if self.shared and "cell" not in self.shots.refine:
            raise NbsimError("the cell is shared between shots but not refined: add cell to --refine")
        if not self.convergence >= 0:
            raise NbsimError(f"the convergence threshold must not be below 0 (got {self.convergence})")
        if self.scale_cycles < 0:
            raise NbsimError(f"the scale-only cycles must not be fewer than 0 (got {self.scale_cycles})")
        if self.em_iterations < 0:
            raise NbsimError(f"the EM steps' cap must not be below 0 (got {self.em_iterations})")
        if self.shells < 1:
            raise NbsimError(f"at least one resolution shell is needed (got {self.shells})")
        if self.solve not in SOLVES:
            raise NbsimError(f"the solve must be one of {', '.join(SOLVES)} (got {self.solve!r})")
        if self.solve == "joint" and self.cycles <= self.scale_cycles:
            raise NbsimError(f"the joint solve follows the scale-only cycles ({self.scale_cycles}): give more cycles "
                             f"than that (got {self.cycles})")
        if self.solve == "joint" and self.shots.restraints:
            raise NbsimError("the joint solve does not restrain the shots: leave the shots' restraints out, or solve "
                             "by cycles")
        if not 0 <= self.shot_change_tolerance < 1:
            raise NbsimError(f"the shot step's change tolerance must be in [0, 1) (got {self.shot_change_tolerance})")


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
    """One shot held by this worker: its frame, its starting and current model (the current one rebuilt from
    its values, `state.shot_values`), and what the last shot step left (the refined scale, the fitted pixels
    and their fixed background)."""

    image: FitImage
    argv: tuple[str, ...]
    start: Setup
    setup: Setup
    values: dict[str, list[float]] | None = None
    scale: float = 1.0
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    background: torch.Tensor | None = None
    document: dict | None = None
    indexing: str = AS_GIVEN
    """The indexing of the shot's start: its given one, or the other indexing (an operator's triplet,
    `reflections.other_indexings`) the first shot step chose; its start is then the given one reindexed."""


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
    cell_A_deg: tuple[float, ...]
    """The mean of the shots' refined cells (the job's where no shot was refined)."""


def start_reflections(job: MergeJob) -> tuple[Reflections, np.ndarray, HKLGrid]:
    """The unique reflections, their starting |F| and the P1 table's grid the kernel looks up."""
    table = read_reflection_file(job.hkl, job.column)
    group = space_group(job.space_group)
    reflections, start = asymmetric_unit(table.reflections, group, job.cell_A_deg, job.anomalous, job.hkl)
    return reflections, start, build_grid(table.reflections, job.default_F)


def job_fingerprint(job: MergeJob) -> str:
    """The digest a checkpoint of this merge carries: the job less what changes only the report or how many
    cycles run, and the input files' sizes and times."""
    fields = dataclasses.asdict(job)
    for name in ("truth", "truth_column"):
        fields.pop(name)
    for name in ("cycles", "convergence", "shells"):
        fields["options"].pop(name)
    paths = [job.hkl, *(name.split("#", 1)[0] for name, _ in job.shots)]
    return fingerprint(fields, paths)


def fit_batches(setups: Sequence[Setup], options: FitOptions) -> list[list[int]]:
    """The shots (by index) each call of `nbsim.fit.fit` refines together: SHOTS_PER_FIT at a time where the fit
    refines each image on its own (Fisher scoring of the crystal alone, nothing shared: one damped Newton step
    per image, every image's pixels in one kernel pass), else one at a time (a joint L-BFGS would couple the
    shots' stopping)."""
    refine = [*options.refine, *(["background"] if options.background == "flat" else [])]
    together = options.optimizer in ("auto", "fisher") and not options.shared and fixed_frame_fittable(setups, refine)
    width = SHOTS_PER_FIT if together else 1
    return [list(range(first, min(first + width, len(setups)))) for first in range(0, len(setups), width)]


def load_shot(name: str, argv: Sequence[str], grid: HKLGrid, adc_offset_adu: float | None) -> Shot:
    """A shot's starting model, resolved, with its frame; a model the merge cannot refine F of is an error. The
    model is kept without its table (1.3 MB a shot of the SAD example): every use puts the merge's current one
    in."""
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
    bare = dataclasses.replace(setup, grid=None)
    return Shot(image=read_fit_image(name, bare, adc_offset_adu), argv=tuple(argv), start=bare, setup=bare)


def _scaled_nll(signal: torch.Tensor, background: torch.Tensor, counts: torch.Tensor, scale: float,
                options: FitOptions) -> float:
    """−log L of pixels whose expected count is s·signal + background, at the scale s that fits best (searched
    within a factor e¹⁰ of `scale`)."""

    def at(log_scale: float) -> float:
        expected = math.exp(log_scale) * signal + background
        return float(negative_log_likelihood(expected, counts, options.readout_photons, options.likelihood))

    around = math.log(max(scale, 1e-300))
    return float(scipy.optimize.minimize_scalar(at, bounds=(around - 10.0, around + 10.0), method="bounded").fun)


@dataclass
class FVariables:
    """The optimiser's variables of an F step (and the |F| and scales of a joint solve): the refined log|F| (`free`)
    as moves from `origin` (the log|F| after the EM steps) in units of 1/`scale`, then, where the scales are refined,
    every shot's log-scale change in units of 1/`shot_scale`; and the step's start (its |F| and objective, before
    the EM steps), which an undone step returns to."""

    origin: torch.Tensor
    free: torch.Tensor
    scale: torch.Tensor
    shot_scale: torch.Tensor
    scale_count: int
    """How many shots' log scales are variables (every shot's, or none where the scale is not refined)."""
    log_floor: float
    start_log_F: torch.Tensor
    start_objective: float
    em_steps: int

    @property
    def count(self) -> int:
        """How many log|F| are refined."""
        return len(self.free)

    def log_F_at(self, point: torch.Tensor) -> torch.Tensor:
        """Every log|F| at a point of the optimiser's coordinates (the refined ones moved from the origin)."""
        log_F = self.origin.clone()
        log_F[self.free] += point[:self.count] / self.scale
        return log_F

    def scale_changes(self, point: torch.Tensor) -> torch.Tensor | None:
        """The shots' log-scale changes at a point: their mean taken out (the likelihood sees only each shot's
        scale·|F|², so one factor on every scale and its inverse on every |F|² change nothing: without this the
        optimiser wanders along that direction). None where the scales are not refined."""
        if not self.scale_count:
            return None
        changes = point[self.count:self.count + self.scale_count] / self.shot_scale
        return changes - changes.mean()

    def gradient(self, log_F_gradient: torch.Tensor, scale_gradient: torch.Tensor) -> torch.Tensor:
        """The objective's gradient in these variables from its gradients in every log|F| and each shot's log-scale
        change."""
        by_scale = ((scale_gradient - scale_gradient.mean()) / self.shot_scale)[:self.scale_count]
        return torch.cat([log_F_gradient[self.free] / self.scale, by_scale])

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The variables' bounds: no |F| or scale moves by more than STEP_FACTOR_LIMIT, and no |F| below the floor."""
        reach = math.log(STEP_FACTOR_LIMIT) * torch.cat([self.scale, self.shot_scale[:self.scale_count]])
        lowest = -reach
        lowest[:self.count] = torch.maximum(-reach[:self.count],
                                            (self.log_floor - self.origin[self.free]).clamp(max=0.0) * self.scale)
        return lowest.numpy(), reach.numpy()


class Merge:
    """The state of a merge on one worker: the shared log|F| and this worker's shots."""

    def __init__(self, job: MergeJob):
        job.options.check()
        self.job, self.options = job, job.options
        if self.options.shots.lattice is None:  # each shot's cell within the space group's lattice system
            shots = dataclasses.replace(self.options.shots, lattice=lattice_system_of(space_group(job.space_group)))
            self.options = dataclasses.replace(self.options, shots=shots)
        self.device = worker_device(job.options.shots.device)
        self.rank, self.size = rank_and_size()
        if self.options.solve == "joint" and self.size > len(job.shots):
            raise NbsimError(f"the joint solve needs a shot on every worker: {self.size} workers for {len(job.shots)} "
                             "shots")
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
        self.design: Design | None = None
        """The F step's linear model of this worker's pixels (built from the shots at the F step's start)."""
        self.kept_shots = 0
        """Shots the last shot step left at their model of the cycle before (`refine_shots`)."""
        self.kernels_decided = False
        """Whether this run has decided on the fit's compiled kernels (`decide_kernels`)."""
        self.measured = np.ones(self.model.size, dtype=bool)
        """The measured parameters (`measured_parameters`; every one until the first F step says)."""
        self.indexings = dict(other_indexings(self.reflections.group, job.cell_A_deg)) if self.options.reindex \
            else {}
        """The lattice's other indexings (triplet: rotation), among which the first shot step chooses."""
        self.reindexed_shots = 0
        """Shots the last shot step gave another indexing (`choose_indexings`)."""

    def table(self, log_F: torch.Tensor) -> torch.Tensor:
        """The kernel's flat padded table at these log|F|."""
        return self.model.table(log_F.to(self.device), self.base, self.nodes)

    def current_grid(self) -> HKLGrid:
        """The current |F| as an HKLGrid (what a shot's set-up carries into `nbsim.fit`)."""
        with torch.no_grad():
            padded = self.table(self.log_F).cpu().numpy().reshape(np.asarray(self.grid.shape) + 2)
        return HKLGrid(values=padded[1:-1, 1:-1, 1:-1].copy(), index_min=self.grid.index_min,
                       entries=self.grid.entries)

    def _rebuilt(self, start: Setup, values: dict[str, list[float]], oversample: int, grid: HKLGrid) -> Setup:
        """A shot's set-up from `start` with `values` of what `--refine` names in place, sampled with `oversample`
        sub-pixels a side, rendering the table `grid`."""
        return dataclasses.replace(rebuilt_setup(start, values, self.options.shots.refine, self.options.shots.lattice,
                                                 oversample), grid=grid)

    def shot_options(self, cycle: int) -> FitOptions:
        """What the shot step of cycle `cycle` (0 the first) refines: only the scale in the first `scale_cycles`
        cycles (the rest of each shot's model, fitted to the pixels' intensities, would take up the errors of a
        start's |F|), then everything asked; the search only in the first cycle that refines the orientation;
        the restraints on what is refined; a change tolerance of at least `shot_change_tolerance`."""
        options = self.options.shots
        refine = options.refine if cycle >= self.options.scale_cycles else \
            tuple(name for name in options.refine if name == "scale")
        first_orientation = "orientation" in refine and cycle == self.options.scale_cycles
        restraints = {name: sigma for name, sigma in options.restraints.items() if name in refine}
        return dataclasses.replace(options, refine=refine, restraints=restraints,
                                   search_deg=options.search_deg if first_orientation else 0.0,
                                   change_tolerance=max(options.change_tolerance, self.options.shot_change_tolerance))

    def refine_shots(self, cycle: int) -> None:
        """The shot step: each shot refined with F fixed (`shot_options`) from its model of the last cycle, or,
        where the shots are restrained, from its start (the restraints are towards the fit's start: so towards
        the shot's start in every cycle, never a drift); its model, scale, pixels and background kept for the F
        step. The shots go to `nbsim.fit.fit` together (`fit_batches`). A shot whose refined model explains
        the pixels the fit chose worse than its model of the last cycle (−log L with the fit's background), or
        whose refinement is not finite, keeps its model of the last cycle (with those pixels; with its own where
        the refinement is not finite); `kept_shots` counts them. In the first cycle, where the lattice admits
        other indexings (`indexings`), each shot then takes the one its pixels prefer (`choose_indexings`) and
        the shots reindexed are fitted again; `reindexed_shots` counts them."""
        grid = self.current_grid()
        options = self.shot_options(cycle)
        self.decide_kernels([dataclasses.replace(shot.setup, grid=grid) for shot in self.shots], options, cycle)
        self.kept_shots = self.reindexed_shots = 0
        self.fit_shots(list(range(len(self.shots))), grid, options)
        if cycle == 0 and self.indexings:
            reindexed = self.choose_indexings(grid, options)
            self.reindexed_shots = len(reindexed)
            self.fit_shots(reindexed, grid, options)
        if "cell" in self.options.shared and "cell" in options.refine:
            self.share_cell(grid)
        self.design = None

    def fit_shots(self, indices: Sequence[int], grid: HKLGrid, options: FitOptions) -> None:
        """The shot step's fits of these shots (`refine_shots`), which keep or replace each one's model."""
        images = {index: dataclasses.replace(self.shots[index].image, setup=dataclasses.replace(
            self.shots[index].start if options.restraints else self.shots[index].setup, grid=grid))
            for index in indices}
        for batch in fit_batches([images[index].setup for index in indices], options):
            batch = [indices[position] for position in batch]
            result = fit([images[index] for index in batch], options)
            model = result.model
            with torch.no_grad():
                values = model.natural()
                photons = [p.to(torch.float64) for p in model.photons(values)]
            refined = model.refined_setups()
            documents = fit_json(result, [list(self.shots[index].argv) for index in batch])["shots"]
            backgrounds = [(expected.detach().to(torch.float64) - found) for expected, found
                           in zip(result.expected, photons, strict=True)]
            previous = self._previous_likelihoods([self.shots[index] for index in batch], result.boxes, backgrounds,
                                                  grid, options)
            for row, index in enumerate(batch):
                shot = self.shots[index]
                box = result.boxes[row]
                expected = photons[row] + backgrounds[row]
                counts = torch.as_tensor(shot.image.counts[box.rows, box.cols], dtype=torch.float64)
                nll = float(negative_log_likelihood(expected, counts, options.readout_photons, options.likelihood))
                finite = math.isfinite(nll) and all(bool(torch.isfinite(v).all()) for v in values[row].values())
                if not finite and shot.rows is None:
                    raise NbsimError(f"{shot.image.name}: its refinement ended in values that are not finite")
                if not finite:  # the last cycle's model, pixels and background
                    self.kept_shots += 1
                    continue
                shot.rows, shot.cols = box.rows, box.cols
                shot.background = backgrounds[row].to(self.device)
                if nll > previous[row]:  # the last cycle's model on the new pixels
                    self.kept_shots += 1
                    continue
                shot.values = shot_values(shot.start, refined[row], options.lattice)
                shot.setup = self._rebuilt(shot.start, shot.values, refined[row].oversample, grid)
                shot.scale = float(values[row]["scale"][0])
                shot.document = {**documents[row], "converged": result.converged, "reason": result.reason,
                                 "negative_log_likelihood": nll, "refined_with": len(batch),
                                 "indexing": shot.indexing}

    def choose_indexings(self, grid: HKLGrid, options: FitOptions) -> list[int]:
        """Each shot's indexing among its start's and the lattice's others (`indexings`): the −log L of its fitted
        pixels, with their background and the scale that fits each best, at its model and at that model
        reindexed (`state.reindexed_start`: every spot where it was, with the |F| of h·R). A shot takes the
        indexing that lowers it by at least REINDEX_MARGIN; its start becomes its given one reindexed (so its
        restraints and every later cycle are in that indexing). Returns the shots reindexed."""
        lattice = options.lattice
        fitted = [index for index, shot in enumerate(self.shots) if shot.rows is not None]
        shots = [self.shots[index] for index in fitted]
        pixels = [(shot.rows, shot.cols) for shot in shots]
        backgrounds = [shot.background for shot in shots]
        nll = np.full((len(fitted), 1 + len(self.indexings)), np.inf)
        candidates: list[list[tuple[Setup, Setup]]] = []  # per other indexing, each fitted shot's start and setup
        for column, operator in enumerate([None, *self.indexings.values()]):
            if operator is None:
                setups = [dataclasses.replace(shot.setup, grid=grid) for shot in shots]
            else:
                starts = [reindexed_start(shot.start, operator, lattice) for shot in shots]
                setups = [self._rebuilt(start, shot.values, shot.setup.oversample, grid)
                          for start, shot in zip(starts, shots, strict=True)]
                candidates.append(list(zip(starts, setups, strict=True)))
            nll[:, column] = self._likelihoods(shots, setups, pixels, backgrounds, options, best_scale=True)
        reindexed = []
        names = list(self.indexings)
        for row, index in enumerate(fitted):
            best = int(np.argmin(nll[row]))
            if best == 0 or nll[row, 0] - nll[row, best] < REINDEX_MARGIN:
                continue
            shot = self.shots[index]
            shot.indexing = names[best - 1]
            shot.start, shot.setup = candidates[best - 1][row]
            reindexed.append(index)
        return reindexed

    def decide_kernels(self, setups: Sequence[Setup], options: FitOptions, cycle: int) -> None:
        """Once a run, where the fit's kernel is "auto": build the fit's compiled kernels first (nbsim.fit.compiled.
        kernels_ready) when the shot steps left, every shot of this worker in each, would take longer eagerly
        than building them and fitting compiled. Each call of `nbsim.fit.fit` weighs only its own shots, which
        for SHOTS_PER_FIT SAD stills never pays for a build: without this a merge without cached kernels fitted
        eagerly in every cycle, four times slower."""
        if self.kernels_decided or Compile.of(options.compile) is not Compile.AUTO:
            return
        self.kernels_decided = True
        pixels = options.max_spots * options.shoebox_px ** 2
        pixel_steps = sum(pixels * setup.steps for setup in setups) * (self.options.cycles - cycle)
        kernels_ready(fit_kernel_variants(setups, options.refine, options), pixel_steps)

    def _previous_likelihoods(self, shots: Sequence[Shot], boxes: Sequence, backgrounds: Sequence[torch.Tensor],
                              grid: HKLGrid, options: FitOptions) -> list[float]:
        """Each shot's −log L at its model of the last cycle on the pixels the shot step chose, with their new
        background (inf for a shot without one: the first cycle)."""
        earlier = [index for index, shot in enumerate(shots) if shot.values is not None]
        found = [math.inf] * len(shots)
        if earlier:
            likelihoods = self._likelihoods([shots[index] for index in earlier],
                                            [dataclasses.replace(shots[index].setup, grid=grid) for index in earlier],
                                            [(boxes[index].rows, boxes[index].cols) for index in earlier],
                                            [backgrounds[index] for index in earlier], options, best_scale=False)
            for index, nll in zip(earlier, likelihoods, strict=True):
                found[index] = nll
        return found

    @staticmethod
    def _likelihoods(shots: Sequence[Shot], setups: Sequence[Setup], pixels: Sequence[tuple[np.ndarray, np.ndarray]],
                     backgrounds: Sequence[torch.Tensor], options: FitOptions, best_scale: bool) -> list[float]:
        """Each shot's −log L of its `pixels` (rows, cols) rendered from its set-up in `setups`, the expected counts
        a scale times the photons plus its background: the shot's scale, or with `best_scale` the scale that fits
        best (`_scaled_nll`). One model renders every shot, nothing refined."""
        model = DiffractionModel(list(setups), list(pixels), (), device=options.device, dtype=torch.float64,
                                 compile=options.compile)
        with torch.no_grad():
            photons = model()
        found = []
        for shot, (rows, cols), signal, background in zip(shots, pixels, photons, backgrounds, strict=True):
            counts = torch.as_tensor(shot.image.counts[rows, cols], dtype=torch.float64)
            signal, background = signal.to(torch.float64).cpu(), background.cpu()
            found.append(_scaled_nll(signal, background, counts, shot.scale, options) if best_scale else
                         float(negative_log_likelihood(shot.scale * signal + background, counts,
                                                       options.readout_photons, options.likelihood)))
        return found

    def share_cell(self, grid: HKLGrid) -> None:
        """One cell for every shot (`shared` names "cell": crystals of one form): the mean of the shots' refined
        cells, each free parameter weighted by 1/σ² of its fit (a plain mean where no fit gave σ)."""
        lattice = self.options.shots.lattice
        free = lattice_system(self.job.cell_A_deg, lattice).free
        sums = torch.zeros(3, len(free), dtype=torch.float64)
        for shot in self.shots:
            values = torch.tensor(shot.values["cell"], dtype=torch.float64)
            sigma = torch.tensor([shot.document["sigma"]["cell"][index] for index in free], dtype=torch.float64)
            weight = torch.where(torch.isfinite(sigma) & (sigma > 0), 1.0 / sigma.clamp(min=1e-300) ** 2, 0.0)
            sums += torch.stack([weight * values, weight, values])
        sums = all_sum(sums, self.device)
        shared = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1e-300), sums[2] / self.shot_count)
        for shot in self.shots:
            shot.values["cell"] = shared.tolist()
            shot.setup = self._rebuilt(shot.start, shot.values, shot.setup.oversample, grid)
            cell = [float(v) for v in shot.setup.lattice.cell_parameters()]
            flags = list(shot.document["flags"])
            position = flags.index("-cell") + 1
            flags[position:position + 6] = [f"{v:.10g}" for v in cell]
            shot.document.update(cell=cell, A_matrix=shot.setup.lattice.reciprocal_per_A.detach().tolist(),
                                 flags=flags)

    def _design(self) -> Design:
        """This worker's shots at their refined models as one sparse linear system in |F|² (`design.Design`),
        built once per F step (the shots are fixed during it)."""
        if self.design is None:
            shots = [shot_design(shot.setup, shot.rows, shot.cols, self.nodes, self.base, self.device)
                     for shot in self.shots]
            self.design = Design(shots, [self._counts(shot) for shot in self.shots],
                                 [shot.background for shot in self.shots], [shot.scale for shot in self.shots],
                                 self.model.size, self.readout, self.options.shots.likelihood, self.device)
        return self.design

    def _counts(self, shot: Shot) -> torch.Tensor:
        return torch.as_tensor(shot.image.counts[shot.rows, shot.cols], dtype=torch.float64, device=self.device)

    @property
    def shot_count(self) -> int:
        """How many shots the merge has, over every worker."""
        return len(self.job.shots)

    def _global(self, local: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """A value per shot of this worker's, placed at the shots' places among every worker's (zero elsewhere)."""
        placed = torch.zeros(self.shot_count, dtype=torch.float64)
        placed[self.rank::self.size] = torch.as_tensor(local, dtype=torch.float64)
        return placed

    def local_nll(self, log_F: torch.Tensor, log_scale_change: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This worker's negative log-likelihood and its gradients in log|F| and in each shot's log-scale change
        (`log_scale_change`: every worker's shots, zero when None)."""
        own = None if log_scale_change is None else log_scale_change[self.rank::self.size]
        value, gradient, scale_gradient = self._design().likelihood(log_F, own)
        return value, gradient, self._global(scale_gradient)

    def nll(self, log_F: torch.Tensor, log_scale_change: torch.Tensor | None = None
            ) -> tuple[float, torch.Tensor, torch.Tensor]:
        """The negative log-likelihood over every worker's shots and its gradients in log|F| and in every shot's
        log-scale change (all-reduced)."""
        value, gradient, scale_gradient = self.local_nll(log_F, log_scale_change)
        summed = all_sum(torch.cat([value.reshape(1), gradient, scale_gradient]), self.device)
        return float(summed[0]), summed[1:1 + self.model.size], summed[1 + self.model.size:]

    def scale_information(self) -> torch.Tensor:
        """The Fisher information of each shot's log scale, Σ_p signal_p²·w_p (every worker's shots)."""
        return all_sum(self._global(self._design().scale_information(self.log_F)), self.device)

    def expectation_maximisation(self, refined: torch.Tensor) -> int:
        """EM steps on the intensities |F|² with the shots fixed (Poisson likelihood): under the nearest lookup
        every pixel's λ is linear in the |F|² of the nodes it sees, λ_p = b_p + Σ_j A_pj·|F_j|², and
        |F_j|² ← |F_j|²·Σ_p A_pj c_p/λ_p / Σ_p A_pj never lowers the likelihood; where each pixel sees one
        reflection it is the optimum in one step, from any start. Σ_p A_pj c_p/λ_p / Σ_p A_pj = 1 − g_j/s_j,
        with g the likelihood's gradient in log|F| and s_j = 2|F_j|²Σ_p A_pj. Only the `refined` parameters move;
        the restraints are left to the L-BFGS that follows. Returns the steps taken."""
        if self.options.shots.likelihood != "poisson" or self.options.em_iterations == 0:
            return 0
        origin = self.log_F.clone()
        signal = all_sum(self._design().signal_gradient(origin), self.device)
        seen = (signal > 0) & refined
        floor = -2.0 * math.log(STEP_FACTOR_LIMIT)
        for step in range(1, self.options.em_iterations + 1):
            _, gradient, _ = self.nll(self.log_F)
            scaled = signal * torch.exp(2.0 * (self.log_F - origin))
            ratio = torch.where(seen, 1.0 - gradient / torch.where(seen, scaled, 1.0), 1.0)
            change = 0.5 * torch.log(ratio.clamp(min=math.exp(floor)))
            change = torch.maximum(self.log_F + change, torch.full_like(change, self.model.log_floor)) - self.log_F
            self.log_F = self.log_F + change
            if float(change.abs().max()) <= self.options.em_tolerance:
                return step
        return self.options.em_iterations

    def fisher_diagonal(self) -> torch.Tensor:
        """The diagonal of the Fisher information of log|F| at the current |F| over every worker's pixels:
        Σ_p (∂λ_p/∂log|F_j|)²·w_p, exact under the nearest lookup (`design.Design`)."""
        return all_sum(self._design().fisher_diagonal(self.log_F), self.device)

    def reference_information(self) -> torch.Tensor:
        """Each parameter's Fisher information in log|F| had it its shell's mean intensity (every worker's
        pixels): what its pixels can tell of it, whatever its estimate."""
        return all_sum(self._design().information_at(self.log_F, self.model.log_reference), self.device)

    def measured_parameters(self) -> np.ndarray:
        """Which parameters count as measured (written, scored): `reference_information` at least
        MEASURED_INFORMATION and information at the estimate at least REFINED_INFORMATION."""
        well_seen = self.reference_information() >= MEASURED_INFORMATION
        return (well_seen & (self.fisher_diagonal() >= REFINED_INFORMATION)).numpy()

    def objective(self, log_F: torch.Tensor) -> float:
        """The F step's objective at these log|F| with the shots as they are: −log L over every worker's pixels
        plus the restraints."""
        with torch.no_grad():
            return self.nll(log_F)[0] + float(self.model.penalty(log_F))

    def refine_F(self) -> dict:
        """The F step: EM steps (`expectation_maximisation`), then L-BFGS on log|F| with the restraints together
        with every shot's log scale (the scale and the |F| it multiplies trade off: refined apart, in turns, they
        would converge slowly), every worker in step. Only the parameters whose pixels can measure them
        (`reference_information`) are refined: the rest keep their |F|. The shots' scales keep their geometric
        mean (`FVariables.scale_changes`). The variables are scaled by √ of each one's Fisher information
        (`open_F_step`). An F step that ends with a higher objective than it started with (or not finite) is
        undone: its start is kept. Returns what the cycle's record says of it: the objective before and after,
        the EM steps, the L-BFGS iterations and whether it was undone. Then the measured parameters
        (`measured_parameters`) are those at the end."""
        variables = self.open_F_step()

        def value_and_gradient(point: np.ndarray) -> tuple[float, np.ndarray]:
            vector = torch.as_tensor(point)
            log_F = variables.log_F_at(vector)
            nll, gradient, scale_gradient = self.nll(log_F, variables.scale_changes(vector))
            value, gradient = self.with_penalty(nll, gradient, log_F)
            return value, variables.gradient(gradient, scale_gradient).numpy()

        outcome = self.minimise(value_and_gradient, variables.count + variables.scale_count, *variables.bounds())
        return self.close_F_step(variables, outcome)

    def open_F_step(self) -> FVariables:
        """The start of an F step or a joint solve: the parameters refined (`reference_information`), the EM steps
        from the objective's start (`expectation_maximisation`) and the scaling of the variables by √ of each one's
        Fisher information (and the restraints' curvature), so that the Hessian is near the identity and a
        gradient component is about the distance to the optimum in standard errors; at least its information at
        its shell's mean intensity, so that a weak |F| (whose information vanishes with |F|²) takes steps of at
        most about one standard error of a typical one, not steps that multiply its |F| a thousandfold (a
        parameter no pixel sees takes the median); a shot's log scale by its own."""
        reference = self.reference_information()
        refined = reference >= REFINED_INFORMATION
        start_log_F, start_objective = self.log_F.clone(), self.objective(self.log_F)
        em_steps = self.expectation_maximisation(refined)
        free = torch.nonzero(refined).reshape(-1)
        curvature = (torch.maximum(self.fisher_diagonal(), reference) + self.model.curvature())[free]
        known = curvature > 0
        typical = float(curvature[known].median()) if known.any() else 1.0
        return FVariables(origin=self.log_F.clone(), free=free,
                          scale=torch.sqrt(torch.where(known, curvature, torch.full_like(curvature, typical))),
                          shot_scale=torch.sqrt(self.scale_information().clamp(min=1.0)),
                          scale_count=self.shot_count if "scale" in self.options.shots.refine else 0,
                          log_floor=self.model.log_floor, start_log_F=start_log_F, start_objective=start_objective,
                          em_steps=em_steps)

    def with_penalty(self, nll: float, gradient: torch.Tensor, log_F: torch.Tensor) -> tuple[float, torch.Tensor]:
        """The objective and its gradient in log|F|: the negative log-likelihood plus the restraints on log|F|."""
        x = log_F.clone().requires_grad_(True)
        penalty = self.model.penalty(x)
        gradient = gradient + (torch.autograd.grad(penalty, x)[0] if penalty.requires_grad else 0.0)
        return nll + float(penalty.detach()), gradient

    def minimise(self, value_and_gradient: Callable[[np.ndarray], tuple[float, np.ndarray]], size: int,
                 lowest: np.ndarray, highest: np.ndarray) -> scipy.optimize.OptimizeResult:
        """L-BFGS-B from zero within the bounds, every worker in step on the same sums; it stops once its last
        CHANGE_ITERATIONS iterations together lowered the objective by less than change_tolerance each on average
        (an absolute test: −log L's size is arbitrary), or at the iteration cap or gradient tolerance."""
        history: list[float] = []

        def settled(intermediate_result: scipy.optimize.OptimizeResult) -> None:
            history.append(float(intermediate_result.fun))
            if len(history) > CHANGE_ITERATIONS and \
                    history[-1 - CHANGE_ITERATIONS] - history[-1] < CHANGE_ITERATIONS * self.options.change_tolerance:
                raise StopIteration

        return scipy.optimize.minimize(
            value_and_gradient, np.zeros(size), jac=True, method="L-BFGS-B", callback=settled,
            bounds=scipy.optimize.Bounds(lowest, highest),
            options={"maxiter": self.options.max_iterations, "gtol": self.options.gradient_tolerance,
                     "ftol": 0.0, "maxcor": 30})

    def close_F_step(self, variables: FVariables, outcome: scipy.optimize.OptimizeResult,
                     keep: Callable[[torch.Tensor], None] | None = None) -> dict:
        """Take an F step's (or a joint solve's) end, or undo it where it ends above its start or not finite (the
        start's |F| and scales kept; `keep(point)` takes what else it refined, only when it is kept); then the
        measured parameters. Returns the record's part of it."""
        finite = math.isfinite(outcome.fun) and bool(np.all(np.isfinite(outcome.x)))
        undone = not (finite and outcome.fun <= variables.start_objective)
        if undone:
            self.log_F = variables.start_log_F
        else:
            vector = torch.as_tensor(outcome.x)
            self.log_F = variables.log_F_at(vector)
            if keep is not None:
                keep(vector)
            if variables.scale_count:
                self.rescale_shots(torch.exp(variables.scale_changes(vector))[self.rank::self.size])
        self.measured = self.measured_parameters()
        return {"objective_before_F": variables.start_objective,
                "objective": outcome.fun if not undone else variables.start_objective,
                "negative_log_likelihood": self.nll(self.log_F)[0], "em_steps": variables.em_steps,
                "f_iterations": int(outcome.nit), "f_step_undone": undone}

    def solve_jointly(self) -> dict:
        """The joint solve (`MergeOptions.solve` "joint"), after a shot step that placed the shoeboxes and fitted
        their background planes: the F step's EM steps, then one L-BFGS on the measurable log|F| (as the F step
        chooses them), every shot's log scale (its gauge fixed as the F step's) and every shot's refined
        quantities (`joint.JointShots`: the fit's coordinates of what --refine names, the cell one for every shot
        where shared), on the negative log-likelihood of every shot's fixed pixels plus the restraints on log|F|,
        its gradient by autograd through the kernel, summed over the workers. The shots' coordinates are scaled
        by √ of their Fisher information (`JointShots.information`), as log|F| and the scales are. A solve that
        ends above where it began is undone (|F|, scales and shots kept). Returns the record's part of it."""
        variables = self.open_F_step()
        shots = self.joint_shots()
        with torch.no_grad():
            table = self.table(variables.origin)
        information = all_sum(shots.information(table), self.device)
        coordinate_scale = torch.sqrt(information.clamp(min=1.0))
        count = variables.count + variables.scale_count

        def value_and_gradient(point: np.ndarray) -> tuple[float, np.ndarray]:
            vector = torch.as_tensor(point)
            log_F = variables.log_F_at(vector).requires_grad_(True)
            changes = variables.scale_changes(vector)
            changes = torch.zeros(self.shot_count, dtype=torch.float64) if changes is None else changes
            with torch.enable_grad():
                table = self.table(log_F)
            nll, by_table, by_scale, by_shot = shots.likelihood(table, changes[self.rank::self.size],
                                                                vector[count:] / coordinate_scale)
            by_log_F = torch.autograd.grad(table, log_F, grad_outputs=by_table)[0].cpu()
            summed = all_sum(torch.cat([torch.tensor([nll], dtype=torch.float64), by_log_F,
                                        self._global(by_scale), by_shot]), self.device)
            size = self.model.size
            value, gradient = self.with_penalty(float(summed[0]), summed[1:1 + size], log_F.detach())
            by_scales, by_shots = summed[1 + size:1 + size + self.shot_count], summed[1 + size + self.shot_count:]
            return value, torch.cat([variables.gradient(gradient, by_scales), by_shots / coordinate_scale]).numpy()

        lowest, highest = variables.bounds()
        reach = np.full(shots.size, JOINT_REACH_SIGMAS)
        outcome = self.minimise(value_and_gradient, count + shots.size, np.concatenate([lowest, -reach]),
                                np.concatenate([highest, reach]))

        def keep(vector: torch.Tensor) -> None:
            coordinates = vector[count:] / coordinate_scale
            self.take_joint_shots(shots, coordinates)

        record = self.close_F_step(variables, outcome, keep)
        return {**record, "solve": "joint", "joint_coordinates": shots.size}

    def joint_shots(self) -> JointShots:
        """This worker's shots, at the shot step's models on its pixels with its backgrounds and scales, as the
        joint solve refines them."""
        return JointShots([shot.setup for shot in self.shots], [(shot.rows, shot.cols) for shot in self.shots],
                          [self._counts(shot) for shot in self.shots], [shot.background for shot in self.shots],
                          [shot.scale for shot in self.shots], self.options.shots.refine, self.options.shared,
                          self.options.shots.lattice, list(range(self.rank, self.shot_count, self.size)),
                          self.shot_count, self.readout, self.options.shots.likelihood, self.device)

    def take_joint_shots(self, shots: JointShots, coordinates: torch.Tensor) -> None:
        """Every shot of this worker at the joint solve's end (`coordinates`: every worker's): its values, set-up
        (with the current |F|) and JSON (the shot step's sigmas kept; `solved_jointly`); the design is rebuilt."""
        grid = self.current_grid()
        lattice = self.options.shots.lattice
        refined = shots.refined(coordinates, [shot.argv for shot in self.shots])
        for shot, (setup, document) in zip(self.shots, refined, strict=True):
            shot.values = shot_values(shot.start, setup, lattice)
            shot.setup = self._rebuilt(shot.start, shot.values, setup.oversample, grid)
            spectrum = {**shot.document.get("spectrum", {}), **document.get("spectrum", {})}  # its sigma kept
            shot.document = {**shot.document, **document, "solved_jointly": True}
            if spectrum:
                shot.document["spectrum"] = spectrum
        self.design = None

    def rescale_shots(self, factors: torch.Tensor) -> None:
        """Multiply this worker's shots' scales (the F step refines them with |F|); their JSON follows."""
        for shot, factor in zip(self.shots, factors.tolist(), strict=True):
            shot.scale *= factor
            document = shot.document
            document["scale"] = shot.scale
            flags = list(document["flags"])
            if "-fluence" in flags:
                position = flags.index("-fluence") + 1
                flags[position] = f"{float(flags[position]) * factor:.10g}"
                document["flags"] = flags
        if self.design is not None:
            self.design.scales = self.design.scales * factors.to(self.design.scales)

    def report_shells(self) -> np.ndarray:
        """Each parameter's reported resolution shell (`options.shells` of them, equal in 1/d³ over the measured
        parameters' resolution range)."""
        d_A = self.reflections.parameter_d_A()
        return shells(d_A, self.options.shells, d_A[self.measured])

    def information(self) -> torch.Tensor:
        """Each parameter's information in log|F| at the estimate: the Fisher diagonal over every worker's pixels
        and the restraints' curvature (σ(log|F|) = 1/√ of it)."""
        return self.fisher_diagonal() + self.model.curvature()

    def signal(self, information: torch.Tensor) -> dict:
        """The merged data's own signal, with or without a truth, from each parameter's `information`: per
        reported shell, its high-resolution limit (Å), how many parameters are measured and their mean
        |F|/σ(|F|) (√ of the information); and the data's resolution, the limit of the last shell, counted from
        the lowest, whose mean |F|/σ is at least RESOLUTION_F_OVER_SIGMA (None: not even the first)."""
        f_over_sigma = torch.sqrt(information.clamp(min=0.0)).numpy()
        d_A = self.reflections.parameter_d_A()
        shell = self.report_shells()
        limits, counts, means = [], [], []
        for index in range(self.options.shells):
            where = (shell == index) & self.measured
            limits.append(float(d_A[where].min()) if where.any() else math.nan)
            counts.append(int(where.sum()))
            means.append(float(f_over_sigma[where].mean()) if where.any() else math.nan)
        resolution = None
        for limit, mean in zip(limits, means, strict=True):
            if not mean >= RESOLUTION_F_OVER_SIGMA:
                break
            resolution = limit
        return {"shell_d_min_A": limits, "measured_by_shell": counts, "f_over_sigma_by_shell": means,
                "resolution_A": resolution}

    def scores(self) -> dict:
        """CC(|F|, truth) overall and by reported shell (`report_shells`), and CCano (of |F(+)| − |F(−)|) overall
        and by shell with `anomalous`, over the measured parameters (every one before cycle 1), and how many
        reflections the overall CC compares (`cc_reflections`: the start's and a cycle's differ)."""
        if self.truth is None:
            return {}
        values = np.where(self.measured, torch.exp(self.log_F).numpy(), np.nan)
        count = self.options.shells
        shell = self.report_shells()
        record = {"cc": correlation(values, self.truth),
                  "cc_reflections": int((np.isfinite(values) & np.isfinite(self.truth)).sum()),
                  "cc_by_shell": [correlation(values[shell == s], self.truth[shell == s]) for s in range(count)]}
        if self.reflections.anomalous:
            plus, _ = self.reflections.friedel_pairs()
            observed = anomalous_differences(self.reflections, values)
            truth = anomalous_differences(self.reflections, self.truth)
            record["cc_anomalous"] = correlation(observed, truth)
            record["cc_anomalous_by_shell"] = [correlation(observed[shell[plus] == s], truth[shell[plus] == s])
                                               for s in range(count)]
        return record

    def save(self, path: str, cycle: int, cycles: list[dict]) -> None:
        """Write the checkpoint after `cycle` cycles (the first worker writes; every worker's shots)."""
        states = [ShotState(name=shot.image.name, values=shot.values, oversample=shot.setup.oversample,
                            scale=shot.scale, rows=np.asarray(shot.rows), cols=np.asarray(shot.cols),
                            background=shot.background.cpu().numpy(), document=shot.document)
                  for shot in self.shots]
        gathered = [state for worker in gather(states) for state in worker]
        if self.rank == 0:
            write_checkpoint(path, Checkpoint(fingerprint=job_fingerprint(self.job), cycle=cycle,
                                              log_F=self.log_F.numpy(), measured=self.measured, shots=gathered,
                                              cycles=cycles))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint: its log|F|, and this worker's shots' models, pixels and backgrounds."""
        states = {state.name: state for state in checkpoint.shots}
        if len(checkpoint.log_F) != self.model.size or len(checkpoint.measured) != self.model.size or \
                any(s.image.name not in states for s in self.shots):
            raise NbsimError("the checkpoint does not hold this merge's reflections and shots; remove it")
        self.log_F = torch.as_tensor(checkpoint.log_F, dtype=torch.float64)
        self.measured = checkpoint.measured
        grid = self.current_grid()
        for shot in self.shots:
            state = states[shot.image.name]
            shot.values, shot.scale, shot.document = state.values, state.scale, state.document
            shot.indexing = state.document.get("indexing", AS_GIVEN)
            if shot.indexing != AS_GIVEN:
                shot.start = reindexed_start(shot.start, self.indexings[shot.indexing], self.options.shots.lattice)
            shot.setup = self._rebuilt(shot.start, state.values, state.oversample, grid)
            shot.rows, shot.cols = state.rows, state.cols
            shot.background = torch.as_tensor(state.background, dtype=torch.float64, device=self.device)
        self.design = None

    def converged(self, cycles: list[dict]) -> bool:
        """Whether the merge stops after the last cycle: a joint solve (the merge's last step), or a cycle, one past
        the scale-only cycles, that changed the log|F| measured before and after it by less than `convergence` of
        their standard errors (the median)."""
        last = cycles[-1] if cycles else {}
        return last.get("solve") == "joint" or (last.get("cycle", 0) > self.options.scale_cycles and
                                                 last.get("median_change_sigmas", math.inf) <= self.options.convergence)

    def run(self, progress: Callable[[dict], None] | None = None, checkpoint: str | None = None,
            stop_after: int | None = None) -> MergeResult | None:
        """Every macro-cycle, then the standard errors; `progress(record)` after each cycle (on every worker).
        With `checkpoint`, the state is written there after each cycle and a run finds it there resumes from
        it; `stop_after`: stop (returning None) once that many cycles are done and checkpointed."""
        started = time.perf_counter()
        cycles: list[dict] = []
        first_cycle = 0
        resumed = None if checkpoint is None else read_checkpoint(checkpoint, job_fingerprint(self.job))
        if resumed is not None:
            if resumed.cycle > self.options.cycles:
                raise NbsimError(f"{checkpoint}: the checkpoint is after cycle {resumed.cycle}, beyond the "
                                 f"{self.options.cycles} cycles asked")
            self.restore(resumed)
            cycles, first_cycle = list(resumed.cycles), resumed.cycle
            if progress is not None:
                progress({"cycle": first_cycle, "resumed": checkpoint})
        elif self.truth is not None:
            cycles.append({"cycle": 0, **self.scores()})
            if progress is not None:
                progress(cycles[0])
        nll = next((r["negative_log_likelihood"] for r in reversed(cycles) if "negative_log_likelihood" in r), math.nan)
        for cycle in range(first_cycle, self.options.cycles):
            if self.converged(cycles):
                break
            before, measured_before = self.log_F.clone(), self.measured.copy()
            self.refine_shots(cycle)
            kept, reindexed = (int(count) for count in all_sum(
                torch.tensor([float(self.kept_shots), float(self.reindexed_shots)], dtype=torch.float64), self.device))
            step = self.solve_jointly() if self.options.solve == "joint" and cycle >= self.options.scale_cycles \
                else self.refine_F()
            nll = step["negative_log_likelihood"]
            both = torch.as_tensor(self.measured & measured_before)
            information = self.information()
            change = (self.log_F - before)[both]
            in_sigmas = change.abs() * torch.sqrt(information[both].clamp(min=0.0))
            record = {"cycle": cycle + 1, **step, "kept_shots": kept, "reindexed_shots": reindexed,
                      "rms_change_log_F": float(torch.sqrt(torch.mean(change ** 2))) if len(change) else 0.0,
                      "median_change_log_F": float(change.abs().median()) if len(change) else 0.0,
                      "median_change_sigmas": float(in_sigmas.median()) if len(change) else 0.0,
                      "seconds": round(time.perf_counter() - started, 3), **self.signal(information),
                      **self.scores()}
            cycles.append(record)
            if progress is not None:
                progress(record)
            if checkpoint is not None:
                self.save(checkpoint, cycle + 1, cycles)
            if stop_after is not None and cycle + 1 >= stop_after and cycle + 1 < self.options.cycles \
                    and not self.converged(cycles):
                return None
        information = self.information().numpy()
        measured = self.measured_parameters()
        self.measured = measured
        amplitudes = torch.exp(self.log_F).numpy()
        with np.errstate(divide="ignore"):
            sigmas = np.where(measured, amplitudes / np.sqrt(information), np.nan)
        documents = [document for worker in gather([s.document for s in self.shots]) for document in worker]
        order = {name: index for index, (name, _) in enumerate(self.job.shots)}
        documents.sort(key=lambda document: order[document["image"]])
        cell = tuple(float(v) for v in np.mean([d["cell"] for d in documents], axis=0)) if documents \
            else self.job.cell_A_deg
        return MergeResult(reflections=self.reflections, amplitudes=amplitudes, sigmas=sigmas, measured=measured,
                           shots=documents, cycles=cycles, nll=nll, seconds=time.perf_counter() - started,
                           cell_A_deg=cell)
