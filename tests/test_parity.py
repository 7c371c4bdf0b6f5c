"""Images against the nanoBragg C binary's own outputs (../shared/golden)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import nbsim
from nbsim.cli import main
from nbsim.reference import correlation
from nbsim.render import Renderer
from nbsim.resolve import resolve

from .conftest import GOLDEN, case_params, load_case, requires_golden


def _assert_close(image: np.ndarray, reference: np.ndarray, min_correlation: float, max_relative: float):
    assert image.shape == reference.shape
    assert np.isfinite(image).all()
    corr = correlation(image, reference)
    worst = float(np.abs(image.astype(np.float64) - reference).max()) / float(np.abs(reference).max())
    assert corr >= min_correlation, f"correlation {corr:.9f} < {min_correlation}"
    assert worst <= max_relative, f"max |diff| / max = {worst:.3g} > {max_relative}"


@pytest.mark.parametrize("name", case_params())
def test_cli_float64_outputs_match_reference(name, tmp_path, in_golden_dir, capsys):
    """float.bin, int.img pixels (±1 count) and SMV header keys, via the nanoBragg-compatible CLI."""
    case = load_case(name)
    floatfile, intfile = tmp_path / "float.bin", tmp_path / "int.img"
    status = main([*case.args, "-floatfile", str(floatfile), "-intfile", str(intfile), "-nonoise", "-nopgm",
                   "-dtype", "float64", "-compile", "off"])
    assert status == 0, capsys.readouterr().err
    image = np.fromfile(floatfile, dtype=np.float32).reshape(case.shape)
    _assert_close(image, case.float_image(), 0.999999, 1e-5)

    ints = np.fromfile(intfile, dtype=np.uint16, offset=512).reshape(case.shape).astype(np.int64)
    assert np.abs(ints - case.int_image()).max() <= 1
    header = (intfile.read_bytes()[:512].decode("ascii").split("}")[0])
    ours = dict(line.rstrip(";").split("=", 1) for line in header.splitlines() if "=" in line)
    assert ours.keys() == case.header().keys()
    for key, value in case.header().items():
        if key in ("DIALS_ORIGIN",):
            np.testing.assert_allclose([float(v) for v in ours[key].split(",")],
                                       [float(v) for v in value.split(",")], rtol=1e-5, atol=1e-9)
        elif key not in ("BYTE_ORDER", "TYPE", "DETECTOR_SN", "BEAMLINE"):
            assert float(ours[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-9), key
        else:
            assert ours[key] == value


@pytest.mark.parametrize("name", case_params())
def test_float32_matches_reference(name, in_golden_dir):
    case = load_case(name)
    image = nbsim.simulate(nbsim.config_from_args(case.args), dtype=torch.float32, compile=False)
    assert image.dtype == torch.float32
    _assert_close(image.numpy(), case.float_image(), 0.99999, 1e-3)


@pytest.mark.slow
@requires_golden
@pytest.mark.parametrize("name, mode", [("seed_bench_256", "aot"), ("triclinic_hkl", "jit")])
def test_compiled_kernel_matches_reference(name, mode, in_golden_dir, monkeypatch):
    """Both compiled paths (ahead-of-time package and torch.compile) render the reference image, and
    the same pixels when a region of interest makes tiles narrower than the image or a single row."""
    monkeypatch.setenv("NBSIM_COMPILE_MODE", mode)
    case = load_case(name)
    renderer = Renderer(resolve(nbsim.config_from_args(case.args)), dtype=torch.float32, compile=True)
    assert renderer.mode == mode
    image = renderer().numpy()
    _assert_close(image, case.float_image(), 0.99999, 1e-3)
    tiled = Renderer(resolve(nbsim.config_from_args(case.args)), dtype=torch.float32, compile=True,
                     tile_elements=16 * case.shape[1])().numpy()
    np.testing.assert_allclose(tiled, image, rtol=1e-6, atol=0)
    last_column = case.shape[1] - 1
    for xmin, xmax, ymin, ymax in [(3, 40, 5, 30), (7, 7, 9, 9), (0, last_column, 11, 11), (0, last_column, 20, 60)]:
        roi = ["-roi", str(xmin), str(xmax), str(ymin), str(ymax)]
        region = Renderer(resolve(nbsim.config_from_args([*case.args, *roi])), dtype=torch.float32,
                          compile=True)().numpy()
        np.testing.assert_allclose(region[ymin:ymax + 1, xmin:xmax + 1], image[ymin:ymax + 1, xmin:xmax + 1],
                                   rtol=1e-6, atol=0)


SUITE_STRUCTURES = ("single-square-default", "steps-square-default", "steps-square-nearest")
"""The structures whose float32 kernels other tests build anyway: between them they render 14 of the 21
golden cases. NBSIM_FULL_PARITY=1 builds every structure in both dtypes (24 kernels; about 5 minutes per
dtype on 2 cores from an empty cache, see docs/kernels.md)."""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", case_params())
def test_compiled_kernels_match_reference(name, dtype, in_golden_dir, monkeypatch):
    """Every golden case through the ahead-of-time kernels of its structure (built once per structure,
    whatever the case's counts and values), to the eager tests' tolerances."""
    monkeypatch.setenv("NBSIM_COMPILE_MODE", "aot")
    case = load_case(name)
    renderer = Renderer(resolve(nbsim.config_from_args(case.args)), dtype=dtype, compile=True)
    if not os.environ.get("NBSIM_FULL_PARITY") and (renderer.structure.name not in SUITE_STRUCTURES
                                                    or dtype != torch.float32):
        pytest.skip(f"the suite builds no {str(dtype)[6:]} kernel of structure {renderer.structure.name} "
                    "(NBSIM_FULL_PARITY=1 builds it)")
    assert renderer.mode == "aot"
    image = renderer().numpy()
    if dtype == torch.float64:
        _assert_close(image, case.float_image(), 0.999999, 1e-5)
    else:
        _assert_close(image, case.float_image(), 0.99999, 1e-3)


@requires_golden
def test_golden_folder_is_where_the_tests_look():
    """Guard against silently skipping every parity test because of a wrong path."""
    assert (GOLDEN / "cases.txt").is_file()
