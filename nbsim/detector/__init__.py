"""The detector as a seeded stage after rendering: noise-free photons in, the detector's ADU image out
(docs/detector.md). `detector_image` is the one entry point; `layout_of` takes what it needs of a set-up."""

from .response import (
    DetectorImage,
    PanelLayout,
    PixelLayout,
    check_response,
    detector_image,
    direct_beam_px,
    distance_along_beam_m,
    layout_of,
)

__all__ = ["DetectorImage", "PanelLayout", "PixelLayout", "check_response", "detector_image", "direct_beam_px",
           "distance_along_beam_m", "layout_of"]
