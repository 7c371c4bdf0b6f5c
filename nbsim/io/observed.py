"""Observed images for fitting: one detector frame as float64 counts with the ADC offset taken off, and
what its header says of the detector's response (gain, saturation).

`read_observed(spec)` tells the format by content (and the raw float image by elimination):

* nanoBragg's SMV (`-intfile`, `-noisefile`): 16-bit pixels; nanoBragg's header does not record its `-adc`
  offset, so 40 (nanoBragg's default) is taken off unless the header has IMAGE_PEDESTAL (ADSC's) or the
  caller gives `adc_offset_adu`; GAIN and SATURATED_VALUE are read where present (else 1 and 65535, the
  largest 16-bit value, where nanoBragg clamps);
* miniCBF (fabio): `Count_cutoff` is the saturation; nbsim's own header records its ADC offset and gain
  (`# nbsim adc_offset_adu 40`, `# nbsim gain_adu_per_photon 1`), other detectors' offset is 0;
* NXmx (HDF5, h5py): `FILE` is the first frame, `FILE#N` frame N (from 0); the detector's
  saturation_value, nbsim's offset and gain from the entry's notes; a detector of several NXdetector_modules
  as (modules, slow, fast), each module's slab (its data_origin and data_size) zero-padded to the largest, in
  the order HDF5 lists them (dxtbx's panel order);
* a shot of a sweep's store (zarr): `STORE#POINT`, a batch store (`images.zarr`) by point name or index, a
  collated `sweep.zarr` by point name or by `axis=value,...` (axes with one value need not be named): the
  detector stage's `detector_image` (ADU, offset and gain from the point's configuration) where the store
  has one, else the noise-free `image` (photons);
* raw float32 (`-floatfile`): native-endian, slow-major; needs `shape` (slow, fast), and its byte count must
  match; of a multi-panel detector (`panels`: each panel's (slow, fast)), the panels one after another as
  `-floatfile` stacks them, returned as (panels, slow, fast) zero-padded to the largest panel (as the NXmx
  file and the renderer hold them).

`observed_spectrum(spec)` gives the spectrum a frame carries: an NXmx file's polychromatic beam, or the
spectrum a store's shot was rendered with (a dataset's `sase` draw).

Errors (missing file, unknown format, a size that does not match `shape`, a frame or point that is not
there) are one-line `InputFileError`s naming the file. `require_observed(specs)` makes the path and store checks
before any work (the command line's, for every shot at once: each store read once).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..config import shifted_spectrum, spectrum_channels_problem
from ..errors import InputFileError
from .images import read_head, read_smv
from .paths import require_file

NANOBRAGG_ADC_OFFSET_ADU = 40.0
"""nanoBragg's default `-adc`: what its SMV images carry on top of the counts (its header does not say)."""
SMV_SATURATION_ADU = 65535.0
"""The largest value of an SMV image's 16-bit pixel: nanoBragg clamps there."""
NBSIM_RESPONSE_PATTERN = re.compile(r"^(?:# )?(?:nbsim )?(adc_offset_adu|gain_adu_per_photon) (\S+)\s*$", re.M)
"""The lines of nbsim's miniCBF header and NXmx notes that record the detector response."""
RAW_FLOAT_SUFFIXES = (".bin", ".raw", ".float")
ENTRY_LOG = "entries.jsonl"
"""A batch store's log of its points' entries, one JSON line each (nbsim.sweep.store writes it)."""

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class ObservedImage:
    """One observed frame: counts in ADU with the ADC offset subtracted, and the detector's response."""

    name: str
    """The image as the user gave it (path, and frame or point), for reports."""
    counts: np.ndarray
    """float64 (slow, fast), or (panels, slow, fast) for a multi-panel NXmx frame; the ADC offset subtracted."""
    adc_offset_adu: float
    """What was subtracted (0 for photon-counting formats)."""
    gain_adu_per_photon: float
    """From the header where the format records it, else 1."""
    overload_adu: float | None
    """The saturation value as the file records it (before the offset is subtracted); None if not recorded."""

    def unusable(self) -> np.ndarray:
        """Pixels that carry no measurement: at or above the saturation value, negative in the file (a
        photon counter's gaps and bad pixels), or 0 in a file with an ADC offset (outside nanoBragg's ROI,
        clamped, or dead)."""
        raw = self.counts + self.adc_offset_adu
        bad = raw < 0
        if self.overload_adu is not None:
            bad |= raw >= self.overload_adu
        if self.adc_offset_adu > 0:
            bad |= raw == 0
        return bad


def read_observed(spec: str, shape: tuple[int, int] | None = None, adc_offset_adu: float | None = None,
                  panels: Sequence[tuple[int, int]] | None = None) -> ObservedImage:
    """The frame `spec` names (see the module's docstring). `shape`: the (slow, fast) pixels the caller
    expects (required for raw float; checked for every format); `adc_offset_adu`: the offset to subtract,
    overriding what the file says or the format's default; `panels`: a multi-panel detector's (slow, fast) per
    panel, in place of `shape` (the frame must then be (panels, slow, fast), zero-padded to the largest)."""
    path, selector = _split(spec)
    if panels is not None:
        shape = (max(slow for slow, _ in panels), max(fast for _, fast in panels))
    image = (_read_store(spec, path, selector) if path.is_dir()
             else _read_file(spec, path, selector, shape, None if panels is None else tuple(panels)))
    if adc_offset_adu is not None:
        if not math.isfinite(adc_offset_adu):
            raise InputFileError(spec, f"the ADC offset must be finite (got {adc_offset_adu:g})")
        image = ObservedImage(image.name, image.counts + image.adc_offset_adu - adc_offset_adu, float(adc_offset_adu),
                              image.gain_adu_per_photon, image.overload_adu)
    if (image.counts.ndim == 3) != (panels is not None) or (panels is not None and len(image.counts) != len(panels)):
        held = f"{len(image.counts)} panels" if image.counts.ndim == 3 else "one panel"
        raise InputFileError(spec, f"the image holds {held}, the model's detector "
                                   f"{'one' if panels is None else len(panels)}")
    if shape is not None and tuple(image.counts.shape[-2:]) != tuple(shape):
        raise InputFileError(spec, f"the image has {_size(image.counts.shape[-2:])} pixels (slow x fast), the "
                                   f"model {_size(shape)}")
    return image


def _size(shape) -> str:
    return " x ".join(str(int(n)) for n in shape)


def _split(spec: str) -> tuple[Path, str | None]:
    """The path and the part after its last '#' (a frame or point), unless the whole spec names a file."""
    if Path(spec).exists() or "#" not in spec:
        return Path(spec), None
    path, selector = spec.rsplit("#", 1)
    return Path(path), selector


def _read_file(spec: str, path: Path, selector: str | None, shape: tuple[int, int] | None,
               panels: tuple[tuple[int, int], ...] | None = None) -> ObservedImage:
    head = read_head(path)
    if head.startswith(_HDF5_MAGIC):
        return _read_nxmx(spec, path, selector)
    if selector is not None:
        raise InputFileError(spec, "only NXmx files and sweep stores hold several images (FILE#N)")
    if head.startswith(b"{\nHEADER_BYTES"):
        return _read_smv(spec, path)
    if head.startswith(b"###CBF") or b"_array_data" in head:
        return _read_mini_cbf(spec, path)
    if panels is not None:
        return _read_stacked_panels(spec, path, panels)
    if shape is not None or path.suffix.lower() in RAW_FLOAT_SUFFIXES:
        return _read_raw_float(spec, path, shape)
    raise InputFileError(str(path), "unknown image format (not SMV, miniCBF, NXmx or a sweep store; a raw float "
                                    "image needs its shape)")


def _read_smv(spec: str, path: Path) -> ObservedImage:
    header, pixels = read_smv(path)
    pedestal = header.last_value("IMAGE_PEDESTAL")
    adc = NANOBRAGG_ADC_OFFSET_ADU if pedestal is None else pedestal
    gain = header.last_value("GAIN")
    saturation = header.last_value("SATURATED_VALUE")
    return ObservedImage(spec, pixels.astype(np.float64) - adc, adc, gain if gain else 1.0,
                         saturation if saturation else SMV_SATURATION_ADU)


def _response_records(text: str) -> dict[str, float]:
    """nbsim's adc_offset_adu and gain_adu_per_photon lines in a header or notes text."""
    return {key: float(value) for key, value in NBSIM_RESPONSE_PATTERN.findall(text)}


def _read_mini_cbf(spec: str, path: Path) -> ObservedImage:
    import fabio

    try:
        image = fabio.open(str(path))
    except Exception as error:  # fabio raises many kinds for a damaged file
        raise InputFileError(str(path), f"not a readable CBF ({type(error).__name__}: {error})") from None
    contents = str(image.header.get("_array_data.header_contents", ""))
    response = _response_records(contents)
    cutoff = re.search(r"^#\s*Count_cutoff\s+(\S+)", contents, re.M)
    adc = response.get("adc_offset_adu", 0.0)
    return ObservedImage(spec, np.asarray(image.data, dtype=np.float64) - adc, adc,
                         response.get("gain_adu_per_photon", 1.0), float(cutoff[1]) if cutoff else None)


def _read_nxmx(spec: str, path: Path, selector: str | None) -> ObservedImage:
    import h5py

    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        raise InputFileError(str(path), f"not a readable HDF5 file ({error})") from None
    with handle:
        entry = _nx_child(handle, "NXentry")
        if entry is None:
            raise InputFileError(str(path), "an HDF5 file without an NXentry (not NXmx)")
        data = _nx_child(entry, "NXdata")
        signal = data.attrs.get("signal", "data") if data is not None else None
        if isinstance(signal, bytes):
            signal = signal.decode()
        if data is None or signal not in data:
            raise InputFileError(str(path), "NXmx without image data (no NXdata signal)")
        frames = data[signal]
        index = _frame_index(spec, selector, frames.shape[0] if frames.ndim > 2 else 1)
        counts = np.asarray(frames[index] if frames.ndim > 2 else frames[()], dtype=np.float64)
        detector = _nx_child(entry["instrument"], "NXdetector") if "instrument" in entry else None
        slabs = _module_slabs(detector) if detector is not None else []
        if len(slabs) > 1:
            counts = _module_stack(spec, counts, slabs)
        saturation = (float(np.asarray(detector["saturation_value"][()]).reshape(-1)[0])
                      if detector is not None and "saturation_value" in detector else None)
        notes = entry["notes"][()] if "notes" in entry else b""
    response = _response_records(notes.decode() if isinstance(notes, bytes) else str(notes))
    adc = response.get("adc_offset_adu", 0.0)
    return ObservedImage(spec, counts - adc, adc, response.get("gain_adu_per_photon", 1.0), saturation)


def _module_slabs(detector) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Each NXdetector_module of the detector, in the order HDF5 lists them (by name, as dxtbx takes them): its
    name, data_origin and data_size."""
    slabs = []
    for name, member in detector.items():
        found = member.attrs.get("NX_class")
        if (found.decode() if isinstance(found, bytes) else found) == "NXdetector_module":
            slabs.append((name, np.asarray(member["data_origin"][()]).reshape(-1),
                          np.asarray(member["data_size"][()]).reshape(-1)))
    return slabs


def _module_stack(spec: str, frame: np.ndarray, slabs: list[tuple[str, np.ndarray, np.ndarray]]) -> np.ndarray:
    """A frame of several modules as (modules, slow, fast), zero-padded to the largest: each module's slab of the
    frame (data_origin and data_size, slow to fast: nbsim's (slow, fast) slabs of panels one below the other,
    or NXmx's (panel, slow, fast) of a (panels, slow, fast) frame)."""
    sizes = [(int(size[-2]), int(size[-1])) for _, _, size in slabs]
    stack = np.zeros((len(slabs), max(slow for slow, _ in sizes), max(fast for _, fast in sizes)))
    for index, ((name, origin, size), (slow, fast)) in enumerate(zip(slabs, sizes, strict=True)):
        region = tuple(slice(int(start), int(start) + int(count)) for start, count in zip(origin, size, strict=True))
        part = frame[region] if len(region) == frame.ndim else None
        if part is None or part.size != slow * fast:
            raise InputFileError(spec, f"module {name}'s slab (origin {origin.tolist()}, size {size.tolist()}) is not "
                                       f"within the frame of {' x '.join(map(str, frame.shape))} pixels")
        stack[index, :slow, :fast] = part.reshape(slow, fast)
    return stack


def observed_spectrum(spec: str) -> tuple[tuple[float, float], ...] | None:
    """The spectrum a frame carries, as (wavelength in Å, weight) channels: an NXmx file's polychromatic beam
    (NXbeam's incident_wavelength with incident_wavelength_weights), or the spectrum a store's shot was rendered
    with (its point's configuration: a dataset's `sase` draw); None for one wavelength or a format without one.
    A spectrum with a non-positive wavelength, a negative weight or no weight at all is a one-line error."""
    path, selector = _split(spec)
    if path.is_dir():
        _, point = _locate(spec, _store_index(path), selector)
        beam = (point.get("config") or {}).get("beam") or {}
        if not beam.get("spectrum"):
            return None
        channels = [(float(wavelength), float(weight)) for wavelength, weight in beam["spectrum"]]
        _check_channels(spec, channels)
        return tuple((float(wavelength), weight) for wavelength, weight in
                     shifted_spectrum(tuple(channels), float(beam.get("spectrum_shift_eV", 0.0)),
                                      float(beam.get("spectrum_stretch", 1.0))))
    if not read_head(path).startswith(_HDF5_MAGIC):
        return None
    import h5py

    with h5py.File(path, "r") as handle:
        entry = _nx_child(handle, "NXentry")
        instrument = entry.get("instrument") if entry is not None else None
        beam = _nx_child(instrument, "NXbeam") if instrument is not None else None
        if beam is None or "incident_wavelength_weights" not in beam:
            return None
        wavelengths = np.asarray(beam["incident_wavelength"][()], dtype=np.float64).reshape(-1)
        weights = np.asarray(beam["incident_wavelength_weights"][()], dtype=np.float64).reshape(-1)
    if len(wavelengths) != len(weights):
        raise InputFileError(spec, f"its beam has {len(wavelengths)} wavelengths but {len(weights)} weights")
    channels = list(zip(wavelengths.tolist(), weights.tolist(), strict=True))
    _check_channels(spec, channels)
    return tuple(channels)


def _check_channels(spec: str, channels: list[tuple[float, float]]) -> None:
    """A frame's spectrum: positive finite wavelengths, weights not negative and not all zero."""
    problem = spectrum_channels_problem(channels)
    if problem:
        raise InputFileError(spec, f"its spectrum: {problem}")


def _nx_child(group, nx_class: str):
    """The first member of `group` of the NeXus class (its `default` first), or None."""
    names = list(group)
    default = group.attrs.get("default")
    default = default.decode() if isinstance(default, bytes) else default
    if default in names:
        names.insert(0, default)
    for name in names:
        member = group.get(name)
        found = member.attrs.get("NX_class") if member is not None else None
        if (found.decode() if isinstance(found, bytes) else found) == nx_class:
            return member
    return None


def _frame_index(spec: str, selector: str | None, frames: int) -> int:
    if selector is None:
        return 0
    if not re.fullmatch(r"\d+", selector):
        raise InputFileError(spec, f"frame '{selector}' is not a number (FILE#N, N from 0)")
    if int(selector) >= frames:
        raise InputFileError(spec, f"no frame {selector}: the file holds {frames} (numbered from 0)")
    return int(selector)


def _read_raw_float(spec: str, path: Path, shape: tuple[int, int] | None) -> ObservedImage:
    if shape is None:
        raise InputFileError(str(path), "a raw float image: give its shape (slow, fast pixels)")
    expected = 4 * int(shape[0]) * int(shape[1])
    size = path.stat().st_size
    if size != expected:
        raise InputFileError(str(path), f"{size} bytes, but a {_size(shape)} float32 image has {expected}")
    counts = np.fromfile(path, dtype=np.float32).reshape(int(shape[0]), int(shape[1])).astype(np.float64)
    return ObservedImage(spec, counts, 0.0, 1.0, None)


def _read_stacked_panels(spec: str, path: Path, panels: tuple[tuple[int, int], ...]) -> ObservedImage:
    """A multi-panel -floatfile: each panel's slow × fast float32 pixels one after another, as (panels, slow, fast)
    zero-padded to the largest panel."""
    sizes = [slow * fast for slow, fast in panels]
    expected, size = 4 * sum(sizes), path.stat().st_size
    if size != expected:
        raise InputFileError(str(path), f"{size} bytes, but {len(panels)} panels of float32 ({sum(sizes)} pixels, "
                                        f"-floatfile's stacking) have {expected}")
    values = np.fromfile(path, dtype=np.float32).astype(np.float64)
    counts = np.zeros((len(panels), max(s for s, _ in panels), max(f for _, f in panels)))
    for index, ((slow, fast), start) in enumerate(zip(panels, np.cumsum([0, *sizes[:-1]]), strict=True)):
        counts[index, :slow, :fast] = values[start:start + slow * fast].reshape(slow, fast)
    return ObservedImage(spec, counts, 0.0, 1.0, None)


def require_observed(specs: Sequence[str]) -> None:
    """A one-line error, before any work, for a frame that cannot be there: a missing, unreadable or folder path
    that is no sweep store, or a shot a store does not hold or has not rendered (`STORE#POINT`). Each store is
    read once however many of its shots are named; an NXmx file's frame (`FILE#N`) is checked when it is read."""
    done: dict[Path, np.ndarray] = {}
    for spec in specs:
        path, selector = _split(spec)
        if not path.is_dir():
            require_file(path)
            continue
        index = _store_index(path)
        if index.names is not None and path not in done:
            done[path] = index.done()
        _locate(spec, index, selector, done.get(path))


@dataclass
class _StoreIndex:
    """What finding a store's shot needs: its image kind, and a batch store's point names and entries by index,
    or a collated store's axes, their values and its points' records (JSON text over the axes)."""

    path: Path
    kind: str
    names: list[str] | None = None
    entries: dict[int, dict] | None = None
    axes: tuple[str, ...] = ()
    axis_values: dict[str, list[str]] | None = None
    records: np.ndarray | None = None

    def done(self) -> np.ndarray:
        """A batch store's done marks, read now (a batch being rendered marks its points after their entries)."""
        import zarr

        return zarr.open_array(str(self.path / "done"), mode="r")[...]

    @cached_property
    def named(self) -> dict[str, tuple[tuple, dict]]:
        """A collated store's points by name (the first of a name): where each is over the axes, and its
        record (parsed on first use: selecting by axis=value reads one record)."""
        named: dict[str, tuple[tuple, dict]] = {}
        for where, text in np.ndenumerate(self.records):
            if str(text):
                point = json.loads(str(text))
                named.setdefault(point.get("name"), (tuple(where), point))
        return named


_STORE_INDEXES: dict[str, tuple[tuple, _StoreIndex]] = {}
"""The stores read last in this process (STORE_INDEXES_KEPT of them), each with the version it was read at
(its files' sizes and times): a merge reads hundreds of shots of one store, each needing the same names and
entries."""
STORE_INDEXES_KEPT = 8


def _store_version(path: Path) -> tuple:
    """What changes when a store does: its metadata file, and a batch store's append-only log of entries."""
    version = []
    for member in (path / "zarr.json", path / ENTRY_LOG):
        try:
            status = member.stat()
        except OSError:
            version.append(None)
            continue
        version.append((status.st_ino, status.st_size, status.st_mtime_ns))
    return tuple(version)


def _store_index(path: Path) -> _StoreIndex:
    """The index of the store at `path` (read again only when the store has changed)."""
    import zarr

    if not (path / "zarr.json").is_file():
        raise InputFileError(str(path), "is a folder but not a zarr store of a sweep")
    key, version = str(path), _store_version(path)
    cached = _STORE_INDEXES.get(key)
    if cached is not None and cached[0] == version:
        return cached[1]
    group = zarr.open_group(str(path), mode="r")
    members = set(group.array_keys())
    kind = "detector_image" if "detector_image" in members else "image"
    if kind not in members:
        raise InputFileError(str(path), "a zarr store without images")
    if "done" in members:
        entries: dict[int, dict] = {}
        log = path / ENTRY_LOG
        if log.is_file():
            for line in log.read_text().splitlines():
                entry = json.loads(line) if line.strip() else {}
                if "index" in entry:
                    entries[int(entry["index"])] = entry  # a resumed batch's later entry wins
        index = _StoreIndex(path, kind, names=[str(name) for name in group["point"][...]], entries=entries)
    else:
        axes = tuple(str(axis) for axis in group.attrs.get("axes", []))
        if "attributes" not in members or not axes:
            raise InputFileError(str(path), "neither a batch store nor a collated sweep.zarr")
        index = _StoreIndex(path, kind, axes=axes,
                            axis_values={axis: [str(value) for value in group[axis][...]] for axis in axes},
                            records=np.asarray(group["attributes"][...], dtype=object))
    _STORE_INDEXES.pop(key, None)
    _STORE_INDEXES[key] = (version, index)
    while len(_STORE_INDEXES) > STORE_INDEXES_KEPT:
        _STORE_INDEXES.pop(next(iter(_STORE_INDEXES)))
    return index


def _locate(spec: str, index: _StoreIndex, selector: str | None,
            done: np.ndarray | None = None) -> tuple[tuple, dict]:
    """Where the shot `selector` is in the store and its point's entry (or record); `done`: a batch store's
    done marks as read by the caller (else read here)."""
    if selector is None:
        raise InputFileError(spec, "a sweep store holds many images: name one as STORE#POINT")
    if index.names is not None:
        return _batch_point(spec, index, selector, index.done() if done is None else done)
    return _collated_point(spec, index, selector)


def _read_store(spec: str, path: Path, selector: str | None) -> ObservedImage:
    """A shot of a batch store (it has `point` and `done` arrays) or of a collated sweep.zarr."""
    import zarr

    index = _store_index(path)
    where, point = _locate(spec, index, selector)
    counts = np.asarray(zarr.open_array(str(path / index.kind), mode="r")[where], dtype=np.float64)
    if counts.ndim == 2 and point.get("size"):
        counts = counts[:int(point["size"]), :int(point["size"])]  # a collated store pads smaller sizes
    if index.kind == "image":
        return ObservedImage(spec, counts, 0.0, 1.0, None)
    response = (point.get("config") or {}).get("response") or {}
    adc = float(response.get("adc_offset_adu", NANOBRAGG_ADC_OFFSET_ADU))
    return ObservedImage(spec, counts - adc, adc, float(response.get("gain_adu_per_photon", 1.0)),
                         SMV_SATURATION_ADU)


def _batch_point(spec: str, index: _StoreIndex, selector: str, done: np.ndarray) -> tuple[tuple, dict]:
    names = index.names or []
    if selector in names:
        position = names.index(selector)
    elif re.fullmatch(r"\d+", selector) and int(selector) < len(names):
        position = int(selector)
    else:
        raise InputFileError(spec, f"no point {selector} in this store (its {len(names)} points are named like "
                                   f"{names[0] if names else '?'}, or numbered from 0)")
    if not done[position]:
        raise InputFileError(spec, f"point {names[position]} is not done (no image yet)")
    return (position,), (index.entries or {}).get(position, {})


def _collated_point(spec: str, index: _StoreIndex, selector: str) -> tuple[tuple, dict]:
    """A collated store's point: by name (its `attributes` record) or by `axis=value,...`."""
    if "=" in selector:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
        unknown = sorted(set(wanted) - set(index.axes))
        if unknown:
            raise InputFileError(spec, f"no axis {unknown[0]} (the axes are {', '.join(index.axes)})")
        where = []
        for axis in index.axes:
            values = (index.axis_values or {})[axis]
            if axis not in wanted and len(values) > 1:
                raise InputFileError(spec, f"axis {axis} has {len(values)} values: give {axis}=VALUE")
            chosen = wanted.get(axis, values[0])
            matches = [i for i, value in enumerate(values) if value == chosen or _same_number(value, chosen)]
            if not matches:
                raise InputFileError(spec, f"no {axis}={chosen} (its values: {', '.join(values[:8])})")
            where.append(matches[0])
        text = str(index.records[tuple(where)])
        if not text:
            raise InputFileError(spec, "that point has no image (it failed or was skipped)")
        found = (tuple(where), json.loads(text))
    else:
        named = index.named
        if selector not in named:
            raise InputFileError(spec, f"no point {selector} in this store (name one as in its tables, or select "
                                       "it by axis=value)")
        found = named[selector]
    if found[1].get("status", "ok") != "ok":
        raise InputFileError(spec, f"that point has no image ({found[1].get('status')})")
    return found


def _same_number(stored: str, given: str) -> bool:
    try:
        return float(stored) == float(given)
    except ValueError:
        return False
