"""Snakemake script: a scenario's tables and collated store (nbsim.sweep.collate)."""

from pathlib import Path

from nbsim.sweep.collate import (
    CORRELATION_COLUMNS,
    TIMING_COLUMNS,
    point_rows,
    write_collated_store,
    write_labels,
    write_tables,
)
from nbsim.sweep.progress import run_logged


def collate(inputs, outputs, params, scenario) -> None:
    rows = point_rows([Path(p) for p in inputs.records], [Path(p) for p in inputs.references])
    write_tables(rows, params.axes, Path(outputs.timing_csv), Path(outputs.timing_md), TIMING_COLUMNS)
    if hasattr(outputs, "correlation_csv"):  # a Namedlist: `in` would test its values
        write_tables(rows, params.axes, Path(outputs.correlation_csv), Path(outputs.correlation_md),
                     ("reference", *CORRELATION_COLUMNS))
    if hasattr(outputs, "labels_csv"):
        write_labels(rows, Path(outputs.labels_csv))
    stores = {Path(p).parent.name: Path(p) for p in params.stores}
    write_collated_store(rows, stores, params.axes, Path(outputs.store), f"collate {scenario}")


run_logged(snakemake.log[0], collate, snakemake.input, snakemake.output, snakemake.params,  # noqa: F821
           snakemake.wildcards.scenario)  # noqa: F821
