"""Shared fixtures: where the nanoBragg reference outputs live, and how to read them."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from benchmarks import workloads
from nbsim.nanobragg.flags import absolute_file_arguments


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist, each worker (and what it starts) uses its share of the cores, unless
    OMP_NUM_THREADS says otherwise: n workers of torch's default thread count each would put n threads on
    every core, and a torch thread that waits at a barrier for one descheduled spins (measured on 2 cores
    with 2 workers: the same fit 10x slower while another process ran). PyTorch is imported here only: the
    controller of the workers, which runs no test, starts them without waiting for its import."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores_among_workers()


REPO_ROOT = Path(__file__).resolve().parents[1]
SEED_ARGS = " ".join(workloads.SEED_ARGS)
"""The seeds' benchmark workload, without a detector size."""


def snakemake_command(folder: Path, profile: str = "default", config: str = "config.yaml") -> list[str]:
    """Snakemake on this repository's Snakefile, working in `folder` with its config file and a profile."""
    return [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory", str(folder),
            "--configfile", str(folder / config), "--workflow-profile",
            str(REPO_ROOT / "workflow" / "profiles" / profile)]


def own_cache_env(folder: Path) -> dict[str, str]:
    """This process's environment with a compile cache inside `folder`."""
    return {**os.environ, "NBSIM_CACHE_DIR": str(folder / "cache")}


HIDDEN_FROM_USERS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
"""The warnings Python's default filters do not show (a DeprecationWarning only where __main__ raises it)."""


def one_line_error_here(argv: list[str], folder: Path, capsys) -> str:
    """nbsim's main on `argv` in this process, in `folder` (no Python and PyTorch start, 1-2 s of CPU each):
    asserts exit status 2, one line on stderr and no warning that the command would show a user; the line."""
    from nbsim.cli import main

    with contextlib.chdir(folder), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = main(argv)
    stderr = capsys.readouterr().err
    shown = [str(warning.message) for warning in caught if not issubclass(warning.category, HIDDEN_FROM_USERS)]
    assert status == 2 and not shown, (status, shown, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory):
    """Compiled kernels go to a folder of the test session, shared by its pytest-xdist workers (the cache's
    locks let one build a kernel while the others wait for it), unless NBSIM_CACHE_DIR says otherwise; no
    background kernel builds and no probe processes."""
    if not os.environ.get("NBSIM_CACHE_DIR"):
        basetemp = tmp_path_factory.getbasetemp()
        session_root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
        os.environ["NBSIM_CACHE_DIR"] = str(session_root / "nbsim-cache")
    # Kernels built behind a test's back would compete with the suite for the CPU (tests that check the
    # background build turn it on themselves).
    os.environ.setdefault("NBSIM_BACKGROUND_BUILD", "off")
    # Probing each package in a child process costs a Python and torch start (3-6 s) per package; the suite
    # opens dozens. tests/test_package_probe.py turns the probe back on and checks it.
    os.environ.setdefault("NBSIM_VERIFY_PACKAGES", "off")
    yield Path(os.environ["NBSIM_CACHE_DIR"])


@pytest.fixture(scope="session", autouse=True)
def system_devices_untouched():
    """/dev/null and /dev/zero are the same character devices after the session as before: no test (run as
    root) may replace one with a file, as an output once did (issue 34)."""
    before = {name: os.lstat(name) for name in ("/dev/null", "/dev/zero")}
    yield
    for name, was in before.items():
        now = os.lstat(name)
        assert stat.S_ISCHR(now.st_mode) and (now.st_rdev, now.st_ino) == (was.st_rdev, was.st_ino), \
            f"{name} was replaced during the tests"


# The test files of more than about 5 s in `make test`, longest first (their seconds on a worker in the suite's
# per-test profile of a fresh clone, 2026-11-27 evening, 331.7 s: workflow 125 (about 115 since its CUDA,
# shipped-config and fit-section tests were cut), parity 47, docs_commands 46, dials 35, slurm 34 (about 28 up
# to its timing table), worker 29, merge 27, fit 24, dials_route 24, dials_loop 23, robustness 22,
# merge_workflow 17, bench 16, dataset 16, panels 14 (about 12 with its batch size given), merge_sad 12, sweep
# 11, ..., kernel 6; test_compile.py, 79, starts first with its kernel builds).
# pytest-xdist hands a worker its next file when it is almost done, so with the longest first the files left
# at the end are short and the two workers finish within seconds of each other (in the order of the file
# names, test_worker.py's 32 s came last).
LONGEST_FILES = ("test_workflow.py", "test_parity.py", "test_docs_commands.py", "test_dials.py", "test_slurm.py",
                 "test_worker.py", "test_merge.py", "test_fit.py", "test_dials_route.py", "test_dials_loop.py",
                 "test_robustness.py", "test_merge_workflow.py", "test_bench.py", "test_dataset.py",
                 "test_panels.py", "test_merge_sad.py", "test_sweep.py", "test_dials_panels.py",
                 "test_package_probe.py", "test_reference_intermediates.py", "test_dials_experiments.py",
                 "test_fit_panels.py", "test_presets.py", "test_dials_import.py", "test_kernel.py")


def pytest_collection_modifyitems(items):
    """Tests that build kernels run first, so that the kernels they build spare later tests a build; then
    the longest files. `make test` keeps this order across its workers (`--no-loadscope-reorder`; by
    default pytest-xdist hands out the files with most tests first). The real-SLURM test removes its
    configuration on exit, so later Snakemake starts do not wait for its controller."""
    def order(item) -> int:
        if item.get_closest_marker("builds_kernels"):
            return 0
        name = item.path.name
        return 1 + LONGEST_FILES.index(name) if name in LONGEST_FILES else 1 + len(LONGEST_FILES)

    items.sort(key=order)


GOLDEN = Path(os.environ.get("NBSIM_GOLDEN", REPO_ROOT.parent / "shared" / "golden"))
C_CASES = REPO_ROOT / "tests" / "data" / "c_cases"
"""Small cases made from the C as the golden ones were (tests/data/c_cases/cases.txt says how), kept in the
repository: each leaves one of the C's defaults to its rules. Their input files lie beside them (`load_case` makes
their names absolute), so they run with the golden ones, or without them where the golden folder is absent."""


@dataclass
class GoldenCase:
    name: str
    folder: Path
    args: list[str]
    shape: tuple[int, int]

    def float_image(self) -> np.ndarray:
        return np.fromfile(self.folder / "float.bin", dtype=np.float32).reshape(self.shape)

    def int_image(self) -> np.ndarray:
        return np.fromfile(self.folder / "int.img", dtype=np.uint16, offset=512).reshape(self.shape)

    def header(self) -> dict[str, str]:
        text = (self.folder / "int.img").read_bytes()[:512].decode("ascii", "replace").split("}")[0]
        return dict(line.rstrip(";").split("=", 1) for line in text.splitlines() if "=" in line)

    def log(self) -> str:
        return (self.folder / "log.txt").read_text()


def _case_names(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "meta.json").is_file())


def golden_case_names() -> list[str]:
    return _case_names(GOLDEN)


def load_case(name: str) -> GoldenCase:
    """A golden case, or one of the repository's C_CASES."""
    repository = (C_CASES / name / "meta.json").is_file()
    folder = C_CASES / name if repository else GOLDEN / name
    meta = json.loads((folder / "meta.json").read_text())
    args = meta["args"].split()
    return GoldenCase(name=name, folder=folder, args=absolute_file_arguments(args, C_CASES) if repository else args,
                      shape=tuple(meta["shape_slow_fast"]))


requires_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"nanoBragg golden outputs not found at {GOLDEN} "
                                                                   "(set NBSIM_GOLDEN to their folder)")

# Cases that take more than a few seconds in eager mode on two cores.
SLOW_CASES = {"mosaic_phi", "divergence_dispersion", "thickness", "source_file", "seed_bench_1024"}


def case_params(names: list[str] | None = None):
    """pytest params for golden cases (one skipped param when the folder is absent) and, without `names`, the
    repository's C_CASES; slow ones marked."""
    repository = [] if names is not None else _case_names(C_CASES)
    names = golden_case_names() if names is None else names
    missing = [] if names else [
        pytest.param(None, marks=pytest.mark.skip(reason=f"nanoBragg golden outputs not found at {GOLDEN}"))]
    return missing + [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in SLOW_CASES else [])
                      for n in names + repository]


@pytest.fixture
def in_golden_dir(monkeypatch):
    """Run with the golden folder as working directory (case arguments name files relative to it; the
    repository's cases name theirs absolute)."""
    monkeypatch.chdir(GOLDEN if GOLDEN.is_dir() else C_CASES)


