"""The DIALS loop on a tiled detector (issue 39; docs/fitting.md, "DIALS in and out: tiled detectors"): nbsim
renders stills on a detector of four modules, two of them displaced from the nominal layout; Debian's DIALS 3.12
imports them with the nominal layout (`reference_geometry`), finds their spots and indexes them; `nbsim fit
--expt --refl --refine ...,panels --expt-out` refines the crystals and the modules from DIALS's models and
writes them back; `dials.ssx_integrate` integrates with nbsim's models (and, for comparison, with DIALS's).

    python benchmarks/dials_panels.py --out DIR

prints, as JSON, each module's error against the truth (the centre's distance, µm, and the angle of the
residual turn, degrees) at the start and after the fit, each still's orientation error and cell lengths
(DIALS's and nbsim's), and what each integration gave (reflections, RMS distance of the predicted from the
observed centroids, mean I/σ). Every command's log stays in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if __package__:
    from .dials_workloads import REPO, DialsError, dials_available, run_program
else:
    from dials_workloads import REPO, DialsError, dials_available, run_program

MODULE_PX, PIXEL_MM, GAP_MM, DISTANCE_MM = 128, 0.2, 1.0, 80.0
"""Four modules of 128 × 128 pixels of 0.2 mm in 2 × 2, 1 mm apart, 80 mm from the sample, the beam through
the gap between them."""
MOVES = {"m1": ((0.0, 0.06, -0.08), (0.1, 0.0, 0.0)), "m2": ((0.05, -0.04, 0.03), (0.0, 0.05, -0.05))}
"""The truth's modules that are not where the nominal layout has them: shift (mm) and rotation vector (degrees)
about the module's centre, nanoBragg's frame (x along the beam, y up); m0 and m3 are where it has them."""
MISSETS = ("10 20 30", "-40 65 5", "70 -15 120")
"""The stills' orientations (-misset, degrees)."""
CRYSTAL = ["-cell", "40", "50", "60", "90", "90", "90", "-default_F", "100", "-N", "10", "-lambda", "1",
           "-oversample", "1", "-flux", "1e19", "-scale", "1", "-nonoise"]
"""The stills: the single-panel loop's crystal and beam (docs/fitting.md), their counts the noise-free photons
(-scale 1 -nonoise; as measured, before multi-panel detectors had a noise image)."""
DIALS_STEPS = [
    ["dials.import", "nominal.nxs", "output.experiments=nominal.expt"],
    ["dials.import", *(f"still_{shot}.nxs" for shot in range(1, len(MISSETS) + 1)),
     "reference_geometry=nominal.expt", "convert_sequences_to_stills=True"],
    ["dials.find_spots", "imported.expt", "nproc=1", "min_spot_size=1"],
    ["dials.index", "imported.expt", "strong.refl", "stills.indexer=sequences", "joint_indexing=False",
     "unit_cell=40,50,60,90,90,90", "space_group=P222", "detector.fix=all", "beam.fix=all",
     "indexing.method=real_space_grid_search", "basis_vector_combinations.max_combinations=20"],
]
FIT = ["fit", "--expt", "indexed.expt", "--refl", "indexed.refl", "--refine", "orientation,cell,N,scale,panels",
       "--shared", "panels", "--expt-out", "refined.expt", "--panels-out", "refined.yaml", "--json", "fit.json",
       "--spots", "80", "--", "-default_F", "100", "-N", "7", "-oversample", "1"]
INTEGRATE = [
    ["dials.filter_reflections", "indexed.refl", "flag_expression=indexed", "output.reflections=indexed_only.refl"],
    ["dials.ssx_integrate", "refined.expt", "indexed_only.refl", "nproc=1", "algorithm=stills"],
]
METRICS = """
import json, math, sys
from dials.array_family import flex
table = flex.reflection_table.from_file(sys.argv[1])
result = {}
for experiment in sorted(set(table["id"])):
    rows = table.select(table["id"] == experiment)
    observed = rows.select(rows["xyzobs.px.value"].norms() > 0)
    x_obs, y_obs, _ = observed["xyzobs.px.value"].parts()
    x_cal, y_cal, _ = observed["xyzcal.px"].parts()
    variance = rows["intensity.sum.variance"]
    good = variance > 0
    ratio = rows["intensity.sum.value"].select(good) / flex.sqrt(variance.select(good))
    result[str(experiment)] = {"reflections": len(rows),
                               "rms_px": math.sqrt(flex.mean(flex.pow2(x_obs - x_cal) + flex.pow2(y_obs - y_cal))),
                               "mean_i_over_sigma": flex.mean(ratio)}
print(json.dumps(result))
"""
"""Run by cctbx.python on an integrated table: each experiment's reflections, the RMS distance (px) of the
predicted centroids from the observed ones, and the mean I/σ of the summed intensities."""


def layout(moves: dict | None = None) -> list[dict]:
    """The four modules (nbsim's YAML panel entries, nanoBragg's frame: fast along +z, slow along -y), each one
    that `moves` names shifted and turned about its centre."""
    from scipy.spatial.transform import Rotation

    extent = MODULE_PX * PIXEL_MM
    panels = []
    for index in range(4):
        row, column = divmod(index, 2)
        fast, slow = np.array([0.0, 0.0, 1.0]), np.array([0.0, -1.0, 0.0])
        corner = np.array([DISTANCE_MM, extent + GAP_MM / 2 - row * (extent + GAP_MM),
                           -extent - GAP_MM / 2 + column * (extent + GAP_MM)])
        name = f"m{index}"
        if moves and name in moves:
            shift, rotation_deg = (np.array(v, dtype=np.float64) for v in moves[name])
            turn = Rotation.from_rotvec(np.radians(rotation_deg)).as_matrix()
            centre = corner + extent / 2 * (fast + slow)
            corner, fast, slow = centre + shift + turn @ (corner - centre), turn @ fast, turn @ slow
        panels.append({"name": name, "pixels": [MODULE_PX, MODULE_PX], "pixel_mm": PIXEL_MM,
                       "fdet": fast.tolist(), "sdet": slow.tolist(), "pix0_mm": corner.tolist()})
    return panels


def _nbsim(arguments: list[str], folder: Path, log: str) -> float:
    """One nbsim command of this checkout, in `folder` (its output in folder/LOG); its seconds."""
    started = time.perf_counter()
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "nbsim.cli", *arguments], cwd=folder, capture_output=True,
                          text=True, env=environment)
    (folder / log).write_text(done.stdout + done.stderr)
    if done.returncode not in (0, 3):
        raise DialsError(f"nbsim {arguments[0]} failed (log: {folder / log}): {done.stderr.strip()[-300:]}")
    return time.perf_counter() - started


def _dials_metrics(table: Path, folder: Path) -> dict:
    done = subprocess.run(["cctbx.python", "-c", METRICS, str(table)], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise DialsError(f"cctbx.python could not read {table}: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _module_errors(panels, truth) -> dict:
    """Each module's centre's distance from the truth's (µm) and the angle (degrees) of the turn between their
    axes."""
    from scipy.spatial.transform import Rotation

    errors = {}
    for panel, true in zip(panels, truth, strict=True):
        frames = []
        for p in (panel, true):
            fast, slow = np.array(p.fdet_vector), np.array(p.sdet_vector)
            centre = np.array(p.pix0_mm) + p.pixel_size_mm / 2 * (p.pixels_f * fast + p.pixels_s * slow)
            frames.append((centre, np.stack([fast, slow, np.cross(fast, slow)], axis=1)))
        (centre, axes), (true_centre, true_axes) = frames
        turn = Rotation.from_matrix(axes @ true_axes.T).magnitude()
        errors[true.name] = {"centre_um": float(np.linalg.norm(centre - true_centre) * 1000.0),
                             "rotation_deg": float(np.degrees(turn))}
    return errors


def _crystal_errors(a_matrix: np.ndarray, truth: np.ndarray) -> dict:
    """The misorientation (degrees, up to P222's equivalent settings) and the sorted cell lengths (Å)."""
    import itertools

    from nbsim.fit.parameters import misorientation_deg

    angle = min(misorientation_deg(np.diag(signs) @ a_matrix, truth)
                for signs in itertools.product((1.0, -1.0), repeat=3) if np.prod(signs) > 0)
    return {"orientation_deg": angle, "cell_A": np.sort(np.linalg.norm(np.linalg.inv(a_matrix).T, axis=1)).tolist()}


def run(folder: Path) -> dict:
    """The loop in `folder` (see the module's docstring); what came out, with each step's seconds and the CPU
    seconds of all of them."""
    import yaml

    from nbsim.io.dials_experiments import read_experiment_list
    from nbsim.io.panels import read_panel_file
    from nbsim.model.crystal import build_lattice
    from nbsim.nanobragg import config_from_args
    from nbsim.rng import Ran1

    folder.mkdir(parents=True, exist_ok=True)
    for name, moves in (("nominal.yaml", None), ("truth.yaml", MOVES)):
        (folder / name).write_text(yaml.safe_dump({"panels": layout(moves)}, sort_keys=False))
    seconds = {"render": _nbsim([*CRYSTAL, "-panelfile", "nominal.yaml", "-nxmxfile", "nominal.nxs"], folder,
                                "render_nominal.out")}
    truths = []
    for shot, misset in enumerate(MISSETS, start=1):
        flags = [*CRYSTAL, "-panelfile", "truth.yaml", "-misset", *misset.split()]
        seconds["render"] += _nbsim([*flags, "-nxmxfile", f"still_{shot}.nxs"], folder, f"render_{shot}.out")
        config = config_from_args([*CRYSTAL, "-misset", *misset.split()])
        truths.append(build_lattice(config.crystal, config.beam.wavelength_A, Ran1()).reciprocal_per_A.numpy())
    for number, (program, *arguments) in enumerate(DIALS_STEPS + INTEGRATE[:1]):
        seconds[f"{program} ({number + 1})"] = run_program(program, arguments, folder, f"{number + 1}_{program}.out")
    seconds["nbsim fit"] = _nbsim(FIT, folder, "fit.out")
    program, *arguments = INTEGRATE[1]
    seconds[program] = run_program(program, arguments, folder)
    own = folder / "dials_models"  # the same integration with DIALS's own models, for comparison
    own.mkdir(exist_ok=True)
    for name in ("indexed.expt", "indexed_only.refl"):
        (own / name).write_bytes((folder / name).read_bytes())
    run_program(program, ["indexed.expt", *arguments[1:]], own)

    truth_panels = read_panel_file(folder / "truth.yaml")
    indexed, refined = read_experiment_list(folder / "indexed.expt"), read_experiment_list(folder / "refined.expt")
    fit = json.loads((folder / "fit.json").read_text())
    stills = [{"image": Path(start.image).name, "dials": _crystal_errors(start.a_matrix_per_A, truths[shot]),
               "nbsim": _crystal_errors(back.a_matrix_per_A, truths[shot])}
              for start, back in zip(indexed, refined, strict=True)
              for shot in [int(Path(start.image.split("#")[0]).stem.split("_")[1]) - 1]]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"modules": {"start": _module_errors(indexed[0].overrides["panels"], truth_panels),
                        "fit": _module_errors(refined[0].overrides["panels"], truth_panels)},
            "stills": stills, "fit": {key: fit[key] for key in ("converged", "reason", "iterations", "seconds",
                                                                 "pixels")},
            "integrated": {"nbsim": _dials_metrics(folder / "integrated_1.refl", folder),
                           "dials": _dials_metrics(own / "integrated_1.refl", own)},
            "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to work in")
    options = parser.parse_args()
    if not dials_available():
        print("DIALS is not installed (dials.import, cctbx.python): apt-get install dials", file=sys.stderr)
        return 2
    try:
        print(json.dumps(run(options.out), indent=2))
    except DialsError as error:
        print(f"dials_panels: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
