"""Detector models (`-detector_model NAME`): a real detector's pixels, modules, sensor and response as the
flags that set them, so that an image looks like that detector's without knowing its spec sheet. The
values and their sources are in docs/detector.md ("Detector models").

A model is a list of flags placed before the user's own, so that the user's flags override it: nanoBragg's
later flags win, and a model's pixel counts give way to a user's -detsize or -img (which size the detector
in other terms)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import NbsimError
from .flags import FLAGS

MODEL_FLAG = "-detector_model"
_PIXEL_COUNT_OVERRIDES = ("-detsize", "-detsize_f", "-detsize_s", "-img")
"""User flags that size the detector otherwise, so a model's pixel counts give way to them."""


@dataclass(frozen=True)
class DetectorModel:
    """A detector as nbsim renders it: pixels, modules and the gaps between them, sensor and response."""

    name: str
    """What -detector_model takes (any case; '-', '_' and spaces ignored)."""
    title: str
    pixel_size_mm: float
    pixels_fast: int
    pixels_slow: int
    module_pixels: tuple[int, int] | None
    """A module's pixels (fast, slow); None: one seamless sensor."""
    module_gap_pixels: tuple[int, int]
    """Pixels between modules (fast, slow): not rendered, written as gaps (docs/detector.md)."""
    sensor_material: str
    sensor_thickness_um: float
    psf: str
    psf_fwhm_um: float
    pedestal_adu: float
    saturation_counts: int

    def flags(self) -> list[str]:
        """The nbsim flags this model sets, in the order they are applied."""
        flags = ["-pixel", f"{self.pixel_size_mm:g}", "-detpixels_f", str(self.pixels_fast),
                 "-detpixels_s", str(self.pixels_slow)]
        if self.module_pixels is not None:
            flags += ["-module_size", *map(str, self.module_pixels), "-module_gap", *map(str, self.module_gap_pixels)]
        if self.sensor_thickness_um > 0:
            flags += ["-sensor_material", self.sensor_material, "-detector_thick", f"{self.sensor_thickness_um:g}"]
        if self.psf != "none":
            flags += ["-psf", self.psf, "-psf_fwhm", f"{self.psf_fwhm_um:g}"]
        flags += ["-adc", f"{self.pedestal_adu:g}"]
        return [*flags, "-saturation", str(self.saturation_counts)]


MODELS: dict[str, DetectorModel] = {m.name: m for m in (
    DetectorModel("pilatus6m", "DECTRIS PILATUS 6M", 0.172, 2463, 2527, (487, 195), (7, 17), "Si", 320.0,
                  "gaussian", 172.0, 0.0, 2**20 - 1),
    DetectorModel("eiger16m", "DECTRIS EIGER X 16M", 0.075, 4150, 4371, (1030, 514), (10, 37), "Si", 450.0,
                  "gaussian", 75.0, 0.0, 2**31 - 1),
    DetectorModel("eiger2cdte16m", "DECTRIS EIGER2 CdTe 16M", 0.075, 4148, 4362, (1028, 512), (12, 38), "CdTe",
                  750.0, "gaussian", 75.0, 0.0, 2**31 - 1),
    DetectorModel("jungfrau4m", "PSI JUNGFRAU 4M", 0.075, 2068, 2164, (1030, 514), (8, 36), "Si", 320.0,
                  "gaussian", 75.0, 0.0, 10000),
    DetectorModel("mx340hs", "Rayonix MX340-HS (2x2 binned)", 0.0886, 3840, 3840, None, (0, 0), "Si", 0.0,
                  "fiber", 88.6, 10.0, 2**16 - 1),
    DetectorModel("mx340hs1x1", "Rayonix MX340-HS (unbinned)", 0.0443, 7680, 7680, None, (0, 0), "Si", 0.0,
                  "fiber", 88.6, 10.0, 2**16 - 1),
)}


def _key(name: str) -> str:
    return re.sub(r"[-_\s]", "", name).lower()


def detector_model(name: str) -> DetectorModel:
    """The model named (any case, '-', '_' and spaces ignored), or a one-line error listing the models."""
    model = MODELS.get(_key(name))
    if model is None:
        raise NbsimError(f"{MODEL_FLAG}: unknown detector model '{name}' (known: {', '.join(MODELS)})")
    return model


def model_flags(argv: list[str]) -> tuple[DetectorModel | None, list[str]]:
    """The -detector_model in `argv` (None without one) and the flags of it that the user's do not override."""
    if MODEL_FLAG not in argv:
        return None, []
    position = len(argv) - 1 - argv[::-1].index(MODEL_FLAG)
    if position + 1 >= len(argv):
        raise NbsimError(f"{MODEL_FLAG} needs 1 value(s), got 0")
    if "-panelfile" in argv:
        raise NbsimError(f"{MODEL_FLAG} describes a one-panel detector; with -panelfile the panel file places "
                         "and sizes every panel")
    model = detector_model(argv[position + 1])
    flags = model.flags()
    if any(flag in argv for flag in _PIXEL_COUNT_OVERRIDES):
        flags = _without(flags, ("-detpixels_f", "-detpixels_s"))
    if "-img" in argv:
        flags = _without(flags, ("-pixel",))
    return model, flags


def expand_detector_model(argv: list[str]) -> list[str]:
    """`argv` with its -detector_model replaced by the model's flags, placed first so the user's win."""
    model, flags = model_flags(argv)
    if model is None:
        return list(argv)
    rest = [arg for i, arg in enumerate(argv) if arg != MODEL_FLAG and (i == 0 or argv[i - 1] != MODEL_FLAG)]
    return [*flags, *rest]


def _without(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """`flags` less the named flags and their values."""
    result: list[str] = []
    i = 0
    while i < len(flags):
        count = 1 + len(FLAGS[flags[i]])
        if flags[i] not in names:
            result += flags[i:i + count]
        i += count
    return result
