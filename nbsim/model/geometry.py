"""Detector geometry: conventions, beam centre, pivots, rotations and the position of the first pixel.

All lengths here are metres and all angles radians, as inside nanoBragg; the derived values
(Fbeam, Sbeam, Fclose, Sclose, close distance, ORGX/ORGY, the DIALS origin) are recomputed from the
final geometry exactly as the reference prints and writes them into image headers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import CONVENTIONS, DetectorConfig, PanelConfig, scalar_value
from ..errors import NbsimError
from ..vectors import as_float64, cross, dot, norm, radians, rotate_about_axis, rotate_xyz, unit

# beam, fast, slow, normal, two-theta axis, polarization, spindle for each convention.
_CONVENTION_VECTORS = {
    "mosflm": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 0, -1), (0, 0, 1), (0, 0, 1)),
    "denzo": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 0, -1), (0, 0, 1), (0, 0, 1)),
    "adxv": ((0, 0, 1), (1, 0, 0), (0, -1, 0), (0, 0, 1), (-1, 0, 0), (1, 0, 0), (1, 0, 0)),
    "xds": ((0, 0, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0), (1, 0, 0), (1, 0, 0)),
    "dials": ((0, 0, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 0), (0, 1, 0), (0, 1, 0)),
    "custom": ((1, 0, 0), (0, 0, 1), (0, -1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1)),
}
_CONVENTION_PIVOT = {"mosflm": "beam", "denzo": "beam", "adxv": "beam", "xds": "sample", "dials": "sample"}


@dataclass
class DetectorGeometry:
    """Final detector frame and the derived beam-centre values (metres, unit vectors)."""

    fdet: torch.Tensor
    sdet: torch.Tensor
    odet: torch.Tensor
    pix0_m: torch.Tensor
    beam: torch.Tensor
    polar: torch.Tensor
    spindle: torch.Tensor
    vertical: torch.Tensor
    pixels_f: int
    pixels_s: int
    pixel_size_m: float
    detsize_f_m: float
    detsize_s_m: float
    distance_m: torch.Tensor
    close_distance_m: torch.Tensor
    requested_distance_m: float
    """The distance before the geometry is recomputed (equal to distance_m up to rounding)."""
    beam_x_m: float
    beam_y_m: float
    close_x_m: float
    close_y_m: float
    fbeam_m: float
    sbeam_m: float
    fclose_m: float
    sclose_m: float
    orgx_px: float
    orgy_px: float
    dials_origin_mm: tuple[float, float, float]
    twotheta_rad: float
    twotheta_axis: torch.Tensor
    pivot: str
    convention: str


def pixel_counts(config: DetectorConfig) -> tuple[int, int, float, float]:
    """Pixels along fast and slow, and the detector size (m) they imply; -detpixels wins over -detsize."""
    pixel = _m(config.pixel_size_mm)
    if pixel <= 0:
        raise NbsimError(f"pixel size must be positive (got {config.pixel_size_mm:g} mm)")
    detsize_f = _m(config.detsize_f_mm) if not config.pixels_f else pixel * config.pixels_f
    detsize_s = _m(config.detsize_s_mm) if not config.pixels_s else pixel * config.pixels_s
    pixels_f = math.ceil(detsize_f / pixel - 0.5)
    pixels_s = math.ceil(detsize_s / pixel - 0.5)
    if pixels_f <= 0 or pixels_s <= 0:
        raise NbsimError(f"the detector has no pixels ({pixels_f} x {pixels_s}); check -detpixels/-detsize/-pixel")
    return pixels_f, pixels_s, detsize_f, detsize_s


def _m(millimetres: float) -> float:
    """mm → m the way nanoBragg converts (a division, so values round exactly as in the C)."""
    return millimetres / 1000.0


def _vec(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def build_geometry(config: DetectorConfig) -> DetectorGeometry:
    """The detector frame and pix0 after conventions, pivots and rotations (nanoBragg's setup)."""
    if config.convention not in CONVENTIONS:
        raise NbsimError(f"unknown detector convention '{config.convention}'")
    pixels_f, pixels_s, detsize_f, detsize_s = pixel_counts(config)
    pixel = _m(config.pixel_size_mm)
    nan = math.nan
    fclose = (config.orgx_px - 0.5) * pixel if config.orgx_px is not None else detsize_f / 2.0
    sclose = (config.orgy_px - 0.5) * pixel if config.orgy_px is not None else detsize_s / 2.0
    close_x = _m(config.close_x_mm) if config.close_x_mm is not None else fclose
    close_y = _m(config.close_y_mm) if config.close_y_mm is not None else sclose
    beam_x = _m(config.beam_x_mm) if config.beam_x_mm is not None else nan
    beam_y = _m(config.beam_y_mm) if config.beam_y_mm is not None else nan

    convention = config.convention
    vectors = [_vec(v) for v in _CONVENTION_VECTORS[convention]]
    if convention == "custom":
        given = (config.beam_vector, config.fdet_vector, config.sdet_vector, config.odet_vector,
                 config.twotheta_axis, config.polar_vector, config.spindle_axis)
        vectors = [_vec(g) if g is not None else v for g, v in zip(given, vectors, strict=True)]
        pivot = config.pivot
    else:
        pivot = _CONVENTION_PIVOT[convention]
    beam, fdet, sdet, odet, twotheta_axis, polar, spindle = vectors

    if convention == "adxv":
        beam_x = (detsize_f + pixel) / 2.0 if math.isnan(scalar_value(beam_x)) else beam_x
        beam_y = (detsize_s - pixel) / 2.0 if math.isnan(scalar_value(beam_y)) else beam_y
        fbeam, sbeam = beam_x, detsize_s - beam_y
    elif convention in ("mosflm", "denzo"):
        beam_x = (detsize_s + pixel) / 2.0 if math.isnan(scalar_value(beam_x)) else beam_x
        beam_y = (detsize_f + pixel) / 2.0 if math.isnan(scalar_value(beam_y)) else beam_y
        shift = 0.5 * pixel if convention == "mosflm" else 0.0
        fbeam, sbeam = beam_y + shift, beam_x + shift
    else:
        beam_x = close_x if math.isnan(scalar_value(beam_x)) else beam_x
        beam_y = close_y if math.isnan(scalar_value(beam_y)) else beam_y
        fbeam, sbeam = beam_x, beam_y
        if convention == "custom":
            fclose, sclose = beam_x, beam_y

    beam, fdet, sdet, polar, spindle = (unit(v) for v in (beam, fdet, sdet, polar, spindle))
    odet_length = norm(odet)
    odet = unit(cross(fdet, sdet)) if scalar_value(odet_length) != 1.0 else odet / odet_length
    vertical = unit(cross(beam, polar))

    rotation = radians(torch.stack([as_float64(a) for a in config.rotation_deg]))
    twotheta = radians(as_float64(config.twotheta_deg))
    ratio = dot(beam, rotate_xyz(odet, rotation))
    if scalar_value(ratio) == 0.0:
        ratio = torch.full_like(ratio, 2.2250738585072014e-308)
    distance = as_float64(config.distance_mm) / 1000.0
    close_distance = (torch.abs(ratio * distance) if config.close_distance_mm is None
                      else as_float64(config.close_distance_mm) / 1000.0)
    distance = close_distance / ratio
    requested_distance = scalar_value(distance)

    if pivot == "sample":
        pix0 = -fclose * fdet - sclose * sdet + close_distance * odet
        pix0 = rotate_about_axis(rotate_xyz(pix0, rotation), twotheta_axis, twotheta)
    fdet, sdet, odet = (rotate_about_axis(rotate_xyz(v, rotation), twotheta_axis, twotheta)
                        for v in (fdet, sdet, odet))
    if pivot == "beam":
        pix0 = -fbeam * fdet - sbeam * sdet + distance * beam
    if config.pix0_vector_mm is not None:
        pix0 = _vec(config.pix0_vector_mm) / 1000.0

    return _placed(fdet, sdet, odet, pix0, beam, polar, spindle, vertical, ratio, pixels_f, pixels_s, pixel,
                   detsize_f, detsize_s, requested_distance, (beam_x, beam_y, close_x, close_y),
                   float(twotheta.detach()), twotheta_axis, pivot, convention)


def _placed(fdet, sdet, odet, pix0, beam, polar, spindle, vertical, ratio, pixels_f: int, pixels_s: int,
            pixel: float, detsize_f: float, detsize_s: float, requested_distance: float,
            centres: tuple[float, float, float, float], twotheta_rad: float, twotheta_axis, pivot: str,
            convention: str) -> DetectorGeometry:
    """The geometry of a placed panel: the beam centre, close point and distances recomputed from its
    final frame and pix0, as nanoBragg recomputes and prints them."""
    beam_x, beam_y, close_x, close_y = centres
    fclose_t = -dot(pix0, fdet)
    sclose_t = -dot(pix0, sdet)
    close_distance = dot(pix0, odet)
    beam_hit = close_distance / ratio * beam - pix0
    distance = close_distance / ratio
    origin = pix0.detach()
    dials_origin = (1000.0 * float(origin[2]), 1000.0 * float(origin[1]), -1000.0 * float(origin[0]))
    return DetectorGeometry(
        fdet=fdet, sdet=sdet, odet=odet, pix0_m=pix0, beam=beam, polar=polar, spindle=spindle,
        vertical=vertical, pixels_f=pixels_f, pixels_s=pixels_s, pixel_size_m=pixel,
        detsize_f_m=detsize_f, detsize_s_m=detsize_s, distance_m=distance, close_distance_m=close_distance,
        requested_distance_m=requested_distance,
        beam_x_m=scalar_value(beam_x), beam_y_m=scalar_value(beam_y), close_x_m=close_x, close_y_m=close_y,
        fbeam_m=float(dot(fdet, beam_hit).detach()), sbeam_m=float(dot(sdet, beam_hit).detach()),
        fclose_m=float(fclose_t.detach()), sclose_m=float(sclose_t.detach()),
        orgx_px=float(fclose_t.detach()) / pixel + 0.5, orgy_px=float(sclose_t.detach()) / pixel + 0.5,
        dials_origin_mm=dials_origin, twotheta_rad=twotheta_rad,
        twotheta_axis=twotheta_axis, pivot=pivot, convention=convention)


def panel_geometries(config: DetectorConfig) -> tuple[DetectorGeometry, ...]:
    """Each panel of a multi-panel detector (config.panels) as a detector of its own: its axes, pixel size
    and first pixel's corner as given (fdet, sdet normalised; odet normalised, or the unit fdet × sdet), the
    beam, polarization and spindle of `config`'s convention. Its beam centre, close point and distance are
    those the C derives for the panel, so each panel is the C's custom-convention render with those
    vectors and the pix0 that -Xbeam/-Ybeam/-distance place (docs/formats.md)."""
    main = build_geometry(config)
    placed = []
    for panel in config.panels or ():
        fdet, sdet = unit(_vec(panel.fdet_vector)), unit(_vec(panel.sdet_vector))
        odet = unit(cross(fdet, sdet) if panel.odet_vector is None else _vec(panel.odet_vector))
        placed.append(placed_panel(fdet, sdet, odet, _vec(panel.pix0_mm) / 1000.0, panel.pixels_f, panel.pixels_s,
                                   _m(panel.pixel_size_mm), main))
    return tuple(placed)


def placed_panel(fdet: torch.Tensor, sdet: torch.Tensor, odet: torch.Tensor, pix0_m: torch.Tensor, pixels_f: int,
                 pixels_s: int, pixel_size_m: float, main: DetectorGeometry) -> DetectorGeometry:
    """A flat panel with these unit axes and first pixel's outer corner (m; tensors, kept differentiable: a fit
    moves panels) under `main`'s beam, polarization and spindle, its beam centre, close point and distance
    derived as the C derives them for a custom-convention detector."""
    ratio = dot(main.beam, odet)
    if scalar_value(ratio) == 0.0:
        ratio = torch.full_like(ratio, 2.2250738585072014e-308)
    corner, fast, slow, normal = (v.detach() for v in (pix0_m, fdet, sdet, odet))
    beam_hit = dot(corner, normal) / ratio.detach() * main.beam - corner
    beam_x, beam_y = float(dot(fast, beam_hit)), float(dot(slow, beam_hit))
    return _placed(fdet, sdet, odet, pix0_m, main.beam, main.polar, main.spindle, main.vertical, ratio, pixels_f,
                   pixels_s, pixel_size_m, pixel_size_m * pixels_f, pixel_size_m * pixels_s,
                   float(dot(corner, normal) / ratio.detach()), (beam_x, beam_y, -float(dot(corner, fast)),
                                                                 -float(dot(corner, slow))),
                   0.0, main.twotheta_axis, "beam", "custom")


def panel_config(name: str, panel: DetectorGeometry) -> PanelConfig:
    """A placed panel as the entry of a panel list that places it again (`-panelfile`: mm, unit vectors)."""

    def numbers(vector: torch.Tensor) -> tuple[float, float, float]:
        x, y, z = (float(v) for v in vector.detach().double())
        return x, y, z

    x, y, z = numbers(panel.pix0_m)
    return PanelConfig(name=name, pixels_f=panel.pixels_f, pixels_s=panel.pixels_s,
                       pixel_size_mm=panel.pixel_size_m * 1000.0, fdet_vector=numbers(panel.fdet),
                       sdet_vector=numbers(panel.sdet), odet_vector=numbers(panel.odet),
                       pix0_mm=(x * 1000.0, y * 1000.0, z * 1000.0))


def single_panel_flags(panel: DetectorGeometry) -> list[str]:
    """The nanoBragg flags that render `panel` (one of `panel_geometries`) as a detector of its own: its
    vectors in the custom convention, its size, and its place as -Xbeam/-Ybeam/-distance along the beam
    (the C recomputes -pix0_vector under either pivot). Exact for axes at right angles to each other and
    to the normal, and a panel facing the beam."""

    def numbers(values) -> list[str]:
        return [repr(float(v)) for v in values]

    return ["-fdet_vector", *numbers(panel.fdet), "-sdet_vector", *numbers(panel.sdet),
            "-odet_vector", *numbers(panel.odet), "-beam_vector", *numbers(panel.beam),
            "-polar_vector", *numbers(panel.polar), "-spindle_axis", *numbers(panel.spindle),
            "-detpixels_f", str(panel.pixels_f), "-detpixels_s", str(panel.pixels_s),
            "-pixel", repr(panel.pixel_size_m * 1000.0), "-Xbeam", repr(panel.beam_x_m * 1000.0),
            "-Ybeam", repr(panel.beam_y_m * 1000.0), "-distance", repr(float(panel.distance_m) * 1000.0)]
