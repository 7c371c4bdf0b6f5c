"""nanoBragg command-line arguments → SimulationConfig and output options, in three steps: strict
validation against the flag table (`flags`), nanoBragg's substring matching (`rules`), and the
typed configuration built from the C's variables. The small input files (-mat, -sourcefile, -spectrumfile) are
read here, strictly, into the configuration; the large tables (-hkl, -mask) stay paths, read by `resolve.resolve`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

from ..config import (
    INT32_MAX_COUNT,
    BeamConfig,
    CrystalConfig,
    DetectorConfig,
    DetectorResponseConfig,
    SimulationConfig,
    StructureFactorConfig,
    check_cell,
    check_response,
    check_spectrum,
    shifted_spectrum,
    spectrum_mean_wavelength_A,
)
from ..errors import NbsimError
from ..io.text import read_mosflm_matrix, read_source_file, read_spectrum_file
from ..modes import Compile
from ..sensors import DEFAULT_MATERIAL, sensor_material
from .flags import (
    DETECTOR_FLAGS,
    NBSIM_ONLY,
    NO_EFFECT,
    SINGLE_PANEL_FILES,
    SINGLE_PANEL_ONLY,
    WAVELENGTH_FLAGS,
    validate,
)
from .presets import DetectorModel, expand_detector_model, model_flags
from .rules import CState, run_nanobragg_rules


@dataclass
class RunOptions:
    """What the CLI writes and how it computes, besides the physics."""

    floatfile: str | None
    intfile: str | None
    pgmfile: str | None
    noisefile: str | None
    """Where the noise image is written: SMV, or NXmx for a multi-panel detector (None: not written)."""
    intfile_scale: float
    pgm_scale: float
    adc: float
    seed: int
    printout_pixel: tuple[int, int] | None
    cbffile: str | None = None
    nxmxfile: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    """-dtype; without it float64 when the noise image is nanoBragg's (its serial draws follow nanoBragg's float
    image to the bit, which only a float64 rendering reproduces; docs/detector.md), else float32."""
    compile: Compile = Compile.AUTO
    """AUTO (compile when the kernel is cached or building it pays), ON or OFF."""
    p1_table_file: str | None = None
    """Where -p1_out writes the P1 table used, as nanoBragg's h k l F text."""
    saturation_counts: int = INT32_MAX_COUNT
    """-saturation: the largest count of the int32 files (-cbffile, -nxmxfile), written as their overload value."""
    counts_pedestal: float = 0.0
    """What the int32 files add to every count: -adc when it is given, else nothing (photon-counting detectors
    have no pedestal; the SMV files add -adc, default 40, as nanoBragg does)."""
    detector_model: str | None = None
    """-detector_model's model name (nbsim.nanobragg.presets.MODELS)."""
    detector_model_flags: tuple[str, ...] = ()
    """The flags the model set, before the command line's own (which override them)."""
    min_photons: float = 1.0
    """-min_photons: an image holding fewer photons in all is reported as empty."""
    sensor_attenuation_source: str | None = None
    """Where the sensor's attenuation length comes from (nanoBragg's default, a material at λ, -detector_abs);
    None without a sensor. `nbsim show` prints it."""
    notes: list[str] = field(default_factory=list)
    noise: bool = False
    """Whether the detector's noise image is drawn (nanoBragg's default; -nonoise turns it off): the -noisefile,
    and the counts of -cbffile and -nxmxfile (else the -intfile image's). A multi-panel detector draws it
    without writing a -noisefile unless one is named."""

    @property
    def wants_counts(self) -> bool:
        """Whether a file for processing software (-cbffile, -nxmxfile) is asked for."""
        return bool(self.cbffile or self.nxmxfile)

    def outputs(self, panels: bool) -> dict[str, str]:
        """The files a run writes, by flag (a multi-panel run, `panels`, writes no -intfile or -pgmfile)."""
        named = {"-floatfile": self.floatfile, "-intfile": self.intfile, "-pgmfile": self.pgmfile,
                 "-noisefile": self.noisefile, "-p1_out": self.p1_table_file, "-cbffile": self.cbffile,
                 "-nxmxfile": self.nxmxfile}
        if panels:
            del named["-intfile"], named["-pgmfile"]
        return {flag: path for flag, path in named.items() if path is not None}


def parse(argv: list[str]) -> tuple[SimulationConfig, RunOptions]:
    """Validate nanoBragg-style arguments and turn them into a configuration and output options. A
    -detector_model's flags go first, so that the command line's own override them."""
    validate(argv)
    given = argv
    model, applied = model_flags(given)
    argv = expand_detector_model(given)
    state = run_nanobragg_rules(argv)
    nbsim_options = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i] in NBSIM_ONLY}
    if "-column" in nbsim_options and state.hkl is None:
        raise NbsimError("-column picks a column of the -hkl file: give -hkl FILE")
    if "-p1_out" in nbsim_options and state.hkl is None and "-model" not in nbsim_options:
        raise NbsimError("-p1_out writes the table of -hkl or -model: give one of them")
    config = _config_from_state(state).with_options(column=nbsim_options.get("-column"),
                                                    model_file=nbsim_options.get("-model"),
                                                    **_modules(argv))
    config, physics_notes = _with_physics_options(config, argv, nbsim_options)
    panel_file = nbsim_options.get("-panelfile")
    if panel_file:
        _check_panel_flags(argv)
        from ..io.panels import read_panel_file  # numpy: only where a panel file is given

        config = config.with_options(panels=read_panel_file(panel_file), panel_file=panel_file)
        state.write_pgm = False
        state.intfile = None
        if not any(flag in argv for flag in ("-noisefile", "-noiseimage")):
            state.noisefile = None  # not nanoBragg's default SMV name: a multi-panel noise image is NXmx, when named
        elif state.noisefile is not None:
            _check_nxmx_name("-noisefile", state.noisefile)
    if "-nxmxfile" in nbsim_options:
        _check_nxmx_name("-nxmxfile", nbsim_options["-nxmxfile"])
    config = config.with_options(spectrum_shift_eV=float(nbsim_options.get("-spectrum_shift", 0.0)),
                                 spectrum_stretch=float(nbsim_options.get("-spectrum_stretch", 1.0)))
    if "-spectrumfile" in nbsim_options:
        config = _with_spectrum(config, nbsim_options["-spectrumfile"], any(flag in argv for flag in WAVELENGTH_FLAGS))
    else:  # a shift or stretch without a spectrum is refused here, as check_spectrum says
        check_spectrum(config.beam)
    config, attenuation_source = _with_sensor(_with_cell_from_file(config), given, applied, model)
    if config.crystal.cell_A_deg is not None:
        check_cell(config.crystal.cell_A_deg)
    notes = [f"{flag} has no effect on the image (accepted for nanoBragg compatibility)"
             for flag in NO_EFFECT if flag in given] + physics_notes + _structure_factor_cache_notes(
                 argv, state.hkl is None and "-model" not in nbsim_options)
    _check_amorphous_curve_file(argv)
    noise = bool(state.calculate_noise) and (state.noisefile is not None or "-cbffile" in nbsim_options
                                              or "-nxmxfile" in nbsim_options)
    if not state.calculate_noise:
        notes += [f"{flag} changes only the -noisefile image, which -nonoise turns off"
                  for flag in DETECTOR_FLAGS if flag in given]
    elif not noise:
        notes += [f"{flag} changes only the noise image, and with -panelfile neither -noisefile nor -nxmxfile is "
                  "written" for flag in DETECTOR_FLAGS if flag in given]
    if "-tophat_xtal" in argv and state.shape != "tophat":
        notes.append("-tophat_xtal is not a nanoBragg option and nanoBragg ignores it (shape stays "
                     f"{state.shape}); use -tophat_spots for flat-topped spots")
    if "pix0" in state.vectors:
        notes.append("-pix0_vector selects the custom convention; as in nanoBragg its value is then recomputed "
                     "from the beam centre and pivot")
    saturation = int(nbsim_options.get("-saturation", INT32_MAX_COUNT))
    if saturation > INT32_MAX_COUNT:
        raise NbsimError(f"-saturation must not exceed {INT32_MAX_COUNT} (an int32 count), got {saturation}")
    if "-saturation" in given and not ("-cbffile" in nbsim_options or "-nxmxfile" in nbsim_options):
        notes.append("-saturation sets the counts of -cbffile and -nxmxfile, and neither is written")
    config = dataclasses.replace(config, response=_response(argv, nbsim_options, state.adc, state.seed))
    noise_is_nanobraggs = noise and config.response.generator == "nanobragg"
    seed = state.seed if state.seed is not None else int(time.time())
    run = RunOptions(
        floatfile=state.floatfile, intfile=state.intfile,
        pgmfile=state.pgmfile if state.write_pgm else None,
        noisefile=state.noisefile if state.calculate_noise else None, noise=noise,
        intfile_scale=state.intfile_scale, pgm_scale=state.pgm_scale, adc=state.adc, seed=seed,
        printout_pixel=state.printout_pixel, cbffile=nbsim_options.get("-cbffile"),
        nxmxfile=nbsim_options.get("-nxmxfile"), device=nbsim_options.get("-device", "cpu"),
        dtype=nbsim_options.get("-dtype", "float64" if noise_is_nanobraggs else "float32"),
        compile=Compile.of(nbsim_options.get("-compile", "auto")),
        p1_table_file=nbsim_options.get("-p1_out"), saturation_counts=saturation,
        counts_pedestal=state.adc if "-adc" in argv else 0.0, detector_model=model.name if model else None,
        detector_model_flags=tuple(applied), min_photons=float(nbsim_options.get("-min_photons", 1.0)),
        sensor_attenuation_source=attenuation_source, notes=notes)
    return config, run


def _with_sensor(config: SimulationConfig, given: list[str], model_flags: list[str],
                 model: DetectorModel | None) -> tuple[SimulationConfig, str | None]:
    """The sensor's material, and where a thickness is given without -detector_abs its attenuation depth, with
    where that depth comes from (None without a sensor). nanoBragg takes the thickness (μ = 1/thickness); a
    physical sensor is asked for by -sensor_material, a -detector_model (which names one) or -physics corrected,
    and then takes the material's attenuation length at λ."""
    chosen = _last_value(given, "-sensor_material")
    from_model = _last_value(model_flags, "-sensor_material")
    config = config.with_options(sensor_material=chosen or from_model or DEFAULT_MATERIAL)
    detector = config.detector
    if detector.sensor_thickness_um <= 0:
        return config, None
    if detector.sensor_absorption_depth_um is not None:
        return config, "given by -detector_abs"
    reason = ("-sensor_material" if chosen else f"-detector_model {model.name}" if from_model and model else
              "-physics corrected" if config.corrected else None)
    if reason is None:
        return config, ("nanoBragg's default, the thickness (-sensor_material or -physics corrected: the material's "
                        "at the wavelength)")
    wavelength_A = float(config.beam.wavelength_A)
    depth_um = sensor_material(detector.sensor_material).attenuation_length_um(wavelength_A)
    return (config.with_options(sensor_absorption_depth_um=depth_um),
            f"{detector.sensor_material}'s at {wavelength_A:g} A ({reason})")


def _last_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag` in `argv`, None without one."""
    values = [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == flag]
    return values[-1] if values else None


def _modules(argv: list[str]) -> dict[str, tuple[int, int] | None]:
    """-module_size and -module_gap (the last of each) as DetectorConfig's module_size_px and module_gap_px."""
    pairs: dict[str, tuple[int, int]] = {}
    for i, flag in enumerate(argv[:-2]):
        if flag in ("-module_size", "-module_gap"):
            pairs[flag] = (int(argv[i + 1]), int(argv[i + 2]))
    size = pairs.get("-module_size")
    if size is not None and min(size) < 1:
        raise NbsimError(f"-module_size must be positive (got {size[0]} {size[1]})")
    gap = pairs.get("-module_gap", (0, 0))
    if min(gap) < 0:
        raise NbsimError(f"-module_gap must not be negative (got {gap[0]} {gap[1]})")
    if gap != (0, 0) and size is None:
        raise NbsimError("-module_gap separates modules: give -module_size F S too")
    return {"module_size_px": size, "module_gap_px": gap}


def _with_physics_options(config: SimulationConfig, argv: list[str],
                          options: dict[str, str]) -> tuple[SimulationConfig, list[str]]:
    """-physics, -sampling, -background and its material, -anomalous, -fp_fdp, -energy_bins and -pix0_vector_mm
    (read in mm and placing the detector under -physics corrected; as nanoBragg, in metres and recomputed, by
    default)."""
    notes = []
    physics = options.get("-physics", "nanobragg")
    anomalous = "-anomalous" in argv
    for flag in ("-fp_fdp", "-energy_bins"):
        if flag in options and not anomalous:
            raise NbsimError(f"{flag} sets the f' and f'' of -anomalous: give -anomalous too")
    if anomalous and "-model" not in options:
        raise NbsimError("-anomalous computes the f' and f'' of a model's atoms: give -model FILE")
    for flag in ("-background_thick", "-background_density", "-background_mw"):
        if flag in options and "-background" not in options:
            raise NbsimError(f"{flag} describes the -background material: give -background FILE|water|air")
    config = config.with_options(
        physics=physics, sampling=options.get("-sampling", "nanobragg"), background=options.get("-background"),
        background_thickness_mm=float(options.get("-background_thick", 0.0)),
        background_density_g_cm3=_float_or_none(options.get("-background_density")),
        background_molecular_weight=_float_or_none(options.get("-background_mw")), anomalous=anomalous,
        anomalous_table=options.get("-fp_fdp"),
        energy_bins=int(options["-energy_bins"]) if "-energy_bins" in options else None)
    if "-pix0_vector_mm" in argv:
        position = argv.index("-pix0_vector_mm")
        values = tuple(float(v) for v in argv[position + 1:position + 4])
        if physics == "corrected":
            config = config.with_options(pix0_vector_mm=values)
        else:
            notes.append("-pix0_vector_mm: nanoBragg reads it as metres and then recomputes it (-physics "
                         "corrected reads millimetres and places the detector there)")
    return config, notes


def _float_or_none(value: str | None) -> float | None:
    return None if value is None else float(value)


def _check_panel_flags(argv: list[str]) -> None:
    """With -panelfile, refuse the flags that place or select pixels of one panel, and its one-panel files."""
    for flag in argv:
        if flag in SINGLE_PANEL_ONLY:
            raise NbsimError(f"{flag} places or selects pixels of a single panel; with -panelfile every panel's "
                             "place and size come from the panel file")
        if flag in SINGLE_PANEL_FILES:
            raise NbsimError(f"{flag} writes one panel; a multi-panel detector (-panelfile) is written by "
                             "-nxmxfile and -noisefile (NXmx, one module per panel) or -floatfile (the panels "
                             "stacked)")


NXMX_SUFFIXES = (".h5", ".nxs", ".hdf5", ".nx5")
"""The suffixes an NXmx (HDF5) file usually carries, named where a file's suffix says another format."""
OTHER_FORMAT_SUFFIXES = (".img", ".smv", ".cbf")
"""Suffixes of the SMV and miniCBF files: an NXmx file under one of them would be read as the wrong format."""


def _values_of(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """The value after each of `flags` on the command line, in order (the C takes the last)."""
    return [argv[i + 1] for i in range(len(argv) - 1) if argv[i] in flags]


def _structure_factor_cache_notes(argv: list[str], without_table: bool) -> list[str]:
    """nanoBragg without -hkl reads its structure factors from its binary cache (-dump FILE, else
    ./Fdump.bin) where that file exists, and renders them; nbsim reads no cache. Refuse a -dump it would
    read (its image would not be the C's); warn of a ./Fdump.bin it would read unasked."""
    named = _values_of(argv, ("-dump",))
    cache = named[-1] if named else "Fdump.bin"
    if not without_table or not os.path.isfile(cache):
        return []
    if named:
        raise NbsimError(f"-dump {cache}: without -hkl nanoBragg reads its structure factors from this cache "
                         "of a previous run, which nbsim does not read; give that run's -hkl file instead")
    return [f"{cache} is here: without -hkl nanoBragg would read its structure factors from this cache of a previous "
            "run; nbsim does not read it (give that run's -hkl file to render them)"]


def _check_amorphous_curve_file(argv: list[str]) -> None:
    """nanoBragg reads the -stol (-4stol, -Q) file, the last one named, and stops without an image where it
    cannot open it or finds only blank lines in it (it never uses the curve); so does nbsim, in one line."""
    named = _values_of(argv, ("-stol", "-4stol", "-Q"))
    if not named:
        return
    try:
        with open(named[-1], errors="replace") as stream:
            lines = stream.readlines()
    except OSError as error:
        raise NbsimError(f"{named[-1]}: cannot be read ({error.strerror or error}); nanoBragg stops there") from None
    if all(line.lstrip(" \t,;:!") == "\n" for line in lines):
        raise NbsimError(f"{named[-1]}: no data (nanoBragg stops at an -stol, -4stol or -Q file of blank lines)")


def _check_nxmx_name(flag: str, path: str) -> None:
    """Refuse an NXmx file (-nxmxfile, a multi-panel -noisefile) named as an SMV or miniCBF file: a user reads a
    file's format from its suffix."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in OTHER_FORMAT_SUFFIXES:
        raise NbsimError(f"{flag} {path}: the file is NXmx (HDF5){' with -panelfile' if flag == '-noisefile' else ''}"
                         f", not the format {suffix} names; end its name in {', '.join(NXMX_SUFFIXES)}")


def _response(argv: list[str], options: dict[str, str], adc: float, seed: int | None) -> DetectorResponseConfig:
    """The detector's settings: -seed, -adc and nbsim's detector flags (docs/detector.md). Without -seed the
    noise seed stays None (the configuration does not depend on the clock; the command line takes it)."""
    if options.get("-psf", "none") != "none" and not float(options.get("-psf_fwhm", 0.0)) > 0:
        raise NbsimError(f"-psf {options['-psf']} needs -psf_fwhm (the width in um, above 0)")
    if float(options.get("-hot_pixels", 0.0)) + float(options.get("-dead_pixels", 0.0)) > 1:
        raise NbsimError("-hot_pixels and -dead_pixels together must not exceed 1")
    defaults = DetectorResponseConfig()
    response = DetectorResponseConfig(
        generator=options.get("-noise_generator", defaults.generator), noise_seed=seed,
        poisson="-nopoisson" not in argv, flicker_fraction=float(options.get("-flicker", 0.0)),
        calibration_fraction=float(options.get("-calibration", 0.0)),
        calibration_seed=int(options.get("-calibration_seed", defaults.calibration_seed)),
        psf=options.get("-psf", defaults.psf), psf_fwhm_um=float(options.get("-psf_fwhm", 0.0)),
        gain_adu_per_photon=float(options.get("-gain", defaults.gain_adu_per_photon)), adc_offset_adu=adc,
        readout_noise_adu=float(options.get("-readout_noise", 0.0)),
        beamstop_radius_mm=float(options.get("-beamstop", 0.0)),
        hot_pixel_fraction=float(options.get("-hot_pixels", 0.0)),
        dead_pixel_fraction=float(options.get("-dead_pixels", 0.0)),
        defect_seed=int(options.get("-defect_seed", defaults.defect_seed)))
    check_response(response)
    return response


def _config_from_state(state: CState) -> SimulationConfig:
    crystal = CrystalConfig(
        cell_A_deg=tuple(state.cell) if state.user_cell else None,
        mosflm_matrix=read_mosflm_matrix(state.mat) if state.mat else None,
        misset_deg=state.misset, misset_random=state.misset_random,
        misset_seed=state.misset_seed if state.misset_seed is not None else state.seed,
        n_cells=(state.Na, state.Nb, state.Nc), crystal_size_mm=tuple(state.sample_mm),
        shape=state.shape, fudge=state.fudge, mosaic_spread_deg=state.mosaic_deg,
        mosaic_domains=state.mosaic_domains, mosaic_seed=state.mosaic_seed, phi_start_deg=state.phi_deg,
        osc_range_deg=state.osc_deg, phi_step_deg=state.phistep_deg, phi_steps=state.phisteps)
    beam = BeamConfig(
        wavelength_A=state.lambda_A, dispersion_percent=state.dispersion_pct,
        dispersion_steps=state.dispsteps, hdiv_range_mrad=state.hdivrange,
        vdiv_range_mrad=state.vdivrange, hdiv_step_mrad=state.hdivstep, vdiv_step_mrad=state.vdivstep,
        hdiv_steps=state.hdivsteps, vdiv_steps=state.vdivsteps, round_divergence=state.round_div,
        sources=read_source_file(state.sourcefile) if state.sourcefile else None,
        kahn_polarization=state.polarization, no_polarization=state.nopolar,
        fluence_photons_per_m2=state.fluence, flux_photons_per_s=state.flux, exposure_s=state.exposure,
        beamsize_mm=state.beamsize_mm, water_thickness_um=state.water_um, dmin_A=state.dmin_A)
    vectors = state.vectors if state.convention == "custom" else {}
    detector = DetectorConfig(
        distance_mm=state.distance_mm, close_distance_mm=_nan_to_none(state.close_distance_mm),
        detsize_f_mm=state.detsize_f_mm, detsize_s_mm=state.detsize_s_mm, pixels_f=state.fpixels or None,
        pixels_s=state.spixels or None, pixel_size_mm=state.pixel_mm, convention=state.convention,
        pivot=state.pivot,
        beam_x_mm=_nan_to_none(state.Xbeam), beam_y_mm=_nan_to_none(state.Ybeam),
        close_x_mm=_nan_to_none(state.Xclose), close_y_mm=_nan_to_none(state.Yclose),
        orgx_px=_nan_to_none(state.ORGX), orgy_px=_nan_to_none(state.ORGY),
        twotheta_deg=state.twotheta_deg, rotation_deg=tuple(state.rot_deg),
        fdet_vector=vectors.get("fdet"), sdet_vector=vectors.get("sdet"), odet_vector=vectors.get("odet"),
        beam_vector=vectors.get("beam"), polar_vector=vectors.get("polar"), spindle_axis=vectors.get("spindle"),
        twotheta_axis=vectors.get("twotheta"), point_pixel=state.point_pixel, curved=state.curved,
        sensor_thickness_um=state.detector_thick_um, sensor_absorption_depth_um=state.absorption_depth_um,
        sensor_layers=state.thicksteps, oversample=state.oversample,
        oversample_thick=state.oversample_thick, oversample_polar=state.oversample_polar,
        oversample_omega=state.oversample_omega, roi=state.roi, mask_file=state.mask)
    structure = StructureFactorConfig(hkl_file=state.hkl, default_F=state.default_F,
                                      interpolate=state.interpolate)
    return SimulationConfig(crystal=crystal, beam=beam, detector=detector, structure=structure)


def _with_spectrum(config: SimulationConfig, path: str, wavelength_given: bool) -> SimulationConfig:
    """The -spectrumfile's channels, moved by the configuration's -spectrum_shift and -spectrum_stretch; the weighted
    mean wavelength of the channels rendered is the nominal one (nanoBragg's lambda0: a -mat matrix's scale, the
    automatic oversample, the headers) unless -lambda or -energy gives it."""
    spectrum = read_spectrum_file(path)
    config = config.with_options(spectrum=spectrum)
    check_spectrum(config.beam)
    if wavelength_given:
        return config
    beam = config.beam
    shifted = tuple(shifted_spectrum(spectrum, beam.spectrum_shift_eV, beam.spectrum_stretch))
    return config.with_options(wavelength_A=spectrum_mean_wavelength_A(shifted))


def _with_cell_from_file(config: SimulationConfig) -> SimulationConfig:
    """Without -cell and -mat, the cell of the -model or of an MTZ or mmCIF -hkl file (as nanoBragg would
    take it from -cell)."""
    if config.crystal.cell_A_deg is not None or config.crystal.mosflm_matrix is not None:
        return config
    if config.structure.hkl_file is None and config.structure.model_file is None:
        return config
    from ..io.inputs import structure_file_cell  # numpy and gemmi: only where a file may hold the cell

    cell = structure_file_cell(config)
    return config if cell is None else config.with_options(cell_A_deg=cell)


def _nan_to_none(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value
