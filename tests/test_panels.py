"""Multi-panel detectors (-panelfile): panels that tile one flat detector give its image pixel for pixel; each
panel of a tilted, shifted detector equals the single-panel custom-convention render the C would be given
for it (geometry.single_panel_flags); the outputs keep the panels; bad panel files are one-line errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

from nbsim.cli import main
from nbsim.config import DetectorResponseConfig
from nbsim.detector import PanelLayout, PixelLayout, detector_image, layout_of
from nbsim.errors import NbsimError
from nbsim.model.geometry import panel_geometries, single_panel_flags
from nbsim.nanobragg import parse
from nbsim.render import Renderer
from nbsim.resolve import resolve

CRYSTAL = ["-cell", "60", "70", "80", "90", "95", "90", "-default_F", "100", "-N", "4", "-lambda", "1.1",
           "-misset", "10", "20", "5", "-oversample", "2", "-mosaic", "0.3", "-mosaic_domains", "2"]


def _panel(name, pixels, pixel_mm, fdet, sdet, pix0_mm, odet=None) -> dict:
    entry = {"name": name, "pixels": list(pixels), "pixel_mm": pixel_mm, "fdet": list(fdet), "sdet": list(sdet),
             "pix0_mm": list(pix0_mm)}
    if odet is not None:
        entry["odet"] = list(odet)
    return entry


def _write(tmp_path, panels: list[dict], name: str = "panels.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"panels": panels}))
    return str(path)


def _render(argv: list[str]) -> torch.Tensor:
    config, _ = parse(argv)
    return Renderer(resolve(config), dtype=torch.float64, compile="off")()


def test_panels_tiling_one_flat_detector_give_its_image(tmp_path):
    """Four panels of unequal sizes cutting a 96 x 80 custom-convention detector (so the stack is padded)."""
    pixel_mm, (fast, slow) = 0.1, (96, 80)
    single = _render(CRYSTAL + ["-fdet_vector", "0", "0", "1", "-sdet_vector", "0", "-1", "0", "-odet_vector", "1",
                                "0", "0", "-beam_vector", "1", "0", "0", "-detpixels_f", str(fast), "-detpixels_s",
                                str(slow), "-pixel", str(pixel_mm), "-Xbeam", "3.1", "-Ybeam", "4.2", "-distance",
                                "60"])
    corner = np.array([60.0, 4.2, -3.1])
    cuts_f, cuts_s = (0, 40, fast), (0, 30, slow)
    panels, where = [], []
    for j in range(2):
        for i in range(2):
            f0, s0 = cuts_f[i], cuts_s[j]
            pix0 = corner + pixel_mm * np.array([0.0, -s0, f0])
            panels.append(_panel(f"q{j}{i}", (cuts_f[i + 1] - f0, cuts_s[j + 1] - s0), pixel_mm, (0, 0, 1),
                                 (0, -1, 0), pix0.tolist()))
            where.append((s0, cuts_s[j + 1], f0, cuts_f[i + 1]))
    stacked = _render(CRYSTAL + ["-panelfile", _write(tmp_path, panels)])
    assert stacked.shape == (4, 50, 56)
    for index, (s0, s1, f0, f1) in enumerate(where):
        panel = stacked[index]
        torch.testing.assert_close(panel[:s1 - s0, :f1 - f0], single[s0:s1, f0:f1], rtol=1e-10,
                                   atol=1e-14 * float(single.max()))
        assert not panel[s1 - s0:].any() and not panel[:, f1 - f0:].any()


def _tilted_panels() -> list[dict]:
    """Three panels: tilted about different axes, shifted, of different sizes and pixel sizes."""
    def rotated(vector, turns):
        v = np.array(vector, dtype=float)
        for axis, angle_deg in turns:
            k, a = np.array(axis, dtype=float), math.radians(angle_deg)
            v = v * math.cos(a) + np.cross(k, v) * math.sin(a) + k * (k @ v) * (1 - math.cos(a))
        return v.tolist()

    tilt, roll = [((0, 1, 0), 25), ((0, 0, 1), -10)], [((1, 0, 0), 30), ((0, 1, 0), -8)]
    return [
        _panel("flat", (40, 32), 0.1, (0, 0, 1), (0, -1, 0), (80.0, 1.6, -2.0)),
        _panel("tilted", (48, 24), 0.12, rotated((0, 0, 1), tilt), rotated((0, -1, 0), tilt), (75.0, 6.0, 3.0)),
        _panel("rolled", (24, 36), 0.09, rotated((0, 0, -1), roll), rotated((0, 1, 0), roll), (78.0, -5.0, 2.5),
               odet=rotated((1, 0, 0), roll)),
    ]


def test_each_tilted_panel_equals_its_single_panel_custom_render(tmp_path):
    """Each panel equals the render of nanoBragg's flags for that panel alone (what the C is checked with in
    benchmarks/panels_vs_c.py): a pix0 recomputed by the C from -Xbeam/-Ybeam/-distance."""
    beam = ["-beam_vector", "0.999", "0.03", "-0.02"]
    argv = CRYSTAL + beam + ["-panelfile", _write(tmp_path, _tilted_panels())]
    config, _ = parse(argv)
    stacked = Renderer(resolve(config), dtype=torch.float64, compile="off")()
    for index, geometry in enumerate(panel_geometries(config.detector)):
        alone = _render(CRYSTAL + single_panel_flags(geometry))
        panel = stacked[index, :geometry.pixels_s, :geometry.pixels_f]
        assert alone.shape == panel.shape
        torch.testing.assert_close(panel, alone, rtol=1e-9, atol=1e-12 * float(alone.max()))


def test_floatfile_stacks_the_panels_and_nxmx_has_one_module_per_panel(tmp_path, monkeypatch):
    """-floatfile holds each panel's slow x fast pixels in the file's order; the NXmx file read back with the
    nxmx reader places every module's pixels where the panel's are (frame-free: distance from the sample and
    angle from the beam) and holds each panel's counts in its data slab, the panels one below the other."""
    nxmx = pytest.importorskip("nxmx")
    import h5py

    monkeypatch.chdir(tmp_path)
    argv = CRYSTAL + ["-panelfile", _write(tmp_path, _tilted_panels()), "-floatfile", "float.bin",
                      "-nxmxfile", "image.nxs", "-dtype", "float64", "-compile", "off", "-scale", "3", "-nonoise"]
    assert main(argv) == 0
    config, _ = parse(argv)
    image = Renderer(resolve(config), dtype=torch.float64, compile="off")().numpy()
    geometries = panel_geometries(config.detector)
    stacked = np.fromfile("float.bin", dtype=np.float32)
    expected = np.concatenate([image[i, :g.pixels_s, :g.pixels_f].ravel() for i, g in enumerate(geometries)])
    np.testing.assert_array_equal(stacked, expected.astype(np.float32))
    with h5py.File("image.nxs") as handle:
        entry = nxmx.NXmx(handle).entries[0]
        detector = entry.instruments[0].detectors[0]
        data = entry.data[0][entry.data[0].signal]
        assert data.shape == (1, 3 * 36, 48)
        assert len(detector.modules) == 3
        for index, (module, g) in enumerate(zip(detector.modules, geometries, strict=True)):
            np.testing.assert_array_equal(module.data_origin, [index * 36, 0])
            np.testing.assert_array_equal(module.data_size, [g.pixels_s, g.pixels_f])
            chain = nxmx.get_dependency_chain(module.fast_pixel_direction)
            placement = nxmx.get_cumulative_transformation(chain[1:])[0]
            fast = placement[:3, :3] @ module.fast_pixel_direction.vector
            slow = placement[:3, :3] @ module.slow_pixel_direction.vector
            pixel_mm = module.fast_pixel_direction[()].to("mm").magnitude[0]
            assert pixel_mm == pytest.approx(g.pixel_size_m * 1000.0)
            for f, s in ((0.5, 0.5), (g.pixels_f - 0.5, 1.5)):
                ours = (g.pix0_m.numpy() + (f * g.fdet.numpy() + s * g.sdet.numpy()) * g.pixel_size_m) * 1000.0
                theirs = placement[:3, 3] + (f * fast + s * slow) * pixel_mm
                assert np.linalg.norm(theirs) == pytest.approx(np.linalg.norm(ours), rel=1e-12)
                assert theirs[2] / np.linalg.norm(theirs) == pytest.approx(
                    ours @ g.beam.numpy() / np.linalg.norm(ours), rel=1e-12)
            counts = data[0, index * 36:(index + 1) * 36]
            panel = image[index, :g.pixels_s, :g.pixels_f]
            # int32 counts of the -intfile image (-nonoise): no -adc pedestal and no 16-bit clamp (docs/formats.md)
            expected_counts = np.floor(np.maximum(panel.astype(np.float32).astype(np.float64) * 3, 0) + 0.5)
            np.testing.assert_array_equal(counts[:g.pixels_s, :g.pixels_f], expected_counts)
            assert not counts[g.pixels_s:].any() and not counts[:, g.pixels_f:].any()


GEOM = """clen = 0.08
res = 10000
p0/min_fs = 0
p0/max_fs = 31
p0/min_ss = 0
p0/max_ss = 15
p0/fs = +1.0x +0.0y
p0/ss = +0.0x +1.0y
p0/corner_x = -16
p0/corner_y = -16
p1/min_fs = 0
p1/max_fs = 31
p1/min_ss = 16
p1/max_ss = 31
p1/fs = +1.0x +0.0y
p1/ss = +0.0x +1.0y
p1/corner_x = -16
p1/corner_y = 0
"""


def test_a_crystfel_geometry_is_read_into_the_lab_frame(tmp_path):
    """CrystFEL's (x, y, z) (beam along z, y up) is nbsim's (z, y, -x); corners, clen and res in metres."""
    path = tmp_path / "two.geom"
    path.write_text(GEOM)
    config, _ = parse(CRYSTAL + ["-panelfile", str(path)])
    first, second = config.detector.panels
    assert (first.name, first.pixels_f, first.pixels_s) == ("p0", 32, 16)
    assert first.pixel_size_mm == pytest.approx(0.1)
    assert first.fdet_vector == pytest.approx((0.0, 0.0, -1.0)) and first.sdet_vector == pytest.approx((0, 1, 0))
    assert first.pix0_mm == pytest.approx((80.0, -1.6, 1.6))
    assert second.pix0_mm == pytest.approx((80.0, 0.0, 1.6))
    assert _render(CRYSTAL + ["-panelfile", str(path)]).shape == (2, 16, 32)


GOOD = dict(name="a", pixels=[8, 8], pixel_mm=0.1, fdet=[0, 0, 1], sdet=[0, -1, 0], pix0_mm=[50, 0.4, -0.4])


@pytest.mark.parametrize("panels, message", [
    ([{k: v for k, v in GOOD.items() if k != "pixel_mm"}], "panel 'a': missing pixel_mm"),
    ([{**GOOD, "colour": 1}], "panel 'a': unknown key(s) colour"),
    ([{**GOOD, "pixels": [0, 8]}], "panel 'a': no pixels (0 x 8"),
    ([{**GOOD, "pixels": [8]}], "panel 'a': pixels must be two integers"),
    ([{**GOOD, "fdet": [0, 0, 0]}], "panel 'a': fdet has zero length"),
    ([{**GOOD, "sdet": [0, 0, 2]}], "panel 'a': fdet and sdet are parallel"),
    ([{**GOOD, "odet": [-1, 0, 0]}], "panel 'a': odet must point away from the sample"),
    ([{**GOOD, "pix0_mm": [50, "x", 0]}], "panel 'a': pix0_mm must be a finite number"),
    ([GOOD, {**GOOD, "name": "b", "pix0_mm": [60, 0.5, -0.5]}], "panel 'b' overlaps panel 'a'"),
    ([GOOD, {**GOOD, "name": "a", "pix0_mm": [50, 1.2, -0.4]}], "panel 'a': two panels have this name"),
])
def test_bad_panel_files_are_one_line_errors_and_write_nothing(panels, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, panels)
    assert main(CRYSTAL + ["-panelfile", path, "-nxmxfile", "image.nxs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nbsim: error: {path}: {message}") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["panels.yaml"]


def test_touching_panels_are_not_overlapping_and_a_rejected_geom_is_one_line(tmp_path, capsys):
    neighbour = {**GOOD, "name": "b", "pix0_mm": [50, 0.4, 0.4]}
    config, _ = parse(CRYSTAL + ["-panelfile", _write(tmp_path, [GOOD, neighbour])])
    assert len(config.detector.panels) == 2
    bad = tmp_path / "bad.geom"
    bad.write_text(GEOM.replace("p1/fs = +1.0x +0.0y", "p1/fs = sideways"))
    assert main(CRYSTAL + ["-panelfile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nbsim: error: {bad}: CrystFEL geometry rejected by cfelpyutils") and err.count("\n") == 1
    mirrored = tmp_path / "mirrored.geom"
    mirrored.write_text(GEOM.replace("p1/ss = +0.0x +1.0y", "p1/ss = +0.0x -1.0y"))
    assert main(CRYSTAL + ["-panelfile", str(mirrored)]) == 2
    assert capsys.readouterr().err == (f"nbsim: error: {mirrored}: panel 'p1': fs x ss points towards the sample (a "
                                       "mirrored read-out); nbsim's panels face away from it, fs x ss along +z for a "
                                       "panel across the beam: reverse ss (and corner_y) or fs (and corner_x)\n")


@pytest.mark.parametrize("flag", [["-intfile", "x.img"], ["-pgmfile", "x.pgm"], ["-cbffile", "x.cbf"],
                                  ["-distance", "90"], ["-roi", "0", "3", "0", "3"], ["-detpixels", "64"]])
def test_single_panel_flags_and_files_are_refused_with_a_panel_file(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(CRYSTAL + ["-panelfile", _write(tmp_path, [GOOD]), *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nbsim: error: {flag[0]} ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["panels.yaml"]


@pytest.mark.parametrize("flag", [["-noisefile", "noise.img"], ["-noiseimage", "noise.SMV"],
                                  ["-nxmxfile", "frame.cbf"]])
def test_an_nxmx_file_named_as_smv_or_cbf_is_refused_before_rendering(flag, tmp_path, monkeypatch, capsys):
    """A multi-panel -noisefile (and -nxmxfile) is NXmx: a name whose suffix says SMV or miniCBF is refused as
    the arguments are parsed, naming the suffixes to use."""
    monkeypatch.chdir(tmp_path)
    assert main(CRYSTAL + ["-panelfile", _write(tmp_path, [GOOD]), *flag]) == 2
    captured = capsys.readouterr()
    shown = "-noisefile" if flag[0] == "-noiseimage" else flag[0]
    assert captured.err.startswith(f"nbsim: error: {shown} {flag[1]}: the file is NXmx (HDF5)")
    assert ".h5, .nxs" in captured.err and captured.err.count("\n") == 1 and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["panels.yaml"]


def test_a_panel_detector_draws_noise_only_for_a_file_that_holds_it(tmp_path):
    """With -panelfile the noise image is drawn (rendering in float64, as nanoBragg's noise asks) for -nxmxfile or a
    named -noisefile, not for -floatfile alone (nanoBragg's default noise file is SMV, one panel): detector flags
    are then noted as changing nothing."""
    panel_file = ["-panelfile", _write(tmp_path, [GOOD])]
    for extra, noise, dtype in (([], False, "float32"), (["-nxmxfile", "x.nxs"], True, "float64"),
                                (["-noisefile", "x.nxs"], True, "float64"),
                                (["-nonoise", "-nxmxfile", "x.nxs"], False, "float32"),
                                (["-noise_generator", "philox", "-nxmxfile", "x.nxs"], True, "float32")):
        _, run = parse(CRYSTAL + panel_file + ["-gain", "2", *extra])
        assert (run.noise, run.dtype, run.intfile, run.pgmfile) == (noise, dtype, None, None), extra
        assert run.noisefile == (extra[1] if extra[:1] == ["-noisefile"] else None)
        noted = "-gain changes only the noise image, and with -panelfile neither -noisefile nor -nxmxfile is written"
        assert (noted in run.notes) == (extra == []), extra


@pytest.mark.slow
def test_a_sweep_keeps_the_panels(tmp_path):
    """A -panelfile scenario through the Snakemake workflow: the batch store's images are (point, panel, slow,
    fast), the collated store's `image` has a `panel` dimension, the padding is zero and the
    panels are the renderer's; the float64 reference compares panel for panel. Its batch size is given: the
    cost model's steps per pixel would import PyTorch into Snakemake's planning (3 CPU-s)."""
    import subprocess

    import xarray as xr

    from nbsim.sweep.store import read_store
    from tests.conftest import own_cache_env, snakemake_command

    panels = [GOOD, {**GOOD, "name": "b", "pixels": [6, 10], "pix0_mm": [50, 0.4, 0.4]}]
    panel_file = _write(tmp_path, panels)
    crystal = ["-cell", "60", "70", "80", "90", "95", "90", "-default_F", "100", "-N", "4", "-lambda", "1.1",
               "-oversample", "1"]
    config = {"results": "results", "compile_cache": "results/compile-cache",
              "scenarios": {"panels": {"args": [*crystal, "-panelfile", "panels.yaml"]}},
              "sweep": {"sizes": [8], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"],
                        "extra": {"fudge": [1.0, 2.0]}, "batch_size": 2},
              "resources": {"mem_mb": 1000, "runtime_min": 5}, "timing": {"warmup": 0, "repeats": 1, "threads": 1},
              "reference": {"compile": False}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([*snakemake_command(tmp_path), "--cores", "2", "--resources=timing_slot=2"],
                            capture_output=True, text=True, timeout=900, env=own_cache_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    batches = sorted((tmp_path / "results" / "panels").rglob("*.zarr"))
    point_store = next(path for path in batches if "float32" in path.parent.name)
    assert read_store(point_store)["image"].dims == ("point", "panel", "slow", "fast")
    collated = xr.open_zarr(tmp_path / "results" / "panels" / "sweep.zarr")
    images = collated["image"].squeeze()
    assert images.dims == ("fudge", "panel", "slow", "fast") and images.shape == (2, 2, 10, 8)
    config, _ = parse([*crystal, "-panelfile", panel_file, "-fudge", "2"])
    expected = Renderer(resolve(config), dtype=torch.float32, compile="off")().numpy()
    np.testing.assert_allclose(images.sel(fudge=2.0).values, expected, rtol=1e-6)
    assert not images.sel(fudge=2.0).values[1, :, 6:].any()
    assert float(collated["correlation"].min()) > 0.9999


def test_panels_change_no_kernel_structure_and_survive_a_point_spec(tmp_path):
    """One, two or three panels of any sizes render with the single panel's kernel structure (no compile per
    panel count), and the panels travel through the sweep's JSON codec unchanged."""
    import json

    from nbsim.config import SimulationConfig
    from nbsim.kernel.structure import structure_of
    from nbsim.sweep.spec import dataclass_from_dict, dataclass_to_dict

    single = parse(CRYSTAL)[0]
    for count in (1, 2, 3):
        config = parse(CRYSTAL + ["-panelfile", _write(tmp_path, _tilted_panels()[:count])])[0]
        assert structure_of(config) == structure_of(single)
        restored = dataclass_from_dict(SimulationConfig, json.loads(json.dumps(dataclass_to_dict(config))))
        assert repr(restored) == repr(config)


TWO_PANELS = PixelLayout(0.1, panels=(PanelLayout(6, 10, 0.1, (5.0, 3.0)), PanelLayout(8, 7, 0.2, (0.0, 4.0))))
"""Two panels of other sizes and pixels (the image padded to 2 x 8 x 10), each with its own direct beam."""


def _two_panel_photons() -> torch.Tensor:
    """The same 6 x 7 photons in the corner of both panels (their draws must still differ), more in panel 0's
    remaining columns, nothing in the padding."""
    photons = torch.zeros(2, 8, 10, dtype=torch.float64)
    common = torch.linspace(0.5, 60.0, 42, dtype=torch.float64).view(6, 7)
    photons[0, :6, :7] = photons[1, :6, :7] = common
    photons[0, :6, 7:] = 25.0
    photons[1, 6:, :7] = 3.0
    return photons


def _stack(image: torch.Tensor) -> torch.Tensor:
    """The panels of a TWO_PANELS image one after another, as -floatfile holds them."""
    return torch.cat([image[index, :p.pixels_slow, :p.pixels_fast].reshape(-1)
                      for index, p in enumerate(TWO_PANELS.panels)])


@pytest.mark.parametrize("generator", ["nanobragg", "philox"])
def test_panels_are_read_out_as_their_stack_with_independent_draws(generator):
    """Every per-pixel draw of a multi-panel read-out is the one-panel read-out's of the panels stacked as
    -floatfile holds them (nanoBragg's serial sequence runs on through the panels; Philox's counter is the
    pixel's place there), so two panels of the same photons draw differently; the padding reads 0."""
    photons = _two_panel_photons()
    response = DetectorResponseConfig(noise_seed=9, generator=generator, flicker_fraction=0.1, readout_noise_adu=1.5,
                                      hot_pixel_fraction=0.02)
    multi = detector_image(photons, response, TWO_PANELS)
    alone = detector_image(_stack(photons).view(1, -1), response, PixelLayout(0.1))
    assert multi.adu.shape == (2, 8, 10) and multi.adu.dtype == torch.int32
    torch.testing.assert_close(_stack(multi.adu), alone.adu[0], rtol=0, atol=0)
    torch.testing.assert_close(_stack(multi.photons), alone.photons[0], rtol=0, atol=0)
    assert (multi.total_photons, multi.max_photons, multi.overloads) == (alone.total_photons, alone.max_photons,
                                                                          alone.overloads)
    assert multi.total_photons > 0
    assert not multi.adu[0, 6:].any() and not multi.adu[1, :, 7:].any()
    assert not torch.equal(multi.photons[0, :6, :7], multi.photons[1, :6, :7])
    assert torch.equal(detector_image(photons, response, TWO_PANELS).adu, multi.adu)


def test_point_spread_and_beam_stop_act_on_each_panel_alone():
    """The point spread (each panel's FWHM in its own pixels) and the beam stop (around where the beam meets each
    panel) of a multi-panel read-out are each panel's own read-out's: no photon crosses a panel's edge. A
    photon image of the wrong shape is one line."""
    photons = _two_panel_photons()
    for settings in ({"psf": "gaussian", "psf_fwhm_um": 150.0}, {"psf": "fiber", "psf_fwhm_um": 150.0},
                     {"beamstop_radius_mm": 0.25}):
        response = DetectorResponseConfig(noise_seed=1, poisson=False, **settings)
        multi = detector_image(photons, response, TWO_PANELS).photons
        for index, panel in enumerate(TWO_PANELS.panels):
            own = PixelLayout(panel.pixel_size_mm, beam_center_px=panel.beam_center_px)
            alone = detector_image(photons[index, :panel.pixels_slow, :panel.pixels_fast], response, own).photons
            torch.testing.assert_close(multi[index, :panel.pixels_slow, :panel.pixels_fast], alone, rtol=0, atol=0)
        assert not multi[0, 6:].any() and not multi[1, :, 7:].any()
        if "psf" in settings:  # spread within each panel, what crosses its edge lost
            assert multi[0, 0, 0] > photons[0, 0, 0] and float(multi.sum()) < float(photons.sum())
    assert (multi[0, 3, 5], multi[1, 4, 0]) == (0.0, 0.0) and multi[0, 3, 8] > 0 and multi[1, 4, 2] > 0
    with pytest.raises(NbsimError, match=r"the photon image is \(8, 10\), the detector's 2 panels need \(2, 8, 10\)"):
        detector_image(photons[0], DetectorResponseConfig(noise_seed=1), TWO_PANELS)


def test_a_panel_detector_writes_its_noise_image_and_counts_as_nxmx(tmp_path, monkeypatch, capsys):
    """-noisefile of a -panelfile detector is NXmx of the noise image (nanoBragg's ADU: the -adc pedestal, 16-bit
    clamp), -nxmxfile holds the same draws as int32 counts without pedestal (float64 rendering, the default for
    nanoBragg's noise); both are the detector stage's read-out of the rendered panels, reproducible from -seed;
    -nonoise gives -nxmxfile the -intfile counts again."""
    import h5py

    monkeypatch.chdir(tmp_path)
    panels = [GOOD, {**GOOD, "name": "b", "pixels": [6, 10], "pix0_mm": [50, 0.4, 0.4]}]
    argv = CRYSTAL + ["-panelfile", _write(tmp_path, panels), "-seed", "5", "-compile", "off", "-fluence", "1e30",
                      "-gain", "2", "-psf", "gaussian", "-psf_fwhm", "120"]
    assert main([*argv, "-noisefile", "noise.h5", "-nxmxfile", "counts.h5"]) == 0
    out = capsys.readouterr().out
    assert "kernel: eager (float64 on cpu)" in out and "writing noise.h5 as NXmx (HDF5) of 16-bit ADU (2 panels)" in out
    assert "intfile_scale" not in out  # no file of the -intfile scale is written
    config, _ = parse(argv)
    setup = resolve(config)
    image = Renderer(setup, dtype=torch.float64, compile="off")().to(torch.float32)
    response = dataclasses.replace(config.response, noise_seed=5)
    read = detector_image(image, response, layout_of(setup))
    expected = read.adu.numpy()
    assert f"{read.total_photons:.0f} photons on noise image ({read.overloads} overloads)" in out
    frames = {}
    for name in ("noise.h5", "counts.h5"):
        with h5py.File(name) as handle:
            frames[name] = handle["entry/data/data"][0].reshape(2, 10, 8)
            frames[name + " saturation"] = int(handle["entry/instrument/detector/saturation_value"][()])
            assert "adc_offset_adu" in handle["entry/notes"][()].decode()
    inside = np.zeros((2, 10, 8), dtype=bool)
    inside[0, :8, :8] = inside[1, :10, :6] = True
    np.testing.assert_array_equal(frames["noise.h5"], np.where(inside, expected, 0))
    np.testing.assert_array_equal(frames["counts.h5"][inside] + 40, frames["noise.h5"][inside])
    assert (frames["noise.h5 saturation"], frames["counts.h5 saturation"]) == (65535, 2147483647)
    assert frames["counts.h5"].max() > 20 and not frames["counts.h5"][~inside].any()
    assert main([*argv, "-nonoise", "-nxmxfile", "clean.h5", "-scale", "1"]) == 0
    assert "intfile_scale = 1\n" in capsys.readouterr().out
    with h5py.File("clean.h5") as handle:
        clean = handle["entry/data/data"][0].reshape(2, 10, 8)
    np.testing.assert_array_equal(clean, np.where(inside, np.floor(np.clip(image.numpy().astype(np.float64), 0, None)
                                                                   + 0.5), 0))


def test_a_first_panel_along_the_beam_leaves_the_record_to_a_panel_the_beam_meets(tmp_path, monkeypatch, capsys):
    """The experiment record's distance and beam centre come from the first panel the direct beam meets (a
    first panel along the beam made a ZeroDivisionError), and are left out where no panel meets it; the
    multi-panel NXmx file holds each module's own placement and no detector-wide beam centre either way."""
    import h5py

    from nbsim.cli.products import experiment_record
    from nbsim.detector import direct_beam_px

    monkeypatch.chdir(tmp_path)
    side = {**GOOD, "name": "side", "sdet": [1, 0, 0], "pix0_mm": [10, 20, -0.4]}
    panel_file = _write(tmp_path, [side, GOOD])
    assert main(CRYSTAL + ["-panelfile", panel_file, "-seed", "3", "-compile", "off", "-nxmxfile", "counts.h5"]) == 0
    capsys.readouterr()
    with h5py.File("counts.h5") as handle:
        detector = handle["entry/instrument/detector"]
        assert "beam_center_x" not in detector and len([k for k in detector if k.startswith("module_")]) == 2
    setup = resolve(parse(CRYSTAL + ["-panelfile", panel_file])[0])
    record = experiment_record(setup, None)
    assert record.distance_m == pytest.approx(0.05)
    assert (record.beam_fast_px, record.beam_slow_px) == pytest.approx(direct_beam_px(setup.panels[1]))
    alone = resolve(parse(CRYSTAL + ["-panelfile", _write(tmp_path, [side], "side.yaml")])[0])
    lone = experiment_record(alone, None)
    assert (lone.distance_m, lone.beam_fast_px, lone.beam_slow_px) == (None, None, None)


def test_a_panel_along_the_beam_is_read_out_and_left_unshaded(tmp_path, monkeypatch, capsys):
    """A side module, its plane along the beam (the direct beam never meets it), gets a noise image as any other
    panel (it was a ZeroDivisionError where its direct beam was placed), and the beam stop shades nothing on it."""
    import h5py

    monkeypatch.chdir(tmp_path)
    side = {**GOOD, "name": "side", "sdet": [1, 0, 0], "pix0_mm": [10, 20, -0.4]}
    assert main(CRYSTAL + ["-panelfile", _write(tmp_path, [GOOD, side]), "-seed", "3", "-compile", "off",
                           "-beamstop", "0.2", "-nxmxfile", "counts.h5"]) == 0
    capsys.readouterr()
    with h5py.File("counts.h5") as handle:
        assert handle["entry/data/data"][0].size == 2 * 8 * 8
    layout = PixelLayout(0.1, panels=(PanelLayout(2, 2, 0.1, (math.inf, math.inf)),))
    read = detector_image(torch.full((1, 2, 2), 50.0, dtype=torch.float64),
                          DetectorResponseConfig(noise_seed=1, poisson=False, beamstop_radius_mm=1.0), layout)
    assert bool((read.photons == 50.0).all())
