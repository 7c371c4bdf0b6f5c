"""Robustness: fuzzed parsers and readers, finite images at singular geometry, killed and concurrent jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbsim
from nbsim.errors import NbsimError
from nbsim.io.images import read_smv
from nbsim.io.structure_files import read_hkl
from nbsim.io.text import read_mosflm_matrix, read_source_file
from nbsim.kernel.physics import lattice_factor, sin_pi_polynomial, sincg_parts
from nbsim.nanobragg.arguments import parse
from nbsim.nanobragg.flags import FLAGS
from nbsim.render import Renderer
from nbsim.resolve import resolve

from .conftest import REPO_ROOT, SEED_ARGS, own_cache_env, snakemake_command

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENS = st.one_of(st.sampled_from(sorted(FLAGS) + ["-cell", "-misset", "random", "inf", "nan", "--", "-"]),
                   st.from_regex(r"-?[0-9]{1,4}(\.[0-9]{0,3})?(e-?[0-9])?", fullmatch=True),
                   st.text(min_size=0, max_size=8))


@FUZZ
@given(st.lists(TOKENS, max_size=14))
def test_argument_parser_never_crashes(argv):
    """Any argument list ends in a configuration or a one-line NbsimError (files may not exist)."""
    try:
        config, run = parse(argv)
    except NbsimError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(config, nbsim.SimulationConfig)


def _check_reader(reader, path: Path, content: bytes):
    path.write_bytes(content)
    try:
        reader(path)
    except NbsimError as error:
        assert "\n" not in str(error)


NUMBERS = st.lists(st.one_of(st.integers(-30, 30).map(str), st.floats(allow_nan=True).map(repr),
                             st.sampled_from(["x", "1e", "--", "#", ",", ";", "\t", "inf"])), max_size=30)


@FUZZ
@given(lines=st.lists(NUMBERS.map(" ".join), max_size=12))
def test_text_readers_never_crash(tmp_path_factory, lines):
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    content = "\n".join(lines).encode()
    for reader, name in ((read_hkl, "f.hkl"), (read_mosflm_matrix, "f.mat"), (read_source_file, "f.txt")):
        _check_reader(reader, folder / name, content)


@FUZZ
@given(content=st.binary(max_size=2048), header=st.booleans())
def test_smv_reader_never_crashes(tmp_path_factory, content, header):
    folder = tmp_path_factory.mktemp("smv", numbered=True)
    prefix = b"{\nHEADER_BYTES=512;\nDIM=2;\nSIZE1=4;\nSIZE2=3;\n}" if header else b""
    _check_reader(read_smv, folder / "f.img", prefix + content)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lattice_factor_is_finite_at_nodes(dtype):
    """Exactly integer h, k, l (δ = 0) give N, not 0/0, in every shape; the compiled sine too."""
    zero = torch.zeros(4, dtype=dtype)
    assert torch.equal(torch.div(*sincg_parts(zero, torch.tensor(7.0, dtype=dtype))), torch.full_like(zero, 7.0))
    assert torch.equal(sin_pi_polynomial(zero), zero)
    from nbsim.kernel.inputs import KernelOptions

    for shape in ("square", "round", "gauss", "tophat"):
        value = lattice_factor(zero, zero, zero, torch.tensor([3.0, 4.0, 5.0], dtype=dtype),
                               torch.eye(3, dtype=dtype) * 0.01, torch.tensor(1.0, dtype=dtype),
                               KernelOptions(shape=shape))
        assert torch.isfinite(value).all() and float(value[0]) > 0


SINGULAR_GEOMETRIES = {
    # The direct beam lands exactly on a pixel centre (S = 0: h = k = l = 0).
    "direct beam": "-detpixels 5 -pixel 0.1 -distance 100",
    # Detector swung to 2θ = 90° (pixels near and beyond 90° scattering).
    "two-theta 90": "-detpixels 9 -pixel 5 -distance 50 -twotheta 90 -xds",
    "near 90 beam pivot": "-detpixels 9 -pixel 2 -distance 50 -detector_roty 89.9",
    "grazing curved": "-detpixels 9 -pixel 20 -distance 20 -curved_det",
}


@pytest.mark.parametrize("name", sorted(SINGULAR_GEOMETRIES))
@pytest.mark.parametrize("shape", ["-square_xtal", "-round_xtal", "-gauss_xtal", "-tophat_spots"])
def test_images_are_finite_at_singular_geometry(name, shape):
    args = (f"-default_F 100 -cell 100 100 100 90 90 90 -lambda 1 -N 3 -oversample 1 {shape} "
            + SINGULAR_GEOMETRIES[name]).split()
    for dtype in (torch.float32, torch.float64):
        image = Renderer(resolve(nbsim.config_from_args(args)), dtype=dtype, compile=False)()
        assert torch.isfinite(image).all(), f"{name} {shape} {dtype}"


def test_no_shell_strings_and_safe_yaml():
    """Commands are argument lists (never shell strings) and YAML is read with the safe loader."""
    sources = [*(REPO_ROOT / "nbsim").glob("*.py"), *(REPO_ROOT / "workflow").rglob("*.py"),
               *(REPO_ROOT / "workflow").rglob("*.smk"), REPO_ROOT / "Snakefile"]
    for path in sources:
        text = path.read_text()
        assert "shell=True" not in text and "os.system(" not in text and "os.popen(" not in text, path
        assert not re.search(r"yaml\.load\(", text), path
        assert not re.search(r"^\s+shell:", text, re.M), f"{path} builds a shell command"


# --- killed and concurrent jobs -------------------------------------------------------------------

SLOW_POINT = {
    "scenarios": {"seed": {"args": SEED_ARGS}},
    "sweep": {"sizes": [512], "dtypes": ["float64"], "devices": ["cpu"], "compile": ["off"]},
    "timing": {"warmup": 0, "repeats": 1, "threads": 1},
    "reference": {"compile": False},
}


def _snakemake(folder: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*snakemake_command(folder), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=own_cache_env(folder))


@pytest.mark.slow
def test_job_killed_mid_write_leaves_nothing_read_as_complete(tmp_path):
    """SIGKILL the batch job once its store exists and its point is rendering: no records, no point marked
    complete in the store, no tables; the rerun completes the batch. Without a reference batch (the batch
    is killed, not its reference) and up to the timing table (no plots or summary)."""
    import psutil

    from nbsim.sweep.store import completed_points

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**SLOW_POINT, "reference": False}))
    batch = tmp_path / "results" / "seed" / "batches" / "n512-float64-cpu-compile_off-b0000"
    table = "results/seed/tables/timing.csv"
    process = _snakemake(tmp_path, table)
    victim = None
    deadline = time.time() + 600
    while victim is None and time.time() < deadline and process.poll() is None:
        if (batch / "images.zarr" / "done" / "zarr.json").is_file():
            jobs = [child for child in psutil.Process(process.pid).children(recursive=True)
                    if any("simulate" in part for part in child.cmdline())]
            if jobs:
                victim = jobs[0].pid
                os.kill(victim, signal.SIGKILL)
        time.sleep(0.002)
    output = process.communicate(timeout=600)[0]
    assert victim is not None, "the batch was never caught rendering:\n" + output[-2000:]
    assert process.returncode != 0
    assert not (batch / "records.json").exists()
    assert not completed_points(batch / "images.zarr").any()
    assert not (tmp_path / "results" / "seed" / "tables" / "timing.csv").exists()

    rerun = _snakemake(tmp_path, table)
    output = rerun.communicate(timeout=900)[0]
    assert rerun.returncode == 0, output[-3000:]
    assert completed_points(batch / "images.zarr").all()
    rows = (tmp_path / "results" / "seed" / "tables" / "timing.csv").read_text().splitlines()
    assert len(rows) == 2 and ",ok," in rows[1]


@pytest.mark.slow
def test_parallel_jobs_do_not_corrupt_stores(tmp_path):
    config = json.loads(json.dumps(SLOW_POINT))
    config["sweep"].update(sizes=[24, 32], dtypes=["float32"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    # The batches' records (their jobs and their references'): collate, plots and summary read the stores
    # one after another.
    records = [f"results/seed/batches/n{size}-float32-cpu-compile_off-b0000/records.json" for size in (24, 32)]
    first = _snakemake(tmp_path, *records, "--cores", "4", "--resources", "timing_slot=4")
    output = first.communicate(timeout=900)[0]
    assert first.returncode == 0, output[-3000:]
    from nbsim.sweep.store import read_store

    stores = sorted((tmp_path / "results" / "seed").glob("*/*/images.zarr"))
    assert len(stores) == 4  # two timed batches and two reference batches
    for store in stores:
        image = read_store(store)["image"].values
        size = int(store.parent.name.split("-")[0][1:])
        assert image.shape == (1, size, size) and np.isfinite(image).all() and image.max() > 0
    again = _snakemake(tmp_path, *records, "--cores", "4", "--resources", "timing_slot=4")
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0 and "Nothing to be done" in output


@pytest.mark.parametrize("option, value, message", [
    ("mosaic_spread_deg", -0.3, "mosaic_spread_deg must be a finite number not below 0 (got -0.3)"),
    ("distance_mm", -5.0, "distance_mm must be positive (got -5)"),
    ("mosaic_domains", -3, "mosaic_domains must be a finite number not below 0 (got -3)"),
    ("wavelength_A", float("nan"), "wavelength_A must be positive (got nan)"),
    ("n_cells", (5, -1, 5), "n_cells must be a finite number not below 0 (got -1)"),
    ("fluence_photons_per_m2", float("inf"), "fluence_photons_per_m2 must be a finite number not below 0"),
])
def test_option_values_out_of_range_are_refused_as_the_flags_are(option, value, message):
    """Values set as options (Python, a sweep's option axes and draws) meet the ranges nanoBragg's flag rules
    give their flags: one line naming the option, before anything renders."""
    config = nbsim.config_from_args("-cell 50 60 70 90 90 90 -default_F 1 -N 5 -detpixels 16".split())
    with pytest.raises(NbsimError, match=re.escape(message)):
        resolve(config.with_options(**{option: value}))
