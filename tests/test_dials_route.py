"""The integration route on nbsim's stills (benchmarks/dials_route.py): DIALS from images to a merged MTZ with
anomalous columns (where DIALS is installed), and the scores against a truth: CC(|F|) and CCano* in the
indexing that fits, checked on truths whose answer is known (1, and −1 for swapped Friedel mates)."""

import gemmi
import numpy as np
import pytest

from benchmarks.dials_route import (
    RouteError,
    integrate_and_merge,
    main,
    render_stills,
    score_against_truth,
    write_truth_mtz,
)
from benchmarks.dials_workloads import dials_available

CELL = (40.0, 40.0, 50.0, 90.0, 90.0, 90.0)
GROUP = "P 43 21 2"
HEXAGONAL_CELL = (40.0, 40.0, 60.0, 90.0, 90.0, 120.0)


@pytest.fixture(scope="module")
def hexagonal_truth(tmp_path_factory):
    """A P6₁ truth (its lattice allows a second indexing, k,h,−l) with anomalous differences."""
    path = tmp_path_factory.mktemp("truth") / "truth.mtz"
    write_truth_mtz(path, "P 61", HEXAGONAL_CELL, d_min_A=3.0)
    return path


def _rewritten(source, target, change) -> str:
    """The MTZ `source` with `change(data)` made to its columns, written to `target`."""
    mtz = gemmi.read_mtz_file(str(source))
    data = np.array(mtz.array)
    change(data)
    mtz.set_data(data)
    mtz.write_to_file(str(target))
    return str(target)


def test_the_truth_scores_one_against_itself(hexagonal_truth):
    scores = score_against_truth(hexagonal_truth, hexagonal_truth)
    assert scores["cc"] == pytest.approx(1.0) and scores["cc_anomalous"] == pytest.approx(1.0)
    assert scores["reindexing"] == "x,y,z" and scores["pairs"] > 100
    assert sum(shell["reflections"] for shell in scores["shells"]) == scores["reflections"]


def test_the_other_indexing_is_found(hexagonal_truth, tmp_path):
    """The truth reindexed by k,h,−l (what DIALS may choose for P6₁) scores 1 in the alternative setting and
    about 0 in the given one."""
    mtz = gemmi.read_mtz_file(str(hexagonal_truth))
    mtz.reindex(gemmi.Op("k,h,-l"))
    mtz.write_to_file(str(tmp_path / "reindexed.mtz"))
    scores = score_against_truth(tmp_path / "reindexed.mtz", hexagonal_truth)
    assert scores["reindexing"] != "x,y,z"
    assert scores["cc"] == pytest.approx(1.0) and scores["cc_anomalous"] == pytest.approx(1.0)
    assert abs(scores["cc_by_alternative"]["x,y,z"]) < 0.3


def test_friedel_mates_swapped_give_minus_one(hexagonal_truth, tmp_path):
    """F(+) and F(−) exchanged: the same |F|, the anomalous differences reversed (CCano* is not made positive)."""
    swapped = _rewritten(hexagonal_truth, tmp_path / "swapped.mtz",
                         lambda data: data.__setitem__((slice(None), [3, 5]), data[:, [5, 3]]))
    scores = score_against_truth(swapped, hexagonal_truth)
    assert scores["cc"] == pytest.approx(1.0) and scores["cc_anomalous"] == pytest.approx(-1.0)


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(RouteError, match="contradicts space group"):
        integrate_and_merge([__file__], tmp_path, "P 61", CELL)
    with pytest.raises(RouteError, match="unknown space group"):
        integrate_and_merge([__file__], tmp_path, "P 7", CELL)
    with pytest.raises(RouteError, match="no amplitude"):
        score_against_truth(_intensities_only(tmp_path), tmp_path / "none.mtz")
    assert main([str(tmp_path / "absent.cbf"), "--space_group", GROUP, "--cell", *map(str, CELL),
                 "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no such image" in error and not (tmp_path / "out").exists()


def _intensities_only(folder) -> str:
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(GROUP)
    mtz.add_dataset("x")
    mtz.set_cell_for_all(gemmi.UnitCell(*CELL))
    mtz.add_column("I", "J")
    mtz.set_data(np.array([[1, 2, 3, 10.0]], np.float32))
    mtz.write_to_file(str(folder / "none.mtz"))
    return str(folder / "none.mtz")


@pytest.mark.slow
@pytest.mark.skipif(not dials_available(),
                    reason="DIALS is not installed (dials.import, cctbx.python): apt-get install dials")
def test_route_merges_stills_with_anomalous_columns(tmp_path):
    """Five 256² stills of a P4₃2₁2 crystal through import, spot finding, indexing, integration, scaling and
    merging: every still indexed, a merged MTZ of the space group with F(+)/F(−), amplitudes that follow the
    truth (measured on these five: see docs/dials_route.md)."""
    truth = tmp_path / "truth.mtz"
    write_truth_mtz(truth, GROUP, CELL)
    images = render_stills(tmp_path / "stills", 5, truth, CELL)
    record = integrate_and_merge(images, tmp_path / "route", GROUP, CELL, anomalous=True)
    assert record["indexed_images"] == record["integrated_images"] == len(images)
    assert record["indexed_spots"] >= 0.9 * record["strong_spots"]
    assert not record["ambiguity_resolved"]  # P4₃2₁2's lattice has no second indexing
    mtz = gemmi.read_mtz_file(record["mtz"])
    assert {"F(+)", "SIGF(+)", "F(-)", "SIGF(-)", "DANO"} <= {column.label for column in mtz.columns}
    assert mtz.spacegroup.hm == GROUP
    scores = score_against_truth(record["mtz"], truth)
    assert scores["cc"] > 0.2 and scores["pairs"] > 10
