"""`nbsim merge`: structure factors refined over many stills with every shot's model (docs/merging.md).

    nbsim merge SHOT [SHOT ...] --starts FILE --hkl START --space_group SG [--anomalous] --mtz OUT.mtz
                [--refine orientation,cell,N,scale] [--json OUT.json] [--workers N] [--truth TRUTH]
                [--cycles K] -- <nanoBragg flags of the shared model>

Each shot's starting model is the flags after `--` with its entry of `--starts` (nbsim fit's per-image JSON:
{"images": {SHOT: {"misset": [x, y, z], "cell": [...], "N": 20, ...}}}); the starting |F| is `--hkl` (MTZ,
sf-mmCIF or nanoBragg's P1 text), looked up by every shot's kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError, NbsimError
from ..io.paths import check_writable, require_file
from ..nanobragg.arguments import parse
from .fit import CELL_LENGTH_TOLERANCE, _flag_overrides, _names, _restraint, _starts, unmodelled_spread
from .options import CommandParser, split_model_flags

DESCRIPTION = __doc__.split("\n\n")[0]
CELL_ANGLE_TOLERANCE_DEG = 2.0


F_RESTRAINTS = ("start", "shell", "friedel")


def _restraints(text: str) -> dict[str, float]:
    from ..fit.names import REFINABLE

    restraints = {}
    for item in _names(text):
        name, sigma = _restraint(item)
        if name not in F_RESTRAINTS + REFINABLE:
            raise argparse.ArgumentTypeError(f"restraint {name!r}: choose from {', '.join(F_RESTRAINTS)} (on |F|) "
                                             f"or {', '.join(REFINABLE)} (on each shot)")
        restraints[name] = sigma
    return restraints


def argument_parser() -> argparse.ArgumentParser:
    """The options of `nbsim merge` (its nanoBragg flags come after `--`)."""
    parser = CommandParser("merge", takes_flags=True, prog="nbsim merge", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Example: nbsim merge shot_*.img --starts starts.json --hkl start.mtz --space_group "
                                  "P212121 --mtz merged.mtz -- -cell 50 60 70 90 90 90 -N 10 -distance 150 "
                                  "-detpixels 512 -pixel 0.1 -nointerpolate")
    parser.add_argument("shots", nargs="*", help="observed stills (any frame nbsim fit reads)")
    parser.add_argument("--starts", help="JSON of per-shot starting values (nbsim fit's --starts format)")
    parser.add_argument("--hkl", required=True, help="starting |F|: MTZ, sf-mmCIF or P1 text (h k l F)")
    parser.add_argument("--column", help="the --hkl column to start from (default: its first amplitude)")
    parser.add_argument("--space_group", "--space-group", dest="space_group",
                        help="space group (default: the --hkl MTZ's)")
    parser.add_argument("--anomalous", action="store_true", help="refine F(+) and F(-) apart")
    parser.add_argument("--refine", type=_names, default=["orientation", "cell", "N", "scale"],
                        help="what each shot refines (nbsim fit's names; default orientation,cell,N,scale)")
    parser.add_argument("--restrain", type=_restraints, default={},
                        help="restraints as NAME=SIGMA,...: on log|F| start, shell (towards the shell's mean), "
                             "friedel (F(+) towards F(-)), sigma relative (0.1: about 10 %%); on each shot "
                             "nbsim fit's names (orientation in degrees, cell in Å, N in cells, ...), towards the "
                             "shot's start")
    parser.add_argument("--cycles", type=int, default=5,
                        help="at most this many macro-cycles: shots, then F (default 5)")
    parser.add_argument("--convergence", type=float, default=0.1,
                        help="stop once a cycle changes the |F| measured before and after it by less than this "
                             "many of their standard errors, the median (default 0.1; 0: run every cycle)")
    parser.add_argument("--shared", type=_names,
                        help="what is one for every shot: cell (the default where the cell is refined: crystals of "
                             "one form; each cycle's cell is the mean of the shots' refined cells, weighted by their "
                             "1/sigma^2); '' for none")
    parser.add_argument("--solve", choices=("cycles", "joint"), default="cycles",
                        help="after the scale-only cycles: cycles (default), macro-cycles of shots with F fixed then "
                             "F with the shots' scales; joint, one shot step then one optimisation of |F| with every "
                             "shot's scale and refined model together, and the merge ends (docs/merging.md)")
    parser.add_argument("--scale-cycles", type=int, default=1,
                        help="the first this many cycles refine only each shot's scale, the rest of its model "
                             "after (default 1)")
    parser.add_argument("--mtz", required=True, help="write the merged |F| here")
    parser.add_argument("--json", help="write every shot's refined model and the cycles here")
    parser.add_argument("--report", help="write a page (HTML, and a PNG beside it) of CC and CCano by resolution "
                                         "shell against the cycle here (needs --truth)")
    parser.add_argument("--checkpoint", help="the state after each cycle, from which a re-run of the same command "
                                             "resumes (default: OUT.mtz.checkpoint; removed once the outputs are "
                                             "written)")
    parser.add_argument("--stop-after-cycle", type=int,
                        help="stop after this cycle, leaving the checkpoint and writing no outputs (a later run "
                             "resumes from it)")
    parser.add_argument("--truth", help="a truth (MTZ, sf-mmCIF or P1 text) to report CC by shell against")
    parser.add_argument("--truth-column", help="the --truth column (default: its first amplitude)")
    parser.add_argument("--workers", type=int, default=1,
                        help="local worker processes holding the shots (default 1; torchrun/srun set their own)")
    parser.add_argument("--shells", type=int, default=6, help="resolution shells of the reported CC (default 6)")
    parser.add_argument("--shoebox", type=int, default=9, help="shoebox side in pixels (odd; default 9)")
    parser.add_argument("--spots", type=int, default=200, help="most spots per shot (default 200)")
    parser.add_argument("--reindex", action="store_true",
                        help="where the lattice admits other indexings than the space group's (P61's k,h,-l), give "
                             "each shot in the first cycle the one its pixels prefer against the --hkl start (stills "
                             "indexed one by one come out in any of them; needs a start near the truth: "
                             "docs/merging.md, 'Other crystals'; default: every shot keeps its start's)")
    parser.add_argument("--search-deg", type=float, default=0.0,
                        help="how far off the starting orientations may be: a search in the first cycle that "
                             "refines the orientation (default 0, none: it matches intensities, which a poor "
                             "starting |F| gets wrong)")
    parser.add_argument("--max-iterations", type=int, default=100,
                        help="per shot refinement's iteration cap (default 100)")
    parser.add_argument("--f-iterations", type=int, default=200, help="the F step's iteration cap (default 200)")
    parser.add_argument("--adc", type=float, help="ADC offset to subtract (default: the file's, else 40 for SMV)")
    parser.add_argument("--device", default="cpu", help="where the shots render: cpu or cuda[:N] (default cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _cell(config, shot: str) -> tuple[float, ...]:
    """A shot's starting cell (Å, degrees): -cell, else the -mat matrix's."""
    if config.crystal.cell_A_deg is not None:
        return tuple(float(v) for v in config.crystal.cell_A_deg)
    if config.crystal.mosflm_matrix is not None:
        import numpy as np

        reciprocal = np.asarray(config.crystal.mosflm_matrix, np.float64).reshape(3, 3).T
        real = np.linalg.inv(reciprocal).T
        lengths = np.linalg.norm(real, axis=1)

        def angle(i: int, j: int) -> float:
            return math.degrees(math.acos(float(real[i] @ real[j] / (lengths[i] * lengths[j]))))

        return (*map(float, lengths), angle(1, 2), angle(0, 2), angle(0, 1))
    raise NbsimError(f"{shot}: no starting cell (give -cell or -mat)")


def check_same_cells(cells: list[tuple[float, ...]], shots: list[str]) -> None:
    """Shots of one crystal form: every starting cell within CELL_*_TOLERANCE of the first shot's."""
    first = cells[0]
    for shot, cell in zip(shots, cells, strict=True):
        lengths = any(abs(a - b) > CELL_LENGTH_TOLERANCE * b for a, b in zip(cell[:3], first[:3], strict=True))
        angles = any(abs(a - b) > CELL_ANGLE_TOLERANCE_DEG for a, b in zip(cell[3:], first[3:], strict=True))
        if lengths or angles:
            raise NbsimError(f"{shot}: its cell {' '.join(f'{v:g}' for v in cell)} is not the cell of "
                             f"{shots[0]} ({' '.join(f'{v:g}' for v in first)}): shots of different crystals")


def _mtz_space_group(path: str) -> str | None:
    """The space group an MTZ names (None for other formats)."""
    from ..io.structure_files import hkl_format

    if hkl_format(path) != "mtz":
        return None
    import gemmi

    try:
        group = gemmi.read_mtz_file(path).spacegroup
    except (RuntimeError, ValueError) as error:
        raise InputFileError(path, f"not a readable MTZ file ({str(error).splitlines()[0]})") from None
    return None if group is None else group.hm


def main(argv: list[str]) -> int:
    """`nbsim merge ARGS`: 0 when merged, 2 for bad input (nothing written)."""
    own, model_flags = split_model_flags(argv)
    if own and own[0] in ("-h", "--help"):
        argument_parser().print_help()
        return 0
    options = argument_parser().parse_args(own)
    from ..fit.names import check_names

    refine = check_names(options.refine, "refined")
    if "-hkl" in model_flags or "-model" in model_flags:
        raise NbsimError("merge: the starting |F| is --hkl; leave -hkl and -model out of the model's flags")
    if options.report is not None and options.truth is None:
        raise NbsimError("merge: --report plots CC against a truth: give --truth")
    if options.stop_after_cycle is not None and options.stop_after_cycle < 1:
        raise NbsimError(f"merge: --stop-after-cycle must be at least 1 (got {options.stop_after_cycle})")
    options.checkpoint = options.checkpoint or f"{options.mtz}.checkpoint"
    for path in (options.mtz, options.json, options.report, options.checkpoint):
        if path is not None:
            check_writable(path)
    shots = list(options.shots)
    if not shots:
        raise NbsimError("merge: give at least one shot")
    if len(set(shots)) != len(shots):
        raise NbsimError("merge: a shot is named twice")
    from ..io.observed import require_observed

    require_observed(shots)
    for path in (options.hkl, options.truth):
        if path is not None:
            require_file(path)
    starts = _starts(options.starts)
    unknown = [name for name in starts if name not in shots]
    if unknown:
        raise InputFileError(options.starts, f"names a shot not given: {unknown[0]}")
    table_flags = ["-hkl", options.hkl, *(["-column", options.column] if options.column else [])]
    argv_per_shot = [model_flags + table_flags + _flag_overrides(starts.get(shot, {}), options.starts or "")
                     for shot in shots]
    from ..resolve import advised_sampling_flags

    configs = []
    for index, argv_shot in enumerate(argv_per_shot):
        config = parse(list(argv_shot))[0]
        config, extra = advised_sampling_flags(config if "-sampling" in argv_shot
                                               else config.with_options(sampling="advised"))
        argv_per_shot[index] = argv_shot + extra
        configs.append(config)
    cells = [_cell(config, shot) for config, shot in zip(configs, shots, strict=True)]
    check_same_cells(cells, shots)
    group_name = options.space_group or _mtz_space_group(options.hkl)
    if group_name is None:
        raise NbsimError("merge: give --space_group (the --hkl file names none)")
    from ..io.structure_files import read_reflection_file
    from ..merge.reflections import check_cell, space_group

    group = space_group(group_name)
    for shot, cell in zip(shots, cells, strict=True):
        check_cell(cell, group, shot)
    read_reflection_file(options.hkl, options.column)
    if options.truth is not None:
        read_reflection_file(options.truth, options.truth_column)
    mean_cell = tuple(float(sum(values) / len(values)) for values in zip(*cells, strict=True))
    unmodelled = unmodelled_spread(configs)
    if unmodelled:
        print(f"nbsim: warning: {unmodelled}", file=sys.stderr)
    return _run(options, shots, argv_per_shot, mean_cell, group.hm, configs[0], refine)


def _run(options: argparse.Namespace, shots: list[str], argv_per_shot: list[list[str]], cell: tuple[float, ...],
         group: str, config, refine: list[str]) -> int:
    from ..fit.refine import FitOptions
    from ..merge import MergeJob, MergeOptions, Restraints, job_fingerprint, launch

    readout_photons = config.response.readout_noise_adu / (config.response.gain_adu_per_photon or 1.0)
    shot_restraints = {name: sigma for name, sigma in options.restrain.items() if name not in F_RESTRAINTS}
    shot_options = FitOptions(refine=tuple(refine), shoebox_px=options.shoebox, max_spots=options.spots,
                              readout_photons=readout_photons, max_iterations=options.max_iterations,
                              search_deg=options.search_deg, restraints=shot_restraints, device=options.device)
    F_restraints = Restraints(**{name: sigma for name, sigma in options.restrain.items() if name in F_RESTRAINTS})
    merge_options = MergeOptions(shots=shot_options, cycles=options.cycles, scale_cycles=options.scale_cycles,
                                 convergence=options.convergence,
                                 shared=tuple(options.shared if options.shared is not None else
                                              [name for name in ("cell",) if name in refine]),
                                 shells=options.shells, max_iterations=options.f_iterations,
                                 restraints=F_restraints, reindex=options.reindex, solve=options.solve)
    merge_options.check()
    adc = options.adc
    if adc is None and any(flag == "-adc" for argv in argv_per_shot for flag in argv):
        adc = config.response.adc_offset_adu
    job = MergeJob(shots=tuple((shot, tuple(argv)) for shot, argv in zip(shots, argv_per_shot, strict=True)),
                   hkl=options.hkl, column=options.column, space_group=group, cell_A_deg=cell,
                   default_F=float(config.structure.default_F), anomalous=options.anomalous, options=merge_options,
                   adc_offset_adu=adc, truth=options.truth, truth_column=options.truth_column)
    from ..merge.state import read_checkpoint

    read_checkpoint(options.checkpoint, job_fingerprint(job))
    outputs = Outputs(mtz=options.mtz, json=options.json, report=options.report, checkpoint=options.checkpoint,
                      stop_after_cycle=options.stop_after_cycle, quiet=options.quiet)
    launch(run_worker, (job, outputs), options.workers, options.device)
    return 0


def _progress_line(record: dict) -> str:
    """One cycle as a line: the likelihood, the mean |F|/σ by shell and the data's resolution, and CC(|F|, truth)
    overall and by shell where a truth is given."""
    parts = [f"cycle {record['cycle']}"]
    if "resumed" in record:
        parts.append(f"done: resumed from {record['resumed']}")
    if "negative_log_likelihood" in record:
        step = "joint solve of F and the shots" if record.get("solve") == "joint" else "F"
        parts.append(f"-logL {record['negative_log_likelihood']:.10g}  {step}: {record['em_steps']} EM steps, "
                     f"{record['f_iterations']} L-BFGS iterations, change of log|F| rms "
                     f"{record['rms_change_log_F']:.4f}, median {record['median_change_sigmas']:.2f} sigma")
    if "f_over_sigma_by_shell" in record:
        resolution = record["resolution_A"]
        signal = " ".join(f"{value:.1f}" for value in record["f_over_sigma_by_shell"])
        parts.append(f"<|F|/sigma> by shell {signal}: data to "
                     f"{'none' if resolution is None else f'{resolution:.2f} A'}")
    if record.get("reindexed_shots"):
        parts.append(f"{record['reindexed_shots']} shots reindexed")
    if "cc" in record:
        shells = " ".join(f"{value:.3f}" for value in record["cc_by_shell"])
        over = f" over {record['cc_reflections']} reflections" if "cc_reflections" in record else ""
        parts.append(f"CC {record['cc']:.4f}{over}  by shell (low to high) {shells}")
    if "cc_anomalous" in record:
        parts.append(f"CCano {record['cc_anomalous']:.4f}")
    if "seconds" in record:
        parts.append(f"{record['seconds']:.1f} s")
    return "  ".join(parts)


@dataclass(frozen=True)
class Outputs:
    """Where a merge writes (the first worker, once every cycle is done) and keeps its checkpoint."""

    mtz: str
    json: str | None
    report: str | None
    checkpoint: str
    stop_after_cycle: int | None
    quiet: bool


def run_worker(job, outputs: Outputs) -> None:
    """One worker's merge; the first worker reports the cycles, writes the checkpoint after each and the
    outputs once all is done (then removes the checkpoint)."""
    from ..io.atomic import atomic_write_text
    from ..merge import Merge, merge_json, write_mtz
    from ..merge.distributed import rank_and_size
    from ..merge.report import write_report

    merge = Merge(job)
    first = rank_and_size()[0] == 0
    progress = None if outputs.quiet or not first else lambda record: print(_progress_line(record), flush=True)
    result = merge.run(progress, checkpoint=outputs.checkpoint, stop_after=outputs.stop_after_cycle)
    if not first:
        return
    if result is None:
        print(f"stopped after cycle {outputs.stop_after_cycle}; the same command resumes from {outputs.checkpoint}",
              file=sys.stderr)
        return
    write_mtz(outputs.mtz, result.reflections, result.amplitudes, result.sigmas, cell_A_deg=result.cell_A_deg)
    if outputs.json is not None:
        atomic_write_text(outputs.json, json.dumps(merge_json(result), indent=2) + "\n")
    if outputs.report is not None:
        write_report(outputs.report, result.cycles, f"nbsim merge: {outputs.mtz}")
    Path(outputs.checkpoint).unlink(missing_ok=True)
    print(f"merged {int(result.measured.sum())} of {result.reflections.size} |F| from {len(result.shots)} shots "
          f"in {result.seconds:.1f} s: {outputs.mtz}", file=sys.stderr)
