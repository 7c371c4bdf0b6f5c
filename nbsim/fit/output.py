"""What a fit reports: the JSON other tools read, the refined model as nanoBragg flags (so `nbsim`
re-renders it), the refined detector as a panel list, the refined experiments for a DIALS experiment list,
and a picture of observed, model and residual counts on the fitted pixels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..config import PanelConfig
from ..io.atomic import atomic_write_with
from ..io.dials_experiments import ExperimentStart, PanelPlacement, RefinedExperiment
from ..model.geometry import DetectorGeometry, panel_config
from ..nanobragg.flags import FLAGS, WAVELENGTH_FLAGS
from ..resolve import R_E_SQR_M2
from .model import DiffractionModel
from .panels import MOVE_SIZE, PanelGroups, panel_names
from .parameters import rotation_matrix, rotation_vector
from .refine import FitResult

REPLACED_FLAGS = ("-cell", "-mat", "-misset", "-misset_seed", "-N", "-Na", "-Nb", "-Nc", "-xtal_size", "-xtalsize",
                  "-sample_size", "-samplesize", "-xtal_thick", "-xtal_x", "-sample_thick", "-sample_x",
                  "-xtal_width", "-xtal_y", "-sample_width", "-sample_y", "-xtal_depth", "-xtal_z",
                  "-sample_depth", "-sample_z", "-mosaic", "-mosaicity", "-mosaic_spread", "-distance",
                  "-close_distance", "-Xbeam", "-Ybeam", *WAVELENGTH_FLAGS, "-fluence", "-flux", "-exposure",
                  "-beamsize", "-spectrum_shift", "-spectrum_stretch")
"""Flags a refined model replaces (whichever of them the start gave)."""


def misset_deg(rotation: torch.Tensor) -> list[float]:
    """Angles (x, y, z; degrees) of nanoBragg's -misset for a rotation U = Rz·Ry·Rx (rotations about x,
    then y, then z, as nanoBragg's rotate())."""
    u = rotation.detach().to(torch.float64)
    angle_y = math.asin(max(-1.0, min(1.0, -float(u[2, 0]))))
    angle_x = math.atan2(float(u[2, 1]), float(u[2, 2]))
    angle_z = math.atan2(float(u[1, 0]), float(u[0, 0]))
    return [math.degrees(angle) for angle in (angle_x, angle_y, angle_z)]


def without_flags(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """`argv` less the flags in `names` and their values (-cell takes 6, -misset 1 or 3)."""
    kept, index = [], 0
    while index < len(argv):
        flag = argv[index]
        if flag in names:
            if flag == "-cell":
                count = 6
            elif flag == "-misset":
                count = 1 if index + 1 < len(argv) and argv[index + 1] == "random" else 3
            else:
                count = len(FLAGS.get(flag, ()))
            index += 1 + count
            continue
        kept.append(flag)
        index += 1
    return kept


def _numbers(values) -> list[str]:
    return [f"{float(v):.10g}" for v in values]


def refined_flags(result: FitResult, image: int, argv: Sequence[str], panel_file: str | None = None) -> list[str]:
    """The image's starting flags with the refined crystal, beam and detector in place (`model_flags` at the
    fit's optimum)."""
    values = {name: value.detach() for name, value in result.model.natural()[image].items()}
    return model_flags(result.model, image, values, argv, panel_file)


def model_flags(model: DiffractionModel, image: int, values: dict[str, torch.Tensor], argv: Sequence[str],
                panel_file: str | None = None) -> list[str]:
    """An image's starting flags with its model's crystal, beam and detector at `values` (the model's natural
    quantities) in place: N rounded to whole cells (nanoBragg's -N is an integer; the JSON keeps the refined value);
    a multi-panel detector is placed by its -panelfile, `panel_file` where given (the refined detector written by
    write_panel_file)."""
    setup = model.setups[image]
    rotation = rotation_matrix(values["orientation"]) @ model.start_rotations[image]
    cell = model.cell(image, values)
    fluence = setup.fluence * float(values["scale"][0])
    flags = without_flags(argv, REPLACED_FLAGS)
    flags += ["-cell", *_numbers(cell), "-misset", *_numbers(misset_deg(rotation))]
    flags += [item for axis, n in zip(("-Na", "-Nb", "-Nc"), values["N"], strict=True)
              for item in (axis, str(max(1, round(float(n)))))]
    spread = float(values["mosaic"][0])
    if spread > 0:
        flags += ["-mosaic", *_numbers([spread])]
    if setup.panels is None:
        flags += ["-distance", *_numbers(values["distance"]), "-Xbeam", *_numbers(values["beam"][:1]),
                  "-Ybeam", *_numbers(values["beam"][1:])]
    elif panel_file is not None:
        flags = [*without_flags(flags, ("-panelfile",)), "-panelfile", panel_file]
    flags += ["-lambda", *_numbers(values["wavelength"]), "-fluence", f"{fluence:.10g}"]
    if "-spectrumfile" in flags:
        flags += ["-spectrum_shift", *_numbers(values["spectrum"][:1]), "-spectrum_stretch",
                  *_numbers(values["spectrum"][1:])]
    return flags


def model_values_json(model: DiffractionModel, image: int, values: dict[str, torch.Tensor]) -> dict:
    """What a shot's JSON says of its model at `values` (the model's natural quantities; docs/fitting.md): the A
    matrix (rows a*, b*, c* in Å⁻¹ at φ = 0, nanoBragg's lab frame), cell, N, scale, mosaic spread, wavelength, a
    single panel's distance and beam centre, and a spectrum's shift and stretch (`spectrum`, where there is one)."""
    found = {"A_matrix": model.a_matrix(image, values).tolist(), "cell": model.cell(image, values).tolist(),
             "N": values["N"].tolist(), "scale": float(values["scale"][0]),
             "mosaic_spread_deg": float(values["mosaic"][0]), "wavelength_A": float(values["wavelength"][0])}
    setup = model.setups[image]
    if setup.panels is None:
        found.update(distance_mm=float(values["distance"][0]), beam_x_mm=float(values["beam"][0]),
                     beam_y_mm=float(values["beam"][1]))
    if setup.config.beam.spectrum is not None:
        found["spectrum"] = {"shift_eV": float(values["spectrum"][0]), "stretch": float(values["spectrum"][1])}
    return found


def _reported(model, image: int, internal: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reported quantities of one image as functions of the internal coordinates (for the sigmas)."""
    values = model.natural(internal)[image]
    return {"cell": model.cell(image, values), "N": values["N"], "scale": values["scale"],
            "mosaic_spread_deg": values["mosaic"], "orientation_deg": torch.rad2deg(values["orientation"]),
            "distance_mm": values["distance"], "beam_mm": values["beam"], "wavelength_A": values["wavelength"],
            "spectrum": values["spectrum"]}


def standard_errors(result: FitResult, image: int) -> dict[str, list[float]]:
    """Standard errors of the reported quantities of one image: the internal covariance carried through the
    Jacobian of the reparametrisation (None-free: NaN where there is no covariance)."""
    model = result.model
    point = model.internal.detach().clone()
    names = list(_reported(model, image, point))
    sizes = [v.numel() for v in _reported(model, image, point).values()]
    if result.covariance is None or not model.size:
        return {name: [math.nan if result.covariance is None and _refined(model, name) else 0.0] * size
                for name, size in zip(names, sizes, strict=True)}

    def flat(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in _reported(model, image, x).values()])

    jacobian = torch.autograd.functional.jacobian(flat, point)
    variance = torch.einsum("ij,jk,ik->i", jacobian, result.covariance, jacobian).clamp(min=0.0)
    sigma = torch.sqrt(variance).tolist()
    out, start = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = sigma[start:start + size]
        start += size
    return out


def _refined(model, name: str) -> bool:
    own = {"cell": "cell", "N": "N", "scale": "scale", "mosaic_spread_deg": "mosaic", "orientation_deg": "orientation",
           "distance_mm": "distance", "beam_mm": "beam", "wavelength_A": "wavelength", "spectrum": "spectrum"}
    return own[name] in model.refine


def fit_json(result: FitResult, argv_per_image: Sequence[Sequence[str]],
             experiments: Sequence[int] | None = None, panel_file: str | None = None) -> dict:
    """The fit as the JSON contract (docs/fitting.md): per shot the A matrix (rows a*, b*, c* in Å⁻¹ at
    φ = 0, nanoBragg's lab frame), cell, N, scale, mosaic spread and their standard errors, a shot with a
    spectrum its shift and stretch, and the DIALS experiment it started from (`experiments`, each shot's number
    in the --expt list); the detector (a single panel's distance and beam centre, or a multi-panel detector's
    panels and each refined group's move); the outcome. `panel_file`: where the refined detector was written (the
    flags place the panels by it)."""
    model = result.model
    natural = [{name: value.detach() for name, value in image_values.items()} for image_values in model.natural()]
    sigmas = [standard_errors(result, image) for image in range(len(result.images))]
    shots = []
    for image, fit_image in enumerate(result.images):
        values, sigma = natural[image], sigmas[image]
        described = model_values_json(model, image, values)
        spectrum = described.pop("spectrum", None)
        shots.append({
            "image": fit_image.name,
            **described,
            "pixels": result.boxes[image].count,
            "shoeboxes": len(result.boxes[image].centres),
            "flags": model_flags(model, image, values, argv_per_image[image], panel_file),
            "sigma": {"A_rotation_deg": sigma["orientation_deg"], "cell": sigma["cell"], "N": sigma["N"],
                      "scale": sigma["scale"][0], "mosaic_spread_deg": sigma["mosaic_spread_deg"][0],
                      "wavelength_A": sigma["wavelength_A"][0]},
        })
        if spectrum is not None:
            shots[-1]["spectrum"] = {**spectrum, "sigma": {"shift_eV": sigma["spectrum"][0],
                                                           "stretch": sigma["spectrum"][1]}}
        if experiments is not None:
            shots[-1]["experiment"] = experiments[image]
    first, detector_values = sigmas[0], natural[0]
    shared = [name for name in model.shared if name in ("distance", "beam", "panels", "wavelength")]
    if model.setups[0].panels is None:
        detector = {"distance_mm": float(detector_values["distance"][0]),
                    "beam_x_mm": float(detector_values["beam"][0]), "beam_y_mm": float(detector_values["beam"][1]),
                    "shared": shared,
                    "sigma": {"distance_mm": first["distance_mm"][0], "beam_x_mm": first["beam_mm"][0],
                              "beam_y_mm": first["beam_mm"][1]}}
    else:
        detector = {"panels": panel_names(model.setups[0]), "shared": shared}
        if model.groups is not None:
            detector["groups"] = panel_group_moves(result)
    return {"shots": shots, "detector": detector, "converged": result.converged, "reason": result.reason,
            "iterations": result.iterations, "seconds": round(result.seconds, 3), "pixels": result.pixels,
            "negative_log_likelihood": result.nll, "refined": list(model.refine), "shared": list(model.shared),
            "restraints": dict(result.restraints), "photon_scale_per_unit": R_E_SQR_M2}


def panel_group_moves(result: FitResult) -> list[dict]:
    """Each refined panel group's move from the detector the fit started with (the first image's): its panels, its
    centre there (mm, lab frame), the shift of that centre (mm) and the rotation vector about it (degrees), as
    the refined panels lie (however many stages moved them), and their standard errors (the last stage's)."""
    model = result.model
    groups: PanelGroups = model.groups
    start, refined = result.images[0].setup.panels, refined_detector(result)
    sigma = panel_sigmas(result)
    names = panel_names(model.setups[0])
    moves = []
    for number, (name, members) in enumerate(zip(groups.names, groups.members, strict=True)):
        before, after = [start[i] for i in members], [refined[i] for i in members]
        centre = _centroid_m(before)
        rotation = torch.linalg.solve(_frame(before[0]).T, _frame(after[0]).T).T
        moves.append({"name": name, "panels": [names[i] for i in members],
                      "centre_mm": (centre * 1000.0).tolist(),
                      "shift_mm": ((_centroid_m(after) - centre) * 1000.0).tolist(),
                      "rotation_deg": torch.rad2deg(rotation_vector(rotation)).tolist(),
                      "sigma": {"shift_mm": sigma[number][:3], "rotation_deg": sigma[number][3:]}})
    return moves


def _frame(panel: DetectorGeometry) -> torch.Tensor:
    """A panel's fast, slow and normal axes as the columns of a matrix (a move turns them all by its rotation)."""
    return torch.stack([panel.fdet.detach(), panel.sdet.detach(), panel.odet.detach()], dim=1).double()


def _centroid_m(panels: Sequence[DetectorGeometry]) -> torch.Tensor:
    """The centroid of the panels' pixels (m)."""
    weights = torch.tensor([float(g.pixels_f * g.pixels_s) for g in panels], dtype=torch.float64)
    centres = torch.stack([g.pix0_m.detach().double() + g.pixels_f * g.pixel_size_m / 2.0 * g.fdet.detach().double()
                           + g.pixels_s * g.pixel_size_m / 2.0 * g.sdet.detach().double() for g in panels])
    return (centres * weights.unsqueeze(-1)).sum(dim=0) / weights.sum()


def panel_sigmas(result: FitResult) -> list[list[float]]:
    """Each group's standard errors (shift mm ×3, rotation degrees ×3) from the covariance of the last stage's
    coordinates (NaN without one)."""
    model = result.model
    slot = next(slot for slot in model.slots if slot.quantity.name == "panels")
    if result.covariance is None:
        variance = torch.full((slot.quantity.size,), math.nan, dtype=torch.float64)
    else:
        variance = torch.diagonal(result.covariance)[slot.start:slot.stop].clamp(min=0.0)
    sigma = (torch.sqrt(variance) * slot.quantity.step).reshape(-1, MOVE_SIZE)
    return sigma.tolist()


def refined_detector(result: FitResult) -> tuple[DetectorGeometry, ...]:
    """The refined detector's panels (the first image's: the panels are shared), or its one panel."""
    setup = result.model.refined_setups()[0]
    return setup.panels or (setup.geometry,)


def refined_panels(result: FitResult) -> tuple[PanelConfig, ...]:
    """The refined detector as a panel list (`-panelfile`'s entries; a single-panel detector's one panel is named
    "panel")."""
    names = panel_names(result.model.setups[0]) or ["panel"]
    return tuple(panel_config(name, panel) for name, panel in zip(names, refined_detector(result), strict=True))


def refined_experiments(result: FitResult, starts: Sequence[ExperimentStart]) -> list[RefinedExperiment]:
    """Each image's refined crystal, wavelength and detector panels (nanoBragg's frame), for the DIALS experiment
    it started from (`starts[image]`): what nbsim.io.dials_experiments.write_experiment_list writes."""
    refined = []
    for setup, start in zip(result.model.refined_setups(), starts, strict=True):
        panels = tuple(PanelPlacement(origin_mm=_array(panel.pix0_m) * 1000.0, fast=_array(panel.fdet),
                                      slow=_array(panel.sdet)) for panel in setup.panels or (setup.geometry,))
        refined.append(RefinedExperiment(start=start, a_matrix_per_A=_array(setup.lattice.reciprocal_per_A),
                                         wavelength_A=float(setup.config.beam.wavelength_A), panels=panels))
    return refined


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


def residual_picture(result: FitResult, path: str, boxes_per_image: int = 64) -> None:
    """A PNG of observed counts, model and Pearson residual (observed − model)/√model, shoebox by shoebox
    (the brightest `boxes_per_image` of each image, tiled), one row of three panels per image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with torch.no_grad():
        expected = [values.numpy() for values in result.expected]
    figure, axes = plt.subplots(len(result.images), 3, figsize=(12, 4 * len(result.images)), squeeze=False)
    for image, (fit_image, boxes) in enumerate(zip(result.images, result.boxes, strict=True)):
        observed = boxes.take(fit_image.counts)
        tiles = [_tiles(boxes, data, boxes_per_image) for data in
                 (observed, expected[image], (observed - expected[image]) / np.sqrt(np.maximum(expected[image], 1e-3)))]
        top = max(np.nanmax(tiles[0]), np.nanmax(tiles[1]), 1e-9)
        for axis, tile, title, limits in zip(axes[image], tiles, ("observed", "model", "residual (σ)"),
                                             ((0, top), (0, top), (-5, 5)), strict=True):
            shown = axis.imshow(tile, cmap="RdBu_r" if title.startswith("residual") else "viridis",
                                vmin=limits[0], vmax=limits[1], interpolation="nearest")
            axis.set_title(f"{fit_image.name}: {title}" if title == "observed" else title)
            axis.set_xticks([])
            axis.set_yticks([])
            figure.colorbar(shown, ax=axis, shrink=0.8)
    figure.tight_layout()
    atomic_write_with(path, lambda temporary: figure.savefig(temporary, dpi=100, format="png"))
    plt.close(figure)


def _tiles(boxes, data: np.ndarray, count: int) -> np.ndarray:
    """The first `count` shoeboxes' values tiled in a square grid (NaN where a box has no fitted pixel)."""
    extent = []
    for index in range(min(count, len(boxes.centres))):
        members = boxes.box == index
        if members.any():
            extent.append((index, boxes.rows[members].min(), boxes.cols[members].min(),
                           boxes.rows[members].max() - boxes.rows[members].min() + 1,
                           boxes.cols[members].max() - boxes.cols[members].min() + 1))
    side = max(h for _, _, _, h, _ in extent) if extent else 1
    width = max(w for _, _, _, _, w in extent) if extent else 1
    columns = max(1, math.ceil(math.sqrt(len(extent))))
    grid_rows = max(1, math.ceil(len(extent) / columns))
    canvas = np.full((grid_rows * (side + 1), columns * (width + 1)), np.nan)
    for position, (index, row0, col0, _, _) in enumerate(extent):
        members = boxes.box == index
        top, left = (position // columns) * (side + 1), (position % columns) * (width + 1)
        canvas[top + boxes.rows[members] - row0, left + boxes.cols[members] - col0] = data[members]
    return canvas
