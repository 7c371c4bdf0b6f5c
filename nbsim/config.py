"""Typed simulation configuration, units in the field names.

`None` means "let nanoBragg's automatic rules decide" (documented in docs/physics.md). Scalar
fields that may carry gradients accept a float or a 0-d torch tensor, so that
`dataclasses.replace(config.detector, distance_mm=torch.tensor(100.0, requires_grad=True))`
gives an image differentiable in that parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union, get_args

if TYPE_CHECKING:
    import torch

INT32_MAX_COUNT = 2**31 - 1
"""The largest count an int32 image (miniCBF, NXmx) holds: their saturation unless -saturation sets one."""

Scalar = Union[float, "torch.Tensor"]  # noqa: UP007 - a string forward reference keeps torch unimported
Vector3 = tuple[float, float, float]

def scalar_value(value: Scalar) -> float:
    """The plain float of a scalar that may be a tensor carrying gradients (for decisions, not maths)."""
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def check_cell(cell_A_deg: tuple[Scalar, ...]) -> None:
    """Raise a one-line error for a cell that cannot exist. As in nanoBragg, b or c not positive take a's
    length and an angle not positive is 90 degrees; then every angle must be below 180 degrees, each
    below the sum of the other two and all three below 360 in sum, or the cell does not close; a cell
    that closes flat has no volume."""
    from .errors import NbsimError

    values = [scalar_value(v) for v in cell_A_deg]
    shown = " ".join(f"{v:g}" for v in values)
    if not values[0] > 0:
        raise NbsimError(f"cell {shown}: the length a must be positive")
    angles = [math.radians(v) if v > 0 else math.pi / 2 for v in values[3:]]
    if any(not angle < math.pi for angle in angles):
        raise NbsimError(f"cell {shown}: cell angles must be below 180 degrees")
    cosines = [math.cos(angle) for angle in angles]
    radicand = 1 - sum(c * c for c in cosines) + 2 * math.prod(cosines)
    if radicand < -1e-9:
        raise NbsimError(f"cell {shown}: these angles cannot close a cell (each must be below the sum of the "
                         "other two, and the three below 360 degrees in sum)")
    if radicand <= 1e-9:
        raise NbsimError(f"cell {shown}: these angles close a flat cell of zero volume")


Convention = Literal["mosflm", "denzo", "adxv", "xds", "dials", "custom"]
CrystalShape = Literal["square", "round", "gauss", "tophat"]
Pivot = Literal["beam", "sample"]
PhysicsModel = Literal["nanobragg", "corrected"]
SamplingMode = Literal["nanobragg", "advised"]
PHYSICS_MODELS: tuple[PhysicsModel, ...] = get_args(PhysicsModel)
CONVENTIONS: tuple[Convention, ...] = get_args(Convention)
CRYSTAL_SHAPES: tuple[CrystalShape, ...] = get_args(CrystalShape)


@dataclass(frozen=True)
class CrystalConfig:
    """Unit cell, orientation, size, shape, mosaicity and rotation of the crystal."""

    cell_A_deg: tuple[Scalar, Scalar, Scalar, Scalar, Scalar, Scalar] | None = None
    """a, b, c (Å) and alpha, beta, gamma (degrees); zeros take nanoBragg's defaults."""
    mosflm_matrix: tuple[float, ...] | None = None
    """The nine numbers of a MOSFLM A matrix (-mat), row by row as in the file: columns a*, b*, c* (Å⁻¹)
    times λ. Read from the file when the arguments are parsed."""
    misset_deg: tuple[Scalar, Scalar, Scalar] | None = None
    misset_random: bool = False
    misset_seed: int | None = None
    n_cells: tuple[int, int, int] = (1, 1, 1)
    crystal_size_mm: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Crystal extent along a, b, c in mm; a non-zero value sets the cell count on that axis."""
    shape: CrystalShape = "square"
    fudge: float = 1.0
    mosaic_spread_deg: Scalar | None = None
    mosaic_domains: int | None = None
    mosaic_seed: int = 12345678
    phi_start_deg: float = 0.0
    osc_range_deg: float | None = None
    phi_step_deg: float | None = None
    phi_steps: int | None = None
    sampling: SamplingMode = "nanobragg"
    """Where the flags leave the φ steps or the mosaic domains out: "nanobragg", the C's defaults (2 φ steps over
    an -osc, 10 domains for a spread); "advised", nbsim's sampling advice (nbsim.resolve.with_advised_sampling)."""


@dataclass(frozen=True)
class BeamConfig:
    """Wavelengths, divergence, explicit sources, polarization and fluence of the incident beam."""

    wavelength_A: Scalar = 1.0
    dispersion_percent: float = 0.0
    dispersion_steps: int | None = None
    hdiv_range_mrad: float | None = None
    vdiv_range_mrad: float | None = None
    hdiv_step_mrad: float | None = None
    vdiv_step_mrad: float | None = None
    hdiv_steps: int | None = None
    vdiv_steps: int | None = None
    round_divergence: bool = True
    sources: tuple[tuple[float | None, ...], ...] | None = None
    """Explicit sources (-sourcefile rows): x, y, z (m), weight, wavelength (m) each, None where the file
    leaves a column out. Read from the file when the arguments are parsed."""
    spectrum: tuple[tuple[float, float], ...] | None = None
    """Weighted channels (-spectrumfile rows): wavelength (Å), weight each. Each channel is a source along
    every divergence direction, its intensity weighted by weight/Σweights (docs/physics.md, Spectra)."""
    spectrum_shift_eV: Scalar = 0.0
    """-spectrum_shift: eV added to every channel's energy (a spectrometer's calibration offset)."""
    spectrum_stretch: Scalar = 1.0
    """-spectrum_stretch: each channel's energy moved from the spectrum's weighted mean energy by this many times
    its offset (1: as given); with the shift, E′ = Ē + shift + stretch·(E − Ē), diffBragg's λ = λ0 + λ1·λ in
    energy about the mean (`shifted_spectrum`)."""
    kahn_polarization: float = 0.0
    no_polarization: bool = False
    fluence_photons_per_m2: float = 1.25932015286227e29
    flux_photons_per_s: float = 0.0
    exposure_s: float = 1.0
    beamsize_mm: float = 0.1
    water_thickness_um: float = 0.0
    dmin_A: float = 0.0
    background: str | None = None
    """An amorphous background from a scattering curve (-background): "water", "air" (simtbx's tables) or a
    file of sin(θ)/λ (Å⁻¹) and F rows; None: none. Linear in fluence, added once per pixel (docs/physics.md)."""
    background_thickness_mm: float = 0.0
    """Path length of the background material along the beam (-background_thick), mm."""
    background_density_g_cm3: float | None = None
    """Its density (-background_density); None: the curve's own (water 1, air 0.0012, a file 1)."""
    background_molecular_weight: float | None = None
    """Its molecular weight in g/mol (-background_mw); None: the curve's own (water 18, air 14, a file 18)."""


@dataclass(frozen=True)
class PanelConfig:
    """One flat panel of a multi-panel detector, in nanoBragg's lab frame (the terms of the C's custom
    convention: -fdet_vector, -sdet_vector, -odet_vector and the first pixel's outer corner)."""

    name: str
    pixels_f: int
    pixels_s: int
    pixel_size_mm: float
    fdet_vector: Vector3
    sdet_vector: Vector3
    odet_vector: Vector3 | None
    """None: the unit vector along fdet × sdet."""
    pix0_mm: Vector3
    """The outer corner of the panel's first pixel, mm."""


@dataclass(frozen=True)
class DetectorConfig:
    """Detector size, placement, orientation, sensor and sampling."""

    distance_mm: Scalar = 100.0
    close_distance_mm: Scalar | None = None
    detsize_f_mm: float = 102.4
    detsize_s_mm: float = 102.4
    pixels_f: int | None = None
    pixels_s: int | None = None
    pixel_size_mm: float = 0.1
    convention: Convention = "mosflm"
    pivot: Pivot = "beam"
    """Only used by the custom convention; the named conventions fix their own pivot."""
    beam_x_mm: Scalar | None = None
    beam_y_mm: Scalar | None = None
    close_x_mm: float | None = None
    close_y_mm: float | None = None
    orgx_px: float | None = None
    orgy_px: float | None = None
    twotheta_deg: Scalar = 0.0
    rotation_deg: tuple[Scalar, Scalar, Scalar] = (0.0, 0.0, 0.0)
    """Rotations about x, then y, then z (nanoBragg's -detector_rotx/y/z)."""
    fdet_vector: Vector3 | None = None
    sdet_vector: Vector3 | None = None
    odet_vector: Vector3 | None = None
    beam_vector: Vector3 | None = None
    polar_vector: Vector3 | None = None
    spindle_axis: Vector3 | None = None
    twotheta_axis: Vector3 | None = None
    pix0_vector_mm: Vector3 | None = None
    """The first pixel's outer corner from the sample, mm (-pix0_vector_mm under -physics corrected): it places the
    detector, after the vectors' rotations. nanoBragg reads it as metres and then recomputes it (None)."""
    point_pixel: bool = False
    curved: bool = False
    sensor_thickness_um: float = 0.0
    sensor_absorption_depth_um: float | None = None
    """Attenuation depth; None uses nanoBragg's fallback (the thickness), math.inf turns absorption off. Where a
    thickness is given without it, the command line sets it to `sensor_material`'s attenuation length at λ under
    -sensor_material, -detector_model or -physics corrected (else it keeps nanoBragg's fallback)."""
    sensor_material: str = "Si"
    """What the sensor is made of (nbsim.sensors.MATERIALS), as the image headers describe it."""
    sensor_layers: int | None = None
    oversample: int | None = None
    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    roi: tuple[int, int, int, int] | None = None
    """xmin, xmax, ymin, ymax in pixels, inclusive, as nanoBragg's -roi."""
    mask_file: str | None = None
    module_size_px: tuple[int, int] | None = None
    """A module's pixels (fast, slow): modules tile the detector from its first pixel (-module_size)."""
    module_gap_px: tuple[int, int] = (0, 0)
    """Pixels between modules (fast, slow), not rendered: a real detector's gaps (-module_gap)."""
    panels: tuple[PanelConfig, ...] | None = None
    """A multi-panel detector (-panelfile), rendered in place of the one panel the fields above place."""
    panel_file: str | None = None
    """The file `panels` were read from (for messages)."""


@dataclass(frozen=True)
class StructureFactorConfig:
    """Where structure factors come from and how they are looked up."""

    hkl_file: str | None = None
    """nanoBragg's h k l F text, an MTZ or an sf-mmCIF file (told apart by content)."""
    column: str | None = None
    """The MTZ or mmCIF column to use (-column); None: the first amplitude, else the first mean intensity."""
    model_file: str | None = None
    """A PDB or mmCIF atomic model (-model) whose |F| are computed to the detector's resolution."""
    default_F: float = 0.0
    interpolate: bool | None = None
    anomalous: bool = False
    """f′ and f″ of every element of a -model at each wavelength (-anomalous): F(+) ≠ F(−), and with a spectrum
    one table per channel (or per energy bin)."""
    anomalous_table: str | None = None
    """A file of `element energy_eV f′ f″` rows (-fp_fdp) that overrides Cromer–Liberman for its elements."""
    energy_bins: int | None = None
    """Anomalous tables for a spectrum: one per channel (None) or one per energy bin of equal width."""


NoiseGenerator = Literal["nanobragg", "philox"]
PsfShape = Literal["none", "gaussian", "fiber"]
NOISE_GENERATORS: tuple[NoiseGenerator, ...] = get_args(NoiseGenerator)
PSF_SHAPES: tuple[PsfShape, ...] = get_args(PsfShape)


@dataclass(frozen=True)
class DetectorResponseConfig:
    """How the detector turns the noise-free photon image into ADU (docs/detector.md), in simtbx's
    `add_noise` order: flicker, Poisson, calibration, point-spread, gain + offset + readout noise, then
    the beam stop and defective pixels. Every effect but Poisson is off by default; the kernel ignores
    all of this (the noise-free image does not depend on it)."""

    generator: NoiseGenerator = "nanobragg"
    """Poisson draws by nanoBragg's serial ran1/poidev sequence (the C's noise image, bit for bit) or by
    counter-based Philox4x32-10 streams (any image, and any pixel, reproducible alone on any device)."""
    noise_seed: int | None = None
    """The -seed value as given (nanoBragg draws with minus it); None: not set (the command line then takes
    the clock, as nanoBragg does; the detector stage needs it set)."""
    poisson: bool = True
    flicker_fraction: float = 0.0
    """rms of the 1/f source noise: expected photons × (1 + fraction·N(0,1)), before Poisson."""
    calibration_fraction: float = 0.0
    """rms of the per-pixel gain error, fixed for a detector (drawn with calibration_seed)."""
    calibration_seed: int = 123456789
    psf: PsfShape = "none"
    psf_fwhm_um: float = 0.0
    gain_adu_per_photon: float = 1.0
    adc_offset_adu: float = 40.0
    readout_noise_adu: float = 0.0
    """rms readout noise in ADU."""
    beamstop_radius_mm: float = 0.0
    """Radius of a beam stop centred on the direct beam: no photons reach the pixels inside it."""
    hot_pixel_fraction: float = 0.0
    """Fraction of pixels that read 65535 ADU (drawn with defect_seed)."""
    dead_pixel_fraction: float = 0.0
    """Fraction of pixels that read 0 ADU (drawn with defect_seed)."""
    defect_seed: int = 1


EMPTY_SHOT_ADVICE = "raise the fluence (-fluence, -flux, -exposure) or the crystal (-N, structure factors)"
"""What the empty-shot warnings (`nbsim -min_photons`, a sweep's `sweep.min_photons`) advise."""
_FRACTIONS = ("flicker_fraction", "calibration_fraction", "hot_pixel_fraction", "dead_pixel_fraction")
_NOT_NEGATIVE = ("psf_fwhm_um", "gain_adu_per_photon", "readout_noise_adu", "beamstop_radius_mm")


def _check_range(name: str, value: float, positive: bool) -> None:
    """A one-line NbsimError naming the setting unless `value` is finite and positive (or not below 0)."""
    from .errors import NbsimError

    if not (math.isfinite(value) and (value > 0.0 if positive else value >= 0.0)):
        raise NbsimError(f"{name} must be {'positive' if positive else 'a finite number not below 0'} (got {value:g})")


def check_response(response: DetectorResponseConfig) -> None:
    """Raise a one-line NbsimError naming the setting for a value the detector cannot have."""
    from .errors import NbsimError

    if response.generator not in NOISE_GENERATORS:
        raise NbsimError(f"generator must be one of {', '.join(NOISE_GENERATORS)} (got {response.generator!r})")
    if response.psf not in PSF_SHAPES:
        raise NbsimError(f"psf must be one of {', '.join(PSF_SHAPES)} (got {response.psf!r})")
    for name in _FRACTIONS:
        value = getattr(response, name)
        if not 0.0 <= value <= 1.0:
            raise NbsimError(f"{name} must be a fraction between 0 and 1 (got {value:g})")
    for name in _NOT_NEGATIVE:
        _check_range(name, getattr(response, name), positive=False)
    if not math.isfinite(response.adc_offset_adu):
        raise NbsimError(f"adc_offset_adu must be finite (got {response.adc_offset_adu:g})")
    if response.hot_pixel_fraction + response.dead_pixel_fraction > 1.0:
        raise NbsimError("hot_pixel_fraction + dead_pixel_fraction must not exceed 1")
    if response.psf != "none" and not response.psf_fwhm_um > 0.0:
        raise NbsimError(f"psf {response.psf} needs psf_fwhm_um > 0")


_SIMULATION_POSITIVE = frozenset((
    "wavelength_A", "distance_mm", "close_distance_mm", "detsize_f_mm", "detsize_s_mm", "pixels_f", "pixels_s",
    "pixel_size_mm", "beamsize_mm", "exposure_s", "background_density_g_cm3", "background_molecular_weight",
    "energy_bins"))
"""Simulator options that must be positive: the options of the flags nanoBragg's rules want positive
(nbsim.nanobragg.flags.MUST_BE_POSITIVE)."""
_SIMULATION_NOT_NEGATIVE = frozenset((
    "n_cells", "crystal_size_mm", "fudge", "mosaic_spread_deg", "mosaic_domains", "osc_range_deg", "phi_step_deg",
    "phi_steps", "dispersion_percent", "dispersion_steps", "hdiv_range_mrad", "vdiv_range_mrad", "hdiv_step_mrad",
    "vdiv_step_mrad", "hdiv_steps", "vdiv_steps", "fluence_photons_per_m2", "flux_photons_per_s",
    "water_thickness_um", "dmin_A", "background_thickness_mm", "sensor_thickness_um", "sensor_layers",
    "oversample"))
"""Simulator options that must not be negative (nbsim.nanobragg.flags.MUST_NOT_BE_NEGATIVE)."""


def check_values(config: SimulationConfig) -> None:
    """Raise a one-line NbsimError naming the option for a value out of its range: the detector's settings
    (`check_response`) and the ranges nanoBragg's rules give the flags, for values set as options (a
    sweep's option axes and draws, Python), which no flag rule sees. Unset values (None) pass."""
    check_response(config.response)
    for part in (config.crystal, config.beam, config.detector, config.structure):
        for item in dataclasses.fields(part):
            positive = item.name in _SIMULATION_POSITIVE
            if not (positive or item.name in _SIMULATION_NOT_NEGATIVE):
                continue
            value = getattr(part, item.name)
            for number in (() if value is None else value if isinstance(value, tuple) else (value,)):
                _check_range(item.name, scalar_value(number), positive)


@dataclass(frozen=True)
class PhysicsConfig:
    """Which physics renders the image (docs/physics.md, "The physics switch")."""

    physics: PhysicsModel = "nanobragg"
    """"nanobragg": the C program's image, its defects included (parity); "corrected": every known defect
    fixed."""


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that determines the image (and, `response`, the detector image made from it)."""

    crystal: CrystalConfig = field(default_factory=CrystalConfig)
    beam: BeamConfig = field(default_factory=BeamConfig)
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    structure: StructureFactorConfig = field(default_factory=StructureFactorConfig)
    response: DetectorResponseConfig = field(default_factory=DetectorResponseConfig)
    physics: PhysicsConfig = field(default_factory=PhysicsConfig)

    @property
    def corrected(self) -> bool:
        """Whether nanoBragg's known defects are corrected (-physics corrected)."""
        return self.physics.physics == "corrected"

    def with_options(self, **options: Any) -> SimulationConfig:
        """Return a copy with fields replaced by name, wherever they live (e.g. mosaic_spread_deg=0.2)."""
        parts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        remaining = dict(options)
        for name, part in parts.items():
            own = {k: remaining.pop(k) for k in list(remaining) if k in _field_names(part)}
            if own:
                parts[name] = dataclasses.replace(part, **own)
        if remaining:
            from .errors import did_you_mean

            first = sorted(remaining)[0]
            raise KeyError(f"unknown simulator option(s): {', '.join(sorted(remaining))}"
                           f"{did_you_mean(first, option_names())}; nbsim show --options lists them")
        return SimulationConfig(**parts)


def mosaic_spread_deg(config: SimulationConfig) -> float:
    """The crystal's mosaic spread in degrees (0 without one)."""
    spread = config.crystal.mosaic_spread_deg
    return 0.0 if spread is None else scalar_value(spread)


def counts_left_to_advice(config: SimulationConfig) -> tuple[bool, bool]:
    """Whether -sampling advised leaves the φ steps of a rotation and the mosaic domains of a spread to the
    advice (the flags give neither). Decided here, without PyTorch, so that a sweep's planning imports it
    (seconds of every Snakemake start) only where an advice is computed."""
    crystal = config.crystal
    if crystal.sampling != "advised":
        return False, False
    rotation_open = crystal.phi_steps is None and crystal.phi_step_deg is None and (crystal.osc_range_deg or 0) > 0
    domains_open = (crystal.mosaic_domains is None or crystal.mosaic_domains <= 0) and mosaic_spread_deg(config) > 0
    return rotation_open, domains_open


def _field_names(instance: Any) -> frozenset[str]:
    return _class_field_names(type(instance))


@functools.cache
def _class_field_names(cls: type) -> frozenset[str]:
    """A dataclass's field names, once per class (with_options asks for every part on every call)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def option_parts() -> tuple[type, ...]:
    """The configuration parts SimulationConfig holds, in its field order (their fields are the options)."""
    defaults = SimulationConfig()
    return tuple(type(getattr(defaults, f.name)) for f in dataclasses.fields(SimulationConfig))


def option_names() -> set[str]:
    """Every option name accepted by SimulationConfig.with_options."""
    return set().union(*(_field_names(part()) for part in option_parts()))


def spectrum_channels_problem(spectrum: Sequence[tuple[float, float]]) -> str | None:
    """What is wrong with a spectrum's (wavelength in Å, weight) channels (None: nothing): no channels, a
    wavelength not positive, a weight negative, or weights summing to 0. One check for a -spectrumfile's
    configuration and a frame's own spectrum, each naming its source before it."""
    if not spectrum:
        return "no channels"
    for index, (wavelength_A, weight) in enumerate(spectrum):
        if not (wavelength_A > 0 and math.isfinite(wavelength_A)):
            return f"channel {index + 1}'s wavelength {wavelength_A:g} A must be positive"
        if not (weight >= 0 and math.isfinite(weight)):
            return f"channel {index + 1}'s weight {weight:g} must not be negative"
    total = sum(weight for _, weight in spectrum)
    if not total > 0:
        return "weights sum to 0 (no weight)"
    if not (math.isfinite(total) and math.isfinite(len(spectrum) / total)):  # normalised as weight * (n / sum)
        return f"weights sum to {total:g}, beyond what their normalisation holds: scale them (only ratios count)"
    return None


def check_spectrum(config: BeamConfig) -> None:
    """A spectrum is at least one channel of positive wavelength and non-negative weight, the weights summing
    to more than 0, and the only source of wavelengths (neither -sourcefile nor -dispersion beside it)."""
    from .errors import NbsimError

    spectrum = config.spectrum
    if spectrum is None:
        if scalar_value(config.spectrum_shift_eV) != 0 or scalar_value(config.spectrum_stretch) != 1:
            raise NbsimError("-spectrum_shift and -spectrum_stretch move a spectrum's channels: give -spectrumfile")
        return
    problem = spectrum_channels_problem(spectrum)
    if problem:
        raise NbsimError(f"the spectrum: {problem}")
    shift_eV, stretch = scalar_value(config.spectrum_shift_eV), scalar_value(config.spectrum_stretch)
    if not (math.isfinite(shift_eV) and stretch > 0 and math.isfinite(stretch)):
        raise NbsimError(f"the spectrum's shift must be finite and its stretch above 0 (got {shift_eV:g} eV, "
                         f"{stretch:g})")
    if min(shifted_energies_eV(spectrum, shift_eV, stretch)) <= 0:
        raise NbsimError(f"a spectrum shift of {shift_eV:g} eV and stretch of {stretch:g} make a channel's energy, "
                         "and its wavelength, non-positive")
    if config.sources is not None:
        raise NbsimError("-spectrumfile and -sourcefile both give the sources: use one")
    if config.dispersion_percent != 0:
        raise NbsimError("-spectrumfile and -dispersion both give the wavelengths: use one")


def shifted_energies_eV(spectrum: tuple[tuple[float, float], ...], shift_eV: Scalar = 0.0,
                        stretch: Scalar = 1.0) -> list[Scalar]:
    """Each channel's energy E moved to Ē + shift + stretch·(E − Ē), Ē the spectrum's weighted mean energy
    (h·c = 12398.42 eV·Å, nanoBragg's); differentiable where the shift or stretch is a tensor."""
    from .sensors import HC_EV_A

    total = sum(weight for _, weight in spectrum)
    mean_eV = sum(HC_EV_A / wavelength * weight for wavelength, weight in spectrum) / total
    return [mean_eV + shift_eV + stretch * (HC_EV_A / wavelength - mean_eV) for wavelength, _ in spectrum]


def shifted_spectrum(spectrum: tuple[tuple[float, float], ...], shift_eV: Scalar = 0.0,
                     stretch: Scalar = 1.0) -> list[tuple[Scalar, float]]:
    """A spectrum's channels, (wavelength in Å, weight), moved by a shift and stretch (`shifted_energies_eV`)."""
    from .sensors import HC_EV_A

    return [(HC_EV_A / energy_eV, weight)
            for energy_eV, (_, weight) in zip(shifted_energies_eV(spectrum, shift_eV, stretch), spectrum, strict=True)]


def spectrum_mean_wavelength_A(spectrum: tuple[tuple[float, float], ...]) -> float:
    """The weighted mean wavelength of a spectrum: its nominal wavelength (nanoBragg's lambda0)."""
    total = sum(weight for _, weight in spectrum)
    return sum(wavelength * weight for wavelength, weight in spectrum) / total
