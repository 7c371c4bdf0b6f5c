"""Refine the detector distance and beam centre against an observed image with your own PyTorch loop.

    python docs/examples/refine_geometry.py [--pixels 64] [--steps 30]

The "observation" is nbsim's own image at the true geometry (distance 100 mm, beam centre 13 mm × 13 mm);
the refinement starts 2 mm and a pixel away. `nbsim.fit.DiffractionModel` holds the resolved set-up once
and exposes the refinable quantities as its parameter (dimensionless: 0.01 mm steps for the distance,
0.005 mm for the beam centre), so each step re-renders only what the geometry changes. The loss is the
Poisson negative log-likelihood, its gradient by autograd, minimised by SciPy's L-BFGS-B (the optimiser
`nbsim fit` uses; any torch optimiser works on `model.parameters()` too).

In two stages, as `nbsim fit` does: the image samples each 0.4 mm pixel at one point of the crystal's
lattice factor, whose nodes are exact zeros, so the likelihood of that model has a wall wherever a node
crosses a pixel that holds counts (a local minimum every few tenths of a millimetre of distance). The first
stage renders each pixel as the mean over its area (`smooth_oversample`: a smooth likelihood, whose optimum
is a hundredth of a millimetre from the image's); the second starts there and samples the pixels as the
image was (`observed_oversample`), reaching the truth within the photon noise.
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.optimize
import torch

import nbsim
from nbsim.fit import DiffractionModel, negative_log_likelihood, observed_oversample, smooth_oversample, with_oversample
from nbsim.resolve import resolve

SEED_ARGS = "-default_F 100 -cell 100 100 100 90 90 90 -lambda 6.2 -N 5".split()
TRUTH = {"distance_mm": 100.0, "beam_x_mm": 13.0, "beam_y_mm": 13.0}
START = {"distance_mm": 102.0, "beam_x_mm": 13.3, "beam_y_mm": 12.8}


def refine(pixels: int = 64, steps: int = 30) -> list[tuple[float, dict[str, float]]]:
    """(loss, geometry) at each evaluation of at most `steps` L-BFGS iterations per stage from START towards
    TRUTH on a pixels² detector of 0.4 mm pixels (float64)."""
    detector = ["-detpixels", str(pixels), "-pixel", str(25.6 / pixels)]

    def geometry(values: dict[str, float]) -> list[str]:
        return ["-distance", str(values["distance_mm"]), "-Xbeam", str(values["beam_x_mm"]),
                "-Ybeam", str(values["beam_y_mm"])]

    truth = nbsim.config_from_args([*SEED_ARGS, *detector, *geometry(TRUTH)])
    observed = torch.as_tensor(np.random.default_rng(1).poisson(
        nbsim.simulate(truth, dtype=torch.float64, compile="off").numpy() * 100.0).reshape(-1) / 100.0)
    rows, cols = np.divmod(np.arange(pixels * pixels), pixels)
    start = resolve(nbsim.config_from_args([*SEED_ARGS, *detector, *geometry(START)]))
    history = []

    def minimise(setup) -> DiffractionModel:
        model = DiffractionModel([setup], [(rows, cols)], refine=["distance", "beam"])

        def loss_and_gradient(point: np.ndarray) -> tuple[float, np.ndarray]:
            internal = torch.as_tensor(point).requires_grad_(True)
            loss = negative_log_likelihood(model(internal)[0], observed, readout_photons=0.0)
            gradient = torch.autograd.grad(loss, internal)[0]
            values = model.natural(internal.detach())[0]
            history.append((float(loss.detach()), {"distance_mm": float(values["distance"][0]),
                                                   "beam_x_mm": float(values["beam"][0]),
                                                   "beam_y_mm": float(values["beam"][1])}))
            return float(loss.detach()), gradient.numpy()

        found = scipy.optimize.minimize(loss_and_gradient, np.zeros(model.size), jac=True, method="L-BFGS-B",
                                        options={"maxiter": steps})
        with torch.no_grad():
            model.internal.copy_(torch.as_tensor(found.x))
        return model

    searched = minimise(with_oversample(start, smooth_oversample(start))).refined_setups()[0]
    minimise(with_oversample(searched, observed_oversample(searched)))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixels", type=int, default=64, help="detector pixels per side (default 64)")
    parser.add_argument("--steps", type=int, default=30, help="most L-BFGS iterations per stage (default 30)")
    options = parser.parse_args()
    print("truth:", TRUTH)
    for step, (loss, values) in enumerate(refine(options.pixels, options.steps), 1):
        print(f"evaluation {step:2d}  -logL {loss:.8e}  " + "  ".join(f"{k} {v:.4f}" for k, v in values.items()))


if __name__ == "__main__":
    main()
