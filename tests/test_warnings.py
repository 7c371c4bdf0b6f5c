"""The warnings nanoBragg prints, printed by nbsim too (own wording, same information, stdout, once each)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from nbsim.cli import main

from .conftest import GOLDEN, load_case

BASE = "-default_F 100 -cell 100 100 100 90 90 90 -lambda 1 -N 5 -distance 100 -detpixels 16 -compile off".split()


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """The CLI writes its default outputs (intimage.img, noiseimage.img, image.pgm) into the working folder."""
    monkeypatch.chdir(tmp_path)


def warnings_of(arguments: list[str], capsys, tmp_path) -> list[str]:
    assert main([*arguments, "-floatfile", str(tmp_path / "image.bin")]) == 0
    output = capsys.readouterr()
    assert "WARNING" not in output.err
    return [line for line in output.out.splitlines() if line.startswith("WARNING")]


@pytest.mark.skipif(not (GOLDEN / "oversample3").is_dir(), reason="golden case oversample3 not present")
def test_sample_size_warning_matches_the_reference(capsys, tmp_path):
    case = load_case("oversample3")
    numbers = re.findall(r"maximum dimension of sample is (\S+) A\s+but reciprocal pixel size is (\S+) A.*?"
                         r"recommend -oversample (\d+)", case.log(), re.S)
    [expected] = numbers
    [line] = warnings_of([*case.args, "-compile", "off"], capsys, tmp_path)
    assert re.search(rf"maximum dimension of sample is {expected[0]} A but reciprocal pixel size is "
                     rf"{expected[1]} A: recommend -oversample {expected[2]}$", line), line


@pytest.mark.parametrize("extra, expected, domains", [
    (["-mosaic", "0.3"], "finite mosaic spread but no domain count: using 10 mosaic domains", 10),
    (["-mosaic_dom", "4"], "mosaic domains but no mosaic spread: using 1 mosaic domain", 1),
    (["-mosaic", "0", "-mosaic_dom", "4"], "zero mosaic spread: using 1 mosaic domain", 1),
])
def test_mosaic_domain_warnings(extra, expected, domains, capsys, tmp_path):
    assert main([*BASE, *extra, "-floatfile", str(tmp_path / "image.bin")]) == 0
    output = capsys.readouterr().out
    assert [line for line in output.splitlines() if line.startswith("WARNING")] == [f"WARNING: {expected}"]
    assert f"created a total of {domains} mosaic domains" in output


def test_no_warning_for_a_complete_mosaic(capsys, tmp_path):
    assert warnings_of([*BASE, "-mosaic", "0.3", "-mosaic_dom", "4"], capsys, tmp_path) == []


def test_zero_cells_warn_and_render_one(capsys, tmp_path):
    assert warnings_of([*BASE, "-N", "0"], capsys, tmp_path) == [
        "WARNING: no unit cells along a, b, c (-N 0): rendering one cell along each, as nanoBragg does"]


@pytest.mark.skipif(not (GOLDEN / "synthetic_P1.hkl").is_file(), reason="golden synthetic_P1.hkl not present")
def test_interpolation_out_of_range_warns_once(capsys, tmp_path):
    """Automatic interpolation (N = 2) near the edge of a 25³ table: nanoBragg prints "out of range for
    three point interpolation" once and interpolates no more; nbsim says where and why, once."""
    arguments = ["-hkl", str(GOLDEN / "synthetic_P1.hkl"), "-cell", "70", "80", "90", "75", "85", "95", "-misset",
                 "10", "20", "30", "-N", "2", "-lambda", "1.5", "-distance", "50", "-detpixels", "32", "-pixel",
                 "0.8", "-compile", "off"]
    [line] = warnings_of(arguments, capsys, tmp_path)
    assert line.startswith("WARNING: out of range for tricubic interpolation at pixel ")
    assert "(h -12..12, k -12..12, l -12..12)" in line and "interpolation is off from there on" in line
    assert warnings_of([*arguments, "-distance", "400"], capsys, tmp_path) == []


def test_an_empty_image_warns_with_its_photons(capsys, tmp_path):
    """An image holding fewer photons than -min_photons (default 1) is named an empty shot, in one line;
    a normal image, or -min_photons 0, says nothing."""
    [line] = [w for w in warnings_of([*BASE, "-fluence", "1e10"], capsys, tmp_path) if "photons in all" in w]
    total = float(re.search(r"holds (\S+) photons in all, fewer than -min_photons 1:", line).group(1))
    assert 0 <= total < 1e-10
    image = np.fromfile(tmp_path / "image.bin", np.float32)
    assert math.isclose(total, float(image.sum(dtype=np.float64)), rel_tol=1e-2)
    assert not [w for w in warnings_of(BASE, capsys, tmp_path) if "photons in all" in w]
    assert not [w for w in warnings_of([*BASE, "-fluence", "1e10", "-min_photons", "0"], capsys, tmp_path)
                if "photons in all" in w]
    bright = warnings_of([*BASE, "-min_photons", "1e30"], capsys, tmp_path)
    assert any("fewer than -min_photons 1e+30" in w for w in bright)
