"""The `anomalous_spectrum_100` benchmark workload (run by benchmarks/run.py): a 100-channel spectrum across the
Se K edge (12608–12708 eV, equal weights) rendered by nbsim with structure factors per channel (`-model
-anomalous`: 100 tables of |F(+)|, |F(−)| with Cromer–Liberman f′ and f″, looked up by each source's channel
in one kernel pass), against the C on the same 100 sources (a -sourcefile) with the single table it can
read (the model's |F| at the mean energy, written by `nbsim -p1_out`). The C cannot look up per-channel
structure factors, so the images differ by the anomalous signal: the workload reports their correlation
but holds only the speed to a target (nbsim warm ≥ 20× the C process). The C binary is $NBSIM_C_BINARY (as
benchmarks/run.py's --c-binary); without it only nbsim's time is recorded."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from model_workloads import write_model

SE_K_EDGE_EV = 12658.0
CHANNELS = 100
ATOMS, SELENIUM_EVERY = 400, 40
CELL_A_DEG = (50.0, 60.0, 70.0, 90.0, 90.0, 90.0)
CRYSTAL = ["-cell", *(f"{v:g}" for v in CELL_A_DEG), "-N", "10", "-misset", "10", "20", "30", "-distance", "150",
           "-pixel", "0.1", "-mosaic", "0.3", "-mosaic_dom", "25", "-mosaic_seed", "3", "-oversample", "1"]
DETPIXELS, QUICK_DETPIXELS = 1024, 128
MIN_SPEEDUP = 20.0
REPEATS = 2


def write_selenium_model(path: Path) -> None:
    """The model_table workload's random model (P 21 21 21), every SELENIUM_EVERY-th atom made selenium."""
    import gemmi

    write_model(path, ATOMS, CELL_A_DEG)
    structure = gemmi.read_structure(str(path))
    for index, atom in enumerate(atom for chain in structure[0] for residue in chain for atom in residue):
        if index % SELENIUM_EVERY == 0:
            atom.element, atom.name = gemmi.Element("Se"), "SE"
    structure.write_pdb(str(path))


def write_spectrum(path: Path) -> None:
    energies = [SE_K_EDGE_EV - 50.0 + 100.0 * i / (CHANNELS - 1) for i in range(CHANNELS)]
    path.write_text("energy_eV weight\n" + "".join(f"{energy!r} 1\n" for energy in energies))


def run_anomalous_spectrum(quick: bool, folder: Path) -> dict:
    model, spectrum, table = folder / "se_model.pdb", folder / "edge_100.txt", folder / "mean_energy.hkl"
    write_selenium_model(model)
    write_spectrum(spectrum)
    pixels = ["-detpixels", str(QUICK_DETPIXELS if quick else DETPIXELS)]
    nbsim_args = ["-model", str(model), "-anomalous", "-spectrumfile", str(spectrum), *CRYSTAL, *pixels]
    json_path = folder / "anomalous.json"
    command = [sys.executable, "-m", "nbsim.cli", "bench", "--dtype", "float32", "--repeats", str(REPEATS),
               "--warmup", "1", "--json", str(json_path), "--", *nbsim_args]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"command": command, "error": (completed.stderr.strip().splitlines() or ["failed"])[-1]}
    result = json.loads(json_path.read_text())
    record = {"command": command, "result": result}
    c_binary = os.environ.get("NBSIM_C_BINARY")
    if not c_binary:
        return record
    # The C's one table: the model's |F| (no f', f'') at the spectrum's mean energy, as nbsim writes it.
    table_command = [sys.executable, "-m", "nbsim.cli", "-model", str(model), "-spectrumfile", str(spectrum),
                     *CRYSTAL, *pixels, "-roi", "0", "0", "0", "0", "-p1_out", str(table), "-nonoise", "-nopgm",
                     "-floatfile", str(folder / "table_run.bin"), "-intfile", str(folder / "table_run.img")]
    completed = subprocess.run(table_command, capture_output=True, text=True, cwd=folder)
    if completed.returncode != 0:
        return {**record, "error": (completed.stderr.strip().splitlines() or ["-p1_out failed"])[-1]}
    c_argv = ["-hkl", str(table), "-spectrumfile", str(spectrum), *CRYSTAL, *pixels]
    times_script = ("import json, sys\nfrom nbsim.reference import run_c_reference\n"
                    "_, times = run_c_reference(sys.argv[1], sys.argv[3:], 0, int(sys.argv[2]))\n"
                    "print(json.dumps(times))\n")
    completed = subprocess.run([sys.executable, "-c", times_script, c_binary, str(REPEATS), *c_argv],
                               capture_output=True, text=True, cwd=folder)
    if completed.returncode != 0:
        return {**record, "error": (completed.stderr.strip().splitlines() or ["C failed"])[-1]}
    c_times = json.loads(completed.stdout.strip().splitlines()[-1])
    c_median_s = statistics.median(c_times)
    return {**record, "c_command": [c_binary, *c_argv], "c_times_s": c_times, "c_median_s": c_median_s,
            "speedup": c_median_s / result["warm_median_s"]}


def anomalous_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    if "speedup" not in record:
        return "n/a (no C binary)"
    return "met" if record["speedup"] >= MIN_SPEEDUP else f"missed ({record['speedup']:.1f}x)"


def anomalous_row(name: str, record: dict) -> str:
    if "result" not in record:
        return f"| {name} | failed: {record.get('error')} |"
    result = record["result"]
    measured = (f"{CHANNELS} channels x {result['steps']} steps per pixel, per-channel F: nbsim "
                f"warm {result['warm_median_s']:.3f} s")
    if "speedup" in record:
        measured += (f"; C (one table, same sources) {record['c_median_s']:.2f} s: {record['speedup']:.1f}x "
                     "(the C cannot do per-channel F)")
    return f"| {name} | {measured} |"


ANOMALOUS_WORKLOADS = {"anomalous_spectrum_100": (run_anomalous_spectrum, anomalous_verdict, anomalous_row,
                                                  f"per-channel F >= {MIN_SPEEDUP:g}x the C's single table")}
