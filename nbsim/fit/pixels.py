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
    the boxes' centre pixels (row, col); `background` (P,) photons of the fixed background model."""

    rows: np.ndarray
    cols: np.ndarray
    box: np.ndarray
    centres: np.ndarray
    background: np.ndarray

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


def _plane(rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Least-squares plane coefficients (c0, c_row, c_col) through values, two rounds of rejecting points
    more than 3σ above it (the tails of neighbouring spots)."""
    keep = np.ones(len(values), dtype=bool)
    design = np.stack([np.ones_like(rows, dtype=np.float64), rows, cols], axis=1)
    coefficients = np.array([float(np.median(values)) if len(values) else 0.0, 0.0, 0.0])
    for _ in range(3):
        if keep.sum() < 4:
            break
        coefficients = np.linalg.lstsq(design[keep], values[keep], rcond=None)[0]
        residual = values - design @ coefficients
        spread = max(float(np.std(residual[keep])), 1.0)
        keep = residual < 3.0 * spread
    return coefficients


def shoeboxes(predicted: np.ndarray, observed: np.ndarray, usable: np.ndarray, size: int = 9,
              max_spots: int = 200, use_observed_spots: bool = True, background: str = "plane") -> Shoeboxes:
    """Shoeboxes of `size`×`size` pixels around the predicted spots (and the observed ones), clipped to the
    detector; pixels not `usable` (masked, overloaded) are left out, and a pixel in several boxes counts
    once. `background`: "plane" fits each box's border, "flat" the image's median there, "none" zero."""
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
    if background == "plane":
        for index, (_, _, r0, r1, c0, c1) in enumerate(boxes):
            border = np.zeros((r1 - r0, c1 - c0), dtype=bool)
            border[[0, -1], :] = True
            border[:, [0, -1]] = True
            border &= usable[r0:r1, c0:c1]
            border_rows, border_cols = np.nonzero(border)
            coefficients = _plane(border_rows + float(r0), border_cols + float(c0),
                                  observed[r0:r1, c0:c1][border])
            members = box == index
            values[members] = np.clip(coefficients[0] + coefficients[1] * rows[members]
                                      + coefficients[2] * cols[members], 0.0, None)
    elif background == "flat":
        values[:] = max(flat_level, 0.0)
    elif background != "none":
        raise NbsimError(f"background must be plane, flat or none (got {background!r})")
    return Shoeboxes(rows=rows, cols=cols, box=box, centres=np.array([b[:2] for b in boxes]), background=values)
