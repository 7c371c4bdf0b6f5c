"""nbsim merge: the asymmetric unit and its P1 table, the restraints, the MTZ, |F| recovered from stills
(noiseless and Poisson), anomalous differences, two gloo workers against one, and the command line."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.connection
import os

import gemmi
import numpy as np
import pytest
import scipy.optimize
import torch

import nbsim
from nbsim.cli import main
from nbsim.fit.likelihood import negative_log_likelihood
from nbsim.fit.model import DiffractionModel, with_oversample
from nbsim.fit.parameters import misorientation_deg
from nbsim.fit.refine import FitOptions
from nbsim.io.structure_files import expand_to_p1_sphere, read_reflection_file, write_hkl
from nbsim.merge import (
    Merge,
    MergeJob,
    MergeOptions,
    Restraints,
    StructureFactorModel,
    asymmetric_unit,
    launch,
    write_mtz,
)
from nbsim.merge import refine as merge_refine
from nbsim.merge.distributed import all_sum
from nbsim.merge.reflections import correlation, lattice_system_of, node_parameters, space_group
from nbsim.model.structure_factors import build_grid
from nbsim.resolve import resolve

CELL = (20.0, 24.0, 28.0, 90.0, 90.0, 90.0)
GROUP = "P 21 21 21"
FLAGS = ("-cell 20 24 28 90 90 90 -N 10 -lambda 1 -distance 14 -detpixels 64 -pixel 0.1 -nointerpolate "
         "-fluence 1e27 -oversample 1").split()
SHOT_OPTIONS = dict(shoebox_px=5, max_spots=40)


def _unique(d_min_A: float = 2.0) -> np.ndarray:
    return np.asarray(gemmi.make_miller_array(gemmi.UnitCell(*CELL), gemmi.SpaceGroup(GROUP), d_min_A, 0, True),
                      np.int64)


def _stills(folder, table: str, count: int, poisson: bool, seed: int = 3,
            prefix: str = "shot") -> dict[str, list[float]]:
    """`count` stills of the P1 table at random orientations (raw float photons, or Poisson counts)."""
    rng = np.random.default_rng(seed)
    missets = {}
    for index in range(count):
        misset = rng.uniform(-180, 180, 3).round(3).tolist()
        config = nbsim.config_from_args([*FLAGS, "-hkl", table, "-misset", *map(str, misset)])
        with torch.no_grad():
            image = nbsim.simulate(config).double().numpy()
        if poisson:
            image = rng.poisson(image).astype(np.float64)
        path = folder / f"{prefix}{index}.bin"
        image.astype(np.float32).tofile(path)
        missets[str(path)] = misset
    return missets


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A truth (random |F|, with anomalous differences), a start far from it (CC about 0.5, none), stills."""
    folder = tmp_path_factory.mktemp("merge")
    miller = _unique()
    group = gemmi.SpaceGroup(GROUP)
    rng = np.random.default_rng(1)
    truth = rng.rayleigh(100, len(miller)) + 5
    centric = np.asarray(group.operations().centric_flag_array(miller.astype(np.int32)), bool)
    truth_minus = np.where(centric, truth, truth * (1 + 0.15 * rng.standard_normal(len(miller))).clip(0.5))
    start = truth * np.exp(0.6 * rng.standard_normal(len(miller)))
    write_hkl(folder / "truth.hkl", expand_to_p1_sphere(miller, truth, None, group))
    write_hkl(folder / "truth_anomalous.hkl", expand_to_p1_sphere(miller, truth, truth_minus, group))
    write_hkl(folder / "start.hkl", expand_to_p1_sphere(miller, start, None, group))
    near = truth * np.exp(0.05 * rng.standard_normal(len(miller)))
    write_hkl(folder / "near.hkl", expand_to_p1_sphere(miller, near, None, group))
    return {"folder": folder, "miller": miller, "truth": truth, "start": start,
            "stills": _stills(folder, str(folder / "truth.hkl"), 4, poisson=False),
            "anomalous_stills": _stills(folder, str(folder / "truth_anomalous.hkl"), 6, poisson=True, seed=5,
                                                prefix="anomalous")}


def _job(data, stills: dict, refine=(), anomalous: bool = False, truth: str = "truth.hkl", cycles: int = 1,
         start_file: str = "start.hkl", **options) -> MergeJob:
    folder = data["folder"]
    start = str(folder / start_file)
    shots = tuple((name, (*FLAGS, "-hkl", start, "-misset", *map(str, misset))) for name, misset in stills.items())
    merge_options = MergeOptions(shots=FitOptions(refine=tuple(refine), **SHOT_OPTIONS), cycles=cycles, **options)
    return MergeJob(shots=shots, hkl=start, column=None, space_group=GROUP, cell_A_deg=CELL, default_F=0.0,
                    anomalous=anomalous, options=merge_options, truth=str(folder / truth))


def assert_parameters_rebuild_table(p1_table: np.ndarray, reflections, values) -> None:
    """The merge's parameters at `values` (its asymmetric unit `reflections` of `p1_table`) reach every node of
    the P1 table's grid and rebuild it exactly."""
    grid = build_grid(p1_table, 0.0)
    nodes = torch.as_tensor(node_parameters(reflections, grid))
    model = StructureFactorModel(reflections, values, Restraints())
    base = torch.as_tensor(grid.padded(0.0).reshape(-1))
    rebuilt = model.table(model.log_start, torch.zeros_like(base), nodes)
    assert (nodes >= 0).sum() == len(p1_table)
    assert torch.allclose(rebuilt, base, rtol=1e-12)


def test_table_of_the_start_is_the_p1_table_nbsim_reads():
    """Every node the asymmetric unit reaches holds the |F| nbsim's reader puts there, F(+) and F(−) apart."""
    miller = _unique(3.0)
    group = space_group(GROUP)
    rng = np.random.default_rng(0)
    plus, minus = rng.uniform(10, 100, len(miller)), rng.uniform(10, 100, len(miller))
    p1 = expand_to_p1_sphere(miller, plus, minus, group)
    reflections, start = asymmetric_unit(p1, group, CELL, anomalous=True, what="test")
    assert_parameters_rebuild_table(p1, reflections, start)
    assert reflections.size > len(miller)  # acentric F(-) refined apart
    unpaired, _ = asymmetric_unit(p1, group, CELL, anomalous=False, what="test")
    assert unpaired.size == len(miller)


def test_restraint_curvature_is_the_hessian_diagonal():
    miller = _unique(3.0)
    group = space_group(GROUP)
    p1 = expand_to_p1_sphere(miller, np.linspace(10, 90, len(miller)), None, group)
    reflections, start = asymmetric_unit(p1, group, CELL, anomalous=True, what="test")
    model = StructureFactorModel(reflections, start, Restraints(start=0.5, shell=0.3, friedel=0.2, shells=3))
    point = model.log_start + 0.1 * torch.randn(model.size, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(0))
    hessian = torch.autograd.functional.hessian(model.penalty, point)
    assert torch.allclose(torch.diagonal(hessian), model.curvature(), rtol=1e-10)


@pytest.mark.parametrize("group, system", [("P 21 21 21", "orthorhombic"), ("P 61", "hexagonal"), ("P 3", "hexagonal"),
                                           ("R 3", "hexagonal"), ("R 3:R", "rhombohedral"), ("C 1 2 1", "monoclinic"),
                                           ("P 1 1 21", "triclinic"), ("I 4", "tetragonal"), ("P 2 3", "cubic")])
def test_shots_refine_the_cell_within_the_space_groups_lattice(group, system):
    assert lattice_system_of(space_group(group)) == system


def test_space_group_the_cell_contradicts():
    p1 = expand_to_p1_sphere(_unique(4.0), np.ones(len(_unique(4.0))), None, space_group(GROUP))
    with pytest.raises(nbsim.NbsimError, match="contradicts space group P 61"):
        asymmetric_unit(p1, space_group("P 61"), CELL, anomalous=False, what="start")


def test_mtz_holds_the_asymmetric_unit_with_ccp4_columns(tmp_path):
    miller = _unique(3.0)
    group = space_group(GROUP)
    values = np.linspace(10, 90, len(miller))
    p1 = expand_to_p1_sphere(miller, values, values * 1.1, group)
    for anomalous, labels in ((False, ["FP", "SIGFP"]), (True, ["F(+)", "SIGF(+)", "F(-)", "SIGF(-)"])):
        reflections, start = asymmetric_unit(p1, group, CELL, anomalous, "test")
        path = tmp_path / f"out{anomalous}.mtz"
        write_mtz(str(path), reflections, start, 0.1 * start)
        mtz = gemmi.read_mtz_file(str(path))
        assert [c.label for c in mtz.columns][3:] == labels
        assert mtz.spacegroup.hm == GROUP and mtz.cell.parameters == pytest.approx(CELL)
        back = read_reflection_file(path)
        assert len(back.reflections) == len(p1) if anomalous else len(back.reflections) > 0


def _whole_still_merge(data) -> Merge:
    """A merge of one anomalous still whose every pixel is fitted, sampled with 2×2 sub-pixels, a scale and a
    background of its own: the F step's input without a shot step."""
    name = next(iter(data["anomalous_stills"]))
    merge = Merge(_job(data, {name: data["anomalous_stills"][name]}, anomalous=True, truth="truth_anomalous.hkl"))
    shot = merge.shots[0]
    shot.rows, shot.cols = (a.ravel() for a in np.divmod(np.arange(64 * 64), 64))
    shot.setup = with_oversample(dataclasses.replace(shot.setup, grid=merge.current_grid()), 2)
    shot.scale = 1.7
    shot.background = torch.linspace(0.0, 3.0, 64 * 64, dtype=torch.float64)
    shot.document = {"scale": shot.scale, "flags": []}
    return merge


def test_design_matrix_is_the_kernels_render(data):
    """The F step's sparse linear model (nbsim.merge.design) gives the kernel's photons at every pixel of an
    anomalous still sampled with 2×2 sub-pixels (pixels whose sub-pixels see two nodes, F(+) and F(−) apart) to
    1e-10 relative in float64, and the likelihood's gradient in log|F| autograd gives through the kernel."""
    merge = _whole_still_merge(data)
    shot = merge.shots[0]
    noise = torch.randn(merge.model.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    log_F = merge.log_F + 0.3 * noise
    design = merge._design()
    _, _, signal = design.state(log_F)
    model = DiffractionModel([shot.setup], [(shot.rows, shot.cols)], (), dtype=torch.float64, compile=False)
    model.set_start(0, "scale", [shot.scale])
    x = log_F.clone().requires_grad_(True)
    model.tables[0] = model.tables[0]._replace(grid=merge.table(x))
    photons = model.render(0, model.natural()[0])
    assert torch.max(torch.abs(signal - photons.detach()) / photons.detach().abs().max()) <= 1e-10
    seen = torch.bincount(design.pixel, minlength=64 * 64)
    assert (seen >= 2).sum() > 100
    plus, minus = merge.reflections.friedel_pairs()
    assert all(torch.isin(design.parameter, torch.as_tensor(half)).any() for half in (plus, minus))
    counts = torch.as_tensor(shot.image.counts[shot.rows, shot.cols], dtype=torch.float64)
    nll = negative_log_likelihood(photons + shot.background, counts, 0.0)
    value, gradient, _ = design.likelihood(log_F)
    assert float(value) == pytest.approx(float(nll.detach()), rel=1e-12)
    assert torch.allclose(gradient, torch.autograd.grad(nll, x)[0], rtol=1e-8, atol=1e-8 * float(gradient.abs().max()))


def test_an_F_step_that_ends_worse_than_it_began_is_undone(data, monkeypatch):
    """The F step lowers the objective; one whose optimiser ends above where the step began (L-BFGS made to
    return a point far off) keeps the |F| and scale it began with, and its record says so."""
    merge = _whole_still_merge(data)
    record = merge.refine_F()
    assert record["objective"] < record["objective_before_F"] and not record["f_step_undone"]
    log_F, scale = merge.log_F.clone(), merge.shots[0].scale

    def far_off(function, start, **options):
        point = start + 5.0
        return scipy.optimize.OptimizeResult(x=point, fun=function(point)[0], nit=1)

    monkeypatch.setattr(merge_refine.scipy.optimize, "minimize", far_off)
    record = merge.refine_F()
    assert record["f_step_undone"] and record["objective"] == record["objective_before_F"]
    assert torch.equal(merge.log_F, log_F) and merge.shots[0].scale == scale


@pytest.mark.slow
def test_shots_refined_together_equal_shots_refined_one_by_one(data, monkeypatch):
    """The shot step refines every shot in one call of nbsim.fit.fit (Fisher scoring, one block a shot): each
    shot's refined orientation, cell, N and scale are those of its own fit (starts 0.05° and 0.3 % off)."""
    stills = dict(list(data["stills"].items())[:2])
    rng = np.random.default_rng(2)
    shots = tuple((name, (*FLAGS, "-hkl", str(data["folder"] / "near.hkl"),
                          "-misset", *map(str, np.asarray(misset) + 0.05 * rng.standard_normal(3)),
                          "-cell", "20.06", "23.93", "28.08", "90", "90", "90")) for name, misset in stills.items())
    options = MergeOptions(shots=FitOptions(refine=("orientation", "cell", "N", "scale"), search_deg=0.0,
                                            **SHOT_OPTIONS), scale_cycles=0)
    job = MergeJob(shots=shots, hkl=str(data["folder"] / "near.hkl"), column=None, space_group=GROUP,
                   cell_A_deg=CELL, default_F=0.0, anomalous=False, options=options)
    refined = {}
    for width in (len(shots), 1):
        monkeypatch.setattr(merge_refine, "SHOTS_PER_FIT", width)
        merge = Merge(job)
        merge.refine_shots(0)
        assert [s.document["refined_with"] for s in merge.shots] == [width] * len(shots)
        refined[width] = [(s.values, s.scale) for s in merge.shots]
    for (together, scale_together), (alone, scale_alone) in zip(refined[len(shots)], refined[1], strict=True):
        assert scale_together == pytest.approx(scale_alone, rel=1e-6)
        for name in ("orientation", "cell", "N"):
            assert np.allclose(together[name], alone[name], rtol=1e-6, atol=1e-9), name
    assert not np.allclose(refined[1][0][0]["orientation"], 0.0, atol=1e-5)  # the fits moved the shots


@pytest.mark.slow
def test_F_recovered_from_noiseless_stills(data):
    """From a start of CC about 0.5, the measured |F| of noiseless stills reach CC ≥ 0.99 with the truth. Each
    cycle's record says the data's own signal (mean |F|/σ by shell, and the resolution where it falls below
    RESOLUTION_F_OVER_SIGMA); the measured |F| are those the pixels would measure to σ(log|F|) ≤ 0.25 at their
    shell's mean intensity; a cycle's median change in standard errors decides convergence."""
    merge = Merge(_job(data, data["stills"], cycles=2))
    records = []
    result = merge.run(records.append)
    assert records[0]["cc"] < 0.7
    truth = merge.truth
    precise = result.measured & (result.amplitudes >= 5 * result.sigmas)
    assert precise.sum() > 50
    assert correlation(result.amplitudes[precise], truth[precise]) >= 0.99
    assert (merge.reference_information().numpy()[result.measured] >= merge_refine.MEASURED_INFORMATION).all()
    last = records[-1]
    assert sum(last["measured_by_shell"]) == result.measured.sum()
    with np.errstate(divide="ignore"):
        f_over_sigma = result.amplitudes / result.sigmas
    shell = merge.report_shells()
    assert last["f_over_sigma_by_shell"] == pytest.approx(
        [f_over_sigma[result.measured & (shell == index)].mean() for index in range(merge.options.shells)])
    leading = []
    for limit, mean in zip(last["shell_d_min_A"], last["f_over_sigma_by_shell"], strict=True):
        if not mean >= merge_refine.RESOLUTION_F_OVER_SIGMA:
            break
        leading.append(limit)
    assert last["resolution_A"] == (leading[-1] if leading else None)
    assert last["median_change_sigmas"] > 0
    assert merge.converged([{"cycle": 2, "median_change_sigmas": 0.05}])
    assert not merge.converged([{"cycle": 2, "median_change_sigmas": 0.5}])
    assert not merge.converged([{"cycle": 1, "median_change_sigmas": 0.0}])  # a scale-only cycle never stops it


@pytest.mark.slow
def test_anomalous_differences_recovered_from_poisson_stills(data):
    """Started without anomalous differences, F(+) − F(−) of Poisson stills correlate with the truth's."""
    merge = Merge(_job(data, data["anomalous_stills"], anomalous=True, truth="truth_anomalous.hkl", cycles=2))
    result = merge.run()
    differences = result.amplitudes[merge.reflections.friedel_pairs()[0]] - \
        result.amplitudes[merge.reflections.friedel_pairs()[1]]
    truth = merge.truth[merge.reflections.friedel_pairs()[0]] - merge.truth[merge.reflections.friedel_pairs()[1]]
    plus, minus = merge.reflections.friedel_pairs()
    precise = result.measured & (result.amplitudes >= 5 * result.sigmas)
    both = precise[plus] & precise[minus]
    assert both.sum() > 20
    assert correlation(differences[both], truth[both]) > 0.5


@pytest.mark.slow
def test_F_and_shots_from_poor_starts_converge_together(data):
    """From |F| at CC about 0.5 and every shot's start 0.1° and 0.5 % off: the first cycle refines only the shots'
    scales (their geometry stays at the start while F is poor), the next one everything, with one cell for all;
    CC rises every cycle (docs/merging.md measures 20 shots to CC 0.99)."""
    rng = np.random.default_rng(7)
    start = str(data["folder"] / "start.hkl")
    shots, start_cells = [], []
    for name, misset in data["stills"].items():
        direction = rng.standard_normal(3)
        misset_off = np.asarray(misset) + 0.1 * direction / np.linalg.norm(direction)
        start_cells.append(np.asarray(CELL[:3]) * (1 + 0.005 * rng.choice([-1, 1], 3)))
        shots.append((name, (*FLAGS, "-hkl", start, "-misset", *map(str, misset_off),
                             "-cell", *map(str, start_cells[-1]), "90", "90", "90")))
    options = MergeOptions(shots=FitOptions(refine=("orientation", "cell", "N", "scale"), search_deg=0.0,
                                            shoebox_px=5, max_spots=20), cycles=2, shared=("cell",), convergence=0.0)
    merge = Merge(MergeJob(shots=tuple(shots), hkl=start, column=None, space_group=GROUP, cell_A_deg=CELL,
                           default_F=0.0, anomalous=False, options=options, truth=str(data["folder"] / "truth.hkl")))
    records, geometry = [], []
    result = merge.run(lambda record: (records.append(record),
                                       geometry.append([(s.values or {}).get("orientation") for s in merge.shots])))
    assert np.max(np.abs(geometry[1])) < 1e-12  # cycle 1: the scales only (no rotation from the start)
    scores = [record["cc"] for record in records]
    assert all(later > earlier for earlier, later in zip(scores, scores[1:], strict=False)), scores
    assert scores[-1] >= 0.8, scores
    cells = np.array([document["cell"] for document in result.shots])
    assert np.allclose(cells, cells[0], rtol=1e-12)  # one cell for every shot
    assert not np.allclose(cells[0, :3], np.mean(start_cells, axis=0), rtol=1e-4)  # refined, not the starts' mean


def _two_stills_job(data, solve: str, cycles: int, off_deg: float = 0.0, off_percent: float = 0.0,
                    **options) -> MergeJob:
    """Two noiseless stills from |F| 5 % off the truth and each shot's start `off_deg` about a random axis and
    `off_percent` in each cell length (random signs) off its truth, refining orientation, one shared cell, N and
    scale."""
    rng = np.random.default_rng(7)
    start = str(data["folder"] / "near.hkl")
    shots = []
    for name, misset in list(data["stills"].items())[:2]:
        axis = rng.standard_normal(3)
        cell = np.asarray(CELL[:3]) * (1 + off_percent / 100 * rng.choice([-1, 1], 3))
        shots.append((name, (*FLAGS, "-hkl", start, "-misset",
                             *map(str, np.asarray(misset) + off_deg * axis / np.linalg.norm(axis)),
                             "-cell", *map(str, cell), "90", "90", "90")))
    shot_options = FitOptions(refine=("orientation", "cell", "N", "scale"), search_deg=0.0, shoebox_px=5, max_spots=20)
    merge_options = MergeOptions(shots=shot_options, cycles=cycles, shared=("cell",), convergence=0.0, solve=solve,
                                 **options)
    return MergeJob(shots=tuple(shots), hkl=start, column=None, space_group=GROUP, cell_A_deg=CELL, default_F=0.0,
                    anomalous=False, options=merge_options, truth=str(data["folder"] / "truth.hkl"))


@pytest.mark.slow
def test_the_joint_solve_reaches_the_F_and_shots_the_cycles_reach(data):
    """--solve joint (a scale-only cycle, then one shot step and one L-BFGS on log|F| with every shot's orientation,
    N, scale and the shared cell) ends where two macro-cycles end (the second changed the measured |F| by 0.1 of
    their standard errors, the median) on noiseless stills, whose optimum, the truth, both approach: |F| within
    1 % of each other (0.15 % measured; both 2 % off the truth, the scale gauge the start sets), every shot's
    orientation within 0.002° (0.0004°), cell within 5·10⁻⁵ (1·10⁻⁵), N within 0.2 % (0.04 %) and scale within
    1 % (2·10⁻⁵). The joint cycle is the merge's last; its record says so and that it lowered the objective;
    each shot's JSON holds the joint solve's model (its flags re-render it)."""
    results, records = {}, {}
    for solve, cycles in (("joint", 2), ("cycles", 2)):
        merge = Merge(_two_stills_job(data, solve, cycles))
        records[solve] = []
        results[solve] = merge.run(records[solve].append)
    joint, cycles = results["joint"], results["cycles"]
    last = records["joint"][-1]
    assert [record["cycle"] for record in records["joint"]] == [0, 1, 2] and last["solve"] == "joint"
    assert last["objective"] < last["objective_before_F"] and not last["f_step_undone"]
    assert last["joint_coordinates"] == 2 * 6 + 3  # per shot: orientation and N; the shared cell's three lengths
    both = joint.measured & cycles.measured
    assert both.sum() >= 25 and correlation(joint.amplitudes[both], merge.truth[both]) >= 0.9999
    assert np.max(np.abs(joint.amplitudes[both] / cycles.amplitudes[both] - 1)) <= 0.01
    for ours, theirs in zip(joint.shots, cycles.shots, strict=True):
        assert ours["solved_jointly"] and "solved_jointly" not in theirs
        assert misorientation_deg(np.asarray(ours["A_matrix"]), np.asarray(theirs["A_matrix"])) <= 0.002
        assert np.allclose(ours["cell"], theirs["cell"], rtol=5e-5)
        assert np.allclose(ours["N"], theirs["N"], rtol=2e-3)
        assert ours["scale"] == pytest.approx(theirs["scale"], rel=0.01)
        flags = ours["flags"]
        assert [float(v) for v in flags[flags.index("-cell") + 1:flags.index("-cell") + 4]] == \
            pytest.approx(ours["cell"][:3], rel=1e-9)
        assert float(flags[flags.index("-fluence") + 1]) == pytest.approx(1e27 * ours["scale"], rel=1e-9)


def _save_amplitudes_and_joint_objective(job: MergeJob, joint_job: MergeJob, path: str) -> None:
    """A worker's merge (`job`), then `joint_job`'s first shot step and its joint solve's objective and gradient at
    a point off its start (every variable 0.3 of a standard error; the solve itself is not run); the first worker
    saves |F| (float64), the objective and the gradient."""
    amplitudes = Merge(job).run().amplitudes
    merge = Merge(joint_job)
    merge.refine_shots(0)
    found = {}

    def evaluate_once(value_and_gradient, size, lowest, highest):
        found["value"], found["gradient"] = value_and_gradient(np.full(size, 0.3))
        return scipy.optimize.OptimizeResult(x=np.zeros(size), fun=value_and_gradient(np.zeros(size))[0], nit=0)

    merge.minimise = evaluate_once
    merge.solve_jointly()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        np.savez(path, amplitudes=amplitudes, **found)


@pytest.mark.slow
def test_two_gloo_workers_give_the_F_of_one(data, tmp_path):
    """The F step's sums all-reduced over two processes (gloo) reach the F one process does (1e-6 relative); a
    weak restraint towards the start gives the |F| that only far tails see (flat in log|F|) one optimum. The
    joint solve's objective and its gradient in every variable (log|F|, scales, each shot's and the shared
    coordinates), all-reduced, are one process's to 1e-9 relative (the joint solve's end is not compared: on a
    likelihood the nearest-node lookup makes rough in the shots' coordinates, its line search stops where
    rounding leads it, 0.7 % apart in |F| here)."""
    stills = dict(list(data["stills"].items())[:2])
    job = _job(data, stills, start_file="near.hkl", gradient_tolerance=1e-8, change_tolerance=1e-15,
               restraints=Restraints(start=1.0))
    joint_job = _two_stills_job(data, "joint", cycles=1, off_deg=0.1, off_percent=0.5, scale_cycles=0)
    for workers, name in ((1, "one.npz"), (2, "two.npz")):
        launch(_save_amplitudes_and_joint_objective, (job, joint_job, str(tmp_path / name)), workers=workers,
               device="cpu")
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    table = read_reflection_file(data["folder"] / "near.hkl").reflections
    _, start = asymmetric_unit(table, space_group(GROUP), CELL, False, "start")
    ones, twos = one["amplitudes"], two["amplitudes"]
    assert not np.allclose(ones, start, rtol=1e-2)  # the F step moved F
    differences = np.abs(twos / ones - 1)
    worst = np.max(differences)
    assert worst <= 1e-6, f"largest relative difference {worst:.3g} at |F| {ones[np.argmax(differences)]:.4g}"
    assert float(two["value"]) == pytest.approx(float(one["value"]), rel=1e-12)
    assert np.all(one["gradient"][-(2 * 6 + 3):] != 0)  # each shot's orientation and N, the shared cell
    assert np.allclose(two["gradient"], one["gradient"], rtol=1e-9, atol=1e-9 * np.abs(one["gradient"]).max())


@pytest.mark.slow
def test_a_joint_solve_takes_shots_off_their_truth_to_it(data):
    """From shots 0.1° and 0.5 % off their noiseless stills' truth and |F| 5 % off, one joint solve (after a
    scale-only cycle) takes every shot to within 0.01° of its true orientation and the shared cell to 1.5·10⁻⁴ of
    the truth (0.005° and 6·10⁻⁵ measured; four macro-cycles from the same start leave a shot 0.09° off and the
    cell 0.26 %)."""
    result = Merge(_two_stills_job(data, "joint", cycles=2, off_deg=0.1, off_percent=0.5)).run()
    for (name, misset), shot in zip(list(data["stills"].items())[:2], result.shots, strict=True):
        truth = resolve(nbsim.config_from_args([*FLAGS, "-default_F", "1", "-misset", *map(str, misset)]))
        assert misorientation_deg(np.asarray(shot["A_matrix"]), truth.lattice.reciprocal_per_A) <= 0.01, name
        assert np.allclose(shot["cell"][:3], CELL[:3], rtol=1.5e-4), shot["cell"]


def _cli(data, tmp_path, *extra: str, starts: dict | None = None, shots: list[str] | None = None):
    folder = data["folder"]
    stills = dict(list(data["stills"].items())[:2])
    starts_path = tmp_path / "starts.json"
    starts_path.write_text(json.dumps({"images": starts or {name: {"misset": m} for name, m in stills.items()}}))
    return main(["merge", *(shots or list(stills)), "--starts", str(starts_path), "--hkl", str(folder / "start.mtz"),
                 "--mtz", str(tmp_path / "out.mtz"), "--json", str(tmp_path / "out.json"), *extra,
                 "--", *FLAGS])


@pytest.fixture(scope="module")
def start_mtz(data):
    """The start as an MTZ (FP, SIGFP; the space group and cell), and the truth as one."""
    group = space_group(GROUP)
    folder = data["folder"]
    for name, values in (("start", data["start"]), ("truth", data["truth"])):
        p1 = expand_to_p1_sphere(data["miller"], values, None, group)
        reflections, start = asymmetric_unit(p1, group, CELL, False, name)
        write_mtz(str(folder / f"{name}.mtz"), reflections, start, 0.1 * start)
    return data


@pytest.mark.slow
def test_cli_merge_writes_the_contract(start_mtz, tmp_path, capsys):
    status = _cli(start_mtz, tmp_path, "--refine", "scale", "--cycles", "1", "--truth",
                  str(start_mtz["folder"] / "truth.mtz"), "--shoebox", "5", "--spots", "40")
    assert status == 0
    out = capsys.readouterr().out
    assert "cycle 1" in out and "-logL" in out and "CC " in out
    mtz = gemmi.read_mtz_file(str(tmp_path / "out.mtz"))
    assert [c.label for c in mtz.columns][3:] == ["FP", "SIGFP"]
    assert mtz.spacegroup.hm == GROUP and mtz.cell.parameters == pytest.approx(CELL)
    document = json.loads((tmp_path / "out.json").read_text())
    assert [shot["image"] for shot in document["shots"]] == list(start_mtz["stills"])[:2]
    assert {"A_matrix", "cell", "N", "scale", "flags", "sigma"} <= set(document["shots"][0])


@pytest.mark.parametrize("case, message", [
    ("cells", "shots of different crystals"),
    ("column", "no column NOPE"),
    ("no_amplitudes", "no amplitude or intensity column"),
    ("truth_column", "no column NOPE"),
    ("group", "contradicts space group P 61"),
    ("shot_group", "contradicts space group P 21 21 21"),
    ("missing", "no such file"),
    ("report", "give --truth"),
    ("shot_restraint", "restraint on mosaic, which is not refined"),
    ("shared", "shares only the cell"),
    ("joint_cycles", "joint solve follows the scale-only cycles"),
    ("joint_restraint", "joint solve does not restrain the shots"),
])
def test_cli_merge_bad_input_is_one_line_and_writes_nothing(start_mtz, tmp_path, capsys, case, message):
    stills = list(start_mtz["stills"])[:2]
    starts = {name: {"misset": m} for name, m in list(start_mtz["stills"].items())[:2]}
    extra: list[str] = []
    shots = None
    if case == "cells":
        starts[stills[1]]["cell"] = [30, 36, 42, 90, 90, 90]
    elif case == "column":
        extra = ["--column", "NOPE"]
    elif case == "no_amplitudes":
        extra = ["--hkl", str(_phases_only_mtz(tmp_path / "phases.mtz"))]
    elif case == "truth_column":
        extra = ["--truth", str(start_mtz["folder"] / "truth.mtz"), "--truth-column", "NOPE"]
    elif case == "group":
        extra = ["--space_group", "P 61"]
    elif case == "shot_group":  # indexed as monoclinic: a shot of another space group
        starts[stills[1]]["cell"] = [20, 24, 28, 90, 91, 90]
    elif case == "report":
        extra = ["--report", str(tmp_path / "report.html")]
    elif case == "shot_restraint":
        extra = ["--restrain", "start=0.5,mosaic=0.1"]
    elif case == "shared":
        extra = ["--shared", "N"]
    elif case == "joint_cycles":
        extra = ["--solve", "joint", "--cycles", "1"]
    elif case == "joint_restraint":
        extra = ["--solve", "joint", "--restrain", "orientation=0.1"]
    else:
        shots = [*stills, str(tmp_path / "absent.bin")]
    assert _cli(start_mtz, tmp_path, *extra, starts=starts, shots=shots) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0]
    assert not any(path.name.startswith("out") or path.name.startswith("report") for path in tmp_path.iterdir())


def _phases_only_mtz(path) -> str:
    """An MTZ whose only column is a phase: no amplitude for the merge to start from."""
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(GROUP)
    mtz.set_cell_for_all(gemmi.UnitCell(*CELL))
    mtz.add_dataset("phases")
    mtz.add_column("PHI", "P")
    mtz.set_data(np.array([[1, 2, 3, 45.0]], dtype=np.float32))
    mtz.write_to_file(str(path))
    return path


def _die_or_sum() -> None:
    """Worker 1 dies at once; worker 0 waits in an all-reduce for it."""
    if torch.distributed.get_rank() == 1:
        os._exit(3)
    all_sum(torch.ones(1, dtype=torch.float64), "cpu")


def test_a_worker_that_dies_ends_every_worker_in_one_line(capfd, monkeypatch):
    """The one line names the worker that died, even when the launcher wakes only after its peer has failed
    too (a loaded machine): the peer's error (a connection reset in its all-reduce) is the death's consequence.
    The launcher is made that late here: its wait for the workers returns once every one has ended."""
    wait = multiprocessing.connection.wait
    monkeypatch.setattr(multiprocessing.connection, "wait", lambda objects, timeout=None: wait(objects, timeout) and [
        ended for ended in objects if wait([ended])])
    with pytest.raises(nbsim.NbsimError) as error:
        launch(_die_or_sum, (), workers=2, device="cpu")
    assert "worker 1 died" in str(error.value) and len(str(error.value).splitlines()) == 1
    assert capfd.readouterr().err == ""  # nothing besides the one line the command prints


@pytest.mark.slow
def test_cli_merge_resumes_from_its_last_cycle(start_mtz, tmp_path, capsys):
    """Stopped after cycle 1, the same command resumes from the checkpoint and ends with the MTZ and shots of an
    uninterrupted run; a checkpoint of other inputs is refused in one line; the report plots every cycle."""
    common = ("--refine", "scale", "--cycles", "2", "--shoebox", "5", "--spots", "40", "--f-iterations", "5",
              "--search-deg", "0", "--truth", str(start_mtz["folder"] / "truth.mtz"))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    assert _cli(start_mtz, straight, *common, "--quiet") == 0
    assert _cli(start_mtz, resumed, *common, "--quiet", "--stop-after-cycle", "1") == 0
    assert sorted(path.name for path in resumed.iterdir()) == ["out.mtz.checkpoint", "starts.json"]
    capsys.readouterr()
    assert _cli(start_mtz, resumed, *common, "--restrain", "start=1") == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "other inputs" in error[0]
    assert _cli(start_mtz, resumed, *common, "--report", str(resumed / "report.html")) == 0
    assert "cycle 1  done: resumed from" in capsys.readouterr().out
    merged = [gemmi.read_mtz_file(str(folder / "out.mtz")).array for folder in (straight, resumed)]
    assert np.array_equal(merged[0], merged[1], equal_nan=True)
    documents = [json.loads((folder / "out.json").read_text()) for folder in (straight, resumed)]
    assert documents[0]["shots"] == documents[1]["shots"]
    assert [{k: v for k, v in c.items() if k != "seconds"} for c in documents[0]["cycles"]] == \
        [{k: v for k, v in c.items() if k != "seconds"} for c in documents[1]["cycles"]]
    assert not (resumed / "out.mtz.checkpoint").exists()
    page = (resumed / "report.html").read_text()
    assert "data:image/png;base64," in page and page.count("<tr><td>") == 3  # the start and both cycles
    assert (resumed / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_shots_refined_spectrum_is_rebuilt_with_it(tmp_path):
    """--refine spectrum in a merge: a shot's set-up is rebuilt with its refined spectrum's shift and stretch
    (what the F step's design matrix renders with), and its values read them back."""
    from nbsim.io.text import HC_EV_A
    from nbsim.merge.state import rebuilt_setup, shot_values
    from nbsim.resolve import resolve

    (tmp_path / "spectrum.txt").write_text("1.0 1\n1.002 2\n1.004 1\n")
    start = resolve(nbsim.config_from_args(
        f"-default_F 100 -cell 50 60 70 90 90 90 -N 5 -detpixels 32 -spectrumfile {tmp_path / 'spectrum.txt'}"
        .split()))
    values = shot_values(start, start, None)
    assert values["spectrum"] == [0.0, 1.0]
    values["spectrum"] = [-4.0, 1.1]
    rebuilt = rebuilt_setup(start, values, ["orientation", "cell", "spectrum"], None, 1)
    given = HC_EV_A / start.sources.wavelength_A.numpy()
    mean = (given * [1, 2, 1]).sum() / 4
    np.testing.assert_allclose(HC_EV_A / rebuilt.sources.wavelength_A.numpy(), mean - 4 + 1.1 * (given - mean),
                               rtol=1e-12)
    assert shot_values(start, rebuilt, None)["spectrum"] == pytest.approx([-4.0, 1.1])


def test_a_shots_refined_mosaic_spread_is_rebuilt_with_it():
    """--refine mosaic in a merge: a shot's set-up is rebuilt with its refined spread (the F step's design
    matrix renders its domains with it), and its values read it back in degrees."""
    from nbsim.merge.state import rebuilt_setup, shot_values
    from nbsim.resolve import resolve

    start = resolve(nbsim.config_from_args(
        "-default_F 100 -cell 50 60 70 90 90 90 -N 5 -detpixels 32 -mosaic 0.2 -mosaic_dom 6 -seed 4".split()))
    values = shot_values(start, start, None)
    assert values["mosaic"] == pytest.approx([0.2])
    values["mosaic"] = [0.35]
    rebuilt = rebuilt_setup(start, values, ["orientation", "mosaic"], None, 1)
    assert float(torch.rad2deg(torch.as_tensor(rebuilt.mosaic.spread_rad))) == pytest.approx(0.35, rel=1e-12)
    assert shot_values(start, rebuilt, None)["mosaic"] == pytest.approx([0.35], rel=1e-12)
    kept = rebuilt_setup(start, values, ["orientation"], None, 1)
    assert float(torch.rad2deg(torch.as_tensor(kept.mosaic.spread_rad))) == pytest.approx(0.2, rel=1e-12)


def test_a_joint_solves_shot_json_says_what_its_flags_say(tmp_path):
    """Each shot's JSON after a joint solve holds its model's distance, beam centre and spectrum, not only its
    crystal: they agree with its flags and its refined set-up, off the start (the shot step's values were kept there
    before)."""
    from nbsim.merge.joint import JointShots

    (tmp_path / "spectrum.txt").write_text("1.0 1\n1.002 2\n1.004 1\n")
    argv = (f"-default_F 100 -cell 20 24 28 90 90 90 -N 5 -distance 14 -detpixels 16 -pixel 0.1 -oversample 1 "
            f"-spectrumfile {tmp_path / 'spectrum.txt'}").split()
    setup = resolve(nbsim.config_from_args(argv))
    pixels = (np.arange(4), np.arange(4))
    shots = JointShots([setup], [pixels], [torch.zeros(4)], [torch.zeros(4)], [2.0],
                       ["orientation", "distance", "beam", "spectrum", "scale"], (), None, [0], 1, 0.0, "poisson",
                       "cpu")
    [(refined, document)] = shots.refined(torch.full((shots.size,), 0.3, dtype=torch.float64), [argv])
    flags = document["flags"]

    def flag(name: str) -> float:
        return float(flags[flags.index(name) + 1])

    assert document["distance_mm"] == pytest.approx(flag("-distance"), rel=1e-9) and document["distance_mm"] != 14.0
    assert (document["beam_x_mm"], document["beam_y_mm"]) == pytest.approx((flag("-Xbeam"), flag("-Ybeam")), rel=1e-9)
    spectrum = document["spectrum"]
    assert (spectrum["shift_eV"], spectrum["stretch"]) == pytest.approx(
        (flag("-spectrum_shift"), flag("-spectrum_stretch")), rel=1e-9)
    assert spectrum["shift_eV"] != 0.0 and document["scale"] == 2.0
    assert float(refined.geometry.distance_m) * 1e3 == pytest.approx(document["distance_mm"], rel=1e-9)  # one model


def test_a_joint_solve_with_a_worker_without_shots_is_refused_as_it_starts(monkeypatch):
    """Every worker of a joint solve renders shots of its own: more workers than shots is one line as the merge
    starts, before anything is read (not after the scale-only cycles)."""
    monkeypatch.setattr(merge_refine, "rank_and_size", lambda: (0, 3))
    options = MergeOptions(shots=FitOptions(refine=("orientation", "scale")), cycles=2, solve="joint")
    job = MergeJob(shots=(("a.bin", ()), ("b.bin", ())), hkl="absent.hkl", column=None, space_group=GROUP,
                   cell_A_deg=CELL, default_F=0.0, anomalous=False, options=options)
    with pytest.raises(nbsim.NbsimError, match=r"^the joint solve needs a shot on every worker: 3 workers for 2 "
                                                r"shots$"):
        Merge(job)
