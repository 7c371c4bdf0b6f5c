"""A merge's page against a truth: CC(|F|, truth) and, with anomalous pairs, CCano (of |F(+)| − |F(−)|) by
resolution shell against the cycle, as a PNG (matplotlib) and a static HTML page holding the PNG and the
tables of the same numbers."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from ..io.atomic import atomic_write_text, atomic_write_with


def _shell_labels(cycles: list[dict]) -> list[str]:
    """Each shell's high-resolution limit, as the last cycle reports it."""
    limits = cycles[-1].get("shell_d_min_A", [])
    return [f"to {limit:.2f} Å" if isinstance(limit, float) and math.isfinite(limit) else f"shell {index + 1}"
            for index, limit in enumerate(limits or cycles[-1]["cc_by_shell"])]


def _panels(cycles: list[dict]) -> list[tuple[str, str, str]]:
    """(title, overall key, by-shell key) of what the records hold."""
    panels = [("CC(|F|, truth)", "cc", "cc_by_shell")]
    if any("cc_anomalous_by_shell" in record for record in cycles):
        panels.append(("CCano (|F(+)| − |F(−)|)", "cc_anomalous", "cc_anomalous_by_shell"))
    return panels


def write_png(path: str | Path, cycles: list[dict]) -> None:
    """One panel per score: a line per resolution shell (low resolution light, high dark) and the overall
    score (black, thick) against the cycle (0: the start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = _shell_labels(cycles)
    panels = _panels(cycles)
    figure, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.2), squeeze=False)
    colours = plt.get_cmap("viridis_r")
    for axis, (title, overall, by_shell) in zip(axes[0], panels, strict=True):
        scored = [record for record in cycles if by_shell in record]
        x = [record["cycle"] for record in scored]
        for shell, label in enumerate(labels):
            axis.plot(x, [_value(record[by_shell], shell) for record in scored], marker="o", markersize=3,
                      color=colours((shell + 0.5) / len(labels)), label=label)
        axis.plot(x, [_value([record[overall]], 0) for record in scored], color="black", linewidth=2.5,
                  label="all")
        axis.set_xlabel("cycle")
        axis.set_ylabel(title)
        axis.set_title(f"{title} by resolution shell")
        axis.set_xticks(x)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    atomic_write_with(path, lambda temporary: figure.savefig(temporary, dpi=100, format="png"))
    plt.close(figure)


def _value(values: list, index: int) -> float:
    value = values[index] if index < len(values) else None
    return math.nan if value is None else float(value)


def write_report(path: str | Path, cycles: list[dict], title: str) -> Path:
    """The page at `path` (the PNG embedded) and the PNG beside it (`path` with the suffix .png); the PNG's
    path."""
    page = Path(path)
    png = page.with_suffix(".png")
    write_png(png, cycles)
    picture = base64.b64encode(png.read_bytes()).decode()
    labels = _shell_labels(cycles)
    tables = []
    for name, overall, by_shell in _panels(cycles):
        head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
        counted = overall == "cc"  # the reflections CC(|F|) compares; CCano's pairs are fewer
        rows = "".join(
            f"<tr><td>{record['cycle']}</td>" + (f"<td>{record.get('cc_reflections', '–')}</td>" if counted else "")
            + f"<td>{_cell(record.get(overall))}</td>"
            + "".join(f"<td>{_cell(value)}</td>" for value in record.get(by_shell, []))
            + "</tr>" for record in cycles if by_shell in record)
        tables.append(f"<h2>{html.escape(name)}</h2><table><tr><th>cycle</th>"
                      f"{'<th>reflections</th>' if counted else ''}<th>all</th>{head}</tr>{rows}</table>")
    content = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
               "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
               "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>"
               f"<h1>{html.escape(title)}</h1><p>Cycle 0 is the start, over every reflection (none is measured "
               "before cycle 1); each cycle after it is over the reflections some pixel measures then (their count: "
               "the reflections column). Shells run from low to high resolution (each named by its "
               "high-resolution limit).</p>"
               f"<img alt='correlations by shell against the cycle' src='data:image/png;base64,{picture}'>"
               f"{''.join(tables)}</body></html>\n")
    atomic_write_text(page, content)
    return png


def _cell(value) -> str:
    return "–" if value is None or not math.isfinite(float(value)) else f"{float(value):.4f}"
