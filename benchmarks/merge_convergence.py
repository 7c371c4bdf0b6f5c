"""`nbsim merge` from a poor start (docs/merging.md, "Measured"): small stills of a random-|F| crystal, a start
far from the truth and each shot's starting model off, then the merge's command line with `--truth` and
`--report`, so CC(|F|, truth) by cycle is what the command prints.

    python benchmarks/merge_convergence.py FOLDER [--shots 20] [--seed 3] [--mosaic DEG] [--run]
        [-- extra nbsim merge options]

The crystal: P2₁2₁2₁, 20 × 24 × 28 Å, |F| drawn from a Rayleigh distribution (σ 100, + 5) to 2 Å; the start
|F|·exp(0.6·𝒩) (CC about 0.55 with the truth). Stills: 64 × 64 pixels of 0.1 mm at 14 mm (to about 3 Å), λ 1 Å,
N 10, random orientations, Poisson counts. Each shot's start: its misset 0.1° off (a random axis) and each cell
length 0.5 % off (a random sign). With `--mosaic DEG` the crystal has that mosaic spread (8 domains), each
shot starts at half of it and the merge refines it too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CELL = (20.0, 24.0, 28.0, 90.0, 90.0, 90.0)
GROUP = "P 21 21 21"
FLAGS = ("-cell 20 24 28 90 90 90 -N 10 -lambda 1 -distance 14 -detpixels 64 -pixel 0.1 -nointerpolate "
         "-fluence 1e27 -oversample 1").split()
MISSET_OFF_DEG = 0.1
CELL_OFF = 0.005
MOSAIC_DOMAINS = 8
MOSAIC_START_SHARE = 0.5
"""With --mosaic: the domains of every still and model, and each shot's start as a share of the true spread."""


def mosaic_flags(mosaic_deg: float) -> list[str]:
    """The flags every still and model shares for a crystal of `mosaic_deg` spread (none without one)."""
    return ["-mosaic_dom", str(MOSAIC_DOMAINS)] if mosaic_deg > 0 else []


def write_dataset(folder: Path, shots: int, seed: int, mosaic_deg: float = 0.0) -> list[str]:
    """The truth, the start, the stills and their starts (starts.json) in `folder`; the stills' paths."""
    import gemmi
    import torch

    import nbsim
    from nbsim.io.structure_files import expand_to_p1_sphere, write_hkl
    from nbsim.merge.reflections import space_group

    folder.mkdir(parents=True, exist_ok=True)
    group = space_group(GROUP)
    miller = np.asarray(gemmi.make_miller_array(gemmi.UnitCell(*CELL), group, 2.0, 0, True), np.int64)
    rng = np.random.default_rng(1)
    truth = rng.rayleigh(100, len(miller)) + 5
    start = truth * np.exp(0.6 * rng.standard_normal(len(miller)))
    write_hkl(folder / "truth.hkl", expand_to_p1_sphere(miller, truth, None, group))
    write_hkl(folder / "start.hkl", expand_to_p1_sphere(miller, start, None, group))
    print(f"CC(start, truth) {np.corrcoef(start, truth)[0, 1]:.4f} over {len(miller)} unique reflections")
    rng = np.random.default_rng(seed)
    starts, paths = {}, []
    for index in range(shots):
        misset = rng.uniform(-180, 180, 3).round(3)
        spread = ["-mosaic", str(mosaic_deg)] if mosaic_deg > 0 else []
        config = nbsim.config_from_args([*FLAGS, *mosaic_flags(mosaic_deg), *spread, "-hkl", str(folder / "truth.hkl"),
                                         "-misset", *map(str, misset)])
        with torch.no_grad():
            image = rng.poisson(nbsim.simulate(config).double().numpy()).astype(np.float32)
        path = folder / f"shot{index}.bin"
        image.tofile(path)
        direction = rng.standard_normal(3)
        direction /= np.linalg.norm(direction)
        lengths = np.asarray(CELL[:3]) * (1 + CELL_OFF * rng.choice([-1, 1], 3))
        starts[str(path)] = {"misset": (misset + MISSET_OFF_DEG * direction).round(4).tolist(),
                             "cell": [*lengths.round(4).tolist(), 90, 90, 90]}
        if mosaic_deg > 0:
            starts[str(path)]["mosaic"] = MOSAIC_START_SHARE * mosaic_deg
        paths.append(str(path))
    (folder / "starts.json").write_text(json.dumps({"images": starts}, indent=1))
    return paths


def merge_command(folder: Path, paths: list[str], extra: list[str], mosaic_deg: float = 0.0) -> list[str]:
    """The nbsim merge command line of the contract, with the truth and the report."""
    refine = "orientation,cell,N,scale" + (",mosaic" if mosaic_deg > 0 else "")
    return [str(REPO / ".venv" / "bin" / "nbsim"), "merge", *paths, "--starts", str(folder / "starts.json"),
            "--hkl", str(folder / "start.hkl"), "--space_group", GROUP.replace(" ", ""),
            "--refine", refine, "--mtz", str(folder / "merged.mtz"),
            "--json", str(folder / "shots.json"), "--truth", str(folder / "truth.hkl"),
            "--report", str(folder / "report.html"), "--shoebox", "5", "--spots", "40", *extra, "--", *FLAGS,
            *mosaic_flags(mosaic_deg)]


def main(argv: list[str]) -> int:
    own, _, extra = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv else (argv, None, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shots", type=int, default=20)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--mosaic", type=float, default=0.0, help="the crystal's mosaic spread, degrees (refined)")
    parser.add_argument("--run", action="store_true", help="run the merge too")
    options = parser.parse_args(own)
    paths = write_dataset(options.folder, options.shots, options.seed, options.mosaic)
    command = merge_command(options.folder, paths, extra, options.mosaic)
    print(" ".join(command))
    return subprocess.call(command) if options.run else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
