"""The refinable quantities by name and the checks of `--refine`/`--shared` lists: without PyTorch, so that
`nbsim fit` and `nbsim merge` reject a wrong name before they import it."""

from __future__ import annotations

from ..errors import NbsimError

REFINABLE = ("orientation", "cell", "N", "mosaic", "scale", "distance", "beam", "panels", "wavelength", "spectrum",
             "background")
"""Names `--refine` takes, in the order they are reported."""

PER_IMAGE_ONLY = ("orientation", "scale", "spectrum", "background")
"""Quantities that belong to one image and cannot be shared."""
SHARED_ONLY = ("panels",)
"""Quantities of the detector every image shares: refined once for all of them (never per image)."""


def check_names(names: list[str], what: str) -> list[str]:
    """Names of refinable quantities, checked (an unknown name is an input error naming the choices)."""
    unknown = [name for name in names if name not in REFINABLE]
    if unknown:
        raise NbsimError(f"unknown {what} parameter {unknown[0]!r}: choose from {', '.join(REFINABLE)}")
    return names


def check_shared(shared: list[str], refine: list[str]) -> None:
    """Shared quantities must be refined and may not belong to one image only."""
    for name in shared:
        if name in PER_IMAGE_ONLY:
            raise NbsimError(f"{name} belongs to each image and cannot be shared")
        if name not in refine:
            raise NbsimError(f"{name} is shared but not refined: add it to --refine")
    for name in SHARED_ONLY:
        if name in refine and name not in shared:
            raise NbsimError(f"{name} are the detector's, the same in every image: refine them once with --shared "
                             f"{name}")
