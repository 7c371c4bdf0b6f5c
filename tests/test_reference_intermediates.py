"""Intermediate values against what the C printed: geometry and cell in log.txt, per-pixel traces."""

from __future__ import annotations

import math
import re

import pytest
import torch

import nbsim
from nbsim.render import Renderer
from nbsim.resolve import resolve

from .conftest import case_params, load_case


def _numbers(log: str, label: str) -> list[float]:
    match = re.search(re.escape(label) + r"\s*([-+0-9.eE ]+)", log)
    assert match, f"{label} not in log"
    return [float(v) for v in match.group(1).split()]


@pytest.mark.parametrize("name", case_params())
def test_setup_matches_reference_log(name, in_golden_dir):
    """The geometry and cell, and what nanoBragg's rules chose where the flags leave it open (the oversample,
    sources, mosaic domains and spread, φ steps and range, sensor layers and μ), as the C printed them."""
    case = load_case(name)
    log = case.log()
    setup = resolve(nbsim.config_from_args(case.args))
    g = setup.geometry
    fbeam, sbeam = (float(v) for v in re.search(r"Fbeam=(\S+) Sbeam=(\S+)", log).groups())
    fclose, sclose = (float(v) for v in re.search(r"Fclose=(\S+) Sclose=(\S+)", log).groups())
    assert g.fbeam_m == pytest.approx(fbeam, rel=1e-5, abs=1e-9)
    assert g.sbeam_m == pytest.approx(sbeam, rel=1e-5, abs=1e-9)
    assert g.fclose_m == pytest.approx(fclose, rel=1e-5, abs=1e-9)
    assert g.sclose_m == pytest.approx(sclose, rel=1e-5, abs=1e-9)
    assert float(g.distance_m) == pytest.approx(float(re.search(r"distance=(\S+)", log).group(1)), rel=1e-5)
    for label, vector in (("DIRECTION_OF_DETECTOR_X-AXIS=", g.fdet), ("DIRECTION_OF_DETECTOR_Y-AXIS=", g.sdet),
                          ("DIRECTION_OF_DETECTOR_Z-AXIS=", g.odet), ("INCIDENT_BEAM_DIRECTION=", g.beam),
                          ("spindle ROTATION_AXIS=", g.spindle)):
        assert vector.tolist() == pytest.approx(_numbers(log, label), abs=1e-5)
    assert list(g.dials_origin_mm) == pytest.approx(_numbers(log, "dials origin="), rel=1e-5, abs=1e-6)
    assert setup.lattice.cell_parameters() == pytest.approx(_numbers(log, "Unit Cell:"), rel=1e-5)
    assert setup.lattice.reciprocal_parameters() == pytest.approx(_numbers(log, "Recp Cell:"), rel=1e-5)
    assert f"{setup.oversample}x{setup.oversample} pixel oversample steps" in log
    assert f"created a total of {setup.sources.count} sources" in log
    assert f"created a total of {setup.mosaic.count} mosaic domains" in log
    thickness_m, layers, mu_per_m = re.search(r"sensor is (\S+) m thick in (\d+) layers with mu= (\S+)", log).groups()
    assert (setup.sensor.thickness_m, setup.sensor.layers) == (pytest.approx(float(thickness_m), rel=1e-5), int(layers))
    assert setup.sensor.mu_per_m == pytest.approx(float(mu_per_m), rel=1e-5)
    spread_deg = re.search(r"mosaic domains over mosaic spread of (\S+) degrees", log).group(1)
    assert math.degrees(float(setup.mosaic.spread_rad)) == pytest.approx(float(spread_deg), rel=1e-5, abs=1e-9)
    phi_steps, phi_from_deg, phi_to_deg = re.search(r"(\d+) phi steps from (\S+) to (\S+) degrees", log).groups()
    phi = setup.phi
    assert phi.steps == int(phi_steps)
    assert [math.degrees(phi.start_rad), math.degrees(phi.start_rad + phi.osc_rad)] == pytest.approx(
        [float(phi_from_deg), float(phi_to_deg)], rel=1e-5, abs=1e-9)


def _traces(text: str):
    blocks = re.split(r"# pixel fast=", text)[1:]
    for block in blocks:
        fast, slow = (int(v) for v in re.match(r"(\d+) slow=(\d+)", block).groups())
        values = {key: float(value) for key, value in re.findall(r"^(I/steps|polar|omega|capfrac|pixel)\s+(\S+)",
                                                                   block, re.M)}
        hkl = [float(v) for v in re.search(r"hkl= (\S+) (\S+) (\S+)", block).groups()]
        hkl0 = [int(v) for v in re.search(r"hkl0= (\S+) (\S+) (\S+)", block).groups()]
        f_cell, f_latt, intensity = (float(v) for v in re.search(
            r"F_cell=(\S+)\s+F_latt=(\S+)\s+I = (\S+)", block).groups())
        yield fast, slow, values, hkl, hkl0, f_cell, f_latt, intensity


@pytest.mark.parametrize("name", case_params())
def test_pixel_trace_matches_reference(name, in_golden_dir):
    """Miller indices, F_cell, F_latt, I/steps (to the 10 digits printed: mosaic domains need the C's powf and
    single-precision angles), polarization, solid angle and capture fraction of two pixels."""
    case = load_case(name)
    renderer = Renderer(resolve(nbsim.config_from_args(case.args)), dtype=torch.float64, compile=False)
    for fast, slow, values, hkl, hkl0, f_cell, f_latt, intensity in _traces((case.folder / "trace.txt").read_text()):
        value, trace = renderer.trace(slow, fast)
        assert list(trace.hkl) == pytest.approx(hkl, abs=2e-6)
        assert list(trace.hkl0) == hkl0
        assert trace.f_cell == pytest.approx(f_cell, rel=1e-5)
        assert abs(trace.f_latt) == pytest.approx(abs(f_latt), rel=1e-5, abs=1e-5)
        assert trace.intensity == pytest.approx(intensity, rel=1e-5)
        assert trace.intensity / renderer.setup.steps == pytest.approx(values["I/steps"], rel=1e-9)  # 10 digits
        assert trace.polar == pytest.approx(values["polar"], rel=1e-8)
        assert trace.omega == pytest.approx(values["omega"], rel=1e-8)
        assert trace.capture == pytest.approx(values["capfrac"], rel=1e-8)
        assert float(value) == pytest.approx(values["pixel"], rel=1e-6)
