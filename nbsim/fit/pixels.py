"""Which pixels a fit renders: shoeboxes around the spots the starting model predicts (and, optionally,
the spots the observed image shows), less masked and overloaded pixels, and each shoebox's background
plane fitted to its border.

Only these pixels are rendered at each evaluation, so a fit costs in proportion to its spots, not to the
detector. A multi-panel detector's images are (panels, slow, fast) stacks: its spots are found panel by
panel, a shoebox stays on its centre's panel, and its pixels are one list, each with its panel.
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
    the boxes' centre pixels (row, col), (B, 3) (panel, row, col) on a multi-panel detector; `background` (P,)
    photons of the flat background (zero unless "flat"); `plane` the map from the residual counts − model to
    each box's background plane, fitted to the box's border pixels (BackgroundPlanes; None unless "plane");
    `panel` (P,) each pixel's panel on a multi-panel detector (in order: a panel's pixels are one run), else
    None."""

    rows: np.ndarray
    cols: np.ndarray
    box: np.ndarray
    centres: np.ndarray
    background: np.ndarray
    plane: BackgroundPlanes | None = None
    panel: np.ndarray | None = None

    @property
    def count(self) -> int:
        """How many pixels are fitted."""
        return len(self.rows)

    @property
    def pixels(self) -> tuple[np.ndarray, ...]:
        """The fitted pixels as an index of the image: (rows, cols), or (panel, rows, cols)."""
        return (self.rows, self.cols) if self.panel is None else (self.panel, self.rows, self.cols)

    def take(self, image: np.ndarray) -> np.ndarray:
        """The image's values at the fitted pixels (P,)."""
        return image[self.pixels]


def local_maxima(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pixels that are the maximum of their 3×3 neighbourhood and above zero, with their 3×3 sums, brightest
    first: (pixels (N, 2) row, col, or (N, 3) panel, row, col of a (panels, slow, fast) stack; sums (N,)); a
    panel's neighbourhoods end at its edges."""
    tensor = torch.as_tensor(image, dtype=torch.float64).reshape(-1, 1, *image.shape[-2:])
    peaks = torch.nn.functional.max_pool2d(tensor, 3, stride=1, padding=1)
    sums = torch.nn.functional.avg_pool2d(tensor, 3, stride=1, padding=1, count_include_pad=False) * 9.0
    is_peak = ((tensor == peaks) & (tensor > 0))[:, 0].reshape(image.shape).numpy()
    where = np.nonzero(is_peak)
    values = sums[:, 0].reshape(image.shape).numpy()[where]
    order = np.argsort(-values, kind="stable")
    return np.stack(where, axis=1)[order], values[order]


def predicted_spots(predicted: np.ndarray, max_spots: int, relative_floor: float = 1e-3) -> np.ndarray:
    """Centres (row, col), or (panel, row, col), of the brightest predicted spots (at most max_spots, none below
    relative_floor of the brightest)."""
    centres, values = local_maxima(predicted)
    keep = values >= relative_floor * (values[0] if len(values) else 0.0)
    return centres[keep][:max_spots]


def observed_spots(observed: np.ndarray, usable: np.ndarray, max_spots: int) -> np.ndarray:
    """Centres of the brightest significant spots of the observed image (3×3 sums SPOT_SIGNIFICANCE σ above
    the median of such sums)."""
    clean = np.where(usable, observed, 0.0)
    centres, values = local_maxima(clean)
    median = float(np.median(values)) if len(values) else 0.0
    threshold = median + SPOT_SIGNIFICANCE * np.sqrt(max(median, 1.0))
    return centres[values > threshold][:max_spots]


def shoeboxes(predicted: np.ndarray, observed: np.ndarray, usable: np.ndarray, size: int = 9,
              max_spots: int = 200, use_observed_spots: bool = True, background: str = "plane",
              given_spots: np.ndarray | None = None) -> Shoeboxes:
    """Shoeboxes of `size`×`size` pixels around the predicted spots (and the observed ones), clipped to the
    detector (to the centre's panel of a (panels, slow, fast) stack: a box never holds two panels' pixels);
    pixels not `usable` (masked, overloaded, a panel's padding) are left out, and a pixel in several boxes
    counts once. The observed spots are `given_spots` (centre pixels (row, col), such as DIALS's spot finder's)
    where given, else the image's own (`observed_spots`). `background`: "plane" fits each box's border
    residuals (plane_operator), "flat" starts from the median of the boxes' borders (refined as one level per
    image), "none" is zero."""
    if size < 3 or size % 2 == 0:
        raise NbsimError(f"shoebox size must be an odd number of pixels, at least 3 (got {size})")
    stacked = predicted.ndim == 3
    centres = predicted_spots(predicted, max_spots)
    if use_observed_spots:
        extra = observed_spots(observed, usable, max_spots) if given_spots is None else _on_detector(
            np.asarray(given_spots, dtype=np.int64).reshape(-1, predicted.ndim)[:max_spots], predicted.shape)
        if len(extra):
            centres = np.concatenate([centres, extra]) if len(centres) else extra
    if not len(centres):
        raise NbsimError("the starting model predicts no spots on the detector and the image shows none")
    half = size // 2
    slow, fast = predicted.shape[-2:]
    owner = np.full(predicted.shape, -1, dtype=np.int64)
    ring = np.zeros(predicted.shape, dtype=bool)
    boxes = []
    for centre in centres:
        row, col = centre[-2:]
        r0, r1 = max(0, row - half), min(slow, row + half + 1)
        c0, c1 = max(0, col - half), min(fast, col + half + 1)
        window = owner[(*centre[:-2], slice(r0, r1), slice(c0, c1))]
        if (window >= 0).all():
            continue
        index = len(boxes)
        window[window < 0] = index
        boxes.append((tuple(centre), (*centre[:-2], slice(r0, r1), slice(c0, c1)),
                      (*centre[:-2], slice(r0 + 1, r1 - 1), slice(c0 + 1, c1 - 1))))
    owner[~usable] = -1
    where = np.nonzero(owner >= 0)
    rows, cols = where[-2:]
    box = owner[where]
    if not len(rows):
        raise NbsimError("every shoebox pixel is masked or overloaded")
    flat_level = 0.0
    if background == "flat":
        for _, whole, inner in boxes:
            ring[whole] = True
            ring[inner] = False
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
    return Shoeboxes(rows=rows, cols=cols, box=box, centres=np.array([b[0] for b in boxes]), background=values,
                     plane=plane, panel=where[0] if stacked else None)


def _on_detector(centres: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The centres ((panel,) row, col) that lie on a detector of `shape` ((panels,) slow, fast)."""
    inside = np.all((centres >= 0) & (centres < np.array(shape)), axis=1)
    return centres[inside]


@dataclass(frozen=True)
class BackgroundPlanes:
    """Each box's least-squares plane through its border pixels, as a map from residuals (counts − model, (P,))
    to background photons at every pixel (P,): a box's coefficients are Σ over its border pixels e of
    weights[e]·residual[e] ((DᵀD)⁻¹dₑ, d = (1, row, col) about the box's centre), and a pixel's plane is
    design[pixel]·(its box's coefficients). The model is subtracted before the plane is fitted, so a spot's
    own tails never count as background; a box with fewer than three border pixels (or all on a line) gets
    their mean, one with none gets no background."""

    edge: torch.Tensor
    edge_box: torch.Tensor
    weights: torch.Tensor
    box: torch.Tensor
    design: torch.Tensor
    boxes: int

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        coefficients = torch.zeros((self.boxes, 3), dtype=residual.dtype, device=residual.device)
        coefficients.index_add_(0, self.edge_box, self.weights * residual[self.edge].unsqueeze(-1))
        return (self.design * coefficients[self.box]).sum(dim=-1)

    def to(self, device: str | torch.device) -> BackgroundPlanes:
        """The same planes with their tensors on `device`."""
        return BackgroundPlanes(*(t.to(device) for t in (self.edge, self.edge_box, self.weights, self.box,
                                                          self.design)), self.boxes)


def plane_operator(rows: np.ndarray, cols: np.ndarray, box: np.ndarray, boxes: int) -> BackgroundPlanes:
    """The BackgroundPlanes of boxes `box` (P,) of the pixels (rows, cols), all boxes at once."""
    counts = np.bincount(box, minlength=boxes)
    present = counts > 0
    low_row, high_row = np.full(boxes, np.iinfo(np.int64).max), np.full(boxes, np.iinfo(np.int64).min)
    low_col, high_col = low_row.copy(), high_row.copy()
    np.minimum.at(low_row, box, rows)
    np.maximum.at(high_row, box, rows)
    np.minimum.at(low_col, box, cols)
    np.maximum.at(high_col, box, cols)
    safe_counts = np.where(present, counts, 1)
    centre_row = np.bincount(box, weights=rows, minlength=boxes) / safe_counts
    centre_col = np.bincount(box, weights=cols, minlength=boxes) / safe_counts
    design = np.stack([np.ones(len(rows)), rows - centre_row[box], cols - centre_col[box]], axis=1)
    border = ((rows == low_row[box]) | (rows == high_row[box]) | (cols == low_col[box]) | (cols == high_col[box]))
    edge = np.flatnonzero(border)
    edge_box = box[edge]
    edge_design = design[edge]
    normal = np.zeros((boxes, 3, 3))
    np.add.at(normal, edge_box, edge_design[:, :, None] * edge_design[:, None, :])
    edges_per_box = np.bincount(edge_box, minlength=boxes)
    full = (edges_per_box >= 3) & (np.linalg.matrix_rank(normal) == 3)
    inverse = np.zeros_like(normal)
    inverse[full] = np.linalg.inv(normal[full])
    weights = np.einsum("eij,ej->ei", inverse[edge_box], edge_design)
    mean_only = ~full[edge_box]
    weights[mean_only] = 0.0
    weights[mean_only, 0] = 1.0 / edges_per_box[edge_box[mean_only]]
    design[~full[box], 1:] = 0.0

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(values))

    return BackgroundPlanes(tensor(edge), tensor(edge_box), tensor(weights), tensor(box), tensor(design), boxes)
