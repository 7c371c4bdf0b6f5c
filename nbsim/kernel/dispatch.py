"""Running a stage pipeline in a mode: eagerly, just-in-time (nbsim.kernel.jit) or ahead of time
(nbsim.kernel.aot), behind one callable per pipeline (`kernel_callable`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

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
    the tile is computed apart and copied in. A tile whose inputs carry gradients is computed under
    `torch.utils.checkpoint`: its backward recomputes the tile's steps instead of holding every tile's
    pixel-step intermediates until the image's backward, so memory stays that of one tile.

    An ahead-of-time stage whose package cannot be used on this machine (nbsim.kernel.aot.verify_package)
    runs just in time instead, with a warning line in `loads.unusable`.
    """
    writes_out = mode is Mode.AOT
    runners = [_runner(variant, mode, cache, loads) for variant in StageVariant.of_pipeline(stages, options)]

    def leading_of(rows: torch.Tensor, cols: torch.Tensor, tensors) -> tuple:
        leading = (rows, cols)
        for runner in runners[:-1]:
            leading = (runner(leading, tensors),)
        return leading

    def tile(rows: torch.Tensor, cols: torch.Tensor, tensors) -> torch.Tensor:
        return runners[-1](leading_of(rows, cols, tensors), tensors)

    def call(rows: torch.Tensor, cols: torch.Tensor, tensors, out: torch.Tensor) -> None:
        n_rows, n_cols = len(rows), len(cols)
        if mode is not Mode.EAGER:
            rows, cols = _at_least_two(rows), _at_least_two(cols)
        if not writes_out:
            if carries_grad(tensors):
                values = checkpoint(tile, rows, cols, tensors, use_reentrant=False)
            else:
                values = tile(rows, cols, tensors)
            out.copy_(values[:n_rows, :n_cols])
            return
        leading = leading_of(rows, cols, tensors)
        direct = out.device.type == "cpu" and out.is_contiguous() and (len(rows), len(cols)) == (n_rows, n_cols)
        target = out if direct else out.new_empty((len(rows), len(cols)))
        runners[-1]((target, *leading), tensors)
        if target is not out:
            out.copy_(target[:n_rows, :n_cols])

    return call


def carries_grad(tensors) -> bool:
    """Does a render with these kernel tensors build an autograd graph?"""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tree_flatten(tensors)[0])


def _runner(variant: StageVariant, mode: Mode, cache: KernelCache, loads: KernelLoads) -> Callable:
    if mode is Mode.EAGER:
        return lambda leading, tensors: variant.stage.function(*leading, tensors, options=variant.options)
    if mode is Mode.JIT:
        return jit_stage(variant)
    return AotStage(variant, cache, loads, fallback=jit_stage)


def _at_least_two(index: torch.Tensor) -> torch.Tensor:
    """Compiled kernels take at least two rows/columns (a traced size of 1 would be specialised); a
    single one is repeated and the extra output cut off again."""
    return index if len(index) >= 2 else index.repeat(2)
