"""Images for processing software (DIALS, XDS, CrystFEL), with the geometry in the header: miniCBF (written
by fabio) and NeXus NXmx HDF5 (written by h5py), both atomically (`atomic_write_with`).

nbsim's lab frame is nanoBragg's (the beam along +x in the MOSFLM convention); NeXus uses the McStas frame,
the beam along +z and y up. `mcstas_rotation` is the fixed rotation between them: z along the beam, x
against the polarization axis' component across it, y = z × x. For MOSFLM, McStas (x, y, z) = nbsim's
(-z, y, x): the DIALS frame of the header's DIALS_ORIGIN (z, y, -x) turned 180° about y, as dxtbx turns it.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import INT32_MAX_COUNT
from ..errors import NbsimError
from ..sensors import DEFAULT_MATERIAL, MATERIALS
from .atomic import atomic_write_with

MINI_CBF_CONVENTION = "GENERIC_MINI"
THINNEST_SENSOR_MM = 1e-6
"""NXmx's sensor_thickness when none was simulated (-detector_thick 0: photons recorded where they meet the
detector's face). dxtbx's NXmx reader needs a positive thickness (its parallax model asserts t0 > 0); a
1 nm sensor moves a spot by under 1e-6 mm, nothing against a pixel."""


@dataclass(frozen=True)
class DetectorModule:
    """One panel of a multi-panel detector: nbsim's lab frame, unit vectors, metres."""

    name: str
    pixel_size_m: float
    pixels_fast: int
    pixels_slow: int
    origin_m: tuple[float, float, float]
    """The outer corner of the panel's first pixel."""
    fast_axis: tuple[float, float, float]
    slow_axis: tuple[float, float, float]


@dataclass(frozen=True)
class ExperimentRecord:
    """What was simulated, in plain numbers: nbsim's lab frame, unit vectors, SI units unless named."""

    pixel_size_m: float
    pixels_fast: int
    pixels_slow: int
    origin_m: tuple[float, float, float]
    """The outer corner of the first pixel."""
    fast_axis: tuple[float, float, float]
    slow_axis: tuple[float, float, float]
    beam_direction: tuple[float, float, float]
    polarization_axis: tuple[float, float, float]
    spindle_axis: tuple[float, float, float]
    twotheta_axis: tuple[float, float, float]
    twotheta_deg: float
    distance_m: float | None
    """From the sample to the detector plane along the beam (nanoBragg's DISTANCE ignores two-theta); None where
    the beam runs along the plane (of every panel), which it never meets."""
    beam_fast_px: float | None
    beam_slow_px: float | None
    """Where the direct beam meets the detector, in pixels from the outer corner of the first pixel (None with
    `distance_m`)."""
    wavelength_A: float
    exposure_s: float
    total_flux_per_s: float
    sensor_thickness_m: float
    phi_start_deg: float
    osc_deg: float
    unit_cell_A_deg: tuple[float, float, float, float, float, float]
    a_matrix_per_A: tuple[tuple[float, float, float], ...]
    """MOSFLM's A matrix at φ = 0: rows a*, b*, c* (Å⁻¹, nbsim's lab frame; not scaled by λ)."""
    notes: tuple[str, ...]
    """Ground truth for the header's comments: seeds, convention, pivot."""
    modules: tuple[DetectorModule, ...] = ()
    """The panels of a multi-panel detector (empty: the one panel the fields above describe)."""
    spectrum: tuple[tuple[float, float], ...] | None = None
    """The -spectrumfile channels, (wavelength in Å, weight), or None for one wavelength."""
    adc_offset_adu: float = 0.0
    """What the counts carry on top of the photons' ADU (nanoBragg's -adc)."""
    gain_adu_per_photon: float = 1.0
    """ADU per photon of the counts (1 for -intfile counts, which are scaled photons)."""
    sensor_material: str = DEFAULT_MATERIAL
    """The sensor's material (nbsim.sensors.MATERIALS), described where the sensor has a thickness."""
    saturation_counts: int = INT32_MAX_COUNT
    """The largest count (-saturation): saturated pixels hold it; the overload value of the headers."""
    gaps: np.ndarray | None = field(default=None, compare=False)
    """(slow, fast) booleans, True on the pixels between modules: written as GAP_COUNT, and flagged in NXmx's
    pixel_mask (None: no gaps)."""


GAP_COUNT = -1
"""What a pixel between modules reads in the int32 files (as in PILATUS miniCBF and EIGER NXmx files)."""
NXMX_GAP_BIT = 1
"""NXmx's pixel_mask bit 0: the pixel lies in a gap between modules."""


def with_gaps(counts: np.ndarray, record: ExperimentRecord) -> np.ndarray:
    """int32 counts with the record's gap pixels set to GAP_COUNT."""
    counts = np.asarray(counts, dtype=np.int32)
    return counts if record.gaps is None else np.where(record.gaps, np.int32(GAP_COUNT), counts)


def _unit(vector: np.ndarray, what: str) -> np.ndarray:
    length = float(np.linalg.norm(vector))
    if length == 0.0:
        raise NbsimError(f"no NeXus frame: {what} has no direction")
    return vector / length


def mcstas_rotation(record: ExperimentRecord) -> np.ndarray:
    """The rotation taking nbsim's lab frame to NeXus' McStas frame (rows: McStas x, y, z in nbsim's)."""
    z = _unit(np.array(record.beam_direction, dtype=np.float64), "the beam")
    polar = np.array(record.polarization_axis, dtype=np.float64)
    x = -_unit(polar - np.dot(polar, z) * z, "the polarization axis across the beam")
    return np.stack([x, np.cross(z, x), z])


def mini_cbf_header(record: ExperimentRecord, start_time: datetime.datetime) -> str:
    """The miniCBF header lines (`# key value`) that dxtbx, XDS and CrystFEL parse, then nbsim's ground truth."""
    r = record
    lines = [
        start_time.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3],
        "Detector: nbsim simulated detector, S/N 000",
        f"Pixel_size {r.pixel_size_m:.6e} m x {r.pixel_size_m:.6e} m",
        f"{MATERIALS[r.sensor_material].header_name} sensor, thickness {r.sensor_thickness_m:.6f} m"
        if r.sensor_thickness_m > 0 else None,
        f"Exposure_time {r.exposure_s:.7f} s",
        f"Exposure_period {r.exposure_s:.7f} s",
        f"Count_cutoff {r.saturation_counts} counts",
        f"Wavelength {r.wavelength_A:.6f} A",
        f"Detector_distance {r.distance_m:.6f} m",
        f"Beam_xy ({r.beam_fast_px:.2f}, {r.beam_slow_px:.2f}) pixels",
        f"Flux {r.total_flux_per_s:.6g}",
        f"Start_angle {r.phi_start_deg:.4f} deg.",
        f"Angle_increment {r.osc_deg:.4f} deg.",
        f"Detector_2theta {r.twotheta_deg:.4f} deg.",
        "nbsim truth: lab frame of nanoBragg, metres",
        "nbsim origin " + _triple(r.origin_m),
        "nbsim fast_axis " + _triple(r.fast_axis),
        "nbsim slow_axis " + _triple(r.slow_axis),
        "nbsim beam_direction " + _triple(r.beam_direction),
        "nbsim spindle_axis " + _triple(r.spindle_axis),
        "nbsim wavelength_A " + f"{r.wavelength_A:.10g}",
        "nbsim unit_cell " + " ".join(f"{v:.10g}" for v in r.unit_cell_A_deg),
        *(f"nbsim A_matrix_per_A {row} " + _triple(values) for row, values in zip("abc", r.a_matrix_per_A,
                                                                                  strict=True)),
        *(f"nbsim {note}" for note in (*r.notes, *response_lines(r))),
    ]
    return "\n".join(f"# {line}" for line in lines if line is not None)


def response_lines(record: ExperimentRecord) -> tuple[str, str]:
    """The detector response of the counts, as the header (and NXmx notes) record it for readers of the
    counts (nbsim.io.observed): `adc_offset_adu X`, `gain_adu_per_photon G`."""
    return (f"adc_offset_adu {record.adc_offset_adu:.10g}", f"gain_adu_per_photon {record.gain_adu_per_photon:.10g}")


def _triple(values) -> str:
    return " ".join(f"{float(v):.10g}" for v in values)


def write_mini_cbf(path: str | Path, counts: np.ndarray, record: ExperimentRecord,
                   start_time: datetime.datetime) -> None:
    """int32 (slow, fast) counts as a miniCBF with `GENERIC_MINI` header contents, written by fabio; gap pixels
    read GAP_COUNT."""
    from fabio.cbfimage import CbfImage

    image = CbfImage(data=np.ascontiguousarray(with_gaps(counts, record)), header={
        "_array_data.header_convention": MINI_CBF_CONVENTION,
        "_array_data.header_contents": mini_cbf_header(record, start_time)})
    atomic_write_with(path, lambda temporary: image.write(str(temporary)))


def _rotate(vector: np.ndarray, axis: np.ndarray, angle_rad: float) -> np.ndarray:
    """Right-handed (Rodrigues) rotation of vector about the unit axis."""
    cos, sin = np.cos(angle_rad), np.sin(angle_rad)
    return vector * cos + np.cross(axis, vector) * sin + axis * np.dot(axis, vector) * (1.0 - cos)


def _axis(group, name: str, values, kind: str, vector, depends_on: str, units: str) -> None:
    """An NXtransformations axis (no offset) with its value(s)."""
    dataset = group.create_dataset(name, data=np.atleast_1d(np.asarray(values, dtype=np.float64)))
    dataset.attrs.update({"transformation_type": kind, "vector": np.asarray(vector, dtype=np.float64),
                          "offset": np.zeros(3), "offset_units": "mm", "units": units, "depends_on": depends_on})


def _module(detector, module: DetectorModule, name: str, data_origin: tuple[int, int], before_twotheta) -> None:
    """One NXdetector_module: its slab of the frame (from `data_origin`, (slow, fast)), the offset of its first
    pixel's corner and its pixel directions."""
    group = detector.create_group(name)
    group.attrs["NX_class"] = "NXdetector_module"
    group["data_origin"] = np.array(data_origin, dtype=np.int64)
    group["data_size"] = np.array((module.pixels_slow, module.pixels_fast), dtype=np.int64)
    origin_mm = before_twotheta(module.origin_m) * 1000.0
    pixel_mm = module.pixel_size_m * 1000.0
    distance_mm = float(np.linalg.norm(origin_mm))
    path = group.name
    direction = origin_mm / distance_mm if distance_mm else (0.0, 0.0, 1.0)
    _axis(group, "module_offset", distance_mm, "translation", direction,
          "/entry/instrument/detector/transformations/two_theta", "mm")
    _axis(group, "fast_pixel_direction", pixel_mm, "translation", before_twotheta(module.fast_axis),
          f"{path}/module_offset", "mm")
    _axis(group, "slow_pixel_direction", pixel_mm, "translation", before_twotheta(module.slow_axis),
          f"{path}/module_offset", "mm")


def _group_name(name: str, index: int, count: int) -> str:
    """A panel's module group: module_<index>_<its name, letters, digits and _ only>, the index zero-padded to
    the width of the last one's so that the groups sort in the panels' order (readers such as dxtbx take the
    modules in the order HDF5 lists them: by name)."""
    return f"module_{index:0{len(str(count - 1))}d}_" + re.sub(r"\W", "_", name)


def _write_wavelengths(beam, record: ExperimentRecord) -> None:
    """NXbeam's incident_wavelength: the wavelength, or a spectrum's channels with their weights (summing to 1)
    in incident_wavelength_weights (NXmx's polychromatic beam)."""
    if record.spectrum is None:
        beam["incident_wavelength"] = record.wavelength_A
    else:
        wavelengths, weights = np.array(record.spectrum, dtype=np.float64).T
        beam["incident_wavelength"] = wavelengths
        beam["incident_wavelength_weights"] = weights / weights.sum()
    beam["incident_wavelength"].attrs["units"] = "angstrom"


def write_nxmx(path: str | Path, frames: Iterable[np.ndarray], omega_deg: np.ndarray, record: ExperimentRecord,
               start_time: datetime.datetime, end_time: datetime.datetime) -> None:
    """An NXmx file: the (slow, fast) counts of each frame (taken one at a time) and its ω, the detector placed
    by a two-theta axis and its module's offset and pixel directions (the detector rotations are folded into
    those), the beam, and the sample's ω axis and orientation, in the McStas frame. Each frame's ω range is
    `omega` to `omega_end` and its exposure `frame_time` (and `count_time`): dxtbx reads a frame's oscillation
    and exposure from those, so one frame imports as a one-image sweep, not a still. A multi-panel record's
    frames are (panels, slow, fast), zero-padded to the largest panel, written as one (panels × slow, fast)
    image, the panels one below the other; each panel is an NXdetector_module named after it whose
    data_origin (panel × slow, 0) and data_size (its slow, its fast) cut it out (a 2-D slab: what dxtbx 3.12,
    Debian's DIALS, reads; it refuses NXmx's (panels, slow, fast) slabs)."""
    import h5py

    r = record
    to_mcstas = mcstas_rotation(r)
    twotheta_axis = _unit(to_mcstas @ np.array(r.twotheta_axis, dtype=np.float64), "the two-theta axis")
    twotheta_rad = np.radians(r.twotheta_deg)

    def before_twotheta(vector) -> np.ndarray:
        return _rotate(to_mcstas @ np.asarray(vector, dtype=np.float64), twotheta_axis, -twotheta_rad)

    modules = r.modules or (DetectorModule("module", r.pixel_size_m, r.pixels_fast, r.pixels_slow, r.origin_m,
                                           r.fast_axis, r.slow_axis),)
    slab_slow = max(m.pixels_slow for m in modules)
    frame_shape = (len(modules) * slab_slow, max(m.pixels_fast for m in modules))
    a_matrix = np.array(r.a_matrix_per_A, dtype=np.float64)

    def write(temporary: Path) -> None:
        with h5py.File(temporary, "w") as nexus:
            nexus.attrs["default"] = "entry"
            entry = nexus.create_group("entry")
            entry.attrs.update({"NX_class": "NXentry", "default": "data"})
            entry["definition"] = "NXmx"
            entry["start_time"] = start_time.strftime("%Y-%m-%dT%H:%M:%SZ")
            entry["end_time"] = end_time.strftime("%Y-%m-%dT%H:%M:%SZ")
            entry["end_time_estimated"] = end_time.strftime("%Y-%m-%dT%H:%M:%SZ")

            instrument = entry.create_group("instrument")
            instrument.attrs["NX_class"] = "NXinstrument"
            instrument["name"] = "nbsim simulated beamline"
            source = entry.create_group("source")
            source.attrs["NX_class"] = "NXsource"
            source["name"] = "nbsim"
            beam = instrument.create_group("beam")
            beam.attrs["NX_class"] = "NXbeam"
            _write_wavelengths(beam, r)
            beam["total_flux"] = r.total_flux_per_s
            beam["total_flux"].attrs["units"] = "Hz"

            detector = instrument.create_group("detector")
            detector.attrs["NX_class"] = "NXdetector"
            detector["description"] = "nbsim simulated detector"
            detector["sensor_material"] = r.sensor_material
            detector["sensor_thickness"] = r.sensor_thickness_m * 1000.0 or THINNEST_SENSOR_MM
            detector["sensor_thickness"].attrs["units"] = "mm"
            for name in ("count_time", "frame_time"):
                detector[name] = r.exposure_s
                detector[name].attrs["units"] = "s"
            detector["saturation_value"] = np.int64(r.saturation_counts)
            detector["depends_on"] = "/entry/instrument/detector/transformations/two_theta"
            placement = detector.create_group("transformations")
            placement.attrs["NX_class"] = "NXtransformations"
            _axis(placement, "two_theta", r.twotheta_deg, "rotation", twotheta_axis, ".", "deg")
            for index, module in enumerate(modules):
                name = _group_name(module.name, index, len(modules)) if r.modules else module.name
                _module(detector, module, name, (index * slab_slow, 0), before_twotheta)
            if not r.modules and r.distance_m is not None:
                for name, value, units in (("distance", r.distance_m * 1000.0, "mm"),
                                           ("beam_center_x", r.beam_fast_px, "pixel"),
                                           ("beam_center_y", r.beam_slow_px, "pixel")):
                    detector[name] = value
                    detector[name].attrs["units"] = units

            sample = entry.create_group("sample")
            sample.attrs["NX_class"] = "NXsample"
            sample["name"] = "nbsim simulated crystal"
            sample["depends_on"] = "/entry/sample/transformations/omega"
            goniometer = sample.create_group("transformations")
            goniometer.attrs["NX_class"] = "NXtransformations"
            _axis(goniometer, "omega", omega_deg, "rotation", to_mcstas @ np.array(r.spindle_axis), ".", "deg")
            goniometer["omega_increment_set"] = r.osc_deg
            goniometer["omega_increment_set"].attrs["units"] = "deg"
            goniometer["omega_end"] = np.atleast_1d(np.asarray(omega_deg, dtype=np.float64)) + r.osc_deg
            goniometer["omega_end"].attrs["units"] = "deg"
            sample["unit_cell"] = np.array([r.unit_cell_A_deg], dtype=np.float64)
            sample["ub_matrix"] = (to_mcstas @ a_matrix.T)[np.newaxis]
            sample["ub_matrix"].attrs["units"] = "1/angstrom"
            sample["ub_matrix"].attrs["description"] = "columns a*, b*, c* at omega = 0 (Busing-Levy, no 2 pi)"
            sample["beam"] = h5py.SoftLink("/entry/instrument/beam")

            data = entry.create_group("data")
            data.attrs.update({"NX_class": "NXdata", "signal": "data"})
            shape = (len(omega_deg), *frame_shape)
            counts = data.create_dataset("data", shape=shape, dtype=np.int32, chunks=(1, *shape[1:]),
                                         compression="gzip", compression_opts=1)
            written = 0
            for frame in frames:
                counts[written] = with_gaps(frame, r).reshape(frame_shape)
                written += 1
            if written != shape[0]:
                raise NbsimError(f"{written} frames for {shape[0]} omega values")
            detector["data"] = h5py.SoftLink("/entry/data/data")
            if r.gaps is not None:
                detector.create_dataset("pixel_mask", data=np.where(r.gaps, NXMX_GAP_BIT, 0).astype(np.uint32),
                                        compression="gzip", compression_opts=1)
            entry["notes"] = "\n".join((*r.notes, *response_lines(r)))

    atomic_write_with(path, write)
