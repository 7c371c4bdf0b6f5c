"""Detector models (-detector_model): each resolves to its documented geometry, sensor and response, the
command line's own flags override it, a bad name is a one-line input error, its module gaps are written as
gaps (miniCBF -1, NXmx pixel_mask) and DIALS reads them as masked pixels."""

from __future__ import annotations

import contextlib
import subprocess

import fabio
import h5py
import numpy as np
import pytest

from nbsim.cli import main
from nbsim.nanobragg import config_from_args, parse
from nbsim.reference import c_arguments
from nbsim.sweep.plan import point_config, sweep_points
from nbsim.sweep.validate import validate_config

from .conftest import REPO_ROOT, SEED_ARGS, one_line_error_here

SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"

DOCUMENTED = {
    # name: pixel mm, pixels (fast, slow), module (fast, slow), gap (fast, slow), sensor, thickness µm
    "pilatus6m": (0.172, (2463, 2527), (487, 195), (7, 17), "Si", 320),
    "eiger16m": (0.075, (4150, 4371), (1030, 514), (10, 37), "Si", 450),
    "eiger2cdte16m": (0.075, (4148, 4362), (1028, 512), (12, 38), "CdTe", 750),
    "jungfrau4m": (0.075, (2068, 2164), (1030, 514), (8, 36), "Si", 320),
    "mx340hs": (0.0886, (3840, 3840), None, (0, 0), "Si", 0),
    "mx340hs1x1": (0.0443, (7680, 7680), None, (0, 0), "Si", 0),
}
"""docs/detector.md's table of the manufacturers' values (the spec sheets cited there)."""


@pytest.mark.parametrize("name", DOCUMENTED)
def test_each_model_resolves_to_its_documented_detector(name):
    pixel_mm, pixels, module, gap, material, thickness_um = DOCUMENTED[name]
    detector = config_from_args(["-detector_model", name]).detector
    assert detector.pixel_size_mm == pixel_mm
    assert (detector.pixels_f, detector.pixels_s) == pixels
    assert detector.module_size_px == module and detector.module_gap_px == gap
    assert detector.sensor_thickness_um == thickness_um
    if thickness_um:
        assert detector.sensor_material == material
        assert detector.sensor_absorption_depth_um is not None and detector.sensor_absorption_depth_um > 0
    if module is not None:
        for count, size, between in zip(pixels, module, gap, strict=True):
            assert (count + between) % (size + between) == 0, "modules tile the detector to its edge"


def test_photon_counters_have_no_pedestal_and_a_ccd_has_its_offset_and_fibre_spread():
    eiger = config_from_args(["-detector_model", "eiger16m"]).response
    assert eiger.adc_offset_adu == 0 and eiger.psf == "gaussian" and eiger.psf_fwhm_um == 75
    rayonix = config_from_args(["-detector_model", "mx340hs"]).response
    assert rayonix.adc_offset_adu == 10 and rayonix.psf == "fiber"


def test_the_models_saturation_clamps_the_int32_files():
    assert parse(["-detector_model", "pilatus6m", "-default_F", "1"])[1].saturation_counts == 2**20 - 1
    assert parse(["-detector_model", "mx340hs", "-default_F", "1"])[1].saturation_counts == 2**16 - 1


def test_the_c_reference_gets_the_models_flags(tmp_path):
    """nanoBragg has no -detector_model: the C reference of a sweep point is given the model's flags."""
    argv = c_arguments(["-detector_model", "jungfrau4m", "-distance", "80"], tmp_path / "sources.txt")
    assert "-detector_model" not in argv and "jungfrau4m" not in argv
    assert argv[argv.index("-pixel") + 1] == "0.075" and argv[-2:] == ["-distance", "80"]


@pytest.mark.parametrize("spelling", ["PILATUS6M", "Pilatus-6M", "pilatus_6m", "pilatus 6M"])
def test_names_ignore_case_and_separators(spelling):
    assert config_from_args(["-detector_model", spelling]).detector.pixels_f == 2463


def test_flags_given_override_the_model():
    config, run = parse(["-detector_model", "pilatus6m", "-pixel", "0.1", "-detpixels", "100", "-detector_thick",
                         "1000", "-psf", "none", "-adc", "40", "-module_gap", "0", "0", "-sensor_material", "CdTe"])
    detector = config.detector
    assert detector.pixel_size_mm == 0.1 and (detector.pixels_f, detector.pixels_s) == (100, 100)
    assert detector.sensor_thickness_um == 1000 and detector.sensor_material == "CdTe"
    assert detector.module_gap_px == (0, 0)
    assert config.response.psf == "none" and config.response.adc_offset_adu == 40
    assert run.detector_model == "pilatus6m"


def test_a_detector_size_in_mm_replaces_the_models_pixel_counts():
    detector = config_from_args(["-detector_model", "pilatus6m", "-detsize", "17.2"]).detector
    assert (detector.pixels_f, detector.pixels_s) == (None, None)
    assert detector.detsize_f_mm == 17.2 and detector.pixel_size_mm == 0.172


def test_the_models_response_flags_make_no_note_under_nonoise():
    _, run = parse(["-detector_model", "eiger16m", "-nonoise", "-default_F", "1"])
    assert not [note for note in run.notes if "-psf" in note]


@pytest.mark.parametrize("argv, message", [
    (["-detector_model", "pilatus7m"], "unknown detector model 'pilatus7m' (known: pilatus6m, eiger16m"),
    (["-detector_model", "eiger16m", "-panelfile", "panels.yaml"], "-detector_model describes a one-panel"),
    (["-module_gap", "2", "2"], "-module_gap separates modules: give -module_size"),
    (["-module_size", "0", "10"], "-module_size must be positive"),
])
def test_bad_models_and_modules_are_one_line_input_errors(tmp_path, argv, message, capsys):
    assert message in one_line_error_here([*argv, "-default_F", "1", "-nonoise", "-nopgm"], tmp_path, capsys)
    assert list(tmp_path.iterdir()) == []


def test_show_prints_the_model_modules_sensor_and_response(capsys):
    assert main(["show", "--", "-detector_model", "eiger16m", "-default_F", "1", "-cell", "50", "50", "50", "90",
                 "90", "90", "-N", "2", "-oversample", "1"]) == 0
    out = capsys.readouterr().out
    gap_pixels = 3 * 10 * 4371 + 7 * 37 * 4150 - (3 * 10) * (7 * 37)
    assert out.startswith("detector model: eiger16m (DECTRIS EIGER X 16M): -pixel 0.075 -detpixels_f 4150 "
                          "-detpixels_s 4371")
    assert f"detector: 4150 x 4371 pixels (fast x slow), {4150 * 4371 - gap_pixels} rendered" in out
    assert f"modules: 1030 x 514 pixels, gaps 10 x 37 pixels ({gap_pixels} gap pixels, not rendered)" in out
    assert "sensor: Si 450 um" in out
    assert "response: point spread gaussian 75 um FWHM, pedestal (-adc) 0 ADU" in out


def test_sweeps_take_a_model_in_a_scenario_and_as_an_axis(tmp_path):
    config = {"scenarios": {"seed": {"args": f"{SEED_ARGS} -detector_model jungfrau4m"}},
              "sweep": {"sizes": [600], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"],
                        "extra": {"-detector_model": ["pilatus6m", "EIGER16M"]}},
              "timing": {"warmup": 0, "repeats": 1, "threads": 1}}
    validate_config(config, SCHEMA, tmp_path)
    detectors = {p.axis_values["detector_model"]: point_config(config, p, tmp_path).detector
                 for p in sweep_points(config)}
    assert detectors["pilatus6m"].pixel_size_mm == 0.172 and detectors["EIGER16M"].pixel_size_mm == 0.075
    assert {d.pixels_f for d in detectors.values()} == {600}, "the sweep's size overrides the model's"


def gaps_of(pixels: int, module: int, gap: int) -> np.ndarray:
    """Indices in gaps along one axis, module by module from the first pixel."""
    return np.array([i for i in range(pixels) if i % (module + gap) >= module])


SMALL_PILATUS = ["-detector_model", "pilatus6m", "-detpixels", "600", "-default_F", "100", "-cell", "100", "100",
                 "100", "90", "90", "90", "-N", "5", "-distance", "100", "-oversample", "1", "-dtype", "float32",
                 "-noise_generator", "philox", "-seed", "1", "-nopgm", "-floatfile", "float.bin",
                 "-noisefile", "noise.img", "-intfile", "int.img", "-cbffile", "pilatus_00001.cbf",
                 "-nxmxfile", "pilatus.nxs"]


@pytest.fixture(scope="module")
def pilatus_files(tmp_path_factory):
    """A 600² corner of a PILATUS 6M (two module rows, two columns), written as miniCBF and NXmx."""
    folder = tmp_path_factory.mktemp("pilatus")
    with contextlib.chdir(folder):
        assert main(SMALL_PILATUS) == 0
    gap = np.zeros((600, 600), dtype=bool)
    gap[gaps_of(600, 195, 17), :] = True
    gap[:, gaps_of(600, 487, 7)] = True
    return folder, gap


def test_gaps_are_not_rendered_and_are_written_as_gaps(pilatus_files):
    folder, gap = pilatus_files
    floats = np.fromfile(folder / "float.bin", dtype=np.float32).reshape(600, 600)
    assert (floats[gap] == 0).all() and (floats[~gap] > 0).all()
    cbf = fabio.open(str(folder / "pilatus_00001.cbf"))
    assert np.array_equal(cbf.data == -1, gap)
    header = cbf.header["_array_data.header_contents"]
    assert "Pixel_size 1.720000e-04 m x 1.720000e-04 m" in header
    assert "Silicon sensor, thickness 0.000320 m" in header
    with h5py.File(folder / "pilatus.nxs") as nexus:
        assert np.array_equal(nexus["entry/data/data"][0] == -1, gap)
        assert np.array_equal(nexus["entry/instrument/detector/pixel_mask"][()] == 1, gap)
        assert float(nexus["entry/instrument/detector/sensor_thickness"][()]) == pytest.approx(0.32)


def test_the_models_pedestal_is_its_own(pilatus_files):
    """A photon counter has no pedestal: the noise-free SMV image's unlit gap pixels read 0, where nanoBragg's
    default -adc would make them read 40."""
    folder, gap = pilatus_files
    counts = fabio.open(str(folder / "int.img")).data
    assert (counts[gap] == 0).all() and counts[~gap].max() > 0


DXTBX_MASK = """
import sys
from dxtbx.model.experiment_list import ExperimentListFactory
for name in sys.argv[1:]:
    experiment = ExperimentListFactory.from_json_file(name, check_format=True)[0]
    panel = experiment.detector[0]
    masked = experiment.imageset.get_mask(0)[0].count(False)
    print(name, *panel.get_image_size(), round(panel.get_pixel_size()[0], 6), panel.get_material(),
          round(panel.get_thickness(), 6), masked)
"""


@pytest.mark.slow
@pytest.mark.skipif(not all(__import__("shutil").which(p) for p in ("dials.import", "cctbx.python")),
                    reason="DIALS is not installed (dials.import, cctbx.python): apt-get install dials")
def test_dials_reads_the_models_frames_with_their_gaps_masked(pilatus_files):
    folder, gap = pilatus_files
    for image, experiments in (("pilatus_00001.cbf", "cbf.expt"), ("pilatus.nxs", "nxs.expt")):
        done = subprocess.run(["dials.import", image, f"output.experiments={experiments}"], cwd=folder,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:]
    (folder / "mask.py").write_text(DXTBX_MASK)
    done = subprocess.run(["cctbx.python", "mask.py", "cbf.expt", "nxs.expt"], cwd=folder, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.endswith(f" {int(gap.sum())}")]
    assert [row[:6] for row in rows] == [[name, "600", "600", "0.172", "Si", "0.32"]
                                         for name in ("cbf.expt", "nxs.expt")], done.stdout
