"""Snakemake script: one point against its reference (nbsim.sweep.compare_point)."""

from pathlib import Path

from nbsim.sweep import compare_point, run_logged

run_logged(snakemake.log[0], compare_point, Path(snakemake.input.store), Path(snakemake.input.reference),  # noqa: F821
           Path(snakemake.output[0]))  # noqa: F821
