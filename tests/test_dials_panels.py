"""Multi-panel DIALS experiment lists (issue 39): a tiled detector's panels, each with its own origin and axes in a
hierarchy of groups, read into the panels nbsim renders; refined panels written back into the same hierarchy,
read back by nbsim and by dxtbx where nbsim put them; `nbsim fit --expt` of a multi-panel list fits and writes
it; an experiment list whose panels are not the image's is one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import dials_panels
from nbsim.cli import main
from nbsim.config import PanelConfig
from nbsim.io.dials_experiments import (
    DIALS_TO_NANOBRAGG,
    PanelPlacement,
    RefinedExperiment,
    read_experiment_list,
    write_experiment_list,
)
from nbsim.io.dials_reflections import read_reflection_table
from nbsim.io.observed import read_observed
from nbsim.io.panels import read_panel_file, write_panel_file
from nbsim.model.geometry import panel_geometries
from nbsim.nanobragg.arguments import parse

from .conftest import REPO_ROOT
from .test_dials_experiments import BASE, _expt, _rotation
from .test_dials_loop import _refl

PIXEL_MM, FAST, SLOW, DISTANCE_MM = 0.2, 24, 20, 60.0
CRYSTAL = ["-cell", "40", "50", "60", "90", "90", "90", "-default_F", "100", "-N", "6", "-lambda", "1",
           "-misset", "10", "20", "30", "-oversample", "1", "-fluence", "1e27"]
TURN = _rotation((0.3, 1.0, 0.0), 0.4)
"""A rigid turn of the whole experiment (DIALS's frame): a beam DIALS refined off -z."""


def _tiles() -> tuple[PanelConfig, ...]:
    """Four modules in 2 x 2 around the beam (nanoBragg's frame), each turned a little its own way, the last one
    narrower."""
    panels = []
    for index in range(4):
        row, column = divmod(index, 2)
        turn = _rotation((1.0, 0.5 * index, -0.3), 0.5 + index)
        fast, slow = turn @ [0.0, 0.0, 1.0], turn @ [0.0, -1.0, 0.0]
        pixels_f = FAST - 4 * (index == 3)
        corner = np.array([DISTANCE_MM + 0.3 * index, (1 - row) * (SLOW * PIXEL_MM + 0.6),
                           (column - 1) * (FAST * PIXEL_MM + 0.6)])
        fast, slow, corner = (tuple(float(v) for v in vector) for vector in (fast, slow, corner))
        panels.append(PanelConfig(f"m{index}", pixels_f, SLOW, PIXEL_MM, fast, slow, None, corner))
    return tuple(panels)


def _frame(origin, axes: np.ndarray) -> dict:
    return {"origin": [float(v) for v in origin], "fast_axis": [float(v) for v in axes[:, 0]],
            "slow_axis": [float(v) for v in axes[:, 1]]}


def _dials_detector(panels: tuple[PanelConfig, ...], turn: np.ndarray) -> dict:
    """The panels as dxtbx writes a hierarchical detector: a root moved and turned, under it groups of two
    panels, each group moved and turned in the root's frame, each panel's vectors in its group's frame."""
    root_origin, root_axes = np.array([1.0, -2.0, -3.0]), _rotation((0.0, 0.2, 1.0), 5.0)
    groups, entries = [], []
    for number, first in enumerate(range(0, len(panels), 2)):
        local_origin, local_axes = np.array([0.5 * number, -1.0, 2.0]), _rotation((1.0, 0.0, 0.4), 3.0 - 7 * number)
        origin, axes = root_origin + root_axes @ local_origin, root_axes @ local_axes
        children = []
        for index in range(first, min(first + 2, len(panels))):
            p = panels[index]
            lab = [turn @ DIALS_TO_NANOBRAGG.T @ np.array(v) for v in (p.pix0_mm, p.fdet_vector, p.sdet_vector)]
            entries.append({"name": f"/entry/instrument/detector/module_{index}_{p.name}", "type": "SENSOR_PAD",
                            **_frame(axes.T @ (lab[0] - origin), axes.T @ np.stack(lab[1:], axis=1)),
                            "image_size": [p.pixels_f, p.pixels_s], "pixel_size": [p.pixel_size_mm] * 2,
                            "trusted_range": [-1.0, 1e6], "thickness": 0.0, "material": "Si", "mu": 0.0,
                            "px_mm_strategy": {"type": "SimplePxMmStrategy"}})
            children.append({"panel": index})
        groups.append({"name": f"group{number}", "type": "", **_frame(local_origin, local_axes),
                       "children": children})
    return {"panels": entries, "hierarchy": {"name": "", "type": "", **_frame(root_origin, root_axes),
                                             "children": groups}}


def _tiled_list(path, panels: tuple[PanelConfig, ...], images: dict | None = None) -> str:
    """A stills experiment list of one lattice (the CRYSTAL's) on a hierarchical detector of `panels`, turned."""
    document = _expt(parse(BASE)[0], TURN, images=images or {"__id__": "ImageSet", "images": ["frame.nxs"],
                                                              "single_file_indices": [0]})
    crystal = [{**_expt(parse(CRYSTAL)[0], TURN)["crystal"][0], "space_group_hall_symbol": " P 1"}]
    document.update(crystal=crystal, detector=[_dials_detector(panels, TURN)])
    del document["goniometer"], document["scan"], document["experiment"][0]["goniometer"]
    del document["experiment"][0]["scan"]
    path.write_text(json.dumps(document))
    return str(path)


def _assert_same_panels(read: tuple[PanelConfig, ...], expected, atol_mm: float = 1e-9) -> None:
    """Panels read back (PanelConfig) lie where `expected` (PanelConfig or PanelPlacement, nanoBragg's frame) do."""
    assert len(read) == len(expected)
    for back, panel in zip(read, expected, strict=True):
        origin, fast, slow = ((panel.origin_mm, panel.fast, panel.slow) if isinstance(panel, PanelPlacement) else
                              (panel.pix0_mm, panel.fdet_vector, panel.sdet_vector))
        np.testing.assert_allclose(back.pix0_mm, origin, rtol=0, atol=atol_mm)
        np.testing.assert_allclose(back.fdet_vector, fast, rtol=0, atol=1e-12)
        np.testing.assert_allclose(back.sdet_vector, slow, rtol=0, atol=1e-12)


def test_a_hierarchical_multi_panel_list_reads_as_the_panels_nbsim_renders(tmp_path):
    """Every panel, its group's and the root's frames composed and the experiment's turn undone, is where the
    panel list put it: nbsim places the same pixels under the same beam, and names the panels after DIALS's."""
    panels = _tiles()
    [start] = read_experiment_list(_tiled_list(tmp_path / "tiled.expt", panels))
    read = start.overrides["panels"]
    assert [p.name for p in read] == [f"module_{index}_m{index}" for index in range(4)]
    assert [(p.pixels_f, p.pixels_s, p.pixel_size_mm) for p in read] == [
        (p.pixels_f, p.pixels_s, pytest.approx(PIXEL_MM)) for p in panels]
    _assert_same_panels(read, panels)
    config = parse(CRYSTAL)[0]
    ours = panel_geometries(config.with_options(**start.overrides).detector)
    truth = panel_geometries(config.with_options(panels=panels).detector)
    for mine, true in zip(ours, truth, strict=True):
        for name in ("pix0_m", "fdet", "sdet", "odet", "beam", "polar"):
            np.testing.assert_allclose(getattr(mine, name).numpy(), getattr(true, name).numpy(), atol=1e-12)


def _refined(start) -> RefinedExperiment:
    """Every panel of `start` moved its own way (a shift and a turn about its first pixel's corner)."""
    placements = []
    for index, panel in enumerate(start.overrides["panels"]):
        turn = _rotation((0.2, 1.0, -0.5 * index), 0.05 * (index + 1))
        placements.append(PanelPlacement(np.array(panel.pix0_mm) + [0.01 * index, -0.02, 0.03],
                                         turn @ panel.fdet_vector, turn @ panel.sdet_vector))
    return RefinedExperiment(start, start.a_matrix_per_A, 1.001, tuple(placements))


def test_refined_panels_written_back_read_back_as_refined_in_the_same_hierarchy(tmp_path):
    [start] = read_experiment_list(_tiled_list(tmp_path / "tiled.expt", _tiles()))
    refined = _refined(start)
    write_experiment_list(tmp_path / "refined.expt", tmp_path / "tiled.expt", [refined])
    written = json.loads((tmp_path / "refined.expt").read_text())["detector"][0]
    source = json.loads((tmp_path / "tiled.expt").read_text())["detector"][0]
    assert written["hierarchy"] == source["hierarchy"]  # the groups stay; the panels move in their frames
    [back] = read_experiment_list(tmp_path / "refined.expt")
    _assert_same_panels(back.overrides["panels"], refined.panels)


def test_dials_spots_on_a_tiled_detector_keep_their_panel(tmp_path):
    """A reflection table's `panel` column: each spot's centre pixel on its own panel (DIALS's panel k is the
    image's k-th)."""
    _refl(tmp_path / "indexed.refl", {0: "lattice"}, [0, 0, 0, -1], [[3.5, 7.2, 0.5], [10.9, 1.1, 0.5],
                                                                   [5.0, 5.0, 0.5], [1.0, 1.0, 0.5]],
          [10.0, 30.0, 20.0, 99.0], panels=[3, 0, 2, 1])
    table = read_reflection_table(tmp_path / "indexed.refl")
    np.testing.assert_array_equal(table.spots("lattice", 0, 10, multi_panel=True), [[0, 1, 10], [2, 5, 5], [3, 7, 3]])
    np.testing.assert_array_equal(table.spots("lattice", 0, 10), [[1, 10], [5, 5], [7, 3]])


def test_an_experiment_list_of_other_panels_than_the_image_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The panels of a list against an NXmx frame of three panels (nbsim's -nxmxfile of a -panelfile detector):
    four panels, one panel, or panels of other sizes are refused before any work."""
    monkeypatch.chdir(tmp_path)
    three = _tiles()[:3]
    write_panel_file("three.yaml", three)
    assert main([*CRYSTAL, "-panelfile", "three.yaml", "-nxmxfile", "frame.nxs", "-compile", "off", "-nonoise"]) == 0
    capsys.readouterr()
    wide = tuple(PanelConfig(p.name, p.pixels_f + 2, p.pixels_s, p.pixel_size_mm, p.fdet_vector, p.sdet_vector,
                             None, p.pix0_mm) for p in three)
    cases = {"four.expt": (_tiles(), "the image holds 3 panels, the model's detector 4"),
             "one.expt": (_tiles()[:1], "the image holds 3 panels, the model's detector one"),
             "wide.expt": (wide, "the image has 20 x 24 pixels (slow x fast), the model 20 x 26")}
    for name, (panels, message) in cases.items():
        _tiled_list(tmp_path / name, panels)
        assert main(["fit", "--expt", name, "--json", "out.json", "--expt-out", "out.expt", "--", "-N", "6",
                     "-default_F", "100"]) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1, error
        assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.expt").exists()


@pytest.mark.skipif(shutil.which("cctbx.python") is None, reason="dxtbx is not installed (cctbx.python: Debian's "
                    "dials package)")
def test_dxtbx_reads_the_written_panels_where_nbsim_put_them_and_nbsim_reads_dxtbx_s_list(tmp_path):
    """dxtbx's reading of the written list (each panel's group frames composed by dxtbx) places every panel where
    nbsim's refined one is, in DIALS's frame; the start list as dxtbx writes it again reads back into the same
    panels."""
    [start] = read_experiment_list(_tiled_list(tmp_path / "tiled.expt", _tiles()))
    refined = _refined(start)
    write_experiment_list(tmp_path / "refined.expt", tmp_path / "tiled.expt", [refined])
    script = ("import json, sys\n"
              "from dxtbx.model.experiment_list import ExperimentListFactory\n"
              "experiments = ExperimentListFactory.from_json_file(sys.argv[1], check_format=False)\n"
              "print(json.dumps([{'origin': p.get_origin(), 'fast': p.get_fast_axis(), 'slow': p.get_slow_axis()}\n"
              "                  for p in experiments[0].detector]))\n"
              "ExperimentListFactory.from_json_file(sys.argv[2], check_format=False).as_file(sys.argv[3])\n")
    done = subprocess.run(["cctbx.python", "-c", script, str(tmp_path / "refined.expt"), str(tmp_path / "tiled.expt"),
                           str(tmp_path / "dxtbx.expt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dxtbx = json.loads(done.stdout.strip().splitlines()[-1])
    to_dials = start.to_nanobragg.T
    assert len(dxtbx) == len(refined.panels) == 4
    for theirs, placement in zip(dxtbx, refined.panels, strict=True):
        np.testing.assert_allclose(theirs["origin"], to_dials @ placement.origin_mm, rtol=0, atol=1e-9)
        np.testing.assert_allclose(theirs["fast"], to_dials @ placement.fast, rtol=0, atol=1e-12)
        np.testing.assert_allclose(theirs["slow"], to_dials @ placement.slow, rtol=0, atol=1e-12)
    [again] = read_experiment_list(tmp_path / "dxtbx.expt")
    _assert_same_panels(again.overrides["panels"], _tiles())


def test_a_fit_from_a_multi_panel_list_writes_its_refined_panels_back(tmp_path, monkeypatch, capsys):
    """`nbsim fit --expt` of a tiled detector's list fits the list's image on its panels; `--expt-out` holds the
    refined crystal and every refined panel (as --panels-out and the JSON have them), in the list's hierarchy."""
    monkeypatch.chdir(tmp_path)
    truth = list(_tiles())
    truth[1] = replace(truth[1], pix0_mm=tuple(float(v) for v in np.array(truth[1].pix0_mm) + [0.0, 0.05, -0.04]))
    write_panel_file("truth.yaml", truth)
    assert main([*CRYSTAL, "-panelfile", "truth.yaml", "-nxmxfile", "frame.nxs", "-compile", "off", "-nonoise"]) == 0
    _tiled_list(tmp_path / "tiled.expt", _tiles())
    code = main(["fit", "--expt", "tiled.expt", "--refine", "orientation,scale,panels", "--shared", "panels",
                 "--search-deg", "0", "--spots", "30", "--max-iterations", "2", "--compile", "off", "--quiet",
                 "--json", "fit.json", "--panels-out", "refined.yaml", "--expt-out", "refined.expt", "--", "-N", "6",
                 "-oversample", "1", "-default_F", "100"])
    capsys.readouterr()
    assert code in (0, 3)
    document = json.loads((tmp_path / "fit.json").read_text())
    [back] = read_experiment_list("refined.expt")
    refined = read_panel_file("refined.yaml")
    _assert_same_panels(back.overrides["panels"], refined)
    assert np.linalg.norm(np.array(refined[1].pix0_mm) - _tiles()[1].pix0_mm) > 1e-3  # moved towards the truth
    np.testing.assert_allclose(back.a_matrix_per_A, document["shots"][0]["A_matrix"], rtol=1e-12)
    written = json.loads((tmp_path / "refined.expt").read_text())["detector"][0]
    assert written["hierarchy"] == json.loads((tmp_path / "tiled.expt").read_text())["detector"][0]["hierarchy"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dials.import") is None, reason="DIALS is not installed (dials.import, "
                    "cctbx.python: Debian's dials package)")
def test_dials_imports_nbsim_s_tiled_nxmx_as_its_panels(tmp_path, monkeypatch, capsys):
    """`dials.import` of nbsim's NXmx of a -panelfile detector, its noise counts (-nxmxfile) and its noise image
    (-noisefile): a detector of its panels, which nbsim reads back where the panel file put them, each panel's
    pixels (dxtbx's raw data) the frame's panel as nbsim reads it, the noise image's the counts + the -adc pedestal
    and trusted up to 65535 (its 16 bits)."""
    monkeypatch.chdir(tmp_path)
    write_panel_file("tiles.yaml", _tiles())
    assert main([*CRYSTAL, "-panelfile", "tiles.yaml", "-nxmxfile", "frame.nxs", "-noisefile", "noise.nxs", "-seed",
                 "3", "-fluence", "1e29", "-compile", "off"]) == 0
    capsys.readouterr()
    for name in ("frame", "noise"):
        done = subprocess.run(["dials.import", f"{name}.nxs", f"output.experiments={name}.expt"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    document = json.loads((tmp_path / "frame.expt").read_text())
    document["crystal"] = _expt(parse(CRYSTAL)[0])["crystal"]  # read_experiment_list starts from a lattice
    document["experiment"][0]["crystal"] = 0
    (tmp_path / "with_crystal.expt").write_text(json.dumps(document))
    [start] = read_experiment_list("with_crystal.expt")
    _assert_same_panels(start.overrides["panels"], _tiles())
    script = ("import json, sys\n"
              "from dxtbx.model.experiment_list import ExperimentListFactory\n"
              "for name in sys.argv[1:]:\n"
              "    [e] = ExperimentListFactory.from_json_file(name)\n"
              "    print(json.dumps({'pixels': [panel.as_numpy_array().ravel().tolist()\n"
              "                                 for panel in e.imageset.get_raw_data(0)],\n"
              "                      'trusted': [list(panel.get_trusted_range()) for panel in e.detector]}))\n")
    done = subprocess.run(["cctbx.python", "-c", script, "frame.expt", "noise.expt"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    frame_raw, noise_raw = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    frame = read_observed("frame.nxs", panels=[(p.pixels_s, p.pixels_f) for p in _tiles()]).counts
    for index, (pixels, noise, panel) in enumerate(zip(frame_raw["pixels"], noise_raw["pixels"], _tiles(),
                                                       strict=True)):
        counts = frame[index, :panel.pixels_s, :panel.pixels_f]
        np.testing.assert_array_equal(np.reshape(pixels, (panel.pixels_s, panel.pixels_f)), counts)
        np.testing.assert_array_equal(np.reshape(noise, (panel.pixels_s, panel.pixels_f)), counts + 40)
    assert frame.max() > 0 and np.any(frame != np.round(frame.mean()))
    assert [high for _, high in noise_raw["trusted"]] == [65535] * 4


def test_the_documented_tiled_loop_is_the_benchmark():
    """docs/fitting.md shows the commands benchmarks/dials_panels.py runs (it runs them there: 15-25 minutes)."""
    text = (REPO_ROOT / "docs" / "fitting.md").read_text()
    marker = text.index("<!-- not run: benchmarks/dials_panels.py")
    start = text.index("```sh\n", marker) + len("```sh\n")
    block = text[start:text.index("```", start)]
    lines = [line.split() for line in block.replace("\\\n", " ").splitlines()]
    still = dials_panels.CRYSTAL
    renders = [words[1:] for words in lines if words[:1] == [".venv/bin/nbsim"] and "-cell" in words]
    assert renders == [[*still, "-panelfile", "nominal.yaml", "-nxmxfile", "nominal.nxs"],
                       [*still, "-panelfile", "truth.yaml", "-misset", "$misset", "-nxmxfile", "still_$shot.nxs"]]
    assert "for misset in " + " ".join(f'"{misset}"' for misset in dials_panels.MISSETS) + "; do" in block
    [fit] = [words for words in lines if words[:2] == [".venv/bin/nbsim", "fit"]]
    assert fit[1:] == dials_panels.FIT
    dials_commands = [words for words in lines if words[0].startswith("dials.")]
    assert dials_commands == dials_panels.DIALS_STEPS + dials_panels.INTEGRATE
