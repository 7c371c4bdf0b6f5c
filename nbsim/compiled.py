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
                    mode: str) -> Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], None]:
    """A callable (rows, cols, tensors, out) that runs the stages in the requested mode and writes
    the last stage's (rows, cols) values into `out`.

    An ahead-of-time CPU kernel writes straight into `out` when it is a contiguous block of image
    rows, so a tile needs no freshly allocated result and no copy; otherwise (and in the other modes)
    the tile is computed apart and copied in.
    """
    writes_out = mode == "aot"
    runners = [_runner(stage, options, grid_shape, mode, writes_out=writes_out and index == len(stages) - 1)
               for index, stage in enumerate(stages)]

    def call(rows: torch.Tensor, cols: torch.Tensor, tensors, out: torch.Tensor) -> None:
        n_rows, n_cols = len(rows), len(cols)
        if mode != "eager":
            rows, cols = _at_least_two(rows), _at_least_two(cols)
        leading = (rows, cols)
        for runner in runners[:-1]:
            leading = (runner(leading, tensors),)
        if not writes_out:
            out.copy_(runners[-1](leading, tensors)[:n_rows, :n_cols])
            return
        direct = out.device.type == "cpu" and out.is_contiguous() and (len(rows), len(cols)) == (n_rows, n_cols)
        target = out if direct else out.new_empty((len(rows), len(cols)))
        runners[-1]((target, *leading), tensors)
        if target is not out:
            out.copy_(target[:n_rows, :n_cols])

    return call


def _runner(stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int], mode: str, writes_out: bool):
    if mode == "eager":
        return lambda leading, tensors: stage.function(*leading, tensors, grid_shape=grid_shape, options=options)
    if mode == "jit":
        return _jit(stage, options, grid_shape)
    return _aot(stage, options, grid_shape, writes_out)


def _write_into(function: Callable, out: torch.Tensor, *arguments, **keywords) -> None:
    """The stage function writing its value into `out` (what an ahead-of-time package runs)."""
    out.copy_(function(*arguments, **keywords))


def _leading_dims(leading: tuple, options: KernelOptions, writes_out: bool) -> list[dict[int, str]]:
    """pixel_dims of a runner's leading inputs, `out` (rows, cols) first when the stage writes into it."""
    if writes_out:
        return [{0: "rows", 1: "cols"}, *pixel_dims(leading[1:], options)]
    return pixel_dims(leading, options)


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
def _aot(stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int], writes_out: bool) -> AotStage:
    return AotStage(stage, options, grid_shape, writes_out)


class _Exported(torch.nn.Module):
    """A stage with flat tensor inputs, as torch.export needs."""

    def __init__(self, function: Callable, options: KernelOptions, grid_shape, leading_spec, tensors_spec):
        super().__init__()
        self.function, self.options, self.grid_shape = function, options, grid_shape
        self.leading_spec, self.tensors_spec = leading_spec, tensors_spec
        self.leading_count = leading_spec.num_leaves

    def forward(self, *flat):
        leading = tree_unflatten(list(flat[:self.leading_count]), self.leading_spec)
        tensors = tree_unflatten(list(flat[self.leading_count:]), self.tensors_spec)
        result = self.function(*leading, tensors, grid_shape=self.grid_shape, options=self.options)
        return () if result is None else tuple(result) if isinstance(result, tuple) else result


class AotStage:
    """Loads (or builds once, under a file lock) the AOTInductor package of one stage variant."""

    def __init__(self, stage: Stage, options: KernelOptions, grid_shape: tuple[int, int, int], writes_out: bool):
        self.stage, self.options, self.grid_shape, self.writes_out = stage, options, grid_shape, writes_out
        self._runners: dict[tuple, object] = {}
        self._flat_tensors: tuple = (None, [], None, ())

    def __call__(self, leading: tuple, tensors):
        flat_leading, leading_spec = tree_flatten(leading)
        flat_tensors, tensors_spec, tensors_signature = self._flatten_tensors(tensors)
        dims = _leading_dims(leading, self.options, self.writes_out)
        static_leading = tuple(tuple(size if dim not in d else None for dim, size in enumerate(t.shape))
                               for t, d in zip(flat_leading, dims, strict=True))
        runner = self._runners.get((static_leading, tensors_signature))
        if runner is None:
            key = self._key(static_leading, flat_tensors, tensors_spec)
            runner = self._runners[static_leading, tensors_signature] = self._load_or_build(
                key, dims, flat_leading, leading_spec, flat_tensors, tensors_spec)
        outputs = runner.run([*flat_leading, *flat_tensors])
        if self.writes_out:
            return None
        return self.stage.output(*outputs) if self.stage.output is not None else outputs[0]

    def _flatten_tensors(self, tensors) -> tuple[list, object, tuple]:
        """The shared inputs flattened, with their shapes, dtypes and devices; remembered for the
        last `tensors` seen, since a renderer passes the same ones to every tile."""
        if self._flat_tensors[0] is not tensors:
            flat, spec = tree_flatten(tensors)
            signature = tuple((tuple(t.shape), t.dtype, t.device) for t in flat)
            self._flat_tensors = (tensors, flat, spec, signature)
        return self._flat_tensors[1:]

    def _key(self, static_leading: tuple, flat_tensors, tensors_spec) -> str:
        description = {
            "nbsim": __version__, "torch": torch.__version__, "stage": self.stage.function.__qualname__,
            "writes_out": self.writes_out, "inductor": repr(self.stage.inductor_options), "source": _source_digest(),
            "options": repr(self.options), "grid_shape": self.grid_shape, "dtype": str(flat_tensors[0].dtype),
            "device": flat_tensors[0].device.type, "leading": static_leading,
            "shapes": [list(t.shape) for t in flat_tensors], "spec": str(tensors_spec),
            "machine": platform.machine(), "cpu_flags": _cpu_flags(),
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _load_or_build(self, key: str, dims, flat_leading, leading_spec, flat_tensors, tensors_spec):
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        package = folder / f"{key}.pt2"
        with _locked(folder / f"{key}.lock"):
            if package.is_file():
                CACHE_EVENTS["aot_hit"] += 1
            else:
                CACHE_EVENTS["aot_miss"] += 1
                self._build(package, dims, flat_leading, leading_spec, flat_tensors, tensors_spec)
        device = flat_tensors[0].device
        device_index = device.index if device.type == "cuda" and device.index is not None else -1
        return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)

    def _build(self, package: Path, dims, flat_leading, leading_spec, flat_tensors, tensors_spec) -> None:
        from torch._inductor import aoti_compile_and_package

        named = {"rows": torch.export.Dim("rows", min=2, max=MAX_PIXELS_PER_SIDE),
                 "cols": torch.export.Dim("cols", min=2, max=MAX_PIXELS_PER_SIDE)}
        dynamic = tuple({dim: named[name] for dim, name in d.items()} or None for d in dims) \
            + tuple(None for _ in flat_tensors)
        function = functools.partial(_write_into, self.stage.function) if self.writes_out else self.stage.function
        module = _Exported(function, self.options, self.grid_shape, leading_spec, tensors_spec)
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
