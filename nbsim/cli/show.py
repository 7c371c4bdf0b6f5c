"""`nbsim show -- <nanoBragg options>`: what a command resolves to, without rendering its image: the
detector, the steps per pixel by kind, the kernel structure and whether its kernels are cached, and the
time the compile policy's cost model expects (nbsim.kernel.policy). `nbsim show --options` lists the
simulator options a sweep's `extra` axes and `SimulationConfig.with_options` take."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import SimulationConfig
from ..errors import NbsimError
from ..modes import Compile
from ..nanobragg.arguments import RunOptions
from ..nanobragg.presets import detector_model

if TYPE_CHECKING:
    from ..resolve import Setup

USAGE = """usage: nbsim show [--] <nanoBragg options>   (what the command resolves to, nothing rendered)
       nbsim show --options                  (the simulator options, for sweep.extra and with_options)"""


def main(argv: list[str], checked_arguments: Callable[[list[str]], tuple[SimulationConfig, RunOptions]]) -> int:
    """`nbsim show ...`; `checked_arguments` is the command line's own parse and checks (nbsim.cli)."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv and argv[0] == "--options":
        if argv[1:]:
            raise NbsimError(f"show --options takes no arguments (got {' '.join(argv[1:])})")
        print("\n".join(option_lines()))
        return 0
    arguments = argv[1:] if argv and argv[0] == "--" else argv
    if not arguments:
        raise NbsimError("show needs the nanoBragg options of a command: nbsim show -- <options>")
    config, run = checked_arguments(arguments)
    lines = show_lines(config, run.device, run.dtype, run.compile, run.sensor_attenuation_source)
    if run.detector_model is not None:
        title = detector_model(run.detector_model).title
        lines.insert(0, f"detector model: {run.detector_model} ({title}): {' '.join(run.detector_model_flags)} "
                        "(flags given override these)")
    print("\n".join(lines))
    return 0


def option_lines() -> list[str]:
    """One line per simulator option: its name, the configuration part holding it and its type as
    nbsim.config annotates it (Scalar: a number or a 0-d tensor that may carry gradients)."""
    from ..config import option_parts

    return [f"{field.name:<28} {part.__name__:<22} {field.type}"
            for part in option_parts() for field in dataclasses.fields(part)]


def show_lines(config: SimulationConfig, device_name: str, dtype_name: str, compile: Compile,
               attenuation_source: str | None = None) -> list[str]:
    """What `config` resolves to on a device and dtype under a compile setting (see the module);
    `attenuation_source`: where the command line took the sensor's attenuation length from."""
    from ..devices import resolve_device, resolve_dtype
    from ..kernel.policy import COMPILED_SPEEDUP, plan_compile
    from ..render import Renderer
    from ..resolve import config_sampling_advice, resolve, sampling_warnings

    device, dtype = resolve_device(device_name), resolve_dtype(dtype_name)
    setup = resolve(config)
    renderer = Renderer(setup, device=device, dtype=dtype, compile=compile)
    xmin, xmax, ymin, ymax = setup.roi
    pixels = (xmax - xmin + 1) * (ymax - ymin + 1) if setup.mask is None else int(
        setup.mask[ymin:ymax + 1, xmin:xmax + 1].sum())
    sources, mosaic, phi, layers = (setup.sources.count, setup.mosaic.count, setup.phi.steps, setup.sensor.layers)
    subpixels = setup.oversample ** 2
    plan, cache = renderer.plan, renderer.cache
    variants = plan.structure.stage_variants()
    missing = cache.missing(plan.structure, dtype, device)
    build_s = plan_compile(Compile.AUTO, device, dtype, False, plan.structure, cache).estimated_build_s
    eager_s = renderer.eager_estimate_s()
    advice = config_sampling_advice(config)
    compiled_s = eager_s / COMPILED_SPEEDUP
    lines = [
        f"detector: {setup.shape[1]} x {setup.shape[0]} pixels (fast x slow), {pixels} rendered, pixel "
        f"{setup.geometry.pixel_size_m * 1e3:g} mm",
        f"steps per pixel: {renderer.steps_per_pixel} = {sources} source(s) x {mosaic} mosaic domain(s) x {phi} "
        f"phi step(s) x {layers} sensor layer(s) x {subpixels} sub-pixel(s)",
        *detector_lines(config, setup, attenuation_source),
        f"oversample: {setup.oversample} ({'-oversample' if config.detector.oversample else 'automatic'})",
        f"sampling advice: {advice.phi_steps} phi step(s), {advice.mosaic_domains} mosaic domain(s) (narrowest spot "
        f"{advice.spot_width_deg:.3g} deg wide at {advice.d_min_A:.3g} A; rendering {phi} and {mosaic}, "
        f"-sampling {config.crystal.sampling})",
        *(f"  warning: {line}" for line in sampling_warnings(advice, phi, mosaic)),
        f"sources: {sources} = {setup.sources.divergence_points} divergence point(s) x "
        f"{setup.sources.dispersion.steps} wavelength(s)",
        *physics_lines(setup),
        f"kernel structure: {plan.structure.name}",
        f"kernels ({dtype_name}, {device}) in {cache.kernels}: " + (
            f"all {len(variants)} cached" if not missing else
            f"{len(missing)} of {len(variants)} not cached ({', '.join(v.stage.name for v in missing)})"),
        f"compile {compile.value}: " + (f"{plan.mode.value}" if plan.pending is None else
                                        f"eager, or {plan.pending.value} if building first pays"),
        f"expected render: eager {eager_s:.3g} s (from an eager probe of the first rows), compiled "
        f"{compiled_s:.3g} s (eager / {COMPILED_SPEEDUP:g}, the policy's assumption)" + (
            f"; building the kernels first {build_s:.0f} s" if build_s else ""),
    ]
    return lines


def detector_lines(config: SimulationConfig, setup, attenuation_source: str | None = None) -> list[str]:
    """The modules and their gaps, the sensor (its attenuation length, and where that came from when known)
    and the detector response, as the command resolved them."""
    detector, response = config.detector, config.response
    lines = []
    if detector.module_size_px is not None:
        gap_pixels = 0 if setup.gaps is None else int(setup.gaps.sum())
        lines.append(f"modules: {detector.module_size_px[0]} x {detector.module_size_px[1]} pixels, gaps "
                     f"{detector.module_gap_px[0]} x {detector.module_gap_px[1]} pixels ({gap_pixels} gap pixels, "
                     "not rendered)")
    sensor = setup.sensor
    if sensor.thickness_m > 0:
        length = f"{1e6 / sensor.mu_per_m:.4g} um" if sensor.mu_per_m > 0 else "inf"
        source = f": {attenuation_source}" if attenuation_source else ""
        lines.append(f"sensor: {detector.sensor_material} {sensor.thickness_m * 1e6:g} um in {sensor.layers} layers, "
                     f"attenuation length {length}{source}")
    psf = "none" if response.psf == "none" else f"{response.psf} {response.psf_fwhm_um:g} um FWHM"
    lines.append(f"response: point spread {psf}, pedestal (-adc) {response.adc_offset_adu:g} ADU")
    return lines


def physics_lines(setup: Setup) -> list[str]:
    """The physics switch, the background and the structure-factor channels a command resolves to."""
    config = setup.config
    note = "" if config.corrected else " (nanoBragg's image, defects included; -physics corrected fixes them)"
    lines = [f"physics: {config.physics.physics}{note}"]
    beam = config.beam
    if setup.background_curve is not None:
        what = f"-background {beam.background}" if beam.background else "-water (corrected: constant F 2.57)"
        lines.append(f"background: {what}, {setup.background_curve.scale:.6g} photons per e^2 per sr, once per pixel")
    if setup.channel_grids:
        energies = setup.channels.energies_eV
        lines.append(f"structure factors: {len(setup.channel_grids)} anomalous table(s), {energies.min():.6g} to "
                     f"{energies.max():.6g} eV, {setup.channel_grids[0].entries} reflections each")
    return lines
