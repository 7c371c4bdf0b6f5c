"""Snakemake script: a scenario's refined − true table and plot (nbsim.sweep.fitting, nbsim.sweep.plots)."""

from pathlib import Path

from nbsim.sweep.collate import write_table
from nbsim.sweep.fitting import FIT_COLUMNS, fit_rows
from nbsim.sweep.plots import plot_fit_errors
from nbsim.sweep.progress import run_logged


def fit_table(inputs, outputs, params) -> None:
    rows = fit_rows([Path(p) for p in inputs.fits])
    write_table(rows, params.axes, Path(outputs.csv), FIT_COLUMNS)
    plot_fit_errors(rows, Path(outputs.plot))


run_logged(snakemake.log[0], fit_table, snakemake.input, snakemake.output, snakemake.params)  # noqa: F821
