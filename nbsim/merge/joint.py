"""The joint solve's side of the shots (`MergeOptions.solve` "joint"; docs/merging.md, "The refinement"): every shot
of a worker as one `nbsim.fit.DiffractionModel` on its fixed pixels, whose negative log-likelihood and gradients
in the table of |F|, each shot's log-scale change and each shot's refined quantities (the fit's internal
coordinates) come from one render of each shot through the kernel with autograd. The merge (`Merge.solve_jointly`)
sums them over the workers, as the F step sums its design's, and runs one L-BFGS on log|F| and all of it.

The coordinates of every worker's shots are laid out the same on every worker: each shot's block (its per-shot
coordinates, the same layout for every shot) in the merge's order of shots, then the shared ones (the cell, one for
every shot); a worker places its own shots' values there and zeros elsewhere, so that the all-reduce assembles the
whole vector.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.autograd.forward_ad as forward_ad

from ..fit.joint import product_columns
from ..fit.likelihood import negative_log_likelihood
from ..fit.model import DiffractionModel
from ..fit.newton import fisher_weights
from ..fit.output import model_flags, model_values_json
from ..modes import Compile
from ..resolve import Setup

HELD_FIXED = ("scale", "background")
"""Refined quantities the joint solve leaves to others: the scale is each shot's log scale beside |F| (as the F
step refines it, its gauge fixed there), the background the shot step's planes (fixed, as in the F step)."""


def joint_quantities(refine: Sequence[str]) -> tuple[str, ...]:
    """What of each shot's model the joint solve refines with |F| (besides its scale)."""
    return tuple(name for name in refine if name not in HELD_FIXED)


class JointShots:
    """A worker's shots on their fixed pixels as a function of the table of |F|, each shot's log-scale change and
    the refined quantities' internal coordinates (zero: the shot step's models). `placement`: each local shot's
    index among every worker's (the merge's order); `shot_count`: every worker's shots."""

    def __init__(self, setups: Sequence[Setup], pixels: Sequence[tuple[np.ndarray, np.ndarray]],
                 counts: Sequence[torch.Tensor], backgrounds: Sequence[torch.Tensor], scales: Sequence[float],
                 refine: Sequence[str], shared: Sequence[str], lattice: str | None, placement: Sequence[int],
                 shot_count: int, readout_photons: float, kind: str, device: str | torch.device):
        names = joint_quantities(refine)
        self.model = DiffractionModel(setups, pixels, names, [name for name in shared if name in names], lattice,
                                      device=device, dtype=torch.float64, compile=Compile.OFF, fixed_frame=False)
        self.counts = [c.to(self.model.device, torch.float64) for c in counts]
        self.backgrounds = [b.to(self.model.device, torch.float64) for b in backgrounds]
        self.scales = torch.as_tensor(list(scales), dtype=torch.float64, device=self.model.device)
        self.readout, self.kind = readout_photons, kind
        own = [slot for slot in self.model.slots if slot.image is not None]
        self.per_shot = sum(slot.quantity.size for slot in own) // max(len(setups), 1)
        shared_slots = [slot for slot in self.model.slots if slot.image is None]
        self.shared_size = sum(slot.quantity.size for slot in shared_slots)
        self.size = shot_count * self.per_shot + self.shared_size
        """Coordinates of every worker's shots."""
        where = torch.empty(self.model.size, dtype=torch.int64)
        offsets: dict[int | None, int] = {}
        for slot in self.model.slots:
            if slot.image is None:
                first = shot_count * self.per_shot + offsets.get(None, 0)
            else:
                first = placement[slot.image] * self.per_shot + offsets.get(slot.image, 0)
            offsets[slot.image] = offsets.get(slot.image, 0) + slot.quantity.size
            where[slot.start:slot.stop] = torch.arange(first, first + slot.quantity.size)
        self.where = where
        """Each local coordinate's place among every worker's."""

    def local(self, coordinates: torch.Tensor) -> torch.Tensor:
        """This worker's internal coordinates from the coordinates of every worker's shots."""
        return coordinates[self.where].to(torch.float64)

    def placed(self, local: torch.Tensor) -> torch.Tensor:
        """A value per local coordinate placed among every worker's (zero elsewhere; the shared ones as they are,
        for the all-reduce to sum)."""
        return torch.zeros(self.size, dtype=torch.float64).index_add_(0, self.where, local.detach().cpu())

    def _expected(self, image: int, internal: torch.Tensor, log_scale_change: torch.Tensor,
                  table: torch.Tensor) -> torch.Tensor:
        """λ at the image's pixels: its scale times its photons, plus its fixed background."""
        self.model.tables[image] = self.model.tables[image]._replace(grid=table)
        photons = self.model.render(image, self.model.image_natural(image, internal))
        return self.scales[image] * torch.exp(log_scale_change[image]) * photons + self.backgrounds[image]

    def likelihood(self, table: torch.Tensor, log_scale_change: torch.Tensor, coordinates: torch.Tensor
                   ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The negative log-likelihood of this worker's pixels and its gradients in the flat table, in each local
        shot's log-scale change and in every worker's shot coordinates (this worker's placed, the rest zero): one
        render and backward pass a shot, so that only one shot's graph is held at a time."""
        device = self.model.device
        table = table.detach().to(device, torch.float64).requires_grad_(True)
        changes = log_scale_change.detach().to(device, torch.float64).requires_grad_(True)
        internal = self.local(coordinates).to(device).requires_grad_(True)
        total = 0.0
        for image in range(len(self.model.setups)):
            with torch.enable_grad():
                nll = negative_log_likelihood(self._expected(image, internal, changes, table), self.counts[image],
                                              self.readout, self.kind)
                nll.backward()
            total += float(nll.detach())

        def grad(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x) if x.grad is None else x.grad

        return total, grad(table), grad(changes).cpu(), self.placed(grad(internal))

    def information(self, table: torch.Tensor) -> torch.Tensor:
        """The diagonal of the Fisher information of every coordinate over this worker's pixels, placed
        (Σ_p w_p·(∂λ_p/∂x)², the derivatives by forward-mode differentiation along the joint fit's directions,
        `nbsim.fit.joint.product_columns`: one pass per position of a shot's block, every shot's at once, and one
        per shared coordinate)."""
        model, device = self.model, self.model.device
        table = table.detach().to(device, torch.float64)
        changes = torch.zeros(len(model.setups), dtype=torch.float64, device=device)
        layout = product_columns(model)
        found = torch.zeros(model.size, dtype=torch.float64)
        for column, tangent in enumerate(layout.tangents):
            with forward_ad.dual_level():
                internal = forward_ad.make_dual(torch.zeros(model.size, dtype=torch.float64, device=device),
                                                tangent.to(device))
                for image, blocks in enumerate(layout.blocks):
                    primal, derivative = forward_ad.unpack_dual(self._expected(image, internal, changes, table))
                    terms = fisher_weights(primal.detach(), self.readout, self.kind) * derivative.detach() ** 2
                    for start, stop, target in blocks:
                        if target[column] >= 0:
                            found[target[column]] += float(terms[start:stop].sum())
        return self.placed(found)

    def refined(self, coordinates: torch.Tensor, argv: Sequence[Sequence[str]]) -> list[tuple[Setup, dict]]:
        """Each local shot's set-up at these coordinates (detached) and what its JSON says of its model there
        (nbsim fit's keys, `nbsim.fit.output.model_values_json`: A matrix, cell, N, scale, mosaic spread, wavelength,
        a single panel's distance and beam centre, a spectrum's shift and stretch; flags with the shot's scale in its
        fluence)."""
        model = self.model
        with torch.no_grad():
            model.internal.copy_(self.local(coordinates))
            setups = model.refined_setups()
            documents = []
            for image in range(len(model.setups)):
                values = {**model.image_natural(image), "scale": self.scales[image].reshape(1).cpu()}
                documents.append({**model_values_json(model, image, values),
                                  "flags": model_flags(model, image, values, argv[image])})
        return list(zip(setups, documents, strict=True))
