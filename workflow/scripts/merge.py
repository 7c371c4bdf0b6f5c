"""Snakemake script: one merge of an experiment's shots, `nbsim merge` with the arguments of
nbsim.sweep.merging.prepare_merge, its output in the rule's log."""

import os
import subprocess
import sys
from pathlib import Path

from nbsim.errors import NbsimError
from nbsim.sweep.merging import prepare_merge
from nbsim.sweep.progress import log, run_logged


def merge(folder: Path, count: int, settings: dict) -> None:
    command = [sys.executable, "-m", "nbsim.cli", *prepare_merge(folder, count, settings)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(settings["threads"])}
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=environment) as process:
        for line in process.stdout:
            log.info("%s", line.rstrip("\n"))
            lines.append(line.strip())
    if process.returncode != 0:
        raise NbsimError(f"nbsim merge exited {process.returncode}: {(lines or ['no output'])[-1]}")


run_logged(snakemake.log[0], merge, Path(snakemake.input.manifest).parent,  # noqa: F821
           snakemake.params.shots, snakemake.params.settings)  # noqa: F821
