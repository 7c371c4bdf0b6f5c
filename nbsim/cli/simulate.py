"""The rendering half of `nbsim`: set up, render and write nanoBragg's files (imports torch; reached only
once the arguments are known to be sound, see nbsim.cli)."""

from __future__ import annotations

import dataclasses
import datetime
import os

import numpy as np
import torch

from .. import __version__
from ..cache import configure_compile_cache
from ..config import EMPTY_SHOT_ADVICE, SimulationConfig
from ..detector import DetectorImage, Readout, detector_images, layout_of
from ..detector.native import load as load_compiled_noise
from ..detector.response import OVERLOAD_ADU
from ..devices import resolve_device, resolve_dtype
from ..errors import NbsimError
from ..io.detector_images import ExperimentRecord, write_mini_cbf, write_nxmx
from ..io.images import write_float_image, write_pgm, write_smv
from ..io.paths import removed_on_failure
from ..io.structure_files import write_hkl
from ..modes import Compile
from ..nanobragg.arguments import RunOptions
from ..render import Renderer
from ..resolve import Setup, noise_image_wraps, resolve
from ..vectors import DEGREES_PER_RADIAN
from .products import (
    ImageStatistics,
    experiment_record,
    integer_image,
    panel_counts,
    panel_images,
    panel_statistics,
    pgm_image,
    smv_fields,
    stacked_panels,
    statistics,
)


def render_command(config: SimulationConfig, run: RunOptions) -> int:
    """Render `config` and write the files `run` asks for, printing what nanoBragg prints."""
    started = datetime.datetime.now(datetime.timezone.utc)
    device = resolve_device(run.device)
    dtype = resolve_dtype(run.dtype)
    setup = resolve(config)
    if run.printout_pixel is not None:
        _check_printout_pixel(setup, *run.printout_pixel)
    for line in run.notes + setup.warnings:
        print(f"WARNING: {line}")
    for line in describe(setup):
        print(line)
    if run.noise and config.response.poisson and config.response.generator == "nanobragg":
        load_compiled_noise()
    if run.compile is not Compile.OFF:
        configure_compile_cache()
    renderer = Renderer(setup, device=device, dtype=dtype, compile=run.compile)
    image = renderer().detach().to("cpu", torch.float32).numpy()
    for line in renderer.warnings:
        print(f"WARNING: {line}")
    total_photons = float(image.sum(dtype=np.float64))
    if total_photons < run.min_photons:
        print(f"WARNING: the image holds {total_photons:.3g} photons in all, fewer than -min_photons "
              f"{run.min_photons:g}: an empty shot; {EMPTY_SHOT_ADVICE}")
    _report_compile_decision(renderer)
    caveat = "; eager and compiled float32 images differ by up to 1e-4 of the maximum, docs/kernels.md"
    print(f"  kernel: {renderer.kernel_path} ({run.dtype} on {device}{caveat if run.dtype == 'float32' else ''})")
    with removed_on_failure(run.outputs(setup.panels is not None).values()):
        if setup.panels is not None:
            return _write_panels(image, setup, run, started)
        return _write_image(image, renderer, setup, run, started)


def _write_image(image: np.ndarray, renderer: Renderer, setup: Setup, run: RunOptions,
                 started: datetime.datetime) -> int:
    """A one-panel detector's files, with what nanoBragg prints between them: -floatfile, -intfile, -pgmfile,
    -noisefile, the -cbffile/-nxmxfile counts and -p1_out."""
    config = setup.config
    stats = statistics(image, setup)
    wavelength_A = float(config.beam.wavelength_A)
    fields = smv_fields(setup.geometry, setup, wavelength_A)
    if run.printout_pixel is not None:
        _print_trace(renderer, setup, *run.printout_pixel)
    if run.floatfile:
        print(f"writing {run.floatfile} as {image.size} 4-byte floats")
        write_float_image(run.floatfile, image)
    print(f"max_I = {stats.max_I:g}  at {stats.max_position_m[0]:g} {stats.max_position_m[1]:g}")
    print(f"mean= {stats.mean:g} rms= {stats.rms:g} rmsd= {stats.rmsd:g}")
    scale = _intfile_scale(run, stats)
    if run.intfile:
        print(f"writing {run.intfile} as 2-byte integers")
        write_smv(run.intfile, integer_image(image, setup, scale, run.adc), fields)
    if run.pgmfile:
        pgm_scale = run.pgm_scale if run.pgm_scale > 0 else (250.0 / (5.0 * stats.rmsd) if stats.rmsd > 0 else scale)
        print(f"pgm_scale = {pgm_scale:g}")
        print(f"writing {run.pgmfile} as 1-byte integers")
        write_pgm(run.pgmfile, pgm_image(image, setup, pgm_scale), pgm_scale)
    detected, noisy_counts = _noise_images(image, setup, run)
    if detected is not None:
        print(f"{detected.total_photons:.0f} photons on noise image ({detected.overloads} overloads)")
        print(f"writing {run.noisefile} as 2-byte integers")
        write_smv(run.noisefile, detected.adu.numpy().astype(np.uint16), fields)
    if run.wants_counts:
        seed = run.seed if run.noise else None
        record = experiment_record(setup, seed, run.saturation_counts, run.counts_pedestal)
        _write_processing_images(run, _processing_counts(image, setup, run, scale, noisy_counts), record, started)
    if run.p1_table_file and setup.p1_table is not None:
        print(f"writing {run.p1_table_file} as {len(setup.p1_table.reflections)} h k l F lines (the P1 table used)")
        write_hkl(run.p1_table_file, setup.p1_table.reflections)
    return 0


def _write_panels(image: np.ndarray, setup: Setup, run: RunOptions, started: datetime.datetime) -> int:
    """A multi-panel detector's files: -floatfile (the panels one after another, each slow x fast, in the panel
    file's order), -noisefile (the noise image, nanoBragg's 16-bit ADU as its SMV holds them, as NXmx) and
    -nxmxfile (the noise image's counts, or the -intfile image's under -nonoise), both one NXdetector_module per
    panel; -p1_out. The one-panel formats are refused when the arguments are parsed."""
    panels = panel_images(image, setup.config.detector.panels)
    stats, brightest = panel_statistics(panels, setup)
    if run.floatfile:
        stacked = stacked_panels(image, setup.config.detector.panels)
        print(f"writing {run.floatfile} as {stacked.size} 4-byte floats ({len(panels)} panels stacked)")
        write_float_image(run.floatfile, stacked)
    print(f"max_I = {stats.max_I:g}  at {stats.max_position_m[0]:g} {stats.max_position_m[1]:g} "
          f"on panel {setup.config.detector.panels[brightest].name}")
    print(f"mean= {stats.mean:g} rms= {stats.rms:g} rmsd= {stats.rmsd:g}")
    scale = _intfile_scale(run, stats)
    detected, noisy_counts = _noise_images(image, setup, run)
    if detected is not None:
        print(f"{detected.total_photons:.0f} photons on noise image ({detected.overloads} overloads)")
        print(f"writing {run.noisefile} as NXmx (HDF5) of 16-bit ADU ({len(panels)} panels)")
        record = experiment_record(setup, run.seed, int(OVERLOAD_ADU), run.adc)
        write_nxmx(run.noisefile, [detected.adu.numpy()], np.array([record.phi_start_deg]), record, started,
                   datetime.datetime.now(datetime.timezone.utc))
    if run.nxmxfile:
        record = experiment_record(setup, run.seed if run.noise else None, run.saturation_counts, run.counts_pedestal)
        _write_processing_images(run, _processing_counts(image, setup, run, scale, noisy_counts), record, started)
    if run.p1_table_file and setup.p1_table is not None:
        print(f"writing {run.p1_table_file} as {len(setup.p1_table.reflections)} h k l F lines (the P1 table used)")
        write_hkl(run.p1_table_file, setup.p1_table.reflections)
    return 0


def _noise_images(image: np.ndarray, setup: Setup, run: RunOptions) -> tuple[DetectorImage | None, np.ndarray | None]:
    """The run's reads of one draw of the detector's noise (nanoBragg draws it once a run), so that its files hold
    the same counts: the -noisefile's detector image (nanoBragg's ADU: the -adc pedestal, clamped at 65535) and the
    int32 files' counts (no pedestal unless -adc is given, clamped at -saturation; docs/formats.md), each None
    where the run writes none."""
    readouts: dict[str, Readout] = {}
    if run.noisefile:
        response = setup.config.response
        readouts["noise"] = Readout(response.adc_offset_adu, wraps_negative=noise_image_wraps(setup.config))
    if run.noise and run.wants_counts:
        readouts["counts"] = Readout(run.counts_pedestal, run.saturation_counts)
    if not readouts:
        return None, None
    response = dataclasses.replace(setup.config.response, noise_seed=run.seed)
    read = dict(zip(readouts, detector_images(torch.from_numpy(image), response, layout_of(setup),
                                              list(readouts.values())), strict=True))
    return read.get("noise"), read["counts"].adu.numpy() if "counts" in read else None


def _intfile_scale(run: RunOptions, stats: ImageStatistics) -> float:
    """-scale, else nanoBragg's 55000 / max_I (1 for an empty image); printed, as nanoBragg prints it before
    writing the -intfile, only where an image of this scale is written: the -intfile, or the counts of -cbffile
    and -nxmxfile under -nonoise."""
    scale = run.intfile_scale if run.intfile_scale > 0 else (55000.0 / stats.max_I if stats.max_I > 0 else 1.0)
    if run.intfile or (run.wants_counts and not run.noise):
        print(f"intfile_scale = {scale:g}")
    return scale


def _processing_counts(image: np.ndarray, setup: Setup, run: RunOptions, scale: float,
                       noisy_counts: np.ndarray | None) -> np.ndarray:
    """The int32 files' counts: the noise image's when there is one (`noisy_counts`, `_noise_images`), else the
    -intfile image's (each panel's); clamped at -saturation, not at the SMV's 65535, and with no pedestal unless
    -adc is given (docs/formats.md)."""
    if noisy_counts is not None:
        return noisy_counts
    if setup.panels is not None:
        return panel_counts(panel_images(image, setup.config.detector.panels), setup, scale, run.counts_pedestal,
                            run.saturation_counts)
    return integer_image(image, setup, scale, run.counts_pedestal, run.saturation_counts)


def _write_processing_images(run: RunOptions, counts: np.ndarray, record: ExperimentRecord,
                             started: datetime.datetime) -> None:
    """The miniCBF and NXmx files of the counts (the noise image's when there is one, else the -intfile's),
    with a warning where pixels reach the saturation: processing programs leave those spots out."""
    saturated = int(np.count_nonzero(counts >= run.saturation_counts))
    if saturated:
        remedy = ("lower the fluence (-fluence, -flux, -exposure)" if run.noise else
                  "lower -scale (under -nonoise the counts are the -intfile image, its brightest pixel 55000 unless "
                  "-scale is given)")
        print(f"WARNING: {saturated} pixels at the saturation ({run.saturation_counts} counts, -saturation) of the "
              f"{' and '.join(n for n, f in (('miniCBF', run.cbffile), ('NXmx', run.nxmxfile)) if f)}: DIALS and "
              f"XDS leave overloaded spots out; {remedy} or raise -saturation to keep them")
    if run.cbffile:
        print(f"writing {run.cbffile} as a miniCBF of 4-byte integers")
        write_mini_cbf(run.cbffile, counts, record, started)
    if run.nxmxfile:
        print(f"writing {run.nxmxfile} as NXmx (HDF5)")
        write_nxmx(run.nxmxfile, [counts], np.array([record.phi_start_deg]), record, started,
                   datetime.datetime.now(datetime.timezone.utc))


def _report_compile_decision(renderer: Renderer) -> None:
    """Print what `auto` decided and, when it left kernels unbuilt, start building them for the next run
    (unless NBSIM_BACKGROUND_BUILD=off)."""
    decision = renderer.settle()
    if not decision.note:
        return
    if not decision.unbuilt:
        print(f"  {decision.note}")
        return
    started = os.environ.get("NBSIM_BACKGROUND_BUILD", "on") != "off" and renderer.build_missing_in_background()
    print(f"  {decision.note}; " + ("building it in the background for the next run" if started
                                    else "not built now (background builds off, or one is running)"))


def describe(setup: Setup) -> list[str]:
    """The setup summary nanoBragg prints before rendering (same quantities, similar wording)."""
    g = setup.geometry
    config = setup.config
    lattice = setup.lattice
    cell = lattice.cell_parameters()
    reciprocal = lattice.reciprocal_parameters()
    real = lattice.real_A.detach().numpy()
    recip = lattice.reciprocal_per_A.detach().numpy()
    sources = setup.sources
    shape_names = {"square": "parallelpiped", "round": "ellipsoidal", "gauss": "gaussian", "tophat": "tophat-spot"}
    lines = [f"nbsim {__version__}: nanoBragg-compatible diffraction simulator",
             f"{g.convention} convention selected.",
             "pivoting detector around " + ("sample" if g.pivot == "sample" else "direct beam spot"),
             "Unit Cell: " + " ".join(f"{v:g}" for v in cell),
             "Recp Cell: " + " ".join(f"{v:g}" for v in reciprocal),
             f"volume = {float(lattice.volume_A3):g} A^3",
             "real-space cell vectors (Angstrom):", "     a           b           c"]
    lines += [f"{axis}: " + " ".join(f"{v:11.8f}" for v in real[:, j]) for j, axis in enumerate("XYZ")]
    lines += ["reciprocal-space cell vectors (Angstrom^-1):", "     a_star      b_star      c_star"]
    lines += [f"{axis}: " + " ".join(f"{v:11.8f}" for v in recip[:, j]) for j, axis in enumerate("XYZ")]
    if lattice.misset_rad is not None and config.crystal.misset_random:
        lines.append("random orientation misset angles: "
                     + " ".join(f"{v * DEGREES_PER_RADIAN:f}" for v in lattice.misset_rad) + " deg")
    lines.append(f"  created a total of {sources.count} sources:")
    lines += [f"{p[0]:g} {p[1]:g} {p[2]:g}   {w:g} {float(lam) * 1e-10:g}"
              for p, w, lam in zip(sources.positions_m, sources.weights, sources.wavelength_A.detach(), strict=True)]
    lines += [
        f"  created a total of {setup.mosaic.count} mosaic domains",
        f"  {setup.grid.entries if setup.grid else 0} initialized hkls (all others ={config.structure.default_F:g})",
        *([f"  structure factors from {config.structure.model_file or config.structure.hkl_file} "
            f"{setup.p1_table.source}"] if setup.p1_table is not None and setup.p1_table.source else []),
        f"  {shape_names[config.crystal.shape]} xtal: {setup.n_cells[0]}x{setup.n_cells[1]}x{setup.n_cells[2]} cells",
        f"  structure factors: {setup.lookup}",
        f"  wave={float(config.beam.wavelength_A) * 1e-10:g} meters +/- {sources.dispersion.range * 100:g}% in "
        f"{sources.dispersion.steps} steps",
        "  polarization effect disabled" if config.beam.no_polarization
        else f"  Kahn polarization factor: {config.beam.kahn_polarization:f}",
        f"  incident fluence: {setup.fluence:g} photons/m^2",
        f"  distance={float(g.distance_m):g} detsize={g.detsize_f_m:g}x{g.detsize_s_m:g}  pixel={g.pixel_size_m:g} "
        f"meters ({g.pixels_f}x{g.pixels_s} pixels)",
        f"  sensor is {setup.sensor.thickness_m:g} m thick in {setup.sensor.layers} layers with mu= "
        f"{setup.sensor.mu_per_m:g}",
        f"  Xbeam={g.beam_x_m:g} Ybeam={g.beam_y_m:g}",
        f"  Fbeam={g.fbeam_m:g} Sbeam={g.sbeam_m:g}",
        f"  Xclose={g.close_x_m:g} Yclose={g.close_y_m:g}",
        f"  Fclose={g.fclose_m:g} Sclose={g.sclose_m:g}",
        "  DIRECTION_OF_DETECTOR_X-AXIS= " + " ".join(f"{float(v):g}" for v in g.fdet),
        "  DIRECTION_OF_DETECTOR_Y-AXIS= " + " ".join(f"{float(v):g}" for v in g.sdet),
        "  DIRECTION_OF_DETECTOR_Z-AXIS= " + " ".join(f"{float(v):g}" for v in g.odet),
        "  INCIDENT_BEAM_DIRECTION= " + " ".join(f"{float(v):g}" for v in g.beam),
        "  spindle ROTATION_AXIS= " + " ".join(f"{float(v):g}" for v in g.spindle),
        "  dials origin= " + " ".join(f"{v:g}" for v in g.dials_origin_mm),
        "  roi: {} < x < {} && {} < y < {}".format(*setup.roi),
        f"  {sources.divergence_points} divergence steps",
        f"  {sources.count} sources",
        f"  {setup.mosaic.count} mosaic domains over mosaic spread of "
        f"{float(setup.mosaic.spread_rad) * DEGREES_PER_RADIAN:g} degrees",
        f"  {setup.phi.steps} phi steps from {setup.phi.start_rad * DEGREES_PER_RADIAN:g} to "
        f"{(setup.phi.start_rad + setup.phi.osc_rad) * DEGREES_PER_RADIAN:g} degrees",
        f"  {setup.oversample}x{setup.oversample} pixel oversample steps",
        f"  {setup.steps} steps per pixel",
    ]
    for panel, p in zip(config.detector.panels or (), setup.panels or (), strict=True):
        vectors = " ".join(f"{name}= " + " ".join(f"{float(v):g}" for v in vector) for name, vector in
                           (("pix0", p.pix0_m), ("fdet", p.fdet), ("sdet", p.sdet), ("odet", p.odet)))
        lines.append(f"  panel {panel.name}: {p.pixels_f}x{p.pixels_s} pixels of {p.pixel_size_m:g} m, {vectors}")
    return lines


def _check_printout_pixel(setup: Setup, fast: int, slow: int) -> None:
    """Refuse a -printout_pixel off the detector as soon as its pixel counts are known, before the render."""
    if not (0 <= fast < setup.geometry.pixels_f and 0 <= slow < setup.geometry.pixels_s):
        raise NbsimError(f"-printout_pixel {fast} {slow} is outside the {setup.geometry.pixels_f}x"
                         f"{setup.geometry.pixels_s} detector")


def _print_trace(renderer: Renderer, setup: Setup, fast: int, slow: int) -> None:
    """The last step's values of one pixel, as nanoBragg prints them; a pixel it skips (outside -roi, or
    zero in -mask) gets a warning instead, as the C prints no trace for it."""
    first_fast, last_fast, first_slow, last_slow = setup.roi
    if not (first_fast <= fast <= last_fast and first_slow <= slow <= last_slow):
        print(f"WARNING: -printout_pixel {fast} {slow} is outside the -roi: not rendered, no trace (as in nanoBragg)")
        return
    if setup.mask is not None and not setup.mask[slow, fast]:
        print(f"WARNING: -printout_pixel {fast} {slow} is masked: not rendered, no trace (as in nanoBragg)")
        return
    value, trace = renderer.trace(slow, fast)
    print(f"{fast:4d} {slow:4d} :")
    print("hkl= {:f} {:f} {:f}  hkl0= {:d} {:d} {:d}".format(*trace.hkl, *trace.hkl0))
    print(f" F_cell={trace.f_cell:g}  F_latt={trace.f_latt:g}   I = {trace.intensity:g}")
    print(f"I/steps {trace.intensity / setup.steps:15.10g}")
    print(f"polar   {trace.polar:15.10g}")
    print(f"omega   {trace.omega:15.10g}")
    print(f"capfrac {trace.capture:15.10g}")
    print(f"pixel   {float(value):15.10g}")

