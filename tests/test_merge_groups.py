"""nbsim merge in space groups other than P 21 21 21 (issue 38: other proteins, scatterers and cells): a heavy-atom
model's anomalous table in P 61 (a hexagonal cell with a long axis; rotations that are not diagonal) and P 43 21 2
(four centric zones), checked against a direct summation over the unit cell's atoms; its asymmetric unit, centric
reflections and Friedel/Bijvoet pairs as the merge lays them out, written to an MTZ and read back; and |F(+)|,
|F(−)| refined from noiseless P 61 stills."""

from __future__ import annotations

import dataclasses

import gemmi
import numpy as np
import pytest
import torch

import nbsim
from benchmarks.merge_workloads import read_amplitudes
from benchmarks.model_workloads import write_model
from nbsim.fit.model import DiffractionModel
from nbsim.fit.output import misset_deg
from nbsim.fit.refine import FitOptions
from nbsim.io.structure_files import expand_to_p1_sphere, read_reflection_file, write_hkl
from nbsim.merge import Merge, MergeJob, MergeOptions, asymmetric_unit, write_mtz
from nbsim.merge.reflections import other_indexings, space_group
from nbsim.merge.state import reindexed_start, shot_values
from nbsim.model.anomalous import HC_EV_A
from nbsim.model.structure_factors import build_grid
from nbsim.resolve import resolve
from nbsim.sweep.fitting import true_rotation

from .test_merge import assert_parameters_rebuild_table

WAVELENGTH_A = 1.2821
"""Just above the Zn K edge (9659 eV): f″ of Zn about 3.9."""
CRYSTALS = {"P 61": (45.0, 45.0, 110.0, 90.0, 90.0, 120.0), "P 43 21 2": (40.0, 40.0, 64.0, 90.0, 90.0, 90.0)}
DETECTOR = "-N 5 -distance 40 -detpixels 64 -pixel 0.2 -oversample 1 -nointerpolate -fluence 1e28".split()


def _model(folder, group: str) -> str:
    """60 atoms at random in `group`'s cell (PDB), 6 of them Zn, the rest C, N and O."""
    path = folder / f"model_{group.replace(' ', '')}.pdb"
    write_model(path, 60, CRYSTALS[group], group, seed=5, elements=("C", "N", "O"), heavy=("Zn", 10))
    return str(path)


def _direct_amplitudes(path: str, miller: np.ndarray, energy_eV: float) -> np.ndarray:
    """|F| at each index by direct summation over every atom of the unit cell: each atom's symmetry mates by the
    space group's operations, IT92 form factors with Cromer–Liberman's f′ and f″, isotropic B and occupancy."""
    structure = gemmi.read_structure(path)
    cell = structure.cell
    operations = gemmi.SpaceGroup(structure.spacegroup_hm).operations()
    stol2 = 0.25 / np.asarray(cell.calculate_d_array(miller.astype(np.int32))) ** 2
    total = np.zeros(len(miller), np.complex128)
    for atom in (atom for residue in structure[0]["A"] for atom in residue):
        form = atom.element.it92
        f0 = sum(a * np.exp(-b * stol2) for a, b in zip(form.a, form.b, strict=True)) + form.c
        fp, fpp = gemmi.cromer_liberman(z=atom.element.atomic_number, energy=energy_eV)
        factor = atom.occ * (f0 + fp + 1j * fpp) * np.exp(-atom.b_iso * stol2)
        position = cell.fractionalize(atom.pos)
        for operation in operations:
            mate = np.array(operation.apply_to_xyz([position.x, position.y, position.z]))
            total += factor * np.exp(2j * np.pi * (miller @ mate))
    return np.abs(total)


@pytest.fixture(scope="module", params=list(CRYSTALS))
def crystal(request, tmp_path_factory):
    """A Zn model in the group, its -anomalous P1 table at WAVELENGTH_A (nbsim's), and the merge's reflections."""
    folder = tmp_path_factory.mktemp("groups")
    group = space_group(request.param)
    path = _model(folder, request.param)
    setup = resolve(nbsim.config_from_args(["-model", path, "-anomalous", "-lambda", str(WAVELENGTH_A),
                                                  *DETECTOR]))
    table = setup.p1_table.reflections
    reflections, values = asymmetric_unit(table, group, CRYSTALS[request.param], True, path)
    return {"folder": folder, "group": group, "model": path, "table": table, "reflections": reflections,
            "values": values}


def test_a_models_anomalous_table_is_the_direct_sum_and_maps_onto_the_asymmetric_unit(crystal):
    """Every node of nbsim's P1 table holds the directly summed |F| of its index (F(+) at h·R, F(−) at −h·R); the
    merge's parameters (F(+) of h, F(−) of −h, one value for a centric reflection) rebuild every node of it; a
    centric reflection's halves are equal and an acentric pair's differ."""
    table, reflections, values = crystal["table"], crystal["reflections"], crystal["values"]
    direct = _direct_amplitudes(crystal["model"], table[:, :3].astype(np.int64), HC_EV_A / WAVELENGTH_A)
    assert np.max(np.abs(table[:, 3] - direct)) <= 1e-6 * direct.max()

    assert_parameters_rebuild_table(table, reflections, values)

    centric = reflections.centric
    assert 0 < centric.sum() < len(centric)
    assert np.array_equal(reflections.plus[centric], reflections.minus[centric])
    plus, minus = (_direct_amplitudes(crystal["model"], sign * reflections.miller, HC_EV_A / WAVELENGTH_A)
                   for sign in (1, -1))
    assert np.allclose(plus[centric], minus[centric], rtol=1e-9)
    assert np.median(np.abs(plus[~centric] / minus[~centric] - 1)) > 0.01  # Bijvoet differences of a few %
    tolerance = 1e-6 * direct.max()  # gemmi's form factors are float32
    assert np.max(np.abs(values[reflections.plus] - plus)) <= tolerance
    assert np.max(np.abs(values[reflections.minus] - minus)) <= tolerance


def test_the_mtz_in_the_group_reads_back_as_the_same_table_and_pairs(crystal, tmp_path):
    """The MTZ the merge writes (the group's asymmetric unit, F(+)/F(−)) reads back through nbsim's reader as
    the same P1 table, and through the benchmark's scorer as each reflection's F(+) and F(−)."""
    reflections, values = crystal["reflections"], crystal["values"]
    path = str(tmp_path / "merged.mtz")
    write_mtz(path, reflections, values, 0.01 * values)
    mtz = gemmi.read_mtz_file(path)
    assert mtz.spacegroup.hm == crystal["group"].hm
    back = read_reflection_file(path).reflections
    order = np.lexsort(back[:, :3].T), np.lexsort(crystal["table"][:, :3].T)
    assert np.array_equal(back[order[0], :3], crystal["table"][order[1], :3])
    assert np.allclose(back[order[0], 3], crystal["table"][order[1], 3], rtol=1e-6)  # float32 in the MTZ
    scored = read_amplitudes(path)
    assert len(scored) == len(reflections.miller)
    for index in np.random.default_rng(0).choice(len(reflections.miller), 50, replace=False):
        plus, minus = scored[tuple(int(v) for v in reflections.miller[index])][:2]
        assert plus == pytest.approx(values[reflections.plus[index]], rel=1e-6)
        assert minus == pytest.approx(values[reflections.minus[index]], rel=1e-6)


@pytest.fixture(scope="module")
def p61(tmp_path_factory):
    """Four noiseless stills of the Zn model in P 61 (and one photon of background a pixel), its anomalous truth
    as a P1 table, and a start of CC about 0.6 without anomalous differences."""
    folder = tmp_path_factory.mktemp("p61")
    group, cell = space_group("P 61"), CRYSTALS["P 61"]
    flags = [*DETECTOR, "-lambda", str(WAVELENGTH_A), "-cell", *map(str, cell)]
    truth = resolve(nbsim.config_from_args(["-model", _model(folder, "P 61"), "-anomalous", *flags]))
    write_hkl(folder / "truth.hkl", truth.p1_table.reflections)
    means, mean_F = asymmetric_unit(truth.p1_table.reflections, group, cell, False, "truth")
    start_F = mean_F * np.exp(0.6 * np.random.default_rng(1).standard_normal(len(mean_F)))
    write_hkl(folder / "start.hkl", expand_to_p1_sphere(means.miller, start_F, None, group))
    rng = np.random.default_rng(4)
    stills = {}
    for index in range(4):
        misset = [str(angle) for angle in rng.uniform(-180, 180, 3).round(3)]
        with torch.no_grad():
            image = nbsim.simulate(nbsim.config_from_args([*flags, "-hkl", str(folder / "truth.hkl"),
                                                           "-misset", *misset]))
        name = str(folder / f"still{index}.bin")
        (image.double().numpy() + 1.0).astype(np.float32).tofile(name)
        stills[name] = misset
    return {"folder": folder, "flags": flags, "stills": stills, "cell": cell, "truth": truth.p1_table.reflections}


def _p61_merge(p61, missets: dict[str, list[str]]) -> Merge:
    """A merge of the P 61 stills from these starting missets whose shots hold every pixel with their background
    and their starts as their models: the F step's or the choice of indexing's input without a shot step."""
    folder = p61["folder"]
    shots = tuple((name, (*p61["flags"], "-hkl", str(folder / "start.hkl"), "-misset", *misset))
                  for name, misset in missets.items())
    merge = Merge(MergeJob(shots=shots, hkl=str(folder / "start.hkl"), column=None, space_group="P 61",
                           cell_A_deg=p61["cell"], default_F=0.0, anomalous=True, truth=str(folder / "truth.hkl"),
                           options=MergeOptions(shots=FitOptions(refine=("scale",)), reindex=True)))
    grid = merge.current_grid()
    for shot in merge.shots:
        shot.rows, shot.cols = (a.ravel() for a in np.divmod(np.arange(64 * 64), 64))
        shot.setup = dataclasses.replace(shot.setup, grid=grid)
        shot.values = shot_values(shot.start, shot.setup, "hexagonal")
        shot.background = torch.ones(64 * 64, dtype=torch.float64)
        shot.document = {"scale": 1.0, "flags": []}
    return merge


def test_F_plus_and_minus_refined_from_noiseless_p61_stills(p61):
    """The F step on four noiseless stills of the Zn model in P 61 (every pixel fitted, the shots at their true
    models), from a start of CC about 0.6 without anomalous differences: the measured |F| reach CC ≥ 0.999 with
    the truth and their Bijvoet differences CCano ≥ 0.99, over the pairs of the hexagonal asymmetric unit."""
    merge = _p61_merge(p61, p61["stills"])
    before = merge.scores()
    merge.refine_F()
    after = merge.scores()
    plus, minus = merge.reflections.friedel_pairs()
    pairs = int((merge.measured[plus] & merge.measured[minus]).sum())
    assert before["cc"] < 0.8 and pairs >= 30, (before, pairs)
    assert after["cc"] >= 0.999 and after["cc_anomalous"] >= 0.99, (after, pairs)


def _reindexed_misset(p61, misset: list[str], operator: np.ndarray) -> list[str]:
    """The -misset of a still's start indexed the other way (`reindexed_start`)."""
    setup = resolve(nbsim.config_from_args([*p61["flags"], "-default_F", "1", "-misset", *misset]))
    other = reindexed_start(dataclasses.replace(setup, grid=None), operator, "hexagonal")
    return [f"{angle:.10f}" for angle in misset_deg(torch.as_tensor(true_rotation(other)))]


def test_a_start_reindexed_sees_each_spot_with_the_F_of_h_R(p61):
    """P 61's lattice is 6/mmm, its point group 6: one other indexing (h·R = k,h,−l up to the group). A still's
    start reindexed renders, from the truth's table reindexed (|F| of h moved to h·R), exactly the still its
    start renders from the truth's: every spot where it was, each with the |F| of its new index."""
    group, cell = space_group("P 61"), p61["cell"]
    ((triplet, operator),) = other_indexings(group, cell)
    assert other_indexings(space_group("P 43 21 2"), CRYSTALS["P 43 21 2"]) == []
    table = p61["truth"]
    moved = np.column_stack([np.rint(table[:, :3] @ operator), table[:, 3]])
    misset = next(iter(p61["stills"].values()))
    images = [_render(resolve(nbsim.config_from_args([*p61["flags"], "-default_F", "1", "-misset", *angles])),
                      rows) for rows, angles in ((table, misset), (moved, _reindexed_misset(p61, misset, operator)))]
    assert float(images[0].max()) > 100 * float(images[0].median())  # spots
    assert torch.allclose(images[1], images[0], rtol=1e-6, atol=1e-9 * float(images[0].max())), triplet


def test_the_first_shot_step_gives_each_shot_the_indexing_its_pixels_prefer(p61):
    """Two of the four P 61 stills started in the other indexing (as stills indexed one by one come out): from the
    start's |F| (CC about 0.6), the choice gives those two the other indexing (their starts reindexed back to the
    truth's), keeps the two given in the truth's, and the reindexed shots render as their truths do."""
    group, cell = space_group("P 61"), p61["cell"]
    ((triplet, operator),) = other_indexings(group, cell)
    missets = {name: (_reindexed_misset(p61, misset, operator) if index % 2 else misset)
               for index, (name, misset) in enumerate(p61["stills"].items())}
    merge = _p61_merge(p61, missets)
    chosen = merge.choose_indexings(merge.current_grid(), merge.shot_options(0))
    assert chosen == [1, 3]
    assert [shot.indexing for shot in merge.shots] == ["x,y,z", triplet, "x,y,z", triplet]
    truth = _p61_merge(p61, p61["stills"])
    for shot, true in zip(merge.shots, truth.shots, strict=True):
        image = _render(shot.setup, p61["truth"])
        assert torch.allclose(image, _render(true.setup, p61["truth"]), rtol=1e-6, atol=1e-9 * float(image.max()))


def _render(setup, table: np.ndarray) -> torch.Tensor:
    """A 64² still's photons from a set-up with this P1 table (float64)."""
    pixels = tuple(a.ravel() for a in np.divmod(np.arange(64 * 64), 64))
    with torch.no_grad():
        return DiffractionModel([dataclasses.replace(setup, grid=build_grid(table, 0.0))], [pixels], (),
                                dtype=torch.float64, compile=False)()[0]
