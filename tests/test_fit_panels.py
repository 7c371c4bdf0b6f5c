"""Fits on multi-panel detectors (nbsim.fit, `nbsim fit` with -panelfile): the model renders every panel's pixels
as the renderer does, shoeboxes stay on their panel, a stacked -floatfile reads back as the panels; a displaced
module is found again (`--refine panels`) within the fit's own standard errors; the refined detector is written
as a panel list nbsim renders and as a CrystFEL geometry that reads back; bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from scipy.spatial.transform import Rotation

import nbsim
from nbsim.cli import main
from nbsim.fit.images import panel_pixels, read_fit_image
from nbsim.fit.model import DiffractionModel
from nbsim.fit.panels import moved_panels, panel_groups
from nbsim.fit.parameters import misorientation_deg
from nbsim.fit.pixels import shoeboxes
from nbsim.io.panels import read_panel_file
from nbsim.render import Renderer
from nbsim.resolve import resolve

PIXEL_MM, FAST, SLOW, GAP_MM, DISTANCE_MM = 0.3, 40, 30, 1.0, 60.0
CRYSTAL = "-default_F 100 -cell 40 50 60 90 90 90 -N 6 -lambda 1.0 -oversample 1 -fluence 1e27".split()
MISSETS = ("10 20 30", "-40 65 5", "70 -15 120")
SHIFT_MM = np.array([0.0, 0.07, -0.05])
ROTATION_DEG = np.array([0.2, 0.0, 0.0])
"""The displaced module's move: 0.07 and 0.05 mm across the beam, 0.2° about its normal."""


def _modules(move: tuple[np.ndarray, np.ndarray] | None = None) -> list[dict]:
    """Three modules in a row across the beam (fast along lab +z, slow along -y; the middle one on the beam, the last
    one narrower, so the stack is padded), the last one `move`d (shift mm, rotation vector degrees, about its
    centre)."""
    width, height = FAST * PIXEL_MM, SLOW * PIXEL_MM
    panels = []
    for index in range(3):
        pixels_f = FAST - 8 * (index == 2)
        pix0 = np.array([DISTANCE_MM, height / 2 + (index - 1) * 0.4, -1.5 * width - GAP_MM + index * (width + GAP_MM)])
        fast, slow = np.array([0.0, 0.0, 1.0]), np.array([0.0, -1.0, 0.0])
        if index == 2 and move is not None:
            rotation = Rotation.from_rotvec(np.radians(move[1])).as_matrix()
            centre = pix0 + pixels_f * PIXEL_MM / 2 * fast + height / 2 * slow
            pix0, fast, slow = centre + move[0] + rotation @ (pix0 - centre), rotation @ fast, rotation @ slow
        panels.append({"name": f"m{index}", "pixels": [pixels_f, SLOW], "pixel_mm": PIXEL_MM, "fdet": fast.tolist(),
                       "sdet": slow.tolist(), "pix0_mm": pix0.tolist()})
    return panels


def _write(path, panels: list[dict]) -> str:
    path.write_text(yaml.safe_dump({"panels": panels}))
    return str(path)


@pytest.fixture(scope="module")
def displaced(tmp_path_factory):
    """Three Poisson stills on the displaced detector, written as -floatfile stacks them, the start's panel file
    and a groups file moving the displaced module (the others hold the frame: a rotation of every module about
    the beam is a rotation of every crystal)."""
    folder = tmp_path_factory.mktemp("fit_panels")
    truth = _write(folder / "truth.yaml", _modules((SHIFT_MM, ROTATION_DEG)))
    _write(folder / "start.yaml", _modules())
    (folder / "groups.yaml").write_text("side: [m2]\n")
    rng = np.random.default_rng(5)
    for shot, misset in enumerate(MISSETS):
        setup = resolve(nbsim.config_from_args([*CRYSTAL, "-misset", *misset.split(), "-panelfile", truth]))
        photons = Renderer(setup, dtype=torch.float64, compile="off")().numpy()
        counts = rng.poisson(photons).astype(np.float32)
        np.concatenate([counts[i, :g.pixels_s, :g.pixels_f].ravel() for i, g in enumerate(setup.panels)]).tofile(
            folder / f"shot_{shot}.bin")
    return folder


def _start(folder, misset: str = MISSETS[0]):
    return resolve(nbsim.config_from_args([*CRYSTAL, "-misset", *misset.split(), "-panelfile",
                                           str(folder / "start.yaml")]))


def test_a_stacked_floatfile_reads_back_as_its_panels_and_shoeboxes_stay_on_theirs(displaced):
    setup = _start(displaced)
    image = read_fit_image(str(displaced / "shot_0.bin"), setup)
    assert image.counts.shape == (3, SLOW, FAST)
    assert image.usable[:2].all() and image.usable[2, :, :FAST - 8].all() and not image.usable[2, :, FAST - 8:].any()
    np.testing.assert_array_equal(panel_pixels(setup), image.usable)
    predicted = Renderer(setup, dtype=torch.float64, compile="off")().numpy()
    boxes = shoeboxes(predicted, image.counts, image.usable, 9, 40)
    assert boxes.panel is not None and np.all(np.diff(boxes.panel) >= 0)
    for box in range(len(boxes.centres)):
        assert len(set(boxes.panel[boxes.box == box])) == 1
    np.testing.assert_array_equal(boxes.take(image.counts), image.counts[boxes.panel, boxes.rows, boxes.cols])


def test_a_multi_panel_nxmx_frame_reads_back_as_its_panels(displaced, tmp_path, monkeypatch, capsys):
    """`-nxmxfile` of a -panelfile detector (frames x panels x slow x fast, padded; its noise-free counts under
    -nonoise) is what the fit reads."""
    monkeypatch.chdir(tmp_path)
    flags = [*CRYSTAL, "-misset", *MISSETS[0].split(), "-panelfile", str(displaced / "start.yaml")]
    assert main([*flags, "-nxmxfile", "frame.nxs", "-scale", "1", "-nonoise"]) == 0
    capsys.readouterr()
    setup = _start(displaced)
    image = read_fit_image("frame.nxs", setup)
    photons = Renderer(setup, dtype=torch.float64, compile="off")().numpy()
    assert image.counts.shape == (3, SLOW, FAST)
    np.testing.assert_array_equal(image.usable, panel_pixels(setup))
    assert np.abs(image.counts - photons)[image.usable].max() <= 0.5 + 1e-6 * photons.max()


def test_nbsim_fit_refines_a_still_from_its_multi_panel_noise_file(displaced, tmp_path, monkeypatch, capsys):
    """`nbsim -panelfile ... -noisefile` (NXmx of the panels' Poisson counts and the -adc pedestal, which the fit
    takes off) is a still `nbsim fit` reads: a start 0.17° off in orientation comes back within 0.02° (0.0065° when
    written, from 12,000 photons)."""
    monkeypatch.chdir(tmp_path)
    crystal = [*CRYSTAL, "-fluence", "1e28", "-panelfile", str(displaced / "start.yaml")]
    truth = [*crystal, "-misset", *MISSETS[0].split()]
    assert main([*truth, "-seed", "7", "-noisefile", "still.nxs", "-compile", "off"]) == 0
    start = [*crystal, "-misset", "10.1", "20.05", "29.9"]
    code = main(["fit", "still.nxs", "--refine", "orientation,scale", "--search-deg", "0", "--spots", "25",
                 "--compile", "off", "--quiet", "--json", "fit.json", "--", *start])
    capsys.readouterr()
    document = json.loads((tmp_path / "fit.json").read_text())
    assert code == 0, document["reason"]
    true_a = resolve(nbsim.config_from_args(truth)).lattice.reciprocal_per_A
    start_a = resolve(nbsim.config_from_args(start)).lattice.reciprocal_per_A
    assert misorientation_deg(start_a, true_a) > 0.15
    assert misorientation_deg(torch.tensor(document["shots"][0]["A_matrix"]), true_a) < 0.02


def test_every_panels_pixels_render_as_the_renderer_renders_them(displaced):
    """One pixel list of every panel: on the crystal's fixed scattering vectors, and through autograd with the
    panel groups at their start; and a group moved as the truth's module was renders the truth's image."""
    setup = _start(displaced)
    image = Renderer(setup, dtype=torch.float64, compile="off")().numpy()
    where = np.nonzero(image > 0.01 * image.max())
    groups = panel_groups(setup, {"side": ["m2"]})
    for refine, shared in ((["orientation", "scale"], []), (["orientation", "panels"], ["panels"])):
        model = DiffractionModel([setup], [where], refine, shared, compile="off", groups=groups)
        assert (model.scattering is None) == ("panels" in refine)
        with torch.no_grad():
            rendered = model()[0].numpy()
        np.testing.assert_allclose(rendered, image[where], rtol=1e-10, atol=1e-12 * image.max())
    truth = resolve(nbsim.config_from_args([*CRYSTAL, "-misset", *MISSETS[0].split(), "-panelfile",
                                            str(displaced / "truth.yaml")]))
    moves = torch.tensor([*SHIFT_MM, *ROTATION_DEG], dtype=torch.float64)
    for moved, true in zip(moved_panels(setup.panels, groups, moves), truth.panels, strict=True):
        for name in ("pix0_m", "fdet", "sdet", "odet"):
            torch.testing.assert_close(getattr(moved, name), getattr(true, name), rtol=0, atol=1e-12)


def test_nbsim_fit_finds_a_displaced_module_within_its_standard_errors(displaced, tmp_path, monkeypatch, capsys):
    """Three stills, the side module 70 and 50 µm off across the beam and turned 0.2° about its normal: `nbsim fit
    --refine orientation,scale,panels` with the outer modules holding the frame finds its move within three of
    its standard errors in each in-plane component (the standard errors themselves a fifth of the move or
    less), writes the refined detector as a panel list that nbsim renders and as a CrystFEL geometry that reads
    back as the same panels."""
    monkeypatch.chdir(displaced)
    shots = [f"shot_{shot}.bin" for shot in range(len(MISSETS))]
    starts = tmp_path / "starts.json"
    starts.write_text(json.dumps({"images": {shot: {"misset": misset.split()} for shot, misset in
                                             zip(shots, MISSETS, strict=True)}}))
    code = main(["fit", *shots, "--starts", str(starts), "--refine", "orientation,scale,panels", "--shared", "panels",
                 "--groups", "groups.yaml", "--search-deg", "0", "--spots", "40", "--compile", "off", "--quiet",
                 "--json", str(tmp_path / "fit.json"), "--panels-out", str(tmp_path / "refined.yaml"),
                 "--geom-out", str(tmp_path / "refined.geom"), "--", *CRYSTAL, "-panelfile", "start.yaml"])
    capsys.readouterr()
    document = json.loads((tmp_path / "fit.json").read_text())
    assert code == 0, document["reason"]
    (group,) = document["detector"]["groups"]
    assert group["name"] == "side" and group["panels"] == ["m2"]
    found = {"shift": (np.array(group["shift_mm"]), np.array(group["sigma"]["shift_mm"]), SHIFT_MM),
             "rotation": (np.array(group["rotation_deg"]), np.array(group["sigma"]["rotation_deg"]), ROTATION_DEG)}
    for name, components in (("shift", (1, 2)), ("rotation", (0,))):
        value, sigma, true = found[name]
        for axis in components:
            assert abs(value[axis] - true[axis]) <= 3.0 * sigma[axis], (name, axis, value, sigma)
            assert sigma[axis] <= 0.2 * min(abs(true[index]) for index in components), (name, sigma)
    refined = read_panel_file(tmp_path / "refined.yaml")
    assert [p.name for p in refined] == ["m0", "m1", "m2"]
    assert all(shot["flags"][shot["flags"].index("-panelfile") + 1] == str(tmp_path / "refined.yaml")
               for shot in document["shots"])
    start = {p.name: p for p in read_panel_file(displaced / "start.yaml")}
    assert refined[0].pix0_mm == pytest.approx(start["m0"].pix0_mm, abs=1e-12)
    assert refined[1].pix0_mm == pytest.approx(start["m1"].pix0_mm, abs=1e-12)
    centre = np.array(group["centre_mm"])
    rotation = Rotation.from_rotvec(np.radians(group["rotation_deg"])).as_matrix()
    moved = centre + np.array(group["shift_mm"]) + rotation @ (np.array(start["m2"].pix0_mm) - centre)
    assert refined[2].pix0_mm == pytest.approx(moved.tolist(), abs=1e-9)
    for geom, yaml_panel in zip(read_panel_file(tmp_path / "refined.geom"), refined, strict=True):
        assert geom.name == yaml_panel.name and geom.pixel_size_mm == pytest.approx(yaml_panel.pixel_size_mm)
        for name in ("pix0_mm", "fdet_vector", "sdet_vector"):
            assert getattr(geom, name) == pytest.approx(getattr(yaml_panel, name), abs=1e-9)
    rendered = nbsim.simulate(nbsim.config_from_args([*CRYSTAL, "-misset", *MISSETS[0].split(), "-panelfile",
                                                      str(tmp_path / "refined.yaml")]), compile="off")
    assert rendered.shape == (3, SLOW, FAST) and float(rendered.sum()) > 0


def test_the_crystfel_geometry_holds_the_groups_and_the_data_layout(displaced, tmp_path):
    from cfelpyutils.geometry import load_crystfel_geometry

    from nbsim.io.panels import write_crystfel_geometry

    panels = read_panel_file(displaced / "truth.yaml")
    write_crystfel_geometry(tmp_path / "truth.geom", panels, {"side": ["m2"], "others": ["m0", "m1"]})
    geometry = load_crystfel_geometry(str(tmp_path / "truth.geom"))
    assert geometry.detector["rigid_groups"] == {"side": ["m2"], "others": ["m0", "m1"]}
    assert [geometry.detector["panels"][p.name]["dim_structure"] for p in panels] == [["%", "ss", "fs"]] * 3
    assert [geometry.detector["panels"][p.name]["orig_min_ss"] for p in panels] == [0, SLOW, 2 * SLOW]
    for back, panel in zip(read_panel_file(tmp_path / "truth.geom"), panels, strict=True):
        assert back.pix0_mm == pytest.approx(panel.pix0_mm, abs=1e-9)
        assert back.fdet_vector == pytest.approx(panel.fdet_vector, abs=1e-12)


OVERLAPPING_GEOM = """clen = 0.06
res = 10000
adu_per_photon = 1
a/min_fs = 0
a/max_fs = 31
a/min_ss = 0
a/max_ss = 15
a/fs = +1.0x +0.0y
a/ss = +0.0x +1.0y
a/corner_x = -16
a/corner_y = -16
b/min_fs = 0
b/max_fs = 31
b/min_ss = 16
b/max_ss = 31
b/fs = +1.0x +0.0y
b/ss = +0.0x +1.0y
b/corner_x = -10
b/corner_y = -8
"""


PANELS = ["--refine", "orientation,panels", "--shared", "panels"]


@pytest.mark.parametrize(("change", "detector", "message"), [
    (["--refine", "orientation,panels"], None, "refine them once with --shared panels"),
    ([*PANELS, "--groups", "bad_groups.yaml"], None, "bad_groups.yaml: group 'g': no panel 'm9'"),
    (["--groups", "all"], None, "--groups says which panels --refine panels moves"),
    (PANELS, ["-panelfile", "overlap.geom"], "overlap.geom: panel 'b' overlaps panel 'a'"),
    (PANELS, ["-detpixels", "32", "-pixel", "0.3"], "this detector is one panel"),
])
def test_bad_panel_fits_are_one_line(displaced, tmp_path, monkeypatch, capsys, change, detector, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_groups.yaml").write_text("g: [m0, m9]\n")
    (tmp_path / "overlap.geom").write_text(OVERLAPPING_GEOM)
    (tmp_path / "shot.bin").write_bytes((displaced / "shot_0.bin").read_bytes())
    detector = detector or ["-panelfile", str(displaced / "start.yaml")]
    assert main(["fit", "shot.bin", *change, "--json", "out.json", "--panels-out", "out.yaml", "--", *CRYSTAL,
                 *detector]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.yaml").exists()


def test_a_module_patterns_gaps_hold_no_fitted_pixel():
    """A -detector_model's modules are one panel with gaps between them (docs/detector.md): the gaps are masked,
    and no shoebox pixel lies in one."""
    setup = resolve(nbsim.config_from_args([*CRYSTAL, "-detector_model", "jungfrau4m", "-detpixels", "600",
                                            "-distance", "80"]))
    assert setup.panels is None and setup.gaps is not None and setup.gaps.any()
    usable = setup.mask.astype(bool)
    rows, cols = np.indices((600, 600))
    predicted = np.where(usable, np.cos(rows * 0.7) ** 16 * np.cos(cols * 0.7) ** 16 + 1e-3, 0.0)
    boxes = shoeboxes(predicted, predicted, usable, 9, 400, use_observed_spots=False)
    in_gap_rows = setup.gaps.all(axis=1)
    assert boxes.count > 1000 and in_gap_rows.any()
    assert not setup.gaps[boxes.rows, boxes.cols].any()
