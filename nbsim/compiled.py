"""Compiled kernels: the kernel stages run eagerly, just-in-time or ahead-of-time.

A kernel is a short pipeline of stages (nbsim.kernel.PIXEL_STAGES: per-pixel preparation, then the
fused step sum). Each stage is compiled on its own with the Inductor options it needs:

* ``jit``: ``torch.compile``. Differentiable and device-agnostic; a new process pays Dynamo tracing
  and a cache lookup (seconds) before the first call.
* ``aot``: ``torch.export`` + AOTInductor, packaged once per kernel variant into the persistent cache
  (``NBSIM_CACHE_DIR``/kernels) and loaded by PyTorch's C++ runner, so a new process starts the kernel
  in milliseconds. Inference only; used on the CPU when no input needs gradients.

Only a tile's rows and columns are dynamic; every other input has the static shape of its setup,
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
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import __version__
from .cache import cache_dir
from .kernel import KernelOptions, Stage, pixel_dims

CACHE_EVENTS: Counter = Counter()
"""'aot_hit' / 'aot_miss' (a package compiled now) counts for this process."""

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


def kernel_callable(stages: tuple[Stage, ...], options: KernelOptions, grid_shape: tuple[int, int, int],
                    mode: str) -> Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]:
    """A callable (rows, cols, tensors) -> tile that runs the stages in the requested mode."""
    runners = [_runner(stage, options, grid_shape, mode) for stage in stages]

    def call(rows: torch.Tensor, cols: torch.Tensor, tensors) -> torch.Tensor:
        n_rows, n_cols = len(rows), len(cols)
        if mode != "eager":
            rows, cols = _at_least_two(rows), _at_least_two(cols)
        value = runners[0]((rows, cols), tensors)
        for runner in runners[1:]:
            value = runner((value,), tensors)
        return value[:n_rows, :n_cols]

    return call


def _runner(stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int], mode: str):
    if mode == "eager":
        return lambda leading, tensors: stage.function(*leading, tensors, grid_shape=grid_shape, options=options)
    if mode == "jit":
        return _jit(stage, options, grid_shape)
    return _aot(stage, options, grid_shape)


def _at_least_two(index: torch.Tensor) -> torch.Tensor:
    """Compiled kernels take at least two rows/columns (sizes 0 and 1 are never symbolic); a single
    one is repeated and the extra output cut off again."""
    return index if len(index) >= 2 else index.repeat(2)


@functools.cache
def _jit(stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int]):
    """torch.compile of one stage with only the tile's rows and columns dynamic.

    Python floats in the kernel are constants (physics parameters arrive as tensors), so Dynamo
    specialises on them instead of re-tracing to turn them into tensors; duck shaping is off so a
    square tile does not tie rows to columns.
    """
    compiled = torch.compile(functools.partial(stage.function, grid_shape=grid_shape, options=options),
                             dynamic=False, options=dict(stage.inductor_options))

    def call(leading: tuple, tensors):
        flat, _ = tree_flatten(leading)
        for tensor, dims in zip(flat, pixel_dims(leading, options), strict=True):
            for dim in dims:
                torch._dynamo.mark_dynamic(tensor, dim)
        with torch._dynamo.config.patch(specialize_float=True), \
                torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*leading, tensors)

    return call


@functools.cache
def _aot(stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int]) -> AotStage:
    return AotStage(stage, options, grid_shape)


class _Exported(torch.nn.Module):
    """A stage with flat tensor inputs, as torch.export needs."""

    def __init__(self, stage: Stage, options: KernelOptions, grid_shape, leading_spec, tensors_spec):
        super().__init__()
        self.stage, self.options, self.grid_shape = stage, options, grid_shape
        self.leading_spec, self.tensors_spec = leading_spec, tensors_spec
        self.leading_count = leading_spec.num_leaves

    def forward(self, *flat):
        leading = tree_unflatten(list(flat[:self.leading_count]), self.leading_spec)
        tensors = tree_unflatten(list(flat[self.leading_count:]), self.tensors_spec)
        result = self.stage.function(*leading, tensors, grid_shape=self.grid_shape, options=self.options)
        return tuple(result) if isinstance(result, tuple) else result


class AotStage:
    """Loads (or builds once, under a file lock) the AOTInductor package of one stage variant."""

    def __init__(self, stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int]):
        self.stage, self.options, self.grid_shape = stage, options, grid_shape
        self._runners: dict[str, object] = {}

    def __call__(self, leading: tuple, tensors):
        flat_leading, leading_spec = tree_flatten(leading)
        flat_tensors, tensors_spec = tree_flatten(tensors)
        key = self._key(flat_leading, flat_tensors, tensors_spec, leading)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._load_or_build(key, leading, flat_leading, leading_spec,
                                                               flat_tensors, tensors_spec)
        outputs = runner.run([*flat_leading, *flat_tensors])
        return self.stage.output(*outputs) if self.stage.output is not None else outputs[0]

    def _key(self, flat_leading, flat_tensors, tensors_spec, leading) -> str:
        dims = pixel_dims(leading, self.options)
        description = {
            "nbsim": __version__, "torch": torch.__version__, "stage": self.stage.function.__qualname__,
            "inductor": repr(self.stage.inductor_options), "source": _source_digest(), "options": repr(self.options),
            "grid_shape": self.grid_shape, "dtype": str(flat_tensors[0].dtype), "device": flat_tensors[0].device.type,
            "leading": [[size if dim not in d else None for dim, size in enumerate(t.shape)]
                        for t, d in zip(flat_leading, dims, strict=True)],
            "shapes": [list(t.shape) for t in flat_tensors], "spec": str(tensors_spec),
            "machine": platform.machine(), "cpu_flags": _cpu_flags(),
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _load_or_build(self, key: str, leading, flat_leading, leading_spec, flat_tensors, tensors_spec):
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        package = folder / f"{key}.pt2"
        with _locked(folder / f"{key}.lock"):
            if package.is_file():
                CACHE_EVENTS["aot_hit"] += 1
            else:
                CACHE_EVENTS["aot_miss"] += 1
                self._build(package, leading, flat_leading, leading_spec, flat_tensors, tensors_spec)
        device = flat_tensors[0].device
        device_index = device.index if device.type == "cuda" and device.index is not None else -1
        return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)

    def _build(self, package: Path, leading, flat_leading, leading_spec, flat_tensors, tensors_spec) -> None:
        from torch._inductor import aoti_compile_and_package

        named = {"rows": torch.export.Dim("rows", min=2, max=MAX_PIXELS_PER_SIDE),
                 "cols": torch.export.Dim("cols", min=2, max=MAX_PIXELS_PER_SIDE)}
        dims = pixel_dims(leading, self.options)
        dynamic = tuple({dim: named[name] for dim, name in d.items()} or None for d in dims) \
            + tuple(None for _ in flat_tensors)
        module = _Exported(self.stage, self.options, self.grid_shape, leading_spec, tensors_spec)
        exported = torch.export.export(module, (*flat_leading, *flat_tensors), dynamic_shapes=(dynamic,),
                                       strict=False)
        partial = package.with_name(f"{package.stem}.partial-{os.getpid()}.pt2")
        with warnings.catch_warnings():
            # PyTorch's own packaging code trips its LeafSpec deprecation; nothing for a user to act on.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            aoti_compile_and_package(exported, package_path=str(partial),
                                     inductor_configs=dict(self.stage.inductor_options))
        os.replace(partial, package)


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
