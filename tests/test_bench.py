"""`nbsim bench` and benchmarks/run.py: the JSON they promise, and the C comparison, with a stand-in C binary."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .conftest import REPO_ROOT, SEED_ARGS

SEED_16 = f"{SEED_ARGS} -detpixels 16".split()
REQUIRED_KEYS = {"cold_s", "warm_median_s", "warm_min_s", "warm_max_s", "repeats", "device", "dtype", "compile",
                 "pixels", "steps", "peak_rss_mb", "torch_version", "cpu"}


def nbsim(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbsim.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def render_here(image_path, flags: list[str]) -> None:
    """The image a stand-in C copies, rendered by nbsim's main in this process (no Python and PyTorch start;
    `nbsim bench` itself runs as a command: its cold time is a fresh process's)."""
    from nbsim.cli import main

    with contextlib.chdir(image_path.parent):
        assert main(["-floatfile", str(image_path), *flags]) == 0


def stand_in_c(folder, image_path) -> str:
    """A 'nanoBragg' that copies a prepared image to its -floatfile argument, as the real one writes it."""
    script = folder / "nanoBragg"
    script.write_text("#!/bin/sh\n"
                      "while [ $# -gt 0 ]; do\n"
                      f"  if [ \"$1\" = -floatfile ]; then cp '{image_path}' \"$2\"; fi\n"
                      "  shift\n"
                      "done\n")
    script.chmod(0o755)
    return str(script)


def test_bench_prints_its_json_last(tmp_path):
    image_path = tmp_path / "image.bin"
    result = nbsim("bench", "--compile", "off", "--repeats", "3", "--warmup", "0", "--floatfile", str(image_path),
                   "--", *SEED_16)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record.keys() >= REQUIRED_KEYS
    assert record["pixels"] == 256 and record["repeats"] == 3 and len(record["warm_times_s"]) == 3
    assert record["warm_min_s"] <= record["warm_median_s"] <= record["warm_max_s"]
    assert record["compile"] == "off" and record["compile_cache"] == "unused"
    assert record["dtype"] == "float32" and record["device"] == "cpu"
    assert record["c_median_s"] is None
    assert np.fromfile(image_path, dtype=np.float32).size == 256


def test_bench_compares_with_the_c_binary(tmp_path):
    image_path = tmp_path / "image.bin"
    render_here(image_path, SEED_16)
    json_path = tmp_path / "bench.json"
    result = nbsim("bench", "--compile", "off", "--repeats", "2", "--warmup", "1", "--json", str(json_path),
                   "--c-binary", stand_in_c(tmp_path, image_path), "--", *SEED_16)
    assert result.returncode == 0, result.stderr
    record = json.loads(json_path.read_text())
    assert record == json.loads(result.stdout.strip().splitlines()[-1])
    assert len(record["c_times_s"]) == 2
    assert record["speedup"] == pytest.approx(record["c_median_s"] / record["warm_median_s"])
    assert record["correlation"] == pytest.approx(1.0, abs=1e-9)


def test_bench_reports_a_crashing_c_binary_in_one_line(tmp_path):
    crashing = tmp_path / "nanoBragg"
    crashing.write_text("#!/bin/sh\necho 'segmentation fault' >&2\nexit 139\n")
    crashing.chmod(0o755)
    result = nbsim("bench", "--compile", "off", "--repeats", "1", "--c-binary", str(crashing), "--", *SEED_16)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"nbsim: error: C reference {crashing} failed with status 139: segmentation fault"]


@pytest.mark.slow
def test_benchmark_script_writes_its_table_and_json(tmp_path, private_compile_cache):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    image_path = prepared / "image.bin"
    seed_256 = [*SEED_16[:-1], "256"]
    render_here(image_path, seed_256)
    out = tmp_path / "benchmarks.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), "--quick", "--only", "seed_f32", "cli", "cli_worker",
         "--repeats", "1", "--c-binary", stand_in_c(prepared, image_path), "--cache-dir", str(private_compile_cache),
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    seed = summary["results"]["seed_f32"]
    assert seed["result"]["pixels"] == 256 * 256 and seed["result"]["correlation"] == pytest.approx(1.0, abs=1e-9)
    assert seed["verdict"] in {"met", "NOT met"}
    for name in ("cli", "cli_worker"):
        cli = summary["results"][name]["result"]
        assert len(cli["nbsim_times_s"]) == len(cli["c_times_s"]) == 1
    assert "nbsim.server.client" in summary["results"]["cli_worker"]["command"]
    assert summary["results"]["cli_worker"]["result"]["worker_commands_served"] == 2
    assert summary["quick"] is True
    table = [line for line in result.stdout.splitlines() if line.startswith("| seed_f32 |")]
    assert len(table) == 1 and seed["verdict"] in table[0]
