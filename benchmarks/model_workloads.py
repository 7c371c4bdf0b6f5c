"""The `model_table` benchmark workload (run by benchmarks/run.py): what a structure-factor table from an
atomic model costs. A 2,000-atom protein-sized model (random C, N, O and S positions in P 21 21 21, cell
50 × 60 × 70 Å, B 10–39 Å²) is written with gemmi, then nbsim computes its full P1 table to 2 Å
(`nbsim.io.structure_files.model_reflections`: gemmi's direct summation, then the P1 expansion) in a
new process, timed from the model's reading to the finished table. Recorded only: the issue names no
target."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ATOMS = 2000
D_MIN_A = 2.0
QUICK_ATOMS, QUICK_D_MIN_A = 200, 4.0
CELL_A_DEG = (50.0, 60.0, 70.0, 90.0, 90.0, 90.0)
ELEMENTS = ("C", "C", "C", "N", "O", "O", "S")


def write_model(path: Path, atoms: int, cell_A_deg: tuple[float, ...] = CELL_A_DEG,
                space_group: str = "P 21 21 21", seed: int = 7, elements: Sequence[str] = ELEMENTS,
                heavy: tuple[str, int] | None = None) -> None:
    """A PDB model of `atoms` atoms at random fractional positions (one chain of one-atom residues), with
    mixed elements (`elements` in turn), B factors (10–39 Å²) and occupancies (every third atom 0.5); with
    `heavy` (element, k), every k-th atom is that element instead, fully occupied with B 20 Å² (an anomalous
    scatterer: `heavy=("Zn", 100)` puts 4 Zn among 400 atoms)."""
    import gemmi
    import numpy as np

    generator = np.random.default_rng(seed)
    structure = gemmi.Structure()
    structure.cell = gemmi.UnitCell(*cell_A_deg)
    structure.spacegroup_hm = space_group
    chain = gemmi.Chain("A")
    for index, fraction in enumerate(generator.random((atoms, 3))):
        residue = gemmi.Residue()
        residue.name, residue.seqid = "UNK", gemmi.SeqId(index + 1, " ")
        atom = gemmi.Atom()
        is_heavy = heavy is not None and index % heavy[1] == heavy[1] // 2
        element = heavy[0] if is_heavy else elements[index % len(elements)]
        atom.name, atom.element = element.upper(), gemmi.Element(element)
        atom.pos = structure.cell.orthogonalize(gemmi.Fractional(*fraction))
        atom.occ, atom.b_iso = (1.0, 20.0) if is_heavy else ((0.5 if index % 3 == 0 else 1.0), 10.0 + index % 30)
        residue.add_atom(atom)
        chain.add_residue(residue)
    model = gemmi.Model("1")
    model.add_chain(chain)
    structure.add_model(model)
    structure.setup_entities()
    structure.write_pdb(str(path))


TIMED = """
import json, sys, time
from nbsim.io.structure_files import model_reflections
begin = time.perf_counter()
table = model_reflections(sys.argv[1], float(sys.argv[2]))
print(json.dumps({"table_s": time.perf_counter() - begin, "reflections": len(table.reflections)}))
"""


def run_model_table(quick: bool, folder: Path) -> dict:
    atoms, d_min_A = (QUICK_ATOMS, QUICK_D_MIN_A) if quick else (ATOMS, D_MIN_A)
    model = folder / "model.pdb"
    write_model(model, atoms)
    command = [sys.executable, "-c", TIMED, str(model), str(d_min_A)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"error": (completed.stderr.strip().splitlines() or ["no output"])[-1]}
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return {"command": ["python", "-c", "<model_reflections(model.pdb, d_min)>", str(d_min_A)],
            "result": {"atoms": atoms, "d_min_A": d_min_A, **result}}


def model_verdict(record: dict) -> str:
    return "failed: " + record["error"] if "error" in record else "recorded"


def model_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    result = record["result"]
    return (f"| {name} | {result['atoms']} atoms to {result['d_min_A']:g} A: {result['reflections']} P1 "
            f"reflections in {result['table_s']:.2f} s |")


MODEL_WORKLOADS = {"model_table": (run_model_table, model_verdict, model_row, "recorded only")}
