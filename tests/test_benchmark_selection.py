"""benchmarks/run.py's default selection: every workload but the hours-long ones (merge_sad), which run when
named (their target's size) or with --quick (their smoke runs); `--list` says what the options run (issue 38)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO_ROOT


def _listed(*options: str) -> list[str]:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), "--list", *options],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


@pytest.mark.parametrize(("options", "merge_sad"), [((), False), (("--quick",), True),
                                                    (("--only", "merge_sad"), True)])
def test_the_hours_long_merge_runs_only_when_named_or_quick(options, merge_sad):
    listed = _listed(*options)
    assert ("merge_sad" in listed) is merge_sad
    if not options:
        assert {"seed_f32", "dataset_10k", "fit_100_stills"} <= set(listed)
    if "--only" in options:
        assert listed == ["merge_sad"]
