"""Datasets: random draws as a sweep axis, their seeds and labels, re-rendering one point from its record,
resumable batch stores (a real SIGKILL), reading a dataset for training."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nbsim.errors import NbsimError
from nbsim.kernel.structure import structure_of
from nbsim.modes import Compile
from nbsim.sweep import plan
from nbsim.sweep.draws import draw, random_misset_deg
from nbsim.sweep.spec import BatchJob, PointSpec
from nbsim.sweep.store import completed_points, open_store_array
from nbsim.sweep.validate import validate_config

from .conftest import REPO_ROOT

SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
ARGS = "-default_F 100 -cell 70 80 90 75 85 95 -N 5 -oversample 1 -mosaic 0.2 -mosaic_domains 3 -distance 60"
DRAWS = {"count": 6, "seed": 7, "values": {
    "-misset": "random", "mosaic_spread_deg": {"uniform": [0.0, 0.5]}, "-N": {"integers": [3, 12]},
    "-lambda": {"normal": [1.0, 0.01]}}}


DETECTOR = {"noise": "poisson", "flicker_fraction": 0.05, "calibration_fraction": 0.03, "readout_noise_adu": 2.0,
            "psf": "gaussian", "psf_fwhm_um": 80.0}


def dataset_config(draws: dict | None = None, size: int = 32, batch_size: int = 4,
                   detector: dict | None = DETECTOR) -> dict:
    config = {"scenarios": {"s": {"args": ARGS}},
              "sweep": {"sizes": [size], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"],
                        "batch_size": batch_size, "draws": copy.deepcopy(draws or DRAWS)},
              "timing": {"warmup": 0, "repeats": 0, "threads": 1}, "reference": False}
    if detector is not None:
        config["sweep"]["detector"] = dict(detector)
    return config


def batch_jobs(config: dict, base: Path) -> list[BatchJob]:
    validate_config(config, SCHEMA, base)
    batches = plan.plan_sweep(plan.sweep_points(config), config["sweep"]["batch_size"]).batches
    return [BatchJob(scenario=scenario, batch=name, points=tuple(plan.point_spec(config, p, base, {})
                                                                for p in batch.points),
                     dtype="float32", device="cpu", compile=Compile.OFF, warmup=0, repeats=0, threads=1,
                     compile_cache=str(base / "cache"), detector="detector" in config["sweep"])
            for (scenario, name), batch in batches.items()]


def test_a_draw_depends_on_the_seed_and_its_index_alone():
    many = [p.draw for p in plan.sweep_points(dataset_config({**DRAWS, "count": 50}))]
    assert [p.draw for p in plan.sweep_points(dataset_config())] == many[:6]
    assert draw(DRAWS, 37) == many[37]
    assert draw({**DRAWS, "seed": 8}, 37) != many[37]
    one_key = draw({**DRAWS, "values": {"-N": DRAWS["values"]["-N"]}}, 37)
    assert dict(one_key.values)["-N"] == dict(many[37].values)["-N"]
    values = {key: [dict(d.values)[key] for d in many] for key in DRAWS["values"]}
    assert set(values["-N"]) <= set(range(3, 13)) and len(set(values["-N"])) > 3
    assert all(0.0 <= v < 0.5 for v in values["mosaic_spread_deg"])
    assert len({d.seeds for d in many}) == 50
    assert all(dict(d.values)["-misset"] == random_misset_deg(dict(d.seeds)["misset"]) for d in many)


def test_integers_include_both_ends():
    drawn = {dict(draw({"seed": 1, "values": {"-N": {"integers": [2, 3]}}}, k).values)["-N"] for k in range(40)}
    assert drawn == {2, 3}


def test_random_orientations_are_uniform_on_so3():
    from nbsim.sweep.draws import random_rotation

    generator = np.random.default_rng(3)
    rotations = np.array([random_rotation(generator) for _ in range(4000)])
    assert np.allclose(rotations @ rotations.transpose(0, 2, 1), np.eye(3), atol=1e-12)
    assert np.allclose(np.linalg.det(rotations), 1.0)
    # Uniform on SO(3): each column is uniform on the sphere (mean 0, second moment 1/3 per component).
    assert np.abs(rotations.mean(axis=0)).max() < 0.05
    assert np.abs((rotations ** 2).mean(axis=0) - 1 / 3).max() < 0.03


def test_a_point_renders_what_its_arguments_say(tmp_path):
    """The draw's seed and orientation are applied as options (one parse for draws of options alone); its
    argv (what the C binary and the records get) parses to the same configuration."""
    from nbsim.nanobragg import config_from_args

    config = dataset_config()
    for point in plan.sweep_points(config)[:3]:
        spec = plan.point_spec(config, point, tmp_path, {})
        assert "-misset" in spec.argv and "-mosaic_seed" in spec.argv
        parsed = config_from_args(spec.argv).with_options(**dict(point.options))
        assert parsed == dataclasses.replace(spec.config, response=parsed.response)


def test_drawn_values_change_no_kernel_structure(tmp_path):
    config = dataset_config({**DRAWS, "count": 20})
    structures = {structure_of(plan.point_config(config, p, tmp_path)) for p in plan.sweep_points(config)}
    assert len(structures) == 1
    configs = [plan.point_config(config, p, tmp_path) for p in plan.sweep_points(config)]
    assert len({c.crystal.n_cells for c in configs}) > 1 and len({c.beam.wavelength_A for c in configs}) == 20


def _missing_file_draws(tmp_path):
    (tmp_path / "a.hkl").write_text("0 0 1 10\n")
    return {"count": 2, "values": {"-hkl": {"choice": ["a.hkl", "b.hkl"]}}}


@pytest.mark.parametrize("draws, message", [
    ({"count": 2, "values": {"mosaic_spread_deg": {"uniform": [0.5, 0.1]}}},
     "sweep.draws.values.mosaic_spread_deg.uniform: lo 0.5 > hi 0.1"),
    ({"count": 2, "values": {"-N": {"integers": [9, 3]}}}, "sweep.draws.values.-N.integers: lo 9 > hi 3"),
    ({"count": -1, "values": {}}, "sweep.draws.count: -1 is not valid here (minimum: 0)"),
    ({"count": 2, "values": {"-N": {"poisson": [3]}}},
     "sweep.draws.values.-N: unknown key(s) 'poisson'; the keys here: uniform,"),
    ({"count": 2, "values": {"-lambda": {"normal": [1.0, -0.1]}}},
     "sweep.draws.values.-lambda.normal.1: -0.1 is not valid here (minimum: 0)"),
    ({"count": 2, "values": {"-N": "random"}}, "sweep.draws.values.-N: 'random' draws the orientation"),
    ({"count": 2, "values": {"-lamda": {"uniform": [1, 2]}}}, "'-lamda' is not a nanoBragg option (did you mean"),
    ({"count": 3, "values": {"-lambda": {"normal": [0.0, 1.0]}}}, "sweep.draws.values.-lambda: draw "),
    ({"count": 2, "values": {"-N": {"uniform": [3, 5]}}}, "sweep.draws.values.-N: draw 0 gave"),
    (_missing_file_draws, "sweep.draws.values.-hkl.choice: file b.hkl does not exist"),
    ({"count": 2, "values": {"mosaic_spread_deg": {"uniform": [-0.5, -0.1]}}},
     "sweep.draws.values.mosaic_spread_deg: draw 0 gave -0."),
    ({"count": 2, "values": {"mosaic_spread_deg": {"uniform": [-0.5, -0.1]}}},
     "mosaic_spread_deg must be a finite number not below 0 (got -0."),
    ({"count": 3, "values": {"wavelength_A": {"normal": [0.0, 1.0]}}}, "wavelength_A must be positive (got "),
])
def test_bad_draws_fail_with_one_line_naming_the_key(tmp_path, draws, message):
    draws = draws(tmp_path) if callable(draws) else draws
    with pytest.raises(NbsimError) as error:
        validate_config(dataset_config(draws), SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("detector, message", [
    ({"gain_adu_per_photon": -1.0}, "sweep.detector: gain_adu_per_photon must be a finite number not below 0"),
    ({"psf": "gaussian", "psf_fwhm_um": -5.0}, "sweep.detector: psf_fwhm_um must be a finite number not below 0"),
    ({"noise": "gauss"}, "sweep.detector.noise: \"gauss\" is not valid here"),
    ({"gian_adu_per_photon": 2.0}, "'gian_adu_per_photon' is not a detector setting (did you mean"),
    ({"noise_seed": 3}, "sweep.detector.noise_seed: with sweep.draws every point's seeds derive"),
])
def test_bad_detector_settings_fail_with_one_line_naming_the_key(tmp_path, detector, message):
    with pytest.raises(NbsimError) as error:
        validate_config(dataset_config(detector=detector), SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_points_render_into_the_store_with_labels_and_reproduce_from_their_record(tmp_path):
    from nbsim.sweep.jobs import render_record, run_batch

    job = batch_jobs(dataset_config(), tmp_path)[0]
    record = run_batch(job, tmp_path / "images.zarr", tmp_path / "records.json")
    assert record["rendered"] == len(job.points) and record["resumed"] == 0
    assert completed_points(tmp_path / "images.zarr").all()
    stored = open_store_array(tmp_path / "images.zarr", "image")
    entry = json.loads((tmp_path / "records.json").read_text())["points"][2]
    labels = entry["labels"]
    assert labels["draw"] == 2 and {"noise_seed", "mosaic_seed", "misset_seed", "calibration_seed"} <= set(labels)
    assert labels["N"] == dict(job.points[2].labels)["N"] and labels["wavelength_A"] == labels["lambda"]
    spec = PointSpec.from_dict(entry)
    assert spec.config.crystal.mosaic_seed == labels["mosaic_seed"]
    assert spec.config.crystal.misset_deg == (labels["misset_x_deg"], labels["misset_y_deg"], labels["misset_z_deg"])
    assert (spec.config.response.noise_seed, spec.config.response.calibration_seed) == \
        (labels["noise_seed"], labels["calibration_seed"])
    again = render_record(json.loads(json.dumps(entry)))  # from the record alone
    image = again["image"]
    assert np.array_equal(image, stored[2]) and image.max() > 0
    detector = open_store_array(tmp_path / "images.zarr", "detector_image")
    assert detector.dtype == np.uint16 and np.array_equal(again["detector_image"], detector[2])
    assert not np.array_equal(detector[2], detector[3]) and detector[2].max() > 40
    assert labels["total_photons"] == pytest.approx(float(image.sum(dtype=np.float64)))
    a_matrix = np.array([labels[f"A_{r}{c}"] for r in range(3) for c in range(3)]).reshape(3, 3)
    assert abs(np.linalg.det(a_matrix)) == pytest.approx(1 / (70 * 80 * 90), rel=0.05)
    # The farthest corner of 32 pixels of 0.1 mm, 60 mm away, from the beam at 1.65 + 0.05 mm (mosflm).
    two_theta = math.atan(math.hypot(1.7e-3, 1.7e-3) / 0.06)
    assert labels["corner_resolution_A"] == pytest.approx(labels["lambda"] / (2 * math.sin(two_theta / 2)), rel=1e-9)
    assert (labels["mosaic_domains"], labels["phi_steps"]) == (3, 1)  # -mosaic_domains 3 given; a still
    assert record["store_files"] <= 20 and record["bytes_per_image"] > 0


RUN_BATCH = """
import json, sys
from pathlib import Path
from nbsim.sweep.jobs import run_batch
from nbsim.sweep.spec import BatchJob
job = BatchJob.from_dict(json.loads(Path(sys.argv[1]).read_text()))
run_batch(job, Path(sys.argv[2]), Path(sys.argv[3]))
"""


def test_a_batch_killed_mid_way_resumes_with_only_the_missing_points(tmp_path):
    """SIGKILL a batch job once some of its points are in its store; the rerun renders only the others,
    and the store ends identical to an uninterrupted run's."""
    from nbsim.sweep.jobs import run_batch

    job = batch_jobs(dataset_config({**DRAWS, "count": 40}, size=64, batch_size=40), tmp_path)[0]
    job_path = tmp_path / "job.json"
    job_path.write_text(json.dumps(job.to_dict()))
    store, records = tmp_path / "killed" / "images.zarr", tmp_path / "killed" / "records.json"
    process = subprocess.Popen([sys.executable, "-c", RUN_BATCH, str(job_path), str(store), str(records)],
                               cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if (store / "done" / "zarr.json").is_file():
            # The job held while its store is read: a slow read (zarr's first import here, 0.5-1 s on a loaded
            # core, as long as the job takes for the 20 points between two flushes) lets no point through.
            process.send_signal(signal.SIGSTOP)
            done = int(completed_points(store).sum())
            if done >= 3:
                break
            process.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    process.kill()
    process.wait()
    done = int(completed_points(store).sum())
    assert 3 <= done < len(job.points), f"the kill came at {done} of {len(job.points)} points"
    assert not records.exists()
    resumed = run_batch(job, store, records)
    assert resumed["resumed"] == done and resumed["rendered"] == len(job.points) - done
    clean = run_batch(job, tmp_path / "clean" / "images.zarr", tmp_path / "clean" / "records.json")
    assert clean["rendered"] == len(job.points)
    assert np.array_equal(open_store_array(store, "image")[...],
                          open_store_array(tmp_path / "clean" / "images.zarr", "image")[...])
    labels = [p["labels"] for p in resumed["points"]]
    assert labels == [p["labels"] for p in clean["points"]]
    assert resumed["store_files"] <= 20


def test_a_multi_panel_dataset_keeps_each_shots_detector_image_of_its_panels(tmp_path):
    """A -panelfile scenario with a detector stage: each shot's detector image is its panels read out
    (nbsim.detector, each panel's own point spread), stored (point, panel, slow, fast) with zero padding, its
    draws the shot's own and again from its record alone."""
    from nbsim.sweep.jobs import render_record, run_batch

    panels = [{"name": name, "pixels": [pixels_f, 12], "pixel_mm": 0.2, "fdet": [0, 0, 1], "sdet": [0, -1, 0],
               "pix0_mm": [60, 1.2, corner]} for name, pixels_f, corner in (("m0", 16, -3.3), ("m1", 10, 0.1))]
    (tmp_path / "panels.yaml").write_text(json.dumps({"panels": panels}))
    config = dataset_config({"count": 2, "seed": 3, "values": {"-misset": "random"}}, batch_size=2)
    config["scenarios"]["s"]["args"] = ("-default_F 100 -cell 40 50 60 90 90 90 -N 5 -oversample 1 -fluence 1e28 "
                                        f"-panelfile {tmp_path / 'panels.yaml'}")
    [job] = batch_jobs(config, tmp_path)
    run_batch(job, tmp_path / "images.zarr", tmp_path / "records.json")
    detector = open_store_array(tmp_path / "images.zarr", "detector_image")[...]
    image = open_store_array(tmp_path / "images.zarr", "image")[...]
    assert detector.shape == image.shape == (2, 2, 12, 16) and detector.dtype == np.uint16
    assert not detector[:, 1, :, 10:].any() and detector[:, :, :, :10].max() > 0
    assert not np.array_equal(detector[0], detector[1])
    entry = json.loads((tmp_path / "records.json").read_text())["points"][1]
    assert np.array_equal(render_record(json.loads(json.dumps(entry)))["detector_image"], detector[1])
    assert entry["labels"]["detector_photons"] > 0


def test_another_job_replaces_the_store(tmp_path):
    from nbsim.sweep.jobs import run_batch

    first = batch_jobs(dataset_config(), tmp_path)[0]
    run_batch(first, tmp_path / "images.zarr", tmp_path / "records.json")
    second = batch_jobs(dataset_config({**DRAWS, "seed": 8}), tmp_path)[0]
    record = run_batch(second, tmp_path / "images.zarr", tmp_path / "records.json")
    assert record["resumed"] == 0 and record["rendered"] == len(second.points)


def test_a_collated_dataset_reads_as_labels_and_images(tmp_path):
    from nbsim.sweep import SweepImages, open_dataset
    from nbsim.sweep.collate import point_rows, write_collated_store, write_labels
    from nbsim.sweep.jobs import run_batch

    config = dataset_config()
    records, stores = [], {}
    for job in batch_jobs(config, tmp_path):
        folder = tmp_path / job.batch
        run_batch(job, folder / "images.zarr", folder / "records.json")
        records.append(folder / "records.json")
        stores[job.batch] = folder / "images.zarr"
    rows = point_rows(records, [])
    write_labels(rows, tmp_path / "labels.csv")
    write_collated_store(rows, stores, plan.sweep_axes(config), tmp_path / "sweep.zarr")
    table = list(csv.DictReader((tmp_path / "labels.csv").open()))
    assert [int(row["draw"]) for row in table] == list(range(6))
    dataset = open_dataset(tmp_path / "sweep.zarr")
    assert {"A_00", "wavelength_A", "noise_seed", "N", "misset_x_deg", "corner_resolution_A",
            "total_photons", "max_photons", "overloads"} <= set(dataset.coords)
    assert [float(v) for v in dataset["lambda"].values] == [float(row["lambda"]) for row in table]
    images = SweepImages(tmp_path / "sweep.zarr", labels=("N", "wavelength_A"))
    image, target = images[4]
    assert len(images) == 6 and tuple(image.shape) == (32, 32)
    assert target.tolist() == [float(table[4]["N"]), float(table[4]["wavelength_A"])]
    batch, index = table[4]["batch"], int(table[4]["index"])
    assert np.array_equal(image.numpy(), open_store_array(stores[batch], "image")[index])
    assert math.isfinite(float(dataset["total_photons"].sum()))
    with pytest.raises(NbsimError, match="no label"):
        SweepImages(tmp_path / "sweep.zarr", labels=("nothing",))


def test_a_batch_store_of_100_images_is_at_most_20_files(tmp_path):
    from nbsim.sweep.store import BatchStore

    store = BatchStore(tmp_path / "images.zarr", "job", [f"p{i}" for i in range(100)], (16, 16),
                       {"image": np.float32, "detector_image": np.uint16}, {})
    for index in range(100):
        store.write(index, {"image": np.full((16, 16), index, np.float32),
                            "detector_image": np.full((16, 16), index, np.uint16)}, {"n": index})
    store.finish({})
    assert len([p for p in (tmp_path / "images.zarr").rglob("*") if p.is_file()]) <= 20
    assert completed_points(tmp_path / "images.zarr").all()
    assert [entry["n"] for entry in store.entries()] == list(range(100))
    assert open_store_array(tmp_path / "images.zarr", "detector_image")[57].max() == 57


def test_a_choice_of_files_draws_each_file(tmp_path):
    for name, f in (("a.hkl", 10), ("b.hkl", 20)):
        (tmp_path / name).write_text("".join(f"{h} {k} {l} {f}\n" for h in range(-2, 3) for k in range(-2, 3)
                                             for l in range(-2, 3)))
    config = dataset_config({"count": 12, "seed": 3, "values": {"-hkl": {"choice": ["a.hkl", "b.hkl"]}}},
                            detector=None)
    config["scenarios"]["s"]["args"] = "-cell 30 30 30 90 90 90 -N 3 -oversample 1 -distance 60"
    validate_config(config, SCHEMA, tmp_path)
    specs = [plan.point_spec(config, p, tmp_path, {}) for p in plan.sweep_points(config)]
    files = [spec.config.structure.hkl_file for spec in specs]
    assert set(files) == {str(tmp_path / "a.hkl"), str(tmp_path / "b.hkl")}
    assert [spec.labels["hkl"] for spec in specs] == [Path(f).name for f in files]


def test_a_dataset_needs_no_timing_section_and_a_timing_sweep_does(tmp_path):
    """With draws, a config without `timing` renders each point once, one thread per job, and times
    repeats (when asked for) on each batch's first point only; without draws `timing` is required."""
    config = dataset_config()
    del config["timing"]
    validate_config(config, SCHEMA, tmp_path)
    assert config["timing"] == {"warmup": 0, "repeats": 0, "threads": 1, "every_point": False}
    asked = {**dataset_config(), "timing": {"warmup": 0, "repeats": 2, "threads": 2}}
    validate_config(asked, SCHEMA, tmp_path)
    assert asked["timing"]["every_point"] is False
    sweep = dataset_config()
    del sweep["timing"], sweep["sweep"]["draws"]
    with pytest.raises(NbsimError, match=r"^timing: required for a sweep without sweep.draws"):
        validate_config(sweep, SCHEMA, tmp_path)
    sweep["timing"] = {"warmup": 0, "repeats": 1, "threads": 1}
    validate_config(sweep, SCHEMA, tmp_path)
    assert sweep["timing"]["every_point"] is True


def test_only_the_first_point_of_a_dataset_batch_is_timed_with_repeats(tmp_path):
    """timing.every_point false (a dataset's default): the batch's first point gets its warm repeats, the
    others are rendered once; true: every point gets them."""
    from nbsim.sweep.jobs import run_batch

    job = batch_jobs(dataset_config(size=16, batch_size=3, detector=None), tmp_path)[0]
    for every_point, repeats in ((False, [2, 0, 0]), (True, [2, 2, 2])):
        timed = dataclasses.replace(job, repeats=2, every_point=every_point)
        folder = tmp_path / str(every_point)
        record = run_batch(timed, folder / "images.zarr", folder / "records.json")
        assert [len(p["timing"]["warm_times_s"]) for p in record["points"]] == repeats


def test_batch_sizes_follow_the_cost_model(tmp_path):
    """Without sweep.batch_size: batches the cost model puts near TARGET_JOB_S, in a multiple of the jobs
    that run side by side, costlier points (more steps per pixel, larger images) in smaller batches."""
    from nbsim.sweep.batching import TARGET_JOB_S, Timing, batch_sizes, point_cost_s

    def planned(args: str, size: int, count: int, parallel_jobs: int) -> tuple[int, int, float]:
        config = dataset_config({**DRAWS, "count": count}, size=size)
        config["scenarios"]["s"]["args"] = args
        del config["sweep"]["batch_size"]
        points = validate_config(config, SCHEMA, tmp_path)
        with plan.structure_memo(None) as memo:
            sizes = batch_sizes(config, points, tmp_path, memo, Timing(1, 1), parallel_jobs, reference=False)
            steps = memo.steps_per_pixel(plan.point_config(config, points[0], tmp_path))
        batches = len(plan.plan_sweep(points, sizes).batches)
        return sizes[("s", size)], batches, point_cost_s(size * size, steps, "cpu", False, "float32", Timing(1, 1))

    light_size, light_batches, light_cost_s = planned(ARGS, 128, 2000, 2)
    assert light_batches >= 2 and light_batches % 2 == 0
    assert light_size * light_cost_s <= TARGET_JOB_S + light_cost_s
    assert light_size * light_cost_s >= TARGET_JOB_S / 2 or light_batches == 2
    heavy_size, heavy_batches, heavy_cost_s = planned(ARGS.replace("-mosaic_domains 3", "-mosaic_domains 30"),
                                                      128, 2000, 2)
    assert heavy_cost_s > light_cost_s and heavy_size < light_size and heavy_batches > light_batches
    assert planned(ARGS, 128, 2000, 3)[1] % 3 == 0
    few_size, few_batches, _ = planned(ARGS, 32, 5, 8)
    assert (few_size, few_batches) == (1, 5)  # fewer points than cores: one each


@pytest.mark.parametrize("args", [
    ARGS,
    "-default_F 100 -cell 70 80 90 75 85 95 -N 5 -distance 60",  # automatic oversample
    "-default_F 100 -cell 70 80 90 90 90 90 -N 5 -osc 0.3 -phisteps 4 -dispersion 1 -dispsteps 3 "
    "-detector_thick 100 -detector_thicksteps 2 -oversample 2",
])
def test_steps_per_pixel_is_what_the_set_up_resolves(args):
    """The cost model's steps per pixel, from the configuration alone, are the resolved set-up's work per
    pixel: its steps (sources × mosaic domains × phi steps × sub-pixels, nanoBragg's count) times its sensor
    layers."""
    from nbsim.kernel.structure import steps_per_pixel
    from nbsim.nanobragg import config_from_args
    from nbsim.resolve import resolve

    config = config_from_args([*args.split(), "-detpixels", "16"])
    setup = resolve(config)
    assert steps_per_pixel(config) == setup.steps * setup.sensor.layers > 1


def test_a_job_planning_again_names_the_planning_processs_batches(tmp_path):
    """A SLURM job plans the sweep again on its node (other cores): it reads the batch sizes the planning
    process kept for the same configuration rather than computing others."""
    from nbsim.sweep.batching import kept_batch_sizes

    path, config = tmp_path / "sizes.json", dataset_config()
    planned = kept_batch_sizes(path, config, True, lambda: {("s", 32): 3})
    assert planned == {("s", 32): 3}
    assert kept_batch_sizes(path, config, False, lambda: {("s", 32): 5}) == planned
    other = {**config, "sweep": {**config["sweep"], "sizes": [64]}}
    assert kept_batch_sizes(path, other, False, lambda: {("s", 64): 5}) == {("s", 64): 5}


def test_planning_imports_no_torch_where_it_computes_no_count(tmp_path):
    """Validation and the batch cost model need PyTorch only to compute counts (a sampling advice, a point's
    steps per pixel): a dataset whose arguments give the mosaic domains (and no rotation) validates, and a
    sweep of one point per size and variant gets its batches (a point each, whatever it costs), without
    importing it, as every Snakemake start plans (each saves a PyTorch import, about 1.5 s of CPU). A sweep
    with CUDA points asks PyTorch for its devices only where the installed PyTorch is built for a GPU
    (torch.version's cuda or hip): a CPU build refuses them without the import."""
    import torch

    sweep = dataset_config(size=32)
    del sweep["sweep"]["draws"], sweep["sweep"]["batch_size"]
    sweep["sweep"].update(sizes=[32, 64], dtypes=["float32", "float64"])
    cuda = copy.deepcopy(sweep)
    cuda["sweep"]["devices"] = ["cpu", "cuda"]
    script = ("import json, sys\n"
              "from pathlib import Path\n"
              "from nbsim.errors import NbsimError\n"
              "from nbsim.sweep.batching import Timing, batch_sizes\n"
              "from nbsim.sweep.plan import StructureMemo\n"
              "from nbsim.sweep.validate import validate_config\n"
              "dataset, sweep, cuda, schema, base = *map(json.loads, sys.argv[1:4]), *map(Path, sys.argv[4:])\n"
              "shots = validate_config(dataset, schema, base)\n"
              "sizes = batch_sizes(sweep, validate_config(sweep, schema, base), base, StructureMemo(None), "
              "Timing(1, 1), 2, False)\n"
              "planned = 'torch' in sys.modules\n"
              "try:\n"
              "    validate_config(cuda, schema, base, devices=True)\n"
              "    refused = None\n"
              "except NbsimError as error:\n"
              "    refused = str(error)\n"
              "print(json.dumps([len(shots), sorted(sizes.values()), planned, refused, 'torch' in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", script, *(json.dumps(c) for c in (dataset_config(), sweep, cuda)),
                           str(SCHEMA), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shots, sizes, planned, refused, imported = json.loads(done.stdout)
    assert [shots, sizes, planned] == [DRAWS["count"], [1, 1], False]
    assert imported == (torch.version.cuda is not None or torch.version.hip is not None)
    if torch.cuda.is_available():
        assert refused is None
    else:
        assert refused.startswith("sweep.devices: cuda is not available: this machine has 0 CUDA device(s)")


def test_shots_take_the_advised_sampling_unless_told(tmp_path):
    """A dataset's shots render with -sampling advised: the mosaic domains their arguments leave out follow
    each shot's drawn spread and cell count (nbsim's sampling advice, never below nanoBragg's 10), the C gets
    them as -mosaic_dom, counts given are kept, and -sampling nanobragg keeps nanoBragg's default."""
    from nbsim.reference import c_arguments
    from nbsim.resolve import config_sampling_advice

    config = dataset_config({**DRAWS, "values": {"-misset": "random", "-mosaic": {"uniform": [1.0, 4.0]},
                                                 "-N": {"integers": [8, 16]}}})
    config["scenarios"]["s"]["args"] = ARGS.replace(" -mosaic_domains 3", "")
    domains = []
    for point in plan.sweep_points(config):
        spec = plan.point_spec(config, point, tmp_path, {})
        assert spec.argv[spec.argv.index("-sampling") + 1] == "advised"
        advised = max(config_sampling_advice(spec.config).mosaic_domains, 10)  # never below nanoBragg's 10
        assert spec.config.crystal.mosaic_domains == advised
        c_argv = c_arguments(list(spec.argv), tmp_path / "sources.txt")
        assert "-sampling" not in c_argv and c_argv[c_argv.index("-mosaic_dom") + 1] == str(advised)
        domains.append(advised)
    assert len(set(domains)) > 1
    point = plan.sweep_points(config)[0]
    assert plan.point_config(dataset_config(), point, tmp_path).crystal.mosaic_domains == 3
    config["scenarios"]["s"]["args"] += " -sampling nanobragg"
    told = plan.point_spec(config, point, tmp_path, {})
    assert told.argv.count("-sampling") == 1 and told.config.crystal.mosaic_domains is None
