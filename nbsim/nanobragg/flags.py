"""The flags nbsim accepts (nanoBragg's, plus nbsim's own): one literal table (`TABLE`, a `Flag` per
flag and its aliases, with its group, the kinds of its values, what it sets with units, and its default) from
which `nbsim -h` and every list here are derived; their limits and conflicts, and the strict validation
that turns any mistake into a one-line error (nanoBragg itself rejects nothing)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import NbsimError, did_you_mean
from ..sensors import MATERIALS

NUM, INT, WORD, PATH = "number", "integer", "word", "file"
VARIABLE = None
"""The kinds of -cell (6 numbers) and -misset (random | 3 numbers), which validate() reads itself."""


@dataclass(frozen=True)
class Flag:
    """One line of `nbsim -h`: its group, a flag and its aliases, the kinds of its values, what it sets (with
    units) and its default ('' for a switch, which is off unless given)."""

    group: str
    spellings: str
    """The flag and its aliases, separated by spaces."""
    kinds: tuple[str, ...] | None
    values: str
    text: str
    default: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """The flag and its aliases."""
        return tuple(self.spellings.split())


GROUPS = ("crystal", "beam", "detector", "sampling", "outputs", "nbsim's own",
          "nbsim's detector response (the -noisefile image; docs/detector.md)", "accepted, no effect in nbsim")
CRYSTAL, BEAM, DETECTOR, SAMPLING, OUTPUTS, NBSIM, RESPONSE, IGNORED = GROUPS
N1, I1, P1, V3 = (NUM,), (INT,), (PATH,), (NUM, NUM, NUM)
"""The kinds of one number, one integer, one file and three numbers."""

TABLE: tuple[Flag, ...] = (
    Flag(CRYSTAL, "-cell", VARIABLE, "A B C AL BE GA",
         "unit cell: lengths in Å, angles in degrees", "from -mat, -hkl or -model"),
    Flag(CRYSTAL, "-mat", P1, "FILE", "MOSFLM orientation matrix: three reciprocal cell vectors times λ, Å⁻¹", "none"),
    Flag(CRYSTAL, "-misset", VARIABLE, "X Y Z|random", "crystal rotations about x, y, z, degrees, or a random "
         "orientation", "0 0 0"),
    Flag(CRYSTAL, "-misset_seed", I1, "N", "random-number seed of -misset random", "-seed"),
    Flag(CRYSTAL, "-hkl", P1, "FILE", "structure factors: h k l F text, MTZ or sf-mmCIF table (P1-expanded)", "none"),
    Flag(CRYSTAL, "-default_F", N1, "F", "structure factor of every reflection not in -hkl, electrons", "0"),
    Flag(CRYSTAL, "-N", I1, "N", "unit cells along a, b and c", "1"),
    Flag(CRYSTAL, "-Na -Nb -Nc", I1, "N", "unit cells along one axis", "1"),
    Flag(CRYSTAL, "-xtalsize -xtal_size -samplesize -sample_size", N1, "MM", "crystal full width along a, b and c, mm "
         "(sets -N)", "0: use -N"),
    Flag(CRYSTAL, "-xtal_thick -xtal_x -sample_thick -sample_x", N1, "MM", "crystal width along a, mm (sets -Na)", "0"),
    Flag(CRYSTAL, "-xtal_width -xtal_y -sample_width -sample_y -width", N1, "MM",
         "crystal width along b, mm (sets -Nb)", "0"),
    Flag(CRYSTAL, "-xtal_height -xtal_z -sample_height -sample_z -height", N1, "MM", "crystal width along c, mm (sets "
         "-Nc)", "0"),
    Flag(CRYSTAL, "-square_xtal", (), "", "parallelepiped crystal: sinc-shaped spots (the default shape)"),
    Flag(CRYSTAL, "-round_xtal", (), "", "ellipsoidal crystal"),
    Flag(CRYSTAL, "-gauss_xtal", (), "", "Gaussian spots, no inter-Bragg maxima"),
    Flag(CRYSTAL, "-tophat_spots -binary_spots", (), "", "spots clipped at their FWHM, no inter-Bragg maxima"),
    Flag(CRYSTAL, "-tophat_xtal", (), "",
         "not a nanoBragg option: ignored as nanoBragg ignores it (use -tophat_spots)"),
    Flag(CRYSTAL, "-fudge", N1, "X", "scale of the spot shape's width", "1"),
    Flag(CRYSTAL, "-mosaic -mosaicity -mosaic_spread", N1, "DEG", "isotropic mosaic spread, degrees (90: powder)", "0"),
    Flag(CRYSTAL, "-phi", N1, "DEG", "starting rotation about the spindle axis, degrees", "0"),
    Flag(CRYSTAL, "-osc", N1, "DEG", "rotation range about the spindle axis, degrees", "-phistep × -phisteps"),
    Flag(CRYSTAL, "-spindle_axis", V3, "X Y Z", "unit vector of the right-handed phi rotation axis", "by convention"),
    Flag(CRYSTAL, "-water", N1, "UM", "water around the crystal (background), µm", "0"),
    Flag(BEAM, "-lambda -wave -wavelength", N1, "Å", "X-ray wavelength, Å", "1"),
    Flag(BEAM, "-energy", N1, "EV", "X-ray photon energy, eV (instead of -lambda)", "12398.42"),
    Flag(BEAM, "-dispersion", N1, "PCT", "spectral width Δλ/λ, percent", "0"),
    Flag(BEAM, "-divergence", N1, "MRAD", "beam divergence, horizontal and vertical, mrad", "0"),
    Flag(BEAM, "-hdivrange -vdivrange", N1, "MRAD", "horizontal or vertical beam divergence, mrad", "0"),
    Flag(BEAM, "-sourcefile", P1, "FILE", "sources, one a line: position X Y Z (m), weight, λ (m)", "none"),
    Flag(BEAM, "-polar", N1, "K", "Kahn polarization factor", "0"),
    Flag(BEAM, "-nopolar", (), "", "no polarization correction"),
    Flag(BEAM, "-polar_vector", V3, "X Y Z", "unit vector of the X-ray E-vector", "by convention"),
    Flag(BEAM, "-beam_vector", V3, "X Y Z", "unit vector of the X-ray beam direction", "by convention"),
    Flag(BEAM, "-fluence", N1, "PH/M2", "incident photons per m²", "1.26e29"),
    Flag(BEAM, "-flux", N1, "PH/S", "incident photons per second (fluence from -flux, -exposure, -beamsize)", "0"),
    Flag(BEAM, "-exposure", N1, "S", "exposure time with -flux, s", "1"),
    Flag(BEAM, "-beamsize", N1, "MM", "beam width with -flux, mm", "0.1"),
    Flag(DETECTOR, "-distance", N1, "MM", "distance from the sample to the detector, mm", "100"),
    Flag(DETECTOR, "-close_distance", N1, "MM", "distance from the sample to the detector plane, mm", "from -distance"),
    Flag(DETECTOR, "-detsize", N1, "MM", "detector width and height, mm", "102.4"),
    Flag(DETECTOR, "-detsize_f -detsize_s", N1, "MM", "detector width along fast or slow, mm", "102.4"),
    Flag(DETECTOR, "-detpixels", I1, "N", "detector width and height, pixels", "-detsize / -pixel"),
    Flag(DETECTOR, "-detpixels_f -detpixels_x -detpixels_s -detpixels_y", I1, "N",
         "pixels along fast (x) or slow (y)", "-detsize / -pixel"),
    Flag(DETECTOR, "-pixel", N1, "MM", "pixel size, mm", "0.1"),
    Flag(DETECTOR, "-Xbeam -Ybeam", N1, "MM",
         "direct-beam position on the detector, fast (X) and slow (Y), mm", "centre"),
    Flag(DETECTOR, "-Xclose -Yclose", N1, "MM",
         "position of the point of the detector closest to the sample, mm", "centre"),
    Flag(DETECTOR, "-ORGX -ORGY", N1, "PX", "XDS-convention beam centre, pixels", "centre"),
    Flag(DETECTOR, "-mosflm -denzo -adxv -xds -dials", (), "", "detector convention of the beam centre and axes "
         "(default -mosflm)"),
    Flag(DETECTOR, "-pivot", (WORD,), "beam|sample", "what stays put when the detector turns", "by convention"),
    Flag(DETECTOR, "-twotheta", N1, "DEG", "detector rotation about the two-theta axis, degrees", "0"),
    Flag(DETECTOR, "-twotheta_axis", V3, "X Y Z", "unit vector of the two-theta axis", "by convention"),
    Flag(DETECTOR, "-detector_rotx -detector_roty -detector_rotz", N1, "DEG", "detector rotation about x, y or z, "
         "degrees", "0"),
    Flag(DETECTOR, "-fdet_vector -sdet_vector", V3, "X Y Z",
         "unit vector of increasing fast or slow pixel index", "by convention"),
    Flag(DETECTOR, "-odet_vector", V3, "X Y Z", "unit vector of increasing detector distance", "by convention"),
    Flag(DETECTOR, "-pix0_vector", V3, "X Y Z", "vector from the sample to the first pixel, m", "beam on the centre"),
    Flag(DETECTOR, "-pix0_vector_mm", V3, "X Y Z", "the same in mm; nanoBragg reads metres and recomputes it, "
         "-physics corrected places the detector there", "beam on the centre"),
    Flag(DETECTOR, "-curved_det", (), "", "every pixel at the same distance from the sample"),
    Flag(DETECTOR, "-point_pixel", (), "", "no pixel solid-angle correction (obliquity and 1/r²)"),
    Flag(DETECTOR, "-detector_thick", N1, "UM", "sensor thickness, µm", "0"),
    Flag(DETECTOR, "-detector_abs -detector_absorb", (WORD,), "UM|inf", "sensor attenuation depth, µm",
         "the thickness (nanoBragg's); the material's at λ with -sensor_material, -detector_model or -physics "
         "corrected"),
    Flag(DETECTOR, "-img", P1, "FILE", "take the detector's values from an SMV image's header", "none"),
    Flag(DETECTOR, "-mask", P1, "FILE", "SMV image: pixels of value 0 are not rendered", "none"),
    Flag(SAMPLING, "-oversample", I1, "N", "sub-pixels per pixel side", "auto: from crystal size and pixel"),
    Flag(SAMPLING, "-oversample_thick -oversample_polar -oversample_omega", (), "", "sensor absorption, polarization "
         "or solid angle per sub-pixel (default: per pixel)"),
    Flag(SAMPLING, "-mosaic_domains -mosaic_dom", I1, "N", "mosaic domains", "10 with -mosaic, else 1"),
    Flag(SAMPLING, "-mosaic_seed", I1, "N", "random-number seed of the mosaic domains", "12345678"),
    Flag(SAMPLING, "-phisteps", I1, "N", "rotation steps over -osc", "1"),
    Flag(SAMPLING, "-phistep", N1, "DEG", "rotation step, degrees", "-osc / -phisteps"),
    Flag(SAMPLING, "-dispsteps", I1, "N", "wavelengths over -dispersion", "auto"),
    Flag(SAMPLING, "-hdivsteps -vdivsteps -divsteps", I1, "N", "source points across the horizontal, vertical or both "
         "divergences", "auto"),
    Flag(SAMPLING, "-hdivstep -vdivstep", N1, "MRAD", "angle between source points, mrad", "auto"),
    Flag(SAMPLING, "-round_div", (), "", "divergence grid with its corners cut off (the default)"),
    Flag(SAMPLING, "-square_div", (), "", "full divergence grid"),
    Flag(SAMPLING, "-detector_thicksteps -thicksteps", I1, "N", "sensor layers", "1"),
    Flag(SAMPLING, "-interpolate -nointerpolate", (), "", "force or forbid tricubic interpolation of F between "
         "reflections (default: on when -N, -Na, -Nb or -Nc gives under 3 cells, or is not given)"),
    Flag(SAMPLING, "-dmin", N1, "Å", "resolution limit: nothing beyond it is rendered, Å", "0: no limit"),
    Flag(SAMPLING, "-roi", (INT, INT, INT, INT), "XMIN XMAX YMIN YMAX",
         "render only these pixels", "the whole detector"),
    Flag(OUTPUTS, "-floatfile -floatimage", P1, "FILE", "image as raw 4-byte floats", "floatimage.bin"),
    Flag(OUTPUTS, "-intfile -intimage", P1, "FILE", "noiseless SMV image", "intimage.img"),
    Flag(OUTPUTS, "-scale", N1, "X", "scale of -intfile", "auto"),
    Flag(OUTPUTS, "-adc", N1, "N", "offset added to the -intfile and -noisefile pixels", "40"),
    Flag(OUTPUTS, "-noisefile -noiseimage", P1, "FILE", "SMV detector image: nanoBragg's Poisson noise and the "
         "detector response below (with -panelfile: NXmx, one module per panel)", "noiseimage.img"),
    Flag(OUTPUTS, "-nonoise", (), "", "no -noisefile"),
    Flag(OUTPUTS, "-seed", I1, "N", "random-number seed of the noise", "the time"),
    Flag(OUTPUTS, "-pgmfile -pgmimage", P1, "FILE", "8-bit PGM image", "image.pgm"),
    Flag(OUTPUTS, "-pgmscale", N1, "X", "relative scale of -pgmfile", "auto"),
    Flag(OUTPUTS, "-nopgm", (), "", "no -pgmfile"),
    Flag(OUTPUTS, "-printout_pixel", (INT, INT), "F S", "print this pixel's value (fast, slow index)", "none"),
    Flag(NBSIM, "-device", (WORD,), "cpu|cuda[:N]", "where to render", "cpu"),
    Flag(NBSIM, "-dtype", (WORD,), "float32|float64",
         "precision of the rendering", "float64 when -noisefile is nanoBragg's, else float32"),
    Flag(NBSIM, "-compile", (WORD,), "auto|on|off", "compiled kernel: when cached or quicker, always, never", "auto"),
    Flag(NBSIM, "-model", P1, "FILE", "atomic model (PDB or mmCIF): its |F| instead of -hkl", "none"),
    Flag(NBSIM, "-column", (WORD,), "LABEL",
         "the amplitude column of an MTZ or sf-mmCIF -hkl", "the first amplitude, else intensity"),
    Flag(NBSIM, "-p1_out", P1, "FILE", "write the P1 table used as h k l F text", "none"),
    Flag(NBSIM, "-cbffile", P1, "FILE", "miniCBF of the counts, with the geometry (docs/formats.md)", "none"),
    Flag(NBSIM, "-nxmxfile", P1, "FILE", "NeXus NXmx HDF5 of the counts, with the geometry", "none"),
    Flag(NBSIM, "-spectrumfile", P1, "FILE", "weighted spectrum, one channel a line: wavelength (Å) or energy (eV, "
         "header energy_eV) and weight; the image is the weighted sum (docs/physics.md)", "one wavelength"),
    Flag(NBSIM, "-spectrum_shift", N1, "EV", "eV added to every -spectrumfile channel's energy (what nbsim fit "
         "--refine spectrum reports)", "0"),
    Flag(NBSIM, "-spectrum_stretch", N1, "S", "each -spectrumfile channel's energy moved from the weighted mean "
         "energy by S times its offset (with the shift: E' = mean + shift + S (E - mean))", "1"),
    Flag(NBSIM, "-panelfile", P1, "FILE", "multi-panel detector: nbsim's YAML panel list or a CrystFEL .geom file "
         "(docs/formats.md)", "one panel"),
    Flag(NBSIM, "-sensor_material", (WORD,), "Si|CdTe", "sensor material: with -detector_thick and no -detector_abs, "
         "the attenuation depth is its NIST attenuation length at λ (silicon's under -physics corrected; "
         "docs/detector.md)", "Si"),
    Flag(NBSIM, "-detector_model", (WORD,), "NAME", "a real detector's pixels, modules, sensor, point spread, "
         "pedestal and saturation; the flags given override them (docs/detector.md lists the models)", "none"),
    Flag(NBSIM, "-module_size", (INT, INT), "F S", "pixels of a detector module, fast and slow: modules tile the "
         "detector from its first pixel, -module_gap apart", "one module"),
    Flag(NBSIM, "-module_gap", (INT, INT), "F S", "pixels between modules, fast and slow: not rendered, written as "
         "gaps (-1 in -cbffile and -nxmxfile, flagged in NXmx's pixel_mask)", "0 0"),
    Flag(NBSIM, "-saturation", I1, "COUNTS", "largest count of -cbffile and -nxmxfile, written as their overload "
         "value; higher counts read it. Those files add -adc only when it is given (the SMV files keep nanoBragg's "
         "65535 and -adc 40)", "2147483647, int32's largest"),
    Flag(NBSIM, "-min_photons", N1, "N", "warn when the image holds fewer photons in all (an empty shot); 0: never",
         "1"),
    Flag(NBSIM, "-anomalous", (), "", "f' and f'' of the -model's elements at each wavelength (Cromer-Liberman): "
         "F(+) != F(-), one table per spectrum channel"),
    Flag(NBSIM, "-fp_fdp", P1, "FILE", "f' and f'' per element and energy (rows: element eV f' f''), in place of "
         "Cromer-Liberman for its elements (with -anomalous)", "none"),
    Flag(NBSIM, "-energy_bins", I1, "N", "-anomalous tables per energy bin of equal width instead of per channel",
         "one per channel"),
    Flag(NBSIM, "-physics", (WORD,), "nanobragg|corrected", "nanoBragg's image, defects included, or every known "
         "defect corrected (docs/physics.md)", "nanobragg"),
    Flag(NBSIM, "-sampling", (WORD,), "nanobragg|advised", "φ steps and mosaic domains the flags leave out: "
         "nanoBragg's defaults, or as many as nbsim's sampling advice asks (docs/physics.md)", "nanobragg"),
    Flag(NBSIM, "-background", P1, "FILE|water|air", "amorphous background from F against sin(θ)/λ (Å⁻¹): simtbx's "
         "water or air, or a file; linear in fluence", "none"),
    Flag(NBSIM, "-background_thick", N1, "MM", "path length of the -background material in the beam, mm", "0"),
    Flag(NBSIM, "-background_density", N1, "G/CM3", "density of the -background material", "water 1, air 0.0012"),
    Flag(NBSIM, "-background_mw", N1, "G/MOL", "molecular weight of the -background material", "water 18, air 14"),
    Flag(RESPONSE, "-noise_generator", (WORD,), "nanobragg|philox", "random numbers of the noise: nanoBragg's own (its "
         "noise image bit for bit) or counter-based Philox (any image reproduced alone, on any device)", "nanobragg"),
    Flag(RESPONSE, "-nopoisson", (), "", "no Poisson noise (the other effects still apply)"),
    Flag(RESPONSE, "-flicker", N1, "FRACTION", "flicker noise: relative rms of the expected photons", "0"),
    Flag(RESPONSE, "-calibration", N1, "FRACTION", "calibration error: relative rms, fixed per pixel", "0"),
    Flag(RESPONSE, "-calibration_seed", I1, "N", "random-number seed of the calibration error", "123456789"),
    Flag(RESPONSE, "-psf", (WORD,), "none|gaussian|fiber", "point-spread function, integrated over each pixel", "none"),
    Flag(RESPONSE, "-psf_fwhm", N1, "UM", "full width at half maximum of the point-spread function, µm", "0"),
    Flag(RESPONSE, "-gain", N1, "ADU", "ADU per photon", "1"),
    Flag(RESPONSE, "-readout_noise", N1, "ADU", "readout noise, rms ADU", "0"),
    Flag(RESPONSE, "-beamstop", N1, "MM", "beam-stop radius around the direct beam: no photons inside, mm", "0"),
    Flag(RESPONSE, "-hot_pixels", N1, "FRACTION", "fraction of pixels that read 65535", "0"),
    Flag(RESPONSE, "-dead_pixels", N1, "FRACTION", "fraction of pixels that read 0", "0"),
    Flag(RESPONSE, "-defect_seed", I1, "N", "random-number seed of the hot and dead pixels", "1"),
    Flag(IGNORED, "-density -sample_density", N1, "G/CM3",
         "sample density (no effect on the image, as in nanoBragg)", "1"),
    Flag(IGNORED, "-MW -molecular_weight -molecules", N1, "G/MOL",
         "molecular weight (no effect on the image, as in nanoBragg)", "18"),
    Flag(IGNORED, "-stol -4stol -Q", P1, "FILE",
         "F of the background against sin(θ)/λ (not used, as in nanoBragg)", "none"),
    Flag(IGNORED, "-stolout", P1, "FILE", "F against sin(θ)/λ, written by nanoBragg (not by nbsim)", "none"),
    Flag(IGNORED, "-dump", P1, "FILE", "nanoBragg's binary cache of F (nbsim neither writes nor reads it; "
         "refused without -hkl where it exists, as nanoBragg would read it)", "Fdump.bin"),
    Flag(IGNORED, "-coherent", (), "", "coherent sum (no effect, as in nanoBragg)"),
    Flag(IGNORED, "-printout", (), "", "print every pixel's value (nbsim prints none)"),
    Flag(IGNORED, "-progress -noprogress", (), "", "progress meter (nbsim prints none)"),
)

FLAGS: dict[str, tuple[str, ...]] = {n: f.kinds for f in TABLE if f.kinds is not VARIABLE for n in f.names}
"""name → tuple of value kinds, for every flag of fixed arity."""
_VARIABLE = tuple(n for f in TABLE if f.kinds is VARIABLE for n in f.names)
MUST_BE_POSITIVE = {"-detpixels", "-detpixels_f", "-detpixels_x", "-detpixels_s", "-detpixels_y", "-pixel",
                    "-distance", "-close_distance", "-detsize", "-detsize_f", "-detsize_s", "-lambda", "-wave",
                    "-wavelength", "-energy", "-beamsize", "-exposure", "-saturation", "-module_size"}
MUST_NOT_BE_NEGATIVE = {"-N", "-Na", "-Nb", "-Nc", "-oversample", "-mosaic", "-mosaicity", "-mosaic_spread",
                        "-mosaic_domains", "-mosaic_dom", "-phisteps", "-dispersion", "-dispsteps", "-divergence",
                        "-hdivrange", "-vdivrange", "-hdivstep", "-vdivstep", "-hdivsteps", "-vdivsteps",
                        "-divsteps", "-detector_thick", "-detector_thicksteps", "-thicksteps", "-water", "-fluence",
                        "-flux", "-dmin", "-samplesize", "-sample_size", "-xtalsize", "-xtal_size", "-fudge",
                        "-osc", "-phistep", "-psf_fwhm", "-gain", "-readout_noise", "-beamstop", "-module_gap",
                        "-min_photons", "-background_thick"}
MUST_BE_POSITIVE |= {"-background_density", "-background_mw", "-energy_bins"}
MUST_BE_FRACTION = {"-flicker", "-calibration", "-hot_pixels", "-dead_pixels"}
SAMPLING_FLAG = "-sampling"
"""nbsim's choice of φ steps and mosaic domains where the flags leave them out (nanobragg | advised)."""
WAVELENGTH_FLAGS = ("-lambda", "-wave", "-wavelength", "-energy")
CONFLICTS = (
    {"-interpolate", "-nointerpolate"},
    {"-square_xtal", "-round_xtal", "-gauss_xtal", "-tophat_spots", "-binary_spots"},
    {"-round_div", "-square_div"},
    {"-nonoise", "-noisefile", "-noiseimage"},
    {"-nopgm", "-pgmfile", "-pgmimage"},
    {"-nopgm", "-pgmscale"},
    {"-nopolar", "-polar"},
    set(WAVELENGTH_FLAGS),
    {"-fluence", "-flux"},
    {"-hkl", "-model"},
    {"-spectrumfile", "-sourcefile"},
    {"-spectrumfile", "-dispersion"},
)
NAMED_VALUES = {"-background": ("water", "air")}
"""File flags that also take a name in place of a file (not made absolute)."""
NBSIM_ONLY = tuple(n for f in TABLE if f.group in (NBSIM, RESPONSE) for n in f.names)
NO_EFFECT = tuple(n for f in TABLE if f.group == IGNORED for n in f.names)
SINGLE_PANEL_ONLY = ("-distance", "-close_distance", "-Xbeam", "-Ybeam", "-Xclose", "-Yclose", "-ORGX", "-ORGY",
                     "-twotheta", "-detector_rotx", "-detector_roty", "-detector_rotz", "-fdet_vector",
                     "-sdet_vector", "-odet_vector", "-pix0_vector", "-pivot", "-detpixels", "-detpixels_f",
                     "-detpixels_x", "-detpixels_s", "-detpixels_y", "-detsize", "-detsize_f", "-detsize_s",
                     "-pixel", "-curved_det", "-roi", "-mask", "-img", "-printout_pixel", "-module_size", "-module_gap",
                     "-pix0_vector_mm")
"""Flags that place, shape or select pixels of the one panel: refused with -panelfile."""
SINGLE_PANEL_FILES = ("-intfile", "-intimage", "-pgmfile", "-pgmimage", "-pgmscale", "-cbffile")
"""Image files of one panel (SMV, PGM, miniCBF): refused with -panelfile (-floatfile, -nxmxfile and the -noisefile
NXmx hold panels)."""
DETECTOR_FLAGS = tuple(n for f in TABLE if f.group == RESPONSE for n in f.names)
"""nbsim's detector effects (docs/detector.md): they change only the noise image (-noisefile, and the counts of
-cbffile and -nxmxfile)."""

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
                   "-psf": ("none", "gaussian", "fiber"), "-physics": ("nanobragg", "corrected"),
                   "-sampling": ("nanobragg", "advised"),
                   "-sensor_material": tuple(MATERIALS)}.get(flag)
        if flag in ("-detector_abs", "-detector_absorb"):
            if not (_NUMBER.match(value) or value.startswith("inf")):
                raise NbsimError(f"{flag} expects an attenuation depth in um or 'inf', got '{value}'")
        elif allowed is not None and value not in allowed:
            raise NbsimError(f"{flag} expects one of {', '.join(allowed)}, got '{value}'")
        elif flag == "-device" and not re.match(r"^(cpu|cuda(:\d+)?)$", value):
            raise NbsimError(f"-device expects cpu or cuda[:N], got '{value}'")


def flag_help(width: int = 34) -> str:
    """`nbsim -h`'s flag lines: each group of TABLE under its name, a line per flag and its aliases with
    its values, what it sets (units included) and its default."""
    lines = []
    for group in GROUPS:
        lines.append(f"{group}:")
        for flag in (f for f in TABLE if f.group == group):
            label = f"  {' '.join(flag.names)} {flag.values}".rstrip()
            text = f"{flag.text} (default: {flag.default})" if flag.default else flag.text
            lines.append(f"{label:<{width}}  {text}" if len(label) < width else f"{label}  {text}")
    return "\n".join(lines)


def absolute_file_arguments(argv: list[str], base: Path) -> list[str]:
    """The arguments with every file value (after -hkl, -mat, ... ) made absolute against `base`."""
    result = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if argv[i + 1] in NAMED_VALUES.get(arg, ()):
            continue
        if FLAGS.get(arg) == (PATH,) and not Path(argv[i + 1]).is_absolute():
            result[i + 1] = str((base / argv[i + 1]).resolve())
    return result
