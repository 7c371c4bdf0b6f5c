"""What the sweep's report shows a reader, from the rows of nbsim.sweep.collate.point_rows: a summary per
scenario (the report's front page: points ok and failed, worst 1−r and relative error, best and median
speedup and what it is over), and each scenario's tables rounded to the columns a reader needs (Markdown
and HTML; the CSVs keep every column and digit). Correlation shows as 1−r: every good point's r rounds to 1.
"""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collate import is_reference_row, reference_label


def _seconds(value: float) -> str:
    return f"{value:.3g}"


def _scientific(value: float) -> str:
    return f"{value:.1e}"


def _ratio(value: float) -> str:
    return f"{value:.3g}"


def _megabytes(value: float) -> str:
    return f"{value:.0f}"


def _sum_ratio(value: float) -> str:
    return f"{value:.6f}"


Column = tuple[str, str, Callable[[float], str]]
"""A reader's column: the row key, its heading, how a number in it is written."""
TIMING_VIEW: tuple[Column, ...] = (
    ("cold_s", "cold s", _seconds), ("warm_median_s", "warm median s", _seconds),
    ("warm_min_s", "warm min s", _seconds), ("warm_max_s", "warm max s", _seconds),
    ("reference_median_s", "reference s", _seconds), ("speedup", "speedup", _ratio),
    ("peak_rss_mb", "peak RSS MB", _megabytes), ("host", "host", str), ("slurm_job_id", "SLURM job", str))
CORRELATION_VIEW: tuple[Column, ...] = (
    ("one_minus_r", "1−r", _scientific), ("max_rel_error", "max relative error", _scientific),
    ("max_abs_error", "max absolute error", _scientific), ("sum_ratio", "sum ratio", _sum_ratio))
REFERENCE_CELL = "reference"
"""The speedup cell of a float64 CPU point measured against nbsim's float64 CPU reference (its own
configuration): it is the reference, not a speedup."""


def varying_axes(rows: list[dict[str, Any]], axes: list[str]) -> list[str]:
    """The axes with more than one value among the rows (`size` when none varies)."""
    varying = [a for a in axes if len({str(r.get(a)) for r in rows}) > 1]
    return varying or ["size"]


def _empty(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def reader_table(rows: list[dict[str, Any]], axes: list[str],
                 view: tuple[Column, ...]) -> tuple[list[str], list[list[str]]]:
    """Headings and cells: the axes that vary, the status (with the reason of a failed point), then the
    view's columns that have a value in some row, rounded; the speedup of a reference row reads
    REFERENCE_CELL."""
    shown_axes = varying_axes(rows, axes)
    columns = [c for c in view if any(not _empty(r.get(c[0])) for r in rows)
               or (c[0] == "speedup" and any(is_reference_row(r) for r in rows))]
    labels = [*shown_axes, "status"]
    for key, heading, _ in columns:
        labels.append(f"speedup over {reference_label(rows)}" if key == "speedup" else heading)
    table = []
    for row in rows:
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason') or ''}".strip()
        cells = [str(row.get(a)) for a in shown_axes] + [status]
        for key, _, write in columns:
            value = row.get(key)
            if key == "speedup" and is_reference_row(row):
                cells.append(REFERENCE_CELL)
            elif _empty(value):
                cells.append("")
            else:
                cells.append(write(value) if isinstance(value, (int, float)) else str(value))
        table.append(cells)
    return labels, table


def write_reader_tables(rows: list[dict[str, Any]], axes: list[str], view: tuple[Column, ...], md_path: Path,
                        html_path: Path, title: str) -> None:
    """`reader_table` as Markdown and as a standalone HTML page (what the report shows)."""
    labels, table = reader_table(rows, axes, view)
    with open(md_path, "w") as stream:
        stream.write("| " + " | ".join(labels) + " |\n|" + "---|" * len(labels) + "\n")
        for cells in table:
            stream.write("| " + " | ".join(cells) + " |\n")
    html_path.write_text(_html_page(title, labels, table))


def _html_page(title: str, labels: list[str], table: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>\n" for cells in table)
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;font-size:13px} table{border-collapse:collapse}"
            "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right} th{background:#eee}"
            f"</style></head><body><h3>{html.escape(title)}</h3>\n<table><tr>{head}</tr>\n{body}</table>"
            "<p>Rounded for reading; the CSV beside it keeps every column and digit.</p></body></html>\n")


@dataclass(frozen=True)
class ScenarioSummary:
    """One scenario at a glance: how many points rendered, how far from the reference the worst one is,
    and how much faster nbsim was (over `over`, empty without speedups; reference rows and failed points
    left out)."""

    scenario: str
    ok: int
    failed: int
    worst_one_minus_r: float | None
    worst_rel_error: float | None
    best_speedup: float | None
    median_speedup: float | None
    over: str

    @classmethod
    def of(cls, scenario: str, rows: list[dict[str, Any]]) -> ScenarioSummary:
        """The summary of a scenario's table rows."""
        ok = [r for r in rows if r["status"] == "ok"]

        def values(key: str) -> list[float]:
            return [float(r[key]) for r in ok if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]

        one_minus_r, rel_error, speedups = values("one_minus_r"), values("max_rel_error"), values("speedup")
        return cls(scenario, len(ok), len(rows) - len(ok), max(one_minus_r, default=None),
                   max(rel_error, default=None), max(speedups, default=None),
                   statistics.median(speedups) if speedups else None, reference_label(rows) if speedups else "")

    def cells(self) -> list[str]:
        """The summary as the front page's table cells, rounded."""
        def shown(value: float | None, write: Callable[[float], str]) -> str:
            return "–" if value is None else write(value)

        return [f"{self.ok} / {self.failed}", shown(self.worst_one_minus_r, _scientific),
                shown(self.worst_rel_error, _scientific), shown(self.best_speedup, _ratio),
                shown(self.median_speedup, _ratio), self.over]


SUMMARY_HEADINGS = ("scenario", "points ok / failed", "worst 1−r", "worst relative error", "best speedup",
                    "median speedup", "speedup over")


def write_summary(summaries: list[ScenarioSummary], rst_path: Path, csv_path: Path) -> None:
    """The front page's summary as reStructuredText (a table; each scenario links to its results) and as CSV."""
    import csv

    lines = [".. list-table::", "   :header-rows: 1", ""]
    for cells in [list(SUMMARY_HEADINGS)] + [[f"`{s.scenario}`_", *s.cells()] for s in summaries]:
        for position, cell in enumerate(cells):
            lines.append(f"   {'*' if position == 0 else ' '} - {cell}")
    lines += ["", "1−r: one minus the correlation of a point's image with its reference; relative error: the "
              "largest absolute difference over the reference's maximum. Speedup: the reference's warm median "
              "time over nbsim's; float64 CPU points measured against nbsim's float64 CPU reference are that "
              "reference's own configuration and read *reference*, not a speedup.", ""]
    rst_path.write_text("\n".join(lines))
    with open(csv_path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["scenario", "ok", "failed", "worst_one_minus_r", "worst_rel_error", "best_speedup",
                         "median_speedup", "speedup_over"])
        for s in summaries:
            writer.writerow([s.scenario, s.ok, s.failed, *("" if v is None else repr(v) for v in (
                s.worst_one_minus_r, s.worst_rel_error, s.best_speedup, s.median_speedup)), s.over])
