"""Snakemake script: an experiment's merge inputs (nbsim.sweep.merging.write_merge_inputs)."""

from pathlib import Path

from nbsim.sweep.merging import write_merge_inputs
from nbsim.sweep.progress import run_logged

run_logged(snakemake.log[0], write_merge_inputs, [Path(p) for p in snakemake.input.records],  # noqa: F821
           snakemake.params.names, snakemake.params.drawn, snakemake.params.settings,  # noqa: F821
           Path(snakemake.output.manifest).parent)  # noqa: F821
