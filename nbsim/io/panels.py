"""Multi-panel detectors (-panelfile): nbsim's own YAML panel list, or a CrystFEL geometry file read by
cfelpyutils (`load_crystfel_geometry`), both checked for degenerate and overlapping panels
(docs/formats.md); both written back (`write_panel_file`, `write_crystfel_geometry`: a fit's refined
detector); the panel groups a fit moves (`read_panel_groups`). Every error names the file and the panel."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..config import PanelConfig, Vector3
from ..errors import InputFileError, NbsimError
from .atomic import atomic_write_text
from .text import read_text

PANEL_KEYS = {"name", "pixels", "pixel_mm", "fdet", "sdet", "odet", "pix0_mm"}
REQUIRED_KEYS = PANEL_KEYS - {"odet"}

CRYSTFEL_TO_LAB = np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
"""CrystFEL's frame (x, y, z: z along the beam, y up) → nbsim's lab frame (beam along +x): (z, y, -x), the
inverse of the McStas rotation io/detector_images uses for the default (MOSFLM) beam and polarization."""

PARALLEL_SINE = 1e-6
"""fdet and sdet whose unit vectors' cross product is shorter than this are parallel."""


def read_panel_file(path: str | Path) -> tuple[PanelConfig, ...]:
    """The panels of a YAML panel list or, for a `.geom` file (or one that reads like one), a CrystFEL
    geometry; checked by `check_panels`."""
    text = read_text(path)
    is_geom = str(path).endswith(".geom") or ("/min_fs" in text and "panels:" not in text)
    panels = _read_geom(str(path)) if is_geom else _read_yaml(str(path), text)
    check_panels(panels, str(path))
    return panels


def _yaml_document(path: str, text: str, kind: str = "YAML"):
    """The YAML document in `text`; a one-line error naming the file and the line where it is not `kind`."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise InputFileError(path, f"not valid {kind} ({getattr(error, 'problem', None) or error})",
                             None if mark is None else mark.line + 1) from None


def _read_yaml(path: str, text: str) -> tuple[PanelConfig, ...]:
    document = _yaml_document(path, text)
    if not isinstance(document, dict) or not isinstance(document.get("panels"), list) or not document["panels"]:
        raise InputFileError(path, "a panel file holds 'panels:', a list of at least one panel")
    if set(document) != {"panels"}:
        raise InputFileError(path, f"unknown top-level key(s) {', '.join(sorted(set(document) - {'panels'}))} "
                                   "(only 'panels' is read)")
    return tuple(_yaml_panel(path, index, entry) for index, entry in enumerate(document["panels"]))


def _yaml_panel(path: str, index: int, entry) -> PanelConfig:
    label = f"panel {index}"
    if not isinstance(entry, dict):
        raise InputFileError(path, f"{label}: a panel is a mapping of {', '.join(sorted(PANEL_KEYS))}")
    if "name" in entry:
        label = f"panel {entry['name']!r}"
    missing, unknown = REQUIRED_KEYS - set(entry), set(entry) - PANEL_KEYS
    if missing:
        raise InputFileError(path, f"{label}: missing {', '.join(sorted(missing))}")
    if unknown:
        raise InputFileError(path, f"{label}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    pixels = entry["pixels"]
    if not (isinstance(pixels, list) and len(pixels) == 2 and all(type(n) is int for n in pixels)):
        raise InputFileError(path, f"{label}: pixels must be two integers [fast, slow]")
    odet = entry.get("odet")
    return PanelConfig(
        name=str(entry["name"]), pixels_f=pixels[0], pixels_s=pixels[1],
        pixel_size_mm=_number(path, label, "pixel_mm", entry["pixel_mm"]),
        fdet_vector=_vector(path, label, "fdet", entry["fdet"]),
        sdet_vector=_vector(path, label, "sdet", entry["sdet"]),
        odet_vector=None if odet is None else _vector(path, label, "odet", odet),
        pix0_mm=_vector(path, label, "pix0_mm", entry["pix0_mm"]))


def _number(path: str, label: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputFileError(path, f"{label}: {key} must be a finite number (got {value!r})")
    return float(value)


def _vector(path: str, label: str, key: str, value) -> Vector3:
    if not (isinstance(value, list) and len(value) == 3):
        raise InputFileError(path, f"{label}: {key} must be three numbers [x, y, z] (got {value!r})")
    x, y, z = (_number(path, label, key, v) for v in value)
    return x, y, z


def _read_geom(path: str) -> tuple[PanelConfig, ...]:
    """A CrystFEL geometry's panels in nbsim's lab frame: pixel size 1/res, the fs and ss directions
    (normalised: nbsim's pixels are square), the first pixel's corner at (corner_x, corner_y)/res and
    clen + coffset along the beam. A clen read from the data (an HDF5 path) has no value here: refused."""
    with warnings.catch_warnings():  # its mypy_extensions.TypedDict warns on import; nothing for the user
        warnings.simplefilter("ignore", DeprecationWarning)
        from cfelpyutils.geometry import load_crystfel_geometry

    try:
        geometry = load_crystfel_geometry(path)
    except Exception as error:  # noqa: BLE001 - the reader raises bare RuntimeError/ValueError/KeyError alike
        message = " ".join(str(error).split()) or type(error).__name__
        raise InputFileError(path, f"CrystFEL geometry rejected by cfelpyutils: {message}") from None
    panels = geometry.detector["panels"]
    if not panels:
        raise InputFileError(path, "the geometry has no panels")
    return tuple(_geom_panel(path, name, panel) for name, panel in panels.items())


def _geom_panel(path: str, name: str, panel: dict) -> PanelConfig:
    label = f"panel {name!r}"
    res = float(panel["res"])
    clen = panel["clen"]
    if not (isinstance(clen, (int, float)) and math.isfinite(clen)):
        raise InputFileError(path, f"{label}: clen must be a number in metres (a clen read from the data, "
                                   f"{panel.get('clen_from') or clen!r}, is not supported)")
    if not (math.isfinite(res) and res > 0):
        raise InputFileError(path, f"{label}: res must be positive pixels per metre (got {res:g})")

    def lab(x: float, y: float, z: float) -> Vector3:
        a, b, c = (float(v) for v in CRYSTFEL_TO_LAB @ np.array([x, y, z], dtype=np.float64))
        return a, b, c

    pixel_m = 1.0 / res
    corner_m = (panel["cnx"] * pixel_m, panel["cny"] * pixel_m, float(clen) + float(panel["coffset"]))
    fs, ss = (panel["fsx"], panel["fsy"], panel["fsz"]), (panel["ssx"], panel["ssy"], panel["ssz"])
    if not np.dot(np.cross(fs, ss), corner_m) > 0:  # check_panels' odet check, in the terms of the file
        raise InputFileError(path, f"{label}: fs x ss points towards the sample (a mirrored read-out); nbsim's "
                                   "panels face away from it, fs x ss along +z for a panel across the beam: "
                                   "reverse ss (and corner_y) or fs (and corner_x)")
    return PanelConfig(
        name=name, pixels_f=int(panel["w"]), pixels_s=int(panel["h"]), pixel_size_mm=pixel_m * 1000.0,
        fdet_vector=lab(*fs), sdet_vector=lab(*ss), odet_vector=None,
        pix0_mm=tuple(1000.0 * v for v in lab(*corner_m)))


def check_panels(panels: tuple[PanelConfig, ...], path: str) -> None:
    """One-line errors for a duplicate name, a panel without pixels or with a non-positive pixel size,
    zero-length or parallel fast and slow axes, a zero-length normal or one pointing towards the sample,
    or two panels overlapping as seen from the sample (a centre of one panel's edge pixels inside another
    panel; edges may touch)."""
    names = [p.name for p in panels]
    for p in panels:
        label = f"panel {p.name!r}"
        if names.count(p.name) > 1:
            raise InputFileError(path, f"{label}: two panels have this name")
        if p.pixels_f <= 0 or p.pixels_s <= 0:
            raise InputFileError(path, f"{label}: no pixels ({p.pixels_f} x {p.pixels_s}, fast x slow)")
        if not p.pixel_size_mm > 0:
            raise InputFileError(path, f"{label}: the pixel size must be positive (got {p.pixel_size_mm:g} mm)")
        f, s = np.array(p.fdet_vector), np.array(p.sdet_vector)
        for key, vector in (("fdet", f), ("sdet", s), ("odet", p.odet_vector)):
            if vector is not None and not np.linalg.norm(vector) > 0:
                raise InputFileError(path, f"{label}: {key} has zero length")
        normal = np.cross(f / np.linalg.norm(f), s / np.linalg.norm(s))
        if np.linalg.norm(normal) < PARALLEL_SINE:
            raise InputFileError(path, f"{label}: fdet and sdet are parallel (the panel has no area)")
        odet = normal if p.odet_vector is None else np.array(p.odet_vector)
        if not np.array(p.pix0_mm) @ odet > 0:
            raise InputFileError(path, f"{label}: odet{' (fdet x sdet)' if p.odet_vector is None else ''} must point "
                                       "away from the sample (nanoBragg's solid angle divides by pix0 . odet)")
    frames = [_Frame(p) for p in panels]
    for a, frame_a in zip(panels, frames, strict=True):
        for b, frame_b in zip(panels, frames, strict=True):
            if a is not b and frame_a.may_meet(frame_b) and frame_a.crossed_by(frame_b.edge_centres()):
                raise InputFileError(path, f"panel {b.name!r} overlaps panel {a.name!r} as seen from the sample")


class _Frame:
    """A panel's corner pix0 (m), unit fast and slow axes, pixel size (m) and pixel counts."""

    def __init__(self, p: PanelConfig):
        f, s = np.array(p.fdet_vector), np.array(p.sdet_vector)
        self.pix0 = np.array(p.pix0_mm) / 1000.0
        self.fast, self.slow = f / np.linalg.norm(f), s / np.linalg.norm(s)
        self.pixel_m = p.pixel_size_mm / 1000.0
        self.counts = (p.pixels_f, p.pixels_s)
        self.cone_ = self.cone()

    def cone(self) -> tuple[np.ndarray, float]:
        """The unit direction of the panel's centre from the sample, and an angle (radians) bounding the panel
        as seen from the sample: the largest to a corner (a spherical cap under 90 degrees holds the corners'
        convex hull), else pi."""
        extent_f, extent_s = (n * self.pixel_m for n in self.counts)
        corners = np.array([self.pix0 + f * self.fast + s * self.slow
                            for f in (0.0, extent_f) for s in (0.0, extent_s)])
        corners /= np.linalg.norm(corners, axis=1, keepdims=True)
        centre = corners.sum(axis=0)
        length = float(np.linalg.norm(centre))
        if length < 1e-9:
            return corners[0], math.pi
        centre /= length
        radius = float(np.arccos(np.clip(corners @ centre, -1.0, 1.0)).max())
        return centre, radius if radius < math.pi / 2 else math.pi

    def may_meet(self, other: _Frame) -> bool:
        """Whether the two panels' cones overlap (else no ray from the sample crosses both)."""
        (centre, radius), (other_centre, other_radius) = self.cone_, other.cone_
        return float(np.arccos(np.clip(centre @ other_centre, -1.0, 1.0))) < radius + other_radius + 1e-9

    def edge_centres(self) -> np.ndarray:
        """(N, 3) centres of the panel's edge pixels."""
        count_f, count_s = self.counts
        f = np.concatenate([np.arange(count_f), np.arange(count_f), np.zeros(count_s), np.full(count_s, count_f - 1)])
        s = np.concatenate([np.zeros(count_f), np.full(count_f, count_s - 1), np.arange(count_s), np.arange(count_s)])
        return (self.pix0 + ((f + 0.5) * self.pixel_m)[:, None] * self.fast
                + ((s + 0.5) * self.pixel_m)[:, None] * self.slow)

    def crossed_by(self, points: np.ndarray) -> bool:
        """Whether a ray from the sample through any of `points` crosses the panel's open rectangle."""
        normal = np.cross(self.fast, self.slow)
        along = points @ normal
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (self.pix0 @ normal) / along
        hit = t[:, None] * points - self.pix0
        axes = np.stack([self.fast, self.slow])
        gram = axes @ axes.T
        u, v = np.linalg.solve(gram, axes @ hit.T) / self.pixel_m
        count_f, count_s = self.counts
        inside = (t > 0) & np.isfinite(t) & (u > 0) & (u < count_f) & (v > 0) & (v < count_s)
        return bool(inside.any())


def write_panel_file(path: str | Path, panels: Sequence[PanelConfig]) -> None:
    """`panels` as nbsim's YAML panel list (what -panelfile reads; every number in full precision)."""
    import yaml

    entries = []
    for p in panels:
        entry = {"name": p.name, "pixels": [p.pixels_f, p.pixels_s], "pixel_mm": p.pixel_size_mm,
                 "fdet": list(p.fdet_vector), "sdet": list(p.sdet_vector)}
        if p.odet_vector is not None:
            entry["odet"] = list(p.odet_vector)
        entry["pix0_mm"] = list(p.pix0_mm)
        entries.append(entry)
    atomic_write_text(path, yaml.safe_dump({"panels": entries}, sort_keys=False, default_flow_style=None))


CRYSTFEL_PANEL_NAME = re.compile(r"[A-Za-z0-9_]+")
"""Panel names a CrystFEL geometry can hold (its keys are NAME/field; `bad...` names bad regions, `rigid_group...`
its groups)."""


def write_crystfel_geometry(path: str | Path, panels: Sequence[PanelConfig],
                            groups: Mapping[str, Sequence[str]] | None = None) -> None:
    """`panels` as a CrystFEL geometry: the data laid out as nbsim's NXmx writes it (/entry/data/data, frames ×
    (panels × slow) × fast, the panels one below the other each in a slab as high as the highest: `dim0 = %`,
    `dim1 = ss`, `dim2 = fs`, panel k's min_ss k × that height), res = 1/pixel,
    fs and ss in CrystFEL's frame (the inverse of `CRYSTFEL_TO_LAB`), the first pixel's corner as corner_x,
    corner_y (pixels) and clen + coffset (m; clen the panels' mean); `groups` (name → panel names) as rigid
    groups (`check_crystfel_panels` says what cannot be written)."""
    lab_to_crystfel = CRYSTFEL_TO_LAB.T
    corners = [[float(v) for v in lab_to_crystfel @ (np.array(p.pix0_mm) / 1000.0)] for p in panels]
    clen = float(np.mean([corner[2] for corner in corners]))
    lines = [f"; {len(panels)} panels written by nbsim (nbsim.io.panels.write_crystfel_geometry)",
             f"clen = {clen!r}", "adu_per_photon = 1", "data = /entry/data/data", "dim0 = %", "dim1 = ss",
             "dim2 = fs", ""]
    slab_slow = max(p.pixels_s for p in panels)
    check_crystfel_panels(panels)
    for index, (p, corner) in enumerate(zip(panels, corners, strict=True)):
        fast = lab_to_crystfel @ _unit(p.fdet_vector)
        slow = lab_to_crystfel @ _unit(p.sdet_vector)
        pixel_m = p.pixel_size_mm / 1000.0
        first_ss = index * slab_slow
        lines += [f"{p.name}/min_fs = 0", f"{p.name}/max_fs = {p.pixels_f - 1}", f"{p.name}/min_ss = {first_ss}",
                  f"{p.name}/max_ss = {first_ss + p.pixels_s - 1}", f"{p.name}/res = {1.0 / pixel_m!r}",
                  f"{p.name}/fs = {_crystfel_direction(fast)}", f"{p.name}/ss = {_crystfel_direction(slow)}",
                  f"{p.name}/corner_x = {corner[0] / pixel_m!r}", f"{p.name}/corner_y = {corner[1] / pixel_m!r}",
                  f"{p.name}/coffset = {corner[2] - clen!r}", ""]
    for name, members in (groups or {}).items():
        lines.append(f"rigid_group_{name} = {','.join(members)}")
    if groups:
        lines.append(f"rigid_group_collection_nbsim = {','.join(groups)}")
    atomic_write_text(path, "\n".join(lines).rstrip("\n") + "\n")


def check_crystfel_panels(panels: Sequence[PanelConfig]) -> None:
    """A one-line error for a panel a CrystFEL geometry cannot hold: a name other than letters, digits and _ (or
    one CrystFEL reads as a bad region or a rigid group), an odet other than fdet × sdet (CrystFEL takes the
    normal from the axes)."""
    for p in panels:
        if not CRYSTFEL_PANEL_NAME.fullmatch(p.name) or p.name.startswith(("bad", "rigid_group")):
            raise NbsimError(f"panel {p.name!r} cannot be named in a CrystFEL geometry (letters, digits and _ only, "
                             "not starting with bad or rigid_group)")
        normal = np.cross(_unit(p.fdet_vector), _unit(p.sdet_vector))
        if p.odet_vector is not None and not np.allclose(_unit(p.odet_vector), normal / np.linalg.norm(normal)):
            raise NbsimError(f"panel {p.name!r}: its odet is not fdet x sdet, which a CrystFEL geometry cannot say")


def _unit(vector: Vector3) -> np.ndarray:
    array = np.array(vector, dtype=np.float64)
    return array / np.linalg.norm(array)


def _crystfel_direction(vector: np.ndarray) -> str:
    """A direction as CrystFEL writes one (+0.5x -0.25y +0z): fixed-point numbers, since its reader splits the
    terms at every sign (an exponent's too)."""
    return " ".join(f"{value:+.15f}{axis}" for value, axis in zip(vector, "xyz", strict=True))


def read_panel_groups(path: str | Path, panel_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The panel groups of a YAML (or JSON) file: a mapping of group name to its panels' names, each panel in one
    group at most (panels no group names stay where they are); one-line errors for anything else, a panel name
    the detector does not have included."""
    document = _yaml_document(str(path), read_text(path), "YAML or JSON")
    if not isinstance(document, dict) or not document:
        raise InputFileError(str(path), "a groups file maps each group's name to a list of its panels' names")
    groups: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for name, members in document.items():
        if not (isinstance(members, list) and members and all(isinstance(m, str) for m in members)):
            raise InputFileError(str(path), f"group {name!r}: a list of at least one panel name")
        for member in members:
            if member not in panel_names:
                known = ", ".join(panel_names[:8]) + (", ..." if len(panel_names) > 8 else "")
                raise InputFileError(str(path), f"group {name!r}: no panel {member!r} (the detector's panels: {known})")
            if member in owner:
                raise InputFileError(str(path), f"panel {member!r} is in groups {owner[member]!r} and {name!r}")
            owner[member] = str(name)
        groups[str(name)] = tuple(members)
    return groups
