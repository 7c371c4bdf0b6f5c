"""Ahead-of-time packages are opened and run in a probe process before a render opens one
(nbsim.kernel.aot.verify_package): a package that crashes PyTorch's loader is stamped unusable and its
stage runs just in time, with a warning; a good one is probed once per machine and installation."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import nbsim
from nbsim.cli import main
from nbsim.kernel import aot, dispatch, jit
from nbsim.kernel.aot import VERIFY_PACKAGES, ensure_package, open_cached_packages, verify_package
from nbsim.kernel.cache import JIT_AFTER_REFUSAL, KernelCache
from nbsim.kernel.stages import StageVariant
from nbsim.kernel.structure import structure_of
from nbsim.modes import Compile, Mode
from nbsim.render import Renderer
from nbsim.resolve import resolve
from nbsim.sweep.jobs import build_kernel
from nbsim.sweep.plan import KernelJob
from nbsim.timing import timed_render

# One step per pixel: a single package, the one test_compile's kernel-building test builds first.
ARGS = ("-default_F 100 -cell 70 80 90 75 85 95 -misset 10 20 30 -N 4 -lambda 1.5 -distance 200 -detpixels 48 "
        "-pixel 1 -oversample 1").split()
CPU = torch.device("cpu")
CRASH_ON_LOAD = "#include <signal.h>\n__attribute__((constructor)) static void crash(void) { raise(SIGSEGV); }\n"


@pytest.fixture(autouse=True)
def _defaults(monkeypatch, tmp_path):
    """The default mode choice (ahead of time on the CPU) and verification; the CLI's outputs in tmp_path."""
    monkeypatch.delenv("NBSIM_COMPILE_MODE", raising=False)
    monkeypatch.delenv(VERIFY_PACKAGES, raising=False)
    monkeypatch.chdir(tmp_path)


def _setup_and_variant():
    setup = resolve(nbsim.config_from_args(ARGS))
    [variant] = structure_of(setup.config).stage_variants()
    return setup, variant


def _crashing_package(cache: KernelCache, variant: StageVariant, folder: Path) -> Path:
    """A package in `cache`'s place for the variant whose shared library raises SIGSEGV while PyTorch's
    loader opens it (as packages did on two lent Intel Xeon machines, docs/benchmarks.md)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (ahead-of-time kernels need one too)")
    (folder / "crash.c").write_text(CRASH_ON_LOAD)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "crash.so"), str(folder / "crash.c")],
                   check=True, timeout=60)
    package = cache.package(variant, torch.float32, CPU)
    package.parent.mkdir(parents=True)
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("crash/archive_format", "pt2")
        archive.write(folder / "crash.so", "crash/data/aotinductor/model/crash.so")
        archive.writestr("crash/data/aotinductor/model/crash_metadata.json", '{"AOTI_DEVICE_KEY": "cpu"}')
    cache.record_build(variant, torch.float32, CPU, 0.0, "crafted")
    return package


def _counted_probes(monkeypatch) -> list[Path]:
    """The packages probe processes are started for, from now on."""
    probed = []

    def counted(cache, package, *rest):
        probed.append(package)
        return probe_package(cache, package, *rest)

    probe_package = aot.probe_package
    monkeypatch.setattr(aot, "probe_package", counted)
    return probed


def _eager_instead_of_jit(monkeypatch) -> list[StageVariant]:
    """The variants the fallback is asked for, from now on, run eagerly: compiling the single-step kernel
    just in time takes 20 s to 2 minutes on 2 cores (the jit tests in test_compile.py and test_parity.py
    cover torch.compile itself); what is tested here is that a render gets there, and its image."""
    asked = []

    def eager(variant):
        asked.append(variant)
        return lambda leading, tensors: variant.stage.function(*leading, tensors, options=variant.options)

    monkeypatch.setattr(dispatch, "jit_stage", eager)
    return asked


def _assert_close(image: np.ndarray | torch.Tensor, reference: torch.Tensor) -> None:
    scale = float(reference.abs().max())
    assert scale > 0
    assert float((torch.as_tensor(image).double() - reference).abs().max()) <= 1e-3 * scale


def test_a_package_that_crashes_the_loader_falls_back_with_a_warning_and_is_probed_once(tmp_path, monkeypatch,
                                                                                         capsys):
    """The probe process dies of SIGSEGV, not the render: the stage runs just in time, the image is right,
    the renderer, the command line and `nbsim bench` (its JSON too) say why, the stamp spares the next render
    a probe, and the resident worker's pre-opening skips the package (opening it here would end this test
    process)."""
    setup, variant = _setup_and_variant()
    cache = KernelCache(tmp_path / "cache")
    package = _crashing_package(cache, variant, tmp_path)
    probed, fallbacks = _counted_probes(monkeypatch), _eager_instead_of_jit(monkeypatch)
    reference = Renderer(setup, dtype=torch.float64, compile="off")()
    warning = (f"ahead-of-time kernel {package} (pixel_kernel float32 cpu): opening it killed a probe process "
               "with SIGSEGV; this stage runs with torch.compile instead")

    renderer = Renderer(setup, dtype=torch.float32, compile="on", cache=cache)
    image = renderer()
    assert renderer.mode is Mode.AOT and renderer.warnings == [warning]
    assert renderer.kernel_path == JIT_AFTER_REFUSAL
    assert (renderer.loads.opened, renderer.loads.built, renderer.loads.unusable) == (0, 0, [warning])
    _assert_close(image, reference)
    verdict = cache.verdict(package)
    assert verdict is not None and not verdict["usable"]
    assert verdict["failure"] == "opening it killed a probe process with SIGSEGV"
    assert probed == [package] and fallbacks == [variant]

    monkeypatch.setenv("NBSIM_CACHE_DIR", str(cache.folder))  # the command line's cache: read the stamp
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # restored after the test
    assert main([*ARGS, "-compile", "on", "-dtype", "float32", "-floatfile", "image.bin", "-nonoise", "-nopgm"]) == 0
    assert f"WARNING: {warning}" in capsys.readouterr().out.splitlines()
    _assert_close(np.fromfile(tmp_path / "image.bin", np.float32).reshape(setup.shape), reference)
    assert probed == [package] and fallbacks == [variant, variant]
    assert main(["bench", "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--json", "bench.json",
                 "--", *ARGS]) == 0
    assert f"WARNING: {warning}" in capsys.readouterr().out.splitlines()
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["warnings"] == [warning] and bench["mode"] == JIT_AFTER_REFUSAL

    open_cached_packages(cache, CPU)
    assert not cache.open_packages


def _recorded_warm_ups(monkeypatch) -> list[tuple]:
    """What the just-in-time warm-up (nbsim.kernel.jit.warm_stages) is asked for from now on, with torch's
    thread count at the time; it compiles nothing (a real one takes 20 s to 2 minutes on 2 cores: the
    campaign's runs measure it, docs/benchmarks.md)."""
    asked = []

    def recorded(variants, dtype, device):
        asked.append((variants, dtype, device, torch.get_num_threads()))
        return [1.5] * len(variants)

    monkeypatch.setattr(jit, "warm_stages", recorded)
    return asked


def _kernel_job(tmp_path, monkeypatch, cache: KernelCache, mode: str, threads: int = 1, device: str = "cpu") -> dict:
    """The sweep's kernel job for the test's structure (float32, timed jobs of 3 threads), run here with
    `threads` threads and its environment restored afterwards; its marker's record."""
    for name, value in {"NBSIM_CACHE_DIR": str(cache.folder), "OMP_NUM_THREADS": "1",
                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    setup, _ = _setup_and_variant()
    job = KernelJob(structure_of(setup.config).to_json(), "float32", device, mode, 3)
    try:
        record = build_kernel(job, threads, str(cache.folder), tmp_path / "marker.json")
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "marker.json").read_text()) == json.loads(json.dumps(record))
    return record


def test_a_kernel_job_warms_the_just_in_time_path_of_a_package_this_machine_refuses(tmp_path, monkeypatch):
    """The sweep's kernel job probes its package before the timed jobs; refused here, it compiles the
    just-in-time path that the stage falls back to, for the timed jobs' thread count, and its marker says so.
    A timed render after it reads the stamp (no probe) and its row names the path it took."""
    setup, variant = _setup_and_variant()
    cache = KernelCache(tmp_path / "cache")
    package = _crashing_package(cache, variant, tmp_path)
    probed, warmed = _counted_probes(monkeypatch), _recorded_warm_ups(monkeypatch)

    record = _kernel_job(tmp_path, monkeypatch, cache, "aot")
    [stage] = record["stages"]
    assert (stage["path"], stage["refused"], stage["cache"], stage["warm_s"]) == (
        JIT_AFTER_REFUSAL, "opening it killed a probe process with SIGSEGV", "hit", 1.5)
    assert record["warm"] == "after the probes" and probed == [package]
    assert warmed == [([variant], torch.float32, CPU, 3)]

    _eager_instead_of_jit(monkeypatch)
    timed = timed_render(setup.config, CPU, torch.float32, Compile.ON, 0, 1)
    assert timed.result.mode == JIT_AFTER_REFUSAL and probed == [package]


def test_a_kernel_job_of_just_in_time_points_warms_their_path(tmp_path, monkeypatch):
    """Points that compile just in time (a GPU's; here a CPU job of that mode, as NBSIM_COMPILE_MODE=jit plans)
    get a kernel job too, which builds no package and warms their path; a warm-up that fails is recorded."""
    _, variant = _setup_and_variant()
    warmed = _recorded_warm_ups(monkeypatch)
    record = _kernel_job(tmp_path, monkeypatch, KernelCache(tmp_path / "cache"), "jit")
    assert record["stages"] == [{"stage": "pixel_kernel", "path": "jit", "warm_s": 1.5}]
    assert record["warm"] == "in this process" and warmed == [([variant], torch.float32, CPU, 3)]
    assert not (tmp_path / "cache" / "kernels").exists()

    def failing(variants, dtype, device):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(jit, "warm_stages", failing)  # the job succeeds: the timed jobs compile for themselves
    record = _kernel_job(tmp_path, monkeypatch, KernelCache(tmp_path / "cache"), "jit")
    assert (record["status"], record["warm"]) == ("ok", "failed: RuntimeError: no compiler")
    assert record["stages"] == [{"stage": "pixel_kernel", "path": "jit"}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_kernel_job_for_a_device_this_machine_lacks_is_recorded_as_skipped(tmp_path, monkeypatch):
    """A CUDA point's kernel job where there is no CUDA (a sweep with on_unavailable_device: skip) compiles
    nothing and says why; the timed job reports the point."""
    warmed = _recorded_warm_ups(monkeypatch)
    record = _kernel_job(tmp_path, monkeypatch, KernelCache(tmp_path / "cache"), "jit", device="cuda")
    assert record["status"] == "skipped" and "cuda" in record["reason"] and record["stages"] == []
    assert not warmed


def test_a_package_that_fails_to_open_is_stamped_with_the_error(tmp_path, monkeypatch):
    """A package the loader refuses (cut short) fails in the probe process with PyTorch's error."""
    _, variant = _setup_and_variant()
    cache = KernelCache(tmp_path / "cache")
    package = _crashing_package(cache, variant, tmp_path)
    package.write_bytes(package.read_bytes()[:100])
    probed = _counted_probes(monkeypatch)
    for _ in range(2):
        failure = verify_package(cache, package, variant, torch.float32, CPU)
        assert failure is not None and failure.startswith("opening it failed in a probe process (RuntimeError: ")
    assert probed == [package]


def test_a_good_package_is_probed_once_per_machine(tmp_path, monkeypatch, private_compile_cache):
    """The session's package (built by the suite's first test, or here), copied into a cache of its own: the
    sweep's kernel job probes it, with two threads after starting the just-in-time compile beside it in a child
    process, which the passing verdict stops (none left running); renders (a new cache object each) open it on
    the stamp alone, another host would probe it again, and NBSIM_VERIFY_PACKAGES=off opens it unprobed."""
    setup, variant = _setup_and_variant()
    session = KernelCache(private_compile_cache)
    ensure_package(session, variant, torch.float32, CPU)
    source = session.package(variant, torch.float32, CPU)
    probed = _counted_probes(monkeypatch)
    reference = Renderer(setup, dtype=torch.float64, compile="off")()
    folders = tmp_path / "verified", tmp_path / "unverified"
    for folder in folders:
        (folder / "kernels").mkdir(parents=True)
        shutil.copy(source, folder / "kernels" / source.name)
        shutil.copy(source.with_suffix(".json"), folder / "kernels" / source.with_suffix(".json").name)
    package = folders[0] / "kernels" / source.name
    started = []

    def recorded(*arguments):
        started.append(start_warming(*arguments))
        return started[-1]

    start_warming = jit.start_warming
    monkeypatch.setattr(jit, "start_warming", recorded)
    record = _kernel_job(tmp_path, monkeypatch, KernelCache(folders[0]), "aot", threads=2)
    assert record["warm"] == "stopped: every package passed its probe"
    assert [(stage["path"], "warm_s" in stage) for stage in record["stages"]] == [("aot", False)]
    assert [child.poll() is not None for child in started] == [True]

    for _ in range(2):
        renderer = Renderer(setup, dtype=torch.float32, compile="on", cache=KernelCache(folders[0]))
        _assert_close(renderer(), reference)
        assert renderer.loads.opened == 1 and not renderer.warnings
    assert probed == [package]
    assert renderer.cache.verdict(package)["usable"]
    worker_cache = KernelCache(folders[0])
    open_cached_packages(worker_cache, CPU)
    assert list(worker_cache.open_packages) == [(package, CPU)]
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(platform, "node", lambda: "another-host")
        assert renderer.cache.verdict(package) is None

    monkeypatch.setenv(VERIFY_PACKAGES, "off")
    unverified = KernelCache(folders[1])
    renderer = Renderer(setup, dtype=torch.float32, compile="on", cache=unverified)
    _assert_close(renderer(), reference)
    assert renderer.loads.opened == 1 and probed == [package]
    assert unverified.verdict(folders[1] / "kernels" / source.name) is None
