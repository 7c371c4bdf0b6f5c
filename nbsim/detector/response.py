"""The detector stage: the noise-free photon image in, the detector's ADU image out (docs/detector.md).

simtbx's `add_noise` order: flicker, Poisson, calibration, point-spread, then ADU = photons·gain + ADC
offset + readout noise; the beam stop shades the expected photons, hot and dead pixels replace the
read-out. With the default settings the result is nanoBragg's noise image, bit for bit.

A multi-panel detector is read out as its panels stacked as -floatfile holds them (one after another, each
slow then fast, no padding): every per-pixel draw is made there, so nanoBragg's serial sequence runs once
through all the panels and each Philox counter is a pixel's place in that stack (every panel's draws its own),
while the point spread and the beam stop act on each panel alone (no photon crosses a panel's edge).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..config import DetectorResponseConfig, check_response
from ..errors import NbsimError
from ..model.geometry import DetectorGeometry
from ..resolve import Setup
from . import effects, philox
from .native import nanobragg_poisson

OVERLOAD_ADU = 65535.0
"""The largest value of a 16-bit pixel; an ADU value above it is clamped and counted as an overload."""

STREAM_POISSON, STREAM_FLICKER, STREAM_READOUT, STREAM_CALIBRATION, STREAM_DEFECTS = range(5)
"""Philox streams: each effect draws from its own, so turning one on changes none of the others' draws."""

@dataclass(frozen=True)
class PanelLayout:
    """One panel of a multi-panel detector: its pixels (the image pads smaller panels to the largest), pixel
    size and where the direct beam meets its plane (fast, slow pixels from the corner of its first pixel; infinite
    where it never does: the beam stop shades nothing there)."""

    pixels_slow: int
    pixels_fast: int
    pixel_size_mm: float
    beam_center_px: tuple[float, float] = (math.nan, math.nan)


@dataclass(frozen=True)
class PixelLayout:
    """What the detector stage needs of the detector: pixel size, where the direct beam hits (fast, slow
    pixels from the corner of the first pixel), the ROI (xmin, xmax, ymin, ymax, inclusive; None: all),
    ran1's state left by the set-up's draws (Setup.ran1_table; () for a fresh process) and, for a
    multi-panel detector, its panels in the image's order (then no ROI; pixel size and beam the first panel's)."""

    pixel_size_mm: float
    beam_center_px: tuple[float, float] = (math.nan, math.nan)
    roi: tuple[int, int, int, int] | None = None
    ran1_table: tuple[int, ...] = ()
    panels: tuple[PanelLayout, ...] = ()

    @property
    def panels_shape(self) -> tuple[int, int, int]:
        """A multi-panel image's shape: (panels, slow, fast), padded to the largest panel."""
        return (len(self.panels), max(p.pixels_slow for p in self.panels), max(p.pixels_fast for p in self.panels))


def distance_along_beam_m(geometry: DetectorGeometry) -> float:
    """From the sample to the detector plane along the direct beam; infinite for a plane along the beam, which
    it never meets (a side module's)."""
    cosine = float(torch.dot(geometry.beam, geometry.odet))
    return math.inf if cosine == 0.0 else float(geometry.close_distance_m) / cosine


def direct_beam_px(geometry: DetectorGeometry) -> tuple[float, float]:
    """Where the direct beam's line meets the detector plane: (fast, slow) pixels from the first pixel's corner;
    infinite for a plane along the beam, which it never meets (a side module's)."""
    along_beam_m = distance_along_beam_m(geometry)
    if math.isinf(along_beam_m):
        return (math.inf, math.inf)
    hit_m = (along_beam_m * geometry.beam - geometry.pix0_m).detach()
    return (float(torch.dot(geometry.fdet, hit_m)) / geometry.pixel_size_m,
            float(torch.dot(geometry.sdet, hit_m)) / geometry.pixel_size_m)


def layout_of(setup: Setup) -> PixelLayout:
    """The PixelLayout of a resolved set-up (a multi-panel one's with its panels)."""
    panels = tuple(PanelLayout(g.pixels_s, g.pixels_f, g.pixel_size_m * 1000.0, direct_beam_px(g))
                   for g in setup.panels or ())
    return PixelLayout(pixel_size_mm=setup.geometry.pixel_size_m * 1000.0,
                       beam_center_px=direct_beam_px(setup.geometry),
                       roi=None if setup.roi_is_whole_detector else setup.roi, ran1_table=setup.ran1_table,
                       panels=panels)


@dataclass
class DetectorImage:
    """The detector's read-out and what a dataset's labels keep of it.

    `adu`: int32 tensor of values from 0 to the saturation (65535, the 16-bit SMV's, unless asked) on the
    photon image's device, 0 outside the ROI (as nanoBragg writes it) and in a multi-panel image's padding;
    the photon image's shape. `photons`: float64, what reached the
    read-out (after Poisson, calibration and point-spread). `total_photons`, `max_photons`: sum and maximum
    of the Poisson draws in the ROI (the sum nanoBragg prints). `overloads`: ROI pixels whose ADU exceeded
    the saturation before clamping.
    """

    adu: torch.Tensor
    photons: torch.Tensor
    total_photons: float
    max_photons: float
    overloads: int


@dataclass(frozen=True)
class Readout:
    """How a file reads the detector's draws out: the ADC offset added to every pixel (ADU) and the saturation its
    values are clamped at (the int32 files take a larger one than the 16-bit SMV's; hot pixels read it)."""

    adc_offset_adu: float
    saturation_adu: float = OVERLOAD_ADU
    wraps_negative: bool = False
    """Whether an ADU below 0 (photons plus a negative ADC offset) is cast as nanoBragg casts its noise image's
    pixels to 16 bits, truncated and wrapped modulo 65536 (x86's conversion: -5 reads 65531), not clamped at 0."""


def c_unsigned_cast(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`values` as nanoBragg's casts to an unsigned `bits`-bit integer leave them on x86: truncated to a 32-bit
    int (INT_MIN where out of its range, or NaN), then its low `bits` bits (-5 reads 65531 in 16 bits)."""
    truncated = torch.trunc(values)
    in_int_range = (truncated >= -2.0**31) & (truncated < 2.0**31)
    return truncated.where(in_int_range, -2.0**31).remainder(2.0**bits)


def detector_image(photons: torch.Tensor, response: DetectorResponseConfig, layout: PixelLayout,
                   saturation_adu: float = OVERLOAD_ADU) -> DetectorImage:
    """The detector image of a noise-free (slow, fast) photon image under `response` (checked first), its
    ADU clamped at `saturation_adu`: `detector_images` read out once, with the response's ADC offset."""
    return detector_images(photons, response, layout, [Readout(response.adc_offset_adu, saturation_adu)])[0]


def detector_images(photons: torch.Tensor, response: DetectorResponseConfig, layout: PixelLayout,
                    readouts: Sequence[Readout]) -> list[DetectorImage]:
    """The detector images of a noise-free (slow, fast) photon image under `response` (checked first, with each
    readout's ADC offset), one per readout, all from one set of draws (as nanoBragg draws its noise once a run):
    the files of a run hold the same counts, each with its own offset and saturation. With a multi-panel layout,
    the photons are (panels, slow, fast), zero-padded as the renderer pads them.

    Same arguments, device and dtype: the same bits. With generator "nanobragg" the Poisson draws are
    nanoBragg's serial sequence over the float32-rounded image (its noise image, bit for bit, with the
    default settings); with "philox" every draw is a pure function of its seed, stream and pixel.
    """
    for readout in readouts:
        check_response(replace(response, adc_offset_adu=readout.adc_offset_adu))
    if response.noise_seed is None:
        raise NbsimError("the detector image needs a noise seed (noise_seed, or -seed)")
    if not layout.panels:
        return _read_outs(photons, response, layout, readouts)
    shape = layout.panels_shape
    if tuple(photons.shape) != shape:
        raise NbsimError(f"the photon image is {tuple(photons.shape)}, the detector's {len(layout.panels)} panels "
                         f"need {shape} (panels, slow, fast)")
    stacked = torch.cat([photons[index, :panel.pixels_slow, :panel.pixels_fast].reshape(-1)
                         for index, panel in enumerate(layout.panels)])
    return [DetectorImage(adu=_padded(read.adu, layout), photons=_padded(read.photons, layout),
                          total_photons=read.total_photons, max_photons=read.max_photons, overloads=read.overloads)
            for read in _read_outs(stacked.view(1, -1), response, layout, readouts)]


def _padded(stacked: torch.Tensor, layout: PixelLayout) -> torch.Tensor:
    """The (1, pixels) stack of a multi-panel layout's panels as its (panels, slow, fast) image, zero-padded."""
    image = torch.zeros(layout.panels_shape, dtype=stacked.dtype, device=stacked.device)
    begin = 0
    for index, panel in enumerate(layout.panels):
        end = begin + panel.pixels_slow * panel.pixels_fast
        image[index, :panel.pixels_slow, :panel.pixels_fast] = stacked[0, begin:end].view(panel.pixels_slow,
                                                                                           panel.pixels_fast)
        begin = end
    return image


def _each_panel(image: torch.Tensor, layout: PixelLayout,
                apply: Callable[[torch.Tensor, float, tuple[float, float]], torch.Tensor]) -> torch.Tensor:
    """`apply(panel, pixel_size_mm, beam_center_px)` on the one (slow, fast) image, or on each panel of a
    multi-panel (1, pixels) stack, stacked again: what acts across pixels never crosses a panel's edge."""
    if not layout.panels:
        return apply(image, layout.pixel_size_mm, layout.beam_center_px)
    parts, begin = [], 0
    for panel in layout.panels:
        end = begin + panel.pixels_slow * panel.pixels_fast
        pixels = image[0, begin:end].view(panel.pixels_slow, panel.pixels_fast)
        parts.append(apply(pixels, panel.pixel_size_mm, panel.beam_center_px).reshape(-1))
        begin = end
    return torch.cat(parts).view(image.shape)


def _read_outs(photons: torch.Tensor, response: DetectorResponseConfig, layout: PixelLayout,
               readouts: Sequence[Readout]) -> list[DetectorImage]:
    """`detector_images` of one (slow, fast) image: the single panel, or a multi-panel layout's (1, pixels) stack.
    Every draw is made once; each readout converts the same photons, read-out noise and defects to its ADU."""
    shape = tuple(photons.shape)
    device = photons.device
    roi = layout.roi or (0, shape[1] - 1, 0, shape[0] - 1)
    window = (slice(roi[2], roi[3] + 1), slice(roi[0], roi[1] + 1))
    drawn_per_pixel = (response.flicker_fraction, response.calibration_fraction, response.readout_noise_adu,
                       response.hot_pixel_fraction, response.dead_pixel_fraction)
    index = (torch.arange(math.prod(shape), device=device, dtype=torch.int64).view(shape)
             if any(value > 0.0 for value in drawn_per_pixel) else None)
    seed = response.noise_seed
    expected = photons.detach()
    if response.beamstop_radius_mm > 0.0:

        def shaded(panel: torch.Tensor, pixel_size_mm: float, beam_center_px: tuple[float, float]) -> torch.Tensor:
            if any(math.isnan(value) for value in beam_center_px):  # infinite: a panel the beam misses, unshaded
                raise NbsimError("beamstop_radius_mm needs the direct beam's position (PixelLayout.beam_center_px)")
            shadow = effects.beamstop_shadow(tuple(panel.shape), pixel_size_mm, beam_center_px,
                                             response.beamstop_radius_mm, device)
            return panel.masked_fill(shadow, 0.0)

        expected = _each_panel(expected, layout, shaded)
    if response.flicker_fraction > 0.0:
        flicker = philox.normals(seed, STREAM_FLICKER, index)
        expected = expected.to(torch.float64) * (1.0 + response.flicker_fraction * flicker)
    observed, sums = _poisson(expected, response, layout, roi, window)
    if sums is None:
        drawn = observed[window]
        sums = (float(drawn.sum()), float(drawn.max()) if drawn.numel() else 0.0)
    total, max_photons = sums
    if response.calibration_fraction > 0.0:
        calibration = philox.normals(response.calibration_seed, STREAM_CALIBRATION, index)
        observed = observed * (1.0 + response.calibration_fraction * calibration)
    if response.psf != "none":
        blur = effects.gaussian_blur if response.psf == "gaussian" else effects.fiber_blur
        observed = _each_panel(observed, layout, lambda panel, pixel_size_mm, _: blur(
            panel, response.psf_fwhm_um / (pixel_size_mm * 1000.0)))
    readout_noise = (response.readout_noise_adu * philox.normals(seed, STREAM_READOUT, index)
                     if response.readout_noise_adu > 0.0 else None)
    hot = dead = None
    if response.hot_pixel_fraction > 0.0 or response.dead_pixel_fraction > 0.0:
        draw = philox.uniforms(response.defect_seed, STREAM_DEFECTS, 0, index)
        hot = draw < response.hot_pixel_fraction
        dead = ~hot & (draw < response.hot_pixel_fraction + response.dead_pixel_fraction)
    found = []
    for readout in readouts:
        saturation_adu = readout.saturation_adu
        if response.gain_adu_per_photon == 1.0:
            adu = observed + readout.adc_offset_adu
        else:
            adu = observed * response.gain_adu_per_photon
            adu += readout.adc_offset_adu
        if readout_noise is not None:
            adu = adu + readout_noise
        if saturation_adu > OVERLOAD_ADU:
            adu = adu.to(torch.float64)  # float32 would round int32's largest count up, past the int32 range
        overloads = int(torch.count_nonzero(adu[window] > saturation_adu))
        wrapped = c_unsigned_cast(adu, 16).where(adu < 0, 0.0) if readout.wraps_negative else None
        adu = adu.clamp_(0.0, saturation_adu)
        if wrapped is not None:
            adu = adu + wrapped
        if hot is not None:
            adu = adu.masked_fill_(hot, saturation_adu).masked_fill_(dead, 0.0)
        if layout.roi is None:
            counts = adu.to(torch.int32)
        else:
            counts = torch.zeros(shape, dtype=torch.int32, device=device)
            counts[window] = adu[window].to(torch.int32)
        found.append(DetectorImage(adu=counts, photons=observed, total_photons=total, max_photons=max_photons,
                                   overloads=overloads))
    return found


def _poisson(expected: torch.Tensor, response: DetectorResponseConfig, layout: PixelLayout,
             roi: tuple[int, int, int, int],
             window: tuple[slice, slice]) -> tuple[torch.Tensor, tuple[float, float] | None]:
    """The observed photons, float64 (0 outside the ROI) and, from nanoBragg's loop, their sum and maximum
    in the ROI (else None)."""
    if response.poisson and response.generator == "nanobragg":
        image = expected.to("cpu", torch.float32).numpy()
        table = np.array(layout.ran1_table, dtype=np.int64) if layout.ran1_table else None
        counts, total, maximum = nanobragg_poisson(image, roi, -response.noise_seed, table)
        return torch.from_numpy(counts).to(expected.device), (total, maximum)
    inside = torch.zeros(expected.shape, dtype=torch.float64, device=expected.device)
    inside[window] = expected[window]
    if not response.poisson:
        return inside, None
    if not bool(torch.isfinite(inside).all()):
        raise NbsimError("the photon image has non-finite pixels: no detector image can be drawn from it")
    return philox.poisson(inside.clamp_(min=0.0).reshape(-1), response.noise_seed, STREAM_POISSON).view(
        expected.shape), None
