"""Refine the detector distance and beam centre against an observed image, by gradient descent through nbsim.

    python docs/examples/refine_geometry.py [--pixels 64] [--steps 10]

The "observation" is nbsim's own image at the true geometry (distance 100 mm, beam centre 13 mm × 13 mm);
the refinement starts 2 mm and a pixel away and takes ten Adam steps on the mean squared difference.
Gradients flow through `SimulationConfig.with_options`: any scalar option given as a tensor with
`requires_grad=True` (distances, beam centre, angles, cell, wavelength, mosaic spread) is differentiable.
"""

from __future__ import annotations

import argparse

import torch

import nbsim
from nbsim.workloads import SEED_ARGS

TRUTH = {"distance_mm": 100.0, "beam_x_mm": 13.0, "beam_y_mm": 13.0}
START = {"distance_mm": 102.0, "beam_x_mm": 13.3, "beam_y_mm": 12.8}
LEARNING_RATES = {"distance_mm": 0.6, "beam_x_mm": 0.1, "beam_y_mm": 0.1}


def refine(pixels: int = 64, steps: int = 10) -> list[tuple[float, dict[str, float]]]:
    """(loss, parameters) after each step of a refinement from START towards TRUTH on a pixels² detector
    of 0.4 mm pixels (float64, eager: see docs/kernels.md on gradients)."""
    config = nbsim.config_from_args([*SEED_ARGS, "-detpixels", str(pixels), "-pixel", str(25.6 / pixels)])

    def render(**geometry) -> torch.Tensor:
        return nbsim.simulate(config.with_options(**geometry), dtype=torch.float64, compile="auto")

    with torch.no_grad():
        observed = render(**TRUTH)
    parameters = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in START.items()}
    optimizer = torch.optim.Adam([{"params": [p], "lr": LEARNING_RATES[n]} for n, p in parameters.items()])
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
    history = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((render(**parameters) - observed) ** 2).mean() / observed.var()
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append((loss.item(), {name: p.item() for name, p in parameters.items()}))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixels", type=int, default=64, help="detector pixels per side (default 64)")
    parser.add_argument("--steps", type=int, default=10, help="optimiser steps (default 10)")
    options = parser.parse_args()
    print("truth:", TRUTH)
    for step, (loss, values) in enumerate(refine(options.pixels, options.steps), 1):
        print(f"step {step:2d}  loss {loss:.3e}  " + "  ".join(f"{k} {v:.3f}" for k, v in values.items()))


if __name__ == "__main__":
    main()
