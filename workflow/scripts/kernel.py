"""Snakemake script: one structure's compiled kernels made ready in the shared cache (nbsim.sweep.jobs.build_kernel)."""

from pathlib import Path

from nbsim.sweep.jobs import build_kernel
from nbsim.sweep.plan import KernelJob
from nbsim.sweep.progress import run_logged

params = snakemake.params.kernel  # noqa: F821
run_logged(snakemake.log[0], build_kernel, KernelJob(**params["job"]), snakemake.threads,  # noqa: F821
           params["compile_cache"], Path(snakemake.output[0]))  # noqa: F821
