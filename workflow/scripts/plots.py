"""Snakemake script: a scenario's plots (nbsim.collate.plot_scenario)."""

from pathlib import Path

from nbsim.collate import plot_scenario, point_rows
from nbsim.sweep import run_logged


def plots(inputs, outputs, params) -> None:
    rows = point_rows([Path(p) for p in inputs.timings], [Path(p) for p in inputs.comparisons],
                      {name: Path(path) for name, path in params.references.items()})
    plot_scenario(rows, [Path(p) for p in inputs.stores], params.axes, Path(outputs.speedup),
                  Path(outputs.warm_time), Path(outputs.previews))


run_logged(snakemake.log[0], plots, snakemake.input, snakemake.output, snakemake.params)  # noqa: F821
