"""The sweep on a real single-node SLURM cluster, through Snakemake's SLURM executor plugin."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import yaml

from .conftest import SEED_ARGS, own_cache_env, snakemake_command
from .slurm_cluster import single_node_slurm, unavailable_reason

REASON = unavailable_reason()
CONFIG = {
    "scenarios": {"seed": {"args": SEED_ARGS}},
    "sweep": {"sizes": [12], "dtypes": ["float32", "float64"], "devices": ["cpu"], "compile": ["off"],
              "extra": {"-phi": {"start": 0, "stop": 0.2, "step": 0.1}}},
    "timing": {"warmup": 0, "repeats": 1, "threads": 1},
    "reference": {"compile": False},
    "resources": {"mem_mb": 1000, "runtime_min": 10},
}
STATUS_CHECK_SECONDS = 1
SNAKEMAKE_CHECKING_EVERY_SECOND = f"""
import sys
from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor

# After a status check that finds no job finished, the plugin waits 10 s longer than before (a step that
# no option sets): the test's jobs take seconds, and most of its time went on those waits.
waits = Executor.next_seconds_between_status_checks
assert isinstance(waits, property) and waits.fset is not None, "the SLURM plugin's status wait moved"
Executor.next_seconds_between_status_checks = waits.setter(
    lambda executor, seconds: waits.fset(executor, None if seconds is None else min(seconds, {STATUS_CHECK_SECONDS})))
sys.argv[0] = "snakemake"
main()
"""
"""Snakemake's command line, its SLURM plugin checking the jobs' status every second."""


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no single-node SLURM here: {REASON}")
def test_sweep_runs_every_batch_as_a_slurm_job(tmp_path):
    """Every batch and reference batch a SLURM job of its own, up to the timing table (the collation, a local
    rule, runs beside them; the plots and the summary, local rules too, are test_workflow's)."""
    with single_node_slurm() as partition:
        config = {**CONFIG, "slurm": {"partition": partition, "gpu_partition": None, "account": None}}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        [_python, _module, _snakemake, *arguments] = snakemake_command(tmp_path, profile="slurm")
        result = subprocess.run(
            [sys.executable, "-c", SNAKEMAKE_CHECKING_EVERY_SECOND, *arguments, "--slurm-status-command", "squeue",
             "--slurm-init-seconds-before-status-checks", str(STATUS_CHECK_SECONDS),
             "--slurm-no-account", "--jobs", "4", "results/seed/tables/timing.csv"],
            capture_output=True, text=True, timeout=1800,
            env=own_cache_env(tmp_path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = sorted((tmp_path / "results" / "seed").glob("*/*/records.json"))
    assert len(records) == 3  # a batch per dtype, two points each, and their reference batch
    job_ids = set()
    for path in records:
        record = json.loads(path.read_text())
        job_id = record["slurm_job_id"]
        assert job_id and job_id.isdigit(), f"{path} did not run as a SLURM job"
        assert record["host"] and len(record["points"]) == 2
        assert all(point["timing"]["slurm_job_id"] == job_id for point in record["points"])
        job_ids.add(job_id)
    assert len(job_ids) == 3
    with open(tmp_path / "results" / "seed" / "tables" / "timing.csv") as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 4 and all(row["slurm_job_id"] in job_ids for row in rows)
    assert len({row["slurm_job_id"] for row in rows}) == 2  # the points of a batch share its job
