"""Structure factors from crystallographic files, read with gemmi: merged MTZ and sf-mmCIF reflection files
(-hkl, chosen by content) and atomic models (-model, PDB or mmCIF), each expanded from its space group to
the full sphere of P1 indices (symmetry mates and Friedel mates) that nanoBragg's table holds.

Every table is parsed once per process: `TABLES` and `MODELS` (explicit `ParsedFiles` objects) keep it by the
SHA-256 of the file's bytes (and the column, or the resolution a model is computed to), so a sweep's or a
series' images do not read it again: a model's |F| to 2 Å takes 2.2 s to compute and 0.2 ms to find again
(config/examples/model.cif, docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from ..config import StructureFactorConfig, check_cell
from ..errors import InputFileError, NbsimError
from .atomic import atomic_write_text
from .text import numeric_rows

HklFormat = Literal["mtz", "mmcif", "text"]
MTZ_MAGIC = b"MTZ "

# Column kinds as MTZ types: F amplitude, J mean intensity, G/K anomalous amplitude/intensity pair.
_AMPLITUDE, _INTENSITY, _AMPLITUDE_PAIR, _INTENSITY_PAIR = "F", "J", "G", "K"
_MMCIF_KINDS = {"F_meas_au": "F", "F_meas": "F", "F_calc": "F", "F_calc_au": "F", "intensity_meas": "J",
                "intensity_calc": "J", "F_squared_meas": "J", "F_squared_calc": "J", "pdbx_F_plus": "G",
                "pdbx_F_minus": "G", "pdbx_I_plus": "K", "pdbx_I_minus": "K"}
_SIGN_SUFFIXES = (("(+)", "(-)"), ("_plus", "_minus"), ("+", "-"))
Parsed = TypeVar("Parsed")


class ParsedFiles(Generic[Parsed]):
    """What files parsed to, by a key naming their content (its SHA-256) and how they were read; at most
    `capacity` entries, the oldest dropped first. A failed parse keeps nothing."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: dict[Hashable, Parsed] = {}
        self.parses = 0
        """How many times `get` parsed (its misses): what keeping entries saves is counted by it."""

    def get(self, key: Hashable, parse: Callable[[], Parsed]) -> Parsed:
        """The entry under `key`, made by `parse` (and kept) when there is none."""
        if key not in self._entries:
            value = parse()
            self.parses += 1
            self.keep(key, value)
        return self._entries[key]

    def keep(self, key: Hashable, value: Parsed) -> None:
        """Keep `value` under `key`: an entry parsed by another process (the worker keeps its commands')."""
        if key not in self._entries and len(self._entries) >= self.capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = value

    def items(self) -> list[tuple[Hashable, Parsed]]:
        """The entries kept, oldest first."""
        return list(self._entries.items())

    def clear(self) -> None:
        """Forget every entry (their arrays are freed once no configuration holds them)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class ReflectionTable:
    """A P1 table over the full sphere of indices, and where it came from."""

    reflections: np.ndarray
    """(reflections, 4): h, k, l, F; every symmetry and Friedel mate listed, absences left out."""
    cell_A_deg: tuple[float, float, float, float, float, float] | None
    """The file's unit cell (None for a plain text table)."""
    source: str | None
    """What the values are, e.g. "column FP (amplitudes)"; None for a plain text table."""
    from_intensities: bool = False

    def __post_init__(self) -> None:
        self.reflections.setflags(write=False)  # kept in TABLES: shared, so read-only


TABLES: ParsedFiles[ReflectionTable] = ParsedFiles()
"""The process's reflection tables (-hkl files and models' computed |F|)."""
MODELS: ParsedFiles[Any] = ParsedFiles()
"""The process's atomic models (gemmi structures), by their file's SHA-256."""


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (the key its parsed contents are kept under)."""
    return hashlib.sha256(_file_bytes(path)).hexdigest()


def table_provenance(structure: StructureFactorConfig) -> dict[str, str] | None:
    """The structure-factor file a configuration names (-hkl or -model), its -column and its content's
    SHA-256: the ground truth kept beside every image; None with -default_F alone."""
    path = structure.hkl_file or structure.model_file
    if path is None:
        return None
    return {"file": str(path), "column": structure.column or "", "sha256": file_digest(path)}


def _file_bytes(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InputFileError(str(path), f"cannot be read ({error.strerror or error})") from None


def hkl_format(path: str | Path) -> HklFormat:
    """An -hkl file's format, by content: the MTZ magic bytes, an mmCIF `_refln.` loop, else a text table."""
    return _format_of(_file_bytes(path), path)


def _format_of(content: bytes, path: str | Path) -> HklFormat:
    if content.startswith(MTZ_MAGIC):
        return "mtz"
    if b"_refln." in content:
        return "mmcif"
    if b"_atom_site." in content or content.lstrip().startswith((b"CRYST1", b"ATOM", b"HETATM", b"HEADER")):
        raise InputFileError(str(path), "an atomic model, not reflections: give it as -model")
    return "text"


def read_reflection_file(path: str | Path, column: str | None = None) -> ReflectionTable:
    """An -hkl file (MTZ, sf-mmCIF or nanoBragg's h k l F text) as a full-sphere P1 table; `column` picks
    an MTZ or mmCIF column (an amplitude, an intensity, or one half of an anomalous pair)."""
    content = _file_bytes(path)
    kind, digest = _format_of(content, path), hashlib.sha256(content).hexdigest()
    if kind == "text":
        if column is not None:
            raise InputFileError(str(path), f"-column {column}: a text table has no columns to choose from")
        return TABLES.get(("text", digest), lambda: ReflectionTable(read_hkl(path), None, None))
    return TABLES.get((kind, digest, column or ""), lambda: _read_merged(path, kind, column))


@dataclass(frozen=True)
class _MergedFile:
    """What nbsim takes from an MTZ or a reflection block of an mmCIF."""

    columns: dict[str, str]
    """label → kind (MTZ type; mmCIF tags mapped to one, "" where nbsim cannot use it)."""
    values: Callable[[str], np.ndarray]
    miller: np.ndarray
    cell: Any
    spacegroup: Any


def _open_merged(path: str, kind: HklFormat) -> _MergedFile:
    import gemmi

    if kind == "mtz":
        mtz = gemmi.read_mtz_file(path)
        labels = mtz.column_labels()
        return _MergedFile({c.label: c.type for c in mtz.columns},
                           lambda label: np.asarray(mtz.array[:, labels.index(label)], np.float64),
                           np.asarray(mtz.make_miller_array(), np.int64), mtz.cell, mtz.spacegroup)
    blocks = [b for b in gemmi.as_refln_blocks(gemmi.cif.read(path)) if b.default_loop is not None]
    if not blocks:
        raise InputFileError(path, "no _refln loop in this mmCIF file")
    block = blocks[0]
    return _MergedFile({label: _MMCIF_KINDS.get(label, "") for label in block.column_labels()},
                       lambda label: np.asarray(block.make_float_array(label), np.float64),
                       np.asarray(block.make_miller_array(), np.int64), block.cell, block.spacegroup)


def _read_merged(path: str | Path, kind: HklFormat, column: str | None) -> ReflectionTable:
    try:
        data = _open_merged(str(path), kind)
    except (RuntimeError, ValueError, IndexError) as error:
        raise InputFileError(str(path), f"not a readable {kind.upper()} file ({str(error).splitlines()[0]})") from None
    if data.spacegroup is None:
        raise InputFileError(str(path), "no space group in the file")
    columns = data.columns
    label = _choose_column(str(path), columns, column)
    pair = _anomalous_partner(label, columns) if columns[label] in (_AMPLITUDE_PAIR, _INTENSITY_PAIR) else None
    intensities = columns[label] in (_INTENSITY, _INTENSITY_PAIR)
    plus, minus = (data.values(label), None) if pair is None else (data.values(pair[0]), data.values(pair[1]))
    if intensities:
        plus = np.sqrt(np.maximum(plus, 0.0))
        minus = None if minus is None else np.sqrt(np.maximum(minus, 0.0))
    reflections = expand_to_p1_sphere(data.miller, plus, minus, data.spacegroup)
    if not len(reflections):
        raise InputFileError(str(path), f"column {label} holds no values")
    shown = label if pair is None else f"{pair[0]}/{pair[1]}"
    source = f"column {shown} ({'intensities, used as amplitudes sqrt(max(I,0))' if intensities else 'amplitudes'})"
    cell = tuple(float(v) for v in data.cell.parameters) if data.cell.is_crystal() else None
    return ReflectionTable(reflections, cell, source, intensities)


def _choose_column(path: str, columns: dict[str, str], column: str | None) -> str:
    """The column asked for, else the first amplitude, mean intensity, amplitude pair, intensity pair."""
    usable = [label for label, kind in columns.items() if kind in "FJGK" and kind]
    if column is not None:
        if column not in columns:
            raise InputFileError(path, f"no column {column} (columns: {', '.join(columns)})")
        if column not in usable:
            raise InputFileError(path, f"column {column} is neither an amplitude nor an intensity "
                                       f"(usable: {', '.join(usable) or 'none'})")
        return column
    for kind in (_AMPLITUDE, _INTENSITY, _AMPLITUDE_PAIR, _INTENSITY_PAIR):
        for label in usable:
            if columns[label] == kind:
                return label
    raise InputFileError(path, f"no amplitude or intensity column (columns: {', '.join(columns)})")


def _anomalous_partner(label: str, columns: dict[str, str]) -> tuple[str, str] | None:
    """The (plus, minus) labels of the anomalous pair `label` belongs to, named F(+)/F(-), F+/F- or
    pdbx_F_plus/pdbx_F_minus; None when its partner is missing."""
    for plus, minus in _SIGN_SUFFIXES:
        for own, other in ((plus, minus), (minus, plus)):
            if label.endswith(own):
                partner = label[:-len(own)] + other
                if columns.get(partner) == columns[label]:
                    return (label, partner) if own == plus else (partner, label)
    return None


def expand_to_p1_sphere(miller: np.ndarray, f_plus: np.ndarray, f_minus: np.ndarray | None,
                        spacegroup: Any) -> np.ndarray:
    """(n, 4) h k l F over the full sphere from unique reflections of a gemmi space group: every symmetry
    mate h·R takes F(+), its Friedel mate −h·R takes F(−) (F(+) without a pair, or where F(−) is missing).
    Missing values and systematic absences are left out (nanoBragg's -default_F fills them)."""
    ops = spacegroup.operations()
    minus = f_plus if f_minus is None else np.where(np.isnan(f_minus), f_plus, f_minus)
    plus = np.where(np.isnan(f_plus), minus, f_plus)
    present = ~np.isnan(plus) & ~ops.systematic_absences(np.ascontiguousarray(miller, np.int32))
    miller, plus, minus = miller[present], plus[present], minus[present]
    rotations = {tuple(map(tuple, op.rot)) for op in ops.sym_ops}
    parts = []
    for side, values in ((-1, minus), (1, plus)):  # F(+) last: it wins where both land on one index
        for rotation in sorted(rotations):
            mates = side * (miller @ (np.array(rotation, np.int64) // ops.sym_ops[0].DEN))
            parts.append(np.column_stack([mates, values]))
    rows = np.concatenate(parts)[::-1]
    _, first = np.unique(rows[:, :3], axis=0, return_index=True)
    return rows[first]


def read_hkl(path: str | Path) -> np.ndarray:
    """Rows of h, k, l, F from a text file; indices must be integers, F a finite number."""
    rows = numeric_rows(path, 4, 4)
    if not rows:
        raise InputFileError(str(path), "no reflections in file")
    for line_number, (h, k, l, _) in rows:
        if h != round(h) or k != round(k) or l != round(l):
            raise InputFileError(str(path), f"Miller indices must be integers (got {h:g} {k:g} {l:g})",
                                 line_number)
    return np.array([values for _, values in rows], dtype=np.float64)


def write_hkl(path: str | Path, reflections: np.ndarray) -> None:
    """An (n, 4) h k l F table as the text nanoBragg's -hkl reads (F to full float64 precision)."""
    atomic_write_text(path, "".join(f"{h:.0f} {k:.0f} {l:.0f} {float(f)!r}\n" for h, k, l, f in reflections))


@dataclass(frozen=True)
class AtomicModel:
    """An atomic model's cell and atom count (its atoms stay in gemmi, in the module's cache)."""

    cell_A_deg: tuple[float, float, float, float, float, float]
    atoms: int
    digest: str


def _read_structure(path: str | Path) -> tuple[str, Any]:
    """A model file's SHA-256 and its gemmi structure (kept in MODELS)."""
    import gemmi

    def parse() -> Any:
        try:
            structure = gemmi.read_structure(str(path))
        except (RuntimeError, ValueError) as error:
            raise InputFileError(str(path), f"not a readable model ({str(error).splitlines()[0]})") from None
        except IndexError:  # gemmi's mmCIF reader on a file without a data block (empty, or comments only)
            raise InputFileError(str(path), "not a readable model (no data block)") from None
        structure.setup_entities()
        return structure

    digest = file_digest(path)
    return digest, MODELS.get(digest, parse)


def read_model(path: str | Path) -> AtomicModel:
    """A PDB or mmCIF model, checked: it has atoms, each at a finite position with a finite occupancy and
    B factor, and a unit cell that exists (a NaN coordinate or a zero-length cell left no reflections)."""
    digest, structure = _read_structure(path)
    atoms = structure[0].count_atom_sites() if len(structure) else 0
    if atoms == 0:
        raise InputFileError(str(path), "the model has no atoms")
    if not structure.cell.is_crystal():
        raise InputFileError(str(path), "the model has no unit cell (a CRYST1 record or _cell values)")
    cell = tuple(float(v) for v in structure.cell.parameters)
    try:
        if not all(math.isfinite(v) and v > 0 for v in cell[:3]):
            raise NbsimError(f"cell {' '.join(f'{v:g}' for v in cell)}: the lengths must be positive")
        check_cell(cell)
    except NbsimError as error:
        raise InputFileError(str(path), f"the model's {error}") from None
    for site in structure[0].all():
        atom = site.atom
        if not all(map(math.isfinite, (atom.pos.x, atom.pos.y, atom.pos.z, atom.occ, atom.b_iso))):
            raise InputFileError(str(path), f"atom {atom.name} of residue {site.residue.name} {site.residue.seqid}: "
                                            "coordinates, occupancy and B factor must be finite numbers")
    return AtomicModel(cell, atoms, digest)


def model_reflections(path: str | Path, d_min_A: float) -> ReflectionTable:
    """|F| of a model's first model to resolution `d_min_A`, by gemmi's direct summation
    (StructureFactorCalculatorX: IT92 form factors, the atoms' B factors and occupancies, no bulk solvent)
    over the unique reflections of its space group, expanded to the full P1 sphere."""
    import gemmi

    model = read_model(path)
    key = ("model", model.digest, f"{d_min_A:.6g}")

    def compute() -> ReflectionTable:
        _, structure = _read_structure(path)
        spacegroup = structure.find_spacegroup() or gemmi.SpaceGroup("P 1")  # no space group given: P1
        miller = np.asarray(gemmi.make_miller_array(structure.cell, spacegroup, d_min_A), np.int64)
        calculator = gemmi.StructureFactorCalculatorX(structure.cell)
        amplitudes = np.array([abs(calculator.calculate_sf_from_model(structure[0], [int(i) for i in hkl]))
                               for hkl in miller], np.float64)
        reflections = expand_to_p1_sphere(miller, amplitudes, None, spacegroup)
        return ReflectionTable(reflections, model.cell_A_deg,
                               f"model, {model.atoms} atoms, |F| by direct summation to {d_min_A:.3g} A")

    return TABLES.get(key, compute)


@dataclass(frozen=True)
class ModelPartials:
    """A model's structure factors split for anomalous scattering, at its unique reflections (d ≥ d_min):
    F0 with the normal form factors (gemmi's direct summation), and per element the partial sum
    G_el(h) = Σ occupancy·Debye–Waller·exp(2πi h·x) over that element's atoms and their symmetry images, so
    that F(h) = F0(h) + Σ_el (f′_el + i·f″_el)·G_el(h) and
    F(−h) = conj(F0(h)) + Σ_el (f′_el + i·f″_el)·conj(G_el(h))."""

    miller: np.ndarray
    F0: np.ndarray
    elements: tuple[str, ...]
    G: np.ndarray
    """(elements, reflections), complex."""
    cell_A_deg: tuple[float, float, float, float, float, float]
    spacegroup: Any


PARTIALS: ParsedFiles[ModelPartials] = ParsedFiles()
"""Each model's anomalous partial sums, by its digest and resolution."""


def model_partials(path: str | Path, d_min_A: float) -> ModelPartials:
    """The model's F0 and per-element partial sums (kept per process by its digest and resolution)."""
    model = read_model(path)
    return PARTIALS.get((model.digest, f"{d_min_A:.6g}"), lambda: _partials(path, model, d_min_A))


def _partials(path: str | Path, model: AtomicModel, d_min_A: float) -> ModelPartials:
    """ModelPartials computed (model_partials keeps them)."""
    import gemmi

    _, structure = _read_structure(path)
    spacegroup = structure.find_spacegroup() or gemmi.SpaceGroup("P 1")
    miller = np.asarray(gemmi.make_miller_array(structure.cell, spacegroup, d_min_A), np.int64)
    calculator = gemmi.StructureFactorCalculatorX(structure.cell)
    F0 = np.array([calculator.calculate_sf_from_model(structure[0], [int(i) for i in hkl]) for hkl in miller],
                  np.complex128)
    images = [(np.eye(3), np.zeros(3))] + [(np.array(image.mat.tolist()), np.array(image.vec.tolist()))
                                           for image in structure.cell.images]
    orthogonal = np.array(structure.cell.frac.mat.tolist())  # x_frac = frac · x_cart
    atoms: dict[str, list[Any]] = {}
    for residue in (residue for chain in structure[0] for residue in chain):
        for atom in residue:
            atoms.setdefault(atom.element.name, []).append(atom)
    elements = tuple(sorted(atoms))
    G = np.zeros((len(elements), len(miller)), np.complex128)
    for index, element in enumerate(elements):
        G[index] = _partial_sum(miller, atoms[element], structure.cell, images, orthogonal)
    return ModelPartials(miller, F0, elements, G, model.cell_A_deg, spacegroup)


def _partial_sum(miller: np.ndarray, atoms: list[Any], cell: Any, images: list[tuple[np.ndarray, np.ndarray]],
                 frac: np.ndarray) -> np.ndarray:
    """Σ over atoms and symmetry images of occupancy·DW(h·R)·exp(2πi h·(R x + t)); DW from B (isotropic) or
    U (anisotropic, Cartesian Å²) of the atom, at the image's rotated index h·R."""
    positions = np.array([cell.fractionalize(atom.pos).tolist() for atom in atoms])
    occupancy = np.array([atom.occ for atom in atoms])
    b_iso = np.array([atom.b_iso for atom in atoms])
    aniso = [atom.aniso.nonzero() for atom in atoms]
    u_cart = np.array([np.array(atom.aniso.as_mat33().tolist()) if has else np.zeros((3, 3))
                       for atom, has in zip(atoms, aniso, strict=True)])
    has_aniso = np.array(aniso)
    total = np.zeros(len(miller), np.complex128)
    for start in range(0, len(miller), 4096):
        h = miller[start:start + 4096].astype(np.float64)
        for rotation, translation in images:
            rotated = h @ rotation  # (n, 3): h·R
            s_cart = rotated @ frac  # reciprocal vector of h·R in Cartesian Å⁻¹
            stol_sqr = 0.25 * np.einsum("ni,ni->n", s_cart, s_cart)
            dw = np.exp(-b_iso[None, :] * stol_sqr[:, None])
            if has_aniso.any():
                quadratic = np.einsum("ni,aij,nj->na", s_cart, u_cart, s_cart)
                dw = np.where(has_aniso[None, :], np.exp(-2.0 * np.pi ** 2 * quadratic), dw)
            phase = 2.0 * np.pi * (rotated @ positions.T + (h @ translation)[:, None])
            total[start:start + len(h)] += (occupancy[None, :] * dw * np.exp(1j * phase)).sum(axis=1)
    return total


def anomalous_model_tables(partials: ModelPartials, factors: list[dict[str, tuple[float, float]]],
                           descriptions: list[str]) -> list[ReflectionTable]:
    """The full-sphere P1 |F| tables of a model, one per set of f′ and f″ per element (`factors`): F(+) at h·R,
    F(−) at −h·R. The expansion is the same for every set, so it is made once (on the reflections' positions)
    and each table only gathers its values."""
    count = len(partials.miller)
    positions = np.arange(count, dtype=np.float64)
    expanded = expand_to_p1_sphere(partials.miller, positions, positions + count, partials.spacegroup)
    source = expanded[:, 3].astype(np.int64)
    tables = []
    for channel, description in zip(factors, descriptions, strict=True):
        plus = partials.F0.copy()
        minus = np.conj(partials.F0)
        for index, element in enumerate(partials.elements):
            fp, fpp = channel.get(element, (0.0, 0.0))
            plus += complex(fp, fpp) * partials.G[index]
            minus += complex(fp, fpp) * np.conj(partials.G[index])
        amplitudes = np.concatenate([np.abs(plus), np.abs(minus)])
        tables.append(ReflectionTable(np.column_stack([expanded[:, :3], amplitudes[source]]), partials.cell_A_deg,
                                      description))
    return tables
