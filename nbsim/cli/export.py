"""`nbsim export`: a sweep's rotation series (the images of one detector size in a scenario's `sweep.zarr`,
one value on every axis but one) as one NXmx file with every frame and its ω, and a numbered miniCBF set;
noiseless, and with the detector's noise (each frame its own seed, written in its records) as well.
Help and argument errors are answered without importing torch.

The noiseless frames are the -intfile images nanoBragg would write, with one scale for the whole series (55000
over the brightest pixel of any frame, unless --scale) so that frames compare; the noise frames are the
detector's counts of the photons themselves (the points' detector response, -noisefile's). Both are int32
counts as -cbffile writes them: no pedestal unless --adc, clamped at --saturation. Each frame's ω is its
point's φ.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import INT32_MAX_COUNT
from ..errors import NbsimError
from ..io.paths import check_writable
from .options import CommandParser

USAGE = """usage: nbsim export SWEEP_ZARR [--size N] [--nxmx FILE] [--cbf PREFIX] [--noise-nxmx FILE]
                    [--noise-cbf PREFIX] [--seed N] [--scale S] [--adc A] [--saturation COUNTS]

Writes the rotation series in a scenario's sweep.zarr (one value on every axis but the rotated one, e.g.
phi) as one NXmx file (--nxmx) and/or miniCBF files PREFIX_00001.cbf, PREFIX_00002.cbf, ... (--cbf):
the -intfile images (one scale for the series: --scale, default 55000 over the brightest pixel). With
--noise-nxmx and --noise-cbf, the same with the detector's noise (the points' detector response): frame k
drawn with seed N + k - 1 (--seed N, default the points' noise seed, else the clock), written in its
header. Counts are int32: no pedestal unless --adc A, none above --saturation (default 2147483647).
Each frame's omega is its point's -phi. See docs/formats.md."""


def main(argv: list[str]) -> int:
    """`nbsim export`: a sweep's -phi series as one NXmx file and numbered miniCBFs; the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    parser = CommandParser("export", "; see nbsim export -h", prog="nbsim export", add_help=False)
    parser.add_argument("store", type=Path)
    parser.add_argument("--size", type=int)
    parser.add_argument("--nxmx", type=Path)
    parser.add_argument("--cbf", type=Path)
    parser.add_argument("--noise-nxmx", type=Path)
    parser.add_argument("--noise-cbf", type=Path)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--scale", type=float, default=0.0)
    parser.add_argument("--adc", type=float, default=0.0)
    parser.add_argument("--saturation", type=int, default=INT32_MAX_COUNT)
    options = parser.parse_args(argv)
    files = SeriesFiles(options.nxmx, options.cbf, options.noise_nxmx, options.noise_cbf)
    if files == SeriesFiles():
        raise NbsimError("export: nothing to write; give --nxmx FILE, --cbf PREFIX, --noise-nxmx FILE and/or "
                         "--noise-cbf PREFIX")
    if not 0 < options.saturation <= INT32_MAX_COUNT:
        raise NbsimError(f"export: --saturation must be from 1 to {INT32_MAX_COUNT}, got {options.saturation}")
    for path in (files.nxmx, files.cbf_prefix, files.noise_nxmx, files.noise_cbf_prefix):
        if path is not None:
            check_writable(path)
    export_series(options.store, options.size, files, CountOptions(options.scale, options.adc, options.saturation,
                                                                   options.seed))
    return 0


@dataclass(frozen=True)
class SeriesFiles:
    """What `nbsim export` writes: NXmx files and miniCBF prefixes, noiseless and with noise (None: not)."""

    nxmx: Path | None = None
    cbf_prefix: Path | None = None
    noise_nxmx: Path | None = None
    noise_cbf_prefix: Path | None = None


@dataclass(frozen=True)
class CountOptions:
    """How the frames become int32 counts: the noiseless frames' scale (0: 55000 over the brightest pixel),
    the pedestal, the saturation, and the first noise frame's seed (None: the points', else the clock)."""

    scale: float = 0.0
    pedestal: float = 0.0
    saturation: int = INT32_MAX_COUNT
    seed: int | None = None


def _series(store: Path, size: int | None):
    """The (frame, slow, fast) images of one size, each frame's point attributes and the axis the frames are
    along (None for one frame)."""
    from ..sweep.store import read_store

    if not store.exists():
        raise NbsimError(f"{store}: no such file or folder (a sweep's results/SCENARIO/sweep.zarr)")
    if not (store / "zarr.json").is_file():
        raise NbsimError(f"{store}: not a sweep.zarr store")
    dataset = read_store(store)
    sizes = [int(s) for s in dataset["size"].values]
    if size is None and len(sizes) == 1:
        size = sizes[0]
    if size not in sizes:
        raise NbsimError(f"{store}: choose a detector size with --size (it holds {', '.join(map(str, sizes))})")
    images = dataset["image"].sel(size=size).isel(slow=slice(0, size), fast=slice(0, size))
    varying = [dim for dim in images.dims[:-2] if images.sizes[dim] > 1]
    if len(varying) > 1:
        raise NbsimError(f"{store}: not one rotation series: {', '.join(varying)} all vary")
    fixed = [dim for dim in images.dims[:-2] if dim not in varying]
    images, attributes = images.squeeze(fixed), dataset["attributes"].sel(size=size).squeeze(fixed)
    if not varying:
        images, attributes = images.expand_dims("frame"), attributes.expand_dims("frame")
    return images, attributes, (varying[0] if varying else None)


def _check_rotation_series(store: Path, configs: list, omega_deg, axis: str | None) -> None:
    """The frames (along `axis`) must differ only in their start angle, each the last one's plus the
    oscillation (a scan DIALS reads); anything else, stills along another axis too, is not one rotation
    series."""
    import numpy as np

    first = configs[0]
    if any(replace(config, crystal=replace(config.crystal, phi_start_deg=first.crystal.phi_start_deg)) != first
           for config in configs[1:]):
        raise NbsimError(f"{store}: not one rotation series: the frames differ in more than -phi")
    osc_deg = first.crystal.osc_range_deg or 0.0
    if len(omega_deg) > 1 and osc_deg == 0:
        raise NbsimError(f"{store}: not one rotation series: {len(omega_deg)} frames along {axis}, none rotated "
                         "(-osc 0)")
    if len(omega_deg) > 1 and not np.allclose(np.diff(omega_deg), osc_deg, rtol=1e-6, atol=1e-9):
        raise NbsimError(f"{store}: not one rotation series: -phi steps of {np.diff(omega_deg)[0]:g} deg, but "
                         f"each frame oscillates {osc_deg:g} deg (-osc)")


def export_series(store: Path, size: int | None, files: SeriesFiles, options: CountOptions) -> None:
    """Write the series in `store` as `files` say (see the module's docstring)."""
    import numpy as np
    import torch

    from ..config import SimulationConfig
    from ..detector import detector_image, layout_of
    from ..io.detector_images import write_mini_cbf, write_nxmx
    from ..resolve import resolve
    from ..sweep.spec import dataclass_from_dict
    from .products import experiment_record, integer_image

    started = datetime.datetime.now(datetime.timezone.utc)
    images, attributes, axis = _series(store, size)
    frames = images.shape[0]
    points = [json.loads(str(value)) if str(value) else {} for value in attributes.values.reshape(-1)]
    if any(point.get("status") != "ok" or not point.get("config") for point in points):
        raise NbsimError(f"{store}: a frame has no image (its point failed or was skipped)")
    configs = [dataclass_from_dict(SimulationConfig, point["config"]) for point in points]
    omega_deg = np.array([config.crystal.phi_start_deg for config in configs], dtype=np.float64)
    _check_rotation_series(store, configs, omega_deg, axis)
    setup = resolve(configs[0])
    scale = options.scale
    if scale <= 0:
        brightest = max(float(np.nanmax(images[frame].values)) for frame in range(frames))
        scale = 55000.0 / brightest if brightest > 0 else 1.0
    first_seed = options.seed
    if first_seed is None:
        first_seed = configs[0].response.noise_seed
    if first_seed is None:
        first_seed = int(time.time())

    def photons(frame: int) -> np.ndarray:
        return np.asarray(images[frame].values, dtype=np.float32)

    def counts(frame: int) -> np.ndarray:
        return integer_image(photons(frame), setup, scale, options.pedestal, options.saturation)

    def noise_counts(frame: int) -> np.ndarray:
        response = replace(configs[frame].response, noise_seed=first_seed + frame, adc_offset_adu=options.pedestal)
        return detector_image(torch.from_numpy(photons(frame)), response, layout_of(setup),
                              saturation_adu=options.saturation).adu.numpy()

    noise_free = files.nxmx is not None or files.cbf_prefix is not None
    print(f"exporting {frames} frames of {images.shape[-1]}x{images.shape[-2]} pixels, omega "
          f"{omega_deg[0]:g} to {omega_deg[-1]:g} deg" + (f", intfile_scale = {scale:g}" if noise_free else ""))
    noise_seeds = f"noise seed of frame k: {first_seed} + k - 1"
    if files.noise_nxmx is not None or files.noise_cbf_prefix is not None:
        print(f"noise frames drawn with seeds {first_seed} .. {first_seed + frames - 1} ({noise_seeds})")

    def frames_written(noise: bool, prefix: Path | None):
        """Each frame's counts (drawn once for both files of a kind), its miniCBF written on the way."""
        for frame in range(frames):
            frame_counts = (noise_counts if noise else counts)(frame)
            if prefix is not None:
                record = experiment_record(setup, first_seed + frame if noise else None, options.saturation,
                                           options.pedestal)
                write_mini_cbf(prefix.with_name(f"{prefix.name}_{frame + 1:05d}.cbf"), frame_counts,
                               replace(record, phi_start_deg=float(omega_deg[frame])), started)
            yield frame_counts

    kinds = ((False, files.cbf_prefix, files.nxmx), (True, files.noise_cbf_prefix, files.noise_nxmx))
    for noise, prefix, path in kinds:
        if path is not None:
            record = experiment_record(setup, first_seed if noise else None, options.saturation, options.pedestal)
            if noise:
                record = replace(record, notes=(*record.notes, noise_seeds))
            write_nxmx(path, frames_written(noise, prefix), omega_deg, record, started,
                       datetime.datetime.now(datetime.timezone.utc))
        elif prefix is not None:
            for _ in frames_written(noise, prefix):
                pass
        if prefix is not None:
            print(f"wrote {prefix}_00001.cbf .. {prefix}_{frames:05d}.cbf" + (" (with noise)" if noise else ""))
        if path is not None:
            print(f"wrote {path} (NXmx, {frames} frames{', with noise' if noise else ''})")
