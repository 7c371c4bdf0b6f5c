"""Run by DIALS's own Python (`cctbx.python`, not nbsim's): what DIALS made of an nbsim rotation series, as
JSON on stdout, for tests/test_dials.py and benchmarks/dials_workloads.py to check against nbsim's truth.

usage: cctbx.python dials_metrics.py FOLDER
(FOLDER holds imported.expt, indexed.refl, refined.expt and refined.refl)"""

import json
import math
import sys
from pathlib import Path

from dials.array_family import flex
from dxtbx.model.experiment_list import ExperimentListFactory


def main(folder: Path) -> None:
    indexed = flex.reflection_table.from_file(str(folder / "indexed.refl"))
    refined = flex.reflection_table.from_file(str(folder / "refined.refl"))
    experiment = ExperimentListFactory.from_json_file(str(folder / "refined.expt"), check_format=False)[0]
    used = refined.select(refined.get_flags(refined.flags.used_in_refinement))
    x_obs, y_obs, _ = used["xyzobs.px.value"].parts()
    x_cal, y_cal, _ = used["xyzcal.px"].parts()
    imported = ExperimentListFactory.from_json_file(str(folder / "imported.expt"), check_format=False)[0]
    panel, beam = experiment.detector[0], experiment.beam
    crystal = experiment.crystal
    print(json.dumps({
        "indexed_fraction": indexed.get_flags(indexed.flags.indexed).count(True) / len(indexed),
        "rmsd_x_px": math.sqrt(flex.mean(flex.pow2(x_obs - x_cal))),
        "rmsd_y_px": math.sqrt(flex.mean(flex.pow2(y_obs - y_cal))),
        "unit_cell": list(crystal.get_unit_cell().parameters()),
        "real_space_A": [list(v) for v in crystal.get_real_space_vectors()],
        "distance_mm": panel.get_directed_distance(),
        "beam_centre_px": list(panel.get_beam_centre_px(beam.get_s0())),
        "beam_direction": list(imported.beam.get_unit_s0()),
        "rotation_axis": list(imported.goniometer.get_rotation_axis()),
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
