"""The reflections a merge refines: the space group's asymmetric unit (gemmi), each unique reflection's |F|
(with `anomalous`, |F(+)| and |F(−)| apart; a centric reflection keeps one value, since F(+) = F(−) there),
where every node of the kernel's P1 table (each symmetry and Friedel mate) takes its value from, and
resolution shells and correlations to compare with a truth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NbsimError
from ..model.structure_factors import HKLGrid, build_grid


def space_group(name: str) -> Any:
    """The gemmi space group of a Hermann–Mauguin name or number ("P 21 21 21", "P212121", "19")."""
    import gemmi

    found = gemmi.find_spacegroup_by_number(int(name)) if name.strip().isdigit() else \
        gemmi.find_spacegroup_by_name(name)
    if found is None:
        raise NbsimError(f"unknown space group {name!r}")
    return found


def lattice_system_of(group: Any) -> str:
    """The lattice system (nbsim.fit's names) whose free cell parameters a space group allows: what each shot's
    cell is refined within (a monoclinic group other than b-unique, whose free angle nbsim.fit does not take,
    refines as triclinic)."""
    system = group.crystal_system_str()
    if system == "trigonal":
        return "rhombohedral" if group.ext == "R" else "hexagonal"
    if system == "monoclinic":
        axes = group.hm.split()[1:]
        return "monoclinic" if len(axes) == 3 and axes[0] == axes[2] == "1" else "triclinic"
    return system


def check_cell(cell_A_deg: tuple[float, ...], group: Any, what: str) -> None:
    """A cell its space group's lattice cannot have (a hexagonal group with a ≠ b, ...) is an input error."""
    import gemmi

    if not gemmi.UnitCell(*cell_A_deg).is_compatible_with_spacegroup(group):
        cell = " ".join(f"{v:g}" for v in cell_A_deg)
        raise NbsimError(f"{what}: the cell {cell} contradicts space group {group.hm}")


TWIN_OBLIQUITY_DEG = 3.0
"""How far from a symmetry of the lattice another indexing may be (gemmi.find_twin_laws; DIALS's LePage default,
as benchmarks/dials_route.py uses)."""


def other_indexings(group: Any, cell_A_deg: tuple[float, ...]) -> list[tuple[str, np.ndarray]]:
    """The other ways a lattice of this cell can be indexed in this space group: symmetries of the lattice that
    are not the point group's (gemmi's twin laws, proper rotations), each as its reindexing (h,k,l → "k,h,-l")
    and the rotation R (fractional, acting on real-space coordinates; h is reindexed h·R). A still indexed on its
    own comes out in any of them: P 61's k,h,−l (the lattice is 6/mmm, the point group 6); none for P 21 21 21 at
    50 × 60 × 70 Å or P 43 21 2 (the lattice's symmetry is the point group's). Of each twin law's equivalents
    (times the group's rotations) the plainest: a signed permutation of the axes where there is one, which keeps
    the crystal's shape, N cells along each axis (`state.reindexed_start`), as k,h,−l does and −h−k,k,−l would
    not."""
    import gemmi

    def plainness(operator: Any) -> tuple:
        rotation = np.array(operator.rot, np.float64) / operator.DEN
        return np.count_nonzero(rotation), -rotation.sum(), operator.as_hkl().triplet()

    found = []
    for twin in gemmi.find_twin_laws(gemmi.UnitCell(*cell_A_deg), group, TWIN_OBLIQUITY_DEG, False):
        plainest = min((twin * operation for operation in group.operations()), key=plainness)
        found.append((plainest.as_hkl().triplet(), np.array(plainest.rot, np.float64) / plainest.DEN))
    return found


@dataclass(frozen=True)
class Reflections:
    """The unique reflections of the asymmetric unit and how their |F| are laid out as parameters: F(+) of
    reflection i is parameter `plus[i]`, F(−) is `minus[i]` (the same index without `anomalous`, and for
    centric reflections)."""

    miller: np.ndarray
    """(n, 3) indices in the space group's reciprocal asymmetric unit."""
    d_A: np.ndarray
    centric: np.ndarray
    anomalous: bool
    group: Any
    cell_A_deg: tuple[float, ...]

    @property
    def plus(self) -> np.ndarray:
        """The parameter of each reflection's F(+)."""
        return np.arange(len(self.miller))

    @property
    def minus(self) -> np.ndarray:
        """The parameter of each reflection's F(−): after the F(+) block, for acentric ones with `anomalous`."""
        if not self.anomalous:
            return self.plus
        acentric = ~self.centric
        minus = self.plus.copy()
        minus[acentric] = len(self.miller) + np.arange(int(acentric.sum()))
        return minus

    @property
    def size(self) -> int:
        """How many |F| are refined."""
        return len(self.miller) + (int((~self.centric).sum()) if self.anomalous else 0)

    def parameter_d_A(self) -> np.ndarray:
        """Each parameter's resolution (Å)."""
        d = np.empty(self.size)
        d[self.plus], d[self.minus] = self.d_A, self.d_A
        return d

    def friedel_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The (F(+), F(−)) parameters of the pairs refined apart."""
        apart = self.plus != self.minus
        return self.plus[apart], self.minus[apart]

    def parameters_of(self, plus: np.ndarray, minus: np.ndarray) -> np.ndarray:
        """F(+) and F(−) per reflection as one parameter vector (F(+) where a pair is tied)."""
        values = np.empty(self.size)
        values[self.minus] = minus
        values[self.plus] = plus
        return values


def _rotations(group: Any) -> list[np.ndarray]:
    """The space group's distinct rotations as integer matrices acting on row vectors h·R."""
    ops = group.operations()
    rotations = {tuple(map(tuple, op.rot)) for op in ops.sym_ops}
    return [np.array(rotation, np.int64) // ops.sym_ops[0].DEN for rotation in sorted(rotations)]


def _lookup(grid: HKLGrid, miller: np.ndarray) -> np.ndarray:
    """The grid's values at integer indices (NaN outside its box)."""
    offsets = miller - np.asarray(grid.index_min)
    inside = np.all((offsets >= 0) & (offsets < np.asarray(grid.shape)), axis=1)
    values = np.full(len(miller), np.nan)
    values[inside] = grid.values[tuple(offsets[inside].T)]
    return values


def asymmetric_unit(p1_table: np.ndarray, group: Any, cell_A_deg: tuple[float, ...], anomalous: bool,
                    what: str) -> tuple[Reflections, np.ndarray]:
    """The unique reflections a P1 table (h, k, l, F over the full sphere, as nbsim reads -hkl files) covers,
    to its resolution, and their |F| as parameters: F(+) from h, F(−) from −h (F(+) where −h is not listed;
    their mean without `anomalous`)."""
    import gemmi

    check_cell(cell_A_deg, group, what)
    cell = gemmi.UnitCell(*cell_A_deg)
    indices = np.ascontiguousarray(p1_table[:, :3].astype(np.int32))
    listed = np.any(indices != 0, axis=1)
    if not listed.any():
        raise NbsimError(f"{what}: no reflections other than 0 0 0")
    d_min = float(cell.calculate_d_array(indices[listed]).min())
    miller = np.asarray(gemmi.make_miller_array(cell, group, d_min * (1 - 1e-9), 0, True), np.int64)
    table = build_grid(p1_table, np.nan)
    plus, minus = _lookup(table, miller), _lookup(table, -miller)
    present = ~np.isnan(plus)
    if not present.any():
        raise NbsimError(f"{what}: no reflection of the asymmetric unit of {group.hm} is listed")
    miller, plus, minus = miller[present], plus[present], minus[present]
    minus = np.where(np.isnan(minus), plus, minus)
    centric = np.asarray(group.operations().centric_flag_array(np.ascontiguousarray(miller, np.int32)), bool)
    reflections = Reflections(miller=miller, d_A=np.asarray(cell.calculate_d_array(miller.astype(np.int32))),
                              centric=centric, anomalous=anomalous, group=group, cell_A_deg=tuple(cell_A_deg))
    if not anomalous:
        return reflections, 0.5 * (plus + minus)
    return reflections, reflections.parameters_of(plus, minus)


def node_parameters(reflections: Reflections, grid: HKLGrid) -> np.ndarray:
    """For each node of the padded table (grid.padded's layout, flattened), the parameter whose |F| it holds,
    or −1 for nodes no refined reflection reaches (they keep the table's value). Every symmetry mate h·R takes
    F(+), its Friedel mate −h·R takes F(−); where both land on one node F(+) wins, as in nbsim's reader."""
    extent = np.asarray(grid.shape) + 2
    nodes = np.full(int(np.prod(extent)), -1, dtype=np.int64)
    low = np.asarray(grid.index_min) - 1
    for side, parameters in ((-1, reflections.minus), (1, reflections.plus)):
        for rotation in _rotations(reflections.group):
            mates = side * (reflections.miller @ rotation) - low
            inside = np.all((mates >= 0) & (mates < extent), axis=1)
            flat = (mates[inside, 0] * extent[1] + mates[inside, 1]) * extent[2] + mates[inside, 2]
            nodes[flat] = parameters[inside]
    return nodes


def values_of_table(reflections: Reflections, p1_table: np.ndarray) -> np.ndarray:
    """A P1 table's |F| at the refined parameters (NaN where it lists neither the reflection nor its mate):
    a truth to compare with."""
    table = build_grid(p1_table, np.nan)
    plus, minus = _lookup(table, reflections.miller), _lookup(table, -reflections.miller)
    minus = np.where(np.isnan(minus), plus, minus)
    return reflections.parameters_of(plus, minus)


def shells(d_A: np.ndarray, count: int, span_A: np.ndarray | None = None) -> np.ndarray:
    """Each value's resolution shell, 0 the lowest: `count` shells of equal size in 1/d³ (equal numbers of
    reflections in a full sphere) between the lowest and highest resolution of `span_A` (default `d_A`)."""
    inverse_cube = 1.0 / np.asarray(d_A) ** 3
    spanned = inverse_cube if span_A is None or not len(span_A) else 1.0 / np.asarray(span_A) ** 3
    edges = np.linspace(spanned.min(), spanned.max(), count + 1)[1:-1]
    return np.searchsorted(edges, inverse_cube, side="right")


def correlation(values: np.ndarray, truth: np.ndarray) -> float:
    """Pearson's correlation over the entries both have (NaN with fewer than three)."""
    both = np.isfinite(values) & np.isfinite(truth)
    if both.sum() < 3 or np.std(values[both]) == 0 or np.std(truth[both]) == 0:
        return float("nan")
    return float(np.corrcoef(values[both], truth[both])[0, 1])


def anomalous_differences(reflections: Reflections, values: np.ndarray) -> np.ndarray:
    """|F(+)| − |F(−)| of the pairs refined apart."""
    plus, minus = reflections.friedel_pairs()
    return values[plus] - values[minus]
