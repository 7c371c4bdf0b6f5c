"""The `cli_answers` benchmark workload (run by benchmarks/run.py): how fast a new `nbsim` process answers
what the arguments alone decide — help, an unknown flag, a non-physical value, a missing file — with no
worker running. Each answer is timed as a whole process (the installed `nbsim` command), 5 times."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workloads import SEED_ARGS

ANSWER_MAX_S = 0.5
SEED = [*SEED_ARGS, "-detpixels", "64"]
ANSWERS = {
    "help": ["-h"],
    "unknown flag": [*SEED, "-bogus"],
    "non-physical value": [*SEED, "-lambda", "0"],
    "missing file": [*SEED, "-hkl", "absent.hkl"],
}
RUNS = 5


def run_cli_answers(quick: bool, folder: Path) -> dict:
    command = [str(Path(sys.executable).with_name("nbsim"))]
    environment = {**os.environ, "NBSIM_WORKER": "off"}
    result = {}
    for name, arguments in ANSWERS.items():
        times = []
        for _ in range(2 if quick else RUNS):
            begin = time.perf_counter()
            completed = subprocess.run([*command, *arguments], cwd=folder, capture_output=True, text=True,
                                       env=environment)
            times.append(time.perf_counter() - begin)
        expected = 0 if name == "help" else 2
        if completed.returncode != expected:
            return {"error": f"{name}: exit status {completed.returncode}"}
        result[name] = {"median_s": statistics.median(times), "times_s": times}
    return {"command": [*command, "<arguments>"], "result": result}


def answers_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    return "met" if all(r["median_s"] <= ANSWER_MAX_S for r in record["result"].values()) else "NOT met"


def answers_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    return f"| {name} | " + "; ".join(f"{answer} {r['median_s']:.2f} s" for answer, r in record["result"].items()) \
        + " (median of whole processes) |"


ANSWER_WORKLOADS = {
    "cli_answers": (run_cli_answers, answers_verdict, answers_row, f"each answer <= {ANSWER_MAX_S:g} s"),
}
