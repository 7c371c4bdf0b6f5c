"""`nbsim fit`: refine a model against observed images (docs/fitting.md).

    nbsim fit IMAGE [IMAGE ...] [options] -- <nanoBragg flags of the starting model>

The starting model is the nanoBragg flags after `--` (the one parser), per image overridden by
`--starts FILE` (JSON: {"images": {IMAGE: {"misset": [x, y, z], "cell": [...], "N": 20, ...}}}, keys
being nanoBragg flags without the dash) or taken from a DIALS experiment list (`--expt FILE`: each
experiment, a lattice of an image, is a fit of that image from its models; `--refl FILE` gives DIALS's spots,
`--expt-out FILE` writes the refined models back as an experiment list, a tiled detector's panels too). A
multi-panel detector (`-panelfile`, or an --expt list's) is fitted on its NXmx frames or stacked
`-floatfile`s; `--refine panels --shared panels` moves its panel groups (`--groups`), and
`--panels-out`/`--geom-out` write the refined detector.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..errors import InputFileError, NbsimError
from ..io.atomic import atomic_write_text
from ..io.paths import check_writable, require_file
from ..nanobragg.arguments import parse
from .options import CommandParser, split_model_flags

DESCRIPTION = __doc__.split("\n\n")[0]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _restraint(text: str) -> tuple[str, float]:
    name, _, sigma = text.partition("=")
    try:
        return name.strip(), float(sigma)
    except ValueError:
        raise argparse.ArgumentTypeError(f"restraint {text!r} is not NAME=SIGMA") from None


def argument_parser() -> argparse.ArgumentParser:
    """The options of `nbsim fit` (its nanoBragg flags come after `--`)."""
    parser = CommandParser("fit", takes_flags=True, prog="nbsim fit", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Example: nbsim fit shot_00001.img --refine orientation,cell,N,scale --json fit.json "
                                  "-- -model model.cif -cell 50 60 70 90 90 90 -misset 10 20 30 -N 14 -distance 150 "
                                  "-detpixels 512 -pixel 0.2")
    parser.add_argument("images", nargs="*",
                        help="observed frames: SMV (.img), miniCBF, NXmx (FILE#N for frame N; a -panelfile detector's "
                             "panels as its modules), raw float (.bin; a -panelfile detector's panels one after "
                             "another), or STORE.zarr#POINT")
    parser.add_argument("--refine", type=_names, default=["orientation", "cell", "N", "scale"],
                        help="what to refine, comma-separated: orientation, cell, N, mosaic, scale, distance, beam, "
                             "panels, wavelength, spectrum (a shot's spectrum's shift in eV and stretch: "
                             "-spectrumfile, or the frame's; with cell, the cell keeps its scale), background "
                             "(default orientation,cell,N,scale)")
    parser.add_argument("--shared", type=_names, default=[],
                        help="quantities refined once for all images (e.g. distance,beam; panels always); others are "
                             "per image")
    parser.add_argument("--groups", metavar="modules|all|FILE",
                        help="the panel groups --refine panels moves, each by a shift (mm) and a rotation about its "
                             "centre (degrees): modules (default: each panel), all (the detector as one), or a "
                             "YAML/JSON file mapping group names to panel names")
    parser.add_argument("--panels-out", metavar="FILE",
                        help="write the refined detector as nbsim's YAML panel list (what -panelfile reads)")
    parser.add_argument("--geom-out", metavar="FILE",
                        help="write the refined detector as a CrystFEL geometry (.geom; the panel groups as rigid "
                             "groups)")
    parser.add_argument("--starts", help="JSON of per-image starting values (nanoBragg flags without the dash)")
    parser.add_argument("--expt", metavar="FILE",
                        help="a DIALS experiment list (.expt): each experiment (a lattice of an image) is fitted "
                             "from its crystal, beam and detector (one panel, or a tiled detector's panels in "
                             "DIALS's order); without IMAGEs, on the image it names")
    parser.add_argument("--refl", metavar="FILE",
                        help="DIALS's spots (the indexed.refl written with the --expt list) as each experiment's "
                             "observed spots: shoeboxes around them")
    parser.add_argument("--expt-out", metavar="FILE",
                        help="write the refined crystals, beam and detector (every panel) as a DIALS experiment list "
                             "(with --expt; dials.integrate and dials.ssx_integrate read it)")
    parser.add_argument("--lattice", help="lattice system of the cell (default: read off the starting cell)")
    parser.add_argument("--shoebox", type=int, default=9, help="shoebox side in pixels (odd; default 9)")
    parser.add_argument("--spots", type=int, default=200,
                        help="most predicted (and observed) spots per image (default 200)")
    parser.add_argument("--no-observed-spots", action="store_true",
                        help="shoeboxes around predicted spots only (default: the image's strong spots too)")
    parser.add_argument("--background", default="plane",
                        help="plane (default: per shoebox, fixed), flat (refined), none")
    parser.add_argument("--likelihood", default="poisson", help="poisson (default) or gaussian (diffBragg's)")
    parser.add_argument("--optimizer", default="auto",
                        help="auto (default: fisher where it applies, else lbfgs), fisher (Fisher scoring, one block "
                             "per image: crystal-only refinements with nothing shared), lbfgs or adam")
    parser.add_argument("--max-iterations", type=int, default=100,
                        help="iteration cap of each optimisation stage (default 100; a fit that meets it: "
                             "converged false, exit status 3)")
    parser.add_argument("--search-deg", type=float, default=0.3,
                        help="how far off the starting orientation may be (the coarse stage; 0 skips the search "
                             "on area-averaged pixels; default 0.3)")
    parser.add_argument("--restrain", type=_restraint, action="append", default=[],
                        help="NAME=SIGMA: a Gaussian restraint towards the start (repeatable; degrees for the "
                             "orientation; panels=SIGMA: SIGMA mm on each group's shift and SIGMA degrees on its "
                             "rotation, 0.1 when not given)")
    parser.add_argument("--adc", type=float, help="ADC offset to subtract (default: the file's, else 40 for SMV)")
    parser.add_argument("--json", help="write the result here (the JSON contract of docs/fitting.md)")
    parser.add_argument("--flags", help="write the refined model's nanoBragg flags here, one line per image")
    parser.add_argument("--plot", help="write observed, model and residual shoeboxes as a PNG")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="the fit's compiled kernel: auto (default: when cached, or when building it first pays), "
                             "on (built first if needed), off (eager)")
    parser.add_argument("--device", default="cpu", help="where to render the model: cpu or cuda[:N] (default cpu)")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                        help="precision of the model and its gradient (default float64)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _flag_overrides(values: dict, source: str) -> list[str]:
    """nanoBragg flags from a starts entry: {"misset": [1, 2, 3], "N": 20} → -misset 1 2 3 -N 20."""
    flags = []
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, (int, float, str)) and not isinstance(item, bool) for item in items):
            raise InputFileError(source, f"the value of {key!r} must be a number, a word or a list of them")
        flags += [f"-{key.lstrip('-')}", *(str(item) for item in items)]
    return flags


def advised_sampling(config, argv: list[str]) -> tuple:
    """The model with the φ steps and mosaic domains nbsim's sampling advice asks for where the flags leave
    them out (`-sampling advised`, the fit's default; `-sampling nanobragg` keeps nanoBragg's): a fit of a
    rotation frame or a mosaic crystal needs every spot rendered, not hit or missed between samples. Returns
    the model and the flags that give those counts (so the refined flags re-render what was fitted)."""
    from ..resolve import advised_sampling_flags

    advised, flags = advised_sampling_flags(config if "-sampling" in argv else config.with_options(sampling="advised"))
    if flags:
        print(f"nbsim fit: {' '.join(flags)} (nbsim's sampling advice; give the flags to choose)", file=sys.stderr)
    return advised, flags


def with_frame_spectrum(config, image: str, argv: list[str]):
    """The model with the spectrum its frame carries (an NXmx beam's, a store shot's `sase` draw) where the flags
    give no wavelengths of their own (-spectrumfile, -sourcefile, -dispersion): the shot's spectrum, whose shift
    and stretch `--refine spectrum` fits. Its weighted mean wavelength is the nominal one unless -lambda or
    -energy gives it."""
    from ..config import spectrum_mean_wavelength_A
    from ..io.observed import observed_spectrum
    from ..nanobragg.flags import WAVELENGTH_FLAGS

    beam = config.beam
    if beam.spectrum is not None or beam.sources is not None or beam.dispersion_percent != 0:
        return config
    spectrum = observed_spectrum(image)
    if spectrum is None:
        return config
    print(f"nbsim fit: {image}: the frame's spectrum ({len(spectrum)} channels) in the model (-spectrumfile FILE "
          "chooses another)", file=sys.stderr)
    if any(flag in argv for flag in WAVELENGTH_FLAGS):
        return config.with_options(spectrum=spectrum)
    return config.with_options(spectrum=spectrum, wavelength_A=spectrum_mean_wavelength_A(spectrum))


def _starts(path: str | None) -> dict[str, dict]:
    if path is None:
        return {}
    require_file(path)
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputFileError(path, f"not JSON ({error})") from None
    images = document.get("images") if isinstance(document, dict) else None
    if not isinstance(images, dict) or not all(isinstance(v, dict) for v in images.values()):
        raise InputFileError(path, 'expected {"images": {IMAGE: {flag: value, ...}}}')
    return images


def main(argv: list[str]) -> int:
    """`nbsim fit ARGS`: 0 when the fit converged, 3 when it did not (the JSON says why), 2 for bad input."""
    own, model_flags = split_model_flags(argv)
    if own and own[0] in ("-h", "--help"):
        argument_parser().print_help()
        return 0
    options = argument_parser().parse_args(own)
    from ..fit.names import check_names, check_shared

    check_shared(check_names(options.shared, "shared"), check_names(options.refine, "refined"))
    if options.groups is not None and "panels" not in options.refine:
        raise NbsimError("fit: --groups says which panels --refine panels moves together: add panels to --refine")
    if "spectrum" in options.refine and "cell" in options.refine:
        print("nbsim fit: the cell keeps its scale beside the spectrum (a still's image is the same for a cell "
              "scaled by 1 + e and energies by 1/(1 + e)); its shape is refined", file=sys.stderr)
    for path in (options.json, options.flags, options.plot, options.expt_out, options.panels_out, options.geom_out):
        if path is not None:
            check_writable(path)
    starts = _starts(options.starts)
    images, experiments = _experiment_shots(options, list(options.images))
    if not images:
        raise NbsimError("fit: give at least one observed image (or an --expt that names its images)")
    unknown = [name for name in starts if name not in images]
    if unknown:
        raise InputFileError(options.starts, f"names an image not given: {unknown[0]}")
    from ..io.observed import require_observed

    require_observed(images)
    argv_per_image = [model_flags + _flag_overrides(starts.get(image, {}), options.starts or "")
                      for image in images]
    configs = [parse(list(argv))[0] for argv in argv_per_image]
    if experiments:
        configs = [config.with_options(**start.overrides) for config, start in zip(configs, experiments, strict=True)]
    configs = [with_frame_spectrum(config, image, argv)
               for config, image, argv in zip(configs, images, argv_per_image, strict=True)]
    from ..fit.model import check_spectrum_refinable

    for config, image in zip(configs, images, strict=True):
        check_spectrum_refinable(config, options.refine, image)
    for index, config in enumerate(configs):
        configs[index], extra = advised_sampling(config, argv_per_image[index])
        argv_per_image[index] = argv_per_image[index] + extra
    for config in configs:
        for path in (config.structure.hkl_file, config.structure.model_file, config.detector.mask_file):
            if path is not None:
                require_file(path)
    groups = _panel_groups(options, configs)
    spots = _dials_spots(options.refl, experiments, options.spots) if options.refl else [None] * len(images)
    return _run(options, images, configs, argv_per_image, model_flags, experiments, spots, groups)


def _panel_groups(options: argparse.Namespace, configs: list):
    """The panel groups --refine panels moves (--groups: modules, all or a file of groups, read and checked against
    the detector's panels before any work); the refined detector checked against --geom-out's format."""
    panels = configs[0].detector.panels
    if options.geom_out and panels:
        from ..io.panels import check_crystfel_panels

        check_crystfel_panels(panels)
    grouping = options.groups or "modules"
    if "panels" not in options.refine:
        return grouping
    from ..fit.panels import check_refinable

    check_refinable([config.detector for config in configs])
    if grouping in ("modules", "all"):
        return grouping
    require_file(grouping)
    from ..io.panels import read_panel_groups

    return read_panel_groups(grouping, [panel.name for panel in panels])


def _experiment_shots(options: argparse.Namespace, given: list[str]) -> tuple[list[str], list]:
    """The images to fit and, with --expt, the experiment each starts from (one fit per experiment: an image
    with several lattices is fitted once from each). Without IMAGEs, every experiment of the list on the image
    it names; with IMAGEs that the list names, their experiments; else one experiment for every image, or one
    for each in turn."""
    if options.expt is None:
        if options.refl or options.expt_out:
            raise NbsimError("fit: --refl and --expt-out go with --expt (DIALS's experiments)")
        return given, []
    if options.refl and options.no_observed_spots:
        raise NbsimError("fit: --refl gives the observed spots; --no-observed-spots leaves them out: choose one")
    require_file(options.expt)
    from ..io.dials_experiments import read_experiment_list

    experiments = read_experiment_list(options.expt)
    if not given:
        for start in experiments:
            if start.image is None:
                raise InputFileError(options.expt, f"experiment {start.number} does not say which image it is of: "
                                                   "give the images")
            if not Path(start.image.split("#", 1)[0]).exists():
                raise InputFileError(options.expt, f"experiment {start.number}'s image "
                                                   f"{start.image.split('#', 1)[0]} is not there")
        return [start.image for start in experiments], experiments
    named = {_absolute_image(image): [start for start in experiments if start.image == _absolute_image(image)]
             for image in given}
    if all(named.values()):
        pairs = [(image, start) for image in given for start in named[_absolute_image(image)]]
        return [image for image, _ in pairs], [start for _, start in pairs]
    if len(experiments) == 1:
        if options.expt_out and len(given) > 1:
            raise NbsimError(f"fit: --expt-out writes each experiment once, but {options.expt}'s one experiment "
                             f"starts {len(given)} images")
        return given, experiments * len(given)
    if len(experiments) == len(given):
        return given, experiments
    unnamed = next(image for image in given if not named[_absolute_image(image)])
    raise NbsimError(f"fit: no experiment in {options.expt} is of {unnamed}, and its {len(experiments)} "
                     f"experiments do not pair with {len(given)} images")


def _absolute_image(image: str) -> str:
    """An image as an experiment list's reader names it: the path absolute, FILE#N kept."""
    path, hash_sign, frame = image.partition("#")
    return str(Path(path).resolve()) + hash_sign + frame


def _dials_spots(path: str, experiments: list, max_spots: int) -> list:
    """Each experiment's spots in DIALS's reflection table `path` (centre pixels, brightest first; on a
    multi-panel detector (panel, row, col), DIALS's panel k being the image's k-th)."""
    require_file(path)
    from ..io.dials_reflections import read_reflection_table

    table = read_reflection_table(path)
    if not table.covers([start.identifier for start in experiments]):
        raise InputFileError(path, "its spots belong to none of the experiments of the --expt list (give the "
                                   ".refl written with that list: dials.index's indexed.refl)")
    return [table.spots(start.identifier, start.number, max_spots, start.overrides.get("panels") is not None)
            for start in experiments]


CELL_LENGTH_TOLERANCE = 0.05
"""Cell lengths further apart than this fraction are another crystal: a fit's refined cell against its start, the
starting cells of a merge's shots against the first shot's."""


def implausible_model(shot: dict, start_cell: tuple[float, ...]) -> list[str]:
    """What makes a fit's refined model (a shot of its JSON) implausible, converged or not: a crystal under one
    cell along an axis, or a cell length more than `CELL_LENGTH_TOLERANCE` from its start."""
    doubts = [f"N along {axis} is {n:.3g} cells" for axis, n in zip("abc", shot["N"], strict=True) if n < 1]
    doubts += [f"cell length {axis} moved from {start:.4g} to {refined:.4g} A"
               for axis, start, refined in zip("abc", start_cell[:3], shot["cell"][:3], strict=True)
               if abs(refined / start - 1) > CELL_LENGTH_TOLERANCE]
    return doubts


def unmodelled_spread(configs: list) -> str | None:
    """The warning for a model whose flags give a point spread (`-psf`, a `-detector_model`'s), which the fit
    does not render; None without one."""
    spread = sorted({(config.response.psf, config.response.psf_fwhm_um) for config in configs} - {("none", 0.0)})
    if not spread:
        return None
    shape, fwhm_um = spread[0]
    return (f"the model's point spread (-psf {shape} -psf_fwhm {fwhm_um:g}) is not modelled: the fit renders sharp "
            "pixels, so spots the spread widened bias the refined model (docs/fitting.md)")


def _run(options: argparse.Namespace, images: list[str], configs: list, argv_per_image: list[list[str]],
         model_flags: list[str], experiments: list, spots: list, groups) -> int:
    import torch

    from ..fit.compiled import start_background_build
    from ..fit.images import read_fit_image
    from ..fit.output import fit_json, refined_experiments, residual_picture
    from ..fit.refine import FitOptions, fit, fit_kernel_variants
    from ..resolve import resolve

    adc = options.adc
    if adc is None and "-adc" in model_flags:
        adc = configs[0].response.adc_offset_adu
    fit_images, warnings = [], []
    for name, config, given_spots in zip(images, configs, spots, strict=True):
        setup = resolve(config)
        warnings += [line for line in setup.warnings if line not in warnings]
        fit_images.append(dataclasses.replace(read_fit_image(name, setup, adc), spots=given_spots))
    for line in warnings:  # once each, and only once every image has been read (a refusal stays one line)
        print(f"nbsim: warning: {line}", file=sys.stderr)
    unmodelled = unmodelled_spread(configs)
    if unmodelled:
        print(f"nbsim: warning: {unmodelled}", file=sys.stderr)
    readout_photons = configs[0].response.readout_noise_adu / (configs[0].response.gain_adu_per_photon or 1.0)
    fit_options = FitOptions(
        refine=tuple(options.refine), shared=tuple(options.shared), lattice=options.lattice,
        shoebox_px=options.shoebox, max_spots=options.spots, observed_spots=not options.no_observed_spots,
        background=options.background, likelihood=options.likelihood, readout_photons=readout_photons,
        optimizer=options.optimizer, max_iterations=options.max_iterations, search_deg=options.search_deg,
        restraints=dict(options.restrain), groups=groups, device=options.device, compile=options.compile,
        dtype=torch.float64 if options.dtype == "float64" else torch.float32)
    show = not options.quiet and sys.stderr.isatty()

    def progress(stage: str, iteration: int, nll: float, gradient: float, seconds: float) -> None:
        print(f"{stage} {iteration:4d}  -logL {nll:.8g}  max|grad| {gradient:.3g}  {seconds:.1f} s", file=sys.stderr)

    result = fit(fit_images, fit_options, progress if show else None)
    if options.compile == "auto" and os.environ.get("NBSIM_BACKGROUND_BUILD", "on") != "off":
        variants = fit_kernel_variants([image.setup for image in fit_images], fit_options.refine, fit_options)
        if start_background_build(variants):
            print("nbsim fit: building the fit's compiled kernel in the background for later fits "
                  "(python -m nbsim.fit.compiled; NBSIM_BACKGROUND_BUILD=off to stop this)", file=sys.stderr)
    document = fit_json(result, argv_per_image, [start.number for start in experiments] or None,
                        options.panels_out and str(Path(options.panels_out).resolve()))
    if options.panels_out or options.geom_out:
        from ..fit.output import refined_panels
        from ..io.panels import write_crystfel_geometry, write_panel_file

        panels = refined_panels(result)
        if options.panels_out:
            write_panel_file(options.panels_out, panels)
        if options.geom_out:
            moved = {group["name"]: group["panels"] for group in document["detector"].get("groups", [])}
            write_crystfel_geometry(options.geom_out, panels, moved)
    if options.json:
        atomic_write_text(options.json, json.dumps(document, indent=2) + "\n")
    if options.flags:
        import shlex

        atomic_write_text(options.flags, "".join(shlex.join(shot["flags"]) + "\n" for shot in document["shots"]))
    if options.plot:
        residual_picture(result, options.plot)
    if options.expt_out:
        from ..io.dials_experiments import write_experiment_list

        write_experiment_list(options.expt_out, options.expt, refined_experiments(result, experiments))
    for shot, image in zip(document["shots"], fit_images, strict=True):
        for doubt in implausible_model(shot, image.setup.lattice.cell_parameters()):
            print(f"nbsim: warning: {shot['image']}: {doubt}: the fit likely left the start's basin (check its "
                  "orientation and cell; docs/fitting.md)", file=sys.stderr)
    for shot in document["shots"]:
        cell = " ".join(f"{v:.4f}" for v in shot["cell"])
        at = shot["flags"].index("-misset")  # the refined orientation, as the refined flags give it
        misset = " ".join(f"{float(v):.4f}" for v in shot["flags"][at + 1:at + 4])
        n_cells = " ".join(f"{v:.2f}" for v in shot["N"])
        spectrum = (f"  spectrum shift {shot['spectrum']['shift_eV']:+.3f} eV stretch {shot['spectrum']['stretch']:.5f}"
                    if "spectrum" in shot else "")
        print(f"{shot['image']}: cell {cell}  misset {misset}  N {n_cells}  scale {shot['scale']:.5g}{spectrum}  "
              f"({shot['pixels']} pixels in {shot['shoeboxes']} shoeboxes)")
    detector = document["detector"]
    if "distance_mm" in detector:
        print(f"detector: distance {detector['distance_mm']:.4f} mm  beam {detector['beam_x_mm']:.4f} "
              f"{detector['beam_y_mm']:.4f} mm")
    for group in detector.get("groups", []):
        shift = " ".join(f"{v * 1000:+.2f}" for v in group["shift_mm"])
        rotation = " ".join(f"{v:+.4f}" for v in group["rotation_deg"])
        print(f"panel group {group['name']}: shift {shift} um  rotation {rotation} deg")
    print(f"converged: {str(result.converged).lower()} ({result.reason}); {result.iterations} iterations, "
          f"{result.seconds:.1f} s")
    return 0 if result.converged else 3
