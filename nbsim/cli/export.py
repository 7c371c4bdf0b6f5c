"""`nbsim export`: a sweep's rotation series (the images of one detector size in a scenario's `sweep.zarr`,
one value on every axis but one) as one NXmx file with every frame and its ω, and a numbered miniCBF set.
Help and argument errors are answered without importing torch.

The frames are the -intfile images nanoBragg would write, with one scale for the whole series (55000 over
the brightest pixel of any frame, unless --scale) so that frames compare; each frame's ω is its point's φ.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import replace
from pathlib import Path

from ..errors import NbsimError
from ..io.paths import check_writable

USAGE = """usage: nbsim export SWEEP_ZARR [--size N] [--nxmx FILE] [--cbf PREFIX] [--scale S] [--adc A]

Writes the rotation series in a scenario's sweep.zarr (one value on every axis but the rotated one, e.g.
phi) as one NXmx file (--nxmx) and/or miniCBF files PREFIX_00001.cbf, PREFIX_00002.cbf, ... (--cbf).
The counts are the -intfile images (one scale for the series: --scale, default 55000 over the brightest
pixel); each frame's omega is its point's -phi. See docs/formats.md."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise NbsimError(f"export: {message}; see nbsim export -h")


def main(argv: list[str]) -> int:
    """`nbsim export`: a sweep's -phi series as one NXmx file and numbered miniCBFs; the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    parser = _Parser(prog="nbsim export", add_help=False)
    parser.add_argument("store", type=Path)
    parser.add_argument("--size", type=int)
    parser.add_argument("--nxmx", type=Path)
    parser.add_argument("--cbf", type=Path)
    parser.add_argument("--scale", type=float, default=0.0)
    parser.add_argument("--adc", type=float, default=40.0)
    options = parser.parse_args(argv)
    if options.nxmx is None and options.cbf is None:
        raise NbsimError("export: nothing to write; give --nxmx FILE and/or --cbf PREFIX")
    for path in (options.nxmx, options.cbf):
        if path is not None:
            check_writable(path)
    export_series(options.store, options.size, options.nxmx, options.cbf, options.scale, options.adc)
    return 0


def _series(store: Path, size: int | None):
    """The (frame, slow, fast) images of one size and each frame's point attributes."""
    from ..sweep.store import read_store

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
    return images, attributes


def _check_rotation_series(store: Path, configs: list, omega_deg) -> None:
    """The frames must differ only in their start angle, each the last one's plus the oscillation (a scan
    DIALS reads); anything else is not one rotation series."""
    import numpy as np

    first = configs[0]
    if any(replace(config, crystal=replace(config.crystal, phi_start_deg=first.crystal.phi_start_deg)) != first
           for config in configs[1:]):
        raise NbsimError(f"{store}: not one rotation series: the frames differ in more than -phi")
    osc_deg = first.crystal.osc_range_deg or 0.0
    if len(omega_deg) > 1 and not np.allclose(np.diff(omega_deg), osc_deg, rtol=1e-6, atol=1e-9):
        raise NbsimError(f"{store}: not one rotation series: -phi steps of {np.diff(omega_deg)[0]:g} deg, but "
                         f"each frame oscillates {osc_deg:g} deg (-osc)")


def export_series(store: Path, size: int | None, nxmx_path: Path | None, cbf_prefix: Path | None,
                  scale: float, adc: float) -> None:
    """Write the series in `store` as NXmx and/or numbered miniCBF files (see the module's docstring)."""
    import numpy as np

    from ..config import SimulationConfig
    from ..io.detector_images import write_mini_cbf, write_nxmx
    from ..setup import resolve
    from ..sweep.spec import dataclass_from_dict
    from .products import experiment_record, integer_image

    started = datetime.datetime.now(datetime.timezone.utc)
    images, attributes = _series(store, size)
    frames = images.shape[0]
    points = [json.loads(str(value)) if str(value) else {} for value in attributes.values.reshape(-1)]
    if any(point.get("status") != "ok" or not point.get("config") for point in points):
        raise NbsimError(f"{store}: a frame has no image (its point failed or was skipped)")
    configs = [dataclass_from_dict(SimulationConfig, point["config"]) for point in points]
    omega_deg = np.array([config.crystal.phi_start_deg for config in configs], dtype=np.float64)
    _check_rotation_series(store, configs, omega_deg)
    setup = resolve(configs[0])
    if scale <= 0:
        brightest = max(float(np.nanmax(images[frame].values)) for frame in range(frames))
        scale = 55000.0 / brightest if brightest > 0 else 1.0

    def counts(frame: int) -> np.ndarray:
        return integer_image(np.asarray(images[frame].values, dtype=np.float32), setup, scale, adc)

    record = experiment_record(setup, noise_seed=None)
    print(f"exporting {frames} frames of {images.shape[-1]}x{images.shape[-2]} pixels, omega "
          f"{omega_deg[0]:g} to {omega_deg[-1]:g} deg, intfile_scale = {scale:g}")
    if cbf_prefix is not None:
        for frame in range(frames):
            path = cbf_prefix.with_name(f"{cbf_prefix.name}_{frame + 1:05d}.cbf")
            write_mini_cbf(path, counts(frame), replace(record, phi_start_deg=float(omega_deg[frame])), started)
        print(f"wrote {cbf_prefix}_00001.cbf .. {cbf_prefix}_{frames:05d}.cbf")
    if nxmx_path is not None:
        write_nxmx(nxmx_path, (counts(frame) for frame in range(frames)), omega_deg, record, started,
                   datetime.datetime.now(datetime.timezone.utc))
        print(f"wrote {nxmx_path} (NXmx, {frames} frames)")
