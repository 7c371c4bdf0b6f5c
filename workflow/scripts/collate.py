"""Snakemake script: a scenario's tables (CSV with every digit; Markdown and HTML rounded for reading) and
collated store (nbsim.sweep.collate, nbsim.sweep.report)."""

import logging
from pathlib import Path

from nbsim.sweep.collate import (
    CORRELATION_COLUMNS,
    TIMING_COLUMNS,
    empty_shots,
    point_rows,
    write_collated_store,
    write_labels,
    write_table,
)
from nbsim.sweep.fitting import fit_rows
from nbsim.sweep.merging import merge_rows
from nbsim.sweep.progress import run_logged
from nbsim.sweep.report import CORRELATION_VIEW, TIMING_VIEW, write_reader_tables


def collate(inputs, outputs, params, scenario) -> None:
    rows = point_rows([Path(p) for p in inputs.records], [Path(p) for p in inputs.references])
    empty = empty_shots(rows, params.min_photons)
    if empty:
        logging.getLogger("nbsim.sweep").warning("nbsim: warning: %s: %s", scenario, empty)
    write_table(rows, params.axes, Path(outputs.timing_csv), TIMING_COLUMNS)
    write_reader_tables(rows, params.axes, TIMING_VIEW, Path(outputs.timing_md), Path(outputs.timing_html),
                        f"{scenario}: timing")
    if hasattr(outputs, "correlation_csv"):  # a Namedlist: `in` would test its values
        write_table(rows, params.axes, Path(outputs.correlation_csv), ("reference", *CORRELATION_COLUMNS))
        write_reader_tables(rows, params.axes, CORRELATION_VIEW, Path(outputs.correlation_md),
                            Path(outputs.correlation_html), f"{scenario}: agreement with the reference")
    if hasattr(outputs, "labels_csv"):
        write_labels(rows, Path(outputs.labels_csv))
    stores = {Path(p).parent.name: Path(p) for p in params.stores}
    fits = fit_rows([Path(p) for p in inputs.fits])
    merges = merge_rows([Path(p) for p in inputs.merges])
    write_collated_store(rows, stores, params.axes, Path(outputs.store), f"collate {scenario}", fits, merges)


run_logged(snakemake.log[0], collate, snakemake.input, snakemake.output, snakemake.params,  # noqa: F821
           snakemake.wildcards.scenario)  # noqa: F821
