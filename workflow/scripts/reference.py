"""Snakemake script: the reference image of a (scenario, size, extras) point (nbsim.sweep.run_reference)."""

from pathlib import Path

from nbsim.sweep import run_logged, run_reference

job = snakemake.params.job  # noqa: F821
run_logged(snakemake.log[0], run_reference, job["args"], job["overrides"], job["c_binary"], job["compile"],  # noqa: F821
           job["warmup"], job["repeats"], job["threads"], job["compile_cache"], Path(snakemake.output.store),  # noqa: F821
           Path(snakemake.output.timing))  # noqa: F821
