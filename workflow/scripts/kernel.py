"""Snakemake script: build one compiled CPU kernel variant into the shared cache (nbsim.sweep.build_kernel)."""

from pathlib import Path

from nbsim.sweep import build_kernel, run_logged

job = snakemake.params.job  # noqa: F821
run_logged(snakemake.log[0], build_kernel, job["args"], job["overrides"], job["dtype"], snakemake.threads,  # noqa: F821
           job["compile_cache"], Path(snakemake.output[0]))  # noqa: F821
