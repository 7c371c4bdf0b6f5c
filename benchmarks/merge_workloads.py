"""The `merge_sad` benchmark workload (run by benchmarks/run.py): an SAD experiment merged by `nbsim merge` from a
poor start, and the DIALS integration route on the same images where DIALS and its script are here.

The stills are config/examples/merge_sad.yaml's dataset (a selenium model with f′ and f″ per energy, a SASE
spectrum per shot across the Se K edge, random orientations, drawn N and fluence, Poisson noise), or another
crystal's: `--config` names any dataset config with a `merge:` section and drawn shots (its model, space group,
cell, scatterers, spectrum and detector; config/examples/merge_zn_p61.yaml and merge_s_p43212.yaml), `--shots` of
them, rendered by the dataset machinery (nbsim.sweep: planned and rendered into a batch store as the pipeline's
`simulate` rule does), the merge's inputs written by nbsim.sweep.merging.write_merge_inputs (the `merge_inputs`
rule's function: the truth's F(+), F(−) at the shots' mean energy, a starting |F| of correlation 0.5 without
anomalous differences, each shot's start 0.1° and 0.5 % off), each shot exported as a miniCBF (what `nbsim
merge` and DIALS both read). Then `nbsim merge` runs as its own process with `--workers` (each worker
`--threads` threads), and its MTZ is scored against the truth's MTZ by this module's own reader (`score`: every
index mapped to gemmi's asymmetric unit, Friedel halves swapped where the mapping inverts them): CC of the
measured |F| (each half of a pair on its own, as the merge refines them) and CCano*, the correlation of
|F(+)| − |F(−)| with the truth's, overall and by resolution shell (equal counts in 1/d³); the start is scored the
same way on the same reflections (`start_cc`). Time per shot-refinement and per F-gradient per shot: a probe in
this process, one worker's threads, on a few of the same shots, through nbsim.merge.Merge (the library the
command runs): the shot step of its first cycle (coarse search included), then one value and gradient of the F
step's likelihood. `merge_cpu_s` is the CPU time of the merge's processes (the steadier figure on a shared
machine: a merge of W workers on W free cores takes about merge_cpu_s / W); `projected_target_s` and
`projected_target_cpu_s` scale the wall and CPU time linearly to 1,000 shots (the same iterations assumed).

The DIALS column (`dials`): the issue's acceptance compares nbsim's CCano* from N shots with the integration route's
from 4N shots of the same dataset, so the dataset is rendered to `--dials-shots` shots (default 4 × `--shots`;
`--quick`: `--shots`), `nbsim merge` takes the first `--shots` of them and benchmarks/dials_route.py's
`integrate_and_merge` the first `--dials-shots` (the same miniCBF files: the first N are the merge's). Both merged
MTZs are scored by that script's `score_against_truth` against the same truth.mtz (the merge's: F(+), F(−) at its
shots' mean energy), each in the indexing that fits best (the lattice's alternatives tried), in the same resolution
shells (equal in 1/d³ over the span both files reach): `dials.scores` and `dials.nbsim_scored_alike`, and
`comparison`, their CC(|F|) and CCano* shell by shell (printed as a table to stderr); `{"skipped": reason}` where
DIALS or the script is absent, `{"error": line}` where the route fails. `--json PATH` also writes the record there.

Kernels: the render and the merge use the normal kernel cache (NBSIM_CACHE_DIR, else the user's), so a second run
of the benchmark builds nothing.

The issue's target: 1,000 stills of 256², the whole refinement on 2 cores in ≤ 30 min, CC ≥ 0.99 in every shell
to the data's resolution (`resolution_A`, the merge's own: where its measured amplitudes' mean |F|/σ falls below
4; `cc_lowest_shell_to_resolution`).
`--quick`: 20 shots of 128² with 5 spectrum channels and one cycle (a smoke run, not the target's figures).

    python benchmarks/merge_workloads.py merge_sad [--config DATASET.yaml] [--device cpu|cuda] [--shots N]
        [--quick] [--workers W] [--threads T] [--size PIXELS] [--channels C] [--cycles C] [--solve cycles|joint]
        [--probe-shots K]
        [--no-dials | --dials-shots M] [--work DIR] [--json PATH]

prints the record as JSON on its last line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "config" / "examples" / "merge_sad.yaml"
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
TARGET_SHOTS, TARGET_S, TARGET_CC = 1000, 1800.0, 0.99
QUICK = {"shots": 20, "size": 128, "channels": 5, "cycles": 1}
SHELLS = 6
STRONG_SIGMAS = 5.0
"""`cc_strong` takes the merged amplitudes of at least this many of their sigmas."""
PROBE_SHOTS = 2
RESOLUTION_TOLERANCE = 0.01
"""How far (relative) a shell's limit may lie beyond the merge's resolution and still count as within it."""
DIALS_SHOTS_PER_SHOT = 4
"""The DIALS route takes this many times the merge's shots: the issue's acceptance, nbsim's CCano* from N shots at
least the route's from 4N."""
DIALS_ROUTE = "benchmarks/dials_route.py"
DIALS_OPTIONS = {"dials.find_spots": ["min_spot_size=2"]}
"""The route's one change for these stills: their spots (no sensor or point spread, one sample a pixel) are 2–5
pixels, and DIALS's spot finder keeps spots of at least 6 on a detector it does not know as a PILATUS: 8 stills of
256² gave 155 spots and 2 indexed stills with the default, 1,108 spots and 5 indexed stills with 2."""


def dataset_config(path: Path, shots: int, size: int | None, channels: int | None, device: str,
                   compile_setting: str) -> dict:
    """The dataset config at `path` (config/examples/merge_sad.yaml or another crystal's, as `--config` names
    it) with `shots` draws (and a smaller detector, or fewer channels in a drawn SASE spectrum), on `device`."""
    config = yaml.safe_load(path.read_text())
    sweep = config["sweep"]
    sweep["draws"]["count"] = shots
    if size:
        sweep["sizes"] = [size]
    spectrum = sweep["draws"]["values"].get("spectrum")
    if channels and isinstance(spectrum, dict) and "sase" in spectrum:
        spectrum["sase"]["channels"] = channels
    sweep.update(devices=[device], compile=[compile_setting], batch_size=shots)
    return config


def render(config: dict, base: Path, work: Path, threads: int) -> tuple[list[Path], dict, dict]:
    """The dataset's shots rendered into one batch store per batch (nbsim.sweep.jobs.run_batch) with the normal
    kernel cache (nbsim.cache.cache_dir: the merge after it finds its kernels there too); the records, the
    experiments (nbsim.sweep.merging.merge_experiments) and the config's merge settings, defaults filled; `base`:
    the config's folder (its relative paths, a -model's among them, are from there)."""
    from nbsim.cache import cache_dir
    from nbsim.modes import Compile
    from nbsim.sweep import plan, validate
    from nbsim.sweep.jobs import run_batch
    from nbsim.sweep.merging import merge_experiments
    from nbsim.sweep.spec import BatchJob

    config["results"], config["compile_cache"] = str(work), str(cache_dir())
    points = validate.validate_config(config, SCHEMA, base)
    builds = plan.PointBuilds()
    planned = plan.plan_sweep(points, config["sweep"]["batch_size"])
    records = []
    for (scenario, name), batch in planned.batches.items():
        first = batch.points[0]
        specs = tuple(plan.point_spec(config, point, base, {}, builds=builds) for point in batch.points)
        job = BatchJob(scenario=scenario, batch=name, points=specs, dtype=first.dtype, device=first.device,
                       compile=Compile.of(first.compile), warmup=0, repeats=0, threads=threads,
                       compile_cache=config["compile_cache"], every_point=False, detector=True)
        folder = work / scenario / "batches" / name
        folder.mkdir(parents=True, exist_ok=True)
        run_batch(job, folder / "images.zarr", folder / "records.json")
        records.append(folder / "records.json")
    return records, merge_experiments(planned), config


def export_cbf(records: list[Path], folder: Path) -> dict[str, str]:
    """Each shot's detector image as a miniCBF (its counts, ADC offset and geometry in the header), by point."""
    from nbsim.cli.products import experiment_record
    from nbsim.io.detector_images import write_mini_cbf
    from nbsim.io.observed import read_observed
    from nbsim.resolve import resolve
    from nbsim.sweep.merging import structureless
    from nbsim.sweep.spec import PointSpec
    from nbsim.sweep.store import read_json

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for path in records:
        for entry in read_json(path)["points"]:
            spec = PointSpec.from_dict(entry)
            observed = read_observed(f"{path.parent / 'images.zarr'}#{spec.name}")
            record = experiment_record(resolve(structureless(spec.config)), spec.config.response.noise_seed, 65535,
                                       observed.adc_offset_adu)
            counts = np.rint(observed.counts * observed.gain_adu_per_photon + observed.adc_offset_adu)
            files[spec.name] = str(folder / f"{spec.name}.cbf")
            write_mini_cbf(files[spec.name], counts.astype(np.int32), record, datetime.datetime(2026, 1, 1))
    return files


def read_amplitudes(path: str) -> dict[tuple[int, int, int], tuple[float, float, float, float]]:
    """An MTZ's amplitudes in gemmi's reciprocal asymmetric unit: (F(+), F(−), σ(F(+)), σ(F(−))) per index (FP
    or F and its sigma for both halves without a pair; NaN sigmas where the file has none), each row's index
    mapped there and its halves swapped where the mapping is a Friedel one."""
    import gemmi

    mtz = gemmi.read_mtz_file(path)
    labels = [column.label for column in mtz.columns]
    if "F(+)" in labels and "F(-)" in labels:
        plus, minus = "F(+)", "F(-)"
    else:
        plus = minus = next(label for label in ("FP", "F", "F-obs", "FMEAN") if label in labels)
    data = np.asarray(mtz.array)

    def column(label: str) -> np.ndarray:
        return data[:, labels.index(label)] if label in labels else np.full(len(data), np.nan)

    sigma = {"FP": "SIGFP", "F": "SIGF", "F-obs": "SIGF-obs", "FMEAN": "SIGFMEAN"}
    values = np.column_stack([column(plus), column(minus), column(sigma.get(plus, f"SIG{plus}")),
                              column(sigma.get(minus, f"SIG{minus}"))])
    asu = gemmi.ReciprocalAsu(mtz.spacegroup)
    operations = mtz.spacegroup.operations()
    found = {}
    for row, (f_plus, f_minus, sigma_plus, sigma_minus) in zip(data[:, :3].astype(np.int32), values, strict=True):
        mapped, isym = asu.to_asu([int(v) for v in row], operations)
        found[tuple(mapped)] = tuple(map(float, (f_plus, f_minus, sigma_plus, sigma_minus) if isym % 2 == 1
                                         else (f_minus, f_plus, sigma_minus, sigma_plus)))
    return found


def _pearson(values: np.ndarray, truth: np.ndarray) -> float | None:
    both = np.isfinite(values) & np.isfinite(truth)
    if both.sum() < 3 or np.std(values[both]) == 0 or np.std(truth[both]) == 0:
        return None
    return float(np.corrcoef(values[both], truth[both])[0, 1])


def score(merged_path: str, truth_path: str, shells: int = SHELLS, start_path: str | None = None) -> dict:
    """CC(|F|, truth) over the measured amplitudes (each half of a pair on its own, a centric reflection once),
    `cc_strong` over those with |F| ≥ STRONG_SIGMAS σ(F) (`strong` of them), and CCano* (|F(+)| − |F(−)|
    against the truth's, over the acentric pairs with both halves measured), overall and by resolution shell
    (equal counts in 1/d³ over the measured reflections); with `start_path`, the start's CC on the same
    amplitudes."""
    import gemmi

    merged, truth = read_amplitudes(merged_path), read_amplitudes(truth_path)
    start = read_amplitudes(start_path) if start_path else {}
    mtz = gemmi.read_mtz_file(truth_path)
    group, cell = mtz.spacegroup, mtz.cell
    common = [hkl for hkl in merged if hkl in truth and any(math.isfinite(v) for v in merged[hkl])]
    if not common:
        return {"measured_reflections": 0, "cc": None, "cc_anomalous": None}
    miller = np.array(common, np.int32)
    centric = np.asarray(group.operations().centric_flag_array(miller), bool)
    d_A = np.asarray(cell.calculate_d_array(miller))
    ours = np.array([merged[h] for h in common])
    true = np.array([truth[h] for h in common])
    began = np.array([start.get(h, (math.nan,) * 4) for h in common])
    inverse_cube = 1.0 / d_A ** 3
    edges = np.quantile(inverse_cube, np.linspace(0, 1, shells + 1))
    shell = np.clip(np.searchsorted(edges, inverse_cube, side="right") - 1, 0, shells - 1)

    def halves(values: np.ndarray, where: np.ndarray) -> np.ndarray:
        minus = np.where(centric[where], np.nan, values[where, 1])
        return np.concatenate([values[where, 0], minus])

    def scores(where: np.ndarray) -> dict:
        acentric = where & ~centric
        result = {"reflections": int(where.sum()), "d_max_A": float(d_A[where].max()) if where.any() else None,
                  "d_min_A": float(d_A[where].min()) if where.any() else None,
                  "cc": _pearson(halves(ours, where), halves(true, where)),
                  "cc_anomalous": _pearson(ours[acentric, 0] - ours[acentric, 1],
                                           true[acentric, 0] - true[acentric, 1]),
                  "anomalous_pairs": int((acentric & np.isfinite(ours[:, 0]) & np.isfinite(ours[:, 1])).sum())}
        amplitudes, sigmas = halves(ours, where), np.concatenate([ours[where, 2], ours[where, 3]])
        strong = amplitudes >= STRONG_SIGMAS * sigmas
        result.update(cc_strong=_pearson(np.where(strong, amplitudes, np.nan), halves(true, where)),
                      strong=int(strong.sum()))
        if start:
            measured = np.isfinite(halves(ours, where))
            result["start_cc"] = _pearson(np.where(measured, halves(began, where), np.nan), halves(true, where))
        return result

    everything = np.ones(len(common), bool)
    return {**scores(everything), "measured_reflections": len(common),
            "by_shell": [scores(shell == index) for index in range(shells)]}


def to_resolution(record: dict, resolution_A: float | None) -> dict:
    """The acceptance's figure: the data's resolution (the merge's last cycle: where the measured amplitudes'
    mean |F|/σ falls below nbsim.merge's RESOLUTION_F_OVER_SIGMA) and the lowest CC(|F|, truth) of the scored
    shells within it (a shell counts when its highest-resolution reflection is at or below that resolution,
    within RESOLUTION_TOLERANCE: the merge's d are of its shots' mean starting cell, the score's of the
    truth's)."""
    within = [shell["cc"] for shell in record["by_shell"] if resolution_A is not None and shell["d_min_A"] is not None
              and shell["d_min_A"] >= resolution_A * (1 - RESOLUTION_TOLERANCE)]
    return {"resolution_A": resolution_A, "shells_to_resolution": len(within),
            "cc_lowest_shell_to_resolution": None if not within or None in within else min(within)}


def probe(manifest: dict, starts: dict, shots: list[str], device: str) -> dict:
    """Seconds per shot-refinement (the first cycle's shot step, coarse search included) and per F-gradient per
    shot (one value and gradient of the F step's likelihood), measured on `shots` in this process through
    nbsim.merge.Merge, the library `nbsim merge` runs, with the merge's default shot options."""
    import torch

    from nbsim.fit.refine import FitOptions
    from nbsim.merge import Merge, MergeJob, MergeOptions
    from nbsim.nanobragg.arguments import parse
    from nbsim.resolve import advised_sampling_flags

    argv_per_shot = []
    for shot in shots:
        argv = [*manifest["flags"], "-hkl", manifest["arguments"][manifest["arguments"].index("--hkl") + 1]]
        for key, value in starts[shot].items():
            argv += [f"-{key}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
        _, extra = advised_sampling_flags(parse(argv)[0].with_options(sampling="advised"))
        argv_per_shot.append(tuple(argv + extra))
    job = MergeJob(shots=tuple(zip(shots, argv_per_shot, strict=True)),
                   hkl=argv_per_shot[0][argv_per_shot[0].index("-hkl") + 1], column=None,
                   space_group=manifest["space_group"], cell_A_deg=tuple(manifest["cell"]), default_F=0.0,
                   anomalous=manifest["anomalous"], options=MergeOptions(shots=FitOptions(device=device)))
    merge = Merge(job)
    begin = time.perf_counter()
    merge.refine_shots(0)
    refine_s = time.perf_counter() - begin
    merge.nll(merge.log_F)  # a first evaluation builds the F step's renderer
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    begin = time.perf_counter()
    merge.nll(merge.log_F)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    gradient_s = time.perf_counter() - begin
    return {"shots": len(shots), "seconds_per_shot_refinement": refine_s / len(shots),
            "seconds_per_F_gradient_per_shot": gradient_s / len(shots), "threads": torch.get_num_threads()}


def dials_column(images: list[str], work: Path, manifest: dict, truth: str, merged: str) -> dict:
    """The integration route on `images` (benchmarks/dials_route.py's `integrate_and_merge`) and nbsim's merge
    (`merged`, where the merge wrote one), both scored against `truth` by that script's `score_against_truth`
    (each in the indexing that fits it best) in the same shells (`scores`, `nbsim_scored_alike`, `comparison`:
    the module docstring); skipped, with the reason, where DIALS or the script is not here, and an error line
    where the route fails."""
    if shutil.which("dials.index") is None:
        return {"skipped": "DIALS is not installed (dials.index not on PATH)"}
    if not (REPO / DIALS_ROUTE).is_file():
        return {"skipped": f"{DIALS_ROUTE} (the DIALS route) is not in this checkout"}
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dials_route

    from nbsim.errors import NbsimError

    begin = time.perf_counter()
    try:
        result = dials_route.integrate_and_merge(images, work / "dials", manifest["space_group"], manifest["cell"],
                                                 manifest["anomalous"], nproc=min(2, os.cpu_count() or 1),
                                                 options=DIALS_OPTIONS)
    except NbsimError as error:
        return {"error": str(error), "wall_s": time.perf_counter() - begin, "shots": len(images)}
    result = {**result, "wall_s": time.perf_counter() - begin, "shots": len(images)}
    files = {"dials": result["mtz"], **({"nbsim": merged} if Path(merged).is_file() else {})}
    alone = {name: dials_route.score_against_truth(path, truth, SHELLS) for name, path in files.items()}
    span_A = [min(score["d_min_A"] for score in alone.values()), max(score["d_max_A"] for score in alone.values())]
    scored = {name: dials_route.score_against_truth(path, truth, SHELLS, span_A) for name, path in files.items()}
    result["scores"] = scored["dials"]
    if "nbsim" in scored:
        result["nbsim_scored_alike"] = scored["nbsim"]
        result["comparison"] = comparison(scored["nbsim"], scored["dials"])
    return result


def comparison(nbsim: dict, dials: dict) -> list[dict]:
    """nbsim's and DIALS's CC(|F|) and CCano* side by side: overall (`shell` None), then shell by shell (the
    shells of one span: score_against_truth's `span_A`)."""

    def figures(score: dict | None, prefix: str) -> dict:
        score = score or {}
        return {f"{prefix}_{key}": score.get(key) for key in ("cc", "cc_anomalous", "reflections", "pairs")}

    rows = [{"shell": None, "d_max_A": max(nbsim["d_max_A"], dials["d_max_A"]),
             "d_min_A": min(nbsim["d_min_A"], dials["d_min_A"]), **figures(nbsim, "nbsim"),
             **figures(dials, "dials")}]
    ours, theirs = ({shell["shell"]: shell for shell in score["shells"]} for score in (nbsim, dials))
    for index in sorted(set(ours) | set(theirs)):
        both = [shell for shell in (ours.get(index), theirs.get(index)) if shell]
        rows.append({"shell": index, "d_max_A": max(shell["d_max_A"] for shell in both),
                     "d_min_A": min(shell["d_min_A"] for shell in both), **figures(ours.get(index), "nbsim"),
                     **figures(theirs.get(index), "dials")})
    return rows


def comparison_table(rows: list[dict], shots: int, dials_shots: int) -> str:
    """The comparison as a Markdown table."""

    def figure(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = [f"| shell (Å) | nbsim, {shots} shots: CC(|F|) | CCano* (pairs) | DIALS, {dials_shots} shots: CC(|F|) "
             "| CCano* (pairs) |", "|---|---|---|---|---|"]
    for row in rows:
        where = "all" if row["shell"] is None else f"{row['d_max_A']:.2f}–{row['d_min_A']:.2f}"
        lines.append(f"| {where} | {figure(row['nbsim_cc'])} | {figure(row['nbsim_cc_anomalous'])} "
                     f"({row['nbsim_pairs'] or 0}) | {figure(row['dials_cc'])} | {figure(row['dials_cc_anomalous'])} "
                     f"({row['dials_pairs'] or 0}) |")
    return "\n".join(lines)


def measure(shots: int, size: int | None, channels: int | None, device: str, workers: int, worker_threads: int,
            cycles: int | None, probe_shots: int, dials_shots: int | None, work: Path,
            config_path: Path = CONFIG, solve: str | None = None) -> dict:
    """The merge_sad record (the module's docstring) of the dataset config at `config_path` (the crystal, its
    scatterers, spectrum and detector): `shots` stills of the config's detector (or `size`² pixels
    of the same pixel size) and spectrum (or `channels` channels), merged by `workers` processes of
    `worker_threads` threads in `cycles` (None: the merge's default), by `solve` (nbsim merge --solve; None: the
    merge's default); with `dials_shots`, the dataset rendered to
    that many shots (at least `shots`) and the DIALS route run on them (None: no DIALS column)."""
    import torch

    from nbsim.sweep.merging import write_merge_inputs

    threads = torch.get_num_threads()
    rendered = max(shots, dials_shots or 0)
    config = dataset_config(config_path, rendered, size, channels, device, "off" if rendered < 100 else "on")
    begin = time.perf_counter()
    records, experiments, config = render(config, config_path.parent, work, threads)
    render_s = time.perf_counter() - begin
    (scenario, experiment), names = next(iter(experiments.items()))
    begin = time.perf_counter()
    files = export_cbf(records, work / "cbf")
    export_s = time.perf_counter() - begin
    begin = time.perf_counter()
    folder = work / scenario / "merge" / experiment
    manifest = write_merge_inputs(records, names[:shots], sorted(config["sweep"]["draws"]["values"]),
                                  config["merge"], folder, shot_files=files)
    inputs_s = time.perf_counter() - begin
    starts = json.loads((folder / "starts.json").read_text())["images"]
    images = (folder / "shots.txt").read_text().split()
    merged, merged_json = folder / "merged.mtz", folder / "merged.json"
    command = [sys.executable, "-m", "nbsim.cli", "merge", *images, *manifest["arguments"], "--mtz", str(merged),
               "--json", str(merged_json), "--workers", str(workers), "--device", device,
               *(["--cycles", str(cycles)] if cycles else []), *(["--solve", solve] if solve else []),
               "--", *manifest["flags"]]
    environment = {**os.environ, "OMP_NUM_THREADS": str(worker_threads), "NBSIM_WORKER": "off"}
    begin, cpu_begin = time.perf_counter(), _children_cpu_s()
    returncode, output = _streamed(command, environment)
    merge_s, merge_cpu_s = time.perf_counter() - begin, _children_cpu_s() - cpu_begin
    pixels = config["sweep"]["sizes"][0]
    record = {"config": _shown(config_path), "scenario": scenario, "space_group": manifest["space_group"],
              "cell": manifest["cell"], "shots": len(images), "detector": f"{pixels}²", "device": device,
              "device_name": _device_name(device),
              "workers": workers, "threads_per_worker": worker_threads, "load_average": list(os.getloadavg()),
              "render_s": render_s, "export_s": export_s, "inputs_s": inputs_s, "merge_s": merge_s,
              "merge_cpu_s": merge_cpu_s,
              "merge_command": ["nbsim", "merge", f"<{len(images)} shots>", *command[4 + len(images):]],
              "energy_eV": manifest["energy_eV"], "start_correlation": manifest["start_correlation"],
              "perturb": manifest["perturb"], "target": {"shots": TARGET_SHOTS, "seconds": TARGET_S, "cc": TARGET_CC}}
    record.update(merge_output=output, projected_target_s=merge_s * TARGET_SHOTS / len(images),
                  projected_target_cpu_s=merge_cpu_s * TARGET_SHOTS / len(images))
    if returncode != 0:  # the timings below still measure something: the record says the merge failed
        record["error"] = f"nbsim merge exited {returncode}: {(output or ['no output'])[-1]}"
    else:
        document = json.loads(merged_json.read_text())
        record.update(cycles=document.get("cycles"), measured_parameters=document.get("measured_parameters"),
                      parameters=document.get("parameters"))
        record.update(score(str(merged), str(folder / "truth.mtz"), SHELLS, str(folder / "start.mtz")))
        record.update(to_resolution(record, (document.get("cycles") or [{}])[-1].get("resolution_A")))
    torch.set_num_threads(worker_threads)  # the probe times one worker's share
    try:
        record["probe"] = probe(manifest, starts, images[:probe_shots], device) if probe_shots else {}
    except Exception as error:  # the merge's library may have changed under the probe: say so, keep the rest
        record["probe"] = {"error": f"{type(error).__name__}: {error}"}
    record.update({key: record["probe"].get(key) for key in ("seconds_per_shot_refinement",
                                                             "seconds_per_F_gradient_per_shot")})
    if dials_shots:
        dials_images = [files[name] for name in names[:dials_shots]]
        record["dials"] = dials_column(dials_images, work, manifest, str(folder / "truth.mtz"), str(merged))
        if "comparison" in record["dials"]:
            print(comparison_table(record["dials"]["comparison"], len(images), len(dials_images)), file=sys.stderr)
    else:
        record["dials"] = {"skipped": "--no-dials"}
    return record


def _shown(path: Path) -> str:
    """A path as the record shows it: relative to the repository where it lies in it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _children_cpu_s() -> float:
    """CPU seconds (user and system) of this process's finished children and theirs: a merge's workers included."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _without_nan(value):
    """The record with NaN (an undefined correlation) as null, so that it is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_nan(item) for item in value]
    return value


def _streamed(command: list[str], environment: dict[str, str]) -> tuple[int, list[str]]:
    """Run `command`, its output passed on to stderr line by line (a long merge shows its cycles); its exit
    status and output lines."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=environment) as process:
        for line in process.stdout:
            print(line, end="", file=sys.stderr, flush=True)
            lines.append(line.rstrip("\n"))
    return process.returncode, lines


def _cuda_devices() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def _device_name(device: str) -> str:
    import torch

    from nbsim.cpu import cpu_name

    return torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name()


def _run(quick: bool, folder: Path) -> dict:
    # Without the DIALS route: at the target's 1,000 shots it would render and integrate 4,000 (hours); its
    # comparison is the command docs/merging.md gives, at 50 shots against 200.
    arguments = ["merge_sad", "--no-dials", *(["--quick"] if quick else [])]
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    lines = completed.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"command": command, "error": (completed.stderr.strip().splitlines() or ["no output"])[-1]}
    if "error" in result:
        return {"command": command, "error": result["error"], "result": result}
    return {"command": ["python", "benchmarks/merge_workloads.py", *arguments], "result": result}


def verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    result = record["result"]
    misses = []
    if result["shots"] < TARGET_SHOTS:
        misses.append(f"{result['shots']} shots, not {TARGET_SHOTS}")
    if result["merge_s"] > TARGET_S:
        misses.append(f"{result['merge_s']:.0f} s")
    lowest = result.get("cc_lowest_shell_to_resolution")
    if lowest is None or lowest < TARGET_CC:
        misses.append("CC undefined" if lowest is None else
                      f"CC {lowest:.3f} in a shell to the data's resolution ({result['resolution_A']:.2f} Å)")
    return "met" if not misses else "missed (" + "; ".join(misses) + ")"


def row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    r = record["result"]

    def figure(value: float | None, digits: int = 3) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    dials = r["dials"].get("skipped") or r["dials"].get("error") or (
        f"{r['dials']['shots']} shots: CCano* {figure(r['dials']['scores']['cc_anomalous'])} (nbsim's from "
        f"{r['shots']} by the same scorer {figure(r['dials'].get('nbsim_scored_alike', {}).get('cc_anomalous'))})")

    return (f"| {name} | {r['shots']} stills of {r['detector']}, {r['workers']} workers: merge {r['merge_s']:.0f} s, "
            f"{r['merge_cpu_s']:.0f} CPU-s (linear in the shots, {r['projected_target_cpu_s']:.0f} CPU-s for "
            f"{TARGET_SHOTS}); per shot-refinement "
            f"{figure(r.get('seconds_per_shot_refinement'), 2)} s, per F-gradient per shot "
            f"{figure(r.get('seconds_per_F_gradient_per_shot'), 4)} s; CC {figure(r['cc'])} (start "
            f"{figure(r.get('start_cc'))}), CCano* {figure(r['cc_anomalous'])} over {r['measured_reflections']} "
            f"reflections; DIALS: {dials} |")


MERGE_WORKLOADS = {
    "merge_sad": (lambda quick, folder: _run(quick, folder), verdict, row,
                  f"{TARGET_SHOTS} stills of 256² on 2 cores in <= {TARGET_S / 60:.0f} min, CC >= {TARGET_CC} in every "
                  "shell to the data's resolution"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=list(MERGE_WORKLOADS))
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="the dataset config of the stills (default config/examples/merge_sad.yaml; another "
                             "crystal: config/examples/merge_zn_p61.yaml, merge_s_p43212.yaml, or one of your own "
                             "with a merge: section)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 shots of 128², 5 channels, 1 cycle")
    parser.add_argument("--shots", type=int, help=f"stills (default {TARGET_SHOTS}; --quick: {QUICK['shots']})")
    parser.add_argument("--workers", type=int, help="nbsim merge --workers (default: 2 on the CPU, or fewer cores; "
                                                    "one a GPU on CUDA)")
    parser.add_argument("--size", type=int, help=f"detector pixels per side (default 256; --quick: {QUICK['size']})")
    parser.add_argument("--channels", type=int,
                        help=f"spectrum channels (default the config's 20; --quick: {QUICK['channels']})")
    parser.add_argument("--threads", type=int, help="CPU threads of each merge worker (default: the cores over the "
                                                    "workers)")
    parser.add_argument("--cycles", type=int, help="nbsim merge --cycles (default: the merge's)")
    parser.add_argument("--solve", choices=("cycles", "joint"), help="nbsim merge --solve (default: the merge's)")
    parser.add_argument("--probe-shots", type=int, default=PROBE_SHOTS, help="shots the timing probe refines")
    dials = parser.add_mutually_exclusive_group()
    dials.add_argument("--no-dials", action="store_true", help="leave the DIALS route out")
    dials.add_argument("--dials-shots", type=int,
                       help=f"shots the DIALS route integrates, the first of the dataset (default "
                            f"{DIALS_SHOTS_PER_SHOT} x --shots; --quick: --shots); the dataset is rendered to them")
    parser.add_argument("--work", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the record to this file")
    options = parser.parse_args(argv)
    if not options.config.is_file():
        parser.error(f"--config {options.config}: no such file")
    shots = options.shots or (QUICK["shots"] if options.quick else TARGET_SHOTS)
    if options.workers is None:
        options.workers = _cuda_devices() if options.device.startswith("cuda") else min(2, os.cpu_count() or 1)
    if any(value is not None and value < 1 for value in (shots, options.workers, options.threads, options.size,
                                                         options.channels, options.cycles, options.dials_shots)):
        parser.error("--shots, --workers, --threads, --size, --channels, --cycles and --dials-shots must be at least 1")
    dials_shots = None if options.no_dials else options.dials_shots or (
        shots if options.quick else DIALS_SHOTS_PER_SHOT * shots)

    def run(work: Path) -> dict:
        threads = options.threads or max(1, (os.cpu_count() or 1) // options.workers)
        size = options.size or (QUICK["size"] if options.quick else None)
        channels = options.channels or (QUICK["channels"] if options.quick else None)
        cycles = options.cycles or (QUICK["cycles"] if options.quick else None)
        return measure(shots, size, channels, options.device, options.workers, threads, cycles,
                       min(options.probe_shots, shots), dials_shots, work, options.config.resolve(), options.solve)

    if options.work is not None:
        options.work.mkdir(parents=True, exist_ok=True)
        record = run(options.work.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="nbsim-merge-sad-") as work:
            record = run(Path(work))
    text = json.dumps(_without_nan(record))
    if options.json is not None:
        options.json.write_text(text + "\n")
    print(text)
    return 0 if "error" not in record else 1


if __name__ == "__main__":
    sys.exit(main())
