"""The sweep report's reader layer (nbsim.sweep.report) and the previews' layout, on hand-made rows."""

from __future__ import annotations

import csv
import json
import math
from html.parser import HTMLParser

from nbsim.sweep.collate import point_rows
from nbsim.sweep.plots import preview_grid
from nbsim.sweep.report import (
    CORRELATION_VIEW,
    SUMMARY_HEADINGS,
    TIMING_VIEW,
    ScenarioSummary,
    reader_table,
    reference_statement,
    write_summary,
)

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


def _timing(*times_s: float) -> dict:
    ordered = sorted(times_s)
    return {"warm_median_s": ordered[len(ordered) // 2], "warm_min_s": ordered[0], "warm_max_s": ordered[-1]}


def _records(folder, batch: str, dtype: str, times_s: tuple[float, ...], reference: str | None = None) -> object:
    """A records.json of one timed point (a reference batch's when `reference` names its kind)."""
    point = {"name": f"n64-{dtype}" if reference is None else "n64", "reference": "n64", "status": "ok", "index": 0,
             "axes": {"size": 64, "dtype": dtype, "device": "cpu", "compile": "on"}, "timing": _timing(*times_s)}
    record = {"scenario": "seed", "batch": batch, "points": [point], "compile": "on",
              **({"reference": reference} if reference else {})}
    path = folder / f"{batch}.json"
    path.write_text(json.dumps(record))
    return path


def test_the_reference_time_is_the_sweeps_own_float64_point(tmp_path):
    """nbsim's float64 reference is timed by the sweep's float64 CPU point (the row the table shows as
    *reference*), not by the reference batch's other process; the speedup's range spans both sides' repeats."""
    rows = point_rows([_records(tmp_path, "n64-float32", "float32", (1.0, 1.1, 1.3)),
                       _records(tmp_path, "n64-float64", "float64", (3.0, 3.3, 3.9))],
                      [_records(tmp_path, "n64-b0000", "float64", (8.0, 8.0, 8.0), reference="nbsim-float64-cpu")])
    single, double = rows
    assert double["reference_median_s"] == double["warm_median_s"] == 3.3 and "speedup" not in double
    assert single["reference_batch"] == "n64-float64" and single["speedup"] == 3.3 / 1.1
    assert (single["speedup_min"], single["speedup_max"]) == (3.0 / 1.3, 3.9 / 1.0)
    _, table = reader_table(rows, AXES[:4], TIMING_VIEW)
    assert table[0][-1] == "3 (2.31–3.9)" and table[1][-1] == "reference"


def test_without_the_reference_configuration_the_reference_batch_times_it(tmp_path):
    """A sweep of float32 alone (or a C reference) takes the reference batch's times."""
    [row] = point_rows([_records(tmp_path, "n64-float32", "float32", (1.0, 1.0, 2.0))],
                       [_records(tmp_path, "n64-b0000", "float64", (4.0, 5.0, 6.0), reference="c")])
    assert row["reference_batch"] == "n64-b0000" and row["speedup"] == 5.0
    assert (row["speedup_min"], row["speedup_max"]) == (2.0, 6.0)


def test_the_reference_statement_names_what_speedups_are_over():
    assert "not over the C nanoBragg" in reference_statement(ROWS)
    assert "compare nbsim with itself" in reference_statement(ROWS)
    assert reference_statement([{"reference": "c"}]).startswith("Speedups and correlations are against the C nanoBragg")
    assert reference_statement([{"status": "ok"}]).startswith("No reference")


class _Text(HTMLParser):
    """A page's text as a browser without JavaScript shows it (head, scripts and styles left out)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.parts, self.scripts = 0, [], 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("head", "script", "style")
        self.scripts += tag == "script"

    def handle_endtag(self, tag):
        self.hidden -= tag in ("head", "script", "style")

    def handle_data(self, data):
        if not self.hidden and data.strip():
            self.parts.append(data.strip())


def test_the_summary_states_its_reference_first_and_shows_the_spread(tmp_path):
    ranged = [dict(row, speedup_min=row["speedup"] / 2, speedup_max=row["speedup"] * 2) if "speedup" in row else row
              for row in ROWS]
    paths = [tmp_path / name for name in ("summary.rst", "summary.csv", "summary.html")]
    write_summary({"seed": ranged}, AXES, *paths)
    statement = reference_statement(ROWS)
    rst, csv_text, page = (path.read_text() for path in paths)
    assert rst.splitlines()[0] == f"**{statement}**"
    assert csv_text.splitlines()[0] == f"# {statement}"
    [row] = csv.DictReader(csv_text.splitlines()[1:])
    assert float(row["best_speedup_min"]) == 12.3456 / 2 and float(row["best_speedup_max"]) == 12.3456 * 2
    assert float(row["median_speedup_min"]) == (12.3456 + 4.0) / 4
    text = _Text()
    text.feed(page)
    assert text.scripts == 0 and text.parts[:2] == ["nbsim sweep summary", statement]
    headings = text.parts.index(SUMMARY_HEADINGS[0])
    assert text.parts[headings:headings + len(SUMMARY_HEADINGS) + 5] == [
        *SUMMARY_HEADINGS, "seed", "3 / 1", "1.0e-08", "4.0e-05", "12.3 (6.17–24.7)"]
    assert "timing" in text.parts and "agreement with the reference" in text.parts


def test_plotted_values_carry_their_range_over_the_repeats():
    """The speedup and time plots draw each value's range over the timed repeats (the tables' brackets), so a
    trend inside it reads as the machine's load; points of another x, or without a range, draw none."""
    from nbsim.sweep.plots import _series

    rows = [_row(64, "float32", 1.0, speedup=1.0, speedup_min=0.3, speedup_max=1.8),
            _row(64, "float32", 2.0, speedup=1.2, speedup_min=0.9, speedup_max=2.5),
            _row(128, "float32", 1.0, speedup=0.5, speedup_min=0.4, speedup_max=1.2)]
    [(label, xs, median, low, high, repeats)] = _series(rows, "size", "speedup")
    assert xs == [64, 128] and median == [1.1, 0.5] and (low, high) == ([1.0, 0.5], [1.2, 0.5])
    assert repeats == ([0.3, 0.4], [2.5, 1.2])
    assert label.endswith("(bars: the range over the repeats)")
    [(label, *_, repeats)] = _series([_row(64, "float32", 1.0, speedup=1.0)], "size", "speedup")
    assert repeats is None and "bars" not in label


def test_a_merge_report_says_how_many_reflections_each_cycles_cc_compares(tmp_path):
    """The start's CC is over every reflection, a cycle's over those measured then (nbsim merge's small crystal:
    0.569 over 1,031 at the start, 0.611 over the 178 measured at the end): the page and the progress line say
    how many, so that cycle 0 is not read as the same reflections' CC."""
    from nbsim.cli.merge import _progress_line
    from nbsim.merge.report import write_report

    cycles = [{"cycle": 0, "cc": 0.5694, "cc_reflections": 1031, "cc_by_shell": [0.62, 0.55]},
              {"cycle": 1, "cc": 0.8411, "cc_reflections": 178, "cc_by_shell": [0.92, 0.70],
               "shell_d_min_A": [4.0, 3.2]}]
    write_report(tmp_path / "report.html", cycles, "merge")
    page = (tmp_path / "report.html").read_text()
    assert "<th>cycle</th><th>reflections</th><th>all</th>" in page
    assert "<tr><td>0</td><td>1031</td><td>0.5694</td>" in page and "<tr><td>1</td><td>178</td>" in page
    assert "Cycle 0 is the start, over every reflection" in page
    assert _progress_line(cycles[0]).startswith("cycle 0  CC 0.5694 over 1031 reflections  by shell")
