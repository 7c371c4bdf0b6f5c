"""The integration route on nbsim's stills: Debian's DIALS 3.12 from images to a merged MTZ, the baseline
beside `nbsim merge` (issue 38; docs/dials_route.md says which commands and why).

    from benchmarks.dials_route import integrate_and_merge, score_against_truth
    record = integrate_and_merge(images, work, "P 61", (60, 60, 90, 90, 90, 120), anomalous=True)
    scores = score_against_truth(record["mtz"], "truth.mtz")   # cc, cc_anomalous, by shell

    python benchmarks/dials_route.py still_*.cbf --space_group P43212 --cell 40 40 50 90 90 90 --out DIR \
        [--truth truth.mtz] [--no-anomalous] [--nproc N]
    python benchmarks/dials_route.py --render 5 --space_group P43212 --cell 40 40 50 90 90 90 --out DIR
        (renders 5 stills of a random truth first: write_truth_mtz, render_stills)

`integrate_and_merge(images, work, space_group, cell, anomalous=True, nproc=2, options=None)` runs, in `work`:

1. `dials.import IMAGES convert_sequences_to_stills=True`: nbsim's miniCBF stills (oscillation 0) import as
   one image sequence, on which `dials.ssx_integrate` integrates only the first image (the others stop on
   `DIALS_ASSERT(bbox[i][4] >= frame0_)`); as stills, every image is its own experiment.
2. `dials.find_spots`.
3. `dials.index stills.indexer=sequences joint_indexing=False` with the space group and cell,
   `indexing.method=real_space_grid_search basis_vector_combinations.max_combinations=20`: `dials.ssx_index`
   and the default stills indexer refine their candidates with `xfel_mono_sim_ext`, which Debian's build
   lacks, and fail on every image; the grid search with at most 20 candidate bases indexes as many stills and
   spots as DIALS's default FFT3D search (or more) for a sixth of its CPU (docs/dials_route.md).
4. Unindexed spots (id -1) dropped (a `cctbx.python` step, which also counts the spots): `dials.ssx_integrate`
   stops on an assertion otherwise.
5. `dials.ssx_integrate` (its default ellipsoid algorithm; all stills in one output file).
6. `dials.cosym space_group=SG`, only where the lattice admits another indexing (gemmi's twin laws of the
   cell and space group, e.g. P6₁'s k,h,−l): every still is indexed on its own, so their choices must be
   made consistent before scaling.
7. `dials.scale anomalous=True|False KB.decay_correction=False`: a scale per still, no B factor (SCALE_OPTIONS
   says why). 8. `dials.merge anomalous=True|False` → work/merged.mtz (IMEAN, F; with anomalous I(+), I(−),
   F(+), F(−), DANO). Neither writes its HTML report.

It returns a dict: `mtz` (the merged MTZ's path), `seconds` (each step's wall time, by step name),
`cpu_seconds` (each step's CPU time, its worker processes' included: on a shared machine the figure to
compare), `images`, `indexed_images`, `integrated_images`, `strong_spots`, `indexed_spots`,
`ambiguity_resolved` (whether cosym ran) and `commands` (each step's command line). `options` adds PHIL
arguments to a step by its name (`{"dials.index": ["indexing.method=fft3d"]}`). A missing DIALS, bad input
or a failing program raises `nbsim.errors.NbsimError` (the CLI: one line, exit 2); DIALS's logs stay in
`work`.

`score_against_truth(merged_mtz, truth_mtz, shells=10)` compares the merged amplitudes with a truth MTZ of
F(+)/F(−) columns (or one amplitude column): CC(|F|, truth), DIALS's F against the truth's
sqrt((F(+)² + F(−)²)/2) over the common reflections, and CCano*, the Pearson correlation of DIALS's
F(+) − F(−) with the truth's over the common acentric reflections with both halves measured; overall and in
`shells` resolution shells (nbsim merge's: equal in 1/d³). Both files are mapped to gemmi's reciprocal
asymmetric unit (a Friedel mate's F(+) is the other's F(−)). DIALS indexes in one of the settings the lattice
allows (P6₁: h,k,l or k,h,−l; cosym makes the stills agree, not which one), so every alternative (identity and
gemmi's twin laws, all proper rotations) is tried on DIALS's indices and the one with the highest CC(|F|) is
kept (`reindexing` names it); CCano* is computed in that setting, never chosen by it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Mapping, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

from nbsim.errors import NbsimError

if __package__:
    from .dials_workloads import DialsError, dials_available, run_program
else:
    from dials_workloads import DialsError, dials_available, run_program

INDEX_OPTIONS = ("stills.indexer=sequences", "joint_indexing=False", "indexing.method=real_space_grid_search",
                 "basis_vector_combinations.max_combinations=20")
"""dials.index on stills without xfel_mono_sim_ext (step 3 of the module docstring)."""
SCALE_OPTIONS = ("KB.decay_correction=False", "output.html=None")
"""dials.scale's stills model (KB) with its scale term only: nbsim's stills share one crystal model and have no
per-shot B factor, and refined freely the stills' B factors can run away together (measured: the same 40 P6₁
stills twice; once B within −10 to 23 Å², once every still's B ≈ 2,790 Å², after which dials.merge stops);
no HTML report (on that run its R-merge-by-batch plot stopped dials.scale on an assertion after the data
were saved; dials.merge writes none either)."""
DROP_UNINDEXED = """\
import json, sys
from dials.array_family import flex
table = flex.reflection_table.from_file(sys.argv[1])
indexed = table.select(table["id"] >= 0)
indexed.as_file(sys.argv[2])
print(json.dumps({"strong_spots": len(table), "indexed_spots": len(indexed)}))
"""
"""Step 4, run by cctbx.python: the indexed spots only, and the counts."""
TWIN_OBLIQUITY_DEG = 3.0
"""How far from a lattice symmetry a twin law may be (gemmi.find_twin_laws): DIALS's LePage default."""


class RouteError(NbsimError):
    """The DIALS route cannot run or failed; one line."""


def integrate_and_merge(images: Sequence[Path | str], work: Path | str, space_group: str,
                        cell: Sequence[float], anomalous: bool = True, nproc: int = 2,
                        options: Mapping[str, Sequence[str]] | None = None) -> dict:
    """Stills through DIALS to a merged MTZ (the module docstring lists the steps and the record)."""
    import gemmi

    images = [Path(image).resolve() for image in images]
    if not images:
        raise RouteError("no images")
    missing = [str(image) for image in images if not image.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RouteError(f"no such image: {missing[0]}{more}")
    group, unit_cell = _group_and_cell(space_group, cell)
    if not dials_available():
        raise RouteError("DIALS is not installed (dials.import, cctbx.python): apt-get install dials")
    options = {step: list(arguments) for step, arguments in (options or {}).items()}
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    symbol = group.hm.replace(" ", "")
    cell_text = ",".join(f"{value:g}" for value in cell)
    ambiguous = bool(gemmi.find_twin_laws(unit_cell, group, TWIN_OBLIQUITY_DEG, False))
    anomalous_flag = f"anomalous={anomalous}"
    steps = [
        ("dials.import", [*map(str, images), "convert_sequences_to_stills=True"]),
        ("dials.find_spots", ["imported.expt", f"nproc={nproc}"]),
        ("dials.index", ["imported.expt", "strong.refl", *INDEX_OPTIONS, f"space_group={symbol}",
                         f"unit_cell={cell_text}", f"indexing.nproc={nproc}"]),
        ("drop_unindexed", ["-c", DROP_UNINDEXED, "indexed.refl", "indexed_only.refl"]),
        ("dials.ssx_integrate", ["indexed.expt", "indexed_only.refl", f"nproc={nproc}",
                                 f"output.batch_size={len(images)}"]),
    ]
    scaled_input = ["integrated_1.expt", "integrated_1.refl"]
    if ambiguous:
        steps.append(("dials.cosym", [*scaled_input, f"space_group={symbol}"]))
        scaled_input = ["symmetrized.expt", "symmetrized.refl"]
    steps += [("dials.scale", [*scaled_input, anomalous_flag, *SCALE_OPTIONS]),
              ("dials.merge", ["scaled.expt", "scaled.refl", anomalous_flag, "output.mtz=merged.mtz",
                               "output.html=None"])]
    unknown = sorted(set(options) - {step for step, _ in steps})
    if unknown:
        raise RouteError(f"options for a step the route does not run: {', '.join(unknown)}")
    for name in ("merged.mtz", "integrated_1.expt"):  # a rerun in the same folder never reads an old result
        (work / name).unlink(missing_ok=True)
    record = {"images": len(images), "ambiguity_resolved": ambiguous, "seconds": {}, "cpu_seconds": {},
              "commands": []}
    for step, arguments in steps:
        program = "cctbx.python" if step == "drop_unindexed" else step
        arguments = [*arguments, *options.get(step, [])]
        record["commands"].append(_shown(step, program, arguments, len(images)))
        before = _children_cpu_s()
        try:
            record["seconds"][step] = run_program(program, arguments, work, log=f"{step}.out")
        except DialsError as error:
            raise RouteError(str(error)) from None
        record["cpu_seconds"][step] = _children_cpu_s() - before
        if step == "drop_unindexed":
            record.update(json.loads((work / "drop_unindexed.out").read_text().strip().splitlines()[-1]))
        if step == "dials.index":
            record["indexed_images"] = _experiments(work / "indexed.expt")
        if step == "dials.ssx_integrate":
            record["integrated_images"] = _experiments(work / "integrated_1.expt")
    record["mtz"] = str(work / "merged.mtz")
    return record


def _children_cpu_s() -> float:
    """User and system seconds of this process's finished children and theirs (DIALS's worker processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _shown(step: str, program: str, arguments: list[str], images: int) -> str:
    """A step's command line as the record shows it: the images counted, the inline script named."""
    if step == "dials.import" and images > 3:
        arguments = [f"<{images} images>", *arguments[images:]]
    if step == "drop_unindexed":
        arguments = ["<drop id -1>", *arguments[2:]]
    return " ".join([program, *arguments])


def _group_and_cell(space_group: str, cell: Sequence[float]):
    """gemmi's space group and cell, checked against each other."""
    import gemmi

    try:
        group = gemmi.SpaceGroup(space_group)
    except (ValueError, RuntimeError):
        raise RouteError(f"unknown space group {space_group!r}") from None
    if len(cell) != 6 or not all(np.isfinite(cell)) or min(cell[:3]) <= 0:
        raise RouteError(f"a cell is a, b, c (Å, > 0) and α, β, γ (degrees): got {list(cell)}")
    unit_cell = gemmi.UnitCell(*cell)
    if not unit_cell.is_compatible_with_spacegroup(group):
        raise RouteError(f"cell {list(cell)} contradicts space group {group.hm}")
    return group, unit_cell


def _experiments(path: Path) -> int:
    """How many experiments a DIALS experiment list (JSON) holds."""
    return len(json.loads(path.read_text())["experiment"]) if path.is_file() else 0


def score_against_truth(merged_mtz: Path | str, truth_mtz: Path | str, shells: int = 10,
                        span_A: Sequence[float] | None = None) -> dict:
    """CC(|F|, truth) and CCano* of a merged MTZ against a truth MTZ, in the indexing that fits best (module
    docstring): `cc`, `cc_anomalous` (None without anomalous columns on both sides), `reindexing` (the
    operator applied to the merged file's indices), `reflections` and `pairs` (how many each figure uses),
    `d_min_A` and `d_max_A` (of the reflections in common with the truth), `cc_by_alternative`, and `shells`
    (each shell with reflections: `shell`, its number from 0 at low resolution, `d_min_A`, `d_max_A`, `cc`,
    `cc_anomalous`, `reflections`, `pairs`). The shells divide the resolution range `span_A` (Å, its lowest
    and highest value; default: the common reflections'), so that two files scored over one span compare
    shell by shell."""
    import gemmi

    from nbsim.merge.reflections import correlation
    from nbsim.merge.reflections import shells as shell_of

    truth, merged = _amplitudes(truth_mtz), _amplitudes(merged_mtz)
    group, unit_cell = truth["group"], truth["cell"]
    alternatives = [gemmi.Op("x,y,z"), *gemmi.find_twin_laws(unit_cell, group, TWIN_OBLIQUITY_DEG, False)]
    best = None
    by_alternative = {}
    for operator in alternatives:
        matched = _match(merged, truth, operator, group)
        score = correlation(matched["mean"], matched["truth_mean"])
        by_alternative[operator.triplet()] = _number(score)
        score = -np.inf if np.isnan(score) else score
        if best is None or score > best[0]:
            best = (score, operator, matched)
    _, operator, matched = best
    d_A = unit_cell.calculate_d_array(matched["miller"].astype(np.int32))
    common = np.isfinite(matched["mean"]) & np.isfinite(matched["truth_mean"])
    if not common.any():
        raise RouteError(f"{merged_mtz} and {truth_mtz} have no reflection in common")
    shell = shell_of(d_A, shells, d_A[common] if span_A is None else np.asarray(span_A, np.float64))
    differences = matched["plus"] - matched["minus"]
    truth_differences = matched["truth_plus"] - matched["truth_minus"]
    paired = np.isfinite(differences) & np.isfinite(truth_differences) & ~matched["centric"]
    has_anomalous = truth["plus"] is not None and merged["plus"] is not None

    def figures(selected: np.ndarray) -> dict:
        cc = correlation(matched["mean"][selected], matched["truth_mean"][selected])
        cc_anomalous = correlation(differences[selected & paired], truth_differences[selected & paired])
        return {"cc": _number(cc), "cc_anomalous": _number(cc_anomalous) if has_anomalous else None,
                "reflections": int(np.sum(selected & common)),
                "pairs": int(np.sum(selected & paired)) if has_anomalous else 0}

    every = np.ones(len(d_A), bool)
    record = {**figures(every), "d_min_A": float(d_A[common].min()), "d_max_A": float(d_A[common].max()),
              "reindexing": operator.triplet(), "cc_by_alternative": by_alternative, "shells": []}
    for index in range(shells):
        selected = (shell == index) & common
        if selected.any():
            record["shells"].append({"shell": index, "d_min_A": float(d_A[selected].min()),
                                     "d_max_A": float(d_A[selected].max()), **figures(selected)})
    return record


def _number(value: float) -> float | None:
    """A correlation for JSON: None where it is undefined (fewer than three values, or constant)."""
    return None if np.isnan(value) else value


def _amplitudes(path: Path | str) -> dict:
    """An MTZ's indices, mean amplitude and, where it has them, F(+) and F(−) (NaN where missing): the mean is
    the file's `F` or `FP` column (else its first amplitude column), else sqrt((F(+)² + F(−)²)/2)."""
    import gemmi

    try:
        data = gemmi.read_mtz_file(str(path))
    except (RuntimeError, ValueError, OSError) as error:
        raise RouteError(f"{path}: not a readable MTZ ({str(error).splitlines()[0]})") from None
    if data.spacegroup is None:
        raise RouteError(f"{path}: no space group")
    kinds = {column.label: column.type for column in data.columns}
    values = np.asarray(data.array, np.float64)
    column = {label: values[:, index] for index, label in enumerate(kinds)}
    plus = minus = None
    if kinds.get("F(+)") == "G" and kinds.get("F(-)") == "G":
        plus, minus = column["F(+)"], column["F(-)"]
    amplitudes = sorted((label for label, kind in kinds.items() if kind == "F"), key=lambda l: l not in ("F", "FP"))
    if amplitudes:
        mean = column[amplitudes[0]]
    elif plus is not None:
        mean = np.sqrt(np.nanmean(np.stack([plus ** 2, minus ** 2]), axis=0))
    else:
        raise RouteError(f"{path}: no F(+)/F(-) pair and no amplitude column (columns: {', '.join(kinds)})")
    return {"miller": np.asarray(data.make_miller_array(), np.int64), "mean": mean, "plus": plus, "minus": minus,
            "group": data.spacegroup, "cell": data.cell}


def _to_asu(miller: np.ndarray, group) -> tuple[np.ndarray, np.ndarray]:
    """Indices in gemmi's reciprocal asymmetric unit, and whether each is the Friedel mate (its F(+) is the
    unit's F(−))."""
    import gemmi

    asu, operations = gemmi.ReciprocalAsu(group), group.operations()
    pairs = [asu.to_asu([int(h), int(k), int(l)], operations) for h, k, l in miller]
    mapped = np.array([hkl for hkl, _ in pairs], np.int64).reshape(-1, 3)
    return mapped, np.array([isym % 2 == 0 for _, isym in pairs], bool)


def _match(merged: dict, truth: dict, operator, group) -> dict:
    """The merged file's reflections under `operator`, mapped to the truth's asymmetric unit, beside the truth's
    values there (NaN where the truth lacks one)."""
    rotation = np.array(operator.rot, np.int64) // operator.DEN
    miller, flipped = _to_asu(merged["miller"] @ rotation, group)
    plus, minus = merged["plus"], merged["minus"]
    if plus is not None:
        plus, minus = np.where(flipped, minus, plus), np.where(flipped, plus, minus)
    truth_miller, truth_flipped = _to_asu(truth["miller"], group)
    truth_plus, truth_minus = truth["plus"], truth["minus"]
    if truth_plus is not None:
        truth_plus, truth_minus = (np.where(truth_flipped, truth_minus, truth_plus),
                                   np.where(truth_flipped, truth_plus, truth_minus))
    index = {tuple(h): row for row, h in enumerate(truth_miller)}
    rows = np.array([index.get(tuple(h), -1) for h in miller], np.int64)
    found = rows >= 0

    def pick(values: np.ndarray | None) -> np.ndarray:
        out = np.full(len(miller), np.nan)
        if values is not None:
            out[found] = values[rows[found]]
        return out

    nan = np.full(len(miller), np.nan)
    return {"miller": miller, "mean": np.where(found, merged["mean"], np.nan), "truth_mean": pick(truth["mean"]),
            "plus": nan if plus is None else plus, "minus": nan if minus is None else minus,
            "truth_plus": pick(truth_plus), "truth_minus": pick(truth_minus),
            "centric": np.asarray(group.operations().centric_flag_array(miller.astype(np.int32)), bool)}


def write_truth_mtz(path: Path | str, space_group: str, cell: Sequence[float], d_min_A: float = 2.0,
                    anomalous_fraction: float = 0.1, seed: int = 1) -> int:
    """A random truth for a test or an example: Wilson-like |F(+)| (Rayleigh, mean ≈ 130) of the space group's
    unique reflections to d_min_A, |F(−)| = |F(+)| (1 + anomalous_fraction × a normal deviate) for acentric
    ones, written as an MTZ of F(+), SIGF(+), F(-), SIGF(-) (σ 1); returns the number of reflections."""
    import gemmi

    group, unit_cell = _group_and_cell(space_group, cell)
    miller = np.asarray(gemmi.make_miller_array(unit_cell, group, d_min_A, 0, True), np.int32)
    rng = np.random.default_rng(seed)
    plus = rng.rayleigh(100, len(miller)) + 5
    centric = np.asarray(group.operations().centric_flag_array(miller), bool)
    minus = np.where(centric, plus, plus * (1 + anomalous_fraction * rng.standard_normal(len(miller))).clip(0.5))
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = group
    mtz.add_dataset("truth")
    mtz.set_cell_for_all(unit_cell)
    for label, kind in (("F(+)", "G"), ("SIGF(+)", "L"), ("F(-)", "G"), ("SIGF(-)", "L")):
        mtz.add_column(label, kind)
    ones = np.ones(len(miller))
    mtz.set_data(np.column_stack([miller, plus, ones, minus, ones]).astype(np.float32))
    mtz.write_to_file(str(path))
    return len(miller)


STILL_ARGS = ("-N", "10", "-gauss_xtal", "-lambda", "1", "-detector_model", "pilatus6m", "-oversample", "1",
              "-noise_generator", "philox", "-dtype", "float32", "-nopgm")
"""The stills `render_stills` makes: a crystal of N = 10 with Gaussian spots on a PILATUS cut (its sensor and
point spread make spots of several pixels, which DIALS's spot finder wants; docs/formats.md, "Handing the
files to DIALS"), λ 1 Å, Poisson noise, one sample per pixel."""


def render_stills(folder: Path | str, count: int, truth_mtz: Path | str, cell: Sequence[float], pixels: int = 256,
                  distance_mm: float = 60.0, first_seed: int = 1) -> list[Path]:
    """`count` stills of the truth's F(+)/F(−) at random orientations (seeds first_seed, first_seed + 1, ...),
    rendered in this process by nbsim's command line as folder/still_00001.cbf, ... (its printout in
    folder/render.log); returns their paths."""
    from nbsim.cli import main as nbsim

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    with open(folder / "render.log", "w") as log, redirect_stdout(log), redirect_stderr(log):
        for index in range(count):
            images.append(_render_still(nbsim, folder, index, truth_mtz, cell, pixels, distance_mm, first_seed))
    return images


def _render_still(nbsim, folder: Path, index: int, truth_mtz: Path | str, cell: Sequence[float], pixels: int,
                  distance_mm: float, first_seed: int) -> Path:
    """`render_stills`' still number index + 1."""
    seed = str(first_seed + index)
    image = folder / f"still_{index + 1:05d}.cbf"
    argv = ["-hkl", str(truth_mtz), "-column", "F(+)", "-cell", *map(str, cell), *STILL_ARGS,
            "-distance", str(distance_mm), "-detpixels", str(pixels), "-misset", "random", "-misset_seed", seed,
            "-seed", seed, "-cbffile", str(image), "-floatfile", "/dev/null", "-intfile", "/dev/null",
            "-noisefile", "/dev/null"]
    if nbsim(argv) != 0:
        raise RouteError(f"nbsim {' '.join(argv)} failed (its printout: {folder / 'render.log'})")
    return image


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring): the record as JSON on stdout; bad input one line, exit status 2."""
    parser = argparse.ArgumentParser(prog="dials_route.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", type=Path, help="stills DIALS imports (miniCBF, NXmx)")
    parser.add_argument("--space_group", required=True, help="e.g. P43212 or 'P 61'")
    parser.add_argument("--cell", required=True, type=float, nargs=6, metavar=("A", "B", "C", "AL", "BE", "GA"))
    parser.add_argument("--out", required=True, type=Path, help="working folder (DIALS's files, merged.mtz)")
    parser.add_argument("--truth", type=Path, help="truth MTZ (F(+)/F(-)): print CC(|F|) and CCano*")
    parser.add_argument("--render", type=int, metavar="N",
                        help="instead of IMAGES: render N stills of a random truth into OUT/stills (256², "
                             "render_stills) and score against that truth")
    parser.add_argument("--no-anomalous", dest="anomalous", action="store_false", help="merge F(+) and F(-)")
    parser.add_argument("--nproc", type=int, default=2, help="processes each DIALS program uses (default 2)")
    args = parser.parse_args(argv)
    if bool(args.images) == (args.render is not None):
        parser.error("give IMAGES or --render N")
    try:
        images, truth = args.images, args.truth
        if args.render is not None:
            truth = args.out / "stills" / "truth.mtz"
            truth.parent.mkdir(parents=True, exist_ok=True)
            write_truth_mtz(truth, args.space_group, args.cell)
            images = render_stills(truth.parent, args.render, truth, args.cell)
        record = integrate_and_merge(images, args.out, args.space_group, args.cell, args.anomalous, args.nproc)
        if truth is not None:
            record["scores"] = score_against_truth(record["mtz"], truth)
    except NbsimError as error:
        print(f"dials_route.py: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
