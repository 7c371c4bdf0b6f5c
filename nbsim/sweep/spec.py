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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from ..config import SimulationConfig
from ..modes import Compile

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
    return cls(**{name: decode(data[name]) for name, decode in _field_decoders(cls) if name in data})


_PLAIN = (bool, int, float, str)


def _encode(value: Any) -> Any:
    if value is None or type(value) in _PLAIN:
        return value
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _encode(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _encode(getattr(value, name)) for name, _ in _field_decoders(type(value))}
    if isinstance(value, _PLAIN):
        return value
    raise TypeError(f"a {type(value).__name__} cannot be written as JSON data")


Decoder = Callable[[Any], Any]


@functools.cache
def _field_decoders(cls: type) -> tuple[tuple[str, Decoder], ...]:
    hints = field_types(cls)
    return tuple((field.name, _decoder(hints[field.name])) for field in dataclasses.fields(cls))


def _as_is(value: Any) -> Any:
    return value


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """How to restore a value of type `hint` from its JSON data (None always stays None), built once per
    type."""
    decode = _structure_decoder(hint)
    return lambda value: None if value is None else decode(value)


def is_union(hint: Any) -> bool:
    """Whether a type hint is a union (`A | B`, `Optional[A]`)."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _structure_decoder(hint: Any) -> Decoder:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if is_union(hint):
        return _union_decoder([m for m in arguments if m is not type(None)])
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            item = _decoder(arguments[0])
            return lambda value: tuple(item(v) for v in value)
        items = tuple(_decoder(a) for a in arguments)
        return lambda value: tuple(decode(v) for decode, v in zip(items, value, strict=True))
    if origin is list:
        item = _decoder(arguments[0])
        return lambda value: [item(v) for v in value]
    if origin in (dict, Mapping):
        item = _decoder(arguments[1])
        return lambda value: {key: item(v) for key, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return lambda value: dataclass_from_dict(hint, value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint
    return _as_is


def _union_decoder(members: list[Any]) -> Decoder:
    """A union's value is restored by the member whose shape it has (a sequence, a mapping, an enum's
    value); plain values (float | Tensor) stay as they were written."""
    def shaped(*shapes: Any) -> Decoder:
        return next((_decoder(m) for m in members if (typing.get_origin(m) or m) in shapes
                     or (Mapping in shapes and dataclasses.is_dataclass(m))), _as_is)

    sequence, mapping = shaped(tuple, list), shaped(dict, Mapping)
    plain = next((_decoder(m) for m in members if isinstance(m, type) and issubclass(m, Enum)), _as_is)
    return lambda value: (sequence if isinstance(value, list) else mapping if isinstance(value, Mapping)
                          else plain)(value)


@dataclass(frozen=True)
class PointSpec:
    """One point as a batch job renders it and its records keep it."""

    name: str
    """The point's name (`n128-float32-cpu-compile_on-phi_12.5`), or its reference's in a reference batch."""
    reference: str
    """The name of the reference point its image is compared with (`n128-phi_12.5`)."""
    size: int
    """Detector pixels per side (a label only for a -panelfile scenario, whose file sizes its panels)."""
    axes: Mapping[str, Any]
    """Its coordinate on every axis of the collated store."""
    config: SimulationConfig
    """What it renders: its nanoBragg arguments parsed once at planning, then its option axes applied."""
    argv: tuple[str, ...]
    """Its nanoBragg arguments: what the C reference binary runs, and what a human reads in the records."""
    kernel: str | None
    """The kernel job whose ahead-of-time kernels it loads; None when it renders without one."""
    labels: Mapping[str, Any] = field(default_factory=dict)
    """Its draw's labels: index, drawn values and seeds (nbsim.sweep.labels.drawn_labels); {} without one."""

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Its image's shape: (size, size), or (panels, slow, fast) padded to the largest panel."""
        panels = self.config.detector.panels
        if not panels:
            return self.size, self.size
        return len(panels), max(p.pixels_s for p in panels), max(p.pixels_f for p in panels)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), as a job's parameters carry it."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PointSpec:
        """The spec `to_dict` wrote."""
        return dataclass_from_dict(cls, data)


@dataclass(frozen=True)
class BatchJob:
    """What one batch job needs (its rule's params, as `to_dict` data): its points' specs in order and how
    to render and time them."""

    scenario: str
    batch: str
    points: tuple[PointSpec, ...]
    dtype: str
    device: str
    compile: Compile
    warmup: int
    repeats: int
    threads: int
    compile_cache: str
    every_point: bool = True
    """Time `warmup` and `repeats` on every point; False (a dataset's default): on the batch's first point
    only, every other point rendered once."""
    c_binary: str | None = None
    """Reference batches only: time this nanoBragg binary instead of nbsim in float64."""
    on_unavailable_device: str = "fail"
    is_reference: bool = False
    """A reference batch: float64 nbsim images (or the C binary's), compared with nothing."""
    detector: bool = False
    """Keep each point's detector image (the detector stage under its `config.response`) beside its image."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), as a job's parameters carry it."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchJob:
        """The batch job `to_dict` wrote."""
        return dataclass_from_dict(cls, data)
