"""DIALS experiment lists (`.expt`, plain JSON: dxtbx is not imported) as starting models in nanoBragg's frame.

DIALS's lab frame has the beam along -z (its `direction` points to the source), x along the spindle of a
standard goniometer, y up; nanoBragg's (MOSFLM) has the beam along +x, the spindle along +z. A DIALS vector
(x, y, z) is nanoBragg's (-z, y, x): the inverse of the header's DIALS_ORIGIN = (z, y, -x) that nbsim writes,
and what dxtbx makes of nbsim's miniCBF and NXmx headers. A beam that DIALS refined off -z is first turned
onto it, with everything else (a rigid turn of the whole experiment changes no diffraction).

Each experiment becomes `SimulationConfig.with_options(**overrides)` keys:

* crystal: `mosflm_matrix` (the A matrix, columns a*, b*, c* times λ, as -mat gives it) with the matching
  `cell_A_deg`, and no misset (so flags' -misset do not turn it again); the A matrix is S·F·U·B, the
  orientation at φ = 0 of the goniometer's setting (S) and fixed (F) rotations;
* beam: `wavelength_A`;
* detector: a detector square to the beam with DIALS's usual axes (fast along DIALS +x, slow along -y, the
  beam's polarization normal along y) in the `mosflm` convention: `distance_mm`, `beam_x_mm`, `beam_y_mm`
  (nanoBragg's -Xbeam/-Ybeam), `pixel_size_mm`, `pixels_f`, `pixels_s`; any other (a refined tilt, another
  spindle or polarization) in the `custom` convention with its vectors, `beam_x_mm`/`beam_y_mm` then being
  where the beam meets the detector from the first pixel's corner along fast and slow (mm), and
  `distance_mm` the distance along the beam; a detector of several panels (a tiled XFEL detector) as
  `panels` (`PanelConfig`s, in DIALS's order: panel k of the detector is panel k of the image), each panel
  where DIALS places it, beside the first panel's place in the options above (whose convention gives the
  beam, polarization and spindle the panels are rendered under); the panels are checked as a panel file's
  are (nbsim.io.panels.check_panels: none overlapping, each facing away from the sample);
* a rotation scan: `phi_start_deg` and `osc_range_deg` of the experiment's first image.

Not converted: the polarization fraction (nanoBragg's -polar stays the caller's), scan-varying models, a
multi-axis goniometer, rectangular pixels (one-line errors). dxtbx writes each panel's vectors in the frame of
the hierarchy group it hangs from, each group's in its parent's: the chain of groups is composed with them.

The way back, `write_experiment_list`: each refined experiment (`RefinedExperiment`: its crystal's A matrix,
its wavelength and every panel's place in nanoBragg's frame) replaces its experiment's models in a copy of the
list it was read from, turned back by the inverse of the same rotations (each panel into its group's frame, the
groups kept), so that DIALS (dials.integrate, dials.ssx_integrate) predicts with nbsim's refined models.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..config import PanelConfig
from ..errors import InputFileError
from .atomic import atomic_write_text
from .panels import check_panels

DIALS_TO_NANOBRAGG = np.array([[0.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
"""nanoBragg's lab vector = DIALS_TO_NANOBRAGG @ DIALS's (a proper rotation; its transpose goes back)."""
MOSFLM_AXES = {"fdet_vector": (0.0, 0.0, 1.0), "sdet_vector": (0.0, -1.0, 0.0), "polar_vector": (0.0, 0.0, 1.0),
               "spindle_axis": (0.0, 0.0, 1.0)}
"""The MOSFLM convention's fixed vectors in nanoBragg's frame (its beam is +x)."""
SQUARE_TOLERANCE = 1e-7
"""How far (radians, about) a vector may lie from the MOSFLM one for the detector to be written as MOSFLM:
1e-7 moves a pixel 300 mm from the beam by 0.03 µm."""
_DETECTOR_RESET = {"close_distance_mm": None, "close_x_mm": None, "close_y_mm": None, "orgx_px": None,
                   "orgy_px": None, "twotheta_deg": 0.0, "rotation_deg": (0.0, 0.0, 0.0), "panels": None,
                   "panel_file": None, "roi": None, "mask_file": None, "fdet_vector": None, "sdet_vector": None,
                   "odet_vector": None, "beam_vector": None, "polar_vector": None, "spindle_axis": None,
                   "twotheta_axis": None}
"""Detector options a starting model replaces whatever the flags said (a user's ROI or mask belongs to
another detector)."""


@dataclass(frozen=True)
class ExperimentStart:
    """One DIALS experiment as a starting model for nbsim."""

    image: str | None
    """The image it names, as nbsim.io.observed reads it (FILE, FILE#N for a frame of an HDF5 file), the
    path made absolute against the .expt's folder; None when its image set does not say which."""
    overrides: dict[str, object]
    """SimulationConfig.with_options keys (see the module's docstring)."""
    a_matrix_per_A: np.ndarray
    """Rows a*, b*, c* (Å⁻¹) at φ = 0 in nanoBragg's lab frame: what nbsim's lattice has as
    reciprocal_per_A, and nbsim's miniCBF header's `nbsim A_matrix_per_A` lines."""
    number: int = 0
    """Its position in the experiment list (from 0): the `id` of its spots in a reflection table without
    identifiers."""
    identifier: str | None = None
    """The experiment's `identifier` (what a reflection table's `identifiers` name), if it has one."""
    to_nanobragg: np.ndarray = field(default_factory=lambda: DIALS_TO_NANOBRAGG.copy())
    """The rotation taking a DIALS lab vector of this experiment to nanoBragg's frame (DIALS_TO_NANOBRAGG after
    the beam's turn onto -z): its transpose writes a refined model back (write_experiment_list)."""
    crystal_to_lab: np.ndarray = field(default_factory=lambda: np.eye(3))
    """The goniometer's setting times fixed rotation (DIALS's frame), which takes the crystal's vectors to the
    lab at φ = 0."""


def read_experiment_list(path: str | Path) -> list[ExperimentStart]:
    """Every experiment of a DIALS .expt file converted to nanoBragg's frame (see the module's docstring)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputFileError(str(path), "no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputFileError(str(path), f"cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise InputFileError(str(path), f"not a DIALS experiment list (JSON: {error.msg})", error.lineno) from None
    if not isinstance(document, dict) or document.get("__id__") != "ExperimentList":
        raise InputFileError(str(path), "not a DIALS experiment list (no ExperimentList)")
    experiments = document.get("experiment") or []
    if not experiments:
        raise InputFileError(str(path), "the experiment list is empty")
    starts = []
    for number, experiment in enumerate(experiments):
        try:
            starts.append(_convert(document, experiment, number, path))
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise InputFileError(str(path), f"experiment {number}: incomplete or malformed ({error!r})") from None
    return starts


def _model(document: dict, experiment: dict, kind: str) -> dict | None:
    index = experiment.get(kind)
    return None if index is None else document[kind][index]


def _vector(values) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float64).reshape(3)
    if not np.all(np.isfinite(vector)):
        raise ValueError(f"non-finite vector {list(vector)}")
    return vector


def _unit(vector: np.ndarray) -> np.ndarray:
    length = float(np.linalg.norm(vector))
    if length == 0.0:
        raise ValueError("a zero-length direction")
    return vector / length


def _turn_onto(direction: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The smallest rotation taking the unit `direction` onto the unit `target`."""
    axis = np.cross(direction, target)
    sin, cos = float(np.linalg.norm(axis)), float(np.dot(direction, target))
    if sin < 1e-15:
        if cos > 0:
            return np.eye(3)
        raise ValueError("the beam points away from the detector frame's -z")
    k = axis / sin
    skew = np.array([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]])
    return np.eye(3) + sin * skew + (1.0 - cos) * skew @ skew


def _convert(document: dict, experiment: dict, number: int, path: Path) -> ExperimentStart:
    beam = _model(document, experiment, "beam")
    crystal = _model(document, experiment, "crystal")
    detector = _model(document, experiment, "detector")
    if beam is None or crystal is None or detector is None:
        missing = [kind for kind, model in (("beam", beam), ("crystal", crystal), ("detector", detector))
                   if model is None]
        raise InputFileError(str(path), f"experiment {number} has no {', '.join(missing)} (index it first)")
    if "wavelength" not in beam:
        raise InputFileError(str(path), f"experiment {number}: a beam without one wavelength "
                                        f"({beam.get('__id__', 'unknown kind')})")
    wavelength_A = float(beam["wavelength"])
    beam_dials = -_unit(_vector(beam["direction"]))
    turn = _turn_onto(_unit(DIALS_TO_NANOBRAGG @ beam_dials), np.array([1.0, 0.0, 0.0]))
    to_nanobragg = turn @ DIALS_TO_NANOBRAGG

    goniometer = _model(document, experiment, "goniometer")
    setting = fixed = np.eye(3)
    spindle_dials = np.array([1.0, 0.0, 0.0])
    if goniometer is not None:
        if "axes" in goniometer and len(goniometer["axes"]) > 1:
            raise InputFileError(str(path), f"experiment {number}: a multi-axis goniometer is not supported")
        setting = np.asarray(goniometer.get("setting_rotation", np.eye(3).ravel()), dtype=np.float64).reshape(3, 3)
        fixed = np.asarray(goniometer.get("fixed_rotation", np.eye(3).ravel()), dtype=np.float64).reshape(3, 3)
        spindle_dials = setting @ _unit(_vector(goniometer["rotation_axis"]))
    real_dials = np.stack([_vector(crystal[f"real_space_{axis}"]) for axis in "abc"])
    a_matrix_dials = np.linalg.inv(real_dials).T  # rows a*, b*, c*
    crystal_to_lab = setting @ fixed
    a_matrix = (to_nanobragg @ crystal_to_lab @ a_matrix_dials.T).T
    overrides: dict[str, object] = {
        "mosflm_matrix": mosflm_matrix(a_matrix, wavelength_A), "cell_A_deg": cell_of(a_matrix),
        "misset_deg": None, "misset_random": False, "wavelength_A": wavelength_A}
    normal = to_nanobragg @ _unit(_vector(beam.get("polarization_normal", (0.0, 1.0, 0.0))))
    overrides.update(_detector(detector, to_nanobragg, to_nanobragg @ spindle_dials,
                               np.cross(np.array([1.0, 0.0, 0.0]), normal), path, number))
    scan = _model(document, experiment, "scan")
    first_image = None
    if scan is not None:
        first_image = int(scan["image_range"][0])
        oscillation = scan.get("oscillation") or (scan.get("properties") or {}).get("oscillation")
        start_deg, width_deg = (float(v) for v in np.asarray(oscillation, dtype=np.float64).reshape(-1)[:2])
        if width_deg != 0.0:
            overrides.update(phi_start_deg=start_deg, osc_range_deg=width_deg)
    identifier = experiment.get("identifier")
    return ExperimentStart(_image(document, experiment, first_image, path), overrides, a_matrix, number,
                           str(identifier) if identifier else None, to_nanobragg, crystal_to_lab)


def _detector(detector: list, to_nanobragg: np.ndarray, spindle: np.ndarray, polar: np.ndarray, path: Path,
              number: int) -> dict[str, object]:
    """The detector options of the experiment's panels (see the module's docstring): one panel's place, or, for
    several, `panels` beside the first one's place (whose convention gives the panels' beam, polarization and
    spindle)."""
    detector = detector[0] if isinstance(detector, list) else detector
    entries = detector["panels"]
    if not entries:
        raise InputFileError(str(path), f"experiment {number}: a detector without panels")
    panels = [_panel(entry, frame, to_nanobragg, path, number) for entry, frame in
              zip(entries, _parent_frames(detector), strict=True)]
    options = _placed_as_one(panels[0], spindle, polar, path, number)
    if len(panels) == 1:
        return options
    configs = tuple(replace(panel, name=name) for panel, name in zip(panels, _panel_names(entries), strict=True))
    check_panels(configs, f"{path} (experiment {number})")
    return {**options, "panels": configs, "panel_file": str(path)}


def _panel(entry: dict, frame: tuple[np.ndarray, np.ndarray], to_nanobragg: np.ndarray, path: Path,
           number: int) -> PanelConfig:
    """One DIALS panel in nanoBragg's frame (its name as given: _panel_names makes the names nbsim uses)."""
    origin, axes = frame
    pixel_fast_mm, pixel_slow_mm = (float(v) for v in entry["pixel_size"])
    label = f"experiment {number}" + (f", panel {entry['name']!r}" if entry.get("name") else "")
    if not math.isclose(pixel_fast_mm, pixel_slow_mm, rel_tol=1e-9):
        raise InputFileError(str(path), f"{label}: pixels of {pixel_fast_mm:g} x {pixel_slow_mm:g} mm; "
                                        "nanoBragg's are square")
    fdet = to_nanobragg @ axes @ _unit(_vector(entry["fast_axis"]))
    sdet = to_nanobragg @ axes @ _unit(_vector(entry["slow_axis"]))
    if abs(float(np.dot(fdet, sdet))) > 1e-6:
        raise InputFileError(str(path), f"{label}: the panel's fast and slow axes are not at right angles, which "
                                        "nanoBragg cannot place")
    fast_px, slow_px = (int(v) for v in entry["image_size"])
    pix0_mm = to_nanobragg @ (origin + axes @ _vector(entry["origin"]))
    return PanelConfig(name=str(entry.get("name") or ""), pixels_f=fast_px, pixels_s=slow_px,
                       pixel_size_mm=pixel_fast_mm, fdet_vector=_triple(fdet), sdet_vector=_triple(sdet),
                       odet_vector=None, pix0_mm=_triple(pix0_mm))


def _placed_as_one(panel: PanelConfig, spindle: np.ndarray, polar: np.ndarray, path: Path,
                   number: int) -> dict[str, object]:
    """The detector options that place `panel` as nanoBragg's one panel (see the module's docstring)."""
    fdet, sdet, pix0_mm = (np.array(v) for v in (panel.fdet_vector, panel.sdet_vector, panel.pix0_mm))
    odet = _unit(np.cross(fdet, sdet))
    beam = np.array([1.0, 0.0, 0.0])
    if float(np.dot(odet, beam)) <= 0.0:
        raise InputFileError(str(path), f"experiment {number}: the panel does not face the beam")
    distance_mm = float(np.dot(pix0_mm, odet)) / float(np.dot(odet, beam))
    hit_mm = distance_mm * beam - pix0_mm
    fbeam_mm, sbeam_mm = float(np.dot(hit_mm, fdet)), float(np.dot(hit_mm, sdet))
    options: dict[str, object] = {**_DETECTOR_RESET, "pixel_size_mm": panel.pixel_size_mm, "pixels_f": panel.pixels_f,
                                  "pixels_s": panel.pixels_s, "distance_mm": distance_mm}
    vectors = {"fdet_vector": fdet, "sdet_vector": sdet, "polar_vector": polar, "spindle_axis": spindle}
    if all(np.linalg.norm(vectors[name] - np.array(axis)) < SQUARE_TOLERANCE for name, axis in MOSFLM_AXES.items()):
        half_pixel = 0.5 * panel.pixel_size_mm
        return {**options, "convention": "mosflm", "beam_x_mm": sbeam_mm - half_pixel,
                "beam_y_mm": fbeam_mm - half_pixel}
    return {**options, "convention": "custom", "pivot": "beam", "beam_x_mm": fbeam_mm, "beam_y_mm": sbeam_mm,
            "beam_vector": tuple(beam), "odet_vector": tuple(float(v) for v in odet),
            **{name: tuple(float(v) for v in vector) for name, vector in vectors.items()}}


def _triple(vector: np.ndarray) -> tuple[float, float, float]:
    x, y, z = (float(v) for v in vector)
    return x, y, z


def _panel_names(entries: list[dict]) -> list[str]:
    """The names nbsim gives a detector's panels: the last part of each DIALS name (dxtbx names an NXmx module's
    panel by its path), or panel0, panel1, ... where those are not distinct names CrystFEL could hold."""
    names = [str(entry.get("name") or "").rsplit("/", 1)[-1] for entry in entries]
    if len(set(names)) == len(names) and all(re.fullmatch(r"[A-Za-z0-9_]+", name) for name in names):
        return names
    return [f"panel{index}" for index in range(len(entries))]


def _parent_frames(detector: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each panel, the origin (mm) and axes (columns fast, slow, fast x slow) of the group it hangs from, in
    the lab: dxtbx writes a panel's vectors in its group's frame, each group's in its parent's, from the
    hierarchy's root (dxtbx's VirtualPanelFrame: global = parent origin + parent axes @ local). Panels outside a
    hierarchy are in the lab."""
    lab = (np.zeros(3), np.eye(3))
    frames: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def walk(node: dict, parent: tuple[np.ndarray, np.ndarray]) -> None:
        origin, axes = parent
        fast, slow = axes @ _unit(_vector(node["fast_axis"])), axes @ _unit(_vector(node["slow_axis"]))
        own = (origin + axes @ _vector(node["origin"]), np.stack([fast, slow, np.cross(fast, slow)], axis=1))
        for child in node.get("children") or []:
            if "panel" in child:
                frames[int(child["panel"])] = own
            else:
                walk(child, own)

    root = detector.get("hierarchy") or {}
    if root:
        walk(root, lab)
    return [frames.get(index, lab) for index in range(len(detector["panels"]))]


def _image(document: dict, experiment: dict, first_image: int | None, path: Path) -> str | None:
    """The image an experiment names (see ExperimentStart.image)."""
    imageset = _model(document, experiment, "imageset")
    if imageset is None:
        return None
    if "template" in imageset:
        template = _absolute(imageset["template"], path)
        number = first_image if first_image is not None else 1
        run = re.search(r"#+", template)
        if run:
            return template[:run.start()] + f"{number:0{len(run[0])}d}" + template[run.end():]
        return f"{template}#{number - 1}"
    images = imageset.get("images") or []
    sharing = [other for other in document["experiment"] if other.get("imageset") == experiment.get("imageset")]
    if len(images) == 1:
        index = 0
    elif len(images) == len(sharing):
        index = next(i for i, other in enumerate(sharing) if other is experiment)
    else:
        return None
    image = _absolute(images[index], path)
    indices = imageset.get("single_file_indices")
    return f"{image}#{int(indices[index])}" if indices else image


def _absolute(name: str, expt_path: Path) -> str:
    return str(name) if Path(name).is_absolute() else str((expt_path.parent / name).resolve())


@dataclass(frozen=True)
class PanelPlacement:
    """Where a refined panel lies, in nanoBragg's frame."""

    origin_mm: np.ndarray
    """The first pixel's outer corner (DIALS's panel origin), mm."""
    fast: np.ndarray
    slow: np.ndarray
    """Unit vectors along the panel's fast and slow pixel directions."""


@dataclass(frozen=True)
class RefinedExperiment:
    """A fitted experiment's crystal, wavelength and detector panels in nanoBragg's frame, to be written back as
    DIALS's (write_experiment_list)."""

    start: ExperimentStart
    a_matrix_per_A: np.ndarray
    """Rows a*, b*, c* (Å⁻¹) at φ = 0."""
    wavelength_A: float
    panels: tuple[PanelPlacement, ...]
    """Every panel of the experiment's detector, in its order."""


MODEL_KINDS = ("imageset", "beam", "detector", "goniometer", "scan", "crystal", "profile", "scaling_model")
"""The model lists an experiment list holds, which its experiments name by index."""
IMAGESET_PATHS = ("template", "mask", "gain", "pedestal", "dx", "dy")
"""An image set's keys that hold a file's path (besides `images`)."""


def write_experiment_list(path: str | Path, source: str | Path, refined: Sequence[RefinedExperiment]) -> None:
    """Write the refined experiments as a DIALS experiment list: each one's experiment of `source` (the list
    read_experiment_list read) with its crystal's real-space vectors, beam's wavelength and detector panels
    replaced by the refined ones, turned back into DIALS's frame (the reader's conversion inverted); its
    other models (image set, goniometer, scan, profile) and identifier as they were, relative image paths
    made absolute, and models equal in every field shared. The crystal's B_covariance (of DIALS's
    refinement) is dropped."""
    source = Path(source)
    document = json.loads(source.read_text())
    written: dict[str, object] = {"__id__": "ExperimentList", "experiment": [],
                                  **{kind: [] for kind in MODEL_KINDS}}
    for experiment in refined:
        original = document["experiment"][experiment.start.number]
        entry = dict(original)
        for kind in MODEL_KINDS:
            model = _model(document, original, kind)
            if model is None:
                continue
            model = copy.deepcopy(model)
            if kind == "crystal":
                _write_crystal(model, experiment)
            elif kind == "beam":
                model["wavelength"] = float(experiment.wavelength_A)
            elif kind == "detector":
                _write_panels(model, experiment)
            elif kind == "imageset":
                _absolute_paths(model, source)
            entry[kind] = _shared_index(written[kind], model)
        written["experiment"].append(entry)
    atomic_write_text(path, json.dumps({key: value for key, value in written.items() if value != []}, indent=2)
                      + "\n")


def _write_crystal(crystal: dict, experiment: RefinedExperiment) -> None:
    to_lab = experiment.start.to_nanobragg @ experiment.start.crystal_to_lab
    real = np.linalg.inv(np.asarray(experiment.a_matrix_per_A, dtype=np.float64)).T  # rows a, b, c
    for axis, row in zip("abc", real, strict=True):
        crystal[f"real_space_{axis}"] = [float(v) for v in to_lab.T @ row]
    crystal.pop("B_covariance", None)


def _write_panels(detector: dict, experiment: RefinedExperiment) -> None:
    """Every panel of the detector placed as refined, each in the frame of the hierarchy group it hangs from (as
    dxtbx writes it; the groups stay where they were)."""
    to_dials = experiment.start.to_nanobragg.T
    for entry, placement, (origin, axes) in zip(detector["panels"], experiment.panels, _parent_frames(detector),
                                                strict=True):
        entry["origin"] = [float(v) for v in np.linalg.solve(axes, to_dials @ placement.origin_mm - origin)]
        for name, vector in (("fast_axis", placement.fast), ("slow_axis", placement.slow)):
            entry[name] = [float(v) for v in np.linalg.solve(axes, to_dials @ np.asarray(vector))]


def _absolute_paths(imageset: dict, source: Path) -> None:
    for key in IMAGESET_PATHS:
        if isinstance(imageset.get(key), str) and imageset[key]:
            imageset[key] = _absolute(imageset[key], source)
    if isinstance(imageset.get("images"), list):
        imageset["images"] = [_absolute(name, source) for name in imageset["images"]]


def _shared_index(models: list, model: dict) -> int:
    """The index of `model` in `models`, appended unless an equal one is there."""
    for index, other in enumerate(models):
        if other == model:
            return index
    models.append(model)
    return len(models) - 1


def mosflm_matrix(a_matrix_per_A: np.ndarray, wavelength_A: float) -> tuple[float, ...]:
    """The nine numbers of a MOSFLM -mat file (columns a*, b*, c* times λ, row by row) for an A matrix of
    rows a*, b*, c* in Å⁻¹: what CrystalConfig.mosflm_matrix takes (nbsim.model.crystal.build_lattice undoes it)."""
    return tuple(float(v) for v in (np.asarray(a_matrix_per_A, dtype=np.float64).T * wavelength_A).ravel())


def cell_of(a_matrix_per_A: np.ndarray) -> tuple[float, float, float, float, float, float]:
    """a, b, c (Å) and alpha, beta, gamma (degrees) of the cell whose reciprocal vectors are the rows."""
    real = np.linalg.inv(np.asarray(a_matrix_per_A, dtype=np.float64)).T  # rows a, b, c
    lengths = np.linalg.norm(real, axis=1)
    angles = [math.degrees(math.acos(float(np.clip(np.dot(real[j], real[k]) / lengths[j] / lengths[k], -1, 1))))
              for j, k in ((1, 2), (0, 2), (0, 1))]
    a, b, c = (float(v) for v in lengths)
    return a, b, c, angles[0], angles[1], angles[2]


def dials_real_space(a_matrix_per_A: np.ndarray) -> dict[str, list[float]]:
    """A crystal's real_space_a/b/c (Å, DIALS's lab frame) for an A matrix of rows a*, b*, c* in nanoBragg's
    frame (a refined model, to be written as a DIALS crystal): the inverse of the reader's conversion for a
    beam along DIALS's -z and no goniometer rotations."""
    real = np.linalg.inv(np.asarray(a_matrix_per_A, dtype=np.float64)).T
    return {f"real_space_{axis}": [float(v) for v in DIALS_TO_NANOBRAGG.T @ row] for axis, row in zip("abc", real,
                                                                                                     strict=True)}


def mini_cbf_a_matrix(header_contents: str) -> np.ndarray | None:
    """The A matrix (rows a*, b*, c*, Å⁻¹, nanoBragg's frame, φ = 0) nbsim's miniCBF header records in its
    `nbsim A_matrix_per_A` lines (fabio's `_array_data.header_contents`); None if it has none."""
    rows = dict(re.findall(r"nbsim A_matrix_per_A ([abc]) (\S+ \S+ \S+)", header_contents))
    if set(rows) != {"a", "b", "c"}:
        return None
    return np.array([[float(v) for v in rows[axis].split()] for axis in "abc"])
