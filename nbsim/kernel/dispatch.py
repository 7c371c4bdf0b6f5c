"""Running a stage pipeline in a mode: eagerly, just-in-time (nbsim.kernel.jit) or ahead of time
(nbsim.kernel.aot), behind one callable per pipeline (`kernel_callable`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..modes import Mode
from .aot import AotStage
from .cache import KernelCache, KernelLoads
from .inputs import KernelOptions
from .jit import jit_stage
from .stages import Stage, StageVariant

KernelCall = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], None]


def kernel_callable(stages: tuple[Stage, ...], options: KernelOptions, mode: Mode, cache: KernelCache,
                    loads: KernelLoads) -> KernelCall:
    """A callable (rows, cols, tensors, out) that runs the stages in `mode` and writes the last stage's
    (rows, cols) values into `out`; ahead-of-time packages come from `cache`, counted in `loads`.

    An ahead-of-time CPU kernel writes straight into `out` when it is a contiguous block of image
    rows, so a tile needs no freshly allocated result and no copy; otherwise (and in the other modes)
    the tile is computed apart and copied in.
    """
    writes_out = mode is Mode.AOT
    runners = [_runner(variant, mode, cache, loads) for variant in StageVariant.of_pipeline(stages, options)]

    def call(rows: torch.Tensor, cols: torch.Tensor, tensors, out: torch.Tensor) -> None:
        n_rows, n_cols = len(rows), len(cols)
        if mode is not Mode.EAGER:
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


def _runner(variant: StageVariant, mode: Mode, cache: KernelCache, loads: KernelLoads) -> Callable:
    if mode is Mode.EAGER:
        return lambda leading, tensors: variant.stage.function(*leading, tensors, options=variant.options)
    if mode is Mode.JIT:
        return jit_stage(variant)
    return AotStage(variant, cache, loads)


def _at_least_two(index: torch.Tensor) -> torch.Tensor:
    """Compiled kernels take at least two rows/columns (a traced size of 1 would be specialised); a
    single one is repeated and the extra output cut off again."""
    return index if len(index) >= 2 else index.repeat(2)
