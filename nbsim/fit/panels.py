"""Multi-panel detectors in a fit (docs/fitting.md, "Multi-panel detectors"): where each fitted pixel is, and the
panel groups `--refine panels` moves, a shift and a rotation per group, the same for every shot.

A group's move is a shift t (mm) and a rotation vector θ (degrees), both in nanoBragg's lab frame: a point p of
one of its panels goes to c + t + R(θ)·(p − c), c the group's centre (the centroid of its pixels at the start)
and R(θ) the rotation by |θ| about θ/|θ|; the panels' fast, slow and normal axes turn by R(θ).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import DetectorConfig
from ..errors import NbsimError
from ..model.geometry import DetectorGeometry, placed_panel
from ..resolve import Setup
from .parameters import rotation_matrix

GROUPINGS = ("modules", "all")
"""Named groupings: each panel its own group, or every panel in one."""
MOVE_SIZE = 6
"""A group's move: shift (x, y, z mm) and rotation (x, y, z degrees)."""


@dataclass(frozen=True)
class PanelGroups:
    """The groups a fit moves: their names, each one's panels (indices into the detector's), and their centres
    (G, 3) in metres, lab frame, at the start."""

    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]
    centres_m: torch.Tensor

    def __len__(self) -> int:
        return len(self.names)

    def panel_names(self, setup: Setup) -> dict[str, list[str]]:
        """Each group's panels by name."""
        names = panel_names(setup)
        return {group: [names[index] for index in members] for group, members in zip(self.names, self.members,
                                                                                     strict=True)}


def panel_names(setup: Setup) -> list[str]:
    """The names of a multi-panel set-up's panels, in the detector's order."""
    return [panel.name for panel in setup.config.detector.panels or ()]


def check_refinable(detectors: Sequence[DetectorConfig]) -> None:
    """One-line errors, from the images' detector configurations alone (before any work), for panels a fit cannot
    refine: a single-panel detector's, or those of images that start from different panel lists."""
    if detectors[0].panels is None:
        raise NbsimError("--refine panels moves the panels of a multi-panel detector (-panelfile: a YAML panel list "
                         "or a CrystFEL .geom); this detector is one panel: refine its place with distance,beam")
    if any(detector.panels != detectors[0].panels for detector in detectors):
        raise NbsimError("the images' panels are refined together, so every image must start from the same "
                         "detector (one panel file)")


def panel_groups(setup: Setup, grouping: str | Mapping[str, Sequence[str]]) -> PanelGroups:
    """The groups of a multi-panel set-up's panels: "modules" (each panel a group of its own, named after it),
    "all" (one group), or a mapping of group names to panel names (a panel no group names stays where it is)."""
    check_refinable([setup.config.detector])
    names = panel_names(setup)
    if grouping == "modules":
        groups = {name: [name] for name in names}
    elif grouping == "all":
        groups = {"all": names}
    elif isinstance(grouping, Mapping):
        groups = {str(group): list(members) for group, members in grouping.items()}
        seen: set[str] = set()
        for group, members in groups.items():
            unknown = [member for member in members if member not in names]
            if unknown or not members or seen & set(members):
                raise NbsimError(f"panel group {group!r}: " + (f"no panel {unknown[0]!r}" if unknown else
                                                               "a panel is in two groups" if members else "empty"))
            seen |= set(members)
    else:
        raise NbsimError(f"panel groups: {', '.join(GROUPINGS)} or a file of groups (got {grouping!r})")
    members = tuple(tuple(names.index(name) for name in group) for group in groups.values())
    return PanelGroups(tuple(groups), members, torch.stack([_centroid([setup.panels[i] for i in group])
                                                            for group in members]))


def _centroid(panels: Sequence[DetectorGeometry]) -> torch.Tensor:
    """The centroid (m) of the panels' pixels (each panel's centre weighted by its pixel count)."""
    centres, weights = [], []
    for g in panels:
        half_f, half_s = g.pixels_f * g.pixel_size_m / 2.0, g.pixels_s * g.pixel_size_m / 2.0
        centres.append(g.pix0_m.detach() + half_f * g.fdet.detach() + half_s * g.sdet.detach())
        weights.append(float(g.pixels_f * g.pixels_s))
    weight = torch.tensor(weights, dtype=torch.float64)
    return (torch.stack(centres) * weight.unsqueeze(-1)).sum(dim=0) / weight.sum()


def moved_panels(panels: Sequence[DetectorGeometry], groups: PanelGroups,
                 moves: torch.Tensor) -> tuple[DetectorGeometry, ...]:
    """The panels with each group moved by its (shift mm, rotation degrees) in `moves` (G·6,), differentiably."""
    moved = list(panels)
    for number, members in enumerate(groups.members):
        move = moves[MOVE_SIZE * number:MOVE_SIZE * (number + 1)]
        rotation = rotation_matrix(torch.deg2rad(move[3:]))
        centre = groups.centres_m[number]
        shift = move[:3] / 1000.0
        for index in members:
            g = panels[index]
            pix0 = centre + shift + rotation @ (g.pix0_m - centre)
            fdet, sdet, odet = (rotation @ axis for axis in (g.fdet, g.sdet, g.odet))
            moved[index] = placed_panel(fdet, sdet, odet, pix0, g.pixels_f, g.pixels_s, g.pixel_size_m, g)
    return tuple(moved)


def pixel_centres_m(setup: Setup, pixels: tuple[np.ndarray, ...]) -> torch.Tensor:
    """The lab-frame centres (P, 3), metres, of pixels given as (rows, cols) or, on a multi-panel detector,
    (panel, rows, cols)."""
    rows, cols = (torch.as_tensor(np.asarray(index), dtype=torch.float64) for index in pixels[-2:])
    if setup.panels is None:
        geometries, panel = [setup.geometry], torch.zeros(len(rows), dtype=torch.int64)
    else:
        geometries, panel = list(setup.panels), torch.as_tensor(np.asarray(pixels[0]), dtype=torch.int64)
    pix0 = torch.stack([g.pix0_m.detach() for g in geometries])[panel]
    fdet = torch.stack([g.fdet.detach() for g in geometries])[panel]
    sdet = torch.stack([g.sdet.detach() for g in geometries])[panel]
    size = torch.tensor([g.pixel_size_m for g in geometries], dtype=torch.float64)[panel].unsqueeze(-1)
    return pix0 + (cols + 0.5).unsqueeze(-1) * size * fdet + (rows + 0.5).unsqueeze(-1) * size * sdet
