"""A sweep point as a typed, serialisable spec: what the batch job renders and the records keep.

The Snakefile builds one `PointSpec` per point at planning (its nanoBragg arguments parsed once into a
`SimulationConfig`), hands it to the batch job as plain JSON data (`to_dict`), and the job restores it
exactly (`from_dict`) and renders `spec.config` without parsing anything. The codec is generic: it walks
dataclass fields and their resolved type hints, so a field added to the configuration needs no code here.
Torch-free (the Snakefile imports it).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from ..config import SimulationConfig

Data = TypeVar("Data")


class _TorchForTypeHints:
    """Stands for the torch module while type hints are resolved: the configuration's `Scalar` names
    torch.Tensor only for type checkers, and resolving it must not import torch."""

    class Tensor:
        pass


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved (`typing.get_type_hints`)."""
    return typing.get_type_hints(cls, localns={"torch": _TorchForTypeHints})


def dataclass_to_dict(instance: Any) -> dict[str, Any]:
    """A dataclass as JSON-able data: nested dataclasses as dicts, tuples as lists, enums as their values."""
    return _encode(instance)


def dataclass_from_dict(cls: type[Data], data: Mapping[str, Any]) -> Data:
    """The dataclass `dataclass_to_dict` wrote, restored exactly: lists become tuples where the field is a
    tuple, dicts become the field's dataclass, values become the field's enum; None stays None."""
    hints = field_types(cls)
    return cls(**{field.name: _decode(hints[field.name], data[field.name])
                  for field in dataclasses.fields(cls) if field.name in data})


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _encode(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _encode(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} cannot be written as JSON data")


def _decode(hint: Any, value: Any) -> Any:
    if value is None or hint is Any:
        return value
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _decode(_member_for(arguments, value), value)
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_decode(arguments[0], item) for item in value)
        return tuple(_decode(item_hint, item) for item_hint, item in zip(arguments, value, strict=True))
    if origin is list:
        return [_decode(arguments[0], item) for item in value]
    if origin in (dict, Mapping):
        return {key: _decode(arguments[1], item) for key, item in value.items()}
    if dataclasses.is_dataclass(hint):
        return dataclass_from_dict(hint, value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    return value


def _member_for(members: tuple[Any, ...], value: Any) -> Any:
    """The member of a union that JSON `value` was written from: the one whose shape (sequence, mapping,
    plain value) it has; plain values (float | Tensor) are restored as they were written."""
    candidates = [m for m in members if m is not type(None)]
    for member in candidates:
        origin = typing.get_origin(member) or member
        if isinstance(value, list) and origin in (tuple, list):
            return member
        if isinstance(value, Mapping) and (origin in (dict, Mapping) or dataclasses.is_dataclass(member)):
            return member
        if isinstance(member, type) and issubclass(member, Enum) and not isinstance(value, (list, Mapping)):
            return member
    return Any


@dataclass(frozen=True)
class PointSpec:
    """One point as a batch job renders it and its records keep it."""

    name: str
    """The point's name (`n128-float32-cpu-compile_on-phi_12.5`), or its reference's in a reference batch."""
    reference: str
    """The name of the reference point its image is compared with (`n128-phi_12.5`)."""
    size: int
    """Detector pixels per side."""
    axes: Mapping[str, Any]
    """Its coordinate on every axis of the collated store."""
    config: SimulationConfig
    """What it renders: its nanoBragg arguments parsed once at planning, then its option axes applied."""
    argv: tuple[str, ...]
    """Its nanoBragg arguments: what the C reference binary runs, and what a human reads in the records."""
    kernel: str | None
    """The kernel job whose ahead-of-time kernels it loads; None when it renders without one."""

    def to_dict(self) -> dict[str, Any]:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PointSpec:
        return dataclass_from_dict(cls, data)
