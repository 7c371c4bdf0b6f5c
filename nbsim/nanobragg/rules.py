"""nanoBragg's own option matching, reproduced so that the same command line gives the same image.

The C tests every argument against every option by *substring*, in source order, so one argument can set
several options (`-printout_pixel` also turns on `-printout`, `-twotheta_axis` also sets the two-theta
angle from its first number, `-misset_seed` also sets misset angles from the three arguments after it; `-mosaic_seed`
and `-misset_seed` do not hold `-seed`, whose dash they lack, and leave the noise seed alone).
The result is the C's variables after parsing (`CState`), headers of -img and -mask included.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.text import HC_EV_A, c_atof, c_atoi
from .flags import NBSIM_ONLY


@dataclass(slots=True)
class CState:
    """nanoBragg's variables after argument parsing (units as the C keeps them after conversion). Slotted,
    so that a rule setting a misspelt variable fails at once instead of adding it."""

    Na: int = 1
    Nb: int = 1
    Nc: int = 1
    user_cell: bool = False
    cell: list[float] = field(default_factory=lambda: [0.0] * 6)
    misset: tuple[float, ...] | None = None
    misset_random: bool = False
    sample_mm: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    Xbeam: float = math.nan
    Ybeam: float = math.nan
    Xclose: float = math.nan
    Yclose: float = math.nan
    ORGX: float = math.nan
    ORGY: float = math.nan
    pivot: str = "beam"
    convention: str = "mosflm"
    vectors: dict[str, tuple[float, ...]] = field(default_factory=dict)
    distance_mm: float = 100.0
    close_distance_mm: float = math.nan
    absorption_depth_um: float | None = None
    detector_thick_um: float = 0.0
    thicksteps: int | None = None
    twotheta_deg: float = 0.0
    rot_deg: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    detsize_f_mm: float = 102.4
    detsize_s_mm: float = 102.4
    fpixels: int = 0
    spixels: int = 0
    curved: bool = False
    pixel_mm: float = 0.1
    point_pixel: bool = False
    polarization: float = 0.0
    nopolar: bool = False
    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    oversample: int | None = None
    roi: tuple[int, ...] | None = None
    lambda_A: float = 1.0
    fluence: float = 1.25932015286227e29
    flux: float = 0.0
    exposure: float = 1.0
    beamsize_mm: float = 0.1
    mosaic_deg: float | None = None
    mosaic_domains: int | None = None
    dispersion_pct: float = 0.0
    dispsteps: int | None = None
    hdivrange: float | None = None
    vdivrange: float | None = None
    hdivstep: float | None = None
    vdivstep: float | None = None
    hdivsteps: int | None = None
    vdivsteps: int | None = None
    round_div: bool = True
    adc: float = 40.0
    phi_deg: float = 0.0
    osc_deg: float | None = None
    phistep_deg: float | None = None
    phisteps: int | None = None
    dmin_A: float = 0.0
    mat: str | None = None
    hkl: str | None = None
    default_F: float = 0.0
    sourcefile: str | None = None
    floatfile: str | None = "floatimage.bin"
    intfile: str | None = "intimage.img"
    pgmfile: str | None = "image.pgm"
    noisefile: str | None = "noiseimage.img"
    write_pgm: bool = True
    calculate_noise: bool = True
    intfile_scale: float = 0.0
    pgm_scale: float = 0.0
    printout: bool = False
    printout_pixel: tuple[int, int] | None = None
    interpolate: bool | None = None
    shape: str = "square"
    fudge: float = 1.0
    seed: int | None = None
    mosaic_seed: int = 12345678
    misset_seed: int | None = None
    water_um: float = 0.0
    mask: str | None = None
    img: str | None = None


def _variable(key: str) -> str:
    """`key`, checked to be one of CState's variables (a rule naming another fails at import)."""
    if key not in CState.__dataclass_fields__:
        raise AttributeError(f"CState has no variable {key!r}")
    return key


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
    _variable(key)
    for k in extra or {}:
        _variable(k)

    def action(state: CState, args: list[str]) -> None:
        setattr(state, key, convert(args[0]) if convert is not None else args[0])
        for k, v in (extra or {}).items():
            setattr(state, k, v)
    return action


def _flag(**assignments: Any):
    for k in assignments:
        _variable(k)

    def action(state: CState, args: list[str]) -> None:
        for k, v in assignments.items():
            setattr(state, k, v)
    return action


def _vector(name: str):
    def action(state: CState, args: list[str]) -> None:
        state.convention = "custom"
        state.vectors[name] = tuple(c_atof(a) for a in args[:3])
    return action


def _energy_to_wavelength(energy_eV: float) -> float:
    return HC_EV_A / energy_eV if energy_eV != 0 else math.inf


def _cell(state: CState, args: list[str]) -> None:
    state.user_cell = True
    for j, token in enumerate(args[:6]):
        if token.startswith("-"):
            return
        state.cell[j] = c_atof(token)


def _misset_random(state: CState, args: list[str]) -> bool:
    if "rand" in args[0]:
        state.misset_random = True
        return True
    return False


def _misset_angles(state: CState, args: list[str]) -> None:
    state.misset_random = False
    state.misset = tuple(c_atof(a) for a in args[:3])


def _sample(axes: tuple[int, ...]):
    def action(state: CState, args: list[str]) -> None:
        for axis in axes:
            state.sample_mm[axis] = c_atof(args[0])
    return action


def _detector_abs(state: CState, args: list[str]) -> None:
    value = args[0] if args else ""
    if "inf" in value or c_atof(value) == 0.0:
        state.detector_thick_um = 0.0
        state.absorption_depth_um = math.inf
    else:
        state.absorption_depth_um = c_atof(value)


def _pivot(state: CState, args: list[str]) -> None:
    if "sample" in args[0]:
        state.pivot = "sample"
    if "beam" in args[0]:
        state.pivot = "beam"


def _roi(state: CState, args: list[str]) -> None:
    state.roi = tuple(c_atoi(a) for a in args[:4])


def _seed(key: str):
    _variable(key)

    def action(state: CState, args: list[str]) -> None:
        setattr(state, key, c_atoi(args[0]))
    return action


def _both(*keys: str, convert=c_atof):
    for key in keys:
        _variable(key)

    def action(state: CState, args: list[str]) -> None:
        for key in keys:
            setattr(state, key, convert(args[0]))
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
    (_sub("-detector_rotx"), 1, lambda s, a: s.rot_deg.__setitem__(0, c_atof(a[0])), False),
    (_sub("-detector_roty"), 1, lambda s, a: s.rot_deg.__setitem__(1, c_atof(a[0])), False),
    (_sub("-detector_rotz"), 1, lambda s, a: s.rot_deg.__setitem__(2, c_atof(a[0])), False),
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
    (_sub("-energy"), 1, lambda s, a: setattr(s, "lambda_A", _energy_to_wavelength(c_atof(a[0]))), False),
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
    (_sub("-printout_pixel"), 2, lambda s, a: setattr(s, "printout_pixel", (c_atoi(a[0]), c_atoi(a[1]))),
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
    state = CState()
    for position, arg in enumerate(argv[:-1]):
        for key in ("mask", "img"):
            if arg.startswith("-") and f"-{key}" in arg:
                setattr(state, key, argv[position + 1])
    for key in ("mask", "img"):
        if getattr(state, key) is not None:
            _apply_header(state, Path(getattr(state, key)), from_mask=key == "mask")
    argc = len(argv) + 1
    for position, arg in enumerate(argv):
        if not arg.startswith("-") or arg in NBSIM_ONLY:
            continue
        i = position + 1
        following = argv[position + 1:]
        for needed, action, stop in _rules_matching(arg):
            if not argc > i + needed - (1 if needed == 0 else 0):
                continue
            result = action(state, following)
            if stop is True or (stop == "conditional" and result):
                break
    return state


@functools.lru_cache(maxsize=4096)
def _rules_matching(arg: str) -> tuple[tuple[int, Any, bool | str], ...]:
    """The rules whose pattern matches `arg`, in source order: what an argument matches does not depend on
    where it stands, so a sweep parsing thousands of command lines of the same flags tests each flag once."""
    return tuple((needed, action, stop) for predicate, needed, action, stop in RULES if predicate(arg))


def _apply_header(state: CState, path: Path, from_mask: bool) -> None:
    """Detector values nanoBragg takes from an SMV header (the last match of each keyword wins)."""
    from ..io.images import read_smv_header

    header = read_smv_header(path)
    state.fpixels, state.spixels = header.pixel_counts(path)
    pixel = header.last_value("PIXEL_SIZE")
    if pixel is not None:
        state.pixel_mm = pixel
    state.detsize_f_mm = state.pixel_mm * state.fpixels
    state.detsize_s_mm = state.pixel_mm * state.spixels
    for keyword, key in (("DISTANCE", "distance_mm"), ("CLOSE_DISTANCE", "close_distance_mm"),
                         ("WAVELENGTH", "lambda_A"), ("BEAM_CENTER_X", "Xbeam"), ("ORGX", "ORGX"),
                         ("ORGY", "ORGY"), ("PHI", "phi_deg"), ("OSC_RANGE", "osc_deg")):
        value = header.last_value(keyword)
        if value is not None:
            setattr(state, _variable(key), value)
    beam_y = header.last_value("BEAM_CENTER_Y")
    if beam_y is not None:
        state.Ybeam = state.detsize_s_mm - beam_y if from_mask else beam_y
