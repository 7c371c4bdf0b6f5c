"""Compiled kernels: one per structure (never per count or value), the auto mode, and the kernel cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor import cpu_vec_isa

import nbsim
from nbsim.kernel.build import start_background_build
from nbsim.kernel.cache import KERNEL_SOURCES, KernelCache, KernelLoads, locked
from nbsim.kernel.inductor_patches import vectors_per_iteration
from nbsim.kernel.inputs import KernelOptions
from nbsim.kernel.policy import plan_compile
from nbsim.kernel.stages import FUSED_VECTORS, SINGLE_STEP_STAGES, Structure
from nbsim.kernel.structure import structure_of
from nbsim.modes import Compile, Mode
from nbsim.render import Renderer
from nbsim.resolve import resolve

from .conftest import GOLDEN, SEED_ARGS, one_line_error_here, requires_golden

TRICLINIC = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -lambda 1.5 -distance 200 -pixel 0.8 -detpixels 24 "
             "-mosaic 0.4 -mosaic_seed 3").split()


def _render(args: list[str], dtype: torch.dtype, compile: bool | str) -> tuple[Renderer, torch.Tensor]:
    renderer = Renderer(resolve(nbsim.config_from_args(args)), dtype=dtype, compile=compile)
    return renderer, renderer()


def _assert_matches_eager(args: list[str], image: torch.Tensor) -> None:
    _, eager = _render(args, torch.float64, False)
    scale = float(eager.abs().max())
    assert scale > 0
    assert float((image.double() - eager).abs().max()) <= 1e-3 * scale


def _hkl_file(path: Path, extent: int) -> str:
    path.write_text("\n".join(f"{h} {k} {l} {5 + abs(h) + 2 * abs(k) + 3 * abs(l)}"
                              for h in range(-extent, extent + 1) for k in range(-extent, extent + 1)
                              for l in range(-extent, extent + 1)) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.builds_kernels
def test_concurrent_processes_share_one_compiled_kernel(tmp_path, private_compile_cache):
    """Two processes compiling the same kernel at once: one builds it under the lock, both render it. The
    build goes to the session's cache when that lacks the kernel (this test runs first, so later tests of
    its structure, golden parity and the sweep's shared cache among them, load it), else to a cache of
    its own, so that it is always a real build."""
    script = (
        "import json, sys, torch, nbsim\n"
        "from nbsim.render import Renderer\n"
        "from nbsim.resolve import resolve\n"
        "config = nbsim.config_from_args(sys.argv[1:])\n"
        "renderer = Renderer(resolve(config), dtype=torch.float32, compile=True)\n"
        "image = renderer()\n"
        "reference = Renderer(resolve(config), dtype=torch.float64, compile=False)()\n"
        "assert torch.allclose(image.double(), reference, rtol=1e-3, atol=1e-3 * float(reference.max()))\n"
        "print(json.dumps({'built': renderer.loads.built, 'opened': renderer.loads.opened}))\n")
    # One step per pixel: a single kernel to build (the lock is the same for every package).
    args = "-default_F 100 -cell 70 80 90 75 85 95 -misset 10 20 30 -N 4 -lambda 1.5 -distance 200 " \
           "-detpixels 48 -pixel 1 -oversample 1".split()
    structure = structure_of(nbsim.config_from_args(args))
    [variant] = structure.stage_variants()
    cpu = torch.device("cpu")
    folder = private_compile_cache if KernelCache(private_compile_cache).missing(structure, torch.float32, cpu) \
        else tmp_path / "cache"
    env = {**os.environ, "NBSIM_CACHE_DIR": str(folder), "NBSIM_COMPILE_MODE": "aot"}
    processes = [subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in processes]
    for process, (_, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, err[-2000:]
    events = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert sum(e["built"] for e in events) == 1  # built once
    assert sum(e["opened"] for e in events) == 1  # and loaded by the other process
    package = KernelCache(folder).package(variant, torch.float32, cpu)
    assert package.is_file() and not list(package.parent.glob(f"{package.stem}.partial-*"))
    with zipfile.ZipFile(package) as archive:
        [source] = [archive.read(name).decode() for name in archive.namelist() if name.endswith(".kernel.cpp")]
    # The single-step kernel is one loop over the tile: nothing written out and read back between loops.
    assert source.count("#pragma omp for") == 1


@pytest.mark.slow
@requires_golden
def test_one_ahead_of_time_kernel_serves_every_count_table_and_value(tmp_path, monkeypatch):
    """The first render of a structure builds its stages; other counts (domains, N, phi steps, sources,
    sub-pixels), another HKL table and other values (λ, distance, misset) then load the same kernels."""
    monkeypatch.setenv("NBSIM_COMPILE_MODE", "aot")
    hkl = ["-hkl", str(GOLDEN / "synthetic_P1.hkl")]
    first = [*TRICLINIC, *hkl, "-N", "5", "-mosaic_dom", "2", "-oversample", "2"]
    renderer, image = _render(first, torch.float32, True)
    assert renderer.mode is Mode.AOT
    _assert_matches_eager(first, image)
    cache = renderer.cache
    built = cache.builds
    variations = [
        [*TRICLINIC, *hkl, "-N", "7", "-mosaic_dom", "3", "-oversample", "1"],
        [*TRICLINIC, *hkl, "-N", "6", "-mosaic_dom", "1", "-mosaic", "0", "-phisteps", "3", "-osc", "0.3",
         "-oversample", "3"],
        [*TRICLINIC, "-hkl", _hkl_file(tmp_path / "other.hkl", 4), "-N", "5", "-mosaic_dom", "4",
         "-hdivrange", "0.3", "-hdivsteps", "3", "-oversample", "2"],
        [*TRICLINIC, *hkl, "-N", "5", "-mosaic_dom", "2", "-oversample", "2", "-lambda", "1.2", "-distance", "180",
         "-misset", "5", "15", "25"],
    ]
    for args in variations:
        renderer, image = _render(args, torch.float32, True)
        assert renderer.mode is Mode.AOT and renderer.steps_per_pixel > 1
        assert renderer.loads.built == 0 and renderer.cache is cache
        _assert_matches_eager(args, image)
    assert cache.builds == built, "a new count, table or value compiled a new kernel"


@pytest.mark.slow
def test_jit_serves_new_step_counts_without_recompiling(monkeypatch):
    """torch.compile marks every count dynamic: a second step count reuses the first one's graphs."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("NBSIM_COMPILE_MODE", "jit")
    base = [*TRICLINIC, "-default_F", "100", "-N", "4", "-detpixels", "12"]
    compiled_graphs = []
    for domains, oversample in (("2", "2"), ("5", "3")):
        args = [*base, "-mosaic_dom", domains, "-oversample", oversample]
        before = counters["stats"]["unique_graphs"]
        renderer, image = _render(args, torch.float32, True)
        assert renderer.mode == "jit"
        compiled_graphs.append(counters["stats"]["unique_graphs"] - before)
        _assert_matches_eager(args, image)
    assert compiled_graphs[0] >= 1
    assert compiled_graphs[1] == 0, f"the second step count compiled {compiled_graphs[1]} new graph(s)"


def test_cache_key_holds_structure_only():
    """Stages that do not read an option share a package; dtype and device split them; no count enters."""
    options = KernelOptions(lookup="nearest", polarization="kahn")
    steps = Structure(options, single_step=False).stage_variants()
    assert [v.stage.function.__name__ for v in steps] == ["prepare_pixels", "sum_steps"]
    prepare, step_sum = steps
    assert prepare.options == KernelOptions(polarization="kahn")  # the lookup is not read per pixel
    assert step_sum.options == KernelOptions(lookup="nearest")  # nor the polarization in the step sum
    cache, cpu = KernelCache(Path("unused")), torch.device("cpu")
    other_shape = Structure(KernelOptions(lookup="nearest", polarization="kahn", shape="round"), False)
    assert cache.key(other_shape.stage_variants()[0], torch.float32, cpu) == cache.key(prepare, torch.float32, cpu)
    assert cache.key(prepare, torch.float32, cpu) != cache.key(prepare, torch.float64, cpu)
    description = json.dumps(cache.description(prepare, torch.float32, cpu))
    for word in ("shape", "grid", "steps", "count", "size"):
        assert word not in description
    interpolated = Structure(KernelOptions(lookup="interpolate"), single_step=True).stage_variants()
    assert [v.stage.function.__name__ for v in interpolated] == \
        ["pixel_kernel", "prepare_pixels", "steps_out_of_range", "pixel_kernel"]


def _fake_cache(tmp_path: Path, structure: Structure, dtype: torch.dtype) -> KernelCache:
    """A kernel cache whose packages of `structure` exist (empty files: enough for every lookup that
    does not load them)."""
    cache = KernelCache(tmp_path / "cache")
    cache.kernels.mkdir(parents=True)
    for variant in structure.stage_variants():
        cache.package(variant, dtype, torch.device("cpu")).touch()
        cache.record_build(variant, dtype, torch.device("cpu"), 12.5, "today")
    return cache


def test_auto_uses_a_cached_kernel_and_else_plans_to_build(tmp_path, monkeypatch):
    monkeypatch.delenv("NBSIM_COMPILE_MODE", raising=False)
    cpu = torch.device("cpu")
    structure = Structure(KernelOptions(), single_step=True)
    empty = KernelCache(tmp_path / "empty")
    uncached = plan_compile(Compile.AUTO, cpu, torch.float32, False, structure, empty)
    assert (uncached.mode, uncached.pending, len(uncached.missing)) == (Mode.EAGER, Mode.AOT, 1)
    assert plan_compile(Compile.ON, cpu, torch.float32, False, structure, empty).mode is Mode.AOT
    assert plan_compile(Compile.OFF, cpu, torch.float32, False, structure, empty).mode is Mode.EAGER
    for setting in (Compile.AUTO, Compile.ON):  # gradients: eager, and the note says why
        with_grad = plan_compile(setting, cpu, torch.float32, True, structure, empty)
        assert (with_grad.mode, with_grad.pending, with_grad.note[:10]) == (Mode.EAGER, None, "gradients:")
    monkeypatch.setenv("NBSIM_COMPILE_MODE", "jit")
    assert plan_compile(Compile.ON, cpu, torch.float32, True, structure, empty).mode is Mode.JIT
    monkeypatch.delenv("NBSIM_COMPILE_MODE")
    cache = _fake_cache(tmp_path, structure, torch.float32)
    assert not cache.missing(structure, torch.float32, cpu)
    cached = plan_compile(Compile.AUTO, cpu, torch.float32, False, structure, cache)
    assert (cached.mode, cached.pending) == (Mode.AOT, None)
    assert plan_compile(Compile.AUTO, cpu, torch.float64, False, structure, cache).mode is Mode.EAGER  # other dtype
    with pytest.raises(TypeError, match="plan_compile takes a Compile"):
        plan_compile("on", cpu, torch.float32, False, structure, cache)
    with pytest.raises(ValueError, match="compile must be auto, on or off"):
        Renderer(resolve(nbsim.config_from_args([*TRICLINIC, "-default_F", "1"])), compile="sometimes")


def test_compiling_pays_only_for_long_eager_renders(tmp_path):
    structure = Structure(KernelOptions(lookup="nearest"), single_step=False)
    cache = _fake_cache(tmp_path, Structure(KernelOptions(), single_step=True), torch.float32)
    plan = plan_compile(Compile.AUTO, torch.device("cpu"), torch.float32, False, structure, cache)
    assert len(plan.missing) == 2
    assert plan.estimated_build_s == pytest.approx(25.0)  # this machine's past builds: 12.5 s a stage
    assert not plan.compile_pays(20.0)
    assert plan.compile_pays(60.0)
    assert plan.decide(20.0).mode is Mode.EAGER and plan.decide(20.0).unbuilt == plan.missing
    assert plan.decide(60.0).mode is Mode.AOT and not plan.decide(60.0).unbuilt


def test_auto_renders_an_uncached_structure_eagerly_and_starts_nothing(tmp_path, monkeypatch):
    """From Python, `auto` settles explicitly, reports what it left unbuilt, and builds nothing in the
    background unless asked."""
    monkeypatch.delenv("NBSIM_COMPILE_MODE", raising=False)
    monkeypatch.setenv("NBSIM_BACKGROUND_BUILD", "on")
    cache = KernelCache(tmp_path / "cache")
    args = [*TRICLINIC, "-default_F", "100", "-N", "4", "-mosaic_dom", "3"]
    renderer = Renderer(resolve(nbsim.config_from_args(args)), dtype=torch.float32, compile="auto", cache=cache)
    assert renderer.decision is None and renderer.plan.pending is Mode.AOT
    started = time.perf_counter()
    image = renderer()
    assert time.perf_counter() - started < 20, "auto mode waited for a build"
    assert renderer.mode is Mode.EAGER and renderer.decision.unbuilt == renderer.plan.missing
    assert "eager render" in renderer.decision.note and renderer.plan.pending is Mode.AOT  # the plan is unchanged
    assert renderer.loads == KernelLoads()
    _assert_matches_eager(args, image)
    assert not (tmp_path / "cache").exists(), "a Python render started a background build"


def test_background_build_runs_once_per_structure(tmp_path):
    """The build for the next run: a detached, niced `python -m nbsim.kernel.build`, not started while one runs."""
    structure = Structure(KernelOptions(), single_step=True)
    cache = _fake_cache(tmp_path, structure, torch.float32)
    assert not list(cache.kernels.glob("build-*.lock"))
    assert start_background_build(cache, structure, torch.float32, torch.device("cpu"))
    log = cache.kernels / "background-build.log"
    deadline = time.monotonic() + 120
    while "cached" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "pixel_kernel float32 cpu (default options): cached" in log.read_text()
    [build_lock] = cache.kernels.glob("build-*.lock")
    with locked(build_lock):
        assert not start_background_build(cache, structure, torch.float32, torch.device("cpu")), \
            "a second build of the same structure was started"


@pytest.mark.parametrize("setting, started, printed", [
    ("on", True, "eager render; building it in the background for the next run"),
    ("on", False, "eager render; not built now (background builds off, or one is running)"),
    ("off", None, "eager render; not built now (background builds off, or one is running)")])
def test_the_command_line_builds_what_auto_left_unbuilt(monkeypatch, capsys, setting, started, printed):
    """`nbsim`'s render command starts the background build (unless NBSIM_BACKGROUND_BUILD=off) and says so."""
    from nbsim.cli.simulate import _report_compile_decision
    from nbsim.kernel.policy import CompileDecision

    calls = []

    class LeftUnbuilt:
        def settle(self):
            return CompileDecision(Mode.EAGER, "eager render", unbuilt=SINGLE_STEP_STAGES)

        def build_missing_in_background(self):
            calls.append(True)
            return started

    monkeypatch.setenv("NBSIM_BACKGROUND_BUILD", setting)
    _report_compile_decision(LeftUnbuilt())
    assert capsys.readouterr().out == f"  {printed}\n"
    assert calls == ([] if setting == "off" else [True])


def test_kernel_sources_cover_what_a_package_is_built_from():
    """The cache key's source digest reads every nbsim module the ahead-of-time path imports, besides those
    no compiled code comes from: the cache's bookkeeping, dtype and device names, and what kernel_inputs
    reads to make the tensors (the set-up, its configuration, vector helpers, errors)."""
    import ast

    kernel = Path(nbsim.__file__).parent / "kernel"
    covered = {(kernel / name).resolve() for name in KERNEL_SOURCES}
    not_compiled = {kernel / "cache.py", *(kernel.parent / f"{name}.py"
                                           for name in ("devices", "resolve", "config", "vectors", "errors"))}
    for source in covered:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                folder = source.parent if node.level == 1 else source.parent.parent
                imported = (folder / f"{node.module.replace('.', '/')}.py").resolve() if node.module else None
                if imported is not None and imported.is_file():
                    assert imported in covered | not_compiled, f"{source.name} imports {imported.name}, not digested"


def test_kernels_command_lists_and_reports_cached_builds(tmp_path, monkeypatch, capsys):
    """nbsim's main in this process (a Python and PyTorch start fewer for each of the three commands), with
    the cache in NBSIM_CACHE_DIR and Inductor's where `kernels build` points it (restored afterwards)."""
    from nbsim.cli import main

    structure = Structure(KernelOptions(), single_step=True)
    _fake_cache(tmp_path, structure, torch.float32)
    monkeypatch.setenv("NBSIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache" / "inductor"))
    assert main(["kernels", "list"]) == 0
    listed = capsys.readouterr()
    assert "1 kernel(s) in" in listed.out and listed.err == ""
    assert "pixel_kernel" in listed.out and "float32" in listed.out and " yes " in listed.out
    assert main(["kernels", "build", "--dtype", "float32", "--", *SEED_ARGS.split(), "-detpixels", "8"]) == 0
    built = capsys.readouterr()
    assert "1 kernel(s) for 1 structure(s)" in built.out and ": cached" in built.out and built.err == ""
    assert one_line_error_here(["kernels", "frob"], tmp_path, capsys) == \
        "nbsim: error: unknown kernels command 'frob' (use build or list)"


def test_fused_stages_compile_several_vectors_per_loop_iteration():
    """While a fused stage without a table lookup builds, Inductor's loops step over four SIMD vectors of
    the kernel's dtype, with Inductor's graph cache off; afterwards its own width and cache are back."""
    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        pytest.skip("Inductor finds no vector instruction set on this processor")
    single_step = SINGLE_STEP_STAGES[0]
    cpu = torch.device("cpu")
    assert single_step.vectors_for(KernelOptions(), cpu) == FUSED_VECTORS > 1
    assert single_step.vectors_for(KernelOptions(lookup="nearest"), cpu) == 1
    assert single_step.vectors_for(KernelOptions(), torch.device("cuda")) == 1
    native, graph_cache = isa.nelements(torch.float), inductor_config.fx_graph_cache
    for dtype in (torch.float32, torch.float64):
        with vectors_per_iteration(FUSED_VECTORS, dtype):
            elements = isa.nelements(torch.float)
            assert not inductor_config.fx_graph_cache
        assert elements * dtype.itemsize * 8 == FUSED_VECTORS * isa.bit_width()
        assert isa.nelements(torch.float) == native
        assert inductor_config.fx_graph_cache == graph_cache


def test_a_missing_inductor_internal_skips_its_patch_and_says_so_once(monkeypatch, caplog):
    """On a PyTorch without the internal a patch replaces, the stage builds unpatched and a warning is logged once."""
    from torch._inductor.sizevars import SizeVarAllocator

    from nbsim.kernel import inductor_patches

    monkeypatch.delattr(SizeVarAllocator, "_simplify_loops_impl")
    inductor_patches._available.cache_clear()
    graph_cache = inductor_config.fx_graph_cache
    try:
        with caplog.at_level(logging.WARNING, logger=inductor_patches.__name__):
            for _ in range(2):
                with inductor_patches.tile_shaped_loops(True):
                    assert inductor_config.fx_graph_cache == graph_cache  # nothing patched
        assert [r.getMessage().count("tile_shaped_loops") for r in caplog.records] == [1]
    finally:
        inductor_patches._available.cache_clear()
