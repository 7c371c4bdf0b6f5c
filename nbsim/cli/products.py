"""What nanoBragg derives from the float image: statistics, the SMV integer image and PGM (the noise image
is the detector stage's, nbsim.detector)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import INT32_MAX_COUNT, PanelConfig, shifted_spectrum
from ..detector import direct_beam_px, distance_along_beam_m
from ..detector.response import OVERLOAD_ADU, c_unsigned_cast
from ..errors import NbsimError
from ..io.detector_images import DetectorModule, ExperimentRecord
from ..io.images import format_g
from ..io.structure_files import table_provenance
from ..model.geometry import DetectorGeometry
from ..resolve import Setup
from ..vectors import DEGREES_PER_RADIAN


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


CHUNK_PIXELS = 1 << 20
"""Pixels converted to float64 at a time: sums stay in cache instead of copying the whole image."""


def _chunks(values: torch.Tensor):
    flat = values.reshape(-1)
    for begin in range(0, flat.numel(), CHUNK_PIXELS):
        yield flat[begin:begin + CHUNK_PIXELS].to(torch.float64, copy=True)


def statistics(image: np.ndarray, setup: Setup) -> ImageStatistics:
    """nanoBragg's sums, in float64 over the rendered pixels (max, mean, rms) and over the ROI (rmsd).

    Raises NbsimError if a rendered pixel is not finite (its square would make rms non-finite).
    """
    pixels = torch.from_numpy(image)
    inside = None if setup.roi_is_whole_detector else torch.from_numpy(roi_mask(setup))
    rendered = inside
    if setup.mask is not None:
        mask = torch.from_numpy(setup.mask)
        rendered = mask if inside is None else inside & mask
    values = pixels if rendered is None else pixels[rendered]
    total = squares = 0.0
    for chunk in _chunks(values):
        total += float(chunk.sum())
        squares += float(torch.dot(chunk, chunk))
    if not math.isfinite(squares):
        raise NbsimError("the simulation produced non-finite pixel values (beyond float range, or a geometry that "
                         "divides by zero); check the geometry and the sizes of F (-hkl, -default_F) and -fluence")
    candidates = pixels if rendered is None else torch.where(rendered, pixels, -torch.inf)
    slow, fast = _first_maximum(candidates)
    peak = float(candidates[slow, fast]) if values.numel() else 0.0
    max_I = peak if peak > 0 else 0.0
    slow, fast = (slow, fast) if max_I > 0 else (0, 0)
    subpixel = setup.geometry.pixel_size_m / setup.oversample
    last = setup.oversample - 1
    position = ((subpixel * (fast * setup.oversample + last) + subpixel / 2, subpixel * (slow * setup.oversample + last)
                 + subpixel / 2) if max_I > 0 else (0.0, 0.0))
    count = max(values.numel(), 1)
    mean = total / count
    rms = math.sqrt(squares / max(count - 1, 1))
    roi_values = pixels if inside is None else pixels[inside]
    deviations = 0.0
    for chunk in _chunks(roi_values):
        chunk -= mean
        deviations += float(torch.dot(chunk, chunk))
    rmsd = math.sqrt(deviations / max(roi_values.numel() - 1, 1))
    return ImageStatistics(max_I=max_I, max_position_m=position, mean=mean, rms=rms, rmsd=rmsd)


def _first_maximum(image: torch.Tensor) -> tuple[int, int]:
    """(slow, fast) of the first brightest pixel in row-major order, as nanoBragg's strict '>' scan finds it.

    Row maxima first (a parallel reduction), then one row's argmax: much faster than a flat argmax.
    """
    row_maxima = image.amax(dim=1)
    slow = int(torch.argmax(row_maxima))
    return slow, int(torch.argmax(image[slow]))


def panel_images(image: np.ndarray, panels: tuple[PanelConfig, ...]) -> list[np.ndarray]:
    """Each panel's (slow, fast) pixels of a multi-panel (panels, slow, fast) image, the padding cut off."""
    return [np.ascontiguousarray(image[index, :p.pixels_s, :p.pixels_f]) for index, p in enumerate(panels)]


def stacked_panels(image: np.ndarray, panels: tuple[PanelConfig, ...]) -> np.ndarray:
    """What -floatfile holds for a multi-panel image: the panels one after another, each slow x fast."""
    return np.concatenate([panel.reshape(-1) for panel in panel_images(image, panels)])


def panel_statistics(panels: list[np.ndarray], setup: Setup) -> tuple[ImageStatistics, int]:
    """nanoBragg's summary over every panel's pixels, and the panel holding the brightest (its position is
    in that panel's frame)."""
    each = [statistics(image, panel) for image, panel in zip(panels, setup.panel_setups(), strict=True)]
    counts = [image.size for image in panels]
    total = sum(n for n in counts)
    mean = sum(s.mean * max(n, 1) for s, n in zip(each, counts, strict=True)) / total
    squares = sum(s.rms ** 2 * max(n - 1, 1) for s, n in zip(each, counts, strict=True))
    brightest = max(range(len(each)), key=lambda index: each[index].max_I)
    rmsd = math.sqrt(max(squares - total * mean * mean, 0.0) / max(total - 1, 1))
    return ImageStatistics(max_I=each[brightest].max_I, max_position_m=each[brightest].max_position_m, mean=mean,
                           rms=math.sqrt(squares / max(total - 1, 1)), rmsd=rmsd), brightest


def panel_counts(panels: list[np.ndarray], setup: Setup, scale: float, adc: float,
                 saturation: int | None = None) -> np.ndarray:
    """The integer image of each panel (`integer_image`), as a (panels, slow, fast) array zero-padded like the
    float image."""
    counts = np.zeros(setup.shape, dtype=np.uint16 if saturation is None else np.int32)
    for index, (image, panel) in enumerate(zip(panels, setup.panel_setups(), strict=True)):
        counts[index, :image.shape[0], :image.shape[1]] = integer_image(image, panel, scale, adc, saturation)
    return counts


def integer_image(image: np.ndarray, setup: Setup, scale: float, adc: float,
                  saturation: int | None = None) -> np.ndarray:
    """Pixels floor(clamp(value·scale + adc, 0, saturation) + ½) inside the ROI, 0 outside. Without a
    saturation: nanoBragg's 16-bit SMV pixels (clamped at 65535, rounded in float32 as the C does); with one,
    the int32 files' counts (computed in float64, exact up to int32's largest)."""
    sixteen_bit = saturation is None
    ceiling = float(OVERLOAD_ADU if sixteen_bit else saturation)
    pixels = np.empty(image.size, dtype=np.uint16 if sixteen_bit else np.int32)
    for index, chunk in enumerate(_chunks(torch.from_numpy(image))):
        counts = chunk.mul_(scale).add_(adc).clamp_(0.0, ceiling).add_(0.5)
        begin = index * CHUNK_PIXELS
        rounded = torch.floor(counts.to(torch.float32) if sixteen_bit else counts)
        pixels[begin:begin + counts.numel()] = rounded.to(torch.int32 if sixteen_bit else torch.int64).numpy()
    pixels = pixels.reshape(image.shape)
    if not setup.roi_is_whole_detector:
        pixels[~roi_mask(setup)] = 0
    return pixels


def pgm_image(image: np.ndarray, setup: Setup, scale: float) -> np.ndarray:
    """nanoBragg's 8-bit PGM pixels: the image times `scale`, clipped at 255 and truncated, 0 outside the ROI. A
    negative value (a detector whose normal points back at the sample makes ω negative) is cast as nanoBragg casts
    it, through a 32-bit int to its low byte (-152.4 reads 104); -physics corrected clips it at 0."""
    inside = roi_mask(setup)
    values = np.minimum(image.astype(np.float64) * scale, 255.0)
    if setup.config.corrected:
        values = np.maximum(np.trunc(values), 0.0)
    else:
        values = c_unsigned_cast(torch.from_numpy(values), 8).numpy()
    return np.where(inside, values, 0).astype(np.uint8)


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


def _plain(vector: torch.Tensor) -> tuple[float, float, float]:
    x, y, z = (float(v) for v in vector.detach().reshape(3))
    return x, y, z


def experiment_record(setup: Setup, noise_seed: int | None, saturation_counts: int = INT32_MAX_COUNT,
                      pedestal_adu: float = 0.0) -> ExperimentRecord:
    """What was simulated, for the headers of the miniCBF and NXmx files (`noise_seed`: None without noise;
    `saturation_counts`: their largest count; `pedestal_adu`: the ADC offset their counts carry). The distance
    and beam centre are the first panel's that the direct beam meets, None where it meets none."""
    g = setup.geometry
    beam = setup.config.beam
    crystal = setup.config.crystal
    beamsize_m = beam.beamsize_mm / 1000.0
    reciprocal = setup.lattice.reciprocal_per_A.detach()
    met = next((panel for panel in setup.panels or (g,) if math.isfinite(distance_along_beam_m(panel))), None)
    along_beam_m = None if met is None else distance_along_beam_m(met)
    beam_fast_px, beam_slow_px = (None, None) if met is None else direct_beam_px(met)
    return ExperimentRecord(
        pixel_size_m=g.pixel_size_m, pixels_fast=g.pixels_f, pixels_slow=g.pixels_s, origin_m=_plain(g.pix0_m),
        fast_axis=_plain(g.fdet), slow_axis=_plain(g.sdet), beam_direction=_plain(g.beam),
        polarization_axis=_plain(g.polar), spindle_axis=_plain(g.spindle), twotheta_axis=_plain(g.twotheta_axis),
        twotheta_deg=g.twotheta_rad * DEGREES_PER_RADIAN,
        distance_m=along_beam_m, beam_fast_px=beam_fast_px, beam_slow_px=beam_slow_px,
        wavelength_A=float(beam.wavelength_A), exposure_s=beam.exposure_s,
        total_flux_per_s=setup.fluence * beamsize_m ** 2 / beam.exposure_s,
        sensor_thickness_m=setup.sensor.thickness_m, phi_start_deg=setup.phi.start_rad * DEGREES_PER_RADIAN,
        osc_deg=setup.phi.osc_rad * DEGREES_PER_RADIAN,
        unit_cell_A_deg=tuple(float(v) for v in setup.lattice.cell_parameters()),
        a_matrix_per_A=tuple(_plain(row) for row in reciprocal),
        notes=(f"convention {g.convention} pivot {g.pivot}",
               f"seeds: mosaic {crystal.mosaic_seed} misset {crystal.misset_seed} noise {noise_seed}",
               f"mosaic domains {setup.mosaic.count} phi steps {setup.phi.steps}",
               *_sensor_notes(setup),
               *_table_notes(setup)),
        modules=tuple(DetectorModule(panel.name, p.pixel_size_m, p.pixels_f, p.pixels_s, _plain(p.pix0_m),
                                     _plain(p.fdet), _plain(p.sdet))
                      for panel, p in zip(setup.config.detector.panels or (), setup.panels or (), strict=True)),
        spectrum=None if beam.spectrum is None else tuple(
            (float(wavelength), weight) for wavelength, weight in
            shifted_spectrum(beam.spectrum, beam.spectrum_shift_eV, beam.spectrum_stretch)),
        adc_offset_adu=pedestal_adu,
        gain_adu_per_photon=setup.config.response.gain_adu_per_photon if noise_seed is not None else 1.0,
        sensor_material=setup.config.detector.sensor_material, saturation_counts=saturation_counts,
        gaps=setup.gaps)


def _sensor_notes(setup: Setup) -> tuple[str, ...]:
    """The sensor as simulated: its material, thickness and attenuation length (none without a thickness)."""
    sensor = setup.sensor
    if sensor.thickness_m <= 0:
        return ()
    length = f"{1.0 / sensor.mu_per_m:.6g}" if sensor.mu_per_m > 0 else "inf"
    return (f"sensor {setup.config.detector.sensor_material} thickness_m {sensor.thickness_m:.6g} "
            f"attenuation_length_m {length} layers {sensor.layers}",)


def _table_notes(setup: Setup) -> tuple[str, ...]:
    """Where the structure factors came from: the -hkl or -model file, what of it was used, and its
    content's SHA-256 (so a table can be traced to the exact file); nothing with -default_F alone."""
    provenance = table_provenance(setup.config.structure)
    if provenance is None:
        return ()
    table = setup.p1_table
    used = table.source if table is not None and table.source else "h k l F text table"
    return (f"structure factors: {provenance['file']} ({used}), sha256 {provenance['sha256']}",)
