"""Snakemake script: render and time one batch of reference images (nbsim.sweep.jobs.run_batch)."""

from pathlib import Path

from nbsim.sweep.jobs import run_batch
from nbsim.sweep.progress import run_logged
from nbsim.sweep.spec import BatchJob

run_logged(snakemake.log[0], run_batch, BatchJob.from_dict(snakemake.params.job),  # noqa: F821
           Path(snakemake.params.store), Path(snakemake.output.records))  # noqa: F821
