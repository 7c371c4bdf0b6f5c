"""Snakemake script: a scenario's merges as one table, CC and CCano* by resolution shell
(nbsim.sweep.merging.merge_rows)."""

from pathlib import Path

from nbsim.sweep.collate import write_table
from nbsim.sweep.merging import MERGE_COLUMNS, merge_rows
from nbsim.sweep.progress import run_logged


def merge_table(inputs, outputs, params) -> None:
    write_table(merge_rows([Path(p) for p in inputs.merges]), params.axes, Path(outputs.csv), MERGE_COLUMNS)


run_logged(snakemake.log[0], merge_table, snakemake.input, snakemake.output, snakemake.params)  # noqa: F821
