"""Just-in-time kernels: one `torch.compile` per stage variant, in memory for the process.

Differentiable and device-agnostic (the compiled back-end for gradients and GPUs); a new process pays
Dynamo tracing and Inductor's cache lookup (seconds) before the first call. Inductor's cache folder is
its own (TORCHINDUCTOR_CACHE_DIR; see nbsim.kernel.aot for why the library leaves it alone).

`warm_stages` compiles a structure's stages once on example inputs, so that Inductor's on-disk caches hold
their code and another process's first render of that structure loads it instead of compiling (the sweep's
kernel jobs do this before its timed jobs; docs/kernels.md). Inductor parallelises a CPU stage's loops for
the thread count torch runs while it compiles, and its cache key does not hold that count; so a CPU stage is
compiled with the count as an Inductor option (`cpp.threads`, the same code), which puts it in the key: code
compiled by a one-thread process is never what a sixteen-thread process loads.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from ..devices import dtype_name, resolve_dtype
from .cache import child_command
from .inputs import example_tensors, input_dims
from .stages import StageVariant, Structure, dynamic_shape_config


@functools.cache
def jit_stage(variant: StageVariant) -> Callable:
    """torch.compile of one stage with every count dynamic (tile rows and columns, sub-steps, sources,
    orientations, table length); the callable takes (leading inputs, tensors).

    Python floats in the kernel are constants (physics parameters arrive as tensors), so Dynamo
    specialises on them instead of re-tracing to turn them into tensors; duck shaping is off so equal
    counts are not tied together, and sizes are size-oblivious so a count of 1 is not specialised.
    One compiled function per device type and CPU thread count (`device_options`).
    """
    stage, options = variant.stage, variant.options
    function = functools.partial(stage.function, options=options)
    compiled: dict[tuple, Callable] = {}
    dims = stage.leading_dims(options) + input_dims(stage.single_step)

    def call(leading: tuple, tensors):
        flat = tree_flatten(leading)[0] + tree_flatten(tensors)[0]
        for tensor, named in zip(flat, dims, strict=True):
            for dim in named:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        extra = device_options(flat[0].device)
        if extra not in compiled:
            compiled[extra] = torch.compile(function, dynamic=False, options=dict(stage.inductor_options + extra))
        with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True):
            return compiled[extra](*leading, tensors)

    return call


def device_options(device: torch.device) -> tuple[tuple[str, object], ...]:
    """Inductor options a stage's compiled code depends on besides its own: on the CPU, the thread count
    Inductor parallelises its loops for (what it takes when unset, now part of its cache key)."""
    return (("cpp.threads", torch.get_num_threads()),) if device.type == "cpu" else ()


def warm_stages(variants: list[StageVariant], dtype: torch.dtype, device: torch.device) -> list[float]:
    """Compile each variant just in time (`jit_stage`) and run it once on example inputs, so that Inductor's
    on-disk caches hold its code; the seconds each took. Run it with the thread count of the processes that
    will load the code (`device_options`)."""
    from .aot import example_leading

    seconds = []
    for variant in variants:
        started = time.perf_counter()
        tensors = example_tensors(dtype, device, variant.stage.single_step)
        jit_stage(variant)(example_leading(variant.stage, variant.options, tensors), tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def start_warming(structure: Structure, dtype: torch.dtype, device: torch.device, threads: int,
                  output: Path) -> subprocess.Popen:
    """A child process that runs `warm_stages` on every stage variant of `structure` with `threads` torch
    threads, its output into the file `output`, whose last line is then the seconds each variant took (a JSON
    list)."""
    spec = {"structure": structure.to_json(), "dtype": dtype_name(dtype), "device": str(device), "threads": threads}
    with open(output, "w") as stream:
        return subprocess.Popen(child_command("nbsim.kernel.jit", spec), stdin=subprocess.DEVNULL, stdout=stream,
                                stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    """The warming child process (`start_warming`)."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    torch.set_num_threads(spec["threads"])
    seconds = warm_stages(Structure.from_json(spec["structure"]).stage_variants(), resolve_dtype(spec["dtype"]),
                          torch.device(spec["device"]))
    print(json.dumps(seconds), flush=True)
    return 0
