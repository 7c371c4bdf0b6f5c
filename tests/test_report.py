"""The sweep report's reader layer (nbsim.sweep.report) and the previews' layout, on hand-made rows."""

from __future__ import annotations

import math

from nbsim.sweep.plots import preview_grid
from nbsim.sweep.report import CORRELATION_VIEW, TIMING_VIEW, ScenarioSummary, reader_table

AXES = ["size", "dtype", "device", "compile", "fudge"]


def _row(size: int, dtype: str, fudge: float, **values) -> dict:
    row = {"point": f"n{size}-{dtype}-{fudge}", "size": size, "dtype": dtype, "device": "cpu", "compile": "on",
           "fudge": fudge, "status": "ok", "reference": "nbsim-float64-cpu", "host": "node1", "slurm_job_id": None}
    row.update(values)
    return row


ROWS = [
    _row(64, "float32", 1.0, warm_median_s=0.0123456, speedup=12.3456, one_minus_r=3.2e-9, max_rel_error=2e-5),
    _row(64, "float32", 2.0, warm_median_s=0.02, speedup=4.0, one_minus_r=1e-8, max_rel_error=4e-5),
    _row(64, "float64", 1.0, warm_median_s=0.05, one_minus_r=1e-15, max_rel_error=1e-8),
    _row(128, "float32", 1.0, status="failed", reason="out of memory"),
]


def test_timing_table_shows_varying_axes_rounded_and_labels_the_reference():
    labels, table = reader_table(ROWS, AXES, TIMING_VIEW)
    assert labels == ["size", "dtype", "fudge", "status", "warm median s",
                      "speedup over nbsim float64 on the CPU", "host"]  # empty slurm_job_id dropped
    assert table[0] == ["64", "float32", "1.0", "ok", "0.0123", "12.3", "node1"]
    assert table[2][5] == "reference"
    assert table[3][3] == "failed: out of memory"


def test_correlation_table_shows_one_minus_r_in_scientific_notation():
    labels, table = reader_table(ROWS, AXES, CORRELATION_VIEW)
    assert labels[4:] == ["1−r", "max relative error"]
    assert table[0][4:] == ["3.2e-09", "2.0e-05"]


def test_scenario_summary_leaves_out_reference_rows_and_failures():
    summary = ScenarioSummary.of("seed", ROWS)
    assert (summary.ok, summary.failed) == (3, 1)
    assert summary.worst_one_minus_r == 1e-8 and summary.worst_rel_error == 4e-5
    assert summary.best_speedup == 12.3456 and math.isclose(summary.median_speedup, (12.3456 + 4.0) / 2)
    assert summary.over == "nbsim float64 on the CPU"
    assert summary.cells() == ["3 / 1", "1.0e-08", "4.0e-05", "12.3", "8.17", "nbsim float64 on the CPU"]


def test_a_dataset_summary_names_no_reference():
    """Without timing or references (a dataset) nothing was sped up over anything: no "over" to name."""
    shots = [{"status": "ok", "size": 64, "dtype": "float32"} for _ in range(3)]
    summary = ScenarioSummary.of("shots", shots)
    assert summary.over == "" and summary.cells() == ["3 / 0", "–", "–", "–", "–", ""]


def test_previews_grid_along_the_varying_axes():
    column_axis, columns, combinations, row_axes = preview_grid(ROWS, AXES)
    assert (column_axis, columns, row_axes) == ("size", [64, 128], ["dtype", "fudge"])
    assert combinations == [("float32", 1.0), ("float32", 2.0), ("float64", 1.0)]
