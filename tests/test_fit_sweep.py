"""The sweep's `fit:` section: starting models perturbed from each shot's truth by the configured amounts,
reproducibly, and its configuration checks (the Snakemake run itself: tests/test_workflow.py)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import yaml

from nbsim.errors import NbsimError
from nbsim.fit.names import REFINABLE
from nbsim.fit.parameters import misorientation_deg
from nbsim.resolve import resolve
from nbsim.sweep import plan
from nbsim.sweep.fitting import PERTURBATIONS, FitJob, fit_chunks, perturbed_start
from nbsim.sweep.validate import validate_config

from .conftest import REPO_ROOT

SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
PERTURB = {"orientation_deg": 0.15, "cell_percent": 0.8, "N_percent": -30, "scale_factor": 3,
           "distance_mm": 1.0, "beam_mm": 0.2, "wavelength_percent": 0.1}


def fit_config(perturb: dict | None = None, **fit) -> dict:
    config = {"scenarios": {"s": {"args": "-default_F 100 -cell 40 50 60 90 90 90 -N 5 -distance 80 -mosaic 0.1"}},
              "sweep": {"sizes": [64], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"],
                        "batch_size": 5, "draws": {"count": 5, "seed": 3, "values": {"-misset": "random"}}},
              "timing": {"warmup": 0, "repeats": 0, "threads": 1}, "reference": False,
              "fit": {"refine": ["orientation", "cell", "N", "scale", "distance", "beam"], "seed": 4,
                      "start": {"perturb": copy.deepcopy(PERTURB if perturb is None else perturb)}, **fit}}
    return config


def starts(config: dict, tmp_path):
    """Each shot's truth and start, as a fit job builds them."""
    validate_config(config, SCHEMA, tmp_path)
    points = plan.sweep_points(config)
    specs = [plan.point_spec(config, p, tmp_path, {}) for p in points]
    out = []
    for spec in specs:
        truth = resolve(spec.config)
        out.append((spec, truth, perturbed_start(spec, truth, config["fit"], "s")))
    return out


def a_matrix(setup) -> torch.Tensor:
    return torch.linalg.inv(setup.lattice.real_A.detach().double()).T


def test_starts_are_off_by_the_configured_amounts(tmp_path):
    shots = starts(fit_config(), tmp_path)
    for _, truth, start in shots:
        assert misorientation_deg(a_matrix(start), a_matrix(truth)) == pytest.approx(0.15, abs=1e-6)
        ratios = [s / t for s, t in zip(start.lattice.cell_parameters()[:3], truth.lattice.cell_parameters()[:3],
                                        strict=True)]
        assert all(r == pytest.approx(1.008) or r == pytest.approx(0.992) for r in ratios)
        assert start.lattice.cell_parameters()[3:] == pytest.approx(truth.lattice.cell_parameters()[3:])
        assert [float(n) for n in start.n_cells] == pytest.approx([3.5, 3.5, 3.5])
        assert start.fluence / truth.fluence == pytest.approx(3.0)
        assert abs(float(start.geometry.distance_m - truth.geometry.distance_m)) * 1e3 == pytest.approx(1.0)
        beam_shift = math.hypot(start.geometry.beam_x_m - truth.geometry.beam_x_m,
                                start.geometry.beam_y_m - truth.geometry.beam_y_m) * 1e3
        assert beam_shift == pytest.approx(0.2)
        assert abs(start.config.beam.wavelength_A / truth.config.beam.wavelength_A - 1) == pytest.approx(1e-3)
    # directions and signs are drawn: the shots do not all move the same way
    signs = {tuple(np.sign(np.subtract(s.lattice.cell_parameters()[:3], t.lattice.cell_parameters()[:3])))
             for _, t, s in shots}
    assert len(signs) > 1


def test_a_shots_start_is_reproduced_alone_and_depends_on_the_seed(tmp_path):
    config = fit_config()
    all_five = starts(config, tmp_path)
    config["sweep"]["draws"]["count"] = 2
    first_two = starts(config, tmp_path)
    for (_, _, one), (_, _, other) in zip(first_two, all_five[:2], strict=False):
        assert torch.equal(one.lattice.real_A, other.lattice.real_A)
    config["fit"]["seed"] = 5
    reseeded = starts(config, tmp_path)
    assert not torch.equal(reseeded[0][2].lattice.real_A, first_two[0][2].lattice.real_A)


def test_shared_quantities_are_perturbed_once(tmp_path):
    shots = starts(fit_config(shared=["distance", "beam"]), tmp_path)
    assert len({float(start.geometry.distance_m) for _, _, start in shots}) == 1
    assert len({float(start.geometry.beam_x_m) for _, _, start in shots}) == 1
    assert len({tuple(start.lattice.cell_parameters()) for _, _, start in shots}) == len(shots)


def test_start_flags_replace_the_truth_and_keep_the_point(tmp_path):
    spec, truth, start = starts(fit_config({}, start={"flags": "-N 3 -distance 81"}), tmp_path)[0]
    assert [float(n) for n in start.n_cells] == [3.0, 3.0, 3.0]
    assert float(start.geometry.distance_m) * 1e3 == pytest.approx(81.0)
    assert torch.allclose(start.lattice.real_A, truth.lattice.real_A)  # the drawn orientation kept


def test_fit_chunks_split_a_batch():
    config = fit_config()
    batch = next(iter(plan.plan_sweep(plan.sweep_points(config), 5).batches.values()))
    chunks = fit_chunks(batch, 2)
    assert [name for name, _ in chunks] == ["f0000", "f0001", "f0002"]
    assert [p for _, points in chunks for p in points] == list(batch.points)


def test_fit_job_round_trips(tmp_path):
    config = fit_config()
    validate_config(config, SCHEMA, tmp_path)
    specs = tuple(plan.point_spec(config, p, tmp_path, {}) for p in plan.sweep_points(config)[:2])
    job = FitJob("s", "b", "f0000", specs, config["fit"], detector=False)
    assert FitJob.from_dict(job.to_dict()) == job


def test_schema_names_what_nbsim_fit_refines():
    schema = yaml.safe_load(SCHEMA.read_text())["properties"]["fit"]["properties"]
    assert schema["refine"]["items"]["enum"] == list(REFINABLE)
    assert set(schema["shared"]["items"]["enum"]) <= set(REFINABLE)
    assert set(schema["start"]["properties"]["perturb"]["properties"]) == set(PERTURBATIONS)
    assert set(PERTURBATIONS.values()) <= set(REFINABLE)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(shared=["beam"], refine=["orientation"]), "fit.shared: beam is not refined"),
    (lambda f: f.update(refine=["orientation", "colour"]), "fit.refine.1"),
    (lambda f: f["start"]["perturb"].update(spin_deg=1), "unknown key(s) 'spin_deg'"),
    (lambda f: f["start"].update(flags="-bogus 1"), "fit.start.flags: with scenario 's'"),
    (lambda f: f.update(shared=["orientation"]), "fit.shared.0"),
])
def test_bad_fit_section_is_one_line(tmp_path, change, message):
    config = fit_config()
    change(config["fit"])
    with pytest.raises(NbsimError) as error:
        validate_config(config, SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)
