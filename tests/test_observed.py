"""Observed images (nbsim.io.observed): every format nbsim writes, read back as the counts of the render
with the ADC offset taken off; the C nanoBragg's noise images follow its float images; bad input is one
line naming the file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from nbsim.cli import main
from nbsim.errors import InputFileError
from nbsim.io.observed import read_observed

from .conftest import GOLDEN, requires_golden

SHAPE = (48, 40)
ARGS = ["-cell", "60", "70", "80", "90", "90", "90", "-default_F", "300", "-N", "6", "-detpixels_f", "40",
        "-detpixels_s", "48", "-pixel", "0.2", "-distance", "70", "-lambda", "1.1", "-compile", "off", "-nopgm",
        "-seed", "11", "-adc", "25", "-gain", "2", "-misset", "10", "20", "30", "-flux", "1e19", "-exposure", "1",
        "-beamsize", "0.1", "-floatfile", "float.bin"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One small render written as raw float, -intfile (scale 1), -noisefile, miniCBF and NXmx (the last two
    hold the noise image's counts)."""
    folder = tmp_path_factory.mktemp("observed")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert main([*ARGS, "-intfile", "int.img", "-scale", "1", "-noisefile", "noise.img",
                     "-cbffile", "image.cbf", "-nxmxfile", "image.nxs"]) == 0
    photons = np.fromfile(folder / "float.bin", dtype=np.float32).reshape(SHAPE).astype(np.float64)
    assert photons.max() > 50.0, "the render must have spots for the checks to mean anything"
    return folder, photons


def test_raw_float_is_the_render(rendered):
    folder, photons = rendered
    image = read_observed(str(folder / "float.bin"), shape=SHAPE)
    assert image.counts.dtype == np.float64 and image.counts.shape == SHAPE
    np.testing.assert_array_equal(image.counts, photons)
    assert (image.adc_offset_adu, image.gain_adu_per_photon, image.overload_adu) == (0.0, 1.0, None)


def test_intfile_is_the_render_to_its_rounding_once_the_offset_is_off(rendered):
    folder, photons = rendered
    default = read_observed(str(folder / "int.img"))
    assert default.adc_offset_adu == 40.0  # nanoBragg's default: its header does not record -adc
    image = read_observed(str(folder / "int.img"), adc_offset_adu=25.0)
    assert image.overload_adu == 65535.0 and not image.unusable().any()
    assert np.abs(image.counts - photons).max() <= 0.5
    np.testing.assert_array_equal(default.counts, image.counts - 15.0)


def _follows_poisson(counts: np.ndarray, expected: np.ndarray) -> None:
    """The counts are Poisson draws of the expected photons: total within 5 sigma, and the squared residual
    over the variance near 1 where the expectation is not tiny."""
    assert abs(counts.sum() - expected.sum()) < 5.0 * np.sqrt(expected.sum())
    bright = expected > 2.0
    assert bright.sum() > 30
    reduced_chi2 = float(np.mean((counts[bright] - expected[bright]) ** 2 / expected[bright]))
    assert 0.7 < reduced_chi2 < 1.3, reduced_chi2


def test_noise_image_and_its_cbf_and_nxmx_copies_are_the_same_counts(rendered):
    folder, photons = rendered
    noise = read_observed(str(folder / "noise.img"), adc_offset_adu=25.0)
    cbf = read_observed(str(folder / "image.cbf"))
    nexus = read_observed(str(folder / "image.nxs"))
    assert (cbf.adc_offset_adu, cbf.gain_adu_per_photon, cbf.overload_adu) == (25.0, 2.0, 2147483647.0)
    assert (nexus.adc_offset_adu, nexus.gain_adu_per_photon, nexus.overload_adu) == (25.0, 2.0, 2147483647.0)
    np.testing.assert_array_equal(cbf.counts, noise.counts)
    np.testing.assert_array_equal(nexus.counts, noise.counts)
    np.testing.assert_array_equal(read_observed(str(folder / "image.nxs") + "#0").counts, noise.counts)
    _follows_poisson(noise.counts / 2.0, photons)  # gain 2: two ADU per photon


@requires_golden
@pytest.mark.parametrize("name", ["seed_bench_256", "flux_adc_roi", "triclinic_hkl"])
def test_the_c_noise_images_follow_their_float_images(name):
    """The real nanoBragg's -noisefile SMV: its counts minus its -adc offset (40 unless given) are Poisson
    draws of its -floatfile image, inside the ROI, saturated pixels left out; left with the offset, not."""
    folder = GOLDEN / "noise" / name
    args = json.loads((folder / "meta.json").read_text())["args"].split()
    adc = float(args[args.index("-adc") + 1]) if "-adc" in args else 40.0
    image = read_observed(str(folder / "noise.img"), adc_offset_adu=adc)
    shape = image.counts.shape
    expected = np.fromfile(folder / "float.bin", dtype=np.float32).reshape(shape).astype(np.float64)
    inside = np.zeros(shape, dtype=bool)
    xmin, xmax, ymin, ymax = ([int(v) for v in args[args.index("-roi") + 1:][:4]] if "-roi" in args
                              else (0, shape[1] - 1, 0, shape[0] - 1))
    inside[ymin:ymax + 1, xmin:xmax + 1] = True
    usable = inside & ~image.unusable()
    assert usable.sum() > 0.9 * inside.sum() - (image.counts >= 65535 - adc).sum()
    _follows_poisson(image.counts[usable], expected[usable])
    with pytest.raises(AssertionError):
        _follows_poisson(image.counts[usable] + adc, expected[usable])


def _batch_store(folder, detector: bool = True, beam: dict | None = None):
    """A batch store of three points of a -phi series (arbitrary images: a photon image and its 16-bit
    detector image, offset 40; `beam`: their configurations' beam), its records, and the collated sweep.zarr
    built from it."""
    from nbsim.sweep.collate import point_rows, write_collated_store
    from nbsim.sweep.store import BatchStore, write_json

    generator = np.random.default_rng(5)
    name = "n16-float32-cpu-compile_off-b0000"
    points = [f"n16-float32-cpu-compile_off-phi_{phi}" for phi in (0.0, 0.5, 1.0)]
    kinds = {"image": np.float32, **({"detector_image": np.uint16} if detector else {})}
    store = BatchStore(folder / name / "images.zarr", "digest", points, (16, 16), kinds, {})
    written, entries = [], []
    for index, (point, phi) in enumerate(zip(points, (0.0, 0.5, 1.0), strict=True)):
        photons = generator.exponential(3.0, (16, 16)).astype(np.float32)
        images = {"image": photons}
        if detector:
            images["detector_image"] = (generator.poisson(photons) + 40).astype(np.uint16)
        entry = {"name": point, "reference": "", "size": 16, "status": "ok", "images": sorted(images),
                 "axes": {"size": 16, "dtype": "float32", "device": "cpu", "compile": "off", "phi": phi},
                 "config": {"response": {"adc_offset_adu": 40.0, "gain_adu_per_photon": 1.0},
                            **({"beam": beam} if beam else {})}}
        store.write(index, images, entry)
        entries.append({**entry, "index": index})
        written.append(images)
    store.finish({})
    write_json(folder / name / "records.json", {"scenario": "s", "batch": name, "points": entries})
    rows = point_rows([folder / name / "records.json"], [])
    write_collated_store(rows, {name: folder / name / "images.zarr"}, ["size", "dtype", "device", "compile", "phi"],
                         folder / "sweep.zarr")
    return folder / name / "images.zarr", folder / "sweep.zarr", points, written


def test_a_shot_of_a_batch_store_or_a_collated_sweep(tmp_path):
    batch, collated, points, written = _batch_store(tmp_path)
    expected = written[1]["detector_image"].astype(np.float64) - 40.0
    for spec in (f"{batch}#{points[1]}", f"{batch}#1", f"{collated}#{points[1]}", f"{collated}#phi=0.5"):
        image = read_observed(spec, shape=(16, 16))
        assert image.adc_offset_adu == 40.0 and image.name == spec
        np.testing.assert_array_equal(image.counts, expected)
    with pytest.raises(InputFileError, match="no point"):
        read_observed(f"{batch}#n16-other")
    with pytest.raises(InputFileError, match="give phi=VALUE"):
        read_observed(f"{collated}#size=16")
    with pytest.raises(InputFileError, match="name one as STORE#POINT"):
        read_observed(str(collated))


def test_a_store_shot_carries_the_spectrum_it_was_rendered_with(tmp_path):
    """A dataset's shot (a `sase` draw) gives the fit its spectrum, moved as its configuration says, from a batch
    store or a collated one; a store shot of one wavelength has none; a spectrum without weight is one line."""
    from nbsim.io.observed import observed_spectrum

    spectrum = [[1.0, 1.0], [1.01, 3.0]]
    batch, collated, points, _ = _batch_store(tmp_path / "a", beam={"spectrum": spectrum, "spectrum_shift_eV": 2.0})
    mean_eV = (12398.42 / 1.0 + 3 * 12398.42 / 1.01) / 4
    for spec in (f"{batch}#{points[1]}", f"{collated}#phi=0.5"):
        found = observed_spectrum(spec)
        assert [weight for _, weight in found] == [1.0, 3.0]
        assert sum(12398.42 / wavelength * weight for wavelength, weight in found) / 4 == pytest.approx(mean_eV + 2.0)
    plain, _, plain_points, _ = _batch_store(tmp_path / "b")
    assert observed_spectrum(f"{plain}#{plain_points[0]}") is None
    weightless, _, weightless_points, _ = _batch_store(tmp_path / "c", beam={"spectrum": [[1.0, 0.0], [1.01, 0.0]]})
    with pytest.raises(InputFileError, match="weights sum to 0"):
        observed_spectrum(f"{weightless}#{weightless_points[0]}")


def test_a_store_without_a_detector_stage_gives_its_photons(tmp_path):
    batch, collated, points, written = _batch_store(tmp_path, detector=False)
    image = read_observed(f"{collated}#phi=1")
    assert image.adc_offset_adu == 0.0
    np.testing.assert_array_equal(image.counts, written[2]["image"].astype(np.float64))


def test_bad_input_is_one_line_naming_the_file(rendered, tmp_path):
    folder, _ = rendered
    cases = [
        (str(tmp_path / "missing.img"), None, "no such file"),
        (str(folder / "float.bin"), None, "give its shape"),
        (str(folder / "float.bin"), (48, 41), "bytes, but a 48 x 41 float32 image has"),
        (str(folder / "noise.img"), (40, 48), "the image has 48 x 40 pixels (slow x fast), the model 40 x 48"),
        (str(folder / "image.nxs") + "#1", None, "no frame 1: the file holds 1"),
        (str(folder / "image.nxs") + "#last", None, "is not a number"),
        (str(folder / "image.cbf") + "#2", None, "only NXmx files and sweep stores"),
        (str(tmp_path), None, "not a zarr store"),
    ]
    (tmp_path / "notes.txt").write_text(json.dumps({"not": "an image"}))
    cases.append((str(tmp_path / "notes.txt"), None, "unknown image format"))
    for spec, shape, message in cases:
        with pytest.raises(InputFileError, match=re.escape(message)) as raised:
            read_observed(spec, shape=shape)
        assert "\n" not in str(raised.value) and spec.split("#")[0] in str(raised.value)
