"""benchmarks/gpu_campaign.py: what can be checked without a GPU (the refusals, the offline wheel install,
the summary's tables); `make gpu-campaign-cpu` runs every step on the CPU."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_campaign

REPO_ROOT = Path(__file__).resolve().parent.parent


def _wheel(folder: Path, name: str, module_text: str = "VALUE = 1\n") -> Path:
    """A minimal pure-Python wheel of distribution `name` with one module of the same name."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}.py": module_text,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{file},,\n" for file in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def test_the_wheelhouse_installs_only_what_this_python_lacks(tmp_path):
    wheelhouse, site = tmp_path / "wheelhouse", tmp_path / "site"
    wheelhouse.mkdir()
    _wheel(wheelhouse, "nbsim_campaign_probe")
    _wheel(wheelhouse, "pytest")  # present here: must not be installed over
    installed = gpu_campaign.install_wheelhouse(wheelhouse, site)
    assert installed == ["nbsim_campaign_probe"]
    assert (site / "nbsim_campaign_probe.py").is_file() and not (site / "pytest.py").exists()
    assert importlib.metadata.version("pytest") != "0.1"


def test_a_missing_module_stops_the_campaign_in_one_line_before_any_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_campaign, "REQUIRED_MODULES", ("numpy", "no_such_module_anywhere"))
    path_before, pythonpath_before = list(sys.path), os.environ.get("PYTHONPATH")
    status = gpu_campaign.main(["--cpu", "--out", str(tmp_path / "out"), "--wheelhouse", str(tmp_path / "none")])
    assert sys.path == path_before and os.environ.get("PYTHONPATH") == pythonpath_before, "no wheelhouse: no path"
    error = capsys.readouterr().err.strip()
    assert status == 2 and len(error.splitlines()) == 1
    assert "lacks no_such_module_anywhere" in error and "nothing was run" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_the_campaign_asks_for_cpu(capsys):
    """The campaign's main in this process (a Python and PyTorch start fewer than running the script)."""
    status = gpu_campaign.main(["--out", "/nonexistent/never-written", "--wheelhouse", "/nonexistent/no-wheels"])
    error = capsys.readouterr().err
    assert status == 2, error
    assert error.count("\n") == 1 and "--cpu" in error


def test_wheels_for_another_python_stop_the_campaign_in_one_line(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "nbsim_campaign_other-0.1-cp27-cp27m-win32.whl").write_bytes(b"")
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_campaign.py"), "--cpu", "--out",
                                str(tmp_path / "out"), "--wheelhouse", str(wheelhouse)],
                               capture_output=True, text=True, cwd=REPO_ROOT)
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert "make wheelhouse" in completed.stderr and not (tmp_path / "out").exists()


def test_the_summary_tables_hold_every_measured_row():
    bench = {"device": "cuda:0", "pixels": 16777216, "cold_s": 26.5, "warm_median_s": 6.0e-4, "warm_min_s": 5.9e-4,
             "warm_max_s": 9.0e-4, "c_median_s": 0.417, "speedup": 695.5, "correlation": 0.9999999997}
    rows = [{"size": size, "dtype": dtype, "device": device, "mode": "jit (aot refused)" if device == "cpu" else "jit",
             "compile_cache": "hit", "cold_s": 0.01, "warm_median_s": 1e-3,
             "warm_min_s": 9e-4, "warm_max_s": 2e-3, "reference": "c", "reference_median_s": 0.4, "speedup": 400.0,
             "speedup_min": 200.0, "speedup_max": 444.0, "correlation": 0.999999, "correlation_cpu": None}
            for size in (256, 4096) for dtype in ("float32", "float64") for device in ("cpu", "cuda")]
    kernels = [{"kernel": "float32-cpu-single-square-default", "stages": [
        {"stage": "pixel_kernel", "path": "jit (aot refused)", "build_s": 100.0, "probe_s": 4.0, "warm_s": 90.5}]}]
    records = {"bench": gpu_campaign.StepRecord("bench", "ok", 38.0, {"float32": bench}),
               "sweep": gpu_campaign.StepRecord("sweep", "failed: snakemake: timed out", 233.0,
                                                {"rows": rows, "kernels": kernels}),
               "merge": gpu_campaign.StepRecord("merge", "skipped: no merge benchmark")}
    text = gpu_campaign.summary_markdown({"gpu": "NVIDIA H200", "python": "3.12"}, records,
                                         argparse.Namespace(c_binary="/c"))
    assert text.startswith("# GPU campaign: NVIDIA H200")
    assert "| bench | ok | 38 |" in text and "| sweep | failed: snakemake: timed out | 233 |" in text
    assert "| float32 | cuda:0 | 16777216 | 26.50 | 0.600 (0.590–0.900) | 0.417 | 696x | 0.9999999997 |" in text
    assert sum(line.startswith(("| 256² |", "| 4096² |")) for line in text.splitlines()) == len(rows)
    assert ("| 4096² | float64 | cuda | jit (hit) | 0.01 | 0.00100 (0.00090–0.00200) | 0.400 | 400.0x (200.0–444.0) |"
            in text)
    assert "| 256² | float32 | cpu | jit (aot refused) (hit) | 0.01 |" in text
    assert "| float32-cpu-single-square-default | pixel_kernel | jit (aot refused) | 100.0 | 4.0 | 90.5 |" in text


def test_each_step_keeps_the_time_the_steps_after_it_reserve(tmp_path, monkeypatch):
    """A step may take what is left of the budget less the later selected steps' shares; the sweep times the
    batches of the larger half of the sizes first. The campaign's clock is the test's: a loaded machine's
    pause between two readings changes nothing."""
    now_s = [1000.0]
    monkeypatch.setattr(gpu_campaign, "time", types.SimpleNamespace(monotonic=lambda: now_s[0]))
    options = argparse.Namespace(budget_s=400.0, only=["environment", "sweep", "merge"])
    campaign = gpu_campaign.Campaign(options, gpu_campaign.Plan.of(True), tmp_path)
    campaign.start_step("sweep")
    reserved = gpu_campaign.STEP_SHARES["merge"] * 400.0
    assert campaign.time_left_s() == pytest.approx(400.0 - reserved, abs=1e-9)
    now_s[0] += 100.0  # the sweep took 100 s
    assert campaign.time_left_s() == pytest.approx(300.0 - reserved, abs=1e-9)
    campaign.start_step("merge")
    assert campaign.time_left_s() == pytest.approx(300.0, abs=1e-9)
    assert gpu_campaign.headline_batches(gpu_campaign.Plan.of(False)) == [
        f"n{size}-{dtype}-{device}-compile_on-b0000" for size in (4096, 2048) for dtype in ("float32", "float64")
        for device in ("cpu", "cuda")]


def test_the_cuda_tests_are_found_by_their_mark():
    files = gpu_campaign.cuda_test_files()
    assert "tests/test_kernel.py" in files and "tests/test_gpu_campaign.py" not in files


def test_the_convergence_tests_the_campaign_runs_exist():
    """`cpu_fits` names its tests by node id: each names a test function of its file."""
    for node in gpu_campaign.CONVERGENCE_TESTS:
        path, name = node.split("::")
        assert f"\ndef {name}(" in (REPO_ROOT / path).read_text(), node
