"""A job's log and progress, through `logging`: every nbsim record goes to the rule's log file; progress
lines and errors also go to stderr (the terminal of a local run, the job's output file on SLURM)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import NbsimError

log = logging.getLogger(__name__)


class Progress:
    """Points (or other `unit`s) done / total, rate and time left, logged at most every `every_s` seconds and
    once at the end."""

    def __init__(self, total: int, label: str, every_s: float = 5.0, unit: str = "points"):
        self.total, self.label, self.every_s, self.unit = total, label, every_s, unit
        self.done = 0
        self.started = self.reported = time.perf_counter()

    def advance(self, count: int = 1) -> None:
        """Count `count` more done; log the progress when it is due or complete."""
        self.done += count
        now = time.perf_counter()
        if self.done >= self.total or now - self.reported >= self.every_s:
            self.reported = now
            self._report(now - self.started)

    def _report(self, elapsed_s: float) -> None:
        rate = self.done / elapsed_s if elapsed_s > 0 else float("inf")
        left = f", {(self.total - self.done) / rate:.0f} s left" if 0 < rate < float("inf") and self.done < self.total \
            else ""
        log.info("%s: %d/%d %s, %.1f %s/s%s", self.label, self.done, self.total, self.unit, rate, self.unit, left)


def _on_the_terminal(record: logging.LogRecord) -> bool:
    """Progress, one-line warnings and errors; a traceback goes to the log only (Python prints it on stderr
    itself)."""
    return record.exc_info is None and (record.name == log.name or record.levelno >= logging.WARNING)


@contextmanager
def job_log(log_path: str | Path) -> Iterator[None]:
    """While a job runs: nbsim's records (and Python warnings) into its log file, progress and errors on
    stderr too."""
    to_file = logging.FileHandler(log_path, mode="w")
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.addFilter(_on_the_terminal)
    loggers = [logging.getLogger("nbsim"), logging.getLogger("py.warnings")]
    logging.captureWarnings(True)
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(to_file)
        logger.propagate = False
    loggers[0].addHandler(to_terminal)
    try:
        yield
    finally:
        loggers[0].removeHandler(to_terminal)
        for logger in loggers:
            logger.removeHandler(to_file)
            logger.propagate = True
        logging.captureWarnings(False)
        to_file.close()


def run_logged(log_path: str | Path, work: Callable[..., object], *args: object) -> None:
    """Run one job's work under `job_log`; a bad input ends it with a one-line reason (in the log and on
    stderr) and exit status 1 instead of a traceback. Anything else is a bug: its traceback goes to the log
    as well as to stderr."""
    with job_log(log_path):
        try:
            work(*args)
        except NbsimError as error:
            log.error("nbsim: error: %s", error)
            sys.exit(1)
        except Exception:
            log.exception("nbsim: unexpected error")
            raise
