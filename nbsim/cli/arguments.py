"""nanoBragg command-line arguments → SimulationConfig and output options.

Two passes:

1. **Validation** against the documented flag list: every flag must be known and carry the right
   number of well-formed values, or the user gets a one-line error. nanoBragg itself never rejects
   anything.
2. **nanoBragg's own matching**: the C tests every argument against every option by *substring*, in
   source order, so one argument can set several options (`-mosaic_seed` also sets the noise `-seed`,
   `-twotheta_axis` also sets the two-theta angle from its first number, `-misset_seed` also sets misset
   angles from the three arguments after it). Those rules are reproduced here so that the same
   command line gives the same image.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import BeamConfig, CrystalConfig, DetectorConfig, SimulationConfig, StructureFactorConfig, check_cell
from ..errors import NbsimError
from ..io.text import c_atof, c_atoi

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
       "-noiseimage")
_flags((INT, INT, INT, INT), "-roi")
_flags((INT, INT), "-printout_pixel")
_flags((WORD,), "-pivot", "-detector_abs", "-detector_absorb", "-device", "-dtype", "-compile")
_VARIABLE = ("-cell", "-misset")
MUST_BE_POSITIVE = {"-detpixels", "-detpixels_f", "-detpixels_x", "-detpixels_s", "-detpixels_y", "-pixel",
                    "-distance", "-close_distance", "-detsize", "-detsize_f", "-detsize_s", "-lambda", "-wave",
                    "-wavelength", "-energy", "-beamsize", "-exposure"}
MUST_NOT_BE_NEGATIVE = {"-N", "-Na", "-Nb", "-Nc", "-oversample", "-mosaic", "-mosaicity", "-mosaic_spread",
                        "-mosaic_domains", "-mosaic_dom", "-phisteps", "-dispersion", "-dispsteps", "-divergence",
                        "-hdivrange", "-vdivrange", "-hdivstep", "-vdivstep", "-hdivsteps", "-vdivsteps",
                        "-divsteps", "-detector_thick", "-detector_thicksteps", "-thicksteps", "-water", "-fluence",
                        "-flux", "-dmin", "-samplesize", "-sample_size", "-xtalsize", "-xtal_size", "-fudge",
                        "-osc", "-phistep"}
CONFLICTS = (
    {"-interpolate", "-nointerpolate"},
    {"-square_xtal", "-round_xtal", "-gauss_xtal", "-tophat_spots", "-binary_spots"},
    {"-round_div", "-square_div"},
    {"-nonoise", "-noisefile", "-noiseimage"},
    {"-nopgm", "-pgmfile", "-pgmimage", "-pgmscale"},
    {"-nopolar", "-polar"},
    {"-lambda", "-wave", "-wavelength", "-energy"},
    {"-fluence", "-flux"},
)
NBSIM_ONLY = ("-device", "-dtype", "-compile")
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
            raise NbsimError(f"unknown option '{flag}'{hint}; see nbsim -h")
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
                   "-compile": ("auto", "on", "off")}.get(flag)
        if flag in ("-detector_abs", "-detector_absorb"):
            if not (_NUMBER.match(value) or value.startswith("inf")):
                raise NbsimError(f"{flag} expects an attenuation depth in um or 'inf', got '{value}'")
        elif allowed is not None and value not in allowed:
            raise NbsimError(f"{flag} expects one of {', '.join(allowed)}, got '{value}'")
        elif flag == "-device" and not re.match(r"^(cpu|cuda(:\d+)?)$", value):
            raise NbsimError(f"-device expects cpu or cuda[:N], got '{value}'")


@dataclass
class CState:
    """nanoBragg's variables after argument parsing (units as the C keeps them after conversion)."""

    values: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value


def _defaults() -> CState:
    nan = math.nan
    return CState(dict(
        Na=1, Nb=1, Nc=1, user_cell=False, cell=[0.0] * 6, misset=None, misset_random=False,
        sample_mm=[0.0, 0.0, 0.0], Xbeam=nan, Ybeam=nan, Xclose=nan, Yclose=nan, ORGX=nan, ORGY=nan,
        pivot="beam", convention="mosflm", vectors={}, distance_mm=100.0, close_distance_mm=nan,
        absorption_depth_um=None, detector_thick_um=0.0, thicksteps=None, twotheta_deg=0.0,
        rot_deg=[0.0, 0.0, 0.0], detsize_f_mm=102.4, detsize_s_mm=102.4, fpixels=0, spixels=0, curved=False,
        pixel_mm=0.1, point_pixel=False, polarization=0.0, nopolar=False, oversample_thick=False,
        oversample_polar=False, oversample_omega=False, oversample=None, roi=None, lambda_A=1.0,
        fluence=1.25932015286227e29, flux=0.0, exposure=1.0, beamsize_mm=0.1, mosaic_deg=None,
        mosaic_domains=None, dispersion_pct=0.0, dispsteps=None, hdivrange=None, vdivrange=None,
        hdivstep=None, vdivstep=None, hdivsteps=None, vdivsteps=None, round_div=True, adc=40.0, phi_deg=0.0,
        osc_deg=None, phistep_deg=None, phisteps=None, dmin_A=0.0, mat=None, hkl=None, default_F=0.0,
        sourcefile=None, floatfile="floatimage.bin", intfile="intimage.img", pgmfile="image.pgm",
        noisefile="noiseimage.img", write_pgm=True, calculate_noise=True, intfile_scale=0.0, pgm_scale=0.0,
        printout=False, printout_pixel=None, interpolate=None, shape="square", fudge=1.0, seed=None,
        mosaic_seed=12345678, misset_seed=None, water_um=0.0, mask=None, img=None))


Rule = tuple[Any, int, Any, bool | str]
"""(matches the argument, values it takes, action, stop: True, False or "conditional" — stop only when the
action returns True)."""


def _sub(pattern: str):
    return lambda arg: pattern in arg


def _any(*patterns: str):
    return lambda arg: any(p in arg for p in patterns)


def _exact(pattern: str):
    return lambda arg: arg == pattern


def _sub_len(pattern: str, length: int):
    return lambda arg: pattern in arg and len(arg) == length


def _set(key: str, convert=c_atof, extra: dict | None = None):
    def action(state: CState, args: list[str]) -> None:
        state[key] = convert(args[0]) if convert is not None else args[0]
        for k, v in (extra or {}).items():
            state[k] = v
    return action


def _flag(**assignments: Any):
    def action(state: CState, args: list[str]) -> None:
        for k, v in assignments.items():
            state[k] = v
    return action


def _vector(name: str):
    def action(state: CState, args: list[str]) -> None:
        state["convention"] = "custom"
        state["vectors"][name] = tuple(c_atof(a) for a in args[:3])
    return action


def _energy_to_wavelength(energy_eV: float) -> float:
    return 12398.42 / energy_eV if energy_eV != 0 else math.inf


def _cell(state: CState, args: list[str]) -> None:
    state["user_cell"] = True
    for j, token in enumerate(args[:6]):
        if token.startswith("-"):
            return
        state["cell"][j] = c_atof(token)


def _misset_random(state: CState, args: list[str]) -> bool:
    if "rand" in args[0]:
        state["misset_random"] = True
        return True
    return False


def _misset_angles(state: CState, args: list[str]) -> None:
    state["misset_random"] = False
    state["misset"] = tuple(c_atof(a) for a in args[:3])


def _sample(axes: tuple[int, ...]):
    def action(state: CState, args: list[str]) -> None:
        for axis in axes:
            state["sample_mm"][axis] = c_atof(args[0])
    return action


def _detector_abs(state: CState, args: list[str]) -> None:
    value = args[0] if args else ""
    if "inf" in value or c_atof(value) == 0.0:
        state["detector_thick_um"] = 0.0
        state["absorption_depth_um"] = math.inf
    else:
        state["absorption_depth_um"] = c_atof(value)


def _pivot(state: CState, args: list[str]) -> None:
    if "sample" in args[0]:
        state["pivot"] = "sample"
    if "beam" in args[0]:
        state["pivot"] = "beam"


def _roi(state: CState, args: list[str]) -> None:
    state["roi"] = tuple(c_atoi(a) for a in args[:4])


def _seed(key: str):
    def action(state: CState, args: list[str]) -> None:
        state[key] = c_atoi(args[0])
    return action


def _both(*keys: str, convert=c_atof):
    def action(state: CState, args: list[str]) -> None:
        for key in keys:
            state[key] = convert(args[0])
    return action


# (predicate, values needed after the flag, action, 'continue' after it) in nanoBragg's source order.
RULES: list[Rule] = [
    (_sub("-Na"), 1, _set("Na", c_atoi), True),
    (_sub("-Nb"), 1, _set("Nb", c_atoi), True),
    (_sub("-Nc"), 1, _set("Nc", c_atoi), True),
    (_exact("-N"), 1, _both("Na", "Nb", "Nc", convert=c_atoi), True),
    (_sub("-cell"), 1, _cell, False),
    (_sub("-misset"), 1, _misset_random, "conditional"),
    (_sub("-misset"), 3, _misset_angles, False),
    (_any("-samplesize", "-sample_size"), 1, _sample((0, 1, 2)), False),
    (_any("-sample_thick", "-sample_x"), 1, _sample((0,)), False),
    (_any("-sample_width", "-sample_y", "-width"), 1, _sample((1,)), False),
    (_any("-sample_heigh", "-sample_z", "-heigh"), 1, _sample((2,)), False),
    (_any("-xtalsize", "-xtal_size"), 1, _sample((0, 1, 2)), False),
    (_any("-xtal_thick", "-xtal_x"), 1, _sample((0,)), False),
    (_any("-xtal_width", "-xtal_y", "-width"), 1, _sample((1,)), False),
    (_any("-xtal_heigh", "-xtal_z", "-heigh"), 1, _sample((2,)), False),
    (_sub("-Xbeam"), 1, _set("Xbeam", extra={"pivot": "beam"}), False),
    (_sub("-Ybeam"), 1, _set("Ybeam", extra={"pivot": "beam"}), False),
    (_sub("-Xclose"), 1, _set("Xclose", extra={"pivot": "sample"}), False),
    (_sub("-Yclose"), 1, _set("Yclose", extra={"pivot": "sample"}), False),
    (_sub("-ORGX"), 1, _set("ORGX", extra={"pivot": "sample"}), False),
    (_sub("-ORGY"), 1, _set("ORGY", extra={"pivot": "sample"}), False),
    (_sub("-pivot"), 1, _pivot, False),
    (_sub("-mosflm"), 0, _flag(convention="mosflm", pivot="beam"), False),
    (_sub("-xds"), 0, _flag(convention="xds", pivot="sample"), False),
    (_sub("-adxv"), 0, _flag(convention="adxv", pivot="beam"), False),
    (_sub("-denzo"), 0, _flag(convention="denzo", pivot="beam"), False),
    (_sub("-dials"), 0, _flag(convention="dials", pivot="beam"), False),
    (_sub("-fdet_vector"), 3, _vector("fdet"), False),
    (_sub("-sdet_vector"), 3, _vector("sdet"), False),
    (_sub("-odet_vector"), 3, _vector("odet"), False),
    (_sub("-beam_vector"), 3, _vector("beam"), False),
    (_sub("-polar_vector"), 3, _vector("polar"), False),
    (_sub("-spindle_axis"), 3, _vector("spindle"), False),
    (_sub("-twotheta_axis"), 3, _vector("twotheta"), False),
    (_sub("-pix0_vector"), 3, _vector("pix0"), False),
    (_sub("-distance"), 1, _set("distance_mm", extra={"pivot": "beam"}), False),
    (_sub("-close_distance"), 1, _set("close_distance_mm", extra={"pivot": "sample"}), False),
    (_sub("-detector_abs"), 0, _detector_abs, False),
    (_sub_len("-detector_thick", 15), 0, _set("detector_thick_um"), False),
    (_sub("-detector_thicksteps"), 0, _set("thicksteps", c_atoi), False),
    (_sub("-thicksteps"), 0, _set("thicksteps", c_atoi), False),
    (_sub("-twotheta"), 1, _set("twotheta_deg", extra={"pivot": "sample"}), False),
    (_sub("-detector_rotx"), 1, lambda s, a: s["rot_deg"].__setitem__(0, c_atof(a[0])), False),
    (_sub("-detector_roty"), 1, lambda s, a: s["rot_deg"].__setitem__(1, c_atof(a[0])), False),
    (_sub("-detector_rotz"), 1, lambda s, a: s["rot_deg"].__setitem__(2, c_atof(a[0])), False),
    (_sub_len("-detsize", 8), 1, _both("detsize_f_mm", "detsize_s_mm"), False),
    (_sub("-detsize_f"), 1, _set("detsize_f_mm"), False),
    (_sub("-detsize_s"), 1, _set("detsize_s_mm"), False),
    (_sub_len("-detpixels", 10), 1, _both("fpixels", "spixels", convert=c_atoi), False),
    (_any("-detpixels_f", "-detpixels_x"), 1, _set("fpixels", c_atoi), False),
    (_any("-detpixels_s", "-detpixels_y"), 1, _set("spixels", c_atoi), False),
    (_sub("-curved_det"), 1, _flag(curved=True), False),
    (_sub("-pixel"), 1, _set("pixel_mm"), False),
    (_sub("-point_pixel"), 0, _flag(point_pixel=True), False),
    (_sub_len("-polar", 6), 1, _set("polarization", extra={"nopolar": False}), False),
    (_sub("-nopolar"), 0, _flag(nopolar=True), False),
    (_sub("-oversample_thick"), 0, _flag(oversample_thick=True), True),
    (_sub("-oversample_polar"), 0, _flag(oversample_polar=True), True),
    (_sub("-oversample_omega"), 0, _flag(oversample_omega=True), True),
    (_sub("-oversample"), 1, _set("oversample", c_atoi), False),
    (_sub("-roi"), 4, _roi, False),
    (_any("-lambda", "-wave"), 1, _set("lambda_A"), False),
    (_sub("-energy"), 1, lambda s, a: s.__setitem__("lambda_A", _energy_to_wavelength(c_atof(a[0]))), False),
    (_sub("-fluence"), 1, _set("fluence"), False),
    (_sub("-flux"), 1, _set("flux"), False),
    (_sub("-exposure"), 1, _set("exposure"), False),
    (_sub("-beamsize"), 1, _set("beamsize_mm"), False),
    (lambda arg: ("-mosaic" in arg and len(arg) == 7) or "-mosaici" in arg or "-mosaic_spr" in arg, 1,
     _set("mosaic_deg"), False),
    (_sub("-mosaic_dom"), 1, _set("mosaic_domains", c_atoi), False),
    (_sub("-dispersion"), 1, _set("dispersion_pct"), False),
    (_sub("-dispsteps"), 1, _set("dispsteps", c_atoi), False),
    (_sub("-divergence"), 1, _both("hdivrange", "vdivrange"), False),
    (_sub("-hdivrange"), 1, _set("hdivrange"), False),
    (_sub("-vdivrange"), 1, _set("vdivrange"), False),
    (_sub_len("-hdivstep", 9), 1, _set("hdivstep"), False),
    (_sub("-hdivsteps"), 1, _set("hdivsteps", c_atoi), False),
    (_sub_len("-vdivstep", 9), 1, _set("vdivstep"), False),
    (_sub("-vdivsteps"), 1, _set("vdivsteps", c_atoi), False),
    (_sub("-divsteps"), 1, _both("hdivsteps", "vdivsteps", convert=c_atoi), False),
    (_sub("-round_div"), 0, _flag(round_div=True), False),
    (_sub("-square_div"), 0, _flag(round_div=False), False),
    (_sub("-adc"), 1, _set("adc"), False),
    (_sub_len("-phi", 4), 1, _set("phi_deg"), False),
    (_sub("-osc"), 1, _set("osc_deg"), False),
    (_sub_len("-phistep", 8), 1, _set("phistep_deg"), False),
    (_sub("-phisteps"), 1, _set("phisteps", c_atoi), False),
    (_sub("-dmin"), 1, _set("dmin_A"), False),
    (_sub("-mat"), 1, _set("mat", None), False),
    (_sub("-hkl"), 1, _set("hkl", None), False),
    (_sub("-default_F"), 1, _set("default_F"), False),
    (_sub("-img"), 1, _set("img", None), False),
    (_sub("-sourcefile"), 1, _set("sourcefile", None), False),
    (_any("-floatfile", "-floatimage"), 1, _set("floatfile", None), False),
    (_any("-intfile", "-intimage"), 1, _set("intfile", None), False),
    (_any("-pgmfile", "-pgmimage"), 1, _set("pgmfile", None, extra={"write_pgm": True}), False),
    (_any("-noisefile", "-noiseimage"), 1, _set("noisefile", None, extra={"calculate_noise": True}), False),
    (_sub("-nonoise"), 0, _flag(calculate_noise=False), False),
    (_sub("-nopgm"), 0, _flag(write_pgm=False), False),
    (_sub("-scale"), 1, _set("intfile_scale"), False),
    (_sub("-pgmscale"), 1, _set("pgm_scale", extra={"write_pgm": True}), False),
    (_sub("-printout"), 0, _flag(printout=True), False),
    (_sub("-interpolate"), 0, _flag(interpolate=True), False),
    (_sub("-nointerpolate"), 0, _flag(interpolate=False), False),
    (_sub("-round_xtal"), 0, _flag(shape="round"), False),
    (_sub("-square_xtal"), 0, _flag(shape="square"), False),
    (_sub("-gauss_xtal"), 0, _flag(shape="gauss"), False),
    (_any("-binary_spots", "-tophat_spots"), 0, _flag(shape="tophat"), False),
    (_sub("-fudge"), 1, _set("fudge"), False),
    (_sub("-printout_pixel"), 2, lambda s, a: s.__setitem__("printout_pixel", (c_atoi(a[0]), c_atoi(a[1]))),
     False),
    (_sub("-seed"), 1, _seed("seed"), False),
    (_sub("-mosaic_seed"), 1, _seed("mosaic_seed"), False),
    (_sub("-misset_seed"), 1, _seed("misset_seed"), False),
    (_sub("-water"), 1, _set("water_um"), False),
]


def run_nanobragg_rules(argv: list[str]) -> CState:
    """nanoBragg's option matching: every rule tested against every '-' argument, in C source order.

    Like the C, headers of -mask and -img files are read first and the flags then override them.
    """
    state = _defaults()
    for position, arg in enumerate(argv[:-1]):
        for key in ("mask", "img"):
            if arg.startswith("-") and f"-{key}" in arg:
                state[key] = argv[position + 1]
    for key in ("mask", "img"):
        if state[key] is not None:
            _apply_header(state, Path(state[key]), from_mask=key == "mask")
    argc = len(argv) + 1
    for position, arg in enumerate(argv):
        if not arg.startswith("-") or arg in NBSIM_ONLY:
            continue
        i = position + 1
        following = argv[position + 1:]
        for predicate, needed, action, stop in RULES:
            if not predicate(arg) or not argc > i + needed - (1 if needed == 0 else 0):
                continue
            result = action(state, following)
            if stop is True or (stop == "conditional" and result):
                break
    return state


def _apply_header(state: CState, path: Path, from_mask: bool) -> None:
    """Detector values nanoBragg takes from an SMV header (the last match of each keyword wins)."""
    from ..io.images import read_smv_header

    header = read_smv_header(path)
    width, height = header.last_value("SIZE1"), header.last_value("SIZE2")
    if width is None or height is None:
        raise NbsimError(f"{path}: SMV header has no SIZE1/SIZE2")
    state["fpixels"], state["spixels"] = int(width), int(height)
    pixel = header.last_value("PIXEL_SIZE")
    if pixel is not None:
        state["pixel_mm"] = pixel
    state["detsize_f_mm"] = state["pixel_mm"] * state["fpixels"]
    state["detsize_s_mm"] = state["pixel_mm"] * state["spixels"]
    for keyword, key in (("DISTANCE", "distance_mm"), ("CLOSE_DISTANCE", "close_distance_mm"),
                         ("WAVELENGTH", "lambda_A"), ("BEAM_CENTER_X", "Xbeam"), ("ORGX", "ORGX"),
                         ("ORGY", "ORGY"), ("PHI", "phi_deg"), ("OSC_RANGE", "osc_deg")):
        value = header.last_value(keyword)
        if value is not None:
            state[key] = value
    beam_y = header.last_value("BEAM_CENTER_Y")
    if beam_y is not None:
        state["Ybeam"] = state["detsize_s_mm"] - beam_y if from_mask else beam_y


@dataclass
class RunOptions:
    """What the CLI writes and how it computes, besides the physics."""

    floatfile: str | None
    intfile: str | None
    pgmfile: str | None
    noisefile: str | None
    intfile_scale: float
    pgm_scale: float
    adc: float
    seed: int
    printout_pixel: tuple[int, int] | None
    device: str = "cpu"
    dtype: str = "float32"
    compile: str = "auto"
    """"auto" (compile when the kernel is cached or building it pays), "on" or "off"."""
    notes: list[str] = field(default_factory=list)


def parse(argv: list[str]) -> tuple[SimulationConfig, RunOptions]:
    """Validate nanoBragg-style arguments and turn them into a configuration and output options."""
    validate(argv)
    state = run_nanobragg_rules(argv)
    nbsim_options = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i] in NBSIM_ONLY}
    config = _config_from_state(state)
    if config.crystal.cell_A_deg is not None:
        check_cell(config.crystal.cell_A_deg)
    notes = [f"{flag} has no effect on the image (accepted for nanoBragg compatibility)"
             for flag in NO_EFFECT if flag in argv]
    if "-tophat_xtal" in argv and state["shape"] != "tophat":
        notes.append("-tophat_xtal is not a nanoBragg option and nanoBragg ignores it (shape stays "
                     f"{state['shape']}); use -tophat_spots for flat-topped spots")
    if "vectors" in state.values and "pix0" in state["vectors"]:
        notes.append("-pix0_vector selects the custom convention; as in nanoBragg its value is then recomputed "
                     "from the beam centre and pivot")
    seed = state["seed"] if state["seed"] is not None else int(time.time())
    run = RunOptions(
        floatfile=state["floatfile"], intfile=state["intfile"],
        pgmfile=state["pgmfile"] if state["write_pgm"] else None,
        noisefile=state["noisefile"] if state["calculate_noise"] else None,
        intfile_scale=state["intfile_scale"], pgm_scale=state["pgm_scale"], adc=state["adc"], seed=seed,
        printout_pixel=state["printout_pixel"], device=nbsim_options.get("-device", "cpu"),
        dtype=nbsim_options.get("-dtype", "float32"), compile=nbsim_options.get("-compile", "auto"),
        notes=notes)
    return config, run


def _config_from_state(state: CState) -> SimulationConfig:
    nan_to_none = _nan_to_none
    crystal = CrystalConfig(
        cell_A_deg=tuple(state["cell"]) if state["user_cell"] else None,
        mosflm_matrix_file=state["mat"],
        misset_deg=state["misset"], misset_random=state["misset_random"],
        misset_seed=state["misset_seed"] if state["misset_seed"] is not None else state["seed"],
        n_cells=(state["Na"], state["Nb"], state["Nc"]), crystal_size_mm=tuple(state["sample_mm"]),
        shape=state["shape"], fudge=state["fudge"], mosaic_spread_deg=state["mosaic_deg"],
        mosaic_domains=state["mosaic_domains"], mosaic_seed=state["mosaic_seed"], phi_start_deg=state["phi_deg"],
        osc_range_deg=state["osc_deg"], phi_step_deg=state["phistep_deg"], phi_steps=state["phisteps"])
    beam = BeamConfig(
        wavelength_A=state["lambda_A"], dispersion_percent=state["dispersion_pct"],
        dispersion_steps=state["dispsteps"], hdiv_range_mrad=state["hdivrange"],
        vdiv_range_mrad=state["vdivrange"], hdiv_step_mrad=state["hdivstep"], vdiv_step_mrad=state["vdivstep"],
        hdiv_steps=state["hdivsteps"], vdiv_steps=state["vdivsteps"], round_divergence=state["round_div"],
        source_file=state["sourcefile"],
        kahn_polarization=state["polarization"], no_polarization=state["nopolar"],
        fluence_photons_per_m2=state["fluence"], flux_photons_per_s=state["flux"], exposure_s=state["exposure"],
        beamsize_mm=state["beamsize_mm"], water_thickness_um=state["water_um"], dmin_A=state["dmin_A"])
    vectors = state["vectors"] if state["convention"] == "custom" else {}
    detector = DetectorConfig(
        distance_mm=state["distance_mm"], close_distance_mm=nan_to_none(state["close_distance_mm"]),
        detsize_f_mm=state["detsize_f_mm"], detsize_s_mm=state["detsize_s_mm"], pixels_f=state["fpixels"] or None,
        pixels_s=state["spixels"] or None, pixel_size_mm=state["pixel_mm"], convention=state["convention"],
        pivot=state["pivot"],
        beam_x_mm=nan_to_none(state["Xbeam"]), beam_y_mm=nan_to_none(state["Ybeam"]),
        close_x_mm=nan_to_none(state["Xclose"]), close_y_mm=nan_to_none(state["Yclose"]),
        orgx_px=nan_to_none(state["ORGX"]), orgy_px=nan_to_none(state["ORGY"]),
        twotheta_deg=state["twotheta_deg"], rotation_deg=tuple(state["rot_deg"]),
        fdet_vector=vectors.get("fdet"), sdet_vector=vectors.get("sdet"), odet_vector=vectors.get("odet"),
        beam_vector=vectors.get("beam"), polar_vector=vectors.get("polar"), spindle_axis=vectors.get("spindle"),
        twotheta_axis=vectors.get("twotheta"), point_pixel=state["point_pixel"], curved=state["curved"],
        sensor_thickness_um=state["detector_thick_um"], sensor_absorption_depth_um=state["absorption_depth_um"],
        sensor_layers=state["thicksteps"], oversample=state["oversample"],
        oversample_thick=state["oversample_thick"], oversample_polar=state["oversample_polar"],
        oversample_omega=state["oversample_omega"], roi=state["roi"], mask_file=state["mask"])
    structure = StructureFactorConfig(hkl_file=state["hkl"], default_F=state["default_F"],
                                      interpolate=state["interpolate"])
    return SimulationConfig(crystal=crystal, beam=beam, detector=detector, structure=structure)


def _nan_to_none(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def absolute_file_arguments(argv: list[str], base: Path) -> list[str]:
    """The arguments with every file value (after -hkl, -mat, ... ) made absolute against `base`."""
    result = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if FLAGS.get(arg) == (PATH,) and not Path(argv[i + 1]).is_absolute():
            result[i + 1] = str((base / argv[i + 1]).resolve())
    return result
