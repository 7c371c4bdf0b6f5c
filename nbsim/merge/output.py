"""What a merge writes: the MTZ (gemmi; the space group's asymmetric unit with CCP4's column names, FP and
SIGFP, or F(+), SIGF(+), F(−), SIGF(−) with anomalous pairs) and the JSON of every shot's refined model and
every cycle."""

from __future__ import annotations

import numpy as np

from ..io.atomic import atomic_write_with
from .refine import MEASURED_INFORMATION, REFINED_INFORMATION, MergeResult
from .reflections import Reflections

SIGMA_TEXT = ("sigma(|F|) = |F| / sqrt(I), I the diagonal of the Fisher information of log|F| over every pixel that "
              "sees the parameter (a pixel that sees several counts for each; their correlation ignored) plus the "
              "restraints' curvature, the shots fixed at their refined models; written for the measured parameters "
              f"only: information at least {MEASURED_INFORMATION:g} at the resolution shell's mean intensity and at "
              f"least {REFINED_INFORMATION:g} at the estimate (docs/merging.md, 'Measured and unmeasured |F|')")
"""What the JSON says of the MTZ's sigmas."""


def write_mtz(path: str, reflections: Reflections, amplitudes: np.ndarray, sigmas: np.ndarray,
              title: str = "nbsim merge", cell_A_deg: tuple[float, ...] | None = None) -> None:
    """The reflections some pixel measured, as an MTZ (unmeasured halves of a pair are missing: NaN), with
    `cell_A_deg` (default: the reflections')."""
    import gemmi

    plus, minus = reflections.plus, reflections.minus
    measured = np.isfinite(sigmas)
    keep = measured[plus] | measured[minus]
    columns = [("FP", "F", plus), ("SIGFP", "Q", plus)]
    if reflections.anomalous:
        columns = [("F(+)", "G", plus), ("SIGF(+)", "L", plus), ("F(-)", "G", minus), ("SIGF(-)", "L", minus)]
    mtz = gemmi.Mtz(with_base=True)
    mtz.title = title
    mtz.spacegroup = reflections.group
    mtz.set_cell_for_all(gemmi.UnitCell(*(cell_A_deg or reflections.cell_A_deg)))
    mtz.add_dataset("nbsim")
    data = [reflections.miller[keep].astype(np.float64)]
    for label, kind, parameters in columns:
        mtz.add_column(label, kind)
        values = sigmas if label.startswith("SIG") else amplitudes
        data.append(np.where(measured[parameters], values[parameters], np.nan)[keep, None])
    mtz.set_data(np.ascontiguousarray(np.hstack(data), dtype=np.float32))
    atomic_write_with(path, lambda temporary: mtz.write_to_file(str(temporary)))


def merge_json(result: MergeResult) -> dict:
    """Every shot's refined model (as `nbsim fit --json` writes a shot), the cycles, and the merged set's size."""
    reflections = result.reflections
    return {"shots": result.shots, "cycles": result.cycles, "space_group": reflections.group.hm,
            "cell": list(result.cell_A_deg), "anomalous": reflections.anomalous,
            "reflections": int(len(reflections.miller)), "measured_parameters": int(result.measured.sum()),
            "parameters": int(reflections.size), "negative_log_likelihood": result.nll,
            "seconds": round(result.seconds, 3),
            "sigma": SIGMA_TEXT}
