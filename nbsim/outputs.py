"""What nanoBragg derives from the float image: statistics, the SMV integer image, PGM and noise."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .geometry import DetectorGeometry
from .io import format_g
from .simulator import Setup
from .vectors import DEGREES_PER_RADIAN


@dataclass
class ImageStatistics:
    """nanoBragg's summary: brightest pixel (value and position in m) and mean/rms/rmsd."""

    max_I: float
    max_position_m: tuple[float, float]
    mean: float
    rms: float
    rmsd: float


def roi_mask(setup: Setup) -> np.ndarray:
    """Pixels nanoBragg renders (inside the ROI); masked pixels are inside but not rendered."""
    xmin, xmax, ymin, ymax = setup.roi
    inside = np.zeros(setup.shape, dtype=bool)
    inside[ymin:ymax + 1, xmin:xmax + 1] = True
    return inside


def statistics(image: np.ndarray, setup: Setup) -> ImageStatistics:
    inside = roi_mask(setup)
    rendered = inside if setup.mask is None else inside & setup.mask
    values = image[rendered].astype(np.float64)
    positive = np.where(rendered, image, -np.inf)
    flat = int(np.argmax(positive))
    max_I = float(positive.flat[flat]) if values.size and positive.flat[flat] > 0 else 0.0
    slow, fast = divmod(flat, setup.shape[1]) if max_I > 0 else (0, 0)
    subpixel = setup.geometry.pixel_size_m / setup.oversample
    last = setup.oversample - 1
    position = ((subpixel * (fast * setup.oversample + last) + subpixel / 2, subpixel * (slow * setup.oversample + last)
                 + subpixel / 2) if max_I > 0 else (0.0, 0.0))
    count = max(values.size, 1)
    mean = float(values.sum()) / count
    rms = math.sqrt(float((values * values).sum()) / max(count - 1, 1))
    roi_values = image[inside].astype(np.float64)
    rmsd = math.sqrt(float(((roi_values - mean) ** 2).sum()) / max(roi_values.size - 1, 1))
    return ImageStatistics(max_I=max_I, max_position_m=position, mean=mean, rms=rms, rmsd=rmsd)


def integer_image(image: np.ndarray, setup: Setup, scale: float, adc: float) -> np.ndarray:
    """16-bit pixels floor(clamp(value·scale + adc, 0, 65535) + ½) inside the ROI, 0 outside."""
    inside = roi_mask(setup)
    counts = np.clip(image.astype(np.float64) * scale + adc, 0.0, 65535.0)
    return np.where(inside, np.floor((counts + 0.5).astype(np.float32)), 0).astype(np.uint16)


def pgm_image(image: np.ndarray, setup: Setup, scale: float) -> np.ndarray:
    inside = roi_mask(setup)
    values = np.minimum(image.astype(np.float64) * scale, 255.0)
    return np.where(inside, np.trunc(np.maximum(values, 0.0)), 0).astype(np.uint8)


def noise_image(image: np.ndarray, setup: Setup, adc: float, seed: int) -> tuple[np.ndarray, int, float]:
    """Poisson photon counts plus adc (seeded, reproducible), truncated to 16 bits; and the overload count."""
    generator = torch.Generator().manual_seed(seed)
    rates = torch.as_tensor(np.maximum(image, 0.0), dtype=torch.float64)
    photons = torch.poisson(rates, generator=generator).numpy()
    inside = roi_mask(setup)
    counts = photons + adc
    overloads = int(np.count_nonzero((counts > 65535.0) & inside))
    total = float(photons[inside].sum())
    return np.where(inside, np.minimum(counts, 65535.0), 0).astype(np.uint16), overloads, total


def smv_fields(geometry: DetectorGeometry, setup: Setup, wavelength_A: float) -> list[tuple[str, str]]:
    """The header keys nanoBragg writes after SIZE1/SIZE2, with its %g formatting."""
    g = geometry
    pixel = g.pixel_size_m
    phi = setup.phi
    deg = DEGREES_PER_RADIAN
    return [
        ("PIXEL_SIZE", format_g(pixel * 1000.0)),
        ("DISTANCE", format_g(float(g.distance_m) * 1000.0)),
        ("WAVELENGTH", format_g(wavelength_A)),
        ("BEAM_CENTER_X", format_g(g.beam_x_m * 1000.0)),
        ("BEAM_CENTER_Y", format_g(g.beam_y_m * 1000)),
        ("ADXV_CENTER_X", format_g(g.fbeam_m * 1000.0)),
        ("ADXV_CENTER_Y", format_g((g.detsize_s_m - g.sbeam_m) * 1000)),
        ("MOSFLM_CENTER_X", format_g((g.sbeam_m - 0.5 * pixel) * 1000.0)),
        ("MOSFLM_CENTER_Y", format_g((g.fbeam_m - 0.5 * pixel) * 1000)),
        ("DENZO_X_BEAM", format_g(g.sbeam_m * 1000.0)),
        ("DENZO_Y_BEAM", format_g(g.fbeam_m * 1000)),
        ("DIALS_ORIGIN", ",".join(format_g(v) for v in g.dials_origin_mm)),
        ("XDS_ORGX", format_g(g.orgx_px)),
        ("XDS_ORGY", format_g(g.orgy_px)),
        ("CLOSE_DISTANCE", format_g(float(g.close_distance_m) * 1000.0)),
        ("PHI", format_g(phi.start_rad * deg)),
        ("OSC_START", format_g(phi.start_rad * deg)),
        ("OSC_RANGE", format_g(phi.osc_rad * deg)),
        ("TWOTHETA", format_g(g.twotheta_rad * deg)),
        ("DETECTOR_SN", "000"),
        ("BEAMLINE", "fake"),
    ]
