"""An SAD experiment as a dataset (config/examples/merge_sad.yaml's `merge:` section, nbsim.sweep.merging) and the
`merge_sad` benchmark (benchmarks/merge_workloads.py): the merge's inputs as written, the benchmark's record at a
tiny size, and its correlations recomputed here from the files it scored."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import gemmi
import numpy as np
import pytest
import yaml
from scipy.spatial.transform import Rotation

from benchmarks import merge_workloads
from nbsim.errors import NbsimError
from nbsim.sweep.merging import scrambled, shared_flags, structure_space_group
from nbsim.sweep.validate import validate_config

from .conftest import REPO_ROOT, own_cache_env, snakemake_command

SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
EXAMPLE = REPO_ROOT / "config" / "examples" / "merge_sad.yaml"


@pytest.mark.parametrize("target", [0.3, 0.5, 0.9, 1.0])
def test_the_poor_start_has_the_asked_correlation(target):
    amplitudes = np.random.default_rng(2).rayleigh(100.0, 3000)
    start = scrambled(amplitudes, target, np.random.default_rng(5))
    assert np.all(start > 0)
    assert np.corrcoef(start, amplitudes)[0, 1] == pytest.approx(target, abs=1e-4)


def test_the_shared_flags_leave_out_structure_factors_draws_and_orientation():
    argv = ("-model", "m.pdb", "-anomalous", "-lambda", "0.98", "-cell", "50", "60", "70", "90", "90", "90",
            "-detpixels", "128", "-N", "9", "-sampling", "advised", "-mosaic_seed", "3", "-misset", "1.5", "2", "3")
    assert shared_flags(argv, ["-N", "-misset", "spectrum"]) == [
        "-lambda", "0.98", "-cell", "50", "60", "70", "90", "90", "90", "-detpixels", "128", "-sampling", "advised",
        "-nointerpolate"]


def _example(**merge) -> dict:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["sweep"]["draws"]["count"] = 2
    config["merge"].update(merge)
    return config


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["sweep"].pop("draws") and c.update(timing={"warmup": 0, "repeats": 0, "threads": 1}),
     "merge: needs shots drawn at random (sweep.draws)"),
    (lambda c: c["scenarios"]["sad"].update(args="-default_F 100 -cell 50 60 70 90 90 90 -distance 100"),
     "merge: scenario 'sad' has no -model or -hkl: no truth to merge towards"),
    (lambda c: c["merge"].update(space_group="P 7"), "merge.space_group: unknown space group 'P 7'"),
    (lambda c: c["merge"].update(shots=[1, 5]), "merge.shots: 5 is more than the 2 shots drawn (sweep.draws.count)"),
])
def test_a_bad_merge_section_is_one_line(change, message):
    config = _example()
    change(config)
    with pytest.raises(NbsimError) as error:
        validate_config(config, SCHEMA, EXAMPLE.parent)
    assert str(error.value) == message


@pytest.mark.parametrize(("name", "group", "cell"), [
    ("merge_sad.yaml", "P 21 21 21", (50, 60, 70, 90, 90, 90)),
    ("merge_zn_p61.yaml", "P 61", (45, 45, 110, 90, 90, 120)),
    ("merge_s_p43212.yaml", "P 43 21 2", (40, 40, 64, 90, 90, 90)),
])
def test_each_crystals_example_is_a_valid_merge_of_its_models_group(name, group, cell):
    """The SAD examples of other crystals (docs/merging.md, "Other crystals") validate as datasets with a merge:
    their model names its space group and cell, which the merge takes."""
    path = REPO_ROOT / "config" / "examples" / name
    config = yaml.safe_load(path.read_text())
    config["sweep"]["draws"]["count"] = 2
    validate_config(config, SCHEMA, path.parent)
    (scenario,) = config["scenarios"].values()
    model = str(path.parent / scenario["args"].split("-model ")[1].split()[0])
    assert structure_space_group(model, True) == group
    assert gemmi.read_structure(model).cell.parameters == pytest.approx(cell)


@pytest.mark.slow
def test_the_pipeline_writes_each_experiments_merge_inputs_after_its_shots(tmp_path):
    """A dry run of the example, shrunk: one merge_inputs job, after the batch, writing the files nbsim merge
    reads (its function is run by the benchmark below), then the merge of the experiment's two shots and the table
    (tests/test_merge_workflow.py runs them)."""
    config = _example()
    config.update(results="results", compile_cache="results/compile-cache")
    config["scenarios"]["sad"]["args"] = config["scenarios"]["sad"]["args"].replace(
        "model_se.pdb", str(EXAMPLE.parent / "model_se.pdb"))
    config["sweep"].update(sizes=[64], compile=["off"], batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([*snakemake_command(tmp_path), "--cores", "2", "--dry-run"], capture_output=True,
                            text=True, timeout=300, env=own_cache_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    shown = result.stdout + result.stderr
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", shown, re.M))
    assert jobs["simulate"] == "1" and jobs["merge_inputs"] == "1" and jobs["merge"] == "1"
    assert jobs["merge_table"] == "1"
    folder = "results/sad/merge/n64-float32-cpu-compile_off"
    assert all(f"{folder}/{name}" in shown for name in
               ("truth.mtz", "start.mtz", "starts.json", "shots.txt", "flags.txt", "merge.json",
                "shots_2/merged.mtz", "shots_2/report.png"))


def test_the_scorer_maps_friedel_mates_into_the_asymmetric_unit(tmp_path):
    """An MTZ listing reflections at their Friedel mates (another program's convention) scores as one listing
    them in the asymmetric unit: each row's halves are swapped where the mapping inverts the index."""
    group = gemmi.SpaceGroup("P 21 21 21")
    miller = np.array([[1, 2, 3], [2, 1, 4], [3, 3, 1], [1, 4, 2], [2, 3, 5]])
    plus, minus = np.array([10.0, 20.0, 15.0, 30.0, 12.0]), np.array([8.0, 23.0, 14.0, 27.0, 13.0])

    def write(path, rows, first, second):
        mtz = gemmi.Mtz(with_base=True)
        mtz.spacegroup = group
        mtz.set_cell_for_all(gemmi.UnitCell(50, 60, 70, 90, 90, 90))
        mtz.add_dataset("test")
        for label, kind in (("F(+)", "G"), ("SIGF(+)", "L"), ("F(-)", "G"), ("SIGF(-)", "L")):
            mtz.add_column(label, kind)
        zeros = np.zeros(len(rows))
        mtz.set_data(np.column_stack([rows, first, zeros, second, zeros]).astype(np.float32))
        mtz.write_to_file(str(path))

    write(tmp_path / "truth.mtz", miller, plus, minus)
    write(tmp_path / "mates.mtz", -miller, minus, plus)  # F(+) of -h is F(-) of h
    assert merge_workloads.read_amplitudes(str(tmp_path / "mates.mtz")) == \
        merge_workloads.read_amplitudes(str(tmp_path / "truth.mtz"))
    scores = merge_workloads.score(str(tmp_path / "mates.mtz"), str(tmp_path / "truth.mtz"), shells=1)
    assert scores["cc"] == pytest.approx(1.0) and scores["cc_anomalous"] == pytest.approx(1.0)
    assert scores["anomalous_pairs"] == 5


def _halves(path: str) -> dict[tuple[int, int, int], tuple[float, float, float, float]]:
    """F(+), F(-), SIGF(+), SIGF(-) (FP, FP, SIGFP, SIGFP) by index, as written."""
    mtz = gemmi.read_mtz_file(path)
    labels = [column.label for column in mtz.columns]
    names = ("F(+)", "F(-)", "SIGF(+)", "SIGF(-)") if "F(+)" in labels else ("FP", "FP", "SIGFP", "SIGFP")
    data = np.asarray(mtz.array)
    return {tuple(int(v) for v in row[:3]): tuple(float(row[labels.index(name)]) for name in names) for row in data}


@pytest.mark.slow
def test_the_merge_sad_benchmark_at_a_tiny_size(tmp_path):
    """Two shots of 96² (the example's pixels, a 5-channel spectrum), one cycle: the record holds what the issue
    asks for, the inputs are as configured, and its CC and CCano* are the correlations of the files it names
    (recomputed here), the start's about the 0.5 asked; no target is asserted at this size."""
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "merge_workloads.py"), "merge_sad", "--quick", "--shots", "2",
         "--size", "96", "--cycles", "1", "--workers", "1", "--threads", "1", "--probe-shots", "1", "--no-dials",
         "--work", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    record = json.loads(completed.stdout.strip().splitlines()[-1])
    assert record["shots"] == 2 and record["detector"] == "96²" and record["workers"] == 1
    assert record["dials"] == {"skipped": "--no-dials"}
    for key in ("render_s", "inputs_s", "merge_s", "merge_cpu_s", "seconds_per_shot_refinement",
                "seconds_per_F_gradient_per_shot", "projected_target_s", "projected_target_cpu_s"):
        assert record[key] > 0, key
    assert "--workers" in record["merge_command"] and "--anomalous" in record["merge_command"]
    assert 12616 < record["energy_eV"] < 12706  # the two spectra's weighted means, across the Se K edge
    assert record["start_correlation"] == pytest.approx(0.5, abs=1e-4)
    assert len(record["by_shell"]) == merge_workloads.SHELLS
    assert sum(shell["reflections"] for shell in record["by_shell"]) == record["measured_reflections"] > 0
    assert record["resolution_A"] == record["cycles"][-1]["resolution_A"]  # the merge's own, from its signal
    within = [shell["cc"] for shell in record["by_shell"] if record["resolution_A"] is not None
              and shell["d_min_A"] >= record["resolution_A"] * (1 - merge_workloads.RESOLUTION_TOLERANCE)]
    assert record["shells_to_resolution"] == len(within)
    assert record["cc_lowest_shell_to_resolution"] == (min(within) if within else None)

    folder = next((tmp_path / "sad" / "merge").iterdir())
    truth_mtz = gemmi.read_mtz_file(str(folder / "truth.mtz"))
    assert [c.label for c in truth_mtz.columns][3:] == ["F(+)", "SIGF(+)", "F(-)", "SIGF(-)"]
    assert truth_mtz.spacegroup.hm == "P 21 21 21"
    assert truth_mtz.cell.parameters == pytest.approx((50, 60, 70, 90, 90, 90))
    assert [c.label for c in gemmi.read_mtz_file(str(folder / "start.mtz")).columns][3:] == ["FP", "SIGFP"]
    starts = json.loads((folder / "starts.json").read_text())["images"]
    records = json.loads(next((tmp_path / "sad" / "batches").glob("*/records.json")).read_text())["points"]
    for entry, (shot, start) in zip(records, starts.items(), strict=True):
        assert shot.endswith(f"{entry['name']}.cbf") and set(start) == {"misset", "cell", "N", "spectrumfile"}
        truth = Rotation.from_euler("xyz", entry["config"]["crystal"]["misset_deg"], degrees=True)
        moved = Rotation.from_euler("xyz", start["misset"], degrees=True)
        assert (moved * truth.inv()).magnitude() == pytest.approx(math.radians(0.1), rel=1e-6)
        assert sorted(abs(a / b - 1) for a, b in zip(start["cell"][:3], (50, 60, 70), strict=True)) == \
            pytest.approx([0.005] * 3)
        assert start["N"] == entry["config"]["crystal"]["n_cells"][0]

    group = truth_mtz.spacegroup.operations()
    merged, truth, began = (_halves(str(folder / name)) for name in ("merged.mtz", "truth.mtz", "start.mtz"))
    indices = [h for h in merged if any(math.isfinite(v) for v in merged[h])]
    centric = dict(zip(indices, group.centric_flag_array(np.array(indices, np.int32)), strict=True))
    ours, true, start_F, strong = [], [], [], []
    for h in indices:
        for half in (0,) if centric[h] else (0, 1):
            if math.isfinite(merged[h][half]):
                ours.append(merged[h][half]), true.append(truth[h][half]), start_F.append(began[h][half])
                strong.append(merged[h][half] >= merge_workloads.STRONG_SIGMAS * merged[h][half + 2])
    assert record["cc"] == pytest.approx(float(np.corrcoef(ours, true)[0, 1]), abs=1e-9)
    assert record["strong"] == sum(strong)
    if sum(strong) >= 3:
        assert record["cc_strong"] == pytest.approx(
            float(np.corrcoef(np.array(ours)[strong], np.array(true)[strong])[0, 1]), abs=1e-9)
    assert record["start_cc"] == pytest.approx(float(np.corrcoef(start_F, true)[0, 1]), abs=1e-9)
    assert 0.2 < record["start_cc"] < 0.8 and record["cc"] < 1 - 1e-6
    pairs = [h for h in indices if not centric[h] and all(math.isfinite(v) for v in merged[h])]
    assert record["anomalous_pairs"] == len(pairs)
    if len(pairs) < 3:
        assert record["cc_anomalous"] is None
    else:
        differences = [[merged[h][0] - merged[h][1] for h in pairs], [truth[h][0] - truth[h][1] for h in pairs]]
        assert record["cc_anomalous"] == pytest.approx(float(np.corrcoef(*differences)[0, 1]), abs=1e-9)
