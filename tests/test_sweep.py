"""The sweep's plan, range axes, validation and collation, without Snakemake."""

from __future__ import annotations

import dataclasses
import json
import math
import tracemalloc
import types
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import workloads
from benchmarks.sweep_workloads import write_synthetic_batches
from nbsim.config import SimulationConfig
from nbsim.errors import NbsimError
from nbsim.modes import Compile
from nbsim.nanobragg import parse
from nbsim.sweep.collate import point_rows, write_collated_store
from nbsim.sweep.plan import axis_values, plan_sweep, point_argv, point_config, point_spec, sweep_points
from nbsim.sweep.spec import PointSpec, dataclass_from_dict, dataclass_to_dict, field_types
from nbsim.sweep.store import SHARD_BYTES, images_per_shard, read_store
from nbsim.sweep.validate import validate_config

from .conftest import REPO_ROOT, SEED_ARGS

SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


def config_with(extra: dict, sizes=(8,), batch_size: int | None = None) -> dict:
    sweep = {"sizes": sizes if isinstance(sizes, dict) else list(sizes), "dtypes": ["float32"], "devices": ["cpu"],
             "compile": ["off"], "extra": extra}
    if batch_size:
        sweep["batch_size"] = batch_size
    return {"scenarios": {"seed": {"args": SEED_ARGS}}, "sweep": sweep,
            "timing": {"warmup": 0, "repeats": 1, "threads": 1}}


@pytest.mark.parametrize("spec, values", [
    ({"start": 0, "stop": 0.5, "step": 0.1}, [0.0, 0.1, 0.2, 0.3, 0.4]),
    ({"start": 1, "stop": 0, "step": -0.25}, [1.0, 0.75, 0.5, 0.25]),
    ({"start": 0, "stop": 10, "step": 3}, [0, 3, 6, 9]),
    ({"count": 3}, [0, 1, 2]),
    ({"count": 3, "start": 5, "step": 2}, [5, 7, 9]),
    ({"count": 2, "start": 0.5}, [0.5, 1.5]),
    ([3, "random", 1.5], [3, "random", 1.5]),
])
def test_axis_values(spec, values):
    assert axis_values(spec) == values


def test_range_axes_validate_and_expand(tmp_path):
    config = config_with({"-phi": {"start": 0, "stop": 100, "step": 0.1}, "-misset_seed": {"count": 4, "start": 1}},
                         sizes={"start": 8, "stop": 17, "step": 8})
    points = validate_config(config, SCHEMA, tmp_path)  # plan.sweep_points's, each point built once
    assert len(points) == 2 * 1000 * 4
    assert {p.size for p in points} == {8, 16}
    assert points[-1].axis_values["phi"] == 99.9 and points[-1].axis_values["misset_seed"] == 4
    assert points[0].name == "n8-float32-cpu-compile_off-misset_seed_1-phi_0.0"
    assert "batch_size" not in config["sweep"]  # the cost model's (nbsim.sweep.batching)


@pytest.mark.parametrize("extra, message", [
    ({"-phi": {"start": 0, "stop": 1, "step": 0}}, "sweep.extra.-phi: "),
    ({"-phi": {"start": 0, "stop": 1}}, "is not a list of values, {start, stop, step} or {count, start, step}"),
    ({"-phi": {"start": 0, "stop": 1, "step": 0.1, "count": 3}}, "is not a list of values"),
    ({"-phi": {"start": 1, "stop": 0, "step": 0.1}}, "holds no value"),
    ({"-phi": {"count": 0}}, "sweep.extra.-phi"),
    ({"-phi": {"start": 0, "stop": 1e-8, "step": 1e-15}}, "more than 1000000"),
    ({"-phi": [1, 1.0]}, "values repeat"),
    ({"-phi": [0.5, -0.5], "phi": [1]}, "is not a simulator option"),
    ({"mosaic_spred_deg": [0.1]}, "'mosaic_spred_deg' is not a simulator option (did you mean mosaic_spread_deg?); "
     "nbsim show --options lists them"),
    ({"-mosiac": [0.1]}, "'-mosiac' is not a nanoBragg option (did you mean -mosaic?); nbsim -h lists them"),
    ({"-distance": ["1 2", "1_2"]}, "give the same point name"),
    ({"-N": {"start": 1, "stop": 2, "step": 0.5}},
     "sweep.extra.-N: value 1.0 in scenario 'seed': -N expects an integer, got '1.0'"),
    ({"-distance": [100, 0]}, "-distance must be positive"),
    ({"mosaic_spread_deg": [0.1, "wide"]}, "sweep.extra.mosaic_spread_deg: value 'wide': expects a number"),
    ({"mosaic_domains": [2, 2.5]}, "expects an integer"),
    ({"curved": [True, "yes"]}, "expects true or false"),
    ({"n_cells": [5]}, "cannot be an axis of single values"),
])
def test_bad_axes_fail_with_one_line(tmp_path, extra, message):
    with pytest.raises(NbsimError, match=None) as error:
        validate_config(config_with(extra), SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("where, key, message", [
    ((), "compile_cach", "top level: unknown key(s) 'compile_cach' (did you mean compile_cache?); the keys here: "),
    (("sweep",), "dtype", "sweep: unknown key(s) 'dtype' (did you mean dtypes?); the keys here: sizes, dtypes,"),
])
def test_misspelt_keys_are_named_with_the_keys_allowed(tmp_path, where, key, message):
    config = config_with({})
    block = config
    for name in where:
        block = block[name]
    block[key] = 1
    with pytest.raises(NbsimError) as error:
        validate_config(config, SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_devices_that_cannot_be_had_fail_before_any_job_with_the_fix(tmp_path, monkeypatch):
    """A CUDA device this machine lacks fails validation (naming on_unavailable_device: skip) unless the
    config skips such points or declares a SLURM GPU partition, where they will run."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = config_with({})
    config["sweep"]["devices"] = ["cpu", "cuda"]
    validate_config(config, SCHEMA, tmp_path)  # without devices=True (a job on a node) devices are not checked
    with pytest.raises(NbsimError) as error:
        validate_config(config, SCHEMA, tmp_path, devices=True)
    assert str(error.value) == ("sweep.devices: cuda is not available: this machine has 0 CUDA device(s) and no "
                                "slurm.gpu_partition is set; set sweep.on_unavailable_device: skip to record its "
                                "points as skipped")
    for fix in ({"sweep": {**config["sweep"], "on_unavailable_device": "skip"}},
                {"slurm": {"gpu_partition": "gpu"}}):
        validate_config({**config, **fix}, SCHEMA, tmp_path, devices=True)


def test_input_files_are_read_before_any_job_and_relative_to_the_config(tmp_path):
    """A scenario's files and file-valued axis values are read (strictly) during validation, relative to the
    config's folder, and the points carry them as absolute paths."""
    (tmp_path / "good.hkl").write_text("0 0 1 100\n1 0 0 50\n")
    (tmp_path / "bad.hkl").write_text("0 0 1 100\n1 0 zero 50\n")
    (tmp_path / "short.mat").write_text("1 0 0\n0 1 0\n")
    config = config_with({"-hkl": ["good.hkl"]})
    validate_config(config, SCHEMA, tmp_path)
    argv = point_argv(config, sweep_points(config)[0], tmp_path)
    assert argv[-2:] == ("-hkl", str(tmp_path / "good.hkl"))
    with pytest.raises(NbsimError, match=r"value 'bad.hkl' in scenario 'seed': .*bad.hkl:2: 'zero' is not a number"):
        validate_config(config_with({"-hkl": ["good.hkl", "bad.hkl"]}), SCHEMA, tmp_path)
    config = config_with({})
    config["scenarios"]["seed"]["args"] = SEED_ARGS + " -mat short.mat"
    with pytest.raises(NbsimError, match=r"scenario 'seed': .*short.mat: a MOSFLM matrix needs 9 numbers"):
        validate_config(config, SCHEMA, tmp_path)


def test_sizes_range_must_be_whole_pixels(tmp_path):
    with pytest.raises(NbsimError, match="whole numbers of pixels"):
        validate_config(config_with({}, sizes={"start": 8, "stop": 9, "step": 0.5}), SCHEMA, tmp_path)


def test_negative_values_keep_distinct_names():
    points = sweep_points(config_with({"-phi": [-0.5, 0.5]}))
    assert [p.name for p in points] == ["n8-float32-cpu-compile_off-phi_m0.5", "n8-float32-cpu-compile_off-phi_0.5"]


def test_batches_follow_the_value_order_and_pair_with_their_references():
    config = config_with({"-phi": axis_values({"start": 0, "stop": 0.5, "step": 0.1})}, sizes=(8, 12))
    config["sweep"]["dtypes"] = ["float32", "float64"]
    plan = plan_sweep(sweep_points(config), batch_size=2)
    assert len(plan.batches) == 2 * 2 * 3 and len(plan.references) == 2 * 3
    batch = plan.batches[("seed", "n8-float64-cpu-compile_off-b0001")]
    assert [p.axis_values["phi"] for p in batch.points] == [0.2, 0.3]
    reference = plan.references[("seed", batch.reference)]
    assert [p.reference_name for p in reference.points] == [p.reference_name for p in batch.points]
    changed = config_with({"-phi": [0.0, 0.1, 0.2, 0.35, 0.4]}, sizes=(8, 12))
    changed["sweep"]["dtypes"] = ["float32", "float64"]
    after = plan_sweep(sweep_points(changed), batch_size=2)
    differing = {key for key in plan.batches if plan.batches[key] != after.batches[key]}
    assert differing == {("seed", f"n{size}-{dtype}-cpu-compile_off-b0001") for size in (8, 12)
                         for dtype in ("float32", "float64")}


def test_a_float64_point_is_compared_as_rendered_not_as_stored(tmp_path):
    """A float64 point is its float64 reference's own configuration: its comparison is exact, not the float32
    rounding of the store it is kept in (the default sweep's tables read 4.7e-8 there before)."""
    from nbsim.sweep.jobs import run_batch
    from nbsim.sweep.spec import BatchJob

    config = config_with({}, sizes=(12,))
    config["sweep"]["dtypes"] = ["float64"]
    validate_config(config, SCHEMA, tmp_path)
    plan = plan_sweep(sweep_points(config), batch_size=1)
    [((_, name), batch)] = plan.batches.items()

    def job(points, batch_name: str, is_reference: bool) -> BatchJob:
        return BatchJob(scenario="seed", batch=batch_name,
                        points=tuple(point_spec(config, p, tmp_path, {}, as_reference=is_reference) for p in points),
                        dtype="float64", device="cpu", compile=Compile.OFF, warmup=0, repeats=1, threads=1,
                        compile_cache=str(tmp_path / "cache"), is_reference=is_reference)

    run_batch(job(plan.references[("seed", batch.reference)].points, batch.reference, True),
              tmp_path / "reference.zarr", tmp_path / "reference.json")
    record = run_batch(job(batch.points, name, False), tmp_path / "points.zarr", tmp_path / "points.json",
                       tmp_path / "reference.zarr")
    [point] = record["points"]
    assert point["comparison"]["max_abs_error"] == 0.0 and point["comparison"]["max_rel_error"] == 0.0


def test_collation_holds_one_shard_at_a_time(tmp_path):
    """Collating 160 points of 256 x 256 (42 MB of images) never holds more than one shard of images (64 of
    the 160 here: nbsim.sweep.store.SHARD_BYTES), the same images as read from a batch store, the shard's
    encoded copy and the small per-point tables, and every point lands at its own coordinate."""
    size, batches, per_batch = 256, 4, 40
    records, stores = write_synthetic_batches(tmp_path, batches, per_batch, size, "phi")
    rows = point_rows(records, [])
    axes = ["size", "dtype", "device", "compile", "phi"]
    tracemalloc.start()
    baseline, _ = tracemalloc.get_traced_memory()
    write_collated_store(rows, stores, axes, tmp_path / "sweep.zarr")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    image_bytes = size * size * 4
    shard_bytes = images_per_shard(batches * per_batch, image_bytes) * image_bytes
    assert shard_bytes <= SHARD_BYTES and shard_bytes < batches * per_batch * image_bytes / 2
    assert peak - baseline < 3 * shard_bytes + 8 * image_bytes, f"collation peaked at {(peak - baseline) / 1e6:.1f} MB"
    dataset = read_store(tmp_path / "sweep.zarr")
    series = dataset["image"].squeeze()
    assert series.dims == ("phi", "slow", "fast") and series.shape[0] == batches * per_batch
    assert dataset["image"].encoding["chunks"][-2:] == (size, size)
    assert np.prod(dataset["image"].encoding["chunks"][:-2]) == 1
    for phi in (0, 77, 159):
        assert float(series.sel(phi=phi).max()) == phi + 1
    assert json.loads(str(dataset["attributes"].squeeze().sel(phi=77).values))["name"] == \
        "n256-float32-cpu-compile_on-b0001-37"


def _through_json(config: SimulationConfig) -> SimulationConfig:
    return dataclass_from_dict(SimulationConfig, json.loads(json.dumps(dataclass_to_dict(config))))


@pytest.mark.parametrize("argv, options", [
    (workloads.SEED_ARGS, {}),
    (workloads.HEAVY_ARGS, {"sensor_absorption_depth_um": math.inf, "mosaic_spread_deg": 0}),
    (("-cell", "70", "80", "90", "75", "85", "95", "-misset", "random", "-N", "5", "-detpixels", "16",
      "-roi", "1", "8", "2", "9", "-beam_vector", "0", "0", "1", "-curved_det"), {"interpolate": None}),
])
def test_config_survives_its_json_round_trip(argv, options):
    """Exactly: tuples stay tuples, None stays None, ints stay ints (repr tells 1 from 1.0 and () from [])."""
    config = parse(list(argv))[0].with_options(**options)
    assert repr(_through_json(config)) == repr(config)


def _values(hint) -> st.SearchStrategy | None:
    """Any value of a config field's type (None for torch.Tensor, which a sweep never holds)."""
    if hint is type(None):
        return st.none()
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([s for s in map(_values, arguments) if s is not None])
    if origin is tuple:
        if arguments[-1] is Ellipsis:
            return st.lists(_values(arguments[0]), max_size=4).map(tuple)
        return st.tuples(*map(_values, arguments))
    if origin is typing.Literal:
        return st.sampled_from(arguments)
    if dataclasses.is_dataclass(hint):
        return st.builds(hint, **{name: _values(h) for name, h in field_types(hint).items()})
    return {bool: st.booleans(), int: st.integers(), float: st.floats(allow_nan=False), str: st.text()}.get(hint)


@settings(max_examples=60, deadline=None)
@given(_values(SimulationConfig))
def test_any_config_survives_its_json_round_trip(config):
    assert repr(_through_json(config)) == repr(config)


def test_one_planning_parses_each_argv_once(tmp_path, monkeypatch):
    """With one PointBuilds (as the Snakefile keeps), validation and the specs share a parse per distinct
    argv: two -phi values and three mosaic spreads (an option) are two parses, not six nor twelve."""
    import nbsim.nanobragg
    from nbsim.sweep.plan import PointBuilds

    parsed: list[tuple[str, ...]] = []
    parse = nbsim.nanobragg.config_from_args
    monkeypatch.setattr(nbsim.nanobragg, "config_from_args", lambda argv: parsed.append(tuple(argv)) or parse(argv))
    config = config_with({"-phi": [0.5, 1.0], "mosaic_spread_deg": [0.1, 0.2, 0.3]})
    builds = PointBuilds()
    validate_config(config, SCHEMA, tmp_path, builds=builds)
    specs = [point_spec(config, point, tmp_path, {}, builds=builds) for point in sweep_points(config)]
    assert len(specs) == 6 and len({spec.config for spec in specs}) == 6
    assert len(parsed) == len(set(parsed)) == 2
    point_spec(config, sweep_points(config)[0], tmp_path, {})  # without one: a parse of its own
    assert len(parsed) == 3


def test_point_spec_round_trip_and_no_parsing_after_planning(tmp_path):
    """A spec carries the parsed configuration: the batch job renders `spec.config` as planned, and the
    argv is there only for the C binary and the reader."""
    config = config_with({"-phi": [0.5], "mosaic_spread_deg": [0.2]})
    validate_config(config, SCHEMA, tmp_path)
    [point] = sweep_points(config)
    spec = point_spec(config, point, tmp_path, {})
    assert PointSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.config == point_config(config, point, tmp_path)  # validation builds what planning builds
    assert spec.config.crystal.phi_start_deg == 0.5 and spec.config.crystal.mosaic_spread_deg == 0.2
    assert spec.argv[-4:] == ("-detpixels", "8", "-phi", "0.5") and spec.kernel is None
    assert spec.axes == {"size": 8, "dtype": "float32", "device": "cpu", "compile": "off", "mosaic_spread_deg": 0.2,
                         "phi": 0.5}


@pytest.mark.parametrize("values", [[2.5], ["four"], [1, True]])
def test_a_value_that_fails_validation_fails_planning_too(tmp_path, values):
    """Validation builds each point as planning does (`point_config`): one channel, the same verdict (and
    True is no integer even after 1 has built)."""
    config = config_with({"mosaic_domains": values})
    with pytest.raises(NbsimError, match="sweep.extra.mosaic_domains: value"):
        validate_config(config, SCHEMA, tmp_path)
    with pytest.raises(NbsimError):
        point_config(config, sweep_points(config)[-1], tmp_path)


@pytest.mark.parametrize("spelling", [True, False, "on", "off"])
def test_compile_spellings_give_one_enum(spelling):
    config = config_with({})
    config["sweep"]["compile"] = [spelling]
    [point] = sweep_points(config)
    assert point.compile is Compile.of(spelling)
    assert point.name.endswith(f"compile_{point.compile.value}") and point.axis_values["compile"] in ("on", "off")


def test_option_axes_are_refused_with_a_c_reference(tmp_path):
    """The C binary takes argv only, so an option axis fails at validation, not in the reference job."""
    binary = tmp_path / "nanoBragg"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    config = config_with({"mosaic_spread_deg": [0.1]})
    config["reference"] = {"c_binary": str(binary)}
    with pytest.raises(NbsimError, match="sweep.extra.mosaic_spread_deg: a simulator option cannot be passed"):
        validate_config(config, SCHEMA, tmp_path)
    config["sweep"]["extra"] = {"-mosaic": [0.1]}
    validate_config(config, SCHEMA, tmp_path)


def test_compiled_points_of_every_device_get_a_kernel_job(tmp_path):
    """Ahead of time on the CPU, just in time on a GPU (its compile warmed before the timed jobs, for their
    threads); eager points get none."""
    from nbsim.sweep.plan import Point, StructureMemo, kernel_jobs

    config = config_with({})
    config["timing"]["threads"] = 4
    points = [Point("seed", 8, "float32", device, compile_) for device in ("cpu", "cuda")
              for compile_ in (Compile.ON, Compile.OFF)]
    jobs, names = kernel_jobs(config, points, False, tmp_path, StructureMemo(None))
    assert {name: (job.device, job.mode, job.threads) for name, job in jobs.items()} == {
        "float32-cpu-single-square-default": ("cpu", "aot", 4),
        "float32-cuda-single-square-default": ("cuda", "jit", 4)}
    assert sorted(point.name for point in names) == ["n8-float32-cpu-compile_on", "n8-float32-cuda-compile_on"]


def test_kernel_jobs_keep_their_structures_for_the_next_plan(tmp_path, monkeypatch):
    """The plan's structures are kept in a memo file: a second plan of the same sources asks no
    structure_of (so a Snakemake start need not import PyTorch), and a memo of other sources is ignored."""
    import nbsim.kernel.structure
    from nbsim.sweep.plan import kernel_jobs, structure_memo

    config = config_with({"-mosaic_dom": [1, 4]})
    config["scenarios"]["seed"]["args"] += " -mosaic 0.5"
    config["sweep"]["compile"] = ["on"]
    validate_config(config, SCHEMA, tmp_path)
    points, memo = sweep_points(config), tmp_path / "memo.json"

    def planned():
        with structure_memo(memo) as structures:
            return kernel_jobs(config, points, False, tmp_path, structures)

    first = planned()
    assert sorted(first[0]) == ["float32-cpu-single-square-default", "float32-cpu-steps-square-default"]

    def refused(_config):
        raise AssertionError("structure_of asked although the memo holds the answer")

    monkeypatch.setattr(nbsim.kernel.structure, "structure_of", refused)
    assert planned() == first
    memo.write_text(memo.read_text().replace(json.loads(memo.read_text())["sources"], "other sources"))
    with pytest.raises(AssertionError, match="structure_of asked"):
        planned()
