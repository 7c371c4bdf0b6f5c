"""Just-in-time kernels: one `torch.compile` per stage variant, in memory for the process.

Differentiable and device-agnostic (the compiled back-end for gradients and GPUs); a new process pays
Dynamo tracing and Inductor's cache lookup (seconds) before the first call. Inductor's cache folder is
its own (TORCHINDUCTOR_CACHE_DIR; see nbsim.kernel.aot for why the library leaves it alone).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from .inputs import input_dims
from .stages import StageVariant, dynamic_shape_config


@functools.cache
def jit_stage(variant: StageVariant) -> Callable:
    """torch.compile of one stage with every count dynamic (tile rows and columns, sub-steps, sources,
    orientations, table length); the callable takes (leading inputs, tensors).

    Python floats in the kernel are constants (physics parameters arrive as tensors), so Dynamo
    specialises on them instead of re-tracing to turn them into tensors; duck shaping is off so equal
    counts are not tied together, and sizes are size-oblivious so a count of 1 is not specialised.
    """
    stage, options = variant.stage, variant.options
    compiled = torch.compile(functools.partial(stage.function, options=options), dynamic=False,
                             options=dict(stage.inductor_options))
    dims = stage.leading_dims(options) + input_dims(stage.single_step)

    def call(leading: tuple, tensors):
        flat = tree_flatten(leading)[0] + tree_flatten(tensors)[0]
        for tensor, named in zip(flat, dims, strict=True):
            for dim in named:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True):
            return compiled(*leading, tensors)

    return call
