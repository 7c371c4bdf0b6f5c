"""Snakemake script: the report's front-page summary, one row per scenario, and the static summary page
with every scenario's tables (nbsim.sweep.report)."""

from pathlib import Path

from nbsim.sweep.collate import point_rows
from nbsim.sweep.progress import run_logged
from nbsim.sweep.report import write_summary


def summary(outputs, params) -> None:
    rows = {scenario: point_rows([Path(p) for p in paths["records"]], [Path(p) for p in paths["references"]])
            for scenario, paths in params.by_scenario.items()}
    write_summary(rows, params.axes, Path(outputs.rst), Path(outputs.csv), Path(outputs.html))


run_logged(snakemake.log[0], summary, snakemake.output, snakemake.params)  # noqa: F821
