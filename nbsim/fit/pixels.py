"""Which pixels a fit renders: shoeboxes around the spots the starting model predicts (and, optionally,
the spots the observed image shows), less masked and overloaded pixels, and each shoebox's background
plane fitted to its border.

Only these pixels are rendered at each evaluation, so a fit costs in proportion to its spots, not to the
detector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NbsimError

SPOT_SIGNIFICANCE = 8.0
"""How many standard deviations above the image's median a 3×3 sum must stand to count as an observed
spot."""


@dataclass(frozen=True)
class Shoeboxes:
    """Fitted pixels of one image: rows, cols (P,) and the shoebox each belongs to (P,); `centres` (B, 2)
    the boxes' centre pixels (row, col); `background` (P,) photons of the flat background (zero unless
    "flat"); `plane` the (P, P) operator that turns the residual counts − model into each box's background
    plane, fitted to the box's border pixels (None unless "plane")."""

    rows: np.ndarray
    cols: np.ndarray
    box: np.ndarray
    centres: np.ndarray
    background: np.ndarray
    plane: torch.Tensor | None = None

    @property
    def count(self) -> int:
        """How many pixels are fitted."""
        return len(self.rows)


def local_maxima(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pixels that are the maximum of their 3×3 neighbourhood and above zero, with their 3×3 sums,
    brightest first."""
    tensor = torch.as_tensor(image, dtype=torch.float64)[None, None]
    peaks = torch.nn.functional.max_pool2d(tensor, 3, stride=1, padding=1)
    sums = torch.nn.functional.avg_pool2d(tensor, 3, stride=1, padding=1, count_include_pad=False) * 9.0
    is_peak = (tensor == peaks) & (tensor > 0)
    rows, cols = np.nonzero(is_peak[0, 0].numpy())
    values = sums[0, 0].numpy()[rows, cols]
    order = np.argsort(-values, kind="stable")
    return rows[order], cols[order], values[order]


def predicted_spots(predicted: np.ndarray, max_spots: int, relative_floor: float = 1e-3) -> np.ndarray:
    """Centres (row, col) of the brightest predicted spots (at most max_spots, none below relative_floor of
    the brightest)."""
    rows, cols, values = local_maxima(predicted)
    keep = values >= relative_floor * (values[0] if len(values) else 0.0)
    return np.stack([rows[keep], cols[keep]], axis=1)[:max_spots]


def observed_spots(observed: np.ndarray, usable: np.ndarray, max_spots: int) -> np.ndarray:
    """Centres of the brightest significant spots of the observed image (3×3 sums SPOT_SIGNIFICANCE σ above
    the median of such sums)."""
    clean = np.where(usable, observed, 0.0)
    rows, cols, values = local_maxima(clean)
    median = float(np.median(values)) if len(values) else 0.0
    threshold = median + SPOT_SIGNIFICANCE * np.sqrt(max(median, 1.0))
    keep = values > threshold
    return np.stack([rows[keep], cols[keep]], axis=1)[:max_spots]


def shoeboxes(predicted: np.ndarray, observed: np.ndarray, usable: np.ndarray, size: int = 9,
              max_spots: int = 200, use_observed_spots: bool = True, background: str = "plane") -> Shoeboxes:
    """Shoeboxes of `size`×`size` pixels around the predicted spots (and the observed ones), clipped to the
    detector; pixels not `usable` (masked, overloaded) are left out, and a pixel in several boxes counts
    once. `background`: "plane" fits each box's border residuals (plane_operator), "flat" starts from the
    median of the boxes' borders (refined as one level per image), "none" is zero."""
    if size < 3 or size % 2 == 0:
        raise NbsimError(f"shoebox size must be an odd number of pixels, at least 3 (got {size})")
    centres = predicted_spots(predicted, max_spots)
    if use_observed_spots:
        extra = observed_spots(observed, usable, max_spots)
        if len(extra):
            centres = np.concatenate([centres, extra]) if len(centres) else extra
    if not len(centres):
        raise NbsimError("the starting model predicts no spots on the detector and the image shows none")
    half = size // 2
    slow, fast = predicted.shape
    owner = np.full(predicted.shape, -1, dtype=np.int64)
    ring = np.zeros(predicted.shape, dtype=bool)
    boxes = []
    for row, col in centres:
        r0, r1 = max(0, row - half), min(slow, row + half + 1)
        c0, c1 = max(0, col - half), min(fast, col + half + 1)
        window = owner[r0:r1, c0:c1]
        if (window >= 0).all():
            continue
        index = len(boxes)
        window[window < 0] = index
        boxes.append((row, col, r0, r1, c0, c1))
    owner[~usable] = -1
    rows, cols = np.nonzero(owner >= 0)
    box = owner[rows, cols]
    if not len(rows):
        raise NbsimError("every shoebox pixel is masked or overloaded")
    flat_level = 0.0
    if background == "flat":
        for _, _, r0, r1, c0, c1 in boxes:
            ring[r0:r1, c0:c1] = True
            ring[r0 + 1:r1 - 1, c0 + 1:c1 - 1] = False
        ring &= usable
        flat_level = float(np.median(observed[ring])) if ring.any() else 0.0
    values = np.zeros(len(rows))
    plane = None
    if background == "plane":
        plane = plane_operator(rows, cols, box, len(boxes))
    elif background == "flat":
        values[:] = max(flat_level, 0.0)
    elif background != "none":
        raise NbsimError(f"background must be plane, flat or none (got {background!r})")
    return Shoeboxes(rows=rows, cols=cols, box=box, centres=np.array([b[:2] for b in boxes]), background=values,
                     plane=plane)


def plane_operator(rows: np.ndarray, cols: np.ndarray, box: np.ndarray, boxes: int) -> torch.Tensor:
    """The sparse (P, P) map from residuals (counts − model) to background photons: per box, the
    least-squares plane through its border pixels' residuals, evaluated at every pixel of the box. The
    model is subtracted before the plane is fitted, so a spot's own tails never count as background; a
    box with fewer than three border pixels gets their mean, one with none gets no background."""
    entries_row, entries_col, entries_value = [], [], []
    for index in range(boxes):
        members = np.flatnonzero(box == index)
        if not len(members):
            continue
        r, c = rows[members], cols[members]
        border = (r == r.min()) | (r == r.max()) | (c == c.min()) | (c == c.max())
        edge = members[border]
        if not len(edge):
            continue
        design_edge = np.stack([np.ones(len(edge)), rows[edge] - r.mean(), cols[edge] - c.mean()], axis=1)
        design_all = np.stack([np.ones(len(members)), r - r.mean(), c - c.mean()], axis=1)
        if len(edge) < 3 or np.linalg.matrix_rank(design_edge) < 3:
            design_edge, design_all = design_edge[:, :1], design_all[:, :1]
        weights = design_all @ np.linalg.pinv(design_edge)
        grid_rows, grid_cols = np.meshgrid(members, edge, indexing="ij")
        entries_row.append(grid_rows.ravel())
        entries_col.append(grid_cols.ravel())
        entries_value.append(weights.ravel())
    size = len(rows)
    if not entries_row:
        return torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.int64), torch.zeros(0, dtype=torch.float64),
                                       (size, size), check_invariants=True).coalesce()
    indices = torch.as_tensor(np.stack([np.concatenate(entries_row), np.concatenate(entries_col)]))
    return torch.sparse_coo_tensor(indices, torch.as_tensor(np.concatenate(entries_value)), (size, size),
                                   check_invariants=True).coalesce()
