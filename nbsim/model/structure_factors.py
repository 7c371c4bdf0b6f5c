"""Structure factors: HKL text files, the dense lookup grid, and tricubic interpolation weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NbsimError

MAX_TABLE_NODES = 2**31 - 1
"""The most nodes the padded table may hold: kernels index it with int32."""


@dataclass
class HKLGrid:
    """F on the box of indices spanned by the file: unlisted points hold default_F (or 0)."""

    values: np.ndarray  # (h, k, l) float64
    index_min: tuple[int, int, int]
    entries: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """Nodes along h, k and l."""
        return self.values.shape

    @property
    def index_max(self) -> tuple[int, int, int]:
        """The largest h, k and l of the grid."""
        return tuple(m + n - 1 for m, n in zip(self.index_min, self.shape, strict=True))

    def padded(self, default_F: float) -> np.ndarray:
        """The values with a one-node border of default_F on every side (what lookups index)."""
        return np.pad(self.values, 1, constant_values=default_F)


def build_grid(reflections: np.ndarray, default_F: float) -> HKLGrid:
    """Dense grid over [min, max] of each index; later duplicates win, as in nanoBragg."""
    indices = reflections[:, :3].astype(np.int64)
    index_min = indices.min(axis=0)
    shape = indices.max(axis=0) - index_min + 1
    nodes = int(np.prod(shape + 2, dtype=object))
    if nodes > MAX_TABLE_NODES:
        raise NbsimError(f"the HKL indices span {' x '.join(str(int(n)) for n in shape)} grid nodes, "
                         f"{nodes} with the table's border ({nodes * 8 / 2**30:.1f} GiB in float64); at most "
                         f"{MAX_TABLE_NODES} are supported")
    values = np.full(tuple(shape), default_F, dtype=np.float64)
    offsets = indices - index_min
    values[offsets[:, 0], offsets[:, 1], offsets[:, 2]] = reflections[:, 3]
    return HKLGrid(values=values, index_min=tuple(int(v) for v in index_min), entries=len(reflections))


def lagrange_weights(fraction: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cubic Lagrange weights for nodes floor-1, floor, floor+1, floor+2 at x = floor + fraction."""
    u = fraction
    return (-u * (u - 1) * (u - 2) / 6, (u + 1) * (u - 1) * (u - 2) / 2,
            -(u + 1) * u * (u - 2) / 2, (u + 1) * u * (u - 1) / 6)
