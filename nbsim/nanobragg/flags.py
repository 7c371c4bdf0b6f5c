"""The flags nbsim accepts (nanoBragg's, plus -device, -dtype and -compile): the kinds of their values,
their limits and conflicts, and the strict validation that turns any mistake into a one-line error
(nanoBragg itself rejects nothing)."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import NbsimError, did_you_mean

NUM, INT, WORD, PATH = "number", "integer", "word", "file"

# name → tuple of value kinds. Special arities: -cell (6 numbers), -misset (random | 3 numbers).
FLAGS: dict[str, tuple[str, ...]] = {}


def _flags(kinds: tuple[str, ...], *names: str) -> None:
    for name in names:
        FLAGS[name] = kinds


_flags((NUM,), "-samplesize", "-sample_size", "-sample_thick", "-sample_x", "-sample_width", "-sample_y",
       "-sample_height", "-sample_z", "-xtalsize", "-xtal_size", "-xtal_thick", "-xtal_x", "-xtal_width",
       "-xtal_y", "-xtal_height", "-xtal_z", "-width", "-height", "-density", "-sample_density", "-MW",
       "-molecular_weight", "-fudge", "-mosaic", "-mosaicity", "-mosaic_spread", "-phi", "-osc", "-phistep",
       "-lambda", "-wave", "-wavelength", "-energy", "-dispersion", "-divergence", "-hdivrange", "-vdivrange",
       "-hdivstep", "-vdivstep", "-polar", "-fluence", "-flux", "-exposure", "-beamsize", "-water", "-dmin",
       "-default_F", "-distance", "-close_distance", "-detsize", "-detsize_f", "-detsize_s", "-pixel",
       "-twotheta", "-detector_rotx", "-detector_roty", "-detector_rotz", "-Xbeam", "-Ybeam", "-Xclose",
       "-Yclose", "-ORGX", "-ORGY", "-detector_thick", "-scale", "-pgmscale", "-adc")
_flags((INT,), "-N", "-Na", "-Nb", "-Nc", "-mosaic_domains", "-mosaic_dom", "-mosaic_seed", "-misset_seed",
       "-seed", "-phisteps", "-dispsteps", "-hdivsteps", "-vdivsteps", "-divsteps", "-detpixels",
       "-detpixels_f", "-detpixels_x", "-detpixels_s", "-detpixels_y", "-detector_thicksteps", "-thicksteps",
       "-oversample")
_flags((), "-square_xtal", "-round_xtal", "-gauss_xtal", "-tophat_spots", "-binary_spots", "-tophat_xtal",
       "-round_div", "-square_div", "-nopolar", "-interpolate", "-nointerpolate", "-point_pixel", "-curved_det",
       "-mosflm", "-xds", "-adxv", "-denzo", "-dials", "-oversample_thick", "-oversample_polar",
       "-oversample_omega", "-nonoise", "-nopgm", "-printout", "-noprogress", "-progress", "-coherent")
_flags((NUM, NUM, NUM), "-polar_vector", "-beam_vector", "-twotheta_axis", "-fdet_vector", "-sdet_vector",
       "-odet_vector", "-pix0_vector", "-spindle_axis")
_flags((PATH,), "-mat", "-hkl", "-sourcefile", "-mask", "-img", "-dump", "-stol", "-4stol", "-Q", "-stolout",
       "-floatfile", "-floatimage", "-intfile", "-intimage", "-pgmfile", "-pgmimage", "-noisefile",
       "-noiseimage", "-cbffile", "-nxmxfile")
_flags((INT, INT, INT, INT), "-roi")
_flags((INT, INT), "-printout_pixel")
_flags((WORD,), "-pivot", "-detector_abs", "-detector_absorb", "-device", "-dtype", "-compile", "-column")
_flags((PATH,), "-model", "-p1_out", "-spectrumfile")
_flags((NUM,), "-flicker", "-calibration", "-psf_fwhm", "-gain", "-readout_noise", "-beamstop", "-hot_pixels",
       "-dead_pixels")
_flags((INT,), "-calibration_seed", "-defect_seed")
_flags((WORD,), "-noise_generator", "-psf")
_flags((), "-nopoisson")
DETECTOR_FLAGS = ("-noise_generator", "-nopoisson", "-flicker", "-calibration", "-calibration_seed", "-psf",
                  "-psf_fwhm", "-gain", "-readout_noise", "-beamstop", "-hot_pixels", "-dead_pixels", "-defect_seed")
"""nbsim's detector effects (docs/detector.md): they change only the -noisefile image."""
_VARIABLE = ("-cell", "-misset")
MUST_BE_POSITIVE = {"-detpixels", "-detpixels_f", "-detpixels_x", "-detpixels_s", "-detpixels_y", "-pixel",
                    "-distance", "-close_distance", "-detsize", "-detsize_f", "-detsize_s", "-lambda", "-wave",
                    "-wavelength", "-energy", "-beamsize", "-exposure"}
MUST_NOT_BE_NEGATIVE = {"-N", "-Na", "-Nb", "-Nc", "-oversample", "-mosaic", "-mosaicity", "-mosaic_spread",
                        "-mosaic_domains", "-mosaic_dom", "-phisteps", "-dispersion", "-dispsteps", "-divergence",
                        "-hdivrange", "-vdivrange", "-hdivstep", "-vdivstep", "-hdivsteps", "-vdivsteps",
                        "-divsteps", "-detector_thick", "-detector_thicksteps", "-thicksteps", "-water", "-fluence",
                        "-flux", "-dmin", "-samplesize", "-sample_size", "-xtalsize", "-xtal_size", "-fudge",
                        "-osc", "-phistep", "-psf_fwhm", "-gain", "-readout_noise", "-beamstop"}
MUST_BE_FRACTION = {"-flicker", "-calibration", "-hot_pixels", "-dead_pixels"}
WAVELENGTH_FLAGS = ("-lambda", "-wave", "-wavelength", "-energy")
CONFLICTS = (
    {"-interpolate", "-nointerpolate"},
    {"-square_xtal", "-round_xtal", "-gauss_xtal", "-tophat_spots", "-binary_spots"},
    {"-round_div", "-square_div"},
    {"-nonoise", "-noisefile", "-noiseimage"},
    {"-nopgm", "-pgmfile", "-pgmimage", "-pgmscale"},
    {"-nopolar", "-polar"},
    set(WAVELENGTH_FLAGS),
    {"-fluence", "-flux"},
    {"-hkl", "-model"},
    {"-spectrumfile", "-sourcefile"},
    {"-spectrumfile", "-dispersion"},
)
NBSIM_ONLY = ("-device", "-dtype", "-compile", "-column", "-model", "-p1_out", "-cbffile", "-nxmxfile",
              "-spectrumfile", *DETECTOR_FLAGS)
NO_EFFECT = ("-density", "-sample_density", "-MW", "-molecular_weight", "-stol", "-4stol", "-Q", "-stolout",
             "-dump", "-coherent", "-printout", "-noprogress", "-progress")

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_INTEGER = re.compile(r"^[+-]?\d+$")
def validate(argv: list[str]) -> None:
    """Raise NbsimError for an unknown flag, a missing value or a malformed value."""
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag not in FLAGS and flag not in _VARIABLE:
            hint = " (values must follow their flag)" if not flag.startswith("-") else ""
            raise NbsimError(f"unknown option '{flag}'{hint}{did_you_mean(flag, [*FLAGS, *_VARIABLE])}; see nbsim -h")
        if flag == "-cell":
            count = 0
            while i + 1 + count < len(argv) and count < 6 and _NUMBER.match(argv[i + 1 + count]):
                count += 1
            if count < 6:
                raise NbsimError(f"-cell needs 6 numbers (a b c alpha beta gamma), got {count}")
            i += 1 + count
            continue
        if flag == "-misset":
            if i + 1 < len(argv) and argv[i + 1].startswith("rand"):
                i += 2
                continue
            kinds: tuple[str, ...] = (NUM, NUM, NUM)
        else:
            kinds = FLAGS[flag]
        values = argv[i + 1:i + 1 + len(kinds)]
        if len(values) < len(kinds):
            raise NbsimError(f"{flag} needs {len(kinds)} value(s), got {len(values)}")
        for kind, value in zip(kinds, values, strict=True):
            _check_value(flag, kind, value)
        if kinds and kinds[0] in (NUM, INT):
            number = float(values[0])
            if flag in MUST_BE_POSITIVE and not number > 0:
                raise NbsimError(f"{flag} must be positive (got {values[0]})")
            if flag in MUST_NOT_BE_NEGATIVE and number < 0:
                raise NbsimError(f"{flag} must not be negative (got {values[0]})")
            if flag in MUST_BE_FRACTION and not 0 <= number <= 1:
                raise NbsimError(f"{flag} must be a fraction between 0 and 1 (got {values[0]})")
        i += 1 + len(kinds)
    flags = {a for a in argv if a in FLAGS or a in _VARIABLE}
    for group in CONFLICTS:
        clash = sorted(group & flags)
        if len(clash) > 1:
            raise NbsimError(f"conflicting options {' and '.join(clash)}: give only one")


def _check_value(flag: str, kind: str, value: str) -> None:
    if kind == NUM and not _NUMBER.match(value):
        raise NbsimError(f"{flag} expects a number, got '{value}'")
    if kind == INT and not _INTEGER.match(value):
        raise NbsimError(f"{flag} expects an integer, got '{value}'")
    if kind == PATH and value.startswith("-") and value != "-":
        raise NbsimError(f"{flag} expects a file name, got '{value}'")
    if kind == WORD:
        allowed = {"-pivot": ("beam", "sample"), "-device": None, "-dtype": ("float32", "float64"),
                   "-compile": ("auto", "on", "off"), "-noise_generator": ("nanobragg", "philox"),
                   "-psf": ("none", "gaussian", "fiber")}.get(flag)
        if flag in ("-detector_abs", "-detector_absorb"):
            if not (_NUMBER.match(value) or value.startswith("inf")):
                raise NbsimError(f"{flag} expects an attenuation depth in um or 'inf', got '{value}'")
        elif allowed is not None and value not in allowed:
            raise NbsimError(f"{flag} expects one of {', '.join(allowed)}, got '{value}'")
        elif flag == "-device" and not re.match(r"^(cpu|cuda(:\d+)?)$", value):
            raise NbsimError(f"-device expects cpu or cuda[:N], got '{value}'")


def absolute_file_arguments(argv: list[str], base: Path) -> list[str]:
    """The arguments with every file value (after -hkl, -mat, ... ) made absolute against `base`."""
    result = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if FLAGS.get(arg) == (PATH,) and not Path(argv[i + 1]).is_absolute():
            result[i + 1] = str((base / argv[i + 1]).resolve())
    return result
