"""Compare single-step ahead-of-time kernel packages in one process: the seed image, same inputs.

Across processes this VM's speed moves by tens of per cent, so kernel changes of a few per cent are
measured here instead: every package renders the whole image `--renders` times per round, in
alternating order, and the medians and minima are printed with each image's largest difference from
the first package's.

    .venv/bin/python benchmarks/compare_kernels.py --dtype float64 OLD.pt2 NEW.pt2

Packages are the `.pt2` files of an nbsim kernel cache (`nbsim kernels list`), built from kernel
sources whose inputs match this checkout's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten
from workloads import SEED_ARGS

from nbsim.kernel.aot import open_package
from nbsim.nanobragg.arguments import parse
from nbsim.render import Renderer
from nbsim.resolve import resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", help="single-step pixel_kernel .pt2 packages")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--size", type=int, default=4096, help="detector pixels per side")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--renders", type=int, default=3, help="renders per package per round")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    setup = resolve(parse([*SEED_ARGS, "-detpixels", str(args.size)])[0])
    tensors = tree_flatten(Renderer(setup, dtype=dtype, compile="off").inputs.tensors)[0]
    rows, cols = (torch.arange(n, dtype=dtype) for n in setup.shape)
    images = {p: torch.empty(setup.shape, dtype=dtype) for p in args.packages}
    runners = {p: open_package(Path(p), torch.device("cpu")) for p in args.packages}
    for package, runner in runners.items():
        runner.run([images[package], rows, cols, *tensors])
    first = images[args.packages[0]]
    times: dict[str, list[float]] = {p: [] for p in args.packages}
    for round_index in range(args.rounds):
        order = args.packages if round_index % 2 == 0 else args.packages[::-1]
        for package in order:
            for _ in range(args.renders):
                start = time.perf_counter()
                runners[package].run([images[package], rows, cols, *tensors])
                times[package].append(time.perf_counter() - start)
    for package in args.packages:
        difference = float((images[package] - first).abs().max() / first.abs().max())
        print(f"{package}: median {statistics.median(times[package]):.4f} s, min {min(times[package]):.4f} s "
              f"over {len(times[package])} renders; max |diff| / max {difference:.2g}")


if __name__ == "__main__":
    main()
