"""A `merge:` section runs `nbsim merge` as the pipeline's last rule (issue 38): a tiny dataset (three 64² Poisson
stills of a small P 2₁2₁2₁ cell with anomalous differences) merged from its first 2 shots in one cycle, and the
merge's CC and CCano* by resolution shell collated into tables/merge.csv and sweep.zarr."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess

import gemmi
import numpy as np
import pytest
import xarray as xr
import yaml

from nbsim.io.structure_files import expand_to_p1_sphere, write_hkl
from nbsim.sweep.merging import prepare_merge

from .conftest import own_cache_env, snakemake_command

CELL = (20.0, 24.0, 28.0, 90.0, 90.0, 90.0)
SHELLS = 2


def _truth(path) -> None:
    """Random |F| of P 2₁2₁2₁ to 1.5 Å, F(−) of each acentric reflection 15 % off F(+), as P1 text."""
    group = gemmi.SpaceGroup("P 21 21 21")
    miller = np.asarray(gemmi.make_miller_array(gemmi.UnitCell(*CELL), group, 1.5, 0, True), np.int64)
    rng = np.random.default_rng(1)
    plus = rng.rayleigh(100, len(miller)) + 5
    centric = np.asarray(group.operations().centric_flag_array(miller.astype(np.int32)), bool)
    minus = np.where(centric, plus, plus * (1 + 0.15 * rng.standard_normal(len(miller))).clip(0.5))
    write_hkl(path, expand_to_p1_sphere(miller, plus, minus, group))


@pytest.mark.slow
def test_a_merge_section_merges_each_experiment_and_collates_its_scores(tmp_path):
    _truth(tmp_path / "truth.hkl")
    config = {
        "results": "results", "compile_cache": "results/compile-cache", "reference": False,
        "scenarios": {"tiny": {"description": "three stills of a small cell",
                               "args": "-hkl truth.hkl -cell 20 24 28 90 90 90 -N 10 -lambda 1 -distance 14 "
                                       "-pixel 0.1 -oversample 1 -fluence 1e27"}},
        "sweep": {"sizes": [64], "dtypes": ["float32"], "devices": ["cpu"], "compile": ["off"], "batch_size": 3,
                  "draws": {"count": 3, "seed": 4, "values": {"-misset": "random"}},
                  "detector": {"noise": "poisson"}},
        "merge": {"space_group": "P212121", "start": {"perturb": {"orientation_deg": 0.05}, "correlation": 0.5},
                  "refine": ["scale"], "cycles": 1, "shots": [2],
                  "options": f"--shoebox 5 --spots 40 --shells {SHELLS}"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    targets = ["results/tiny/tables/merge.csv", "results/tiny/sweep.zarr"]
    result = subprocess.run([*snakemake_command(tmp_path), "--cores", "2", *targets], capture_output=True, text=True,
                            timeout=600, env=own_cache_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]

    folder = tmp_path / "results" / "tiny" / "merge" / "n64-float32-cpu-compile_off"
    with open(tmp_path / targets[0]) as stream:
        rows = list(csv.DictReader(stream))
    assert [(row["shots"], row["shell"]) for row in rows] == [("2", str(shell)) for shell in range(SHELLS + 1)]
    merge = folder / "shots_2"
    merged = json.loads((merge / "merged.json").read_text())
    assert [shot["image"].rsplit("#", 1)[1] for shot in merged["shots"]] == \
        [f"n64-float32-cpu-compile_off-draw_{draw}" for draw in (0, 1)]  # the first two shots, in draw order
    assert set(json.loads((merge / "starts.json").read_text())["images"]) == {shot["image"] for shot in merged["shots"]}
    last = merged["cycles"][-1]
    assert last["cycle"] == 1 and merged["anomalous"]
    assert [float(row["cc"]) for row in rows] == pytest.approx([last["cc"], *last["cc_by_shell"]], nan_ok=True)
    assert [float(row["cc_anomalous"]) for row in rows] == pytest.approx(
        [last["cc_anomalous"], *last["cc_anomalous_by_shell"]], nan_ok=True)
    assert math.isfinite(last["cc"]) and float(rows[0]["start_cc"]) == pytest.approx(merged["cycles"][0]["cc"])
    assert all(row["shots_merged"] == "2" and row["space_group"] == "P 21 21 21" for row in rows)
    collated = xr.open_zarr(tmp_path / targets[1])
    point = collated.sel(size=64, dtype="float32", device="cpu", compile="off", merge_shots=2)
    assert float(point.merge_cc) == pytest.approx(last["cc"]) and collated.merge_shots.values.tolist() == [2]
    assert point.merge_cc_anomalous_by_shell.values.tolist() == pytest.approx(last["cc_anomalous_by_shell"],
                                                                              nan_ok=True)
    assert (merge / "report.png").stat().st_size > 0
    labels = [column.label for column in gemmi.read_mtz_file(str(merge / "merged.mtz")).columns]
    assert labels[3:] == ["F(+)", "SIGF(+)", "F(-)", "SIGF(-)"]
    assert collated.image.sizes["draw"] == 3 and not (folder / "shots_3").exists()


def _experiment(folder) -> None:
    """An experiment's merge inputs as merge_inputs writes them (three shots; the files need not exist)."""
    folder.mkdir()
    shots = [f"store.zarr#d{index}" for index in range(3)]
    (folder / "shots.txt").write_text("".join(f"{shot}\n" for shot in shots))
    (folder / "starts.json").write_text(json.dumps({"images": {shot: {"misset": [index, 0, 0]}
                                                               for index, shot in enumerate(shots)}}))
    (folder / "merge.json").write_text(json.dumps({
        "arguments": ["--starts", str(folder / "starts.json"), "--hkl", "start.mtz", "--space_group", "P212121"],
        "flags": ["-cell", "20", "24", "28", "90", "90", "90"]}))


def test_a_merge_takes_the_first_shots_their_starts_and_resumes_only_its_own_checkpoint(tmp_path):
    folder = tmp_path / "experiment"
    _experiment(folder)
    settings = {"refine": ["scale"], "cycles": 2, "workers": 1, "options": "--shells 3"}
    command = prepare_merge(folder, 2, settings)
    output = folder / "shots_2"
    assert command == ["merge", "store.zarr#d0", "store.zarr#d1", "--starts", str(output / "starts.json"), "--hkl",
                       "start.mtz", "--space_group", "P212121", "--refine", "scale", "--cycles", "2", "--workers", "1",
                       "--shells", "3", "--mtz", str(output / "merged.mtz"), "--json", str(output / "merged.json"),
                       "--report", str(output / "report.html"), "--", "-cell", "20", "24", "28", "90", "90", "90"]
    assert json.loads((output / "starts.json").read_text()) == {"images": {"store.zarr#d0": {"misset": [0, 0, 0]},
                                                                           "store.zarr#d1": {"misset": [1, 0, 0]}}}
    checkpoint = output / "merged.mtz.checkpoint"
    checkpoint.write_text("a killed merge's state")
    assert prepare_merge(folder, 2, settings) == command and checkpoint.exists()  # the same merge resumes
    prepare_merge(folder, 2, {**settings, "refine": ["scale", "N"]})
    assert not checkpoint.exists()  # another merge's: it would refuse to start from it
    checkpoint.write_text("a killed merge's state")
    os.utime(checkpoint, ns=(1, 1))  # older than the experiment's inputs: written for inputs since rewritten
    prepare_merge(folder, 2, {**settings, "refine": ["scale", "N"]})
    assert not checkpoint.exists()
