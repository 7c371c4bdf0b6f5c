"""The detector as a seeded stage after rendering: noise-free photons in, the detector's ADU image out
(docs/detector.md). `detector_images` is the one entry point (several read-outs of one draw; `detector_image`
reads it out once); `layout_of` takes what it needs of a set-up."""

from .response import (
    DetectorImage,
    PanelLayout,
    PixelLayout,
    Readout,
    check_response,
    detector_image,
    detector_images,
    direct_beam_px,
    distance_along_beam_m,
    layout_of,
)

__all__ = ["DetectorImage", "PanelLayout", "PixelLayout", "Readout", "check_response", "detector_image",
           "detector_images", "direct_beam_px", "distance_along_beam_m", "layout_of"]
