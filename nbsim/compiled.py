"""Compiled kernels: the same pure kernel function, eager, just-in-time or ahead-of-time.

* ``jit``: ``torch.compile`` (Inductor). Differentiable and device-agnostic; a new process pays
  Dynamo tracing and a cache lookup (several seconds) before the first call.
* ``aot``: ``torch.export`` + AOTInductor, packaged once per kernel variant into the persistent cache
  (``NBSIM_CACHE_DIR``/kernels) and loaded by PyTorch's C++ runner: a new process starts the kernel in
  milliseconds. Inference only; used on the CPU when no input needs gradients.

Only the pixel rows and columns are dynamic; every other input has the static shape of its setup,
which is part of the cache key together with the kernel options, dtype, device, source and versions.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import __version__
from .cache import cache_dir

CACHE_EVENTS: Counter = Counter()
"""'aot_hit', 'aot_miss' (package compiled now) counts for this process."""

_SOURCES = ("kernel.py", "structure_factors.py", "compiled.py")
MAX_PIXELS_PER_SIDE = 1 << 20


def choose_mode(compile: bool, device: torch.device, needs_grad: bool) -> str:
    """'eager' when not compiling; 'jit' for gradients or non-CPU devices; 'aot' otherwise.
    NBSIM_COMPILE_MODE=jit|aot overrides the choice (aot still needs no gradients)."""
    if not compile:
        return "eager"
    forced = os.environ.get("NBSIM_COMPILE_MODE")
    if forced == "jit" or needs_grad:
        return "jit"
    if forced == "aot":
        return "aot"
    return "aot" if device.type == "cpu" else "jit"


def kernel_callable(function: Callable, options, grid_shape: tuple[int, int, int],
                    mode: str) -> Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]:
    """A callable (rows, cols, tensors) -> tile for the requested mode."""
    if mode == "eager":
        return functools.partial(function, grid_shape=grid_shape, options=options)
    if mode == "jit":
        return _jit(function, options, grid_shape)
    return _aot(function, options, grid_shape)


@functools.cache
def _jit(function: Callable, options, grid_shape: tuple[int, int, int]):
    """torch.compile with only rows and columns dynamic.

    Python floats in the kernel are constants (physics parameters arrive as tensors), so Dynamo
    specialises on them instead of re-tracing to turn them into tensors; duck shaping is off so a
    square tile does not tie rows to columns.
    """
    compiled = torch.compile(functools.partial(function, grid_shape=grid_shape, options=options), dynamic=False)

    def call(rows, cols, tensors):
        torch._dynamo.mark_dynamic(rows, 0)
        torch._dynamo.mark_dynamic(cols, 0)
        with torch._dynamo.config.patch(specialize_float=True), \
                torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(rows, cols, tensors)

    return call


@functools.cache
def _aot(function: Callable, options, grid_shape: tuple[int, int, int]) -> AotKernel:
    return AotKernel(function, options, grid_shape)


class _Exported(torch.nn.Module):
    """The kernel with flat tensor inputs, as torch.export needs."""

    def __init__(self, function: Callable, options, grid_shape, spec):
        super().__init__()
        self.function, self.options, self.grid_shape, self.spec = function, options, grid_shape, spec

    def forward(self, rows, cols, *flat):
        return self.function(rows, cols, tree_unflatten(list(flat), self.spec), grid_shape=self.grid_shape,
                             options=self.options)


class AotKernel:
    """Loads (or builds once, under a file lock) the AOTInductor package of a kernel variant."""

    def __init__(self, function: Callable, options, grid_shape: tuple[int, int, int]):
        self.function, self.options, self.grid_shape = function, options, grid_shape
        self._runners: dict[str, object] = {}

    def __call__(self, rows: torch.Tensor, cols: torch.Tensor, tensors) -> torch.Tensor:
        flat, spec = tree_flatten(tensors)
        key = self._key(flat, spec, rows)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._load_or_build(key, rows, cols, flat, spec)
        n_rows, n_cols = len(rows), len(cols)
        rows, cols = _at_least_two(rows), _at_least_two(cols)
        return runner.run([rows, cols, *flat])[0][:n_rows, :n_cols]

    def _key(self, flat: list[torch.Tensor], spec, rows: torch.Tensor) -> str:
        description = {
            "nbsim": __version__, "torch": torch.__version__, "function": self.function.__qualname__,
            "source": _source_digest(), "options": repr(self.options), "grid_shape": self.grid_shape,
            "dtype": str(rows.dtype), "device": rows.device.type, "shapes": [list(t.shape) for t in flat],
            "spec": str(spec), "machine": platform.machine(), "cpu_flags": _cpu_flags(),
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]

    def _load_or_build(self, key: str, rows, cols, flat, spec):
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        package = folder / f"{key}.pt2"
        with _locked(folder / f"{key}.lock"):
            if package.is_file():
                CACHE_EVENTS["aot_hit"] += 1
            else:
                CACHE_EVENTS["aot_miss"] += 1
                self._build(package, _at_least_two(rows), _at_least_two(cols), flat, spec)
        device_index = rows.device.index if rows.device.type == "cuda" and rows.device.index is not None else -1
        return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)

    def _build(self, package: Path, rows, cols, flat, spec) -> None:
        rows_dim = torch.export.Dim("rows", min=2, max=MAX_PIXELS_PER_SIDE)
        cols_dim = torch.export.Dim("cols", min=2, max=MAX_PIXELS_PER_SIDE)
        dynamic = ({0: rows_dim}, {0: cols_dim}, tuple(None for _ in flat))
        exported = torch.export.export(_Exported(self.function, self.options, self.grid_shape, spec),
                                       (rows, cols, *flat), dynamic_shapes=dynamic, strict=False)
        from torch._inductor import aoti_compile_and_package

        partial = package.with_name(f"{package.stem}.partial-{os.getpid()}.pt2")
        aoti_compile_and_package(exported, package_path=str(partial))
        os.replace(partial, package)


def _at_least_two(index: torch.Tensor) -> torch.Tensor:
    """Exported kernels take at least two rows/columns; a single one is repeated (and cut off again)."""
    return index if len(index) >= 2 else index.repeat(2)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _source_digest() -> str:
    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                wanted = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "sse4_2", "amx_tile")
                present = set(line.split(":", 1)[1].split())
                return ",".join(flag for flag in wanted if flag in present)
    except OSError:
        pass
    return platform.processor()
