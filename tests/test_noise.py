"""nanoBragg's noise image, bit for bit: its serial ran1/poidev sequence (compiled from
nbsim/detector/nanobragg_noise.c) against the C program's noise.img of the golden noise cases."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nbsim.cli import main
from nbsim.config import DetectorResponseConfig
from nbsim.detector import PixelLayout, detector_image
from nbsim.detector.native import nanobragg_poisson
from nbsim.rng import Ran1

from .conftest import GOLDEN, requires_golden

NOISE = GOLDEN / "noise"
NOISE_CASES = ("seed_bench_256", "flux_adc_roi", "triclinic_hkl")


def _case(name: str) -> tuple[list[str], np.ndarray, bytes, str]:
    folder = NOISE / name
    args = json.loads((folder / "meta.json").read_text())["args"].split()
    image = np.fromfile(folder / "float.bin", dtype=np.float32).reshape(256, 256)
    line = next(line for line in (folder / "log.txt").read_text().splitlines() if "photons on noise" in line)
    return args, image, (folder / "noise.img").read_bytes(), line


def _value(args: list[str], flag: str, count: int = 1) -> list[str] | None:
    return args[args.index(flag) + 1:args.index(flag) + 1 + count] if flag in args else None


@requires_golden
@pytest.mark.parametrize("name", NOISE_CASES)
def test_the_c_float_image_gives_the_c_noise_image(name):
    """Fed the C's own float image, the detector stage draws the C's noise image and prints its line."""
    args, image, noise, line = _case(name)
    roi = _value(args, "-roi", 4)
    response = DetectorResponseConfig(noise_seed=int(_value(args, "-seed")[0]),
                                      adc_offset_adu=float((_value(args, "-adc") or ["40"])[0]))
    result = detector_image(torch.from_numpy(image), response,
                            PixelLayout(0.1, roi=tuple(map(int, roi)) if roi else None))
    expected = np.frombuffer(noise, dtype=np.uint16, offset=512).reshape(256, 256)
    np.testing.assert_array_equal(result.adu.numpy().astype(np.uint16), expected)
    assert f"{result.total_photons:.0f} photons on noise image ({result.overloads} overloads)" == line
    assert result.max_photons == float(result.photons.max())


@requires_golden
@pytest.mark.slow
@pytest.mark.parametrize("name", NOISE_CASES)
def test_the_command_line_writes_the_c_noise_file(name, tmp_path, monkeypatch, capsys):
    """The same arguments give the C's noise file, header and all: without -dtype the noise image's render is
    float64, whose float image is the C's to the bit. In float32 the float image differs from the C's in the
    last bits and a pixel whose draw count changes shifts the serial stream for all that follow
    (docs/detector.md)."""
    args, _, noise, line = _case(name)
    monkeypatch.chdir(NOISE)
    out = tmp_path / "noise.img"
    assert main([*args, "-compile", "off", "-nopgm", "-floatfile", str(tmp_path / "f.bin"),
                 "-intfile", str(tmp_path / "i.img"), "-noisefile", str(out)]) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert out.read_bytes() == noise


@pytest.mark.parametrize(("extra", "dtype"), [([], "float64"), (["-nonoise"], "float32"),
                                              (["-noise_generator", "philox"], "float32"),
                                              (["-dtype", "float32"], "float32")])
def test_the_default_precision_follows_the_noise_image(extra, dtype):
    """nanoBragg's noise image needs nanoBragg's float image to the bit: float64 unless -dtype says otherwise;
    without that noise image the default is float32."""
    from nbsim.nanobragg import parse

    _, run = parse(["-default_F", "1", "-cell", "50", "50", "50", "90", "90", "90", *extra])
    assert run.dtype == dtype


def test_a_positive_seed_continues_the_table_of_the_earlier_draws():
    """As in the C: a seed <= 0 restarts ran1, a positive one continues the shuffle table left by the
    mosaic and misset draws, or, with none before, starts as seed 1 does."""
    image = np.linspace(0.0, 30.0, 400, dtype=np.float32).reshape(20, 20)
    roi = (0, 19, 0, 19)
    fresh = nanobragg_poisson(image, roi, -1)[0]
    np.testing.assert_array_equal(nanobragg_poisson(image, roi, 5)[0], fresh)
    generator = Ran1()
    seed = -12345678
    for _ in range(6):
        _, seed = generator.draw(seed)
    continued = nanobragg_poisson(image, roi, 5, np.array(generator.table()))[0]
    restarted = nanobragg_poisson(image, roi, -5, np.array(generator.table()))[0]
    assert not np.array_equal(continued, restarted)
    np.testing.assert_array_equal(restarted, nanobragg_poisson(image, roi, -5)[0])


def test_pixels_outside_the_roi_take_no_draw_and_read_zero():
    """Outside the ROI nanoBragg draws nothing and its noise image holds 0; inside, the draws are those of
    the ROI alone, in row order."""
    image = np.full((6, 8), 3.0, dtype=np.float32)
    whole = nanobragg_poisson(image, (0, 7, 0, 5), -9)[0]
    part = nanobragg_poisson(image, (2, 5, 1, 3), -9)[0]
    assert not part[0].any() and not part[:, :2].any() and not part[4:].any()
    np.testing.assert_array_equal(part[1:4, 2:6].ravel(), whole.ravel()[:12])
    result = detector_image(torch.from_numpy(image), DetectorResponseConfig(noise_seed=9, adc_offset_adu=10),
                            PixelLayout(0.1, roi=(2, 5, 1, 3)))
    assert not result.adu[0].any() and bool((result.adu[1:4, 2:6] >= 10).all())


def test_overloads_are_clamped_and_counted():
    image = np.array([[70000.0, 10.0], [2e6, 0.0]], dtype=np.float32)
    result = detector_image(torch.from_numpy(image), DetectorResponseConfig(noise_seed=3), PixelLayout(0.1))
    assert result.overloads == 2
    assert result.adu[0, 0] == result.adu[1, 0] == 65535
    assert re.fullmatch(r"\d+", f"{result.total_photons:.0f}") and result.total_photons > 2e6


@pytest.mark.parametrize("physics, wrapped", [("nanobragg", True), ("corrected", False)])
def test_a_negative_adc_wraps_the_noise_image_as_nanoBragg_casts_it(physics, wrapped, tmp_path, monkeypatch):
    """nanoBragg casts photons + -adc to unsigned 16 bits unclamped below: -5 reads 65531 (measured on the C
    binary, -adc -10: 347 of 576 pixels); -physics corrected clamps at 0. Same seed, same draws."""
    monkeypatch.chdir(tmp_path)
    argv = ("-default_F 100 -cell 60 70 80 90 90 90 -N 3 -lambda 1 -distance 80 -detpixels 12 -pixel 0.4 -seed 7 "
            f"-nopgm -compile off -fluence 1e25 -physics {physics}").split()
    assert main([*argv, "-adc", "0", "-noisefile", "plain.img"]) == 0
    assert main([*argv, "-adc", "-10", "-noisefile", "shifted.img"]) == 0
    plain, shifted = (np.fromfile(name, dtype=np.uint16, offset=512).astype(np.int64)
                      for name in ("plain.img", "shifted.img"))
    assert (plain < 10).any()
    expected = (plain - 10) % 65536 if wrapped else np.maximum(plain - 10, 0)
    np.testing.assert_array_equal(shifted, expected)


def test_readout_noise_below_zero_is_clamped_not_wrapped(tmp_path, monkeypatch):
    """The wrap is nanoBragg's cast on its own path only: nbsim's readout noise (nanoBragg has none) that takes
    a pixel below 0 reads 0, not 65535 less it."""
    monkeypatch.chdir(tmp_path)
    argv = ("-default_F 100 -cell 60 70 80 90 90 90 -N 3 -lambda 1 -distance 80 -detpixels 12 -pixel 0.4 -seed 7 "
            "-nopgm -compile off -fluence 1e25 -adc 0 -readout_noise 3 -noisefile noisy.img").split()
    assert main(argv) == 0
    noisy = np.fromfile("noisy.img", dtype=np.uint16, offset=512)
    assert (noisy == 0).any() and noisy.max() < 65000


def test_c_unsigned_cast_is_x86s_cast_through_an_int():
    from nbsim.detector.response import c_unsigned_cast

    values = torch.tensor([-5.7, 65535.9, 70000.0, -1e10, 3e9, float("nan"), 200.2], dtype=torch.float64)
    assert c_unsigned_cast(values, 16).tolist() == [65531, 65535, 70000 - 65536, 0, 0, 0, 200]
    assert c_unsigned_cast(values, 8).tolist() == [251, 255, 112, 0, 0, 0, 200]


def test_processes_building_at_once_share_one_library(tmp_path):
    """The compiled code is built into the cache by whichever process comes first; processes that build
    at the same time each rename a whole library into place, and all of them load it."""
    script = ("import numpy as np; from nbsim.detector.native import nanobragg_poisson, library_path, find_compiler; "
              "print(nanobragg_poisson(np.full((4, 4), 3.0, np.float32), (0, 3, 0, 3), -1)[1], "
              "library_path(find_compiler()))")
    environment = {**os.environ, "NBSIM_CACHE_DIR": str(tmp_path / "cache")}
    processes = [subprocess.Popen([sys.executable, "-c", script], env=environment, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert len({out for out, _ in outputs}) == 1
    assert [path.name for path in (tmp_path / "cache" / "native").iterdir()] == [Path(outputs[0][0].split()[1]).name]
