"""DIALS in the loop: a rotation series of the shipped model, rendered with the φ steps nbsim advises,
through dials.import → find_spots → index → refine → integrate → scale → merge, checked against the truth
in the miniCBF header (benchmarks/dials_workloads.py holds the chain and the checks; benchmarks/run.py
--only dials_chain runs a larger series)."""

import pytest

from benchmarks.dials_workloads import LIMITS, dials_available, failures, run_dials_chain


@pytest.mark.slow
@pytest.mark.skipif(not dials_available(),
                    reason="DIALS is not installed (dials.import, cctbx.python): apt-get install dials")
def test_dials_processes_a_rotation_series_as_simulated(tmp_path):
    record = run_dials_chain(True, tmp_path)
    assert set(record["metrics"]) == set(LIMITS)
    assert failures(record["metrics"]) == [], record["metrics"]


def test_checks_fail_outside_the_limits():
    """The checks are not vacuous: each metric just past its limit is reported."""
    for name, limit in LIMITS.items():
        good = {key: (1.0 if key in ("indexed_fraction", "intensity_correlation") else 0.0) for key in LIMITS}
        good[name] = limit * (0.99 if name in ("indexed_fraction", "intensity_correlation") else 1.01)
        assert [line.split()[0] for line in failures(good)] == [name]
