"""The sweep's plan, torch-free (the part the Snakefile imports): points, their references, batches and
kernel jobs.

A *point* is one (scenario, detector size, dtype, device, compile, extra option values) combination;
its *reference point* drops dtype, device and compile. Points that share a scenario, size, dtype, device
and compile setting are rendered in *batches* of `sweep.batch_size` by one job; the references of a
(scenario, size) are batched the same way, so point batch `b0003` of every dtype compares against
reference batch `b0003`.
"""

from __future__ import annotations

import itertools
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kernel.modes import choose_mode

CORE_AXES = ("size", "dtype", "device", "compile")


@dataclass(frozen=True)
class Point:
    """One point of the sweep: its axes, typed."""

    scenario: str
    size: int
    """Detector pixels per side."""
    dtype: str
    device: str
    compile: bool
    extras: tuple[tuple[str, Any], ...] = ()
    """(option or nanoBragg flag, value) for each extra axis, in the config's sorted order."""

    @property
    def _extras_suffix(self) -> str:
        return "".join(f"-{axis_name(k)}_{_slug(v)}" for k, v in self.extras)

    @property
    def name(self) -> str:
        return f"n{self.size}-{self.dtype}-{self.device}-compile_{on_off(self.compile)}" + self._extras_suffix

    @property
    def reference_name(self) -> str:
        return f"n{self.size}" + self._extras_suffix

    @property
    def axis_values(self) -> dict[str, Any]:
        """The point's coordinate on every axis of the collated store (extra axes by `axis_name`)."""
        return {"size": self.size, "dtype": self.dtype, "device": self.device, "compile": on_off(self.compile),
                **{axis_name(k): v for k, v in self.extras}}

    @property
    def prebuilds_kernel(self) -> bool:
        """Points that load ahead-of-time kernels (asked of the renderer's own mode choice) get them from
        a `kernel` job first."""
        return choose_mode(self.compile, self.device.split(":")[0], needs_grad=False) == "aot"


def axis_name(option: str) -> str:
    """The axis (table column, store dimension) of an extra option: nanoBragg flags lose their dash,
    so `-phi` is swept along `phi`."""
    return option.lstrip("-")


def on_off(value: bool) -> str:
    return "on" if value else "off"


def _slug(value: Any) -> str:
    text = str(value)
    text = "m" + text[1:] if text.startswith("-") else text
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


def _on(value: Any) -> bool:
    """YAML turns a bare `on` into True; accept either spelling."""
    return value is True or str(value).lower() in ("on", "true", "yes", "1")


def axis_values(spec: list | dict) -> list:
    """An axis's values: a list as given, or a range, `{start, stop, step}` (stop excluded) or
    `{count, start=0, step=1}`. Range values are `start + i * step`, rounded to 12 significant digits so
    that 0.1-steps read as 0.3, not 0.30000000000000004; integers stay integers."""
    if isinstance(spec, list):
        return spec
    start, step = spec.get("start", 0), spec.get("step", 1)
    count = int(spec["count"]) if "count" in spec else max(0, math.ceil((spec["stop"] - start) / step - 1e-9))
    integral = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, step))
    return [start + i * step if integral else float(f"{start + i * step:.12g}") for i in range(count)]


def sweep_points(config: dict) -> list[Point]:
    """Every point of the sweep: scenarios × sizes × dtypes × devices × compile × extra axes, in that
    (product) order."""
    sweep = config["sweep"]
    extra = sweep.get("extra") or {}
    extra_names = sorted(extra)
    points = []
    for scenario in config["scenarios"]:
        for size, dtype, device, compile_, *values in itertools.product(
                axis_values(sweep["sizes"]), sweep["dtypes"], sweep["devices"], sweep["compile"],
                *(axis_values(extra[name]) for name in extra_names)):
            points.append(Point(scenario, int(size), dtype, device, _on(compile_),
                                tuple(zip(extra_names, values, strict=True))))
    return points


def sweep_axes(config: dict) -> list[str]:
    """The collated store's dimensions and the tables' axis columns."""
    return [*CORE_AXES, *(axis_name(name) for name in sorted(config["sweep"].get("extra") or {}))]


def nbsim_reference_point(point: Point) -> Point:
    """The float64 CPU point whose kernel renders the nbsim reference of `point`."""
    return Point(point.scenario, point.size, "float64", "cpu", True, point.extras)


@dataclass(frozen=True)
class Batch:
    """Points rendered one after another by one job (one process, one SLURM job)."""

    scenario: str
    name: str
    points: tuple[Point, ...]
    reference: str | None
    """The reference batch this point batch compares against; None for a reference batch."""

@dataclass(frozen=True)
class SweepPlan:
    """Point batches and reference batches, each by (scenario, name)."""

    batches: dict[tuple[str, str], Batch]
    references: dict[tuple[str, str], Batch]

    def scenario_batches(self, scenario: str) -> list[Batch]:
        return [b for (s, _), b in self.batches.items() if s == scenario]

    def scenario_references(self, scenario: str) -> list[Batch]:
        return [b for (s, _), b in self.references.items() if s == scenario]


def plan_sweep(points: list[Point], batch_size: int) -> SweepPlan:
    """Batch the points: consecutive points (in product order) of one scenario, size, dtype, device and
    compile setting, `batch_size` at a time; changing one value changes only the batch that holds it."""
    groups: dict[tuple, list[Point]] = {}
    for point in points:
        groups.setdefault((point.scenario, point.size, point.dtype, point.device, point.compile), []).append(point)
    batches: dict[tuple[str, str], Batch] = {}
    references: dict[tuple[str, str], Batch] = {}
    for (scenario, size, dtype, device, compile_), members in groups.items():
        for index, start in enumerate(range(0, len(members), batch_size)):
            chunk = tuple(members[start:start + batch_size])
            reference = f"n{size}-b{index:04d}"
            name = f"n{size}-{dtype}-{_slug(device)}-compile_{on_off(compile_)}-b{index:04d}"
            batches[(scenario, name)] = Batch(scenario, name, chunk, reference)
            references.setdefault((scenario, reference), Batch(scenario, reference, chunk, None))
    return SweepPlan(batches, references)


@dataclass(frozen=True)
class KernelJob:
    """One `kernel` job: the ahead-of-time kernels of one structure, dtype and device."""

    structure: str
    """nbsim.kernel.backends.Structure as JSON."""
    dtype: str
    device: str


def kernel_jobs(config: dict, points: list[Point], compiled_reference: bool,
                base: Path) -> tuple[dict[str, KernelJob], dict[Point, str]]:
    """The kernel jobs of a sweep (by name) and each prebuilding point's kernel job name. Points share a
    job when their structure, dtype and device agree, whatever their sizes and values;
    `compiled_reference` adds the float64 kernels the nbsim references use."""
    candidates = list(points) + ([nbsim_reference_point(p) for p in points] if compiled_reference else [])
    jobs: dict[str, KernelJob] = {}
    names: dict[Point, str] = {}
    structures: dict[tuple, Any] = {}
    for point in candidates:
        if not point.prebuilds_kernel or point in names:
            continue
        key = (point.scenario, point.size, point.extras)
        if key not in structures:
            args, overrides = point_arguments(config, point, base)
            structures[key] = arguments_structure(args, overrides)
        structure = structures[key]
        name = f"{point.dtype}-{_slug(point.device)}-{structure.name}"
        jobs.setdefault(name, KernelJob(structure.to_json(), point.dtype, point.device))
        names[point] = name
    return jobs, names


def arguments_structure(args: list[str], overrides: dict[str, Any]):
    """The kernel structure (nbsim.kernel.backends.Structure) a point's arguments and option overrides
    render with."""
    from ..kernel.structure import structure_of
    from ..nanobragg import parse

    config, _ = parse(args)
    if overrides:
        config = config.with_options(**overrides)
    return structure_of(config)


def scenario_args(config: dict, scenario: str, base: Path) -> list[str]:
    """A scenario's nanoBragg arguments, with file values made absolute against the config's folder."""
    from ..nanobragg.flags import absolute_file_arguments

    spec = config["scenarios"][scenario]
    args = spec["args"] if isinstance(spec["args"], list) else shlex.split(spec["args"])
    return absolute_file_arguments([str(a) for a in args], base)


def point_arguments(config: dict, point: Point, base: Path) -> tuple[list[str], dict[str, Any]]:
    """nanoBragg arguments of a point (size appended, flag axes appended) and its option overrides."""
    from ..nanobragg.flags import absolute_file_arguments

    flags: list[str] = []
    overrides: dict[str, Any] = {}
    for name, value in point.extras:
        if name.startswith("-"):
            flags += [name, str(value)]
        else:
            overrides[name] = value
    args = scenario_args(config, point.scenario, base) + ["-detpixels", str(point.size)]
    return args + absolute_file_arguments(flags, base), overrides


def c_binary_path(config: dict, base: Path) -> str | None:
    import shutil

    binary = (config.get("reference") or {}).get("c_binary")
    if not binary:
        return None
    return shutil.which(binary) or str((base / binary).resolve())
