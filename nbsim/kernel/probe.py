"""The probe process: opens one ahead-of-time package and runs it once on small example inputs, so that a
package whose loading crashes this machine's PyTorch (SIGSEGV inside its loader on two lent Intel Xeon
machines, docs/benchmarks.md) ends this short process rather than a render.

    python -m nbsim.kernel.probe SPEC

SPEC is the JSON nbsim.kernel.aot.probe_package writes (package, stage, options, writes_out, dtype,
device). The process prints `opening` before it opens the package, `opened` once it is open and `ran` once
it has run; probe_package reads how far it came and how it ended, and stamps the verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from ..devices import resolve_dtype
from .aot import OPENED, OPENING, RAN, example_leading, open_package
from .inputs import KernelOptions, example_tensors
from .stages import OUT_OF_RANGE_STAGES, PIXEL_STAGES, SINGLE_STEP_STAGES, StageVariant

PROBE_PIXELS = (2, 16)
"""Rows and columns of the probe's tile: the smallest a compiled stage takes, and a few vectors wide."""


def probe_inputs(variant: StageVariant, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The flat inputs of a PROBE_PIXELS tile for the variant's package (values irrelevant, as in a build)."""
    tensors = example_tensors(dtype, device, variant.stage.single_step)
    leading = example_leading(variant.stage, variant.options, tensors, *PROBE_PIXELS)
    if variant.writes_out:  # the image tile it writes into, made as a build makes it (eagerly: a small tile)
        out = variant.stage.function(*leading, tensors, options=variant.options)
        leading = (torch.empty_like(out), *leading)
    return tree_flatten(leading)[0] + tree_flatten(tensors)[0]


def main(argv: list[str] | None = None) -> int:
    """Open and run the package SPEC names (see the module docstring)."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    stages = {stage.name: stage for stage in (*PIXEL_STAGES, *SINGLE_STEP_STAGES, *OUT_OF_RANGE_STAGES)}
    variant = StageVariant(stages[spec["stage"]], KernelOptions(**spec["options"]), spec["writes_out"])
    device = torch.device(spec["device"])
    inputs = probe_inputs(variant, resolve_dtype(spec["dtype"]), device)
    print(OPENING, flush=True)
    runner = open_package(Path(spec["package"]), device)
    print(OPENED, flush=True)
    runner.run(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(RAN, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
