"""What the sweep's report shows a reader, from the rows of nbsim.sweep.collate.point_rows: a summary per
scenario (the report's front page, and `summary.html` for a browser without JavaScript: what the speedups
and correlations are against, points ok and failed, worst 1−r and relative error, best and median speedup
with their range over the repeats), and each scenario's tables rounded to the columns a reader needs
(Markdown and HTML; the CSVs keep every column and digit). Correlation shows as 1−r: every good point's r
rounds to 1.
"""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collate import NBSIM_REFERENCE, is_reference_row, reference_label


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


def _speedup(value: float, low: float | None, high: float | None) -> str:
    """A speedup rounded, with its range over the repeats in brackets when it has one: `12.3 (11.8–12.9)`."""
    shown = _ratio(value)
    return shown if low is None or high is None else f"{shown} ({_ratio(low)}–{_ratio(high)})"


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
    view's columns that have a value in some row, rounded; a speedup shows its range over the repeats
    (`_speedup`), and that of a reference row reads REFERENCE_CELL."""
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
            elif key == "speedup" and not _empty(value):
                cells.append(_speedup(value, *(None if _empty(row.get(k)) else row[k]
                                               for k in ("speedup_min", "speedup_max"))))
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


def _html_table(labels: list[str], table: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>\n" for cells in table)
    return f"<table><tr>{head}</tr>\n{body}</table>\n"


def _html_document(title: str, body: str) -> str:
    """A standalone page, readable without JavaScript."""
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;font-size:13px} table{border-collapse:collapse}"
            "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right} th{background:#eee}"
            f"</style></head><body>\n{body}</body></html>\n")


def _html_page(title: str, labels: list[str], table: list[list[str]]) -> str:
    return _html_document(title, f"<h3>{html.escape(title)}</h3>\n{_html_table(labels, table)}"
                                 "<p>Rounded for reading; the CSV beside it keeps every column and digit.</p>\n")


Range = tuple[float, float]
"""A speedup's lowest and highest value over the repeats of both sides."""


def _median_range(rows: list[dict[str, Any]]) -> Range | None:
    """The medians of the rows' speedup ranges (None when no row has one)."""
    ranged = [r for r in rows if not _empty(r.get("speedup_min")) and not _empty(r.get("speedup_max"))]
    if not ranged:
        return None
    return (statistics.median(r["speedup_min"] for r in ranged), statistics.median(r["speedup_max"] for r in ranged))


@dataclass(frozen=True)
class ScenarioSummary:
    """One scenario at a glance: how many points rendered, how far from the reference the worst one is,
    and how much faster nbsim was (over `over`, empty without speedups; reference rows and failed points
    left out): the best point's speedup with its range over the repeats, and the median speedup with the
    medians of the points' ranges."""

    scenario: str
    ok: int
    failed: int
    worst_one_minus_r: float | None
    worst_rel_error: float | None
    best_speedup: float | None
    best_speedup_range: Range | None
    median_speedup: float | None
    median_speedup_range: Range | None
    over: str

    @classmethod
    def of(cls, scenario: str, rows: list[dict[str, Any]]) -> ScenarioSummary:
        """The summary of a scenario's table rows."""
        ok = [r for r in rows if r["status"] == "ok"]

        def values(key: str) -> list[float]:
            return [float(r[key]) for r in ok if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]

        sped_up = [r for r in ok if isinstance(r.get("speedup"), (int, float)) and not math.isnan(r["speedup"])]
        best = max(sped_up, key=lambda r: r["speedup"], default=None)
        speedups = [r["speedup"] for r in sped_up]
        return cls(scenario, len(ok), len(rows) - len(ok), max(values("one_minus_r"), default=None),
                   max(values("max_rel_error"), default=None), best["speedup"] if best else None,
                   _median_range([best]) if best else None, statistics.median(speedups) if speedups else None,
                   _median_range(sped_up), reference_label(rows) if speedups else "")

    def cells(self) -> list[str]:
        """The summary as the front page's table cells, rounded (a speedup with its range in brackets)."""
        def shown(value: float | None, write: Callable[[float], str]) -> str:
            return "–" if value is None else write(value)

        def speedup(value: float | None, spread: Range | None) -> str:
            return shown(value, lambda v: _speedup(v, *(spread or (None, None))))

        return [f"{self.ok} / {self.failed}", shown(self.worst_one_minus_r, _scientific),
                shown(self.worst_rel_error, _scientific), speedup(self.best_speedup, self.best_speedup_range),
                speedup(self.median_speedup, self.median_speedup_range), self.over]


SUMMARY_HEADINGS = ("scenario", "points ok / failed", "worst 1−r", "worst relative error", "best speedup (range)",
                    "median speedup (range)", "speedup over")
SUMMARY_NOTE = ("1−r: one minus the correlation of a point's image with its reference; relative error: the largest "
                "absolute difference over the reference's maximum. Speedup: the reference's warm median time over "
                "nbsim's, and in brackets its range over the repeats of both sides (the reference's fastest over "
                "nbsim's slowest, its slowest over nbsim's fastest; for the median, the medians of the points' "
                "ranges). Each batch of points is timed in its own process, one at a time: a machine whose load "
                "changes between batches shifts whole rows beyond that range, so rerun before reading a "
                "difference smaller than it. nbsim's float64 reference is timed by the sweep's own float64 CPU "
                "point of its configuration where the sweep has one (that row reads *reference*, not a speedup).")


def reference_statement(rows: list[dict[str, Any]]) -> str:
    """One sentence: what the rows' speedups and correlations are against (the front page's first line)."""
    kinds = {row["reference"] for row in rows if row.get("reference")}
    if not kinds:
        return "No reference: nothing here is compared with, or timed against, another image."
    against = []
    if NBSIM_REFERENCE in kinds:
        against.append("nbsim's own float64 image on the CPU (no reference.c_binary configured): the speedups are "
                       "over nbsim in float64, not over the C nanoBragg, and the correlations compare nbsim with "
                       "itself")
    if "c" in kinds:
        against.append("the C nanoBragg (reference.c_binary), timed as whole processes (start-up and file writes "
                       "included) against nbsim's warm renders")
    against += sorted(kinds - {NBSIM_REFERENCE, "c"})
    return "Speedups and correlations are against " + "; and ".join(against) + "."


def write_summary(rows_by_scenario: dict[str, list[dict[str, Any]]], axes: list[str], rst_path: Path,
                  csv_path: Path, html_path: Path) -> None:
    """The front page's summary, each format opening with `reference_statement`: reStructuredText (a table;
    each scenario links to its results), CSV (every digit, the statement as a `#` line) and a standalone
    HTML page with each scenario's timing and agreement tables (readable without JavaScript)."""
    import csv

    summaries = [ScenarioSummary.of(scenario, rows) for scenario, rows in rows_by_scenario.items()]
    statement = reference_statement([row for rows in rows_by_scenario.values() for row in rows])
    lines = [f"**{statement}**", "", ".. list-table::", "   :header-rows: 1", ""]
    for cells in [list(SUMMARY_HEADINGS)] + [[f"`{s.scenario}`_", *s.cells()] for s in summaries]:
        for position, cell in enumerate(cells):
            lines.append(f"   {'*' if position == 0 else ' '} - {cell}")
    lines += ["", SUMMARY_NOTE, ""]
    rst_path.write_text("\n".join(lines))
    with open(csv_path, "w", newline="") as stream:
        stream.write(f"# {statement}\n")
        writer = csv.writer(stream)
        writer.writerow(["scenario", "ok", "failed", "worst_one_minus_r", "worst_rel_error", "best_speedup",
                         "best_speedup_min", "best_speedup_max", "median_speedup", "median_speedup_min",
                         "median_speedup_max", "speedup_over"])
        for s in summaries:
            numbers = (s.worst_one_minus_r, s.worst_rel_error, s.best_speedup, *(s.best_speedup_range or (None,) * 2),
                       s.median_speedup, *(s.median_speedup_range or (None,) * 2))
            writer.writerow([s.scenario, s.ok, s.failed, *("" if v is None else repr(v) for v in numbers), s.over])
    body = [f"<h1>nbsim sweep summary</h1>\n<p><strong>{html.escape(statement)}</strong></p>\n",
            _html_table(list(SUMMARY_HEADINGS), [[s.scenario, *s.cells()] for s in summaries]),
            f"<p>{html.escape(SUMMARY_NOTE.replace('*', ''))}</p>\n"]
    for scenario, rows in rows_by_scenario.items():
        body.append(f"<h2>{html.escape(scenario)}</h2>\n<h3>timing</h3>\n")
        body.append(_html_table(*reader_table(rows, axes, TIMING_VIEW)))
        if any(row.get("reference") for row in rows):
            body.append("<h3>agreement with the reference</h3>\n")
            body.append(_html_table(*reader_table(rows, axes, CORRELATION_VIEW)))
    body.append("<p>Rounded for reading: each scenario's <code>tables/*.csv</code> keep every column and digit, "
                "and its <code>plots/</code> the speedup, time and preview plots.</p>\n")
    html_path.write_text(_html_document("nbsim sweep summary", "".join(body)))
