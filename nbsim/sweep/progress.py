"""Progress of a long job: points done / total, rate and time left, in its log and on the terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """Reports at most every `every_s` seconds, and once at the end, to stdout (a job's log under
    nbsim.sweep.jobs.run_logged) and to the process's own stderr (the terminal of a local run, the
    job's output file on SLURM)."""

    def __init__(self, total: int, label: str, every_s: float = 5.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done = 0
        self.started = self.reported = time.perf_counter()

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = time.perf_counter()
        if self.done >= self.total or now - self.reported >= self.every_s:
            self.reported = now
            self._report(now - self.started)

    def _report(self, elapsed_s: float) -> None:
        rate = self.done / elapsed_s if elapsed_s > 0 else float("inf")
        left = f", {(self.total - self.done) / rate:.0f} s left" if 0 < rate < float("inf") and self.done < self.total \
            else ""
        line = f"{self.label}: {self.done}/{self.total} points, {rate:.1f} points/s{left}"
        print(line, flush=True)
        if sys.__stderr__ is not None and sys.__stderr__ is not sys.stdout:
            print(line, file=sys.__stderr__, flush=True)
