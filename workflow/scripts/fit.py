"""Snakemake script: fit one chunk of a batch's shots (nbsim.sweep.fitting.run_fit_job)."""

from pathlib import Path

from nbsim.sweep.fitting import FitJob, run_fit_job
from nbsim.sweep.progress import run_logged

run_logged(snakemake.log[0], run_fit_job, FitJob.from_dict(snakemake.params.job),  # noqa: F821
           Path(snakemake.params.store), Path(snakemake.output.fits))  # noqa: F821
