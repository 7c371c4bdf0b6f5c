"""Measure the effect of each known defect of nanoBragg's physics, as docs/physics.md's table gives it: nbsim's
default physics (the C's image) against -physics corrected, on a small crystal (64×64 pixels, float64, eager).

    PYTHONPATH=. .venv/bin/python benchmarks/physics_defects.py
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nbsim.model.crystal import build_lattice
from nbsim.nanobragg import parse
from nbsim.render import Renderer
from nbsim.resolve import resolve
from nbsim.rng import Ran1

CRYSTAL = "-cell 50 60 70 90 90 90 -default_F 10 -N 3 -lambda 1 -distance 100 -detpixels 64 -pixel 0.1".split()


def image(extra: list[str], threads: int = 2) -> np.ndarray:
    setup = resolve(parse(CRYSTAL + extra)[0])
    return Renderer(setup, dtype=torch.float64, compile="off", reference_threads=threads)().numpy()


def water(extra: list[str]) -> float:
    """Mean water background of a 3 µm droplet (the image with it minus the image without)."""
    return float((image(extra + ["-water", "3"]) - image(extra)).mean())


def misset_random_angle_deg(corrected: bool) -> float:
    config = parse(CRYSTAL + ["-misset_seed", "5", "-misset", "random"])[0]
    unrotated = build_lattice(parse(CRYSTAL)[0].crystal, 1.0, Ran1())
    rotation = torch.linalg.solve(unrotated.real_A.T, build_lattice(config.crystal, 1.0, Ran1(), corrected).real_A.T)
    return math.degrees(math.acos((float(torch.trace(rotation)) - 1) / 2))


def main() -> None:
    for physics in ("nanobragg", "corrected"):
        switch = ["-physics", physics]
        base = water(switch + ["-fluence", "4e26"])
        print(f"{physics}: water mean {base:.6g} photons at fluence 4e26; x100 fluence: "
              f"x{water(switch + ['-fluence', '4e28']) / base:.6g}; -oversample 3: "
              f"x{water(switch + ['-fluence', '4e26', '-oversample', '3']) / base:.6g}; -mosaic_dom 4: "
              f"x{water(switch + ['-fluence', '4e26', '-mosaic_dom', '4', '-mosaic', '0.5']) / base:.6g}")
        phi = switch + ["-phi", "0", "-osc", "0.5", "-phisteps", "2"]
        one, two = image(phi, 1), image(phi, 2)
        differ = np.abs(one - two)
        print(f"{physics}: phi = 0, 1 against 2 threads: {int((differ > 0).sum())} pixel(s) differ, largest relative "
              f"{float((differ / one).max()):.3g}")
        angle = misset_random_angle_deg(physics == "corrected")
        print(f"{physics}: -misset random -misset_seed 5 rotates by {angle:.4g} degrees")
    # -detector_abs 100: nanoBragg's attenuation depth (the thickness) under both physics settings (-physics
    # corrected would take silicon's at λ), so that the ratio is the defect's alone
    sensor = ["-detector_thick", "100", "-detector_abs", "100", "-detector_thicksteps"]
    for flags in (["-oversample_omega"], ["-oversample_polar"], ["-oversample_thick", *sensor, "3"],
                  ["-oversample_thick", *sensor, "10"]):
        switches = [flag for flag in flags if flag.startswith("-oversample_")]
        base = ["-oversample", "2"] + [flag for flag in flags if flag not in switches]
        corrected = image(base + ["-physics", "corrected"] + switches).mean()
        print(f"{' '.join(flags)}: the C's mean / corrected mean = {image(base + switches).mean() / corrected:.4g}; "
              f"corrected / without the flag = {corrected / image(base + ['-physics', 'corrected']).mean():.7g}")


if __name__ == "__main__":
    main()
