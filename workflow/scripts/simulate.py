"""Snakemake script: render and time one batch of points against its reference batch, if any
(nbsim.sweep.jobs.run_batch)."""

from pathlib import Path

from nbsim.sweep.jobs import run_batch
from nbsim.sweep.progress import run_logged
from nbsim.sweep.spec import BatchJob

reference = snakemake.input.reference  # noqa: F821
run_logged(snakemake.log[0], run_batch, BatchJob.from_dict(snakemake.params.job),  # noqa: F821
           Path(snakemake.params.store), Path(snakemake.output.records),  # noqa: F821
           Path(reference).with_name("images.zarr") if reference else None)
