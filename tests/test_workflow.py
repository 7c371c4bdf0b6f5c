"""The Snakemake sweep, run for real in a temporary folder on a tiny configuration."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks import workloads

from .conftest import REPO_ROOT, SEED_ARGS, own_cache_env, snakemake_command

TINY = {
    "results": "results",
    "compile_cache": "results/compile-cache",
    "scenarios": {
        "seed": {"args": SEED_ARGS},
        "hkl": {"args": ["-hkl", "inputs/tiny.hkl", "-cell", "30", "30", "30", "90", "90", "90", "-N", "3",
                         "-lambda", "1.0", "-distance", "50", "-pixel", "0.5", "-oversample", "1"]},
    },
    "sweep": {"sizes": [12, 16], "dtypes": ["float32", "float64"], "devices": ["cpu"], "compile": ["off"],
              "extra": {"fudge": [1.0]}},
    "resources": {"mem_mb": 1000, "runtime_min": 5},
    "timing": {"warmup": 0, "repeats": 2, "threads": 1},
    "reference": {"compile": False},
}


def snakemake(folder: Path, *arguments: str, config: str = "config.yaml",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Snakemake on two cores (with a compile cache inside `folder` unless `env` says otherwise); these
    tests check what the jobs write, not how fast, so two single-thread timed jobs may run at once
    (`timing_slot=2`)."""
    return subprocess.run([*snakemake_command(folder, config=config), "--cores", "2", "--resources=timing_slot=2",
                           *arguments], capture_output=True, text=True, timeout=900, env=env or own_cache_env(folder))


def write_config(folder: Path, config: dict, name: str = "config.yaml") -> None:
    """The config file and the HKL file TINY's scenario reads (validation reads every input file), in a
    temporary `folder`: never into the checkout (a config.yaml and inputs/ once landed at its root)."""
    assert not folder.resolve().is_relative_to(REPO_ROOT), f"{folder} is inside the checkout"
    hkl = folder / "inputs" / "tiny.hkl"
    if not hkl.exists():
        hkl.parent.mkdir(exist_ok=True)
        hkl.write_text("\n".join(f"{h} {k} {l} {10 + abs(h) + 2 * abs(k) + 3 * abs(l)}"
                                 for h in range(-3, 4) for k in range(-3, 4) for l in range(-3, 4)) + "\n")
    (folder / name).write_text(yaml.safe_dump(config))


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts from a dry run's 'Job stats' table."""
    counts = {}
    for rule, count in re.findall(r"^(\w+)\s+(\d+)$", result.stdout + result.stderr, re.M):
        if rule != "total":
            counts[rule] = int(count)
    return counts


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    write_config(folder, TINY)
    result = snakemake(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_tables_list_every_point(sweep_run):
    for scenario in TINY["scenarios"]:
        tables = sweep_run / "results" / scenario / "tables"
        with open(tables / "timing.csv") as stream:
            timing = list(csv.DictReader(stream))
        with open(tables / "correlation.csv") as stream:
            correlation = list(csv.DictReader(stream))
        assert len(timing) == len(correlation) == 4
        for row in timing:
            assert row["status"] == "ok"
            assert float(row["cold_s"]) > 0 and float(row["warm_median_s"]) > 0
            assert float(row["warm_min_s"]) <= float(row["warm_median_s"]) <= float(row["warm_max_s"])
            assert float(row["reference_median_s"]) > 0
            # float64 CPU points are the nbsim reference's own configuration: no speedup, and their time is the
            # reference's (one measurement, not two processes' that differ by the machine's load)
            if row["dtype"] == "float64":
                assert row["speedup"] == "" and row["reference_median_s"] == row["warm_median_s"]
            else:
                assert float(row["speedup_min"]) <= float(row["speedup"]) <= float(row["speedup_max"])
                assert row["reference_batch"] == row["batch"].replace("float32", "float64")
            assert float(row["peak_rss_mb"]) > 0
        for row in correlation:
            assert row["reference"] == "nbsim-float64-cpu"
            limit = 0.999999 if row["dtype"] == "float64" else 0.99999
            assert float(row["correlation"]) >= limit
            assert float(row["one_minus_r"]) == pytest.approx(1 - float(row["correlation"]), abs=1e-15)
            assert float(row["max_rel_error"]) <= (1e-5 if row["dtype"] == "float64" else 1e-3)
            assert row["finite"] == "True"
        timing_md = (tables / "timing.md").read_text()
        assert timing_md.startswith("| size | dtype | status |") and "| reference |" in timing_md
        assert "slurm" not in timing_md and "SLURM" not in timing_md  # empty everywhere: dropped
        correlation_md = (tables / "correlation.md").read_text()
        assert correlation_md.count("\n") == 6 and "| 1−r |" in correlation_md
        assert "<td>reference</td>" in (tables / "timing.html").read_text()


@pytest.mark.slow
def test_batch_stores_carry_images_and_records(sweep_run):
    from nbsim.sweep.spec import PointSpec
    from nbsim.sweep.store import read_store

    batch = sweep_run / "results" / "seed" / "batches" / "n16-float32-cpu-compile_off-b0000"
    dataset = read_store(batch / "images.zarr")
    assert dataset["image"].dims == ("point", "slow", "fast") and dataset["image"].shape == (1, 16, 16)
    assert list(dataset["point"].values) == ["n16-float32-cpu-compile_off-fudge_1.0"]
    assert float(dataset["image"].max()) > 0
    records = json.loads((batch / "records.json").read_text())
    assert records["dtype"] == "float32" and records["device"] == "cpu" and records["kind"] == "points"
    assert {"nbsim", "torch", "numpy", "zarr", "xarray"} <= set(records["versions"])
    assert records["process_startup_s"] > 0 and records["wall_s"] >= records["timed_s"] > 0
    [point] = records["points"]
    assert point["size"] == 16 and point["argv"][-2:] == ["-detpixels", "16"]
    spec = PointSpec.from_dict(point)  # the records keep the spec the job rendered
    assert spec.config.detector.pixels_f == 16 and spec.config.crystal.fudge == 1.0
    assert point["timing"]["repeats"] == 2 and point["timing"]["warm_median_s"] > 0 and point["device_name"]
    assert point["comparison"]["correlation"] > 0.9999
    assert point["structure_factors"] is None  # -default_F alone: no table to trace


@pytest.mark.slow
def test_collated_store_has_every_axis(sweep_run):
    import xarray as xr

    dataset = xr.open_zarr(sweep_run / "results" / "hkl" / "sweep.zarr")
    assert list(dataset["size"].values) == [12, 16]
    assert sorted(dataset["dtype"].values) == ["float32", "float64"]
    assert list(dataset["fudge"].values) == [1.0]
    assert dataset["warm_median_s"].dims == ("size", "dtype", "device", "compile", "fudge")
    assert bool((dataset["correlation"] > 0.9999).all())
    assert all(dataset[name].dims[:5] == dataset["warm_median_s"].dims for name in dataset.data_vars)
    assert dataset["image"].dims[5:] == ("slow", "fast") and dataset["image"].shape[-2:] == (16, 16)
    small = dataset["image"].sel(size=12, dtype="float32").squeeze()
    assert bool(np.isfinite(small[:12, :12]).all()) and bool(np.isnan(small[12:, :]).all())
    assert list(dataset["slow"].values) == list(range(16))
    assert np.allclose(dataset["fast_mm"].values, (np.arange(16) + 0.5) * 0.5)  # the scenario's -pixel 0.5
    attributes = json.loads(str(dataset["attributes"].sel(size=12, dtype="float64").values.ravel()[0]))
    assert attributes["name"].startswith("n12-float64")
    assert attributes["timing"]["warm_median_s"] > 0 and attributes["host"]


@pytest.mark.slow
def test_plots_and_report(sweep_run):
    for name in ("speedup.png", "warm_time.png", "previews.png"):
        assert (sweep_run / "results" / "seed" / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    result = snakemake(sweep_run, "--report", str(sweep_run / "report.html"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (sweep_run / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_summary_has_a_row_per_scenario(sweep_run):
    against = "# Speedups and correlations are against nbsim's own float64 image on the CPU"
    first, *lines = (sweep_run / "results" / "summary.csv").read_text().splitlines()
    assert first.startswith(against)
    summary = {row["scenario"]: row for row in csv.DictReader(lines)}
    assert sorted(summary) == sorted(TINY["scenarios"])
    for row in summary.values():
        assert (row["ok"], row["failed"]) == ("4", "0")
        assert 0 <= float(row["worst_one_minus_r"]) < 1e-5 and float(row["worst_rel_error"]) < 1e-3
        assert float(row["best_speedup"]) >= float(row["median_speedup"]) > 0
        for kind in ("best_speedup", "median_speedup"):
            assert float(row[f"{kind}_min"]) <= float(row[kind]) <= float(row[f"{kind}_max"])
        assert row["speedup_over"] == "nbsim float64 on the CPU"
    rst = (sweep_run / "results" / "summary.rst").read_text()
    assert rst.startswith(f"**{against[2:]}") and "`seed`_" in rst
    page = (sweep_run / "results" / "summary.html").read_text()  # the summary and tables without JavaScript
    assert "<script" not in page and against[2:] in page.replace("&#x27;", "'")
    assert all(f"<h2>{scenario}</h2>" in page for scenario in TINY["scenarios"])


class _VisibleText(HTMLParser):
    """The text a browser shows: everything outside script, style and template elements."""

    def __init__(self):
        super().__init__()
        self.hidden, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("script", "style", "template")

    def handle_endtag(self, tag):
        self.hidden -= tag in ("script", "style", "template")

    def handle_data(self, data):
        if not self.hidden and data.strip():
            self.parts.append(data.strip())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless Chromium (apt-get install chromium)")
def test_report_front_page_in_a_browser(sweep_run):
    """Chromium renders report.html (the report is a JavaScript app: its text exists only once rendered); what
    the speedups are against comes right after the title, then the summary table, and a 1280×900 screenshot is
    written (by the same Chromium run: a browser start fewer)."""
    report = sweep_run / "report.html"
    if not report.exists():
        assert snakemake(sweep_run, "--report", str(report)).returncode == 0
    screenshot = sweep_run / "report.png"
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                          "--dump-dom", f"--screenshot={screenshot}", report.as_uri()],
                         capture_output=True, text=True, timeout=120)
    parser = _VisibleText()
    parser.feed(dom.stdout)
    text = parser.parts
    title = text.index("nbsim sweep report")
    assert text[title + 1].startswith("Speedups and correlations are against nbsim's own float64 image")
    assert text[title + 2:title + 9] == ["scenario", "points ok / failed", "worst 1−r", "worst relative error",
                                         "best speedup (range)", "median speedup (range)", "speedup over"]
    assert {"hkl", "seed"} <= set(text[title + 9:title + 25])
    assert screenshot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_second_run_executes_nothing(sweep_run):
    result = snakemake(sweep_run)
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


@pytest.mark.slow
def test_changing_one_value_reruns_only_the_affected_points(sweep_run):
    changed = json.loads(json.dumps(TINY))
    changed["sweep"]["sizes"] = [12, 20]
    write_config(sweep_run, changed, "changed.yaml")
    plan = planned_jobs(snakemake(sweep_run, "--dry-run", config="changed.yaml"))
    assert plan["simulate"] == 4  # the batches of the two dtypes at size 20, for each scenario
    assert plan["reference"] == 2
    assert plan["collate"] == 2


ROTATION = {
    "scenarios": {"rotation": {"args": SEED_ARGS + " -misset 10 20 30 -osc 0.1"}},
    "sweep": {"sizes": [12], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"], "batch_size": 3,
              "extra": {"-phi": {"start": 0, "stop": 0.5, "step": 0.1}}},
    "timing": {"warmup": 0, "repeats": 2, "threads": 1},
    "reference": {"compile": False},
}


@pytest.fixture(scope="module")
def rotation_run(tmp_path_factory):
    """Five frames of a rotation series in batches of three: two timed batches, two reference batches."""
    folder = tmp_path_factory.mktemp("rotation")
    write_config(folder, ROTATION)
    result = snakemake(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


@pytest.mark.slow
def test_points_run_in_batches(rotation_run):
    """The run's plan (its 'Job stats' table and job messages, as a dry run prints them) and its batches."""
    folder, result = rotation_run
    assert planned_jobs(result) == {"simulate": 2, "reference": 2, "collate": 1, "plots": 1, "summary": 1, "all": 1}
    shown = result.stdout + result.stderr
    assert "batch rotation/n12-float32-cpu-compile_off-b0000: 3 points, n12-float32-cpu-compile_off-phi_0.0 .. " \
           "n12-float32-cpu-compile_off-phi_0.2" in shown
    assert "reference batch rotation/n12-b0001: 2 references, n12-phi_0.3 .. n12-phi_0.4" in shown
    batches = sorted((folder / "results" / "rotation" / "batches").iterdir())
    assert [len(json.loads((b / "records.json").read_text())["points"]) for b in batches] == [3, 2]
    log = (folder / "results" / "logs" / "simulate" / "rotation" / "n12-float32-cpu-compile_off-b0000.log").read_text()
    assert "rotation n12-float32-cpu-compile_off-b0000: 3/3 points" in log and "points/s" in log
    assert "rotation n12-float32-cpu-compile_off-b0000: 3/3 points" in result.stderr  # on the terminal too
    assert "collate rotation: 5/5 images" in result.stderr  # one image a point: no detector stage
    with open(folder / "results" / "rotation" / "tables" / "timing.csv") as stream:
        rows = list(csv.DictReader(stream))
    assert [float(row["phi"]) for row in rows] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert [row["batch"][-5:] for row in rows] == ["b0000", "b0000", "b0000", "b0001", "b0001"]
    records = json.loads((batches[0] / "records.json").read_text())
    [load] = records["kernel_loads"]
    assert load["kernel"] == "eager" and load["point"] == rows[0]["point"]
    for point in records["points"]:
        timing = point["timing"]
        assert timing["cold_s"] > 0 and timing["warm_min_s"] <= timing["warm_median_s"] <= timing["warm_max_s"]


@pytest.mark.slow
def test_rotation_series_reads_as_one_array(rotation_run):
    import xarray as xr

    folder, _ = rotation_run
    dataset = xr.open_zarr(folder / "results" / "rotation" / "sweep.zarr")
    series = dataset["image"].squeeze()
    assert series.dims == ("phi", "slow", "fast") and "slow_mm" in series.coords
    assert list(series["phi"].values) == [0.0, 0.1, 0.2, 0.3, 0.4]
    frames = series.values
    assert np.isfinite(frames).all() and all(frames[i].max() > 0 for i in range(5))
    assert not np.array_equal(frames[0], frames[4])  # the crystal turned
    assert {"size", "dtype", "device", "compile", "phi"} <= set(dataset.coords)
    assert float(dataset["correlation"].min()) > 0.99999


@pytest.mark.slow
def test_changing_one_value_reruns_only_its_batch(rotation_run):
    folder, _ = rotation_run
    again = snakemake(folder)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    changed = json.loads(json.dumps(ROTATION))
    changed["sweep"]["extra"]["-phi"] = [0.0, 0.1, 0.2, 0.35, 0.4]
    write_config(folder, changed, "changed.yaml")
    plan = snakemake(folder, "--dry-run", config="changed.yaml")
    assert planned_jobs(plan) == {"simulate": 1, "reference": 1, "collate": 1, "plots": 1, "summary": 1, "all": 1}
    assert "rotation/n12-float32-cpu-compile_off-b0001" in plan.stdout + plan.stderr


def test_snakemake_lint_is_clean(tmp_path):
    write_config(tmp_path, TINY)
    result = snakemake(tmp_path, "--lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "good condition" in result.stdout + result.stderr


BAD_CONFIGS = [
    (lambda c: c["sweep"].update(colour="blue"), "sweep: unknown key(s) 'colour'"),
    (lambda c: c["sweep"].update(sizes=[]), "sweep.sizes"),
    (lambda c: c["sweep"].update(dtypes=["float16"]), "sweep.dtypes.0"),
    (lambda c: c["timing"].update(repeats="three"), "timing.repeats"),
    (lambda c: c["sweep"]["extra"].update(colour=[1]), "'colour' is not a simulator option"),
    (lambda c: c["scenarios"]["seed"].update(args="-default_F 100 -bogus"), "unknown option '-bogus'"),
    (lambda c: c.update(reference={"c_binary": "/nonexistent/nanoBragg"}), "does not exist"),
    (lambda c: c.update(reference={"c_binary": "config.yaml"}), "is not executable"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS)
def test_bad_config_is_one_line(tmp_path, change, message):
    from nbsim.errors import NbsimError
    from nbsim.sweep.validate import validate_config

    config = json.loads(json.dumps(TINY))
    change(config)
    write_config(tmp_path, config)
    with pytest.raises(NbsimError) as error:
        validate_config(config, REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml", tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("change, message", [BAD_CONFIGS[0], BAD_CONFIGS[5]])
def test_bad_config_fails_before_any_job(tmp_path, change, message):
    config = json.loads(json.dumps(TINY))
    change(config)
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "--dry-run")
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("Using workflow specific")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert lines[0].startswith("nbsim: invalid sweep configuration: ")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_compiled_points_share_the_compile_cache(tmp_path, private_compile_cache):
    """One kernel job finds (or builds) the structure's ahead-of-time kernels in the user's cache
    (NBSIM_CACHE_DIR, here the test session's, so it builds nothing another test built) when the config
    names none; every timed job, at every size, then loads them, and each records which it did; the
    command line's cache lookup finds them too. No reference batches: they render eagerly (the config's
    reference.compile is off) and load no kernel."""
    from nbsim.kernel.cache import KernelCache
    from nbsim.kernel.structure import structure_of
    from nbsim.nanobragg import config_from_args

    config = json.loads(json.dumps(TINY))
    config["scenarios"] = {"seed": TINY["scenarios"]["seed"]}
    del config["compile_cache"]
    config["sweep"].update(sizes=[12, 16], dtypes=["float32"], compile=["on"])
    config["reference"] = False
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "results/seed/tables/timing.csv",
                       env={**os.environ, "NBSIM_CACHE_DIR": str(private_compile_cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "results" / "seed" / "tables" / "timing.csv") as stream:
        states = sorted(row["compile_cache"] for row in csv.DictReader(stream))
    assert states == ["hit", "hit"]
    for batch in (tmp_path / "results" / "seed" / "batches").glob("*/records.json"):
        [load] = json.loads(batch.read_text())["kernel_loads"]
        assert load["cache"] == "hit" and load["kernel"] == "float32-cpu-single-square-default"
    markers = list((tmp_path / "results" / "kernels").glob("*.json"))
    assert [m.name for m in markers] == ["float32-cpu-single-square-default.json"]
    kernel = json.loads(markers[0].read_text())
    [stage] = kernel["stages"]
    assert stage["stage"] == "pixel_kernel" and stage["cache"] in ("hit", "miss")
    assert (private_compile_cache / "kernels" / stage["package"]).is_file()
    structure = structure_of(config_from_args([*SEED_ARGS.split(), "-detpixels", "64"]))
    assert KernelCache.default().missing(structure, torch.float32, torch.device("cpu")) == []


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_cuda_point_without_cuda(tmp_path, policy):
    config = json.loads(json.dumps(TINY))
    config["scenarios"] = {"seed": TINY["scenarios"]["seed"]}
    config["sweep"].update(sizes=[12], dtypes=["float32"], devices=["cpu", "cuda"], on_unavailable_device=policy)
    config["reference"] = False  # the device policy is the batches' (a reference renders on the CPU)
    write_config(tmp_path, config)
    if policy == "fail":  # refused by the validation, before any job and by a dry run alike
        for arguments in (("--dry-run",), ()):
            result = snakemake(tmp_path, "results/seed/tables/timing.csv", *arguments)
            assert result.returncode != 0 and "Traceback" not in result.stderr
            assert ("nbsim: invalid sweep configuration: sweep.devices: cuda is not available" in result.stderr
                    and "on_unavailable_device: skip" in result.stderr)
            assert not (tmp_path / "results").exists()
    else:
        result = snakemake(tmp_path, "results/seed/tables/timing.csv")
        assert result.returncode == 0, result.stderr[-2000:]
        with open(tmp_path / "results" / "seed" / "tables" / "timing.csv") as stream:
            rows = {row["device"]: row for row in csv.DictReader(stream)}
        assert rows["cuda"]["status"] == "skipped" and rows["cpu"]["status"] == "ok"


CONFIG_FILES = sorted((REPO_ROOT / "config").rglob("*.yaml"))
SHARED = REPO_ROOT.parent / "shared"
"""Beside the clone: the C reference outputs (`shared/golden`), absent from a bare clone."""


def absent_shared_inputs(config: dict, folder: Path) -> list[str]:
    """The files under ../shared that a config's scenarios read (relative to `folder`) but that are not there."""
    absent = []
    for scenario in config["scenarios"].values():
        args = scenario["args"]
        for token in args.split() if isinstance(args, str) else args:
            path = Path(os.path.normpath(folder / token))
            if path.is_relative_to(SHARED) and not path.exists():
                absent.append(str(path))
    return absent


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(REPO_ROOT / "config").as_posix())
def test_shipped_configs_are_valid(path, tmp_path):
    from nbsim.sweep.plan import axis_values
    from nbsim.sweep.validate import validate_config

    config = yaml.safe_load(path.read_text())
    if absent := absent_shared_inputs(config, path.parent):
        pytest.skip(f"reads {absent[0]}, which is absent: the C reference outputs are not in {SHARED / 'golden'}")
    if (config.get("reference") or {}).get("c_binary"):
        stand_in = tmp_path / "nanoBragg"
        stand_in.write_text("#!/bin/sh\nexit 0\n")
        stand_in.chmod(0o755)
        config["reference"]["c_binary"] = str(stand_in)
    points = validate_config(config, REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml", path.parent)
    extra_points = (config["sweep"].get("draws") or {}).get("count", 1)
    for values in config["sweep"]["extra"].values():
        extra_points *= len(axis_values(values))
    axes = config["sweep"]
    expected = (len(config["scenarios"]) * len(axis_values(axes["sizes"])) * len(axes["dtypes"])
                * len(axes["devices"]) * len(axes["compile"]) * extra_points)
    assert len(points) == expected  # plan.sweep_points's, as Snakemake's planning takes them
    if "seed" in config["scenarios"]:  # the seeds' workload, written out for the reader, as benchmarks/workloads.py has
        assert config["scenarios"]["seed"]["args"].split() == list(workloads.SEED_ARGS)


def test_example_sweep_plans_every_point(tmp_path):
    example = REPO_ROOT / "config" / "examples" / "mosaic_sweep.yaml"
    result = subprocess.run([*snakemake_command(tmp_path, config=str(example)), "--cores", "2", "--dry-run"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = planned_jobs(result)
    assert plan["simulate"] == 4  # one batch per size and dtype: the three spreads render in one process
    assert plan["reference"] == 2
    # 3 spreads x 2 sizes x 2 dtypes share one kernel per dtype and structure: spread 0 leaves one mosaic
    # domain (one step per pixel), 0.2 and 0.5 ten (many steps); the float64 references reuse float64's.
    assert plan["kernel"] == 4


DATASET = {
    "results": "results",
    "compile_cache": "results/compile-cache",
    "scenarios": {"data": {"args": ["-default_F", "100", "-cell", "70", "80", "90", "75", "85", "95", "-N", "5",
                                    "-oversample", "1", "-mosaic_domains", "3", "-distance", "60"]}},
    "sweep": {"sizes": [32], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"],
              "draws": {"count": 5, "seed": 7, "values": {"-misset": "random",
                                                          "mosaic_spread_deg": {"uniform": [0.05, 0.5]},
                                                          "-N": {"integers": [3, 8]}}}},
    "resources": {"mem_mb": 1000, "runtime_min": 5},
    "reference": False,
}
"""As a user writes a dataset: no timing section, no batch size."""


def test_dataset_sweep_has_labels_and_no_references(tmp_path):
    """A dataset (draws, reference: false) written without timing or batch size: its shots in batches
    filling the two cores, each rendered once; no reference jobs or correlation tables; labels in
    tables/labels.csv and as coordinates of sweep.zarr; no empty-shot warning; a second run executes
    nothing, and one with sweep.min_photons above every shot's photons reruns only the collation, which
    names all five shots in one warning line."""
    import nbsim.sweep

    write_config(tmp_path, DATASET)
    result = snakemake(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "photons (sweep.min_photons" not in result.stderr
    results = tmp_path / "results" / "data"
    records = [json.loads(p.read_text()) for p in sorted((results / "batches").glob("*/records.json"))]
    assert len(records) == 2 and [len(r["points"]) for r in records] == [3, 2]
    assert all(r["repeats"] == 0 and r["threads"] == 1 for r in records)
    assert not (results / "references").exists() and not (results / "tables" / "correlation.csv").exists()
    labels = list(csv.DictReader((results / "tables" / "labels.csv").open()))
    assert [int(row["draw"]) for row in labels] == list(range(5))
    dataset = nbsim.sweep.open_dataset(results / "sweep.zarr")
    assert dataset["image"].squeeze().dims == ("draw", "slow", "fast")
    assert [int(v) for v in dataset["N"].values] == [int(row["N"]) for row in labels]
    timing = list(csv.DictReader((results / "tables" / "timing.csv").open()))
    assert all(float(row["bytes_per_image"]) > 0 for row in timing)
    again = snakemake(tmp_path)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    write_config(tmp_path, {**DATASET, "sweep": {**DATASET["sweep"], "min_photons": 1e30}})
    warned = snakemake(tmp_path)
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "simulate" not in planned_jobs(warned)
    lines = [line for line in warned.stderr.splitlines() if "photons (sweep.min_photons" in line]
    assert len(lines) == 1 and "5 of 5 shots hold fewer than 1e+30 photons" in lines[0], warned.stderr[-3000:]
    assert "draw 0, draw 1, draw 2, draw 3, draw 4" in lines[0]


@pytest.mark.slow
def test_fit_section_benchmarks_refinement(tmp_path):
    """config/examples/fit_dataset.yaml, shrunk to three shots of fewer spots in two fit jobs: every shot fitted
    from its perturbed start, one row per shot and refined parameter with finite values in tables/fit.csv,
    the plot, and the fit_* variables of sweep.zarr on the draw axis. Those three are the run's targets: the
    scenario's timing plots and the summary, which no fit changes, are test_dataset_sweep_has_labels_and_no_references's
    (a dataset's, without references)."""
    import xarray as xr

    config = yaml.safe_load((REPO_ROOT / "config" / "examples" / "fit_dataset.yaml").read_text())
    config.update(results="results", compile_cache="results/compile-cache")
    config["sweep"]["draws"]["count"] = 3
    config["fit"].update(batch_size=2, max_spots=40)
    write_config(tmp_path, config)
    result = snakemake(tmp_path, *(f"results/shots/{target}" for target in
                                   ("tables/fit.csv", "plots/fit_errors.png", "sweep.zarr")))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = planned_jobs(result)  # the run's 'Job stats' table
    assert plan["simulate"] == 1 and plan["fit"] == 2 and plan["fit_table"] == 1
    results = tmp_path / "results" / "shots"
    rows = list(csv.DictReader((results / "tables" / "fit.csv").open()))
    parameters = ["orientation_x_deg", "orientation_y_deg", "orientation_z_deg", "misorientation_deg", "a_A", "b_A",
                  "c_A", "Na", "Nb", "Nc", "scale"]  # orthorhombic: the angles are not refined
    assert sorted((int(row["draw"]), row["parameter"]) for row in rows) == sorted(
        (draw, parameter) for draw in range(3) for parameter in parameters)
    for row in rows:
        assert row["status"] == "ok"
        values = [float(row[key]) for key in ("true", "start", "refined", "error", "start_error")]
        assert all(math.isfinite(v) for v in values)
        assert float(row["error"]) == pytest.approx(float(row["refined"]) - float(row["true"]))
    started = {row["parameter"]: abs(float(row["start_error"])) for row in rows if row["draw"] == "0"}
    assert started["misorientation_deg"] == pytest.approx(0.15)
    assert started["a_A"] == pytest.approx(0.32) and started["Na"] == pytest.approx(1.5)
    assert (results / "plots" / "fit_errors.png").read_bytes()[:4] == b"\x89PNG"
    dataset = xr.open_zarr(results / "sweep.zarr")
    error = dataset["fit_error"].squeeze()
    assert error.dims == ("draw", "fit_parameter") and list(dataset["fit_parameter"].values) == parameters
    by_table = {(int(row["draw"]), row["parameter"]): float(row["error"]) for row in rows}
    assert all(float(error.sel(draw=d, fit_parameter=p)) == v for (d, p), v in by_table.items())
    assert dataset["fit_converged"].squeeze().dims == ("draw",)
