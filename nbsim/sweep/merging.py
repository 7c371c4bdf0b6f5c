"""A dataset as a merging experiment: the `merge:` section of a dataset config writes, beside its labels, what
`nbsim merge` needs to merge its shots and what to score the merge against (docs/sweeps.md, "Merging a
dataset").

An *experiment* is the shots of one scenario that share every axis but the draw (a dataset of one size,
dtype, device and compile setting is one experiment). For each, in `results/<scenario>/merge/<experiment>/`:

* `truth.mtz`: the true |F| of the space group's asymmetric unit at the energy the merge models, one table
  for every shot: the mean over the shots of each shot's spectrum-weighted mean energy (a shot without a
  spectrum: its wavelength's). A `-model -anomalous` gives F(+) and F(−) there (f′, f″ at that energy), as
  `F(+)`, `SIGF(+)`, `F(-)`, `SIGF(-)`; a table without anomalous differences as `FP`, `SIGFP`. The sigmas
  are 0: a truth has no error.
* `start.mtz`: a poor starting |F| (`FP`, `SIGFP` 0): the truth's mean of F(+) and F(−) (no anomalous
  differences) times exp(σ·z), z a standard normal per reflection, σ chosen so that its correlation with
  that mean is `start.correlation`.
* `starts.json`: each shot's start in `nbsim fit`'s per-image format, keyed as `shots.txt` names the shot:
  the misset angles and cell of its truth moved by `start.perturb` (the generators of a `fit:` section's
  starts, keyed by the merge's seed and the shot), its N, its drawn nanoBragg flags, and with `spectra` its
  drawn spectrum as a `-spectrumfile` written to `spectra/<point>.txt` (the merge renders each shot's
  channels with the one table).
* `shots.txt` (one shot a line, `<batch store>#<point>`), `flags.txt` (the shared model's nanoBragg flags:
  the scenario's, its size and flag axes, `-nointerpolate`, without the structure-factor flags the merge's
  `--hkl` replaces) and `merge.json` (the energy, space group, cell, counts, the start's correlation and the
  merge's arguments), so that, from the working folder of the run (the files' paths are relative to it as the
  config's `results` is),

      nbsim merge $(cat shots.txt) $(jq -r '.arguments | join(" ")' merge.json) --mtz merged.mtz -- $(cat flags.txt)

  (each file with its folder) runs the merge, scored against the truth (`--truth truth.mtz` is among the
  arguments).

With `merge.run` (the default) the pipeline's `merge` rule then runs that command on the first n shots of each
experiment, for each n of `merge.shots` (default: every shot), in `shots_<n>/` (`prepare_merge`: its shots' starts
and the command's arguments): `merged.mtz`, `merged.json` (every shot's refined model and each cycle's CC and
CCano* by resolution shell against the truth), `report.html` and `report.png`. `merge_rows` reads the merges'
last cycles for `tables/merge.csv` and `write_merge_variables` keeps them in `sweep.zarr`.

The planning part (`merge_experiments`, `check_merge`, `merge_counts`) is torch-free: the Snakefile imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import NbsimError
from ..model.anomalous import HC_EV_A
from .fitting import keyed_generator, perturbed_start, start_values
from .plan import Point, SweepPlan, scenario_args
from .spec import PointSpec

if TYPE_CHECKING:
    from ..config import SimulationConfig
    from ..resolve import Setup

STRUCTURE_FLAGS = ("-model", "-hkl", "-column", "-anomalous", "-fp_fdp", "-energy_bins")
"""The structure-factor flags left out of the merge's shared flags: `nbsim merge --hkl` gives its table."""
START_FLAGS = ("-misset", "-N")
"""Drawn flags a shot's start sets itself (from its perturbed truth)."""
MERGE_FILES = ("truth.mtz", "start.mtz", "starts.json", "shots.txt", "flags.txt", "merge.json")
"""The files written per experiment (and the folder `spectra/`)."""
ANOMALOUS_TOLERANCE = 1e-9
"""Relative |F(+)| − |F(−)| below which a truth has no anomalous differences."""
MERGE_OUTPUTS = ("merged.mtz", "merged.json", "report.html", "report.png")
"""What each merge of an experiment writes into its `shots_<n>/` folder (beside `starts.json`, its shots' starts,
and `command.json`, its arguments)."""
MERGE_COLUMNS = ("shots", "shots_merged", "shell", "d_min_A", "cc", "cc_anomalous", "start_cc", "cycles", "seconds",
                 "measured_parameters", "parameters", "space_group", "anomalous")
"""The columns of tables/merge.csv after the experiment (`point`), its axes but the draw, and its status: `shots`
asked (`merge.shots`) and merged, the resolution shell (0: all, then 1 to K from low to high resolution) and its
high-resolution limit, the last cycle's CC(|F|, truth) and CCano* (of |F(+)| − |F(−)| against the truth's), the
starting |F|'s CC as the merge scores it before its first cycle, cycles run, seconds, |F| measured and in all."""
MERGE_SCORES = {"cc": "cc_by_shell", "cc_anomalous": "cc_anomalous_by_shell", "d_min_A": "shell_d_min_A"}
"""A row's score and the key of a merge's cycle record that holds it by shell."""


def experiment_name(point: Point) -> str:
    """The experiment a shot belongs to: its point's name without its draw."""
    return dataclasses.replace(point, draw=None).name


def merge_experiments(plan: SweepPlan) -> dict[tuple[str, str], tuple[str, ...]]:
    """Each (scenario, experiment)'s point names, in draw order."""
    experiments: dict[tuple[str, str], list[str]] = {}
    for batch in plan.batches.values():
        for point in batch.points:
            experiments.setdefault((point.scenario, experiment_name(point)), []).append(point.name)
    return {key: tuple(points) for key, points in experiments.items()}


def check_merge(config: dict, base: Path) -> None:
    """What the schema cannot say about `merge:`: the sweep draws its shots (at least as many as a merge takes),
    each scenario's structure factors come from a file (the truth), and the space group, given or the file's, is
    known."""
    if "draws" not in config["sweep"]:
        raise NbsimError("merge: needs shots drawn at random (sweep.draws)")
    drawn = config["sweep"]["draws"]["count"]
    too_many = [count for count in config["merge"].get("shots") or [] if count > drawn]
    if too_many:
        raise NbsimError(f"merge.shots: {too_many[0]} is more than the {drawn} shots drawn (sweep.draws.count)")
    given = config["merge"].get("space_group")
    for scenario in config["scenarios"]:
        words = scenario_args(config, scenario, base)
        files = [(words[i + 1], word == "-model") for i, word in enumerate(words[:-1]) if word in ("-model", "-hkl")]
        if not files:
            raise NbsimError(f"merge: scenario {scenario!r} has no -model or -hkl: no truth to merge towards")
        name = given or structure_space_group(*files[-1])
        if name is None:
            raise NbsimError(f"merge.space_group: {files[-1][0]} names no space group; give one")
        space_group_of(name, "merge.space_group")


def merge_counts(settings: Mapping[str, Any], drawn: int) -> list[int]:
    """How many shots each merge of an experiment of `drawn` shots takes: `merge.shots`, else all of them."""
    return sorted(set(settings.get("shots") or [drawn]))


def prepare_merge(folder: Path, count: int, settings: Mapping[str, Any]) -> list[str]:
    """`nbsim merge`'s arguments (after `nbsim`) for the first `count` shots of the experiment whose inputs are in
    `folder`, writing into `folder/shots_<count>/`, with the `merge:` block's options (`settings`). Writes the
    starts of those shots there first (`--starts` may name only shots given) and the arguments (`command.json`); a
    checkpoint left by a killed merge is kept for the same command to resume from, and removed when the command
    or the experiment's inputs (rewritten since) have changed: a merge of other inputs cannot resume from it."""
    from ..io.atomic import atomic_write_text
    from .store import read_json

    manifest = read_json(folder / "merge.json")
    shots = (folder / "shots.txt").read_text().splitlines()[:count]
    starts = read_json(folder / "starts.json")["images"]
    output = folder / f"shots_{count}"
    output.mkdir(parents=True, exist_ok=True)
    arguments = list(manifest["arguments"])
    arguments[arguments.index("--starts") + 1] = str(output / "starts.json")
    command = ["merge", *shots, *arguments, "--refine", ",".join(settings["refine"]), "--cycles",
               str(settings["cycles"]), "--workers", str(settings["workers"]), *shlex.split(settings["options"]),
               "--mtz", str(output / "merged.mtz"), "--json", str(output / "merged.json"),
               "--report", str(output / "report.html"), "--", *manifest["flags"]]
    checkpoint, recorded = output / "merged.mtz.checkpoint", output / "command.json"
    if checkpoint.exists() and (not recorded.exists() or read_json(recorded) != command
                                or checkpoint.stat().st_mtime_ns < (folder / "merge.json").stat().st_mtime_ns):
        checkpoint.unlink()
    atomic_write_text(output / "starts.json",
                      json.dumps({"images": {shot: starts[shot] for shot in shots}}, indent=1) + "\n")
    atomic_write_text(recorded, json.dumps(command) + "\n")
    return command


def merge_rows(results: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per merge and resolution shell (MERGE_COLUMNS) from the merges' JSON (`<experiment>/shots_<n>/
    merged.json`, the experiment's merge.json beside that folder), scored by the last cycle."""
    from .store import read_json

    rows = []
    for path in results:
        path = Path(path)
        document = read_json(path)
        manifest = read_json(path.parent.parent / "merge.json")
        scored = [record for record in document["cycles"] if "cc" in record]
        last = scored[-1] if scored else {}
        start = scored[0] if scored and scored[0]["cycle"] == 0 else {}
        base = {"point": manifest["experiment"], **manifest["axes"], "status": "ok",
                "shots": int(path.parent.name.removeprefix("shots_")), "shots_merged": len(document["shots"]),
                "cycles": max((record["cycle"] for record in document["cycles"]), default=0),
                "seconds": document["seconds"], "measured_parameters": document["measured_parameters"],
                "parameters": document["parameters"], "space_group": document["space_group"],
                "anomalous": document["anomalous"], "start_cc": start.get("cc")}
        limits = [limit for limit in last.get("shell_d_min_A", []) if limit is not None and math.isfinite(limit)]
        rows.append({**base, "shell": 0, "cc": last.get("cc"), "cc_anomalous": last.get("cc_anomalous"),
                     "d_min_A": min(limits) if limits else None})
        for index in range(len(last.get("cc_by_shell", []))):
            rows.append({**base, "shell": index + 1, **{name: (last.get(key) or [None] * (index + 1))[index]
                                                         for name, key in MERGE_SCORES.items()}})
    return rows


def write_merge_variables(store, rows: list[dict[str, Any]], grid, axes: Sequence[str]) -> None:
    """In a collated store, over the sweep's axes but the draw and `merge_shots` (the shots each merge took):
    `merge_cc`, `merge_cc_anomalous`, `merge_start_cc`, `merge_seconds`, `merge_shots_merged`, and by resolution
    shell (`merge_shell`, 1 = lowest resolution) `merge_cc_by_shell`, `merge_cc_anomalous_by_shell`,
    `merge_d_min_A`; aligned with `grid` (the sweep's rows gridded over the axes), NaN where no merge is."""
    import pandas as pd
    import xarray as xr

    if not rows:
        return
    dimensions = [axis for axis in axes if axis != "draw"]
    frame = pd.DataFrame(rows)
    counts = sorted(frame["shots"].unique().tolist())
    shells = sorted(int(shell) for shell in frame["shell"].unique() if shell > 0)
    store.coordinate("merge_shots", counts)
    align = {**{axis: grid[axis].values for axis in dimensions}, "shots": counts}
    shape = (*(len(grid[axis]) for axis in dimensions), len(counts))
    overall = frame[frame["shell"] == 0].set_index([*dimensions, "shots"])
    per_merge = xr.Dataset.from_dataframe(overall[["cc", "cc_anomalous", "start_cc", "seconds", "shots_merged"]]
                                          .astype(float)).reindex(align)
    for name in ("cc", "cc_anomalous", "start_cc", "seconds", "shots_merged"):
        store.variable(f"merge_{name}", (*dimensions, "merge_shots"), shape, np.float64,
                       data=per_merge[name].values.astype(np.float64))
    if not shells:
        return
    store.coordinate("merge_shell", shells)
    by_shell = frame[frame["shell"] > 0].set_index([*dimensions, "shots", "shell"])
    per_shell = xr.Dataset.from_dataframe(by_shell[list(MERGE_SCORES)].astype(float)).reindex({**align,
                                                                                                "shell": shells})
    for name, variable in (("cc", "merge_cc_by_shell"), ("cc_anomalous", "merge_cc_anomalous_by_shell"),
                           ("d_min_A", "merge_d_min_A")):
        store.variable(variable, (*dimensions, "merge_shots", "merge_shell"), (*shape, len(shells)), np.float64,
                       data=per_shell[name].values.astype(np.float64))


def structure_space_group(path: str, model: bool) -> str | None:
    """The space group a model (`model`) or an MTZ names (None for a table that names none)."""
    import gemmi

    from ..io.structure_files import hkl_format

    if model:
        group = gemmi.read_structure(path).find_spacegroup()
    elif hkl_format(path) == "mtz":
        group = gemmi.read_mtz_file(path).spacegroup
    else:
        return None
    return None if group is None else group.hm


def space_group_of(name: str, what: str) -> Any:
    """The gemmi space group of a name or number; an unknown one is an input error naming `what` (as
    nbsim.merge.reflections.space_group, which planning cannot import: nbsim.merge imports torch)."""
    import gemmi

    found = gemmi.find_spacegroup_by_number(int(name)) if name.strip().isdigit() else \
        gemmi.find_spacegroup_by_name(name)
    if found is None:
        raise NbsimError(f"{what}: unknown space group {name!r}")
    return found


def merge_energy_eV(specs: Sequence[PointSpec]) -> float:
    """The energy the merge models: the mean over shots of each shot's spectrum-weighted mean energy."""
    energies = []
    for spec in specs:
        spectrum = spec.config.beam.spectrum or ((float(spec.config.beam.wavelength_A), 1.0),)
        weights = np.array([weight for _, weight in spectrum], np.float64)
        channel_eV = HC_EV_A / np.array([wavelength for wavelength, _ in spectrum], np.float64)
        energies.append(float((weights * channel_eV).sum() / weights.sum()))
    return float(np.mean(energies))


def flag_words(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """nanoBragg arguments as (flag, its values), in order."""
    from ..nanobragg.flags import FLAGS

    words, index = [], 0
    while index < len(argv):
        flag = argv[index]
        arity = len(FLAGS.get(flag, ()))
        if flag == "-cell":
            arity = 6
        elif flag == "-misset":
            arity = 1 if argv[index + 1].startswith("rand") else 3
        words.append((flag, list(argv[index + 1:index + 1 + arity])))
        index += 1 + arity
    return words


def shared_flags(argv: Sequence[str], drawn: Sequence[str]) -> list[str]:
    """The merge's model for every shot, from a shot's arguments: the scenario's flags and its size and flag
    axes, without its drawn flags, orientation and mosaic seed (each shot's start gives them) and without the
    structure-factor flags; with `-nointerpolate` (the merge looks F up at the nearest node)."""
    left_out = {*STRUCTURE_FLAGS, *drawn, "-misset", "-mosaic_seed"}
    return [word for flag, values in flag_words(argv) if flag not in left_out for word in (flag, *values)] + [
        "-nointerpolate"]


def structureless(config: SimulationConfig) -> SimulationConfig:
    """A configuration's crystal, beam and detector without its structure factors (what a start needs, in a
    fraction of the set-up time of a model's anomalous tables)."""
    return config.with_options(model_file=None, hkl_file=None, anomalous=False, default_F=1.0)


def shot_start(spec: PointSpec, drawn: Sequence[str], settings: Mapping[str, Any], owner: str,
               spectrum_path: str | None, lattice: str) -> dict:
    """A shot's `--starts` entry: its truth's misset and cell moved by `start.perturb` (generators keyed by the
    merge's seed and `owner`/the shot; the cell within `lattice`, the merge's space group's lattice system, so that
    the start keeps the cell the group asks for: a = b in P 61 or P 43 21 2 whatever the lengths' metric shows),
    its N (× (1 + N_percent/100), rounded), its other drawn flags, and its spectrum file."""
    from ..resolve import resolve

    fit_settings = {"start": {"perturb": dict(settings["start"]["perturb"])}, "shared": [], "seed": settings["seed"],
                    "lattice": lattice}
    light = dataclasses.replace(spec, config=structureless(spec.config))
    start = start_values(perturbed_start(light, resolve(light.config), fit_settings, owner))
    counts = [max(1, round(n)) for n in start["N"]]
    entry: dict[str, Any] = {"misset": [round(float(angle), 9) for angle in start["misset_deg"]],
                             "cell": [round(float(value), 9) for value in start["cell"]]}
    entry.update({"N": counts[0]} if len(set(counts)) == 1 else dict(zip(("Na", "Nb", "Nc"), counts, strict=True)))
    for flag, values in flag_words(spec.argv):
        if flag in drawn and flag not in START_FLAGS:
            entry[flag.lstrip("-")] = values if len(values) != 1 else values[0]
    if spectrum_path is not None:
        entry["spectrumfile"] = spectrum_path
    return entry


def truth_setup(spec: PointSpec, energy_eV: float) -> Setup:
    """A shot's model with one wavelength, at `energy_eV`: its structure factors are the truth's there."""
    from ..resolve import resolve

    return resolve(spec.config.with_options(spectrum=None, wavelength_A=HC_EV_A / energy_eV, dispersion_percent=0.0))


def scrambled(amplitudes: np.ndarray, correlation_target: float, generator: np.random.Generator) -> np.ndarray:
    """|F|·exp(σ·z) (z standard normal per reflection), σ found by bisection so that the correlation with |F|
    is `correlation_target` (to 1e-4)."""
    noise = generator.standard_normal(len(amplitudes))
    if correlation_target >= 1.0:
        return amplitudes.copy()

    def correlation(sigma: float) -> float:
        return float(np.corrcoef(amplitudes * np.exp(sigma * noise), amplitudes)[0, 1])

    low, high = 0.0, 1.0
    while correlation(high) > correlation_target and high < 64.0:
        low, high = high, 2.0 * high
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if correlation(middle) > correlation_target else (low, middle)
        if high - low < 1e-6:
            break
    return amplitudes * np.exp(0.5 * (low + high) * noise)


def write_merge_inputs(records: Sequence[Path], names: Sequence[str], drawn: Sequence[str],
                       settings: Mapping[str, Any], folder: Path, shot_files: Mapping[str, str] | None = None) -> dict:
    """Write an experiment's merge inputs (the module's docstring) into `folder`, from its points' (`names`)
    entries in their batches' records (`records`: the scenario's records.json files, each store beside its
    records); `drawn`: the sweep's drawn keys; `shot_files`: a file per point name to name the shot by instead
    of its store's `images.zarr#POINT`."""
    from ..io.atomic import atomic_write_text
    from ..merge import write_mtz
    from ..merge.reflections import asymmetric_unit, correlation, lattice_system_of
    from .store import read_json

    found: dict[str, tuple[PointSpec, str, str]] = {}
    for path in records:
        record = read_json(path)
        for entry in record["points"]:
            if entry["name"] in names and entry.get("status") == "ok":
                shot = (shot_files or {}).get(entry["name"]) or f"{Path(path).parent / 'images.zarr'}#{entry['name']}"
                found[entry["name"]] = (PointSpec.from_dict(entry), shot, record["scenario"])
    shots = [found[name] for name in names if name in found]
    if not shots:
        raise NbsimError(f"merge: no rendered shot among {', '.join(list(names)[:3])}")
    first, _, scenario = shots[0]
    experiment = folder.name
    energy_eV = merge_energy_eV([spec for spec, _, _ in shots])
    truth = truth_setup(first, energy_eV)
    structure = first.config.structure
    path = structure.model_file or structure.hkl_file
    if truth.p1_table is None or path is None:
        raise NbsimError(f"merge: scenario {scenario!r} has no structure-factor file to take the truth from")
    group_name = settings.get("space_group") or structure_space_group(path, structure.model_file is not None)
    if group_name is None:
        raise NbsimError(f"merge.space_group: {path} names no space group; give one")
    group = space_group_of(group_name, "merge.space_group")
    cell = tuple(round(float(v), 9) for v in truth.lattice.cell_parameters())
    table = truth.p1_table.reflections
    pairs, values = asymmetric_unit(table, group, cell, True, path)
    plus, minus = values[pairs.plus], values[pairs.minus]
    anomalous = bool(np.any(np.abs(plus - minus) > ANOMALOUS_TOLERANCE * np.maximum(plus, minus)))
    means, mean_F = asymmetric_unit(table, group, cell, False, path)
    reflections, truth_F = (pairs, values) if anomalous else (means, mean_F)
    generator = keyed_generator(settings["seed"], f"merge/{scenario}/{experiment}", "start_F")
    start_F = scrambled(mean_F, settings["start"]["correlation"], generator)
    spectra = folder / "spectra"
    spectra.mkdir(parents=True, exist_ok=True)
    starts, lattice = {}, lattice_system_of(group)
    for spec, shot, _ in shots:
        spectrum_path = None
        if settings["spectra"] and spec.config.beam.spectrum is not None:
            spectrum_path = str(spectra / f"{spec.name}.txt")
            atomic_write_text(spectrum_path, "".join(f"{wavelength!r} {weight!r}\n"
                                                     for wavelength, weight in spec.config.beam.spectrum))
        starts[shot] = shot_start(spec, drawn, settings, f"merge/{scenario}", spectrum_path, lattice)
    flags = shared_flags(first.argv, drawn)
    arguments = ["--starts", str(folder / "starts.json"), "--hkl", str(folder / "start.mtz"),
                 "--space_group", group.hm.replace(" ", ""), *(["--anomalous"] if anomalous else []),
                 "--truth", str(folder / "truth.mtz")]
    manifest = {
        "scenario": scenario, "experiment": experiment, "axes": {axis: value for axis, value in first.axes.items()
                                                                 if axis != "draw"},
        "shots": len(shots), "energy_eV": energy_eV,
        "wavelength_A": HC_EV_A / energy_eV,
        "energy": "the mean over the shots of each shot's spectrum-weighted mean energy: the merge's one table",
        "space_group": group.hm, "cell": list(cell), "anomalous": anomalous,
        "table_d_min_A": float(reflections.d_A.min()), "reflections": int(len(reflections.miller)),
        "start_correlation": correlation(start_F, mean_F),
        "start_correlation_target": settings["start"]["correlation"], "perturb": dict(settings["start"]["perturb"]),
        "seed": settings["seed"], "arguments": arguments, "flags": flags}
    write_mtz(str(folder / "truth.mtz"), reflections, truth_F, np.zeros_like(truth_F),
              title=f"nbsim truth at {energy_eV:.2f} eV")
    write_mtz(str(folder / "start.mtz"), means, start_F, np.zeros_like(start_F), title="nbsim poor start")
    atomic_write_text(folder / "starts.json", json.dumps({"images": starts}, indent=1) + "\n")
    atomic_write_text(folder / "shots.txt", "".join(f"{shot}\n" for _, shot, _ in shots))
    atomic_write_text(folder / "flags.txt", shlex.join(flags) + "\n")
    atomic_write_text(folder / "merge.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
