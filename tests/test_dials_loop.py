"""The DIALS loop (issue 39): `nbsim fit --expt` fits every experiment (lattice) of a list on its image,
`--refl` gives DIALS's spots as the observed spots, `--expt-out` writes the refined models back as an
experiment list that DIALS integrates. Fast tests of the files; one slow test runs the loop through Debian's
DIALS where it is installed."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess

import fabio
import msgpack
import numpy as np
import pytest

from nbsim.cli import main
from nbsim.cli.fit import _experiment_shots
from nbsim.errors import InputFileError, NbsimError
from nbsim.fit.pixels import shoeboxes
from nbsim.io.dials_experiments import (
    PanelPlacement,
    RefinedExperiment,
    mini_cbf_a_matrix,
    read_experiment_list,
    write_experiment_list,
)
from nbsim.io.dials_reflections import read_reflection_table
from nbsim.model.geometry import build_geometry
from nbsim.nanobragg.arguments import parse

from .conftest import REPO_ROOT
from .test_dials_experiments import BASE, _expt, _misorientation_deg, _rotation


def _refl(path, identifiers: dict[int, str], ids, centroids, intensities=None, panels=None) -> None:
    """A reflection table as DIALS writes it (flex.reflection_table.as_msgpack's layout); `panels`: each spot's
    panel (all 0 when not given)."""
    rows = len(ids)
    panels = np.zeros(rows) if panels is None else panels
    data = {"id": ["int", [rows, np.asarray(ids, "<i4").tobytes()]],
            "xyzobs.px.value": ["vec3<double>", [rows, np.asarray(centroids, "<f8").tobytes()]],
            "panel": ["std::size_t", [rows, np.asarray(panels, "<u8").tobytes()]]}
    if intensities is not None:
        data["intensity.sum.value"] = ["double", [rows, np.asarray(intensities, "<f8").tobytes()]]
    path.write_bytes(msgpack.packb(["dials::af::reflection_table", 1,
                                    {"identifiers": identifiers, "nrows": rows, "data": data}]))


def test_a_reflection_table_gives_each_experiment_its_brightest_spots(tmp_path):
    _refl(tmp_path / "indexed.refl", {0: "first", 1: "second"}, [0, 1, -1, 0, 0],
          [[10.5, 20.5, 0.5], [3.2, 4.9, 0.5], [7.0, 7.0, 0.5], [30.9, 40.1, 0.5], [50.5, 60.5, 0.5]],
          [5.0, 9.0, 100.0, 50.0, 20.0])
    table = read_reflection_table(tmp_path / "indexed.refl")
    # x is fast (the column), y slow (the row), in pixels from the first pixel's outer corner
    np.testing.assert_array_equal(table.spots("first", 0, 10), [[40, 30], [60, 50], [20, 10]])
    np.testing.assert_array_equal(table.spots("first", 0, 2), [[40, 30], [60, 50]])
    np.testing.assert_array_equal(table.spots("second", 1, 10), [[4, 3]])
    assert table.spots("another", 0, 10).shape == (0, 2)
    assert table.covers(["another", "second"]) and not table.covers(["another"])
    _refl(tmp_path / "plain.refl", {}, [0, 1], [[1.5, 2.5, 0.5], [3.5, 4.5, 0.5]])  # no identifiers, no intensity
    plain = read_reflection_table(tmp_path / "plain.refl")
    np.testing.assert_array_equal(plain.spots(None, 1, 10), [[4, 3]])
    assert plain.covers(["anything"])


def test_given_spots_are_the_observed_spots_of_the_shoeboxes():
    predicted = np.zeros((40, 50))
    predicted[10, 10] = 1.0
    observed = np.random.default_rng(1).poisson(5.0, (40, 50)).astype(np.float64)
    observed[30, 40] = 1000.0  # the image's own brightest spot, which given spots replace
    usable = np.ones_like(observed, dtype=bool)
    own = shoeboxes(predicted, observed, usable, size=3)
    given = shoeboxes(predicted, observed, usable, size=3, given_spots=np.array([[20, 25], [99, 0], [5, 45]]))
    assert sorted(map(tuple, own.centres)) == [(10, 10), (30, 40)]
    assert sorted(map(tuple, given.centres)) == [(5, 45), (10, 10), (20, 25)]  # (99, 0) is off the detector


def test_bad_reflection_tables_are_one_line(tmp_path):
    (tmp_path / "text.refl").write_text("not msgpack\n")
    (tmp_path / "other.refl").write_bytes(msgpack.packb(["something else", 1, {}]))
    _refl(tmp_path / "short.refl", {}, [0, 1], [[1.5, 2.5, 0.5]])
    (tmp_path / "nocentroid.refl").write_bytes(msgpack.packb(
        ["dials::af::reflection_table", 1, {"nrows": 1, "data": {"id": ["int", [1, b"\0\0\0\0"]]}}]))
    messages = {"missing.refl": "no such file", "text.refl": "not a DIALS reflection table",
                "other.refl": "no dials::af::reflection_table", "short.refl": "holds 24 bytes for 2 of 2 rows",
                "nocentroid.refl": "no column 'xyzobs.px.value'"}
    for name, message in messages.items():
        with pytest.raises(InputFileError, match=message) as raised:
            read_reflection_table(tmp_path / name)
        assert "\n" not in str(raised.value) and name in str(raised.value)


def _written_back(tmp_path) -> tuple[dict, RefinedExperiment]:
    """A list with a goniometer's setting rotation, a beam turned off DIALS's -z and a detector hierarchy whose
    root is moved and turned (tmp_path/start.expt), and a refined crystal, wavelength and panel written back
    from it (tmp_path/refined.expt): the start's document and what was written."""
    config = parse(BASE)[0]
    document = _expt(config, _rotation((0.3, 1.0, 0.0), 0.4), _rotation((0.2, 1.0, -0.3), 25.0))
    document["experiment"][0]["identifier"] = "lattice-0"
    document["crystal"][0]["B_covariance"] = [0.0] * 81
    document["crystal"][0]["space_group_hall_symbol"] = " P 1"
    document["scan"][0].update(exposure_time=[0.1] * 7, epochs=[0.0] * 7, batch_offset=0)  # dxtbx's too
    root_turn = _rotation((0.0, 0.0, 1.0), 5.0)
    root_origin = np.array([1.0, -2.0, -3.0])
    panel = document["detector"][0]["panels"][0]
    document["detector"][0]["hierarchy"] = {**panel, "name": "", "origin": root_origin.tolist(),
                                            "fast_axis": (root_turn @ [1.0, 0.0, 0.0]).tolist(),
                                            "slow_axis": (root_turn @ [0.0, 1.0, 0.0]).tolist(),
                                            "children": [{"panel": 0}]}
    (tmp_path / "start.expt").write_text(json.dumps(document))
    [start] = read_experiment_list(tmp_path / "start.expt")
    start_geometry = build_geometry(config.with_options(**start.overrides).detector)
    # the hierarchy's root frame is composed (dxtbx writes panels in its root's frame): the panel in the lab
    root_axes = root_turn  # columns: the root's fast, slow and normal axes
    expected_origin = root_origin + root_axes @ np.array(panel["origin"])
    np.testing.assert_allclose(start.to_nanobragg.T @ start_geometry.pix0_m.numpy() * 1000.0, expected_origin,
                               atol=1e-9)
    turn = _rotation((1.0, 2.0, 3.0), 0.7)
    refined = RefinedExperiment(start, start.a_matrix_per_A @ turn.T * 1.002, 1.31, (PanelPlacement(
        start_geometry.pix0_m.numpy() * 1000.0 + np.array([0.3, -0.1, 0.05]), turn @ start_geometry.fdet.numpy(),
        turn @ start_geometry.sdet.numpy()),))
    write_experiment_list(tmp_path / "refined.expt", tmp_path / "start.expt", [refined])
    return document, refined


def test_refined_experiments_written_back_read_back_as_refined(tmp_path):
    """The writer inverts the reader: what was refined reads back exactly; what was not is kept."""
    document, refined = _written_back(tmp_path)
    config = parse(BASE)[0]
    [panel] = refined.panels
    a_matrix, pix0_mm, fast, slow = refined.a_matrix_per_A, panel.origin_mm, panel.fast, panel.slow
    written = json.loads((tmp_path / "refined.expt").read_text())
    assert written["experiment"][0]["identifier"] == "lattice-0"
    assert "B_covariance" not in written["crystal"][0]
    assert written["crystal"][0]["space_group_hall_symbol"] == " P 1"
    assert written["goniometer"] == document["goniometer"] and written["scan"] == document["scan"]
    assert written["imageset"][0]["template"] == str(tmp_path / "frames" / "img_#####.cbf")
    [back] = read_experiment_list(tmp_path / "refined.expt")
    np.testing.assert_allclose(back.a_matrix_per_A, a_matrix, rtol=0, atol=1e-14)
    assert back.overrides["wavelength_A"] == 1.31
    geometry = build_geometry(config.with_options(**back.overrides).detector)
    np.testing.assert_allclose(geometry.pix0_m.numpy() * 1000.0, pix0_mm, atol=1e-9)
    np.testing.assert_allclose(geometry.fdet.numpy(), fast, atol=1e-12)
    np.testing.assert_allclose(geometry.sdet.numpy(), slow, atol=1e-12)


def _stills_list(tmp_path, lattices_per_image: list[int]) -> str:
    """An experiment list of stills, image k holding lattices_per_image[k] lattices (the files exist)."""
    config = parse(BASE)[0]
    document = _expt(config)
    del document["goniometer"], document["scan"]
    document["imageset"] = []
    document["experiment"] = []
    for image, lattices in enumerate(lattices_per_image):
        (tmp_path / f"still_{image}.cbf").write_bytes(b"")
        document["imageset"].append({"__id__": "ImageSet", "images": [f"still_{image}.cbf"]})
        for _ in range(lattices):
            document["experiment"].append({"__id__": "Experiment", "identifier": f"e{len(document['experiment'])}",
                                           "beam": 0, "detector": 0, "crystal": 0, "imageset": image})
    (tmp_path / "stills.expt").write_text(json.dumps(document))
    return str(tmp_path / "stills.expt")


def test_every_lattice_of_every_image_is_a_fit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expt = _stills_list(tmp_path, [2, 1, 1])

    def shots(*images: str) -> list[tuple[str, int]]:
        options = argparse.Namespace(expt=expt, refl=None, expt_out=None, no_observed_spots=False)
        images_out, starts = _experiment_shots(options, list(images))
        return [(image.rsplit("/", 1)[-1], start.number) for image, start in zip(images_out, starts, strict=True)]

    assert shots() == [("still_0.cbf", 0), ("still_0.cbf", 1), ("still_1.cbf", 2), ("still_2.cbf", 3)]
    assert shots("still_2.cbf", "still_0.cbf") == [("still_2.cbf", 3), ("still_0.cbf", 0), ("still_0.cbf", 1)]
    with pytest.raises(NbsimError, match="no experiment in .* is of other.cbf, and its 4 experiments do not pair "
                                         "with 1 images"):
        shots("other.cbf")


def test_missing_images_and_misplaced_options_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    expt = _stills_list(tmp_path, [1, 1])
    (tmp_path / "still_1.cbf").unlink()
    _refl(tmp_path / "other.refl", {0: "not-these"}, [0], [[1.5, 2.5, 0.5]])
    cases = [(["--expt", expt], f"experiment 1's image {tmp_path / 'still_1.cbf'} is not there"),
             (["still_0.cbf", "--refl", "other.refl"], "--refl and --expt-out go with --expt"),
             (["--expt", expt, "--refl", "x.refl", "--no-observed-spots"], "choose one"),
             (["still_0.cbf", "--expt", expt, "--refl", "other.refl"],
              "other.refl: its spots belong to none of the experiments")]
    for arguments, message in cases:
        assert main(["fit", *arguments, "--", "-default_F", "1"]) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1, error


LOOP_STILL = ["-cell", "40", "50", "60", "90", "90", "90", "-default_F", "100", "-N", "10", "-lambda", "1",
              "-distance", "80", "-detpixels", "256", "-pixel", "0.2", "-oversample", "1", "-flux", "1e19",
              "-nopgm", "-compile", "off"]
"""The stills of the loop: small spots on a small detector, which DIALS finds (min_spot_size=1) and indexes."""
LOOP_DIALS = [
    ["dials.import", "still_00001.cbf", "still_00002.cbf", "convert_sequences_to_stills=True"],
    ["dials.find_spots", "imported.expt", "nproc=1", "min_spot_size=1"],
    ["dials.index", "imported.expt", "strong.refl", "stills.indexer=sequences", "joint_indexing=False",
     "unit_cell=40,50,60,90,90,90", "space_group=P222", "detector.fix=all", "beam.fix=all",
     "indexing.method=real_space_grid_search", "basis_vector_combinations.max_combinations=20"],
]
LOOP_FIT = ["fit", "--expt", "indexed.expt", "--refl", "indexed.refl", "--expt-out", "refined.expt",
            "--json", "fit.json", "--spots", "80", "--compile", "off", "--", "-default_F", "100", "-N", "7",
            "-oversample", "1"]
LOOP_INTEGRATE = [
    ["dials.filter_reflections", "indexed.refl", "flag_expression=indexed", "output.reflections=indexed_only.refl"],
    ["dials.ssx_integrate", "refined.expt", "indexed_only.refl", "nproc=1", "algorithm=stills"],
]


def test_the_documented_loop_is_the_tests():
    """docs/fitting.md shows the commands the next test runs (it runs them there, not twice): the same render
    flags (the test adds -compile off), DIALS commands and fit (the test adds --compile off)."""
    text = (REPO_ROOT / "docs" / "fitting.md").read_text()
    marker = text.index("<!-- not run: tests/test_dials_loop.py runs these commands")
    start = text.index("```sh\n", marker) + len("```sh\n")
    lines = [line.split() for line in text[start:text.index("```", start)].replace("\\\n", " ").splitlines()]
    [render] = [words for words in lines if words[:1] == [".venv/bin/nbsim"] and "-cell" in words]
    assert render[1:render.index("-misset")] == [flag for flag in LOOP_STILL if flag not in ("-compile", "off")]
    [fit] = [words for words in lines if words[:2] == [".venv/bin/nbsim", "fit"]]
    assert fit[1:] == [word for word in LOOP_FIT if word not in ("--compile", "off")]
    for command in LOOP_DIALS + LOOP_INTEGRATE:
        assert command in lines, command


def _dials(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dials.ssx_integrate") is None, reason="DIALS is not installed (dials.import, "
                    "dials.find_spots, dials.index, dials.ssx_integrate: Debian's dials package)")
def test_the_dials_loop_integrates_nbsim_models_closer_to_the_truth(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for seed in ("1", "2"):
        assert main([*LOOP_STILL, "-misset", "random", "-misset_seed", seed, "-seed", seed,
                     "-cbffile", f"still_0000{seed}.cbf", "-noisefile", "/dev/null", "-floatfile", "/dev/null",
                     "-intfile", "/dev/null"]) == 0
    for command in LOOP_DIALS:
        _dials(command)
    indexed = read_experiment_list("indexed.expt")
    table = read_reflection_table("indexed.refl")
    for start in indexed:  # DIALS's spots are where the image is bright (x fast = column, y slow = row)
        counts = fabio.open(start.image).data
        spots = table.spots(start.identifier, start.number, 50)
        assert len(spots) >= 20
        assert np.median(counts[spots[:, 0], spots[:, 1]]) > 10 * max(np.median(counts), 1.0)

    assert main(LOOP_FIT) == 0
    shots = json.loads((tmp_path / "fit.json").read_text())["shots"]
    refined = read_experiment_list("refined.expt")
    assert [shot["experiment"] for shot in shots] == [0, 1]
    for start, back, shot in zip(indexed, refined, shots, strict=True):
        assert back.image == start.image and back.identifier == start.identifier
        np.testing.assert_allclose(back.a_matrix_per_A, shot["A_matrix"], rtol=1e-12)
        truth = mini_cbf_a_matrix(fabio.open(start.image).header["_array_data.header_contents"])
        assert _misorientation_deg(back.a_matrix_per_A, truth) <= _misorientation_deg(start.a_matrix_per_A, truth)
        assert _length_error(back.a_matrix_per_A, truth) <= _length_error(start.a_matrix_per_A, truth)

    for command in LOOP_INTEGRATE:
        _dials(command)
    integrated = read_reflection_table("integrated_1.refl")
    for start in refined:
        assert len(integrated.spots(start.identifier, start.number, 10_000)) >= 10


def _length_error(a_matrix: np.ndarray, truth: np.ndarray) -> float:
    """The largest relative error of the cell's lengths (sorted: DIALS may name the axes otherwise)."""
    lengths, true_lengths = (np.sort(np.linalg.norm(np.linalg.inv(m).T, axis=1)) for m in (a_matrix, truth))
    return float(np.max(np.abs(lengths / true_lengths - 1.0)))


@pytest.mark.skipif(shutil.which("cctbx.python") is None, reason="dxtbx is not installed (cctbx.python: Debian's "
                    "dials package)")
def test_dxtbx_reads_the_written_models_where_nbsim_put_them(tmp_path):
    """dxtbx's own reading of the written list (its hierarchy root's frame composed by dxtbx, the crystal at
    the goniometer's datum) places the panel, the beam and the crystal where nbsim's refined ones are, in
    DIALS's frame."""
    _, refined = _written_back(tmp_path)
    script = ("import json, sys\n"
              "from dxtbx.model.experiment_list import ExperimentListFactory\n"
              "[e] = ExperimentListFactory.from_json_file(sys.argv[1], check_format=False)\n"
              "p = e.detector[0]\n"
              "setting = e.goniometer.get_setting_rotation(); fixed = e.goniometer.get_fixed_rotation()\n"
              "from scitbx import matrix\n"
              "a = matrix.sqr(setting) * matrix.sqr(fixed) * matrix.sqr(e.crystal.get_A())\n"
              "print(json.dumps({'origin': p.get_origin(), 'fast': p.get_fast_axis(), 'slow': p.get_slow_axis(),\n"
              "                  'wavelength': e.beam.get_wavelength(), 'A': list(a)}))\n")
    done = subprocess.run(["cctbx.python", "-c", script, str(tmp_path / "refined.expt")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dxtbx = json.loads(done.stdout.strip().splitlines()[-1])
    to_dials = refined.start.to_nanobragg.T
    [panel] = refined.panels
    np.testing.assert_allclose(dxtbx["origin"], to_dials @ panel.origin_mm, atol=1e-9)
    np.testing.assert_allclose(dxtbx["fast"], to_dials @ panel.fast, atol=1e-12)
    np.testing.assert_allclose(dxtbx["slow"], to_dials @ panel.slow, atol=1e-12)
    assert dxtbx["wavelength"] == 1.31
    # dxtbx's A (columns a*, b*, c*) at φ = 0 in the lab: the refined rows turned into DIALS's frame
    np.testing.assert_allclose(np.array(dxtbx["A"]).reshape(3, 3), to_dials @ refined.a_matrix_per_A.T, atol=1e-14)
