"""Snakemake script: the report's front-page summary, one row per scenario (nbsim.sweep.report)."""

from pathlib import Path

from nbsim.sweep.collate import point_rows
from nbsim.sweep.progress import run_logged
from nbsim.sweep.report import ScenarioSummary, write_summary


def summary(outputs, params) -> None:
    summaries = [ScenarioSummary.of(scenario, point_rows([Path(p) for p in paths["records"]],
                                                         [Path(p) for p in paths["references"]]))
                 for scenario, paths in params.by_scenario.items()]
    write_summary(summaries, Path(outputs.rst), Path(outputs.csv))


run_logged(snakemake.log[0], summary, snakemake.output, snakemake.params)  # noqa: F821
