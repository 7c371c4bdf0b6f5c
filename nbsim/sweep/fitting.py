"""Refinement as a benchmark: the `fit:` section of a sweep or dataset config fits every shot (nbsim.fit)
from its truth perturbed by configured amounts, or from given nanoBragg flags, and collates refined − true
per parameter and per shot (docs/sweeps.md, "Fitting every shot").

A shot's truth is its point's configuration (`PointSpec.config`); its observed image is its detector image
in the batch store (`images.zarr#POINT`, read by nbsim.io.observed) when the sweep has a detector stage,
else its noise-free image read out with Poisson noise from a seed of the fit's. Its start is the truth with
the `start.flags` (if any) applied, then each `start.perturb` amount, drawn from a counter-based generator
keyed by (`seed`, the shot's name, the amount's key): one shot's start is reproduced alone. Quantities
refined once for every shot (`shared`) are perturbed once, keyed by the scenario instead of the shot.

The planning part (`fit_chunks`, `check_fit`) is torch-free: the Snakefile imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import NbsimError
from .plan import Batch, Point, scenario_args
from .progress import Progress
from .spec import PointSpec, dataclass_from_dict, dataclass_to_dict
from .store import write_json

if TYPE_CHECKING:
    from ..resolve import Setup

log = logging.getLogger(__name__)

PERTURBATIONS = {
    "orientation_deg": "orientation",
    "cell_percent": "cell",
    "cell_angle_deg": "cell",
    "N_percent": "N",
    "mosaic_percent": "mosaic",
    "scale_factor": "scale",
    "distance_mm": "distance",
    "beam_mm": "beam",
    "wavelength_percent": "wavelength",
}
"""Each `start.perturb` key and the refinable quantity it moves. Directions and signs are drawn:
orientation_deg rotates about a random axis, cell_percent scales each free length by 1 ± p/100 and
cell_angle_deg moves each free angle by ± its value (the lattice system kept), distance_mm and
wavelength_percent take a random sign, beam_mm a random direction in the detector plane. N_percent
(N × (1 + p/100)), mosaic_percent and scale_factor (the fluence × f) are applied as given."""

START_PARTS = ("crystal", "beam", "detector")
"""The configuration parts `start.flags` may change (the start's crystal, beam and detector)."""


def fit_chunks(batch: Batch, chunk_size: int) -> list[tuple[str, tuple[Point, ...]]]:
    """A batch's shots in fit jobs of `chunk_size`: (name, points), names f0000, f0001, ..."""
    return [(f"f{index:04d}", batch.points[start:start + chunk_size])
            for index, start in enumerate(range(0, len(batch.points), chunk_size))]


def check_fit(config: dict, base: Path) -> None:
    """What the schema cannot say about `fit:`: shared quantities are refined ones, and the start's flags
    parse with every scenario's arguments (file names relative to `base`, the config's folder)."""
    block = config["fit"]
    unshared = [name for name in block["shared"] if name not in block["refine"]]
    if unshared:
        raise NbsimError(f"fit.shared: {unshared[0]} is not refined (add it to fit.refine)")
    flags = block["start"].get("flags")
    if flags:
        from ..nanobragg import config_from_args

        for scenario in config["scenarios"]:
            try:
                config_from_args([*scenario_args(config, scenario, base), *shlex.split(flags)])
            except NbsimError as error:
                raise NbsimError(f"fit.start.flags: with scenario {scenario!r}: {error}") from None


@dataclass(frozen=True)
class FitJob:
    """One fit job (its rule's params, as `to_dict` data): a chunk of a batch's shots and the `fit:` block."""

    scenario: str
    batch: str
    chunk: str
    points: tuple[PointSpec, ...]
    settings: Mapping[str, Any]
    """The config's `fit:` block, defaults filled in by the schema."""
    detector: bool
    """The batch store holds each shot's detector image (the sweep has a detector stage)."""

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON data (what the Snakemake rule hands its script)."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FitJob:
        """The job from its JSON data."""
        return dataclass_from_dict(cls, data)


def keyed_generator(seed: int, owner: str, key: str) -> np.random.Generator:
    """The counter-based generator of one key (a perturbation, the noise) of one owner (a shot, or the scenario
    when shared): numpy's Philox keyed by a SeedSequence of the seed and the two names."""
    sequence = np.random.SeedSequence(int(seed), spawn_key=(zlib.crc32(owner.encode()), zlib.crc32(key.encode())))
    return np.random.Generator(np.random.Philox(sequence))


def _sign(generator: np.random.Generator) -> float:
    return 1.0 if generator.random() < 0.5 else -1.0


def flag_changes(argv: Sequence[str], flags: Sequence[str]) -> dict[str, Any]:
    """The crystal, beam and detector options that `flags`, added after `argv`, change: as options, so that
    they apply on top of a point's configuration (its option axes and draws kept)."""
    from ..nanobragg import config_from_args

    base, given = config_from_args(list(argv)), config_from_args([*argv, *flags])
    changes = {}
    for part in START_PARTS:
        before, after = getattr(base, part), getattr(given, part)
        for field in dataclasses.fields(after):
            if getattr(before, field.name) != getattr(after, field.name):
                changes[field.name] = getattr(after, field.name)
    return changes


def true_rotation(setup: Setup) -> np.ndarray:
    """A set-up's orientation U (real vectors = those of its cell in nanoBragg's default orientation · Uᵀ)."""
    import torch

    from ..fit.parameters import starting_rotation

    cell = torch.tensor(setup.lattice.cell_parameters(), dtype=torch.float64)
    return starting_rotation(cell, setup.lattice.real_A.detach().to(torch.float64)).numpy()


def perturbed_start(spec: PointSpec, truth: Setup, settings: Mapping[str, Any], scenario: str) -> Setup:
    """A shot's starting model: its truth with `start.flags` applied, then each `start.perturb` amount."""
    import torch

    from ..fit.output import misset_deg
    from ..fit.parameters import cell_from_free, lattice_system
    from ..resolve import resolve

    start = settings["start"]
    base_config = spec.config
    flags = shlex.split(start.get("flags") or "")
    if flags:
        base_config = base_config.with_options(**flag_changes(spec.argv, flags))
    base = truth if base_config == spec.config else resolve(base_config)
    perturb = start.get("perturb") or {}

    def generator(key: str) -> np.random.Generator:
        owner = scenario if PERTURBATIONS[key] in settings["shared"] else f"{scenario}/{spec.name}"
        return keyed_generator(settings["seed"], owner, key)

    cell = list(base.lattice.cell_parameters())
    system = lattice_system(tuple(cell), settings["lattice"])
    free = [cell[index] for index in system.free]
    if "cell_percent" in perturb:
        rng = generator("cell_percent")
        free = [value * (1 + _sign(rng) * perturb["cell_percent"] / 100) if index < 3 else value
                for value, index in zip(free, system.free, strict=True)]
    if "cell_angle_deg" in perturb:
        rng = generator("cell_angle_deg")
        free = [value + _sign(rng) * perturb["cell_angle_deg"] if index >= 3 else value
                for value, index in zip(free, system.free, strict=True)]
    start_cell = cell_from_free(torch.tensor(cell, dtype=torch.float64), system,
                                torch.tensor(free, dtype=torch.float64)).tolist()
    rotation = true_rotation(base)
    if "orientation_deg" in perturb:
        from scipy.spatial.transform import Rotation

        axis = generator("orientation_deg").normal(size=3)
        turn = Rotation.from_rotvec(axis / np.linalg.norm(axis) * math.radians(perturb["orientation_deg"]))
        rotation = turn.as_matrix() @ rotation
    options: dict[str, Any] = {"cell_A_deg": tuple(start_cell), "mosflm_matrix": None, "misset_random": False,
                               "misset_deg": tuple(misset_deg(torch.as_tensor(rotation)))}
    config = base.config
    if "mosaic_percent" in perturb:
        options["mosaic_spread_deg"] = (config.crystal.mosaic_spread_deg or 0.0) * (1 + perturb["mosaic_percent"] / 100)
    if "wavelength_percent" in perturb:
        options["wavelength_A"] = config.beam.wavelength_A * (1 + _sign(generator("wavelength_percent"))
                                                              * perturb["wavelength_percent"] / 100)
    geometry = base.geometry
    if "distance_mm" in perturb or "beam_mm" in perturb:
        options["distance_mm"] = float(geometry.distance_m) * 1e3
        options["beam_x_mm"], options["beam_y_mm"] = geometry.beam_x_m * 1e3, geometry.beam_y_m * 1e3
    if "distance_mm" in perturb:
        options["distance_mm"] += _sign(generator("distance_mm")) * perturb["distance_mm"]
    if "beam_mm" in perturb:
        angle = generator("beam_mm").uniform(0.0, 2 * math.pi)
        options["beam_x_mm"] += perturb["beam_mm"] * math.cos(angle)
        options["beam_y_mm"] += perturb["beam_mm"] * math.sin(angle)
    setup = resolve(config.with_options(**options))
    n_cells = tuple(float(n) * (1 + perturb.get("N_percent", 0.0) / 100) for n in base.n_cells)
    return dataclasses.replace(setup, n_cells=n_cells, fluence=base.fluence * perturb.get("scale_factor", 1.0))


def observed_counts(spec: PointSpec, truth: Setup, store: Path, job: FitJob) -> tuple[np.ndarray, np.ndarray, float]:
    """A shot's observed counts in photons, its usable pixels and its readout noise in photons: its
    detector image from the batch store, or its noise-free image read out with Poisson noise (philox,
    seeded by the fit's seed and the shot's name)."""
    import torch

    from ..io.observed import SMV_SATURATION_ADU, ObservedImage, read_observed

    if job.detector:
        observed = read_observed(f"{store}#{spec.name}", shape=tuple(truth.shape))
        response = spec.config.response
    else:
        from ..detector import detector_image, layout_of

        noise = keyed_generator(job.settings["seed"], f"{job.scenario}/{spec.name}", "noise")
        noise_seed = int(noise.integers(1, 2**31 - 1))
        response = dataclasses.replace(spec.config.response, poisson=True, generator="philox", noise_seed=noise_seed)
        image = read_observed(f"{store}#{spec.name}", shape=tuple(truth.shape))
        adu = detector_image(torch.as_tensor(image.counts), response, layout_of(truth)).adu.cpu().numpy()
        observed = ObservedImage(spec.name, adu.astype(np.float64) - response.adc_offset_adu, response.adc_offset_adu,
                                 response.gain_adu_per_photon or 1.0, SMV_SATURATION_ADU)
    usable = ~observed.unusable()
    if truth.mask is not None:
        usable &= truth.mask.astype(bool)
    gain = observed.gain_adu_per_photon or 1.0
    return observed.counts / gain, usable, response.readout_noise_adu / gain


CELL_NAMES = (("a_A", "Å"), ("b_A", "Å"), ("c_A", "Å"), ("alpha_deg", "°"), ("beta_deg", "°"), ("gamma_deg", "°"))


def _rotation_from_a_matrix(a_matrix: Sequence[Sequence[float]], cell: Sequence[float]) -> np.ndarray:
    """The orientation U of an A matrix (rows a*, b*, c*) of the given cell."""
    import torch

    from ..fit.parameters import starting_rotation

    real = torch.linalg.inv(torch.tensor(a_matrix, dtype=torch.float64)).T
    return starting_rotation(torch.tensor(cell, dtype=torch.float64), real).numpy()


def _rotation_offset_deg(rotation: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The rotation vector (degrees, lab frame) taking `reference` to `rotation`."""
    from scipy.spatial.transform import Rotation

    return np.degrees(Rotation.from_matrix(rotation @ reference.T).as_rotvec())


def shot_rows(truth: Setup, start: Setup, shot: Mapping[str, Any], sigma: Mapping[str, Sequence[float]],
              refine: Sequence[str], fixed_angles: Sequence[int] = ()) -> list[dict[str, Any]]:
    """One row per refined parameter of one fitted shot: true, start and refined values, refined − true
    (`error`), start − true (`start_error`) and the fit's standard error (`sigma`; `sigma` as
    nbsim.fit.output.standard_errors gives it for the shot). The orientation is the rotation vector from the
    true orientation (so its true value is 0) and `misorientation_deg` its length; the scale is the fluence
    relative to the truth's."""
    rows: list[dict[str, Any]] = []

    def row(name: str, unit: str, true: float, begin: float, refined: float, error_sigma: float | None) -> None:
        error = refined - true
        rows.append({"parameter": name, "unit": unit, "true": true, "start": begin, "refined": refined,
                     "error": error, "start_error": begin - true, "sigma": error_sigma,
                     "error_over_sigma": error / error_sigma if error_sigma else None})

    if "orientation" in refine:
        true_u = true_rotation(truth)
        begin = _rotation_offset_deg(true_rotation(start), true_u)
        refined = _rotation_offset_deg(_rotation_from_a_matrix(shot["A_matrix"], shot["cell"]), true_u)
        for axis, first, last, error_sigma in zip("xyz", begin, refined, sigma["orientation_deg"], strict=True):
            row(f"orientation_{axis}_deg", "°", 0.0, float(first), float(last), error_sigma)
        row("misorientation_deg", "°", 0.0, float(np.linalg.norm(begin)), float(np.linalg.norm(refined)), None)
    if "cell" in refine:
        true_cell, start_cell = truth.lattice.cell_parameters(), start.lattice.cell_parameters()
        for position, ((name, unit), true, first, last, error_sigma) in enumerate(
                zip(CELL_NAMES, true_cell, start_cell, shot["cell"], sigma["cell"], strict=True)):
            if position not in fixed_angles:
                row(name, unit, float(true), float(first), float(last), error_sigma)
    if "N" in refine:
        for axis, true, first, last, error_sigma in zip("abc", truth.n_cells, start.n_cells, shot["N"], sigma["N"],
                                                         strict=True):
            row(f"N{axis}", "cells", float(true), float(first), float(last), error_sigma)
    if "scale" in refine:
        ratio = start.fluence / truth.fluence
        row("scale", "× true fluence", 1.0, ratio, shot["scale"] * ratio, sigma["scale"][0] * ratio)
    if "mosaic" in refine:
        row("mosaic_spread_deg", "°", float(truth.config.crystal.mosaic_spread_deg or 0.0),
            float(start.config.crystal.mosaic_spread_deg or 0.0), shot["mosaic_spread_deg"],
            sigma["mosaic_spread_deg"][0])
    if "distance" in refine:
        row("distance_mm", "mm", float(truth.geometry.distance_m) * 1e3, float(start.geometry.distance_m) * 1e3,
            shot["distance_mm"], sigma["distance_mm"][0])
    if "beam" in refine:
        for index, axis in enumerate("xy"):
            row(f"beam_{axis}_mm", "mm", float(getattr(truth.geometry, f"beam_{axis}_m")) * 1e3,
                float(getattr(start.geometry, f"beam_{axis}_m")) * 1e3, shot[f"beam_{axis}_mm"],
                sigma["beam_mm"][index])
    if "wavelength" in refine:
        row("wavelength_A", "Å", float(truth.config.beam.wavelength_A), float(start.config.beam.wavelength_A),
            shot["wavelength_A"], sigma["wavelength_A"][0])
    return rows


def fit_options(settings: Mapping[str, Any], readout_photons: float):
    """The `fit:` block as nbsim.fit's FitOptions."""
    import torch

    from ..fit.refine import FitOptions

    return FitOptions(refine=tuple(settings["refine"]), shared=tuple(settings["shared"]), lattice=settings["lattice"],
                      shoebox_px=settings["shoebox_px"], max_spots=settings["max_spots"],
                      background=settings["background"], likelihood=settings["likelihood"],
                      readout_photons=readout_photons, max_iterations=settings["max_iterations"],
                      search_deg=settings["search_deg"],
                      dtype=torch.float64 if settings["dtype"] == "float64" else torch.float32)


def run_fit_job(job: FitJob, store: Path, output: Path) -> dict:
    """Fit a chunk of a batch's shots (each alone, or all together when quantities are shared) and write
    their outcomes and rows (`shot_rows`) as one JSON, once all are done. A shot whose fit cannot start
    (an input error) is recorded as failed with its reason; a fit that does not converge keeps its rows
    with `converged: false` and the reason."""
    import torch

    from ..fit.output import fit_json, standard_errors
    from ..fit.refine import FitImage, fit
    from ..resolve import resolve
    from .jobs import _job_identity

    torch.set_num_threads(max(1, job.settings["threads"]))
    started = time.perf_counter()
    groups = [list(job.points)] if job.settings["shared"] else [[point] for point in job.points]
    progress = Progress(len(job.points), f"{job.scenario} {job.batch} {job.chunk} fits")
    shots = []
    for group in groups:
        prepared, failures = [], []
        for spec in group:
            try:
                truth = resolve(spec.config)
                start = perturbed_start(spec, truth, job.settings, job.scenario)
                counts, usable, readout = observed_counts(spec, truth, store, job)
                prepared.append((spec, truth, start, FitImage(spec.name, start, counts, usable), readout))
            except NbsimError as error:
                failures.append({"point": spec.name, "axes": dict(spec.axes), "status": "failed", "reason": str(error)})
        shots += failures
        if not prepared:
            progress.advance(len(group))
            continue
        try:
            result = fit([p[3] for p in prepared], fit_options(job.settings, prepared[0][4]))
        except NbsimError as error:
            shots += [{"point": p[0].name, "axes": dict(p[0].axes), "status": "failed", "reason": str(error)}
                      for p in prepared]
            progress.advance(len(group))
            continue
        document = fit_json(result, [list(p[0].argv) for p in prepared])
        for index, ((spec, truth, start, _, _), shot) in enumerate(zip(prepared, document["shots"], strict=True)):
            fixed = [position for position, tie in enumerate(result.model.systems[index].tied) if tie < 0]
            rows = shot_rows(truth, start, shot, standard_errors(result, index), result.model.refine, fixed)
            shots.append({"point": spec.name, "axes": dict(spec.axes), "status": "ok",
                          "converged": document["converged"], "reason": document["reason"],
                          "iterations": document["iterations"], "seconds": document["seconds"],
                          "pixels": shot["pixels"], "shoeboxes": shot["shoeboxes"], "start": start_values(start),
                          "fit": shot, "rows": rows})
        progress.advance(len(group))
    record = {"scenario": job.scenario, "batch": job.batch, "chunk": job.chunk, "settings": dict(job.settings),
              "wall_s": time.perf_counter() - started, **_job_identity(), "shots": shots}
    write_json(output, record)
    return record


def start_values(start: Setup) -> dict[str, Any]:
    """What a shot's fit started from: cell, orientation (nanoBragg's -misset angles), N and fluence."""
    import torch

    from ..fit.output import misset_deg

    return {"cell": list(start.lattice.cell_parameters()),
            "misset_deg": misset_deg(torch.as_tensor(true_rotation(start))),
            "N": [float(n) for n in start.n_cells], "fluence_photons_per_m2": float(start.fluence),
            "mosaic_spread_deg": start.config.crystal.mosaic_spread_deg,
            "distance_mm": float(start.geometry.distance_m) * 1e3, "beam_x_mm": float(start.geometry.beam_x_m) * 1e3,
            "beam_y_mm": float(start.geometry.beam_y_m) * 1e3, "wavelength_A": float(start.config.beam.wavelength_A)}


FIT_COLUMNS = ("parameter", "unit", "true", "start", "refined", "error", "start_error", "sigma", "error_over_sigma",
               "converged", "reason", "iterations", "seconds", "pixels", "batch", "chunk")
"""The columns of tables/fit.csv after the point, its axes and its status."""
FIT_VARIABLES = ("true", "start", "refined", "error", "start_error", "sigma")
"""Row values kept in sweep.zarr as `fit_<name>` over the sweep's axes and `fit_parameter`."""
SHOT_VARIABLES = ("converged", "iterations", "seconds", "pixels")
"""Per-shot values kept in sweep.zarr as `fit_<name>` over the sweep's axes."""


def fit_rows(records: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per shot and refined parameter from the fit jobs' JSON (a failed shot: one row, its reason)."""
    from .store import read_json

    rows = []
    for path in records:
        record = read_json(path)
        for shot in record["shots"]:
            base = {"point": shot["point"], **shot["axes"], "status": shot["status"], "batch": record["batch"],
                    "chunk": record["chunk"], **{key: shot.get(key) for key in ("reason", *SHOT_VARIABLES)}}
            rows += [{**base, **row} for row in shot.get("rows") or [{}]]
    return rows


def write_fit_variables(store, rows: list[dict[str, Any]], grid, axes: Sequence[str]) -> None:
    """`fit_<value>` (axes, fit_parameter) and per-shot `fit_<value>` (axes) in a collated store, aligned with
    `grid` (the sweep's rows gridded over the axes: NaN where a point has no fit)."""
    import pandas as pd
    import xarray as xr

    fitted = [row for row in rows if row["status"] == "ok"]
    if not fitted:
        return
    parameters = list(dict.fromkeys(row["parameter"] for row in fitted))
    store.coordinate("fit_parameter", parameters)
    frame = pd.DataFrame(fitted)
    frame["converged"] = frame["converged"].astype(float)
    align = {axis: grid[axis].values for axis in axes}
    per_parameter = xr.Dataset.from_dataframe(frame.set_index([*axes, "parameter"])[list(FIT_VARIABLES)])
    per_parameter = per_parameter.reindex({**align, "parameter": parameters})
    shape = (*(len(grid[axis]) for axis in axes), len(parameters))
    for name in FIT_VARIABLES:
        store.variable(f"fit_{name}", (*axes, "fit_parameter"), shape, np.float64,
                       data=per_parameter[name].values.astype(np.float64))
    shots = frame.drop_duplicates("point").set_index(list(axes))[list(SHOT_VARIABLES)]
    per_shot = xr.Dataset.from_dataframe(shots).reindex(align)
    for name in SHOT_VARIABLES:
        store.variable(f"fit_{name}", tuple(axes), shape[:-1], np.float64,
                       data=per_shot[name].values.astype(np.float64))
