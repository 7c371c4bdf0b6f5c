"""Snakemake script: render and time one sweep point (nbsim.sweep.run_point)."""

from pathlib import Path

from nbsim.sweep import PointJob, run_logged, run_point

run_logged(snakemake.log[0], run_point, PointJob(**snakemake.params.job),  # noqa: F821
           Path(snakemake.output.store), Path(snakemake.output.timing))  # noqa: F821
