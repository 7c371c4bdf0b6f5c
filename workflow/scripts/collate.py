"""Snakemake script: a scenario's tables and collated store (nbsim.collate)."""

from pathlib import Path

from nbsim.collate import CORRELATION_COLUMNS, TIMING_COLUMNS, point_rows, write_collated_store, write_tables
from nbsim.sweep import run_logged


def collate(inputs, outputs, params) -> None:
    rows = point_rows([Path(p) for p in inputs.timings], [Path(p) for p in inputs.comparisons],
                      {name: Path(path) for name, path in params.references.items()})
    write_tables(rows, params.axes, Path(outputs.timing_csv), Path(outputs.timing_md), TIMING_COLUMNS)
    write_tables(rows, params.axes, Path(outputs.correlation_csv), Path(outputs.correlation_md),
                 ("reference", *CORRELATION_COLUMNS))
    write_collated_store(rows, [Path(p) for p in inputs.stores], params.axes, Path(outputs.store))


run_logged(snakemake.log[0], collate, snakemake.input, snakemake.output, snakemake.params)  # noqa: F821
