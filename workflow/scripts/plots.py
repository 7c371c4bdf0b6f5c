"""Snakemake script: a scenario's plots (nbsim.sweep.plots)."""

from pathlib import Path

from nbsim.sweep.collate import point_rows
from nbsim.sweep.plots import plot_scenario
from nbsim.sweep.progress import run_logged


def plots(inputs, outputs, params) -> None:
    rows = point_rows([Path(p) for p in inputs.records], [Path(p) for p in inputs.references])
    plot_scenario(rows, {Path(p).parent.name: Path(p) for p in params.stores}, params.axes,
                  Path(outputs.speedup), Path(outputs.warm_time), Path(outputs.previews))


run_logged(snakemake.log[0], plots, snakemake.input, snakemake.output, snakemake.params)  # noqa: F821
