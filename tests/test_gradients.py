"""Differentiability: torch.autograd.gradcheck in float64 on a tiny detector."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import nbsim
from nbsim.modes import Mode
from nbsim.render import Renderer
from nbsim.resolve import resolve

BASE = ("-default_F 100 -cell 70 80 90 80 85 95 -N 3 -lambda 1.2 "
        "-distance 80 -detpixels 3 -pixel 8 -Xbeam 20 -Ybeam 15 -oversample 1").split()


def _image(config: nbsim.SimulationConfig) -> torch.Tensor:
    return nbsim.simulate(config, dtype=torch.float64, compile=False)


def _check(build, *values: float):
    parameters = tuple(torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values)
    assert torch.autograd.gradcheck(lambda *p: _image(build(*p)), parameters, eps=1e-6, atol=1e-5, rtol=1e-3)


def _with(config: nbsim.SimulationConfig, part: str, **fields) -> nbsim.SimulationConfig:
    return dataclasses.replace(config, **{part: dataclasses.replace(getattr(config, part), **fields)})


@pytest.fixture(scope="module")
def base() -> nbsim.SimulationConfig:
    return nbsim.config_from_args(BASE)


def test_gradient_distance(base):
    _check(lambda d: _with(base, "detector", distance_mm=d), 80.0)


def test_gradient_cell_lengths_and_angles(base):
    _check(lambda a, b, c, al, be, ga: _with(base, "crystal", cell_A_deg=(a, b, c, al, be, ga)),
           70.0, 80.0, 90.0, 80.0, 85.0, 95.0)


def test_gradient_misset(base):
    _check(lambda x, y, z: _with(base, "crystal", misset_deg=(x, y, z)), 10.0, 20.0, 30.0)


def test_gradient_detector_rotations_and_twotheta(base):
    _check(lambda x, y, z, t: _with(base, "detector", rotation_deg=(x, y, z), twotheta_deg=t), 1.0, 2.0, 3.0, 4.0)


def test_gradient_wavelength(base):
    _check(lambda lam: _with(base, "beam", wavelength_A=lam), 1.2)


def test_gradient_mosaic_spread(base):
    mosaic = _with(base, "crystal", mosaic_domains=4, mosaic_seed=7)
    _check(lambda spread: _with(mosaic, "crystal", mosaic_spread_deg=spread), 0.5)


def test_mosaic_angles_are_the_c_single_precision_products_unless_the_spread_carries_gradients():
    """nanoBragg rounds spread·fraction to a float (without the rounding a fuzzed -printout_pixel I was off
    by up to 2e-7); a spread with gradients keeps the smooth product that gradcheck differentiates."""
    from nbsim.model.crystal import MosaicDomains

    spread_rad = math.radians(1.32)

    def angle_rad(spread: torch.Tensor) -> torch.Tensor:
        domains = MosaicDomains(axes=np.array([[0.0, 0.0, 1.0]] * 2), angle_fractions=np.array([1.0, 0.3]),
                                spread_rad=spread)
        rotation = domains.matrices()[1]
        return torch.atan2(rotation[1, 0], rotation[0, 0])

    c_angle_rad = float(np.float32(spread_rad) * np.float32(0.3))
    assert c_angle_rad != pytest.approx(spread_rad * 0.3, rel=1e-9)
    assert angle_rad(torch.tensor(spread_rad, dtype=torch.float64)).item() == pytest.approx(c_angle_rad, rel=1e-14)
    smooth = torch.tensor(spread_rad, dtype=torch.float64, requires_grad=True)
    angle = angle_rad(smooth)
    angle.backward()
    assert angle.item() == pytest.approx(spread_rad * 0.3, rel=1e-14)
    assert smooth.grad.item() == pytest.approx(0.3, rel=1e-12)


def test_gradient_flows_to_image_values(base):
    """A gradient that is actually non-zero (gradcheck alone would pass for a constant function)."""
    distance = torch.tensor(80.0, dtype=torch.float64, requires_grad=True)
    _image(_with(base, "detector", distance_mm=distance)).sum().backward()
    assert distance.grad is not None and distance.grad.abs() > 0


def test_gradient_beam_centre(base):
    _check(lambda x, y: _with(base, "detector", beam_x_mm=x, beam_y_mm=y), 12.0, 11.0)


def test_auto_renders_gradients_eagerly_and_says_so(base, monkeypatch):
    """`auto` never compiles a backward in the caller's process: it renders eagerly and the decision says why."""
    monkeypatch.delenv("NBSIM_COMPILE_MODE", raising=False)
    distance = torch.tensor(80.0, requires_grad=True)
    renderer = Renderer(resolve(_with(base, "detector", distance_mm=distance)), compile="auto")
    decision = renderer.settle()
    assert decision.mode is Mode.EAGER and decision.note.startswith("gradients:")
    renderer().sum().backward()
    assert distance.grad is not None and distance.grad.abs() > 0


def test_compile_on_with_gradients_warns_and_renders_eagerly(base, monkeypatch):
    """A compiled backward is not offered (docs/kernels.md): `on` renders eagerly with a warning saying why."""
    monkeypatch.delenv("NBSIM_COMPILE_MODE", raising=False)
    distance = torch.tensor(80.0, requires_grad=True)
    with pytest.warns(UserWarning, match="compile on: gradients: eager render"):
        renderer = Renderer(resolve(_with(base, "detector", distance_mm=distance)), compile="on")
    assert renderer.mode is Mode.EAGER


def test_tiled_gradient_equals_one_tile(base):
    """Tiles are checkpointed (recomputed in the backward): the gradient does not depend on the tiling."""
    config = base.with_options(pixels_f=8, pixels_s=8)
    grads = []
    for tile_elements in (8, None):
        distance = torch.tensor(80.0, dtype=torch.float64, requires_grad=True)
        setup = resolve(_with(config, "detector", distance_mm=distance))
        Renderer(setup, dtype=torch.float64, compile="off", tile_elements=tile_elements)().sum().backward()
        grads.append(distance.grad)
    assert grads[0] != 0 and torch.allclose(grads[0], grads[1], rtol=1e-12)


def test_refinement_example_converges():
    """docs/examples/refine_geometry.py: L-BFGS on the DiffractionModel brings distance and beam centre to
    the truth (2 mm and a pixel off at the start)."""
    path = Path(__file__).resolve().parent.parent / "docs" / "examples" / "refine_geometry.py"
    spec = importlib.util.spec_from_file_location("refine_geometry", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    history = example.refine(pixels=64, steps=30)
    first_loss, last_loss = history[0][0], history[-1][0]
    assert last_loss < first_loss
    for name, truth in example.TRUTH.items():
        assert abs(history[-1][1][name] - truth) < 0.01, (name, history[-1][1])
