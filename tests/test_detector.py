"""The detector stage (nbsim/detector): Philox streams, Poisson deviates, simtbx's effects, the bad settings
refused before rendering, and the configuration that carries them."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from nbsim.cli import main
from nbsim.config import DetectorResponseConfig, SimulationConfig, check_response
from nbsim.detector import PixelLayout, detector_image, effects, layout_of, native, philox
from nbsim.errors import NbsimError
from nbsim.kernel.structure import structure_of
from nbsim.nanobragg.arguments import parse
from nbsim.resolve import resolve
from nbsim.sweep.spec import dataclass_from_dict, dataclass_to_dict

RANDOM123_KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)
"""Philox4x32-10's known-answer tests from Random123 (kat_vectors)."""


@pytest.mark.parametrize("counter, key, expected", RANDOM123_KNOWN_ANSWERS)
def test_philox_matches_random123(counter, key, expected):
    words = philox.philox4x32(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in words) == expected


def test_compiled_and_torch_philox_give_the_same_words():
    """The CPU's compiled words and the torch operations that run on a GPU agree, word for word."""
    assert native.compiled_philox_available()
    scattered = torch.randint(0, 1 << 40, (1000,), generator=torch.Generator().manual_seed(1))
    index = torch.cat([torch.arange(1000), scattered])
    for seed, stream, draw in ((0, 0, 0), (7, 3, 2), (2 ** 64 - 5, 4, 1 << 31)):
        assert torch.equal(philox.words(seed, stream, draw, index), philox.torch_words(seed, stream, draw, index))


@pytest.mark.parametrize("mean", [0.05, 2.0, 9.5, 10.0, 40.0, 3000.0])
def test_philox_poisson_has_the_mean_and_variance(mean):
    n = 40000
    counts = philox.poisson(torch.full((n,), mean, dtype=torch.float64), seed=11, stream=0)
    assert torch.equal(counts, torch.floor(counts)) and bool((counts >= 0).all())
    tolerance = 5 * math.sqrt(mean / n)
    assert float(counts.mean()) == pytest.approx(mean, abs=tolerance)
    assert float(counts.var()) == pytest.approx(mean, rel=0.05)


def test_philox_poisson_of_a_pixel_does_not_depend_on_the_others():
    """Counter-based: change every other pixel and a pixel keeps its draw (an image, or a pixel of it, is
    drawn again alone)."""
    rates = torch.linspace(0.0, 50.0, 500, dtype=torch.float64)
    other = rates.clone()
    other[1::2] = 1000.0
    first = philox.poisson(rates, seed=5, stream=0)
    second = philox.poisson(other, seed=5, stream=0)
    assert torch.equal(first[::2], second[::2])
    assert not torch.equal(first, philox.poisson(rates, seed=6, stream=0))


def _image(shape=(48, 64)) -> torch.Tensor:
    slow, fast = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    return (50.0 * torch.exp(-((slow - 20.0) ** 2 + (fast - 30.0) ** 2) / 20.0) + 0.3).to(torch.float32)


LAYOUT = PixelLayout(pixel_size_mm=0.1, beam_center_px=(32.0, 24.0))


def test_the_same_seed_gives_the_same_bits_and_torch_philox_the_same_image():
    response = DetectorResponseConfig(generator="philox", noise_seed=42, flicker_fraction=0.05, readout_noise_adu=2.0,
                                      calibration_fraction=0.02, hot_pixel_fraction=0.01, dead_pixel_fraction=0.01)
    first = detector_image(_image(), response, LAYOUT)
    assert torch.equal(first.adu, detector_image(_image(), response, LAYOUT).adu)
    assert not torch.equal(first.adu, detector_image(_image(), replace(response, noise_seed=43), LAYOUT).adu)


def test_the_gpu_code_path_gives_the_same_image_on_the_cpu(monkeypatch):
    """The torch operations a GPU runs give, on the CPU, the image the compiled words give."""
    response = DetectorResponseConfig(generator="philox", noise_seed=3, readout_noise_adu=1.5, flicker_fraction=0.1)
    compiled = detector_image(_image(), response, LAYOUT)
    monkeypatch.setattr(native, "compiled_philox_available", lambda: False)
    assert torch.equal(detector_image(_image(), response, LAYOUT).adu, compiled.adu)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_philox_on_cuda_is_reproducible():
    response = DetectorResponseConfig(generator="philox", noise_seed=3, readout_noise_adu=1.5)
    image = _image().cuda()
    first = detector_image(image, response, LAYOUT)
    assert first.adu.is_cuda and torch.equal(first.adu, detector_image(image, response, LAYOUT).adu)


def test_gain_offset_and_truncation_without_poisson():
    response = DetectorResponseConfig(noise_seed=1, poisson=False, gain_adu_per_photon=2.5, adc_offset_adu=10.0)
    image = _image()
    result = detector_image(image, response, LAYOUT)
    expected = torch.clamp(image.double() * 2.5 + 10.0, 0, 65535).to(torch.int32)
    assert torch.equal(result.adu, expected)


def test_readout_noise_has_its_rms():
    response = DetectorResponseConfig(noise_seed=1, poisson=False, readout_noise_adu=3.0, adc_offset_adu=100.0)
    result = detector_image(torch.zeros(200, 200), response, LAYOUT)
    assert float(result.adu.double().std()) == pytest.approx(3.0, rel=0.05)


def test_calibration_is_fixed_per_pixel_whatever_the_noise_seed():
    flat = torch.full((40, 40), 1000.0)
    settings = dict(poisson=False, calibration_fraction=0.1, adc_offset_adu=0.0)
    one = detector_image(flat, DetectorResponseConfig(noise_seed=1, **settings), LAYOUT)
    two = detector_image(flat, DetectorResponseConfig(noise_seed=2, **settings), LAYOUT)
    other = detector_image(flat, DetectorResponseConfig(noise_seed=1, calibration_seed=5, **settings), LAYOUT)
    assert torch.equal(one.adu, two.adu) and not torch.equal(one.adu, other.adu)
    assert float(one.photons.std()) == pytest.approx(100.0, rel=0.1)


def test_beamstop_shades_the_direct_beam():
    response = DetectorResponseConfig(noise_seed=1, generator="philox", beamstop_radius_mm=1.0, adc_offset_adu=7.0)
    result = detector_image(torch.full((48, 64), 100.0), response, LAYOUT)
    slow, fast = torch.meshgrid(torch.arange(48) + 0.5, torch.arange(64) + 0.5, indexing="ij")
    inside = ((slow - 24.0) ** 2 + (fast - 32.0) ** 2) * 0.01 < 1.0
    assert int(inside.sum()) > 250
    assert bool((result.adu[inside] == 7).all()) and bool((result.adu[~inside] > 50).all())


def test_hot_and_dead_pixels_take_their_fractions():
    response = DetectorResponseConfig(noise_seed=1, poisson=False, hot_pixel_fraction=0.05, dead_pixel_fraction=0.1,
                                      adc_offset_adu=40.0)
    result = detector_image(torch.full((100, 100), 5.0), response, LAYOUT)
    assert float((result.adu == 65535).double().mean()) == pytest.approx(0.05, abs=0.01)
    assert float((result.adu == 0).double().mean()) == pytest.approx(0.1, abs=0.01)
    again = detector_image(torch.full((100, 100), 9.0), response, LAYOUT)
    assert torch.equal(again.adu == 65535, result.adu == 65535)


def _integrated(psf, x: float, y: float, samples: int = 400) -> float:
    """The PSF integrated over the pixel at (x, y) by the midpoint rule."""
    offsets = (torch.arange(samples, dtype=torch.float64) + 0.5) / samples - 0.5
    ys, xs = torch.meshgrid(y + offsets, x + offsets, indexing="ij")
    return float(psf(xs, ys).mean())


def test_pixel_integrated_kernels_match_numerical_integration():
    fwhm = 1.7
    sigma = fwhm / math.sqrt(8 * math.log(2))
    weights = effects.gaussian_pixel_weights(fwhm, 3)
    gauss = lambda x, y: torch.exp(-(x * x + y * y) / (2 * sigma * sigma)) / (2 * math.pi * sigma * sigma)  # noqa: E731
    for dx, dy in ((0, 0), (1, 0), (2, -1)):
        assert float(weights[3 + dx] * weights[3 + dy]) == pytest.approx(_integrated(gauss, dx, dy), rel=1e-4)
    g = effects.FIBER_G_PER_FWHM * fwhm
    fiber = lambda x, y: g / (2 * math.pi) * (g * g + x * x + y * y) ** -1.5  # noqa: E731
    offsets = torch.arange(-2.0, 3.0, dtype=torch.float64)
    kernel = effects.fiber_pixel_weights(g, offsets, offsets)
    for dx, dy in ((0, 0), (1, 0), (2, -1)):
        assert float(kernel[2 + dy, 2 + dx]) == pytest.approx(_integrated(fiber, dx, dy), rel=1e-4)
    far = torch.tensor(1e9, dtype=torch.float64)
    assert 4 * float(effects.fiber_cumulative(far, far, g)) == pytest.approx(1.0, abs=1e-8)


@pytest.mark.parametrize("blur", [effects.gaussian_blur, effects.fiber_blur])
def test_blurs_are_convolutions_with_the_pixel_kernels(blur):
    """Against a direct sum over every source pixel; the total is kept but for what leaves the detector."""
    image = torch.zeros(9, 11, dtype=torch.float64)
    image[4, 5], image[1, 2] = 100.0, 30.0
    fwhm = 1.3
    result = blur(image, fwhm)
    ys = torch.arange(9, dtype=torch.float64)
    xs = torch.arange(11, dtype=torch.float64)
    expected = torch.zeros_like(image)
    for (sy, sx), value in ((4, 5), 100.0), ((1, 2), 30.0):
        if blur is effects.gaussian_blur:
            radius = 40
            w = effects.gaussian_pixel_weights(fwhm, radius)
            expected += value * w[(ys - sy).long() + radius][:, None] * w[(xs - sx).long() + radius][None, :]
        else:
            expected += value * effects.fiber_pixel_weights(effects.FIBER_G_PER_FWHM * fwhm, ys - sy, xs - sx)
    torch.testing.assert_close(result, expected, rtol=1e-9, atol=1e-9)


BAD_SETTINGS = {
    "flicker_fraction": (dict(flicker_fraction=1.5), "flicker_fraction must be a fraction"),
    "calibration_fraction": (dict(calibration_fraction=-0.1), "calibration_fraction must be a fraction"),
    "gain": (dict(gain_adu_per_photon=-1.0), "gain_adu_per_photon must be"),
    "psf width": (dict(psf_fwhm_um=-3.0), "psf_fwhm_um must be"),
    "psf without width": (dict(psf="fiber"), "psf fiber needs psf_fwhm_um > 0"),
    "readout": (dict(readout_noise_adu=-2.0), "readout_noise_adu must be"),
    "beamstop": (dict(beamstop_radius_mm=math.nan), "beamstop_radius_mm must be"),
    "defects": (dict(hot_pixel_fraction=0.6, dead_pixel_fraction=0.6), "must not exceed 1"),
    "generator": (dict(generator="mt19937"), "generator must be one of nanobragg, philox"),
}


@pytest.mark.parametrize("name", BAD_SETTINGS)
def test_bad_settings_name_their_key(name):
    settings, message = BAD_SETTINGS[name]
    with pytest.raises(NbsimError, match=message):
        check_response(DetectorResponseConfig(**settings))


GOOD = ("-default_F 100 -cell 100 100 100 90 90 90 -lambda 6.2 -N 2 -distance 100 -detpixels 8 -compile off "
        "-seed 3").split()
BAD_FLAGS = {
    "negative gain": (["-gain", "-1"], "-gain must not be negative"),
    "negative psf width": (["-psf", "gaussian", "-psf_fwhm", "-5"], "-psf_fwhm must not be negative"),
    "psf without width": (["-psf", "fiber"], "-psf fiber needs -psf_fwhm"),
    "flicker above one": (["-flicker", "1.5"], "-flicker must be a fraction between 0 and 1"),
    "negative dead fraction": (["-dead_pixels", "-0.1"], "-dead_pixels must be a fraction"),
    "negative readout": (["-readout_noise", "-1"], "-readout_noise must not be negative"),
    "unknown psf": (["-psf", "lorentz", "-psf_fwhm", "10"], "-psf expects one of none, gaussian, fiber"),
    "unknown generator": (["-noise_generator", "mt"], "-noise_generator expects one of nanobragg, philox"),
    "too many defects": (["-hot_pixels", "0.7", "-dead_pixels", "0.7"], "-hot_pixels and -dead_pixels together"),
}


@pytest.mark.parametrize("name", BAD_FLAGS)
def test_bad_detector_flags_stop_before_rendering(name, tmp_path, monkeypatch, capsys):
    flags, message = BAD_FLAGS[name]
    monkeypatch.chdir(tmp_path)
    assert main([*GOOD, *flags, "-noisefile", "noise.img"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_detector_flags_reach_the_noise_file(tmp_path, monkeypatch, capsys):
    """-noisefile holds the detector image of the float image; -floatfile stays noise-free."""
    monkeypatch.chdir(tmp_path)
    flags = ["-noise_generator", "philox", "-gain", "2", "-readout_noise", "1", "-psf", "gaussian", "-psf_fwhm", "80",
             "-beamstop", "0.2", "-adc", "20"]
    argv = [*GOOD, *flags, "-nopgm", "-floatfile", "f.bin", "-noisefile", "n.img"]
    assert main(argv) == 0
    image = torch.from_numpy(np.fromfile(tmp_path / "f.bin", dtype=np.float32).reshape(8, 8))
    response = DetectorResponseConfig(generator="philox", noise_seed=3, gain_adu_per_photon=2.0, readout_noise_adu=1.0,
                                      psf="gaussian", psf_fwhm_um=80.0, beamstop_radius_mm=0.2, adc_offset_adu=20.0)
    config = parse(argv)[0]
    assert config.response == response
    expected = detector_image(image, response, layout_of(resolve(config)))
    written = np.fromfile(tmp_path / "n.img", dtype=np.uint16, offset=512).reshape(8, 8)
    np.testing.assert_array_equal(written, expected.adu.numpy())
    assert f"{expected.total_photons:.0f} photons on noise image" in capsys.readouterr().out


def test_the_response_is_a_simulator_option_the_kernel_ignores():
    config = SimulationConfig().with_options(default_F=100.0, cell_A_deg=(50.0, 50.0, 50.0, 90.0, 90.0, 90.0))
    varied = config.with_options(psf="fiber", psf_fwhm_um=30.0, noise_seed=9, hot_pixel_fraction=0.01)
    assert varied.response.psf == "fiber" and varied.response.noise_seed == 9
    assert dataclass_from_dict(SimulationConfig, dataclass_to_dict(varied)) == varied
    assert structure_of(varied) == structure_of(config)


def test_detector_flags_under_nonoise_are_noted():
    notes = parse([*GOOD, "-nonoise", "-gain", "2"])[1].notes
    assert "-gain changes only the -noisefile image, which -nonoise turns off" in notes
