"""Multi-panel detectors (-panelfile): panels that tile one flat detector give its image pixel for pixel; each
panel of a tilted, shifted detector equals the single-panel custom-convention render the C would be given
for it (geometry.single_panel_flags); the outputs keep the panels; bad panel files are one-line errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from nbsim.cli import main
from nbsim.geometry import panel_geometries, single_panel_flags
from nbsim.nanobragg import parse
from nbsim.render import Renderer
from nbsim.setup import resolve

CRYSTAL = ["-cell", "60", "70", "80", "90", "95", "90", "-default_F", "100", "-N", "4", "-lambda", "1.1",
           "-misset", "10", "20", "5", "-oversample", "2", "-mosaic", "0.3", "-mosaic_domains", "2"]


def _panel(name, pixels, pixel_mm, fdet, sdet, pix0_mm, odet=None) -> dict:
    entry = {"name": name, "pixels": list(pixels), "pixel_mm": pixel_mm, "fdet": list(fdet), "sdet": list(sdet),
             "pix0_mm": list(pix0_mm)}
    if odet is not None:
        entry["odet"] = list(odet)
    return entry


def _write(tmp_path, panels: list[dict], name: str = "panels.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"panels": panels}))
    return str(path)


def _render(argv: list[str]) -> torch.Tensor:
    config, _ = parse(argv)
    return Renderer(resolve(config), dtype=torch.float64, compile="off")()


def test_panels_tiling_one_flat_detector_give_its_image(tmp_path):
    """Four panels of unequal sizes cutting a 96 x 80 custom-convention detector (so the stack is padded)."""
    pixel_mm, (fast, slow) = 0.1, (96, 80)
    single = _render(CRYSTAL + ["-fdet_vector", "0", "0", "1", "-sdet_vector", "0", "-1", "0", "-odet_vector", "1",
                                "0", "0", "-beam_vector", "1", "0", "0", "-detpixels_f", str(fast), "-detpixels_s",
                                str(slow), "-pixel", str(pixel_mm), "-Xbeam", "3.1", "-Ybeam", "4.2", "-distance",
                                "60"])
    corner = np.array([60.0, 4.2, -3.1])
    cuts_f, cuts_s = (0, 40, fast), (0, 30, slow)
    panels, where = [], []
    for j in range(2):
        for i in range(2):
            f0, s0 = cuts_f[i], cuts_s[j]
            pix0 = corner + pixel_mm * np.array([0.0, -s0, f0])
            panels.append(_panel(f"q{j}{i}", (cuts_f[i + 1] - f0, cuts_s[j + 1] - s0), pixel_mm, (0, 0, 1),
                                 (0, -1, 0), pix0.tolist()))
            where.append((s0, cuts_s[j + 1], f0, cuts_f[i + 1]))
    stacked = _render(CRYSTAL + ["-panelfile", _write(tmp_path, panels)])
    assert stacked.shape == (4, 50, 56)
    for index, (s0, s1, f0, f1) in enumerate(where):
        panel = stacked[index]
        torch.testing.assert_close(panel[:s1 - s0, :f1 - f0], single[s0:s1, f0:f1], rtol=1e-10,
                                   atol=1e-14 * float(single.max()))
        assert not panel[s1 - s0:].any() and not panel[:, f1 - f0:].any()


def _tilted_panels() -> list[dict]:
    """Three panels: tilted about different axes, shifted, of different sizes and pixel sizes."""
    def rotated(vector, turns):
        v = np.array(vector, dtype=float)
        for axis, angle_deg in turns:
            k, a = np.array(axis, dtype=float), math.radians(angle_deg)
            v = v * math.cos(a) + np.cross(k, v) * math.sin(a) + k * (k @ v) * (1 - math.cos(a))
        return v.tolist()

    tilt, roll = [((0, 1, 0), 25), ((0, 0, 1), -10)], [((1, 0, 0), 30), ((0, 1, 0), -8)]
    return [
        _panel("flat", (40, 32), 0.1, (0, 0, 1), (0, -1, 0), (80.0, 1.6, -2.0)),
        _panel("tilted", (48, 24), 0.12, rotated((0, 0, 1), tilt), rotated((0, -1, 0), tilt), (75.0, 6.0, 3.0)),
        _panel("rolled", (24, 36), 0.09, rotated((0, 0, -1), roll), rotated((0, 1, 0), roll), (78.0, -5.0, 2.5),
               odet=rotated((1, 0, 0), roll)),
    ]


def test_each_tilted_panel_equals_its_single_panel_custom_render(tmp_path):
    """Each panel equals the render of nanoBragg's flags for that panel alone (what the C is checked with in
    benchmarks/panels_vs_c.py): a pix0 recomputed by the C from -Xbeam/-Ybeam/-distance."""
    beam = ["-beam_vector", "0.999", "0.03", "-0.02"]
    argv = CRYSTAL + beam + ["-panelfile", _write(tmp_path, _tilted_panels())]
    config, _ = parse(argv)
    stacked = Renderer(resolve(config), dtype=torch.float64, compile="off")()
    for index, geometry in enumerate(panel_geometries(config.detector)):
        alone = _render(CRYSTAL + single_panel_flags(geometry))
        panel = stacked[index, :geometry.pixels_s, :geometry.pixels_f]
        assert alone.shape == panel.shape
        torch.testing.assert_close(panel, alone, rtol=1e-9, atol=1e-12 * float(alone.max()))
