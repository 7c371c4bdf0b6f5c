"""Sweep configuration checks: the JSON schema (with its defaults filled in), then what a schema cannot
say, then every point built as planning builds it. Every failure is an NbsimError with a one-line reason
naming the offending key."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..cache import torch_version_file
from ..errors import NbsimError, did_you_mean
from .draws import RANDOM_ORIENTATION, Draw, check_draws
from .fitting import check_fit
from .merging import check_merge
from .plan import (
    CORE_AXES,
    Point,
    PointBuilds,
    axis_name,
    axis_values,
    c_binary_path,
    check_option_value,
    nbsim_reference_point,
    point_config,
    sweep_points,
)

MAX_AXIS_VALUES = 1_000_000


DATASET_TIMING = {"warmup": 0, "repeats": 0, "threads": 1}
"""A sweep with draws (a dataset) without a `timing` section: each point rendered once, one thread per job,
the jobs side by side on the cores."""


def validate_config(config: dict, schema_path: str | Path, base: Path, devices: bool = False,
                    builds: PointBuilds | None = None) -> list[Point]:
    """Check the config against the JSON schema (filling its defaults and `fill_timing`'s), then
    semantically, then (with `devices`, in the process that plans the jobs) that its devices can be had
    (`check_devices`). The sweep's points, as `plan.sweep_points` gives them (built once, for both), are
    built into `builds` (the planning's, so that it parses nothing again) or a new one."""
    check_schema(config, schema_path)
    fill_timing(config)
    points = check_config(config, base, builds)
    if devices:
        check_devices(config)
    return points


def fill_timing(config: dict) -> None:
    """The `timing` defaults the schema cannot give, as they hang on `sweep.draws`: a dataset needs no timing
    section (DATASET_TIMING) and times warmup and repeats on each batch's first point only, unless
    `timing.every_point`; a sweep without draws must say how to time its points."""
    drawn = "draws" in config["sweep"]
    if "timing" not in config:
        if not drawn:
            raise NbsimError("timing: required for a sweep without sweep.draws (warmup, repeats and threads: how "
                             "each point is timed); a dataset (sweep.draws) may leave it out")
        config["timing"] = dict(DATASET_TIMING)
    config["timing"].setdefault("every_point", not drawn)


def check_devices(config: dict) -> None:
    """Every CUDA device of sweep.devices exists on this machine, or the config declares a SLURM partition
    with GPUs (slurm.gpu_partition, where CUDA points are sent: the submit host itself may have none);
    else a one-line error naming the fix, unless sweep.on_unavailable_device is skip."""
    sweep = config["sweep"]
    cuda = [d for d in sweep["devices"] if d.startswith("cuda")]
    if not cuda or sweep.get("on_unavailable_device") == "skip" or (config.get("slurm") or {}).get("gpu_partition"):
        return
    count = cuda_device_count()
    for device in cuda:
        if int(device.partition(":")[2] or 0) >= count:
            raise NbsimError(f"sweep.devices: {device} is not available: this machine has {count} CUDA device(s) "
                             "and no slurm.gpu_partition is set; set sweep.on_unavailable_device: skip to record "
                             "its points as skipped")


def cuda_device_count() -> int:
    """The CUDA devices PyTorch sees here: 0 without importing it where the installed PyTorch is built for
    neither CUDA nor ROCm (`torch_has_gpu_build`), else asked of `torch.cuda`. The import is about 1.5 s of
    CPU in every Snakemake start that plans CUDA points, dry runs included."""
    if not torch_has_gpu_build():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torch_has_gpu_build() -> bool:
    """Whether the installed PyTorch was built for CUDA or ROCm, read from its `torch/version.py` (the
    `cuda` and `hip` that `torch.version` holds: both None in a CPU build) without importing it; True
    where that file cannot be read as such, so that the caller asks PyTorch itself."""
    import ast

    version_file = torch_version_file()
    try:
        tree = ast.parse(version_file.read_text()) if version_file is not None else None
    except (OSError, SyntaxError, ValueError):
        tree = None
    if tree is None:
        return True
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return not all(name in constants and constants[name] is None for name in ("cuda", "hip"))


def check_schema(config: dict, schema_path: str | Path) -> None:
    """snakemake.utils.validate, which fills the schema's defaults; its error (the jsonschema error it
    chains, taken at the key the config got wrong) becomes one line."""
    import jsonschema
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, str(schema_path), set_default=True)
    except WorkflowError as error:
        cause = error.__context__
        if not isinstance(cause, jsonschema.ValidationError):
            raise NbsimError(str(error).splitlines()[0]) from None
        while cause.parent is not None:
            cause = cause.parent
        where = ".".join(str(p) for p in cause.absolute_path) or "top level"
        raise NbsimError(f"{where}: {_short_message(cause)}") from None


def _short_message(error) -> str:
    if error.validator == "additionalProperties":
        known = list(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(known))
        return (f"unknown key(s) {', '.join(map(repr, extra))}{did_you_mean(extra[0], known)}; the keys here: "
                f"{', '.join(known)}")
    if error.validator == "required":
        return error.message.replace("'", "", 0)
    if error.validator in ("type", "enum", "pattern", "minimum", "maximum", "minItems", "minProperties",
                           "uniqueItems", "oneOf", "minLength", "exclusiveMinimum", "not"):
        shown = json.dumps(error.instance, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        if error.validator == "oneOf" and "#/$defs/range" in json.dumps(error.validator_value):
            return f"{shown} is not a list of values, {{start, stop, step}} or {{count, start, step}}"
        return f"{shown} is not valid here ({error.validator}: {json.dumps(error.validator_value, default=str)[:80]})"
    return error.message.splitlines()[0][:160]


def _check_axis(where: str, spec: list | dict) -> None:
    """A range must step towards its stop and hold between 1 and MAX_AXIS_VALUES distinct values."""
    if isinstance(spec, dict):
        if spec.get("step", 1) == 0:
            raise NbsimError(f"{where}: step must not be 0")
        if "count" not in spec:
            count = (spec["stop"] - spec["start"]) / spec["step"]
            if count <= 0:
                raise NbsimError(f"{where}: a range from {spec['start']} to {spec['stop']} in steps of "
                                 f"{spec['step']} holds no value")
            if count > MAX_AXIS_VALUES:
                raise NbsimError(f"{where}: a range of {count:.0f} values is more than {MAX_AXIS_VALUES}")
    values = axis_values(spec)
    if len(set(values)) != len(values):
        raise NbsimError(f"{where}: values repeat (after rounding to 12 significant digits)")


def check_config(config: dict, base: Path, builds: PointBuilds | None = None) -> list[Point]:
    """Semantic checks the schema cannot express, then every point built (`check_points`); the points."""
    from ..config import option_names
    from ..nanobragg.flags import FLAGS

    sweep = config["sweep"]
    names = option_names()
    _check_axis("sweep.sizes", sweep["sizes"])
    if any(not isinstance(size, int) or not 1 <= size <= 65536 for size in axis_values(sweep["sizes"])):
        raise NbsimError("sweep.sizes: detector sizes are whole numbers of pixels from 1 to 65536")
    extra = sweep.get("extra") or {}
    binary = (config.get("reference") or {}).get("c_binary")
    if binary:
        path = Path(c_binary_path(config, base))
        if not path.is_file():
            raise NbsimError(f"reference.c_binary {binary} does not exist")
        if not os.access(path, os.X_OK):
            raise NbsimError(f"reference.c_binary {binary} is not executable")
    for name, spec in extra.items():
        if name.startswith("-"):
            if name not in FLAGS:
                raise NbsimError(f"sweep.extra: '{name}' is not a nanoBragg option{did_you_mean(name, FLAGS)}; "
                                 "nbsim -h lists them")
        elif name not in names:
            raise NbsimError(f"sweep.extra: '{name}' is not a simulator option{did_you_mean(name, names)}; "
                             "nbsim show --options lists them")
        elif binary:
            raise NbsimError(f"sweep.extra.{name}: a simulator option cannot be passed to the C reference "
                             "(reference.c_binary); sweep the nanoBragg flag that sets it instead")
        _check_axis(f"sweep.extra.{name}", spec)
    draws = sweep.get("draws")
    if draws is not None:
        check_draws(draws, base)
        for name in draws.get("values") or {}:
            if name.startswith("-") and name not in FLAGS and name != RANDOM_ORIENTATION:
                raise NbsimError(f"sweep.draws.values: '{name}' is not a nanoBragg option{did_you_mean(name, FLAGS)}")
            if not name.startswith("-") and name not in names:
                raise NbsimError(f"sweep.draws.values: '{name}' is not a simulator option"
                                 f"{did_you_mean(name, names)}; the options are the fields of nbsim.config's "
                                 "dataclasses")
            if not name.startswith("-") and binary:
                raise NbsimError(f"sweep.draws.values.{name}: a simulator option cannot be passed to the C "
                                 "reference (reference.c_binary); draw the nanoBragg flag that sets it instead")
            if name in extra:
                raise NbsimError(f"sweep.draws.values.{name}: also an axis of sweep.extra; give it one or the other")
    if sweep.get("detector") is not None:
        _check_detector(sweep["detector"], draws is not None)
    if "fit" in config:
        check_fit(config, base)
    if "merge" in config:
        check_merge(config, base)
    axes = [*CORE_AXES, *(axis_name(name) for name in extra), *(["draw"] if draws is not None else [])]
    clash = sorted({a for a in axes if axes.count(a) > 1})
    if clash:
        raise NbsimError(f"sweep.extra: the axes {clash} would share one name (a flag's axis drops its dash)")
    points = sweep_points(config)
    seen: dict[tuple[str, str], object] = {}
    for point in points:
        other = seen.setdefault((point.scenario, point.name), point)
        if other is not point:
            raise NbsimError(f"sweep.extra: the values of {dict(point.extras)} and {dict(other.extras)} give "
                             f"the same point name {point.name}")
    check_points(config, points, base, builds)
    return points


def _check_detector(block: dict, drawn: bool) -> None:
    """`sweep.detector`: DetectorResponseConfig's fields (plus `noise: poisson | none`), checked by the
    detector stage's own `check_response`; with draws, the noise and calibration seeds are the draws'."""
    from ..config import DetectorResponseConfig, check_response

    fields = {f.name for f in dataclasses.fields(DetectorResponseConfig)}
    for key, value in block.items():
        if key == "noise":
            if value not in ("poisson", "none"):
                raise NbsimError(f"sweep.detector.noise: expects poisson or none, got {value!r}")
            continue
        if key not in fields:
            raise NbsimError(f"sweep.detector: '{key}' is not a detector setting{did_you_mean(key, fields)}; the "
                             "settings are the fields of nbsim.config.DetectorResponseConfig")
        if drawn and key in ("noise_seed", "calibration_seed"):
            raise NbsimError(f"sweep.detector.{key}: with sweep.draws every point's seeds derive from the draws' "
                             "seed and the point's index")
        try:
            check_option_value(key, value)
        except NbsimError as error:
            raise NbsimError(f"sweep.detector.{key}: {error}") from None
    settings = {k: v for k, v in block.items() if k != "noise"}
    try:
        check_response(DetectorResponseConfig(**settings))
    except NbsimError as error:
        raise NbsimError(f"sweep.detector: {error}") from None


def check_points(config: dict, points: list[Point], base: Path, builds: PointBuilds | None = None) -> None:
    """Build every distinct point as planning builds it (`plan.point_config`) and read each input file its
    configuration names, once, strictly. A point that fails is built again from its scenario alone, then
    with each of its axis values alone, to name the key at fault."""
    from ..config import check_values
    from ..io.inputs import input_file_paths, read_input_file
    from ..io.structure_files import hkl_format

    builds = builds or PointBuilds()
    files_read: set[tuple[str, str, str | None]] = set()
    c_reference = bool((config.get("reference") or {}).get("c_binary"))

    def build(point: Point) -> None:
        simulation = point_config(config, point, base, builds)
        check_values(simulation)
        if simulation.detector.panels:
            _check_panel_scenario(config, c_reference)
        hkl_file = simulation.structure.hkl_file
        if c_reference and (simulation.structure.model_file or (hkl_file and hkl_format(hkl_file) != "text")):
            raise NbsimError("reference.c_binary: nanoBragg reads only h k l F text tables, not an MTZ, mmCIF or "
                             "-model; give both the P1 table nbsim writes with -p1_out")
        if c_reference and (simulation.corrected or simulation.beam.background):
            raise NbsimError("reference.c_binary: nanoBragg renders its own physics only, not -physics corrected "
                             "or -background; compare the C with the default physics")
        for field, path in input_file_paths(simulation).items():
            key = (field, path, simulation.structure.column)
            if path is not None and key not in files_read:
                read_input_file(field, simulation)
                files_read.add(key)

    for point in dict.fromkeys(nbsim_reference_point(p) for p in points):
        try:
            build(point)
        except NbsimError as error:
            raise NbsimError(_blame(build, point, error)) from None


def _check_panel_scenario(config: dict, c_reference: bool) -> None:
    """A -panelfile scenario: its panel file sizes the detector (one sweep size, a label) and the C renders one
    panel (no C reference)."""
    if len(axis_values(config["sweep"]["sizes"])) > 1:
        raise NbsimError("sweep.sizes: -panelfile sizes every panel from its file; give one size (it only names "
                         "the points)")
    if c_reference:
        raise NbsimError("reference.c_binary: the C renders one panel, not a -panelfile detector; drop it for "
                         "nbsim's float64 reference")


def _blame(build: Callable[[Point], None], point: Point, error: NbsimError) -> str:
    """The failing point's error, naming the scenario, the axis value, or the combination at fault."""
    try:
        build(dataclasses.replace(point, extras=(), draw=None))
    except NbsimError as own:
        return f"scenario '{point.scenario}': {own}"
    for name, value in point.extras:
        try:
            build(dataclasses.replace(point, extras=((name, value),)))
        except NbsimError as alone:
            where = f" in scenario '{point.scenario}'" if name.startswith("-") else ""
            return f"sweep.extra.{name}: value {value!r}{where}: {alone}"
    drawn = point.draw.values if point.draw else ()
    for name, value in drawn:
        try:
            build(dataclasses.replace(point, extras=(), draw=Draw(point.draw.index, ((name, value),),
                                                                    point.draw.seeds)))
        except NbsimError as alone:
            return (f"sweep.draws.values.{name}: draw {point.draw.index} gave {value!r} in scenario "
                    f"'{point.scenario}': {alone}")
    where = f"the values {dict(point.extras)}" + (f" and draw {point.draw.index}" if point.draw else "")
    return f"sweep.extra: {where} in scenario '{point.scenario}': {error}"
