"""Sweep configuration checks: the JSON schema (with its defaults filled in), then what a schema cannot
say. Every failure is an NbsimError with a one-line reason naming the offending key."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from ..errors import NbsimError
from .plan import CORE_AXES, axis_name, axis_values, c_binary_path, scenario_args, sweep_points

MAX_AXIS_VALUES = 1_000_000


def validate_config(config: dict, schema_path: str | Path, base: Path) -> None:
    """Check the config against the JSON schema (filling its defaults), then semantically."""
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(_validator_with_defaults(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        where = ".".join(str(p) for p in error.absolute_path) or "top level"
        raise NbsimError(f"{where}: {_short_message(error)}")
    check_config(config, base)


def _validator_with_defaults(schema: dict):
    """A jsonschema validator that also fills in defaults, as snakemake's validate() does."""
    import jsonschema

    base = jsonschema.validators.validator_for(schema)
    original = base.VALIDATORS["properties"]

    def properties(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for name, property_schema in properties.items():
                if "default" in property_schema:
                    instance.setdefault(name, copy.deepcopy(property_schema["default"]))
        yield from original(validator, properties, instance, subschema)

    return jsonschema.validators.extend(base, {"properties": properties})(schema)


def _short_message(error) -> str:
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"unknown key(s) {', '.join(map(repr, extra))}"
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


def _check_value(args: list[str], name: str, value, scenario: str, base: Path) -> None:
    """A flag's value must parse after the scenario's arguments (and a file it names must read, relative to
    the config's folder); an option's value must have the option's type (its annotation in nbsim.config)."""
    from ..io.inputs import input_file_paths, read_input_file
    from ..nanobragg import parse
    from ..nanobragg.flags import absolute_file_arguments

    where = f"sweep.extra.{name}: value {value!r}"
    if name.startswith("-"):
        flag = absolute_file_arguments([name, str(value)], base)
        try:
            config, _ = parse(args + flag)
            for field, path in input_file_paths(config).items():
                if path == flag[1]:  # the input file this value names (the scenario's own were read already)
                    read_input_file(field, path)
        except NbsimError as error:
            raise NbsimError(f"{where} in scenario '{scenario}': {error}") from None
        return
    kind = option_types()[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    valid = {"bool": isinstance(value, bool), "str": isinstance(value, str), "int": number and value == int(value),
             "float": number, "Scalar": number}
    if kind not in valid:
        raise NbsimError(f"sweep.extra.{name}: a {kind} option cannot be an axis of single values; sweep the "
                         "nanoBragg flag that sets it instead")
    if not valid[kind]:
        expected = {"bool": "true or false", "str": "text", "int": "an integer"}.get(kind, "a number")
        raise NbsimError(f"{where}: expects {expected}")


def option_types() -> dict[str, str]:
    """Each simulator option's type as annotated in nbsim.config, without `| None`."""
    import dataclasses

    from ..config import BeamConfig, CrystalConfig, DetectorConfig, StructureFactorConfig

    return {f.name: str(f.type).removesuffix(" | None") for cls in (CrystalConfig, BeamConfig, DetectorConfig,
                                                                    StructureFactorConfig)
            for f in dataclasses.fields(cls)}


def check_config(config: dict, base: Path) -> None:
    """Semantic checks the schema cannot express."""
    from ..config import option_names
    from ..io.inputs import read_input_files
    from ..nanobragg import parse
    from ..nanobragg.flags import FLAGS

    sweep = config["sweep"]
    names = option_names()
    _check_axis("sweep.sizes", sweep["sizes"])
    sizes = axis_values(sweep["sizes"])
    if any(not isinstance(size, int) or not 1 <= size <= 65536 for size in sizes):
        raise NbsimError("sweep.sizes: detector sizes are whole numbers of pixels from 1 to 65536")
    extra = sweep.get("extra") or {}
    for name, spec in extra.items():
        if name.startswith("-"):
            if name not in FLAGS:
                raise NbsimError(f"sweep.extra: '{name}' is not a nanoBragg option")
        elif name not in names:
            raise NbsimError(f"sweep.extra: '{name}' is not a simulator option (known: see nbsim.config)")
        _check_axis(f"sweep.extra.{name}", spec)
    axes = [*CORE_AXES, *(axis_name(name) for name in extra)]
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
    for scenario in config["scenarios"]:
        args = scenario_args(config, scenario, base) + ["-detpixels", str(sizes[0])]
        try:
            read_input_files(parse(args)[0])
        except NbsimError as error:
            raise NbsimError(f"scenario '{scenario}': {error}") from None
        for name, spec in extra.items():
            for value in axis_values(spec):
                _check_value(args, name, value, scenario, base)
    binary = (config.get("reference") or {}).get("c_binary")
    if binary:
        path = Path(c_binary_path(config, base))
        if not path.is_file():
            raise NbsimError(f"reference.c_binary {binary} does not exist")
        if not os.access(path, os.X_OK):
            raise NbsimError(f"reference.c_binary {binary} is not executable")
