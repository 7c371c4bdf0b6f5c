"""A merge's state between cycles, and its checkpoint.

A shot's refined model is kept as its values (`shot_values`: the refinable quantities in their units, the
orientation as the rotation vector from its starting orientation) and its set-up rebuilt from those and its
start (`rebuilt_setup`), in every cycle: the checkpoint holds exactly what the run continues from, so a run
resumed from it goes on as the uninterrupted run would have.

The checkpoint (one .npz file, written atomically after each cycle; no pickles): the cycle it ends, log|F| and
which of them are measured, every shot's values, sampling, scale, fitted pixels, fixed background and refined
model's JSON, the cycles' records, and the fingerprint of the inputs (`fingerprint`): resuming with other
inputs is an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import NbsimError
from ..fit.model import DiffractionModel, starting_values, with_oversample
from ..fit.parameters import lattice_system, nearest_rotation, real_vectors, starting_rotation
from ..io.atomic import atomic_write_with
from ..resolve import Setup

CHECKPOINT_VERSION = 1
SETUP_QUANTITIES = ("mosaic", "distance", "beam", "wavelength", "spectrum")
"""Refined quantities a set-up is rebuilt with only where refined (the crystal's are always rebuilt)."""


def rotation_vector(rotation: torch.Tensor) -> torch.Tensor:
    """The rotation vector (radians; axis times angle) of a rotation matrix: the inverse of
    `nbsim.fit.parameters.rotation_matrix`."""
    from scipy.spatial.transform import Rotation

    return torch.as_tensor(Rotation.from_matrix(rotation.detach().numpy()).as_rotvec(), dtype=torch.float64)


def shot_values(start: Setup, refined: Setup, lattice: str | None) -> dict[str, list[float]]:
    """A refined set-up's quantities in their units (`nbsim.fit`'s names; the cell's free parameters of the
    lattice system, else the start's), the orientation as the rotation vector from the start's orientation."""
    system = lattice_system(start.lattice.cell_parameters(), lattice)
    values = starting_values(refined, system)
    cells = [torch.tensor(setup.lattice.cell_parameters(), dtype=torch.float64) for setup in (start, refined)]
    rotations = [starting_rotation(cell, setup.lattice.real_A.detach())
                 for cell, setup in zip(cells, (start, refined), strict=True)]
    values["orientation"] = rotation_vector(rotations[1] @ rotations[0].T)
    values["mosaic"] = torch.rad2deg(torch.as_tensor(refined.mosaic.spread_rad, dtype=torch.float64)).reshape(1)
    return {name: [float(v) for v in value.detach().reshape(-1)] for name, value in values.items()}


def rebuilt_setup(start: Setup, values: dict[str, list[float]], refined: Sequence[str], lattice: str | None,
                  oversample: int) -> Setup:
    """The start's set-up with `values` in place (as `nbsim.fit` builds a refined one), sampled with
    `oversample` sub-pixels a side. Without its structure-factor table: the merge puts the current one in."""
    bare = dataclasses.replace(start, grid=None, channel_grids=None)
    one_pixel = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    model = DiffractionModel([bare], [one_pixel], [q for q in SETUP_QUANTITIES if q in refined], lattice=lattice,
                             compile=False)
    tensors = {name: torch.tensor(value, dtype=torch.float64) for name, value in values.items()}
    with torch.no_grad():
        setup = model.image_setup(0, tensors)
    return with_oversample(setup, oversample)


def reindexed_start(start: Setup, operator: np.ndarray, lattice: str | None) -> Setup:
    """A shot's start indexed the other way `operator` gives (a reflection indexed h is indexed h·R:
    `reflections.other_indexings`): the same lattice on the basis (a, b, c)·R, which is the same cell in the
    orientation U·Q, Q = L₀·R·L₀⁻¹ (L₀: the cell's vectors as columns in nanoBragg's default orientation; a
    rotation, R being a symmetry of the lattice). Every spot stays where it was and takes the |F| of h·R. Where R
    permutes the axes (with signs), the cells along them are permuted alike, so the crystal keeps its shape (the
    lattice factor's: N cells along each axis); another R changes the shape the model gives the crystal."""
    cell = torch.tensor(start.lattice.cell_parameters(), dtype=torch.float64)
    columns = real_vectors(cell).T
    operator = torch.as_tensor(operator, dtype=torch.float64)
    turn = nearest_rotation(columns @ operator @ torch.linalg.inv(columns))
    rotation = starting_rotation(cell, start.lattice.real_A.detach().to(torch.float64))
    values = shot_values(start, start, lattice)
    values["orientation"] = rotation_vector(rotation @ turn @ rotation.T).tolist()
    if bool(((operator != 0).sum(dim=0) == 1).all()):  # a'_j = ±a_i: N'_j = N_i
        values["N"] = [values["N"][int(torch.nonzero(operator[:, axis])[0])] for axis in range(3)]
    return rebuilt_setup(start, values, (), lattice, start.oversample)


def fingerprint(job_fields: dict, paths: Sequence[str]) -> str:
    """A digest of what a merge's result depends on: the job's fields (JSON) and each input file's (or
    folder's files') size and modification time."""
    digest = hashlib.sha256(json.dumps(job_fields, sort_keys=True, default=str).encode())
    for path in paths:
        for name in _files(Path(path)):
            status = name.stat()
            digest.update(f"{name}\0{status.st_size}\0{status.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(member for member in path.rglob("*") if member.is_file())
    return [path] if path.exists() else []


@dataclass
class ShotState:
    """What a checkpoint keeps of one shot after a cycle."""

    name: str
    values: dict[str, list[float]]
    oversample: int
    scale: float
    rows: np.ndarray
    cols: np.ndarray
    background: np.ndarray
    document: dict


@dataclass
class Checkpoint:
    """The state after `cycle` cycles: log|F|, every shot's state, the cycles' records."""

    fingerprint: str
    cycle: int
    log_F: np.ndarray
    measured: np.ndarray
    shots: list[ShotState]
    cycles: list[dict]


def write_checkpoint(path: str, checkpoint: Checkpoint) -> None:
    """The checkpoint as one .npz (arrays, and the rest as JSON text), written atomically."""
    meta = {"version": CHECKPOINT_VERSION, "fingerprint": checkpoint.fingerprint, "cycle": checkpoint.cycle,
            "cycles": checkpoint.cycles,
            "shots": [{"name": s.name, "values": s.values, "oversample": s.oversample, "scale": s.scale,
                       "document": s.document} for s in checkpoint.shots]}
    arrays = {"meta": np.array(json.dumps(meta)), "log_F": np.asarray(checkpoint.log_F, np.float64),
              "measured": np.asarray(checkpoint.measured, bool)}
    for index, shot in enumerate(checkpoint.shots):
        arrays[f"rows{index}"] = np.asarray(shot.rows, np.int64)
        arrays[f"cols{index}"] = np.asarray(shot.cols, np.int64)
        arrays[f"background{index}"] = np.asarray(shot.background, np.float64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_with(path, lambda temporary: temporary.write_bytes(buffer.getvalue()))


def read_checkpoint(path: str, expected_fingerprint: str) -> Checkpoint | None:
    """The checkpoint at `path` (None when there is none); one written for other inputs, or not readable as a
    checkpoint, is an input error."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(str(archive["meta"]))
            log_F, measured = archive["log_F"].copy(), archive["measured"].copy()
            shots = [ShotState(name=entry["name"], values=entry["values"], oversample=int(entry["oversample"]),
                               scale=float(entry["scale"]), rows=archive[f"rows{index}"].copy(),
                               cols=archive[f"cols{index}"].copy(), background=archive[f"background{index}"].copy(),
                               document=entry["document"])
                     for index, entry in enumerate(meta["shots"])]
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise NbsimError(f"{path}: not a merge checkpoint ({error}); remove it to start afresh") from None
    if meta.get("version") != CHECKPOINT_VERSION or meta.get("fingerprint") != expected_fingerprint:
        raise NbsimError(f"{path}: a checkpoint of a merge with other inputs; remove it to start afresh")
    return Checkpoint(fingerprint=meta["fingerprint"], cycle=int(meta["cycle"]), log_F=log_F, measured=measured,
                      shots=shots, cycles=meta["cycles"])

