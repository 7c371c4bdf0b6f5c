"""The sweep's plan, torch-free (the part the Snakefile imports): points, their references, their specs,
batches and kernel jobs.

A *point* is one (scenario, detector size, dtype, device, compile, extra option values) combination;
its *reference point* drops dtype, device and compile. Points that share a scenario, size, dtype, device
and compile setting are rendered in *batches* of `sweep.batch_size` by one job; the references of a
(scenario, size) are batched the same way, so point batch `b0003` of every dtype compares against
reference batch `b0003`.

`point_config` builds what a point renders, the one construction that planning (`point_spec`, the
`PointSpec` a batch job receives) and validation (`nbsim.sweep.validate`) share; a `PointBuilds` given to
them makes each parse once for the whole planning.

Why one module of this length: its two halves, naming the points (`Point`, `sweep_points`, `plan_sweep`)
and building what each point renders (`point_config`, `point_spec`, `kernel_jobs`), are the one plan the
Snakefile imports, and each half reads the other's names (a point's name is its batch's and its kernel's).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import shlex
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import SimulationConfig, counts_left_to_advice
from ..errors import NbsimError
from ..modes import Compile, Mode, choose_mode
from ..nanobragg.flags import SAMPLING_FLAG
from .draws import RANDOM_ORIENTATION, SPECTRUM, Draw, draw, draw_count
from .labels import drawn_labels
from .spec import PointSpec, field_types, is_union

if typing.TYPE_CHECKING:
    from ..resolve import SamplingAdvisor

CORE_AXES = ("size", "dtype", "device", "compile")


@dataclass(frozen=True)
class Point:
    """One point of the sweep: its axes, typed."""

    scenario: str
    size: int
    """Detector pixels per side."""
    dtype: str
    device: str
    compile: Compile
    extras: tuple[tuple[str, Any], ...] = ()
    """(option or nanoBragg flag, value) for each extra axis, in the config's sorted order."""
    draw: Draw | None = None
    """Its random draw (`sweep.draws`), None without one."""

    @property
    def _extras_suffix(self) -> str:
        drawn = f"-draw_{self.draw.index}" if self.draw else ""
        return "".join(f"-{axis_name(k)}_{_slug(v)}" for k, v in self.extras) + drawn

    @property
    def name(self) -> str:
        """The point's name: size, dtype, device, compile setting, extra values and draw."""
        return f"n{self.size}-{self.dtype}-{self.device}-compile_{self.compile.value}" + self._extras_suffix

    @property
    def reference_name(self) -> str:
        """Its reference point's name: size, extra values and draw."""
        return f"n{self.size}" + self._extras_suffix

    @property
    def axis_values(self) -> dict[str, Any]:
        """The point's coordinate on every axis of the collated store (extra axes by `axis_name`)."""
        return {"size": self.size, "dtype": self.dtype, "device": self.device, "compile": self.compile.value,
                **{axis_name(k): v for k, v in self.extras}, **({"draw": self.draw.index} if self.draw else {})}

    @property
    def _drawn(self) -> tuple[tuple[str, Any], ...]:
        return self.draw.values if self.draw else ()

    @property
    def flags(self) -> tuple[tuple[str, Any], ...]:
        """Its nanoBragg flag axes and drawn flags (names starting with '-') and their values."""
        return tuple((k, v) for k, v in (*self.extras, *self._drawn)
                     if k.startswith("-") and k != RANDOM_ORIENTATION)

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """Its simulator option axes and drawn options (nbsim.config field names) and their values."""
        return tuple((k, v) for k, v in (*self.extras, *self._drawn) if not k.startswith("-"))

    @property
    def draw_settings(self) -> tuple[tuple[str, Any], ...]:
        """With a draw, its mosaic seed and, where the orientation is drawn, its misset angles, as options:
        what its `draw_arguments` set (applied as options so that draws of options alone share one parse)."""
        if not self.draw:
            return ()
        misset = [v for k, v in self.draw.values if k == RANDOM_ORIENTATION]
        return (("mosaic_seed", dict(self.draw.seeds)["mosaic"]),
                *((("misset_deg", misset[0]), ("misset_random", False)) if misset else ()))

    @property
    def draw_arguments(self) -> tuple[str, ...]:
        """`draw_settings` as nanoBragg arguments, `-mosaic_seed` and `-misset` with three angles (exact
        decimal forms), for the C binary and the records."""
        words: list[str] = []
        for name, value in self.draw_settings:
            if name == "mosaic_seed":
                words += ["-mosaic_seed", str(value)]
            elif name == "misset_deg":
                words += ["-misset", *(repr(angle) for angle in value)]
        return tuple(words)

    @property
    def kernel_mode(self) -> Mode:
        """How the point's kernel runs (asked of the renderer's own mode choice)."""
        return choose_mode(self.compile, self.device.split(":")[0], needs_grad=False)

    @property
    def prebuilds_kernel(self) -> bool:
        """Compiled points get their kernels from a `kernel` job first: ahead-of-time packages built and
        probed, or the just-in-time compile warmed in the on-disk caches (nbsim.sweep.jobs.build_kernel)."""
        return self.kernel_mode is not Mode.EAGER


def axis_name(option: str) -> str:
    """The axis (table column, store dimension) of an extra option: nanoBragg flags lose their dash,
    so `-phi` is swept along `phi`."""
    return option.lstrip("-")


def _slug(value: Any) -> str:
    text = str(value)
    text = "m" + text[1:] if text.startswith("-") else text
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


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
    """Every point of the sweep: scenarios × sizes × dtypes × devices × compile × extra axes × draws, in
    that (product) order."""
    sweep = config["sweep"]
    extra = sweep.get("extra") or {}
    extra_names = sorted(extra)
    draws = [draw(sweep["draws"], index) for index in range(draw_count(config))] or [None]
    points = []
    for scenario in config["scenarios"]:
        for size, dtype, device, compile_, *values, drawn in itertools.product(
                axis_values(sweep["sizes"]), sweep["dtypes"], sweep["devices"], sweep["compile"],
                *(axis_values(extra[name]) for name in extra_names), draws):
            points.append(Point(scenario, int(size), dtype, device, Compile.of(compile_),
                                tuple(zip(extra_names, values, strict=True)), drawn))
    return points


def sweep_axes(config: dict) -> list[str]:
    """The collated store's dimensions and the tables' axis columns (`draw` last, with draws)."""
    return [*CORE_AXES, *(axis_name(name) for name in sorted(config["sweep"].get("extra") or {})),
            *(["draw"] if "draws" in config["sweep"] else [])]


def nbsim_reference_point(point: Point) -> Point:
    """The float64 CPU point whose kernel renders the nbsim reference of `point`."""
    return Point(point.scenario, point.size, "float64", "cpu", Compile.ON, point.extras, point.draw)


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
        """A scenario's point batches."""
        return [b for (s, _), b in self.batches.items() if s == scenario]

    def scenario_references(self, scenario: str) -> list[Batch]:
        """A scenario's reference batches."""
        return [b for (s, _), b in self.references.items() if s == scenario]


def plan_sweep(points: list[Point], batch_size: int | Mapping[tuple[str, int], int]) -> SweepPlan:
    """Batch the points: consecutive points (in product order) of one scenario, size, dtype, device and
    compile setting, `batch_size` at a time (one for all, or one per (scenario, size): `sweep.batching`);
    changing one value changes only the batch that holds it."""
    groups: dict[tuple, list[Point]] = {}
    for point in points:
        groups.setdefault((point.scenario, point.size, point.dtype, point.device, point.compile), []).append(point)
    batches: dict[tuple[str, str], Batch] = {}
    references: dict[tuple[str, str], Batch] = {}
    for (scenario, size, dtype, device, compile_), members in groups.items():
        step = batch_size if isinstance(batch_size, int) else batch_size[(scenario, size)]
        for index, start in enumerate(range(0, len(members), step)):
            chunk = tuple(members[start:start + step])
            reference = f"n{size}-b{index:04d}"
            name = f"n{size}-{dtype}-{_slug(device)}-compile_{compile_.value}-b{index:04d}"
            batches[(scenario, name)] = Batch(scenario, name, chunk, reference)
            references.setdefault((scenario, reference), Batch(scenario, reference, chunk, None))
    return SweepPlan(batches, references)


@dataclass(frozen=True)
class KernelJob:
    """One `kernel` job: the compiled kernels of one structure, dtype and device, made ready before the timed
    jobs (nbsim.sweep.jobs.build_kernel)."""

    structure: str
    """nbsim.kernel.stages.Structure as JSON."""
    dtype: str
    device: str
    mode: str
    """The points' kernel mode: 'aot' (packages built and probed, the just-in-time path warmed where this
    machine refuses one) or 'jit' (the just-in-time path warmed)."""
    threads: int
    """The timed jobs' CPU threads (timing.threads): just-in-time CPU code is compiled for that count."""


def kernel_jobs(config: dict, points: list[Point], compiled_reference: bool, base: Path,
                memo: StructureMemo, builds: PointBuilds | None = None
                ) -> tuple[dict[str, KernelJob], dict[Point, str]]:
    """The kernel jobs of a sweep (by name) and each prebuilding point's kernel job name. Points share a
    job when their structure, dtype and device agree, whatever their sizes and values;
    `compiled_reference` adds the float64 kernels the nbsim references use. `memo` (`structure_memo`)
    keeps each configuration's structure for the next plan of the same nbsim sources; `builds` shares the
    points' parsed configurations."""
    builds = builds or PointBuilds()
    candidates = list(points) + ([nbsim_reference_point(p) for p in points] if compiled_reference else [])
    jobs: dict[str, KernelJob] = {}
    names: dict[Point, str] = {}
    structures: dict[tuple, tuple[str, str]] = {}
    for point in candidates:
        if not point.prebuilds_kernel or point in names:
            continue
        key = (point.scenario, point.size, point.extras, point.draw)
        if key not in structures:
            structures[key] = memo.structure(point_config(config, point, base, builds))
        structure_name, structure_json = structures[key]
        name = f"{point.dtype}-{_slug(point.device)}-{structure_name}"
        jobs.setdefault(name, KernelJob(structure_json, point.dtype, point.device, point.kernel_mode.value,
                                        config["timing"]["threads"]))
        names[point] = name
    return jobs, names


class StructureMemo:
    """Each configuration's kernel structure (name, JSON) and steps per pixel, kept in a JSON file for the
    next plan of the same nbsim sources: computing them (`kernel.structure`) imports PyTorch, seconds of every
    Snakemake start that plans compiled points or sizes batches. Keyed by the SHA-256 of the configuration's
    repr (its dataclasses hold plain values only, so the repr is the whole configuration)."""

    def __init__(self, path: Path | None):
        import json

        from ..cache import sources_digest

        self.path = path
        try:
            known = json.loads(path.read_text()) if path is not None else {}
        except (OSError, ValueError):
            known = {}
        self.known = known if known.get("sources") == sources_digest() else {"sources": sources_digest()}
        for part in ("names", "structures", "steps"):
            self.known.setdefault(part, {})
        self.added = False

    @staticmethod
    def _key(simulation: SimulationConfig) -> str:
        import hashlib

        return hashlib.sha256(repr(simulation).encode()).hexdigest()

    def structure(self, simulation: SimulationConfig) -> tuple[str, str]:
        """The configuration's kernel structure as (name, JSON)."""
        names, structures, key = self.known["names"], self.known["structures"], self._key(simulation)
        if key not in names:
            from ..kernel.structure import structure_of

            structure = structure_of(simulation)
            names[key], structures[structure.name], self.added = structure.name, structure.to_json(), True
        return names[key], structures[names[key]]

    def steps_per_pixel(self, simulation: SimulationConfig) -> int:
        """The steps each of the configuration's pixels sums (`kernel.structure.steps_per_pixel`)."""
        steps, key = self.known["steps"], self._key(simulation)
        if key not in steps:
            from ..kernel.structure import steps_per_pixel

            steps[key], self.added = steps_per_pixel(simulation), True
        return steps[key]

    def save(self) -> None:
        """Write what was added back to the file (quietly not, where it cannot be written)."""
        import json

        from ..io.atomic import atomic_write_text

        if self.added and self.path is not None:
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.path, json.dumps(self.known))


@contextlib.contextmanager
def structure_memo(path: Path | None) -> Iterator[StructureMemo]:
    """The `StructureMemo` of `path` (None: kept in memory only), saved on exit."""
    memo = StructureMemo(path)
    yield memo
    memo.save()


class PointBuilds:
    """What one planning builds for its points, each once: the scenarios' arguments split and made absolute,
    the parse of each distinct argv (shared by the points of every dtype, device, compile setting, option
    value and draw of options), each point's configuration (shared by validation, the kernel jobs and the
    batch specs) and the sampling advice's shared parts (`resolve.SamplingAdvisor`). The Snakefile keeps one
    for its whole planning; a function given none makes its own. Measured (docs/benchmarks.md, "Planning"):
    config/examples/dataset.yaml's 10,000 shots plan in 2.5 s of CPU with one, 3.1 s keeping parses alone,
    5.4 s with one per call."""

    def __init__(self) -> None:
        self._arguments: dict[tuple[str | tuple, Path], tuple[str, ...]] = {}
        self._parsed: dict[tuple[str, ...], SimulationConfig] = {}
        self._configured: dict[tuple, SimulationConfig] = {}
        self._advisor: SamplingAdvisor | None = None

    def arguments(self, args: str | tuple, base: Path) -> tuple[str, ...]:
        """A scenario's arguments split (a string) and with file values made absolute against `base`."""
        key = (args, base)
        if key not in self._arguments:
            from ..nanobragg.flags import absolute_file_arguments

            words = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
            self._arguments[key] = tuple(absolute_file_arguments(words, base))
        return self._arguments[key]

    def configured(self, argv: tuple[str, ...], options: tuple[tuple[str, Any], ...],
                   settings: tuple[tuple[str, Any], ...] = ()) -> SimulationConfig:
        """`argv` parsed, then the options (each checked) and a draw's settings applied, and under -sampling
        advised the counts it leaves out set (`resolve.with_advised_sampling`, as the render sets them)."""
        key = (argv, options, settings)
        if key not in self._configured:
            for name, value in options:
                check_option_value(name, value)
            if argv not in self._parsed:
                from ..nanobragg import config_from_args

                self._parsed[argv] = config_from_args(list(argv))
            configured = self._parsed[argv].with_options(**dict(options), **dict(settings))
            if any(counts_left_to_advice(configured)):
                from ..resolve import SamplingAdvisor, with_advised_sampling

                self._advisor = self._advisor or SamplingAdvisor()
                configured = with_advised_sampling(configured, self._advisor)
            self._configured[key] = configured
        return self._configured[key]


def scenario_args(config: dict, scenario: str, base: Path, builds: PointBuilds | None = None) -> tuple[str, ...]:
    """A scenario's nanoBragg arguments, with file values made absolute against the config's folder."""
    args = config["scenarios"][scenario]["args"]
    return (builds or PointBuilds()).arguments(tuple(args) if isinstance(args, list) else args, base)


def point_argv(config: dict, point: Point, base: Path, draw_arguments: bool = True,
               builds: PointBuilds | None = None) -> tuple[str, ...]:
    """A point's nanoBragg arguments: its scenario's, its size (not for a -panelfile scenario: the panel file
    sizes its panels), its flag axes and drawn flags (file values absolute), `-sampling advised` for a draw
    (a dataset's shots take the φ steps and mosaic domains nbsim advises, unless its arguments say
    otherwise), then (`draw_arguments`) its draw's seed and orientation arguments."""
    from ..nanobragg.flags import absolute_file_arguments

    flags = [text for name, value in point.flags for text in (name, str(value))]
    scenario = scenario_args(config, point.scenario, base, builds)
    size = () if "-panelfile" in scenario else ("-detpixels", str(point.size))
    chosen = SAMPLING_FLAG in (*scenario, *flags) or "sampling" in dict(point.options)
    advised = (SAMPLING_FLAG, "advised") if point.draw and not chosen else ()
    return (*scenario, *size, *absolute_file_arguments(flags, base), *advised,
            *(point.draw_arguments if draw_arguments else ()))


def point_config(config: dict, point: Point, base: Path, builds: PointBuilds | None = None) -> SimulationConfig:
    """What a point renders: its nanoBragg arguments parsed, then its detector settings and option axes
    applied, each checked against the option's type (`PointBuilds.configured`). The one construction
    planning and validation share; NbsimError for a value that does not build."""
    builds = builds or PointBuilds()
    detector = detector_settings(config, point)
    # Without a detector stage no noise is drawn: the clock-based seed a parse without -seed takes would only
    # make the point's parameters differ from run to run.
    unused = () if detector else (("noise_seed", None),)
    return builds.configured(point_argv(config, point, base, draw_arguments=False, builds=builds),
                             (*detector, *point.options), (*point.draw_settings, *unused))


DEFAULT_NOISE_SEED = 1
"""A sweep's noise seed without draws and without `sweep.detector.noise_seed`."""


def detector_settings(config: dict, point: Point) -> tuple[tuple[str, Any], ...]:
    """The `sweep.detector` block as `DetectorResponseConfig` options: its keys (field names) as given, `noise:
    poisson` / `none` as `poisson`, the counter-based `philox` generator unless another is named, and with a
    draw, its noise and calibration seeds; () without the block (no detector stage)."""
    block = config["sweep"].get("detector")
    if block is None:
        return ()
    settings = {"generator": "philox", "noise_seed": DEFAULT_NOISE_SEED,
                **{k: v for k, v in block.items() if k != "noise"}}
    if "noise" in block:
        settings["poisson"] = block["noise"] == "poisson"
    if point.draw:
        seeds = dict(point.draw.seeds)
        settings.update(noise_seed=seeds["noise"], calibration_seed=seeds["calibration"])
    return tuple(sorted(settings.items()))


@functools.cache
def option_types() -> dict[str, Any]:
    """Each simulator option's type (nbsim.config's field types, resolved)."""
    return {name: hint for part in field_types(SimulationConfig).values() for name, hint in field_types(part).items()}


def check_option_value(name: str, value: Any) -> None:
    """An option axis's value must have the option's type: a bool, a number (an integer for an int), text
    or one of a Literal's values; an option holding several values (a cell, a vector) is no axis. The
    error says what is expected; the caller names the key."""
    hint = option_types()[name]
    members = [m for m in (typing.get_args(hint) if is_union(hint) else (hint,)) if m is not type(None)]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    accepted = {bool: ("true or false", isinstance(value, bool)), str: ("text", isinstance(value, str)),
                int: ("an integer", number and float(value).is_integer()), float: ("a number", number)}
    if typing.get_origin(members[0]) is typing.Literal:
        choices = typing.get_args(members[0])
        if value not in choices:
            raise NbsimError(f"expects one of {', '.join(map(repr, choices))}")
        return
    if name == SPECTRUM and isinstance(value, tuple) and all(
            isinstance(channel, tuple) and len(channel) == 2 for channel in value):
        return  # a drawn spectrum (`sase`): its values are checked when the point is set up
    kinds = [m for m in members if m in accepted]
    if not kinds:
        raise NbsimError(f"{name} holds several values and cannot be an axis of single values; "
                         "sweep the nanoBragg flag that sets it instead")
    if not any(accepted[kind][1] for kind in kinds):
        raise NbsimError(f"expects {accepted[kinds[0]][0]}")


def point_spec(config: dict, point: Point, base: Path, kernel_of_point: dict[Point, str],
               as_reference: bool = False, builds: PointBuilds | None = None) -> PointSpec:
    """A point as its batch job renders it (`as_reference`: as its reference batch renders it)."""
    builds = builds or PointBuilds()
    kernel_point = nbsim_reference_point(point) if as_reference else point
    argv = point_argv(config, point, base, builds=builds)
    return PointSpec(name=point.reference_name if as_reference else point.name, reference=point.reference_name,
                     size=point.size, axes=point.axis_values, config=point_config(config, point, base, builds),
                     argv=argv, kernel=kernel_of_point.get(kernel_point), labels=drawn_labels(point.draw))


def c_binary_path(config: dict, base: Path) -> str | None:
    """The C reference binary (`reference.c_binary`, on PATH or relative to the config), or None."""
    import shutil

    binary = (config.get("reference") or {}).get("c_binary")
    if not binary:
        return None
    return shutil.which(binary) or str((base / binary).resolve())


def compile_cache_path(config: dict) -> str:
    """The kernel cache the sweep's jobs use: `compile_cache` when the config names one (relative to the
    working folder), else the user's (NBSIM_CACHE_DIR, default ~/.cache/nbsim), the one `nbsim` uses, so
    that kernels built by either serve the other."""
    from ..cache import cache_dir

    return str(Path(config.get("compile_cache") or cache_dir()).expanduser().resolve())
