"""DIALS experiment lists (nbsim.io.dials_experiments): a synthetic .expt written from an nbsim set-up converts
back to the same reciprocal vectors and detector; a real dials.import -> find_spots -> index of nbsim's
miniCBF series converts to the simulated orientation, cell, distance and beam centre."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess

import fabio
import numpy as np
import pytest

from nbsim.cli import main
from nbsim.errors import InputFileError
from nbsim.fit.parameters import misorientation_deg
from nbsim.io.dials_experiments import dials_real_space, mini_cbf_a_matrix, read_experiment_list
from nbsim.model.crystal import build_lattice
from nbsim.model.geometry import build_geometry
from nbsim.nanobragg.arguments import parse
from nbsim.rng import Ran1

from .conftest import REPO_ROOT


def to_dials(vector) -> list[float]:
    """nanoBragg's lab vector in DIALS's frame: (z, y, -x), the header's DIALS_ORIGIN mapping."""
    x, y, z = (float(v) for v in vector)
    return [z, y, -x]


def _resolved(config):
    geometry = build_geometry(config.detector)
    lattice = build_lattice(config.crystal, config.beam.wavelength_A, Ran1())
    return geometry, lattice


def _expt(config, turn: np.ndarray | None = None, setting: np.ndarray | None = None, images=None) -> dict:
    """The experiment list dxtbx would write for the nbsim set-up (its header's geometry), every vector then
    turned by `turn` (a rigid turn of the whole experiment, in DIALS's frame); `setting`: a goniometer
    setting rotation, the crystal given at its datum (setting⁻¹ applied)."""
    turn = np.eye(3) if turn is None else turn
    setting = np.eye(3) if setting is None else setting
    geometry, lattice = _resolved(config)
    assert to_dials(geometry.pix0_m.numpy() * 1000.0) == pytest.approx(list(geometry.dials_origin_mm), abs=1e-9)

    def turned(vector) -> list[float]:
        return [float(v) for v in turn @ np.array(to_dials(vector))]

    # The basis an indexer finds is the inverse of the reciprocal one (nanoBragg's real_A of a triclinic -cell
    # differs from it by ~1e-4 relative: its regenerated reciprocal vectors are what diffract).
    inverse = np.linalg.inv(lattice.reciprocal_per_A.numpy()).T
    real = [np.linalg.inv(setting) @ np.array(turned(row)) for row in inverse]
    return {"__id__": "ExperimentList",
            "experiment": [{"__id__": "Experiment", "beam": 0, "detector": 0, "goniometer": 0, "scan": 0,
                            "crystal": 0, "imageset": 0}],
            "imageset": [images or {"__id__": "ImageSequence", "template": "frames/img_#####.cbf"}],
            "beam": [{"direction": [float(v) for v in -turn @ np.array(to_dials(geometry.beam))],
                      "wavelength": float(config.beam.wavelength_A),
                      "polarization_normal": turned(-geometry.vertical.numpy()), "polarization_fraction": 0.999}],
            "detector": [{"panels": [{"name": "Panel", "fast_axis": turned(geometry.fdet),
                                      "slow_axis": turned(geometry.sdet),
                                      "origin": turned(geometry.pix0_m.numpy() * 1000.0),
                                      "image_size": [geometry.pixels_f, geometry.pixels_s],
                                      "pixel_size": [geometry.pixel_size_m * 1000.0] * 2}]}],
            "goniometer": [{"rotation_axis": [float(v) for v in np.linalg.inv(setting) @ turned(geometry.spindle)],
                            "fixed_rotation": np.eye(3).ravel().tolist(),
                            "setting_rotation": setting.ravel().tolist()}],
            "scan": [{"image_range": [3, 9], "oscillation": [float(config.crystal.phi_start_deg), 0.5]}],
            "crystal": [{"__id__": "crystal", **{f"real_space_{axis}": [float(v) for v in row]
                                                 for axis, row in zip("abc", real, strict=True)}}]}


def _rotation(axis, angle_deg: float) -> np.ndarray:
    k = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    skew = np.array([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]])
    angle = np.radians(angle_deg)
    return np.eye(3) + np.sin(angle) * skew + (1.0 - np.cos(angle)) * skew @ skew


BASE = ["-cell", "61", "72", "83", "81", "95", "102", "-misset", "12", "-31", "47", "-lambda", "1.3", "-N", "3",
        "-default_F", "1", "-detpixels_f", "300", "-detpixels_s", "280", "-pixel", "0.172", "-distance", "150.5",
        "-phi", "4"]


@pytest.mark.parametrize("flags, turn_deg, convention", [
    (["-Xbeam", "20.3", "-Ybeam", "27.9"], 0.0, "mosflm"),
    (["-Xbeam", "20.3", "-Ybeam", "27.9"], 0.4, "mosflm"),  # the whole experiment turned off -z: turned back
    (["-detector_rotx", "1.5", "-detector_roty", "-2", "-twotheta", "7"], 0.0, "custom"),
])
def test_a_synthetic_experiment_converts_back_to_its_set_up(tmp_path, flags, turn_deg, convention):
    config = parse([*BASE, *flags])[0]
    setting = _rotation((0.2, 1.0, -0.3), 25.0)
    path = tmp_path / "start.expt"
    path.write_text(json.dumps(_expt(config, _rotation((0.3, 1.0, 0.0), turn_deg), setting)))
    [start] = read_experiment_list(path)
    assert start.overrides["convention"] == convention
    assert start.image == str(tmp_path / "frames" / "img_00003.cbf")
    rebuilt = config.with_options(misset_deg=(5.0, 5.0, 5.0), beam_x_mm=1.0).with_options(**start.overrides)
    geometry, lattice = _resolved(rebuilt)
    truth_geometry, truth_lattice = _resolved(config)
    np.testing.assert_allclose(start.a_matrix_per_A, truth_lattice.reciprocal_per_A.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lattice.reciprocal_per_A.numpy(), truth_lattice.reciprocal_per_A.numpy(), atol=1e-12)
    assert rebuilt.crystal.cell_A_deg == pytest.approx(lattice.cell_parameters(), rel=1e-10)  # its own matrix's cell
    for name in ("pix0_m", "fdet", "sdet", "odet", "beam", "spindle"):
        np.testing.assert_allclose(getattr(geometry, name).numpy(), getattr(truth_geometry, name).numpy(),
                                   atol=1e-12, err_msg=name)
    if "-twotheta" not in flags:  # nanoBragg's distance of a detector turned by two-theta ignores the turn
        assert float(geometry.distance_m) == pytest.approx(float(truth_geometry.distance_m), abs=1e-12)
    assert (geometry.pixels_f, geometry.pixels_s, geometry.pixel_size_m) == (300, 280, pytest.approx(0.000172))
    assert (rebuilt.crystal.phi_start_deg, rebuilt.crystal.osc_range_deg) == (4.0, 0.5)
    assert rebuilt.beam.wavelength_A == 1.3


def test_the_a_matrix_goes_back_to_dials_real_space():
    config = parse(BASE)[0]
    lattice = _resolved(config)[1]
    back = dials_real_space(lattice.reciprocal_per_A.numpy())
    for axis, row in zip("abc", np.linalg.inv(lattice.reciprocal_per_A.numpy()).T, strict=True):
        np.testing.assert_allclose(back[f"real_space_{axis}"], to_dials(row), atol=1e-9)


def test_stills_name_their_image_and_frame(tmp_path):
    config = parse(BASE)[0]
    document = _expt(config, images={"__id__": "ImageSet", "images": ["shots.nxs", "shots.nxs"],
                                     "single_file_indices": [4, 7]})
    document["experiment"].append({**document["experiment"][0]})
    for experiment in document["experiment"]:
        del experiment["scan"], experiment["goniometer"]
    (tmp_path / "stills.expt").write_text(json.dumps(document))
    starts = read_experiment_list(tmp_path / "stills.expt")
    assert [s.image for s in starts] == [f"{tmp_path / 'shots.nxs'}#4", f"{tmp_path / 'shots.nxs'}#7"]
    assert "phi_start_deg" not in starts[0].overrides


def test_bad_experiment_lists_are_one_line(tmp_path):
    config = parse(BASE)[0]
    overlapping = _expt(config)
    overlapping["detector"][0]["panels"] *= 2  # two panels in one place
    unindexed = _expt(config)
    del unindexed["experiment"][0]["crystal"]
    cases = {"missing.expt": None, "text.expt": "not json", "list.expt": json.dumps([1]),
             "panels.expt": json.dumps(overlapping), "unindexed.expt": json.dumps(unindexed)}
    messages = {"missing.expt": "no such file", "text.expt": "not a DIALS experiment list (JSON",
                "list.expt": "no ExperimentList", "panels.expt": "panel 'panel1' overlaps panel 'panel0'",
                "unindexed.expt": "has no crystal (index it first)"}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(InputFileError, match=re.escape(messages[name])) as raised:
            read_experiment_list(tmp_path / name)
        assert "\n" not in str(raised.value) and name in str(raised.value)


SERIES = ["-cell", "40", "50", "60", "90", "90", "90", "-default_F", "100", "-N", "10", "-lambda", "1",
          "-distance", "80", "-detpixels", "256", "-pixel", "0.2", "-oversample", "1", "-misset", "10", "20", "30",
          "-osc", "1", "-phisteps", "5", "-seed", "3", "-flux", "1e19", "-nopgm", "-compile", "off"]
DIALS_COMMANDS = [
    ["dials.import", "img_00001.cbf", "img_00002.cbf", "img_00003.cbf"],
    ["dials.find_spots", "imported.expt", "nproc=1", "min_spot_size=1"],
    ["dials.index", "imported.expt", "strong.refl", "unit_cell=40,50,60,90,90,90", "space_group=P222",
     "detector.fix=all", "beam.fix=all", "basis_vector_combinations.max_refine=5", "indexing.method=fft1d"],
]


def test_the_documented_series_commands_are_the_tests():
    """docs/formats.md shows the commands the next test runs (it runs them there, not twice): the same
    nbsim flags (the test adds -compile off) and the same DIALS commands."""
    text = (REPO_ROOT / "docs" / "formats.md").read_text()
    marker = text.index("<!-- not run: tests/test_dials_experiments.py runs these commands")
    start = text.index("```sh\n", marker) + len("```sh\n")
    block = text[start:text.index("```", start)].replace("\\\n", " ")
    lines = [line.split() for line in block.splitlines()]
    [render] = [words for words in lines if words and words[0] == ".venv/bin/nbsim"]
    compile_flag = SERIES.index("-compile")
    assert render[1:render.index("-phi")] + render[render.index("-phi") + 2:render.index("-cbffile")] == \
        SERIES[:compile_flag] + SERIES[compile_flag + 2:]
    for command in DIALS_COMMANDS:
        assert command in lines


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dials.index") is None, reason="DIALS is not installed (dials.import, "
                    "dials.find_spots, dials.index: Debian's dials package)")
def test_dials_indexing_of_an_nbsim_series_converts_to_the_simulation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for frame in range(3):
        assert main([*SERIES, "-phi", str(frame), "-cbffile", f"img_{frame + 1:05d}.cbf",
                     "-noisefile", f"noise_{frame}.img"]) == 0
    for command in DIALS_COMMANDS:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    [start] = read_experiment_list(tmp_path / "indexed.expt")
    truth = mini_cbf_a_matrix(fabio.open("img_00001.cbf").header["_array_data.header_contents"])
    assert start.image == str(tmp_path / "img_00001.cbf")
    assert _misorientation_deg(start.a_matrix_per_A, truth) <= 0.1
    cell = start.overrides["cell_A_deg"]
    np.testing.assert_allclose(cell[:3], (40.0, 50.0, 60.0), rtol=0.002)
    np.testing.assert_allclose(cell[3:], (90.0, 90.0, 90.0), atol=0.2)
    simulated = parse(SERIES)[0]
    ours = build_geometry(simulated.with_options(**start.overrides).detector)
    theirs = build_geometry(simulated.detector)
    assert float(ours.distance_m) * 1000 == pytest.approx(float(theirs.distance_m) * 1000, abs=0.05)
    assert ours.fbeam_m * 1000 == pytest.approx(theirs.fbeam_m * 1000, abs=0.05)
    assert ours.sbeam_m * 1000 == pytest.approx(theirs.sbeam_m * 1000, abs=0.05)

    # nbsim fit from DIALS's indexing (--expt: its crystal, beam, detector and first image) ends closer to
    # the truth than DIALS in orientation and cell. DIALS's orientation is within 0.1° (above): no search
    # stages (tests/test_fit.py runs them; here they were 90 % of the fit's time).
    seed = SERIES.index("-seed")
    flags = [*SERIES[:seed], *SERIES[seed + 2:], "-phi", "0"]
    assert main(["fit", "--expt", "indexed.expt", "--refine", "orientation,cell,N,scale", "--search-deg", "0",
                 "--json", "fit.json", "--", *flags]) == 0
    [shot] = json.loads((tmp_path / "fit.json").read_text())["shots"]
    fitted = np.array(shot["A_matrix"])

    def cell_error(lengths) -> float:
        return max(abs(found - true) / true for found, true in zip(sorted(lengths), (40.0, 50.0, 60.0), strict=True))

    assert _misorientation_deg(fitted, truth) < _misorientation_deg(start.a_matrix_per_A, truth)
    assert cell_error(shot["cell"][:3]) < cell_error(cell[:3])


def _misorientation_deg(a_matrix: np.ndarray, truth: np.ndarray) -> float:
    """How far an A matrix is turned from the truth, in whichever of P222's equivalent settings ((a, b, c)
    with two of them negated) DIALS chose."""
    return min(misorientation_deg(np.diag(signs) @ a_matrix, truth)
               for signs in itertools.product((1.0, -1.0), repeat=3) if np.prod(signs) > 0)
